"""The keyword arguments lm-eval's vllm model accepts, read from the installed sources with `ast`.

lm-eval hands every `engine_args` key it does not take itself to `vllm.LLM`, which hands the rest to `EngineArgs`: a
misspelt key fails only when vLLM builds the engine, after the calibration. Importing vLLM to ask costs seconds and a
CUDA probe, so the names are read from the three source files instead; where one is missing or its layout is not the
expected one, nothing is checked (the engine still refuses the key when it starts).
"""

from __future__ import annotations

import ast
import difflib
from functools import lru_cache
import importlib.util
from pathlib import Path

from featcal_llm.errors import FeatCalError

# (module, class, what the names are: a constructor's parameters, or a dataclass's fields)
SOURCES = (("lm_eval.models.vllm_causallms", "VLLM", "parameters"), ("vllm.entrypoints.llm", "LLM", "parameters"),
           ("vllm.engine.arg_utils", "EngineArgs", "fields"))


def source_file(module: str) -> Path | None:
    """The module's file, found without importing its package (find_spec of a submodule imports the parents)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *rest[:-1], f"{rest[-1]}.py")
    return path if path.is_file() else None


def _class_names(path: Path, name: str, kind: str) -> set[str] | None:
    """The class's constructor parameters, plus the keys its constructor pops from **kwargs; or its annotated fields."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None)
    if found is None:
        return None
    if kind == "fields":
        names = {item.target.id for item in found.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
        return names or None
    inits = [item for item in found.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"]
    if not inits:
        return None
    names: set[str] = set()
    for init in inits:  # every definition (an @overload'ed constructor has several): a key any of them takes
        arguments = init.args
        names |= {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs] if a.arg != "self"}
        if arguments.kwarg is not None:
            names |= keys_read(init, arguments.kwarg.arg)
    return names


def _strings(node: ast.AST) -> set[str] | None:
    """The strings of a literal list, tuple or set of strings; None for anything else."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and node.elts and all(
            isinstance(item, ast.Constant) and isinstance(item.value, str) for item in node.elts):
        return {item.value for item in node.elts}
    return None


def _loop_names(function: ast.FunctionDef) -> dict[str, set[str]]:
    """Names a function binds to each string of a literal list in turn: `for name in ["a", "b"]`, and a comprehension
    over a name it assigned such a list (`names = [...]; {n: kwargs.pop(n) for n in names}`)."""
    lists: dict[str, set[str]] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            strings = _strings(node.value)
            if strings is not None:
                lists.setdefault(node.targets[0].id, set()).update(strings)
    bound: dict[str, set[str]] = {}
    for node in ast.walk(function):
        comprehension = isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp))
        loops = [node] if isinstance(node, ast.For) else node.generators if comprehension else []
        for loop in loops:
            if isinstance(loop.target, ast.Name):
                strings = _strings(loop.iter) or (lists.get(loop.iter.id) if isinstance(loop.iter, ast.Name) else None)
                if strings:
                    bound.setdefault(loop.target.id, set()).update(strings)
    return bound


def keys_read(function: ast.FunctionDef, kwargs: str) -> set[str]:
    """The string keys a constructor reads from its **kwargs itself: `kwargs.pop/get("k")`, `kwargs["k"]` (also in a
    `del`) and `"k" in kwargs`, the key also a name bound to each string of a literal list (`for k in ["a", "b"]:
    kwargs.pop(k)`); a key it handles there is one it takes, whatever it passes on."""
    bound = _loop_names(function)

    def is_kwargs(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == kwargs

    def texts(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        return bound.get(node.id, set()) if isinstance(node, ast.Name) else set()

    keys: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_kwargs(node.func.value) \
                and node.func.attr in ("pop", "get", "setdefault") and node.args:
            keys |= texts(node.args[0])
        elif isinstance(node, ast.Subscript) and is_kwargs(node.value):
            keys |= texts(node.slice)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and is_kwargs(node.comparators[0]):
            keys |= texts(node.left)
    return keys


@lru_cache(maxsize=1)
def vllm_argument_names() -> frozenset[str] | None:
    """Every key lm-eval's vllm model, `vllm.LLM` or `EngineArgs` takes; None where a source cannot be read."""
    names: set[str] = set()
    for module, name, kind in SOURCES:
        path = source_file(module)
        read = None if path is None else _class_names(path, name, kind)
        if read is None:
            return None
        names |= read
    return frozenset(names)


def check_vllm_engine_args(engine_args: dict, origin: str) -> None:
    """A key none of the three takes is refused now, in one line, with the nearest one it does take."""
    known = vllm_argument_names()
    if known is None:
        return
    for key in sorted(engine_args):
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise FeatCalError(f"{origin}.{key}: not an argument of lm-eval's vllm model, vllm.LLM or vllm's "
                               f"EngineArgs{hint}")
