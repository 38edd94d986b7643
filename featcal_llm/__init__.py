"""featcal-llm: FeatCal feature calibration as a mergekit post-merge stage."""

__version__ = "0.1.0"

_API = {"validate": "featcal_llm.api", "Problem": "featcal_llm.api"}  # loaded on first use: `import featcal_llm` stays light


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'featcal_llm' has no attribute {name!r}")
