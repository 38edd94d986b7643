"""The all-gap study's arithmetic: shares are ratios of sums over every domain, and the JSON's rows and keys."""

from __future__ import annotations

import json

import pytest

from studies.allgap_report import build, markdown, shares
from studies.quality_setup import SETTINGS, paper_rule, rows
from studies.real_data import KINDS


EXPERTS = {  # each expert best on its own domain; the C expert's average is the worst
    "expert:code": {"code": 2.0, "prose": 3.0, "c": 3.0},
    "expert:prose": {"code": 3.0, "prose": 2.0, "c": 3.0},
    "expert:c": {"code": 3.2, "prose": 3.2, "c": 2.0},
}


def test_share_is_a_ratio_of_sums_over_every_domain():
    merged = {"code": 2.5, "prose": 2.4, "c": 2.2}
    experts = {"code": 2.4, "prose": 2.0, "c": 2.1}  # gaps .1, .4, .1
    model = {"code": 2.4, "prose": 2.3, "c": 2.25}  # recovered .1, .1, -.05
    total, per = shares(merged, experts, model)
    assert total == pytest.approx(0.15 / 0.6)  # not the mean of 1, .25, -.5
    assert per == pytest.approx({"code": 1.0, "prose": 0.25, "c": -0.5})


def test_allgap_rows_are_the_defaults_the_paper_rule_and_one_expert_at_a_time():
    assert SETTINGS["allgap"].merge_weight is not None and SETTINGS["allgap"].experts == ("code", "prose", "c")
    main, single = rows("allgap"), rows("single")
    assert [r.keys for r in main] == [{}, paper_rule(), {"refine": True}] and set(paper_rule().values()) == {"equal", "keep", "own", False}
    assert [dict(r.weights) for r in single] == [{"prose": 0.0, "c": 0.0}, {"code": 0.0, "c": 0.0}, {"code": 0.0, "prose": 0.0}]
    assert all(r.settings == ("allgap", "allgap-half") for r in [main[0], main[2], *single])
    assert main[1].settings == ("allgap", "allgap-half", "broad")  # the paper's rule is also the broad setting's ablation


def test_report_rows_and_keys(tmp_path):
    nll = {
        **EXPERTS,
        "allgap:merged": {"code": 2.2, "prose": 2.4, "c": 2.2},
        "allgap:featcal defaults": {"code": 2.1, "prose": 2.2, "c": 2.2},
        "allgap:featcal defaults, prose only": {"code": 2.3, "prose": 2.1, "c": 2.3},
    }
    block = {"merged": "m", "output": "o", "data": {"experts/code": {"path": "c.jsonl", "format": "text"}}, "samples": 64}
    resolved = {"token_weights": "equal", "alpha": 0.5, "trailing_experts": "keep"}  # what that run's card said
    rows_state = {"allgap:featcal defaults": {"seconds": 10.0, "featcal": block, "featcal_effective": resolved,
                                              "record_leads": {"code": 0.2, "prose": 0.1, "c": 0.05}},
                  "allgap:featcal defaults, prose only": {"seconds": 5.0, "featcal": block}}
    (tmp_path / "state.json").write_text(json.dumps({"nll": nll, "rows": {"allgap": rows_state}, "training": {}}))
    result = build(tmp_path)
    assert result["setting"]["gap"] == pytest.approx({"code": 0.2, "prose": 0.4, "c": 0.2})
    row = result["rows"]["featcal defaults"]
    assert row["share"] == pytest.approx(0.3 / 0.8) and row["seconds"] == 10.0 and row["featcal"] == block
    # what the run resolved, as recorded when it ran (its card), not today's defaults (expert_lead, 0.15) filled in now
    assert row["featcal_effective"] == resolved and row["record_leads"] == {"code": 0.2, "prose": 0.1, "c": 0.05}
    assert result["ceiling"]["single_expert"]["prose"]["featcal_effective"] is None  # recorded nothing: said so
    assert set(row) >= {"nll", "nll_avg", "share", "share_per_domain", "seconds", "featcal"}
    assert result["rows"]["best single expert"]["expert"] == "code"  # average 2.667
    assert result["rows"]["merged"]["share"] == 0
    assert result["ceiling"]["single_expert"]["prose"]["own_share"] == pytest.approx(0.75)
    assert "| featcal defaults |" in markdown(result)


def test_report_of_the_half_setting_keeps_every_row_it_ran(tmp_path):
    """The TA ½ setting's rows are keyed by its own name; a lever row run there appears with its share."""
    nll = {
        **EXPERTS,
        "allgap-half:merged": {"code": 2.2, "prose": 2.4, "c": 2.2},
        "allgap-half:featcal defaults": {"code": 2.1, "prose": 2.2, "c": 2.2},
        "allgap-half:featcal, a lever": {"code": 2.0, "prose": 2.0, "c": 2.0},
        "allgap:featcal defaults": {"code": 9.0, "prose": 9.0, "c": 9.0},  # another setting's row: not this one's
    }
    rows_state = {"allgap-half:featcal defaults": {"seconds": 10.0}, "allgap-half:featcal, a lever": {"seconds": 7.0}}
    (tmp_path / "state.json").write_text(json.dumps({"nll": nll, "rows": {"allgap-half": rows_state}, "training": {}}))
    result = build(tmp_path, setting_name="allgap-half")
    assert result["setting"]["name"] == "allgap-half" and result["setting"]["ta_weight"] == SETTINGS["allgap-half"].merge_weight
    assert result["rows"]["featcal, a lever"]["share"] == pytest.approx(1.0)
    assert result["rows"]["featcal defaults"]["share"] == pytest.approx(0.3 / 0.8)
    assert list(result["rows"]) == ["merged", "featcal defaults", "featcal, a lever", "best single expert"]


def _records(nll: float, tokens: list[int], spread: float) -> list[list[float]]:
    """Per-record (summed NLL, tokens) whose token-weighted mean is ``nll``, the records apart by ``spread``."""
    means = [nll + spread * (i - (len(tokens) - 1) / 2) for i in range(len(tokens))]
    shift = nll - sum(m * t for m, t in zip(means, tokens)) / sum(tokens)
    return [[(m + shift) * t, t] for m, t in zip(means, tokens)]


def test_report_intervals_resample_each_rows_own_test_records(tmp_path):
    """Shares' intervals come from the per-record scores of the row, the merge and each domain's own expert (paired),
    and the refinement's ratio to the distillation from both rows' records in the same resamples."""
    import random

    from studies.common import bootstrap_share_ratio, bootstrap_shares, mean_nll

    tokens = [100, 80, 120, 90]
    nll = {**EXPERTS, "allgap:merged": {"code": 2.2, "prose": 2.4, "c": 2.2},
           "allgap:featcal defaults": {"code": 2.1, "prose": 2.2, "c": 2.2},
           "allgap:featcal defaults + refine": {"code": 2.05, "prose": 2.1, "c": 2.1}}
    rng = random.Random(0)
    records = {name: {d: _records(v, tokens, rng.uniform(0.05, 0.3)) for d, v in scores.items()} for name, scores in nll.items()}
    assert mean_nll(records["allgap:merged"]["prose"]) == pytest.approx(2.4)
    rows_state = {f"allgap:{n}": {"seconds": 1.0} for n in ("featcal defaults", "featcal defaults + refine")}
    run = {"name": "joint lr 0.0001", "serve": "joint", "lr": 1e-4, "steps": 8, "batch": 4, "records": 4, "train_s": 3.0,
           "val_kl": {d: 0.1 for d in KINDS}, "nll": {"code": 2.15, "prose": 2.15, "c": 2.15},
           "test_records": {d: _records(2.15, tokens, 0.2) for d in KINDS}}
    (tmp_path / "distill").mkdir()
    (tmp_path / "distill" / "merged.json").write_text(json.dumps({"val_kl": {d: 0.2 for d in KINDS}}))
    (tmp_path / "distill" / "joint-lr0.0001.json").write_text(json.dumps(run))
    (tmp_path / "state.json").write_text(json.dumps({"nll": nll, "records": records, "rows": {"allgap": rows_state}}))
    result = build(tmp_path)
    merged, own = records["allgap:merged"], {d: records[f"expert:{d}"][d] for d in KINDS}
    refine = result["rows"]["featcal defaults + refine"]
    expected = bootstrap_shares(merged, own, records["allgap:featcal defaults + refine"])
    assert refine["share"] == pytest.approx((0.15 + 0.3 + 0.1) / 0.8)
    assert refine["share_ci95"] == pytest.approx(expected["share"], abs=1e-4)
    assert refine["share_per_domain_ci95"]["c"] == pytest.approx(expected["share_per_domain"]["c"], abs=1e-4)
    assert refine["share_ci95"][0] < refine["share"] < refine["share_ci95"][1]
    ratio = result["share_ratios"]["featcal defaults + refine / distill joint (lr by val KL)"]
    assert ratio["ratio"] == pytest.approx(refine["share"] / result["rows"]["distill joint (lr by val KL)"]["share"], abs=1e-4)
    assert ratio["ci95"] == pytest.approx(bootstrap_share_ratio(merged, own, records["allgap:featcal defaults + refine"],
                                                                run["test_records"]), abs=1e-4)
    assert "share_ci95" not in result["rows"]["merged"]
    assert "(" in markdown(result).split("| featcal defaults + refine |")[1].split("\n")[0]  # the interval is printed
