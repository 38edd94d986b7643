"""Which files hold a checkpoint's weights: read from the directory's listing alone, so `validate` can ask without
safetensors or torch."""

from __future__ import annotations

from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def missing_weights(directory: Path) -> str | None:
    """Why `directory` holds no safetensors weights featcal-llm can read (None: an index or a single file is there)."""
    if (directory / INDEX_FILE).is_file() or (directory / SINGLE_FILE).is_file():
        return None
    if any(directory.glob("*.bin")):
        return "only pickled .bin weights found; featcal-llm reads safetensors only (convert with transformers' save_pretrained)"
    return f"no {SINGLE_FILE} or {INDEX_FILE} found"
