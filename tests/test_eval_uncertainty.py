"""Standard errors and paired comparisons from per-item records, checked against a direct
computation; and how they reach the markdown, CSV and PNG leaderboards."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from featcal_llm.evaluation import uncertainty
from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation.leaderboard import build_leaderboard, comparison_row, fmt, reference_rows
from featcal_llm.evaluation.suite import load_suite

SUITE = load_suite("mergebench")
RNG = np.random.default_rng(42)
# two tasks, 40 and 25 items; the "calibrated" model flips some items of the "merged" one
MERGED = {"gsm8k": np.tile([1.0, 0.0], 20), "ifeval": RNG.integers(0, 2, 25).astype(float)}
CALIBRATED = {task: values.copy() for task, values in MERGED.items()}
CALIBRATED["gsm8k"][[1, 3, 5, 7, 9, 11, 13, 15]] = 1.0  # 8 items gained
CALIBRATED["gsm8k"][[0]] = 0.0  # 1 lost: McNemar p = 2 (C(9,0) + C(9,1)) / 2^9
CALIBRATED["ifeval"][[4, 8]] = 1 - CALIBRATED["ifeval"][[4, 8]]


def _summary(tmp_path, label, values, full=False):
    tasks = {}
    for task in (SUITE.tasks if full else values):
        items = values.get(task, np.zeros(5))
        metric = SUITE.tasks[task].metric
        name, filter_name = metric.split(",")
        path = tmp_path / f"{label}-{task}.jsonl"
        with path.open("w") as handle:
            for doc_id, value in enumerate(items):
                handle.write(json.dumps({"doc_id": doc_id, "filter": filter_name, name: value}) + "\n")
                handle.write(json.dumps({"doc_id": doc_id, "filter": "other", name: 1 - value}) + "\n")
        tasks[task] = {"label": SUITE.tasks[task].label, "metric": metric, "value": items.mean(), "score": 100 * items.mean(),
                       "stderr": 100 * uncertainty.stderr(items), "samples": path.name, "result": path.name}
    complete = set(tasks) == set(SUITE.tasks)
    return {"schema": "featcal-llm/eval-summary/1", "label": label, "_dir": str(tmp_path),
            "model": {"path": f"/m/{label}", "fingerprint": label}, "suite": {"name": SUITE.name, "version": SUITE.version,
                                                                                 "path": str(SUITE.path)},
            "backend": {"name": "hf"}, "chat_template": {"applied": False}, "tasks": tasks, "complete": complete,
            "average": sum(t["score"] for t in tasks.values()) / len(tasks) if complete else None}


def _direct_bootstrap(pairs, iterations=10_000, seed=0):
    """The textbook loop: per iteration, resample each task's items with replacement."""
    rng = np.random.default_rng(seed)
    per_task = []
    for base, other in pairs:
        diffs = other - base
        per_task.append(np.array([diffs[rng.integers(0, diffs.size, diffs.size)].mean() for _ in range(iterations)]))
    deltas = np.mean(per_task, axis=0)
    return np.quantile(deltas, [0.025, 0.975]), deltas


def test_paired_bootstrap_and_mcnemar_match_a_direct_computation(tmp_path):
    merged, calibrated = _summary(tmp_path, "merged", MERGED), _summary(tmp_path, "calibrated", CALIBRATED)
    row = comparison_row(merged, calibrated, SUITE)
    gsm = row.intervals["gsm8k"]
    (low, high), deltas = _direct_bootstrap([(MERGED["gsm8k"], CALIBRATED["gsm8k"])])
    np.testing.assert_allclose(uncertainty.bootstrap_deltas([(MERGED["gsm8k"], CALIBRATED["gsm8k"])]), deltas)
    assert gsm.delta == pytest.approx(100 * (CALIBRATED["gsm8k"] - MERGED["gsm8k"]).mean())
    assert (gsm.low, gsm.high) == pytest.approx((100 * low, 100 * high), abs=1e-9)
    assert gsm.low < gsm.delta < gsm.high
    gained = int(((MERGED["gsm8k"] == 0) & (CALIBRATED["gsm8k"] == 1)).sum())
    lost = int(((MERGED["gsm8k"] == 1) & (CALIBRATED["gsm8k"] == 0)).sum())
    n = gained + lost
    p = min(1.0, 2 * sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2**n)
    assert gsm.p_mcnemar == pytest.approx(p) and p == pytest.approx(2 * (1 + 9) / 2**9)
    assert row.scores["math500"] is None and row.average is None  # no records, no interval


def test_average_interval_resamples_every_task(tmp_path):
    merged = _summary(tmp_path, "merged", MERGED, full=True)
    calibrated = _summary(tmp_path, "calibrated", CALIBRATED, full=True)
    row = comparison_row(merged, calibrated, SUITE)
    pairs = [(MERGED.get(t, np.zeros(5)), CALIBRATED.get(t, np.zeros(5))) for t in SUITE.tasks]
    (low, high), _ = _direct_bootstrap(pairs)
    assert (row.intervals["average"].low, row.intervals["average"].high) == pytest.approx((100 * low, 100 * high), abs=1e-9)
    assert row.average == pytest.approx(np.mean([100 * (o - b).mean() for b, o in pairs]))


def test_standard_error_and_degenerate_cases():
    values = MERGED["gsm8k"]
    assert uncertainty.stderr(values) == pytest.approx(np.std(values, ddof=1) / math.sqrt(values.size))
    assert uncertainty.stderr([1.0]) is None
    same = uncertainty.compare([(values, values)])
    assert (same.delta, same.low, same.high, same.p_mcnemar) == (0.0, 0.0, 0.0, 1.0)
    assert uncertainty.mcnemar_p(np.array([0.5, 1.0]), np.array([1.0, 1.0])) is None  # pass@1 over n samples


def test_leaderboard_shows_errors_and_intervals(tmp_path):
    for label, values in (("merged", MERGED), ("calibrated", CALIBRATED)):
        (tmp_path / f"{label}.json").write_text(json.dumps(_summary(tmp_path, label, values)))
    markdown, paths = build_leaderboard([tmp_path], tmp_path / "board", comparisons=[("merged", "calibrated")])
    row = comparison_row(_summary(tmp_path, "merged", MERGED), _summary(tmp_path, "calibrated", CALIBRATED), SUITE)
    gsm = row.intervals["gsm8k"]
    delta_line = next(line for line in markdown.splitlines() if line.startswith("| Δ calibrated − merged"))
    assert f"+{gsm.delta:.1f} [{gsm.low:+.1f}, {gsm.high:+.1f}]" in delta_line
    merged_line = next(line for line in markdown.splitlines() if line.startswith("| merged |"))
    stderr = 100 * uncertainty.stderr(MERGED["gsm8k"])
    assert f"{100 * MERGED['gsm8k'].mean():.1f} ±{stderr:.1f}" in merged_line
    assert "paired-bootstrap interval, 10,000 resamples" in markdown and "McNemar exact p: GSM8K" in markdown
    rows = list(csv.DictReader(paths["csv"].open()))
    delta = next(r for r in rows if r["model"].startswith("Δ"))
    assert float(delta["gsm8k_ci_low"]) == pytest.approx(gsm.low, abs=0.05)
    assert float(delta["gsm8k_p_mcnemar"]) == pytest.approx(gsm.p_mcnemar, rel=1e-3)
    assert float(next(r for r in rows if r["model"] == "merged")["gsm8k_stderr"]) == pytest.approx(stderr, abs=0.05)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_normalized_score_divides_by_the_expert(tmp_path):
    experts = {"gsm8k": "calibrated"}
    for label, values in (("merged", MERGED), ("calibrated", CALIBRATED)):
        (tmp_path / f"{label}.json").write_text(json.dumps(_summary(tmp_path, label, values)))
    markdown, _ = build_leaderboard([tmp_path], tmp_path / "board", experts=experts)
    expected = 100 * MERGED["gsm8k"].mean() / CALIBRATED["gsm8k"].mean()
    line = next(line for line in markdown.splitlines() if line.startswith("| merged ÷ expert"))
    assert f"| {expected:.1f} |" in line
    assert "MergeBench's normalized score" in markdown


@pytest.mark.parametrize("content, message", [
    ({"schema": 5}, "not an evaluation summary written by `featcal_llm eval`"),
    ({"schema": "featcal-llm/eval-summary/1", "label": "x"}, "an evaluation summary without model, suite, tasks, backend, chat_template"),
    ({"schema": "featcal-llm/eval-summary/1", "label": "x", "model": {}, "suite": {"name": "mergebench"}, "tasks": {},
      "backend": {}, "chat_template": {}}, "an evaluation summary without suite.name, suite.version"),
])
def test_a_summary_the_leaderboard_cannot_read_is_one_line(tmp_path, content, message):
    from click.testing import CliRunner

    from featcal_llm.cli import main

    (tmp_path / "s.json").write_text(json.dumps(content))
    result = CliRunner().invoke(main, ["leaderboard", str(tmp_path / "s.json")])
    assert result.exit_code == 2 and not isinstance(result.exception, (KeyError, AttributeError, TypeError)), result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("featcal-llm: error: ") and message in line, line


def test_one_summary_given_twice_is_one_row_and_a_label_two_folders_share_is_told_apart(tmp_path):
    for folder in ("3b", "8b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "merged.json").write_text(json.dumps(_summary(tmp_path / folder, "merged", MERGED)))
    markdown, _ = build_leaderboard([tmp_path / "3b", tmp_path / "3b" / "merged.json"], tmp_path / "board")
    assert [line for line in markdown.splitlines() if line.startswith("| merged")] != [] and markdown.count("| merged |") == 1
    markdown, _ = build_leaderboard([tmp_path / "3b", tmp_path / "8b"], tmp_path / "board",
                                    comparisons=[("merged (3b)", "merged (8b)")])  # short enough to type
    assert markdown.count("| merged (3b) |") == 1 and markdown.count("| merged (8b) |") == 1  # the folders' names, not paths
    with pytest.raises(FeatCalError, match=r"--compare merged:merged: no summary labelled merged"):
        build_leaderboard([tmp_path / "3b", tmp_path / "8b"], tmp_path / "board", comparisons=[("merged", "merged")])


def test_the_paper_s_rows_on_another_suite_are_refused():
    with pytest.raises(FeatCalError, match=r"--reference: the paper's rows are scored on suite mergebench, not mergebench-protocol"):
        reference_rows(["Llama-3.1-8B-Instruct"], load_suite("mergebench-protocol"))
    assert reference_rows([], load_suite("mergebench-protocol")) == []


def test_a_summary_of_another_suite_is_named_by_its_file(tmp_path):
    for folder, version in (("3b", SUITE.version), ("8b", "1")):
        (tmp_path / folder).mkdir()
        summary = _summary(tmp_path / folder, "merged", MERGED)
        summary["suite"]["version"] = version
        (tmp_path / folder / "merged.json").write_text(json.dumps(summary))
    with pytest.raises(FeatCalError, match=rf"^{tmp_path / '8b' / 'merged.json'}: scored with suite mergebench v1, not mergebench v"):
        build_leaderboard([tmp_path / "3b", tmp_path / "8b"], tmp_path / "board")


def test_an_items_samples_are_averaged(tmp_path):
    """n samples of one item (pass@1 over 10 samples) are its mean, whatever their order in the log."""
    samples = tmp_path / "samples.jsonl"
    rows = [{"doc_id": 0, "filter": "none", "acc": 0.0}, {"doc_id": 0, "filter": "none", "acc": 1.0},
            {"doc_id": 1, "filter": "none", "acc": 1.0}, {"doc_id": 1, "filter": "other", "acc": 0.0}]
    samples.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert uncertainty.per_item_scores(samples, "acc,none") == {0: 0.5, 1: 1.0}


# ------------------------------------------------------------------ mutation round 8: tests a surviving mutation showed missing

def test_table_numbers_round_half_up_from_their_decimal_text_and_carry_one_sign():
    """Hand-rounded: 62.25 -> 62.3 (half-even would print 62.2), 2.675 -> 2.68 (its binary float is 2.67499..., which
    f-strings print as 2.67); a signed cell is +x or -x, never +-x."""
    assert f"{62.25:.1f}" == "62.2" and f"{2.675:.2f}" == "2.67"  # what the float formatting would print
    assert (fmt(62.25, 1), fmt(2.675, 2), fmt(0.125, 2), fmt(-1.25, 1)) == ("62.3", "2.68", "0.13", "-1.3")
    assert (fmt(1.25, 1, signed=True), fmt(-1.25, 1, signed=True), fmt(0.0, 1, signed=True)) == ("+1.3", "-1.3", "+0.0")
    assert fmt(None, 1) == "–"


def test_a_normalized_average_with_a_task_the_model_lacks_is_no_number():
    """Hand-computed: the expert scores 80 and 50; a model's 40 and 25 are 50% and 50% of them (average 50); a model
    without the second task has no normalized average (not 50 / 2 = 25, nor 50 over the one task it has)."""
    from featcal_llm.evaluation.leaderboard import Row, normalized_rows
    from featcal_llm.evaluation.suite import load_suite

    suite = load_suite("mergebench")
    def row(name, gsm8k, ifeval):
        return Row(name, {t: {"gsm8k": gsm8k, "ifeval": ifeval}.get(t) for t in suite.tasks}, None, "this harness")
    rows = [row("e", 80.0, 50.0), row("m", 40.0, 25.0), row("part", 40.0, None)]
    normalized = normalized_rows(rows, {"gsm8k": "e", "ifeval": "e"}, suite)
    assert [r.name for r in normalized] == ["m ÷ expert", "part ÷ expert"]
    assert (normalized[0].scores["gsm8k"], normalized[0].scores["ifeval"], normalized[0].average) == (50.0, 50.0, 50.0)
    assert (normalized[1].scores["gsm8k"], normalized[1].scores["ifeval"], normalized[1].average) == (50.0, None, None)


def test_an_expert_for_a_task_the_suite_lacks_is_refused_in_one_line():
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.leaderboard import Row, normalized_rows
    from featcal_llm.evaluation.suite import load_suite

    suite = load_suite("mergebench")
    rows = [Row("e", {t: 50.0 for t in suite.tasks}, 50.0, "this harness")]
    with pytest.raises(FeatCalError, match=r"^--expert: expected TASK=LABEL .*\(nosuch not found\)"):
        normalized_rows(rows, {"nosuch": "e"}, suite)


def test_the_average_s_standard_error_is_that_of_a_mean_of_independent_task_scores():
    """k tasks, each with standard error 2: the mean of k independent scores has standard error 2 / sqrt(k)
    (Var(mean) = sum of variances / k^2), not 2."""
    import math

    from featcal_llm.evaluation.leaderboard import summary_rows
    from featcal_llm.evaluation.suite import load_suite

    suite = load_suite("mergebench")
    k = len(suite.tasks)
    assert k > 1
    summary = {"label": "m", "suite": {"name": suite.name, "version": suite.version}, "backend": {"name": "hf"},
               "chat_template": {"applied": False}, "complete": True, "average": 50.0,
               "tasks": {t: {"score": 50.0, "stderr": 2.0} for t in suite.tasks}}
    [row] = summary_rows([summary], suite)
    assert row.stderr["average"] == pytest.approx(2.0 / math.sqrt(k))
    summary["tasks"][next(iter(suite.tasks))]["stderr"] = None  # one task without one: the average has none
    assert "average" not in summary_rows([summary], suite)[0].stderr


@pytest.mark.parametrize("gained, lost", [(1, 1), (3, 3), (0, 5), (2, 7), (10, 4), (6, 0)])
def test_mcnemar_p_is_scipy_s_exact_binomial_test_on_the_discordant_items(gained, lost):
    """McNemar's exact test is the two-sided binomial test of `gained` of the gained + lost discordant items at 1/2;
    concordant items (both right, both wrong) do not count. With gained == lost the doubled tail passes 1: p is 1."""
    import numpy as np

    from featcal_llm.evaluation import uncertainty

    stats = pytest.importorskip("scipy.stats")
    base = np.array([0.0] * gained + [1.0] * lost + [1.0] * 4 + [0.0] * 3)
    other = np.array([1.0] * gained + [0.0] * lost + [1.0] * 4 + [0.0] * 3)
    expected = stats.binomtest(gained, gained + lost, 0.5).pvalue
    assert uncertainty.mcnemar_p(base, other) == pytest.approx(expected, rel=1e-12)
    assert uncertainty.mcnemar_p(base, other) <= 1.0


def test_mcnemar_p_needs_both_models_scored_zero_or_one():
    import numpy as np

    from featcal_llm.evaluation import uncertainty

    binary = np.array([1.0, 0.0, 1.0])
    assert uncertainty.mcnemar_p(binary, np.array([1.0, 0.5, 1.0])) is None  # pass@1 over n samples
    assert uncertainty.mcnemar_p(np.array([1.0, 0.5, 1.0]), binary) is None


def test_items_are_paired_by_doc_id_and_only_where_both_were_scored():
    from featcal_llm.evaluation import uncertainty

    base, other = uncertainty.paired({2: 1.0, 0: 1.0, 1: 0.0}, {3: 0.0, 1: 1.0, 2: 0.5})
    assert (base.tolist(), other.tolist()) == ([0.0, 1.0], [1.0, 0.5])


def test_a_comparison_without_items_is_none_and_an_average_has_no_mcnemar_p():
    """McNemar's test is one task's: the average column's interval pools tasks, and has no p-value."""
    import numpy as np

    from featcal_llm.evaluation import uncertainty

    empty = np.array([], dtype=float)
    assert uncertainty.compare([(empty, empty)]) is None and uncertainty.compare([]) is None
    one = (np.array([0.0, 1.0, 0.0, 0.0]), np.array([1.0, 1.0, 1.0, 0.0]))
    two = (np.array([1.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0]))
    assert uncertainty.compare([one]).p_mcnemar == pytest.approx(0.5)  # 2 gained, 0 lost: 2 * 1/4
    pooled = uncertainty.compare([one, two, (empty, empty)], iterations=200)
    assert pooled.p_mcnemar is None and pooled.n == 7
    assert pooled.delta == pytest.approx(((2 / 4) + (-1 / 3)) / 2)  # the mean of the tasks' mean differences
