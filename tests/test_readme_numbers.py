"""Every number of the README's results table comes from a committed results file."""

from __future__ import annotations

import json

import pytest

from studies.readme_numbers import OTHER_SETTINGS, README, RESULTS, ROWS, readme_block, render


def test_the_readme_table_is_rendered_from_the_results_files():
    assert readme_block(README.read_text(encoding="utf-8")) == render()


def test_each_row_names_a_row_of_its_results_file():
    for file, key, _label in ROWS:
        results = json.loads((RESULTS / file).read_text(encoding="utf-8"))
        assert key in results["rows"], (file, key)
        row = results["rows"][key]
        assert set(row["nll"]) == set(results["setting"]["experts"])
        assert abs(row["nll_avg"] - sum(row["nll"].values()) / len(row["nll"])) < 1e-3


@pytest.mark.parametrize("file, key, field", [(ROWS[-1][0], ROWS[-1][1], "nll_avg"), (OTHER_SETTINGS[0][0], "featcal defaults", "share"),
                                             (OTHER_SETTINGS[0][0], OTHER_SETTINGS[0][2], "share")])
def test_a_changed_result_fails_the_comparison(tmp_path, file, key, field):
    """The check can fail: one number moved in a copy of the results gives another block (table, or other settings' line)."""
    for name in {f for f, _, _ in ROWS} | {f for f, *_ in OTHER_SETTINGS}:
        (tmp_path / name).write_text((RESULTS / name).read_text(encoding="utf-8"), encoding="utf-8")
    assert render(tmp_path) == readme_block(README.read_text(encoding="utf-8"))
    results = json.loads((tmp_path / file).read_text(encoding="utf-8"))
    results["rows"][key][field] += 0.01
    (tmp_path / file).write_text(json.dumps(results), encoding="utf-8")
    assert render(tmp_path) != readme_block(README.read_text(encoding="utf-8"))
