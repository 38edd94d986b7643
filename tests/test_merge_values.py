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


def _linear_merge_is_finite(weights, normalize=True) -> bool:
    """mergekit's own linear kernel on one tensor per input, with the weights its parameter validation reads."""
    from mergekit.merge_methods.base import TensorBatch
    from mergekit.merge_methods.linear import linear_merge
    from mergekit.merge_methods.registry import get

    spec = {p.name: p for p in get("linear").spec.parameters}
    read = [float(spec["weight"].validate(w)) for w in weights]  # pydantic's lax reading, as the merge reads the recipe
    batch = TensorBatch(tuple(torch.full((2, 2), float(i + 1)) for i in range(len(read))))
    merged = linear_merge.implementation(batch, torch.tensor([read] * 2), normalize=normalize)
    return bool(torch.isfinite(merged).all())


def test_linear_weights_of_false_are_refused_as_mergekit_reads_them_as_zero():
    from mergekit.config import MergeConfiguration

    config = MergeConfiguration.model_validate({"merge_method": "linear", "models": [
        {"model": f"expert-{i}", "parameters": {"weight": False}} for i in range(2)]})
    assert not _linear_merge_is_finite([False, False])
    assert value_problems(config, "r.yaml")


def test_linear_weights_with_a_negative_sum_merge_finite_and_pass():
    """Only a sum of exactly 0 is a division by zero: a negative sum (mergekit divides by it) merges finite."""
    from mergekit.config import MergeConfiguration

    for weights in ((0.5, -1.0), (-0.25, -0.25), (1e-3, 0.0)):
        config = MergeConfiguration.model_validate({"merge_method": "linear", "models": [
            {"model": f"expert-{i}", "parameters": {"weight": w}} for i, w in enumerate(weights)]})
        assert _linear_merge_is_finite(weights)
        assert value_problems(config, "r.yaml") == [], weights


def test_linear_s_weight_sum_counts_the_base_model_as_mergekit_merges_it(scenario, tmp_path):
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
    from safetensors.torch import load_file

    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe.pop("featcal")
    verdicts = []
    for name, top, weights in (("nan", -2.0, (1.0, 0.5, 0.5)), ("finite", 1.0, (0.5, -0.5, 0.0))):
        raw = {**recipe, "merge_method": "linear", "parameters": {"weight": top},
               "models": [{"model": m["model"], "parameters": {"weight": w}} for m, w in zip(recipe["models"], weights)]}
        refused = bool(value_problems(MergeConfiguration.model_validate(raw), "r.yaml"))  # before run_merge, which edits it
        run_merge(MergeConfiguration.model_validate(raw), str(tmp_path / name), options=MergeOptions(quiet=True, write_model_card=False))
        finite = all(bool(torch.isfinite(t).all()) for f in (tmp_path / name).glob("*.safetensors") for t in load_file(f).values())
        verdicts.append((name, refused, finite))
    assert verdicts == [("nan", True, False), ("finite", False, True)]


@pytest.mark.parametrize("top, per_model, key", [(0.0, None, "parameters"), (None, 0.0, "models"), (0.0, 0.0, "parameters")])
def test_linear_weights_summing_to_zero_are_named_where_they_are_written(top, per_model, key):
    from mergekit.config import MergeConfiguration

    config = MergeConfiguration.model_validate({
        "merge_method": "linear", **({"parameters": {"weight": top}} if top is not None else {}),
        "models": [{"model": f"expert-{i}", **({"parameters": {"weight": per_model}} if per_model is not None else {})}
                   for i in range(2)]})
    assert not _linear_merge_is_finite([0.0, 0.0])
    assert [problem.key for problem in value_problems(config, "r.yaml")] == [key]


@pytest.mark.parametrize("method, parameters", [
    ("dare_linear", {"weight": 0.5, "density": -1e300}), ("della", {"weight": 0.5, "density": 0.5, "epsilon": 1e300}),
    ("linear", {"weight": 1e300}),
])
def test_a_value_past_the_largest_is_one_problem_of_the_parameter_check_not_two(method, parameters):
    """A value past ±1e6 is mergekit_methods' refusal (not finite enough to merge); the range rules here leave it to that
    check, so the recipe gets one line for one value."""
    from mergekit.config import MergeConfiguration

    from featcal_llm.io.mergekit_methods import parameter_problems

    models = [{"model": "expert-a", "parameters": dict(parameters)},
              {"model": "expert-b", "parameters": {**parameters, **({"weight": -1e300} if method == "linear" else {})}}]
    config = MergeConfiguration.model_validate({"merge_method": method, "base_model": "base", "models": models}
                                               if method != "linear" else {"merge_method": method, "models": models})
    assert parameter_problems(config, "r.yaml") and value_problems(config, "r.yaml") == []


@pytest.mark.parametrize("normalize", [None, True])
def test_task_arithmetic_weights_summing_to_zero_pass_as_mergekit_guards_that_divisor(normalize):
    """Only `linear` divides by the weights' sum unguarded: the task-vector methods default to normalize: false, and
    with normalize: true mergekit's generalized task arithmetic replaces a divisor of |x| < 1e-8 by 1."""
    import inspect

    from mergekit.config import MergeConfiguration
    from mergekit.merge_methods import generalized_task_arithmetic
    from mergekit.merge_methods.registry import get

    assert "divisor[divisor.abs() < 1e-8] = 1" in inspect.getsource(generalized_task_arithmetic)
    for name in ("task_arithmetic", "dare_linear", "della_linear"):
        assert {p.name: p.default for p in get(name).spec.parameters}["normalize"] is False
        config = MergeConfiguration.model_validate({
            "merge_method": name, "base_model": "base", **({"parameters": {"normalize": normalize}} if normalize else {}),
            "models": [{"model": f"expert-{i}", "parameters": {"weight": w}} for i, w in enumerate((0.5, -0.5))]})
        assert value_problems(config, "r.yaml") == [], name


def test_the_most_specific_setting_decides_even_where_it_is_no_plain_number():
    """mergekit reads a parameter at the most specific level that sets it: a gradient there is the value, and the
    top-level plain number it overrides is never read (so never refused)."""
    from mergekit.config import MergeConfiguration, evaluate_setting
    from mergekit.sparsify import SparsificationMethod

    gradient = [0.1, 0.5]
    config = MergeConfiguration.model_validate({"merge_method": "dare_linear", "base_model": "base", "parameters": {"density": -0.2},
                                                "models": [{"model": f"expert-{i}", "parameters": {"weight": 0.5, "density": gradient}}
                                                           for i in range(2)]})
    for t in (0.0, 0.5, 1.0):
        assert not _mergekit_raises(SparsificationMethod.random, density=evaluate_setting("x", gradient, t, validate=float))
    assert value_problems(config, "r.yaml") == []
    linear = MergeConfiguration.model_validate({"merge_method": "linear", "parameters": {"weight": 0.0}, "models": [
        {"model": f"expert-{i}", "parameters": {"weight": [0.5, 1.0]}} for i in range(2)]})
    assert _linear_merge_is_finite([0.5, 0.5]) and _linear_merge_is_finite([1.0, 1.0])
    assert value_problems(linear, "r.yaml") == []
