"""The keyword arguments lm-eval's hf model accepts, read from the installed sources with `ast`.

lm-eval's `HFLM` takes some `engine_args` keys itself and hands the rest to `AutoModelForCausalLM.from_pretrained`:
transformers' loaders take some, the model's config takes every key it has as an attribute (it is set on the config),
and the model's constructor gets what is left, which a Llama refuses with a TypeError, after the calibration. Importing
transformers and lm-eval to ask costs seconds, so the names are read from their source files instead: `HFLM.__init__`
and `_create_model`, the auto class's and `PreTrainedModel`'s `from_pretrained` (their parameters and the keys they read
from **kwargs) with the keys the config's loader reads, and the config class the model's config.json names by `model_type` (its fields, attributes and settable
properties, with those of its bases down to `PreTrainedConfig`, `attribute_map`'s aliases and the config.json's own
keys but those the config's loader consumes: an old top-level `rope_theta`, the generation parameters). Where a source is missing or its layout is not the expected one, or no config.json can be read, nothing is
checked (the model's constructor still refuses the key when it loads).
"""

from __future__ import annotations

import ast
import difflib
from functools import lru_cache
import importlib.util
import json
from pathlib import Path

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation.vllm_arguments import keys_read, source_file

HFLM = ("lm_eval.models.huggingface", "HFLM")
# (module, class, method, the positional parameters its callers fill: cls and the model's path; None: only the keys it
# reads from **kwargs, as the config's loader, which the auto class calls with keywords of its own, takes the rest)
LOADERS = (("transformers.models.auto.auto_factory", "_BaseAutoModelClass", "from_pretrained", 2),
           ("transformers.modeling_utils", "PreTrainedModel", "from_pretrained", 2),
           ("transformers.configuration_utils", "PreTrainedConfig", "_get_config_dict", None))
SPECIAL_MODULES = "SPECIAL_MODEL_TYPE_TO_MODULE_NAME"  # in transformers/models/auto/: model type → its module, where they differ
CONFIG_BASE = "PreTrainedConfig"  # in transformers/configuration_utils.py: every model config's base
# where a config's loader consumes a config.json key instead of setting it on the config: (module, class, methods: the
# first the class defines; a dataclass config's extra keys reach __post_init__); and the generation parameters it
# drops, the keys of the dict this static method returns
CONSUMERS = (("transformers.configuration_utils", CONFIG_BASE, ("__post_init__", "__init__")),
             ("transformers.modeling_rope_utils", "RotaryEmbeddingConfigMixin", ("convert_rope_params_to_dict",)))
GENERATION_DEFAULTS = ("transformers.generation.configuration_utils", "GenerationConfig", "_get_default_generation_params")
WHAT = "lm-eval's hf model, transformers' from_pretrained or the model's config"


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    if tree is None:
        return None
    return next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None)


def _methods(found: ast.ClassDef, name: str) -> list[ast.FunctionDef]:
    return [item for item in found.body if isinstance(item, ast.FunctionDef) and item.name == name]


def _taken(function: ast.FunctionDef, filled: int) -> set[str]:
    """The keywords a function takes: its parameters but the first `filled` positional ones, and what it reads from
    its **kwargs."""
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args][filled:]
    names = {a.arg for a in [*positional, *arguments.kwonlyargs]}
    if arguments.kwarg is not None:
        names |= keys_read(function, arguments.kwarg.arg)
    return names


@lru_cache(maxsize=1)
def hf_loader_names() -> tuple[frozenset[str], frozenset[str]] | None:
    """The keys lm-eval's HFLM and transformers' from_pretrained take, and those HFLM.__init__ passes `_create_model`
    itself, which a key of engine_args would repeat; None where a source cannot be read."""
    path = source_file(HFLM[0])
    found = _class(_tree(path), HFLM[1]) if path is not None else None
    if found is None:
        return None
    inits, creates = _methods(found, "__init__"), _methods(found, "_create_model")
    if len(inits) != 1 or len(creates) != 1:
        return None
    own = _taken(inits[0], 1)
    calls = [node for node in ast.walk(inits[0]) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "_create_model"]
    if len(calls) != 1:
        return None
    repeated = {keyword.arg for keyword in calls[0].keywords if keyword.arg is not None} - own
    names = own | _taken(creates[0], 1)
    for module, name, method, filled in LOADERS:
        path = source_file(module)
        found = _class(_tree(path), name) if path is not None else None
        loads = _methods(found, method) if found is not None else []
        if len(loads) != 1 or (filled is None and loads[0].args.kwarg is None):
            return None
        names |= _taken(loads[0], filled) if filled is not None else keys_read(loads[0], loads[0].args.kwarg.arg)
    return frozenset(names - repeated), frozenset(repeated)


@lru_cache(maxsize=1)
def consumed_config_keys() -> frozenset[str]:
    """The config.json keys a config's loader takes out instead of keeping as attributes: an old config's top-level
    `rope_theta` or `rope_scaling` (moved into `rope_parameters`), `torch_dtype`, the generation parameters. Such a key
    in the model's config.json is no attribute to set, so given in engine_args it reaches the model's constructor and
    fails there. Empty where a source cannot be read (every config.json key is then taken, as before)."""
    keys: set[str] = set()
    for module, name, methods in CONSUMERS:
        path = source_file(module)
        found = _class(_tree(path), name) if path is not None else None
        functions = next((each for each in (_methods(found, method) for method in methods) if each), []) if found is not None else []
        if len(functions) != 1 or functions[0].args.kwarg is None:
            return frozenset()
        keys |= keys_read(functions[0], functions[0].args.kwarg.arg)
    path = source_file(GENERATION_DEFAULTS[0])
    found = _class(_tree(path), GENERATION_DEFAULTS[1]) if path is not None else None
    functions = _methods(found, GENERATION_DEFAULTS[2]) if found is not None else []
    returned = [node.value for node in ast.walk(functions[0]) if isinstance(node, ast.Return)] if len(functions) == 1 else []
    if len(returned) != 1 or not isinstance(returned[0], ast.Dict):
        return frozenset()
    keys |= {key.value for key in returned[0].keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
    return frozenset(keys)


def _imported(name: str, path: Path, tree: ast.Module, depth: int = 0) -> tuple[ast.ClassDef, Path] | None:
    """The class `name` means in the file: defined there, or imported from a module of the same package."""
    found = _class(tree, name)
    if found is not None:
        return found, path
    if depth > 3:
        return None
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        alias = next((alias for alias in node.names if (alias.asname or alias.name) == name), None)
        if alias is None:
            continue
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        parts = node.module.split(".") if node.module else []
        for candidate in (base.joinpath(*parts[:-1], f"{parts[-1]}.py") if parts else None, base.joinpath(*parts, "__init__.py")):
            if candidate is not None and candidate.is_file():
                other = _tree(candidate)
                return None if other is None else _imported(alias.name, candidate, other, depth + 1)
    return None


def _attributes(found: ast.ClassDef) -> set[str]:
    """What a config object of the class has that can be set: its fields and class attributes, the properties it
    gives a setter, what its methods assign to self, and attribute_map's aliases."""
    names = set()
    for item in found.body:
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name):
                names.add(target.id)
                if target.id == "attribute_map" and isinstance(item.value, ast.Dict):
                    names |= {key.value for key in item.value.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
        if isinstance(item, ast.FunctionDef):
            names |= {decorator.value.id for decorator in item.decorator_list if isinstance(decorator, ast.Attribute)
                      and decorator.attr == "setter" and isinstance(decorator.value, ast.Name)}
    for node in ast.walk(found):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for each in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(each, ast.Attribute) and isinstance(each.value, ast.Name) and each.value.id == "self":
                    names.add(each.attr)
    return names


def _transformers_models() -> Path | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), "models")


def _string_pairs(node: ast.expr) -> dict[str, str]:
    """A literal {"a": "b"} or [("a", "b"), ...] of strings (an OrderedDict's argument), as a dict."""
    if isinstance(node, ast.Dict):
        pairs = zip(node.keys, node.values)
    elif isinstance(node, (ast.List, ast.Tuple)):
        pairs = (item.elts for item in node.elts if isinstance(item, ast.Tuple) and len(item.elts) == 2)
    else:
        return {}
    return {key.value: value.value for key, value in pairs if isinstance(key, ast.Constant) and isinstance(value, ast.Constant)
            and isinstance(key.value, str) and isinstance(value.value, str)}


@lru_cache(maxsize=1)
def _special_modules() -> dict[str, str]:
    """transformers' model types whose module is not named after them (gemma3_text → gemma3): its
    SPECIAL_MODEL_TYPE_TO_MODULE_NAME, as assigned in auto/auto_mappings.py and updated in auto/configuration_auto.py,
    read without importing transformers (what its model_type_to_module_name looks up)."""
    models = _transformers_models()
    found: dict[str, str] = {}
    for name in ("auto_mappings.py", "configuration_auto.py"):
        tree = _tree(models / "auto" / name) if models is not None else None
        for node in ast.walk(tree) if tree is not None else ():
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == SPECIAL_MODULES for t in node.targets)
                    and isinstance(node.value, ast.Call) and node.value.args):
                found.update(_string_pairs(node.value.args[0]))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == SPECIAL_MODULES and node.args):
                found.update(_string_pairs(node.args[0]))
    return found


def _module(model_type: str) -> str:
    """The folder under transformers/models/ that holds this model type's config and model classes."""
    return _special_modules().get(model_type) or model_type.replace("-", "_")


@lru_cache(maxsize=16)
def config_attribute_names(model_type: str) -> frozenset[str] | None:
    """Every attribute transformers sets on the config of this model type from a from_pretrained keyword; None where
    the config class cannot be read (a model type of remote code, another layout)."""
    models = _transformers_models()
    if models is None:
        return None
    module = _module(model_type)
    path = models / module / f"configuration_{module}.py"
    tree = _tree(path) if path.is_file() else None
    if tree is None:
        return None
    found = next((node for node in tree.body if isinstance(node, ast.ClassDef) and any(
        isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "model_type" for t in item.targets)
        and isinstance(item.value, ast.Constant) and item.value.value == model_type for item in node.body)), None)
    if found is None:
        return None
    names, pending, seen, based = set(), [(found, path, tree)], set(), False
    while pending:
        found, path, tree = pending.pop()
        if (path, found.name) in seen:
            continue
        seen.add((path, found.name))
        names |= _attributes(found)
        based = based or (found.name == CONFIG_BASE and path.name == "configuration_utils.py")
        for base in found.bases:
            resolved = _imported(base.id, path, tree) if isinstance(base, ast.Name) else None
            if resolved is not None:
                pending.append((*resolved, _tree(resolved[1])))
    return frozenset(names) if based else None


@lru_cache(maxsize=16)
def _model_init_names(model_type: str, architecture: str) -> frozenset[str]:
    """The keywords the model class's own constructor takes beside its config (none for a Llama)."""
    models = _transformers_models()
    module = _module(model_type)
    path = None if models is None else models / module / f"modeling_{module}.py"
    found = _class(_tree(path), architecture) if path is not None and path.is_file() else None
    inits = _methods(found, "__init__") if found is not None else []
    return frozenset(_taken(inits[0], 2)) if len(inits) == 1 else frozenset()


def read_model_config(directory: Path | str | None) -> dict | None:
    """The directory's config.json as a dict; None where there is none to read."""
    if directory is None:
        return None
    try:
        config = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def check_hf_engine_args(engine_args: dict, origin: str, config: dict | None) -> None:
    """A key neither lm-eval's HFLM, transformers' from_pretrained nor the model's config (`config`: its config.json)
    takes is refused now, in one line, with the nearest one that is taken; a key HFLM passes its loader itself too."""
    if not engine_args or not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return
    loader = hf_loader_names()
    attributes = config_attribute_names(config["model_type"])
    if loader is None or attributes is None:
        return
    taken, repeated = loader
    architectures = config.get("architectures") or []
    constructors = {name for architecture in architectures if isinstance(architecture, str)
                    for name in _model_init_names(config["model_type"], architecture)}
    own = {key for key in config if isinstance(key, str)} - consumed_config_keys()  # kept as attributes on loading
    known = taken | attributes | constructors | own
    for key in sorted(engine_args):
        if key in repeated:
            raise FeatCalError(f"{origin}.{key}: lm-eval's hf model passes {key} to its loader itself; it cannot be "
                               "given in engine_args")
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise FeatCalError(f"{origin}.{key}: not an argument of {WHAT}{hint}")
