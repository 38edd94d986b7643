"""Instruments for the benchmark: a per-layer phase timer and a checkpoint reader that counts its reads."""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from featcal_llm.benchmark import machine
from featcal_llm.io.checkpoint import CheckpointReader
from featcal_llm.engine.profiling import PhaseTimer


class LayerTimer(PhaseTimer):
    """PhaseTimer that also keeps exclusive (net of nested phases) seconds and snapshots them per layer.

    A layer starts at the first "read" phase after a "write" (or the first
    "read" of the run): in the engine each layer begins by reading its tensors
    and ends after committing them (and advancing the streams). Only the thread
    that created the timer is timed.
    """

    def __init__(self, synchronize: Callable[[], None]):
        super().__init__(synchronize)
        self.exclusive: dict[str, float] = defaultdict(float)
        self.top_level = 0.0
        self.marks: list[tuple[float, dict[str, float], float]] = []
        self.start = time.perf_counter()
        self._children: list[float] = []
        self._layer_done = True
        self._thread = threading.get_ident()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if threading.get_ident() != self._thread:
            yield
            return
        self._synchronize()
        if name == "read" and self._layer_done and not self._open:
            self._layer_done = False
            self.marks.append((time.perf_counter(), dict(self.exclusive), self.top_level))
        start = time.perf_counter()
        self._open.append(name)
        self._children.append(0.0)
        try:
            yield
        finally:
            self._synchronize()
            elapsed = time.perf_counter() - start
            self._open.pop()
            children = self._children.pop()
            self.seconds[name] += elapsed
            self.calls[name] += 1
            self.exclusive[name] += elapsed - children
            if self._children:
                self._children[-1] += elapsed
            else:
                self.top_level += elapsed
            if name == "write":
                self._layer_done = True

    def layers(self, end: float) -> list[dict]:
        closing = self.marks[1:] + [(end, dict(self.exclusive), self.top_level)]
        result = []
        for layer, ((t0, before, top0), (t1, after, top1)) in enumerate(zip(self.marks, closing)):
            seconds = {p: after.get(p, 0.0) - before.get(p, 0.0) for p in after}
            result.append({"layer": layer, "wall": t1 - t0, "seconds": seconds, "other": max(0.0, (t1 - t0) - (top1 - top0))})
        return result


class ReadCounter:
    """Bytes and reading seconds per layer, from whichever thread reads (the engine prefetches in the background)."""

    def __init__(self):
        self.bytes: dict[int, int] = defaultdict(int)
        self.seconds: dict[int, float] = defaultdict(float)
        self._lock = threading.Lock()

    def add(self, layer: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes[layer] += nbytes
            self.seconds[layer] += seconds


class BenchReader(CheckpointReader):
    """A CheckpointReader that counts bytes and time per layer, can make reads cold, and can reuse stored layers.

    With `stored_layers` < the layers calibrated, layer l is read from stored
    layer l mod stored_layers (so 32 layers can be benchmarked from a few on
    disk). With `cold`, the layer's shard files are dropped from the page cache
    before each read (handles are closed first so no mapping pins the pages).
    """

    def __init__(self, directory: Path, what: str, counter: ReadCounter, stored_layers: int, cold: bool):
        super().__init__(directory, what)
        self.counter, self.stored_layers, self.cold = counter, stored_layers, cold

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        match = re.search(r"(\d+)\.$", prefix)
        if match is None:
            return super().tensors(prefix)
        started = time.perf_counter()
        layer = int(match.group(1))
        stored = prefix[: match.start(1)] + f"{layer % self.stored_layers}."
        if self.cold:
            shards = {shard for name, shard in self.weight_map.items() if name.startswith(stored)}
            self.close()
            for shard in shards:
                machine.drop_from_page_cache(self.directory / shard)
        tensors = super().tensors(stored)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.counter.add(layer, nbytes, time.perf_counter() - started)
        return tensors
