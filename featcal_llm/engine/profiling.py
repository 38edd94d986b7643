"""Per-phase wall-clock accounting for the layer loop (used by `featcal-llm bench`).

The engine calls `timer.phase(name)` around reading, forward passes,
statistics, solves and writing; the default `NullTimer` costs nothing.
Statistics run inside forward hooks, so their time is also inside "forward";
the benchmark reports forward time net of statistics.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator


class NullTimer:
    def phase(self, name: str):
        return nullcontext()


class PhaseTimer:
    """Accumulates seconds per phase; `synchronize` (e.g. torch.cuda.synchronize) makes GPU time honest."""

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._synchronize = synchronize or (lambda: None)
        self._open: list[str] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._synchronize()
        start = time.perf_counter()
        self._open.append(name)
        try:
            yield
        finally:
            self._synchronize()
            self._open.pop()
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
