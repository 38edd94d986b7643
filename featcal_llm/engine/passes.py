"""The passes before the layers (expert weights, token weights, leads), kept for a resume on any number of ranks.

Rank 0 saves what the passes measured in a form that does not depend on the sharding: the experts' weights and
coverage losses, each expert's token-weight summary, mean lead and scale, and every calibration record's token
advantages under the record's index among the expert's calibration records (each rank's are gathered to rank 0).
A resumed run, on any number of ranks, receives them from rank 0 by broadcast and each rank rebuilds its own batches'
token weights from its records' advantages: the finished and the remaining layers use the same weights, token for
token, and the passes' forward runs are not repeated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from featcal_llm.engine.resume import sequences_digest
from featcal_llm.engine.streams import make_batches
from featcal_llm.engine.token_weights import TokenWeights, weight_roots
from featcal_llm.family.batch import TokenBatch
from featcal_llm.maths.advantage import leads, mark_trailing_records, marked_trailing

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext
    from featcal_llm.engine.distributed import Single
    from featcal_llm.engine.resume import StagingArea

PASS = "weights"
LAYOUT = 3  # the saved form's version: progress saved in another form runs the passes again

Rows = dict[str, list[list[int]]]  # task → for each of this rank's batches, the record index on each of its rows


def record_rows(comm: "Single", sequences: dict[str, list[list[int]]], batch_tokens: int) -> Rows:
    """Which calibration record sits on each row of each of this rank's batches.

    Batches depend on the records' lengths and order alone (streams.make_batches, distributed.shard_indices), so
    records tagged with their own index, sharded and batched as the run's are, name the record of every row.
    """
    tagged = {task: [[index] * len(sequence) for index, sequence in enumerate(records)] for task, records in sequences.items()}
    return {task: [batch.input_ids[:, 0].tolist() for batch in make_batches(records, batch_tokens, pad_id=0)]
            for task, records in comm.shard(tagged).items()}


def by_record(advantages: list[torch.Tensor], batches: list[TokenBatch], rows: list[list[int]]) -> dict[int, torch.Tensor]:
    """Batches' (batch, seq) values, record by record (each row's kept tokens), under the record's index."""
    return {index: advantage[row, : int(batch.keep[row].sum())].clone()
            for advantage, batch, indices in zip(advantages, batches, rows) for row, index in enumerate(indices)}


def by_batch(records: list[torch.Tensor], batches: list[TokenBatch], rows: list[list[int]]) -> list[torch.Tensor]:
    """The inverse of `by_record`: each batch's (batch, seq) float64 values, 0 on padding."""
    result = []
    for batch, indices in zip(batches, rows):
        values = torch.zeros(batch.keep.shape, dtype=torch.float64)
        if len(indices) != batch.keep.shape[0]:
            raise RuntimeError(f"internal: a batch of {batch.keep.shape[0]} rows given {len(indices)} records")
        for row, index in enumerate(indices):
            if len(records[index]) != int(batch.keep[row].sum()):
                raise RuntimeError(f"internal: record {index} has {len(records[index])} saved values for {int(batch.keep[row].sum())} tokens")
            values[row, : len(records[index])] = records[index]
        result.append(values)
    return result


def save_passes(comm: "Single", staging: "StagingArea", weights: dict[str, float], coverage: Any,
                token_weights: TokenWeights | None, batches: dict[str, list[TokenBatch]], rows: Rows,
                teachers: dict[str, tuple[str, float, float]] | None = None) -> None:
    """Rank 0 saves the passes' results with every rank's records' advantages (a collective: every rank calls it)."""
    tokens = None
    if token_weights is not None:
        mine = {task: by_record(token_weights.advantages[task], batches[task], rows[task]) for task in batches}
        gathered = comm.gather_objects(mine)
        if gathered is not None:
            records = {task: {index: values for part in gathered for index, values in part[task].items()} for task in batches}
            tokens = {"summary": token_weights.summary, "mean_leads": token_weights.mean_leads, "scales": token_weights.scales,
                      "lead_margins": token_weights.lead_margins,
                      "records": {task: [found[index] for index in range(len(found))] for task, found in records.items()}}
    if comm.is_main:
        staging.save_pass(PASS, {"layout": LAYOUT, "weights": weights, "coverage": coverage, "tokens": tokens,
                                 "teachers": {task: list(chosen) for task, chosen in (teachers or {}).items()}})


def load_passes(comm: "Single", staging: "StagingArea", sequences: dict[str, list[list[int]]]) -> dict | None:
    """What rank 0 saved under this run's fingerprint, on every rank (None: the passes run again)."""
    saved = staging.load_pass(PASS) if comm.is_main else None
    if saved is not None and (saved.get("layout") != LAYOUT or (saved["tokens"] is not None and any(
            len(saved["tokens"]["records"].get(task, [])) != len(records) for task, records in sequences.items()))):
        saved = None
    return comm.broadcast_object(saved)


def saved_token_weights(tokens: dict, batches: dict[str, list[TokenBatch]], rows: Rows) -> TokenWeights:
    """This rank's token weights, rebuilt from the saved records' advantages and the experts' scales."""
    advantages = {task: by_batch(tokens["records"][task], batches[task], rows[task]) for task in batches}
    return TokenWeights(weight_roots(advantages, batches, tokens["scales"]), tokens["summary"], tokens["mean_leads"],
                        tokens["scales"], advantages, tokens["lead_margins"])


def trailing_record_indices(comm: "Single", advantages: dict[str, list[torch.Tensor]], batches: dict[str, list[TokenBatch]],
                            rows: Rows, counts: dict[str, int]) -> dict[str, frozenset[int]]:
    """Per expert, the indices of the records whose tokens weigh 0 because the expert trails the merge on them
    (`trailing_records: drop`, marked by maths/advantage.mark_trailing_records), gathered from every rank."""
    flags: list[float] = []
    for task, count in counts.items():
        marked = [0.0] * count
        for index, values in by_record(advantages.get(task, []), batches.get(task, []), rows.get(task, [])).items():
            marked[index] = float(values.numel() > 0 and bool(marked_trailing(values)))
        flags += marked
    flags = comm.sum_floats(flags)
    result, start = {}, 0
    for task, count in counts.items():
        result[task] = frozenset(index for index in range(count) if flags[start + index] > 0)
        start += count
    return result


HELD_OUT_PASS = "held-out-trailing"


def held_out_trailing_indices(ctx: "RunContext", leading: list[str], sequences: dict[str, list[list[int]]],
                              batch_tokens: int) -> dict[str, frozenset[int]]:
    """Per expert in `leading` (not behind the merge beyond doubt), the indices of its held-out records (`sequences`,
    the probe's) that `trailing_records: drop` marks as it marks a calibration record: the expert's leads over the
    merge on the record's judged tokens summed below 0 (maths/advantage.mark_trailing_records). The lead pass never
    saw these records; the layer loop left each one's last decoder-layer output of the merged model and of the expert
    (the probe's streams, engine/calibrate.py), so their final norms and LM heads alone measure it, no second forward.
    A collective: every rank measures its shard and the marks are summed over the ranks; rank 0 keeps what it first
    measured in the staging area with the digest of the records marked, so a resumed run, on any number of ranks,
    leaves out the same records, and one for other records (each is known by its place) measures them again."""
    from featcal_llm.engine.drift import Head
    from featcal_llm.engine.scoring import response_positions, token_log_probs
    from featcal_llm.engine.transfer import on_device

    probe, runner, comm = ctx.probe, ctx.runner, ctx.comm
    rows = record_rows(comm, sequences, batch_tokens)
    merged_head = Head(runner, ctx.models.merged)
    flags: list[float] = []
    for task in leading:
        marked = [0.0] * len(sequences[task])
        batches = probe.batches.get(task, [])
        if batches:
            expert_head = Head(runner, ctx.models.experts[task])
            pairs = on_device(runner.device, probe.merged[task], probe.expert[task])
            for batch, indices, (merged_hidden, expert_hidden) in zip(batches, rows[task], pairs):
                lead = leads(token_log_probs(expert_head, expert_hidden, batch), token_log_probs(merged_head, merged_hidden, batch),
                             response_positions(batch)).sum(dim=1)
                trailing = marked_trailing(mark_trailing_records(torch.zeros((len(indices), 1), dtype=lead.dtype), lead))
                for index, flag in zip(indices, trailing.tolist()):
                    marked[index] = float(flag)
            del expert_head
        flags += marked
    flags = comm.sum_floats(flags)
    result, start = {}, 0
    for task in leading:
        result[task] = frozenset(index for index in range(len(sequences[task])) if flags[start + index] > 0)
        start += len(sequences[task])
    if comm.is_main:  # kept with the digest of the records they mark, as refine's teachers are: never read for others
        covered = sequences_digest({task: sequences[task] for task in leading})
        saved = ctx.staging.load_pass(HELD_OUT_PASS)
        if saved is not None and saved.get("leading") == list(leading) and saved.get("records") == covered:
            result = {task: frozenset(indices) for task, indices in saved["marks"].items()}
        else:
            ctx.staging.save_pass(HELD_OUT_PASS, {"leading": list(leading), "records": covered,
                                                  "marks": {task: sorted(v) for task, v in result.items()}})
    return result


__all__ = ["HELD_OUT_PASS", "LAYOUT", "PASS", "by_batch", "by_record", "held_out_trailing_indices", "load_passes", "record_rows",
           "save_passes", "saved_token_weights", "trailing_record_indices"]
