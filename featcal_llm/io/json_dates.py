"""Arrow's JSON reader (datasets') types a string column that holds only ISO-8601 dates as timestamps: a prompt or a
text that is a date ("2024-01-01") would reach the run as a datetime and be refused, while the file (and `validate`,
which reads it with `json`) holds a string. The top-level columns so typed are read back from the file as it says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from featcal_llm.io.data_files import JSON_WHITESPACE


def dated_columns(records: Any) -> list[str]:
    """The top-level columns datasets typed as timestamps or dates."""
    return [name for name, feature in records.features.items()
            if str(getattr(feature, "dtype", "")).startswith(("timestamp", "date"))]


def _rows(text: str) -> list[Any]:
    """The file's records: the whole document's (an array of records, or one record), else one per JSON line."""
    try:
        document = json.loads(text)
    except ValueError:
        return [json.loads(line) for line in text.split("\n") if line.strip(JSON_WHITESPACE)]
    return document if isinstance(document, list) else [document]


def restore_dates(records: Any, path: Path) -> Any:
    """`records` (a local JSON or JSON-lines file's, from datasets) with each dated column's values as the file's strings."""
    columns = dated_columns(records)
    if not columns:
        return records
    try:
        rows = _rows(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return records
    if len(rows) != len(records):  # not the records datasets read: its values stand (and are refused as datetimes)
        return records
    order = list(records.column_names)
    for name in columns:
        values = [row.get(name) if isinstance(row, dict) else None for row in rows]
        records = records.remove_columns(name).add_column(name, values)
    return records.select_columns(order)
