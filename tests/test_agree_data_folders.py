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


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_record_in_a_dataset_folder_is_refused_alike(scenario, tmp_path, case):
    rows, keys, write, said = CASES[case]
    recipe = recipe_of(scenario, tmp_path)
    write(tmp_path / "ds", rows)
    recipe["featcal"]["data"][expert_of(recipe, 0)] = {"path": str(tmp_path / "ds"), **keys}
    line = refused_alike(recipe, tmp_path)[0]
    assert line.endswith(f"featcal.data.{expert_of(recipe, 0)}.path: {tmp_path / 'ds'}: {said}"), line
    assert not (tmp_path / "merged").exists()


def test_validate_reads_a_folder_s_records_in_the_order_the_run_numbers_them(tmp_path):
    """The records validate checks are those the run loads, in its order: a save_to_disk folder of two Arrow shards
    (load_from_disk), and a folder of data files (load_dataset: the split's files in datasets' order, not by name
    length), each against datasets' own loading; a bad record in the second file is named by its place in the split."""
    import datasets

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data_files import load_records, saved_records
    from featcal_llm.io.validate_data import check_data

    rows = [{"text": f"record {i}"} for i in range(7)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) == 2
    assert saved_records(tmp_path / "saved", "train", 100) == list(load_records(DataSpec(path=str(tmp_path / "saved")), "e")) == rows
    assert saved_records(tmp_path / "saved", "train", 5) == rows[:5]
    (tmp_path / "files").mkdir()
    for name, chunk in (("train-10.jsonl", rows[4:]), ("train-9.jsonl", rows[2:4]), ("train-1.jsonl", rows[:2])):
        (tmp_path / "files" / name).write_text("".join(json.dumps(row) + "\n" for row in chunk))
    loaded = list(load_records(DataSpec(path=str(tmp_path / "files")), "e"))
    (tmp_path / "files" / "train-9.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": ""}) + "\n")
    number = [row["text"] for row in loaded].index("record 3")  # the blank record's place in the split, as run numbers it
    with pytest.raises(FeatCalError, match=rf": record {number}: field 'text' is empty; drop the record or fill it$"):
        check_data(DataSpec(path=str(tmp_path / "files")), "featcal.data.e", tmp_path, False, [])
    assert check_data(DataSpec(path=str(tmp_path / "files")), "featcal.data.e", tmp_path, False, [], taken=number) is None
