"""How many embedding rows the merge mergekit makes will have, known before it merges.

Every expert must have as many (family/compat.check_vocabulary_sizes: the features are fed the same
token ids everywhere, the drift compares one vocabulary). Where the recipe keeps the base's tokenizer,
mergekit copies the base's rows. Where it names a tokenizer (`tokenizer_source`, a `tokenizer:` block,
`tokenizer_source: base` included), mergekit re-lays the embedding out over the tokenizer it builds: as
many rows as that tokenizer's vocabulary, padded to `pad_to_multiple_of`. That tokenizer is built here
with mergekit's own builder, so `validate` and `run` refuse an expert of another size before the merge,
in the words run used after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MergeVocabulary:
    """The merge's embedding rows and how the refusal names where they come from."""

    rows: int
    what: str


def merge_vocabulary(merge_config: Any, sources: dict[str, Any] | None, base_rows: int | None,
                     trust_remote_code: bool) -> MergeVocabulary | None:
    """The rows mergekit will write, or None where they are not known before merging (a tokenizer mergekit cannot
    build from the files here: the merge reports why, and run checks the rows it wrote)."""
    block, source = merge_config.tokenizer, tokenizer_source(merge_config)
    if source is None:
        return MergeVocabulary(base_rows, "the base model") if isinstance(base_rows, int) else None
    pad = block.pad_to_multiple_of if block is not None else None
    try:
        rows = _tokenizer_rows(merge_config, sources, trust_remote_code)
    except Exception:  # mergekit's merge raises it, naming the tokenizer: one place to report it
        return None
    if pad and rows % pad:  # mergekit's PermutedEmbeddings rounds up the same way
        rows = (rows // pad + 1) * pad
    padded = f", padded to a multiple of {pad}" if pad else ""
    return MergeVocabulary(rows, f"the merge mergekit makes (its tokenizer's vocabulary from tokenizer source {_named(source)}{padded})")


_BUILT: dict[tuple, int] = {}  # the rows of each tokenizer built in this process, by its configuration and files


def _tokenizer_rows(merge_config: Any, sources: dict[str, Any] | None, trust_remote_code: bool) -> int:
    """The vocabulary of the tokenizer mergekit's merge builds: built once for one configuration and unchanged files
    (`run` checks the recipe as `validate` does, then again before it merges, for a caller past validate: seconds
    each at 128k tokens)."""
    from featcal_llm.io.merge import spell_out_adapters

    config = spell_out_adapters(merge_config, sources)  # mergekit's own models, adapters as the merge reads them
    key = (config.model_dump_json(), trust_remote_code, _files_signature(config))
    if key not in _BUILT:
        _BUILT[key] = len(_merge_tokenizer(config, trust_remote_code).get_vocab())
    return _BUILT[key]


def _files_signature(config: Any) -> tuple:
    """Each local model folder's files (name, size, modification time): a tokenizer rewritten since is built again."""
    source = tokenizer_source(config)
    references = [config.base_model, *config.referenced_models(), source]  # a source model outside the merge too
    folders = {Path(str(path.path)) for reference in references if hasattr(reference, "model")
               for path in (reference.model, reference.lora) if path is not None}
    return tuple((str(folder), tuple(sorted((entry.name, stat.st_size, stat.st_mtime_ns)
                                             for entry in folder.iterdir() if entry.is_file() for stat in [entry.stat()])))
                 for folder in sorted(folders) if folder.is_dir())


def _merge_tokenizer(config: Any, trust_remote_code: bool) -> Any:
    """The tokenizer mergekit's merge builds (its `BuildTokenizer` task), from the configuration the merge is given."""
    from mergekit.tokenizer.build import build_tokenizer
    from mergekit.tokenizer.config import TokenizerConfig

    from featcal_llm.runlog import library_silenced

    source = tokenizer_source(config)
    tokens = (config.tokenizer or TokenizerConfig()).tokens or {}
    with library_silenced("mergekit", printed=True):  # each tokenizer it loads, and its permutations' bar: the merge says it again
        return build_tokenizer(base_model=config.base_model, referenced_models=list(config.referenced_models()),
                               tokenizer_source=source, trust_remote_code=trust_remote_code, add_tokens=list(tokens)).tokenizer


def tokenizer_source(merge_config: Any) -> Any:
    """The tokenizer source the recipe names (a `tokenizer:` block's, else `tokenizer_source`), or None."""
    return merge_config.tokenizer.source if merge_config.tokenizer is not None else merge_config.tokenizer_source


def _named(source: Any) -> str:
    """The source as the recipe wrote it: 'base', 'union' or a model reference, an adapter's `+lora` included."""
    return str(source)
