"""Probes of precisions and dtypes end to end (checkpoints stored in float32/bf16/fp16, `featcal.dtype`, `stats_dtype`):
what the saved recipe pins, and how float16's range is refused (the defects found, each pinned by a test)."""

from __future__ import annotations

import pytest
import torch
import yaml
from click.testing import CliRunner
from scenario import build_scenario
from transformers import AutoModelForCausalLM

from featcal_llm.cli import main


def _digests(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.glob("*.safetensors"))}


def test_the_saved_recipe_pins_the_precisions_auto_resolved_so_another_machine_replays_the_same_bytes(tmp_path, monkeypatch):
    """A bf16 checkpoint with `dtype: auto` computes in float32 on a CPU without bf16 units and in bf16 on one with
    them (engine/devices.resolve_dtype). featcal_recipe.yml must write out what this run resolved (as it does for a
    tuned run and for refine's precision), keeping the recipe's comments, so that its replay on the other machine
    gives the same bytes."""
    import featcal_llm.engine.devices as devices
    from featcal_llm.pipeline import run_recipe

    scenario = build_scenario(tmp_path / "s", experts=2, layers=2, samples=6, dtype="bfloat16")
    raw = yaml.safe_load(scenario.recipe.read_text())
    raw["featcal"].update(output=str(tmp_path / "first"), dtype="auto")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("# my bf16 merge\n" + yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.setattr(devices, "native_bf16_matmul", lambda: False)  # this machine: no bf16 units, float32 compute
    first = run_recipe(recipe, progress=False)
    saved = (first / "featcal_recipe.yml").read_text()
    assert saved.startswith("# my bf16 merge\n")  # the text as written, its comments kept
    block = yaml.safe_load(saved)["featcal"]
    assert (block["dtype"], block["stats_dtype"]) == ("float32", "float64")  # λ 1e-3 < 1e-2: float64 products
    replay = tmp_path / "replay.yaml"
    replay.write_text(saved.replace(str(tmp_path / "first"), str(tmp_path / "again")))
    monkeypatch.setattr(devices, "native_bf16_matmul", lambda: True)  # the other machine: auto would be bf16 here
    again = run_recipe(replay, progress=False)
    assert _digests(again) == _digests(first)


def _scaled_scenario(root, scale_embeddings: float = 1.0, scale_down: float = 1.0):
    """Base and experts stored in float32 whose values float32 holds but float16 (at most 65504) does not: embeddings
    or the MLPs' down projections scaled; the recipe computes in float16."""
    scenario = build_scenario(root, experts=2, layers=2, samples=4)
    for path in [scenario.base, *scenario.experts.values()]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(scale_embeddings)
            for layer in model.model.layers:
                layer.mlp.down_proj.weight.mul_(scale_down)
        for old in path.glob("model*.safetensors*"):
            old.unlink()
        model.save_pretrained(path)
    return scenario.write_recipe(dtype="float16")


@pytest.mark.parametrize(("where", "code", "coverage"), [("embeddings", 2, False), ("layers", 1, False), ("layers", 1, True)])
def test_float16_overflow_is_refused_naming_featcal_dtype_and_writes_no_output(tmp_path, where, code, coverage):
    """Finite float32 checkpoints whose embeddings (1e6) or hidden states (down_proj × 1e7) pass float16's range: a run
    with `dtype: float16` stops in one line that blames float16 and names the key to change, and writes no output."""
    recipe = _scaled_scenario(tmp_path, **({"scale_embeddings": 1e6} if where == "embeddings" else {"scale_down": 1e7}))
    if coverage:  # the default weighing's pass over the models meets the overflow first
        recipe.write_text(recipe.read_text().replace("expert_weights: equal", "expert_weights: coverage"))
    result = CliRunner().invoke(main, ["run", str(recipe)])
    assert isinstance(result.exception, SystemExit) and result.exit_code == code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("featcal-llm: error: ")]
    assert len(errors) == 1, result.stderr
    assert errors[0].endswith(" in float16 (featcal.dtype: float16 holds at most 65504; set featcal.dtype: bfloat16 or float32)"), errors
    assert not (tmp_path / "featcal").exists()
    if coverage:  # the weighing's pass runs the base first: its layer is named, not "calibrated layer"
        assert errors[0].startswith(f"featcal-llm: error: layer 0: base model {tmp_path / 'base'} produced NaN/Inf hidden states in float16 ("), errors


def test_featcal_values_are_written_in_place_keeping_comments_or_the_block_is_written_out_again():
    """A key written `auto` has its value replaced, a missing one goes above the block's first key at its indentation;
    a flow-style block, or a key given as an alias, is written out again (parsing to the same values)."""
    from featcal_llm.io.recipe_yaml import with_featcal_values

    text = "merge_method: ties  # keep\nfeatcal:\n    # mine\n    output: out   # where\n    dtype: auto  # hw\n"
    assert with_featcal_values(text, {"dtype": "float32", "stats_dtype": "float64"}) == (
        "merge_method: ties  # keep\nfeatcal:\n    # mine\n    stats_dtype: float64\n    output: out   # where\n    dtype: float32  # hw\n")
    for other in ("featcal: {output: o}\n", "x: &a auto\nfeatcal:\n  dtype: *a\n"):
        rewritten = with_featcal_values(other, {"dtype": "bfloat16"})
        assert yaml.safe_load(rewritten)["featcal"] == {**yaml.safe_load(other)["featcal"], "dtype": "bfloat16"}
    assert yaml.safe_load(with_featcal_values("x: &a auto\nfeatcal:\n  dtype: *a\n", {"dtype": "bfloat16"}))["x"] == "auto"
