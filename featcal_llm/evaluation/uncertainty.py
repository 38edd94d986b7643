"""How sure a score and a difference are, from lm-eval's per-sample records.

- standard error of a task score: the sample standard deviation of the per-item scores / sqrt(n);
- a comparison (calibrated vs merged on the same items): a seeded paired bootstrap over items of
  the mean difference (percentile interval), and McNemar's exact test when items score 0 or 1.
The average column's interval resamples every task's items in the same iteration and averages the
per-task differences, as the average itself is formed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ITERATIONS = 10_000
SEED = 0
CONFIDENCE = 0.95


def per_item_scores(samples_file: Path, metric_key: str) -> dict[int, float]:
    """doc_id -> the metric's value, from lm-eval's samples log, for the metric's filter. Several
    records of one item (n samples) are averaged."""
    metric, filter_name = metric_key.split(",", 1)
    values: dict[int, list[float]] = {}
    with samples_file.open() as handle:
        for line in handle:
            sample = json.loads(line)
            if sample.get("filter", filter_name) != filter_name or metric not in sample:
                continue
            values.setdefault(int(sample["doc_id"]), []).append(float(sample[metric]))
    return {doc: sum(v) / len(v) for doc, v in values.items()}


def stderr(values) -> float | None:
    values = np.asarray(list(values), dtype=np.float64)
    if values.size < 2:
        return None
    return float(values.std(ddof=1) / math.sqrt(values.size))


@dataclass(frozen=True)
class Comparison:
    delta: float          # mean(other - base) over the shared items
    low: float            # paired-bootstrap percentile interval
    high: float
    n: int
    p_mcnemar: float | None  # exact McNemar p-value (binary items only)


def paired(base: dict[int, float], other: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    shared = sorted(set(base) & set(other))
    return (np.array([base[i] for i in shared], dtype=np.float64),
            np.array([other[i] for i in shared], dtype=np.float64))


def bootstrap_deltas(pairs: list[tuple[np.ndarray, np.ndarray]], iterations: int = ITERATIONS,
                     seed: int = SEED) -> np.ndarray:
    """Per iteration, the mean over tasks of the mean paired difference on resampled items."""
    rng = np.random.default_rng(seed)
    total = np.zeros(iterations)
    for base, other in pairs:
        diff = other - base
        indices = rng.integers(0, diff.size, size=(iterations, diff.size))
        total += diff[indices].mean(axis=1)
    return total / len(pairs)


def mcnemar_p(base: np.ndarray, other: np.ndarray) -> float | None:
    """Two-sided exact McNemar test on the discordant items (None unless every score is 0 or 1)."""
    if not (np.isin(base, (0.0, 1.0)).all() and np.isin(other, (0.0, 1.0)).all()):
        return None
    gained = int(((base == 0) & (other == 1)).sum())
    lost = int(((base == 1) & (other == 0)).sum())
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(pairs: list[tuple[np.ndarray, np.ndarray]], iterations: int = ITERATIONS, seed: int = SEED,
            confidence: float = CONFIDENCE) -> Comparison | None:
    """Difference of `other` over `base` (one task: one pair; the average: every task's pair)."""
    pairs = [(b, o) for b, o in pairs if b.size]
    if not pairs:
        return None
    deltas = bootstrap_deltas(pairs, iterations, seed)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(deltas, [alpha, 1 - alpha])
    delta = float(np.mean([(o - b).mean() for b, o in pairs]))
    p = mcnemar_p(*pairs[0]) if len(pairs) == 1 else None
    return Comparison(delta, float(low), float(high), int(sum(b.size for b, _ in pairs)), p)
