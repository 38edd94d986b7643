"""`data.<expert>.weight`: an expert's weight in the re-fit, against the brute force; RegMean with one expert left."""

from __future__ import annotations

import pytest
import torch
import yaml
from reference import brute_force_featcal, brute_force_head
from test_exactness import TOLERANCE, check_against_brute_force, delta_error, read_weights
from test_head import reference_models

from featcal_llm.errors import FeatCalError
from featcal_llm.pipeline import run_recipe


def weighted_recipe(scenario, path, shares: dict[str, float], **featcal):
    recipe = yaml.safe_load(scenario.write_recipe(path, **featcal).read_text())
    for name, share in shares.items():
        recipe["featcal"]["data"][str(scenario.experts[name])]["weight"] = share
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.parametrize("shares", [{"expert0": 2.5, "expert1": 0.4}, {"expert0": 1.0, "expert1": 0.0}])
def test_weights_scale_each_experts_share_of_the_refit_as_the_brute_force_does(family_scenarios, tmp_path, shares):
    """Qwen2: weights, biases and norms; an expert of weight 0 is merged in but never calibrated toward."""
    scenario = family_scenarios("qwen2")
    recipe = weighted_recipe(scenario, tmp_path / "r.yaml", shares, output=str(tmp_path / "out"), norms=True, batch_tokens=150, dtype="float64")
    output = run_recipe(recipe, progress=False)
    by_path = {str(scenario.experts[name]): share for name, share in shares.items()}
    errors = check_against_brute_force(scenario, output, norms=True, samples=12, max_length=64, shares=by_path)
    assert any("bias" in name for name in errors) and any("layernorm" in name for name in errors)
    card = (output / "README.md").read_text()
    assert f"calibration tokens, weight {shares['expert1']:g}" in card and "expert_weights:" in card
    unweighted = run_recipe(scenario.write_recipe(tmp_path / "u.yaml", output=str(tmp_path / "u"), norms=True, batch_tokens=150, dtype="float64"), progress=False)
    ours, plain = read_weights(output), read_weights(unweighted)
    assert not torch.equal(ours["model.layers.1.mlp.down_proj.weight"], plain["model.layers.1.mlp.down_proj.weight"])


def test_the_head_takes_the_weights_too(family_scenarios, tmp_path):
    scenario = family_scenarios("llama")
    shares = {"expert0": 0.3, "expert1": 1.7}
    recipe = weighted_recipe(scenario, tmp_path / "r.yaml", shares, output=str(tmp_path / "out"), batch_tokens=150, dtype="float64", head=True)
    output = run_recipe(recipe, progress=False)
    merged, base, experts, sequences = reference_models(scenario)
    by_path = {str(scenario.experts[name]): share for name, share in shares.items()}
    cal = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8, shares=by_path)
    expected = brute_force_head(cal, merged, base, experts, sequences, 1e-5, 1.0, 0.5, 1e-8, shares=by_path)
    assert delta_error(read_weights(output)["lm_head.weight"], expected, merged.get_output_embeddings().weight) <= TOLERANCE


def test_regmean_with_one_expert_weighted_gives_that_experts_projections(family_scenarios, tmp_path):
    """Σ w_i W_i G̃_i (Σ w_i G̃_i)⁻¹ with weights (1, 0) is W_0: an independent check of where the weights enter."""
    scenario = family_scenarios("llama")
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), dtype="float64").read_text())
    for key in ("lambda", "alpha", "rho"):
        recipe["featcal"].pop(key)
    recipe["featcal"].update(method="regmean", eps=1e-15)  # the solve adds eps I: W_0 G (G + eps I)⁻¹ → W_0
    recipe["featcal"]["data"][str(scenario.experts["expert1"])]["weight"] = 0
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    ours, expert = read_weights(run_recipe(tmp_path / "r.yaml", progress=False)), read_weights(scenario.experts["expert0"])
    projections = [name for name in ours if "layers." in name and name.endswith("_proj.weight")]
    assert len(projections) == 14
    worst = max(float((ours[n] - expert[n]).norm() / expert[n].norm()) for n in projections)
    print(f"RegMean, weights (1, 0): worst relative distance to expert 0's projections {worst:.1e}")
    assert worst < 1e-9


@pytest.mark.parametrize(
    ("shares", "message"),
    [
        ({"expert0": -1.0}, "weight: Input should be greater than or equal to 0"),
        ({"expert0": 0, "expert1": 0}, "featcal.data: every expert has weight 0"),
        ({"expert0": "heavy"}, "weight: Input should be a valid number"),
    ],
)
def test_a_bad_weight_is_one_line_naming_the_key(family_scenarios, tmp_path, shares, message):
    scenario = family_scenarios("llama")
    with pytest.raises(FeatCalError) as error:
        run_recipe(weighted_recipe(scenario, tmp_path / "r.yaml", shares, output=str(tmp_path / "out")), progress=False)
    assert message in str(error.value) and "\n" not in str(error.value).strip()
    assert not (tmp_path / "out").exists()
