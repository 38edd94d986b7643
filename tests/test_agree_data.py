"""`validate` says what `run` will say about the calibration data: files, dataset directories, JSON lines, CSV and
parquet, as datasets reads them (each test one edit, both commands asked; run's own reader past validate too)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from agreement import dataset_directory, error_lines, expert_of, first_data_file, recipe_of, refused_alike


def test_files_opening_with_a_utf8_bom_are_read_as_datasets_reads_them(scenario, tmp_path):
    """Excel's "CSV UTF-8" and editors that write a BOM: validate reads the fields and counts as run's reader does."""
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data_files import load_records
    from featcal_llm.io.validate import check_recipe

    recipe = recipe_of(scenario, tmp_path)
    texts = [f"record number {i}" for i in range(6)]
    (tmp_path / "bom.csv").write_text("text\n" + "".join(f'"{text}"\n' for text in texts), encoding="utf-8-sig")
    (tmp_path / "bom.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8-sig")
    (tmp_path / "bom.json").write_text(json.dumps([{"text": text} for text in texts]), encoding="utf-8-sig")
    for name, source in zip(recipe["featcal"]["data"], ("bom.csv", "bom.jsonl", "bom.json")):
        recipe["featcal"]["data"][name] = {"path": str(tmp_path / source), "samples": 6}
    path = tmp_path / "bom.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    report = check_recipe(path, plan=False)
    assert report.problems == [] and not any("records" in note for note in report.notes), report.notes
    for source in ("bom.csv", "bom.jsonl", "bom.json"):
        assert list(load_records(DataSpec(path=str(tmp_path / source)), "w")["text"]) == texts


def test_a_data_path_missing_its_extension_is_caught_as_a_typo(scenario, tmp_path, monkeypatch):
    """`path: data/code` where data/ is a local folder holding code.jsonl: validate took it for a hub dataset id (a note,
    exit 0) where run refuses it ("cannot load calibration data (Couldn't reach 'data/code' on the Hub ...)" offline);
    as for featcal.tokenizer, a path under a local directory is no hub id, and the close local name is the typo."""
    monkeypatch.chdir(tmp_path)
    recipe = recipe_of(scenario, tmp_path)
    (tmp_path / "data").mkdir()
    shutil.copy(recipe["featcal"]["data"][expert_of(recipe, 0)]["path"], tmp_path / "data" / "code.jsonl")
    recipe["featcal"]["data"][expert_of(recipe, 0)]["path"] = "data/code"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    validated = CliRunner().invoke(main, ["validate", str(path)])
    assert validated.exit_code == 2, validated.output
    assert len(error_lines(validated)) == 1 and f"featcal.data.{expert_of(recipe, 0)}.path: data/code" in error_lines(validated)[0]
    assert "data/code.jsonl" in error_lines(validated)[0]


def test_a_dataset_directory_whose_splits_differ_in_format_is_refused_alike(scenario, tmp_path):
    """A local dataset directory of train.jsonl and test.csv: validate reads its splits from the file names and had
    passed it; run refused it as datasets does ("Couldn't infer the same data file format for all splits")."""
    recipe = recipe_of(scenario, tmp_path)
    records = Path(recipe["featcal"]["data"][expert_of(recipe, 0)]["path"]).read_text()
    dataset_directory(recipe, tmp_path, {"train.jsonl": records, "test.csv": "text\nhello there\n"})
    refused_alike(recipe, tmp_path)
    assert not (tmp_path / "merged").exists()


def test_a_dataset_directory_without_the_field_asked_for_is_refused_alike(scenario, tmp_path):
    """`text: body` for a local dataset directory whose train.jsonl has only `text`: validate checks the fields of a
    data file and had passed the directory; run refused it ("record 0 has no field 'body' (fields: text)")."""
    recipe = recipe_of(scenario, tmp_path)
    records = Path(recipe["featcal"]["data"][expert_of(recipe, 0)]["path"]).read_text()
    dataset_directory(recipe, tmp_path, {"train.jsonl": records}, text="body")
    assert "no field 'body'" in refused_alike(recipe, tmp_path)[0]
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("line", ['{"text": "a", "text": "b"}', '{"text": "a", "id": 1, "id": 2}'])
def test_a_jsonl_record_with_a_key_given_twice_is_refused_alike(scenario, tmp_path, line):
    """A JSON-lines record that repeats a key (Python's json keeps the last; pyarrow, which datasets reads it with, refuses
    it): validate passed the file; run refused it, exit 2, in words naming neither record nor key: "cannot load
    calibration data (An error occurred while generating the dataset)" (after datasets' own unprefixed log line
    "... ArrowInvalid ...: Column(/text) was specified twice in row 10")."""
    recipe = recipe_of(scenario, tmp_path)
    records = [json.dumps({"text": f"hello record {i}"}) for i in range(19)]
    first_data_file(recipe, tmp_path, "twice.jsonl", "\n".join(records[:10] + [line] + records[10:]) + "\n")  # record 10
    [error] = refused_alike(recipe, tmp_path)
    key = "text" if line.count('"text"') == 2 else "id"
    assert error.endswith(f"twice.jsonl: record 10 gives the key {key!r} twice; keep one (datasets refuses a repeated key)"), error
    ran = CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")])
    assert [line for line in ran.stderr.splitlines() if line.strip()] == [f"featcal-llm: error: {error}"], ran.stderr  # datasets' log unshown


def test_a_parquet_file_whose_text_column_holds_numbers_is_refused_alike(scenario, tmp_path):
    """A parquet file whose `text` column is int64: validate passed it (it checks a JSON or CSV file's fields, not a
    parquet file's); run refused it before the merge, "p.parquet: record 0: field 'text' is a int, not a string;
    format: text reads it as text"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    recipe = recipe_of(scenario, tmp_path)
    pq.write_table(pa.table({"text": list(range(20))}), tmp_path / "p.parquet")
    recipe["featcal"]["data"][expert_of(recipe, 0)] = {"path": str(tmp_path / "p.parquet")}
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith("p.parquet: record 0: field 'text' is a number (int), not a string; format: text reads it as text"), line


def test_a_csv_row_with_more_cells_than_the_header_is_refused_alike(scenario, tmp_path):
    """A CSV file whose row 10 has three cells under a one-column header: validate passed it; run refused it before the
    merge in words naming neither row nor cause: "c.csv: cannot load calibration data (An error occurred while
    generating the dataset)"."""
    recipe = recipe_of(scenario, tmp_path)
    rows = [f"hello {i}" for i in range(20)]
    first_data_file(recipe, tmp_path, "c.csv", "text\n" + "\n".join(rows[:10] + ["x,y,z"] + rows[10:]) + "\n")
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith("c.csv: cannot load calibration data (Error tokenizing data. C error: Expected 1 fields in line 12, saw 3)"), line


@pytest.mark.parametrize("shuffle", [False, True])
def test_run_s_own_reader_names_a_repeated_key_and_hides_datasets_log(tmp_path, caplog, capsys, shuffle):
    """run's reader, past validate: a JSON-lines record that repeats a key (datasets refuses the file, after logging
    Arrow's error) is one line naming the record and the key, and datasets' log line is not shown; a plain file reads."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data import calibration_sequences

    class Words:  # a tokenizer of whitespace words, enough to read text records
        def __call__(self, texts, **kwargs):
            return {"input_ids": [[len(word) for word in text.split()] for text in texts]}

    records = [json.dumps({"text": f"hello record {i}"}) for i in range(6)]
    (tmp_path / "twice.jsonl").write_text("\n".join(records[:3] + ['{"text": "a", "text": "b"}'] + records[3:]) + "\n")
    spec = DataSpec(path=str(tmp_path / "twice.jsonl"), format="text")
    with pytest.raises(FeatCalError) as refused:
        calibration_sequences({"e": spec}, ["e"], Words(), 8, 16, shuffle, 0, tmp_path / "r.yaml")
    assert str(refused.value) == (f"{tmp_path / 'r.yaml'}: featcal.data.e.path: {spec.path}: record 3 gives the key 'text' "
                                  "twice; keep one (datasets refuses a repeated key)")
    assert "twice" not in capsys.readouterr().err and not any("twice" in r.getMessage() for r in caplog.records)


def test_run_s_own_reader_gives_the_csv_reader_s_words(tmp_path):
    """run's reader, past validate: datasets wraps pandas' refusal of a row of more cells than the header in "An error
    occurred while generating the dataset"; the line gives pandas' own words, as validate does."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data_files import load_records

    (tmp_path / "c.csv").write_text("text\nhello\nthere\nx,y,z\nagain\n")
    with pytest.raises(FeatCalError, match=r"^w\.path: .*c\.csv: cannot load calibration data \(Error tokenizing data\. "
                                           r"C error: Expected 1 fields in line 4, saw 3\)$"):
        load_records(DataSpec(path=str(tmp_path / "c.csv"), format="text"), "w")


@pytest.mark.parametrize("key, value", [("split", "validation"), ("split", "train[:4]"), ("name", "main")])
def test_a_split_or_name_for_a_single_data_file_is_refused_alike(scenario, tmp_path, key, value):
    """`split: validation` (or a slice, or a configuration `name:`) on an entry whose path is one file: both commands
    had read the whole file as train without a word, so the records calibrated on were not the ones asked for."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["featcal"]["data"][expert_of(recipe, 0)][key] = value
    [line] = refused_alike(recipe, tmp_path)
    assert f"featcal.data.{expert_of(recipe, 0)}.{key}: {value}: a single data file has no" in line, line
    recipe["featcal"]["data"][expert_of(recipe, 0)][key] = "train" if key == "split" else None  # as datasets reads it: fine
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert CliRunner().invoke(main, ["validate", str(tmp_path / "r.yaml")]).exit_code == 0


def test_run_s_own_reader_refuses_a_split_for_a_single_file(tmp_path):
    """run's reader, past validate, on both of its paths (the plain JSON-lines reader and datasets')."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data import calibration_sequences

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(4)))
    spec = DataSpec(path=str(tmp_path / "d.jsonl"), split="test")
    for shuffle in (False, True):
        with pytest.raises(FeatCalError, match=r"featcal\.data\.e\.split: test: a single data file has no splits"):
            calibration_sequences({"e": spec}, ["e"], None, 4, 16, shuffle, 0, tmp_path / "r.yaml")


def test_a_dataset_directory_is_read_at_the_split_the_entry_names(tmp_path):
    """A dataset directory's `split:` picks its file, as datasets names splits by file (the mutation round found no
    test that failed when the split was read as train)."""
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data_files import load_records

    (tmp_path / "ds").mkdir()
    for split in ("train", "validation"):
        (tmp_path / "ds" / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{split} {i}"}) + "\n" for i in range(3)))
    for split in ("train", "validation", "validation[:2]"):
        rows = load_records(DataSpec(path=str(tmp_path / "ds"), split=split), "featcal.data.e")
        assert [row["text"] for row in rows] == [f"{split.split('[')[0]} {i}" for i in range(3 if "[" not in split else 2)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_run_s_own_reader_counts_the_repeated_key_s_record_as_datasets_counts_records(tmp_path, suffix):
    """Blank lines are no records to datasets: the record named is the one datasets hands out at that index once the
    key is given once; in a .json file of JSON lines alike. A line that is no JSON before it is the reader's refusal."""
    import datasets

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data_files import load_records

    lines = ['{"text": "r0"}', "", '{"text": "r1"}', "   ", "", '{"text": "r2"}', '{"text": "a", "id": "x", "id": "y"}', '{"text": "r4"}']
    path = tmp_path / f"d{suffix}"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FeatCalError) as refused:
        load_records(DataSpec(path=str(path), format="text"), "w")
    assert "gives the key 'id' twice" in str(refused.value), refused.value
    record = int(str(refused.value).split(": record ")[1].split()[0])
    path.write_text("\n".join(line.replace('"id": "x", ', "") for line in lines) + "\n")
    assert datasets.load_dataset("json", data_files=str(path), split="train")[record]["text"] == "a"
    path.write_text("\n".join(['{"text": "r0"}', "{not json", *lines[2:]]) + "\n")
    with pytest.raises(FeatCalError) as refused:
        load_records(DataSpec(path=str(path), format="text"), "w")
    assert "cannot load calibration data" in str(refused.value) and "twice" not in str(refused.value)


def test_validate_s_first_rows_of_a_csv_or_parquet_file_are_those_datasets_hands_the_run(tmp_path):
    """file_head reads a CSV file's first rows without datasets (a BOM skipped, blank lines no rows, pandas' missing
    markers null) and a parquet file's through pyarrow: the same rows datasets gives the run."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from featcal_llm.io.validate_data import file_head

    csv_path = tmp_path / "c.csv"
    csv_path.write_bytes("\ufefftext,label\nhello,NA\n\nworld,\nNULL,x\nNone,y\nn/a,z\nplain,#N/A\nlast,w\n".encode())
    header, rows, whole = file_head(csv_path, "w")
    expected = datasets.load_dataset("csv", data_files=str(csv_path), split="train").to_list()
    assert header == ["text", "label"] and rows == expected and not whole
    parquet_path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(7)], "n": list(range(7))}), parquet_path, row_group_size=3)
    header, rows, _ = file_head(parquet_path, "w")
    assert header == ["text", "n"] and rows == datasets.load_dataset("parquet", data_files=str(parquet_path), split="train").to_list()



def test_a_save_to_disk_folder_is_read_at_its_split_and_a_missing_split_refused_alike(tmp_path):
    """A folder `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote is a local dataset directory (docs/recipe.md):
    run reads it with `datasets.load_from_disk`, the split the entry names (a single Dataset is one split, train);
    a split it lacks is refused by validate and run in one line naming the key and the splits there are."""
    import datasets
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data_files import load_records
    from featcal_llm.io.validate_data import check_data

    rows = {split: [{"text": f"{split} {i}"} for i in range(3)] for split in ("train", "validation")}
    datasets.Dataset.from_list(rows["train"]).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in rows.items()}).save_to_disk(str(tmp_path / "two"))
    assert list(load_records(DataSpec(path=str(tmp_path / "one")), "featcal.data.e")) == rows["train"]
    for split in ("train", "validation"):
        assert list(load_records(DataSpec(path=str(tmp_path / "two"), split=split), "featcal.data.e")) == rows[split]
    for folder, split in (("two", "test"), ("one", "validation")):
        spec = DataSpec(path=str(tmp_path / folder), split=split)
        for check in (lambda: load_records(spec, "featcal.data.e"), lambda: check_data(spec, "featcal.data.e", tmp_path, False, [])):
            with pytest.raises(FeatCalError, match=rf"^featcal\.data\.e\.split: {split}: {tmp_path / folder} has the splits? (train, validation|train) \(") as error:
                check()
            assert "\n" not in str(error.value)


def test_a_csv_line_of_spaces_is_no_record_to_validate_as_to_datasets(tmp_path):
    """pandas, datasets' CSV reader, skips a line of spaces or tabs as it skips an empty one (not inside a quoted cell):
    validate counted it as a record, refused it as "only whitespace" and numbered the records after it one too high."""
    import datasets
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.validate_data import check_data

    body = 'text,x\r\n \t \r\na,1\r\n   \r\n"b\n  \nc",2\r\n\t\r\n'
    (tmp_path / "d.csv").write_text(body, encoding="utf-8", newline="")
    rows = datasets.load_dataset("csv", data_files=str(tmp_path / "d.csv"), split="train")["text"]
    assert rows == ["a", "b\n  \nc"]
    assert check_data(DataSpec(path="d.csv"), "featcal.data.e", tmp_path, False, []) == len(rows)
    (tmp_path / "d.csv").write_text(body + ",3\r\n", encoding="utf-8", newline="")  # record 2, to datasets, has no text
    with pytest.raises(FeatCalError, match=r"^featcal\.data\.e\.path: d\.csv: record 2: field 'text' is null"):
        check_data(DataSpec(path="d.csv"), "featcal.data.e", tmp_path, False, [])


@pytest.mark.parametrize("blank", ["\x0c", "\x0b", "\u00a0"])
def test_a_json_lines_line_of_other_whitespace_is_refused_alike(tmp_path, blank):
    """JSON's whitespace is space, tab, CR and LF: Arrow (datasets' JSON reader, the run's) refuses a line holding only
    a form feed, a vertical tab or a no-break space, which validate skipped as Python's str.strip() does."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data import calibration_sequences
    from featcal_llm.io.validate_data import check_data

    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n' + blank + '\n{"text": "b"}\n', encoding="utf-8")
    spec = DataSpec(path="d.jsonl")
    with pytest.raises(FeatCalError, match=r"^featcal\.data\.e\.path: d\.jsonl: cannot load calibration data \(line 2 is not JSON\)$"):
        check_data(spec, "featcal.data.e", tmp_path, False, [])
    with pytest.raises(FeatCalError, match=r"featcal\.data\.e\.path: d\.jsonl: cannot load calibration data \("):
        calibration_sequences({"e": spec}, ["e"], None, 4, 16, False, 0, tmp_path / "r.yaml")


def test_a_configuration_name_for_a_folder_of_data_files_is_refused_alike(tmp_path):
    """A folder of data files is one configuration to datasets (`default`): `name: main` passed validate, and run
    stopped on "featcal.data.e.path: ...: cannot load calibration data (BuilderConfig 'main' not found ...)". Both
    now name the key; `name: default` reads the folder as without a name."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data_files import load_records
    from featcal_llm.io.validate_data import check_data

    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    spec = DataSpec(path="ds", name="main")
    line = r"^featcal\.data\.e\.name: main: ds is a folder of data files, one configuration to datasets \(default\); "
    for check in (lambda: check_data(spec, "featcal.data.e", tmp_path, False, []), lambda: load_records(spec, "featcal.data.e", tmp_path)):
        with pytest.raises(FeatCalError, match=line):
            check()
    assert list(load_records(DataSpec(path="ds", name="default"), "featcal.data.e", tmp_path)) == [{"text": "a"}, {"text": "b"}]
    check_data(DataSpec(path="ds", name="default"), "featcal.data.e", tmp_path, False, [])


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_prompt_that_is_an_iso_date_is_read_as_the_file_s_string(tmp_path, shuffle, suffix):
    """Arrow (datasets' JSON reader) types a string column holding only ISO dates as timestamps: run refused such a
    prompt as "a datetime, not a string" while validate (json) passed it. Both read the file's strings now."""
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.io.data import calibration_sequences
    from featcal_llm.io.validate_data import check_data
    from featcal_llm.tiny import build_char_tokenizer

    rows = [{"prompt": "2024-01-01", "completion": " was a Monday"}, {"prompt": "2024-02-01 10:00", "completion": " was a Thursday"}]
    text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(row) + "\n" for row in rows)
    (tmp_path / f"d{suffix}").write_text(text)
    spec = DataSpec(path=f"d{suffix}", format="completion")
    assert check_data(spec, "featcal.data.e", tmp_path, False, []) == 2
    tokenizer = build_char_tokenizer()
    records = calibration_sequences({"e": spec}, ["e"], tokenizer, 2, 64, shuffle, 0, tmp_path / "r.yaml")["e"]
    assert sorted(tokenizer.decode(record) for record in records) == ["2024-01-01 was a Monday", "2024-02-01 10:00 was a Thursday"]
