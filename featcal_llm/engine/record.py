"""Step 2a of the schedule: run cal's layer and expert i's layer on one task's batches, with hooks.

Forward hooks on the real decoder layers feed the pure accumulators of
`stats.py`; only non-padding tokens are kept. Statistics buffers are
allocated once and reused (zeroed) for every task and layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from featcal_llm.engine.plan import CalibrationPlan
from featcal_llm.engine.transfer import on_device
from featcal_llm.errors import RunFailure, float16_cause
from featcal_llm.family.layers import LayerRunner, hooked, norm_epsilon
from featcal_llm.maths.advantage import weighted_rows
from featcal_llm.maths.stats import (
    TOTAL_DTYPE,
    GroupStatistics,
    accumulate_cross,
    accumulate_gram,
    accumulate_moment,
    accumulate_normalized_square,
    accumulate_sum,
    cross_moment_pays,
)

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext


class StatisticsWorkspace:
    """Statistics buffers allocated once and zeroed per task: a fresh multi-GB allocation per task costs seconds of page faults."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, dict[str, GroupStatistics]] = {}

    def zeroed(self, plan: CalibrationPlan, layer: torch.nn.Module, runner: LayerRunner, grams_only: bool = False) -> dict[str, GroupStatistics]:
        """Each group's statistics, zeroed; `grams_only`: the Gram alone (an objective that needs nothing else)."""
        key = (grams_only,) + tuple(
            (group.name, tuple((p, tuple(layer.get_submodule(p).weight.shape), layer.get_submodule(p).bias is not None) for p in group.projections))
            for group in plan.groups()
        )
        if key not in self._buffers:
            self._buffers.clear()
            self._buffers[key] = {
                group.name: GroupStatistics.empty(
                    layer.get_submodule(group.projections[0]).in_features,
                    {} if grams_only else {p: layer.get_submodule(p).out_features for p in plan.selected(group)},
                    with_means=not grams_only and plan.biases and any(layer.get_submodule(p).bias is not None for p in plan.selected(group)),
                    with_norm=not grams_only and plan.norms and group.norm is not None,
                    device=runner.device,
                )
                for group in plan.groups()
            }
        stats = self._buffers[key]
        for group_stats in stats.values():
            group_stats.reset()
        return stats


def _compose(callbacks: dict[str, list[Callable]], timer) -> dict[str, Callable]:
    def chain(functions):
        def run(x, y):
            with timer.phase("statistics"):
                for function in functions:
                    function(x, y)
        return run
    return {path: chain(functions) for path, functions in callbacks.items()}


def record_task(ctx: "RunContext", task: str, cal_layer: torch.nn.Module, expert_layer: torch.nn.Module) -> dict[str, GroupStatistics]:
    """One task's statistics for every input group.

    The task's expert stream is advanced in place to expert i's layer output
    (h_exp for the next layer), batch by batch, so old and new streams never
    coexist.
    """
    recording = getattr(ctx.plan.objective, "recording", None)
    if recording is not None:  # RegMean / RegMean++: Grams only, on expert i's layer
        return record_grams(ctx, task, expert_layer, recording.stream)
    plan, runner, timer = ctx.plan, ctx.runner, ctx.timer
    batches, cal_stream, expert_stream = ctx.batches[task], ctx.cal[task], ctx.expert[task]
    device, precision = runner.device, runner.stats_dtype  # float64 totals; each batch's products in `precision`
    stats = ctx.workspace.zeroed(plan, cal_layer, runner)
    task_tokens = ctx.comm.sum_int(sum(batch.tokens for batch in batches))  # every rank records the same way
    for group_stats in stats.values():
        # wide groups: one moment Σ x_exp x_calᵀ, crosses W_i,p · moment after the task (fewer FLOPs, same sums)
        group_stats.via_moment = group_stats.moment is not None and cross_moment_pays(
            task_tokens, group_stats.gram.shape[0], sum(c.shape[0] for c in group_stats.cross.values())
        )
    roots = ctx.token_roots[task] if ctx.token_roots is not None else None
    for index, (batch, (h_cal, h_exp)) in enumerate(zip(batches, on_device(device, cal_stream, expert_stream))):
        keep = batch.keep.to(device)
        # √w of each kept token (float64): Grams take it on both sides, the expert side of every cross, moment and
        # sum takes w = (√w)² and the merged side's rows stay as they are, each scaled in the statistics' precision
        root = None if roots is None else roots[index].to(device)[keep]
        weight = None if root is None else root * root
        x_cal = {}  # input group → this batch's x_cal rows (unweighted, compute dtype), shared by the expert hooks
        cal_hooks: dict[str, list[Callable]] = {}
        expert_hooks: dict[str, list[Callable]] = {}
        for group in plan.groups():
            group_stats = stats[group.name]

            def on_cal_input(x, _y, name=group.name, s=group_stats):
                rows = x_cal[name] = x[keep]
                accumulate_gram(s.gram, weighted_rows(rows, root, precision), precision)
                if s.sum_cal is not None:
                    accumulate_sum(s.sum_cal, weighted_rows(rows, weight, TOTAL_DTYPE))

            cal_hooks.setdefault(group.projections[0], []).append(on_cal_input)
            if group_stats.norm_sq is not None:
                epsilon = norm_epsilon(cal_layer.get_submodule(group.norm))
                cal_hooks.setdefault(group.norm, []).append(
                    lambda x, _y, s=group_stats, e=epsilon: accumulate_normalized_square(s.norm_sq, x[keep], e, root)
                )
            if group_stats.sum_exp is not None:
                expert_hooks.setdefault(group.projections[0], []).append(
                    lambda x, _y, s=group_stats: accumulate_sum(s.sum_exp, weighted_rows(x[keep], weight, TOTAL_DTYPE))
                )
            if group_stats.via_moment:  # the group's first projection sees x_exp as its input
                expert_hooks.setdefault(group.projections[0], []).append(
                    lambda x, _y, name=group.name, s=group_stats: accumulate_moment(s.moment, weighted_rows(x[keep], weight, precision), x_cal[name], precision)
                )
                continue
            for projection in plan.selected(group):
                module = expert_layer.get_submodule(projection)

                def on_expert_output(_x, y, name=group.name, s=group_stats, p=projection, m=module):
                    rows = y[keep]  # y_exp = W_i x_exp (+ b_i): the bias comes off in the statistics' precision
                    if m.bias is not None:
                        wide = torch.promote_types(rows.dtype, precision)
                        rows = rows.to(wide) - m.bias.to(wide)
                    accumulate_cross(s.cross[p], weighted_rows(rows, weight, precision), x_cal[name], precision)

                expert_hooks.setdefault(projection, []).append(on_expert_output)

        context = runner.context(batch, h_cal)
        with torch.no_grad(), timer.phase("forward"):
            with hooked(cal_layer, _compose(cal_hooks, timer)):
                runner.forward(cal_layer, h_cal, context)
            with hooked(expert_layer, _compose(expert_hooks, timer)):
                h_next = runner.forward(expert_layer, h_exp, context)
        _advance_expert(ctx, task, cal_layer.featcal_index, expert_stream, index, h_next, batch, keep)
        _count(ctx, stats, batch)
        del h_cal, h_exp, h_next
    return stats


def _advance_expert(ctx: "RunContext", task: str, layer: int, stream: list, index: int, output: torch.Tensor, batch, keep: torch.Tensor) -> None:
    """Expert i's layer output replaces its input in the stream (h_exp for the next layer), once checked finite."""
    if not bool(torch.isfinite(output[keep]).all()):
        raise RunFailure(f"layer {layer}: expert {task} produced NaN/Inf hidden states{float16_cause(output.dtype)}")
    stream[index] = ctx.store.store(output, batch.keep)


def _count(ctx: "RunContext", stats: dict[str, GroupStatistics], batch) -> None:
    for s in stats.values():
        s.tokens += batch.tokens
    ctx.progress.tokens(batch.tokens)


def record_grams(ctx: "RunContext", task: str, expert_layer: torch.nn.Module, stream: str) -> dict[str, GroupStatistics]:
    """Σ x xᵀ of each input group's input inside expert i's layer, the layer fed by `stream` (non-padding tokens only).

    `expert` (RegMean): expert i's own hidden states, advanced in place to the
    layer's output. `cal` (RegMean++): the model being built; that stream is
    advanced by the loop through the solved layer, so nothing is stored here.
    One forward pass per batch and one Gram per group: the merged layer never
    runs over the calibration records, and no crosses are formed.
    """
    plan, runner, timer = ctx.plan, ctx.runner, ctx.timer
    batches = ctx.batches[task]
    hidden_stream = ctx.expert[task] if stream == "expert" else ctx.cal[task]
    stats = ctx.workspace.zeroed(plan, expert_layer, runner, grams_only=True)
    for index, (batch, (hidden,)) in enumerate(zip(batches, on_device(runner.device, hidden_stream))):
        keep = batch.keep.to(runner.device)
        hooks = {
            group.projections[0]: [lambda x, _y, s=stats[group.name]: accumulate_gram(s.gram, x[keep], runner.stats_dtype)]
            for group in plan.groups()
        }
        with torch.no_grad(), timer.phase("forward"), hooked(expert_layer, _compose(hooks, timer)):
            output = runner.forward(expert_layer, hidden, runner.context(batch, hidden))
        if stream == "expert":
            _advance_expert(ctx, task, expert_layer.featcal_index, hidden_stream, index, output, batch, keep)
        _count(ctx, stats, batch)
        del hidden, output
    return stats
