"""Bad RegMean input: one line naming the key, exit code 2, nothing written (issue 18)."""

from __future__ import annotations

import pytest
from test_bad_input import assert_refused_in_one_line

FEATCAL_KEYS = ("lambda", "alpha", "rho")


def _regmean(method: str = "regmean", drop=FEATCAL_KEYS, **keys):
    """The scenario's recipe turned into a `method` recipe: FeatCal's keys in `drop` removed, `keys` set."""
    def mutate(recipe, _tmp):
        block = recipe["featcal"]
        for key in drop:
            block.pop(key, None)
        block.update(method=method, **keys)
    return mutate


CASES = {
    "unknown method": (_regmean("regmaen"), ["bad.yaml: featcal.method: expected one of featcal, regmean, regmean++", "'regmaen'"]),
    "a stack in the wrong order": (_regmean(["featcal", "regmean++"]), ["featcal.method: expected a stack [regmean, featcal] or [regmean++, featcal]"]),
    "reduction above one": (_regmean(reduction=1.5), ["bad.yaml: featcal.reduction:", "less than or equal to 1"]),
    "reduction below zero": (_regmean(reduction=-0.1), ["bad.yaml: featcal.reduction:", "greater than or equal to 0"]),
    "reduction candidate outside [0, 1]": (_regmean(reduction=[0.5, 2.0]), ["featcal.reduction:", "less than or equal to 1"]),
    "reduction with featcal": (_regmean("featcal", drop=(), reduction=0.5), ["bad.yaml: featcal.reduction: only methods regmean and regmean++ read it (method is featcal)"]),
    "lambda with regmean": (_regmean(drop=("alpha", "rho")), ["bad.yaml: featcal.lambda: only method featcal reads it (method is regmean)"]),
    "alpha with regmean++": (_regmean("regmean++", drop=("lambda", "rho")), ["bad.yaml: featcal.alpha: only method featcal reads it (method is regmean++)"]),
    "norms with regmean": (_regmean(norms=True), ["bad.yaml: featcal.norms: only method featcal reads it"]),
    "biases with regmean++": (_regmean("regmean++", biases=False), ["bad.yaml: featcal.biases: only method featcal reads it"]),
    "tune with a fixed reduction": (_regmean(reduction=0.5, tune={"holdout": 0.25}), ["featcal.tune: nothing to tune (set reduction to auto"]),
    "reduction per layer of the wrong length": (_regmean(reduction={"per_layer": [0.5, 0.5]}), ["featcal.reduction.per_layer: 2 values for a model of 3 decoder layers"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_regmean_input_is_one_clear_line(merged_scenario, tmp_path, case):
    mutate, expected = CASES[case]
    assert_refused_in_one_line(merged_scenario, tmp_path, mutate, expected)


@pytest.mark.parametrize("method, name", [("regmean", "demo-regmean"), ("regmean++", "demo-regmeanpp")])
def test_shipped_regmean_recipes_are_the_ones_the_demo_writes(method, name):
    from pathlib import Path

    from featcal_llm.demo.baselines import baseline_recipe
    from featcal_llm.demo.config import FULL
    from featcal_llm.io.recipe import load_recipe

    path = Path(__file__).parent.parent / "featcal_llm" / "recipes" / f"{name}.yaml"
    assert path.read_text() == baseline_recipe(FULL, method, name.removeprefix("demo-"))
    recipe = load_recipe(path)
    assert recipe.featcal.method == method and recipe.merge_config.merge_method == "linear"
    assert [e.name for e in recipe.experts] == [f"experts/{t}" for t in FULL.tasks]  # the base (weight 0) is no expert
