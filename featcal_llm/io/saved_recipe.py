"""`featcal_recipe.yml`: the recipe as it reruns the calibration (tuned values, resolved precisions and sampling pinned)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml

from featcal_llm.io.block import beside_recipe
from featcal_llm.io.recipe import Recipe, settings_of_text
from featcal_llm.io.recipe_yaml import value_span, with_featcal_values
from featcal_llm.io.run_settings import with_replay_line

REPLAY_HEADER = (
    "# Written by featcal-llm: the recipe as run, with the values its search chose per decoder layer\n"
    "# (featcal_tuning.json) and the precisions it resolved. Running it again replays them, without a search.\n"
)


def replay_text(recipe: Recipe, tuning: dict, precisions: dict[str, torch.dtype]) -> str:
    """The recipe with lambda/alpha/rho as {per_layer: winners}, the held-out share explicit and `auto` precisions pinned."""
    raw = yaml.safe_load(recipe.text)
    block = raw["featcal"]
    for key in tuning["chosen"]:
        block[key] = {"per_layer": list(tuning["chosen"][key])}
    block["tune"] = {**(block.get("tune") or {}), "holdout": tuning["search"]["holdout"]}
    block.update(pinned_precisions(block, precisions))
    return REPLAY_HEADER + yaml.safe_dump(raw, sort_keys=False)


def pinned_precisions(block: dict, precisions: dict[str, torch.dtype]) -> dict[str, str]:
    """The precision keys (`dtype`, `stats_dtype`) the `featcal:` block leaves `auto`, as this run resolved them: `auto`
    depends on the machine (a GPU, a CPU's bf16 units, a GPU's float64 rate), so a replay elsewhere would compute
    otherwise. Not the head's: its statistics are float64 whatever the layers' (stages/prepare.py)."""
    return {key: str(dtype).removeprefix("torch.") for key, dtype in precisions.items()
            if key != "head_stats_dtype" and block.get(key, "auto") == "auto"}


PINNED_SAMPLING = ("max_new_tokens", "temperature", "top_p", "min_p", "seed", "batch_size")  # what a default change could move
SAMPLING_HEADER = (
    "# Written by featcal-llm: the recipe as run, with the sampling settings each `generate:` expert used written out,\n"
    "# (and the start a measurement chose, as the chat_template that forces it), so that running it again draws the same\n"
    "# samples (and reuses them) whatever a later version's defaults are.\n"
)


MEASURED_STARTS = {"bos": "off", "chat": "on", "empty": "empty"}  # a measured start mode → the chat_template that forces it


def with_sampling_pinned(text: str, sampling: dict[str, dict[str, Any]], starts: dict[str, dict] | None = None) -> str:
    """The recipe text with each `generate:` expert's resolved sampling settings (`sampling`: name → settings) explicit,
    and the start `chat_template: auto` measured (`starts`: name → its record) as the chat_template that forces it."""
    if not sampling:
        return text
    raw = yaml.safe_load(text)
    for name, settings in sampling.items():
        # copies: a YAML anchor (`generate: *shared`) is one dict for every expert naming it, and each pins its own start
        spec = raw["featcal"]["data"][name] = dict(raw["featcal"]["data"][name])
        generate = spec["generate"] = dict(spec["generate"]) if isinstance(spec.get("generate"), dict) else {}  # `generate:` bare
        for key in PINNED_SAMPLING:
            generate.setdefault(key, settings[key])
        start = (starts or {}).get(name, {})
        if start.get("chosen_by") not in (None, "recipe") and start.get("mode") in MEASURED_STARTS and generate.get("chat_template", "auto") == "auto":
            generate["chat_template"] = MEASURED_STARTS[start["mode"]]
    if text.startswith(REPLAY_HEADER):  # a tuned run's replay: its header stays (loading the YAML drops comments)
        header = REPLAY_HEADER + "# The sampling settings of each `generate:` expert are written out as well.\n"
    else:
        header = SAMPLING_HEADER
    return header + yaml.safe_dump(raw, sort_keys=False)


def _input_files(block: yaml.MappingNode) -> list[tuple[yaml.ScalarNode, bool]]:
    """The `featcal:` block's scalars that name an input file a run finds beside the recipe too (data paths, prompts
    files, the eval block's suite file, data and nltk_data), each with whether `~` is expanded first (the eval block's)."""
    def get(node: Any, key: str) -> Any:
        if not isinstance(node, yaml.MappingNode):
            return None
        found = next((value for name, value in node.value if isinstance(name, yaml.ScalarNode) and name.value == key), None)
        for name, merged in node.value if found is None else ():  # `<<: *shared` (or a list of them): YAML's merge key
            if isinstance(name, yaml.ScalarNode) and name.value == "<<":
                for source in merged.value if isinstance(merged, yaml.SequenceNode) else [merged]:
                    found = found if found is not None else get(source, key)
        return found

    def values(node: Any) -> list[Any]:
        return [value for _, value in node.value] if isinstance(node, yaml.MappingNode) else []

    found: list[tuple[Any, bool]] = []
    for entry in values(get(block, "data")):
        found += [(get(entry, "path"), False), (get(get(entry, "generate"), "prompts"), False)]
    section = get(block, "eval")
    suite = get(section, "suite")
    if isinstance(suite, yaml.ScalarNode) and (suite.value.endswith((".yaml", ".yml")) or "/" in suite.value):
        found.append((suite, True))
    found += [(value, True) for value in values(get(section, "data"))] + [(get(section, "nltk_data"), True)]
    return [(node, expand) for node, expand in found if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":str")]


def with_found_paths(text: str, recipe_dir: Path) -> str:
    """The recipe text with each input file the run found beside the recipe (not from the current directory) written
    as it was found, so that the saved recipe, which lives in the output, replays from where this run ran. Only those
    values change: comments and layout stay."""
    node = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    block = next((value for key, value in node.value if key.value == "featcal"), None) if isinstance(node, yaml.MappingNode) else None
    edits = {}
    for scalar, expand in _input_files(block):
        given = str(Path(scalar.value).expanduser()) if expand else scalar.value
        found = beside_recipe(given, recipe_dir)
        if str(found) != given:
            value = yaml.safe_dump(str(found), default_flow_style=True).removesuffix("\n...\n").strip()
            edits[value_span(text, scalar)] = value  # an alias's (the anchor's) span once, the anchor kept
    for (start, end), value in sorted(edits.items(), reverse=True):
        text = text[:start] + value + text[end:]
    return text


def saved_recipe(recipe: Recipe, tuning: dict | None, precisions: dict[str, torch.dtype], sampling: dict[str, dict[str, Any]],
                 starts: dict[str, dict], refined: dict[str, Any] | None = None, data_fields: dict[str, dict[str, str]] | None = None) -> str:
    """The recipe as run: input files found beside the recipe written as found, the record fields data entries' defaults
    resolved to (`data_fields`: io/data_fields.py) written out, `auto` precisions pinned, a tuned run's
    choices replayed (replay_text), each `generate:` expert's sampling pinned, a comment naming where each began its samples, and
    `refine:`'s machine-dependent choices written out (`refined`: the stage's report), and a line naming the settings it
    replays (io/run_settings.with_replay_line)."""
    recipe = replace(recipe, text=with_data_fields(with_found_paths(recipe.text, recipe.path.parent), data_fields or {}))
    if tuning is None:  # the text as written, comments kept, with the precisions `auto` resolved written in
        saved = with_featcal_values(recipe.text, pinned_precisions(yaml.safe_load(recipe.text)["featcal"], precisions))
    else:
        saved = replay_text(recipe, tuning, precisions)
    saved = with_sampling_pinned(saved, sampling, starts)
    if starts:
        saved = saved.rstrip("\n") + "\n" + "".join(
            f"# generate: {name} began its samples from the {s['start']} (chosen by {s['chosen_by']})\n" for name, s in starts.items()
        )
    saved = with_refine_pinned(saved, refined)
    settings = settings_of_text(saved, recipe.path) if recipe.settings_root is not None else None
    return saved if settings is None else with_replay_line(saved, recipe.settings_root, settings)


DATA_FIELDS_HEADER = ("# Written by featcal-llm: the recipe as run, with the record fields each data entry's defaults read in\n"
                      "# its data written out, so that running it again reads the same fields.\n")


def with_data_fields(text: str, fields: dict[str, dict[str, str]]) -> str:
    """The recipe text with each data entry's keys its defaults resolved from the data (`fields`: expert → {key: field})
    written out; the YAML is written out again (comments dropped), as with_sampling_pinned writes it."""
    if not fields:
        return text
    raw = yaml.safe_load(text)
    for name, chosen in fields.items():  # copies: a YAML anchor may be one dict for several entries
        raw["featcal"]["data"][name] = {**raw["featcal"]["data"][name], **chosen}
    return DATA_FIELDS_HEADER + yaml.safe_dump(raw, sort_keys=False)


REFINE_NOTE = "# refine's automatic choices (params, precision) are written out, so that another machine refines alike.\n"


def with_refine_pinned(text: str, refined: dict[str, Any] | None) -> str:
    """The saved recipe with `refine:`'s `auto` choices that depend on the machine (params: its memory; precision: whether
    it computes bf16 natively, not on a float64 run, which refines in float64) written out as this run resolved them,
    so that a replay elsewhere refines alike.
    The comment lines before and after the YAML (the headers, the `generate:` starts) stay where they were; the YAML
    between them is written out again (its inline comments dropped), as a tuned run's replay is."""
    if refined is None:
        return text
    raw = yaml.safe_load(text)
    spec = raw["featcal"].get("refine")
    if spec is None or spec is False:
        return text
    spec = {} if spec is True else dict(spec)
    from featcal_llm.io.refine_card import refine_precision

    master, autocast = refine_precision(refined)
    resolved = {"params": refined["params"], "precision": "bfloat16" if autocast else "float32"}
    if master == "float64":  # a float64 run refines in float64 whatever precision says: nothing to pin
        del resolved["precision"]
    unset = {key: value for key, value in resolved.items() if spec.get(key, "auto") == "auto"}
    if not unset:
        return text
    if unset.get("params") == "full":  # a rank written beside params: auto applied to nothing, and refine: refuses it beside full
        spec.pop("rank", None)
    raw["featcal"]["refine"] = {**spec, **unset}
    lines = text.splitlines(keepends=True)
    comment = lambda line: line.startswith("#")  # noqa: E731
    head = next((i for i, line in enumerate(lines) if not comment(line)), len(lines))
    tail = next((i for i in range(len(lines), head, -1) if not comment(lines[i - 1])), head)
    header = "".join(lines[:head])
    if not header.startswith("# Written by featcal-llm"):
        header = "# Written by featcal-llm: the recipe as run.\n" + header
    return header + REFINE_NOTE + yaml.safe_dump(raw, sort_keys=False) + "".join(lines[tail:])
