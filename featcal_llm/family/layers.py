"""Real transformers decoder layers, built one at a time from checkpoint tensors, and hooks on them.

Attention, RoPE, masks and the embedding step are the model family's own code:
we instantiate its decoder layer from the checkpoint's config, and take each
layer's call arguments (sliding-window or full causal/padding mask, rotary
tables, positions) and layer 0's input (Gemma's scaled embedding) from the
family's own `*Model.forward` through `front.ModelFront`. The attention
implementation is the one transformers picks for the family (sdpa, or eager
where sdpa would drop Gemma-2's soft-capping).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from featcal_llm.family.architectures import Architecture
from featcal_llm.errors import FeatCalError
from featcal_llm.family.front import ModelFront
from featcal_llm.family.batch import TokenBatch


class LayerRunner:
    def __init__(
        self,
        architecture: Architecture,
        config: Any,
        device: torch.device,
        dtype: torch.dtype,
        stats_dtype: torch.dtype = torch.float32,
        head_stats_dtype: torch.dtype | None = None,
    ):
        self.architecture = architecture
        self.config = copy.deepcopy(config)
        self.config._attn_implementation = None  # let the family choose, as from_pretrained does
        self.config.use_cache = False
        self.device = device
        self.dtype = dtype
        self.stats_dtype = stats_dtype  # precision of each batch's statistics products (totals are float64)
        # the LM head's re-fit solves at its own λ (`head: lambda`, 1e-5 by default): its products take float64 (stages/prepare)
        self.head_stats_dtype = head_stats_dtype or stats_dtype
        self.front = ModelFront(architecture.model_class(), self.config, device, dtype)  # sets config._attn_implementation

    def build(self, layer_index: int, weights: dict[str, torch.Tensor], where: str) -> torch.nn.Module:
        """A decoder layer on the compute device holding `weights` (names relative to the layer)."""
        with torch.device("meta"):
            layer = self.architecture.layer_class()(self.config, layer_index)
        expected = set(layer.state_dict())
        missing, unexpected = expected - set(weights), set(weights) - expected
        if missing or unexpected:
            problem = f"missing {sorted(missing)[0]}" if missing else f"unexpected {sorted(unexpected)[0]}"
            raise FeatCalError(f"{where}: layer {layer_index} tensors do not match the architecture ({problem})")
        state = {name: tensor.to(device=self.device, dtype=self.dtype) for name, tensor in weights.items()}
        layer.load_state_dict(state, assign=True, strict=True)
        layer.requires_grad_(False)
        layer.featcal_index, layer.featcal_kind = layer_index, self.front.kinds[layer_index]
        return layer.eval()

    def context(self, batch: TokenBatch, hidden: torch.Tensor) -> dict[str, Any]:
        """Keyword arguments of a decoder layer call for this batch, per layer kind (sliding/full attention)."""
        return self.front.arguments(hidden, batch.keep)

    def embed(self, batch: TokenBatch, embedding: torch.Tensor, what: str) -> torch.Tensor:
        """Layer 0's input for the batch, through the family's embedding step, in the compute dtype on the device."""
        return self.front.embed(batch.input_ids, batch.keep, embedding, self.dtype, what)

    @staticmethod
    @torch.inference_mode()
    def forward(layer: torch.nn.Module, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        arguments = context[layer.featcal_kind] if len(context) > 1 else next(iter(context.values()))
        output = layer(hidden, **arguments)
        return output[0] if isinstance(output, tuple) else output


def norm_epsilon(module: torch.nn.Module) -> float:
    """The epsilon of a family's RMSNorm module, whatever the family calls it."""
    for attribute in ("variance_epsilon", "eps", "epsilon"):
        if hasattr(module, attribute):
            return float(getattr(module, attribute))
    raise FeatCalError(f"internal: cannot find the epsilon of {type(module).__name__}")


HookFn = Callable[[torch.Tensor, torch.Tensor], None]


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    if args:
        return args[0]
    for key in ("input", "hidden_states", "x"):
        if key in kwargs:
            return kwargs[key]
    raise FeatCalError("internal: a hooked module was called without a tensor input")


@contextmanager
def hooked(layer: torch.nn.Module, callbacks: dict[str, HookFn]) -> Iterator[None]:
    """Call `callbacks[path](input, output)` whenever the submodule at `path` runs."""
    handles = []
    try:
        for path, callback in callbacks.items():
            module = layer.get_submodule(path)
            handles.append(
                module.register_forward_hook(
                    lambda _m, args, kwargs, output, fn=callback: fn(_first_input(args, kwargs), output),
                    with_kwargs=True,
                )
            )
        yield
    finally:
        for handle in handles:
            handle.remove()
