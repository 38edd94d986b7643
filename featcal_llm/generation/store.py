"""Generated sets on disk, beside the output: `featcal_generated/<expert>.jsonl` plus a `.json` record of how it was made.

A set is reused when its record's key (generation/run.py `key_ingredients`: the
expert's files by content, the settings, the prompt token ids, dtype, device and
backend) matches and the JSON-lines file is the one the record
describes; otherwise it is generated again. Both files are written to a
temporary name and renamed, the record last, so an interrupted run leaves no set
that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

GENERATED_DIR = "featcal_generated"
FORMAT = 2  # bump when what a key covers or what a record holds changes


def generated_folder(output: Path) -> Path:
    """Where the sets of experts that write their own records are kept: beside the output, so a re-run finds them."""
    return output.parent / GENERATED_DIR


def generated_set_paths(output: Path, experts: list[str]) -> dict[str, tuple[Path, Path]]:
    """Expert name → its (samples, record) paths, for every expert of the recipe (in its order: the short labels
    depend on all of them); a label is made file-safe."""
    from featcal_llm.io.names import short_names

    safe = {name: re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "expert" for name, label in short_names(experts).items()}
    def files(stem: str) -> set[str]:  # a folder on a case-blind file system holds one of Math and math
        return {f"{stem}.jsonl".lower(), f"{stem}.json".lower(), f"{stem}.start.json".lower()}

    paths = {}
    for name, stem in safe.items():
        # `math v1` and `math_v1` made alike, or `m`'s start choice named as `m.start`'s record: each keeps a digest of its name
        if any(files(stem) & files(other) for n, other in safe.items() if n != name):
            stem = f"{stem}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
        paths[name] = (generated_folder(output) / f"{stem}.jsonl", generated_folder(output) / f"{stem}.json")
    return paths


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_samples(samples_path: Path, record_path: Path, key: str) -> tuple[list[dict], dict] | None:
    """The stored samples and their record when both are there and made under `key`; else None."""
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or not samples_path.is_file():
        return None
    if file_digest(samples_path) != record.get("sha256"):
        return None
    with samples_path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()], record


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_bytes(text.encode("utf-8"))  # bytes: no newline translation, so the digest is the file's
        temporary.replace(path)
    except BaseException:  # a full disk, Ctrl-C, SIGTERM: leave nothing half-written behind
        temporary.unlink(missing_ok=True)
        raise


def store_samples(samples_path: Path, record_path: Path, samples: list[dict], record: dict[str, Any]) -> dict:
    """Write the samples, then the record (with the samples' digest); returns the record written."""
    samples_path.parent.mkdir(parents=True, exist_ok=True)
    record_path.unlink(missing_ok=True)  # no record describes a half-replaced set
    text = "".join(json.dumps(sample, ensure_ascii=False) + "\n" for sample in samples)
    _write_atomically(samples_path, text)
    # the digest of what this run wrote, not of the file now there: another run sharing the folder may have replaced it
    record = {**record, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
    _write_atomically(record_path, json.dumps(record, indent=1) + "\n")
    return record


def choice_path(samples_path: Path) -> Path:
    """Where an expert's measured start choice is kept, beside its set (reused while its key holds)."""
    return samples_path.with_name(samples_path.stem + ".start.json")


def cached_choice(path: Path, key: str) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("key") == key and isinstance(record.get("choice"), dict) else None


def store_choice(path: Path, key: str, choice: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, json.dumps({"format": FORMAT, "key": key, "choice": choice}, indent=1) + "\n")
