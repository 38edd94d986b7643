"""Merge parameter values that mergekit's registry types allow but its merge refuses, or turns into NaN, mid-merge.

The types come from mergekit's registry (io/mergekit_methods.py); these ranges are in its merge code instead:
DARE's random drop draws `torch.bernoulli(density)`, which refuses a density below 0; DELLA's magnitude-ranked
drop needs density ± epsilon inside (0, 1) wherever 0 < density < 1 (epsilon 0.15 unless set); `linear` divides by
the weights' sum unless `normalize: false` (a base not listed among the models counts as one more input, at the
top level's weight), and `multislerp` by the experts' unless `normalize_weights: false`, so weights that sum to 0
merge into NaN. Only plain numbers are judged
(a gradient or a filtered value is left to mergekit). tests/test_merge_values.py and tests/test_agree_settings.py run
mergekit on each.
"""

from __future__ import annotations

from typing import Any

from featcal_llm.io.mergekit_methods import LARGEST_VALUE, merge_inputs
from featcal_llm.io.problems import Problem

RANDOM_DROP = ("dare_linear", "dare_ties")  # mergekit's SparsificationMethod.random
RANKED_DROP = ("della", "della_linear")  # SparsificationMethod.della_magprune
DELLA_EPSILON = 0.15  # mergekit's default epsilon for the ranked drop
WEIGHT_SUM_DIVIDERS = {"linear": "normalize", "multislerp": "normalize_weights"}  # method → its flag that divides by the sum


def _plain(chain: list[tuple[str, dict | None]], parameter: str) -> tuple[str, float] | None:
    """(where, value) of a parameter as the input reads it, where the most specific setting is a plain number."""
    for site, settings in chain:
        if settings and parameter in settings:
            value = settings[parameter]
            if isinstance(value, str):  # `weight: "0"`: the number mergekit's lax validation reads (not one: its type check's)
                from pydantic import TypeAdapter, ValidationError

                try:
                    value = TypeAdapter(float).validate_python(value)
                except ValidationError:
                    return None
            # a boolean is the number mergekit's validation makes of it (false: 0.0); else: io/mergekit_methods
            plain = isinstance(value, (int, float)) and abs(value) <= LARGEST_VALUE
            return (f"{site}.{parameter}", float(value)) if plain else None
    return None


def value_problems(config: Any, file: str) -> list[Problem]:
    """Each value mergekit would stop the merge on (or merge into NaN), once, where it is written."""
    name, problems = config.merge_method, []
    if config.modules:
        return []

    def add(key: str, message: str) -> None:
        if not any(problem.key == key for problem in problems):
            problems.append(Problem(file, key, message))

    inputs = merge_inputs(config)
    for _, reference, chain in inputs:
        if reference == config.base_model:
            continue  # the drop applies to the experts' task vectors only
        density = _plain(chain, "density")
        if name in RANDOM_DROP and density is not None and density[1] < 0:
            add(density[0], f"{density[1]:g}: {name} keeps each change with probability density, so it lies in 0 to 1 "
                            "(mergekit: \"Expected p_in >= 0 && p_in <= 1\")")
        if name in RANKED_DROP and density is not None and 0 < density[1] < 1:
            epsilon = _plain(chain, "epsilon")
            spread = epsilon[1] if epsilon is not None else DELLA_EPSILON
            if density[1] + spread >= 1 or density[1] - spread <= 0:
                where = epsilon[0] if epsilon is not None else density[0]
                add(where, f"density {density[1]:g} ± epsilon {spread:g} must lie inside (0, 1): {name} keeps changes "
                           "with probabilities in that range (mergekit: \"Epsilon must be chosen such that density +/- "
                           "epsilon is in (0, 1)\")")
    flag = WEIGHT_SUM_DIVIDERS.get(name)
    if flag is not None and (config.parameters or {}).get(flag, True) is not False:
        # linear: a base not among the models is one more input; multislerp weighs the experts only
        weights = [_plain(chain, "weight") for _, reference, chain in inputs if name == "linear" or reference != config.base_model]
        if weights and all(weight is not None for weight in weights) and sum(weight[1] for weight in weights) == 0:
            add("parameters" if config.parameters and "weight" in config.parameters else "models",
                f"the weights sum to 0, and {name} divides by their sum ({flag}, on by default): the merge would be "
                f"NaN; give weights with a non-zero sum, or set {flag}: false")
    return problems
