"""The MergeBench-protocol suite (eval/mergebench-protocol.yaml): MergeBench's scripts/evaluate.sh
settings, no chat template, code sampled n = 10 at T = 0.2 and scored pass@1 = c / n."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation import runner
from featcal_llm.evaluation.config import EvalSection
from featcal_llm.evaluation.suite import load_suite

FIXTURES = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench"


@pytest.fixture(scope="module")
def suite():
    return load_suite("mergebench-protocol")


def test_protocol_suite_pins_evaluate_sh(suite):
    pytest.importorskip("lm_eval")
    from featcal_llm.evaluation.tasks import resolve_task_config

    assert list(suite.tasks) == ["gsm8k", "ifeval", "humaneval_plus", "mbpp_plus"]
    assert suite.apply_chat_template == "never" and suite.fewshot_as_multiturn is False
    gsm = resolve_task_config(suite, "gsm8k", data=None, max_gen_toks=None)
    assert (gsm["task"], gsm["num_fewshot"]) == ("gsm8k_cot", 8)
    assert "max_gen_toks" not in gsm["generation_kwargs"]  # the backend's 256, as evaluate.sh ran it
    for task_id in ("humaneval_plus", "mbpp_plus"):
        config = resolve_task_config(suite, task_id, data=None, max_gen_toks=None)
        generation = config["generation_kwargs"]
        assert config["repeats"] == 10
        assert (generation["do_sample"], generation["temperature"], generation["top_p"]) == (True, 0.2, 0.95)
        assert generation["max_gen_toks"] == 512


def test_code_tasks_score_pass_at_1_over_ten_samples(suite, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from featcal_llm.evaluation.replay import grade_completions

    right, wrong = "\n    return x + y\n", "\n    return x - y\n"
    completions = [[right] * 3 + [wrong] * 7, [wrong] * 10, ["\n    return text == text[::-1]\n"] * 10]
    score, samples = grade_completions(suite, "humaneval_plus", completions, data=FIXTURES / "humaneval_plus.jsonl",
                                       allow_code_execution=True, code_limits={"min_time_limit_s": 1.0})
    assert [s["primary"] for s in samples] == pytest.approx([0.3, 0.0, 1.0])
    assert score == pytest.approx((0.3 + 0.0 + 1.0) / 3)
    verdict = json.loads(samples[0]["filtered_resps"][0][0])  # the first of its 10 samples
    assert verdict["solution"].startswith("def add(x: int, y: int) -> int:")  # prompt + completion


def test_protocol_suite_scores_without_the_chat_template(tmp_path, monkeypatch):
    jobs = []
    monkeypatch.setattr(runner, "_run_worker", lambda job, output, label, echo: jobs.append(job) or (_ for _ in ()).throw(
        FeatCalError("stop")))
    model = tmp_path / "tiny-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "model.safetensors").write_bytes(b"w")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    section = EvalSection.model_validate({"suite": "mergebench-protocol", "tasks": ["gsm8k"], "output": str(tmp_path / "o"),
                                          "backend": {"name": "hf", "device": "cpu"}})
    with pytest.raises(FeatCalError, match="stop"):
        runner.evaluate_model(model, "m", section, echo=lambda line: None)
    assert jobs[0]["chat"]["applied"] is False and jobs[0]["chat"]["reason"] == "suite mergebench-protocol: never"
    forced = section.model_copy(update={"chat_template": "on"})
    with pytest.raises(FeatCalError, match="--chat-template on: suite mergebench-protocol scores every model without"):
        runner.evaluate_model(model, "m", forced, echo=lambda line: None)
