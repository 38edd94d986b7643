"""io/merge_values.py's ranges against mergekit's own merge code: a value is refused exactly where mergekit's
sparsification raises mid-merge (DARE's random drop, DELLA's magnitude-ranked drop), and nowhere else."""

from __future__ import annotations

import pytest
import torch

from featcal_llm.io.merge_values import DELLA_EPSILON, value_problems

DENSITIES = (-0.2, -1e-9, 0.0, 0.05, 0.1, 0.5, 0.85, 0.9, 0.999, 1.0, 1.5)


def _config(method: str, parameters: dict):
    from mergekit.config import MergeConfiguration

    return MergeConfiguration.model_validate({"merge_method": method, "base_model": "base", "models": [
        {"model": "expert-a", "parameters": {"weight": 0.5, **parameters}}, {"model": "expert-b", "parameters": {"weight": 0.5}}]})


def _mergekit_raises(method, **settings) -> bool:
    from mergekit.sparsify import sparsify

    try:
        sparsify(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)), method=method, **settings)
    except (ValueError, RuntimeError):
        return True
    return False


@pytest.mark.parametrize("density", DENSITIES)
def test_dare_density_is_refused_where_mergekit_s_random_drop_raises(density):
    from mergekit.sparsify import SparsificationMethod

    for name in ("dare_linear", "dare_ties"):
        refused = value_problems(_config(name, {"density": density}), "r.yaml")
        assert bool(refused) == _mergekit_raises(SparsificationMethod.random, density=density), (name, density, refused)


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("epsilon", (None, 0.05, 0.4, 0.9))
def test_della_density_and_epsilon_are_refused_where_mergekit_s_ranked_drop_raises(density, epsilon):
    from mergekit.sparsify import SparsificationMethod

    given = {"density": density, **({"epsilon": epsilon} if epsilon is not None else {})}
    for name in ("della", "della_linear"):
        refused = value_problems(_config(name, given), "r.yaml")
        raises = _mergekit_raises(SparsificationMethod.della_magprune, density=density,
                                  epsilon=DELLA_EPSILON if epsilon is None else epsilon)
        assert bool(refused) == raises, (name, given, refused)
        assert not refused or refused[0].key == f"models.0.parameters.{'epsilon' if epsilon is not None else 'density'}"


def test_della_s_default_epsilon_is_mergekit_s():
    from mergekit.merge_methods.registry import get

    for name in ("della", "della_linear"):
        assert {p.name: p.default for p in get(name).spec.parameters}["epsilon"] == DELLA_EPSILON


@pytest.mark.parametrize("weights, normalize, refused", [
    ((0.0, 0.0), None, True), ((0.5, -0.5), None, True), ((0.5, 0.5), None, False), ((0.0, 0.0), False, False),
    ((0.0, 0.0), True, True),
])
def test_linear_weights_summing_to_zero_are_refused_where_mergekit_merges_nan(weights, normalize, refused):
    from mergekit.config import MergeConfiguration
    from mergekit.merge_methods.base import TensorBatch
    from mergekit.merge_methods.linear import linear_merge

    config = MergeConfiguration.model_validate({
        "merge_method": "linear", **({"parameters": {"normalize": normalize}} if normalize is not None else {}),
        "models": [{"model": f"expert-{i}", "parameters": {"weight": w}} for i, w in enumerate(weights)]})
    batch = TensorBatch((torch.ones(3, 3), torch.full((3, 3), 2.0)))
    merged = linear_merge.implementation(batch, torch.tensor([list(weights)] * 3), normalize=normalize is not False)
    assert bool(value_problems(config, "r.yaml")) == refused == (not bool(torch.isfinite(merged).all()))
