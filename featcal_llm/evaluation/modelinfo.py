"""What the harness needs to know about a model directory without loading it.

The fingerprint (weights, config, tokenizer, chat template) is what results are cached by, so
the same weights under another path or label hit the cache and changed weights never do. The
chat-template decision is made here once per model and recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from featcal_llm.io.model_files import read_config_json, saved_chat_template
from featcal_llm.errors import FeatCalError

HASHED_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = (
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
    "merges.txt", "chat_template.json",
)
_INSTRUCT = re.compile(r"instruct|chat|(^|[-_/])it($|[-_/])", re.IGNORECASE)


def check_model_dir(path: Path) -> Path:
    """A folder transformers and vLLM can open as a model: refused here in one line, not in the worker after it
    started (which read a config.json that is not JSON as no config at all)."""
    try:
        values = read_config_json(path)
    except ValueError as error:
        raise FeatCalError(str(error)) from None
    if not isinstance(values.get("model_type"), str):
        raise FeatCalError(f"{path / 'config.json'}: no model_type, so no runtime knows which model family to load")
    return path.resolve()


def check_model_dirs(paths: list[Path], caller: str) -> None:
    """Every model to score, before any is scored: each path there (a wrong path is the first thing to fix), then
    each a model folder (check_model_dir)."""
    from featcal_llm.io.output_dir import name_problem, shown

    for path in paths:
        unusable = name_problem(Path(path))
        if unusable is not None:
            raise FeatCalError(f"{caller}: {shown(Path(path))}: {unusable}")
    missing = [str(path) for path in paths if not Path(path).exists()]
    if missing:
        raise FeatCalError(f"{caller}: {', '.join(missing)}: model directory does not exist")
    for path in paths:
        check_model_dir(Path(path))


def fingerprint_files(model_dir: Path) -> list[Path]:
    files = [p for p in model_dir.iterdir() if p.is_file() and (
        p.suffix in HASHED_WEIGHT_SUFFIXES or p.name in CONFIG_FILES or p.suffix == ".jinja")]
    return sorted(files)


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over (file name, file sha256) of the weights, config and tokenizer files; each file's digest is the one
    the calibration remembers (io/identity), so an 8B checkpoint is hashed once, not on every `eval` call."""
    from featcal_llm.io.identity import content_digest

    files = fingerprint_files(model_dir)
    if not any(f.suffix in HASHED_WEIGHT_SUFFIXES for f in files):
        raise FeatCalError(f"{model_dir}: no weight files ({', '.join(HASHED_WEIGHT_SUFFIXES)})")
    listing = [[f.name, content_digest(f)] for f in files]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def max_positions(model_dir: Path) -> int | None:
    config = _read_json(model_dir / "config.json")
    if not isinstance(config, dict):
        raise FeatCalError(f"{model_dir / 'config.json'}: expected a JSON object (a model config)")
    return config_positions(config)


def config_positions(config: dict) -> int | None:
    """The positions a model config gives its text model (None where it names none)."""
    value = _config_value(config, "max_position_embeddings")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _config_value(config: dict, *keys: str):
    """The first of `keys` a config gives: its text model's (`text_config`, a multimodal config's), else its own."""
    text = config.get("text_config")
    for part in (text if isinstance(text, dict) else {}, config):
        for key in keys:
            if part.get(key) is not None:
                return part[key]
    return None


def config_dtype(model_dir: Path) -> str | None:
    """The dtype the checkpoint's config names (transformers 5's `dtype`, or the older `torch_dtype`), None if it names none."""
    config = _read_json(model_dir / "config.json")
    value = _config_value(config, "dtype", "torch_dtype") if isinstance(config, dict) else None
    return value if value in ("float32", "bfloat16", "float16") else None


def _lineage_names(model_dir: Path) -> list[str]:
    """The model's own name, its recorded hub name and, for a merge, its merge base."""
    names = [model_dir.name, str(_read_json(model_dir / "config.json").get("_name_or_path") or "")]
    mergekit = model_dir / "mergekit_config.yml"
    if mergekit.is_file():
        try:
            recipe = yaml.safe_load(mergekit.read_text()) or {}
        except yaml.YAMLError:
            recipe = {}
        base = recipe.get("base_model") if isinstance(recipe, dict) else None
        if isinstance(base, dict):
            base = base.get("model")
        if base:
            names.append(str(base))
    return [name for name in names if name]


@dataclass(frozen=True)
class ChatDecision:
    applied: bool
    reason: str
    template_sha256: str | None


def decide_chat_template(model_dir: Path, mode: str) -> ChatDecision:
    """auto: on for -Instruct/-chat/-it models (by name, hub name or merge base) that have a
    template; on/off: forced. Always recorded with the reason."""
    template = saved_chat_template(model_dir)
    sha = hashlib.sha256(template.encode()).hexdigest() if template else None
    if mode == "on":
        if template is None:
            raise FeatCalError(f"{model_dir}: --chat-template on, but the tokenizer has no chat template")
        return ChatDecision(True, "forced on", sha)
    if mode == "off":
        return ChatDecision(False, "forced off", sha)
    if template is None:
        return ChatDecision(False, "auto: the tokenizer has no chat template", None)
    for name in _lineage_names(model_dir):
        if _INSTRUCT.search(name):
            return ChatDecision(True, f"auto: '{name}' is an instruct/chat model", sha)
    return ChatDecision(False, "auto: no instruct/chat name in the model, its _name_or_path or merge base", sha)
