"""The base of every pydantic model a recipe's keys are read into: a YAML boolean where a number is expected is refused.

pydantic's lax mode reads `true` as 1 for an int or float field, so `refine: {steps: true}` ran one step and
`lr: yes` a learning rate of 1.0 while `validate` said ok. Only booleans are refused: a quoted number stays accepted,
as YAML reads `1e-3` (no dot) as a string, which pydantic turns into the number meant.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationInfo, field_validator


def _admits(annotation: Any, kinds: tuple[type, ...], literals: bool = True) -> bool:
    """Whether the annotation (through Optional, unions and Annotated) takes a value of one of `kinds` (with
    `literals`, also as one of a Literal's values)."""
    if annotation is Any:
        return bool in kinds
    if annotation in kinds:
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return _admits(get_args(annotation)[0], kinds, literals)
    if origin in (Union, types.UnionType):
        return any(_admits(arg, kinds, literals) for arg in get_args(annotation))
    if origin is Literal:
        return literals and any(isinstance(arg, kinds) for arg in get_args(annotation))
    return False


class RecipeModel(BaseModel):
    """A recipe section: its own model_config (extra keys forbidden) is set by each subclass."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            annotation = cls.model_fields[info.field_name].annotation
            if _admits(annotation, (int, float)) and not _admits(annotation, (bool,)):
                kind = "a number or a string" if _admits(annotation, (str,), literals=False) else "a number"  # e.g. 5B
                raise ValueError(f"expected {kind}, got {str(value).lower()}")
        return value
