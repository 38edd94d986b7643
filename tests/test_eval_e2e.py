"""End to end on CPU with lm-eval's hf backend: a tiny local model over local fixture versions of
the six MergeBench tasks -> results + samples, cache hits, resume, leaderboard, and the
after-calibration comparison. Scores of a random model are 0; the plumbing is what is checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

pytest.importorskip("lm_eval")

from featcal_llm.cli import main  # noqa: E402
from featcal_llm.evaluation import EvalSection, run_after_calibration  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench"
SIX = ["math500", "gsm8k", "humaneval_plus", "mbpp_plus", "ifeval", "arc_challenge"]
DATA = [arg for task in SIX for arg in ("--data", f"{task}={FIXTURES / f'{task}.jsonl'}")]


def _tiny(path: Path, seed: int) -> Path:
    from featcal_llm.tiny import (
        build_char_tokenizer,
        new_tiny_llama,
        save_model,
        tiny_llama_config,
    )

    tokenizer = build_char_tokenizer()
    return save_model(new_tiny_llama(tiny_llama_config(len(tokenizer), max_position_embeddings=1024), seed), tokenizer, path)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _eval(model: Path, out: Path, *extra: str):
    args = ["eval", str(model), "--backend", "hf", "--max-gen-toks", "8", "--allow-code-execution",
            "--output", str(out), *DATA, *extra]
    return CliRunner().invoke(main, args)


@pytest.mark.slow
def test_eval_writes_results_hits_cache_resumes_and_ranks(tmp_path):
    model = _tiny(tmp_path / "tiny-Instruct", seed=0)
    out = tmp_path / "results"
    first = _eval(model, out)
    assert first.exit_code == 0, first.output
    summary = json.loads((out / "tiny-Instruct.json").read_text())
    assert list(summary["tasks"]) == SIX and summary["complete"] and summary["average"] == 0.0
    assert summary["chat_template"]["applied"] is True  # "-Instruct" in the name, template present
    for task_id, entry in summary["tasks"].items():
        record = json.loads((out / entry["result"]).read_text())
        assert record["task"]["id"] == task_id and record["cache_key"] == entry["cache_key"]
        assert set(record["versions"]) >= {"lm_eval", "vllm", "transformers", "torch"}
        assert record["versions"]["vllm"] is None and record["versions"]["lm_eval"]
        assert record["seeds"] == {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}
        assert record["backend"]["model_args"]["max_length"] == 1024 and record["backend"]["batch_size"] == 1
        assert record["chat_template"]["applied_template_sha256"] == summary["chat_template"]["template_sha256"]
        assert record["task"]["settings"]["generation_kwargs"]["max_gen_toks"] == 8
        assert record["lm_eval"]["n-samples"] == {"original": 3, "effective": 3}
        samples = (out / entry["samples"]).read_text().splitlines()
        assert len({json.loads(line)["doc_id"] for line in samples}) == 3
    code_sample = json.loads((out / summary["tasks"]["mbpp_plus"]["samples"]).read_text().splitlines()[0])
    assert json.loads(code_sample["filtered_resps"][0])["status"] in {"failed", "timeout", "crashed"}

    log = out / "logs" / "tiny-Instruct.log"
    second = _eval(model, out)
    assert second.exit_code == 0, second.output
    assert second.output.count(" cached (") == 6
    assert log.read_text().count("===== worker") == 1  # no worker was started

    # a crash mid-run loses only unfinished tasks: drop one entry, only that task runs again
    shutil.rmtree(out / "cache" / summary["tasks"]["ifeval"]["cache_key"])
    third = _eval(model, out)
    assert third.exit_code == 0, third.output
    assert third.output.count(" cached (") == 5
    assert "tiny-Instruct: ifeval (ifeval)" in log.read_text().split("===== worker")[-1]
    assert "gsm8k (" not in log.read_text().split("===== worker")[-1]

    board = CliRunner().invoke(main, ["leaderboard", str(out), "--reference", "Llama-3.2-3B-Instruct"])
    assert board.exit_code == 0, board.output
    lines = (out / "leaderboard.md").read_text().splitlines()
    assert lines[0] == "| Model | MATH-500 | GSM8K | HumanEval+ | MBPP+ | IFEval | ARC-C | Avg. | Source |"
    zero = "0.0 ±0.0"  # a random model: every item fails, so the standard error is 0 too
    assert f"| tiny-Instruct | {' | '.join([zero] * 7)} | this harness (hf, chat, max_gen_toks 8) |" in lines
    assert ("| Llama-3.2-3B-Instruct · w/ FeatCal (paper) | 47.0 | 78.0 | 53.0 | 55.3 | 66.5 | 72.5 | 62.1 "
            "| paper, Table 4 |") in lines
    csv_rows = (out / "leaderboard.csv").read_text().splitlines()
    assert csv_rows[0].startswith(
        "model,math500,gsm8k,humaneval_plus,mbpp_plus,ifeval,arc_challenge,average,source,settings,reference,math500_stderr,")
    assert (out / "leaderboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_model_and_bad_data_are_one_line_errors(tmp_path):
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "nope"), "--tasks", "gsm8k"])
    assert result.exit_code == 2
    assert result.output.strip() == f"featcal-llm: error: eval: {tmp_path / 'nope'}: model directory does not exist"
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "empty"), "--tasks", "gsm8k"])
    assert result.exit_code == 2
    assert result.output.strip() == f"featcal-llm: error: {tmp_path / 'empty'}: not a model directory (no config.json)"
    model = _tiny(tmp_path / "m", seed=0)
    result = CliRunner().invoke(main, ["eval", str(model), "--tasks", "gsm8k", "--data", "gsm8k=/no/such.jsonl",
                                       "--backend", "hf"])
    assert result.exit_code == 2
    assert result.output.strip() == "featcal-llm: error: data.gsm8k: /no/such.jsonl does not exist"


@pytest.mark.slow
def test_ifeval_without_punkt_fails_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("NLTK_DATA", str(tmp_path / "empty-nltk"))
    model = _tiny(tmp_path / "tiny-Instruct", seed=0)
    result = CliRunner().invoke(main, ["eval", str(model), "--backend", "hf", "--tasks", "ifeval", "--output",
                                       str(tmp_path / "out"), "--data", f"ifeval={FIXTURES / 'ifeval_punkt.jsonl'}",
                                       "--max-gen-toks", "16"])  # IFEval's 1280 would not fit the model's 1024
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith(
        "featcal-llm: error: ifeval: IFEval needs NLTK's punkt_tab data (for length_constraints:number_sentences)")
    assert "loading" not in result.output
    assert not (tmp_path / "out").exists()  # refused input: the results folder this call made (a memo, logs) is gone


@pytest.mark.slow
def test_run_after_calibration_compares_merged_and_calibrated(tmp_path, monkeypatch):
    recipe_dir, here = tmp_path / "recipe", tmp_path / "here"
    recipe_dir.mkdir()
    here.mkdir()
    monkeypatch.chdir(here)  # the results directory is from the current directory, as featcal.output is
    merged = _tiny(tmp_path / "merged", seed=1)
    # same weights under another directory: scored once, the second is a cache hit by fingerprint
    calibrated = shutil.copytree(merged, tmp_path / "calibrated")
    section = EvalSection.model_validate({
        "tasks": ["arc_challenge"], "backend": {"name": "hf"}, "chat_template": "off", "max_gen_toks": 4,
        "output": "eval", "data": {"arc_challenge": str(FIXTURES / "arc_challenge.jsonl")},
        "reference": "Llama-3.1-8B-Instruct",
    })
    scored = run_after_calibration(section, merged, calibrated, recipe_dir)
    table = scored.table
    assert scored.calibrated == json.loads((here / "eval" / "calibrated.json").read_text())
    assert (here / "eval" / "logs" / "merged.log").is_file()
    assert "not a git repository" not in (here / "eval" / "logs" / "merged.log").read_text()  # lm-eval asks git here
    assert not (here / "eval" / "logs" / "calibrated.log").exists()
    lines = table.splitlines()
    assert "| merged | – | – | – | – | – | 0.0 ±0.0 | – | this harness (hf, no chat, max_gen_toks 4) |" in lines
    assert "| calibrated | – | – | – | – | – | 0.0 ±0.0 | – | this harness (hf, no chat, max_gen_toks 4) |" in lines
    assert "| Δ calibrated − merged | – | – | – | – | – | +0.0 [+0.0, +0.0] | – |  |" in lines
    assert any(line.startswith("Δ calibrated − merged: mean paired difference [95% paired-bootstrap") for line in lines)
    assert any(line.startswith("| Llama-3.1-8B-Instruct · Task Arithmetic (paper) |") for line in lines)
    assert (here / "eval" / "after-calibration.md").read_text() == table
    assert json.loads((here / "eval" / "calibrated.json").read_text())["chat_template"]["reason"].startswith(
        "as the merged model")
    [result] = [json.loads(path.read_text()) for path in (here / "eval" / "cache").glob("*/result.json")]
    assert result["chat_template"]["fewshot_as_multiturn"] is False  # no chat template applied: no chat turns either


@pytest.mark.slow
def test_a_metric_lm_eval_does_not_report_fails_before_the_model_loads(tmp_path):
    """The worker checks the suite's metric against the task's metrics and filters before any model loads (it had been
    found missing in the results, after the task's whole generation)."""
    from featcal_llm.evaluation.suite import resolve_suite_path

    shipped = resolve_suite_path("mergebench")
    shutil.copytree(shipped.parent, tmp_path / "suites")
    suite = yaml.safe_load(shipped.read_text())
    suite["tasks"]["gsm8k"]["metric"] = "exact_match,flexible_extract"
    (tmp_path / "suites" / "bad.yaml").write_text(yaml.safe_dump(suite, sort_keys=False))
    model = _tiny(tmp_path / "m", seed=0)
    result = CliRunner().invoke(main, ["eval", str(model), "--suite", str(tmp_path / "suites" / "bad.yaml"), "--backend", "hf",
                                       "--tasks", "gsm8k", "--output", str(tmp_path / "out"), "--max-gen-toks", "16",
                                       "--data", f"gsm8k={FIXTURES / 'gsm8k.jsonl'}"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].endswith(
        "tasks.gsm8k.metric: 'exact_match,flexible_extract' is not a result lm-eval reports for gsm8k_cot_llama (it reports "
        "exact_match,flexible-extract, exact_match,strict-match)")
    assert "loading" not in result.output and "Running generate_until" not in result.output


def test_the_git_hash_lm_eval_records_is_asked_quietly(tmp_path, monkeypatch, capfd):
    import subprocess

    from featcal_llm.evaluation.worker import quiet_git_hash

    monkeypatch.chdir(tmp_path)
    assert quiet_git_hash() is None and "fatal" not in capfd.readouterr().err
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert quiet_git_hash() == head
    full = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert quiet_git_hash() == full  # without git, lm-eval's own reading of .git, as it falls back itself


def test_the_hf_backend_decodes_as_vllm_whatever_the_checkpoints_generation_config(tmp_path):
    """vLLM, under lm-eval, takes only the stop ids from generation_config.json; lm-eval's hf backend calls `generate`,
    which would take the file's repetition penalty and n-gram ban too. Two copies of one model, one whose file asks for
    both, must answer alike (the plain copy's answers repeat a token, so the ban would change them)."""
    plain = _tiny(tmp_path / "plain", seed=0)
    banned = tmp_path / "banned"
    shutil.copytree(plain, banned)
    config = json.loads((banned / "generation_config.json").read_text())
    (banned / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 10.0, "no_repeat_ngram_size": 1}))
    answers = {}
    for model in (plain, banned):
        result = _eval(model, tmp_path / f"out-{model.name}", "--tasks", "gsm8k", "--max-gen-toks", "12", "--chat-template", "off")
        assert result.exit_code == 0, result.output
        summary = json.loads((tmp_path / f"out-{model.name}" / f"{model.name}.json").read_text())
        samples = (tmp_path / f"out-{model.name}" / summary["tasks"]["gsm8k"]["samples"]).read_text().splitlines()
        answers[model.name] = [json.loads(line)["resps"] for line in samples]
    assert answers["banned"] == answers["plain"]
    texts = [text for resps in answers["plain"] for text in (resps[0] if isinstance(resps[0], list) else resps)]
    assert any(len(set(text)) < len(text) for text in texts), texts  # a repeated character: the ban would have changed it


def test_a_missing_nltk_data_directory_is_refused_before_any_model_loads(tmp_path):
    model = _tiny(tmp_path / "tiny-Instruct", seed=0)
    result = CliRunner().invoke(main, ["eval", str(model), "--tasks", "ifeval", "--nltk-data", str(tmp_path / "nope"),
                                       "--output", str(tmp_path / "out")])
    assert result.exit_code == 2 and result.stderr.strip() == f"featcal-llm: error: eval: --nltk-data {tmp_path / 'nope'}: directory not found"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_generation_budget_that_fills_the_context_is_refused_before_the_model_loads(tmp_path):
    model = _tiny(tmp_path / "m", seed=0)
    result = CliRunner().invoke(main, ["eval", str(model), "--backend", "hf", "--tasks", "gsm8k", "--quiet",
                                       "--output", str(tmp_path / "out"), "--data", f"gsm8k={FIXTURES / 'gsm8k.jsonl'}"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "max_gen_toks" in line or "--max-gen-toks" in line, line
    assert "it/s" not in line and not (tmp_path / "out").exists()
