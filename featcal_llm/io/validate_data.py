"""`validate`'s checks of one calibration data entry, without `datasets` or torch: the file exists, has a known
format and the fields the entry's format reads, as text where it reads text (the first records the run converts).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any, Iterator

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data_fields import resolve_fields
from featcal_llm.io.data import alpaca_input, chat_messages, completion_text, missing_field, text_field, text_fields
from featcal_llm.io.data_files import (JSON_WHITESPACE, PLAIN_JSONL_MAX_BYTES, RepeatedKey, check_file_options,
                                       check_folder_name, check_saved_folder, close_sibling, data_path, distinct_keys, file_builder,
                                       file_not_found, looks_like_hub_id, no_records, not_utf8, repeated_key, saved_fields,
                                       saved_records, saved_splits)
from featcal_llm.io.hub_lookup import hub_lookup
from featcal_llm.io.problems import Problem

FIELD_SCAN_LINES = 1000  # records read for their field names from a JSON-lines file too large to read whole
COUNT_MAX_BYTES = 2**30  # CSV and JSON-lines files up to this size have their records counted (a pass over the lines)


def needed_fields(spec: DataSpec) -> list[str]:
    """The record fields the entry's format reads (alpaca's input is optional): its text fields, or a chat's messages."""
    return [spec.messages] if spec.messages and spec.format not in ("text", "alpaca") else text_fields(spec)


def check_fields(spec: DataSpec, where: str, fields: list[str] | None) -> DataSpec:
    """Record 0 holds every field the entry reads (None: only datasets can tell, nothing is checked), its defaults
    resolved from these fields as the run resolves them (io/data_fields.py); returns the entry reading them."""
    spec = resolve_fields(spec, fields, where)
    for name in needed_fields(spec) if fields is not None else []:
        if name not in fields:
            raise missing_field(spec, name, fields, where, 0)
    return spec


def check_dataset_directory(spec: DataSpec, where: str, path: Path, taken: int | None = None) -> None:
    """A local dataset directory holds data files and the split asked for, as datasets reads its listing (its own
    `get_data_patterns`: `train.jsonl` is split train, a lone `foo.jsonl` too); a directory that declares its layout
    itself (a README's configs, a loading script, a `save_to_disk` folder) is left to the run; a configuration `name:`
    is refused where no README.md or script can declare one."""
    check_folder_name(spec, where, path)
    declared = ("README.md", "dataset_dict.json", "dataset_info.json", "state.json")
    if any((path / name).is_file() for name in declared) or any(path.glob("*.py")):  # check_folder_name left a name only there
        return
    from datasets.data_files import EmptyDatasetError, get_data_patterns

    try:
        patterns = {str(split): found for split, found in get_data_patterns(str(path)).items()}
    except EmptyDatasetError:
        raise FeatCalError(f"{where}.path: {spec.path}: the directory holds no data file datasets reads (JSON lines, JSON, "
                           "CSV, parquet, text, ...)") from None
    splits = list(patterns)
    asked = re.match(r"[\w.-]+", spec.split)  # `train[:100]` slices split train
    if asked is not None and asked.group(0) not in splits:
        raise FeatCalError(f"{where}.split: {spec.split}: {spec.path} has the split{'s' if len(splits) > 1 else ''} "
                           f"{', '.join(splits)} (named by its files, as datasets reads them)")
    files = {split: _split_files(found, path) for split, found in patterns.items()}
    _check_split_files(spec, where, files, files.get(asked.group(0), []) if asked is not None else [], taken)


def _split_files(patterns: list[str], directory: Path) -> list[Path]:
    """The files of one split, in the order datasets reads them (DataFilesList.from_patterns: pattern by pattern, each
    pattern's matches in resolve_pattern's order; a pattern that matches nothing adds none)."""
    from datasets.data_files import resolve_pattern

    found: dict[str, None] = {}
    for pattern in patterns:
        try:
            found.update(dict.fromkeys(resolve_pattern(pattern, str(directory))))
        except FileNotFoundError:
            continue
    return [Path(name) for name in found]


def _check_split_files(spec: DataSpec, where: str, files: dict[str, list[Path]], asked: list[Path], taken: int | None = None) -> None:
    """What datasets refuses of a directory's files, and the fields the entry reads in the asked split's first file:
    one builder for every split (train.jsonl beside test.csv: "Couldn't infer the same data file format for all
    splits"), record 0's fields where the file's head tells them, and the records the run converts first, as check_data
    reads a file's: those of the split's JSON files in datasets' order, while each is read whole."""
    try:  # datasets' own table of file types → builders (private: where it moved, no type is judged)
        from datasets.packaged_modules import _EXTENSION_TO_MODULE as builders
    except ImportError:
        builders = {}
    kinds = {builders[file.suffix.lower()][0] for found in files.values() for file in found if file.suffix.lower() in builders}
    if len(kinds) > 1:
        raise FeatCalError(f"{where}.path: {spec.path}: its splits are files of different types ({', '.join(sorted(kinds))}), "
                           "and datasets reads one type for every split; keep files of one type there, or name the file")
    first = next((file for file in asked if file.suffix.lower() in (".jsonl", ".json")), None)
    fields, records_first, complete_first = file_head(first, f"{where}.path: {spec.path}") if first is not None else (None, [], False)
    spec = check_fields(spec, where, fields)
    wanted, records = taken or FIELD_SCAN_LINES, []
    for file in asked:  # the split's records, file after file
        if len(records) >= wanted or file.suffix.lower() not in (".jsonl", ".json"):
            break
        try:
            head, complete = file_head(file, f"{where}.path: {spec.path}")[1:] if file != first else (records_first, complete_first)
        except FeatCalError:
            break  # a later file datasets may read otherwise: left to the run, in its reader's words
        records += head
        if not complete:  # a large file's first lines: the next file's are not the next records
            break
    check_records(spec, where, fields, records[:wanted])


def check_data(spec: DataSpec, where: str, base_dir: Path, online: bool, unchecked: list[str], offline: list[str] | None = None,
               taken: int | None = None) -> int | None:
    """One entry's calibration file: exists, a known non-empty format, holding the fields the entry names, as text
    where the format reads text (in the first `taken` records, the ones the run converts; every record read if None).

    Returns how many records the file holds, as `datasets` will count them, where that is cheap to know (`record_count`),
    else None; a file holding none is refused as run refuses it."""
    path = data_path(spec, base_dir)
    if path.is_file():
        file_builder(path, where)
        check_file_options(spec, where)
        fields, records, complete = file_head(path, f"{where}.path: {spec.path}")
        spec = check_fields(spec, where, fields)
        check_records(spec, where, fields, records[:taken])
        count = len(records) if complete else record_count(path) if fields is not None else None
        if count == 0:
            raise no_records(spec, where)
        return count
    if path.is_dir() and (splits := saved_splits(path)) is not None:
        check_saved_folder(spec, where, splits)
        fields = saved_fields(path, spec.split)
        spec = check_fields(spec, where, fields)
        check_records(spec, where, fields, saved_records(path, spec.split, taken or FIELD_SCAN_LINES) if fields is not None else [])
        return None  # its record count: the run's load_from_disk says it
    if path.is_dir():
        check_dataset_directory(spec, where, path, taken)
        return None  # its record count: datasets decides the layout's files when the run loads it
    if not looks_like_hub_id(spec.path) or (path.parent.is_dir() and close_sibling(path) is not None):  # a local typo
        raise file_not_found(path, where, base_dir)
    if not online:
        unchecked.append(f"{spec.path} (dataset)")
        return None
    hub_lookup("dataset", spec.path, None, f"{where}.path", offline if offline is not None else [])
    return None


def check_records(spec: DataSpec, where: str, fields: list[str] | None, records: list[dict]) -> None:
    """The records the run converts first, read as it reads them: each field the entry reads as text is text (a field
    some records lack is null to run's reader, datasets), a chat's messages {role, content} turns, an alpaca input
    absent or text, a completion not empty."""
    for index, record in enumerate(records):
        for name in text_fields(spec):
            text_field({**record, name: record.get(name)} if fields is not None and name in fields else record, spec, name, where, index)
        if spec.format == "chat" and spec.messages:
            chat_messages(record, spec, where, index)
        if spec.format == "alpaca":
            alpaca_input(record, spec, where, index)
        if spec.format == "completion":
            completion_text(record, spec, where, index)


def record_count(path: Path) -> int | None:
    """The rows of a parquet file (its footer says), or the records of a CSV or JSON-lines file of at most
    `COUNT_MAX_BYTES` (one pass: CSV rows after the header, lines empty or of spaces and tabs skipped as pandas skips
    them; non-blank JSON lines); None for anything else, which run counts once `datasets` has loaded it."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as parquet

        return parquet.read_metadata(path).num_rows
    if path.stat().st_size > COUNT_MAX_BYTES:
        return None
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as handle:
            return sum(1 for _ in csv_records(handle)) - 1
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip(JSON_WHITESPACE.encode()))


def short_file_findings(path: Path, featcal: Any, counts: dict[str, int], notes: list[str], problems: list[Problem]) -> None:
    """Files holding fewer records than their entries ask for (`counts`: expert → records, where `check_data` counted
    them): run takes all of them (a note), and draws its held-out split (`tune.holdout`, for a search or
    `refine:`) from those, so a split that count cannot make is refused, at the first such expert as run refuses it."""
    from featcal_llm.engine.tuning import holdout_problem  # light: no torch

    share = featcal.tune_settings().holdout if featcal.holds_out else None
    refine = getattr(featcal, "refine", None)
    if refine is not None:  # run's warning, before the closed form's hours
        read = {name: min(counts.get(name, spec.records(featcal.samples)), spec.records(featcal.samples)) for name, spec in featcal.data.items()}
        at_most = sum(n - round(share * n) if share is not None else n for name, n in read.items() if featcal.data[name].weight > 0)
        # trains on: each calibrated expert's records less its held-out ones (none at all: every weight 0, its own error)
        if 0 < at_most < refine.batch_records:
            notes.append(f"{path}: featcal.refine.batch_records: {refine.batch_records} is more than the at most {at_most} "
                         "records the refinement can train on (the held-out ones stop it), so every step would repeat "
                         "records (a step costs that many more forwards for about the same gradient)")
    refused = any(problem.key == "featcal.tune.holdout" for problem in problems)  # for the count asked: one line already
    for name, count in counts.items():
        wanted = featcal.data[name].records(featcal.samples)
        if count >= wanted:
            continue
        notes.append(f"{path}: featcal.data.{name}: {count} records, fewer than the {wanted} requested; using all of them")
        problem = holdout_problem(share, count, name) if share is not None and not refused else None
        if problem is not None:
            key, _, message = problem.partition(": ")
            problems.append(Problem(str(path), key, message))
            refused = True


def file_head(path: Path, where: str) -> tuple[list[str] | None, list[dict], bool]:
    """(field names, None where only `datasets` can tell; the JSON records read; whether they are all the file's):
    read without `datasets`, every record of a small file, the first lines of a large one, none of a CSV or parquet
    file (the run reads their cells through `datasets`)."""
    suffix = path.suffix.lower()
    unreadable = f"{where}: cannot load calibration data"
    if suffix == ".csv":
        try:
            with open(path, newline="", encoding="utf-8-sig") as handle:  # a BOM (Excel's "CSV UTF-8"), as datasets skips it
                reader = csv_records(handle)
                header = next(reader, None)
                rows = csv_rows(reader, header) if header else []
        except UnicodeDecodeError as error:
            raise FeatCalError(f"{where}: {not_utf8(error)}") from None
        if not header:
            raise FeatCalError(f"{unreadable} (no header row)")
        _pandas_reads_head(path, unreadable)
        return header, rows, False
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as parquet

            table = parquet.ParquetFile(path)
            first = next(table.iter_batches(batch_size=FIELD_SCAN_LINES), None)  # the run's values, as datasets hands them
            return list(table.schema_arrow.names), first.to_pylist() if first is not None else [], False
        except ImportError:
            return None, [], False
        except Exception as error:
            raise FeatCalError(f"{unreadable} ({str(error).splitlines()[0]})") from None
    whole = path.stat().st_size <= PLAIN_JSONL_MAX_BYTES
    if suffix == ".json" and whole:
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except (ValueError, UnicodeDecodeError):
            data = None  # JSON lines in a .json file: read below
        if isinstance(data, list) and not data:
            return None, [], True  # no records: refused as run refuses a file holding none
        if isinstance(data, list):
            return (_union(data), data, True) if all(isinstance(r, dict) for r in data) else (None, [], False)
        if isinstance(data, dict):  # one record to datasets, whatever its fields hold (columns of lists included)
            return list(data), [data], True
    records = []
    with open(path, "rb") as handle:  # lines decoded one by one, strictly: run's reader (Arrow) refuses what is not UTF-8
        for number, raw in enumerate(handle, 1):
            if not whole and number > FIELD_SCAN_LINES:
                break
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM before the first record, as datasets skips it
            except UnicodeDecodeError as error:
                raise FeatCalError(f"{where}: {not_utf8(error).replace('at offset', f'on line {number}, at offset')}") from None
            if not line.strip(JSON_WHITESPACE):
                continue
            try:
                records.append(json.loads(line, object_pairs_hook=distinct_keys))
            except RepeatedKey as error:
                raise repeated_key(where, len(records), error.key) from None
            except ValueError:
                if suffix == ".jsonl" and number == 1 and whole and _is_json(path):
                    return None, [], False  # a whole JSON document in a .jsonl file: datasets reads it
                if not whole and not records and line.lstrip()[:1] in ("[", "{"):
                    return None, [], False  # a JSON document too large to parse here (an array of records): datasets reads it
                raise FeatCalError(f"{unreadable} (line {number} is not JSON)") from None
    if not records or not all(isinstance(record, dict) for record in records):
        raise FeatCalError(f"{unreadable} (expected one JSON object per line)")
    return _union(records), records, whole


# the cells pandas (datasets' CSV reader) reads as missing: null to the run, which refuses them as text
CSV_MISSING = {"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
               "NA", "NULL", "NaN", "None", "n/a", "nan", "null"}


def csv_records(handle: Any) -> Iterator[list[str]]:
    """The CSV rows pandas (datasets' reader) reads: a line that is empty or holds only spaces and tabs, outside a
    quoted cell, is no row to it (a quoted cell's lines are kept as they are)."""
    between = True  # whether the reader asks for a record's first line

    def lines() -> Iterator[str]:
        nonlocal between
        for line in handle:
            if between and not line.strip(" \t\r\n"):
                continue
            between = False
            yield line

    for cells in csv.reader(lines()):
        between = True
        yield cells


def csv_rows(reader: Any, header: list[str]) -> list[dict]:
    """The first rows after the header as datasets hands them to the run, as far as their text goes: a missing cell
    is null."""
    rows = []
    for number, cells in enumerate(reader):
        if number >= FIELD_SCAN_LINES:
            break
        rows.append({name: (None if cell in CSV_MISSING else cell) for name, cell in zip(header, cells)})
    return rows


def _pandas_reads_head(path: Path, unreadable: str) -> None:
    """The first rows of a CSV file through pandas, datasets' CSV reader: a row of more cells than the header (past
    pandas' implicit index) is its ParserError, which the run reports in the same words."""
    try:
        import pandas
    except ImportError:
        return
    try:
        pandas.read_csv(path, nrows=FIELD_SCAN_LINES, encoding="utf-8")
    except pandas.errors.ParserError as error:
        raise FeatCalError(f"{unreadable} ({str(error).strip().splitlines()[0]})") from None
    except (ValueError, OSError, UnicodeDecodeError):
        return  # the checks above and the run's own say it


def _is_json(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8-sig"))
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _union(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(key for record in records for key in record))


__all__ = ["COUNT_MAX_BYTES", "FIELD_SCAN_LINES", "check_data", "check_records", "file_head", "needed_fields", "record_count", "short_file_findings"]
