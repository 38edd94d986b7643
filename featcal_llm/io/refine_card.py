"""The model card's `## Refinement` section and `featcal_refine.json` beside it: what the `refine:` stage ran, what
the held-out records chose, and every check (engine/refine.py's report)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from featcal_llm.io.card import has_biases
from featcal_llm.io.card_edits import insert_before
from featcal_llm.io.names import public_names
from featcal_llm.engine.refine_rules import why_none_kept
from featcal_llm.io.card_settings import adapter_trained

REFINE_FILE = "featcal_refine.json"


def refine_precision(refined: dict[str, Any]) -> tuple[str, bool]:
    """(master dtype, whether it trained under bf16 autocast) from `featcal_refine.json`: `"master": "float32",
    "autocast": "bfloat16" | null`, or the `torch.float32` / `"None"` strings earlier versions wrote."""
    master = str(refined.get("master") or "float32").removeprefix("torch.")
    return master, str(refined.get("autocast")).removeprefix("torch.") == "bfloat16"


def refine_text(refined: dict[str, Any], biases: bool = True) -> str:
    """The card's `## Refinement` section: what the `refine:` stage ran and what the held-out records chose (`biases`:
    whether the model has any)."""
    kl = refined["held_out_kl"]
    kept = refined["chosen_step"] > 0
    params = "every parameter" if refined["params"] == "full" else adapter_trained(refined.get("rank"), biases,
                                                                                  bool(refined.get("tied_head")), kept)
    taught_by = refined.get("taught_by", {})
    teachers = ", ".join(f"`{task}`: " + (f"expert `{taught_by[task]}`" if task in taught_by else teacher)
                         for task, teacher in refined["teachers"].items())
    left_out = {task: count for task, count in refined.get("records_left_out", {}).items() if count}
    if left_out:
        teachers += (". Left out, as the closed form weighs them 0 (the expert trails the merge on them): "
                     + ", ".join(f"{count} of `{task}`'s records" for task, count in left_out.items()))
    if not kept:
        outcome = (f"No held-out check improved on the closed form's output (held-out KL {kl['before']:.4g}) without raising "
                   "an expert's held-out KL above the closed form's beyond two standard errors over its held-out records, so the "
                   "weights are the closed form's, unchanged")
        outcome += f": {why_none_kept(refined['history'], refined['lr'])}." if refined.get("history") else "."
    else:
        outcome = (f"The held-out KL to the teachers went from {kl['before']:.4g} (the closed form's output) to {kl['after']:.4g} at "
                   f"step {refined['chosen_step']}, the weights written. The drift report (`featcal_drift.json`) measures "
                   "the closed form's output, before this refinement.")
    outcome += (" These held-out KLs are the stage's own measure, over each teacher's top-k tokens in the precision it "
                "trained in, not the drift report's full-vocabulary KL to each expert, and need not equal it.")
    held = refined.get("held_out_records") or {}
    if any(held.values()):
        outcome += (" The checks' records (" + ", ".join(f"{count} of `{task}`'s" for task, count in held.items())
                    + ") were held out of the closed form's statistics too (`tune.holdout`): both stages fitted the rest.")
    held_left_out = {task: count for task, count in refined.get("held_out_left_out", {}).items() if count}
    if held_left_out:
        outcome += (" Held-out records left out of the checks, as of the training, since the expert trails the merge on them "
                    "(`trailing_records: drop`): " + ", ".join(f"{count} of `{task}`'s" for task, count in held_left_out.items()) + ".")
    master, autocast = refine_precision(refined)
    precision = f"under bf16 autocast with {master} master weights" if autocast else f"in {master} throughout"
    return (f"## Refinement\nAfter the closed form, `refine:` trained {params} (AdamW, peak learning rate {refined['lr']:g}, warm-up "
            f"then cosine, {precision}) toward each record's teacher, KL(teacher ‖ model) on the tokens each expert is judged on, the teachers "
            f"kept as their top-{refined['top_k']} tokens. Teachers: {teachers}. It ran {refined['steps_run']} of at most "
            f"{refined['max_steps']} steps{_why_it_stopped(refined)}. {outcome} Every held-out check: `{REFINE_FILE}`.\n\n")


def _why_it_stopped(refined: dict[str, Any]) -> str:
    """Where the stage stopped before its last step: `patience` checks in a row found no better state to keep."""
    if refined["steps_run"] >= refined["max_steps"] or "patience" not in refined:
        return ""
    checks = "a check" if refined["patience"] == 1 else f"{refined['patience']} checks in a row"
    return f", stopping once {checks} (one every {refined['eval_every']} steps) kept no better state (`patience`)"


def append_refinement(directory: Path, refined: dict[str, Any]) -> None:
    """Add the `refine:` stage's section to the card (before Usage) and its full record beside it (`featcal_refine.json`)."""
    names = public_names(list(refined["teachers"]))  # local paths by short name, as the rest of the card
    rename = lambda mapping: {names.get(key, key): value for key, value in mapping.items()}  # noqa: E731
    refined = {**refined, "teachers": rename(refined["teachers"]), "records": rename(refined.get("records", {})),
               **({"taught_by": {names.get(task, task): names.get(teacher, teacher) for task, teacher in refined["taught_by"].items()}}
                  if "taught_by" in refined else {}),
               "records_left_out": rename(refined.get("records_left_out", {})),
               "held_out_records": rename(refined.get("held_out_records", {})),
               **({"held_out_left_out": rename(refined["held_out_left_out"])} if "held_out_left_out" in refined else {}),
               "per_expert": {when: rename(values) for when, values in refined.get("per_expert", {}).items()},
               "history": [{**check, "per_expert": rename(check["per_expert"]),
                            "above_closed_form": [names.get(key, key) for key in check.get("above_closed_form", [])]}
                           for check in refined.get("history", [])]}
    card = directory / "README.md"
    section = refine_text(refined, has_biases(directory))
    card.write_text(insert_before(card.read_text(encoding="utf-8"), "## Usage", section), encoding="utf-8")
    (directory / REFINE_FILE).write_text(json.dumps(_finite(refined), indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    """NaN and infinities (a diverged check's KL) as null: JSON has no such numbers, and strict parsers refuse them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


__all__ = ["REFINE_FILE", "append_refinement", "refine_text"]
