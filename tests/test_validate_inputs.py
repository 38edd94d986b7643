"""`validate` on inputs beside the recipe's table of bad recipes: hub ids looked up only online, devices, chat messages,
unlistable folders, refine's batch notes, how problems are spelt and ordered, and the memory plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import featcal_llm
from featcal_llm.cli import main
from test_validate import _data, _expert, _write


def test_hub_ids_are_looked_up_only_online(scenario, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    calls = []

    def missing(self, repo_id, **kwargs):
        calls.append(repo_id)
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # as huggingface_hub raises it for a 404
        Exception.__init__(error, f"{repo_id} not found")
        raise error

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", missing)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", missing)

    def hub_names(r, _t):
        r["featcal"]["data"][_expert(r, 1)]["path"] = "someone/calibration-set"
        r["featcal"]["data"]["someone/expert"] = r["featcal"]["data"].pop(_expert(r, 2))
        r["models"][2]["model"] = "someone/expert"

    recipe = _write(scenario, tmp_path, hub_names)
    offline = CliRunner().invoke(main, ["validate", str(recipe)])
    assert offline.exit_code == 0 and calls == [], (offline.output, calls)
    assert "hub ids not looked up (pass --online to check them): someone/calibration-set (dataset), someone/expert" in offline.stderr
    online = CliRunner().invoke(main, ["validate", str(recipe), "--online"])
    assert online.exit_code == 2 and sorted(calls) == ["someone/calibration-set", "someone/expert"]
    assert "models: someone/expert: someone/expert: no such model on the hub" in online.stderr
    assert "someone/calibration-set: no such dataset on the hub" in online.stderr


def test_run_reports_a_bad_data_path_before_resolving_any_model(scenario, tmp_path, no_weights):
    """A hub-id expert would cost hub retries: run stops on the data path first, with every problem listed."""

    def mutate(r, t):
        r["featcal"]["data"]["someone/expert"] = r["featcal"]["data"].pop(_expert(r, 2))
        r["models"][2]["model"] = "someone/expert"
        _data(r, 0)["path"] = str(t / "nowhere.jsonl")
        r["featcal"]["lamda"] = r["featcal"].pop("lambda")

    recipe = _write(scenario, tmp_path, mutate)
    result = CliRunner().invoke(main, ["run", str(recipe)])
    errors = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (errors, result.exception)
    assert len(errors) == 2 and all(line.startswith("featcal-llm: error: ") for line in errors), errors
    assert "nowhere.jsonl: calibration file not found" in errors[1] and "did you mean 'lambda'?" in errors[0]


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CPU"])
def test_run_device_option_is_checked_like_the_recipe_key(scenario, tmp_path, device):
    result = CliRunner().invoke(main, ["run", str(scenario.recipe), "--device", device])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"featcal-llm: error: --device: expected auto, cpu, cuda or cuda:N, got {device!r}"]


def test_a_device_passed_to_the_library_is_checked_too(scenario, tmp_path):
    from featcal_llm.errors import FeatCalError
    from featcal_llm.pipeline import run_recipe

    recipe = _write(scenario, tmp_path, lambda r, t: None)
    with pytest.raises(FeatCalError) as refused:  # by the recipe's checks, before torch
        run_recipe(recipe, device="gpu")
    assert str(refused.value) == f"{recipe}: --device: expected auto, cpu, cuda or cuda:N, got 'gpu'"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("messages, shown", [
    ('"hi"', "'hi'"), ("[]", "[]"), ('[{"role": "user"}]', "[{'role': 'user'}]"), ('[{"role": "user", "content": 3}]', None),
])
def test_chat_messages_are_checked_as_run_reads_them(tmp_path, messages, shown):
    """`format: chat` with `messages`: validate and run refuse, in one line naming the record, what the chat template
    would have failed on with a traceback (a string, an empty list, a turn without text)."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data import chat_messages
    from featcal_llm.io.validate_data import check_data

    path = tmp_path / "chat.jsonl"
    good = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'
    path.write_text(f'{good}\n{{"messages": {messages}}}\n')
    spec = DataSpec(path=str(path), format="chat", messages="messages")
    with pytest.raises(FeatCalError) as error:
        check_data(spec, "r.yaml: featcal.data.e", tmp_path, False, [])
    line = str(error.value)
    assert line.startswith(f"r.yaml: featcal.data.e.path: {path}: record 1: field 'messages' is ") and "\n" not in line
    assert shown is None or f"is {shown}; format: chat reads a non-empty list of {{role, content}} messages" in line
    with pytest.raises(FeatCalError) as run_error:  # run's reader, on the record as datasets gives it
        chat_messages(__import__("json").loads(f'{{"messages": {messages}}}'), spec, "r.yaml: featcal.data.e", 1)
    assert str(run_error.value) == line


@pytest.mark.parametrize("recipe_device, option, cuda, planned", [
    ("auto", None, "CUDA is not available (torch is a CPU-only build)", "on the CPU"),  # auto, where no GPU can be
    ("auto", None, None, "on one GPU (device auto: a GPU when there is one)"),
    ("cuda", "cpu", None, "on the CPU"),  # validate --device, as run --device
])
def test_the_memory_plan_is_for_the_device_the_run_will_use(scenario, tmp_path, no_weights, monkeypatch, recipe_device, option, cuda, planned):
    from featcal_llm import hardware

    monkeypatch.setattr(hardware, "cuda_refusal", lambda: cuda)
    recipe = _write(scenario, tmp_path, lambda r, _t: r["featcal"].__setitem__("device", recipe_device))
    result = CliRunner().invoke(main, ["validate", str(recipe), *(["--device", option] if option else [])])
    assert result.exit_code == 0, result.output
    assert planned in result.stdout, result.stdout


def test_a_missing_calibration_file_in_a_folder_that_cannot_be_listed_is_one_line(tmp_path, monkeypatch):
    from featcal_llm.io.data_files import file_not_found

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refuse)
    error = file_not_found(tmp_path / "cal.jsonl", "r.yaml: featcal.data.e")
    assert str(error) == f"r.yaml: featcal.data.e.path: {tmp_path / 'cal.jsonl'}: calibration file not found"


def test_a_refine_batch_larger_than_every_record_is_noted_before_the_run(scenario, tmp_path, no_weights):
    """run warns only once the closed form is done; validate says it first (a note: the run is valid, only wasteful)."""
    recipe = _write(scenario, tmp_path, lambda r, _t: r["featcal"].update(refine={"batch_records": 4096}))
    result = featcal_llm.validate(recipe)
    read = [min(16, sum(1 for _ in open(path))) for path in scenario.data.values()]
    at_most = sum(n - round(0.25 * n) for n in read)  # less tune.holdout's default share, held out to stop it
    assert result.ok and any(f"featcal.refine.batch_records: 4096 is more than the at most {at_most} records" in note
                             for note in result.notes), result.notes
    assert not any("batch_records" in note for note in featcal_llm.validate(_write(
        scenario, tmp_path, lambda r, _t: r["featcal"].update(refine={"batch_records": 2}))).notes)


def test_the_refine_batch_note_counts_what_run_trains_on(scenario, tmp_path, no_weights):
    """The training records run counts: each expert's records less its held-out share, an expert at weight 0 none
    (tests/test_refine.py sees run's own count). At exactly that many records a step repeats none: no note."""
    def edit(r, _t, batch):
        r["featcal"]["data"][next(iter(r["featcal"]["data"]))]["weight"] = 0  # the first expert's, as scenario.data's first
        r["featcal"].update(refine={"batch_records": batch}, tune={"holdout": 0.5})

    read = [min(16, sum(1 for _ in open(path))) for path in scenario.data.values()]
    trained = sum(n - round(0.5 * n) for n in read[1:])
    noted = featcal_llm.validate(_write(scenario, tmp_path, lambda r, t: edit(r, t, trained + 1))).notes
    assert any(f"batch_records: {trained + 1} is more than the at most {trained} records" in note for note in noted), noted
    assert not any("batch_records" in note for note in featcal_llm.validate(_write(
        scenario, tmp_path, lambda r, t: edit(r, t, trained))).notes)


def test_every_weight_zero_is_one_error_without_a_note_about_zero_records(scenario, tmp_path, no_weights):
    """Every expert at weight 0 is refused; validate also noted `batch_records: 8 is more than the at most 0 records`."""
    def edit(r, _t):
        for entry in r["featcal"]["data"].values():
            entry["weight"] = 0
        r["featcal"].update(refine=True)

    result = featcal_llm.validate(_write(scenario, tmp_path, edit))
    assert not result.ok and any("weight" in f"{problem.key} {problem.message}" for problem in result), list(result)
    assert not any("batch_records" in note for note in result.notes), result.notes


def test_a_block_s_pydantic_errors_read_as_a_recipe_spells_them():
    """io/problems.pydantic_problems on a block of its own: a long value cut at 60 characters (57 and "..."), a
    literal's choices as YAML spells them (true/false, not Python's True/False), and a validator's "was renamed" message
    without the value appended."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

    from featcal_llm.io.problems import pydantic_problems

    class Block(BaseModel):
        model_config = ConfigDict(extra="forbid")
        samples: int = 1
        shuffle: Literal["auto", True, False] = "auto"
        name: str = "x"

        @field_validator("name")
        @classmethod
        def _renamed(cls, value):
            if value == "old":
                raise ValueError("'old' was renamed to 'new'")
            return value

    with pytest.raises(ValidationError) as caught:
        Block.model_validate({"samples": "x" * 80, "shuffle": "sometimes", "name": "old"})
    assert [str(problem) for problem in pydantic_problems("r.yaml", caught.value, "featcal.block", Block)] == [
        "r.yaml: featcal.block.samples: Input should be a valid integer, unable to parse string as an integer (got '"
        + "x" * 56 + "...)",
        "r.yaml: featcal.block.shuffle: Input should be 'auto', true or false (got 'sometimes')",
        "r.yaml: featcal.block.name: 'old' was renamed to 'new'"]


def test_problems_keep_their_file_and_their_order_in_the_document():
    """A check's error text becomes a problem with its key only where the text starts with one (no spaces); a check that
    raises RecipeProblems keeps each problem's own file; problems sort as their keys appear in the block, a key the
    block lacks after every key it has."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.problems import Problem, RecipeProblems, collect, in_document_order

    assert Problem.from_error("r.yaml", "r.yaml: featcal.samples: must be positive") == Problem("r.yaml", "featcal.samples", "must be positive")
    assert Problem.from_error("r.yaml", "the data file is empty: add records") == Problem("r.yaml", "", "the data file is empty: add records")
    problems: list[Problem] = []

    def data_problems():
        raise RecipeProblems([Problem("data.jsonl", "", "line 3: not JSON"), Problem("data.jsonl", "text", "missing")])

    def one_line():
        raise FeatCalError("r.yaml: featcal.seed: not an integer")

    assert collect(problems, "r.yaml", data_problems) is None and collect(problems, "r.yaml", one_line) is None
    assert collect(problems, "r.yaml", lambda: 7) == 7
    assert problems == [Problem("data.jsonl", "", "line 3: not JSON"), Problem("data.jsonl", "text", "missing"),
                        Problem("r.yaml", "featcal.seed", "not an integer")]
    block = {"merged": "m", "data": {"path": "d", "samples": 4}, "seed": 1}
    unsorted = [Problem("r", "featcal.seed", "a"), Problem("r", "featcal.nowhere", "b"), Problem("r", "featcal.data.samples.0", "c"),
                Problem("r", "featcal.merged", "d")]
    assert [problem.message for problem in in_document_order(unsorted, block, "featcal")] == ["d", "c", "a", "b"]


def test_the_memory_plan_counts_a_tiny_models_parameters_in_thousands():
    """A test model of 71,000 parameters was planned as '0 M parameters'."""
    from featcal_llm.io.names import parameter_count

    assert [parameter_count(n) for n in (8_030_261_248, 134_515_008, 71_232, 999)] == ["8,030 M", "135 M", "71 k", "999"]
    assert [parameter_count(n) for n in (10**6, 10**6 - 1, 10**3, 10**3 - 1)] == ["1 M", "1,000 k", "1 k", "999"]  # each unit from its first whole one
