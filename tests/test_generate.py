"""Experts that write their own calibration data (`featcal.data.<expert>: {generate: ...}`, issue 17): bad settings,
generation, its cache and what calibration sees; what samples are made of is in test_generate_sampling.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from featcal_llm.generation import backends, run as generation_run
from featcal_llm.generation.prompts import SEED_PROMPTS, read_prompts
from featcal_llm.generation.store import GENERATED_DIR
from featcal_llm.pipeline import run_recipe
from featcal_llm.tiny import build_char_tokenizer
from test_bad_input import assert_refused_in_one_line

SMALL = {"samples": 6, "max_new_tokens": 10, "batch_size": 4}


def _generate_recipe(scenario, root: Path, which=(0, 1, 2), **generate) -> Path:
    """The scenario's recipe with experts `which` generating their data (SMALL settings plus `generate`)."""
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["output"] = str(root / "out")
    names = [m["model"] for m in recipe["models"]]
    for index in which:
        recipe["featcal"]["data"][names[index]] = {"generate": {**SMALL, **generate}}
    root.mkdir(parents=True, exist_ok=True)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _generate_only(path: Path) -> dict[str, list[list[int]]]:
    """The generation step of a run, alone (what the pipeline calls before tokenising the other experts' files)."""
    from transformers import AutoConfig

    from featcal_llm.io.recipe import load_recipe
    from featcal_llm.io.references import resolve_source

    recipe = load_recipe(path)
    base = resolve_source(recipe.base, "base_model")
    sources = {e.name: resolve_source(e.reference, e.name, base) for e in recipe.experts}
    configs = {name: AutoConfig.from_pretrained(source.directory) for name, source in sources.items()}
    return generation_run.generated_sequences(recipe, sources, configs, torch.device("cpu"), dict.fromkeys(sources, torch.float32), False)


def _stored(root: Path, expert: str) -> list[dict]:
    return [json.loads(line) for line in (root / GENERATED_DIR / f"{expert}.jsonl").read_text().splitlines()]


# --- bad input: one line, nothing written -----------------------------------------------------------------------


def _set_generate(value):
    def mutate(recipe, tmp_path):
        first = recipe["models"][0]["model"]
        recipe["featcal"]["data"][first] = value(tmp_path) if callable(value) else value
    return mutate


def _prompts_file(name: str, text: str):
    def value(tmp_path):
        (tmp_path / name).write_text(text)
        return {"generate": {"prompts": str(tmp_path / name)}}
    return value


BAD = {
    "generate and path": ({"path": "x.jsonl", "generate": {}}, ["generate", "either path", "not both"]),
    "neither": ({"format": "text"}, ["either path", "not neither"]),
    "dataset key with generate": ({"generate": {}, "format": "chat"}, ["format describes dataset records"]),
    "samples twice": ({"generate": {"samples": 4}, "samples": 4}, ["samples is given twice"]),
    "zero samples": ({"generate": {"samples": 0}}, ["generate.samples", "greater than or equal to 1"]),
    "zero new tokens": ({"generate": {"max_new_tokens": 0}}, ["generate.max_new_tokens", "greater than or equal to 1"]),
    "negative temperature": ({"generate": {"temperature": -0.5}}, ["generate.temperature"]),
    "top_p above one": ({"generate": {"top_p": 1.5}}, ["generate.top_p"]),
    "min_p of one": ({"generate": {"min_p": 1.0}}, ["generate.min_p", "less than 1"]),
    "unknown generate key": ({"generate": {"sample": 4}}, ["generate.sample: unknown key"]),
    "prompts file missing": ({"generate": {"prompts": "/nonexistent/prompts.txt"}}, ["generate.prompts: /nonexistent/prompts.txt: prompts file not found"]),
    "prompts path empty": ({"generate": {"prompts": ""}}, ["generate.prompts: String should have at least 1 character"]),
    "prompts file blank": (_prompts_file("p.txt", "\n \n"), ["generate.prompts", "p.txt: no prompts (the file holds only blank lines)"]),
    "prompts file empty": (_prompts_file("p.txt", ""), ["generate.prompts", "p.txt: no prompts (the file is empty)"]),
    "prompts a directory": (lambda tmp_path: {"generate": {"prompts": str(tmp_path)}},
                            ["generate.prompts", ": a directory; expected a .txt file"]),
    "prompts wrong type": (_prompts_file("p.csv", "a,b\n"), ["generate.prompts", "expected a .txt file"]),
    "start with prompts": ({"generate": {"start": "</s>", "prompts": "p.txt"}}, ["generate: start is the first token of prompt-less samples"]),
    "start with chat on": ({"generate": {"start": "</s>", "chat_template": "on"}}, ["chat_template: on answers requests"]),
    "start with an empty request": ({"generate": {"start": "</s>", "chat_template": "empty"}}, ["chat_template: empty answers requests"]),
    "prompts with an empty request": ({"generate": {"prompts": "p.txt", "chat_template": "empty"}},
                                      ["generate: chat_template: empty answers an empty request instead of prompts"]),
    "prompts jsonl without field": (_prompts_file("p.jsonl", '{"text": "a"}\n'), ["p.jsonl: line 1: expected an object with a non-empty string field `prompt`"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_generate_settings_are_one_line_and_write_nothing(merged_scenario, tmp_path, case):
    value, expected = BAD[case]
    assert_refused_in_one_line(merged_scenario, tmp_path, _set_generate(value), expected)
    assert not (tmp_path / GENERATED_DIR).exists()


@pytest.mark.parametrize("installed", [True, False])
def test_vllm_asked_for_where_it_cannot_run_is_refused_by_validate_and_run_alike(merged_scenario, tmp_path, monkeypatch, installed):
    import importlib.util

    from click.testing import CliRunner

    from featcal_llm.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" and installed else
                        None if name == "vllm" else real(name, *a))
    recipe = yaml.safe_load(merged_scenario.recipe.read_text())
    recipe["featcal"].update(output=str(tmp_path / "out"), device="cpu")
    _set_generate({"generate": {"backend": "vllm"}})(recipe, tmp_path)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    why = "the device is not a GPU" if installed else "it is not installed (pip install 'featcal-llm[vllm]')"
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, str(tmp_path / "r.yaml")])
        errors = [line for line in result.stderr.splitlines() if line.startswith("featcal-llm: error: ")]
        assert result.exit_code == 2 and len(errors) == 1 and errors[0].endswith(f"generate.backend: vllm requested but {why}"), result.output
    assert not (tmp_path / "out").exists()
    if installed:  # `run --device cuda` overrides the recipe's cpu: then vLLM can sample
        import featcal_llm.hardware as hardware
        from featcal_llm.io.validate import check_recipe

        monkeypatch.setattr(hardware, "cuda_refusal", lambda: None)
        assert check_recipe(tmp_path / "r.yaml", plan=False, device="cuda").problems == []


def test_an_expert_without_a_tokenizer_cannot_write_and_validate_says_so(merged_scenario, tmp_path):
    from click.testing import CliRunner

    from featcal_llm.cli import main
    from featcal_llm.io.model_files import TOKENIZER_FILES

    recipe = yaml.safe_load(merged_scenario.recipe.read_text())
    first = recipe["models"][0]["model"]
    bare = tmp_path / "bare-expert"
    shutil.copytree(first, bare, symlinks=True, ignore=shutil.ignore_patterns(*TOKENIZER_FILES, "special_tokens_map.json"))
    recipe["models"][0]["model"] = str(bare)
    recipe["featcal"]["data"].pop(first)
    recipe["featcal"]["data"][str(bare)] = {"generate": {}}
    recipe["featcal"]["output"] = str(tmp_path / "out")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    lines = []
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, str(tmp_path / "r.yaml")])
        errors = [line for line in result.stderr.splitlines() if line.startswith("featcal-llm: error: ")]
        assert result.exit_code == 2 and len(errors) == 1 and "bare-expert has no tokenizer files" in errors[0], result.output
        lines.append(errors[0])
    assert lines[0] == lines[1] and f"featcal.data.{bare}.generate: expert {bare}: " in lines[0]


def test_generated_sequences_are_what_calibration_sees_and_tuning_holds_out_only_them(merged_scenario, tmp_path, monkeypatch):
    """Expert 0 generates, experts 1 and 2 read files; with `auto`, each expert's held-out records are drawn from its own set."""
    import featcal_llm.stages.prepare as prepare

    seen = {}
    original_split = prepare.split_holdout
    monkeypatch.setattr(prepare, "split_holdout", lambda s, *a: seen.setdefault("split", (s, original_split(s, *a)))[1])
    path = _generate_recipe(merged_scenario, tmp_path, which=(0,), chat_template="off", samples=8)
    recipe = yaml.safe_load(path.read_text())
    recipe["featcal"].update({"lambda": [1e-3, 1e-2], "alpha": 0.3, "rho": 0.5, "max_length": 8})
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_recipe(path, progress=False)

    names = [m["model"] for m in recipe["models"]]
    everything, (calibration, held_out) = seen["split"]
    generated = [s["token_ids"][:8] for s in _stored(tmp_path, Path(names[0]).name)]
    assert everything[names[0]] == generated  # truncated to max_length, in generation order
    assert len(held_out[names[0]]) == round(0.25 * 8) and len(calibration[names[0]]) == 6
    assert all(s in generated for s in held_out[names[0]]) and all(s in generated for s in calibration[names[0]])
    for other in names[1:]:  # the file-backed experts keep their own records
        assert not any(s in generated for s in held_out[other])
    assert json.loads((tmp_path / "out" / "featcal_tuning.json").read_text())


def test_chat_experts_answer_the_shipped_prompts(merged_scenario, tmp_path):
    path = _generate_recipe(merged_scenario, tmp_path, which=(2,), samples=3, chat_template="on")
    run_recipe(path, progress=False)
    samples = _stored(tmp_path, merged_scenario.experts["expert2"].name)
    shipped = read_prompts(SEED_PROMPTS, "seed")
    assert [s["prompt"] for s in samples] == [
        build_char_tokenizer().apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in shipped[:3]
    ]


def test_prompts_that_fill_max_length_are_named_in_a_warning(merged_scenario, tmp_path, capsys):
    """Calibration reads a sample's first max_length tokens: a prompt that long leaves none of the expert's text."""
    (tmp_path / "p.txt").write_text("a short one\n" + "a prompt far longer than the sixteen tokens kept " * 3 + "\n")
    path = _generate_recipe(merged_scenario, tmp_path, which=(0,), samples=2, prompts=str(tmp_path / "p.txt"), chat_template="off")
    raw = yaml.safe_load(path.read_text())
    raw["featcal"]["max_length"] = 16
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    _generate_only(path)
    err = capsys.readouterr().err
    assert "generate: 1 of 2 prompts (prompt 2: " in err
    assert "fill featcal.max_length 16, so their records hold none of what the expert writes; shorten them or raise max_length" in err


def test_dropped_samples_are_replaced_by_new_rounds(merged_scenario, tmp_path, monkeypatch):
    """The first two samples come back empty (an immediate EOS): a second round replaces them, the record counts them."""
    calls = []
    original = backends.TransformersSampler.sample

    def sample(self, prompts, settings, seed):
        out = original(self, prompts, settings, seed)
        calls.append(len(prompts))
        if len(calls) == 1:
            out[0] = out[1] = [2]
        return out

    monkeypatch.setattr(backends.TransformersSampler, "sample", sample)
    path = _generate_recipe(merged_scenario, tmp_path, which=(0,), chat_template="off", samples=4, batch_size=4)
    run_recipe(path, progress=False)
    assert calls == [4, 2]
    expert = merged_scenario.experts["expert0"].name
    record = json.loads((tmp_path / GENERATED_DIR / f"{expert}.json").read_text())
    assert record["kept"] == 4 and record["dropped"] == {"empty": 2}
    assert len(_stored(tmp_path, expert)) == 4


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"])
def test_every_family_generates_reproducibly(family_scenarios, tmp_path, family):
    """Each family's expert samples through its own transformers class; the same seed gives the same ids."""
    scenario = family_scenarios(family)
    path = _generate_recipe(scenario, tmp_path, which=(0,), chat_template="off", samples=3, max_new_tokens=6)
    expert = str(scenario.experts["expert0"])
    first = _generate_only(path)[expert]
    shutil.rmtree(tmp_path / GENERATED_DIR)
    assert _generate_only(path)[expert] == first
    assert len(first) == 3 and all(s[0] == build_char_tokenizer().bos_token_id and 1 < len(s) <= 7 for s in first)


def test_unquoted_yaml_switches_and_per_expert_streams(merged_scenario, tmp_path):
    """`chat_template: off` unquoted (a YAML boolean) means off; experts sharing a seed draw from distinct random streams."""
    from featcal_llm.io.recipe import load_recipe

    path = _generate_recipe(merged_scenario, tmp_path, which=(0, 1))
    text = path.read_text().replace("batch_size: 4", "batch_size: 4\n        chat_template: off", 1)
    path.write_text(text)
    assert "chat_template: off\n" in text  # unquoted in the file
    recipe = load_recipe(path)
    names = [e.name for e in recipe.experts]
    assert recipe.featcal.data[names[0]].generate.chat_template == "off"
    assert [generation_run.settings_of(recipe, n)["stream"] for n in names[:2]] == [0, 1]
    assert generation_run.settings_of(recipe, names[0])["seed"] == generation_run.settings_of(recipe, names[1])["seed"]


def test_a_quiet_run_prints_no_generation_line_loading_bar_or_search_table_and_logs_them(merged_scenario, tmp_path):
    """`run -q` promises warnings, errors and the result only: the generation's lines, transformers' loading bar and a
    search's table go to the log file alone."""
    from click.testing import CliRunner

    from featcal_llm.cli import main

    path = _generate_recipe(merged_scenario, tmp_path, which=(0,), chat_template="off")
    recipe = yaml.safe_load(path.read_text())
    recipe["featcal"].update({"lambda": [1e-3, 1e-2], "alpha": 0.3, "rho": 0.5})
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    log = tmp_path / "run.log"
    result = CliRunner().invoke(main, ["run", str(path), "--quiet", "--log", str(log)])
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and result.stdout == f"calibrated checkpoint written to {tmp_path / 'out'}\n"
    logged = log.read_text()
    assert "generation: transformers loaded" in logged and "generation: expert" in logged and "samples from the BOS token" in logged
    assert "lambda" in logged.split("samples from the BOS token")[1]  # the search's table, after the generation


def test_every_start_is_checked_before_any_expert_samples(merged_scenario, tmp_path, count_samplers, monkeypatch):
    """A start validate cannot read (no tokenizer.json: a SentencePiece model, a vocab.json; simulated here) is a note
    there, and run refuses it before the first expert samples, not after every expert before it has generated."""
    from types import SimpleNamespace

    import featcal_llm.io.validate_models as validate_module
    from featcal_llm.errors import FeatCalError
    from featcal_llm.generation.prompts import check_start
    from featcal_llm.io.validate import check_recipe

    monkeypatch.setattr(validate_module, "vocabulary_has", lambda directory, token: None)
    path = _generate_recipe(merged_scenario, tmp_path, which=(0, 1), chat_template="off")
    recipe = yaml.safe_load(path.read_text())
    second = recipe["models"][1]["model"]
    recipe["featcal"]["data"][second]["generate"]["start"] = "<nope>"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    report = check_recipe(path)
    assert report.problems == [] and any("generate.start: '<nope>' not checked: validate reads a vocabulary from "
                                         "tokenizer.json" in note for note in report.notes)
    with pytest.raises(FeatCalError) as error:
        run_recipe(path, progress=False)
    assert str(error.value) == f"{path}: featcal.data.{second}.generate.start: '<nope>' is not a token of the expert's vocabulary"
    assert count_samplers == [] and not (tmp_path / "out").exists()
    bare = SimpleNamespace(bos_token_id=None, eos_token_id=None, chat_template=None)
    spec = SimpleNamespace(chat_template="off", start=None, prompts=None)
    with pytest.raises(FeatCalError, match=r"^r.yaml: featcal.data.e.generate: the expert's tokenizer and config have neither a BOS "
                                           r"nor an EOS token to start generation from; give prompts \(generate.prompts\) or a start"):
        check_start(spec, bare, SimpleNamespace(bos_token_id=None), "r.yaml: featcal.data.e.generate")
    templated = SimpleNamespace(bos_token_id=None, eos_token_id=None, chat_template="{{ messages[0]['content'] }}")
    with pytest.raises(FeatCalError, match="neither a BOS nor an EOS"):  # auto measures the BOS start among the others
        check_start(SimpleNamespace(chat_template="auto", start=None, prompts=None), templated, SimpleNamespace(bos_token_id=None), "w")
    check_start(SimpleNamespace(chat_template="on", start=None, prompts=None), templated, SimpleNamespace(bos_token_id=None), "w")
