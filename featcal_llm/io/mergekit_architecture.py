"""The tensors mergekit's architecture definition requires of every model it merges, checked against the checkpoints.

mergekit's merge plans every weight its architecture lists (`mergekit/_data/architectures/*.json`, chosen by the
config's one architecture name, and by `model_type` where several share it) and fails on the first one that is not
optional and that an input model stores under none of its names (the name, its aliases, its tied names): `Tensor
lm_head.weight required but not present in model ...`, after torch and every model are loaded. A tied Phi-3
(Phi-4-mini: `tie_word_embeddings`, no `lm_head.weight` stored) is refused so, while Llama's and Qwen2's definitions read
a missing head from the tied embedding. `validate` answers without torch, and importing `mergekit.architecture`
imports it (5-10 s), so the installed mergekit's own definition files are read here, found without importing mergekit,
and resolved as `mergekit.architecture.arch_info_for_config` and `all_weights` resolve them; tests/test_mergekit_weights.py
compares the result with mergekit's API for every definition it ships. An architecture mergekit has no definition for
(it infers one from the models' own tensors) is not checked. mergekit also builds a missing tensor from a checkpoint
layout transformers renames (its conversion mapping: MoE and some vision types); validate checks only the families
featcal-llm calibrates, none of which has one (a test watches that).
"""

from __future__ import annotations

import json
import string
from functools import lru_cache
from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError

Required = tuple[str, tuple[str, ...]]  # a weight's name, and every name mergekit reads it under (its own first)
CODED = ("AfmoeForCausalLM", "Glm4MoeForCausalLM")  # defined in mergekit's code (moe_defs), not in its files


class _Template(string.Template):  # mergekit's TemplateWithArithmetic: ${layer_index+1}, ${num_layers-1}
    idpattern = r"(?a:[_a-z][_a-z0-9]*([+-]1)?)"


@lru_cache(maxsize=1)
def definitions() -> dict[str, list[dict]]:
    """Architecture name → the installed mergekit's definitions of it (its JSON files, as mergekit loads them)."""
    from importlib.util import find_spec

    spec = find_spec("mergekit")  # a top-level package's spec: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return {}
    found: dict[str, list[dict]] = {}
    for file in sorted((Path(next(iter(spec.submodule_search_locations))) / "_data" / "architectures").glob("*.json")):
        definition = json.loads(file.read_text(encoding="utf-8"))
        for name in definition.get("architectures", []):
            found.setdefault(name, []).append(definition)
    return found


def definition_for(config: dict) -> dict | None:
    """The definition mergekit merges a model of this config.json as (arch_info_for_config's choice); None where it
    has none (it infers the weights from the models then) or the config names no single architecture."""
    names = config.get("architectures")
    if not isinstance(names, list) or len(names) != 1 or names[0] in CODED:
        return None
    candidates = definitions().get(names[0], [])
    if len(candidates) == 1:
        return candidates[0]
    return next((candidate for candidate in candidates if candidate.get("model_type") == config.get("model_type")), None)


def required_weights(definition: dict, config: dict) -> list[Required] | None:
    """The weights `definition` requires of a model of `config` (its optional ones left out), each with the names
    mergekit finds it under; None where the config does not say how many layers (transformers' default would)."""
    modules = definition["modules"].values() if definition.get("kind") == "modular" else [{"architecture": definition}]
    required: list[Required] = []
    for module in modules:
        architecture, prefix = module["architecture"], module.get("weight_prefix") or ""
        layers = architecture.get("override_num_layers")
        if layers is None:
            layers = _config_value(config, architecture.get("num_layers_config_key") or "num_hidden_layers")
        if not isinstance(layers, int) or isinstance(layers, bool):
            return None
        listed = [(weight, None) for weight in architecture["pre_weights"]]
        listed += [(weight, index) for index in range(layers) for weight in architecture["layer_templates"]["weights"]]
        listed += [(weight, None) for weight in architecture["post_weights"]]
        for weight, index in listed:
            if weight.get("optional"):
                continue
            names = [weight["name"], *(weight.get("aliases") or ()), *(weight.get("tied_names") or ())]
            required.append(tuple(prefix + _substitute(name, layers, index) for name in names))
    return [(names[0], names) for names in required]


def first_missing(required: list[Required], stored: set[str]) -> Required | None:
    """The first required weight a checkpoint storing `stored` holds under none of its names."""
    return next(((name, names) for name, names in required if not stored.intersection(names)), None)


def missing_weight_refusal(directory: Path, config: dict, missing: Required) -> str:
    name, names = missing
    also = f" (nor under {', '.join(names[1:])})" if len(names) > 1 else ""
    tied = config.get("tie_word_embeddings") is True and name.endswith("lm_head.weight")
    fix = ("its config ties the head to the input embeddings (tie_word_embeddings), which mergekit's definition does "
           "not read the head from: save the model untied (lm_head.weight a copy of the embedding, "
           "tie_word_embeddings: false)") if tied else "a damaged or converted checkpoint? save it again with transformers"
    return (f"{directory}: stores no {name}{also}, which mergekit's architecture for {config['architectures'][0]} "
            f"requires of every model it merges; {fix}")


def check_mergekit_weights(directory: Path, config: dict, what: str) -> None:
    """Refuse, before any merge, a local model mergekit's merge would stop at: a weight its architecture requires and
    the checkpoint's index or header does not list."""
    from featcal_llm.io.model_files import tensor_names

    definition = definition_for(config)
    required = required_weights(definition, config) if definition is not None else None
    if not required:
        return
    missing = first_missing(required, tensor_names(directory))
    if missing is not None:
        raise FeatCalError(f"{what}: {missing_weight_refusal(directory, config, missing)}")


def reads_other_weights(source: Any, base_directory: Path | None) -> bool:
    """Whether mergekit's merge reads this expert's own checkpoint, not the base's: a plain adapter applies to the
    base's tensors (its directory is the base's), a `model+adapter` to the model's."""
    return source.directory != base_directory


def check_merge_inputs(recipe_path: Any, base: Any, experts: dict[str, Any]) -> None:
    """`check_mergekit_weights` of every model the merge reads as it is, before run merges: `validate` checks the local
    folders (in the same words, of the same models: `reads_other_weights`), run also the hub snapshots it resolved
    (Phi-4-mini is a hub id)."""
    from featcal_llm.io.model_files import read_config_json

    check_mergekit_weights(base.directory, read_config_json(base.directory), f"{recipe_path}: base_model")
    for source in experts.values():
        if reads_other_weights(source, base.directory):
            check_mergekit_weights(source.directory, read_config_json(source.directory), f"{recipe_path}: models")


def _config_value(config: dict, key: str) -> Any:
    value: Any = config
    for part in key.split("."):  # mergekit's get_config_value: `text_config.num_hidden_layers`
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _substitute(template: str, layers: int, index: int | None) -> str:
    if "{" not in template:
        return template
    values = {"num_layers": layers, "num_layers+1": layers + 1, "num_layers-1": layers - 1}
    if index is not None:
        values.update({"layer_index": index, "layer_index+1": index + 1, "layer_index-1": index - 1})
    return _Template(template).substitute(values)
