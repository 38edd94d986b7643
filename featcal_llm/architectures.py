"""Per model family: where a decoder layer's tensors live and which projections share an input.

Architecture knowledge is data, not code: the pipeline never spells a module
name. Adding a family (Mistral, Qwen2 are here) is adding an entry.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from featcal_llm.errors import FeatCalError


@dataclass(frozen=True)
class InputGroup:
    """Projections that read the same input; they share one Gram matrix per task."""

    name: str
    projections: tuple[str, ...]  # module paths inside the decoder layer
    norm: str | None = None  # the RMSNorm whose output is this group's input, if any


@dataclass(frozen=True)
class Architecture:
    layer_prefix: str  # format string with {layer}
    embed_tokens: str
    decoder_layer: str  # import path of the transformers decoder layer class
    rotary_embedding: str  # import path of the family's rotary embedding class
    groups: tuple[InputGroup, ...]

    def layer_class(self) -> type:
        return _import(self.decoder_layer)

    def rotary_class(self) -> type:
        return _import(self.rotary_embedding)

    def prefix(self, layer: int) -> str:
        return self.layer_prefix.format(layer=layer)

    def projections(self) -> tuple[str, ...]:
        return tuple(p for group in self.groups for p in group.projections)

    def norms(self) -> tuple[str, ...]:
        return tuple(group.norm for group in self.groups if group.norm)


def _import(dotted: str) -> type:
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


_LLAMA_GROUPS = (
    InputGroup("attention_input", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), norm="input_layernorm"),
    InputGroup("attention_output", ("self_attn.o_proj",)),
    InputGroup("mlp_input", ("mlp.gate_proj", "mlp.up_proj"), norm="post_attention_layernorm"),
    InputGroup("mlp_hidden", ("mlp.down_proj",)),
)


def _llama_like(family: str, class_prefix: str) -> Architecture:
    return Architecture(
        layer_prefix="model.layers.{layer}.",
        embed_tokens="model.embed_tokens.weight",
        decoder_layer=f"transformers.models.{family}.modeling_{family}.{class_prefix}DecoderLayer",
        rotary_embedding=f"transformers.models.{family}.modeling_{family}.{class_prefix}RotaryEmbedding",
        groups=_LLAMA_GROUPS,
    )


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": _llama_like("llama", "Llama"),
    "MistralForCausalLM": _llama_like("mistral", "Mistral"),
    "Qwen2ForCausalLM": _llama_like("qwen2", "Qwen2"),
}


def architecture_for(config: Any, where: str) -> Architecture:
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise FeatCalError(
        f"{where}: architecture {names or 'unknown'} is not supported (supported: {', '.join(ARCHITECTURES)})"
    )


def select_projections(architecture: Architecture, requested: list[str] | None, where: str) -> frozenset[str]:
    """Module paths to calibrate; `requested` may use short names like q_proj."""
    every = architecture.projections()
    if requested is None:
        return frozenset(every)
    chosen = set()
    for name in requested:
        matches = [p for p in every if p == name or p.rsplit(".", 1)[-1] == name]
        if not matches:
            raise FeatCalError(f"{where}: featcal.modules: unknown projection {name!r} (expected one of {', '.join(p.rsplit('.', 1)[-1] for p in every)})")
        chosen.update(matches)
    return frozenset(chosen)
