"""`trailing_experts: merge` (FeatCal's default): the merged model teaches the records of an expert that is behind it on them.

FeatCal pulls the merge's features toward each expert's on that expert's
records. Where the expert predicts its own records worse than the merge does
(its mean lead over the merge at predicting the next token, from the
token-weight pass, is 0 or below; over the responses of prompt/response
records, over every token of plain text), that pull moves the merge toward
what it already does better: calibrating makes it worse on that text. The token
weights' ½ floor keeps half of the pull on every token, and the head's re-fit
(α 1: each expert's own logits) carries it straight to the output.

The lead is judged beyond doubt: an expert is behind only where its mean lead
stays at or below 0 when raised by two standard errors, counted over its
records (maths/advantage.lead_margin). A lead too close to 0 for the records
to tell its sign leaves the expert its records: in the broad study an expert
0.018 behind on its 64 calibration records led the merge by 0.091 on unseen
text of its kind, and with the merge as its teacher the calibrated model ended
worse than the merge on that text.

The records of an expert behind beyond doubt are calibrated toward the merged model instead, as if
the merged checkpoint were that expert: its streams, layers, final norm and LM
head are the merge's, and its tokens weigh alike (the merge has no lead over
itself). The records still count, with the expert's weight, so the layers
keep doing on that text what the merge did there while the other experts pull
them elsewhere. An expert that leads the merge on its records is untouched,
so where every expert leads, the run is the same as with `keep`, bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from featcal_llm import runlog
from featcal_llm.engine.context import Models
from featcal_llm.engine.streams import TokenBatch
from featcal_llm.errors import FeatCalError, warn
from featcal_llm.io.names import short_names
from featcal_llm.io.records import response_spans
from featcal_llm.maths.advantage import judged_tokens, trails

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext


def trailing_experts(mean_leads: dict[str, float], margins: dict[str, float] | None = None) -> dict[str, float]:
    """The experts behind the merge on their own records beyond doubt (their mean lead, nats a token, below 0 by more
    than its `margins`: two standard errors over the records; 0 where not given), with their mean lead."""
    margins = margins or {}
    return {task: lead for task, lead in mean_leads.items() if trails(lead, margins.get(task, 0.0))}


def check_judged(sequences: dict[str, list[list[int]]], where: str, held_out: bool) -> None:
    """Refuse an expert whose calibration records keep no judged token: its lead over the merge would read 0.0 (no
    evidence) and it would be declared trailing. Checked on the records that enter the statistics, before any pass."""
    for task, records in sequences.items():
        if sum(judged_tokens(len(record), response_spans(record)) for record in records) == 0:
            split = " after the hold-out split" if held_out else ""
            raise FeatCalError(
                f"{where}.data.{task}: none of its {len(records)} calibration records keeps a judged (response) token{split}, so whether "
                f"it leads the merge (trailing_experts: merge) cannot be measured; give it more samples, a longer max_length"
                + (" or a smaller tune.holdout" if held_out else " or shorter prompts"))


def taught_by_the_merge(models: Models, tasks: list[str] | dict[str, float]) -> Models:
    """`models` with the merged checkpoint in place of each of `tasks`' experts (the merge, the base and the rest as they are)."""
    return replace(models, experts={task: models.merged if task in tasks else reader for task, reader in models.experts.items()})


def let_the_best_teach(ctx: "RunContext", teachers: dict[str, tuple[str, float, float]], where: str | None = None) -> None:
    """`teachers: best`: each expert in `teachers` has its records taught by the expert named there (ctx.models,
    ctx.teachers), before the token-weight pass, so that its tokens' weights, whether the merge teaches instead
    (`trailing_experts`) and refine's teacher all read the chosen model. `where`: the key to log under (None: a resume,
    which logged the choice the first time)."""
    ctx.teachers = dict(teachers)
    if teachers:
        ctx.models = replace(ctx.models, experts={task: ctx.models.experts[teachers[task][0]] if task in teachers else reader
                                                  for task, reader in ctx.models.experts.items()})
    if where is None:
        return
    names = short_names(list(ctx.models.experts))
    if not teachers:
        runlog.stage("teachers: best: each expert predicts its own records best (no other expert beats it there by more "
                     "than two standard errors), so each teaches its own")
        return
    runlog.stage("teachers: best: " + "; ".join(
        f"{names[teacher]} teaches {names[task]}'s records (it predicts them better by {lead:.3f} ± {margin:.3f} nats a token)"
        for task, (teacher, lead, margin) in teachers.items()) + "; each expert's weight stays its own")


def with_teachers(names: dict[str, str], teachers: dict[str, tuple[str, float, float]]) -> dict[str, str]:
    """Each expert's label for a line about its lead: `manpage (taught by broad)` where `teachers: best` handed its
    records over, since the lead measured on them is the chosen teacher's."""
    return {task: f"{name} (taught by {names[teachers[task][0]]})" if task in teachers else name for task, name in names.items()}


def pulling(weights: dict[str, float]) -> set[str]:
    """The experts that pull the layers at all: weight above 0 in the objective (`data.<expert>.weight: 0` counts for nothing)."""
    return {task for task, weight in weights.items() if weight > 0}


def every_expert_taught_by_the_merge(taught: dict[str, float], weights: dict[str, float]) -> bool:
    """Whether the merge teaches every calibrated expert's records that counts (`weights`: each expert's weight in the
    objective): then every target with a pull is the merge's own, and the only pull away from its weights would be the
    anchor's, toward the base. The run then keeps the merge as it is. An expert at weight 0 that leads pulls nothing, so
    it decides nothing."""
    counted = pulling(weights)
    return bool(counted) and counted <= set(taught)


def alike(batches: list[TokenBatch]) -> list[torch.Tensor]:
    """√w = 1 on every kept token, 0 on padding: the token weights of records the merge teaches."""
    return [batch.keep.to(torch.float64) for batch in batches]


def let_the_merge_teach(ctx: "RunContext", mean_leads: dict[str, float], where: str,
                        margins: dict[str, float] | None = None) -> dict[str, float]:
    """Swap in the merge as the teacher of every expert behind it beyond doubt (ctx.models, ctx.token_roots); returns them.

    `ctx.plan.task_weights` must be set: whether every expert that counts trails is judged on those weights."""
    behind = trailing_experts(mean_leads, margins)
    names = with_teachers(short_names(list(mean_leads)), ctx.teachers)
    doubtful = [task for task, lead in mean_leads.items() if lead <= 0 and task not in behind]
    if doubtful:
        runlog.stage("trailing_experts: merge: " + ", ".join(
            f"{names[task]} (behind the merge by {abs(mean_leads[task]):.3f} ± {(margins or {}).get(task, 0.0):.3f} nats a token)"
            for task in doubtful) + (" teaches its" if len(doubtful) == 1 else " teach their") + " own records, as "
            + ("its" if len(doubtful) == 1 else "their") + " records cannot tell the sign of that lead")
    if not behind:
        if not doubtful:
            runlog.stage("trailing_experts: merge: every expert leads the merge on its own records, so each teaches its own")
        return behind
    ctx.models = taught_by_the_merge(ctx.models, behind)
    if ctx.token_roots is not None:
        ctx.token_roots = {task: alike(ctx.batches[task]) if task in behind else roots for task, roots in ctx.token_roots.items()}
    runlog.stage("trailing_experts: merge: the merged model teaches the records of "
                 + ", ".join(f"{names[task]} (behind it by {abs(lead):.3f} nats a token)" if lead < 0 else
                             f"{names[task]} (no better than it: a lead of exactly 0, as a copy of the merge has)" for task, lead in behind.items())
                 + ", as those experts predict their own records no better than the merge does, beyond two standard errors")
    if every_expert_taught_by_the_merge(behind, {task: ctx.plan.task_weight(task) for task in mean_leads}):
        warn(f"{where}: every expert predicts its own records worse than the merged model, so the output is the merged model, "
             "unchanged; check that each expert's data is its kind of text and that the expert learnt it (one that also "
             "trails the base has not). trailing_experts: keep would calibrate toward them anyway, away from the model "
             "that predicts these records best")
    return behind


__all__ = ["alike", "check_judged", "every_expert_taught_by_the_merge", "let_the_best_teach", "let_the_merge_teach", "pulling", "taught_by_the_merge", "trailing_experts", "with_teachers"]
