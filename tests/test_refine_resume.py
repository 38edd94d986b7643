"""`refine:` stopped and rerun: a resume mid-refinement writes the uninterrupted bytes; changed settings, a lost best
state and saved teachers of another top-k start over as much as they must, and the saved recipe replays (the shared
runs: refine_scenario.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from refine_scenario import REFINE, run


def killed_after_check(scenario, name: str, refine: dict, at: int, monkeypatch) -> Path:
    """Run `name` and kill it right after its held-out check at step `at`, as a crash would; its staging area."""
    import featcal_llm.engine.refine as refine_module

    def crash(step, saved):
        if step == 2:
            assert saved  # the first check always saves
        if step == at:
            raise RuntimeError(f"killed after step {at}")

    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "after_check", crash)
        with pytest.raises(RuntimeError, match=f"killed after step {at}"):
            run(scenario, name, refine=refine)
    return scenario.root / f".{name}.featcal-partial"


def test_resume_mid_refinement_writes_the_same_bytes(far_scenario, refined, monkeypatch):
    import featcal_llm.engine.refine as refine_module

    settings, whole = REFINE, refined
    # the step written comes after the crash: the resumed steps (optimizer, schedule, order restored) decide the bytes
    assert json.loads((whole / "featcal_refine.json").read_text())["chosen_step"] > 2

    partial = killed_after_check(far_scenario, "resumed", settings, 2, monkeypatch)
    assert (partial / "pass-refine.pt").is_file() and not (far_scenario.root / "resumed").exists()
    saved = torch.load(partial / "pass-refine.pt", weights_only=True)  # the best state lives in its own file, written once
    assert saved["best"] is None and saved["best_step"] == 2
    assert [p.name for p in partial.glob("pass-refine-best-*")] == ["pass-refine-best-2.pt"]
    calls, step = [], refine_module.train_step
    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "train_step", lambda *a, **k: calls.append(1) or step(*a, **k))
        resumed = run(far_scenario, "resumed", refine=settings)
    assert len(calls) == json.loads((whole / "featcal_refine.json").read_text())["steps_run"] - 2  # only the steps after the check
    differ = sorted(path.name for path in whole.iterdir() if path.read_bytes() != (resumed / path.name).read_bytes())
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in whole.iterdir())
    assert differ == ["README.md", "featcal_recipe.yml"], differ  # the card and the recipe name the output (refined, resumed)


def test_a_best_state_lost_from_the_saved_progress_starts_the_refinement_over(far_scenario, refined, monkeypatch, capsys):
    """The progress names a best state whose file is gone (removed by hand, a damaged disk): the rerun says so and
    refines again from the calibrated layers, to the uninterrupted run's bytes (it had refused, advising a --force
    that never clears the progress)."""
    import featcal_llm.engine.refine as refine_module

    partial = killed_after_check(far_scenario, "lost", REFINE, 2, monkeypatch)
    (partial / "pass-refine-best-2.pt").unlink()
    calls, step = [], refine_module.train_step
    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "train_step", lambda *a, **k: calls.append(1) or step(*a, **k))
        resumed = run(far_scenario, "lost", refine=REFINE)
    assert "the saved progress names step 2 as best, but its state is missing" in capsys.readouterr().err
    assert len(calls) == json.loads((refined / "featcal_refine.json").read_text())["steps_run"]  # every step again
    assert (resumed / "model.safetensors").read_bytes() == (refined / "model.safetensors").read_bytes()


def test_a_changed_refine_setting_keeps_the_layers_and_refines_again(far_scenario, monkeypatch, capsys):
    """Killed in its refinement (as by running out of memory) and rerun with `gradient_checkpointing: true`: the calibrated
    layers and the teachers are reused, the refinement starts over under its new settings, and the bytes are those of a
    fresh run with them."""
    import featcal_llm.engine.calibrate as calibrate_module
    import featcal_llm.engine.refine as refine_module

    partial = killed_after_check(far_scenario, "changed", REFINE, 4, monkeypatch)
    assert (partial / "pass-refine.pt").is_file() and list(partial.glob("pass-refine-best-*"))
    changed = {**REFINE, "gradient_checkpointing": True}
    capsys.readouterr()
    with monkeypatch.context() as patch:  # killed again before its first step: none of the old progress is left to mix in
        patch.setattr(refine_module, "train_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed at step 1")))
        with pytest.raises(RuntimeError, match="killed at step 1"):
            run(far_scenario, "changed", refine=changed)
    assert "its settings changed since the saved progress, so it starts over" in capsys.readouterr().err
    assert sorted(p.name for p in partial.glob("pass-refine*")) == ["pass-refine-teachers.pt"]
    layers, steps = [], []
    fit, step = calibrate_module.calibrate_layer, refine_module.train_step
    with monkeypatch.context() as patch:
        patch.setattr(calibrate_module, "calibrate_layer", lambda *a, **k: layers.append(1) or fit(*a, **k))
        patch.setattr(refine_module, "train_step", lambda *a, **k: steps.append(1) or step(*a, **k))
        resumed = run(far_scenario, "changed", refine=changed)
    err = capsys.readouterr().err
    assert layers == [] and "the teachers' distributions reused" in err
    report = json.loads((resumed / "featcal_refine.json").read_text())
    assert report["gradient_checkpointing"] is True and len(steps) == report["steps_run"] > 4  # from step 0, not step 4
    fresh = run(far_scenario, "changed-fresh", refine=changed)
    assert (resumed / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()


def test_keep_layers_lets_a_rerun_with_another_lr_refine_from_the_calibrated_layers(far_scenario, monkeypatch, capsys):
    """`run --keep-layers`: the finished run keeps its saved progress and says so; the rerun into the same output with
    another `lr` calibrates no layer and computes no teacher again, writes a fresh run's bytes and, without the flag,
    removes the progress. Without `refine:` the flag is refused in one line, before any work."""
    import featcal_llm.engine.calibrate as calibrate_module
    import featcal_llm.engine.refine as refine_module
    from featcal_llm.api import calibrate
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.output_dir import partial_dir
    from featcal_llm.pipeline import run_recipe

    recipe = far_scenario.write_recipe(far_scenario.root / "kept.yaml", output=str(far_scenario.root / "kept"), refine=REFINE)
    output = run_recipe(recipe, force=True, progress=False, keep_layers=True)
    partial = partial_dir(output)
    assert re.search(rf"kept {re.escape(str(partial))} \(\d+\.\d\d GiB\): rerunning this recipe into {re.escape(str(output))} "
                     r"\(with --force, or after moving it aside\) with other refine: settings starts from its calibrated layers",
                     " ".join(capsys.readouterr().err.split()))
    assert (partial / "pass-refine-teachers.pt").is_file() and (output / "model.safetensors").is_file()
    # what no rerun with other settings reads is not kept: the refinement's progress, its best state, its tensors
    assert not (partial / "pass-refine.pt").exists() and not list(partial.glob("pass-refine-best-*")) and not (partial / "refine").exists()
    slower = {**REFINE, "lr": 1e-4}
    again = far_scenario.write_recipe(far_scenario.root / "kept-slower.yaml", output=str(output), refine=slower)
    layers, teachers = [], []
    fit, teach = calibrate_module.calibrate_layer, refine_module.teach
    with monkeypatch.context() as patch:
        patch.setattr(calibrate_module, "calibrate_layer", lambda *a, **k: layers.append(1) or fit(*a, **k))
        patch.setattr(refine_module, "teach", lambda *a, **k: teachers.append(1) or teach(*a, **k))
        rerun = run_recipe(again, force=True, progress=False)
    assert layers == [] and teachers == [] and not partial.exists()
    assert json.loads((rerun / "featcal_refine.json").read_text())["lr"] == 1e-4
    fresh = run(far_scenario, "kept-fresh", refine=slower)
    assert (rerun / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    bare = far_scenario.write_recipe(far_scenario.root / "bare.yaml", output=str(far_scenario.root / "bare"))
    with pytest.raises(FeatCalError) as error:
        calibrate(bare, keep_layers=True, progress=False)
    line = f"{bare}: --keep-layers (keep_layers=True): featcal has no refine: block;"
    assert str(error.value).startswith(line) and "\n" not in str(error.value)
    assert not (far_scenario.root / "bare").exists()
    from click.testing import CliRunner

    from featcal_llm.cli import main

    checked = CliRunner().invoke(main, ["validate", str(bare), "--keep-layers"])  # what run refuses, validate refuses
    assert checked.exit_code == 2 and line in checked.output, checked.output


def test_teachers_saved_at_another_top_k_are_computed_again(far_scenario, monkeypatch, capsys):
    """The teachers' saved top-k distributions hold `top_k` tokens a position: a rerun asking for fewer computes them
    again (reusing them would train on a KL over other bins), to the bytes of a fresh run at the new top_k."""
    killed_after_check(far_scenario, "topk", REFINE, 2, monkeypatch)
    fewer = {**REFINE, "top_k": 16}
    capsys.readouterr()
    resumed = run(far_scenario, "topk", refine=fewer)
    err = capsys.readouterr().err
    assert "the teachers' distributions reused" not in err and "the teachers' top-16 next-token distributions" in err
    fresh = run(far_scenario, "topk-fresh", refine=fewer)
    assert (resumed / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()


def test_progress_saved_under_other_settings_is_forgotten_whole(tmp_path):
    """The old progress and every old best state go before a refinement starts over: a best state of the same step
    written under other settings must never be read back as the new run's."""
    from featcal_llm.engine.refine_progress import best_pass, forget_progress
    from featcal_llm.engine.resume import StagingArea

    staging = StagingArea(tmp_path / "partial", "fingerprint")
    for name in ("refine", best_pass(2), best_pass(4), "refine-teachers"):
        staging.save_pass(name, {"step": 0})
    forget_progress(staging)
    assert sorted(p.name for p in staging.root.glob("pass-*")) == ["pass-refine-teachers.pt"]


def test_a_crash_after_an_unsaved_check_resumes_from_the_last_save(far_scenario, refined, monkeypatch):
    """Saves only at the first check (as when saving is slow against the steps): killed after the check at step 4, which
    found a new best but saved nothing, the rerun resumes after step 2 and still writes the unbroken run's bytes."""
    import featcal_llm.engine.refine as refine_module
    import featcal_llm.engine.refine_progress as progress_module

    whole = json.loads((refined / "featcal_refine.json").read_text())
    assert [h["step"] for h in whole["history"]] == [0, 2, 4, 6] and whole["chosen_step"] >= 4
    seen = []

    def crash(step, saved):
        seen.append((step, saved))
        if step == 4:
            raise RuntimeError("killed after step 4")

    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "after_check", crash)
        patch.setattr(progress_module, "save_due", lambda since, cost, share=0.1: since is None)
        with pytest.raises(RuntimeError, match="killed after step 4"):
            run(far_scenario, "unsaved", refine=REFINE)
    assert seen == [(2, True), (4, False)]
    partial = far_scenario.root / ".unsaved.featcal-partial"
    assert torch.load(partial / "pass-refine.pt", weights_only=True)["step"] == 2
    calls, step = [], refine_module.train_step
    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "train_step", lambda *a, **k: calls.append(1) or step(*a, **k))
        resumed = run(far_scenario, "unsaved", refine=REFINE)
    assert len(calls) == whole["steps_run"] - 2
    assert (resumed / "model.safetensors").read_bytes() == (refined / "model.safetensors").read_bytes()


def test_the_saved_recipe_pins_refines_machine_dependent_choices_and_replays_elsewhere(far_scenario, monkeypatch):
    """`params: auto` (the device's memory) and `precision: auto` (native bf16 or not) are written out as this run
    resolved them: the replay on a machine that would resolve precision the other way writes the same bytes."""
    import featcal_llm.engine.refine as refine_module
    from featcal_llm.engine.devices import native_bf16
    from featcal_llm.io.saved_recipe import REFINE_NOTE
    from featcal_llm.pipeline import run_recipe

    settings = {key: value for key, value in REFINE.items() if key not in ("params", "precision")}
    output = run(far_scenario, "pinned", refine={**settings, "steps": 2, "eval_every": 2})
    report = json.loads((output / "featcal_refine.json").read_text())
    saved = (output / "featcal_recipe.yml").read_text()
    resolved = "bfloat16" if report["autocast"] == "bfloat16" else "float32"
    assert REFINE_NOTE in saved and saved.startswith("# Written by featcal-llm")
    assert yaml.safe_load(saved)["featcal"]["refine"] == {**settings, "steps": 2, "eval_every": 2, "params": report["params"], "precision": resolved}
    monkeypatch.setattr(refine_module, "native_bf16", lambda device: not native_bf16(device))  # the other kind of machine
    replay = yaml.safe_load(saved)
    replay["featcal"]["output"] = str(far_scenario.root / "pinned-replay")
    (far_scenario.root / "pinned-replay.yaml").write_text(yaml.safe_dump(replay, sort_keys=False))
    again = run_recipe(far_scenario.root / "pinned-replay.yaml", force=True, progress=False)
    assert json.loads((again / "featcal_refine.json").read_text())["autocast"] == report["autocast"]
    assert (again / "model.safetensors").read_bytes() == (output / "model.safetensors").read_bytes()
