"""studies/data_free_start.py: the recipes it writes and the report it makes (data_free_start_report.py; no model is loaded)."""

from __future__ import annotations

import yaml

from studies import data_free_start as dfs
from studies.data_free_start_report import report


def _args(*extra: str):
    return dfs._parser().parse_args(["--workdir", "/tmp/unused", *extra])


def _featcal(text: str) -> dict:
    return yaml.safe_load(text)["featcal"]


def test_defaults_write_no_featcal_hyper_parameters_and_bare_generate():
    args = _args("--device", "cuda")
    featcal = _featcal(dfs.recipe_text("raw", "auto", args))
    assert not {"lambda", "alpha", "rho"} & set(featcal)
    assert featcal["device"] == "cuda"
    assert all(spec == {"generate": {}} for spec in featcal["data"].values())
    assert "{generate: {}}" in dfs.recipe_text("raw", "auto", args)


def test_settings_and_overrides():
    args = _args("--lambda", "0.001", "--alpha", "0.5", "--rho", "1")
    assert {k: _featcal(dfs.recipe_text("chat", "real", args))[k] for k in ("lambda", "alpha", "rho")} == {
        "lambda": 0.001, "alpha": 0.5, "rho": 1.0}
    data = _featcal(dfs.recipe_text("chat", "real", args))["data"]
    assert data["chat/code"] == {"path": "chat_cal/code.jsonl", "format": "text"}
    assert _featcal(dfs.recipe_text("chat", "real_x4", args))["data"]["chat/c"] == {
        "path": "chat_cal_x4/c.jsonl", "format": "text", "samples": 4 * args.cal_records}
    assert _featcal(dfs.recipe_text("raw", "bos", args))["data"]["raw/c"] == {"generate": {"chat_template": "off"}}
    assert _featcal(dfs.recipe_text("raw", "chat", args))["data"]["raw/c"] == {"generate": {"chat_template": "on"}}
    assert _featcal(dfs.recipe_text("raw", "auto_x4", args))["data"]["raw/c"] == {"generate": {"samples": 4 * args.cal_records}}
    assert _featcal(dfs.recipe_text("raw", "top_p90", args))["data"]["raw/c"] == {"generate": {"temperature": 1.0, "top_p": 0.9}}
    assert _featcal(dfs.recipe_text("chat", "temp1", args))["data"]["chat/c"] == {"generate": {"temperature": 1.0}}
    assert _featcal(dfs.recipe_text("raw", "min_p10", args))["data"]["raw/c"] == {"generate": {"temperature": 1.0, "min_p": 0.1}}
    args.max_new_tokens = 32
    assert _featcal(dfs.recipe_text("raw", "auto", args))["data"]["raw/c"] == {"generate": {"max_new_tokens": 32}}


def test_picked_forces_each_experts_chat_template_and_refuses_a_missing_kind():
    import pytest

    data = _featcal(dfs.recipe_text("chat", "picked", _args("--picked", "code=on,prose=off,c=empty")))["data"]
    assert [data[f"chat/{k}"] for k in ("code", "prose", "c")] == [
        {"generate": {"chat_template": "on"}}, {"generate": {"chat_template": "off"}}, {"generate": {"chat_template": "empty"}}]
    with pytest.raises(SystemExit, match="--picked: give c=on, c=off or c=empty"):
        dfs.recipe_text("chat", "picked", _args("--picked", "code=on,prose=off"))


def test_quick_generate_is_small():
    args = _args("--quick")
    args.quick, args.cal_records, args.max_new_tokens = True, 4, 16
    assert _featcal(dfs.recipe_text("raw", "auto", args))["data"]["raw/code"] == {"generate": {"samples": 4, "max_new_tokens": 16}}


def test_report_has_a_row_per_setting_even_without_a_gap():
    nll = {"merged": {"code": 1.0, "prose": 1.0, "c": 1.0}, **{f"expert:{k}": {k: 2.0} for k in ("code", "prose", "c")},
           **{f"featcal:{s}": {"code": 1.5, "prose": 1.5, "c": 1.5} for s in dfs.SETTINGS}}
    runs = {"raw_bos": {"same_as": "raw_auto", "seconds": 0.0, "generated": {}, "warnings": [], "choices": []}}
    text = report({"nll": {"raw": nll}, "runs": runs, "failed": {}, "skipped": ["chat_auto_x4"], "timings": {"x": 1.0}}, dfs.SETTINGS)
    for setting in dfs.SETTINGS:
        assert any(line.startswith(f"| {setting}") and "–" in line for line in text.splitlines())
    assert "| bos (= auto) |" in text and "chat_auto_x4" in text


def test_report_shares():
    nll = {"merged": {k: 3.0 for k in ("code", "prose", "c")}, **{f"expert:{k}": {k: 2.0} for k in ("code", "prose", "c")},
           "featcal:real": {k: 2.5 for k in ("code", "prose", "c")}}
    text = report({"nll": {"chat": nll}, "runs": {}}, dfs.SETTINGS)
    assert "| real | 0.50 | 0.50 | 0.50 | 0.50 |" in text
