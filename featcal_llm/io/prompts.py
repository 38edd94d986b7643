"""Prompt files for `generate:` (.txt, one prompt per line, or .jsonl with a `prompt` field), read at recipe load."""

from __future__ import annotations

import json
from pathlib import Path

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block import TILDE_NOT_EXPANDED

PROMPT_SUFFIXES = (".txt", ".jsonl")


def read_prompts(path: Path, where: str) -> list[str]:
    """The prompts of a `.txt` file (one per non-blank line) or a `.jsonl` file (a string field `prompt` per record)."""
    if path.is_dir():
        raise FeatCalError(f"{where}: {path}: a directory; expected a .txt file (one prompt per line) or a .jsonl file (field `prompt`)")
    if not path.is_file():
        tilde = f": {TILDE_NOT_EXPANDED}" if str(path).startswith("~") else ""
        raise FeatCalError(f"{where}: {path}: prompts file not found{tilde}")
    if path.suffix.lower() not in PROMPT_SUFFIXES:
        raise FeatCalError(f"{where}: {path}: expected a .txt file (one prompt per line) or a .jsonl file (field `prompt`)")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a BOM (Notepad, Excel) skipped, as data files skip it
    except UnicodeDecodeError:
        raise FeatCalError(f"{where}: {path}: not UTF-8 text") from None
    if path.suffix.lower() == ".txt":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise FeatCalError(f"{where}: {path}: line {number} is not JSON") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
                raise FeatCalError(f"{where}: {path}: line {number}: expected an object with a non-empty string field `prompt`")
            prompts.append(record["prompt"])
    if not prompts:
        raise FeatCalError(f"{where}: {path}: no prompts (the file {'holds only blank lines' if any(lines) else 'is empty'})")
    return prompts
