"""Host→device copies of stream batches that overlap compute: batch k+1 is copied on a side CUDA stream while batch k computes.

On a CPU (or any non-CUDA device) it is the plain path: each batch is
`.to(device)` when it is reached. The streams are read lazily, one batch
ahead, so a caller may replace batch k in place (the engine does, to keep old
and new streams from coexisting) as soon as it has received it.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch


def on_device(device: torch.device, *streams: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ...]]:
    """Yield (streams[0][k], streams[1][k], …) on `device` for k = 0, 1, …, prefetching k + 1 on CUDA."""
    count = min((len(stream) for stream in streams), default=0)
    if device.type != "cuda":
        for index in range(count):
            yield tuple(stream[index].to(device) for stream in streams)
        return
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)

    def copy(index: int) -> tuple[torch.Tensor, ...]:
        with torch.cuda.stream(side):  # pinned host memory: an asynchronous DMA that runs beside main's kernels
            return tuple(stream[index].to(device, non_blocking=True) for stream in streams)

    pending = copy(0) if count else ()
    for index in range(count):
        current = pending
        main.wait_stream(side)  # main's kernels on batch k start after its copy
        for tensor in current:
            tensor.record_stream(main)  # allocated on `side`, used on main: not reused before main is done with it
        pending = copy(index + 1) if index + 1 < count else ()
        yield current
