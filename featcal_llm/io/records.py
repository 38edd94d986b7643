"""A calibration record's token ids and the spans of its response tokens (no torch here: the data stage loads without it)."""

from __future__ import annotations

from collections.abc import Iterable

Span = tuple[int, int]  # [start, end) token indices


class Record(list):
    """One calibration record's token ids, knowing which of them are its response's.

    Whether an expert leads the merge on its records (which decides who
    teaches them, engine/teachers.py) is judged on the responses of
    prompt/response records (`alpaca`, `chat`, `completion`): that is what an
    expert was trained to predict and what a user's benchmarks score, while a
    prompt's tokens are whatever the user typed. A conversation has one span per
    assistant turn (the user and system turns between them are not judged);
    the other formats one, from the response's start to the record's end. A
    plain list is judged on every token: plain text, and the texts an expert
    samples itself (`generate:`), whose prompts (a user's, the seed requests, a
    chat template's turn markers) are judged with what the expert wrote. Every
    token is a calibration sample either way.
    """

    def __init__(self, ids: list[int], response_from: int | None = None, spans: Iterable[Span] | None = None):
        super().__init__(ids)
        if (response_from is None) == (spans is None):
            raise TypeError("a Record takes either response_from or spans")
        self.spans = clip_spans([(response_from, len(self))] if spans is None else spans, len(self))

    @property
    def response_from(self) -> int:
        """Index of the first response token (the record's length where none is left)."""
        return self.spans[0][0] if self.spans else len(self)


def clip_spans(spans: Iterable[Span], length: int) -> tuple[Span, ...]:
    """Spans within [0, length), in order, empty ones dropped, overlapping or touching ones joined."""
    result: list[Span] = []
    for start, end in sorted((max(start, 0), min(end, length)) for start, end in spans):
        if start >= end:
            continue
        if result and start <= result[-1][1]:
            result[-1] = (result[-1][0], max(end, result[-1][1]))
        else:
            result.append((start, end))
    return tuple(result)


def response_spans(sequence: list[int]) -> tuple[Span, ...]:
    """A `Record`'s response spans; the whole of plain text."""
    return sequence.spans if isinstance(sequence, Record) else clip_spans([(0, len(sequence))], len(sequence))


def response_from(sequence: list[int]) -> int:
    """Index of a sequence's first response token: a `Record`'s response start, 0 for plain text."""
    return getattr(sequence, "response_from", 0)


def response_mask(length: int, spans: Iterable[Span]) -> list[bool]:
    """Per token of a record of `length` tokens: whether it is a response token (inside one of `spans`)."""
    mask = [False] * length
    for start, end in clip_spans(spans, length):
        mask[start:end] = [True] * (end - start)
    return mask


def judged_positions(length: int, spans: Iterable[Span]) -> list[int]:
    """The positions p whose next token p + 1 is a response token: those a record is judged on (a record's first
    token has no predecessor, so it is never judged, and its last predicts nothing)."""
    return [p for start, end in clip_spans(spans, length) for p in range(max(start - 1, 0), end - 1)]
