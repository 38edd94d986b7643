"""The refine stage's schedule: which training records each optimizer step draws (seeded epochs, drawn as the run
reaches them, the same from any resumed step) and the learning rate's share of its peak at each step."""

from __future__ import annotations

import math
import random

from featcal_llm.engine.refine_data import Key


def lr_factor(step: int, steps: int, warmup: float) -> float:
    """The learning rate's share of its peak at `step`: linear warm-up, then a cosine down to 0.1 (as the study's distillation reference)."""
    warm = max(1, round(warmup * steps))
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def record_order(keys: list[Key], steps: int, per_step: int, seed: int) -> "RecordOrder":
    """The records of every step: seeded shuffles of every training record, one epoch after another."""
    return RecordOrder(keys, steps, per_step, seed)


class RecordOrder:
    """`record_order`'s steps, drawn as the run reaches them: memory for one step and one epoch, not for every step
    (100,000 steps of 65,536 records would be billions of keys). Step s holds the same records whichever step a
    resumed run starts from: the draws before it are replayed."""

    def __init__(self, keys: list[Key], steps: int, per_step: int, seed: int):
        self.keys, self.steps, self.per_step, self.seed = list(keys), steps, per_step, seed
        self._restart()

    def _restart(self) -> None:
        self._rng = random.Random(f"featcal-refine:{self.seed}")
        self._pending: list[Key] = []
        self._step, self._batch = -1, []

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> list[Key]:
        if not 0 <= step < self.steps:
            raise IndexError(step)
        if step < self._step:
            self._restart()
        while self._step < step:
            while len(self._pending) < self.per_step:
                epoch = list(self.keys)
                self._rng.shuffle(epoch)
                self._pending += epoch
            self._batch, self._pending = self._pending[:self.per_step], self._pending[self.per_step:]
            self._step += 1
        return self._batch
