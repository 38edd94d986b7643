"""Every number of the README's results table comes from a committed results file (issue 46)."""

from __future__ import annotations

import json

from studies.readme_numbers import README, RESULTS, ROWS, readme_block, render


def test_the_readme_table_is_rendered_from_the_results_files():
    assert readme_block(README.read_text(encoding="utf-8")) == render()


def test_each_row_names_a_row_of_its_results_file():
    for file, key, _label in ROWS:
        results = json.loads((RESULTS / file).read_text(encoding="utf-8"))
        assert key in results["rows"], (file, key)
        row = results["rows"][key]
        assert set(row["nll"]) == set(results["setting"]["experts"])
        assert abs(row["nll_avg"] - sum(row["nll"].values()) / len(row["nll"])) < 1e-3


def test_a_changed_result_fails_the_comparison(tmp_path):
    """The check can fail: one number moved in a copy of the results gives another table."""
    for file in {file for file, _, _ in ROWS}:
        (tmp_path / file).write_text((RESULTS / file).read_text(encoding="utf-8"), encoding="utf-8")
    file, key, _ = ROWS[-1]
    results = json.loads((tmp_path / file).read_text(encoding="utf-8"))
    results["rows"][key]["nll_avg"] += 0.01
    (tmp_path / file).write_text(json.dumps(results), encoding="utf-8")
    assert render(tmp_path) != readme_block(README.read_text(encoding="utf-8"))
