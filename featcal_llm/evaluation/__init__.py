"""MergeBench-style evaluation: suites shipped in evaluation/suites/, lm-eval (vLLM or hf) in one subprocess per
model, cached results, EvalPlus grading, leaderboards.

Importing this package is cheap (pydantic only); lm-eval, torch and vLLM load in the worker.
"""

from __future__ import annotations

from pathlib import Path

from featcal_llm.evaluation.config import BackendSettings, EvalSection

__all__ = ["BackendSettings", "EvalSection", "run_after_calibration"]


def run_after_calibration(section: EvalSection, merged_dir: Path, calibrated_dir: Path, recipe_dir: Path, echo=None):
    """Score the merged and the calibrated model with one pipeline; return the comparison table and the calibrated
    model's summary (evaluation.compare.AfterCalibration).

    Called by `run recipe.yaml` after calibration when the recipe has `featcal.eval:`.
    """
    from featcal_llm.evaluation.compare import compare_after_calibration

    return compare_after_calibration(section, Path(merged_dir), Path(calibrated_dir), Path(recipe_dir),
                                     **({"echo": echo} if echo is not None else {}))
