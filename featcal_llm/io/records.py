"""A calibration record's token ids and where its response starts (no torch here: the data stage loads without it)."""

from __future__ import annotations


class Record(list):
    """One calibration record's token ids, knowing where its response starts.

    Whether an expert leads the merge on its records (which decides who
    teaches them, engine/teachers.py) is judged on the responses of
    prompt/response records (`alpaca`, `chat`, `completion`): that is what an
    expert was trained to predict and what a user's benchmarks score, while a
    prompt's tokens are whatever the user typed. A plain list is judged on
    every token: plain text, and the texts an expert samples itself
    (`generate:`), whose prompts (a user's, the seed requests, a chat
    template's turn markers) are judged with what the expert wrote. Every token
    is a calibration sample either way.
    """

    def __init__(self, ids: list[int], response_from: int):
        super().__init__(ids)
        self.response_from = response_from  # index of the first response token (its prediction is scored)


def response_from(sequence: list[int]) -> int:
    """Index of a sequence's first scored token: a `Record`'s response start, 0 for plain text."""
    return getattr(sequence, "response_from", 0)
