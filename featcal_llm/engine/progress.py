"""Calibration progress counted in tokens, so that a rate and an ETA appear after the first batches of the first layer.

Every layer runs each expert's calibration tokens through the layer once
(statistics); the bar advances by each batch's non-padding tokens. Layers a
resumed run replays are counted as done from the start, so the rate is that of
new work. Each finished layer also gives one plain line (elapsed, rate, ETA) to
the log file, and to the terminal with --verbose.
"""

from __future__ import annotations

import sys
import time

from featcal_llm import runlog


class NullProgress:
    def tokens(self, count: int) -> None:
        pass

    def layer_done(self, layer: int) -> None:
        pass

    def close(self) -> None:
        pass


class TokenProgress(NullProgress):
    def __init__(self, layers: int, tokens_per_layer: int, done_layers: int = 0, show: bool = True, method: str = "FeatCal"):
        from tqdm.auto import tqdm

        self.layers, self.per_layer, self.method = layers, max(1, tokens_per_layer), method
        self.done = done_layers * self.per_layer
        self.start, self.counted = time.perf_counter(), 0
        self.bar = tqdm(
            total=layers * self.per_layer, initial=self.done, desc=f"{method} layer {min(done_layers + 1, layers)}/{layers}", unit="tok",
            unit_scale=True, file=sys.stderr, disable=not show, smoothing=0.05, dynamic_ncols=True,
        )

    def tokens(self, count: int) -> None:
        self.counted += count
        self.bar.update(count)

    def layer_done(self, layer: int) -> None:
        self.bar.set_description(f"{self.method} layer {min(layer + 2, self.layers)}/{self.layers}", refresh=False)
        elapsed = time.perf_counter() - self.start
        rate = self.counted / elapsed if elapsed > 0 else 0.0
        left = (self.layers - layer - 1) * self.per_layer
        eta = f", about {_duration(left / rate)} left" if rate > 0 and left else ""
        runlog.note(f"layer {layer + 1}/{self.layers} calibrated ({_duration(elapsed)} elapsed, {rate:,.0f} tokens/s{eta})")

    def close(self) -> None:
        self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
