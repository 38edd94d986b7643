"""One expert's calibration data read into records: a local file (JSON lines, JSON, parquet, CSV), a local dataset
directory or a hub dataset, through `datasets.load_dataset` (a folder `save_to_disk` wrote: `load_from_disk`).

One shortcut: a local JSON-lines file of flat string records, read in file order, is parsed with `json` instead of
`datasets` (whose import, with pyarrow and pandas, is ≈ 0.5 s of a ≈ 3.5 s start-up). Such records are exactly what
`datasets` would return (same keys, order and strings; tested against it); anything else (numbers, nulls, nesting,
ragged keys, strings Arrow reads as dates (read back as the file's strings: io/json_dates.py), shuffling, other
formats) goes through `datasets`. What the file cannot give (a key repeated in a record, a split of a single file)
is refused in one line, by `validate` and the run alike.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from featcal_llm import runlog
from featcal_llm.errors import FeatCalError
from featcal_llm.io.block import TILDE_NOT_EXPANDED, beside_recipe
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.startup import heavy_import

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
PLAIN_JSONL_MAX_BYTES = 64 * 2**20  # larger files go through datasets (memory-mapped Arrow, not one Python string)
# Arrow's JSON reader turns ISO-8601 date(-time) strings into timestamps; any value starting like one goes to datasets.
DATE_LIKE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
JSON_WHITESPACE = " \t\r\n"  # a JSON-lines line of these alone is blank to Arrow; a form feed or no-break space is not


FILE_SUFFIX = re.compile(r"\.[A-Za-z]{1,8}")  # `.jsonl`, `.txt`: a file type; `.5`, `.1-8B-Instruct`: part of an id


def looks_like_hub_id(value: str) -> bool:
    """`org/name`: two parts, not absolute, not starting with a dot or ~, not ending in a file type (`data/cal.jsonl` is
    a local file; `teknium/OpenHermes-2.5` and `meta-llama/Llama-3.1-8B-Instruct` are ids, their dots part of the name)."""
    path = Path(value)
    return (not path.is_absolute() and len(path.parts) == 2 and not value.startswith((".", "~"))
            and not FILE_SUFFIX.fullmatch(path.suffix))


def data_path(spec: DataSpec, base_dir: Path | None) -> Path:
    """The spec's path, or the same path under the recipe's directory where only that one exists."""
    return beside_recipe(spec.path, base_dir)


def _string_pairs(pairs: list[tuple[str, Any]]) -> dict[str, str] | None:
    """`json` object hook: the object if its values are strings with distinct keys, else None (→ datasets)."""
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys) or not all(isinstance(value, str) for _, value in pairs):
        return None
    return dict(pairs)


def plain_jsonl_records(path: Path) -> list[dict[str, str]] | None:
    """The records of a JSON-lines file whose every line is an object with the same keys, in the same order,
    and string values only; None for any other file (the caller then uses `datasets`, which decides)."""
    if path.suffix.lower() != ".jsonl" or not path.is_file() or not 0 < path.stat().st_size <= PLAIN_JSONL_MAX_BYTES:
        return None
    try:
        text = path.read_bytes().decode("utf-8")  # strict: what is not UTF-8 is for datasets to judge
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        records = [json.loads(line, object_pairs_hook=_string_pairs) for line in lines]
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not records or any(not isinstance(record, dict) for record in records):
        return None  # empty lines, nested or non-string values, arrays or scalars
    keys = list(records[0])
    if not keys or any(list(record) != keys for record in records):
        return None
    try:  # lone surrogates (`"\\ud800"`) are valid JSON for `json` but not UTF-8 for Arrow
        for record in records:
            for value in record.values():
                value.encode("utf-8")
                if DATE_LIKE.match(value):
                    return None
    except UnicodeEncodeError:
        return None
    return records



def file_builder(path: Path, where: str) -> str:
    """The datasets builder for a local calibration file (json, csv, parquet); an unknown type or an empty file is refused."""
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise FeatCalError(f"{where}.path: {path}: unsupported file type (expected {', '.join(FILE_BUILDERS)})")
    if path.stat().st_size == 0:
        raise FeatCalError(f"{where}.path: {path}: file is empty")
    return builder


def close_sibling(path: Path) -> str | None:
    """The file of `path`'s folder it most likely means: the same name with a file type (`data/code` → code.jsonl),
    else the nearest name; None where the folder holds none close, or is not there."""
    import difflib

    try:
        siblings = sorted(item.name for item in path.parent.iterdir() if item.is_file())
    except OSError:  # no such folder, or one that cannot be listed
        return None
    typed = [name for name in siblings if Path(name).stem == path.name and FILE_SUFFIX.fullmatch(Path(name).suffix)]
    close = typed or difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
    return close[0] if close else None


def file_not_found(path: Path, where: str, base_dir: Path | None = None) -> FeatCalError:
    """The one line for a calibration file that is not there, with the nearest file of its folder where one is close,
    and the two places a relative path is looked for where the recipe is not in the current directory."""
    close = close_sibling(path)
    hint = f"; did you mean {str(path.parent / close)!r}?" if close else ""
    looked = ""
    if str(path).startswith("~"):  # as featcal.output says it: mergekit and datasets take paths as written
        looked = f": {TILDE_NOT_EXPANDED}"
    elif not path.is_absolute() and base_dir is not None and base_dir.resolve() != Path.cwd().resolve():
        looked = f" in the current directory nor beside the recipe ({base_dir})"
    return FeatCalError(f"{where}.path: {path}: calibration file not found{looked}{hint}")


def no_records(spec: DataSpec, where: str) -> FeatCalError:
    """The one line for a data source that holds no records: run's after loading it, validate's after counting it."""
    return FeatCalError(f"{where}.path: {spec.path}: no records")


def not_utf8(error: UnicodeDecodeError) -> str:
    return f"cannot load calibration data (not UTF-8 text: byte {error.object[error.start:error.start + 1]!r} at offset {error.start})"


def check_file_options(spec: DataSpec, where: str) -> None:
    """A single data file is one split of one configuration (datasets reads it as `train`): a `split:` other than
    train or a `name:` would be ignored without a word, so each is refused."""
    if spec.split != "train":
        raise FeatCalError(f"{where}.split: {spec.split}: a single data file has no splits (it is read whole, as train); "
                           "split applies to a dataset directory or a hub dataset")
    if spec.name is not None:
        raise FeatCalError(f"{where}.name: {spec.name}: a single data file has no configurations; name applies to a hub "
                           "dataset or a dataset directory")


def saved_splits(path: Path) -> list[str] | None:
    """The splits of a folder `save_to_disk` wrote, which `load_dataset` cannot read (`load_from_disk` does): a
    DatasetDict's are listed in its dataset_dict.json, a single Dataset (state.json) is one split, train; None for any
    other folder."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return [str(split) for split in splits] if isinstance(splits, list) else None
    return ["train"] if (path / "state.json").is_file() and (path / "dataset_info.json").is_file() else None


def saved_fields(path: Path, split: str) -> list[str] | None:
    """The column names of a `save_to_disk` folder's split, as its dataset_info.json's features list them (the order
    `load_from_disk` gives them); None where that file does not say."""
    folder = path / split if (path / "dataset_dict.json").is_file() else path
    try:
        features = json.loads((folder / "dataset_info.json").read_text(encoding="utf-8"))["features"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [str(name) for name in features] if isinstance(features, dict) else None


def saved_records(path: Path, split: str, limit: int) -> list[dict]:
    """The first `limit` records of a `save_to_disk` folder's split, as `load_from_disk` hands them to the run: its
    Arrow files (state.json's `_data_files`, in order) read with pyarrow alone, no `datasets` or torch; none where the
    folder does not say or pyarrow cannot read them (the run's load_from_disk says it)."""
    folder = path / split if (path / "dataset_dict.json").is_file() else path
    try:
        import pyarrow.ipc

        names = [str(entry["filename"]) for entry in json.loads((folder / "state.json").read_text(encoding="utf-8"))["_data_files"]]
        records: list[dict] = []
        for name in names:
            with pyarrow.memory_map(str(folder / name)) as source:
                for batch in pyarrow.ipc.open_stream(source):  # datasets writes Arrow's stream format
                    records += batch.slice(0, limit - len(records)).to_pylist()
                    if len(records) >= limit:
                        return records
        return records
    except Exception:  # noqa: BLE001 (what pyarrow or the folder's JSON raises: left to the run)
        return []


def check_saved_folder(spec: DataSpec, where: str, splits: list[str]) -> None:
    """A save_to_disk folder has the splits it was saved with and no configurations: anything else is one line."""
    if spec.name is not None:
        raise FeatCalError(f"{where}.name: {spec.name}: a folder datasets' save_to_disk wrote has no configurations; "
                           "name applies to a hub dataset or a dataset directory of data files")
    if spec.split not in splits:
        raise FeatCalError(f"{where}.split: {spec.split}: {spec.path} has the split{'s' if len(splits) > 1 else ''} "
                           f"{', '.join(splits)} (a folder datasets' save_to_disk wrote; a split is named whole, not sliced)")


def check_folder_name(spec: DataSpec, where: str, path: Path) -> None:
    """A folder of data files is one configuration to datasets, `default`: another `name:` is refused in one line
    (datasets: "BuilderConfig not found"), unless a README.md or a loading script there may declare configurations."""
    if spec.name in (None, "default") or (path / "README.md").is_file() or any(path.glob("*.py")):
        return
    raise FeatCalError(f"{where}.name: {spec.name}: {spec.path} is a folder of data files, one configuration to datasets "
                       "(default); name applies to a hub dataset or a folder whose README.md declares configurations")


class RepeatedKey(ValueError):
    """A JSON object that gives one key twice: `json` keeps the last value, Arrow (datasets' reader) refuses the file."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json` object hook that refuses a repeated key, as the run's reader does."""
    keys = [key for key, _ in pairs]
    repeated = next((key for key in keys if keys.count(key) > 1), None)
    if repeated is not None:
        raise RepeatedKey(repeated)
    return dict(pairs)


def repeated_key(where: str, record: int, key: str) -> FeatCalError:
    return FeatCalError(f"{where}: record {record} gives the key {key!r} twice; keep one (datasets refuses a repeated key)")


def _first_repeated_key(path: Path) -> tuple[int, str] | None:
    """(record, key) of the first JSON-lines record that repeats a key, for a load datasets refused."""
    record = 0
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if not line.strip(JSON_WHITESPACE):
                    continue
                try:
                    json.loads(line, object_pairs_hook=distinct_keys)
                except RepeatedKey as error:
                    return record, error.key
                except ValueError:
                    return None
                record += 1
    except (OSError, UnicodeDecodeError):
        return None
    return None


def load_records(spec: DataSpec, where: str, base_dir: Path | None = None):
    """The records of one expert's calibration set, as a `datasets.Dataset`."""
    from featcal_llm.io.json_dates import restore_dates  # it imports this module's JSON_WHITESPACE

    datasets = heavy_import("datasets")

    datasets.disable_progress_bars()
    path = data_path(spec, base_dir)
    try:
        if path.is_file():
            check_file_options(spec, where)
            builder = file_builder(path, where)
            with runlog.library_silenced("datasets"):  # a reader's error is logged, then raised: refused below in one line
                loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
            return restore_dates(loaded, path) if builder == "json" else loaded
        if path.is_dir() and (splits := saved_splits(path)) is not None:
            check_saved_folder(spec, where, splits)
            saved = datasets.load_from_disk(str(path))
            return saved[spec.split] if isinstance(saved, datasets.DatasetDict) else saved
        if path.is_dir():
            check_folder_name(spec, where, path)
            return datasets.load_dataset(str(path), spec.name, split=spec.split)
        if not looks_like_hub_id(spec.path):
            raise file_not_found(path, where, base_dir)
        return datasets.load_dataset(spec.path, spec.name, split=spec.split)
    except FeatCalError:
        raise
    except Exception as error:
        repeated = _first_repeated_key(path) if path.is_file() and path.suffix.lower() in (".jsonl", ".json") else None
        if repeated is not None:
            raise repeated_key(f"{where}.path: {spec.path}", *repeated) from None
        cause = error.__cause__ if type(error).__name__ == "DatasetGenerationError" and error.__cause__ else error
        message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__  # the reader's words
        raise FeatCalError(f"{where}.path: {spec.path}: cannot load calibration data ({message})") from None
