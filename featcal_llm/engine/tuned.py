"""One layer of a tuned run: solve each candidate from the shared statistics, score it on the held-out records, keep the best.

Candidates are evaluated one at a time; only the best one's held-out outputs are
kept, so memory stays at one layer plus two held-out streams. A candidate
whose solve fails, whose weights or outputs are not finite, or whose score is
not finite scores +inf (reported as such): it loses to every finite one, and
the layer fails only when no candidate is finite.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from featcal_llm.engine.drift import Heads, Probe, next_token_kl, outputs, reduced_drifts, relative_drift
from featcal_llm.engine.prefetch import LayerTensors
from featcal_llm.engine.tuning import as_values, coordinate_search, criterion_value
from featcal_llm.errors import FeatCalError, RunFailure, warn
from featcal_llm.maths.objective import GroupSystem, Hyperparameters
from featcal_llm.maths.solve import RidgeSolver

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext


def criterion(
    name: str, probe: Probe, candidate: dict[str, list[torch.Tensor]], expert: dict[str, list[torch.Tensor]],
    heads: Heads | None, device: torch.device | None = None, comm=None,
) -> float:
    """The held-out score of one candidate over every rank's records, lower is better.

    `hidden`: the arithmetic mean over experts of the relative drift, already a
    scale-free number per expert. `output`: the geometric mean over experts of
    the logit-lens KL, whose scale differs from expert to expert (in nats, larger
    for an expert further from the merge); the geometric mean counts a 10 %
    change the same for every expert, so the expert with the largest KL does not
    decide the layer alone.
    """
    if name == "output":
        return geometric_mean([next_token_kl(heads.merged, candidate[task], heads.experts[task], expert[task], batches, comm)
                               for task, batches in probe.batches.items()])
    if comm is not None:
        values = list(reduced_drifts(comm, candidate, expert, probe.batches, device).values())
    else:
        values = [relative_drift(candidate[task], expert[task], batches, device) for task, batches in probe.batches.items()]
    return sum(values) / len(values)


def geometric_mean(values: list[float]) -> float:
    """exp(mean log v); a zero (an exact match) counts as the smallest positive float, so the mean stays finite."""
    return math.exp(sum(math.log(max(value, math.ulp(0.0))) for value in values) / len(values))


def _finite(streams: dict[str, list[torch.Tensor]]) -> bool:
    return all(bool(torch.isfinite(hidden).all()) for stream in streams.values() for hidden in stream)


def select_layer(
    ctx: "RunContext", layer: int, systems: dict[str, GroupSystem], tensors: LayerTensors, expert_out: dict[str, list[torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], dict, dict[str, list[torch.Tensor]]]:
    """(winner's tensors, this layer's tuning record, the winner's held-out layer outputs)."""
    plan, runner, probe, timer = ctx.plan, ctx.runner, ctx.probe, ctx.timer
    search = plan.tuning
    solver = RidgeSolver(keep_lhs=True)
    kept: dict = {}
    failures: list[str] = []

    def evaluate(hyper: Hyperparameters) -> tuple[dict[str, torch.Tensor] | None, dict[str, list[torch.Tensor]] | None, float]:
        try:
            with timer.phase("solve"):
                solved = ctx.comm.solve_layer(ctx, layer, systems, tensors, hyper, solver)
        except FeatCalError as error:
            failures.append(f"{as_values(hyper)}: {error}")
            return None, None, math.inf
        with timer.phase("load"):
            candidate_layer = runner.build(layer, {**tensors.merged, **solved}, "merged model")
        with timer.phase("forward"):
            out = {task: outputs(runner, candidate_layer, batches, probe.cal[task], ctx.store) for task, batches in probe.batches.items()}
        if not ctx.comm.all_true(_finite(out)):
            failures.append(f"{as_values(hyper)}: NaN/Inf held-out hidden states")
            return None, None, math.inf
        value = criterion(search.criterion, probe, out, expert_out, ctx.heads, runner.device, ctx.comm)
        if not math.isfinite(value):
            failures.append(f"{as_values(hyper)}: criterion {value}")
            return None, None, math.inf
        return solved, out, value

    def score(hyper: Hyperparameters) -> float:
        solved, out, value = evaluate(hyper)
        if solved is not None and (not kept or value < kept["value"]):
            kept.update(hyper=hyper, solved=solved, out=out, value=value)
        return value

    winner, table = coordinate_search(search, score)
    for failure in failures:
        warn(f"layer {layer}: candidate {failure}: scored +inf")
    if not kept:
        raise RunFailure(f"layer {layer}: no candidate setting gave finite weights, hidden states and criterion ({len(table)} tried)")
    if kept["hyper"] != winner:  # an exact tie resolved differently: recompute the winner (deterministic)
        solved, out, value = evaluate(winner)
        kept.update(hyper=winner, solved=solved, out=out, value=value)
    record = {
        "candidates": [{**as_values(hyper), "criterion": criterion_value(value)} for hyper, value in table],
        "chosen": {**as_values(winner), "criterion": kept["value"]},
    }
    return kept["solved"], record, kept["out"]
