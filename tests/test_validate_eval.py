"""`validate` checks a recipe's `eval:` block before any calibration, as the evaluation would refuse it after the
calibration: its backend on this machine, its engine arguments, its suites and their hub datasets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import featcal_llm
from featcal_llm.cli import main
from test_validate import _write


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
