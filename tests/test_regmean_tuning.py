"""Choosing RegMean's reduction per layer on held-out records, as λ/α/ρ are chosen for FeatCal (issue 18)."""

from __future__ import annotations

import json

import torch
import yaml
from test_exactness import read_weights, relative_error
from test_regmean import regmean_recipe
from test_tuning import _calibration_only_data

import featcal_llm.engine.tuned as tuned_module
from featcal_llm.engine.tuning import Search, coordinate_search
from featcal_llm.maths.regmean import RegMeanSetting
from featcal_llm.pipeline import run_recipe
from featcal_llm.io.run_record import read_run_record

CANDIDATES = [0.2, 0.5, 0.9]


def test_coordinate_search_over_the_objectives_own_key():
    search = Search({"reduction": (0.1, 0.3, 0.5, 0.7, 0.9)}, eps=1e-8, holdout=0.25, budget=12, criterion="hidden")
    seen = []
    winner, table = coordinate_search(search, lambda h: seen.append(h.reduction) or abs(h.reduction - 0.7))
    assert winner == RegMeanSetting(0.7, 1e-8) and seen == [0.1, 0.3, 0.5, 0.7, 0.9] and len(table) == 5


def test_forced_winner_equals_a_fixed_run_on_the_calibration_records(merged_scenario, tmp_path, monkeypatch):
    """The reduction a tuned RegMean++ run chooses gives the fixed run's weights on the records it calibrates on.

    The criterion is flat and the winner forced to r = 0.9 (the last candidate evaluated is not kept
    while searching: the first one is), so the winner must be solved again from the shared sums.
    """
    real = tuned_module.coordinate_search
    monkeypatch.setattr(tuned_module, "coordinate_search", lambda s, score: real(s, lambda h: (score(h), 0.0 if h.reduction == 0.9 else 1.0)[1]))
    monkeypatch.setattr(tuned_module, "criterion", lambda *args: 0.0)
    tuned = run_recipe(regmean_recipe(merged_scenario, tmp_path / "t.yaml", method="regmean++", output=str(tmp_path / "tuned"),
                                      reduction=CANDIDATES, dtype="float64"), progress=False)
    report = json.loads((tuned / "featcal_tuning.json").read_text())
    assert report["chosen"] == {"reduction": [0.9, 0.9, 0.9]}
    fixed = run_recipe(regmean_recipe(merged_scenario, tmp_path / "f.yaml", method="regmean++", output=str(tmp_path / "fixed"),
                                      reduction=0.9, dtype="float64", data=_calibration_only_data(merged_scenario, tmp_path)), progress=False)
    ours, reference, merged = read_weights(tuned), read_weights(fixed), read_weights(merged_scenario.root / "merged")
    worst = max(relative_error(ours[n] - merged[n], reference[n] - merged[n]) for n in ours if n.endswith("_proj.weight"))
    print(f"tuned (forced r = 0.9) vs fixed RegMean++ on the calibration records: worst relative ΔW difference {worst:.2e}")
    assert worst <= 1e-8


def test_tuned_reduction_is_recorded_and_replays_byte_for_byte(merged_scenario, tmp_path):
    output = run_recipe(regmean_recipe(merged_scenario, tmp_path / "auto.yaml", method="regmean", output=str(tmp_path / "auto"),
                                       reduction=CANDIDATES, dtype="float64"), progress=False)
    report = json.loads((output / "featcal_tuning.json").read_text())
    assert report["search"]["values"] == {"reduction": CANDIDATES} and report["search"]["evaluations_per_layer"] == 3
    for layer in report["layers"]:
        assert [row["reduction"] for row in layer["candidates"]] == CANDIDATES
        best = min(layer["candidates"], key=lambda row: row["criterion"])
        assert layer["chosen"] == best
    card = read_run_record(output)
    written = yaml.safe_load((output / "featcal_recipe.yml").read_text())["featcal"]
    assert card["method"] == "regmean" and card["hyperparameters"]["reduction"] == report["chosen"]["reduction"]
    assert written["reduction"] == {"per_layer": report["chosen"]["reduction"]} and written["tune"]["holdout"] == 0.25
    replay_path = tmp_path / "replay.yaml"
    written["output"] = str(tmp_path / "replay")
    replay_path.write_text(yaml.safe_dump({**yaml.safe_load((output / "featcal_recipe.yml").read_text()), "featcal": written}))
    replay = read_weights(run_recipe(replay_path, progress=False))
    ours = read_weights(output)
    assert all(torch.equal(ours[n], replay[n]) for n in ours)
    assert not (tmp_path / "replay" / "featcal_tuning.json").exists()
