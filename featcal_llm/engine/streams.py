"""Token batches and the host-resident hidden-state streams.

Sequences are grouped into right-padded batches under a padded-token budget
(longest first, so padding stays small). Streams hold one (batch, seq, d)
tensor per batch on the host; they travel to the compute device one batch at
a time, so GPU memory never holds more than one batch of activations.
"""

from __future__ import annotations

import itertools
import math
import weakref
from pathlib import Path

import torch

from featcal_llm.family.batch import TokenBatch
from featcal_llm.io.records import response_mask, response_spans


def make_batches(sequences: list[list[int]], batch_tokens: int, pad_id: int = 0) -> list[TokenBatch]:
    """Deterministic length-sorted batches whose padded size stays within `batch_tokens`.

    A sequence longer than the budget gets a batch of its own. A batch of plain-text sequences has no response mask
    (every token counts); one with a prompt/response `Record` marks each record's response tokens (a conversation's:
    every assistant turn's).
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
        response = keep.clone()
        for row, index in enumerate(group):
            ids[row, : len(sequences[index])] = torch.tensor(sequences[index], dtype=torch.long)
            keep[row, : len(sequences[index])] = True
            response[row, : len(sequences[index])] = torch.tensor(response_mask(len(sequences[index]), response_spans(sequences[index])))
        batches.append(TokenBatch(ids, keep, None if torch.equal(response, keep) else response))
    return batches


class HostStore:
    """Host memory for stream batches: RAM up to a byte budget, memory-mapped files beyond it.

    RAM batches are pinned when a GPU computes, so host→device copies run at full
    bandwidth. A spilled batch lives in an unlinked file under `spill_dir`; the
    page cache keeps it in memory when it can and the kernel writes it out when
    it must, so resident memory stays near the budget.

    `in_ram` counts what is really held. Unpinned: the tensors' bytes. Pinned:
    CUDA's caching host allocator rounds every block up to a power of two and
    keeps freed blocks for reuse instead of returning them, so a batch costs
    its rounded size, and a freed batch stays counted (as a cached block that a
    later batch of the same size class reuses at no cost).
    """

    def __init__(self, budget_bytes: int | None, spill_dir: Path | None, pin: bool):
        self.budget = budget_bytes
        self.spill_dir = spill_dir
        self.pin = pin
        self.in_ram = 0
        self.peak_in_ram = 0
        self.spilled = 0
        self._cached: dict[int, int] = {}  # pinned block size → freed blocks the host allocator keeps
        self._counter = itertools.count()

    def held_size(self, nbytes: int) -> int:
        """Bytes a block of `nbytes` really occupies: a power of two when pinned (CUDA's CachingHostAllocator)."""
        return 1 << max(nbytes - 1, 0).bit_length() if self.pin else nbytes

    def _release(self, size: int) -> None:
        if self.pin:
            self._cached[size] = self._cached.get(size, 0) + 1
        else:
            self.in_ram -= size

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        size = self.held_size(nbytes)
        reuse = self._cached.get(size, 0) > 0
        if self.budget is None or reuse or self.in_ram + size <= self.budget or self.spill_dir is None:
            tensor = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
            if reuse:
                self._cached[size] -= 1
            else:
                self.in_ram += size
            self.peak_in_ram = max(self.peak_in_ram, self.in_ram)
            weakref.finalize(tensor, self._release, size)
            return tensor
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / f"batch-{next(self._counter)}.bin"
        with open(path, "wb") as handle:
            handle.truncate(nbytes)
        tensor = torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)
        path.unlink()  # the mapping keeps the data; nothing is left behind on exit
        self.spilled += nbytes
        return tensor

    def store(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Copy one batch to the host with padding zeroed, so padding can never turn into NaN."""
        hidden = hidden.masked_fill(~keep.to(hidden.device).unsqueeze(-1), 0)
        host = self.allocate(tuple(hidden.shape), hidden.dtype)
        host.copy_(hidden)
        return host
