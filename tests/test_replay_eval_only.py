"""A saved recipe (featcal_recipe.yml) writes out what its run resolved (the `auto` precisions, the data files found
beside the recipe), so its settings are not the recipe's although a run of it writes the same weights. `run --eval-only`
scores that run's output under the recipe it replays, and the first output under the saved recipe copied elsewhere;
an edited saved recipe makes other weights and is refused, naming what differs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.io.run_record import read_run_record
from test_outputs import TABLE


@pytest.fixture
def scored(monkeypatch):
    import featcal_llm.evaluation
    from featcal_llm.evaluation.compare import AfterCalibration

    outputs = []
    monkeypatch.setattr(featcal_llm.evaluation, "run_after_calibration",
                        lambda section, merged_dir, calibrated_dir, recipe_dir, echo=None:
                        outputs.append(Path(calibrated_dir)) or AfterCalibration(TABLE, {}))
    return outputs


def _run(*arguments: str):
    return CliRunner().invoke(main, [arguments[0], *map(str, arguments[1:])])


def test_a_replays_output_is_scored_under_the_recipe_it_replays_and_an_edited_replays_is_not(small, tmp_path, monkeypatch, scored):
    monkeypatch.chdir(tmp_path)
    beside = tmp_path / "recipes"
    beside.mkdir()
    data = {}
    for name, path in small.data.items():  # data files named relative to the recipe: the saved recipe writes them out
        shutil.copy(path, beside / path.name)
        data[str(small.experts[name])] = {"path": path.name, "format": "text", "text": "text"}
    first = tmp_path / "first"
    recipe = small.write_recipe(beside / "recipe.yaml", output=str(first), data=data,
                                eval={"tasks": ["arc_challenge"], "backend": {"name": "hf"}})
    assert _run("run", "-q", recipe).exit_code == 0
    saved = first / "featcal_recipe.yml"
    assert "\n# featcal-llm: these settings (" in saved.read_text()

    second = tmp_path / "second"
    assert _run("run", "-q", saved, second).exit_code == 0
    assert (second / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    made = read_run_record(first)["made_from"], read_run_record(second)["made_from"]
    differ = ["featcal.data", "featcal.dtype", "featcal.stats_dtype"]  # the paths found, the precisions `auto` chose
    assert sorted(key for key in made[0] if made[0][key] != made[1][key]) == differ
    assert read_run_record(first)["settings_root"] == read_run_record(second)["settings_root"]
    assert (second / "featcal_recipe.yml").read_text().count("# featcal-llm: these settings (") == 1  # one line, not one a replay

    copy = tmp_path / "elsewhere.yml"  # the saved recipe away from its output: not the output's own recipe
    shutil.copy(saved, copy)
    for command in ("validate", "run"):
        for path, output in ((recipe, second), (copy, first)):
            done = _run(command, path, output, "--eval-only")
            assert done.exit_code == 0, done.output
    assert scored == [first, second, second, first]  # the two runs, then the two --eval-only runs

    third = tmp_path / "third"  # a replay of the replay
    assert _run("run", "-q", second / "featcal_recipe.yml", third).exit_code == 0
    assert _run("run", recipe, third, "--eval-only").exit_code == 0 and scored[-1] == third

    edited = tmp_path / "edited.yml"
    edited.write_text(saved.read_text().replace("eps: 1.0e-08", "eps: 1.0e-07"))
    assert edited.read_text() != saved.read_text()
    fourth = tmp_path / "fourth"
    assert _run("run", "-q", edited, fourth).exit_code == 0
    assert (fourth / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    evaluated = len(scored)
    for command in ("validate", "run"):
        refused = _run(command, recipe, fourth, "--eval-only")
        assert refused.exit_code == 2 and "featcal-llm: error: " + (
            f"{recipe}: --eval-only (eval_only=True): {fourth} was made from other settings than the "
            "recipe's now (featcal.data, featcal.dtype, featcal.eps, featcal.stats_dtype); run the recipe without "
            "--eval-only to calibrate with them, or put them back") in refused.stderr.splitlines(), refused.output
    assert len(scored) == evaluated  # refused before scoring

    # An output an earlier version wrote records no root: the settings alone decide, as they did.
    record = json.loads((second / "featcal_weights.json").read_text())
    del record["settings_root"]
    (second / "featcal_weights.json").write_text(json.dumps(record))
    refused = _run("validate", recipe, second, "--eval-only")
    assert refused.exit_code == 2 and "(featcal.data, featcal.dtype, featcal.stats_dtype)" in refused.stderr


def test_a_saved_recipe_that_resolved_nothing_has_no_replay_line(small, tmp_path):
    """Every setting written as it ran (the precisions, the data files given in full): the saved recipe has the recipe's
    settings, so it names none it replays."""
    output = tmp_path / "out"
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(output), dtype="float32", stats_dtype="float64")
    assert _run("run", "-q", recipe).exit_code == 0
    saved = yaml.safe_load((output / "featcal_recipe.yml").read_text())
    assert "featcal-llm: these settings" not in (output / "featcal_recipe.yml").read_text()
    assert saved["featcal"]["dtype"] == "float32" and saved["featcal"]["stats_dtype"] == "float64"


def test_an_output_written_before_teachers_best_is_scored_under_teachers_own(small, tmp_path, monkeypatch, scored):
    """`teachers:` came later, and its setting counts only where it is not `own`: an output whose record has no
    `featcal.teachers` digest (an earlier version's, made with every expert teaching its records) is scored under a
    recipe that says `teachers: own`, and refused under today's default, `best`, naming that setting."""
    monkeypatch.chdir(tmp_path)
    evaluate = {"tasks": ["arc_challenge"], "backend": {"name": "hf"}}
    output = tmp_path / "out"
    own = small.write_recipe(tmp_path / "own.yaml", output=str(output), teachers="own", eval=evaluate)
    assert _run("run", "-q", own).exit_code == 0
    record = json.loads((output / "featcal_weights.json").read_text())
    assert "featcal.teachers" not in record["made_from"]
    del record["settings_root"]  # as an earlier version wrote it: no root, no teachers digest
    (output / "featcal_weights.json").write_text(json.dumps(record))
    assert _run("validate", own, output, "--eval-only").exit_code == 0
    default = small.write_recipe(tmp_path / "default.yaml", output=str(output), eval=evaluate, teachers=None)  # not written
    refused = _run("validate", default, output, "--eval-only")
    assert refused.exit_code == 2 and "recipe's now (featcal.teachers)" in refused.stderr, refused.output
