"""docs/recipe.md documents every recipe key once, with type, default and meaning, as the pydantic models define them."""

from __future__ import annotations

import re
from pathlib import Path

from featcal_llm.io.recipe_reference import SECTIONS, models_reachable, render

PAGE = Path(__file__).resolve().parents[1] / "docs" / "recipe.md"


def test_every_model_of_the_featcal_block_has_a_section():
    assert models_reachable() == {model for _, model, _ in SECTIONS}


def test_every_key_has_a_meaning():
    undocumented = [f"{model.__name__}.{name}" for _, model, _ in SECTIONS for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert undocumented == [], f"add description= to these fields: {undocumented}"


def test_every_key_appears_once_in_its_section():
    text = PAGE.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) == len(SECTIONS)
    for section, (heading, model, _) in zip(sections, SECTIONS):
        assert section.startswith(f"`{heading}`")
        rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| `")]
        assert rows == [f"`{field.alias or name}`" for name, field in model.model_fields.items()], heading
    for key in ("shuffle", "seed", "lambda", "per_layer", "max_new_tokens", "holdout", "allow_code_execution", "tensor_parallel_size"):
        assert f"| `{key}` |" in text, key


def test_the_committed_page_is_the_generated_one():
    assert PAGE.read_text(encoding="utf-8") == render(), "regenerate: python -m featcal_llm.io.recipe_reference > docs/recipe.md"


def test_method_dependent_defaults_are_shown_as_the_run_resolves_them():
    """`expert_weights`/`token_weights` are null in the model (the method decides); the page shows what a run uses."""
    from featcal_llm.io.block import FeatCalConfig

    cells = [re.split(r"(?<!\\)\|", line) for line in PAGE.read_text(encoding="utf-8").splitlines() if line.startswith("| `")]
    rows = {cell[1].strip(): cell[3].strip() for cell in cells}
    block = {"merged": "m", "output": "o", "data": {}}
    featcal, regmean = FeatCalConfig.model_validate(block), FeatCalConfig.model_validate(block | {"method": "regmean"})
    assert (featcal.balancing, featcal.token_weighting, regmean.balancing, regmean.token_weighting) == ("coverage", "expert_lead", "equal", "equal")
    assert rows["`expert_weights`"] == "`coverage` (regmean, regmean++: `equal`)"
    assert rows["`token_weights`"] == "`expert_lead` (regmean, regmean++: `equal`)"
    assert "w = ½ + ½·a/mean(a)" in FeatCalConfig.model_fields["token_weights"].description
