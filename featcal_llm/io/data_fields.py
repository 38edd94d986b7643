"""The record fields a data entry leaves to its defaults, resolved once per dataset from its field names (its columns),
by `validate` (io/validate_data.py) and the run (io/data.py) alike.

The two layouts public data mostly has: `format: chat` with none of `messages`, `prompt`, `response` given reads a
`messages` field (a list of {role, content} turns: HF's and TRL's conversational form, HuggingFaceH4/ultrachat_200k's)
where the records lack `prompt` or `response`; `format: alpaca` without `response` reads `output` (tatsu-lab/alpaca's
name, and most of its forks') where the records lack `response`. Data that has the fields the defaults name reads them,
as before, even when it has the other layout's too. Data that has neither is refused in one line naming the file and
the fields it has (alpaca records without their instruction field too are refused for that field first, as before).
What a default resolved to is written out in the saved recipe and recorded in the run record
(`data_fields`), so that a replay reads the same fields; the settings digests (`made_from`, the resume fingerprint)
are taken of the block as written, as for the precisions `auto` resolves.
"""

from __future__ import annotations

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block_sections import DataSpec

CHAT_KEYS = ("messages", "prompt", "response")
ALPACA_OUTPUT = "output"  # Stanford Alpaca's name for the response
OTHER_RESPONSES = ("completion", "answer")  # names a response goes by elsewhere, suggested where the records have one


def default_fields(spec: DataSpec, fields: list[str] | None, where: str) -> dict[str, str]:
    """The keys `spec` leaves to their defaults that its data (`fields`: its records' field names; None: not known)
    reads under other names, {key: field}; empty where the defaults stand. Data with neither reading is refused."""
    if not fields or spec.path is None:
        return {}
    given = spec.model_fields_set
    if spec.format == "chat" and not given & set(CHAT_KEYS):
        if spec.prompt in fields and spec.response in fields:
            return {}
        if "messages" in fields:
            return {"messages": "messages"}
        raise FeatCalError(f"{where}.path: {spec.path}: format: chat reads a `messages` field (a list of {{role, content}} "
                           f"turns) or `prompt` and `response` fields, and its records have {', '.join(fields)}; name the "
                           "ones to read with messages: (or prompt: and response:)")
    if spec.format == "alpaca" and "response" not in given and spec.response not in fields and spec.instruction in fields:
        if ALPACA_OUTPUT in fields:
            return {"response": ALPACA_OUTPUT}
        other = next((name for name in OTHER_RESPONSES if name in fields), None)
        raise FeatCalError(f"{where}.path: {spec.path}: format: alpaca reads the response from a `response` field (or "
                           f"`{ALPACA_OUTPUT}`, Stanford Alpaca's name), and its records have {', '.join(fields)}; name the "
                           f"one holding it with response:{f' (response: {other}?)' if other else ''}")
    return {}


def resolve_fields(spec: DataSpec, fields: list[str] | None, where: str) -> DataSpec:
    """`spec` reading what its defaults resolve to for data with these `fields` (default_fields)."""
    chosen = default_fields(spec, fields, where)
    return spec.model_copy(update=chosen) if chosen else spec


__all__ = ["default_fields", "resolve_fields"]
