"""First imports of the heavy libraries (torch, mergekit with transformers' model code, datasets) without the cyclic collector.

Importing them creates about 700k long-lived objects, and Python's cyclic
collector, triggered by the allocations, traverses the growing heap again and
again while it is being built: ≈ 1 s of a ≈ 3.7 s start-up of `featcal-llm
run` on the 2-core development VM (6 full collections before the progress
bar). `heavy_import` pauses the collector for the first import of a module and
restores it after. Where the process is ours (the CLI, which calls
`freeze_after_imports`), what the imports created is also frozen (`gc.freeze`):
module state is never traversed again, so the collections of the layer loop
stay cheap. Frozen objects are still freed by reference counting; only cycles
among them are no longer collected (≈ 8 MB of import-time garbage here).
"""

from __future__ import annotations

import gc
import importlib
import sys
from types import ModuleType

_freeze = False


def freeze_after_imports() -> None:
    """From now on, freeze what each heavy import leaves alive; for a process that is ours alone (the CLI)."""
    global _freeze
    _freeze = True


def heavy_import(name: str) -> ModuleType:
    """`importlib.import_module(name)`, with the cyclic collector paused while the module is first imported."""
    if name in sys.modules or not gc.isenabled():
        return importlib.import_module(name)
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        if _freeze:
            gc.freeze()
        gc.enable()
