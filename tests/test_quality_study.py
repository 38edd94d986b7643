"""The quality study's pure parts: every row's recipe is one the product accepts, and the report's arithmetic.

The real model is not run here (minutes of CPU per fine-tune); ``python -m studies.quality run --quick`` is the
smoke test of the whole path.
"""

from __future__ import annotations

import json

import pytest
import yaml

from featcal_llm.io.recipe import load_recipe
from featcal_llm.tiny import build_char_tokenizer
from studies.quality import _parser
from studies.quality_data import records_as_trained
from studies.real_data import interleave
from studies.quality_report import setting_summary
from studies.quality_setup import PHASES, SETTINGS, Row, expert_dir, recipe_text, rows


def _workdir(tmp_path):
    for kind in ("code", "prose", "c", "mix"):
        folder = tmp_path / "data" / kind
        folder.mkdir(parents=True)
        (folder / "cal.jsonl").write_text(json.dumps({"text": f"{kind} text"}) + "\n")
        (folder / "prompts.jsonl").write_text(json.dumps({"prompt": f"{kind}"}) + "\n")
    records_as_trained(tmp_path / "data", build_char_tokenizer())
    return tmp_path


def test_the_product_calibrates_on_the_records_as_the_experts_were_trained_bos_first(tmp_path):
    """The study fine-tunes and scores BOS + text; a tokenizer that adds no BOS gets it written into the records."""
    from studies.real_models import encode

    tokenizer = build_char_tokenizer()
    folder = _workdir(tmp_path) / "data" / "code"
    record, prompt = json.loads((folder / "cal-bos.jsonl").read_text()), json.loads((folder / "prompts-bos.jsonl").read_text())
    assert tokenizer(record["text"])["input_ids"] == encode(tokenizer, ["code text"])[0]
    assert prompt["prompt"] == tokenizer.bos_token + "code"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_row_writes_a_recipe_the_product_accepts(tmp_path, monkeypatch, setting):
    monkeypatch.chdir(_workdir(tmp_path))
    seen = set()
    for phase in PHASES:
        for row in rows(phase):
            merged = "merged/x-linear" if row.merged == "linear" else "merged/x-ta"
            text = recipe_text(SETTINGS[setting], row, "runs/out", merged, record_tokens=160, prompt_tokens=32,
                               cal_records=64, seed=0, device="cpu", dtype="float32", merge_weight=0.333333)
            path = tmp_path / "r.yaml"
            path.write_text(text)
            recipe = load_recipe(path)
            featcal, raw = recipe.featcal, yaml.safe_load(text)
            assert [e.name for e in recipe.experts] == [expert_dir(k) for k in SETTINGS[setting].experts]
            assert raw["merge_method"] == ("linear" if row.merged == "linear" else "task_arithmetic")
            assert (row.merged == "linear") == (row.method != "featcal")  # RegMean++ and its stacks start from the linear merge
            assert featcal.method == (tuple(yaml.safe_load(row.method)) if row.method.startswith("[") else row.method)
            assert featcal.merged == merged
            for key, value in row.keys.items():
                if key == "head" and value is False:
                    assert featcal.head is None
                elif key == "head":
                    assert featcal.head is not None and featcal.head.when == "always" and all(getattr(featcal.head, k) == v for k, v in (value if isinstance(value, dict) else {}).items())
                elif key == "expert_weights":
                    assert featcal.balancing == value
                elif key == "token_weights":
                    assert featcal.token_weighting == value
                elif key == "norms":
                    assert featcal.norms is value
                elif key == "trailing_experts":
                    assert featcal.trailing == value
                elif key == "teachers":
                    assert featcal.teaching == value
                elif key == "refine":  # `true`: the stage with its defaults
                    assert value is True and featcal.refine is not None and featcal.refine.steps == 40
                elif key != "tune":
                    assert featcal.hyper_values()[key] == value, (row.name, key)
            assert (featcal.refine is not None) == ("refine" in row.keys)
            if "head" not in row.keys:
                assert featcal.head_when_changed  # the default: re-fitted only where an expert changed its head
            for kind, weight in row.weights:
                if kind in SETTINGS[setting].experts:
                    assert featcal.data[expert_dir(kind)].weight == weight
            assert sum(spec.weight != 1 for spec in featcal.data.values()) == sum(k in SETTINGS[setting].experts for k, _ in row.weights)
            if row.data == "generate":
                assert all(spec.generate.samples == row.samples for spec in featcal.data.values())
            elif row.data == "self":  # data-free: no prompts, no forced start; the row's sampling keys, the rest the product's
                for spec in featcal.data.values():
                    assert spec.path is None and spec.generate.samples == row.samples and spec.generate.prompts is None
                    assert spec.generate.chat_template == dict(row.sampling).get("chat_template", "auto") and spec.generate.start is None
                    sampling = {"top_p": 1.0, "temperature": 0.7, "min_p": 0.0, **dict(row.sampling)}  # the product's defaults unless set
                    assert (spec.generate.top_p, spec.generate.temperature, spec.generate.min_p) == (sampling["top_p"], sampling["temperature"], sampling["min_p"])
            else:
                assert featcal.samples == (row.records or 64) and all(spec.path.endswith("/cal-bos.jsonl") for spec in featcal.data.values())
            seen.add(row.name)
    assert {"featcal defaults", "featcal auto", "regmean++", "stack: regmean++ → featcal defaults", "featcal defaults + head",
            "featcal defaults, 256 records", "regmean++, 256 records", "stack: regmean++ → featcal defaults, 256 records",
            "featcal defaults, generate {} 64", "featcal defaults, generate {} 64, temperature 1, top_p 0.9",
            "featcal defaults, generate {} 64, temperature 1, min_p 0.1"} <= seen


def test_defaults_row_leaves_the_products_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(_workdir(tmp_path))
    path = tmp_path / "r.yaml"
    path.write_text(recipe_text(SETTINGS["narrow"], Row("featcal defaults"), "o", "m", record_tokens=160,
                                prompt_tokens=32, cal_records=64, seed=0, device="cpu", dtype="float32",
                                merge_weight=0.5))
    assert load_recipe(path).featcal.hyper_values() == {"lambda": 1e-5, "alpha": 0.15, "rho": 0.5}


def _state():
    """NLL by hand: the broad expert is best on average (2.0), the merge 2.3, one calibrated model 1.9."""
    nll = {
        "base": {"code": 3.0, "prose": 3.0, "c": 3.0},
        "expert:broad": {"code": 2.1, "prose": 1.8, "c": 2.1},  # average 2.0
        "expert:code": {"code": 1.5, "prose": 3.0, "c": 2.7},  # average 2.4
        "expert:c": {"code": 2.6, "prose": 3.0, "c": 1.6},  # average 2.4
        "broad:merged": {"code": 2.0, "prose": 2.8, "c": 2.1},
        "broad:featcal auto": {"code": 1.75, "prose": 2.3, "c": 1.85},  # average 1.9667
    }
    kl = {"broad": {"broad:merged": {"code": 0.4, "prose": 0.5, "c": 0.2},
                    "broad:featcal auto": {"code": 0.1, "prose": 0.25, "c": 0.2}}}
    return {"nll": nll, "kl": kl, "rows": {"broad": {"broad:merged": {}, "broad:featcal auto": {"seconds": 12.0},
                                                     "broad:regmean++": {"error": "FeatCalError: boom"}}}}


def test_summary_measures_against_each_domains_expert_and_the_best_single_expert():
    summary = setting_summary(_state(), SETTINGS["broad"])
    assert summary["best_expert"] == "expert:broad" and summary["best_expert_average"] == pytest.approx(2.0)
    row = summary["models"]["broad:featcal auto"]
    # gaps: code 2.0-1.5 = .5, prose 2.8-1.8 = 1.0 (the broad expert owns prose), c 2.1-1.6 = .5
    assert row["recovered"] == pytest.approx({"code": 0.5, "prose": 0.5, "c": 0.5})
    assert row["recovered_mean"] == pytest.approx(0.5)
    assert row["kl_recovered"] == pytest.approx({"code": 0.75, "prose": 0.5, "c": 0.0})
    assert row["beats_every_expert"] is True and row["seconds"] == 12.0
    assert summary["models"]["broad:merged"]["beats_every_expert"] is False
    assert summary["models"]["expert:broad"]["beats_every_expert"] is False  # not below itself
    assert summary["failed"] == {"broad:regmean++": "FeatCalError: boom"}


def test_no_gap_is_no_share():
    state = _state()
    state["nll"]["broad:merged"]["code"] = 1.4  # the merge already beats the code expert on code
    row = setting_summary(state, SETTINGS["broad"])["models"]["broad:featcal auto"]
    assert row["recovered"]["code"] is None and row["recovered_mean"] == pytest.approx(0.5)


def test_mix_interleaves_kinds_and_cli_needs_a_source():
    assert interleave([[1, 2, 3], ["a", "b", "c"], ["x", "y", "z"]], 7) == [1, "a", "x", 2, "b", "y", 3]
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--data", "d", "--workdir", "w"])


def test_report_tables_are_rectangular(tmp_path):
    from studies.quality_report import write_report

    state = {**_state(), "timings": {"scoring": 1.0}}
    options = {"settings": ["broad"], "device": "cpu", "steps": 96, "batch_size": 8, "lr": 5e-4, "cal_records": 64,
               "test_records": 48, "kl_records": 16, "calibration_dtype": "float32", "quick": False}
    text = write_report(state, options, tmp_path)
    table = [line for line in text.splitlines() if line.startswith("| model")]
    rows = text.split(table[0])[1].split("\n\n")[0].strip().splitlines()
    assert len({line.count("|") for line in [table[0], *rows] if line.startswith("|")}) == 1
    assert "| featcal auto | 1.750 | 2.300 | 1.850 | 1.967 | 0.50 | 0.50 | 0.50 | 0.50 |" in text
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["broad"]["best_expert"] == "expert:broad"
