"""Fault injection at every point where work is reused (docs/reuse.md): a change that matters redoes or refuses it, one that does not keeps it.

Reuse points: the merged model, generated sample sets, saved layers (resume), the evaluation cache and
spilled hidden-state streams. For each, one input that changes the result is changed (reuse refused or
redone) and one that does not is changed (a touch without new content, a moved directory: still reused).
Full or read-only disks are simulated by a write that raises OSError (root ignores chmod).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from featcal_llm.errors import FeatCalError
from featcal_llm.io import merge as merge_module
from featcal_llm.io.merge import ensure_merged
from featcal_llm.io.recipe import load_recipe
from featcal_llm.pipeline import run_recipe

MARKER, MERGEKIT_CONFIG = "featcal_merge.json", "mergekit_config.yml"  # what featcal-llm and mergekit leave in a merge


def _recipe(scenario, path: Path, weight: float = 0.5, **featcal) -> Path:
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["models"][0]["parameters"]["weight"] = weight
    recipe["featcal"].update(featcal)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _touch(directory: Path) -> None:
    later = time.time() + 100
    for item in directory.iterdir():
        os.utime(item, (later, later))


def _perturb(directory: Path) -> None:
    for shard in sorted(directory.glob("*.safetensors"))[:1]:
        tensors = load_file(shard)
        name = next(iter(tensors))
        tensors[name] = tensors[name] + 1e-3
        save_file(tensors, shard, metadata={"format": "pt"})


# --- the merged model --------------------------------------------------------------------------------------------


def test_a_merge_made_by_featcal_from_another_configuration_is_merged_again(reuse_scenario, tmp_path, capsys):
    merged = tmp_path / "merged"
    ensure_merged(load_recipe(_recipe(reuse_scenario, tmp_path / "a.yaml", merged=str(merged))), merged, "cpu")
    assert (merged / MARKER).is_file() and (merged / MERGEKIT_CONFIG).is_file()
    capsys.readouterr()
    changed = load_recipe(_recipe(reuse_scenario, tmp_path / "b.yaml", weight=0.2, merged=str(merged)))
    ensure_merged(changed, merged, "cpu")
    log = capsys.readouterr().err
    assert "was made from other inputs than the recipe's (differs in models[0].parameters.weight); merging again" in log
    reference = tmp_path / "reference"
    ensure_merged(load_recipe(_recipe(reuse_scenario, tmp_path / "c.yaml", weight=0.2, merged=str(reference))), reference, "cpu")
    ours, theirs = load_file(merged / "model.safetensors"), load_file(reference / "model.safetensors")
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)


def test_a_rerun_with_force_after_editing_a_merge_weight_calibrates_the_new_merge(reuse_scenario, tmp_path, capsys):
    """The edited recipe's run equals a run of it from scratch (its own fresh merge), not a calibration of the old merge."""
    recipe = _recipe(reuse_scenario, tmp_path / "r.yaml", merged=str(tmp_path / "merged"), output=str(tmp_path / "out"))
    run_recipe(recipe, progress=False)
    recipe = _recipe(reuse_scenario, tmp_path / "r.yaml", weight=0.2, merged=str(tmp_path / "merged"), output=str(tmp_path / "out"))
    run_recipe(recipe, force=True, progress=False)
    log = capsys.readouterr().err
    fresh = run_recipe(_recipe(reuse_scenario, tmp_path / "f.yaml", weight=0.2, merged=str(tmp_path / "m2"), output=str(tmp_path / "fresh")), progress=False)
    ours, theirs = load_file(tmp_path / "out" / "model.safetensors"), load_file(fresh / "model.safetensors")
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    assert "merging again" in log
    assert "weight: 0.2" in (tmp_path / "out" / "featcal_recipe.yml").read_text()


def test_a_merge_the_user_supplied_from_another_configuration_is_refused_naming_the_keys(reuse_scenario, tmp_path):
    merged = tmp_path / "merged"
    ensure_merged(load_recipe(_recipe(reuse_scenario, tmp_path / "a.yaml", merged=str(merged))), merged, "cpu")
    (merged / MARKER).unlink()  # made by mergekit-yaml, say
    getattr(merge_module, "_settled", {}).clear()  # a new process
    changed = load_recipe(_recipe(reuse_scenario, tmp_path / "b.yaml", weight=0.2, merged=str(merged)))
    with pytest.raises(FeatCalError) as refused:
        ensure_merged(changed, merged, "cpu")
    message = str(refused.value)
    assert "\n" not in message and "differs in models[0].parameters.weight)" in message and str(merged) in message


def test_a_merge_without_its_configuration_is_used_with_a_warning(reuse_scenario, tmp_path, capsys):
    merged = tmp_path / "merged"
    ensure_merged(load_recipe(_recipe(reuse_scenario, tmp_path / "a.yaml", merged=str(merged))), merged, "cpu")
    (merged / MERGEKIT_CONFIG).unlink()
    (merged / MARKER).unlink()
    getattr(merge_module, "_settled", {}).clear()
    before = (merged / "model.safetensors").read_bytes()
    ensure_merged(load_recipe(_recipe(reuse_scenario, tmp_path / "b.yaml", weight=0.2, merged=str(merged))), merged, "cpu")
    assert "cannot be checked" in capsys.readouterr().err
    assert (merged / "model.safetensors").read_bytes() == before


def test_a_moved_and_touched_merge_of_the_same_configuration_is_reused(reuse_scenario, tmp_path, capsys, monkeypatch):
    merged = tmp_path / "merged"
    ensure_merged(load_recipe(_recipe(reuse_scenario, tmp_path / "a.yaml", merged=str(merged))), merged, "cpu")
    moved = tmp_path / "elsewhere" / "merged"
    moved.parent.mkdir()
    shutil.move(merged, moved)
    _touch(moved)
    monkeypatch.setattr(merge_module, "_merge", lambda *a, **k: pytest.fail("merged again"), raising=False)
    ensure_merged(load_recipe(_recipe(reuse_scenario, tmp_path / "b.yaml", merged=str(moved))), moved, "cpu")
    assert f"reusing {moved}" in capsys.readouterr().err


def test_a_merge_featcal_made_is_reused_for_a_moved_expert_and_merged_again_when_its_files_change(reuse_scenario, tmp_path, capsys):
    expert = tmp_path / "experts" / "expert0"
    shutil.copytree(reuse_scenario.experts["expert0"], expert)
    recipe = _recipe(reuse_scenario, tmp_path / "a.yaml", merged=str(tmp_path / "merged"))
    recipe.write_text(recipe.read_text().replace(str(reuse_scenario.experts["expert0"]), str(expert)))
    ensure_merged(load_recipe(recipe), tmp_path / "merged", "cpu")
    getattr(merge_module, "_settled", {}).clear()  # a new process
    _touch(expert)
    moved = tmp_path / "moved" / "expert0"  # the same files elsewhere: the same model
    shutil.move(expert.parent, moved.parent)
    recipe.write_text(recipe.read_text().replace(str(expert), str(moved)))
    expert = moved
    ensure_merged(load_recipe(recipe), tmp_path / "merged", "cpu")
    assert "reusing" in capsys.readouterr().err
    getattr(merge_module, "_settled", {}).clear()
    _perturb(expert)
    ensure_merged(load_recipe(recipe), tmp_path / "merged", "cpu")
    assert "(differs in models[0].model); merging again" in capsys.readouterr().err
    base = tmp_path / "base"  # the base too is judged by its files, not by its path
    shutil.copytree(reuse_scenario.base, base)
    recipe.write_text(recipe.read_text().replace(str(reuse_scenario.base), str(base)))
    ensure_merged(load_recipe(recipe), tmp_path / "merged", "cpu")
    assert "reusing" in capsys.readouterr().err
    getattr(merge_module, "_settled", {}).clear()
    _perturb(base)
    ensure_merged(load_recipe(recipe), tmp_path / "merged", "cpu")
    assert "(differs in base_model); merging again" in capsys.readouterr().err


def test_configurations_that_differ_in_how_many_models_differ():
    from featcal_llm.io.merge_identity import differing_keys

    one, two = {"model": "a", "parameters": {"weight": 0.5}}, {"model": "b", "parameters": {"weight": 0.5}}
    assert differing_keys({"models": [one, two]}, {"models": [one]}) == ["models"]
    assert differing_keys({"models": [one, two]}, {"models": [one, {**two, "model": "c"}]}) == ["models[1].model"]


# --- saved layers (resume) and spilled streams ---------------------------------------------------------------------


def _crash_at_layer(monkeypatch, at: int):
    import featcal_llm.engine.calibrate as calibrate

    real = calibrate.calibrate_layer

    def crashing(ctx, layer, tensors):
        if layer == at:
            raise RuntimeError("injected crash")
        return real(ctx, layer, tensors)

    monkeypatch.setattr(calibrate, "calibrate_layer", crashing)


def test_saved_layers_survive_a_touch_and_a_moved_merge_but_not_a_changed_expert(reuse_scenario, tmp_path, monkeypatch, capsys):
    merged = tmp_path / "merged"
    recipe = _recipe(reuse_scenario, tmp_path / "r.yaml", merged=str(merged), output=str(tmp_path / "out"))
    experts = tmp_path / "experts"
    shutil.copytree(reuse_scenario.experts["expert0"], experts / "expert0")  # an expert this test may change
    text = recipe.read_text().replace(str(reuse_scenario.experts["expert0"]), str(experts / "expert0"))
    recipe.write_text(text)
    _crash_at_layer(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="injected"):
        run_recipe(recipe, progress=False)
    capsys.readouterr()
    _touch(experts / "expert0")  # new mtimes, same bytes
    shutil.move(merged, tmp_path / "merged2")  # the merge moved (the recipe follows it)
    recipe.write_text(text.replace(str(merged), str(tmp_path / "merged2")))
    with pytest.raises(RuntimeError, match="injected"):
        run_recipe(recipe, progress=False)
    assert "resuming from" in capsys.readouterr().err
    _perturb(experts / "expert0")  # new bytes
    monkeypatch.undo()
    run_recipe(recipe, progress=False)
    err = capsys.readouterr().err
    assert "starting over" in err and "resuming" not in err


def test_spilled_streams_are_never_reused(reuse_scenario, tmp_path, monkeypatch):
    """Streams spill to files under the run's partial directory; a rerun rebuilds them (replaying saved layers) and ignores leftovers."""
    clean = run_recipe(_recipe(reuse_scenario, tmp_path / "clean.yaml", merged=str(tmp_path / "merged"), output=str(tmp_path / "clean")), progress=False)
    recipe = _recipe(reuse_scenario, tmp_path / "r.yaml", merged=str(tmp_path / "merged"), output=str(tmp_path / "out"), host_memory_gb=1e-9)
    _crash_at_layer(monkeypatch, 1)
    with pytest.raises(RuntimeError):
        run_recipe(recipe, progress=False)
    spill = tmp_path / ".out.featcal-partial" / "spill"
    spill.mkdir(parents=True, exist_ok=True)
    (spill / "batch-0.bin").write_bytes(os.urandom(4096))  # a leftover that must not be read
    monkeypatch.undo()
    run_recipe(recipe, progress=False)
    assert load_file(tmp_path / "out" / "model.safetensors").keys() == load_file(clean / "model.safetensors").keys()
    ours, theirs = load_file(tmp_path / "out" / "model.safetensors"), load_file(clean / "model.safetensors")
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    assert not (tmp_path / ".out.featcal-partial").exists()


# --- full and read-only disks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_fails_in_one_line_and_the_rerun_resumes(reuse_scenario, tmp_path, monkeypatch, capsys, code):
    import featcal_llm.engine.resume as resume

    recipe = _recipe(reuse_scenario, tmp_path / "r.yaml", merged=str(tmp_path / "merged"), output=str(tmp_path / "out"))
    real, writes = resume.save_file, []

    def failing(tensors, path, *args, **kwargs):  # the second layer's file does not fit / may not be written
        writes.append(path)
        if len(writes) == 2:
            raise OSError(code, os.strerror(code), str(path))
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(resume, "save_file", failing)
    with pytest.raises(FeatCalError) as failed:
        run_recipe(recipe, progress=False)
    assert "\n" not in str(failed.value) and os.strerror(code) in str(failed.value) and "rerun the same command to resume" in str(failed.value)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    run_recipe(recipe, progress=False)
    assert "resuming from" in capsys.readouterr().err and (tmp_path / "out" / "model.safetensors").is_file()


def test_a_full_disk_during_the_merge_leaves_no_merged_directory(reuse_scenario, tmp_path, monkeypatch):
    merged = tmp_path / "merged"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("mergekit.merge.run_merge", full)
    with pytest.raises(FeatCalError, match="No space left on device"):
        ensure_merged(load_recipe(_recipe(reuse_scenario, tmp_path / "a.yaml", merged=str(merged))), merged, "cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.yaml"]


def test_a_merge_of_hub_models_is_judged_by_their_snapshots_files(tmp_path, capsys):
    """Hub references are identified by the snapshot each resolves to (the base's too): the same snapshot reuses a
    merge (one featcal-llm made or one supplied), a new snapshot of an expert merges featcal-llm's own again."""
    from types import SimpleNamespace

    from mergekit.config import MergeConfiguration

    from featcal_llm.io.merge import _stale
    from featcal_llm.io.merge_identity import MARKER, MERGEKIT_CONFIG, input_identities

    def snapshot(name: str, content: bytes) -> SimpleNamespace:
        folder = tmp_path / "hub" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(content)
        return SimpleNamespace(directory=folder, adapter=None)

    text = "merge_method: task_arithmetic\nbase_model: org/base\nmodels:\n  - model: org/expert\n    parameters: {weight: 0.5}\n"
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    recipe = SimpleNamespace(merge_config=config, featcal=SimpleNamespace(merge_seed=0), path="r.yaml", base=config.base_model,
                             experts=[SimpleNamespace(reference=config.models[0].model)])
    sources = {"org/base": snapshot("base", b"base"), "org/expert": snapshot("expert", b"expert")}
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / MERGEKIT_CONFIG).write_text(text)
    assert _stale(recipe, merged, sources) is None  # supplied: the snapshots the recipe resolves to
    (merged / MARKER).write_text(json.dumps({"made_by": "featcal-llm", "inputs": input_identities(recipe, sources)}))
    assert set(json.loads((merged / MARKER).read_text())["inputs"]) == {"org/base", "org/expert"}
    merge_module._settled.clear()
    assert _stale(recipe, merged, sources) is None and "reusing" in capsys.readouterr().err
    merge_module._settled.clear()
    assert _stale(recipe, merged, {**sources, "org/expert": snapshot("expert-v2", b"expert, trained on")}) == ["models[0].model"]


@pytest.mark.parametrize("method, stale", [("task_arithmetic", None), ("dare_ties", ["featcal.merge_options.random_seed"])])
def test_another_merge_seed_merges_again_only_for_a_random_method(tmp_path, capsys, method, stale):
    """A merge featcal-llm drew with seed 1, a recipe now at seed 2: a deterministic method gives the same weights under
    any seed (the merge is reused), a random one (dare_ties) draws other masks (merged again)."""
    from types import SimpleNamespace

    from mergekit.config import MergeConfiguration

    from featcal_llm.io.merge import _stale
    from featcal_llm.io.merge_identity import MARKER, MERGEKIT_CONFIG

    models = {}
    for name in ("base", "expert"):
        models[name] = tmp_path / name
        models[name].mkdir()
        (models[name] / "config.json").write_text("{}")
        (models[name] / "model.safetensors").write_bytes(name.encode())
    density = ", density: 0.5" if method == "dare_ties" else ""
    text = (f"merge_method: {method}\nbase_model: {models['base']}\nmodels:\n  - model: {models['expert']}\n"
            f"    parameters: {{weight: 0.5{density}}}\n")
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    recipe = SimpleNamespace(merge_config=config, featcal=SimpleNamespace(merge_seed=2), path="r.yaml", base=config.base_model,
                             experts=[SimpleNamespace(reference=config.models[0].model)])
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / MERGEKIT_CONFIG).write_text(text)
    (merged / MARKER).write_text(json.dumps({"made_by": "featcal-llm", "random_seed": 1}))
    merge_module._settled.clear()
    assert _stale(recipe, merged, None) == stale
    merge_module._settled.clear()


def test_the_merge_s_lines_are_time_stamped_in_a_log_file_as_every_other_line(reuse_scenario, tmp_path):
    import re

    from featcal_llm import runlog

    merged = tmp_path / "merged"
    recipe = load_recipe(_recipe(reuse_scenario, tmp_path / "a.yaml", merged=str(merged)))
    ensure_merged(recipe, merged, "cpu")
    getattr(merge_module, "_settled", {}).clear()  # a new process
    log = tmp_path / "run.log"
    with runlog.session(log):
        ensure_merged(recipe, merged, "cpu")
    lines = [line for line in log.read_text().splitlines() if "reusing" in line]
    assert len(lines) == 1 and re.fullmatch(r"\d\d:\d\d:\d\d merge: reusing .*", lines[0]), log.read_text()
