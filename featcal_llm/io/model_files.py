"""Which files a model directory holds (weights, tokenizer): read from its listing alone, so `validate` can ask
without safetensors, transformers or torch."""

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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
NO_TOKENIZER = f"no tokenizer files ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}); name one with featcal.tokenizer"


def calibration_tokenizer_directory(tokenizer: str | None, merged: Path | None, base: Path) -> Path:
    """The directory the records are tokenised with: featcal.tokenizer, else the merge once it exists, else the base."""
    return Path(tokenizer) if tokenizer else merged if merged is not None and merged.exists() else base


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def generating_expert_without_tokenizer(directory: Path, name: str) -> str:
    """The refusal for an expert that is to write its samples but has no tokenizer to write them with."""
    return (f"expert {name}: {directory} has no tokenizer files (tokenizer.json or tokenizer_config.json); an expert that "
            "writes its own data needs its tokenizer: copy it into that directory, or give this expert a data file")


def has_chat_template(directory: Path) -> bool:
    """Whether the tokenizer saved in `directory` carries a chat template (its own file, or the tokenizer config's key)."""
    import json

    if any((directory / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
