"""The span arithmetic of a record's response (io/records.py, maths/advantage.judged_tokens) against a brute force
token by token: a token is a response token where some span holds it (spans cut to the record, overlapping or touching
ones joined), and a position p is judged where token p + 1 is a response token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from featcal_llm.io.records import Record, clip_spans, judged_positions, response_mask, response_spans
from featcal_llm.maths.advantage import judged_tokens

LENGTHS = st.integers(0, 24)
SPANS = st.lists(st.tuples(st.integers(-3, 28), st.integers(-3, 28)), max_size=5)


def _held(length: int, spans: list[tuple[int, int]]) -> list[bool]:
    return [any(start <= t < end for start, end in spans) for t in range(length)]


def _runs(mask: list[bool]) -> tuple[tuple[int, int], ...]:
    runs, start = [], None
    for t, held in enumerate(mask + [False]):
        if held and start is None:
            start = t
        elif not held and start is not None:
            runs.append((start, t))
            start = None
    return tuple(runs)


@settings(max_examples=400, deadline=None)
@given(LENGTHS, SPANS)
def test_spans_masks_and_judged_positions_are_the_brute_force_s(length, spans):
    held = _held(length, spans)
    assert clip_spans(spans, length) == _runs(held)
    assert response_mask(length, spans) == held
    judged = [p for p in range(length - 1) if held[p + 1]]
    assert judged_positions(length, spans) == judged
    assert judged_tokens(length, list(clip_spans(spans, length))) == len(judged)


@settings(max_examples=200, deadline=None)
@given(LENGTHS, SPANS)
def test_a_record_keeps_its_spans_cut_to_its_tokens_and_plain_text_is_one_span(length, spans):
    record = Record(list(range(length)), spans=spans)
    assert response_spans(record) == _runs(_held(length, spans))
    assert record.response_from == (record.spans[0][0] if record.spans else length)
    assert response_spans(list(range(length))) == (((0, length),) if length else ())
    start = min(max(spans[0][0], 0), length) if spans else 0
    assert Record(list(range(length)), start).spans == (((start, length),) if start < length else ())
