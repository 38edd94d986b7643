"""RegMean and RegMean++ in the streaming engine against an independent float64 brute force, for every family (issue 18)."""

from __future__ import annotations

import pytest
import torch
import yaml
from reference_regmean import brute_force_regmean
from test_exactness import FAMILIES, TOLERANCE, calibration_sequences, delta_error, load, read_weights

from featcal_llm.pipeline import run_recipe

SAMPLES, MAX_LENGTH, REDUCTION, EPS = 12, 64, 0.5, 1e-8


def regmean_recipe(scenario, path, **featcal):
    """The scenario's recipe with FeatCal's own keys dropped and the given RegMean keys set."""
    recipe = yaml.safe_load(scenario.recipe.read_text())
    block = recipe["featcal"]
    for key in ("lambda", "alpha", "rho", "norms", "biases"):
        block.pop(key, None)
    block.update(featcal)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path



def reference_weights(scenario, reduction: float, propagated: bool) -> dict[str, torch.Tensor]:
    experts = {str(p): load(p, torch.float64) for p in scenario.experts.values()}
    sequences = {str(scenario.experts[n]): s for n, s in calibration_sequences(scenario, SAMPLES, MAX_LENGTH).items()}
    return brute_force_regmean(load(scenario.root / "merged", torch.float64), experts, sequences, reduction, EPS, propagated).state_dict()


def delta_errors(ours: dict, reference: dict, merged: dict) -> dict[str, float]:
    """ΔW error of every tensor the product changed; the product must change exactly the decoder projections' weights."""
    changed = {n for n in ours if not torch.equal(ours[n], merged[n])}
    expected = {n for n in merged if ".layers." in n and n.endswith("_proj.weight") and not torch.equal(reference[n].to(merged[n].dtype), merged[n])}
    assert changed == expected, sorted(changed ^ expected)
    return {name: delta_error(ours[name], reference[name], merged[name]) for name in changed}


def run_method(scenario, tmp_path, method: str, **featcal):
    recipe = regmean_recipe(scenario, tmp_path / f"{method}.yaml", method=method, output=str(tmp_path / method),
                            batch_tokens=150, dtype="float64", **featcal)
    return read_weights(run_recipe(recipe, progress=False))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["regmean", "regmean++"])
def test_regmean_matches_brute_force(family_scenarios, family, method, tmp_path):
    """Every decoder projection's ΔW within 1e-8 of the brute force; biases, norms, embeddings stay the merged model's."""
    scenario = family_scenarios(family)
    ours = run_method(scenario, tmp_path, method, reduction=REDUCTION)
    merged = read_weights(scenario.root / "merged")
    errors = delta_errors(ours, reference_weights(scenario, REDUCTION, propagated=method == "regmean++"), merged)
    worst = max(errors, key=errors.get)
    print(f"{family} {method}: worst ΔW relative error {errors[worst]:.2e} at {worst} ({len(errors)} tensors)")
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])
    assert all(torch.equal(ours[n], merged[n]) for n in merged if not n.endswith("_proj.weight"))


@pytest.mark.parametrize("method", ["regmean", "regmean++"])
def test_a_reduction_other_than_a_half_is_the_gram_s_off_diagonal_share(family_scenarios, method, tmp_path):
    """At `reduction: 0.5` the reduced Gram r·G + (1 − r)·diag G reads the same with r and 1 − r swapped; at 0.3 the
    brute force tells them apart (the full and diagonal parts swapped in the Gram or the targets: the 0.7 merge)."""
    scenario = family_scenarios("llama")
    ours = run_method(scenario, tmp_path, method, reduction=0.3)
    merged = read_weights(scenario.root / "merged")  # (made by the run where no test before it made it)
    propagated = method == "regmean++"
    assert max(delta_errors(ours, reference_weights(scenario, 0.3, propagated), merged).values()) <= TOLERANCE
    assert max(delta_errors(ours, reference_weights(scenario, 0.7, propagated), merged).values()) > 1e-3


def test_wrong_stream_or_missing_reduction_is_caught(family_scenarios, tmp_path):
    """The comparison is sensitive to what the issue names: the input stream (expert vs propagated) and the reduction."""
    scenario = family_scenarios("llama")
    merged = read_weights(scenario.root / "merged")
    regmean, regmean_pp = run_method(scenario, tmp_path, "regmean", reduction=REDUCTION), run_method(scenario, tmp_path, "regmean++", reduction=REDUCTION)
    own, propagated = reference_weights(scenario, REDUCTION, False), reference_weights(scenario, REDUCTION, True)
    unreduced = reference_weights(scenario, 1.0, False)
    assert max(delta_errors(regmean, own, merged).values()) <= TOLERANCE
    wrong = {
        "regmean vs propagated inputs": (regmean, propagated),
        "regmean++ vs own inputs": (regmean_pp, own),
        "regmean vs no reduction": (regmean, unreduced),
    }
    for what, (ours, reference) in wrong.items():
        errors = {n: delta_error(ours[n], reference[n], merged[n]) for n in ours if n.endswith("_proj.weight") and ".layers." in n}
        assert max(errors.values()) > 1e-3, what
