"""What a file or a model directory *is*, by content: the keys under which work is reused.

Reuse (saved progress, generated samples, the merge) must survive what does not
change a model (a `touch`, a moved or copied directory) and must not survive what
does (any changed byte). Files are therefore identified by a sha256 of their
content. Hashing a large checkpoint takes a while, so each digest is remembered in
a small cache keyed by the file's path, size, inode, modification time and status
change time: a file whose metadata is unchanged is not read again, and one whose
metadata changed (touched, moved, copied) is read once more and gives the same digest
if its bytes are the same. The change time is the one a write always moves: a file
rewritten in place at its old size with its mtime set back (`cp -p`, `tar`, `rsync -t`
from files of one fixed mtime) is read again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE_ENV = "FEATCAL_CACHE_DIR"  # where remembered digests live (default: $XDG_CACHE_HOME/featcal-llm)
DIGESTS_FILE = "file-digests.json"
TOKENIZING_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
_memory: dict[str, str] = {}


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "featcal-llm"


def _stat_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_ino}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"


def _remembered() -> dict[str, str]:
    try:
        stored = json.loads((cache_dir() / DIGESTS_FILE).read_text(encoding="utf-8"))
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember(entries: dict[str, str]) -> None:
    """Add digests to the on-disk cache; a cache that cannot be written only costs hashing again next time."""
    try:
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        merged = {**_remembered(), **entries}
        temporary = directory / f".{DIGESTS_FILE}.{os.getpid()}"
        temporary.write_text(json.dumps(merged), encoding="utf-8")
        os.replace(temporary, directory / DIGESTS_FILE)
    except OSError:
        pass


def content_digest(path: Path) -> str:
    """sha256 of the file's bytes, read again only when its path, size, inode, mtime or ctime changed."""
    key = _stat_key(path)
    if key in _memory:
        return _memory[key]
    known = _remembered().get(key)
    if known is None:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        known = digest.hexdigest()
        _remember({key: known})
    _memory[key] = known
    return known


def weights_identity(directory: Path) -> list:
    """A checkpoint's config, index and weight files, by name and content (not by where the directory is)."""
    return [
        [item.name, content_digest(item)]
        for item in sorted(directory.iterdir())
        if item.is_file() and (item.name in ("config.json", "model.safetensors.index.json") or item.suffix == ".safetensors")
    ]


def sampling_identity(model_directory: Path, tokenizer_directory: Path) -> list:
    """What decides how a model samples besides its weights: its generation config (EOS ids, defaults) and tokenizer files."""
    generation = model_directory / "generation_config.json"
    identity = [["generation_config.json", content_digest(generation) if generation.is_file() else None]]
    for name in TOKENIZING_FILES:
        item = tokenizer_directory / name
        identity.append([name, content_digest(item) if item.is_file() else None])
    return identity
