"""The coverage pass: every expert's and the base's next-token NLL on every expert's records, layer by layer.

Before the calibration loop, a sample of each expert's calibration records is
run through the base and through every expert, one decoder layer at a time (the
same streaming as the loop: one layer of each model on the device, hidden
states on the host), and scored by each model's own final norm and LM head.
The NLLs give the experts' coverage weights (maths/coverage.py). Each rank
scores its shard of the sample and the sums are added, so ranks agree.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from featcal_llm import runlog
from featcal_llm.engine.drift import Head, spaced_sample
from featcal_llm.engine.scoring import final_hidden, response_positions, scored_positions, token_log_probs
from featcal_llm.engine.streams import make_batches
from featcal_llm.engine.transfer import on_device
from featcal_llm.errors import RunFailure, warn
from featcal_llm.io.names import short_names
from featcal_llm.maths.advantage import lead_moments
from featcal_llm.maths.coverage import COVERAGE_RECORDS, Losses, behind_the_base, coverage_shares, coverage_weights

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext

BASE = "base"


@dataclass(frozen=True)
class CoveragePass:
    """What the pass measured: each expert's and the base's mean NLL on each expert's records, and each expert's lead
    over each other expert on that expert's records, record by record (for `teachers: best`)."""

    losses: Losses  # expert i → expert j whose records → mean NLL
    base: dict[str, float]  # expert j → the base's mean NLL on j's records
    leads: dict[str, dict[str, list[float]]]  # expert i → expert j → lead_moments of j over i on i's judged tokens


def model_losses(ctx: "RunContext", sequences: dict[str, list[list[int]]], num_layers: int, batch_tokens: int) -> CoveragePass:
    """Mean next-token NLL of each expert (and of the base) on a sample of each expert's records, and the record-by-
    record leads of each expert over each record's own expert (on the judged tokens: the responses of prompt/response
    records, every token of plain text, as the lead over the merge is judged).

    `sequences`: this rank's shard of the sample; the results are summed over every rank.
    """
    models, runner = ctx.models, ctx.runner
    readers = {(BASE,): models.base, **{(name,): reader for name, reader in models.experts.items()}}
    batches = {task: make_batches(seqs, batch_tokens, pad_id=0) for task, seqs in sequences.items()}
    streams = final_hidden(ctx, {role: (reader, batches) for role, reader in readers.items()}, num_layers)
    sums: list[float] = []
    judged_sums: dict[tuple[str, str], torch.Tensor] = {}  # (model, whose records) → each record's judged log-prob sum
    for role, reader in readers.items():
        head = Head(runner, reader)
        for task, task_batches in batches.items():
            total, count, per_record = 0.0, 0, []
            for batch, (hidden,) in zip(task_batches, on_device(runner.device, streams[role][task])):
                log_probs = token_log_probs(head, hidden, batch)
                total -= float(log_probs.sum())
                count += int(scored_positions(batch).sum())
                per_record.append((log_probs * response_positions(batch)).sum(dim=1))
            sums += [total, float(count)]
            judged_sums[role[0], task] = torch.cat(per_record) if per_record else torch.zeros(0, dtype=torch.float64)
        del head
    judged = {task: torch.cat([response_positions(b).sum(dim=1) for b in task_batches]) if task_batches else torch.zeros(0)
              for task, task_batches in batches.items()}
    pairs = [(own, other) for own in batches for other in models.experts]  # other's lead over own on own's records
    moments = [value for own, other in pairs for value in lead_moments(judged_sums[other, own] - judged_sums[own, own], judged[own])]
    sums, moments = ctx.comm.sum_floats(sums), ctx.comm.sum_floats(moments)
    losses: Losses = {}
    position = 0
    for (model,) in readers:
        losses[model] = {}
        for task in batches:
            losses[model][task] = sums[position] / max(sums[position + 1], 1.0)
            position += 2
    for (model,), reader in readers.items():
        for task, loss in losses[model].items():
            if not math.isfinite(loss):
                raise RunFailure(f"expert_weights: coverage: {reader.what}'s NLL on expert {task}'s records is not finite; "
                                   "check that model's weights, or set expert_weights: equal and teachers: own (which skip this pass)")
    leads: dict[str, dict[str, list[float]]] = {}
    for index, (own, other) in enumerate(pairs):
        leads.setdefault(own, {})[other] = moments[6 * index: 6 * index + 6]
    base = losses.pop(BASE)
    return CoveragePass(losses, base, leads)


def coverage_sample(sequences: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """An evenly spaced sample of COVERAGE_RECORDS of each expert's calibration records."""
    return {task: spaced_sample(seqs, min(len(seqs), COVERAGE_RECORDS)) for task, seqs in sequences.items()}


def describe(weights: dict[str, float], losses: Losses, base: dict[str, float], names: dict[str, str], seconds: float,
             given: set[str]) -> str:
    """One log line: each expert's weight, with the share of each other expert's gain it achieves (or `given`)."""
    shares = coverage_shares(losses, base)
    parts = []
    for expert, weight in weights.items():
        others = ", ".join(f"{names[j]} {share:.2f}" for j, share in shares[expert].items() if j != expert)
        parts.append(f"{names[expert]} {weight:.2f} " + ("(data.<expert>.weight)" if expert in given else f"(1 + its share of each other's gain: {others})"))
    return f"experts weighed by coverage ({seconds:.0f} s): " + "; ".join(parts)


def expert_weights(ctx: "RunContext", featcal, sequences: dict[str, list[list[int]]],
                   num_layers: int) -> tuple[dict[str, float], Losses | None, dict[str, dict[str, list[float]]] | None]:
    """Each expert's weight in the objective: `data.<expert>.weight` where given, else by the block's `expert_weights:`.

    Returns the weights and, when the coverage pass ran (for the weights, or for `teachers: best`), its losses (model →
    records → NLL, the base under BASE) and each expert's lead over each record's own expert (CoveragePass.leads).
    """
    given = {name: spec.weight for name, spec in featcal.data.items() if "weight" in spec.model_fields_set}
    unset = [name for name in featcal.data if name not in given]
    unweighed = {name: given.get(name, 1.0) for name in featcal.data}
    weigh = featcal.balancing == "coverage" and bool(unset) and len(featcal.data) >= 2
    if not weigh and not (featcal.teaching == "best" and len(featcal.data) >= 2):
        return unweighed, None, None
    sample = coverage_sample(sequences)
    counts = {task: len(records) for task, records in sample.items()}
    counted = (f"{min(counts.values())}" if len(set(counts.values())) == 1
               else f"{min(counts.values())}–{max(counts.values())}")  # fewer than COVERAGE_RECORDS where an expert has fewer
    why = "weighing the experts by coverage" if weigh else "finding each expert's records' best teacher (teachers: best)"
    runlog.stage(f"{why}: {counted} records per expert through the base and every expert")
    started = time.perf_counter()
    measured = model_losses(ctx, ctx.comm.shard(sample), num_layers, featcal.batch_tokens)
    losses, base = measured.losses, measured.base
    names = short_names(list(featcal.data))
    if weigh:
        covered = coverage_weights(losses, base)
        weights = {name: given.get(name, covered[name]) for name in featcal.data}
        runlog.stage(describe(weights, losses, base, names, time.perf_counter() - started, set(given)))
    else:
        weights = unweighed
    for name, (own, base_nll) in behind_the_base(losses, base).items():
        warn(f"featcal.data.{name}: expert {names[name]} predicts its own records no better than the base model does "
             f"({own:.3f} against {base_nll:.3f} nats a token, on {counts[name]} of them): it has not learnt this kind "
             "of text; check that the data is what it was fine-tuned on, and the expert itself")
    return weights, {**losses, BASE: base}, measured.leads


__all__ = ["COVERAGE_RECORDS", "CoveragePass", "coverage_sample", "coverage_weights", "describe", "expert_weights", "model_losses"]
