"""The embedded demo: its pieces, and a reduced run end to end through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from featcal_llm.demo.config import FULL, QUICK
from featcal_llm.demo.report import gap_recovery, table
from featcal_llm.demo.run import CALIBRATED_ROW, MERGED_ROW, recipe_text
from featcal_llm.demo.tasks import TASKS, make_splits

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(TASKS))
def test_splits_are_disjoint_deterministic_and_answers_are_right(name):
    sizes = {"train": 300, "cal": 40, "dev": 40, "test": 40}
    splits = make_splits(TASKS[name], sizes, seed=3)
    assert splits == make_splits(TASKS[name], sizes, seed=3)
    prompts = [set(r["prompt"] for r in records) for records in splits.values()]
    assert sum(map(len, prompts)) == sum(sizes.values())  # unique within and across splits
    for record in splits["test"]:
        assert record["text"] == record["prompt"] + record["answer"]
        body = record["prompt"][:-1]
        if name == "arithmetic":
            a, b = body.split("+")
            assert int(record["answer"]) == int(a) + int(b)
        elif name == "reverse":
            assert record["answer"] == body.removeprefix("rev:")[::-1]
        else:
            shown = body.removeprefix("pat:")
            assert (shown + record["answer"])[len(shown):] == record["answer"]


def test_exact_match_scores_a_model_that_knows_the_answer():
    import torch

    from featcal_llm.demo.score import exact_match
    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    records = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "5"}, {"prompt": "10+0=", "answer": "2"}]

    class AlwaysTwo(torch.nn.Module):  # generate() stand-in: appends "2</s>" to every prompt
        def generate(self, input_ids, max_new_tokens, **_):
            tail = torch.tensor(tokenizer.convert_tokens_to_ids(["2", "</s>"]))
            return torch.cat([input_ids, tail.expand(len(input_ids), 2)], dim=1)

    assert exact_match(AlwaysTwo(), tokenizer, records) == pytest.approx(200 / 3)


def test_gap_recovery_and_table():
    tasks = ["a", "b"]
    scores = {
        "base": {"a": 0.0, "b": 0.0},
        "expert:a": {"a": 100.0, "b": 0.0},
        "expert:b": {"a": 0.0, "b": 90.0},
        MERGED_ROW: {"a": 40.0, "b": 50.0},
        CALIBRATED_ROW: {"a": 70.0, "b": 49.0},
    }
    recovery = gap_recovery(scores, tasks, MERGED_ROW, CALIBRATED_ROW)
    assert recovery["mean_gap"] == pytest.approx(50.0)
    assert recovery["recovered"] == pytest.approx(14.5 / 50.0)
    assert recovery["worst_drop"] == pytest.approx(-1.0)
    text = table(scores, tasks)
    assert all(row in text for row in scores) and "average" in text.splitlines()[0]


def test_shipped_recipes_are_the_ones_the_demo_writes_and_their_titles_tell_them_apart():
    from dataclasses import replace

    fixed, auto = (REPO / "featcal_llm" / "recipes" / "demo.yaml").read_text(), (REPO / "featcal_llm" / "recipes" / "demo-auto.yaml").read_text()
    assert fixed == recipe_text(FULL) and auto == recipe_text(replace(FULL, auto=True))
    assert fixed.splitlines()[0] != auto.splitlines()[0]  # `featcal-llm recipes` lists each by its first line


def test_the_cached_calibration_is_redone_when_the_weight_code_changes(monkeypatch):
    """A default changed in the code leaves the recipe's text as it was: the cache key must still change."""
    import featcal_llm.demo.run as demo_run

    experts, recipe = {"a": "1"}, recipe_text(QUICK)
    key = demo_run.calibration_key(experts, recipe)
    assert demo_run.calibration_key(experts, recipe) == key
    monkeypatch.setattr(demo_run, "source_digest", lambda: "other weight code")
    assert demo_run.calibration_key(experts, recipe) != key


def test_quick_demo_end_to_end(tmp_path):
    """Also: the demo needs none of the test extras (it runs with them hidden)."""
    workdir = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "tests" / "without_test_extras.py"), "demo", "--quick", "--workdir", str(workdir)]
    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr

    for name in ("recipe.yaml", "results.json", "results.png", "results.md", "featcal/config.json",
                 "merged/config.json", "base/tokenizer_config.json", "data/arithmetic/cal.jsonl"):
        assert (workdir / name).exists(), name
    rows = ["base", *(f"expert:{t}" for t in QUICK.tasks), MERGED_ROW, CALIBRATED_ROW]
    table_lines = [line for line in first.stdout.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table_lines[1:]] == rows
    results = json.loads((workdir / "results.json").read_text())
    assert list(results["test"]) == rows and set(results["test"]["base"]) == set(QUICK.tasks)
    assert "recovered" in results["gap_recovery_test"]
    for task in QUICK.tasks:  # no target in the quick scenario: the cap, with a dev check every 6 steps and at the cap
        record = results["experts_training"][task]
        assert record["steps"] == 12 and [step for step, _ in record["checks"]] == [6, 12] and record["reached"]
        # the last check in training is the saved expert's dev score, re-measured from disk by the scoring stage
        assert record["dev_accuracy"] == record["checks"][-1][1] == results["dev"][f"expert:{task}"][task]
    splits = {s: {json.loads(line)["prompt"] for line in (workdir / f"data/reverse/{s}.jsonl").open()}
              for s in ("train", "cal", "dev", "test")}
    assert not (splits["cal"] & splits["dev"]) and not (splits["dev"] & splits["test"])
    assert not (splits["cal"] & splits["test"]) and not (splits["train"] & splits["test"])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(workdir / "featcal")
    tokenizer = AutoTokenizer.from_pretrained(workdir / "featcal")
    ids = tokenizer("12+35=", return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)

    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "merge + FeatCal: cached" in second.stdout and "base: cached" in second.stdout
    assert table_lines == [line for line in second.stdout.splitlines() if line.startswith("| ")]

    # --auto calibrates the same models with the search's recipe: its row says so, as the RegMean baselines' `auto` rows do
    auto = subprocess.run(command + ["--auto", "--no-baselines"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert auto.returncode == 0, auto.stdout + auto.stderr
    auto_rows = [line.split("|")[1].strip() for line in auto.stdout.splitlines() if line.startswith("| ")][1:]
    assert auto_rows == [*rows[:-1], "merged + FeatCal, `auto`"]
    assert list(json.loads((workdir / "results.json").read_text())["test"]) == auto_rows


def _tiny_model_and_records():
    from featcal_llm.tiny import build_char_tokenizer, new_tiny_llama, tiny_llama_config

    tokenizer = build_char_tokenizer()
    model = new_tiny_llama(tiny_llama_config(len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1), 0)
    records = make_splits(TASKS["reverse"], {"train": 40, "cal": 1, "dev": 1, "test": 1}, seed=0)["train"]
    return model, tokenizer, records


def _finetune(scores: list[float], target: float | None, steps: int, every: int = 4, on_check=None):
    from featcal_llm.demo.train import finetune

    model, tokenizer, records = _tiny_model_and_records()
    pending = iter(scores)

    def skill() -> float:
        if on_check is not None:
            on_check(model)
        return next(pending)

    result = finetune(model, tokenizer, records, steps=steps, batch_size=4, lr=1e-3, seed=0,
                      skill=skill, target=target, check_every=every)
    return model, result


def test_finetune_stops_at_the_first_dev_check_that_reaches_the_target():
    model, result = _finetune([10.0, 60.0, 99.0], target=50.0, steps=12)
    assert (result.steps, result.checks, result.accuracy, result.reached) == (8, [(4, 10.0), (8, 60.0)], 60.0, True)
    assert not model.training


def test_finetune_checks_at_the_cap_and_reports_a_missed_target():
    _, result = _finetune([10.0, 20.0, 30.0, 40.0], target=95.0, steps=10)
    assert (result.steps, result.checks, result.reached) == (10, [(4, 10.0), (8, 20.0), (10, 30.0)], False)
    _, untargeted = _finetune([1.0, 2.0, 3.0], target=None, steps=10)
    assert untargeted.steps == 10 and untargeted.reached and untargeted.accuracy == 3.0


def test_an_early_stop_leaves_the_weights_of_that_step_of_an_unchecked_run():
    """Dev checks do not perturb training and the schedule spans the cap: a run stopped at step 8 of 12 has
    exactly the weights that a run without any check had at its step 8."""
    import torch

    from featcal_llm.demo.train import finetune

    stopped, _ = _finetune([0.0, 100.0], target=50.0, steps=12)
    model, tokenizer, records = _tiny_model_and_records()
    seen = {}
    finetune(model, tokenizer, records, steps=12, batch_size=4, lr=1e-3, seed=0, every=4,
             progress=lambda step, _, __: seen.setdefault(step, {k: v.clone() for k, v in model.state_dict().items()}))
    assert all(torch.equal(value, seen[8][name]) for name, value in stopped.state_dict().items())
    assert not all(torch.equal(value, seen[12][name]) for name, value in stopped.state_dict().items())


def test_quick_demo_refuses_to_report_when_an_expert_misses_its_target(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "results.json").write_text("{}")  # a stale result from an earlier run must not survive
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "featcal_llm", "demo", "--quick", "--workdir", str(workdir), "--expert-target", "100"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featcal-llm: error: experts/arithmetic: dev exact match "), lines
    assert "after 12 steps" in lines[0] and "expected at least 100%" in lines[0]
    assert all(f"experts/{task}" in lines[0] for task in QUICK.tasks)
    assert not any(line.startswith("| ") for line in result.stdout.splitlines())  # no table
    for name in ("results.json", "results.md", "results.png", "merged", "featcal", "experts/arithmetic"):
        assert not (workdir / name).exists(), name
    assert (workdir / "base" / "config.json").exists()  # what did succeed stays cached


def test_drift_legends_and_labels_use_short_expert_names(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import matplotlib.figure
    import torch

    from featcal_llm.engine.drift import Probe, drift_report, short_names, write_report

    names = ["/srv/runs/2026/experts/arithmetic", "/srv/runs/a/code", "/srv/runs/b/code", "math"]
    assert short_names(names) == {names[0]: "arithmetic", names[1]: "a/code", names[2]: "b/code", "math": "math"}
    assert short_names(["/x/math", "math"]) == {"/x/math": "x/math", "math": "math"}

    batch = SimpleNamespace(keep=torch.ones(2, 3, dtype=torch.bool), tokens=6)
    probe = Probe({name: [batch] for name in names}, "calibration subsample")
    records = [{"drift": {kind: {name: 0.1 * (i + 1) for i, name in enumerate(names)} for kind in ("merged", "calibrated")}}]
    report = drift_report(probe, records)
    assert report["experts"] == names and report["expert_labels"] == short_names(names)
    legends = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda figure, *a, **k: legends.append([t.get_text() for t in figure.axes[0].get_legend().get_texts()]))
    write_report(tmp_path, report)
    assert legends == [[f"{label}: {kind}" for label in ("arithmetic", "a/code", "b/code", "math")
                        for kind in ("merged", "calibrated")]]
    assert json.loads((tmp_path / "featcal_drift.json").read_text())["layers"][0]["merged"][names[1]] == 0.2
