"""The forward-order FeatCal loop over decoder layers (featcal_method.md, "Forward-order schedule").

For layer l: load layer l of the merged model (the `cal` layer, still merged)
and of each expert; record statistics with hooks while running cal on h_cal
and expert i on h_exp,i; fold each task into the group systems; solve; load
the solution into cal; advance h_cal through the *updated* layer. Only one
layer of each model exists at a time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from featcal_llm.maths.candidates import SharedSystem, add_task_shared
from featcal_llm.io.checkpoint import CheckpointReader
from featcal_llm.engine.drift import Head, Probe, next_token_kls, outputs, relative_drift
from featcal_llm.errors import FeatCalError
from featcal_llm.family.layers import LayerRunner
from featcal_llm.engine.plan import CalibrationPlan, Hyperparameters
from featcal_llm.engine.prefetch import LayerPrefetcher, LayerTensors
from featcal_llm.engine.profiling import NullTimer
from featcal_llm.engine.record import StatisticsWorkspace, record_task
from featcal_llm.engine.resume import StagingArea
from featcal_llm.maths.solve import (
    GroupSystem,
    add_task,
    anchor,
    ridge_solve,
    solve_bias,
    solve_norm,
)
from featcal_llm.maths.stats import GroupStatistics
from featcal_llm.engine.streams import HostStore, TokenBatch
from featcal_llm.engine.transfer import on_device
from featcal_llm.engine.tuned import select_layer


@dataclass
class Models:
    merged: CheckpointReader
    base: CheckpointReader
    experts: dict[str, CheckpointReader]  # task name → expert checkpoint


Streams = dict[str, list[torch.Tensor]]  # task → one host tensor per batch


def initial_streams(models: Models, plan: CalibrationPlan, batches: dict[str, list[TokenBatch]], runner: LayerRunner, store: HostStore) -> tuple[Streams, Streams]:
    """h_cal from the merged embedding for every task; h_exp,i from expert i's own (both through the family's embedding step)."""
    name = plan.architecture.embed_tokens

    def stream(reader: CheckpointReader, task_batches: list[TokenBatch], what: str) -> list[torch.Tensor]:
        embedding = reader.get(name)
        return [store.store(runner.embed(b, embedding, what), b.keep) for b in task_batches]

    cal = {task: stream(models.merged, task_batches, "merged model") for task, task_batches in batches.items()}
    experts = {task: stream(models.experts[task], task_batches, f"expert {task}") for task, task_batches in batches.items()}
    return cal, experts


def advance(
    runner: LayerRunner, layer: torch.nn.Module, batches: list[TokenBatch], stream: list[torch.Tensor], store: HostStore, timer=NullTimer()
) -> None:
    """Replace the stream, batch by batch and in place, by `layer` applied to it."""
    with timer.phase("forward"):
        for index, (batch, (hidden,)) in enumerate(zip(batches, on_device(runner.device, stream))):
            output = runner.forward(layer, hidden, runner.context(batch, hidden))
            if not bool(torch.isfinite(output[batch.keep.to(output.device)]).all()):  # caught where it appears, not a layer later
                raise FeatCalError(f"layer {getattr(layer, 'featcal_index', '?')}: calibrated layer produced NaN/Inf hidden states")
            stream[index] = store.store(output, batch.keep)


def fold_task(
    plan: CalibrationPlan,
    systems: dict[str, GroupSystem | SharedSystem],
    stats: dict[str, GroupStatistics],
    expert_weights: dict[str, torch.Tensor],
) -> None:
    """Add one task's statistics to every input group's system (so they can be freed).

    A tuned run folds into α-independent `SharedSystem`s instead.
    """
    for group in plan.groups():
        selected = plan.selected(group)
        weights = {p: expert_weights[f"{p}.weight"] for p in selected}
        biases = {p: expert_weights[f"{p}.bias"] for p in selected if plan.biases and f"{p}.bias" in expert_weights}
        norm = expert_weights.get(f"{group.norm}.weight") if group.norm else None
        if plan.tuning is not None:
            systems[group.name] = add_task_shared(systems.get(group.name), stats[group.name], weights, biases, norm, plan.hyper.eps)
        else:
            systems[group.name] = add_task(
                systems.get(group.name), stats[group.name], weights, biases, norm, plan.hyper.alpha, plan.hyper.eps
            )


def _ridge(group: str, lhs, rhs, anchors, lam: float, eps: float, where: str) -> dict[str, torch.Tensor]:
    return ridge_solve(lhs, rhs, anchors, lam, eps, where)


def solve_layer(
    plan: CalibrationPlan,
    systems: dict[str, GroupSystem],
    merged: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor],
    layer: int,
    device: torch.device,
    hyper: Hyperparameters | None = None,
    ridge=_ridge,
) -> dict[str, torch.Tensor]:
    """Calibrated tensors of one layer (names relative to the layer), in the merged checkpoint's dtypes.

    `hyper` defaults to the plan's; `ridge(group, lhs, rhs, anchors, λ, eps, where)` solves the
    weights (a tuned run passes factors shared across candidates).
    """
    hyper = hyper or plan.hyper
    solved: dict[str, torch.Tensor] = {}

    def anchored(name: str) -> torch.Tensor:
        return anchor(merged[name].to(device), base[name].to(device), hyper.rho)

    for group in plan.groups():
        system = systems[group.name]
        selected = plan.selected(group)
        if selected:
            solutions = ridge(
                group.name,
                system.lhs,
                {p: system.rhs[p] for p in selected},
                {p: anchored(f"{p}.weight") for p in selected},
                hyper.lam,
                hyper.eps,
                where=f"layer {layer} {group.name}",
            )
            for projection, weight in solutions.items():
                solved[f"{projection}.weight"] = weight
                if projection in system.bias_sum:
                    solved[f"{projection}.bias"] = solve_bias(system, projection, weight, anchored(f"{projection}.bias"), hyper.lam)
        if plan.norms and group.norm:
            solved[f"{group.norm}.weight"] = solve_norm(system, anchored(f"{group.norm}.weight"), hyper.lam)
    for name, tensor in solved.items():
        if not bool(torch.isfinite(tensor).all()):
            raise FeatCalError(f"layer {layer}: solution for {name} has NaN/Inf")
        solved[name] = tensor.to(dtype=merged[name].dtype).cpu()
    return solved


def replay_layer(
    layer: int,
    tensors: LayerTensors,
    runner: LayerRunner,
    batches: dict[str, list[TokenBatch]],
    calibrated: dict[str, torch.Tensor],
    cal_streams: Streams,
    expert_streams: Streams,
    store: HostStore,
    probe: Probe | None = None,
) -> None:
    """Advance every stream through an already calibrated layer (resume): forward passes only."""
    cal_layer = runner.build(layer, {**tensors.merged, **calibrated}, "merged model")
    for task, task_batches in batches.items():
        advance(runner, cal_layer, task_batches, cal_streams[task], store)
        expert_layer = runner.build(layer, tensors.experts[task], f"expert {task}")
        advance(runner, expert_layer, task_batches, expert_streams[task], store)
        if probe is not None:
            advance(runner, expert_layer, probe.batches[task], probe.expert[task], store)
            advance(runner, cal_layer, probe.batches[task], probe.cal[task], store)
    if probe is not None:
        merged_layer = runner.build(layer, tensors.merged, "merged model")
        for task, task_batches in probe.batches.items():
            advance(runner, merged_layer, task_batches, probe.merged[task], store)


def start_probe(models: Models, plan: CalibrationPlan, probe: Probe, runner: LayerRunner, store: HostStore) -> None:
    """Embed the probe records: cal and merged streams from the merged embedding, expert i's from its own."""
    probe.cal, probe.expert = initial_streams(models, plan, probe.batches, runner, store)
    probe.merged = {task: [store.store(h, b.keep) for h, b in zip(stream, probe.batches[task])] for task, stream in probe.cal.items()}


def output_divergence(models: Models, runner: LayerRunner, probe: Probe) -> dict[str, dict[str, float]]:
    """Mean next-token KL(expert i ‖ model) on expert i's probe records, for the merged and the calibrated model."""
    merged_head = Head(runner, models.merged)
    result: dict[str, dict[str, float]] = {"merged": {}, "calibrated": {}}
    for task, batches in probe.batches.items():
        expert_head = Head(runner, models.experts[task])
        compared = [(merged_head, probe.merged[task]), (merged_head, probe.cal[task])]
        result["merged"][task], result["calibrated"][task] = next_token_kls(compared, expert_head, probe.expert[task], batches)
    return result


def calibrate(
    models: Models,
    plan: CalibrationPlan,
    runner: LayerRunner,
    batches: dict[str, list[TokenBatch]],
    num_layers: int,
    staging: StagingArea,
    store: HostStore,
    progress: bool = True,
    timer=NullTimer(),
    probe: Probe | None = None,
) -> dict[str, Path]:
    """Run the whole forward-order schedule; returns tensor name → staged file holding its new value.

    Layers the staging area already holds are replayed, not recomputed. With a
    `probe`, every layer's drift (and a tuned run's choice) is recorded in the
    staging area, and `probe.divergence` holds the final output divergence.
    A tuned plan needs the probe: its records are the held-out ones.
    """
    if plan.tuning is not None and probe is None:
        raise FeatCalError("internal: a tuned run needs its held-out records as the probe")
    cal_streams, expert_streams = initial_streams(models, plan, batches, runner, store)
    if probe is not None:
        start_probe(models, plan, probe, runner, store)
    heads = None
    if plan.tuning is not None and plan.tuning.criterion == "output":
        heads = {"merged": Head(runner, models.merged), **{task: Head(runner, reader) for task, reader in models.experts.items()}}
    total_tokens = sum(b.tokens for task_batches in batches.values() for b in task_batches)
    prefetcher = LayerPrefetcher(
        models.merged, models.base, models.experts, plan.architecture.prefix, num_layers, pin=runner.device.type == "cuda"
    )
    workspace = StatisticsWorkspace()
    bar = tqdm(total=num_layers, desc="FeatCal", unit="layer", file=sys.stderr, disable=not progress)
    bar.set_postfix(tokens=total_tokens, tasks=len(batches))
    try:
        for layer in range(num_layers):
            with timer.phase("read"):
                tensors = prefetcher.get(layer)
            if layer < staging.completed:
                prefix = plan.architecture.prefix(layer)
                calibrated = {name[len(prefix):]: t for name, t in staging.load(layer).items()}
                replay_layer(layer, tensors, runner, batches, calibrated, cal_streams, expert_streams, store, probe)
            else:
                calibrate_layer(
                    layer, tensors, plan, runner, batches, cal_streams, expert_streams, staging, store, workspace, timer, probe, heads
                )
            del tensors
            bar.update(1)
        if probe is not None:
            probe.divergence = output_divergence(models, runner, probe)
    finally:
        prefetcher.close()
        bar.close()
    return staging.replacements()


def calibrate_layer(
    layer: int,
    tensors: LayerTensors,
    plan: CalibrationPlan,
    runner: LayerRunner,
    batches: dict[str, list[TokenBatch]],
    cal_streams: Streams,
    expert_streams: Streams,
    staging: StagingArea,
    store: HostStore,
    workspace: StatisticsWorkspace,
    timer=NullTimer(),
    probe: Probe | None = None,
    heads: dict[str, Head] | None = None,
) -> None:
    """Record, solve (or select), stage and advance one layer (steps 2a-2c of the schedule)."""
    merged_weights = tensors.merged
    with timer.phase("load"):
        cal_layer = runner.build(layer, merged_weights, "merged model")
    systems: dict[str, GroupSystem | SharedSystem] = {}
    expert_out: dict[str, list[torch.Tensor]] = {}
    for task, expert_weights in tensors.experts.items():
        with timer.phase("load"):
            expert_layer = runner.build(layer, expert_weights, f"expert {task}")
        stats = record_task(
            layer, runner, plan, cal_layer, expert_layer, batches[task], cal_streams[task], expert_streams[task], store, workspace, timer
        )
        if probe is not None:
            with timer.phase("forward"):
                expert_out[task] = outputs(runner, expert_layer, probe.batches[task], probe.expert[task], store)
        del expert_layer
        with timer.phase("solve"):
            fold_task(plan, systems, stats, expert_weights)
        del stats
    record: dict = {}
    cal_out = None
    if probe is not None:
        with timer.phase("forward"):
            merged_out = {task: outputs(runner, cal_layer, b, probe.merged[task], store) for task, b in probe.batches.items()}
    if plan.tuning is not None:
        solved, record["tuning"], cal_out = select_layer(
            layer, plan, runner, systems, merged_weights, tensors.base, probe, expert_out, store, solve_layer, heads, timer
        )
    else:
        with timer.phase("solve"):
            solved = solve_layer(plan, systems, merged_weights, tensors.base, layer, runner.device)
    del systems
    with timer.phase("load"):
        cal_layer = runner.build(layer, {**merged_weights, **solved}, "merged model")
    if probe is not None:
        if cal_out is None:
            with timer.phase("forward"):
                cal_out = {task: outputs(runner, cal_layer, b, probe.cal[task], store) for task, b in probe.batches.items()}
        record["drift"] = {
            kind: {task: relative_drift(out[task], expert_out[task], b, runner.device) for task, b in probe.batches.items()}
            for kind, out in (("merged", merged_out), ("calibrated", cal_out))
        }
        probe.cal, probe.expert, probe.merged = cal_out, expert_out, merged_out
    prefix = plan.architecture.prefix(layer)
    with timer.phase("write"):
        staging.commit(layer, {prefix + name: tensor for name, tensor in solved.items()}, record or None)
    for task, task_batches in batches.items():
        advance(runner, cal_layer, task_batches, cal_streams[task], store, timer)
