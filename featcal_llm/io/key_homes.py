"""Where an unknown key of the `featcal:` block belongs, when it is a key of another of its sections.

`refine:`'s keys written level with `refine:` (`featcal.steps`), a sampling key beside `generate:` rather than in
it, `holdout:` under `refine:` where `tune:` reads it: pydantic says "unknown key" and its nearest spelling at that
level (`steps` → 'eps'), which points the wrong way. The sections and their keys come from the block's own models.
"""

from __future__ import annotations

from pydantic import BaseModel

from featcal_llm.io.block import FeatCalConfig
from featcal_llm.io.block_sections import DataSpec, GenerateSpec, HeadSpec, MergeOptionsSpec, RefineSpec, TuneSpec
from featcal_llm.io.problems import known_keys

EXPERT = "EXPERT"  # stands for the data entry's expert where the key is outside any entry

# (section name as a key's path spells it, its model), in the order a key found in several is told its homes
_SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("featcal", FeatCalConfig),
    ("featcal.refine", RefineSpec),
    ("featcal.tune", TuneSpec),
    ("featcal.head", HeadSpec),
    ("featcal.merge_options", MergeOptionsSpec),
    (f"featcal.data.{EXPERT}", DataSpec),
    (f"featcal.data.{EXPERT}.generate", GenerateSpec),
)


def _section_of(key: str) -> tuple[str, str]:
    """The section a problem's dotted key sits in, spelt as `_SECTIONS` spells it, and the expert ('' outside data).

    An expert's name may hold dots (`Llama-3.2-3B`): the data sections are read from both ends of the key."""
    parent = key.rpartition(".")[0]
    if parent.startswith("featcal.data.") and parent != "featcal.data":
        inner = parent.removeprefix("featcal.data.")
        if inner.endswith(".generate"):
            return f"featcal.data.{EXPERT}.generate", inner.removesuffix(".generate")
        return f"featcal.data.{EXPERT}", inner
    return parent, ""


def homes(key: str) -> list[str]:
    """The other sections of the block that read `key`'s last part, as a recipe writes them (`featcal.refine:`), the
    data entry's expert filled in where the key sits in one; [] where no other section reads it."""
    name = key.rpartition(".")[2]
    section, expert = _section_of(key)
    return [where.replace(EXPERT, expert or EXPERT) + ":" for where, model in _SECTIONS
            if where != section and name in known_keys(model)]


def placed_message(key: str) -> str | None:
    """`unknown key here: a key of featcal.refine: (move it there)`, or None where no other section reads the key."""
    found = homes(key)
    return f"unknown key here: a key of {' or '.join(found)} (move it there)" if found else None
