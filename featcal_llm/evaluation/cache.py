"""The result cache: one directory per (model fingerprint, suite version, task, settings).

Layout under the output directory:
    cache/<key>/result.json      the task's record (metrics, settings, versions, seeds, ...)
    cache/<key>/samples.jsonl    lm-eval's per-sample log (prompt, completion, verdicts)
    <label>.json                 one model's summary, pointing at its cache entries
An entry appears atomically (written aside, then renamed), so an entry that exists is complete
and a rerun after a crash skips exactly the finished tasks.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

RESULT_FILE = "result.json"
SAMPLES_FILE = "samples.jsonl"


def cache_key(fields: dict) -> str:
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def entry_dir(output: Path, key: str) -> Path:
    return output / "cache" / key


def read_entry(directory: Path) -> dict | None:
    """The cached result, or None (scored again) where it is missing, unreadable, or not what this cache wrote: its key
    fields hash to another entry, or its score is not the metric lm-eval reported (a hand-edited value had been
    summarised as it stood)."""
    try:
        record = json.loads((directory / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None
    try:
        task, metrics = record["task"], record["metrics"]
        consistent = (cache_key(record["key_fields"]) == directory.name and isinstance(task["metric"], str)
                      and not isinstance(task["value"], bool) and isinstance(task["value"], (int, float))
                      and metrics[task["metric"]] == task["value"])
    except (KeyError, TypeError):
        return None
    return record if consistent else None


def write_entry(directory: Path, record: dict, samples: list[dict]) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    with (staging / SAMPLES_FILE).open("w") as handle:
        for sample in samples:
            handle.write(json.dumps(sample) + "\n")
    (staging / RESULT_FILE).write_text(json.dumps(record, indent=1))
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)


def data_fingerprint(path: Path) -> str:
    """Content hash of a local data file; for a directory, of its files' names and contents."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and ".git" not in p.parts)
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else file.name).encode())
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()
