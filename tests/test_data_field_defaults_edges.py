"""The edges of the record fields an entry leaves to its defaults (io/data_fields.py), which a mutation round found
unpinned: the keys an entry names are read as named (never overridden by a default), a `messages` column is read
wherever it stands among the fields, records with only one of prompt and response read their messages, and alpaca
records without their instruction are refused for it first.

References, independent of the product: the tokenizer's own `apply_chat_template(messages, tokenize=True)` ids, and
the one-line refusal the run and `validate` both give (the same line from both).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import calibration_sequences
from featcal_llm.io.validate_data import check_data
from featcal_llm.tiny import build_char_tokenizer

TURNS = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]


def _write(folder: Path, rows: list[dict]) -> str:
    (folder / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder / "d.jsonl")


def _template_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def _read(spec: DataSpec, folder: Path, tokenizer) -> list[list[int]]:
    read = calibration_sequences({"e": spec}, ["e"], tokenizer, 8, 512, False, 0, folder / "r.yaml")["e"]
    return [list(record) for record in read]


def _refusals(spec: DataSpec, folder: Path) -> tuple[str, str]:
    """The run's line and validate's for the same entry, the recipe path written alike."""
    with pytest.raises(FeatCalError) as run:
        _read(spec, folder, build_char_tokenizer())
    with pytest.raises(FeatCalError) as validate:
        check_data(spec, "r.yaml: featcal.data.e", folder, False, [])
    return str(run.value).replace(str(folder / "r.yaml"), "r.yaml"), str(validate.value)


@pytest.mark.parametrize("row", [
    {"id": "0", "messages": TURNS},  # the messages column after another
    {"prompt": "ignored", "messages": TURNS},  # a prompt but no response: not a prompt/response record
    {"messages": TURNS, "response": "ignored"},  # a response but no prompt
], ids=["messages-second", "prompt-only", "response-only"])
def test_chat_records_without_both_prompt_and_response_read_their_messages_column(tmp_path, row):
    path = _write(tmp_path, [row])
    tokenizer = build_char_tokenizer()
    assert _read(DataSpec(path=path, format="chat"), tmp_path, tokenizer) == [_template_ids(tokenizer, TURNS)]
    assert check_data(DataSpec(path=path, format="chat"), "r.yaml: featcal.data.e", tmp_path, False, []) == 1


def test_a_chat_entry_that_names_its_prompt_field_reads_its_prompt_and_response_not_the_messages(tmp_path):
    tokenizer = build_char_tokenizer()
    path = _write(tmp_path, [{"question": "1+1?", "response": "2", "messages": TURNS}])
    asked = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    assert _read(DataSpec(path=path, format="chat", prompt="question"), tmp_path, tokenizer) == [_template_ids(tokenizer, asked)]
    (tmp_path / "b").mkdir()
    lacking = _write(tmp_path / "b", [{"question": "1+1?", "messages": TURNS}])  # its response field is missing
    run, validate = _refusals(DataSpec(path=lacking, format="chat", prompt="question"), tmp_path / "b")
    assert run == validate == ("r.yaml: featcal.data.e: record 0 has no field 'response' (fields: question, messages); "
                               "write `messages: messages` in this entry")


def test_an_alpaca_entry_that_names_its_response_field_is_refused_for_it_not_read_from_output(tmp_path):
    path = _write(tmp_path, [{"instruction": "add 2 and 3", "output": "5"}])
    run, validate = _refusals(DataSpec(path=path, format="alpaca", response="answer"), tmp_path)
    assert run == validate == ("r.yaml: featcal.data.e: record 0 has no field 'answer' (fields: instruction, output); "
                               "write `response: output` in this entry")


@pytest.mark.parametrize("row", [{"question": "add 2 and 3", "answer": "5"}, {"question": "add 2 and 3", "output": "5"}],
                         ids=["no-output", "output"])
def test_alpaca_records_without_their_instruction_are_refused_for_it_first(tmp_path, row):
    path = _write(tmp_path, [row])
    run, validate = _refusals(DataSpec(path=path, format="alpaca"), tmp_path)
    assert run == validate == (f"r.yaml: featcal.data.e: record 0 has no field 'instruction' (fields: {', '.join(row)}); "
                               "write `instruction: question` in this entry")


def test_a_chat_entry_that_names_its_messages_field_reads_it_whatever_else_the_records_hold(tmp_path):
    tokenizer = build_char_tokenizer()
    other = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for rows in ([{"conversation": TURNS}], [{"conversation": TURNS, "messages": other}]):
        path = _write(tmp_path, rows)
        spec = DataSpec(path=path, format="chat", messages="conversation")
        assert _read(spec, tmp_path, tokenizer) == [_template_ids(tokenizer, TURNS)]
        assert check_data(spec, "r.yaml: featcal.data.e", tmp_path, False, []) == 1


@pytest.mark.parametrize("row, suggested", [({"instruction": "add", "answer": "5"}, " (response: answer?)"),
                                            ({"instruction": "add", "completion": "5"}, " (response: completion?)"),
                                            ({"instruction": "add", "result": "5"}, "")])
def test_alpaca_records_with_no_response_field_are_refused_with_the_likely_one_suggested(tmp_path, row, suggested):
    path = _write(tmp_path, [row])
    run, validate = _refusals(DataSpec(path=path, format="alpaca"), tmp_path)
    assert run == validate == (f"r.yaml: featcal.data.e.path: {path}: format: alpaca reads the response from a `response` "
                               f"field (or `output`, Stanford Alpaca's name), and its records have {', '.join(row)}; name the "
                               f"one holding it with response:{suggested}")
