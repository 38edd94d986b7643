"""Whether an output directory can be written, asked before any work (by `validate` and by `run`), without torch."""

from __future__ import annotations

import os
from pathlib import Path


def unwritable(output: Path) -> str | None:
    """Why `output` cannot be created or replaced (None: it can): its nearest existing ancestor decides."""
    ancestor = output.parent.resolve()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{output}: {ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK):
        return f"{output}: directory is not writable"
    return None


def overwrites_input(output: Path, inputs: dict[str, Path], merged: Path | None = None) -> str | None:
    """Why writing `output` would destroy what the run reads (None: it would not): the output directory is replaced as
    a whole, so it may not be an input (`inputs`: what names it → its path), hold one (a link to a model
    included), or lie inside the merge (`merged`), which mergekit writes again when the recipe's merge changes. With `merged` and
    `output` the same directory, a first run wrote the calibrated model over its merge, and the next run calibrated
    that output again as if it were the merge."""
    targets = _spellings(output)
    if merged is not None and any(source in target.parents for target, source in zip(targets, _spellings(merged))):
        return f"{output} lies inside featcal.merged {merged}, which a new merge replaces; name a directory outside it"
    for label, path in inputs.items():
        sources = _spellings(path)
        if any(target == source for target, source in zip(targets, sources)):
            return f"{output} is also {label}: the run replaces its output as a whole; name another directory"
        if any(target in source.parents for target, source in zip(targets, sources)):
            return f"{output} holds {label}: the run replaces its output as a whole, deleting it; name another directory"
    return None


def _spellings(path: Path) -> tuple[Path, Path]:
    """The path made absolute as written (a link is itself) and with every link followed."""
    path = path.expanduser()
    return Path(os.path.abspath(path)), path.resolve()
