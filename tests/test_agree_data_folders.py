"""`validate` reads the first records of a local dataset folder as it reads a data file's, so that a record `run`
refuses is refused by both, in the same line: a folder `save_to_disk` wrote (HF's own way to keep a prepared set) and
a folder of data files (datasets' layout, split by file name). Before, validate checked such a folder's fields only and
said ok, and run refused the record after loading the tokenizer (an empty `messages` list, a whitespace text, a
number where text is read)."""

from __future__ import annotations

import json

import pytest

from agreement import expert_of, recipe_of, refused_alike

TURNS = [{"role": "user", "content": "what is two and two"}, {"role": "assistant", "content": "four"}]


def _saved(folder, rows, split=None):
    import datasets

    dataset = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: dataset}) if split else dataset).save_to_disk(str(folder))


def _files(folder, rows, name="train.jsonl"):
    folder.mkdir()
    (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


CASES = {  # name → (rows, the entry's keys, the folder's writer, the line's end)
    "saved chat, an empty messages list": ([{"messages": TURNS}] * 2 + [{"messages": []}], {"format": "chat"}, _saved,
                                           "record 2: field 'messages' is []; format: chat reads a non-empty list of {role, content} messages with text in both"),
    "saved split, a whitespace text": ([{"text": "hello there"}, {"text": "  \n"}], {"split": "validation"},
                                       lambda f, r: _saved(f, r, "validation"), "record 1: field 'text' is only whitespace; drop the record or fill it"),
    "saved, a number for the text": ([{"text": 7}, {"text": 8}], {}, _saved,
                                     "record 0: field 'text' is a number (int), not a string; format: text reads it as text"),
    "saved alpaca, a number for the input": ([{"instruction": "add", "input": 3, "output": "5"}], {"format": "alpaca"}, _saved,
                                             "record 0: field 'input' is a number (int), not a string; format: alpaca reads it as text"),
    "data files, an empty messages list": ([{"messages": TURNS}, {"messages": []}], {"format": "chat"}, _files,
                                           "record 1: field 'messages' is []; format: chat reads a non-empty list of {role, content} messages with text in both"),
    "data files, a null text": ([{"text": "hello"}, {"text": None}], {}, lambda f, r: _files(f, r, "train-00000.jsonl"),
                                "record 1: field 'text' is null (or missing: datasets fills a field some records lack with null), not a string; format: text reads it as text"),
}


@pytest.mark.xfail(strict=True, reason="validate checks a dataset folder's fields, not its records: it says ok, run refuses")
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_record_in_a_dataset_folder_is_refused_alike(scenario, tmp_path, case):
    rows, keys, write, said = CASES[case]
    recipe = recipe_of(scenario, tmp_path)
    write(tmp_path / "ds", rows)
    recipe["featcal"]["data"][expert_of(recipe, 0)] = {"path": str(tmp_path / "ds"), **keys}
    line = refused_alike(recipe, tmp_path)[0]
    assert line.endswith(f"featcal.data.{expert_of(recipe, 0)}.path: {tmp_path / 'ds'}: {said}"), line
    assert not (tmp_path / "merged").exists()
