"""Whether two experts' generated sets are nearly the same text (experts that differ in kind should get different data).

The measure: the overlap Σ_g min(p(g), q(g)) of two sets' token-bigram frequencies (1: the same bigrams in the same
proportions, 0: none shared). A finite sample of one distribution does not overlap itself fully, so the overlap of
two sets is compared with the overlap of the two halves of each set (odd and even samples, so that both comparisons
use sets of the same size): when the sets overlap at least ALIKE_SHARE as much as a set's halves do, they are no more
different than two draws of one distribution, and a warning says so.
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations

ALIKE_SHARE = 0.9
MIN_SAMPLES = 4  # per set: fewer and the halves say nothing


def bigrams(sequences: list[list[int]]) -> Counter:
    counts: Counter = Counter()
    for sequence in sequences:
        counts.update(zip(sequence, sequence[1:]))
    return counts


def overlap(a: Counter, b: Counter) -> float:
    """Σ_g min(p(g), q(g)) of the two frequency tables (0 when either is empty)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    if not total_a or not total_b:
        return 0.0
    return sum(min(count / total_a, b[gram] / total_b) for gram, count in a.items() if gram in b)


def alikeness(a: list[list[int]], b: list[list[int]]) -> tuple[float, float] | None:
    """(overlap between the sets, overlap within them), both on half-sets; None when a set is too small to tell."""
    if min(len(a), len(b)) < MIN_SAMPLES:
        return None
    a0, a1, b0, b1 = bigrams(a[0::2]), bigrams(a[1::2]), bigrams(b[0::2]), bigrams(b[1::2])
    between = (overlap(a0, b1) + overlap(a1, b0)) / 2
    within = (overlap(a0, a1) + overlap(b0, b1)) / 2
    return between, within


def look_alike(sets: dict[str, list[list[int]]]) -> list[tuple[str, str, float, float]]:
    """(expert, expert, between, within) for every pair whose sets overlap at least ALIKE_SHARE × as much as their halves."""
    found = []
    for first, second in combinations(sets, 2):
        measured = alikeness(sets[first], sets[second])
        if measured is not None and measured[1] > 0 and measured[0] >= ALIKE_SHARE * measured[1]:
            found.append((first, second, *measured))
    return found
