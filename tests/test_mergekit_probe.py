"""Recipes mergekit 0.1.5 merges otherwise than they read, or that featcal-llm refused in words that named the wrong
thing: each found by running validate, run and mergekit-yaml side by side on one tiny base and its experts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from agreement import recipe_of, refused_alike


def _mergekit_merge(merge: dict, out: Path) -> str:
    """mergekit's own merge of `merge` (no featcal: block), as mergekit-yaml runs it; the digest of its weights."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    run_merge(MergeConfiguration.model_validate(merge), str(out), options=MergeOptions(copy_tokenizer=False, quiet=True,
                                                                                      write_model_card=False, random_seed=0))
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(out.glob("*.safetensors")))).hexdigest()


@pytest.mark.parametrize("method, parameters", [("task_arithmetic", {"weight": 0.3}), ("ties", {"density": 0.5}),
                                                ("nuslerp", {"weight": 0.3})])
def test_a_per_expert_parameter_given_to_the_base_model_is_refused_alike(scenario, tmp_path, method, parameters):
    """`- model: BASE, parameters: {weight: 0.3}` under models: for a method that reads weight/density of the experts
    only (scope non_base): mergekit merges exactly as without it (checked here), so the recipe says a merge it does
    not get. Both commands passed it; now both refuse it in one line naming the key."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["merge_method"] = method
    recipe["models"] = recipe["models"][:2]
    for entry in recipe["models"]:
        entry["parameters"] = {"weight": 0.5}
    merge = {key: value for key, value in recipe.items() if key != "featcal"}
    with_base = {**merge, "models": [{"model": recipe["base_model"], "parameters": parameters}, *merge["models"]]}
    assert _mergekit_merge(merge, tmp_path / "plain") == _mergekit_merge(with_base, tmp_path / "with-base")
    recipe["models"] = with_base["models"]
    for expert in list(recipe["featcal"]["data"])[2:]:
        del recipe["featcal"]["data"][expert]
    [line] = refused_alike(recipe, tmp_path)
    name = next(iter(parameters))
    assert f"r.yaml: models.0.parameters.{name}: " in line and "base model" in line, line
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("form, says", [
    ("empty sources", "r.yaml: slices[0]: sources: empty (list the base model and every expert, each with its layer_range)"),
    ("slice base only", "r.yaml: slices[0]: base_model: given in this slice only; FeatCal needs the base model at the top level "
                        "(write it as the recipe's base_model:)"),
])
def test_a_slice_without_sources_or_with_the_only_base_model_is_refused_naming_it(scenario, tmp_path, form, says):
    """`slices: [{sources: []}]` (mergekit-yaml: IndexError) was refused as "sources take different layer ranges ()";
    a base_model written only inside the slice (mergekit merges it) as "differs from the recipe's None"."""
    recipe = recipe_of(scenario, tmp_path)
    base, experts = recipe.pop("base_model"), [entry["model"] for entry in recipe.pop("models")]
    sources = [{"model": base, "layer_range": [0, 3]}, *({"model": e, "layer_range": [0, 3], "parameters": {"weight": 0.5}} for e in experts)]
    if form == "empty sources":
        recipe.update(base_model=base, slices=[{"sources": []}])
    else:
        recipe["slices"] = [{"base_model": base, "sources": sources}]
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith(says), line


def test_karcher_averages_the_base_model_in_as_the_docs_say(scenario, tmp_path):
    """mergekit adds the recipe's base_model to karcher's inputs (an equal share of the mean), as it adds it to
    linear's: the merge of two experts with a base_model is the merge of the three models without one. The docs' table
    said so for linear only ("the experts are averaged")."""
    from featcal_llm.io.forms import MERGE_METHODS

    base, experts = str(scenario.base), [str(p) for p in scenario.experts.values()][:2]
    with_base = {"merge_method": "karcher", "base_model": base, "models": [{"model": e} for e in experts]}
    three = {"merge_method": "karcher", "models": [{"model": e} for e in (*experts, base)]}
    assert _mergekit_merge(with_base, tmp_path / "a") == _mergekit_merge(three, tmp_path / "b")
    row = next(line for line in (Path(__file__).parent.parent / "docs" / "methods.md").read_text().splitlines()
               if line.startswith("| `linear`, `karcher`"))
    assert "`karcher` averages `base_model` in too" in row, row
    assert "base_model in too" in MERGE_METHODS["karcher"][1], MERGE_METHODS["karcher"]


def test_a_filter_that_is_no_string_is_named_as_the_filter(scenario, tmp_path):
    """`weight: {filter: 5, value: 0.5}` (mergekit's schema refuses the filter too): both commands said the weight was
    of no form mergekit takes "(got 5)", as if `weight: 5`, which is a weight mergekit takes."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["models"][1]["parameters"]["weight"] = {"filter": 5, "value": 0.5}
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith("r.yaml: models.1.parameters.weight: expected {value, filter}, a list of {value, filter}, true or "
                         "false, an integer, a number, a string or a list of values; filter: Input should be a valid string "
                         "(got 5)"), line


def test_multislerp_weights_that_sum_to_zero_are_refused_alike(scenario, tmp_path):
    """multislerp divides the experts' weights by their sum (`normalize_weights`, on by default), as linear does: with
    weights 0.5 and -0.5 mergekit writes a merge of NaN only (checked here). validate passed it; run merged it into
    featcal.merged and then stopped on "the embedding of a calibration token contains NaN or Inf", naming no key.
    With normalize_weights: false the same weights merge finite, and validate passes them."""
    from safetensors.torch import load_file

    recipe = recipe_of(scenario, tmp_path)
    recipe["merge_method"] = "multislerp"
    recipe["models"] = recipe["models"][:2]
    recipe["models"][0]["parameters"], recipe["models"][1]["parameters"] = {"weight": 0.5}, {"weight": -0.5}
    for expert in list(recipe["featcal"]["data"])[2:]:
        del recipe["featcal"]["data"][expert]
    merge = {key: value for key, value in recipe.items() if key != "featcal"}
    _mergekit_merge(merge, tmp_path / "nan")
    assert all(bool(tensor.isnan().all()) for tensor in load_file(tmp_path / "nan" / "model.safetensors").values())
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith("r.yaml: models: the weights sum to 0, and multislerp divides by their sum (normalize_weights, on by "
                         "default): the merge would be NaN; give weights with a non-zero sum, or set normalize_weights: false"), line
    assert not (tmp_path / "merged").exists()
    recipe["parameters"] = {"normalize_weights": False}
    _mergekit_merge({**merge, "parameters": {"normalize_weights": False}}, tmp_path / "finite")
    assert all(bool(tensor.isfinite().all()) for tensor in load_file(tmp_path / "finite" / "model.safetensors").values())
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    import featcal_llm

    assert featcal_llm.validate(tmp_path / "r.yaml") == []


@pytest.mark.parametrize("merge, keys", [
    ({"merge_method": "ties", "base_model": "b", "slices": [{"sources": [
        {"model": "b", "layer_range": [0, 2], "parameters": {"weight": 0.3}},
        {"model": "e", "layer_range": [0, 2], "parameters": {"weight": 0.5}}]}]}, ["slices.0.sources.0.parameters.weight"]),
    ({"merge_method": "linear", "base_model": "b", "models": [{"model": "b", "parameters": {"weight": 0.3}},
                                                              {"model": "e", "parameters": {"weight": 0.5}}]}, []),
    ({"merge_method": "multislerp", "base_model": "b", "models": [{"model": "b", "parameters": {"weight": 0.3}},
                                                                  {"model": "e", "parameters": {"weight": 0.5}}]}, ["models.0.parameters.weight"]),
], ids=["slice source", "linear weighs its base", "multislerp"])
def test_the_base_s_own_parameters_are_refused_only_where_the_method_does_not_read_them(merge, keys):
    """A slice source that is the base is the base too; linear's weight is read for every input, the base included."""
    from mergekit.config import MergeConfiguration

    from featcal_llm.io.mergekit_methods import parameter_problems

    problems = parameter_problems(MergeConfiguration.model_validate(merge), "r")
    assert [problem.key for problem in problems] == keys
    assert all("reads weight for the experts only" in problem.message for problem in problems)


def test_numbers_written_as_strings_are_judged_as_mergekit_reads_them():
    """mergekit validates `weight: "0"` with pydantic's lax rules: the number 0 (tests/test_mergekit_schema.py). The
    range checks left strings to mergekit, so linear weights "0" and "0.0" passed validate and merged into NaN, and a
    DARE density "-0.2" passed and stopped the merge."""
    from mergekit.config import MergeConfiguration
    from test_merge_values import _linear_merge_is_finite

    from featcal_llm.io.merge_values import value_problems

    assert not _linear_merge_is_finite(["0", "0.0"])
    linear = MergeConfiguration.model_validate({"merge_method": "linear", "models": [
        {"model": "expert-a", "parameters": {"weight": "0"}}, {"model": "expert-b", "parameters": {"weight": "0.0"}}]})
    dare = MergeConfiguration.model_validate({"merge_method": "dare_linear", "base_model": "base", "models": [
        {"model": "expert-a", "parameters": {"weight": 0.5, "density": "-0.2"}}]})
    assert [problem.key for problem in value_problems(linear, "r")] == ["models"]
    assert [problem.key for problem in value_problems(dare, "r")] == ["models.0.parameters.density"]
    assert value_problems(MergeConfiguration.model_validate({"merge_method": "linear", "models": [
        {"model": "expert-a", "parameters": {"weight": "0.5"}}, {"model": "expert-b", "parameters": {"weight": "x"}}]}), "r") == []
