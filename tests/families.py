"""Test-only model builders: a tiny config of every supported family, and non-trivial norms and biases."""

from __future__ import annotations

import torch

from featcal_llm.tiny import tiny_llama_config

def tiny_config(family: str, vocab_size: int, layers: int = 2, **overrides):
    """A tiny config of `family` (llama, mistral, qwen2, qwen3, gemma2, phi3): hidden 64, GQA 4/2, head_dim 16.

    Sliding windows, soft-capping and biases keep each family's defaults unless
    overridden; tests pass a tiny `sliding_window` so that it matters.
    """
    import transformers

    if family == "llama":
        return tiny_llama_config(vocab_size, num_hidden_layers=layers, **overrides)
    classes = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma2", "phi3": "Phi3"}
    if family not in classes:
        raise ValueError(f"unknown family {family!r} (expected llama or one of {', '.join(classes)})")
    settings = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family in ("qwen3", "gemma2"):
        settings["head_dim"] = 16
    if family == "gemma2":
        settings.update(query_pre_attn_scalar=16, attn_logit_softcapping=1.0, final_logit_softcapping=30.0)
    if family != "gemma2":
        settings["tie_word_embeddings"] = False
    settings.update(overrides)
    config = getattr(transformers, f"{classes[family]}Config")(**settings)
    config.architectures = [f"{classes[family]}ForCausalLM"]
    return config

def randomize_small_parameters(model: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    """Seeded noise on every 1-D parameter (biases, norm scales), which HF initialises to exactly 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(scale * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model
