"""The Python API: what the command line does, as functions.

    import featcal_llm
    problems = featcal_llm.validate("recipe.yaml")   # [] when the recipe is clean
    for problem in problems:
        print(problem)                               # file: key: what is wrong and what is expected
"""

from __future__ import annotations

from pathlib import Path

from featcal_llm.io.problems import Problem

__all__ = ["Problem", "validate"]


def validate(recipe: str | Path, *, online: bool = False) -> list[Problem]:
    """Every problem of a recipe, found without loading any weights (as `featcal-llm validate`).

    Checks the schema, recipe forms, calibration files and their fields, model
    references and adapters, and the output location. Hub model and dataset ids
    are looked up only with `online=True`; local paths never touch the network.
    """
    from featcal_llm.io.validate import validate_recipe

    return validate_recipe(recipe, online=online)
