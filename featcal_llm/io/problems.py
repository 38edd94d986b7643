"""What is wrong with a recipe, one line per problem, naming the file and the key.

pydantic reports every field error of a block at once; these helpers turn each into
one line (`file: featcal.samples: ... (got 0)`), suggest the nearest known key for an
unknown one, and keep a check that raises `FeatCalError` from hiding the ones after it.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import BaseModel, ValidationError

from featcal_llm.errors import FeatCalError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe: the file, the dotted key (empty for the file as a whole) and what is expected."""

    file: str
    key: str
    message: str

    def __str__(self) -> str:
        return ": ".join(part for part in (self.file, self.key, self.message) if part)

    @classmethod
    def from_error(cls, file: Path | str, error: FeatCalError | str) -> "Problem":
        """A problem from a one-line `FeatCalError` text (`file: key: message` or any part of it)."""
        text, file = str(error), str(file)
        if text.startswith(file + ": "):
            text = text[len(file) + 2 :]
        key, separator, message = text.partition(": ")
        if not separator or " " in key.strip():
            return cls(file, "", text)
        return cls(file, key, message)


class RecipeProblems(FeatCalError):
    """Every problem of a recipe, one per line (the CLI prints each as its own error line)."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(problem) for problem in self.problems))


def suggestion(key: str, known: Iterable[str]) -> str:
    """`; did you mean 'x'?` for the closest known key, or nothing."""
    close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _model_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_class(argument) if typing.get_origin(argument) is None else None
        if found is not None:
            return found
    return None


def _container_item(annotation: Any) -> Any:
    """The value type of a dict (or item type of a list) inside `annotation`, for a location part that is a key or index."""
    for candidate in (annotation, *typing.get_args(annotation)):
        origin = typing.get_origin(candidate)
        if origin is dict:
            return typing.get_args(candidate)[1]
        if origin in (list, tuple):
            return typing.get_args(candidate)[0]
    return None


def _field(model: type[BaseModel], name: str) -> Any:
    for field_name, field in model.model_fields.items():
        if name in (field_name, field.alias):
            return field
    return None


def known_keys(model: type[BaseModel]) -> list[str]:
    """The keys a block accepts, as a recipe writes them (aliases such as `lambda`)."""
    return [field.alias or name for name, field in model.model_fields.items()]


def keys_at(root: type[BaseModel], location: tuple) -> list[str]:
    """The keys accepted where `location` (a pydantic error location, the unknown key last) points."""
    model = model_at(root, location)
    return known_keys(model) if model is not None else []


def model_at(root: type[BaseModel], location: tuple) -> type[BaseModel] | None:
    """The block (pydantic model) holding the last key of `location`, or None where it is not one."""
    current: Any = root
    for part in location[:-1]:
        current = _inside(current, part)
        if current is None:
            return None
    return _model_class(current)


def _inside(annotation: Any, part: Any) -> Any:
    """The annotation one location part deeper: a block's field, a mapping's value or a list's item; None where
    `part` leads nowhere the annotation knows."""
    model = _model_class(annotation)
    field = _field(model, part) if model is not None and isinstance(part, str) else None
    return field.annotation if field is not None else _container_item(annotation)


def _shown(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return _yaml_words(repr(value))
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _yaml_words(text: str) -> str:
    """Python's True, False and None as a recipe spells them (true, false, null)."""
    return re.sub(r"\b(True|False|None)\b", lambda found: {"True": "true", "False": "false", "None": "null"}[found.group()], text)


def _unannotated(annotation: Any) -> Any:
    """The type under `Annotated[...]` (PositiveInt is Annotated[int, Gt(0)])."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _members(annotation: Any) -> list[Any]:
    """The members of a union annotation besides None (Annotated and Optional unwrapped); [] for any other."""
    annotation = _unannotated(annotation)
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return []
    return [member for member in typing.get_args(annotation) if member is not type(None)]


def _union_at(root: type[BaseModel] | None, location: tuple) -> tuple[int, Any] | None:
    """(index, union annotation) where `location` reaches a key of several types and pydantic adds a member's tag
    (`batch_size.literal['auto']`, `weight.list[ConditionalParameter].0.value`); None where it does not."""
    current: Any = root
    for index, part in enumerate(location):
        members = _members(current)
        if len(members) > 1:
            return (index, current) if isinstance(part, str) else None
        current = _inside(current, part)
        if current is None:
            return None
    return None


def _described(annotation: Any) -> list[str]:
    """A union member in a recipe's words: `{value, filter}`, a list of them, a number, true or false, 'auto'."""
    annotation = _unannotated(annotation)
    members = _members(annotation)
    if members:
        return [words for member in members for words in _described(member)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ["{" + ", ".join(known_keys(annotation)) + "}"]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return [_yaml_words(repr(value)) for value in typing.get_args(annotation)]
    if origin in (list, tuple):
        item = typing.get_args(annotation)[0] if typing.get_args(annotation) else None
        inner = _described(item) if item is not None else []
        return [f"a list of {inner[0]}" if len(inner) == 1 else "a list of values"]
    return [{bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(annotation, getattr(annotation, "__name__", str(annotation)))]


def one_error_per_key(errors: list[dict], root: type[BaseModel] | None) -> list[dict]:
    """A union key's value that fits no member as one error: pydantic gives one per member (and per error inside a
    member), each tagged with the member's type. Two plain members' messages are joined (`Input should be a valid
    integer or 'auto'`); a wider union is described by its members (`{value, filter}, a list of {value, filter}, ...`)."""
    groups: dict[tuple, list[dict]] = {}
    order: list[Any] = []
    for item in errors:
        found = _union_at(root, tuple(item["loc"]))
        if found is None:
            order.append(item)
            continue
        key = tuple(item["loc"][: found[0]])
        if key not in groups:
            groups[key] = []
            order.append((key, found[1]))
        groups[key].append(item)
    merged = []
    for entry in order:
        if isinstance(entry, dict):
            merged.append(entry)
            continue
        key, annotation = entry
        items = groups[key]
        plain = all(len(item["loc"]) == len(key) + 1 for item in items)
        if plain and len(items) <= 2:
            wanted = [item["msg"].removeprefix("Value error, ").removeprefix("Input should be ").split(", ")[0] for item in items]
            message = "Input should be " + " or ".join(dict.fromkeys(wanted))
        else:
            kinds = list(dict.fromkeys(_described(annotation)))
            message = "expected " + (", ".join(kinds[:-1]) + " or " + kinds[-1] if len(kinds) > 1 else kinds[0])
            missing = [".".join(str(part) for part in item["loc"][len(key) + 1:]) for item in items if item["type"] == "missing"]
            if missing:  # the mapping form was meant, short of a key: say which
                message += "; " + ", ".join(dict.fromkeys(f"{where} is missing" for where in missing))
            fields = [item for item in items if len(item["loc"]) == len(key) + 2 and isinstance(item["loc"][-1], str)
                      and item["type"] != "missing"]
            if fields:  # the mapping form was meant, one of its keys wrong (`filter: 5`): name it, not its value alone
                wrong = fields[0]
                message += f"; {wrong['loc'][-1]}: {wrong['msg']} (got {_shown(wrong['input'])})"
        merged.append({**items[0], "loc": key, "type": "union", "msg": message})
    return merged


def _expected_block(item: dict, root: type[BaseModel] | None) -> str:
    """`Input should be a valid dictionary or instance of DataSpec` in a recipe's words: the keys the mapping takes
    (a model reference: the path or hub id a recipe writes)."""
    if (item.get("ctx") or {}).get("class_name") == "ModelReference":
        return "expected a model path or hub id (a string: path, or path+lora for an adapter)"
    model = model_at(root, (*item["loc"], "")) if root is not None else None
    return f"expected a mapping of {', '.join(known_keys(model))}" if model is not None else item["msg"]


def pydantic_problems(file: Path | str, error: ValidationError, prefix: str, root: type[BaseModel] | None) -> list[Problem]:
    """Every error of one `model_validate` call, one problem each (a union key's members' errors as one)."""
    problems = []
    for item in one_error_per_key(error.errors(), root):
        location = ".".join(str(part) for part in item["loc"])
        key = f"{prefix}.{location}" if prefix and location else (prefix or location)
        if item["type"] == "extra_forbidden":
            model = model_at(root, item["loc"]) if root is not None else None
            renamed = getattr(model, "renamed_keys", {}).get(item["loc"][-1]) if model is not None else None
            if renamed is not None:  # a key renamed since it was published: name the new one
                problems.append(Problem(str(file), key, f"was renamed: use {key.rpartition('.')[0] + '.' if '.' in key else ''}{renamed}"))
                continue
            hint = suggestion(item["loc"][-1], keys_at(root, item["loc"])) if root is not None else ""
            problems.append(Problem(str(file), key, f"unknown key{hint}"))
            continue
        if item["type"] == "missing":  # with what the key is for (featcal.merged: the folder of mergekit's merge)
            model = model_at(root, tuple(item["loc"])) if root is not None else None
            field = _field(model, item["loc"][-1]) if model is not None and isinstance(item["loc"][-1], str) else None
            about = f": {field.description}" if field is not None and field.description else ""
            problems.append(Problem(str(file), key, f"required key is missing{about}"))
            continue
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] in ("model_type", "dataclass_type"):  # pydantic names the class: say what a recipe writes
            message = _expected_block(item, root)
        if item["type"] == "literal_error":  # the choices, as YAML spells them: 'auto', true or false
            message = _yaml_words(message)
        if "got " not in message and "renamed" not in message and "input" in item and not isinstance(item["input"], dict):
            # (a whole block's check names what it is about: its mapping, shown, is noise)
            message += f" (got {_shown(item['input'])})"
        if item["type"] == "literal_error" and isinstance(item.get("input"), str):  # `format: txt`: did you mean 'text'?
            message += suggestion(item["input"], re.findall(r"'([^']*)'", str((item.get("ctx") or {}).get("expected", ""))))
        problems.append(Problem(str(file), key, message))
    return problems


def in_document_order(problems: list[Problem], block: dict, prefix: str) -> list[Problem]:
    """Problems of one block sorted as their keys appear in the file (pydantic lists unknown keys last)."""
    order: dict[str, int] = {}

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                order.setdefault(f"{where}.{key}", len(order))
                walk(item, f"{where}.{key}")

    walk(block, prefix)

    def position(problem: Problem) -> int:
        key = problem.key
        while key and key not in order:
            key = key.rpartition(".")[0]
        return order.get(key, len(order))

    return sorted(problems, key=position)


def collect(problems: list[Problem], file: Path | str, check: Callable[[], Any]) -> Any:
    """Run one check that raises `FeatCalError`; its error becomes a problem and the checks after it still run."""
    try:
        return check()
    except RecipeProblems as error:
        problems.extend(error.problems)
    except FeatCalError as error:
        problems.extend(Problem.from_error(file, line) for line in str(error).splitlines())
    return None
