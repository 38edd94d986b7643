"""The calibrated checkpoint's model card and saved recipe."""

from __future__ import annotations

from pathlib import Path

import yaml

from featcal_llm import __version__
from featcal_llm.recipe import Recipe

RECIPE_FILE = "featcal_recipe.yml"


def write_card(directory: Path, recipe: Recipe, merged: str, tokens: dict[str, int]) -> None:
    """README.md with hub-style YAML front matter, plus the full recipe beside it."""
    featcal = recipe.featcal
    hyper = {"lambda": featcal.lambda_, "alpha": featcal.alpha, "rho": featcal.rho, "eps": featcal.eps}
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
λ = {featcal.lambda_}, α = {featcal.alpha}, ρ = {featcal.rho}, eps = {featcal.eps}

## Recipe
The full recipe (mergekit configuration plus the `featcal:` block) is saved as `{RECIPE_FILE}`:

```yaml
{recipe.text.rstrip()}
```
"""
    text = "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n" + body
    (directory / "README.md").write_text(text, encoding="utf-8")
    (directory / RECIPE_FILE).write_text(recipe.text, encoding="utf-8")
