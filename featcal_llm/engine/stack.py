"""`method: [regmean++, featcal]`: RegMean (or RegMean++) first, then FeatCal on its result, in one command.

The two stages run one after the other exactly as two recipes would (the second's `merged` is the first's
`output`): stage 1 writes its merge into a hidden sibling of the output, stage 2 calibrates it into the output,
and the sibling is removed, with stage 1's saved progress. Where stage 2 fails or is stopped, both stay: the rerun
takes stage 1's layers from its saved progress (the fingerprint checks they still fit) and resumes stage 2. The
saved recipe is the stack itself, with the values any search chose per layer, so running it again replays both
stages.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

import yaml

from featcal_llm.engine.drift import TUNING_JSON
from featcal_llm.engine.resume import remove_staging
from featcal_llm.io.output_dir import intermediate_dir
from featcal_llm.io.recipe import Recipe


def with_chosen(text: str, tuning_file: Path) -> str:
    """The recipe text with the first stage's searched values (its featcal_tuning.json) as {per_layer: [...]}."""
    if not tuning_file.is_file():
        return text
    tuning = json.loads(tuning_file.read_text(encoding="utf-8"))
    raw = yaml.safe_load(text)
    block = raw["featcal"]
    for key, values in tuning["chosen"].items():
        block[key] = {"per_layer": list(values)}
    block["tune"] = {**(block.get("tune") or {}), "holdout": tuning["search"]["holdout"]}
    return yaml.safe_dump(raw, sort_keys=False)


def run_stack(recipe: Recipe, force: bool, run_stage: Callable[[Recipe, bool], Path], is_main: bool,
              barrier: Callable[[], None]) -> Path:
    """Run the stack's two stages; returns the output directory (stage 2's). The caller holds the output's lock, whose
    acquisition checked the output (an existing one stops the run before stage 1)."""
    featcal = recipe.featcal
    output = Path(featcal.output)
    intermediate = intermediate_dir(output, featcal.method[0])
    first = replace(recipe, featcal=featcal.stage(0, str(intermediate)))
    run_stage(first, True)
    barrier()  # every rank waits for rank 0's stage-1 checkpoint
    text = with_chosen(recipe.text, intermediate / TUNING_JSON) if first.featcal.tuned else recipe.text
    second = replace(recipe, featcal=featcal.stage(1, str(intermediate)), text=text,
                     merged_label=f"{featcal.merged} + {featcal.method[0]}", card_text=recipe.text)
    output = run_stage(second, force)
    if is_main and not featcal._keeps_progress:  # only now: a failure before this keeps both for the rerun (--keep-layers: always)
        from featcal_llm.io.output_dir import partial_dir

        shutil.rmtree(intermediate, ignore_errors=True)
        remove_staging(partial_dir(intermediate))
    return output
