"""Resume after SIGKILL, determinism, fingerprinted progress, NaN detection (issue 4)."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from scenario import build_scenario

from featcal_llm.cli import main


def tree_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(directory).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def resumes_to_the_same_bytes(recipe: Path, output: Path, crash_layer: int, monkeypatch) -> None:
    """Run the recipe; rerun it crashing before layer `crash_layer`, then resume: the output must be byte-identical."""
    import json

    import pytest

    import featcal_llm.engine.calibrate as calibrate_module
    from featcal_llm.pipeline import run_recipe

    digest = tree_hash(run_recipe(recipe, progress=False))
    real = calibrate_module.calibrate_layer

    def crash(ctx, layer, *args, **kwargs):
        if layer == crash_layer:
            raise RuntimeError("simulated crash")
        return real(ctx, layer, *args, **kwargs)

    monkeypatch.setattr(calibrate_module, "calibrate_layer", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_recipe(recipe, force=True, progress=False)
    monkeypatch.setattr(calibrate_module, "calibrate_layer", real)
    state = json.loads((output.with_name(f".{output.name}.featcal-partial") / "state.json").read_text())
    assert state["completed_layers"] == crash_layer
    run_recipe(recipe, force=True, progress=False)
    assert tree_hash(output) == digest


def run_cli(recipe: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "featcal_llm", "run", str(recipe), *extra], capture_output=True, text=True, timeout=600)


def past_its_first_layer(recipe: Path, state: Path) -> subprocess.Popen:
    """`featcal-llm run recipe` in a process of its own, returned once its saved progress (`state`) counts a layer."""
    process = subprocess.Popen([sys.executable, "-m", "featcal_llm", "run", str(recipe)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if state.exists() and json.loads(state.read_text() or "{}").get("completed_layers", 0) >= 1:
            return process
        assert process.poll() is None, "the run ended before a layer was done"
        time.sleep(0.01)
    raise AssertionError("no layer done in 300 s")


@pytest.fixture(scope="module")
def slow_scenario(tmp_path_factory):
    """Enough layers and tokens that a layer takes a noticeable fraction of a second."""
    scenario = build_scenario(tmp_path_factory.mktemp("slow"), experts=2, layers=4, samples=64, hidden_size=96, intermediate_size=256)
    scenario.write_recipe(batch_tokens=512)
    return scenario


def test_kill_and_rerun_gives_the_same_bytes_as_an_uninterrupted_run(slow_scenario, tmp_path):
    recipe = slow_scenario.write_recipe(tmp_path / "recipe.yaml", output=str(tmp_path / "out"))
    reference = run_cli(recipe)
    assert reference.returncode == 0, reference.stderr[-2000:]
    (tmp_path / "out").rename(tmp_path / "reference")

    state = tmp_path / ".out.featcal-partial" / "state.json"
    process = past_its_first_layer(recipe, state)
    process.send_signal(signal.SIGKILL)
    process.wait()
    completed = json.loads(state.read_text())["completed_layers"]
    assert 1 <= completed < 4, completed
    assert not (tmp_path / "out").exists()

    resumed = run_cli(recipe)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {state.parent}: {completed} of 4 layers already calibrated" in resumed.stderr
    assert tree_hash(tmp_path / "out") == tree_hash(tmp_path / "reference")
    assert not state.parent.exists()


def test_two_runs_produce_identical_bytes(merged_scenario, tmp_path):
    recipe = merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    hashes = []
    for _ in range(2):
        result = CliRunner().invoke(main, ["run", "--force", str(recipe)])
        assert result.exit_code == 0, result.stderr
        hashes.append(tree_hash(tmp_path / "out"))
    assert hashes[0] == hashes[1]


def test_changed_hyperparameter_discards_saved_progress(merged_scenario, tmp_path):
    partial = tmp_path / ".out.featcal-partial"
    partial.mkdir()
    (partial / "state.json").write_text(json.dumps({"fingerprint": "something-else", "completed_layers": 2}))
    (partial / "layers").mkdir()
    result = CliRunner().invoke(main, ["run", str(merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out")))])
    assert result.exit_code == 0, result.stderr
    assert "was made with a different recipe, data, models or settings; starting over" in result.stderr
    assert (tmp_path / "out" / "config.json").is_file()


def test_force_replaces_an_existing_output(merged_scenario, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "featcal_recipe.yml").write_text("an earlier output's")  # --force replaces only those (test_bad_input)
    (output / "old.txt").write_text("old")
    result = CliRunner().invoke(main, ["run", "--force", str(merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(output)))])
    assert result.exit_code == 0, result.stderr
    assert not (output / "old.txt").exists() and (output / "config.json").is_file()


def test_nan_in_expert_weights_names_layer_and_module(merged_scenario, tmp_path):
    expert = tmp_path / "nan-expert"
    source = merged_scenario.experts["expert2"]
    expert.mkdir()
    for item in source.iterdir():
        target = expert / item.name
        if item.suffix == ".safetensors":
            tensors = load_file(item)
            if "model.layers.0.mlp.down_proj.weight" in tensors:
                tensors["model.layers.0.mlp.down_proj.weight"][3, 5] = float("nan")
            save_file(tensors, target, metadata={"format": "pt"})
        else:
            target.write_bytes(item.read_bytes())
    recipe = yaml.safe_load(merged_scenario.recipe.read_text())
    old = recipe["models"][2]["model"]
    recipe["models"][2]["model"] = str(expert)
    recipe["featcal"]["data"][str(expert)] = recipe["featcal"]["data"].pop(old)
    recipe["featcal"]["output"] = str(tmp_path / "out")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 2
    # the recipe now names the NaN expert, so the merge featcal-llm made from the old one is made again, from it:
    # the first model read with NaN in that tensor is the new merge
    last = result.stderr.strip().splitlines()[-1]
    assert "tensor model.layers.0.mlp.down_proj.weight contains NaN or Inf" in last and "merged" in last, last
    assert not (tmp_path / "out").exists()
    # refused at the first layer, before any layer was saved: the staging folder this run made is gone (it left
    # `.out.featcal-partial/` with a state naming no layer and an empty `layers/`; a layer saved before is kept)
    assert not (tmp_path / ".out.featcal-partial").exists()


def test_sigterm_stops_a_run_as_ctrl_c_does_and_the_rerun_resumes(slow_scenario, tmp_path):
    """SIGTERM (SLURM's stop, `docker stop`, `kill`) mid-calibration: exit 143 and the one line that says the work is
    kept, the output's lock released (not merely dropped with the process), the saved layers resumed by the rerun.
    Python's default for SIGTERM ends the process at once: exit -15, no line, nothing cleaned up."""
    from featcal_llm.io.output_lock import lock_path

    recipe = slow_scenario.write_recipe(tmp_path / "recipe.yaml", output=str(tmp_path / "out"))
    state = tmp_path / ".out.featcal-partial" / "state.json"
    process = past_its_first_layer(recipe, state)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (
        "featcal-llm: terminated (SIGTERM); what the run finished (a merge, generated records, calibrated layers, "
        "refinement steps) is kept, and the same command resumes from there")
    assert not lock_path(tmp_path / "out").exists() and not (tmp_path / "out").exists()
    completed = json.loads(state.read_text())["completed_layers"]
    resumed = run_cli(recipe)
    assert resumed.returncode == 0 and f"{completed} of 4 layers already calibrated" in resumed.stderr, resumed.stderr[-2000:]
