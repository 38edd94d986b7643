"""The forward-order loop over decoder layers (featcal_method.md, "Forward-order schedule").

For layer l: load layer l of the merged model (the `cal` layer, still merged)
and of each expert; record statistics with hooks while running cal on h_cal
and expert i on h_exp,i; fold each task into the group systems with the
plan's objective; solve (or select among candidates); load the solution into
cal; advance h_cal through the *updated* layer. Only one layer of each model
exists at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from featcal_llm import runlog
from featcal_llm.engine.context import RunContext, Streams
from featcal_llm.engine.drift import LM_HEAD, Head, Heads, outputs, next_token_kls, reduced_drifts
from featcal_llm.engine.head import calibrate_head
from featcal_llm.engine.prefetch import LayerPrefetcher, LayerTensors
from featcal_llm.engine.progress import NullProgress, TokenProgress
from featcal_llm.engine.record import record_task
from featcal_llm.engine.streams import TokenBatch
from featcal_llm.engine.transfer import on_device
from featcal_llm.engine.tuned import select_layer
from featcal_llm.engine.resume import resuming_line
from featcal_llm.errors import RunFailure, float16_cause, warn
from featcal_llm.maths.objective import GroupSystem


def embedded(ctx: RunContext, reader, batches: list[TokenBatch], what: str) -> list[torch.Tensor]:
    """Layer 0's input of every batch through `reader`'s embedding (the family's embedding step), as a host stream."""
    embedding = reader.get(ctx.plan.architecture.embed_tokens)
    return [ctx.store.store(ctx.runner.embed(b, embedding, what), b.keep) for b in batches]


def initial_streams(ctx: RunContext, batches: dict[str, list[TokenBatch]]) -> tuple[Streams, Streams]:
    """h_cal from the merged embedding for every task; h_exp,i from expert i's own (both through the family's embedding step)."""
    cal = {task: embedded(ctx, ctx.models.merged, task_batches, "merged model") for task, task_batches in batches.items()}
    experts = {task: embedded(ctx, ctx.models.experts[task], task_batches, f"expert {task}") for task, task_batches in batches.items()}
    return cal, experts


def advance(ctx: RunContext, layer: torch.nn.Module, batches: list[TokenBatch], stream: list[torch.Tensor],
            what: str = "calibrated layer") -> None:
    """Replace the stream, batch by batch and in place, by `layer` applied to it (`what`: whose layer, for the error)."""
    runner = ctx.runner
    with ctx.timer.phase("forward"):
        for index, (batch, (hidden,)) in enumerate(zip(batches, on_device(runner.device, stream))):
            output = runner.forward(layer, hidden, runner.context(batch, hidden))
            if not bool(torch.isfinite(output[batch.keep.to(output.device)]).all()):  # caught where it appears, not a layer later
                raise RunFailure(f"layer {getattr(layer, 'featcal_index', '?')}: {what} produced NaN/Inf hidden states{float16_cause(output.dtype)}")
            stream[index] = ctx.store.store(output, batch.keep)


def replay_layer(ctx: RunContext, layer: int, tensors: LayerTensors, calibrated: dict[str, torch.Tensor]) -> None:
    """Advance every stream through an already calibrated layer (resume): forward passes only."""
    runner, probe = ctx.runner, ctx.probe
    cal_layer = runner.build(layer, {**tensors.merged, **calibrated}, "merged model")
    for task, task_batches in ctx.batches.items():
        advance(ctx, cal_layer, task_batches, ctx.cal[task])
        expert_layer = runner.build(layer, tensors.experts[task], f"expert {task}")
        advance(ctx, expert_layer, task_batches, ctx.expert[task], f"expert {task}")
        if probe is not None:
            advance(ctx, expert_layer, probe.batches[task], probe.expert[task], f"expert {task}")
            advance(ctx, cal_layer, probe.batches[task], probe.cal[task])
    if probe is not None:
        merged_layer = runner.build(layer, tensors.merged, "merged model")
        for task, task_batches in probe.batches.items():
            advance(ctx, merged_layer, task_batches, probe.merged[task], "merged model")


def start_probe(ctx: RunContext) -> None:
    """Embed the probe records: cal and merged streams from the merged embedding, expert i's from its own."""
    probe = ctx.probe
    probe.cal, probe.expert = initial_streams(ctx, probe.batches)
    probe.merged = {task: [ctx.store.store(h, b.keep) for h, b in zip(stream, probe.batches[task])] for task, stream in probe.cal.items()}


def output_divergence(ctx: RunContext) -> dict[str, dict[str, float]]:
    """Mean next-token KL(expert i ‖ model) on expert i's probe records, for the merged and the calibrated model."""
    probe = ctx.probe
    merged_head = Head(ctx.runner, ctx.models.merged)
    calibrated_head = merged_head
    if ctx.head is not None:
        calibrated_head = Head(ctx.runner, ctx.models.merged, ctx.head)
    result: dict[str, dict[str, float]] = {"merged": {}, "calibrated": {}}
    for task, batches in probe.batches.items():
        expert_head = Head(ctx.runner, ctx.models.experts[task])
        compared = [(merged_head, probe.merged[task]), (calibrated_head, probe.cal[task])]
        result["merged"][task], result["calibrated"][task] = next_token_kls(compared, expert_head, probe.expert[task], batches, ctx.comm)
    return result


def calibrate(ctx: RunContext, num_layers: int, progress: bool = True) -> dict[str, Path]:
    """Run the whole forward-order schedule; returns tensor name → staged file holding its new value.

    Layers the staging area already holds are replayed, not recomputed. With a
    probe, every layer's drift (and a tuned run's choice) is recorded in the
    staging area, and `ctx.probe.divergence` holds the final output divergence.
    A tuned plan needs the probe: its records are the held-out ones.
    """
    plan = ctx.plan
    if plan.tuning is not None and ctx.probe is None:
        raise RunFailure("internal: a tuned run needs its held-out records as the probe")
    ctx.cal, ctx.expert = initial_streams(ctx, ctx.batches)
    if ctx.probe is not None:
        start_probe(ctx)
    if plan.tuning is not None and plan.tuning.criterion == "output":
        ctx.heads = Heads(Head(ctx.runner, ctx.models.merged), {task: Head(ctx.runner, r) for task, r in ctx.models.experts.items()})
    total_tokens = sum(b.tokens for task_batches in ctx.batches.values() for b in task_batches)
    models = ctx.models
    prefetcher = LayerPrefetcher(
        models.merged, models.base, models.experts, plan.architecture.prefix, num_layers, pin=ctx.runner.device.type == "cuda"
    )
    if ctx.staging.completed and ctx.comm.is_main:
        warn(resuming_line(ctx.staging.root, ctx.staging.completed, num_layers))
    counted = progress or runlog.wants_notes()  # the log's per-layer lines come from the same counts, bar or no bar
    method = {"featcal": "FeatCal", "regmean": "RegMean", "regmean++": "RegMean++"}[plan.objective.name]
    ctx.progress = (TokenProgress(num_layers, total_tokens, min(ctx.staging.completed, num_layers), progress, method) if counted
                    else NullProgress())
    try:
        for layer in range(num_layers):
            with ctx.timer.phase("read"):
                tensors = prefetcher.get(layer)
            if layer < ctx.staging.completed:
                prefix = plan.architecture.prefix(layer)
                replay_layer(ctx, layer, tensors, {name[len(prefix):]: t for name, t in ctx.staging.load(layer).items()})
            else:
                calibrate_layer(ctx, layer, tensors)
                ctx.progress.layer_done(layer)
            del tensors
        if plan.head is not None:  # the head is staged as one more "layer"
            if ctx.staging.completed <= num_layers:
                ctx.staging.commit(num_layers, head := calibrate_head(ctx, plan.head))
            else:
                head = ctx.staging.load(num_layers)
            ctx.head = head[LM_HEAD]
        if ctx.probe is not None:
            ctx.probe.divergence = output_divergence(ctx)
    finally:
        prefetcher.close()
        ctx.progress.close()
        ctx.progress = NullProgress()
    return ctx.staging.replacements()


def calibrate_layer(ctx: RunContext, layer: int, tensors: LayerTensors) -> None:
    """Record, solve (or select), stage and advance one layer (steps 2a-2c of the schedule)."""
    plan, runner, probe, timer, comm = ctx.plan, ctx.runner, ctx.probe, ctx.timer, ctx.comm
    merged_weights = tensors.merged
    with timer.phase("load"):
        cal_layer = runner.build(layer, merged_weights, "merged model")
    comm.new_layer()
    ctx.owners = comm.owners(plan, cal_layer)
    owned = comm.local_plan(plan, ctx.owners)  # the groups this rank folds and solves (all of them in one process)
    systems: dict[str, GroupSystem] = {}
    expert_out: dict[str, list[torch.Tensor]] = {}
    for task, expert_weights in tensors.experts.items():
        with timer.phase("load"):
            expert_layer = runner.build(layer, expert_weights, f"expert {task}")
        stats = record_task(ctx, task, cal_layer, expert_layer)
        if probe is not None:
            with timer.phase("forward"):
                expert_out[task] = outputs(runner, expert_layer, probe.batches[task], probe.expert[task], ctx.store)
        del expert_layer
        with timer.phase("reduce"):
            comm.reduce_statistics(stats, ctx.owners)
        with timer.phase("solve"):
            plan.objective.fold_task(owned, layer, systems, stats, expert_weights, task)
        del stats
    record: dict = {}
    cal_out = None
    if probe is not None:
        with timer.phase("forward"):
            merged_out = {task: outputs(runner, cal_layer, b, probe.merged[task], ctx.store) for task, b in probe.batches.items()}
    if plan.tuning is not None:
        solved, record["tuning"], cal_out = select_layer(ctx, layer, systems, tensors, expert_out)
    else:
        with timer.phase("solve"):
            solved = comm.solve_layer(ctx, layer, systems, tensors)
    del systems
    with timer.phase("load"):
        cal_layer = runner.build(layer, {**merged_weights, **solved}, "merged model")
    if probe is not None:
        if cal_out is None:
            with timer.phase("forward"):
                cal_out = {task: outputs(runner, cal_layer, b, probe.cal[task], ctx.store) for task, b in probe.batches.items()}
        record["drift"] = {
            kind: reduced_drifts(comm, out, expert_out, probe.batches, runner.device) for kind, out in (("merged", merged_out), ("calibrated", cal_out))
        }
        probe.cal, probe.expert, probe.merged = cal_out, expert_out, merged_out
    prefix = plan.architecture.prefix(layer)
    with timer.phase("write"):
        ctx.staging.commit(layer, {prefix + name: tensor for name, tensor in solved.items()}, record or None)
    recording = getattr(plan.objective, "recording", None)
    if recording is None or recording.stream == "cal":  # RegMean's statistics never read h_cal: it is not advanced
        for task, task_batches in ctx.batches.items():
            advance(ctx, cal_layer, task_batches, ctx.cal[task])
