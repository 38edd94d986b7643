"""The example recipes shipped in the wheel (package data), listed and printed by `featcal-llm recipes [NAME]`.

Each recipe's first comment line, up to its first colon, is its title.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from featcal_llm.errors import FeatCalError


@dataclass(frozen=True)
class Shipped:
    name: str  # the file name without .yaml
    title: str  # its first comment line, up to the first colon


def shipped() -> list[Shipped]:
    """Every shipped recipe, by name."""
    found = []
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda item: item.name):
        if entry.name.endswith(".yaml"):
            first = entry.read_text(encoding="utf-8").splitlines()[0]
            found.append(Shipped(entry.name.removesuffix(".yaml"), first.lstrip("# ").split(": ")[0].strip().rstrip(".")))
    return found


def recipe_text(name: str) -> str:
    """The text of shipped recipe `name` (with or without .yaml)."""
    import difflib

    names = [entry.name for entry in shipped()]
    stem = name.removesuffix(".yaml")
    if stem not in names:
        close = difflib.get_close_matches(stem, names, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise FeatCalError(f"recipes {name}: no such shipped recipe (featcal-llm recipes lists them){hint}")
    return resources.files(__package__).joinpath(f"{stem}.yaml").read_text(encoding="utf-8")
