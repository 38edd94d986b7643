"""The calibrated checkpoint's model card and saved recipe.

The card is written to be published: models given by local paths appear by
their short names (the shortest trailing part of the path that tells them
apart), hub ids as they are; the saved recipe (`featcal_recipe.yml`) keeps the
paths, since it is what reruns the calibration.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import yaml

from featcal_llm import __version__
from featcal_llm.io.recipe import Recipe

RECIPE_FILE = "featcal_recipe.yml"
SYMBOLS = {"lambda": "λ", "alpha": "α", "rho": "ρ", "reduction": "r", "eps": "eps"}
METHOD_TEXT = {
    "featcal": "FeatCal feature calibration\n(Gu et al., 2026)",
    "regmean": "RegMean\n(Jin et al., 2023; MergeBench's definition, each expert's Grams on its own inputs)",
    "regmean++": "RegMean++\n(Nguyen et al., 2025; MergeBench's definition, Grams on the inputs propagated through the layers already solved)",
}
HOW_TEXT = {
    "featcal": "by a closed-form ridge regression so that the merged model's features match each expert's\n"
               "on its calibration data, while staying close to the anchor ρ·W_merged + (1 − ρ)·W_base.",
    "regmean": "as W* = (Σ_i W_i G̃_i)(Σ_i G̃_i)⁻¹ with G̃ = r·G + (1 − r)·diag(G); biases, norms, embeddings\n"
               "and lm_head are the merged model's.",
}


EVAL_HEADING = "## Evaluation"


def is_local(reference: str) -> bool:
    """Whether a model reference (or one part of `model+adapter`) is a local path rather than a hub id."""
    part = reference.split("@")[0]
    return os.path.isabs(part) or part.startswith(("./", "../", "~", ".\\")) or part in (".", "..") or Path(part).exists()


def public_names(references: list[str]) -> dict[str, str]:
    """Each reference as a card shows it: hub ids unchanged, local paths (also as `base+adapter` parts) by short name."""
    from featcal_llm.io.names import short_names

    parts = {part for reference in references for part in reference.split("+") if is_local(part)}
    short = short_names(sorted(parts))
    return {reference: "+".join(short.get(part, part) for part in reference.split("+")) for reference in references}


def _public_recipe(text: str, names: dict[str, str]) -> str:
    """The recipe's YAML with every local path (a string holding a path separator that exists or is absolute) shortened."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {walk(key): walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, str) and node in names:
            return names[node]
        if isinstance(node, str) and ("/" in node or os.sep in node) and is_local(node):
            return Path(node.split("+")[0]).name + ("+" + Path(node.split("+", 1)[1]).name if "+" in node else "")
        return node

    return yaml.safe_dump(walk(yaml.safe_load(text)), sort_keys=False)


def _calibrated_text(calibrated: dict | None, regmean: bool) -> str:
    if calibrated is None or calibrated["every_projection"]:
        what = "every linear projection of every decoder layer was re-fitted"
    else:
        listed = ", ".join(f"`{name}`" for name in calibrated["projections"])
        what = f"the projections {listed} of every decoder layer were re-fitted (the other projections keep the merged weights)"
    if calibrated is not None and not regmean:
        extras = [name for name, on in (("RMSNorm scales", calibrated["norms"]), ("biases", calibrated["biases"])) if on]
        what += f"; also updated: {', '.join(extras)}" if extras else "; norms and biases keep the merged values"
        head = calibrated.get("head")
        if head is not None:
            what += ("; after the last layer the LM head was re-fitted the same way on the final norm's outputs"
                     + (" (it was tied to the input embeddings and is now a tensor of its own, config `tie_word_embeddings: false`)"
                        if head["untied"] else ""))
    return what


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
    for key, dtype in precisions.items():
        if block.get(key, "auto") == "auto":
            block[key] = str(dtype).removeprefix("torch.")
    return REPLAY_HEADER + yaml.safe_dump(raw, sort_keys=False)


PINNED_SAMPLING = ("max_new_tokens", "temperature", "top_p", "min_p", "seed", "batch_size")  # what a default change could move
SAMPLING_HEADER = (
    "# Written by featcal-llm: the recipe as run, with the sampling settings each `generate:` expert used written out,\n"
    "# so that running it again draws the same samples (and reuses them) whatever a later version's defaults are.\n"
)


def with_sampling_pinned(text: str, sampling: dict[str, dict[str, Any]]) -> str:
    """The recipe text with each `generate:` expert's resolved sampling settings (`sampling`: name → settings) explicit."""
    if not sampling:
        return text
    raw = yaml.safe_load(text)
    for name, settings in sampling.items():
        spec = raw["featcal"]["data"][name]
        if not isinstance(spec.get("generate"), dict):  # `generate:` written bare
            spec["generate"] = {}
        generate = spec["generate"]
        for key in PINNED_SAMPLING:
            generate.setdefault(key, settings[key])
    if text.startswith(REPLAY_HEADER):  # a tuned run's replay: its header stays (loading the YAML drops comments)
        header = REPLAY_HEADER + "# The sampling settings of each `generate:` expert are written out as well.\n"
    else:
        header = SAMPLING_HEADER
    return header + yaml.safe_dump(raw, sort_keys=False)


def write_card(
    directory: Path, recipe: Recipe, merged: str, tokens: dict[str, int], tuning: dict | None = None,
    precisions: dict[str, torch.dtype] | None = None, sources: dict[str, Any] | None = None, calibrated: dict | None = None,
    starts: dict[str, dict] | None = None, weights: dict[str, float] | None = None, coverage: dict | None = None,
    sampling: dict[str, dict[str, Any]] | None = None, advantage: dict[str, dict[str, float]] | None = None,
) -> None:
    """README.md with hub-style YAML front matter, plus the recipe beside it.

    `sources` (base_model / expert name → io.references.ModelSource) records every model as read:
    its reference, hub revision and LoRA adapter. `calibrated`: the projections re-fitted
    (`projections`, `every_projection`) and whether norms and biases were (`norms`, `biases`).
    `starts`: how each `generate:` expert began its samples (generation.run.start_records).
    `weights`: each expert's weight in the objective as the run used it; `coverage`: the
    NLLs the coverage weights came from (engine.coverage.expert_weights). `sampling`: each `generate:`
    expert's resolved sampling settings (generation.run.settings_of), written out in the saved recipe.
    `advantage`: per expert, the share of its tokens where it predicts the next token better than the
    merge and its mean advantage in nats (engine.token_weights), when tokens were weighed by it.

    For a tuned run (`tuning`: featcal_tuning.json's payload) the hyper-parameters are the
    per-layer chosen lists, and the saved recipe replays them (`replay_text`; `precisions`:
    the run's resolved `dtype` and `stats_dtype`).
    """
    featcal = recipe.featcal
    saved = recipe.text
    if tuning is None:
        given = featcal.model_dump(mode="json", by_alias=True)
        hyper = {key: value if given.get(key) is None else given[key] for key, value in featcal.hyper_values().items()} | {"eps": featcal.eps}
        values = ", ".join(f"{SYMBOLS[key]} = {value}" for key, value in hyper.items())
    else:
        search = tuning["search"]
        hyper = {**tuning["chosen"], "eps": featcal.eps,
                 "tuning": {k: search[k] for k in ("criterion", "holdout", "budget")} | {"most_common": tuning["most_common"]}}
        common = tuning["most_common"]
        values = (
            f"Chosen per layer by featcal-llm on held-out calibration records ({search['criterion']} criterion, "
            f"holdout {search['holdout']:g}; every candidate's score is in `featcal_tuning.json`):\n\n"
            + "\n".join(f"- {SYMBOLS[key]}: {chosen}" for key, chosen in tuning["chosen"].items())
            + "\n\nMost common: " + ", ".join(f"{SYMBOLS[key]} = {value:g}" for key, value in common.items()) + f"; eps = {featcal.eps}"
        )
        saved = replay_text(recipe, tuning, precisions or {})
    saved = with_sampling_pinned(saved, sampling or {})
    starts = starts or {}
    if starts:
        saved = saved.rstrip("\n") + "\n" + "".join(
            f"# generate: {name} began its samples from the {s['start']} (chosen by {s['chosen_by']})\n" for name, s in starts.items()
        )
    base = str(recipe.base)
    names = public_names([base, merged, *(expert.name for expert in recipe.experts)])
    models = {}
    for role, source in (sources or {}).items():
        record = source.describe()
        record["reference"] = public_names([record["reference"]])[record["reference"]]
        if "lora_adapter" in record:
            record["lora_adapter"] = public_names([record["lora_adapter"]])[record["lora_adapter"]]
        models[names.get(role, role)] = record
    settings = {key: getattr(featcal, key) for key in ("samples", "max_length", "shuffle", "seed")}
    settings["merge_seed"] = featcal.merge_seed  # the seed a random merge (dare_*, della) was drawn with
    settings["balance"] = featcal.balancing
    settings |= {key: str(value).removeprefix("torch.") for key, value in (precisions or {}).items()}
    if calibrated is not None:
        settings["projections"] = "all" if calibrated["every_projection"] else list(calibrated["projections"])
        if not featcal.regmean:
            settings |= {"token_weights": featcal.token_weighting, "norms": calibrated["norms"], "biases": calibrated["biases"]}
            if calibrated.get("head") is not None:
                settings["head"] = calibrated["head"]
    front = {
        **({} if is_local(base) else {"base_model": base}),
        "tags": ["merge", "mergekit", "featcal"],
        "library_name": "transformers",
        "featcal": {
            "base_model": names[base],
            "merged_model": names[merged],
            "merge_method": recipe.merge_config.merge_method,
            "method": featcal.method,
            "experts": [names[expert.name] for expert in recipe.experts],
            "hyperparameters": hyper,
            "settings": settings,
            "calibration_tokens": {names[name]: count for name, count in tokens.items()},
            **({"generation_starts": {names.get(name, name): start for name, start in starts.items()}} if starts else {}),
            **({"models": models} if models else {}),
            "featcal_llm_version": __version__,
        },
    }
    if weights is None:  # the recipe's own
        weights = {e.name: featcal.data[e.name].weight for e in recipe.experts if e.name in featcal.data}
    weights = {name: round(weight, 4) for name, weight in weights.items()}
    weighed = any(weight != 1 for weight in weights.values())
    if weighed:
        front["featcal"]["expert_weights"] = {names[name]: weight for name, weight in weights.items()}
    if coverage is not None:  # model (the base under "base") → whose records → NLL: what the coverage weights came from
        front["featcal"]["coverage_nll"] = {names.get(model, model): {names[task]: nll for task, nll in row.items()}
                                            for model, row in coverage.items()}
    if advantage is not None:  # expert → where it is ahead of the merge: what its tokens' weights came from
        front["featcal"]["token_advantage"] = {names[task]: summary for task, summary in advantage.items()}
    given = {e.name for e in recipe.experts if e.name in featcal.data and "weight" in featcal.data[e.name].model_fields_set}
    how = lambda name: "" if not weighed else f", weight {weights[name]:g}" + ("" if name in given or featcal.balancing == "equal" else " (coverage)")  # noqa: E731
    experts = "\n".join(
        f"- `{names[e.name]}`: {tokens[e.name]} calibration tokens" + how(e.name)
        + (f", written by the expert from the {starts[e.name]['start']} (chosen by {starts[e.name]['chosen_by']})" if e.name in starts else "")
        for e in recipe.experts
    )
    setting_lines = "\n".join(f"- {key}: {value}" for key, value in settings.items())
    body = f"""# {"FeatCal-calibrated merge" if featcal.method == "featcal" else featcal.method + " merge"}

This model is `{names[merged]}` (a `{recipe.merge_config.merge_method}` merge of the experts below onto
`{names[base]}`, made with [mergekit](https://github.com/arcee-ai/mergekit)) after {METHOD_TEXT[featcal.method]} with featcal-llm {__version__}: {_calibrated_text(calibrated, featcal.regmean)},
in forward order, {HOW_TEXT["featcal" if featcal.method == "featcal" else "regmean"]}

## Experts
{experts}

## Hyper-parameters
{values}

## Settings
{setting_lines}

Per-layer feature drift of the merged and the calibrated model to each expert: `featcal_drift.json`, `featcal_drift.png`.

## Recipe
The full recipe (mergekit configuration plus the `featcal:` block) is saved as `{RECIPE_FILE}`; here with local
paths shortened to their names:

```yaml
{_public_recipe(recipe.text, names).rstrip()}
```
"""
    text = "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n" + body
    (directory / "README.md").write_text(text, encoding="utf-8")
    (directory / RECIPE_FILE).write_text(saved, encoding="utf-8")


def append_evaluation(directory: Path, table: str) -> None:
    """Add the merged-vs-calibrated evaluation table (a run's `eval:` block) to the card, before the recipe."""
    card = directory / "README.md"
    text = card.read_text(encoding="utf-8")
    section = f"{EVAL_HEADING}\nThe merged and the calibrated model scored with one pipeline (featcal-llm `eval:`):\n\n{table.rstrip()}\n\n"
    head, marker, tail = text.partition("## Recipe")
    card.write_text(head + section + marker + tail if marker else text.rstrip() + "\n\n" + section, encoding="utf-8")
