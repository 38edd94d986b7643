"""Models run to the end of the network before the calibration loop, and their next-token log-probabilities.

The passes that decide how the loop weighs its data need each model's
prediction of the calibration text: coverage (which expert counts for which)
and the token weights (which tokens count). They stream like the loop: one
decoder layer of each model on the device at a time, every record's hidden
state in the host store, the family's own layers, final norm and LM head.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from featcal_llm.engine.calibrate import advance, embedded
from featcal_llm.engine.drift import KL_CHUNK, Head
from featcal_llm.engine.prefetch import LayerPrefetcher
from featcal_llm.engine.streams import TokenBatch
from featcal_llm.io.checkpoint import CheckpointReader

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext

# a model's role in the pass → (its checkpoint, task → the batches it reads)
Runs = dict[Hashable, tuple[CheckpointReader, dict[str, list[TokenBatch]]]]
Streams = dict[Hashable, dict[str, list[torch.Tensor]]]  # role → task → one host tensor per batch


def final_hidden(ctx: "RunContext", runs: Runs, num_layers: int) -> Streams:
    """The last decoder layer's output of every run's model on its batches (host streams)."""
    streams = {role: {task: embedded(ctx, reader, batches, reader.what) for task, batches in tasks.items()}
               for role, (reader, tasks) in runs.items()}
    readers = {role: reader for role, (reader, _) in runs.items()}
    prefetcher = LayerPrefetcher(None, None, readers, ctx.runner.architecture.prefix, num_layers, pin=ctx.runner.device.type == "cuda")
    try:
        for layer in range(num_layers):
            tensors = prefetcher.get(layer)
            for role, (reader, tasks) in runs.items():
                module = ctx.runner.build(layer, tensors.experts[role], reader.what)
                for task, batches in tasks.items():
                    advance(ctx, module, batches, streams[role][task], reader.what)
                del module
            del tensors
    finally:
        prefetcher.close()
    return streams


def scored_positions(batch: TokenBatch) -> torch.Tensor:
    """(batch, seq) bool: the tokens whose successor is in the same record (the last of a record has none)."""
    scored = torch.zeros_like(batch.keep)
    scored[:, :-1] = batch.keep[:, :-1] & batch.keep[:, 1:]
    return scored


def response_positions(batch: TokenBatch) -> torch.Tensor:
    """(batch, seq) bool: the scored tokens whose successor is a response token (every scored token of plain text)."""
    scored = scored_positions(batch)
    if batch.response is not None:
        scored[:, :-1] &= batch.response[:, 1:]
    return scored


def token_log_probs(head: Head, hidden: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """log p(next token) at every scored position, 0 elsewhere: (batch, seq) float64 on the host."""
    scored = scored_positions(batch)
    rows = hidden[scored.to(hidden.device)]
    targets = batch.input_ids[:, 1:][scored[:, :-1]]
    values = [head.log_probs(chunk).gather(1, target.to(head.device).unsqueeze(1)).squeeze(1).cpu()
              for chunk, target in zip(rows.split(KL_CHUNK), targets.split(KL_CHUNK))]
    result = torch.zeros(batch.keep.shape, dtype=torch.float64)
    if values:
        result[scored] = torch.cat(values)
    return result


__all__ = ["Runs", "final_hidden", "response_positions", "scored_positions", "token_log_probs"]
