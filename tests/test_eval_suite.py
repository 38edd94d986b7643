"""Suite files, the eval: section and option validation: bad input is one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation import EvalSection
from featcal_llm.evaluation.config import section_from_options
from featcal_llm.evaluation.suite import eval_root, load_suite

SIX = ["math500", "gsm8k", "humaneval_plus", "mbpp_plus", "ifeval", "arc_challenge"]


def test_mergebench_suite_pins_the_six_tasks():
    suite = load_suite("mergebench")
    assert list(suite.tasks) == SIX
    assert [t.label for t in suite.tasks.values()] == ["MATH-500", "GSM8K", "HumanEval+", "MBPP+", "IFEval", "ARC-C"]
    assert {k: t.metric for k, t in suite.tasks.items()} == {
        "math500": "math_verify,none",
        "gsm8k": "exact_match,flexible-extract",
        "humaneval_plus": "pass@1,evalplus",
        "mbpp_plus": "pass@1,evalplus",
        "ifeval": "prompt_level_strict_acc,none",
        "arc_challenge": "exact_match,remove_whitespace",
    }
    assert [k for k, t in suite.tasks.items() if t.executes_code] == ["humaneval_plus", "mbpp_plus"]
    # chain-of-thought tasks get room past lm-eval's 256-token default
    assert suite.tasks["math500"].generation_kwargs["max_gen_toks"] == 2048
    assert all(t.generation_kwargs.get("max_gen_toks", 0) > 256 for k, t in suite.tasks.items() if k != "arc_challenge")
    assert (suite.report.scale, suite.report.decimals) == ("percent", 1)
    assert all(len(t.why) > 80 for t in suite.tasks.values())


def test_task_fingerprint_follows_the_definition(tmp_path):
    suite = load_suite("mergebench")
    text = (eval_root() / "mergebench.yaml").read_text()
    copy = tmp_path / "copy.yaml"
    copy.write_text(text.replace("max_gen_toks: 2048", "max_gen_toks: 1024"))
    (tmp_path / "tasks").symlink_to(eval_root() / "tasks")
    changed = load_suite(str(copy))
    assert changed.task_fingerprint("math500") != suite.task_fingerprint("math500")
    assert changed.task_fingerprint("gsm8k") == suite.task_fingerprint("gsm8k")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("version"), "bad.yaml: version: Field required"),
        (lambda d: d["tasks"]["gsm8k"].update(metric="exact_match"), "bad.yaml: tasks.gsm8k: Value error, metric must be '<metric>,<filter>'"),
        (lambda d: d["tasks"]["math500"].update(shots=4), "bad.yaml: tasks.math500.shots: Extra inputs are not permitted"),
        (lambda d: d["tasks"]["mbpp_plus"].update(task_file="tasks/nope.yaml"), "tasks.mbpp_plus.task_file:"),
    ],
)
def test_bad_suite_is_one_line_naming_the_key(tmp_path, edit, message):
    data = yaml.safe_load((eval_root() / "mergebench.yaml").read_text())
    edit(data)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    (tmp_path / "tasks").symlink_to(eval_root() / "tasks")
    with pytest.raises(FeatCalError) as error:
        load_suite(str(bad))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_eval_section_requires_opt_in_for_code_tasks():
    with pytest.raises(ValueError, match="humaneval_plus, mbpp_plus execute model-written code"):
        EvalSection.model_validate({"suite": "mergebench"})
    assert EvalSection.model_validate({"tasks": ["gsm8k", "ifeval"]}).tasks == ["gsm8k", "ifeval"]
    assert EvalSection.model_validate({"allow_code_execution": True, "chat_template": True}).chat_template == "on"
    with pytest.raises(ValueError, match="unknown task gsm9k"):
        EvalSection.model_validate({"tasks": ["gsm9k"]})
    with pytest.raises(ValueError, match="Extra inputs"):
        EvalSection.model_validate({"allow_code_execution": True, "backend": {"tp": 2}})


def test_section_reads_inputs_as_featcal_data_paths_are_read_and_writes_from_the_current_directory(tmp_path, monkeypatch):
    """Inputs from the current directory, or beside the recipe where only that one exists (validate accepts both);
    the results directory from the current directory, as featcal.output."""
    recipe_dir, here = tmp_path / "recipes", tmp_path / "here"
    for folder in (recipe_dir / "data", recipe_dir / "suites", here / "suites"):
        folder.mkdir(parents=True)
    (recipe_dir / "data" / "gsm8k.jsonl").write_text("{}\n")
    (recipe_dir / "suites" / "my.yaml").write_text("tasks: []\n")
    (here / "suites" / "my.yaml").write_text("tasks: []\n")  # both exist: the current directory's, as mergekit reads paths
    monkeypatch.chdir(here)
    section = EvalSection.model_validate(
        {"tasks": ["gsm8k"], "output": "results", "data": {"gsm8k": "data/gsm8k.jsonl"}, "suite": "suites/my.yaml"}
    ).resolve(recipe_dir)
    assert section.output == str(here / "results")
    assert section.data == {"gsm8k": str(recipe_dir / "data/gsm8k.jsonl")}
    assert section.suite == str(here / "suites/my.yaml")
    assert EvalSection.model_validate({"tasks": ["gsm8k"], "data": {"gsm8k": "data/gsm8k.jsonl"}}).resolve().data == {
        "gsm8k": str(here / "data/gsm8k.jsonl")}  # `featcal-llm eval`: no recipe, the current directory


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backend": {"gpu_memory_utilization": 1.5}}, "eval --gpu-memory-utilization: Input should be less than or equal to 1"),
        ({"backend": {"dtype": "fp8"}}, "eval --dtype:"),
        ({"limit": 0}, "eval --limit: Input should be greater than 0"),
        ({"limit": 10**20}, "eval --limit: Input should be less than or equal to"),  # had crashed the worker's islice
        ({"backend": {"device": "banana"}}, "eval --device: expected cpu, cuda or cuda:N, got 'banana'"),  # had run on the CPU
        ({"output": ""}, "eval --output: String should have at least 1 character"),  # had written into the current directory
        ({"tasks": []}, "eval --tasks: List should have at least 1 item"),  # had meant every task (None does)
        ({}, "eval: humaneval_plus, mbpp_plus execute model-written code: pass --allow-code-execution"),
    ],
)
def test_cli_options_errors(options, message):
    with pytest.raises(FeatCalError) as error:
        section_from_options(options)
    assert str(error.value).startswith(message)


def test_task_configs_resolve_from_lm_eval_and_our_yamls():
    pytest.importorskip("lm_eval")
    from featcal_llm.evaluation.tasks import resolve_task_config

    suite = load_suite("mergebench")
    fixtures = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench"
    names = {}
    for task_id in SIX:
        config = resolve_task_config(suite, task_id, data=fixtures / f"{task_id}.jsonl", max_gen_toks=None)
        names[task_id] = config["task"]
        assert config["dataset_path"] == "json"
        assert config["dataset_kwargs"] == {"data_files": {config["test_split"]: str(fixtures / f"{task_id}.jsonl")}}
        assert config["num_fewshot"] == suite.tasks[task_id].num_fewshot
        for key, value in suite.tasks[task_id].generation_kwargs.items():
            assert config["generation_kwargs"][key] == value
    assert names == {"math500": "minerva_math500", "gsm8k": "gsm8k_cot_llama", "humaneval_plus": "evalplus_humaneval_plus",
                     "mbpp_plus": "evalplus_mbpp_plus", "ifeval": "ifeval", "arc_challenge": "arc_challenge_chat"}
    # our MBPP+ grades the full EvalPlus `test` field, never lm-eval's three-assert target
    mbpp = resolve_task_config(suite, "mbpp_plus", data=None, max_gen_toks=7)
    assert mbpp["dataset_path"] == "evalplus/mbppplus" and mbpp["generation_kwargs"]["max_gen_toks"] == 7
    assert mbpp["filter_list"][0]["filter"][0]["filter_fn"].__name__ == "mbpp_verdicts"


def test_file_override_refuses_few_shot_from_the_dataset(tmp_path):
    pytest.importorskip("lm_eval")
    from featcal_llm.evaluation.tasks import apply_data_override

    data = tmp_path / "arc.jsonl"
    data.write_text("{}\n")
    config = {"num_fewshot": 25, "test_split": "test", "fewshot_split": "train"}
    with pytest.raises(FeatCalError, match="data.arc_challenge: a single file holds only the test split"):
        apply_data_override(config, data, "arc_challenge")
    with pytest.raises(FeatCalError, match="data.arc_challenge: .*arc.txt: expected one of"):
        (tmp_path / "arc.txt").write_text("")
        apply_data_override({"num_fewshot": 0, "test_split": "test"}, tmp_path / "arc.txt", "arc_challenge")


@pytest.mark.parametrize("name", ["mergebench", "mergebench-protocol"])
def test_every_shipped_metric_is_one_lm_eval_reports_and_a_wrong_one_is_refused_before_generation(name):
    """The worker checks the suite's metric against the task's metric_list × filter_list before any model loads (it
    had been found missing only in the results, after the task's whole generation); validate reads the same."""
    pytest.importorskip("lm_eval")
    from featcal_llm.evaluation.tasks import check_metric, declared_config, reported_metrics, resolve_task_config

    suite = load_suite(name)
    for task_id in suite.tasks:
        config = declared_config(suite, task_id)
        assert reported_metrics(config) and suite.tasks[task_id].metric in reported_metrics(config), task_id
        check_metric(suite, task_id, config)
    gsm8k = next(task_id for task_id, spec in suite.tasks.items() if spec.lm_eval_task and "gsm8k" in spec.lm_eval_task)
    resolved = resolve_task_config(suite, gsm8k, data=None, max_gen_toks=None)  # what the worker checks
    suite.tasks[gsm8k].metric = "exact_match,flexible_extract"
    with pytest.raises(FeatCalError, match=r"tasks\.gsm8k\.metric: 'exact_match,flexible_extract' is not a result lm-eval "
                                           r"reports for gsm8k_cot(_llama)? \(it reports exact_match,flexible-extract, "):
        check_metric(suite, gsm8k, resolved)


def test_a_blank_chat_template_is_none_to_the_evaluation(tmp_path):
    """transformers loads a blank chat_template.jinja as "", which renders every prompt as nothing: the evaluation's
    decision counts it as no template, as the calibration's records and validate do."""
    from featcal_llm.evaluation.modelinfo import decide_chat_template
    from featcal_llm.io.model_files import saved_chat_template

    (tmp_path / "config.json").write_text('{"_name_or_path": "x-Instruct"}')
    (tmp_path / "chat_template.jinja").write_text("  \n")
    assert saved_chat_template(tmp_path) is None
    assert not decide_chat_template(tmp_path, "auto").applied
    with pytest.raises(FeatCalError, match="but the tokenizer has no chat template"):
        decide_chat_template(tmp_path, "on")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert decide_chat_template(tmp_path, "auto").applied


def test_a_function_metric_is_not_judged_from_its_unresolved_yaml():
    """`metric: !function utils.pass_at_k` reads as a path when functions are left unresolved; lm-eval reports it under
    the function's name, so nothing is judged from the YAML (validate had refused humaneval's correct metric)."""
    from featcal_llm.evaluation.tasks import reported_metrics

    assert reported_metrics({"metric_list": [{"metric": "/lm_eval/tasks/humaneval/utils.pass_at_k"}], "filter_list": [{"name": "create_test"}]}) is None
    assert reported_metrics({"metric_list": [{"metric": "acc"}]}) == {"acc,none"}


@pytest.mark.parametrize("name, refused", [("hf", True), ("auto", False)])
def test_gpu_memory_utilization_is_refused_only_where_hf_is_named(name, refused):
    """`auto` may be vLLM on the GPU box the recipe was written for; only an explicit hf ignores the setting."""
    from featcal_llm.evaluation.backends import check_settings
    from featcal_llm.evaluation.config import BackendSettings

    settings = BackendSettings.model_validate({"name": name, "gpu_memory_utilization": 0.5})
    if refused:
        with pytest.raises(FeatCalError, match="backend.gpu_memory_utilization: only the vllm backend"):
            check_settings("hf", settings)
    else:
        check_settings("hf", settings)  # auto, resolved to hf on this machine


def test_one_reader_of_a_saved_chat_template_for_validate_and_the_evaluation(tmp_path):
    """chat_template.json's blank key beside tokenizer_config.json's template: transformers takes the file, so there is
    no template; validate had said there was (it read the file's text), the evaluation that there was none."""
    from featcal_llm.evaluation.modelinfo import decide_chat_template
    from featcal_llm.io.model_files import has_chat_template, saved_chat_template

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].content }}"}')
    assert has_chat_template(tmp_path) and saved_chat_template(tmp_path) == "{{ messages[0].content }}"
    (tmp_path / "chat_template.json").write_text('{"chat_template": ""}')
    assert not has_chat_template(tmp_path) and saved_chat_template(tmp_path) is None
    assert not decide_chat_template(tmp_path, "auto").applied


# ------------------------------------------------------------------ mutation round 8: tests a surviving mutation showed missing

def _chat_model(path: Path, name_or_path: str = "", merge_base=None) -> Path:
    import yaml

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": name_or_path}))
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    if merge_base is not None:
        (path / "mergekit_config.yml").write_text(yaml.safe_dump({"merge_method": "ties", "base_model": merge_base}))
    return path


@pytest.mark.parametrize("name, applied", [
    ("Llama-3.2-3B-Instruct", True), ("gemma-2-2b-it", True), ("vicuna-7b-chat", True), ("it-model", True),
    ("Llama-3.2-3B", False), ("llama-7b-summit", False), ("gemma-2-2b-italian", False), ("dolphin-kit", False),
])
def test_auto_chat_template_follows_an_instruct_chat_or_it_name(tmp_path, name, applied):
    from featcal_llm.evaluation.modelinfo import decide_chat_template

    assert decide_chat_template(_chat_model(tmp_path / name), "auto").applied is applied


def test_forced_off_chat_template_holds_for_an_instruct_model(tmp_path):
    from featcal_llm.evaluation.modelinfo import decide_chat_template

    model = _chat_model(tmp_path / "Llama-3.2-3B-Instruct")
    decision = decide_chat_template(model, "off")
    assert (decision.applied, decision.reason) == (False, "forced off") and decision.template_sha256 is not None


@pytest.mark.parametrize("base", ["meta-llama/Llama-3.2-3B-Instruct", {"model": "meta-llama/Llama-3.2-3B-Instruct"}])
def test_auto_chat_template_follows_a_merge_s_instruct_base(tmp_path, base):
    """A merge saved as `merged/` with no hub name is an instruct model when its mergekit base is one (either form
    mergekit writes base_model in)."""
    from featcal_llm.evaluation.modelinfo import decide_chat_template

    decision = decide_chat_template(_chat_model(tmp_path / "merged", merge_base=base), "auto")
    assert (decision.applied, decision.reason) == (True, "auto: 'meta-llama/Llama-3.2-3B-Instruct' is an instruct/chat model")
    assert not decide_chat_template(_chat_model(tmp_path / "plain", merge_base="meta-llama/Llama-3.2-3B"), "auto").applied
