"""A mergekit recipe plus its ``featcal:`` block, validated.

The mergekit part is parsed by mergekit's own ``MergeConfiguration`` (so what
``mergekit-yaml`` accepts we accept); the ``featcal:`` block is ours
(``featcal_llm.io.block``) and is strict: an unknown or misspelled key is an
error that names it. Here: reading the file, and the checks across both parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from featcal_llm.errors import FeatCalError, warn
from featcal_llm.io.block import FEATCAL_ONLY, REGMEAN_ONLY, FeatCalConfig, beside_recipe
from featcal_llm.io.forms import check_forms
from featcal_llm.io.problems import Problem, RecipeProblems, collect, in_document_order, known_keys, pydantic_problems, suggestion
from featcal_llm.startup import heavy_import

@dataclass(frozen=True)
class Expert:
    """An expert as the recipe names it, with where its weights live."""

    name: str  # exactly as written under `models:`; keys `featcal.data`
    reference: Any  # mergekit ModelReference


@dataclass(frozen=True)
class Recipe:
    path: Path
    text: str
    merge_config: Any  # mergekit MergeConfiguration
    featcal: FeatCalConfig
    base: Any  # mergekit ModelReference
    experts: tuple[Expert, ...]
    merged_label: str | None = None  # how the model card names the start of calibration (default featcal.merged)


def _read_yaml_mapping(path: Path) -> dict:
    if not path.is_file():
        raise FeatCalError(f"{path}: recipe file not found")
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise FeatCalError(f"{path}: not valid YAML{where}") from None
    if raw is None:
        raise FeatCalError(f"{path}: the recipe file is empty (expected a mergekit recipe with a featcal: block)")
    if not isinstance(raw, dict):
        raise FeatCalError(f"{path}: expected a YAML mapping (a mergekit recipe), got {'a list' if isinstance(raw, list) else 'a single value'}")
    return raw


def _experts_of(merge_config: Any) -> list[Any]:
    """Every input model except the base, in recipe order, from `models:` or `slices:`."""
    references: list[Any] = []
    if merge_config.models:
        references = [entry.model for entry in merge_config.models]
    else:
        slices = merge_config.slices or [
            s for module in (merge_config.modules or {}).values() for s in (module.slices or [])
        ]
        for output_slice in slices:
            references.extend(source.model for source in output_slice.sources)
    unique: list[Any] = []
    for reference in references:
        if reference != merge_config.base_model and reference not in unique:
            unique.append(reference)
    return unique


def _stages(featcal: FeatCalConfig) -> list[FeatCalConfig]:
    """The block's one-method stages (itself, unless it is a stack)."""
    return [featcal.stage(i, featcal.output) for i in range(2)] if featcal.stacked else [featcal]


def _unknown_top_keys(path: Path, raw: dict, merge_model: Any) -> None:
    """mergekit ignores keys it does not know; a misspelled one (`base_modle`) would silently change the merge."""
    known = [*known_keys(merge_model), "featcal"]
    for key in raw:
        hint = suggestion(str(key), known)
        if key not in known and hint:
            warn(f"{path}: {key}: not a mergekit or featcal key (mergekit ignores it){hint}")


def _block_checks(path: Path, featcal: FeatCalConfig, problems: list[Problem]) -> None:
    """What the block says wrong on its own, across its keys: method-specific keys, tuning, weights, prompts files."""
    wrong = [] if featcal.stacked else [key for key in (REGMEAN_ONLY if not featcal.regmean else FEATCAL_ONLY) if key in featcal.model_fields_set
                                        and not (key == "head" and featcal.head is None)  # `head: false` is what RegMean does
                                        and not (key == "trailing_experts" and featcal.trailing_experts == "keep")]  # so is keep
    for key in wrong:
        owner = "regmean and regmean++" if not featcal.regmean else "featcal"
        problems.append(Problem(str(path), f"featcal.{key.rstrip('_')}", f"only method {owner} reads it (method is {featcal.method})"))
    if featcal.regmean and featcal.token_weights == "expert_lead":
        problems.append(Problem(str(path), "featcal.token_weights", f"expert_lead is FeatCal's; {featcal.method} weighs every token alike (equal)"))
    if any(stage.tuned and stage.per_layer for stage in _stages(featcal)):
        problems.append(Problem(str(path), "featcal", "per_layer values replay a tuned run and cannot be combined with auto or candidate lists"))
    if featcal.tune is not None and not featcal.tuned and not featcal.per_layer:
        problems.append(Problem(str(path), "featcal.tune", f"nothing to tune (set {'reduction' if featcal.regmean else 'lambda, alpha or rho'} to auto or a list of candidates)"))
    if featcal.data and all(spec.weight == 0 for spec in featcal.data.values()):
        problems.append(Problem(str(path), "featcal.data", "every expert has weight 0: nothing to calibrate toward (give at least one a weight above 0)"))
    for name, spec in featcal.data.items():  # a prompts file is read now: a bad one stops the run before any work
        if spec.generate is not None and spec.generate.prompts is not None:
            from featcal_llm.io.prompts import read_prompts

            where = f"{path}: featcal.data.{name}.generate.prompts"
            collect(problems, path, lambda spec=spec, where=where: read_prompts(beside_recipe(spec.generate.prompts, path.parent), where))


def _merge_checks(path: Path, featcal: FeatCalConfig, merge_config: Any, problems: list[Problem]) -> tuple[Expert, ...]:
    """What the block and the mergekit part say together: recipe forms, the base, experts against data entries."""
    if merge_config is None:
        return ()
    before = len(problems)
    collect(problems, path, lambda: check_forms(merge_config, path))
    if len(problems) > before:  # a form FeatCal cannot calibrate: what follows would only repeat it
        return ()
    if merge_config.base_model is None:
        problems.append(Problem(str(path), "base_model", "FeatCal needs the base model the experts were fine-tuned from"))
    experts = tuple(Expert(str(reference), reference) for reference in _experts_of(merge_config))
    if not experts:
        problems.append(Problem(str(path), "models", "no expert besides the base model"))
    names = [expert.name for expert in experts]
    for name in names:
        if name not in featcal.data:
            problems.append(Problem(str(path), "featcal.data", f"no calibration data for expert {name!r}"))
    for key in featcal.data:
        if key not in names:
            without = [name for name in names if name not in featcal.data]
            problems.append(Problem(str(path), f"featcal.data.{key}", f"not an expert of this recipe (experts: {', '.join(names)}){suggestion(key, without)}"))
    return experts


@dataclass
class Parsed:
    """What the recipe's text gave: the recipe when it is valid, every problem, and the parts that parsed on their own."""

    recipe: Recipe | None
    problems: list[Problem]
    merge_config: Any = None
    featcal: FeatCalConfig | None = None
    block: dict | None = None
    merge_unchecked: bool = False  # the block had problems and the mergekit part was left for later (`block_first`)


def _read_block(path: Path, block: Any, problems: list[Problem]) -> FeatCalConfig | None:
    """The `featcal:` block validated (pydantic only: no mergekit, no torch), with the checks across its keys."""
    if block is None:
        problems.append(Problem(str(path), "featcal", "block is missing (add it after the mergekit recipe)"))
        return None
    if not isinstance(block, dict):
        problems.append(Problem(str(path), "featcal", "expected a mapping"))
        return None
    try:
        featcal = FeatCalConfig.model_validate(block)
    except ValidationError as error:
        problems.extend(in_document_order(pydantic_problems(path, error, "featcal", FeatCalConfig), block, "featcal"))
        return None
    _block_checks(path, featcal, problems)
    return featcal


def block_problems(path: str | Path) -> list[Problem]:
    """The YAML's and the `featcal:` block's own problems, without mergekit: what `run` refuses before it imports torch."""
    path, problems = Path(path), []
    raw = collect(problems, path, lambda: _read_yaml_mapping(path))
    if raw is not None:
        _read_block(path, raw.get("featcal"), problems)
    return problems


def read_recipe(path: str | Path, block_first: bool = False) -> Parsed:
    """The recipe and every problem its text shows (schema, recipe forms, experts against data), without touching a model.

    `block_first`: when the `featcal:` block has problems, return them without importing mergekit (which brings
    torch and transformers, seconds): a key typo comes back at once; the mergekit part is checked once the block is clean.
    """
    path = Path(path)
    problems: list[Problem] = []
    raw = collect(problems, path, lambda: _read_yaml_mapping(path))
    if raw is None:
        return Parsed(None, problems)
    block = raw.pop("featcal", None)
    parsed = Parsed(None, problems, block=block if isinstance(block, dict) else None)
    block_problems: list[Problem] = []
    parsed.featcal = _read_block(path, block, block_problems)
    if block_first and block_problems:
        problems.extend(block_problems)
        parsed.merge_unchecked = True
        return parsed
    MergeConfiguration = heavy_import("mergekit.config").MergeConfiguration
    _unknown_top_keys(path, raw, MergeConfiguration)
    try:
        parsed.merge_config = MergeConfiguration.model_validate(raw)
    except ValidationError as error:
        problems.extend(pydantic_problems(path, error, "", MergeConfiguration))
    except Exception as error:  # mergekit raises RuntimeError from its own validators
        problems.append(Problem(str(path), "", f"not a valid mergekit recipe: {error}"))
    problems.extend(block_problems)
    if parsed.featcal is None or parsed.merge_config is None:
        return parsed
    experts = _merge_checks(path, parsed.featcal, parsed.merge_config, problems)
    if not problems:
        merge_config = parsed.merge_config
        text = path.read_text(encoding="utf-8")
        parsed.recipe = Recipe(path=path, text=text, merge_config=merge_config, featcal=parsed.featcal, base=merge_config.base_model, experts=experts)
    return parsed


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe without touching any model or dataset; every problem is reported at once."""
    parsed = read_recipe(path)
    if parsed.problems:
        raise RecipeProblems(parsed.problems)
    return parsed.recipe
