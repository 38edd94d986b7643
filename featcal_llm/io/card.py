"""The calibrated checkpoint's model card and saved recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from featcal_llm import __version__
from featcal_llm.io.recipe import Recipe

RECIPE_FILE = "featcal_recipe.yml"


def write_card(
    directory: Path, recipe: Recipe, merged: str, tokens: dict[str, int], tuning: dict | None = None, sources: dict[str, Any] | None = None
) -> None:
    """README.md with hub-style YAML front matter, plus the full recipe beside it.

    `sources` (base_model / expert name → io.references.ModelSource) records every model as read:
    its reference, hub revision and LoRA adapter.

    For a tuned run (`tuning`: featcal_tuning.json's payload) the hyper-parameters are the
    per-layer chosen lists, and the saved recipe ends with them as a comment block.
    """
    featcal = recipe.featcal
    if tuning is None:
        hyper = {"lambda": featcal.lambda_, "alpha": featcal.alpha, "rho": featcal.rho, "eps": featcal.eps}
        values = f"λ = {featcal.lambda_}, α = {featcal.alpha}, ρ = {featcal.rho}, eps = {featcal.eps}"
        chosen_comment = ""
    else:
        search = tuning["search"]
        hyper = {**tuning["chosen"], "eps": featcal.eps,
                 "tuning": {k: search[k] for k in ("criterion", "holdout", "budget")} | {"most_common": tuning["most_common"]}}
        common = tuning["most_common"]
        values = (
            f"Chosen per layer by featcal-llm on held-out calibration records ({search['criterion']} criterion, "
            f"holdout {search['holdout']:g}; every candidate's score is in `featcal_tuning.json`):\n\n"
            + "\n".join(f"- {symbol}: {tuning['chosen'][key]}" for key, symbol in (("lambda", "λ"), ("alpha", "α"), ("rho", "ρ")))
            + f"\n\nMost common: λ = {common['lambda']:g}, α = {common['alpha']:g}, ρ = {common['rho']:g}; eps = {featcal.eps}"
        )
        chosen_comment = "\n# featcal-llm chose per decoder layer (featcal_tuning.json):\n" + "".join(
            f"#   {key}: {tuning['chosen'][key]}\n" for key in ("lambda", "alpha", "rho")
        )
    front = {
        "base_model": str(recipe.base),
        "tags": ["merge", "mergekit", "featcal"],
        "library_name": "transformers",
        "featcal": {
            "merged_model": merged,
            "merge_method": recipe.merge_config.merge_method,
            "experts": [expert.name for expert in recipe.experts],
            "hyperparameters": hyper,
            "calibration_tokens": tokens,
            **({"models": {name: source.describe() for name, source in sources.items()}} if sources else {}),
            "featcal_llm_version": __version__,
        },
    }
    experts = "\n".join(f"- `{e.name}`: {tokens[e.name]} calibration tokens" for e in recipe.experts)
    body = f"""# FeatCal-calibrated merge

This model is `{merged}` (a `{recipe.merge_config.merge_method}` merge of the experts below onto
`{recipe.base}`, made with [mergekit](https://github.com/arcee-ai/mergekit)) after FeatCal feature calibration
(Gu et al., 2026) with featcal-llm {__version__}: every linear projection of every decoder layer was re-fitted,
in forward order, by a closed-form ridge regression so that the merged model's features match each expert's
on its calibration data, while staying close to the anchor ρ·W_merged + (1 − ρ)·W_base.

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
    saved = recipe.text.rstrip("\n") + "\n" + chosen_comment if chosen_comment else recipe.text
    (directory / RECIPE_FILE).write_text(saved, encoding="utf-8")
