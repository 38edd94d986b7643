"""The all-gap study's arithmetic: shares are ratios of sums over every domain, and the JSON's rows and keys."""

from __future__ import annotations

import json

import pytest

from studies.allgap_report import build, markdown, shares
from studies.quality_setup import SETTINGS, paper_rule, rows


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
    assert [r.keys for r in main] == [{}, paper_rule()] and set(paper_rule().values()) == {"equal", "keep", False}
    assert [dict(r.weights) for r in single] == [{"prose": 0.0, "c": 0.0}, {"code": 0.0, "c": 0.0}, {"code": 0.0, "prose": 0.0}]
    assert all(r.settings == ("allgap", "allgap-half") for r in [main[0], *single])
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
