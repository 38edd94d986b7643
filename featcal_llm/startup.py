"""First imports of the heavy libraries (torch, mergekit with transformers' model code, datasets) without the cyclic collector.

Importing them creates about 700k long-lived objects, and Python's cyclic
collector, triggered by the allocations, traverses the growing heap again and
again while it is being built: ≈ 1 s of a ≈ 3.7 s start-up of `featcal-llm
run` on the 2-core development VM (6-7 full collections before the progress
bar). `heavy_import` pauses the collector for the first import of a module and
restores it after. During the CLI's `run` (`freezing_imports`), what the
imports leave alive is also frozen (`gc.freeze`): module state is never
traversed again, so the collections of the layer loop, and the one at exit,
stay cheap. Frozen objects are still freed by reference counting; only cycles
among them are no longer collected (≈ 8 MB of import-time garbage here).
"""

from __future__ import annotations

import gc
import importlib
import logging
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

_freeze = False


@contextmanager
def freezing_imports() -> Iterator[None]:
    """Inside: each heavy import also freezes what it leaves alive. For the CLI, whose process the run is."""
    global _freeze
    previous, _freeze = _freeze, True
    try:
        yield
    finally:
        _freeze = previous


def heavy_import(name: str) -> ModuleType:
    """`importlib.import_module(name)`, with the cyclic collector paused while the module is first imported."""
    if name in sys.modules or not gc.isenabled():
        return _quiet(importlib.import_module(name))
    gc.disable()
    try:
        return _quiet(importlib.import_module(name))
    finally:
        if _freeze:
            gc.freeze()
        gc.enable()


DEPRECATED_BY_US = "`torch_dtype` is deprecated"  # mergekit sets config.torch_dtype in every merge we start


def _drop_our_deprecations(record: logging.LogRecord) -> bool:
    return DEPRECATED_BY_US not in record.getMessage()


def _quiet(module: ModuleType) -> ModuleType:
    """Once transformers is loaded: drop its `torch_dtype` deprecation, which our merges cause and the user cannot act on."""
    if "transformers" in sys.modules:
        logger = logging.getLogger("transformers.configuration_utils")
        if _drop_our_deprecations not in logger.filters:
            logger.addFilter(_drop_our_deprecations)
    return module


def child_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child `python -m featcal_llm...`: it imports this featcal_llm. From a checkout (run from its
    root, or on PYTHONPATH) the package's folder is put first on PYTHONPATH; an installed package is found by the same
    interpreter already, and putting site-packages first on PYTHONPATH would set it before the standard library."""
    import os
    import site
    from pathlib import Path

    env = dict(os.environ if env is None else env)
    root = Path(__file__).resolve().parents[1]
    installed = {Path(place).resolve() for place in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in installed:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env
