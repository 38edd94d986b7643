"""A YAML boolean where a recipe expects a number is refused, in every section (pydantic's lax mode read `true` as 1)."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from featcal_llm.io.recipe_model import RecipeModel


def _models() -> list[type[RecipeModel]]:
    import featcal_llm.evaluation.config  # noqa: F401  (its sections subclass RecipeModel too)
    import featcal_llm.io.block  # noqa: F401

    found, stack = [], list(RecipeModel.__subclasses__())
    while stack:
        model = stack.pop()
        found.append(model)
        stack.extend(model.__subclasses__())
    return found


NUMBER_FIELDS = {  # (model, field) → a valid number: the cases the refusal must cover, read from the models' own code
    ("RefineSpec", "steps"), ("RefineSpec", "lr"), ("RefineSpec", "warmup"), ("DataSpec", "weight"), ("DataSpec", "samples"),
    ("FeatCalConfig", "samples"), ("FeatCalConfig", "lambda_"), ("FeatCalConfig", "eps"), ("TuneSpec", "holdout"),
    ("GenerateSpec", "temperature"), ("HeadSpec", "rho"), ("BackendSettings", "batch_size"), ("EvalSection", "max_gen_toks"),
}


def test_every_number_field_refuses_a_boolean_and_every_boolean_field_takes_one():
    """Each section's every field, given `true`: refused where the field is a number (by the shared check, or a field's
    own validator in its own words), taken where it may be a boolean."""
    from featcal_llm.io.recipe_model import _admits

    refused, taken = set(), set()
    for model in _models():
        for name, field in model.model_fields.items():
            key = field.alias or name
            try:
                model.model_validate({key: True})
                errors = []
            except ValidationError as error:
                errors = [e for e in error.errors() if e["loc"][:1] == (key,)]
            (refused if errors else taken).add((model.__name__, name))
            if _admits(field.annotation, (int, float)) and not _admits(field.annotation, (bool,)):
                assert errors, (model.__name__, name)
            elif _admits(field.annotation, (bool,)):
                assert not errors, (model.__name__, name, errors)
    assert NUMBER_FIELDS <= refused, NUMBER_FIELDS - refused
    assert {("FeatCalConfig", "shuffle"), ("RefineSpec", "gradient_checkpointing")} <= taken


def test_quoted_and_yaml_string_numbers_still_read_as_numbers():
    from featcal_llm.io.block_sections import RefineSpec

    spec = RefineSpec.model_validate(yaml.safe_load("{steps: '3', lr: 1e-3}"))  # YAML reads 1e-3 (no dot) as a string
    assert (spec.steps, spec.lr) == (3, 1e-3)
    with pytest.raises(ValidationError, match="expected a number, got false"):
        RefineSpec.model_validate(yaml.safe_load("{patience: no}"))
    from featcal_llm.io.block_sections import MergeOptionsSpec

    with pytest.raises(ValidationError, match="expected a number or a string, got true"):  # out_shard_size: 5B is a string
        MergeOptionsSpec.model_validate({"out_shard_size": True})
