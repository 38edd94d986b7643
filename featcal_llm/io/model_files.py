"""Which files a model directory holds (weights, tokenizer): read from its listing alone, so `validate` can ask
without safetensors, transformers or torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def missing_weights(directory: Path) -> str | None:
    """Why `directory` holds no safetensors weights featcal-llm can read (None: an index whose shards are all there, or
    a single file), from the listing and the index alone."""
    index = directory / INDEX_FILE
    if index.is_file():
        import json

        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return f"{INDEX_FILE}: not a safetensors index (expected a 'weight_map' mapping)"
        missing = [shard for shard in shards if not (directory / str(shard)).is_file()]
        return f"{INDEX_FILE}: points at missing shard file {missing[0]}" if missing else None
    if (directory / SINGLE_FILE).is_file():
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


def carries_chat_template(tokenizer: Any) -> bool:
    """Whether a loaded tokenizer has a chat template that renders something: transformers loads an empty
    chat_template.jinja as "", which renders every conversation as nothing."""
    return renders_something(getattr(tokenizer, "chat_template", None))


def renders_something(template: Any) -> bool:
    """Whether a chat template (a string, a mapping of named templates, or tokenizer_config.json's older list of
    them) holds one that is not blank."""
    if isinstance(template, dict):
        templates = list(template.values())
    elif isinstance(template, list):  # tokenizer_config.json's older form: [{"name": ..., "template": ...}]
        templates = [item.get("template") if isinstance(item, dict) else item for item in template]
    else:
        templates = [template]
    return any(isinstance(text, str) and text.strip() for text in templates)


def has_chat_template(directory: Path) -> bool:
    """Whether the tokenizer saved in `directory` carries a chat template (its own file, or the tokenizer config's key),
    as carries_chat_template judges the loaded tokenizer: a blank file is none."""
    import json

    for name in ("chat_template.jinja", "chat_template.json"):
        if (directory / name).is_file():  # transformers takes the file over the config's key
            try:
                return bool((directory / name).read_text(encoding="utf-8").strip())
            except (OSError, UnicodeDecodeError):
                return True  # not ours to judge: the tokenizer's loader reports it
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and renders_something(config.get("chat_template"))
