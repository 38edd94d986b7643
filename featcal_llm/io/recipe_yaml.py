"""A recipe file's YAML as text: read (UTF-8, keys given twice found before YAML keeps the last), and one value
replaced without touching the comments and layout around it (the replay recipe a run saves)."""

from __future__ import annotations

from pathlib import Path

import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.io.problems import Problem


def yaml_reason(error: yaml.YAMLError) -> str:
    """Where and why: `at line 3, column 9: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence at line 1)`."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context:
        problem += f" ({context}{f' at line {context_mark.line + 1}' if context_mark and (not mark or context_mark.line != mark.line) else ''})"
    return f"{where}: {problem}"


def duplicate_keys(node: yaml.Node, where: str = "") -> list[tuple[str, int, int]]:
    """(dotted key, first line, repeated line) for each key a YAML mapping gives twice, at any depth."""
    found: list[tuple[str, int, int]] = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{where}.{key}" if where else str(key)
            if key == "<<":  # a YAML merge key: the keys it brings in may be given again here (YAML's override)
                continue
            if key is not None:
                if key in first:
                    found.append((dotted, first[key], key_node.start_mark.line + 1))
                else:
                    first[key] = key_node.start_mark.line + 1
            found += duplicate_keys(value_node, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found += duplicate_keys(item, f"{where}.{index}" if where else str(index))
    return found


def recipe_text(path: Path) -> str:
    """The recipe file's text: YAML files are UTF-8, and mergekit reads them so; another encoding is refused in one line."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise FeatCalError(f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} on line {line}); save the recipe "
                           "as UTF-8") from None


def read_yaml_mapping(path: Path, problems: list[Problem] | None = None) -> dict:
    """The recipe's mapping; a key given twice is appended to `problems` (YAML keeps the last one without a word)."""
    if not path.is_file():
        raise FeatCalError(f"{path}: recipe file not found")
    text = recipe_text(path)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        duplicates = duplicate_keys(node) if node is not None else []  # before construction flattens merge keys (`<<`) into the node
        raw = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as error:
        raise FeatCalError(f"{path}: not valid YAML{yaml_reason(error)}") from None
    finally:
        loader.dispose()
    for key, first, again in sorted(duplicates, key=lambda found: found[2]) if problems is not None else []:
        problems.append(Problem(str(path), key, f"given twice (lines {first} and {again}); YAML would keep the second silently: keep one"))
    if raw is None:
        raise FeatCalError(f"{path}: the recipe file is empty (expected a mergekit recipe with a featcal: block)")
    if not isinstance(raw, dict):
        raise FeatCalError(f"{path}: expected a YAML mapping (a mergekit recipe), got {'a list' if isinstance(raw, list) else 'a single value'}")
    return raw


def value_span(text: str, node: yaml.Node) -> tuple[int, int]:
    """Where a scalar's value stands in the text: after its anchor (`&name`) and tag (`!!str`), which a node's own
    span includes and which replacing the value must keep (an alias elsewhere names the anchor)."""
    start = node.start_mark.index
    while text[start] in "&!":
        while start < node.end_mark.index and not text[start].isspace():
            start += 1
        while start < node.end_mark.index and text[start].isspace():
            start += 1
    return start, node.end_mark.index


def with_output(text: str, output: str) -> str:
    """The recipe text with `featcal.output` set to `output` (`run RECIPE OUTPUT`), so the saved replay recipe writes
    where this run wrote. Only the value is replaced: comments and layout stay as the user wrote them."""
    return with_featcal_values(text, {"output": str(output)})


def with_featcal_values(text: str, values: dict[str, str]) -> str:
    """The recipe text with these `featcal:` keys set to these strings, comments and layout kept: a key written in the
    block has its value replaced, a missing one is written above the block's first key at its indentation. A block
    this cannot edit in place (flow style, a key written as an alias) is written out again, its comments lost."""
    node = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    block = next((value for key, value in node.value if key.value == "featcal"), None) if isinstance(node, yaml.MappingNode) else None
    if not isinstance(block, yaml.MappingNode) or not values:
        return text
    edits: dict[tuple[int, int], str] = {}
    missing, aliased = dict(values), False
    for key, current in block.value:
        if isinstance(key, yaml.ScalarNode) and key.value in missing:
            aliased |= not (isinstance(current, yaml.ScalarNode) and current.start_mark.index > key.end_mark.index)
            edits[value_span(text, current)] = _scalar(missing.pop(key.value))
    first = block.value[0][0] if block.value else None
    line_start = text.rfind("\n", 0, first.start_mark.index) + 1 if first is not None else 0
    in_place = not aliased and (not missing or (
        first is not None and not block.flow_style and text[line_start:first.start_mark.index].strip() == ""))
    if not in_place:
        raw = yaml.safe_load(text)
        raw["featcal"].update(values)
        return yaml.safe_dump(raw, sort_keys=False)
    if missing:
        indent = " " * first.start_mark.column
        edits[(line_start, line_start)] = "".join(f"{indent}{key}: {_scalar(value)}\n" for key, value in missing.items())
    for (start, end), value in sorted(edits.items(), reverse=True):
        text = text[:start] + value + text[end:]
    return text


def _scalar(value: str) -> str:
    """`value` as a YAML scalar that reads back as this string (quoted where it must be)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
