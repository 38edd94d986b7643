"""Short, unambiguous labels for models a recipe names by (often long) paths, and the names a card shows."""

from __future__ import annotations

import os
from pathlib import Path


def short_names(names: list[str]) -> dict[str, str]:
    """Each model name's shortest trailing run of path components that no other name ends with.

    Recipes name experts by paths, often long absolute ones; a legend needs only
    what tells them apart (``/runs/a/experts/math`` → ``math``, or ``a/math`` when
    another expert is ``/runs/b/math``).
    """
    parts = {name: [p for p in name.replace("\\", "/").split("/") if p] or [name] for name in names}
    labels = {}
    for name, tail in parts.items():
        label = name
        for count in range(1, len(tail) + 1):
            candidate = "/".join(tail[-count:])
            if all(other == name or "/".join(parts[other][-count:]) != candidate for other in parts):
                label = candidate
                break
        labels[name] = label
    return labels


def parameter_count(count: int) -> str:
    """A parameter count in the unit that gives it whole digits: 8,030 M, 135 M, 71 k (a tiny model is not 0 M)."""
    return f"{count / 1e6:,.0f} M" if count >= 10**6 else f"{count / 1e3:,.0f} k" if count >= 10**3 else f"{count}"


def parse_parameter_count(value: int | str) -> int:
    """A parameter count as mergekit spells it (`5B`, `500M`, `1000K` or a number); ValueError naming the form."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    text = str(value).strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    try:
        count = int(float(digits) * scale)
    except ValueError:
        count = 0
    if count <= 0:
        raise ValueError(f"expected a positive parameter count such as 5B, 500M or 1000000, got {value!r}")
    return count


def is_local(reference: str) -> bool:
    """Whether a model reference (or one part of `model+adapter`) is a local path rather than a hub id."""
    part = reference.split("@")[0]
    return os.path.isabs(part) or part.startswith(("./", "../", "~", ".\\")) or part in (".", "..") or Path(part).exists()


def public_names(references: list[str]) -> dict[str, str]:
    """Each reference as a card shows it: hub ids unchanged, local paths (also as `base+adapter` parts) by short name."""
    parts = {part for reference in references for part in reference.split("+") if is_local(part)}
    short = short_names(sorted(parts))
    return {reference: "+".join(short.get(part, part) for part in reference.split("+")) for reference in references}
