"""The model card's settings in words: what each resolved setting is called, and its value as a sentence reads it
(no Python reprs). The keys stay in `featcal_weights.json`."""

from __future__ import annotations

from typing import Any

from featcal_llm.io.card_meta import rounded
from featcal_llm.io.merge_identity import RANDOM_METHODS

SYMBOLS = {"lambda": "λ", "alpha": "α", "rho": "ρ", "reduction": "r", "eps": "eps"}
# what the card's settings list calls each resolved setting (featcal_weights.json keeps the keys)
SETTING_TEXT = {
    "samples": "calibration records per expert, at most",
    "max_length": "tokens per record, at most",
    "shuffle": "records shuffled before they are taken",
    "seed": "seed",
    "merge_seed": f"seed of a random merge method ({', '.join(sorted(RANDOM_METHODS))})",
    "expert_weights": "expert weights",
    "token_weights": "token weights",
    "trailing_experts": "records of an expert that trails the merge are calibrated toward",
    "dtype": "compute precision (the weights keep the merge's dtypes)",
    "stats_dtype": "statistics' precision",
    "projections": "projections re-fitted",
    "norms": "norm scales re-fitted",
    "biases": "biases re-fitted",
    "head": "LM head",
    "data_fields": "record fields read where an entry's defaults named others (resolved from its data's fields)",
}
TRAILING_TEXT = {"merge": "the merged model (`merge`)", "keep": "the expert itself (`keep`)"}


def human(value: Any) -> str:
    """A resolved value as a sentence reads it: no Python reprs (booleans as yes/no, lists and mappings spelled out)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        if set(value) == {"per_layer"}:
            return "per layer: " + human(value["per_layer"])
        return ", ".join(f"{SYMBOLS.get(key, key)} = {human(item)}" for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(human(item) for item in value)
    return str(value)


def _setting_text(key: str, value: Any) -> str:
    if key == "head":
        fitted = ", ".join(f"{SYMBOLS[name]} = {human(value[name])}" for name in ("lambda", "alpha", "rho") if name in value)
        return f"re-fitted ({fitted})" + (", untied from the input embeddings" if value.get("untied") else "")
    if key == "data_fields":  # expert → {key: field}
        return "; ".join(f"`{name}`: " + ", ".join(f"{k}: `{f}`" for k, f in chosen.items()) for name, chosen in value.items())
    if key == "trailing_experts":
        return TRAILING_TEXT.get(value, human(value))
    if key == "projections" and isinstance(value, list):
        return ", ".join(f"`{name}`" for name in value)
    return human(value)


def settings_lines(settings: dict[str, Any]) -> str:
    """The card's settings list, one `- what: value` line each, in words."""
    return "\n".join(f"- {SETTING_TEXT.get(key, key)}: {_setting_text(key, value)}" for key, value in rounded(settings).items())


def adapter_trained(rank: int | None, biases: bool, tied_head: bool, kept: bool = True) -> str:
    """What `refine: {params: adapter}` trained, in the card's words: biases named only for a model that has them, the
    input embeddings where the LM head is tied to them (the head trains as the embedding then), and the adapter merged
    back only where a check was kept."""
    lora = f"a rank-{rank} LoRA" if rank else "a LoRA"
    full = "the norms, biases and LM head" if biases else "the norms and LM head"
    tied = " (the LM head is tied to the input embeddings: they trained as one)" if tied_head else ""
    merged = ", merged back into the weights," if kept else ""
    return f"{lora} on the calibrated projections{merged} with {full} in full{tied}"
