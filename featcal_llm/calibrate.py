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

from featcal_llm.checkpoint import CheckpointReader
from featcal_llm.errors import FeatCalError
from featcal_llm.layers import LayerRunner
from featcal_llm.plan import CalibrationPlan
from featcal_llm.prefetch import LayerPrefetcher, LayerTensors
from featcal_llm.profiling import NullTimer
from featcal_llm.record import StatisticsWorkspace, record_task
from featcal_llm.resume import StagingArea
from featcal_llm.solve import (
    GroupSystem,
    add_task,
    anchor,
    ridge_solve,
    solve_bias,
    solve_norm,
)
from featcal_llm.stats import GroupStatistics
from featcal_llm.streams import HostStore, TokenBatch, embed
from featcal_llm.transfer import on_device


@dataclass
class Models:
    merged: CheckpointReader
    base: CheckpointReader
    experts: dict[str, CheckpointReader]  # task name → expert checkpoint


Streams = dict[str, list[torch.Tensor]]  # task → one host tensor per batch


def initial_streams(models: Models, plan: CalibrationPlan, batches: dict[str, list[TokenBatch]], dtype: torch.dtype, store: HostStore) -> tuple[Streams, Streams]:
    """h_cal from the merged embedding for every task; h_exp,i from expert i's own embedding."""
    name = plan.architecture.embed_tokens
    merged_embedding = models.merged.get(name)
    cal = {task: [embed(b, merged_embedding, dtype, store) for b in task_batches] for task, task_batches in batches.items()}
    del merged_embedding
    experts = {}
    for task, task_batches in batches.items():
        embedding = models.experts[task].get(name)
        vocabulary = embedding.shape[0]
        largest = max(int(b.input_ids.max()) for b in task_batches)
        if largest >= vocabulary:
            raise FeatCalError(f"expert {task}: vocabulary of {vocabulary} tokens cannot embed calibration token id {largest}")
        experts[task] = [embed(b, embedding, dtype, store) for b in task_batches]
    return cal, experts


def advance(
    runner: LayerRunner, layer: torch.nn.Module, batches: list[TokenBatch], stream: list[torch.Tensor], store: HostStore, timer=NullTimer()
) -> None:
    """Replace the stream, batch by batch and in place, by `layer` applied to it."""
    with timer.phase("forward"):
        for index, (batch, (hidden,)) in enumerate(zip(batches, on_device(runner.device, stream))):
            stream[index] = store.store(runner.forward(layer, hidden, runner.context(batch, hidden)), batch.keep)


def fold_task(
    plan: CalibrationPlan,
    systems: dict[str, GroupSystem],
    stats: dict[str, GroupStatistics],
    expert_weights: dict[str, torch.Tensor],
) -> None:
    """Add one task's statistics to every input group's system (so they can be freed)."""
    for group in plan.groups():
        selected = plan.selected(group)
        systems[group.name] = add_task(
            systems.get(group.name),
            stats[group.name],
            {p: expert_weights[f"{p}.weight"] for p in selected},
            {p: expert_weights[f"{p}.bias"] for p in selected if plan.biases and f"{p}.bias" in expert_weights},
            expert_weights.get(f"{group.norm}.weight") if group.norm else None,
            plan.hyper.alpha,
            plan.hyper.eps,
        )


def solve_layer(
    plan: CalibrationPlan,
    systems: dict[str, GroupSystem],
    merged: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor],
    layer: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Calibrated tensors of one layer (names relative to the layer), in the merged checkpoint's dtypes."""
    hyper = plan.hyper
    solved: dict[str, torch.Tensor] = {}

    def anchored(name: str) -> torch.Tensor:
        return anchor(merged[name].to(device), base[name].to(device), hyper.rho)

    for group in plan.groups():
        system = systems[group.name]
        selected = plan.selected(group)
        if selected:
            solutions = ridge_solve(
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
) -> None:
    """Advance every stream through an already calibrated layer (resume): forward passes only."""
    cal_layer = runner.build(layer, {**tensors.merged, **calibrated}, "merged model")
    for task, task_batches in batches.items():
        advance(runner, cal_layer, task_batches, cal_streams[task], store)
        expert_layer = runner.build(layer, tensors.experts[task], f"expert {task}")
        advance(runner, expert_layer, task_batches, expert_streams[task], store)


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
) -> dict[str, Path]:
    """Run the whole forward-order schedule; returns tensor name → staged file holding its new value.

    Layers the staging area already holds are replayed, not recomputed.
    """
    cal_streams, expert_streams = initial_streams(models, plan, batches, runner.dtype, store)
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
                replay_layer(layer, tensors, runner, batches, calibrated, cal_streams, expert_streams, store)
            else:
                calibrate_layer(layer, tensors, plan, runner, batches, cal_streams, expert_streams, staging, store, workspace, timer)
            del tensors
            bar.update(1)
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
) -> None:
    """Record, solve, stage and advance one layer (steps 2a-2c of the schedule)."""
    merged_weights = tensors.merged
    with timer.phase("load"):
        cal_layer = runner.build(layer, merged_weights, "merged model")
    systems: dict[str, GroupSystem] = {}
    for task, expert_weights in tensors.experts.items():
        with timer.phase("load"):
            expert_layer = runner.build(layer, expert_weights, f"expert {task}")
        stats = record_task(
            layer, runner, plan, cal_layer, expert_layer, batches[task], cal_streams[task], expert_streams[task], store, workspace, timer
        )
        del expert_layer
        with timer.phase("solve"):
            fold_task(plan, systems, stats, expert_weights)
        del stats
    with timer.phase("solve"):
        solved = solve_layer(plan, systems, merged_weights, tensors.base, layer, runner.device)
    del systems
    prefix = plan.architecture.prefix(layer)
    with timer.phase("write"):
        staging.commit(layer, {prefix + name: tensor for name, tensor in solved.items()})
    with timer.phase("load"):
        cal_layer = runner.build(layer, {**merged_weights, **solved}, "merged model")
    for task, task_batches in batches.items():
        advance(runner, cal_layer, task_batches, cal_streams[task], store, timer)
