"""A mergekit recipe plus its ``featcal:`` block, validated.

The mergekit part is checked against mergekit's schema without torch
(``io/mergekit_config.py``, the same models as ``mergekit.config``, and the merge
methods' parameters from ``io/mergekit_methods.py``), so ``validate`` answers in
under a second (an ``eval:`` block's task checks import lm-eval and NLTK: 10 s
more); ``run`` then parses it with mergekit's own ``MergeConfiguration``
(what ``mergekit-yaml`` accepts we accept). The ``featcal:`` block is ours
(``featcal_llm.io.block``) and is strict: an unknown or misspelled key is an
error that names it. YAML keys given twice are errors (YAML would keep the last
silently: ``io/recipe_yaml.py`` finds them). Here: the checks across both parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from featcal_llm.errors import silenced_warnings, warn
from featcal_llm.io.block import FEATCAL_ONLY, REGMEAN_ONLY, FeatCalConfig, beside_recipe
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.forms import check_forms
from featcal_llm.io.key_homes import placed_message
from featcal_llm.io.mergekit_config import MergeConfiguration
from featcal_llm.io.merge_values import value_problems
from featcal_llm.io.mergekit_methods import parameter_problems
from featcal_llm.io.model_spellings import one_model_two_ways, plus_in_a_folder
from featcal_llm.io.merge_settings import merge_setting_problems
from featcal_llm.io.output_dir import name_problem, shown
from featcal_llm.io.recipe_yaml import read_yaml_mapping, recipe_text
from featcal_llm.io.run_settings import made_from, settings_root
from featcal_llm.io.problems import (Problem, RecipeProblems, collect, in_document_order, known_keys, one_error_per_key,
                                     pydantic_problems, suggestion)
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
    card_text: str | None = None  # the recipe the card shows, where `text` is a stage's (a stack's second, with the first's choices)
    output_key: str = "featcal.output"  # how refusals name the output: OUTPUT where the command line (output=) gave it
    made_from: dict | None = None  # the user's settings (io/run_settings.made_from), a stack's stages keep them; its run record keeps them
    settings_root: str | None = None  # the digest of the settings first run (io/run_settings.settings_root): a replay's original's


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


def _unknown_top_keys(path: Path, raw: dict, merge_model: Any, problems: list[Problem]) -> None:
    """mergekit ignores keys it does not know; a misspelled one (`base_modle`) would silently change the merge (a
    warning: mergekit's own recipes may carry keys of other tools). A featcal key there is refused: `samples:` or
    `refine: true` one indent too far left is read by no one, and the run would not do what the recipe says."""
    known = [*known_keys(merge_model), "featcal"]
    ours = known_keys(FeatCalConfig)
    for key in raw:
        if key not in known and key in ours:
            problems.append(Problem(str(path), str(key), "a featcal key, read only under featcal: (indent it there); at the "
                                                         "top level mergekit ignores it and the run would not read it"))
            continue
        hint = suggestion(str(key), known)
        if key not in known and hint:
            warn(f"{path}: {key}: not a mergekit or featcal key (mergekit ignores it){hint}")


def _block_checks(path: Path, featcal: FeatCalConfig, problems: list[Problem]) -> None:
    """What the block says wrong on its own, across its keys: method-specific keys, tuning, weights, prompts files."""
    wrong = [] if featcal.stacked else [key for key in (REGMEAN_ONLY if not featcal.regmean else FEATCAL_ONLY) if key in featcal.model_fields_set
                                        and not (key == "head" and featcal.head is None)  # `head: false` is what RegMean does
                                        and not (key == "trailing_experts" and featcal.trailing_experts == "keep")  # so is keep
                                        and not (key == "teachers" and featcal.teachers == "own")]  # and own teachers
    for key in wrong:
        owner = "methods regmean and regmean++ read" if not featcal.regmean else "method featcal reads"
        problems.append(Problem(str(path), f"featcal.{key.rstrip('_')}", f"only {owner} it (method is {featcal.method})"))
    if featcal.regmean and featcal.token_weights == "expert_lead":
        problems.append(Problem(str(path), "featcal.token_weights", f"expert_lead is FeatCal's; {featcal.method} weighs every token alike (equal)"))
    elif not featcal.regmean and "trailing_records" in featcal.model_fields_set and featcal.token_weighting != "expert_lead":
        problems.append(Problem(str(path), "featcal.trailing_records", f"only token_weights: expert_lead reads it (a trailing record "
                                f"weighs 0 through its token weights), and token_weights is {featcal.token_weighting}"))
    if any(stage.tuned and stage.per_layer for stage in _stages(featcal)):
        problems.append(Problem(str(path), "featcal", "per_layer values replay a tuned run and cannot be combined with auto or candidate lists"))
    if featcal.tune is not None and not featcal.tuned and not featcal.per_layer:
        search_keys = sorted(featcal.tune.model_fields_set - {"holdout"})  # refine holds its records out by tune.holdout too
        if featcal.refine is None or search_keys:
            key = f"featcal.tune.{search_keys[0]}" if featcal.refine is not None else "featcal.tune"
            problems.append(Problem(str(path), key, f"nothing to tune (set {'reduction' if featcal.regmean else 'lambda, alpha or rho'} "
                                    "to auto or a list of candidates)" + ("; with refine only tune.holdout applies" if featcal.refine is not None else "")))
    from featcal_llm.engine.tuning import build_search, holdout_problem  # light: no torch

    for stage in _stages(featcal):  # a stack searches each stage on its own, each within the budget (engine/method.py)
        if stage.tuned:
            collect(problems, path, lambda stage=stage: build_search(stage, str(path)))
    if featcal.holds_out:  # the records the recipe asks for (a shorter file is caught when it is read)
        share = featcal.tune_settings().holdout
        for name, spec in featcal.data.items():
            problem = holdout_problem(share, spec.records(featcal.samples), name)
            if problem is not None:
                key, _, message = problem.partition(": ")
                problems.append(Problem(str(path), key, message))
                break
    if featcal.data and all(spec.weight == 0 for spec in featcal.data.values()):
        problems.append(Problem(str(path), "featcal.data", "every expert has weight 0: nothing to calibrate toward (give at least one a weight above 0)"))
    generated = [name for name, spec in featcal.data.items() if spec.generate is not None and spec.weight > 0]
    if featcal.refine is not None and generated:  # measured both ways: docs/data-free.md
        warn(f"{path}: featcal.refine: {', '.join(generated)} {'calibrates' if len(generated) == 1 else 'calibrate'} on generated records, and refinement's held-out "
             "records are generated too, so it cannot see a loss on real text; it helped where the experts led the merge "
             "by 0.3-0.6 nats a token and cost a kind where they led by 0.05-0.18 with 64-128 records each (docs/data-free.md)")
    for name, spec in featcal.data.items():  # a prompts file is read now: a bad one stops the run before any work
        if spec.generate is not None and spec.generate.prompts is not None:
            from featcal_llm.io.prompts import read_prompts

            where = f"{path}: featcal.data.{name}.generate.prompts"
            collect(problems, path, lambda spec=spec, where=where: read_prompts(beside_recipe(spec.generate.prompts, path.parent), where))


def _merge_checks(path: Path, featcal: FeatCalConfig | None, merge_config: Any, problems: list[Problem]) -> tuple[Expert, ...]:
    """What the mergekit part says on its own (recipe forms, the method's parameters) and with the block (experts against data entries)."""
    if merge_config is None:
        return ()
    from featcal_llm.io.mergekit_methods import methods

    if merge_config.merge_method not in methods():  # a typo: the nearest method, from mergekit's own registry
        known = list(methods())
        problems.append(Problem(str(path), "merge_method", f"{merge_config.merge_method} is not a mergekit merge method"
                                f"{suggestion(merge_config.merge_method, known)} (mergekit has: {', '.join(known)})"))
        return ()
    before = len(problems)
    collect(problems, path, lambda: check_forms(merge_config, path))
    if len(problems) > before:  # a form FeatCal cannot calibrate: what follows would only repeat it
        return ()
    base = str(merge_config.base_model) if merge_config.base_model is not None else None
    taken_for_expert = tuple(f"models.{i}.parameters." for i, entry in enumerate(merge_config.models or ())
                             if featcal is not None and str(entry.model) == base and base in featcal.data)
    # the base listed as an expert, with data and an expert's weight: one problem (its data entry, below), not two
    problems.extend(problem for problem in parameter_problems(merge_config, str(path))
                    if not (taken_for_expert and problem.key.startswith(taken_for_expert)))
    problems.extend(value_problems(merge_config, str(path)))
    if merge_config.base_model is None:
        problems.append(Problem(str(path), "base_model", "FeatCal needs the base model the experts were fine-tuned from"))
    experts = tuple(Expert(str(reference), reference) for reference in _experts_of(merge_config))
    if not experts:
        problems.append(Problem(str(path), "models", "no expert besides the base model"))
    problems.extend(merge_setting_problems(path, merge_config))
    listed = [str(entry.model) for entry in merge_config.models or ()]
    for name in dict.fromkeys(name for name in listed if listed.count(name) > 1):  # mergekit refuses it mid-run
        problems.append(Problem(str(path), "models", f"{name} is listed {listed.count(name)} times; list each model once"))
    problems.extend(Problem(str(path), "models", message) for message in one_model_two_ways(merge_config))
    problems.extend(plus_in_a_folder(path, merge_config))
    if base in listed and featcal is not None and base in featcal.data:
        problems.append(Problem(str(path), f"featcal.data.{base}", "this is the base_model, not an expert: calibrating toward "
                                "the base would pull the merge back to it; remove its data entry"))
    if featcal is None:
        return experts
    names = [expert.name for expert in experts]
    typos = misspelt_models(experts, featcal.data)  # a model path typo: io/validate_models.py reports it once, as the path's
    without = [name for name in names if name not in featcal.data and name not in typos]
    named = set()
    for key in featcal.data:
        if key not in names and key not in typos.values() and not (key == base and base in listed):
            hint = suggestion(key, without)
            folder = [name for name in without if Path(name).name == key]  # `wiki:` for models/wiki, as the card names it
            hint = hint or (f"; did you mean {folder[0]!r}?" if len(folder) == 1 else "")
            named.update(name for name in without if hint == f"; did you mean {name!r}?")
            problems.append(Problem(str(path), f"featcal.data.{key}", f"not an expert of this recipe (experts: {', '.join(names)}){hint}"))
    for name in without:
        if name not in named:  # a data key typo names its expert above: one error for one typo
            problems.append(Problem(str(path), "featcal.data", f"no calibration data for expert {name!r}"))
    return experts


def misspelt_models(experts: tuple[Expert, ...], data: dict[str, Any]) -> dict[str, str]:
    """Expert → data key, where the expert's local path does not exist and the unmatched data key is a close spelling that does.

    The model path is the typo then (one error, io/validate_models.py names it), not the data key.
    """
    import difflib

    names = [expert.name for expert in experts]
    spare = [key for key in data if key not in names and Path(key).exists()]
    found = {}
    for expert in experts:
        if expert.name in data or Path(expert.name).exists() or "+" in expert.name:
            continue
        close = difflib.get_close_matches(expert.name, spare, n=1, cutoff=0.75)
        if close:
            found[expert.name] = close[0]
            spare.remove(close[0])
    return found


@dataclass
class Parsed:
    """What the recipe's text gave: the recipe when it is valid, every problem, and the parts that parsed on their own."""

    recipe: Recipe | None
    problems: list[Problem]
    merge_config: Any = None  # io/mergekit_config.MergeConfiguration (torch-free), whatever `mergekit` says
    featcal: FeatCalConfig | None = None
    block: dict | None = None
    mergekit_part: dict | None = None  # the recipe's mergekit part, as written

    def setting(self, key: str) -> Any:
        """A `featcal:` key's value: from the parsed block, or (when the block has errors) a string value as written."""
        if self.featcal is not None:
            return getattr(self.featcal, key)
        value = (self.block or {}).get(key)
        return value if isinstance(value, str) else None

    def data_entries(self) -> dict[str, DataSpec]:
        """The data entries (DataSpec): from the parsed block, or (when the block has errors) each entry that is valid
        on its own (the others are reported with the block)."""
        if self.featcal is not None:
            return self.featcal.data
        entries = self.block.get("data") if self.block else None
        valid = {}
        for name, entry in (entries or {}).items() if isinstance(entries, dict) else ():
            try:
                valid[str(name)] = DataSpec.model_validate(entry)
            except ValidationError:
                continue
        return valid


def _read_block(path: Path, block: Any, problems: list[Problem], raw: dict | None = None) -> FeatCalConfig | None:
    """The `featcal:` block validated (pydantic only: no mergekit, no torch), with the checks across its keys."""
    if block is None:
        import difflib

        close = difflib.get_close_matches("featcal", [str(key) for key in raw or {}], n=1, cutoff=0.75)
        if close:  # `featcall:`: the block is there, misspelt
            problems.append(Problem(str(path), close[0], "unknown key; did you mean 'featcal'?"))
            raw.pop(close[0])  # mergekit would ignore it: no second warning
        else:
            problems.append(Problem(str(path), "featcal", "block is missing (add it after the mergekit recipe)"))
        return None
    if not isinstance(block, dict):
        problems.append(Problem(str(path), "featcal", "expected a mapping"))
        return None
    try:
        featcal = FeatCalConfig.model_validate(block)
    except ValidationError as error:
        found = pydantic_problems(path, error, "featcal", FeatCalConfig)
        # a default computed from another key (data.X.response from its format) is not computed once that key is wrong: the
        # wrong key is the one problem
        found = [problem for problem, item in zip(found, error.errors()) if item["type"] != "default_factory_not_called"]
        problems.extend(in_document_order(_placed(found, raw), block, "featcal"))
        return None
    _block_checks(path, featcal, problems)
    return featcal


def _placed(found: list[Problem], raw: dict | None) -> list[Problem]:
    """An unknown key one indentation level off, told where it goes: an expert's data entry level with `data:` (which
    is then empty), a featcal key inside a data entry, a key of another section (io/key_homes.py)."""
    models = (raw or {}).get("models")
    experts = {str(item.get("model")) for item in models if isinstance(item, dict)} if isinstance(models, list) else set()
    placed = []
    for problem in found:
        key, message = problem.key, problem.message
        if message.startswith("unknown key") and key.removeprefix("featcal.") in experts:
            message = "unknown key: an expert of models:, so its data entry goes under featcal.data: (indent it there)"
        elif key == "featcal.data" and message.startswith("Input should be a valid dictionary") and message.endswith("(got null)"):
            message = "empty: one entry per expert goes under it, indented (EXPERT: {path: ..., format: ...})"
        elif key == "featcal.data" and message.startswith("Input should be a valid dictionary"):  # a YAML list of entries
            got = message[message.find(" (got "):] if " (got " in message else ""
            message = "expected a mapping: one entry per expert, keyed by its name under models: (EXPERT: {path: ..., format: ...})" + got
        elif message.startswith("unknown key") and (home := placed_message(key)) is not None:
            message = home  # `steps:` level with `refine:`: its nearest spelling there ('eps') points the wrong way
        placed.append(Problem(problem.file, key, message))
    return placed


def _mergekit_problems(path: Path, error: ValidationError) -> list[Problem]:
    """pydantic's errors of the mergekit part, one line each; a whole-recipe rule (exactly one of models/slices) without the recipe echoed."""
    problems = pydantic_problems(path, error, "", MergeConfiguration)
    for index, item in enumerate(one_error_per_key(error.errors(), MergeConfiguration)):  # one per problem, in order
        if isinstance(item.get("input"), (dict, list)) and item["type"] not in ("missing", "extra_forbidden"):
            problems[index] = Problem(str(path), problems[index].key, item["msg"].removeprefix("Value error, "))
    return problems


def read_recipe(path: str | Path, mergekit: bool = True) -> Parsed:
    """The recipe and every problem its text shows (YAML, schema, recipe forms, merge parameters, experts against data), in one round.

    Everything is checked without torch; with `mergekit` (what `run` needs) a clean recipe is then parsed by
    mergekit's own `MergeConfiguration`, which imports torch and transformers (seconds).
    """
    path = Path(path)
    problems: list[Problem] = []
    unusable = name_problem(path)
    if unusable is not None:  # no file could have this name
        return Parsed(None, [Problem(shown(path), "", unusable)])
    raw = collect(problems, path, lambda: read_yaml_mapping(path, problems))
    if raw is None:
        return Parsed(None, problems)
    block = raw.pop("featcal", None)
    parsed = Parsed(None, problems, block=block if isinstance(block, dict) else None, mergekit_part=raw)
    block_problems: list[Problem] = []
    parsed.featcal = _read_block(path, block, block_problems, raw)
    _unknown_top_keys(path, raw, MergeConfiguration, problems)
    try:
        parsed.merge_config = MergeConfiguration.model_validate(raw)
    except ValidationError as error:
        problems.extend(_mergekit_problems(path, error))
    problems.extend(block_problems)
    experts = _merge_checks(path, parsed.featcal, parsed.merge_config, problems)
    if problems or parsed.featcal is None or parsed.merge_config is None:
        return parsed
    merge_config = parsed.merge_config
    if mergekit:
        try:
            merge_config = heavy_import("mergekit.config").MergeConfiguration.model_validate(raw)
        except Exception as error:  # the schema test keeps the two alike; should they part, mergekit has the last word
            problems.append(Problem(str(path), "", f"not a valid mergekit recipe: {str(error).splitlines()[0] if str(error) else type(error).__name__}"))
            return parsed
        experts = tuple(Expert(str(reference), reference) for reference in _experts_of(merge_config))
    text = recipe_text(path)
    settings = made_from(parsed.featcal, raw)
    parsed.recipe = Recipe(path=path, text=text, merge_config=merge_config, featcal=parsed.featcal, base=merge_config.base_model,
                           experts=experts, made_from=settings, settings_root=settings_root(text, settings))
    return parsed


def settings_of_text(text: str, path: Path) -> dict[str, str] | None:
    """made_from of a recipe's text (the saved recipe a run writes), or None where its block does not validate."""
    import yaml

    raw = yaml.safe_load(text)
    with silenced_warnings():
        featcal = _read_block(path, raw.pop("featcal", None), [], raw) if isinstance(raw, dict) else None
    return None if featcal is None else made_from(featcal, raw)


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe without touching any model or dataset; every problem is reported at once."""
    parsed = read_recipe(path)
    if parsed.problems:
        raise RecipeProblems(parsed.problems)
    return parsed.recipe
