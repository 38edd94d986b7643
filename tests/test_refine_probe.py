"""`refine:` probed as a user reads it: what the saved recipe, the log, the card and `featcal_refine.json` say ran
against what ran (each test one finding; the stage end to end: test_refine.py)."""

from __future__ import annotations

import pytest
import yaml


def test_a_float64_runs_saved_recipe_does_not_say_its_refinement_ran_in_float32():
    """`dtype: float64` refines in float64 whatever `precision` says (engine/refine.refine_dtypes): the report's master
    is float64, the card says "in float64 throughout". The saved recipe ("the recipe as run") pinned `precision:
    float32` there, a precision that did not run; `precision` has no effect on a float64 run, so nothing is pinned."""
    from featcal_llm.io.saved_recipe import with_refine_pinned

    text = yaml.safe_dump({"featcal": {"output": "o", "dtype": "float64", "refine": {"steps": 5}}}, sort_keys=False)
    report = {"params": "full", "autocast": "None", "master": "torch.float64"}
    pinned = yaml.safe_load(with_refine_pinned(text, report))["featcal"]["refine"]
    assert pinned.get("precision", "auto") == "auto", pinned
    assert pinned["params"] == "full"  # the memory's choice is still pinned
