"""The calibrated checkpoint's model card and saved recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from featcal_llm import __version__
from featcal_llm.io.recipe import Recipe

RECIPE_FILE = "featcal_recipe.yml"
SYMBOLS = {"lambda": "λ", "alpha": "α", "rho": "ρ", "reduction": "r", "eps": "eps"}
METHOD_TEXT = {
    "featcal": "FeatCal feature calibration\n(Gu et al., 2026)",
    "regmean": "RegMean\n(Jin et al., 2023; MergeBench's definition, each expert's Grams on its own inputs)",
    "regmean++": "RegMean++\n(Nguyen et al., 2025; MergeBench's definition, Grams on the inputs propagated through the layers already solved)",
}
HOW_TEXT = {
    "featcal": "by a closed-form ridge regression so that the merged model's features match each expert's\n"
               "on its calibration data, while staying close to the anchor ρ·W_merged + (1 − ρ)·W_base.",
    "regmean": "as W* = (Σ_i W_i G̃_i)(Σ_i G̃_i)⁻¹ with G̃ = r·G + (1 − r)·diag(G); biases, norms, embeddings\n"
               "and lm_head are the merged model's.",
}


REPLAY_HEADER = (
    "# Written by featcal-llm: the recipe as run, with the values its search chose per decoder layer\n"
    "# (featcal_tuning.json) and the precisions it resolved. Running it again replays them, without a search.\n"
)


def replay_text(recipe: Recipe, tuning: dict, precisions: dict[str, torch.dtype]) -> str:
    """The recipe with lambda/alpha/rho as {per_layer: winners}, the held-out share explicit and `auto` precisions pinned."""
    raw = yaml.safe_load(recipe.text)
    block = raw["featcal"]
    for key in tuning["chosen"]:
        block[key] = {"per_layer": list(tuning["chosen"][key])}
    block["tune"] = {**(block.get("tune") or {}), "holdout": tuning["search"]["holdout"]}
    for key, dtype in precisions.items():
        if block.get(key, "auto") == "auto":
            block[key] = str(dtype).removeprefix("torch.")
    return REPLAY_HEADER + yaml.safe_dump(raw, sort_keys=False)


def write_card(
    directory: Path, recipe: Recipe, merged: str, tokens: dict[str, int], tuning: dict | None = None,
    precisions: dict[str, torch.dtype] | None = None, sources: dict[str, Any] | None = None,
) -> None:
    """README.md with hub-style YAML front matter, plus the recipe beside it.

    `sources` (base_model / expert name → io.references.ModelSource) records every model as read:
    its reference, hub revision and LoRA adapter.

    For a tuned run (`tuning`: featcal_tuning.json's payload) the hyper-parameters are the
    per-layer chosen lists, and the saved recipe replays them (`replay_text`; `precisions`:
    the run's resolved `dtype` and `stats_dtype`).
    """
    featcal = recipe.featcal
    saved = recipe.text
    if tuning is None:
        given = featcal.model_dump(mode="json", by_alias=True)
        hyper = {key: value if given.get(key) is None else given[key] for key, value in featcal.hyper_values().items()} | {"eps": featcal.eps}
        values = ", ".join(f"{SYMBOLS[key]} = {value}" for key, value in hyper.items())
    else:
        search = tuning["search"]
        hyper = {**tuning["chosen"], "eps": featcal.eps,
                 "tuning": {k: search[k] for k in ("criterion", "holdout", "budget")} | {"most_common": tuning["most_common"]}}
        common = tuning["most_common"]
        values = (
            f"Chosen per layer by featcal-llm on held-out calibration records ({search['criterion']} criterion, "
            f"holdout {search['holdout']:g}; every candidate's score is in `featcal_tuning.json`):\n\n"
            + "\n".join(f"- {SYMBOLS[key]}: {chosen}" for key, chosen in tuning["chosen"].items())
            + "\n\nMost common: " + ", ".join(f"{SYMBOLS[key]} = {value:g}" for key, value in common.items()) + f"; eps = {featcal.eps}"
        )
        saved = replay_text(recipe, tuning, precisions or {})
    from featcal_llm.generation.run import start_records

    starts = start_records(recipe)
    if starts:
        saved = saved.rstrip("\n") + "\n" + "".join(
            f"# generate: {name} began its samples from the {s['start']} (chosen by {s['chosen_by']})\n" for name, s in starts.items()
        )
    front = {
        "base_model": str(recipe.base),
        "tags": ["merge", "mergekit", "featcal"],
        "library_name": "transformers",
        "featcal": {
            "merged_model": merged,
            "merge_method": recipe.merge_config.merge_method,
            "method": featcal.method,
            "experts": [expert.name for expert in recipe.experts],
            "hyperparameters": hyper,
            "calibration_tokens": tokens,
            **({"generation_starts": starts} if starts else {}),
            **({"models": {name: source.describe() for name, source in sources.items()}} if sources else {}),
            "featcal_llm_version": __version__,
        },
    }
    experts = "\n".join(
        f"- `{e.name}`: {tokens[e.name]} calibration tokens"
        + (f", written by the expert from the {starts[e.name]['start']} (chosen by {starts[e.name]['chosen_by']})" if e.name in starts else "")
        for e in recipe.experts
    )
    body = f"""# {"FeatCal-calibrated merge" if featcal.method == "featcal" else featcal.method + " merge"}

This model is `{merged}` (a `{recipe.merge_config.merge_method}` merge of the experts below onto
`{recipe.base}`, made with [mergekit](https://github.com/arcee-ai/mergekit)) after {METHOD_TEXT[featcal.method]} with featcal-llm {__version__}: every linear projection of every decoder layer was re-fitted,
in forward order, {HOW_TEXT["featcal" if featcal.method == "featcal" else "regmean"]}

## Experts
{experts}

## Hyper-parameters
{values}

Per-layer feature drift of the merged and the calibrated model to each expert: `featcal_drift.json`, `featcal_drift.png`.

## Recipe
The full recipe (mergekit configuration plus the `featcal:` block) is saved as `{RECIPE_FILE}`:

```yaml
{recipe.text.rstrip()}
```
"""
    text = "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n" + body
    (directory / "README.md").write_text(text, encoding="utf-8")
    (directory / RECIPE_FILE).write_text(saved, encoding="utf-8")
