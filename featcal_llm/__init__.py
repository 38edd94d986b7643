"""featcal-llm: FeatCal feature calibration as a mergekit post-merge stage.

The Python API (`calibrate`, `evaluate`, `validate` and their result types) lives in
`featcal_llm.api` and is loaded on first use, so `import featcal_llm` stays light;
`FeatCalError`, what they raise for bad input, and its subclass `RunFailure`, for a run that started and
failed, are here from the start.
"""

from featcal_llm.errors import FeatCalError as FeatCalError, RunFailure as RunFailure  # re-exported, light: what `calibrate` and `validate` raise, to catch without the API loaded

__version__ = "0.1.0"

_API = {"calibrate", "evaluate", "validate", "CalibrationResult", "EvaluationResult", "ExpertSummary", "Problem", "RefineSummary",
        "ValidationResult"}
__all__ = sorted({*_API, "FeatCalError", "RunFailure"})


def __getattr__(name: str):
    if name in _API:
        import importlib

        api = importlib.import_module("featcal_llm.api")
        if hasattr(api, name):
            return getattr(api, name)
    raise AttributeError(f"module 'featcal_llm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
