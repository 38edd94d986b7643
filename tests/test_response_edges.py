"""Edges of a record's response (io/records.py, io/data.py's turn spans and encoding) that a mutation round found
unpinned, each against a computation by hand: the bytes a data digest is taken of, token ids built one a character."""

from __future__ import annotations

import hashlib

import numpy as np

from featcal_llm.engine.resume import sequences_digest
from featcal_llm.io.records import Record, response_from


def test_plain_text_is_judged_from_its_first_token_and_digests_as_its_ids_alone():
    """Plain text (a list, not a Record) has no prompt: its response starts at 0, and its data digest is its ids and
    the record separator only, as before responses were told apart (saved progress of a text run still resumes)."""
    ids = [5, 6, 7, 8]
    assert response_from(ids) == 0 and response_from(Record(ids, 2)) == 2 and response_from(Record(ids, 4)) == 4
    by_hand = hashlib.sha256(b"a" + np.array(ids, dtype=np.int64).tobytes() + b"|").hexdigest()
    assert sequences_digest({"a": [ids]}) == by_hand
    assert sequences_digest({"a": [Record(ids, 0)]}) == by_hand  # a response that is the whole record: every token


# A template that renders an empty assistant turn as exactly its generation prompt: nothing follows the prompt there.
BARE_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _conversation_refusal(tmp_path, second: str, max_length: int) -> str:
    """The run's refusal of one conversation whose first answer is empty and whose second is `second`."""
    import json

    import pytest

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data import calibration_sequences
    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = BARE_TEMPLATE
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
             {"role": "user", "content": "say it"}, {"role": "assistant", "content": second}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    spec = DataSpec(path="c.jsonl", format="chat", messages="messages")
    with pytest.raises(FeatCalError) as refused:
        calibration_sequences({"e": spec}, ["e"], tokenizer, 1, max_length, False, 0, tmp_path / "r.yaml")
    return str(refused.value)


def test_a_conversation_whose_only_answer_is_cut_is_refused_for_max_length_not_as_empty(tmp_path):
    """Its first answer is empty (the template renders it as the generation prompt alone), its second is past
    max_length: the responses are not all empty, so the refusal says the prompts fill max_length; every answer
    empty says so. `<user>hi<assistant><user>say it<assistant>` is 42 characters, one token each."""
    where = f"{tmp_path / 'r.yaml'}: featcal.data.e"
    assert _conversation_refusal(tmp_path, "ok", 42) == (f"{where}: no record keeps a response token within featcal.max_length "
                                                        "42 (the prompts fill it); raise max_length or shorten the prompts")
    assert _conversation_refusal(tmp_path, "", 64) == f"{where}: no record has a response to score: every response is empty"


def test_a_response_whose_one_token_repeats_the_prompt_s_last_is_kept():
    """The prompt `ab` and the response `b` (a tokenizer adding no special token: one id a character): the record is
    a, b, b and its response is the last b, though it is the prompt's last token again (only a special token the
    tokenizer appends to the prompt alone, its EOS, means no response is left)."""
    from featcal_llm.io.data import tokenize_texts
    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    assert tokenizer("ab")["input_ids"] == [a, b]
    [record] = tokenize_texts(["abb"], tokenizer, 64, "w", ["ab"])
    assert list(record) == [a, b, b] and record.spans == ((2, 3),)


def test_records_whose_prompts_fill_max_length_beside_one_that_keeps_a_response_are_kept():
    """Only an expert none of whose records keeps a response token is refused: here `aaaa` (its prompt alone, 4
    tokens past max_length 3) keeps none, `abb` keeps its last b."""
    from featcal_llm.io.data import tokenize_texts
    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    kept, filled = tokenize_texts(["abb", "aaaab"], tokenizer, 3, "w", ["ab", "aaaa"])
    assert (list(kept), kept.spans) == ([a, b, b], ((2, 3),)) and (list(filled), filled.spans) == ([a, a, a], ())


def test_plain_text_that_starts_with_the_bos_gets_no_second_one():
    """A tokenizer that wraps plain text in <s> ... </s> (a Llama-style post-processor) encodes text that already
    opens with <s> with no special token added (no second BOS), and other text wrapped; ids by hand."""
    from tokenizers import processors

    from featcal_llm.io.data import encode
    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    h, i = tokenizer.convert_tokens_to_ids(["h", "i"])
    assert encode("hi", tokenizer) == [bos, h, i, eos]
    assert encode("<s>hi", tokenizer) == [bos, h, i]
