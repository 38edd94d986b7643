"""One layer of a tuned run: solve each candidate from the shared statistics, score it on the held-out records, keep the best.

Candidates are evaluated one at a time; only the best one's held-out outputs are
kept, so memory stays at one layer plus two held-out streams.
"""

from __future__ import annotations

from typing import Callable

import torch

from featcal_llm.maths.candidates import RidgeFactors, SharedSystem, system_for
from featcal_llm.engine.drift import Head, Probe, next_token_kl, outputs, relative_drift
from featcal_llm.family.layers import LayerRunner
from featcal_llm.engine.plan import CalibrationPlan, Hyperparameters
from featcal_llm.engine.profiling import NullTimer
from featcal_llm.engine.streams import HostStore
from featcal_llm.engine.tuning import as_values, coordinate_search


def criterion(
    name: str, probe: Probe, candidate: dict[str, list[torch.Tensor]], expert: dict[str, list[torch.Tensor]],
    heads: dict[str, Head] | None, device: torch.device | None = None,
) -> float:
    """Mean over experts (equal weights) of the held-out drift (`hidden`) or logit-lens KL (`output`)."""
    values = []
    for task, batches in probe.batches.items():
        if name == "output":
            values.append(next_token_kl(heads["merged"], candidate[task], heads[task], expert[task], batches))
        else:
            values.append(relative_drift(candidate[task], expert[task], batches, device))
    return sum(values) / len(values)


def select_layer(
    layer: int,
    plan: CalibrationPlan,
    runner: LayerRunner,
    shared: dict[str, SharedSystem],
    merged: dict[str, torch.Tensor],
    base: dict[str, torch.Tensor],
    probe: Probe,
    expert_out: dict[str, list[torch.Tensor]],
    store: HostStore,
    solve: Callable,
    heads: dict[str, Head] | None = None,
    timer=NullTimer(),
) -> tuple[dict[str, torch.Tensor], dict, dict[str, list[torch.Tensor]]]:
    """(winner's tensors, this layer's tuning record, the winner's held-out layer outputs).

    `solve(plan, systems, merged, base, layer, device, hyper=, ridge=)` is calibrate.solve_layer.
    """
    search = plan.tuning
    factors = RidgeFactors()
    kept: dict = {}

    def evaluate(hyper: Hyperparameters) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]], float]:
        with timer.phase("solve"):
            systems = {name: system_for(system, hyper.alpha) for name, system in shared.items()}
            solved = solve(plan, systems, merged, base, layer, runner.device, hyper=hyper, ridge=factors.solve)
        with timer.phase("load"):
            candidate_layer = runner.build(layer, {**merged, **solved}, "merged model")
        with timer.phase("forward"):
            out = {task: outputs(runner, candidate_layer, batches, probe.cal[task], store) for task, batches in probe.batches.items()}
        return solved, out, criterion(search.criterion, probe, out, expert_out, heads, runner.device)

    def score(hyper: Hyperparameters) -> float:
        solved, out, value = evaluate(hyper)
        if not kept or value < kept["value"]:
            kept.update(hyper=hyper, solved=solved, out=out, value=value)
        return value

    winner, table = coordinate_search(search, score)
    if kept["hyper"] != winner:  # an exact tie resolved differently: recompute the winner (deterministic)
        solved, out, value = evaluate(winner)
        kept.update(hyper=winner, solved=solved, out=out, value=value)
    record = {
        "candidates": [{**as_values(hyper), "criterion": value} for hyper, value in table],
        "chosen": {**as_values(winner), "criterion": kept["value"]},
    }
    return kept["solved"], record, kept["out"]
