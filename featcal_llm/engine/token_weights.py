"""The token-weight pass: where each expert predicts its own records better than the merge (maths/advantage.py).

Before the calibration loop, each expert's calibration records run through
the merged model and through that expert to the end of the network
(engine/scoring.py). A token weighs the expert's advantage over the merge at
predicting the next token, scaled to mean 1 over the expert's tokens (summed
over every rank, so ranks weigh alike), for half of its weight; the other
half is 1 (maths/advantage.py). The loop's statistics then take √w-scaled
rows (engine/record.py).

The same pass measures each expert's net lead over the merge, which decides
who teaches its records (engine/teachers.py). On prompt/response records it
counts the response alone: an expert is judged on what it was trained to
answer, not on a user's prompt. The weights still count every token: a
prompt token the expert predicts better (its task's format) holds features
its answers attend to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from featcal_llm import runlog
from featcal_llm.engine.drift import Head
from featcal_llm.engine.scoring import final_hidden, response_positions, scored_positions, token_log_probs
from featcal_llm.engine.transfer import on_device
from featcal_llm.errors import warn
from featcal_llm.io.names import short_names
from featcal_llm.engine.teachers import trailing_experts, with_teachers
from featcal_llm.maths.advantage import (advantages, lead_margin, lead_moments, leads, mark_trailing_records, marked_trailing,
                                         mean_one_scale, token_weights)

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext

MERGED = ("merged",)  # the pass's role keys: tuples, so that no expert's name can collide with the merge's


@dataclass(frozen=True)
class TokenWeights:
    roots: dict[str, list[torch.Tensor]]  # task → √w of each of its batches, (batch, seq) float64 on the host
    summary: dict[str, dict[str, float]]  # task → {"tokens_ahead": share of its tokens where the expert is ahead, "lead": mean nats}
    mean_leads: dict[str, float]  # task → the expert's mean lead over the merge per scored response token (every token of
    # plain text), negative where it trails (not clamped)
    scales: dict[str, float] | None = None  # task → mean_one_scale over every rank's tokens of the expert
    advantages: dict[str, list[torch.Tensor]] | None = None  # task → a_t of each of this rank's batches, (batch, seq) float64
    lead_margins: dict[str, float] | None = None  # task → two standard errors of its mean lead, over its records


def weight_roots(advantages: dict[str, list[torch.Tensor]], batches: dict, scales: dict[str, float]) -> dict[str, list[torch.Tensor]]:
    """√w of every token of every batch from its advantage and its expert's scale (maths/advantage.token_weights)."""
    return {task: [token_weights(weights, batch.keep, scales[task]).sqrt() for weights, batch in zip(advantages[task], batches[task])]
            for task in batches}


def advantage_weights(ctx: "RunContext", num_layers: int, where: str, drop_trailing_records: bool = True) -> TokenWeights:
    """Every calibration token's weight: the expert's advantage over the merge there, mean 1 per expert; 0 on a record
    the expert trails the merge on (`trailing_records: drop`, maths/advantage.mark_trailing_records)."""
    models, runner, batches = ctx.models, ctx.runner, ctx.batches
    runs = {MERGED: (models.merged, batches), **{("expert", task): (models.experts[task], {task: task_batches})
                                                  for task, task_batches in batches.items()}}
    runlog.stage("weighing each expert's tokens by its lead over the merge: its records through the merged model and the expert")
    started = time.perf_counter()
    streams = final_hidden(ctx, runs, num_layers)
    merged_head = Head(runner, models.merged)
    raw: dict[str, list[torch.Tensor]] = {}
    record_leads: dict[str, list[torch.Tensor]] = {}  # task → each batch's records' summed leads, (batch,)
    sums: list[float] = []
    moments: list[float] = []  # per task, lead_moments over this rank's records
    for task, task_batches in batches.items():
        expert_head = Head(runner, models.experts[task])
        raw[task] = []
        total = ahead = tokens = scored = signed = answered = 0.0
        record_leads[task] = []
        judged: list[torch.Tensor] = []
        for batch, (merged_hidden, expert_hidden) in zip(task_batches, on_device(runner.device, streams[MERGED][task], streams[("expert", task)][task])):
            positions, responses = scored_positions(batch), response_positions(batch)
            expert_lp, merged_lp = token_log_probs(expert_head, expert_hidden, batch), token_log_probs(merged_head, merged_hidden, batch)
            lead, weights = leads(expert_lp, merged_lp, responses), advantages(expert_lp, merged_lp, positions)
            total, ahead, signed = total + float(weights.sum()), ahead + float((weights > 0).sum()), signed + float(lead.sum())
            tokens, scored, answered = tokens + batch.tokens, scored + float(positions.sum()), answered + float(responses.sum())
            raw[task].append(weights)
            record_leads[task].append(lead.sum(dim=1))  # `leads` is 0 off the judged positions
            judged.append(responses.sum(dim=1))
        sums += [total, ahead, tokens, scored, signed, answered]
        moments += lead_moments(torch.cat(record_leads[task]), torch.cat(judged)) if judged else [0.0] * 6  # a rank may hold none
        del expert_head
    del streams
    # an expert's lead is judged on its responses where its records are prompt/response pairs, else on every token
    with_responses = ctx.comm.sum_floats([float(any(batch.response is not None for batch in batches[task])) for task in batches])
    on_responses = {task: flag > 0 for task, flag in zip(batches, with_responses)}
    sums, moments = ctx.comm.sum_floats(sums), ctx.comm.sum_floats(moments)
    scales, summary, mean_leads, margins, records = {}, {}, {}, {}, {}
    for index, task in enumerate(batches):
        total, ahead, tokens, scored, signed_sum, answered = sums[6 * index: 6 * index + 6]
        records[task] = int(moments[6 * index])  # lead_moments' first: the records summed over
        mean_leads[task] = signed_sum / max(answered, 1.0)
        margins[task] = lead_margin(moments[6 * index: 6 * index + 6])
        scales[task] = mean_one_scale(total, int(tokens))
        summary[task] = {"tokens_ahead": round(ahead / max(scored, 1.0), 4), "lead": round(total / max(scored, 1.0), 4),
                         "net_lead": round(mean_leads[task], 4), "net_lead_margin": round(margins[task], 4), "records": records[task]}
    if drop_trailing_records:  # an expert not behind beyond doubt (one that is is the merge's to teach, or kept whole)
        behind = trailing_experts(mean_leads, margins)
        leading = [task for task in batches if task not in behind]
        for task in leading:
            raw[task] = [mark_trailing_records(weights, sums) for weights, sums in zip(raw[task], record_leads[task])]
        counts = ctx.comm.sum_floats([value for task in leading for value in (
            sum(float(marked_trailing(weights).sum()) for weights in raw[task]), sum(float(batch.keep.shape[0]) for batch in batches[task]))])
        for index, task in enumerate(leading):
            summary[task].update(records_dropped=int(counts[2 * index]), records=int(counts[2 * index + 1]))
    roots = weight_roots(raw, batches, scales)
    names = short_names(list(batches))
    for task in batches:
        if summary[task]["tokens_ahead"] == 0:
            warn(f"{where}: expert {task} predicts none of its records' tokens better than the merge, so its tokens weigh "
                 "alike; check that its data is its kind of text")
    names = with_teachers(names, ctx.teachers)
    runlog.stage(f"tokens weighed by the expert's lead over the merge ({time.perf_counter() - started:.0f} s): "
                 + "; ".join(f"{names[task]} ahead on {s['tokens_ahead']:.0%} of its tokens, by {s['lead']:.3f} nats a token on average "
                             f"(net of where it trails{', on its responses' if on_responses[task] else ''}: {mean_leads[task]:+.3f} "
                             + (f"± {margins[task]:.3f})" if records[task] >= 2 else "; one record, so no spread)")
                             + (f", behind on {s['records_dropped']} of its {s['records']} records, which weigh 0"
                                if s.get("records_dropped") else "")
                             for task, s in summary.items()))
    return TokenWeights(roots, summary, mean_leads, scales, raw, margins)


__all__ = ["TokenWeights", "advantage_weights", "weight_roots"]
