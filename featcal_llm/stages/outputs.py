"""The run's last stage: the calibrated checkpoint, its drift report, tuning table and card, renamed into place; `eval:`."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from featcal_llm import runlog
from featcal_llm.errors import FeatCalError
from featcal_llm.engine.context import RunContext
from featcal_llm.io.card import write_card
from featcal_llm.io.card_edits import append_evaluation
from featcal_llm.io.refine_card import REFINE_FILE, append_refinement
from featcal_llm.io.checkpoint import (
    copy_side_files,
    move_into_place,
    head_needs_untying,
    stores_its_own_head,
    untie_head,
    write_calibrated_checkpoint,
)
from featcal_llm.engine.drift import LM_HEAD, TUNING_JSON, Probe, drift_report, write_report
from featcal_llm.engine.refine_progress import forget_refinement
from featcal_llm.engine.resume import remove_staging
from featcal_llm.engine.streams import make_batches
from featcal_llm.engine.tuning import tuning_report, tuning_table
from featcal_llm.stages.prepare import Data, Opened, Resolved


def _tokenizer_where_the_merge_has_none(featcal: Any, tokenizer: Any, checkpoint: Path) -> None:
    """A merge without tokenizer files (its base had none, so the recipe named `featcal.tokenizer`): the output gets the
    tokenizer the records were tokenised with (the object itself: no second fetch of a hub id), so that it loads, and
    the card's usage runs, as it stands."""
    from featcal_llm.io.model_files import has_tokenizer_files

    if not featcal.tokenizer or tokenizer is None or has_tokenizer_files(checkpoint):
        return
    runlog.stage(f"the merge has no tokenizer files: the output gets featcal.tokenizer's ({featcal.tokenizer}), which the "
                 "records were tokenised with")
    tokenizer.save_pretrained(checkpoint)


def _generation_config_where_the_merge_has_none(base: Path, checkpoint: Path) -> None:
    """A merge given without generation_config.json (mergekit writes none where it builds the tokenizer: a
    `tokenizer_source` or `chat_template` recipe merged by mergekit itself): the output gets the base's, the file
    mergekit's plain copy takes, so that runtimes stop and sample as the base does."""
    from featcal_llm.io.model_files import GENERATION_CONFIG, lend_generation_config

    if lend_generation_config(base, checkpoint):
        runlog.stage(f"the merge has no {GENERATION_CONFIG}: the output gets the base model's (its stop ids and sampling defaults)")


def _tied_head_copy(merged: Any, architecture: Any, ties: bool) -> tuple[dict[str, str], bool]:
    """A family vLLM serves only tied (Gemma-2: its loader asserts tie_word_embeddings and reads logits off the
    embedding) whose merge stores an lm_head.weight: that tensor is written as the input embedding the output keeps
    (refined or not), so that transformers, which serves a stored head, serves the same head as vLLM. Also returns
    whether that changes the head transformers serves (the stored one differed from the embedding)."""
    if not (architecture.head_tied_only and ties and LM_HEAD in merged.weight_map):
        return {}, False
    differs = not torch.equal(merged.get(LM_HEAD), merged.get(architecture.embed_tokens))
    if differs:
        runlog.stage(f"the merge's config ties the LM head to the input embeddings, but its files store an lm_head.weight "
                     f"of its own; vLLM serves {architecture.name} only tied, so the output's lm_head.weight is the input "
                     "embedding, the head every runtime then serves")
    return {LM_HEAD: architecture.embed_tokens}, differs


@dataclass(frozen=True)
class RunOutcome:
    """What a run produced: the calibrated and the merged model's directories, and the `eval:` table if one ran."""

    output: Path
    merged: Path
    evaluation: str | None = None
    unchanged: bool = False  # the output is the merged model: every expert trails it on its own records
    head_changed: bool = False  # unchanged but for the LM head a tied merge stored of its own (written as vLLM serves it)
    refined: dict | None = None  # where `refine:` changed the weights: its chosen step and per-expert held-out KL
    start: str = "merged"  # what the calibration started from, as the drift report measured it (a stack: its first method)


def write_outputs(context: RunContext, resolved: Resolved, data: Data, opened: Opened, replacements, lead_summary, coverage,
                  taught: dict[str, float], refined: dict | None = None) -> RunOutcome:
    """The checkpoint, its report, tuning table and card, written beside the output and renamed into place."""
    recipe, featcal, plan, staging = resolved.recipe, resolved.recipe.featcal, context.plan, context.staging
    models, output, runner = opened.models, resolved.output, opened.runner
    merged_dir, partial = models.merged.directory, staging.root
    probe = Probe({task: make_batches(seqs, featcal.batch_tokens, pad_id=0) for task, seqs in data.probe_sequences.items()}, data.probe.source,
                  divergence=data.probe.divergence)  # the report counts every rank's records
    unchanged = replacements is None  # every expert trails the merge (`trailing_experts: merge`): no layer was fitted
    replacements = replacements or {}
    records = [] if unchanged else [staging.record(layer) for layer in range(opened.num_layers)]
    shutil.rmtree(partial / "spill", ignore_errors=True)
    checkpoint = partial / "checkpoint"
    shutil.rmtree(checkpoint, ignore_errors=True)
    checkpoint.mkdir()
    ties = bool(getattr(opened.merged_config, "tie_word_embeddings", False))
    copies, head_as_embedding = _tied_head_copy(models.merged, plan.architecture, ties)  # unchanged too: untied, vLLM refuses it
    write_calibrated_checkpoint(models.merged, replacements, checkpoint, copies)
    copy_side_files(merged_dir, checkpoint)
    _tokenizer_where_the_merge_has_none(featcal, data.tokenizer, checkpoint)
    _generation_config_where_the_merge_has_none(resolved.base.directory, checkpoint)
    untied = not copies and head_needs_untying(LM_HEAD in replacements, ties, LM_HEAD in models.merged.weight_map)
    own_stored_head = not copies and not untied and ties and stores_its_own_head(models.merged, replacements, plan.architecture.embed_tokens)
    if own_stored_head:  # the head the run calibrated against and transformers serves; vLLM too, once untied
        runlog.stage("the merge's config ties the LM head to the input embeddings, but its files store an lm_head.weight "
                     "of its own (the calibration's head, as transformers serves it): the output is written untied, so "
                     "that vLLM serves that head too")
    if untied or own_stored_head:
        untie_head(checkpoint)
    tokens = {task: sum(len(s) for s in seqs) for task, seqs in data.sequences.items()}
    tuning = None
    if plan.tuning is not None and not unchanged:
        tuning = tuning_report(plan.tuning, [record["tuning"] for record in records])
        (checkpoint / TUNING_JSON).write_text(json.dumps(tuning, indent=1) + "\n", encoding="utf-8")
        runlog.table(tuning_table(tuning))
    if not unchanged:
        report = drift_report(probe, records)
        if taught:  # their probe's expert streams are the merge's: drift and KL to the records' teacher, not to the expert
            report["taught_by_merge"] = [name for name in report["experts"] if name in taught]
        if context.teachers:  # their probe's expert streams are the teacher's: drift and KL to it, not to the expert
            report["teachers"] = {name: context.teachers[name][0] for name in report["experts"] if name in context.teachers}
        if refined is not None and refined["chosen_step"] > 0:  # measured in the layer loop, before the refinement
            report["measured_on"] = f"the closed form's output, before refine: changed the weights ({REFINE_FILE})"
        write_report(checkpoint, report)
    architecture = plan.architecture
    calibrated = {"projections": sorted(plan.projections), "every_projection": plan.projections == frozenset(architecture.projections()),
                  "norms": plan.norms, "biases": plan.biases,
                  "head": None if plan.head is None else {**plan.head.values(), "untied": untied},
                  "own_heads": plan.own_heads, "taught_by_merge": taught, "unchanged": unchanged, "own_stored_head": own_stored_head,
                  "teachers": context.teachers,
                  "head_as_embedding": head_as_embedding,
                  "untied_by_refine": untied and plan.head is None}
    from featcal_llm.generation.run import sampling_records, start_records

    weights, covered = coverage
    precisions = {"dtype": runner.dtype, "stats_dtype": runner.stats_dtype}
    if plan.head is not None and runner.head_stats_dtype != runner.stats_dtype:  # the head's own λ chose another
        precisions["head_stats_dtype"] = runner.head_stats_dtype
    write_card(checkpoint, recipe, recipe.merged_label or featcal.merged, tokens, tuning=tuning,
               precisions=precisions, sources=resolved.sources, calibrated=calibrated,
               starts=start_records(recipe), weights=weights, coverage=covered, sampling=sampling_records(recipe),
               advantage=lead_summary, refined=refined, data_fields=data.fields)
    if refined is not None:
        append_refinement(checkpoint, refined)
    move_into_place(checkpoint, output, "featcal-old")  # an old output (--force) is swapped out, then removed
    if not featcal._keeps_progress:
        remove_staging(partial)
    else:  # a stack's first stage (the stack removes it once stage 2 has finished too), or --keep-layers
        forget_refinement(staging)
    changed = refined is not None and refined["chosen_step"] > 0
    return RunOutcome(output, merged_dir, unchanged=unchanged, head_changed=unchanged and (head_as_embedding or own_stored_head),
                      refined={key: refined[key] for key in ("chosen_step", "per_expert", "top_k")} if changed else None)


def evaluate_outputs(recipe: Any, outcome: RunOutcome, after_run: bool = True) -> RunOutcome:
    """`eval:`, once the run's models, streams and statistics are released (pipeline._run), so that the evaluation's
    engine (vLLM asks for a share of the GPU's free memory) finds the memory the calibration held free again. Where it
    fails after a run, the checkpoint is complete: the error says how to score it without calibrating again."""
    featcal = recipe.featcal
    if featcal.eval is None:
        return outcome
    from featcal_llm.evaluation import run_after_calibration

    runlog.stage(f"evaluating the merged and the calibrated model on suite {featcal.eval.suite}")
    try:  # the worker's log goes where the run's stage lines go (not to the terminal under -q; always to --log)
        scored = run_after_calibration(featcal.eval, outcome.merged, outcome.output, recipe.path.parent,  # as data paths are read
                                       echo=runlog.stage)
    except FeatCalError as error:
        if after_run:
            error.args = (f"{error}; the calibrated checkpoint is complete in {outcome.output} (its card without the "
                          f"evaluation): once that is mended, `featcal-llm run {recipe.path} {outcome.output} --eval-only` "
                          "(calibrate(..., eval_only=True) in Python) scores it and the merge and adds the table to its card",)
        raise
    append_evaluation(outcome.output, scored.table, scored.calibrated)  # its scores: the card's model-index
    print(scored.table)
    return replace(outcome, evaluation=scored.table)
