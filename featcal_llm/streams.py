"""Token batches and the host-resident hidden-state streams.

Sequences are grouped into right-padded batches under a padded-token budget
(longest first, so padding stays small). Streams hold one (batch, seq, d)
tensor per batch on the host; they travel to the compute device one batch at
a time, so GPU memory never holds more than one batch of activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBatch:
    input_ids: torch.Tensor  # (batch, seq) int64, right-padded
    keep: torch.Tensor  # (batch, seq) bool, True for real tokens

    @property
    def tokens(self) -> int:
        return int(self.keep.sum())


def make_batches(sequences: list[list[int]], batch_tokens: int, pad_id: int = 0) -> list[TokenBatch]:
    """Deterministic length-sorted batches whose padded size stays within `batch_tokens`.

    A sequence longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i))
    groups: list[list[int]] = []
    for index in order:
        if groups:
            current = groups[-1]
            longest = len(sequences[current[0]])
            if (len(current) + 1) * longest <= batch_tokens:
                current.append(index)
                continue
        groups.append([index])
    batches = []
    for group in groups:
        length = max(len(sequences[i]) for i in group)
        ids = torch.full((len(group), length), pad_id, dtype=torch.long)
        keep = torch.zeros((len(group), length), dtype=torch.bool)
        for row, index in enumerate(group):
            ids[row, : len(sequences[index])] = torch.tensor(sequences[index], dtype=torch.long)
            keep[row, : len(sequences[index])] = True
        batches.append(TokenBatch(ids, keep))
    return batches


def embed(batch: TokenBatch, embedding: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Look the batch's tokens up in an embedding matrix; padding positions are zero."""
    hidden = torch.nn.functional.embedding(batch.input_ids, embedding).to(dtype)
    hidden[~batch.keep] = 0
    return hidden.pin_memory() if pin else hidden


def to_host(hidden: torch.Tensor, keep: torch.Tensor, pin: bool) -> torch.Tensor:
    """Move one batch's output back to the host, zeroing padding so it can never turn into NaN."""
    hidden = hidden.masked_fill(~keep.to(hidden.device).unsqueeze(-1), 0)
    if hidden.device.type == "cpu":
        return hidden
    host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=pin)
    host.copy_(hidden, non_blocking=False)
    return host
