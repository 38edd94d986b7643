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
