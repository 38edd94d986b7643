"""`featcal-llm run`: recipe in, calibrated checkpoint out.

The steps, each its own module: validate the recipe → check the models agree →
tokenise the calibration data → merge with mergekit if needed (stages/prepare.py)
→ weigh experts and tokens, decide who teaches → the layer loop → refine:
→ write the checkpoint into a temporary sibling and rename it into place
(stages/outputs.py).
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

from featcal_llm import runlog
from featcal_llm.engine.calibrate import calibrate
from featcal_llm.engine.coverage import expert_weights
from featcal_llm.engine.teachers import every_expert_taught_by_the_merge, let_the_best_teach, let_the_merge_teach, trailing_experts
from featcal_llm.maths.coverage import better_teachers
from featcal_llm.engine.token_weights import advantage_weights
from featcal_llm.engine.passes import (held_out_trailing_indices, load_passes, record_rows, save_passes, saved_token_weights,
                                       trailing_record_indices)
from featcal_llm.engine.context import RunContext
from featcal_llm.engine.devices import release_memory
from featcal_llm.engine.distributed import Single, WorldError, communicator
from featcal_llm.errors import QUIET, REFINE_REMEDY, FeatCalError, RunFailure, out_of_memory
from featcal_llm.io.output_lock import OutputLock
from featcal_llm.io.recipe import Recipe
from featcal_llm.io.recipe_yaml import with_output
from featcal_llm.io.validate import EVAL_ONLY, check_before_run
from featcal_llm.stages.keep_layers import kept_layers, say_kept
from featcal_llm.stages.outputs import RunOutcome, evaluate_outputs, write_outputs
from featcal_llm.stages.prepare import Data, Opened, Resolved, check_output, open_merged, read_data, resolve, run_context


WRITE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM)


def _unwritable(comm: Single, error: OSError) -> RunFailure:
    where = f" {error.filename}" if error.filename else ""
    message = f"cannot write{where} ({error.strerror or os.strerror(error.errno)}); free space or make the directory writable, then rerun the same command to resume"
    comm.report_failure(message)
    return RunFailure(f"rank {comm.rank}: {message}" if comm.world > 1 else message)


def run_recipe(recipe_path: str | Path, force: bool = False, device: str | None = None, progress: bool = True,
               output: str | Path | None = None, keep_layers: bool = False, eval_only: bool = False) -> Path:
    """Calibrate the merge described by the recipe; returns the output directory (`output` overrides featcal.output)."""
    return run_recipe_outcome(recipe_path, force, device, progress, output, keep_layers, eval_only).output


def run_recipe_outcome(recipe_path: str | Path, force: bool = False, device: str | None = None, progress: bool = True,
                       output: str | Path | None = None, keep_layers: bool = False, eval_only: bool = False) -> RunOutcome:
    """Calibrate the merge described by the recipe; returns what the run produced.

    Progress is kept in a hidden sibling of the output after every layer; rerunning
    the same command after a crash resumes from it (`keep_layers`: after a finished
    run too, so that a rerun with other `refine:` settings starts from the closed form).
    Under torchrun (WORLD_SIZE > 1) this process is one rank of a data-parallel run
    (engine/distributed.py).
    """
    if eval_only:
        return _evaluate_only(recipe_path, output, device)
    comm = communicator()
    QUIET["warnings"] = not comm.is_main
    try:
        return _run(comm, recipe_path, force, device, progress, output, keep_layers=keep_layers)
    except WorldError:
        raise
    except OSError as error:  # a full disk or a read-only directory: one line; saved layers stay for the rerun
        if error.errno not in WRITE_ERRNOS:
            raise
        raise _unwritable(comm, error) from None
    except FeatCalError as error:
        if not comm.ready:  # during the setup every rank meets the others with its error: rank 0 reports
            comm.agree(None, str(error))
        comm.report_failure(str(error))  # in the loop: this rank's own error, which the others will name
        if comm.world == 1:
            raise  # with its cause (mergekit's full error, for one), which the CLI shows
        raise (RunFailure if isinstance(error, RunFailure) else FeatCalError)(f"rank {comm.rank}: {error}") from None
    finally:
        comm.close()
        QUIET["warnings"] = False


def _run(comm: Single, recipe_path: str | Path | Recipe, force: bool, device: str | None, progress: bool,
         output_override: str | Path | None = None, locked: bool = False, keep_layers: bool = False) -> RunOutcome:
    """resolve → data → merge → run context → weights → layers → outputs → `eval:` (a stack: two runs of this function,
    under the stack's lock: `locked`)."""
    # every problem `validate` finds, before any model is resolved (a stack's stages arrive already checked)
    recipe = recipe_path if isinstance(recipe_path, Recipe) else check_before_run(recipe_path, output_override, device, keep_layers)
    if output_override is not None:
        recipe = replace(recipe, featcal=recipe.featcal.model_copy(update={"output": str(output_override)}), output_key="OUTPUT",
                         text=with_output(recipe.text, str(output_override)))  # the saved replay recipe writes here too
    if keep_layers:
        recipe = kept_layers(recipe)
    if recipe.featcal.stacked:  # RegMean first, then FeatCal on its result: two runs of this function, under one lock
        from featcal_llm.engine.stack import run_stack

        stage = lambda part, part_force: _run(comm, part, part_force, device, progress, locked=True)  # noqa: E731
        with _output_lock(comm, recipe, Path(recipe.featcal.output), force):
            outcome = run_stack(recipe, force, stage, comm.is_main, comm.barrier)
            if keep_layers and comm.is_main:
                say_kept(recipe)
        # stage 2's start was the removed intermediate, which stage 1 had changed: the output is never the merge unchanged
        return replace(outcome, merged=Path(recipe.featcal.merged), unchanged=False, start=recipe.featcal.method[0])
    resolved = resolve(comm, recipe, force, device)
    with nullcontext() if locked else _output_lock(comm, recipe, resolved.output, force):
        outcome = _calibrate_or_clean_up(comm, resolved, progress)
        if comm.is_main:  # the run's models, streams and statistics went with _calibrate's frame: `eval:` finds the memory
            release_memory()
            outcome = evaluate_outputs(recipe, outcome)  # under the lock: a --force run may not swap the output it reads
            if keep_layers:
                say_kept(recipe)
    return outcome


def _evaluate_only(recipe_path: str | Path, output_override: str | Path | None, device: str | None) -> RunOutcome:
    """`run --eval-only`: the recipe's `eval:` on the output a finished run wrote (its evaluation had failed, or its
    block changed), without calibrating again; under the output's lock, as a run evaluates."""
    from featcal_llm.io.output_dir import partial_dir, scored_merge

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise FeatCalError(f"{recipe_path}: {EVAL_ONLY}: scores in one process; run it without torchrun (the evaluation "
                           "takes the GPUs eval.backend names)")
    # an eval: block, a finished output, the merge (a stack's first stage) beside it
    recipe = check_before_run(recipe_path, output_override, device, eval_only=True)
    featcal = recipe.featcal
    output = Path(output_override or featcal.output)
    merged = scored_merge(featcal, output)
    lock = OutputLock.acquire(output, f"{recipe.path}: {recipe.output_key}", lambda: None)
    try:
        outcome = evaluate_outputs(recipe, RunOutcome(output, merged), after_run=False)
        if featcal.stacked and not partial_dir(output).exists():  # what the stack's run leaves once it has evaluated
            from featcal_llm.engine.resume import remove_staging  # (not where --keep-layers kept its progress)

            shutil.rmtree(merged, ignore_errors=True)
            remove_staging(partial_dir(merged))
        # as a stack's run reports it: from the recipe's merge, its first stage's output gone (pipeline._run)
        return replace(outcome, merged=Path(featcal.merged), start=featcal.method[0] if featcal.stacked else "merged")
    finally:
        lock.release()


@contextmanager
def _output_lock(comm: Single, recipe: Recipe, output: Path, force: bool):
    """Rank 0 holds the output's lock (io/output_lock.py) from before the run writes anything until it has evaluated the
    output; the output is checked again once the lock is held."""
    lock = comm.run_on_main("the output's lock", lambda: OutputLock.acquire(output, f"{recipe.path}: {recipe.output_key}",
                                                                            lambda: check_output(recipe, output, force)))
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _calibrate_or_clean_up(comm: Single, resolved: Resolved, progress: bool) -> RunOutcome:
    """`_calibrate`; where it refuses its input (a NaN weight met at the first layer, say) before any layer is saved,
    the staging folder this run made goes too: nothing there to resume, and the output's folder is left as it was."""
    from featcal_llm.engine.resume import holds_no_layer, remove_staging
    from featcal_llm.io.output_dir import partial_dir

    partial = partial_dir(resolved.output)
    made_here = not partial.exists()
    try:
        return _calibrate(comm, resolved, progress)
    except FeatCalError as error:
        if made_here and comm.is_main and not isinstance(error, RunFailure) and holds_no_layer(partial):
            remove_staging(partial)
        raise


def _calibrate(comm: Single, resolved: Resolved, progress: bool) -> RunOutcome:
    """data → merge → run context → weights → layers → refine → the written output (rank 0; the others return once
    their layers are done)."""
    recipe = resolved.recipe
    data = read_data(comm, resolved, progress)
    opened = open_merged(comm, resolved, data)
    context = run_context(comm, resolved, data, opened)
    lead_summary, coverage, taught, dropped, leading = _weights(context, resolved, data, opened)
    if every_expert_taught_by_the_merge(taught, {task: context.plan.task_weight(task) for task in context.batches}):
        # nothing to calibrate toward (every expert with a weight above 0 trails): the output is the merge
        runlog.stage("trailing_experts: merge: every expert trails the merged model on its own records, so no layer is "
                     "re-fitted and the output is the merged model, unchanged")
        replacements = None
    else:
        replacements = calibrate(context, opened.num_layers, progress and comm.is_main)
    held_dropped = {}
    if leading is not None and replacements is not None:  # every rank: the held-out records' marks are gathered
        held_dropped = held_out_trailing_indices(context, leading, data.probe_sequences, recipe.featcal.batch_tokens)
    comm.barrier()
    if not comm.is_main:
        return RunOutcome(resolved.output, opened.models.merged.directory)
    refined = None
    if recipe.featcal.refine is not None:  # rank 0 alone, after the others finished their layers (docs/refine.md)
        _drop_the_layer_loops_state(context)
        replacements, refined = _refine(context, resolved, data, opened, replacements, taught, dropped, progress, held_dropped)
    return write_outputs(context, resolved, data, opened, replacements, lead_summary, coverage, taught, refined)


def _weights(context: RunContext, resolved: Resolved, data: Data, opened: Opened):
    """The passes before the layers: each expert's weight (coverage), each token's (its expert's lead), who teaches
    each expert's records (`trailing_experts:`), and, for `refine:`, the records that weigh 0 (`trailing_records: drop`)
    and the experts whose held-out records are marked alike after the layers (those not behind the merge beyond doubt;
    None where no record is left out).

    Rank 0 keeps their results in the staging area with the layers, record by record (engine/passes.py), so a resumed
    run reuses them with any number of ranks.
    """
    featcal, staging, comm = resolved.recipe.featcal, context.staging, context.comm
    where = f"{resolved.recipe.path}: featcal"
    rows = record_rows(comm, data.sequences, featcal.batch_tokens)
    cached = load_passes(comm, staging, data.sequences)
    if cached is not None:
        runlog.stage("expert and token weights: reused from the saved progress")
        weights, coverage = cached["weights"], cached["coverage"]
        teachers = {task: tuple(chosen) for task, chosen in cached.get("teachers", {}).items()}
        let_the_best_teach(context, teachers)
        token_weights = None if cached["tokens"] is None else saved_token_weights(cached["tokens"], context.batches, rows)
    else:
        weights, coverage, leads = expert_weights(context, featcal, data.sequences, opened.num_layers)
        teachers = better_teachers(leads) if featcal.teaching == "best" and leads is not None else {}
        let_the_best_teach(context, teachers, f"{where}.teachers" if featcal.teaching == "best" else None)
        token_weights = None
        if featcal.token_weighting == "expert_lead" or featcal.trailing == "merge":  # one pass measures both
            token_weights = advantage_weights(context, opened.num_layers, f"{where}.token_weights",
                                              featcal.token_weighting == "expert_lead" and featcal.trailing_records == "drop")
        save_passes(comm, staging, weights, coverage, token_weights, context.batches, rows, teachers)
    context.plan = resolved.plan = replace(resolved.plan, task_weights=weights)
    if featcal.token_weighting == "expert_lead":
        context.token_roots = token_weights.roots
    taught = {}
    if featcal.trailing == "merge":
        taught = let_the_merge_teach(context, token_weights.mean_leads, f"{where}.trailing_experts", token_weights.lead_margins)
    lead_summary = token_weights.summary if featcal.token_weighting == "expert_lead" else None
    dropped, leading = {}, None
    if featcal.refine is not None and featcal.token_weighting == "expert_lead" and featcal.trailing_records == "drop":
        counts = {task: len(records) for task, records in data.sequences.items()}  # every rank: the gather is collective
        dropped = trailing_record_indices(comm, token_weights.advantages, context.batches, rows, counts)
        behind = trailing_experts(token_weights.mean_leads, token_weights.lead_margins)  # as advantage_weights marks
        leading = [task for task in data.sequences if task not in behind]
    return lead_summary, (weights, coverage), taught, dropped, leading


def _drop_the_layer_loops_state(context: RunContext) -> None:
    """What only the layer loop needed, dropped before `refine:` builds whole models: the hidden-state streams (at 8B,
    26 GB of host memory, pinned on a GPU box), the statistics buffers (4 GB of the GPU's) and the `output` criterion's
    heads (8 GB). What is written after reads the plan, the staging area and the data, not these."""
    from featcal_llm.engine.record import StatisticsWorkspace

    context.cal, context.expert, context.heads, context.workspace = {}, {}, None, StatisticsWorkspace()
    if context.probe is not None:
        context.probe.cal, context.probe.expert, context.probe.merged = {}, {}, {}
    release_memory()


def _refine(context: RunContext, resolved: Resolved, data: Data, opened: Opened, replacements, taught: dict[str, float],
            dropped: dict[str, frozenset[int]], progress: bool, held_dropped: dict[str, frozenset[int]] | None = None):
    """`refine:`: gradient steps from the closed form's output toward each record's teacher (engine/refine.py), on the
    records the closed form weighs: not those an expert trails the merge on (`trailing_records: drop`), and checked
    on the held-out records alike (`held_dropped`: those of the held-out ones it trails the merge on)."""
    held_dropped = held_dropped or {}
    if replacements is None:
        runlog.stage("refine: skipped, as the output is the merged model and every record's teacher is the merge")
        return None, None
    from featcal_llm.engine.refine import RefineJob, refine

    featcal = resolved.recipe.featcal
    calibrated = [task for task in data.sequences if context.plan.task_weight(task) > 0]  # weight 0: merged in, not calibrated toward
    job = RefineJob(featcal.refine, featcal.seed, featcal.batch_tokens, opened.merged_config, opened.models.merged,
                    context.models.experts, taught, replacements,
                    {t: [s for i, s in enumerate(data.sequences[t]) if i not in dropped.get(t, ())] for t in calibrated},
                    {t: [s for i, s in enumerate(data.probe_sequences[t]) if i not in held_dropped.get(t, ())] for t in calibrated},
                    resolved.plan.projections,
                    resolved.device, opened.runner.dtype, context.staging, featcal.trust_remote_code, progress,
                    {t: len(dropped.get(t, ())) for t in calibrated}, resolved.plan.architecture.head_tied_only,
                    {t: len(held_dropped.get(t, ())) for t in calibrated}, {t: chosen[0] for t, chosen in context.teachers.items()})
    try:
        return refine(job)
    except (MemoryError, RuntimeError) as error:  # its levers are its own keys, which keep the calibrated layers
        failure = out_of_memory(error, REFINE_REMEDY)
        if failure is None:
            raise
        raise failure from error
