"""Decoder-layer inputs taken from the model family's own `*Model.forward` (the llm-compressor/GPTQModel catcher).

The family's base model (`LlamaModel`, `Gemma2Model`, …) is built on the meta
device; only its embedding, rotary embedding and other buffers are made real,
and each decoder layer is replaced by a `_Catcher` that records what the
forward hands it and stops the forward. So Gemma's √d embedding scale, every
sliding-window or full causal/padding mask, rotary tables and whatever
keyword the family passes its layers come from transformers, not from us.
Nothing of size vocabulary × hidden is ever allocated: the embedding is
called on the rows a batch uses.
"""

from __future__ import annotations

from typing import Any

import torch

from featcal_llm.errors import FeatCalError, float16_cause


def materialise_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Real buffers (rotary inv_freq, Gemma's embed_scale) of a model built on the meta device, filled by the family's
    own `_init_weights`; meta parameters are left alone (the weights are assigned from the checkpoints)."""
    for module in model.modules():
        meta = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        if not meta:
            continue
        for name in meta:
            buffer = module._buffers[name]
            module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
        model._init_weights(module)


FULL = "full_attention"  # the layer kind of families without `config.layer_types`


class _Stop(Exception):
    """Raised by a catcher once everything wanted is recorded; ends the model forward early."""


class _Catcher(torch.nn.Module):
    """Stands in for decoder layer `index`: records its call, returns the input unchanged or stops the forward."""

    def __init__(self, index: int, kind: str, front: "ModelFront"):
        super().__init__()
        self.index, self.kind, self._front = index, kind, front

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise FeatCalError(f"internal: {type(self._front.model).__name__} passes positional layer arguments")
        return self._front._caught(self, hidden_states, kwargs)


def layer_kinds(config: Any) -> list[str]:
    """Per decoder layer, the key of its arguments: `config.layer_types[l]` (sliding/full) where the family has it."""
    kinds = getattr(config, "layer_types", None)
    return list(kinds) if kinds else [FULL] * config.num_hidden_layers


class ModelFront:
    """The family's model forward up to (and excluding) the decoder layers, on `device`."""

    def __init__(self, model_class: type, config: Any, device: torch.device, dtype: torch.dtype = torch.float32):
        # Built under the compute dtype, as `from_pretrained(dtype=...)` builds a model: buffers such as Gemma's
        # embed_scale = √hidden take that dtype (float64 runs get the float64 root, not a float32 one).
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                self.model = model_class(config)  # resolves config._attn_implementation the family's way
        finally:
            torch.set_default_dtype(previous)
        self.model.eval().requires_grad_(False)
        self.kinds = layer_kinds(config)
        self.model.layers = torch.nn.ModuleList(_Catcher(i, kind, self) for i, kind in enumerate(self.kinds))
        materialise_buffers(self.model, device)
        self.device = device
        self._wanted: set[str] = set()
        self._record: dict[str, Any] = {}

    def _caught(self, catcher: _Catcher, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        if catcher.index == 0:
            self._record["hidden"] = hidden
        if catcher.kind in self._wanted and catcher.kind not in self._record:
            self._record[catcher.kind] = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
        if all(kind in self._record for kind in self._wanted) and "hidden" in self._record:
            raise _Stop
        return hidden

    def _run(self, wanted: set[str], keep: torch.Tensor, **inputs: Any) -> dict[str, Any]:
        self._wanted, self._record = wanted, {}
        try:
            with torch.inference_mode():
                self.model(attention_mask=keep.to(self.device).long(), use_cache=False, **inputs)
        except _Stop:
            pass
        finally:
            record, self._record, self._wanted = self._record, {}, set()
        if any(kind not in record for kind in wanted) or "hidden" not in record:
            raise FeatCalError(f"internal: {type(self.model).__name__}.forward did not reach every decoder layer")
        return record

    def arguments(self, hidden: torch.Tensor, keep: torch.Tensor) -> dict[str, dict[str, Any]]:
        """Layer kind → the keyword arguments the family passes a decoder layer of that kind for these inputs."""
        record = self._run(set(self.kinds), keep, inputs_embeds=hidden)
        return {kind: record[kind] for kind in set(self.kinds)}

    def embed(self, input_ids: torch.Tensor, keep: torch.Tensor, embedding: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
        """Decoder layer 0's input for these tokens: the family's embedding step (scaled, for Gemma) over `embedding`'s rows.

        The embedding step is per token in every supported family (no absolute
        position embeddings), so the forward runs once on each distinct real
        token, as a batch of one-token sequences: no mask or rotary work, and
        only those rows are moved and converted. Padding positions get some
        real token's vector (they are masked everywhere, and `HostStore.store`
        zeroes them), so a pad id needs no row.
        """
        real = input_ids[keep]
        if real.numel() == 0:
            raise FeatCalError(f"{what}: a batch without tokens")
        if bool((real < 0).any()) or int(real.max()) >= embedding.shape[0]:
            raise FeatCalError(f"{what}: embedding of {embedding.shape[0]} rows cannot embed calibration token id {int(real.max())} (tokenizer mismatch?)")
        rows, positions = torch.unique(real, return_inverse=True)
        local = torch.zeros_like(input_ids)
        local[keep] = positions
        module = self.model.get_input_embeddings()
        original = module.weight, module.padding_idx
        table = embedding[rows].to(device=self.device, dtype=dtype)
        module.weight, module.padding_idx = torch.nn.Parameter(table, requires_grad=False), None  # padding_idx only matters for gradients
        try:
            ids = torch.arange(len(rows), device=self.device).unsqueeze(1)
            per_token = self._run(set(), torch.ones_like(ids, dtype=torch.bool), input_ids=ids)["hidden"][:, 0]
        finally:
            module.weight, module.padding_idx = original
        if not bool(torch.isfinite(per_token.sum())):  # one pass; a sum of finite embeddings cannot overflow
            raise FeatCalError(f"{what}: the embedding of a calibration token contains NaN or Inf{float16_cause(dtype)}")
        return per_token[local.to(self.device)]
