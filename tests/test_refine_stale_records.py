"""A run killed mid-refinement, resumed after its calibration records changed: what the staging area keeps by each
record's place (the teachers' distributions, the refinement's progress, the held-out records' trailing marks) is never
read for other records. The run fingerprint covers the records (resume.sequences_digest of the training and the held-out
ones), so such a rerun starts over and writes what a fresh run on the new records writes.

Each test is a check that can fail: the held-out record changed is one whose mark flips (expert1's held-out records
left out go from 2 to 1), and a resume that read the saved marks, teachers or layers would write other bytes."""

from __future__ import annotations

import json

import pytest
import yaml
from scenario import build_scenario

import featcal_llm.stages.prepare as prepare
from featcal_llm.engine.tuning import split_holdout
from featcal_llm.pipeline import run_recipe
from refine_scenario import killed_after_step_2

RECORDS, SEED = 9, 2  # 2 of each expert's 9 records held out; seed 2 leaves out held-out records {0, 2, 2}, keeps its last check
KEYS = {"token_weights": "expert_lead", "trailing_experts": "keep", "seed": SEED,
        "refine": {"steps": 4, "eval_every": 2, "lr": 1e-4, "params": "full", "precision": "float32"}}
SAME = ["README.md", "featcal_recipe.yml"]  # the card and the recipe name the output folder


@pytest.fixture(scope="module")
def nine(tmp_path_factory):
    """Three experts of 9 records each: every line of their files (the recipe asks for more), so that a line changed or
    added changes the records and nothing in the recipe. Returns the scenario and each file's spare lines."""
    scenario = build_scenario(tmp_path_factory.mktemp("stale"), experts=3, layers=2, samples=RECORDS, words=(4, 10), dtype="float64")
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"].update(dtype="float64", norms=True, batch_tokens=150, samples=50)
    scenario.recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
    spare = {}
    for name, path in scenario.data.items():
        lines = path.read_text().splitlines()
        path.write_text("\n".join(lines[:RECORDS]) + "\n")
        spare[name] = lines[RECORDS:]
    return scenario, spare


def _left_out(output) -> dict:
    return json.loads((output / "featcal_refine.json").read_text()).get("held_out_left_out")


def _differ(one, other) -> list[str]:
    return sorted(path.name for path in one.iterdir() if path.read_bytes() != (other / path.name).read_bytes())


@pytest.fixture()
def data(nine):
    """The data files as the scenario wrote them, put back after the test."""
    scenario, spare = nine
    before = {name: path.read_text() for name, path in scenario.data.items()}
    yield scenario, spare
    for name, path in scenario.data.items():
        path.write_text(before[name])


def _change_a_held_out_record(scenario, spare) -> None:
    """expert1's first held-out record (by the run's own split) gets another text: one it no longer trails the merge on."""
    _, held = split_holdout({name: [[i] for i in range(RECORDS)] for name in scenario.data}, 0.25, SEED, "split")
    index = held["expert1"][0][0]
    lines = scenario.data["expert1"].read_text().splitlines()
    lines[index] = spare["expert1"][-1]
    scenario.data["expert1"].write_text("\n".join(lines) + "\n")


def test_a_held_out_record_changed_before_the_resume_starts_it_over(data, tmp_path, monkeypatch, capsys):
    scenario, spare = data
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "resumed"), **KEYS)
    killed_after_step_2(recipe, monkeypatch)
    _change_a_held_out_record(scenario, spare)
    capsys.readouterr()
    resumed = run_recipe(recipe, progress=False)
    log = capsys.readouterr().err
    fresh = run_recipe(scenario.write_recipe(tmp_path / "f.yaml", output=str(tmp_path / "fresh"), **KEYS), progress=False)
    assert _left_out(fresh) == {"expert0": 0, "expert1": 1, "expert2": 2}, _left_out(fresh)  # the saved marks said 2 for expert1
    assert _differ(fresh, resumed) == SAME
    assert log.count("was made with a different recipe, data, models or settings; starting over") == 1, log
    assert "reused" not in log and "resuming" not in log, log  # no layer, pass, mark, teacher or progress read


def test_a_record_added_before_the_resume_starts_it_over(data, tmp_path, monkeypatch, capsys):
    scenario, spare = data
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "resumed"), **KEYS)
    killed_after_step_2(recipe, monkeypatch)
    with scenario.data["expert0"].open("a") as handle:
        handle.write(spare["expert0"][0] + "\n")
    capsys.readouterr()
    resumed = run_recipe(recipe, progress=False)
    log = capsys.readouterr().err
    fresh = run_recipe(scenario.write_recipe(tmp_path / "f.yaml", output=str(tmp_path / "fresh"), **KEYS), progress=False)
    report = json.loads((fresh / "featcal_refine.json").read_text())
    assert report["records"]["expert0"] + report["records_left_out"]["expert0"] + report["held_out_records"]["expert0"] == RECORDS + 1
    assert _differ(fresh, resumed) == SAME
    assert log.count("was made with a different recipe, data, models or settings; starting over") == 1, log
    assert "reused" not in log and "resuming" not in log, log


def test_marks_saved_for_other_held_out_records_are_measured_again(data, tmp_path, monkeypatch, capsys):
    """Beyond the fingerprint: the held-out records' marks are kept with the digest of the records they mark, as the
    teachers and the progress are, so that none of the three is read for other records even where the fingerprint
    does not tell them apart (here prepare.sequences_digest made a constant: the saved layers and passes, which the
    unchanged training records decide, are rightly reused). The marks are measured again, and with them the teachers
    and the refinement, to a fresh run's refined weights and report."""
    scenario, spare = data
    monkeypatch.setattr(prepare, "sequences_digest", lambda sequences: "blind")
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "resumed"), **KEYS)
    killed_after_step_2(recipe, monkeypatch)
    _change_a_held_out_record(scenario, spare)
    capsys.readouterr()
    resumed = run_recipe(recipe, progress=False)
    log = capsys.readouterr().err
    assert "2 of 2 layers already calibrated" in log, log  # the fingerprint did not see the change
    fresh = run_recipe(scenario.write_recipe(tmp_path / "f.yaml", output=str(tmp_path / "fresh"), **KEYS), progress=False)
    assert _left_out(resumed) == _left_out(fresh) == {"expert0": 0, "expert1": 1, "expert2": 2}, _left_out(resumed)
    for name in ("featcal_refine.json", "model.safetensors"):  # the drift report's layer records are the saved layers'
        assert (resumed / name).read_bytes() == (fresh / name).read_bytes(), name
    assert "teachers' distributions reused" not in log and "resuming after step" not in log, log


def test_a_resume_on_the_same_records_writes_the_uninterrupted_bytes_with_a_check_after_the_kill_kept(data, tmp_path, monkeypatch):
    """The same records: the resume reads the saved marks (measured again, none would be left out here) and writes an
    uninterrupted run's bytes. Unlike tests/test_trailing_resume.py's run, whose closed form stands (step 0 kept),
    here the check kept is the last one, after the kill, so the refined weights themselves are compared."""
    import featcal_llm.engine.passes as passes

    scenario, _ = data
    whole = run_recipe(scenario.write_recipe(tmp_path / "w.yaml", output=str(tmp_path / "whole"), **KEYS), progress=False)
    report = json.loads((whole / "featcal_refine.json").read_text())
    assert report["chosen_step"] == report["steps_run"] == 4 and sum(report["held_out_left_out"].values()) > 0, report
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "resumed"), **KEYS)
    killed_after_step_2(recipe, monkeypatch)
    monkeypatch.setattr(passes, "mark_trailing_records", lambda weights, leads: weights)
    assert _differ(whole, run_recipe(recipe, progress=False)) == SAME
