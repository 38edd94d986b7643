"""`featcal-llm validate`: every problem of a bad recipe at once, one line each, exit 2, without opening any weights."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import featcal_llm
from featcal_llm.cli import main

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@pytest.fixture
def no_weights(monkeypatch):
    """Any attempt to open a weight file, or to reach the hub, fails the test."""
    import huggingface_hub
    import safetensors
    import safetensors.torch
    import torch
    from mergekit.common import ModelReference

    import featcal_llm.io.checkpoint
    import featcal_llm.io.lora

    def refuse(*args, **kwargs):
        raise AssertionError(f"weights opened: {args[:1]}")

    for module, name in [
        (safetensors, "safe_open"), (safetensors.torch, "safe_open"), (safetensors.torch, "load_file"), (torch, "load"),
        (featcal_llm.io.checkpoint, "safe_open"), (featcal_llm.io.lora, "safe_open"), (ModelReference, "local_path"),
        (huggingface_hub.HfApi, "model_info"), (huggingface_hub.HfApi, "dataset_info"),
    ]:
        monkeypatch.setattr(module, name, refuse)
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if str(file).endswith(WEIGHT_SUFFIXES):
            raise AssertionError(f"weight file opened: {file}")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)


def _expert(recipe: dict, index: int) -> str:
    return recipe["models"][index]["model"]


def _data(recipe: dict, index: int) -> dict:
    return recipe["featcal"]["data"][_expert(recipe, index)]


def _text(content: str):
    def write(_recipe, _tmp):
        return content
    return write


def _typos(r, _t):
    r["featcal"]["lamda"] = r["featcal"].pop("lambda")
    r["featcal"]["aplha"] = r["featcal"].pop("alpha")
    r["featcal"]["samples"] = 0


def _entry_typos(r, _t):
    _data(r, 0)["txt"] = _data(r, 0).pop("text")
    _data(r, 1)["formt"] = _data(r, 1).pop("format")
    r["featcal"]["data"][_expert(r, 2)] = {"generate": {"max_new_token": 8}}


def _nested_typos(r, _t):
    r["featcal"]["lambda"] = "auto"
    r["featcal"]["tune"] = {"holdot": 0.2}
    r["featcal"]["eval"] = {"backend": {"nam": "hf"}}


def _missing_paths(r, t):
    r["base_model"] = str(t / "no-base")
    r["featcal"]["data"][str(t / "no-expert")] = r["featcal"]["data"].pop(_expert(r, 1))
    r["models"][1]["model"] = str(t / "no-expert")
    _data(r, 2)["path"] = str(t / "nowhere.jsonl")


def _bad_files(r, t):
    (t / "fields.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    _data(r, 0).update(path=str(t / "fields.jsonl"), format="alpaca")
    (t / "cal.txt").write_text("x")
    _data(r, 1)["path"] = str(t / "cal.txt")
    (t / "empty.jsonl").write_text("")
    _data(r, 2)["path"] = str(t / "empty.jsonl")


def _other_shape(r, t, edit=lambda config: config.__setitem__("hidden_size", config["hidden_size"] + 8)) -> Path:
    """The last expert replaced by a copy (weights linked, never read) whose config.json `edit` changes."""
    odd = t / "odd-expert"
    shutil.copytree(_expert(r, 2), odd, copy_function=os.symlink)
    (odd / "config.json").unlink()
    shutil.copy(Path(_expert(r, 2)) / "config.json", odd / "config.json")
    config = json.loads((odd / "config.json").read_text())
    edit(config)
    (odd / "config.json").write_text(json.dumps(config))
    r["featcal"]["data"][str(odd)] = r["featcal"]["data"].pop(_expert(r, 2))
    r["models"][2]["model"] = str(odd)
    return odd


def _pickled_and_weightless(r, t):
    """One expert with pickled .bin weights only, another with no weight file: run's reader refuses both."""
    for index, name in ((1, "pickled-expert"), (2, "weightless-expert")):
        folder = t / name
        folder.mkdir()
        shutil.copy(Path(_expert(r, index)) / "config.json", folder / "config.json")
        if index == 1:
            (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
        r["featcal"]["data"][str(folder)] = r["featcal"]["data"].pop(_expert(r, index))
        r["models"][index]["model"] = str(folder)


def _method_keys(r, _t):
    r["featcal"]["reduction"] = 0.5
    r["featcal"]["tune"] = {"budget": 4}


def _data_key_typo(r, _t):
    name = _expert(r, 1)
    r["featcal"]["data"][name + "x"] = r["featcal"]["data"].pop(name)


def _bad_adapter(r, t):
    (t / "not-an-adapter").mkdir()
    name = _expert(r, 0)
    r["models"][0]["model"] = f"{name}+{t / 'not-an-adapter'}"
    r["featcal"]["data"][r["models"][0]["model"]] = r["featcal"]["data"].pop(name)


def _mergekit_and_featcal(r, _t):
    r.pop("merge_method")
    r["featcal"]["device"] = "gpu"
    r["featcal"]["alpha"] = 1.5


def _output_under_file(r, t):
    (t / "a-file").write_text("x")
    r["featcal"]["output"] = str(t / "a-file" / "out")
    r["featcal"]["eval"] = {"data": {"gsm8k": str(t / "no-gsm8k.jsonl")}, "tasks": ["gsm8k"]}


def _suite_file_checks(r, t):
    """A suite given by a relative file path (read beside the recipe): its code tasks need the opt-in, data names its tasks."""
    import shutil

    from featcal_llm.evaluation.suite import SHIPPED

    shutil.copytree(SHIPPED, t / "suites")
    r["featcal"]["eval"] = {"suite": "suites/mergebench.yaml"}


def _suite_data_key(r, t):
    (t / "gsm8k.jsonl").write_text("{}\n")
    r["featcal"]["eval"] = {"tasks": ["gsm8k"], "data": {"gsm9k": str(t / "gsm8k.jsonl")}, "reference": "Llama-9B"}


def _eval_settings_refused_after_the_run(r, _t):
    """Settings the evaluation after the calibration refuses: found before it, each on its line."""
    r["featcal"]["eval"] = {"suite": "mergebench-protocol", "chat_template": "on", "allow_code_execution": True,
                            "backend": {"name": "hf", "tensor_parallel_size": 2}}


def _eval_output_file_and_data_type(r, t):
    """Each had passed validate, then failed after the calibration."""
    (t / "a-file").write_text("x")
    (t / "gsm8k.txt").write_text("x")
    r["featcal"]["eval"] = {"tasks": ["gsm8k"], "output": str(t / "a-file"), "data": {"gsm8k": str(t / "gsm8k.txt")},
                            "nltk_data": str(t / "a-file")}


def _eval_output_under_a_file(r, t):
    """Had passed validate, calibrated, then ended in a traceback."""
    (t / "a-file").write_text("x")
    r["featcal"]["eval"] = {"tasks": ["gsm8k"], "output": str(t / "a-file" / "results")}


def _eval_output_is_the_merge(r, _t):
    r["featcal"]["eval"] = {"tasks": ["gsm8k"], "output": r["featcal"]["merged"]}


def _eval_output_in_the_checkpoint(r, _t):
    """Had passed: the evaluation's cache and tables went into the published checkpoint, which a --force rerun deletes."""
    r["featcal"]["eval"] = {"tasks": ["gsm8k"], "output": str(Path(r["featcal"]["output"]) / "scores")}


def _renamed(r, _t):
    r["featcal"]["balance"] = "equal"
    r["featcal"]["token_weights"] = "advantage"


# name → (mutation of the scenario's recipe, or the file's text; one list of fragments per expected error line)
CASES = {
    "empty file": (_text(""), [["bad.yaml: the recipe file is empty"]]),
    "not YAML": (_text("merge_method: [task_arithmetic\n"), [["bad.yaml: not valid YAML at line"]]),
    "a list, not a mapping": (_text("- a\n- b\n"), [["bad.yaml: expected a YAML mapping", "got a list"]]),
    "misspelled featcal keys": (_typos, [
        ["featcal.samples:", "greater than or equal to 1", "(got 0)"],
        ["featcal.lamda: unknown key; did you mean 'lambda'?"],
        ["featcal.aplha: unknown key; did you mean 'alpha'?"],
    ]),
    "misspelled data keys": (_entry_typos, [
        ["featcal.data.", ".txt: unknown key; did you mean 'text'?"],
        ["featcal.data.", ".formt: unknown key; did you mean 'format'?"],
        ["featcal.data.", ".generate.max_new_token: unknown key; did you mean 'max_new_tokens'?"],
    ]),
    "misspelled tune and eval keys": (_nested_typos, [
        ["featcal.tune.holdot: unknown key; did you mean 'holdout'?"],
        ["featcal.eval.backend.nam: unknown key; did you mean 'name'?"],
    ]),
    "missing model and data paths": (_missing_paths, [
        ["base_model:", "no-base: model directory does not exist"],
        ["models:", "no-expert: model directory does not exist"],
        ["featcal.data.", "nowhere.jsonl: calibration file not found"],
    ]),
    "bad calibration files": (_bad_files, [
        ["featcal.data.", "record 0 has no field 'instruction' (fields: question, answer)"],
        ["cal.txt: unsupported file type"],
        ["empty.jsonl: file is empty"],
    ]),
    "expert of another shape": (_other_shape, [["odd-expert/config.json: config hidden_size", "differs from the base model's"]]),
    "keys of another method": (_method_keys, [
        ["featcal.reduction: only methods regmean and regmean++ read it (method is featcal)"],
        ["featcal.tune: nothing to tune"],
    ]),
    "data for a misspelled expert": (_data_key_typo, [  # one typo, one error (the expert it names has no other line)
        ["featcal.data.", "x: not an expert of this recipe", "did you mean"],
    ]),
    "adapter without adapter_config.json": (_bad_adapter, [["not-an-adapter: not a PEFT adapter (adapter_config.json is missing)"]]),
    "featcal and mergekit errors in one round": (_mergekit_and_featcal, [  # the mergekit part needs no torch (< 1 s)
        ["bad.yaml: merge_method: required key is missing"],
        ["featcal.alpha: every value should be less than or equal to 1, got 1.5"],
        ["featcal.device: expected auto, cpu, cuda or cuda:N, got 'gpu'"],
    ]),
    "a mergekit error": (lambda r, _t: r.pop("merge_method") and None, [["bad.yaml: merge_method: required key is missing"]]),
    "renamed key and value": (_renamed, [
        ["bad.yaml: featcal.balance: was renamed: use featcal.expert_weights"],
        ["bad.yaml: featcal.token_weights: advantage was renamed: use expert_lead"],
    ]),
    "a suite file's code tasks without the opt-in": (_suite_file_checks, [
        ["featcal.eval: humaneval_plus, mbpp_plus execute model-written code"]]),
    "experts without safetensors weights": (_pickled_and_weightless, [
        ["pickled-expert: only pickled .bin weights found; featcal-llm reads safetensors only"],
        ["weightless-expert: no model.safetensors or model.safetensors.index.json found"]]),
    "eval settings refused after the run": (_eval_settings_refused_after_the_run, [
        ["featcal.eval.chat_template: on, but suite mergebench-protocol scores every model without its chat template"],
        ["featcal.eval.backend.tensor_parallel_size: only the vllm backend shards a model"]]),
    "eval output a file, eval data of a type lm-eval cannot load": (_eval_output_file_and_data_type, [
        ["featcal.eval.output:", "a-file: a file, not a results directory"],
        ["featcal.eval.data.gsm8k:", "gsm8k.txt: expected one of .json, .jsonl, .parquet, .csv, .arrow or a directory"],
        ["featcal.eval.nltk_data:", "a-file: directory not found"]]),
    "eval output under a file": (_eval_output_under_a_file, [["featcal.eval.output:", "a-file is not a directory"]]),
    "eval output the merge": (_eval_output_is_the_merge, [["featcal.eval.output:", ": is featcal.merged ",
                                                          ": the results would be written into a model's folder"]]),
    "eval output inside the calibrated checkpoint": (_eval_output_in_the_checkpoint, [
        ["featcal.eval.output:", "/scores: lies inside featcal.output", ": the results would be written into a model's folder; "
         "name a results directory of its own"]]),
    "eval data for a task the suite lacks, a reference the paper lacks": (_suite_data_key, [
        ["featcal.eval.data.gsm9k: not a task of suite mergebench"], ["featcal.eval.reference: unknown model Llama-9B; the paper has"]]),
    "output under a file, eval data missing": (_output_under_file, [
        ["featcal.output:", "a-file is not a directory"],
        ["featcal.eval.data.gsm8k:", "no-gsm8k.jsonl: not found"],
    ]),
}


def _write(scenario, tmp_path: Path, mutate) -> Path:
    path = tmp_path / "bad.yaml"
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["output"] = str(tmp_path / "out")
    text = mutate(recipe, tmp_path)
    path.write_text(text if isinstance(text, str) else yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_at_least_twelve_bad_recipes():
    assert len(CASES) >= 12


@pytest.mark.parametrize("case", list(CASES))
def test_every_problem_is_listed(scenario, tmp_path, no_weights, case):
    mutate, expected = CASES[case]
    recipe = _write(scenario, tmp_path, mutate)
    started = time.perf_counter()
    result = CliRunner().invoke(main, ["validate", str(recipe)])
    print(f"validate {case}: {time.perf_counter() - started:.2f} s")
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("featcal-llm: error: ")]
    assert result.exit_code == 2, (result.exit_code, lines, result.exception)
    assert all(line.startswith("featcal-llm: ") for line in lines[:-1]) and lines[-1].endswith("problem" + "s" * (len(errors) > 1)), lines
    assert len(errors) == len(expected), errors
    for fragments in expected:
        assert any(all(fragment in line for fragment in fragments) for line in errors), (fragments, errors)
    assert all("(got" not in line or line.count("got ") == 1 for line in errors), errors  # no `got 1.5 (got 1.5)`
    assert not (tmp_path / "out").exists()


def test_api_returns_the_same_problems(scenario, tmp_path, no_weights):
    recipe = _write(scenario, tmp_path, _missing_paths)
    problems = featcal_llm.validate(recipe)
    result = CliRunner().invoke(main, ["validate", str(recipe)])
    assert [f"featcal-llm: error: {problem}" for problem in problems] == result.stderr.strip().splitlines()[:-1]
    assert {problem.key for problem in problems} == {"base_model", "models", f"featcal.data.{_expert(yaml.safe_load(recipe.read_text()), 2)}.path"}
    assert all(problem.file == str(recipe) for problem in problems)


def test_a_clean_recipe_passes_with_a_memory_estimate(scenario, tmp_path, no_weights):
    recipe = _write(scenario, tmp_path, lambda r, t: None)
    result = CliRunner().invoke(main, ["validate", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "memory plan (estimate from the configs, not a measurement)" in result.stdout
    assert "host RAM" in result.stdout and result.stdout.strip().endswith(": ok")
    assert featcal_llm.validate(recipe) == []


@pytest.mark.parametrize("installed, cuda, backend, expected", [
    ({"vllm": False}, "CUDA is not available (no NVIDIA driver is loaded)", {"name": "vllm"},
     "featcal.eval.backend.name: vllm is not installed; install the extra: pip install 'featcal-llm[vllm]', or set featcal.eval.backend.name: hf"),
    ({"vllm": True}, "CUDA is not available (torch is a CPU-only build)", {"name": "vllm"},
     "featcal.eval.backend.name: vllm scores on a CUDA GPU, but CUDA is not available (torch is a CPU-only build); use hf"),
    ({"vllm": False}, "CUDA is not available (torch is a CPU-only build)", {"tensor_parallel_size": 2},  # auto is hf here
     "featcal.eval.backend.tensor_parallel_size: only the vllm backend shards a model"),
    ({"vllm": False}, None, {"tensor_parallel_size": 2}, None),  # auto where CUDA may be: torch decides at the run
    ({"vllm": False}, "CUDA is not available (torch is a CPU-only build)", {"name": "hf", "device": "cuda:0"},
     "featcal.eval.backend.device: cuda:0, but CUDA is not available (torch is a CPU-only build); use cpu"),
    ({"vllm": False}, None, {"name": "hf", "device": "cuda"}, None),  # where CUDA may be: torch decides at the run
    ({"vllm": False}, None, {"name": "hf", "gpu_memory_utilization": 0.5},
     "featcal.eval.backend.gpu_memory_utilization: only the vllm backend sizes its memory by it"),
    ({"vllm": True, "lm_eval": False}, None, {"name": "vllm"},
     "featcal.eval: lm-eval is not installed; install the extra: pip install 'featcal-llm[eval]'"),
])
def test_the_eval_backend_is_checked_before_the_calibration(scenario, tmp_path, no_weights, monkeypatch, installed, cuda, backend, expected):
    """What the evaluation after the run refuses of its backend on this machine (uninstalled, vLLM without CUDA, hf
    settings under `auto` on a CPU) is refused by validate, so that run stops before the calibration's hours."""
    from featcal_llm import hardware
    from featcal_llm.evaluation import backends

    have = {"lm_eval": True, "torch": True, "transformers": True, **installed}
    monkeypatch.setattr(backends, "_installed", lambda name: have[name])
    monkeypatch.setattr(hardware, "cuda_refusal", lambda: cuda)
    recipe = _write(scenario, tmp_path, lambda r, _t: r["featcal"].__setitem__("eval", {"tasks": ["arc_challenge"], "backend": backend}))
    assert [str(problem).removeprefix(f"{recipe}: ") for problem in featcal_llm.validate(recipe)] == ([expected] if expected else [])


def test_an_eval_backend_this_machine_lacks_leaves_the_memory_plan_shown(scenario, tmp_path, no_weights, monkeypatch):
    """A recipe written for a GPU box, checked on a laptop without vLLM: the eval problem is an error (run would refuse
    it here too), and the calibration's memory plan is printed beside it, as nothing in it depends on the evaluation."""
    from featcal_llm.evaluation import backends

    monkeypatch.setattr(backends, "_installed", lambda name: name != "vllm")
    recipe = _write(scenario, tmp_path, lambda r, _t: r["featcal"].__setitem__("eval", {"tasks": ["arc_challenge"], "backend": {"name": "vllm"}}))
    result = CliRunner().invoke(main, ["validate", str(recipe)])
    assert result.exit_code == 2 and "featcal.eval.backend.name: vllm is not installed" in result.stderr
    assert "memory plan (estimate from the configs, not a measurement)" in result.stdout and "host RAM" in result.stdout
    bad = _write(scenario, tmp_path, lambda r, _t: r["featcal"].__setitem__("samples", "many"))  # another problem: no plan
    assert "memory plan" not in CliRunner().invoke(main, ["validate", str(bad)]).stdout


@pytest.mark.parametrize("edit", [
    lambda c: c.pop("intermediate_size"),  # transformers' Llama default, 11008, is not the base's 128
    lambda c: c.pop("rms_norm_eps"),  # default 1e-6, the base's 1e-5
    lambda c: c.pop("architectures"),
    lambda c: c.pop("attention_bias"),  # default false, as the base's: the same layer
    lambda c: (c.pop("mlp_bias"), c.pop("pretraining_tp")),
    lambda c: c.__setitem__("num_key_value_heads", c["num_attention_heads"]),
], ids=["intermediate_size", "rms_norm_eps", "architectures", "attention_bias", "mlp_bias", "kv heads"])
def test_validate_compares_an_experts_config_as_run_reads_it(scenario, tmp_path, no_weights, edit):
    """A key one config.json leaves out is the family's default, as transformers fills it in for run: validate refuses
    what run's `check_compatible` refuses, with its line, and passes what it passes."""
    from transformers import AutoConfig

    from featcal_llm.family.compat import check_compatible

    odd = []
    recipe = _write(scenario, tmp_path, lambda r, t: odd.append(_other_shape(r, t, edit)))
    found = [str(problem) for problem in featcal_llm.validate(recipe)]
    what = f"{recipe}: models: {odd[0]}: {odd[0] / 'config.json'}"
    try:
        base = yaml.safe_load(scenario.recipe.read_text())["base_model"]
        check_compatible(AutoConfig.from_pretrained(base), AutoConfig.from_pretrained(odd[0]), what)
        refused = []
    except featcal_llm.FeatCalError as error:
        refused = [str(error)]
    assert found == refused


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


def _eval_suite(tmp_path: Path, **task_changes) -> str:
    """A copy of the shipped mergebench suite whose gsm8k entry is changed."""
    from featcal_llm.evaluation.suite import resolve_suite_path

    shipped = resolve_suite_path("mergebench")
    shutil.copytree(shipped.parent, tmp_path / "suites")  # its own task YAMLs beside it
    suite = yaml.safe_load(shipped.read_text())
    suite["tasks"]["gsm8k"].update(task_changes)
    path = tmp_path / "suites" / "custom.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return str(path)


def _base_without_chat_template(recipe: dict, tmp_path: Path) -> None:
    base = tmp_path / "plain-base"
    base.mkdir()
    for item in Path(recipe["base_model"]).iterdir():  # the weights linked (this module refuses to open them), the rest copied
        (base / item.name).symlink_to(item) if item.suffix == ".safetensors" else shutil.copy(item, base / item.name)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    recipe["base_model"] = str(base)
    recipe["featcal"]["merged"] = str(tmp_path / "merged")


FIXTURES = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench"
EVAL_CASES = {
    "an lm-eval task this lm-eval lacks": (
        lambda r, t: r["featcal"]["eval"].update(suite=_eval_suite(t, lm_eval_task="gsm8k_cot_lama"), tasks=["gsm8k"]),
        "tasks.gsm8k.lm_eval_task: 'gsm8k_cot_lama' is not a task of this lm-eval"),
    "a metric the task does not report": (
        lambda r, t: r["featcal"]["eval"].update(suite=_eval_suite(t, metric="exact_match,flexible_extract"), tasks=["gsm8k"]),
        "tasks.gsm8k.metric: 'exact_match,flexible_extract' is not a result lm-eval reports for gsm8k_cot_llama (it reports "
        "exact_match,flexible-extract, exact_match,strict-match)"),
    "IFEval from the hub without punkt_tab": (
        lambda r, t: r["featcal"]["eval"].update(tasks=["ifeval"]),
        "featcal.eval.tasks.ifeval: ifeval: IFEval needs NLTK's punkt_tab data (for change_case:capital_word_frequency, "
        "length_constraints:number_sentences) and it is not installed"),
    "IFEval prompts that need punkt_tab": (
        lambda r, t: r["featcal"]["eval"].update(tasks=["ifeval"], data={"ifeval": str(FIXTURES / "ifeval_punkt.jsonl")}),
        "IFEval needs NLTK's punkt_tab data (for "),
    "IFEval with an nltk_data that lacks punkt_tab": (  # the directory given is named, not an option of another command
        lambda r, t: ((t / "nltk-empty").mkdir(), r["featcal"]["eval"].update(tasks=["ifeval"], nltk_data=str(t / "nltk-empty"))),
        "nltk-empty; on a machine with internet run `python -m nltk.downloader -d DIR punkt_tab`, then copy it into that directory"),
    "IFEval prompts that do not need it": (
        lambda r, t: r["featcal"]["eval"].update(tasks=["ifeval"], data={"ifeval": str(FIXTURES / "ifeval.jsonl")}), None),
    "IFEval with punkt_tab in nltk_data": (
        lambda r, t: ((t / "nltk" / "tokenizers" / "punkt_tab" / "english").mkdir(parents=True),
                      r["featcal"]["eval"].update(tasks=["ifeval"], nltk_data=str(t / "nltk"))), None),
    "a task's generation budget that fills the model's positions": (
        lambda r, t: (r["featcal"]["eval"].pop("max_gen_toks"), r["featcal"]["eval"].update(
            tasks=["gsm8k"], data={"gsm8k": str(FIXTURES / "gsm8k.jsonl")})),
        "featcal.eval.tasks.gsm8k: generates up to 1024 tokens (the suite's max_gen_toks for gsm8k) in a context of 512 "
        "tokens"),
    "chat_template on, but the merge's tokenizer has none": (
        lambda r, t: (_base_without_chat_template(r, t), r["featcal"]["eval"].update(chat_template="on")),
        "featcal.eval.chat_template: on, but the merged model's tokenizer ("),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_what_the_evaluation_refuses_before_it_generates_validate_refuses_first(scenario, tmp_path, no_weights, monkeypatch, case):
    """The evaluation after the run checks each task's lm-eval name, metric and NLTK data, and the chat template, before
    it generates; validate (and run, before the calibration's hours) read the same from lm-eval's YAMLs and the files."""
    pytest.importorskip("lm_eval")
    from featcal_llm.evaluation.worker import punkt_available

    if "IFEval" in case and punkt_available():  # the other cases do not depend on it
        pytest.skip("NLTK's punkt_tab is installed here")
    edit, expected = EVAL_CASES[case]

    def mutate(recipe, tmp):
        recipe["featcal"]["eval"] = {"tasks": ["arc_challenge"], "backend": {"name": "hf"}, "max_gen_toks": 64}  # the
        # tiny models' 512 positions hold no task's own budget
        edit(recipe, tmp)

    recipe = _write(scenario, tmp_path, mutate)
    problems = [str(problem).removeprefix(f"{recipe}: ") for problem in featcal_llm.validate(recipe)]
    assert (len(problems) == 1 and expected in problems[0]) if expected else problems == [], problems


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


def test_the_evaluation_s_hub_datasets_are_noted_offline_and_looked_up_online(scenario, tmp_path, no_weights, monkeypatch):
    """The data an `eval:` task downloads after the calibration is a hub id like the calibration's: named among those not
    looked up, looked up with --online (not for a task given local data)."""
    pytest.importorskip("lm_eval")
    import featcal_llm.io.validate_eval as validate_eval
    import featcal_llm.io.validate_models as validate_models

    recipe = _write(scenario, tmp_path, lambda r, _t: r["featcal"].__setitem__("eval", {
        "tasks": ["arc_challenge", "gsm8k"], "backend": {"name": "hf"}, "data": {"gsm8k": str(FIXTURES / "gsm8k.jsonl")},
        "max_gen_toks": 64}))
    result = featcal_llm.validate(recipe)
    assert result.ok and any("allenai/ai2_arc (dataset, eval task arc_challenge)" in note for note in result.notes), result.notes
    assert not any("gsm8k (dataset" in note for note in result.notes)
    looked = []
    monkeypatch.setattr(validate_eval, "hub_lookup", lambda kind, repo, revision, where, offline: looked.append((kind, repo, where)))
    monkeypatch.setattr(validate_models, "hub_config", lambda model_path, online: None)
    assert featcal_llm.validate(recipe, online=True).ok
    assert ("dataset", "allenai/ai2_arc", "featcal.eval.tasks.arc_challenge") in looked and not any("gsm8k" in repo for _, repo, _ in looked)


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


def test_vllm_engine_args_are_checked_before_the_calibration_under_auto(scenario, tmp_path, no_weights, monkeypatch):
    """`backend: auto` where CUDA may be present picks vLLM once torch sees the GPU: a key vLLM does not take is
    refused by validate, not only when the evaluation plans its backend after the calibration."""
    from test_eval_backends import _fake_vllm

    from featcal_llm import hardware
    from featcal_llm.evaluation import vllm_arguments

    _fake_vllm(tmp_path / "site", ["model", "max_num_seqs"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(hardware, "cuda_refusal", lambda: None)
    vllm_arguments.vllm_argument_names.cache_clear()
    try:
        for engine_args, expected in (({"max_num_seqs": 64}, []), ({"max_num_seq": 64}, [
                "featcal.eval.backend.engine_args.max_num_seq: not an argument of lm-eval's vllm model, vllm.LLM or vllm's "
                "EngineArgs (did you mean max_num_seqs?)"])):
            recipe = _write(scenario, tmp_path, lambda r, _t, e=engine_args: r["featcal"].__setitem__(
                "eval", {"tasks": ["arc_challenge"], "backend": {"engine_args": e}}))
            assert [str(problem).removeprefix(f"{recipe}: ") for problem in featcal_llm.validate(recipe)] == expected
    finally:
        vllm_arguments.vllm_argument_names.cache_clear()


def test_an_empty_eval_block_is_refused_not_read_as_no_evaluation(scenario, tmp_path, no_weights):
    """`eval:` with every key commented out read as no evaluation, while `eval: {}` asks for the suite's defaults."""
    recipe = _write(scenario, tmp_path, lambda r, _t: r["featcal"].__setitem__("eval", None))
    assert [str(problem).removeprefix(f"{recipe}: ") for problem in featcal_llm.validate(recipe)] == [
        "featcal.eval: empty; write its keys (tasks, backend, ...) or leave eval: out (got null)"]


def test_hf_engine_args_are_checked_before_the_calibration_by_the_models_config(scenario, tmp_path, no_weights):
    """hf hands engine_args to transformers, where the model's constructor refuses a key it does not take only when the
    evaluation loads it, after the calibration: validate refuses it first, by the base's config.json (no merge yet)."""
    for engine_args, expected in (({"use_cache": False, "attn_implementation": "eager", "low_cpu_mem_usage": True}, []), (
            {"foo": 1}, ["featcal.eval.backend.engine_args.foo: not an argument of lm-eval's hf model, transformers' "
                         "from_pretrained or the model's config"])):
        recipe = _write(scenario, tmp_path, lambda r, _t, e=engine_args: r["featcal"].__setitem__(
            "eval", {"tasks": ["arc_challenge"], "backend": {"name": "hf", "engine_args": e}}))
        assert [str(problem).removeprefix(f"{recipe}: ") for problem in featcal_llm.validate(recipe)] == expected


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
