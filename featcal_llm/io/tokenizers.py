"""Loading a model's tokenizer, with the one-line refusals a run gives for a folder that has none or an unreadable one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError
from featcal_llm.io.model_files import NO_TOKENIZER, TOKENIZER_FILES, has_tokenizer_files


def load_tokenizer(source: Path, what: str, trust_remote_code: bool, without: str | None = None) -> Any:
    """`source`'s tokenizer (a folder, or a hub id transformers resolves); `what` names whose it is in the error, and
    `without` replaces the refusal for a folder with no tokenizer files (the data-free path says why it needs one)."""
    from transformers import AutoTokenizer

    if source.is_dir() and not has_tokenizer_files(source):  # validate says the same from the listing
        raise FeatCalError(f"{what}: {without or f'{source}: {NO_TOKENIZER}'}")
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as error:
        vocabulary = [name for name in TOKENIZER_FILES if name != "tokenizer_config.json" and (source / name).is_file()]
        if source.is_dir() and not vocabulary:  # transformers' own message lists the files it tried as "one of: " and nothing
            raise FeatCalError(f"{what}: {source}: cannot load a tokenizer: it has tokenizer_config.json but no vocabulary "
                               f"file ({', '.join(name for name in TOKENIZER_FILES if name != 'tokenizer_config.json')}); copy "
                               "the tokenizer's files there") from None
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise FeatCalError(f"{what}: {source}: cannot load a tokenizer ({reason})") from None


__all__ = ["load_tokenizer"]
