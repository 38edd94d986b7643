"""The calibrated checkpoint's model card (its run record: run_record.py; its saved recipe: saved_recipe.py; the
`refine:` section: refine_card.py; the evaluation section and the Hub repository's usage line, added later: card_edits.py).

The card is written to be published: its front matter holds what the Hub reads
(card_meta.py), its body says in words what was done; models given by local
paths appear by their short names (the shortest trailing part of the path that
tells them apart), hub ids as they are. What the run resolved, at full
precision, goes to `featcal_weights.json` beside it. The saved recipe
(`featcal_recipe.yml`) keeps the paths, since it is what reruns the calibration.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import yaml

from featcal_llm import __version__
from featcal_llm.io.card_edits import USAGE_ID
from featcal_llm.io.card_meta import CITATION, PAPER_URL, hub_front_matter, rounded
from featcal_llm.io.card_settings import SYMBOLS, adapter_trained, human, settings_lines
from featcal_llm.io.names import is_local, public_names
from featcal_llm.io.recipe import Recipe
from featcal_llm.io.run_record import WEIGHTS_FILE, run_record, write_run_record
from featcal_llm.io.output_dir import RECIPE_FILE
from featcal_llm.io.saved_recipe import saved_recipe

METHOD_TEXT = {
    "featcal": "FeatCal feature calibration (Gu et al., 2026)",
    "regmean": "RegMean (Jin et al., 2023; MergeBench's definition: each expert's Grams on its own inputs)",
    "regmean++": "RegMean++ (Nguyen et al., 2025; MergeBench's definition: Grams on the inputs propagated through the layers already solved)",
}
HOW_TEXT = {
    "featcal": "Each re-fitted weight is the closed-form ridge regression that makes the merged model's features match each "
               "expert's on that expert's calibration data, while staying close to the anchor ρ·W_merged + (1 − ρ)·W_base.",
    "regmean": "Each re-fitted weight is W* = (Σ_i W_i G̃_i)(Σ_i G̃_i)⁻¹ with G̃ = r·G + (1 − r)·diag(G), over the experts' "
               "Grams G_i of their calibration inputs; {rest} are the merged model's.",
}


def _where_generated_again(featcal: Any) -> str:
    """The condition a replay of generated records needs: its backend resolved as this run's (auto: vLLM on a GPU with
    vLLM, else transformers), as the two draw other samples from one seed."""
    if not any(spec.generate is not None for spec in featcal.data.values()):
        return ""
    return (" on a machine where each `generate:` expert's `backend` resolves as it did here (transformers and vLLM draw "
            "other samples from one seed)")


def _public_recipe(text: str, names: dict[str, str], output: str = "") -> str:
    """The recipe's YAML with every local path (a string holding a path separator that exists or is absolute, and the
    output, not written yet) shortened."""
    def walk(node: Any) -> Any:
        if isinstance(node, str) and output and node == output:
            return Path(node).name
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


def has_biases(directory: Path) -> bool:
    """Whether the checkpoint in `directory` has any bias tensor (Qwen2's q/k/v do; Llama's projections do not)."""
    import json

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}))
    else:
        from safetensors import safe_open

        names = []
        for shard in sorted(directory.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as handle:
                names.extend(handle.keys())
    return any(name.endswith(".bias") for name in names)


def _calibrated_text(calibrated: dict | None, regmean: bool, biases: bool, refined: dict | None = None) -> str:
    """What was re-fitted, in plain sentences; biases are named only for a model that has them. After a refinement
    that changed the weights, the sentences are the closed form's, and a last one says what the refinement trained."""
    if calibrated is not None and calibrated.get("unchanged"):
        head = _head_sentences(calibrated)
        return " ".join(["Every expert predicts its own calibration records worse than the merged model (`trailing_experts: merge`), "
                         "so there was nothing to calibrate toward: no weight was re-fitted, and this model is the merged model, unchanged"
                         + (", but for its LM head, as below." if head else "."), *head])
    if calibrated is None or calibrated["every_projection"]:
        sentences = ["Every linear projection of every decoder layer was re-fitted."]
    else:
        listed = ", ".join(f"`{name}`" for name in calibrated["projections"])
        sentences = [f"In every decoder layer the projections {listed} were re-fitted; the other projections keep the merged model's weights."]
    if calibrated is not None and not regmean:
        sentences.append("The RMSNorm scales were updated too." if calibrated["norms"] else "The norms keep the merged model's scales.")
        if biases:
            sentences.append("The projections' biases were updated with their weights." if calibrated["biases"]
                             else "The projections' biases keep the merged model's values.")
        head, own_heads = calibrated.get("head"), calibrated.get("own_heads")
        why = "" if not own_heads else f" (`head: auto`: {_listed(own_heads)} changed {'its' if len(own_heads) == 1 else 'their'} LM head from the base's)"
        if head is not None:
            sentences.append("After the last layer, the LM head was re-fitted the same way on the final norm's outputs" + why
                             + (": it was tied to the input embeddings and is now a tensor of its own, config `tie_word_embeddings: false`."
                                if head["untied"] else "."))
        elif own_heads is not None:
            sentences.append("The LM head keeps the merged model's weights (`head: auto`: every expert kept the base's).")
        if calibrated.get("untied_by_refine"):
            sentences.append("The refinement trained the LM head apart from the input embeddings: it is a tensor of its own, "
                             "config `tie_word_embeddings: false`.")
        sentences.extend(_head_sentences(calibrated))
    if refined is not None and refined.get("chosen_step", 0) > 0:
        trained = ("every parameter (the embeddings, norms and LM head included)" if refined["params"] == "full" else
                   adapter_trained(refined.get("rank"), biases, bool(refined.get("tied_head"))))
        sentences = [sentence.replace("keep the merged model's", "kept the merged model's") for sentence in sentences]
        sentences.append(f"That is the closed form; the refinement after it (see Refinement) then trained {trained}, so "
                         "those too now differ from the merged model.")
    return " ".join(sentences)


def _head_sentences(calibrated: dict) -> list[str]:
    """What the output did with a head stored beside a tied config, so that transformers and vLLM serve one head."""
    if calibrated.get("own_stored_head"):
        return ["The merge's config ties the LM head to the input embeddings, but its files store an `lm_head.weight` of its "
                "own, which the calibration used and transformers serves: the config now says `tie_word_embeddings: false`, "
                "so that vLLM serves that head too."]
    if calibrated.get("head_as_embedding"):
        return ["The merge's config ties the LM head to the input embeddings, but its files store an `lm_head.weight` of its "
                "own; vLLM serves this family only tied, off the input embeddings, so the output's `lm_head.weight` is "
                "written as the input embedding, the head transformers then serves too."]
    return []


def _listed(names: list[str]) -> str:
    quoted = [f"`{name}`" for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _how_text(method: str, biases: bool) -> str:
    if method == "featcal":
        return HOW_TEXT["featcal"]
    return HOW_TEXT["regmean"].format(rest="the norms, the embeddings, the LM head" + (" and the biases" if biases else ""))


def _usage(name: str) -> str:
    return f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

{USAGE_ID}{name}"  # this model's directory, or its Hub repository id
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id, dtype="auto")

messages = [{{"role": "user", "content": "Write a haiku about merging models."}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").to(model.device)
outputs = model.generate(**inputs, max_new_tokens=64)
print(tokenizer.decode(outputs[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

Without a chat template, call `tokenizer(text, return_tensors="pt")` instead of `apply_chat_template`."""


LEAD_NOTE = ("\nAn expert's *mean positive lead* is max(0, log p_expert − log p_merged) over every token of its records, "
             "averaged, with 0 where it trails: what its tokens' weights came from (`token_weights: expert_lead`). Whether it "
             "trails the merge (`trailing_experts`) is judged on its signed mean lead over its judged tokens instead, "
             "its *net lead*: behind only where it stays at or below 0 when raised by two standard errors counted over its "
             "records (the ± margin).\n")


def write_card(
    directory: Path, recipe: Recipe, merged: str, tokens: dict[str, int], *, tuning: dict | None = None,
    precisions: dict[str, torch.dtype] | None = None, sources: dict[str, Any] | None = None, calibrated: dict | None = None,
    starts: dict[str, dict] | None = None, weights: dict[str, float] | None = None, coverage: dict | None = None,
    sampling: dict[str, dict[str, Any]] | None = None, advantage: dict[str, dict[str, float]] | None = None,
    refined: dict[str, Any] | None = None, data_fields: dict[str, dict[str, str]] | None = None,
) -> None:
    """README.md (the Hub's front matter, then the run in sentences), the recipe, and featcal_weights.json beside it.

    The front matter holds what the Hub reads (lineage, licence, datasets, tags; `model-index` once `eval:` scored the
    model, append_evaluation); everything the run resolved goes to `featcal_weights.json` at full precision (the card
    rounds). Keyword arguments, so that a new record is one more keyword:
    `sources` (base_model / expert name → io.references.ModelSource) records every model as read:
    its reference, hub revision and LoRA adapter. `calibrated`: the projections re-fitted
    (`projections`, `every_projection`), whether norms and biases were (`norms`, `biases`), the head's
    settings, `taught_by_merge` and `unchanged`. `starts`: how each `generate:` expert began its samples
    (generation.run.start_records). `weights`: each expert's weight in the objective as the run used it; `coverage`: the
    NLLs the coverage weights came from (engine.coverage.expert_weights). `sampling`: each `generate:`
    expert's resolved sampling settings (generation.run.settings_of), written out in the saved recipe.
    `advantage`: per expert, the share of its tokens where it predicts the next token better than the
    merge and its mean positive lead in nats (engine.token_weights), when tokens were weighed by it. `refined`: the
    `refine:` stage's report, whose machine-dependent choices the saved recipe writes out (and `data_fields`: io/data_fields.py).

    For a tuned run (`tuning`: featcal_tuning.json's payload) the hyper-parameters are the
    per-layer chosen lists, and the saved recipe replays them (`replay_text`; `precisions`:
    the run's resolved `dtype` and `stats_dtype`).
    """
    featcal = recipe.featcal
    unchanged = bool((calibrated or {}).get("unchanged"))  # every expert trails the merge: the weights are the merge's
    if tuning is None:
        given = featcal.model_dump(mode="json", by_alias=True)
        hyper = {key: value if given.get(key) is None else given[key] for key, value in featcal.hyper_values().items()} | {"eps": featcal.eps}
        values = ", ".join(f"{SYMBOLS[key]} = {human(value)}" for key, value in rounded(hyper).items())
    else:
        search = tuning["search"]
        hyper = {**tuning["chosen"], "eps": featcal.eps,
                 "tuning": {k: search[k] for k in ("criterion", "holdout", "budget")} | {"most_common": tuning["most_common"]}}
        common = tuning["most_common"]
        values = (
            f"Chosen per layer by featcal-llm on held-out calibration records ({search['criterion']} criterion, "
            f"holdout {search['holdout']:g}; every candidate's score is in `featcal_tuning.json`):\n\n"
            + "\n".join(f"- {SYMBOLS[key]}: {human(rounded(chosen))}" for key, chosen in tuning["chosen"].items())
            + "\n\nMost common: " + ", ".join(f"{SYMBOLS[key]} = {value:g}" for key, value in common.items()) + f"; eps = {featcal.eps:g}"
        )
    starts = starts or {}
    base = str(recipe.base)
    names = public_names([base, merged, *(expert.name for expert in recipe.experts)])
    models = {}
    for role, source in (sources or {}).items():
        record = source.describe()
        record["reference"] = public_names([record["reference"]])[record["reference"]]
        if "lora_adapter" in record:
            record["lora_adapter"] = public_names([record["lora_adapter"]])[record["lora_adapter"]]
        models[names.get(role, role)] = record
    biases = has_biases(directory)
    settings = {key: getattr(featcal, key) for key in ("samples", "max_length", "shuffle", "seed")}
    settings["merge_seed"] = featcal.merge_seed  # the seed a random merge (RANDOM_METHODS) was drawn with
    settings["expert_weights"] = featcal.balancing
    settings |= {"data_fields": {names[name]: chosen for name, chosen in data_fields.items()}} if data_fields else {}
    settings |= {key: str(value).removeprefix("torch.") for key, value in (precisions or {}).items()}
    head_stats = settings.pop("head_stats_dtype", None)
    if head_stats is not None:  # the head's re-fit solves at its own λ: its statistics took their own precision
        settings["stats_dtype"] += f" (the LM head's re-fit: {head_stats})"
    if calibrated is not None and not featcal.regmean:
        settings |= {"token_weights": featcal.token_weighting, "trailing_experts": featcal.trailing, "teachers": featcal.teaching}
        if featcal.token_weighting == "expert_lead":
            settings["trailing_records"] = featcal.trailing_records
    if calibrated is not None and not unchanged:  # what was re-fitted: nothing, in an unchanged run
        settings["projections"] = "all" if calibrated["every_projection"] else list(calibrated["projections"])
        if not featcal.regmean:
            settings["norms"] = calibrated["norms"]
            if biases:  # a model without biases has nothing this setting could change
                settings["biases"] = calibrated["biases"]
            if calibrated.get("head") is not None:
                settings["head"] = calibrated["head"]
    base_source = (sources or {}).get("base_model")
    front = hub_front_matter(recipe, base_source.directory if base_source is not None else None)
    weights = weights if weights is not None else {e.name: featcal.data[e.name].weight for e in recipe.experts if e.name in featcal.data}
    weighed = any(weight != 1 for weight in weights.values())
    taught = (calibrated or {}).get("taught_by_merge") or {}
    teachers = (calibrated or {}).get("teachers") or {}
    run = run_record(recipe, merged, names, hyper, settings, tokens, starts=starts, models=models, weights=weights if weighed else None,
                     coverage=coverage, advantage=advantage, taught=taught, unchanged=unchanged, teachers=teachers)
    given = {e.name for e in recipe.experts if e.name in featcal.data and "weight" in featcal.data[e.name].model_fields_set}
    how = lambda name: "" if not weighed else f", weight {weights[name]:.4g}" + ("" if name in given or featcal.balancing == "equal" else " (coverage)")  # noqa: E731

    def lead_text(name: str) -> str:
        if advantage is None or name not in advantage:
            return ""
        summary = advantage[name]
        return (f"; ahead of the merged model on {summary['tokens_ahead']:.0%} of its tokens, mean positive lead "
                f"{summary['lead']:.3g} nats a token"
                + (net_lead_text(summary) if "net_lead" in summary else "")
                + (f", {summary['records_dropped']} of its {summary['records']} records weighed 0 (`trailing_records: drop`)"
                   if summary.get("records_dropped") else ""))

    held_out = " (in the records not held out: `tune.holdout`)" if featcal.holds_out else ""
    experts = "\n".join(
        f"- `{names[e.name]}`: {tokens[e.name]} calibration tokens" + held_out + how(e.name)
        + (f", written by the expert from the {starts[e.name]['start']} (chosen by {starts[e.name]['chosen_by']})" if e.name in starts else "")
        + (f"; its records were calibrated toward `{names[teachers[e.name][0]]}`, which predicts them better (by "
           f"{teachers[e.name][1]:.3g} ± {teachers[e.name][2]:.3g} nats a token: `teachers: best`)" if e.name in teachers else "")
        + lead_text(e.name)
        + (f"; it predicts its own records worse than the merged model (by {-taught[e.name]:.3g} nats a token), so its records "
           "were calibrated toward the merged model (`trailing_experts: merge`)" if e.name in taught else "")
        + ("; it predicts its own records worse than the merged model beyond two standard errors, and `trailing_experts: keep` "
           "calibrated toward it all the same: on its kind of text this model moved toward a weaker one"
           if e.name not in taught and featcal.method == "featcal" and featcal.trailing == "keep" and _trails(advantage, e.name) else "")
        for e in recipe.experts
    )
    title = Path(featcal.output).name
    kind = "FeatCal" if featcal.method == "featcal" else featcal.method
    count = len(recipe.experts)
    method = METHOD_TEXT[featcal.method].replace("(Gu et al., 2026)", f"([Gu et al., 2026]({PAPER_URL}))")
    hyper_section = "" if unchanged else f"## Hyper-parameters\n{values}\n\n"
    files = ([] if unchanged else ["per-layer feature drift of the merged and the calibrated model to each expert: "
                                   "`featcal_drift.json`, `featcal_drift.png`"])
    files.append(f"everything the run resolved (models as read, settings, calibration tokens, the expert and token weights "
                 f"at full precision): `{WEIGHTS_FILE}`")
    body = f"""# {title}

This model is a merge of {count} expert{"s" * (count != 1)} fine-tuned from `{names[base]}`, calibrated after the merge with {kind}.
The experts were first merged by [mergekit](https://github.com/arcee-ai/mergekit)'s `{recipe.merge_config.merge_method}` method
into the merged model (`{names[merged]}`). featcal-llm {__version__} then applied {method} to the merged model.
{_how_text(featcal.method, biases)}
{_calibrated_text(calibrated, featcal.regmean, biases, refined)}

## Experts
{experts}
{LEAD_NOTE if advantage is not None else ""}
{hyper_section}## Settings
{settings_lines(settings)}

Beside this card: {"; ".join(files)}.

## Usage
{_usage(title)}

## Recipe
The recipe as it was written (mergekit configuration plus the `featcal:` block), local paths shortened to their
names. `{RECIPE_FILE}` beside this card is the recipe as it ran, with what `auto` chose and the settings of generated
data written out: running it again makes this checkpoint{_where_generated_again(featcal)}.

```yaml
{_public_recipe(recipe.card_text or recipe.text, names, featcal.output).rstrip()}
```

## Citation
```bibtex
{CITATION}
```
"""
    text = "---\n" + yaml.safe_dump(rounded(front), sort_keys=False, allow_unicode=True) + "---\n\n" + body
    (directory / "README.md").write_text(text, encoding="utf-8")
    (directory / RECIPE_FILE).write_text(saved_recipe(recipe, tuning, precisions or {}, sampling or {}, starts, refined, data_fields), encoding="utf-8")
    write_run_record(directory, run)


def net_lead_text(summary: dict[str, Any]) -> str:
    """The expert's signed lead with its margin; one record measures no spread, so it has none to show (not "± 0")."""
    if summary.get("records", 2) < 2:
        return f", net lead {summary['net_lead']:+.3g} (one record, so no spread)"
    return f", net lead {summary['net_lead']:+.3g} ± {summary['net_lead_margin']:.2g}"


def _trails(advantage: dict | None, name: str) -> bool:
    """Behind the merge on its own records beyond doubt: its net lead stays below 0 when raised by its margin."""
    from featcal_llm.maths.advantage import trails

    summary = (advantage or {}).get(name) or {}
    return "net_lead" in summary and trails(summary["net_lead"], summary.get("net_lead_margin", 0.0))
