"""`head:`: the LM head re-fitted after the last layer, against a brute force on each family's full model forward."""

from __future__ import annotations

import json

import pytest
import torch
from reference import brute_force_featcal, brute_force_head
from test_exactness import TOLERANCE, calibration_sequences, delta_error, load, read_weights

from featcal_llm.errors import FeatCalError
from featcal_llm.pipeline import run_recipe

HEAD = {"lambda": 1e-3, "alpha": 0.7, "rho": 0.4}


def reference_models(scenario):
    def load64(path):
        return load(path, torch.float64)

    merged, base = load64(scenario.root / "merged"), load64(scenario.base)
    experts = {str(p): load64(p) for p in scenario.experts.values()}
    sequences = {str(scenario.experts[n]): s for n, s in calibration_sequences(scenario, 12, 64).items()}
    return merged, base, experts, sequences


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # an untied head; a tied one with (1 + w) norms and soft-capped logits
def test_the_head_update_matches_the_brute_force_and_the_layers_are_unchanged(family_scenarios, family, tmp_path):
    scenario = family_scenarios(family)
    plain = run_recipe(scenario.write_recipe(tmp_path / "plain.yaml", output=str(tmp_path / "plain"), batch_tokens=150, dtype="float64"), progress=False)
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64", head=HEAD), progress=False)
    merged, base, experts, sequences = reference_models(scenario)
    cal = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8)
    expected = brute_force_head(cal, merged, base, experts, sequences, HEAD["lambda"], HEAD["alpha"], HEAD["rho"], 1e-8)
    ours, without = read_weights(output), read_weights(plain)
    merged_head = merged.get_output_embeddings().weight
    error = delta_error(ours["lm_head.weight"], expected, merged_head)
    print(f"{family}: head ΔW relative error {error:.2e}, ‖ΔW‖/‖W‖ {float((expected - merged_head).norm() / merged_head.norm()):.3f}")
    assert error <= TOLERANCE
    assert set(ours) == set(without) | {"lm_head.weight"}
    assert all(torch.equal(ours[name], without[name]) for name in without if name != "lm_head.weight")  # the layers: as without head
    config = json.loads((output / "config.json").read_text())
    model = load(output, torch.float64)
    assert torch.equal(model.get_output_embeddings().weight, ours["lm_head.weight"])
    assert torch.equal(model.get_input_embeddings().weight, merged.get_input_embeddings().weight)
    card = (output / "README.md").read_text()
    assert "the LM head was re-fitted" in card and "head: {'lambda': 0.001, 'alpha': 0.7, 'rho': 0.4, 'untied': " in card
    if family == "gemma2":  # tied in the merge: untied in the output, or transformers would tie the embeddings back
        assert "lm_head.weight" not in read_weights(scenario.root / "merged")
        assert config["tie_word_embeddings"] is False and "now a tensor of its own" in card
    ids = torch.tensor([sequences[next(iter(sequences))][0]])
    logits = model(input_ids=ids).logits  # the model transformers loads computes with the calibrated head
    features = model.model(input_ids=ids).last_hidden_state
    expected_logits = features @ ours["lm_head.weight"].T
    if family == "gemma2":
        expected_logits = torch.tanh(expected_logits / 30.0) * 30.0
    assert torch.allclose(logits, expected_logits, atol=1e-10)


def reshard(directory, tmp_path):
    """The merge in two shards with an index, as a large mergekit merge is written."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, directory / shard, metadata={"format": "pt"})
    (directory / "model.safetensors").unlink()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: shard for shard, part in halves.items() for n in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_a_sharded_merge_gets_the_untied_head_in_its_last_shard_and_index(tmp_path):
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "s", experts=2, layers=2, samples=8, family="gemma2", dtype="float64")
    run_recipe(scenario.write_recipe(tmp_path / "first.yaml", output=str(tmp_path / "first")), progress=False)  # makes the merge
    merged_index = reshard(scenario.root / "merged", tmp_path)
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), head=True), progress=False)
    index = json.loads((output / "model.safetensors.index.json").read_text())
    head = read_weights(output)["lm_head.weight"]
    assert index["weight_map"] == {**merged_index["weight_map"], "lm_head.weight": "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == merged_index["metadata"]["total_size"] + head.numel() * head.element_size()
    assert torch.equal(load(output, torch.float64).get_output_embeddings().weight, head)


@pytest.mark.parametrize(
    ("head", "message"),
    [
        ({"alpha": 1.5}, "featcal.head.alpha"),
        ({"lambda": 0}, "featcal.head.lambda"),
        ({"lamda": 1e-3}, "featcal.head.lamda: unknown key; did you mean 'lambda'?"),
        ("sometimes", "featcal.head"),
    ],
)
def test_a_bad_head_setting_is_one_line_naming_the_key(family_scenarios, tmp_path, head, message):
    scenario = family_scenarios("llama")
    with pytest.raises(FeatCalError) as error:
        run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), head=head), progress=False)
    assert message in str(error.value)
    assert not (tmp_path / "out").exists()


def test_regmean_refuses_the_head(family_scenarios, tmp_path):
    scenario = family_scenarios("llama")
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), method="regmean++", head=True)
    for key in ("lambda", "alpha", "rho"):
        text = recipe.read_text().replace(f"  {key}:", f"  # {key}:")
        recipe.write_text(text)
    with pytest.raises(FeatCalError, match=r"featcal\.head: only method featcal reads it"):
        run_recipe(recipe, progress=False)


@pytest.mark.parametrize("crash_in", ["calibrate_head", "output_divergence"])  # before the head is staged, after it
def test_a_run_with_the_head_resumes_to_the_same_bytes(family_scenarios, tmp_path, monkeypatch, crash_in):
    import featcal_llm.engine.calibrate as calibrate_module
    from test_reliability import tree_hash

    scenario = family_scenarios("gemma2")
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), head=True)
    digest = tree_hash(run_recipe(recipe, progress=False))
    real = getattr(calibrate_module, crash_in)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(calibrate_module, crash_in, crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_recipe(recipe, force=True, progress=False)
    monkeypatch.setattr(calibrate_module, crash_in, real)
    state = json.loads((tmp_path / ".out.featcal-partial" / "state.json").read_text())
    assert state["completed_layers"] == (2 if crash_in == "calibrate_head" else 3)  # two layers, then the head
    run_recipe(recipe, force=True, progress=False)
    assert tree_hash(tmp_path / "out") == digest
