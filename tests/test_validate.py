"""`featcal-llm validate`: every problem of a bad recipe at once, one line each, exit 2, without opening any weights
(conftest.py's `no_weights`; the evaluation's checks: test_validate_eval.py; other inputs: test_validate_inputs.py)."""

from __future__ import annotations

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
