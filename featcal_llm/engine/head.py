"""The `head:` step after the last layer: the LM head re-fitted on the final norm's outputs (featcal_llm.maths.head).

The streams h_cal and h_exp,i already hold the last layer's outputs, so the
step costs one final norm per batch and two d × d products per token, plus
the vocabulary-wide solve. The calibrated model's final norm is the merged
one (FeatCal leaves it as it is); expert i's features go through its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from featcal_llm import runlog
from featcal_llm.engine.drift import LM_HEAD, final_norm
from featcal_llm.engine.transfer import on_device
from featcal_llm.errors import RunFailure
from featcal_llm.io.checkpoint import CheckpointReader
from featcal_llm.io.names import short_names
from featcal_llm.maths.advantage import weighted_rows
from featcal_llm.maths.head import HeadStatistics, differs_at_stored_precision, solve_head
from featcal_llm.maths.objective import Hyperparameters
from featcal_llm.maths.stats import accumulate_gram, accumulate_moment

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext
    from featcal_llm.family.architectures import Architecture


def head_tensor(reader: CheckpointReader, embed_tokens: str) -> str:
    """The checkpoint's LM head: `lm_head.weight`, or the input embedding it is tied to."""
    return LM_HEAD if LM_HEAD in reader.names() else embed_tokens


def experts_with_their_own_head(base: CheckpointReader, experts: dict[str, CheckpointReader], embed_tokens: str) -> list[str]:
    """The experts whose LM head (or the input embedding it is tied to) is not the base's: `head: auto` re-fits the head
    only for them, since where every expert kept the base's head the merge's head is already each expert's."""
    reference = base.get(head_tensor(base, embed_tokens))
    return [name for name, reader in experts.items() if differs_at_stored_precision(reader.get(head_tensor(reader, embed_tokens)), reference)]


def experts_that_changed_the_head(featcal: Any, readers: dict[str, CheckpointReader], architecture: "Architecture") -> list[str] | None:
    """`head: auto`: the experts (by short name) whose LM head is not the base's, said in the log; None when not asked,
    or where the head must stay tied to the input embeddings for vLLM to serve the output (Gemma-2: it stays merged).

    `readers`: the base (`base_model`) and every expert, opened; each head is read once here, one at a time.
    """
    if not featcal.head_when_changed or featcal.regmean:
        return None
    if architecture.head_tied_only:
        runlog.stage(f"head: auto: the LM head stays merged, tied to the input embeddings: vLLM serves {architecture.name} "
                     "only tied, and a re-fitted head would be a tensor of its own")
        return None
    experts = {name: reader for name, reader in readers.items() if name != "base_model"}
    labels = short_names(list(experts))
    own = [labels[name] for name in experts_with_their_own_head(readers["base_model"], experts, architecture.embed_tokens)]
    runlog.stage("head: auto: " + (f"the LM head is re-fitted after the last layer, since {', '.join(own)} changed it from the base's"
                                   if own else "the LM head stays merged, since every expert kept the base's"))
    return own


def head_statistics(ctx: "RunContext", task: str, merged_norm: torch.nn.Module, expert_norm: torch.nn.Module) -> HeadStatistics:
    """Σ w x_cal x_calᵀ and Σ w x_exp x_calᵀ over task i's non-padding tokens, x = the final norm's output (w: the token weights, else 1)."""
    runner = ctx.runner
    stats = HeadStatistics.empty(runner.config.hidden_size, runner.device)
    roots = ctx.token_roots[task] if ctx.token_roots is not None else None
    with torch.no_grad(), ctx.timer.phase("statistics"):
        for index, (batch, (h_cal, h_exp)) in enumerate(zip(ctx.batches[task], on_device(runner.device, ctx.cal[task], ctx.expert[task]))):
            keep = batch.keep.to(runner.device)
            root = None if roots is None else roots[index].to(runner.device)[keep]
            weight = None if root is None else root * root
            x_cal, x_exp = merged_norm(h_cal)[keep], expert_norm(h_exp)[keep]  # weighted in the statistics' precision
            dtype = runner.head_stats_dtype  # float64 whatever the layers take (engine/devices.head_stats_dtype)
            accumulate_gram(stats.gram, weighted_rows(x_cal, root, dtype), dtype)
            accumulate_moment(stats.moment, weighted_rows(x_exp, weight, dtype), x_cal, dtype)
            stats.tokens += int(x_cal.shape[0])
    comm = ctx.comm  # every rank adds its shard's sums, then solves the same system
    stats.gram, stats.moment = comm.all_sum(stats.gram), comm.all_sum(stats.moment)
    stats.tokens = comm.sum_int(stats.tokens)
    return stats


def calibrate_head(ctx: "RunContext", hyper: Hyperparameters) -> dict[str, torch.Tensor]:
    """{"lm_head.weight": W*} in the merged head's dtype, on the host."""
    runner, models = ctx.runner, ctx.models
    embed = ctx.plan.architecture.embed_tokens
    merged_norm = final_norm(runner, models.merged)
    statistics, heads = [], []
    for task, reader in models.experts.items():
        statistics.append(head_statistics(ctx, task, merged_norm, final_norm(runner, reader)))
        heads.append(reader.get(head_tensor(reader, embed)))
    merged = models.merged.get(head_tensor(models.merged, embed))
    with ctx.timer.phase("solve"):
        shares = [ctx.plan.task_weight(task) for task in models.experts]
        solved = solve_head(statistics, heads, merged, models.base.get(head_tensor(models.base, embed)), hyper, shares, dtype=merged.dtype)
    if not bool(torch.isfinite(solved).all()):
        raise RunFailure("LM head: the solution has NaN/Inf")
    return {LM_HEAD: solved.cpu()}
