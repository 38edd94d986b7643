"""A run killed in its refinement, with held-out records left out of refine's checks (`trailing_records: drop`),
resumes to the uninterrupted run's bytes, reading which records were left out from the staging area (the marks are
measured once, from the layer loop's last streams, engine/passes.held_out_trailing_indices), not measuring them again."""

from __future__ import annotations

import json


from featcal_llm.maths import advantage
from featcal_llm.pipeline import run_recipe
from refine_scenario import killed_after_step_2
from test_trailing import lead_and_trail  # noqa: F401  (the module's fixture: one expert leads the merge, one trails)

SEED = 0  # a split whose held-out records hold some a leading expert trails the merge on (asserted below)


def _keys(seed: int) -> dict:
    return dict(batch_tokens=150, dtype="float64", token_weights="expert_lead", trailing_experts="merge", seed=seed,
                refine={"steps": 4, "eval_every": 2, "lr": 1e-4, "params": "full", "precision": "float32"})


def test_a_run_killed_mid_refinement_resumes_with_the_held_out_records_it_left_out(lead_and_trail, tmp_path, monkeypatch):  # noqa: F811
    import featcal_llm.engine.passes as passes

    scenario = lead_and_trail[0]
    monkeypatch.setattr(advantage, "LEAD_STANDARD_ERRORS", 10.0)  # expert1 is not behind beyond doubt: its records count
    whole = run_recipe(scenario.write_recipe(tmp_path / "w.yaml", output=str(tmp_path / "whole"), **_keys(SEED)), progress=False)
    report = json.loads((whole / "featcal_refine.json").read_text())
    assert sum(report["held_out_left_out"].values()) > 0, report.get("held_out_left_out")
    assert report["chosen_step"] > 2 or report["steps_run"] > 2  # the steps after the kill decide the bytes

    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "resumed"), **_keys(SEED))

    killed_after_step_2(recipe, monkeypatch)
    assert list((tmp_path / ".resumed.featcal-partial").glob(f"*{passes.HELD_OUT_PASS}*"))
    with monkeypatch.context() as patch:  # measured again, no held-out record would be left out
        patch.setattr(passes, "mark_trailing_records", lambda weights, leads: weights)
        resumed = run_recipe(recipe, progress=False)
    differ = sorted(path.name for path in whole.iterdir() if path.read_bytes() != (resumed / path.name).read_bytes())
    assert differ == ["README.md", "featcal_recipe.yml"], differ  # the card and the recipe name the output


def test_teachers_saved_for_other_held_out_records_are_computed_again(lead_and_trail, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The teachers and the refinement's progress are kept by each record's place among the records they cover: a
    resume whose held-out records left out differ (the saved marks lost, the records measured otherwise) computes the
    teachers again and refines from the calibrated layers, to a fresh run's bytes; it stopped on a KeyError."""
    import featcal_llm.engine.passes as passes

    scenario = lead_and_trail[0]
    monkeypatch.setattr(advantage, "LEAD_STANDARD_ERRORS", 10.0)
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "resumed"), **_keys(SEED))

    killed_after_step_2(recipe, monkeypatch)
    marks = list((tmp_path / ".resumed.featcal-partial").glob(f"*{passes.HELD_OUT_PASS}*"))
    assert marks
    for path in marks:
        path.unlink()
    monkeypatch.setattr(passes, "mark_trailing_records", lambda weights, leads: weights)  # now none is left out
    capsys.readouterr()
    resumed = run_recipe(recipe, progress=False)
    log = capsys.readouterr().err
    assert "teachers' distributions reused" not in log and "next-token distributions in" in log, log
    fresh = run_recipe(scenario.write_recipe(tmp_path / "f.yaml", output=str(tmp_path / "fresh"), **_keys(SEED)), progress=False)
    assert "held_out_left_out" not in json.loads((fresh / "featcal_refine.json").read_text())
    differ = sorted(path.name for path in fresh.iterdir() if path.read_bytes() != (resumed / path.name).read_bytes())
    assert differ == ["README.md", "featcal_recipe.yml"], differ
