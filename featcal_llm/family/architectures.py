"""Per model family: where a decoder layer's tensors live and which projections share an input.

Architecture knowledge is data, not code: the pipeline never spells a module
name. Adding a family is adding an entry; masks, rotary tables, the
embedding step and attention come from the family's transformers classes
(`layers.py`, `front.py`). Norms not named by a group (Gemma-2's
post-attention/post-feedforward norms, Qwen3's q_norm/k_norm) stay merged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from featcal_llm.errors import FeatCalError
from featcal_llm.startup import heavy_import


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
    base_model: str  # import path of the family's `*Model` (embedding, masks, rotary, layers)
    groups: tuple[InputGroup, ...]
    name: str = ""  # the transformers class, as config.json's `architectures` names it
    # vLLM serves it only with the LM head tied to the input embeddings (its Gemma-2 class asserts
    # `tie_word_embeddings`), so a re-fitted head, a tensor of its own, would not load there
    head_tied_only: bool = False

    def layer_class(self) -> type:
        return _import(self.decoder_layer)

    def model_class(self) -> type:
        return _import(self.base_model)

    def prefix(self, layer: int) -> str:
        return self.layer_prefix.format(layer=layer)

    def projections(self) -> tuple[str, ...]:
        return tuple(p for group in self.groups for p in group.projections)

    def norms(self) -> tuple[str, ...]:
        return tuple(group.norm for group in self.groups if group.norm)


def _import(dotted: str) -> type:
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(heavy_import(module_name), attribute)


def _groups(qkv: tuple[str, ...], gate_up: tuple[str, ...], mlp_norm: str = "post_attention_layernorm") -> tuple[InputGroup, ...]:
    return (
        InputGroup("attention_input", tuple(f"self_attn.{p}" for p in qkv), norm="input_layernorm"),
        InputGroup("attention_output", ("self_attn.o_proj",)),
        InputGroup("mlp_input", tuple(f"mlp.{p}" for p in gate_up), norm=mlp_norm),
        InputGroup("mlp_hidden", ("mlp.down_proj",)),
    )


_SEPARATE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _family(family: str, class_prefix: str, groups: tuple[InputGroup, ...] = _groups(*_SEPARATE), head_tied_only: bool = False) -> Architecture:
    module = f"transformers.models.{family}.modeling_{family}"
    return Architecture(
        layer_prefix="model.layers.{layer}.",
        embed_tokens="model.embed_tokens.weight",
        decoder_layer=f"{module}.{class_prefix}DecoderLayer",
        base_model=f"{module}.{class_prefix}Model",
        groups=groups,
        name=f"{class_prefix}ForCausalLM",
        head_tied_only=head_tied_only,
    )


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": _family("llama", "Llama"),
    "MistralForCausalLM": _family("mistral", "Mistral"),
    "Qwen2ForCausalLM": _family("qwen2", "Qwen2"),  # Qwen2 and Qwen2.5
    "Qwen3ForCausalLM": _family("qwen3", "Qwen3"),
    # Gemma-2: the MLP reads pre_feedforward_layernorm's output; its norms scale by (1 + w).
    "Gemma2ForCausalLM": _family("gemma2", "Gemma2", _groups(*_SEPARATE, mlp_norm="pre_feedforward_layernorm"), head_tied_only=True),
    # Phi-3: fused projections, each one input group of its own.
    "Phi3ForCausalLM": _family("phi3", "Phi3", _groups(("qkv_proj",), ("gate_up_proj",))),
}
MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_head_refit(architecture: Architecture, featcal: Any, where: str) -> None:
    """`head: true` (`when: always`) on a family vLLM serves only tied is refused: the re-fitted head would be written
    untied, which transformers serves and vLLM refuses to load. `head: auto` keeps such a head tied instead (the run
    says so)."""
    if architecture.head_tied_only and featcal.head is not None and not featcal.regmean and not featcal.head_when_changed:
        raise FeatCalError(f"{where}: featcal.head: a re-fitted LM head is a tensor of its own, untied from the input "
                           f"embeddings, and vLLM serves {architecture.name} only tied; set head: false or auto (which keep it tied)")


def architecture_for(config: Any, where: str) -> Architecture:
    names = list(getattr(config, "architectures", None) or [])
    if any(getattr(config, key, None) for key in MOE_CONFIG_KEYS):
        raise FeatCalError(f"{where}: architecture {names or 'unknown'} is a mixture of experts; FeatCal calibrates dense decoder layers only")
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
