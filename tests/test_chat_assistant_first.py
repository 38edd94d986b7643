"""A conversation that opens with the assistant's turn (a greeting before the user speaks) is calibrated on, every
assistant turn judged, as `validate` passes it. The run rendered the conversation before each assistant turn to find
where the turn starts, and for an opening turn that is no conversation at all: transformers refuses to render an empty
one, so the run refused the record ("the tokenizer's chat template refused it (Cannot apply chat template to an empty
conversation ...)") though the template renders the record itself. The opening turn is judged from the record's start
(nothing is said before it); the others as before.

Reference: the tokenizer's own `apply_chat_template(..., tokenize=True)` ids of the record and of its prefixes.
"""

from __future__ import annotations

import json
from pathlib import Path

from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import calibration_sequences
from featcal_llm.io.validate_data import check_data
from featcal_llm.tiny import build_char_tokenizer

OPENING = [{"role": "assistant", "content": "hello, how can i help"}, {"role": "user", "content": "add 2 and 3"},
           {"role": "assistant", "content": "5"}]


def _ids(tokenizer, messages, **options) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"])


def test_a_conversation_opening_with_the_assistant_is_read_and_judged_on_every_assistant_turn(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": OPENING}) + "\n" + json.dumps({"messages": OPENING[1:]}) + "\n")
    spec = DataSpec(path=str(path), format="chat")
    assert check_data(spec, "r.yaml: featcal.data.e", tmp_path, False, []) == 2  # validate: two records, no problem
    tokenizer = build_char_tokenizer()
    first, second = calibration_sequences({"e": spec}, ["e"], tokenizer, 2, 512, False, 0, Path(tmp_path / "r.yaml"))["e"]
    ids = _ids(tokenizer, OPENING)
    assert list(first) == ids
    opening_end = len(_ids(tokenizer, OPENING[:1]))  # the template renders each turn after the ones before it unchanged
    reply_start = len(_ids(tokenizer, OPENING[:2], add_generation_prompt=True))
    assert first.spans == ((0, opening_end), (reply_start, len(ids)))
    assert list(second) == _ids(tokenizer, OPENING[1:])  # the same exchange without the greeting, as before
    assert second.spans == ((len(_ids(tokenizer, OPENING[1:2], add_generation_prompt=True)), len(second)),)
