"""Engine behaviour beyond exactness: batching invariance, limits, round trips (issue 2, proofs 2-4)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors import safe_open
from test_exactness import load, read_weights, relative_error
from transformers import AutoModelForCausalLM, AutoTokenizer

from featcal_llm.pipeline import run_recipe
from featcal_llm.tiny import build_char_tokenizer, save_model
from featcal_llm.io.run_record import read_run_record


def test_batching_and_padding_do_not_change_the_result(scenario, tmp_path):
    single = run_recipe(scenario.write_recipe(tmp_path / "a.yaml", output=str(tmp_path / "single"), batch_tokens=1), progress=False)
    mixed = run_recipe(scenario.write_recipe(tmp_path / "b.yaml", output=str(tmp_path / "mixed"), batch_tokens=4096), progress=False)
    first, second = read_weights(single), read_weights(mixed)
    worst = max(relative_error(second[n], first[n]) for n in first)
    print(f"batch 1 vs batches of up to 4096 padded tokens: worst relative difference {worst:.2e}")
    assert worst <= 1e-5


def test_large_lambda_gives_the_anchor(scenario, tmp_path):
    rho = 0.7
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **{"lambda": 1e12, "rho": rho}), progress=False)
    ours, merged, base = read_weights(output), read_weights(scenario.root / "merged"), read_weights(scenario.base)
    projections = [n for n in ours if n.endswith("proj.weight")]
    assert len(projections) == 3 * 7
    for name in projections:
        anchor = rho * merged[name].double() + (1 - rho) * base[name].double()
        assert relative_error(ours[name], anchor) <= 1e-6, name
        assert relative_error(ours[name], merged[name]) > 1e-3  # the anchor really differs from the merge


def test_experts_equal_to_merged_and_base_leave_the_weights_unchanged(scenario, tmp_path):
    recipe = yaml.safe_load(scenario.recipe.read_text())
    copies = [tmp_path / f"copy{i}" for i in range(3)]  # two experts and their merge, each the base
    for copy in copies:
        shutil.copytree(scenario.base, copy)
    recipe["models"] = [{"model": str(c), "parameters": {"weight": 0.5}} for c in copies[:2]]
    recipe["featcal"].update(
        merged=str(copies[2]), output=str(tmp_path / "out"), eps=1e-12, **{"lambda": 1e-4},
        data={str(c): {"path": str(p), "format": "text"} for c, p in zip(copies[:2], scenario.data.values())},
    )
    path = tmp_path / "identity.yaml"
    path.write_text(yaml.safe_dump(recipe))
    ours, base = read_weights(run_recipe(path, progress=False)), read_weights(scenario.base)
    worst = max(relative_error(ours[n], base[n]) for n in ours)
    print(f"experts = merged = base: worst relative change {worst:.2e}")
    # exact in exact arithmetic but for the eps ridge, which shrinks by at most eps / lambda = 1e-8
    assert worst <= 1e-6


@pytest.fixture(scope="module")
def bf16_sharded(scenario, tmp_path_factory):
    """A bfloat16 merged checkpoint in many shards, to check the output keeps its layout."""
    root = tmp_path_factory.mktemp("bf16")
    merged = load(scenario.root / "merged") if (scenario.root / "merged").exists() else load(scenario.base)
    save_model(merged, build_char_tokenizer(), root / "merged", max_shard_size="30KB", dtype=torch.bfloat16)
    output = run_recipe(scenario.write_recipe(root / "r.yaml", merged=str(root / "merged"), output=str(root / "out")), progress=False)
    return root / "merged", output


def _layout(directory):
    layout = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                layout[name] = (file.name, tuple(tensor.get_shape()), tensor.get_dtype())
    return layout


def test_output_keeps_names_shapes_dtypes_and_shards(bf16_sharded):
    merged, output = bf16_sharded
    assert len(list(merged.glob("*.safetensors"))) > 3
    assert _layout(output) == _layout(merged)
    assert json.loads((output / "model.safetensors.index.json").read_text())["weight_map"] == json.loads((merged / "model.safetensors.index.json").read_text())["weight_map"]
    for side_file in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (output / side_file).read_bytes() == (merged / side_file).read_bytes()


def test_output_loads_with_transformers_and_generates(bf16_sharded):
    _, output = bf16_sharded
    model = AutoModelForCausalLM.from_pretrained(output)
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert model.dtype == torch.bfloat16
    ids = tokenizer("the merge", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 5)


def test_model_card_has_front_matter_and_the_recipe(bf16_sharded):
    _, output = bf16_sharded
    text = (output / "README.md").read_text()
    front = yaml.safe_load(text.split("---")[1])
    assert front["tags"] == ["merge", "mergekit", "featcal"]
    assert "base_model" not in front  # a local base is no hub id; the card names it by its short name
    assert "featcal" not in front  # the run's record is featcal_weights.json
    run = read_run_record(output)
    assert run["base_model"] == "base"
    assert len(run["experts"]) == 3
    assert run["hyperparameters"]["lambda"] == 1e-3
    assert "featcal:" in (output / "featcal_recipe.yml").read_text()


def test_recipe_without_merged_model_is_merged_by_mergekit_first(scenario, tmp_path):
    merged = tmp_path / "merged-here"
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", merged=str(merged), output=str(tmp_path / "out")), progress=False)
    assert (merged / "config.json").is_file() and output.is_dir()
    assert "featcal:" in (merged / "mergekit_config.yml").read_text()
    # mergekit's task arithmetic: base + 0.5 Σ (expert - base), checked tensor by tensor
    base = read_weights(scenario.base)
    experts = [read_weights(p) for p in scenario.experts.values()]
    ours = read_weights(merged)
    name = "model.layers.1.mlp.down_proj.weight"
    expected = base[name] + 0.5 * sum(e[name] - base[name] for e in experts)
    assert torch.allclose(ours[name], expected, atol=1e-6)


def test_mergekit_yaml_accepts_the_recipe_with_the_featcal_block(scenario, tmp_path):
    out = tmp_path / "mk"
    result = subprocess.run(
        [str(__import__("pathlib").Path(sys.executable).parent / "mergekit-yaml"), str(scenario.recipe), str(out), "--no-write-model-card"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "config.json").is_file()
    from mergekit.config import MergeConfiguration

    raw = yaml.safe_load(scenario.recipe.read_text())
    assert "featcal" in raw
    MergeConfiguration.model_validate(raw)


def test_streams_spilled_to_disk_give_identical_weights(merged_scenario, tmp_path):
    in_ram = run_recipe(merged_scenario.write_recipe(tmp_path / "a.yaml", output=str(tmp_path / "ram")), progress=False)
    spilled = run_recipe(merged_scenario.write_recipe(tmp_path / "b.yaml", output=str(tmp_path / "disk"), host_memory_gb=1e-6), progress=False)
    first, second = read_weights(in_ram), read_weights(spilled)
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert not (tmp_path / ".disk.featcal-partial").exists()


def test_host_store_spills_beyond_its_budget(tmp_path):
    from featcal_llm.engine.streams import HostStore

    store = HostStore(budget_bytes=1000, spill_dir=tmp_path / "spill", pin=False)
    small = store.allocate((10, 10), torch.float32)  # 400 bytes: RAM
    large = store.allocate((20, 20), torch.float32)  # 1600 bytes: over budget, spilled
    assert store.in_ram == 400 and store.spilled == 1600
    large.fill_(2.0)
    small.fill_(1.0)
    assert float(large.sum()) == 800.0 and list((tmp_path / "spill").iterdir()) == []  # unlinked, still mapped
    del small
    import gc

    gc.collect()
    assert store.in_ram == 0


def test_bfloat16_compute_stays_close_to_float32(merged_scenario, tmp_path):
    """The GPU default (bf16 forward passes, float32 statistics) on CPU: same weights to bf16 accuracy."""
    reference = read_weights(run_recipe(merged_scenario.write_recipe(tmp_path / "a.yaml", output=str(tmp_path / "f32")), progress=False))
    half = read_weights(
        run_recipe(merged_scenario.write_recipe(tmp_path / "b.yaml", output=str(tmp_path / "bf16"), dtype="bfloat16", stats_dtype="float32"), progress=False)
    )
    errors = {n: relative_error(half[n], reference[n]) for n in reference if "proj" in n}
    worst = max(errors.values())
    print(f"bf16 compute vs float32: worst relative difference {worst:.2e}")
    assert 0 < worst <= 5e-2
    assert all(half[n].dtype == reference[n].dtype for n in reference)
