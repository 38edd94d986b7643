"""Which generated samples are not worth calibrating on (the stated rule, counted in the log).

A sample is dropped when its continuation has
- no ordinary token (nothing, or only special tokens such as an immediate EOS): "empty";
- a repetition loop: with at least LOOP_MIN_TOKENS ordinary tokens, fewer than
  LOOP_DISTINCT_SHARE of the LOOP_NGRAM-grams in the second half of them are
  distinct (a loop of period p over n tokens leaves about p of n distinct;
  ordinary text keeps nearly all of them distinct).
"""

from __future__ import annotations

LOOP_NGRAM = 4
LOOP_MIN_TOKENS = 32
LOOP_DISTINCT_SHARE = 0.3
REASONS = ("empty", "repetition loop")


def degeneracy(continuation: list[int], special_ids: set[int]) -> str | None:
    """Why the sample is dropped (one of REASONS), or None to keep it."""
    ordinary = [token for token in continuation if token not in special_ids]
    if not ordinary:
        return "empty"
    if len(ordinary) >= LOOP_MIN_TOKENS:
        tail = ordinary[len(ordinary) // 2 :]
        grams = [tuple(tail[i : i + LOOP_NGRAM]) for i in range(len(tail) - LOOP_NGRAM + 1)]
        if len(set(grams)) < LOOP_DISTINCT_SHARE * len(grams):
            return "repetition loop"
    return None
