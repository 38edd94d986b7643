"""docs/recipe.md, written from the recipe's pydantic models: every key once, with its type, default and meaning.

The tables come from the models' fields (`description=` is the meaning), so the reference
cannot fall behind the code; a test compares the committed page with `render()`.
Regenerate it with `python -m featcal_llm.io.recipe_reference > docs/recipe.md`.
"""

from __future__ import annotations

import typing
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import PydanticUndefined  # pydantic_core's, as pydantic re-exports it

from featcal_llm.evaluation.config import BackendSettings, EvalSection
from featcal_llm.io.block import FeatCalConfig, PerLayer, Tunable
from featcal_llm.io.block_sections import DataSpec, GenerateSpec, HeadSpec, MergeOptionsSpec, RefineSpec, TuneSpec

# (heading, the model, what the block is) in page order; every model reachable from FeatCalConfig is here
SECTIONS: list[tuple[str, type[BaseModel], str]] = [
    ("featcal:", FeatCalConfig, "The block FeatCal adds after a mergekit recipe. Keys not listed here are errors."),
    ("featcal.data.EXPERT:", DataSpec, "One entry per expert, keyed by the expert's name exactly as written under `models:`. Give `path` (a dataset) or `generate` (the expert writes its own texts), not both. The `messages` and alpaca `response` defaults are resolved once per dataset from its field names (its columns), by `validate` and `run` alike; data with neither reading is refused in one line naming the file and its fields, and the fields a default resolved to are written out in the saved recipe (`featcal_recipe.yml`) and recorded in `featcal_weights.json` (`settings.data_fields`)."),
    ("featcal.data.EXPERT.generate:", GenerateSpec, "The expert samples its own calibration texts. With `generate`, only `samples` and `weight` may be set beside it."),
    ("featcal.head:", HeadSpec, "The LM head re-fitted after the last layer by the layers' rule, on the final norm's outputs. `head: auto` (the default) is `{when: auto}`, `head: true` is `{when: always}`, both with these defaults; `head: false` leaves the head merged."),
    ("featcal.merge_options:", MergeOptionsSpec, "mergekit's options for the merge the run makes when `merged` does not exist, as `mergekit-yaml` takes them. The merge is re-made when its seed differs from the recipe's."),
    ("featcal.tune:", TuneSpec, "How hyper-parameters given as `auto` or as a list of candidates are chosen, per layer, on held-out records."),
    ("featcal.refine:", RefineSpec, "After the closed form, gradient steps toward each record's teacher on the calibration records, stopped by the held-out records (docs/refine.md). `refine: true` is `{}`: these defaults; `refine: false` (the default) runs no refinement."),
    ("per_layer", PerLayer, "The form `lambda`, `alpha`, `rho` and `reduction` take in a tuned run's written recipe: `{per_layer: [...]}`, replayed as given."),
    ("featcal.eval:", EvalSection, "Score the merged and the calibrated model after the run. Files it reads (suite, data, nltk_data) are found as featcal.data paths are: from the current directory, or beside the recipe where only that one exists; `output` is from the current directory."),
    ("featcal.eval.backend:", BackendSettings, "How lm-eval drives the model; every setting is part of the results' cache key."),
]

INTRO = """# Recipe reference

A featcal-llm recipe is a mergekit recipe (`mergekit-yaml`'s syntax, parsed by mergekit itself; merges FeatCal cannot
calibrate, such as `slerp`, `nearswap` and `passthrough`, are refused in one line) with one more block, `featcal:`.
This page lists every key of that block. Check a recipe without running it:

```
featcal-llm validate recipe.yaml
```

It reports every problem at once, one line each, and `run` refuses the same recipes with the same lines:
[validate.md](validate.md) lists each refusal with both commands' words.

Hyper-parameters marked *tunable* (`lambda`, `alpha`, `rho`, `reduction`) take a number, a list of
candidates, `auto` (the documented candidate set), or `{per_layer: [...]}` (one value per decoder layer).

<!-- Generated from the pydantic models by `python -m featcal_llm.io.recipe_reference > docs/recipe.md`; do not edit. -->
"""

NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null", Any: "any value"}


def type_text(annotation: Any) -> str:
    """A field's type as a recipe writer reads it."""
    if annotation == Tunable:
        return "tunable"
    if annotation in NAMES:
        return NAMES[annotation]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        heading = next((heading for heading, model, _ in SECTIONS if model is annotation), None)
        return f"mapping (`{heading}`)" if heading else "mapping"
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{str(value).lower() if isinstance(value, bool) else value}`" for value in arguments)  # YAML's true
    if origin is typing.Annotated:
        return type_text(arguments[0]) + _bounds(annotation.__metadata__)
    if origin is dict:
        return f"mapping of {type_text(arguments[1])}"
    if origin in (list, tuple):
        return f"list of {type_text(arguments[0])}"
    if arguments:  # a union
        members = [a for a in arguments if a is not type(None)]
        if Tunable in (annotation, typing.Union[tuple(members)]) or set(typing.get_args(Tunable)) <= set(members):
            text = "tunable"
        else:
            text = " or ".join(type_text(member) for member in members)
        return text + (" or null" if type(None) in arguments else "")
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: Any) -> str:
    symbols = {Ge: ("≥", "ge"), Gt: (">", "gt"), Le: ("≤", "le"), Lt: ("<", "lt")}
    parts = []
    for item in metadata:
        for kind, (symbol, attribute) in symbols.items():
            if isinstance(item, kind):
                bound = getattr(item, attribute)
                parts.append(f"{symbol} {bound}" if isinstance(bound, int) else f"{symbol} {bound:g}")  # a seed's 2³² − 1 whole
    return f", {', '.join(parts)}" if parts else ""


def default_text(field: Any) -> str:
    """The default as a recipe writer reads it; a method-dependent one (null in the model) as the field spells it out."""
    shown = (field.json_schema_extra or {}).get("shown_default") if isinstance(field.json_schema_extra, dict) else None
    if shown:
        return shown
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(see below)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`" if value != {} else "`{}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(model: type[BaseModel]) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        kind = extra.get("shown_type") or type_text(field.annotation) + _bounds(field.metadata)  # a validator's own forms
        rows.append(f"| `{field.alias or name}` | {kind} | {default_text(field)} | {_cell(field.description or '')} |")
    return rows


def render() -> str:
    """The whole page."""
    lines = [INTRO.rstrip("\n")]
    for heading, model, summary in SECTIONS:
        lines += ["", f"## `{heading}`", "", summary, "", *table(model)]
    return "\n".join(lines) + "\n"


def models_reachable(root: type[BaseModel] = FeatCalConfig) -> set[type[BaseModel]]:
    """Every pydantic model a recipe's `featcal:` block can contain (what the page must cover)."""
    found: set[type[BaseModel]] = set()

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in found:
                found.add(annotation)
                for field in annotation.model_fields.values():
                    visit(field.annotation)
            return
        for argument in typing.get_args(annotation):
            visit(argument)

    visit(root)
    return found


USAGE = ("usage: python -m featcal_llm.io.recipe_reference > docs/recipe.md\n\n"
         "Prints the reference of the featcal: block's keys, rendered from its pydantic models.")

if __name__ == "__main__":
    import sys

    if sys.argv[1:] in (["-h"], ["--help"]):
        print(USAGE)
    elif sys.argv[1:]:
        sys.exit(f"featcal-llm: error: recipe_reference takes no arguments (got {' '.join(sys.argv[1:])})\n{USAGE}")
    else:
        print(render(), end="")
