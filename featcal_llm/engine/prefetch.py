"""Read the next layer's tensors in a background thread while the current layer computes.

Reading (safetensors copies out of the page cache or from disk), the NaN/Inf
check of every weight and computing overlap; the main thread only waits for
what is not ready yet. At most two
layers' tensors of each model are on the host at once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from featcal_llm.io.checkpoint import CheckpointReader
from featcal_llm.errors import FeatCalError


@dataclass
class LayerTensors:
    merged: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]
    experts: dict[str, dict[str, torch.Tensor]]


class LayerPrefetcher:
    def __init__(self, merged: CheckpointReader | None, base: CheckpointReader | None, experts: dict[str, CheckpointReader], prefix_of, num_layers: int, pin: bool):
        self._readers = (merged, base, experts)
        self._prefix_of = prefix_of
        self._num_layers = num_layers
        self._pin = pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="featcal-prefetch")
        self._pending: dict[int, Future] = {}

    def _read(self, layer: int) -> LayerTensors:
        merged, base, experts = self._readers
        prefix = self._prefix_of(layer)

        def load(reader: CheckpointReader) -> dict[str, torch.Tensor]:
            tensors = {}
            for name, tensor in reader.tensors(prefix).items():
                # safetensors hands out memory-mapped tensors: copy here so the disk read happens in this thread.
                tensor = tensor.pin_memory() if self._pin else tensor.clone()
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    shard = getattr(reader, "weight_map", {}).get(prefix + name)  # a LoRA expert: base and adapter summed
                    raise FeatCalError(f"{reader.what}: tensor {prefix}{name} contains NaN or Inf (read from "
                                       f"{reader.directory / shard if shard else reader.directory}); the re-fit starts from "
                                       "finite weights only (a damaged download or a diverged fine-tune?)")
                tensors[name] = tensor
            return tensors

        return LayerTensors(load(merged) if merged is not None else {}, load(base) if base is not None else {}, {task: load(reader) for task, reader in experts.items()})

    def _submit(self, layer: int) -> None:
        if 0 <= layer < self._num_layers and layer not in self._pending:
            self._pending[layer] = self._pool.submit(self._read, layer)

    def get(self, layer: int) -> LayerTensors:
        """Layer `layer`'s tensors (waiting if needed); starts reading layer + 1."""
        self._submit(layer)
        future = self._pending.pop(layer)
        self._submit(layer + 1)
        return future.result()

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        self._pending.clear()
