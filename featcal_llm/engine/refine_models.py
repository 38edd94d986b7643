"""Whole causal LMs for the refine stage, built from the engine's checkpoint readers.

The layer loop never holds a whole model; refinement does: the student (the
merged model with the closed form's tensors in place) and, one at a time,
each teacher. They are built from `CheckpointReader`s, so a LoRA expert
(`LoraReader`: W + scale·B·A on read) and the merge standing in for a trailing
expert come out as the layer loop sees them. The model is made on the meta
device under the family's own transformers class, its buffers (rotary tables,
Gemma's embedding scale) filled by the family's `_init_weights`, then the
tensors are assigned: no random initialisation of billions of weights first.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from featcal_llm.engine.drift import LM_HEAD
from featcal_llm.family.front import materialise_buffers


def build_causal_lm(config: Any, names: list[str], get: Callable[[str], torch.Tensor], device: torch.device,
                    dtype: torch.dtype, what: str, trust_remote_code: bool = False,
                    dtypes: Callable[[str], torch.dtype] | None = None) -> torch.nn.Module:
    """The family's `*ForCausalLM` holding these tensors on `device` in `dtype` (`dtypes(name)`: per tensor, where given).

    Tied exactly when the checkpoint has no `lm_head.weight`, as the engine's own heads read it (engine/drift.Head).
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.tie_word_embeddings = LM_HEAD not in names
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else previous)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    finally:
        torch.set_default_dtype(previous)
    materialise_buffers(model, device)
    wanted = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    # copies: a reader's tensor may be a view of its memory-mapped file, which training must never write through
    state = {name: get(name).to(device=device, dtype=dtypes(name) if dtypes else dtype, copy=True) for name in names if name in wanted}
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [name for name in result.missing_keys if not (config.tie_word_embeddings and name == LM_HEAD)]
    if config.tie_word_embeddings:
        model.tie_weights()
    still_meta = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if missing or still_meta:
        raise RuntimeError(f"internal: {what}: tensors missing from the checkpoint for the whole model: {(missing or still_meta)[:3]}")
    return model


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The `*Model` inside a `*ForCausalLM` (embedding, layers, final norm)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def logits_of(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on final-norm outputs, returned in float32, with the family's logit soft-capping (Gemma-2). Under bf16
    autocast the product itself is bf16 (logits near 20 in steps of 0.125), for the student as for its teachers, whose
    top-k log-probabilities are kept in float16: a KL floor estimated near 1e-3 nats a token (not measured on a GPU)."""
    head = model.get_output_embeddings()
    logits = head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


__all__ = ["build_causal_lm", "decoder", "logits_of"]
