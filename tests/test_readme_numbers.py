"""Every number of the README's results table, of docs/results.md's other settings and of docs/costs.md's memory plan
comes from a committed results file or from validate's own plan."""

from __future__ import annotations

import json
import shutil

import pytest

from studies import readme_numbers
from studies.readme_numbers import (EXPERTS, OTHER_SETTINGS, README, RESULTS, TABLE_FILE, TABLE_ROWS, TARGETS, readme_block,
                                    render_costs, render_others, render_table)


@pytest.mark.parametrize("page", list(TARGETS), ids=lambda p: p.name)
def test_each_page_block_is_rendered_from_its_source(page):
    assert readme_block(page.read_text(encoding="utf-8"), page) == TARGETS[page]()


def test_each_table_row_names_a_row_of_its_results_file():
    results = json.loads((RESULTS / TABLE_FILE).read_text(encoding="utf-8"))
    shown = [key for key, _ in TABLE_ROWS if key in results["rows"]]
    assert {"merged", "featcal defaults"} <= set(shown)
    for key in shown:
        row = results["rows"][key]
        assert set(row["nll"]) == set(results["setting"]["experts"])
        assert abs(row["nll_avg"] - sum(row["nll"].values()) / len(row["nll"])) < 1e-3


def _copy(tmp_path):
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


@pytest.mark.parametrize("file, key, field, renderer", [(TABLE_FILE, "featcal defaults", "nll_avg", render_table),
                                                        (OTHER_SETTINGS[0][0], "featcal defaults", "share", render_others),
                                                        (OTHER_SETTINGS[0][0], OTHER_SETTINGS[0][2], "share", render_others)])
def test_a_changed_result_fails_the_comparison(tmp_path, file, key, field, renderer):
    """The check can fail: one number moved in a copy of the results gives another block."""
    page = next(p for p, r in TARGETS.items() if r is renderer)
    before = readme_block(page.read_text(encoding="utf-8"), page)
    assert renderer(_copy(tmp_path)) == before
    results = json.loads((tmp_path / file).read_text(encoding="utf-8"))
    results["rows"][key][field] += 0.01
    (tmp_path / file).write_text(json.dumps(results), encoding="utf-8")
    assert renderer(tmp_path) != before


def test_the_table_reads_in_words():
    """Lower is better; a share above 1 is said to beat the experts; no negative share is printed; the expert row is
    the merge's NLL minus each expert's gap, computed here from the file."""
    block = readme_block(README.read_text(encoding="utf-8"))
    results = json.loads((RESULTS / TABLE_FILE).read_text(encoding="utf-8"))
    assert "lower is better" in block
    shares = [row["share"] for key, row in results["rows"].items() if key in dict(TABLE_ROWS) and row.get("share") is not None]
    if max(shares) > 1:
        assert "above 1 is better than the experts" in block
    rows = [line for line in block.splitlines() if line.startswith("|") and not line.startswith("|---")]
    assert not any(cell.strip().startswith(("-", "−")) for line in rows for cell in line.split("|")[2:])
    merged, gap = results["rows"]["merged"]["nll"], results["setting"]["gap"]
    expert_line = next(line for line in block.splitlines() if line.startswith(f"| {dict(TABLE_ROWS)[EXPERTS]} |"))
    assert expert_line.split("|")[3:6] == [f" {merged[d] - gap[d]:.3f} " for d in results["setting"]["experts"]]


def test_intervals_are_shown_where_a_row_carries_them(tmp_path):
    """The study engineer's contract: `share_ci95` and `nll_ci95` in a row render as `value (lo–hi)`."""
    _copy(tmp_path)
    file = "allgap-half.json"  # a file without intervals of its own
    results = json.loads((tmp_path / file).read_text(encoding="utf-8"))
    row = results["rows"]["featcal defaults"]
    row["share_ci95"] = [1.234, 1.5678]
    row["nll_ci95"] = {"avg": [2.2501, 2.26549], "code": [2.4, 2.6]}
    results["setting"]["ci_method"] = "bootstrap over test records"
    (tmp_path / file).write_text(json.dumps(results), encoding="utf-8")
    line = next(line for line in render_table(tmp_path, file).splitlines() if line.startswith("| + FeatCal, featcal-llm's defaults |"))
    cells = [cell.strip() for cell in line.split("|")[2:-1]]
    assert cells == [f"{row['nll_avg']:.3f} (2.250–2.265)", f"{row['nll']['code']:.3f}", f"{row['nll']['prose']:.3f}",
                     f"{row['nll']['c']:.3f}", f"{row['share']:.2f} (1.23–1.57)"]  # per-domain intervals stay in the file
    assert "95 % intervals of the average and of the share (bootstrap over test records)" in render_table(tmp_path, file)
    assert "no uncertainty was measured" in render_table(RESULTS, file)


def test_one_constant_switches_the_table(monkeypatch):
    """TABLE_FILE alone chooses the README's setting: rows the file lacks are left out, the rest follow it."""
    other = "allgap.json"
    assert other != TABLE_FILE
    monkeypatch.setattr(readme_numbers, "TABLE_FILE", other)
    block = readme_numbers.render_table()
    results = json.loads((RESULTS / other).read_text(encoding="utf-8"))
    assert f"Setting `{results['setting']['name']}`" in block and f"docs/studies/results/{other})" in block
    defaults = next(line for line in block.splitlines() if line.startswith("| + FeatCal, featcal-llm's defaults |"))
    assert defaults.split("|")[-2].strip() == f"{results['rows']['featcal defaults']['share']:.2f}"
    assert block != readme_block(README.read_text(encoding="utf-8"))  # the committed file's table


def test_the_costs_page_is_validates_plan():
    """docs/costs.md's estimates are what `featcal-llm validate` plans (estimate.memory_plan) for each model."""
    from featcal_llm.benchmark.estimate import memory_plan, size_text

    block = readme_numbers.plan_block()
    assert block.samples == 256 and block.max_length == 2048 and len(block.data) == 3
    for name, config in readme_numbers.PLAN_MODELS.items():
        plan = memory_plan(config, block, 3, merged_exists=False)
        line = next(line for line in render_costs().splitlines() if line.startswith(f"| {name} |"))
        assert [cell.strip() for cell in line.split("|")[3:5]] == [size_text(plan.gpu_bytes), size_text(plan.host_bytes)]
        assert line.split("|")[5].strip().startswith(size_text(plan.disk_bytes))
        assert line.split("|")[6].strip() == size_text(plan.inputs_bytes)


def test_a_new_setting_renders_from_its_file_alone(tmp_path, monkeypatch):
    """A results file of another shape of setting (other kinds of text, a refinement row, intervals, no gap recorded)
    renders with only TABLE_FILE changed: its rows in TABLE_ROWS order, its kinds as columns, its intervals."""
    kinds = ["news", "law", "recipes"]
    row = lambda avg, share, ci=None: {"nll": dict(zip(kinds, [avg - 0.1, avg, avg + 0.1])), "nll_avg": avg, "share": share,  # noqa: E731
                                       **({"share_ci95": ci} if ci else {})}
    results = {"setting": {"name": "made-up", "model": "SmolLM2-135M-Instruct (full fine-tunes)", "experts": kinds,
                           "ta_weight": 0.5},
               "rows": {"featcal defaults + refine": row(2.1, 0.81, [0.7, 0.9]), "merged": row(2.5, 0.0),
                        "featcal defaults": row(2.3, 0.56, [0.5, 0.62]), "unlisted row": row(9.9, 9.9)}}
    (tmp_path / "made-up-setting.json").write_text(json.dumps(results), encoding="utf-8")
    monkeypatch.setattr(readme_numbers, "TABLE_FILE", "made-up-setting.json")
    block = readme_numbers.render_table(tmp_path)
    table = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    labels = dict(TABLE_ROWS)
    assert [line.split("|")[1].strip() for line in table] == [labels["merged"], labels["featcal defaults"], labels["featcal defaults + refine"]]
    assert block.splitlines()[2] == "| model | average NLL | news NLL | law NLL | recipes NLL | share of the gap |"
    assert table[-1].split("|")[-2].strip() == "0.81 (0.70–0.90)" and "9.9" not in block
    assert "three experts fine-tuned from it on news (`news`), law (`law`), recipes (`recipes`)" in block
    assert f"[study]({readme_numbers.absolute('docs/results.md')})" in block  # no study page of that name


def test_the_specialised_files_shape_renders(tmp_path, monkeypatch):
    """The shape studies/specialised_report.py writes: experts as `expert:<kind>` rows (the best by average NLL becomes
    the single-expert row), the merge's degenerate 0–0 interval left out, the bootstrap named from `setting.bootstrap`."""
    kinds = ["manpage", "changelog", "copyright"]
    def row(nll, share, share_ci=None, nll_ci=None):  # noqa: E306
        return {"nll": dict(zip(kinds, nll)), "nll_avg": sum(nll) / 3, "share": share,
                **({"share_ci95": share_ci} if share_ci else {}), **({"nll_ci95": nll_ci} if nll_ci else {})}
    results = {"setting": {"name": "specialised", "model": "SmolLM2-135M-Instruct (GGUF)", "experts": kinds, "ta_weight": 0.5,
                           "gap": {"manpage": 0.3, "changelog": 0.2, "copyright": 0.1},
                           "bootstrap": {"resamples": 1000, "level": 0.95, "over": "test records, per domain, paired across models"}},
               "rows": {"merged": row([2.0, 3.0, 1.0], 0.0, [0.0, 0.0]),
                        "featcal defaults": row([1.8, 2.9, 0.95], 0.58, [0.51, 0.66], {"avg": [1.85, 1.9]}),
                        "expert:manpage": row([1.7, 3.5, 1.6], -1.5), "expert:changelog": row([2.5, 2.8, 1.5], -0.9),
                        "expert:copyright": row([2.6, 3.6, 0.9], -2.0), "base": row([2.5, 3.5, 1.4], -2.2)}}
    (tmp_path / "made-up-specialised.json").write_text(json.dumps(results), encoding="utf-8")
    monkeypatch.setattr(readme_numbers, "TABLE_FILE", "made-up-specialised.json")
    lines = readme_numbers.render_table(tmp_path).splitlines()
    labels = dict(TABLE_ROWS)
    assert [line.split("|")[1].strip() for line in lines if line.startswith("| ") and not line.startswith("| model")] == [
        labels["merged"], labels[EXPERTS], labels["best single expert"] + " (changelog)", labels["featcal defaults"]]
    merged = next(line for line in lines if line.startswith(f"| {labels['merged']} |"))
    assert merged.split("|")[-2].strip() == "0.00"  # not "0.00 (0.00–0.00)"
    experts = next(line for line in lines if line.startswith(f"| {labels[EXPERTS]} |"))
    assert [cell.strip() for cell in experts.split("|")[3:6]] == ["1.700", "2.800", "0.900"]  # merged − gap
    defaults = next(line for line in lines if line.startswith(f"| {labels['featcal defaults']} |"))
    assert defaults.split("|")[-2].strip() == "0.58 (0.51–0.66)" and defaults.split("|")[2].strip() == "1.883 (1.850–1.900)"
    assert "95 % intervals of the average and of the share (bootstrap over test records, per domain, paired across models)." in lines[-1]


def test_a_recipe_under_two_row_names_shows_once_as_the_first(tmp_path, monkeypatch):
    """`refine: true` ran as "featcal defaults + refine" on one build and as "..., held-out drawn by position" on the
    rebuilt one: the table shows one row of that label, the first TABLE_ROWS key the file has."""
    kinds = ["news", "law", "recipes"]
    row = lambda share: {"nll": dict(zip(kinds, [2.0, 2.1, 2.2])), "nll_avg": 2.1, "share": share}  # noqa: E731
    rows = {"merged": row(0.0), "featcal defaults": row(0.5), "featcal defaults + refine, held-out drawn by position": row(0.77)}
    results = {"setting": {"name": "made-up", "experts": kinds, "ta_weight": 0.5}, "rows": rows}
    monkeypatch.setattr(readme_numbers, "TABLE_FILE", "made-up-setting.json")
    label = dict(TABLE_ROWS)["featcal defaults + refine"]
    shares = []
    for extra in ({}, {"featcal defaults + refine": row(0.66)}):
        (tmp_path / "made-up-setting.json").write_text(json.dumps({**results, "rows": {**rows, **extra}}), encoding="utf-8")
        lines = [line for line in readme_numbers.render_table(tmp_path).splitlines() if line.startswith(f"| {label} |")]
        assert len(lines) == 1
        shares.append(lines[0].split("|")[-2].strip())
    assert shares == ["0.77", "0.66"]
