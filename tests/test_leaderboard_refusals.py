"""The leaderboard and compare commands on the summaries an evaluation left: a bad score, a null entry, a label given
twice, a missing samples file, an output that cannot be a folder: one line each and no partial file; the chart leaves
out normalized rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featcal_llm.evaluation import runner
from test_eval_cache import _fake_model, _one_line_refusal, _section


@pytest.mark.parametrize("name", ["", "../../escape", "sub/board", ".hidden"])
def test_the_leaderboards_name_is_a_file_stem(tmp_path, name):
    """`--name ../../escape` had written outside the results folder, `--name ''` a file named `.md`."""
    from click.testing import CliRunner

    from featcal_llm.cli import main

    (tmp_path / "out").mkdir()
    result = CliRunner().invoke(main, ["leaderboard", str(tmp_path / "out"), "--name", name])
    assert result.exit_code == 2 and result.stderr.strip() == (
        f"featcal-llm: error: --name {name!r}: expected a file stem of letters, digits, '.', '_' or '-' (no path)")
    assert list((tmp_path / "out").iterdir()) == [] and not (tmp_path.parent / "escape.md").exists()


def _scored(tmp_path, fake_worker, labels=("a", "b")) -> Path:
    """A results folder with a summary per label (fake worker: no model runs)."""
    for number, label in enumerate(labels):
        model = _fake_model(tmp_path / "models" / label, f"w{number}".encode())
        runner.evaluate_model(model, label, _section(tmp_path, ["gsm8k"]), echo=lambda line: None)
    return tmp_path / "out"


def _board(*arguments):
    from click.testing import CliRunner

    from featcal_llm.cli import main

    return CliRunner().invoke(main, ["leaderboard", *map(str, arguments)])


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_summary_with_a_non_numeric_score_is_refused_in_one_line(tmp_path, fake_worker):
    out = _scored(tmp_path, fake_worker)
    _edit(out / "b.json", lambda data: data["tasks"]["gsm8k"].update(score="high"))
    _one_line_refusal(_board(out), "b.json")
    assert not (out / "leaderboard.md").exists()


def test_a_summary_with_a_null_task_entry_is_refused_in_one_line(tmp_path, fake_worker):
    out = _scored(tmp_path, fake_worker)
    _edit(out / "b.json", lambda data: data["tasks"].update(gsm8k=None))
    _one_line_refusal(_board(out), "b.json")


def test_compare_on_a_summary_without_samples_is_refused_in_one_line(tmp_path, fake_worker):
    out = _scored(tmp_path, fake_worker)
    _edit(out / "b.json", lambda data: data["tasks"]["gsm8k"].pop("samples"))
    _one_line_refusal(_board(out, "--compare", "a:b"), "b.json")


def test_two_summaries_with_one_label_in_one_folder_are_told_apart(tmp_path, fake_worker):
    out = _scored(tmp_path, fake_worker)
    _edit(out / "b.json", lambda data: data.update(label="a"))
    result = _board(out)
    if result.exit_code == 2:  # refused in one line is right too
        _one_line_refusal(result, "a")
        return
    assert result.exit_code == 0, result.output
    names = [line.split("|")[1].strip() for line in (out / "leaderboard.md").read_text().splitlines()[2:4]]
    assert len(set(names)) == 2, names


def test_a_leaderboard_output_that_cannot_be_a_folder_is_refused_in_one_line(tmp_path, fake_worker):
    out = _scored(tmp_path, fake_worker)
    (tmp_path / "afile").write_text("")
    _one_line_refusal(_board(out, "--output", tmp_path / "afile" / "sub"), "--output")


def test_a_leaderboard_that_fails_leaves_no_partial_files(tmp_path, fake_worker):
    out = _scored(tmp_path, fake_worker)
    (out / "board.png").mkdir()
    result = _board(out, "--name", "board")
    assert result.exit_code in (1, 2) and len(result.stderr.strip().splitlines()) == 1, result.output
    assert not (out / "board.md").exists() and not (out / "board.csv").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), True])
def test_a_summary_with_a_nan_infinite_or_boolean_score_is_refused_in_one_line(tmp_path, fake_worker, value):
    """json reads NaN and Infinity as floats and true as a bool (an int): none is a score a table can print."""
    out = _scored(tmp_path, fake_worker)
    _edit(out / "b.json", lambda data: data["tasks"]["gsm8k"].update(stderr=value))
    _one_line_refusal(_board(out), "b.json", "tasks.gsm8k.stderr")
    assert not (out / "leaderboard.md").exists()


def test_two_summaries_with_one_label_in_one_folder_are_named_by_their_files(tmp_path, fake_worker):
    out = _scored(tmp_path, fake_worker)
    _edit(out / "b.json", lambda data: data.update(label="a"))
    result = _board(out)
    assert result.exit_code == 0, result.output
    names = sorted(line.split("|")[1].strip() for line in (out / "leaderboard.md").read_text().splitlines()[2:4])
    assert names == ["a (out/a.json)", "a (out/b.json)"]  # the folder's name and the files', not their paths


def test_a_comparison_whose_samples_file_is_gone_leaves_its_cell_empty(tmp_path, fake_worker):
    out = _scored(tmp_path, fake_worker)
    summary = json.loads((out / "b.json").read_text())
    (out / summary["tasks"]["gsm8k"]["samples"]).unlink()
    result = _board(out, "--compare", "a:b")
    assert result.exit_code == 0, result.output
    row = next(line for line in (out / "leaderboard.md").read_text().splitlines() if line.startswith("| Δ b − a"))
    assert row.split("|")[2].strip() == "–"


def test_the_chart_leaves_out_the_normalized_rows(tmp_path, fake_worker, monkeypatch):
    """÷ expert rows are percentages of another model's score, not scores: the table has them, the chart does not."""
    from featcal_llm.evaluation import leaderboard

    out = _scored(tmp_path, fake_worker)
    charted = []
    real = leaderboard.write_png
    monkeypatch.setattr(leaderboard, "write_png", lambda rows, suite, path: (charted.extend(r.name for r in rows),
                                                                            real(rows, suite, path)))
    markdown, _ = leaderboard.build_leaderboard([out], out, experts={"gsm8k": "b"})
    assert "| a ÷ expert |" in markdown and charted == ["a", "b"]


def test_a_model_label_given_twice_is_refused(tmp_path, monkeypatch):
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.cli import _models

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FeatCalError, match=r"^a/merged: label 'merged' is used twice"):
        _models(("merged=b/x", "a/merged"))
