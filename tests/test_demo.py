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


def test_shipped_recipe_is_the_one_the_demo_writes():
    assert (REPO / "recipes" / "demo.yaml").read_text() == recipe_text(FULL)


def test_quick_demo_end_to_end(tmp_path):
    workdir = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "featcal_llm", "demo", "--quick", "--workdir", str(workdir)]
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
    splits = {s: {json.loads(line)["prompt"] for line in (workdir / f"data/reverse/{s}.jsonl").open()}
              for s in ("train", "cal", "dev", "test")}
    assert not (splits["cal"] & splits["dev"]) and not (splits["dev"] & splits["test"])
    assert not (splits["cal"] & splits["test"]) and not (splits["train"] & splits["test"])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(workdir / "featcal")
    tokenizer = AutoTokenizer.from_pretrained(workdir / "featcal")
    ids = tokenizer("12+35=", return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)

    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "merge + FeatCal: cached" in second.stdout and "base: cached" in second.stdout
    assert table_lines == [line for line in second.stdout.splitlines() if line.startswith("| ")]
