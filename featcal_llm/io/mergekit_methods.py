"""mergekit's merge methods as data: their parameters (name, scope, type, required) and which inputs they take.

mergekit ignores a parameter name its method does not read (`wieght: 0.5` merges as if no weight were given)
and checks values and required parameters only while it merges, after minutes of work. `validate` and
`run` check them from `mergekit_methods.json`, generated from mergekit's registry
(`python -m featcal_llm.io.mergekit_methods > featcal_llm/io/mergekit_methods.json`), so the check needs
neither mergekit nor torch; tests/test_mergekit_schema.py regenerates it from the installed mergekit and
compares, so it cannot fall behind.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Union

from featcal_llm.io.problems import Problem, suggestion

SCHEMA_FILE = Path(__file__).with_name("mergekit_methods.json")
SCALARS = {"number": float, "boolean": bool, "integer": int, "string": str, "null": type(None)}
WORDS = {"number": "a number", "boolean": "true or false", "integer": "an integer", "string": "a string", "null": "null"}


def generate() -> dict[str, Any]:
    """The schema, read from the installed mergekit's registry (imports mergekit and torch: build time only)."""
    from importlib.metadata import version

    from mergekit.merge_methods.base import MISSING
    from mergekit.merge_methods.registry import registered_methods
    from pydantic import TypeAdapter

    methods = {}
    for method in sorted(registered_methods(), key=lambda m: m.spec.name):
        spec, contract = method.spec, method.spec.contract
        methods[spec.name] = {
            "base": contract.base.value,
            "min_inputs": contract.min_inputs, "max_inputs": contract.max_inputs,
            "min_non_base": contract.min_non_base, "max_non_base": contract.max_non_base,
            "parameters": {
                p.name: {"scope": p.scope.value, "type": TypeAdapter(p.value_type).json_schema(), "required": p.default is MISSING}
                for p in spec.parameters
            },
        }
    return {"mergekit": version("mergekit"), "methods": methods}


@lru_cache(maxsize=1)
def methods() -> dict[str, dict[str, Any]]:
    """Method name → its schema entry, as shipped."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))["methods"]


def _python_type(schema: dict) -> Any:
    if "anyOf" in schema:
        return Union[tuple(_python_type(member) for member in schema["anyOf"])]
    return SCALARS[schema["type"]]


def _type_words(schema: dict) -> str:
    if "anyOf" in schema:
        return " or ".join(_type_words(member) for member in schema["anyOf"])
    return WORDS[schema["type"]]


def _leaves(setting: Any) -> Iterator[Any]:
    """The scalar values of a parameter setting: a value, a gradient (list), a {value, filter} or a list of them."""
    if isinstance(setting, list):
        for item in setting:
            yield from _leaves(item)
    elif hasattr(setting, "value"):  # ConditionalParameter
        yield from _leaves(setting.value)
    else:
        yield setting


# far past any merge weight, density or scale; mergekit multiplies tensors by such a value and writes inf or NaN
LARGEST_VALUE = 1e6


def _bad_value(schema: dict, setting: Any) -> tuple[Any, str] | None:
    """The first value of `setting` mergekit would refuse or merge into inf/NaN, and what is expected (None when all pass)."""
    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(_python_type(schema))
    for value in _leaves(setting):
        try:
            adapter.validate_python(value)
        except ValidationError:
            return (value if value is not None else "null"), _type_words(schema)
        if isinstance(value, float) and value != value or isinstance(value, (int, float)) and not isinstance(value, bool) \
                and abs(value) > LARGEST_VALUE:  # .nan, .inf, 1e300: a number mergekit takes, and a merge of NaN
            return value, f"a finite number between -{LARGEST_VALUE:.0f} and {LARGEST_VALUE:.0f}"
    return None


def covers_every_tensor(setting: Any) -> bool:
    """Whether a parameter setting gives every tensor a value: a number, a gradient, or a conditional list (or entry)
    with an entry whose filter matches every tensor (none, '*' or ''). A setting whose every entry has a filter leaves the tensors none matches to the
    next level (mergekit's model → slice → top-level parameters), and without one there, "Missing required parameter"."""
    if isinstance(setting, list):
        if not setting:
            return False
        return any(covers_every_tensor(item) for item in setting) if any(hasattr(item, "filter") for item in setting) else True
    if hasattr(setting, "filter"):
        return setting.filter in CATCH_ALL_FILTERS
    return True


CATCH_ALL_FILTERS = (None, "*", "")  # mergekit's evaluate_setting: no filter, '*', or a substring of every name


def merge_inputs(config: Any) -> list[tuple[str, Any, list[tuple[str, dict | None]]]]:
    """Each input model of the merge: (its key in the recipe, its reference, (key, settings) from the most specific).

    As mergekit's planner reads them: a base model not listed among the inputs is added without parameters.
    """
    base, found = config.base_model, []
    top = [("parameters", config.parameters)]
    if config.models:
        found = [(f"models.{i}", entry.model, [(f"models.{i}.parameters", entry.parameters), *top]) for i, entry in enumerate(config.models)]
        if base is not None and all(entry.model != base for entry in config.models):
            found.append(("base_model", base, top))
    for i, output_slice in enumerate(config.slices or []):
        chain = [(f"slices.{i}.parameters", output_slice.parameters), *top]
        found += [(f"slices.{i}.sources.{j}", source.model, [(f"slices.{i}.sources.{j}.parameters", source.parameters), *chain])
                  for j, source in enumerate(output_slice.sources)]
        if base is not None and all(source.model != base for source in output_slice.sources):
            found.append(("base_model", base, chain))
    return found


def _sites(config: Any) -> list[tuple[str, dict, bool, bool]]:
    """Where the recipe sets parameters: (key, the settings, whether per-model parameters only, whether they are the
    base model's: the slice's base_model, else the recipe's)."""
    base = config.base_model
    sites = [("parameters", config.parameters, False, False)]
    sites += [(f"models.{i}.parameters", entry.parameters, True, base is not None and entry.model == base)
              for i, entry in enumerate(config.models or [])]
    for i, output_slice in enumerate(config.slices or []):
        slice_base = output_slice.base_model or base
        sites.append((f"slices.{i}.parameters", output_slice.parameters, False, False))
        sites += [(f"slices.{i}.sources.{j}.parameters", source.parameters, True, slice_base is not None and source.model == slice_base)
                  for j, source in enumerate(output_slice.sources)]
    return [site for site in sites if site[1]]


def parameter_problems(config: Any, file: str) -> list[Problem]:
    """The parameters of a parsed mergekit configuration against its method: names, value types, required ones, input counts.

    An unknown method is left to io/forms.py (it has FeatCal's own table); so are multi-module recipes.
    """
    name = config.merge_method
    method = methods().get(name)
    if method is None or config.modules:
        return []
    spec = method["parameters"]
    per_model = [p for p, entry in spec.items() if entry["scope"] != "shared"]
    problems, hinted = [], set()
    for key, settings, model_site, of_base in _sites(config):
        for parameter, setting in settings.items():
            where = f"{key}.{parameter}"
            if parameter not in spec:
                hint = suggestion(parameter, per_model if model_site else spec)
                hinted.add((key, hint))
                listed = ", ".join(per_model if model_site else spec) or "none"
                problems.append(Problem(file, where, f"not a parameter of merge method {name}{hint} (mergekit would ignore it; "
                                                     f"{'per-model' if model_site else 'its'} parameters: {listed})"))
                continue
            if model_site and spec[parameter]["scope"] == "shared":
                problems.append(Problem(file, where, f"a global parameter of {name}: mergekit reads it only under the top-level "
                                                     "parameters: (here it would be ignored)"))
                continue
            if of_base and spec[parameter]["scope"] == "non_base" and method["base"] != "ignored":
                problems.append(Problem(file, where, f"merge method {name} reads {parameter} for the experts only: given to the "
                                                     "base model, mergekit would ignore it (remove it)"))
                continue
            bad = _bad_value(spec[parameter]["type"], setting)
            if bad is not None:
                problems.append(Problem(file, where, f"expected {bad[1]} (got {bad[0]!r})"))
    base = config.base_model if method["base"] != "ignored" else None
    for key, reference, chain in merge_inputs(config):
        for parameter, entry in spec.items():
            needed = entry["required"] and (entry["scope"] == "input" or (entry["scope"] == "non_base" and reference != base))
            given = [(site, settings[parameter]) for site, settings in chain if parameter in (settings or {})]
            if needed and given and not any(covers_every_tensor(setting) for _, setting in given):
                where = f"{given[0][0]}.{parameter}"  # the most specific: where the filters are written
                gap = "an empty list gives no tensor" if given[0][1] == [] else "every entry has a filter, so a tensor none matches has no"
                if not any(problem.key == where for problem in problems):
                    problems.append(Problem(file, where, f"{gap} {parameter} (mergekit: \"Missing required parameter\"); add an "
                                                         f"entry without a filter, or set {parameter} under the top-level parameters:"))
                continue
            if needed and not given:
                site = f"{key}.parameters" if key != "base_model" else "parameters"
                if (site, f"; did you mean {parameter!r}?") in hinted:
                    continue  # the misspelt name is the problem, reported above
                if key == "base_model":  # mergekit merges the base as one more input
                    problems.append(Problem(file, site, f"merge method {name} needs {parameter} for the base model too (set it "
                                                        f"under parameters:, or list the base under models: with its {parameter})"))
                else:
                    problems.append(Problem(file, site, f"merge method {name} needs {parameter} for model {reference} (set it "
                                                        "here or under the top-level parameters:)"))
    shared = [config.parameters, *(output_slice.parameters for output_slice in config.slices or [])]
    for parameter, entry in spec.items():
        if entry["required"] and entry["scope"] == "shared" and not any(parameter in (settings or {}) for settings in shared):
            problems.append(Problem(file, "parameters", f"merge method {name} needs {parameter}"))
    problems += _count_problems(config, method, base, file)
    return problems


def _count_problems(config: Any, method: dict, base: Any, file: str) -> list[Problem]:
    """How many models the method merges (mergekit's input contract: nuslerp two experts, model_stock at least two, ...)."""
    name, problems = config.merge_method, []
    if method["base"] == "required" and config.base_model is None:
        return []  # io/recipe.py: FeatCal needs a base model in every case
    if method["base"] == "forbidden" and config.base_model is not None:
        return [Problem(file, "base_model", f"merge method {name} does not take a base model")]
    references = {str(reference) for _, reference, _ in merge_inputs(config)}
    count = len(references)
    non_base = count - (base is not None and str(base) in references)
    for what, value, low, high in (("models", count, method["min_inputs"], method["max_inputs"]),
                                   ("experts besides the base model", non_base, method["min_non_base"], method["max_non_base"])):
        if low is None and high is None:
            continue
        low = low or 0
        if value < low or (high is not None and value > high):
            wanted = f"exactly {low}" if low == high else f"at least {low}" if value < low else f"at most {high}"
            problems.append(Problem(file, "models" if config.models else "slices", f"merge method {name} merges {wanted} {what}"
                                    f"{' (the base model included)' if what == 'models' else ''}; this recipe has {value}"))
    return problems


if __name__ == "__main__":
    import sys

    usage = "usage: python -m featcal_llm.io.mergekit_methods > featcal_llm/io/mergekit_methods.json (no arguments)"
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(usage)
    elif sys.argv[1:]:
        sys.exit(f"featcal-llm: error: mergekit_methods takes no arguments (got {' '.join(sys.argv[1:])})\n{usage}")
    else:
        print(json.dumps(generate(), indent=1, sort_keys=True))
