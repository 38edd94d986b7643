"""What `generate:` costs next to the calibration itself, on the benchmark's shapes.

Each expert writing as many tokens as the benchmark calibrates on, with
transformers `generate` (KV cache, batches of 32 as `generate:` defaults to,
from the BOS token, every sample run to its full length), timed on models of the
benchmark's shapes at 1 layer and at the measured layer count, and extrapolated
to the full depth as fixed part + depth × per-layer part (the LM head of a large
vocabulary is a fixed cost that would dominate a small layer count). Weights are
random (from the config): the cost of a decode step does not depend on their values.
"""

from __future__ import annotations

import time
from typing import Any

import torch


BATCH = 32  # GenerateSpec.batch_size's default


def _time_generate(config, layers: int, sequences: int, seq_len: int, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds for `sequences` samples of `seq_len` new tokens each, in batches of BATCH, at `layers` layers."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = config.__class__.from_dict(config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    full_length = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=seq_len, min_new_tokens=seq_len,
                                   pad_token_id=0, eos_token_id=None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    with torch.inference_mode():
        warm = torch.ones((1, 1), dtype=torch.long, device=device)
        model.generate(input_ids=warm, attention_mask=warm, generation_config=GenerationConfig(max_new_tokens=2, min_new_tokens=2, pad_token_id=0, eos_token_id=None))
        sync()
        began = time.perf_counter()
        for first in range(0, sequences, BATCH):
            start = torch.ones((min(BATCH, sequences - first), 1), dtype=torch.long, device=device)  # from the BOS id
            model.generate(input_ids=start, attention_mask=torch.ones_like(start), generation_config=full_length)
        sync()
        return time.perf_counter() - began


def measure_generation(config: Any, layers: int, sequences: int, seq_len: int, experts: int, device: torch.device, dtype: torch.dtype) -> dict:
    """One expert's sequences × seq_len new tokens, timed at 1 layer and at `layers` layers (a fixed part plus a part per layer)."""
    depths = sorted({1, max(1, layers)})
    seconds = {depth: _time_generate(config, depth, sequences, seq_len, device, dtype) for depth in depths}
    high = depths[-1]
    per_layer = (seconds[high] - seconds[1]) / (high - 1) if high > 1 else seconds[1]
    fixed = seconds[1] - per_layer if high > 1 else 0.0
    tokens = sequences * seq_len
    return {"backend": "transformers", "layers": high, "batch": min(BATCH, sequences), "tokens_per_expert": tokens, "experts": experts,
            "seconds_per_expert": seconds[high], "tokens_per_second": tokens / seconds[high],
            "seconds_at_depth": {str(d): s for d, s in seconds.items()}, "fixed_seconds": fixed, "per_layer_seconds": per_layer}


def compare_with_calibration(generation: dict, calibration_seconds: float, target_layers: int) -> dict:
    """Generation for every expert at the extrapolated depth (the fixed part, embedding, LM head and sampling, plus
    the measured cost per layer times the depth), against calibration extrapolated to the same depth."""
    one_expert = max(generation["fixed_seconds"], 0.0) + max(generation["per_layer_seconds"], 0.0) * target_layers
    scaled = one_expert * generation["experts"]
    return {**generation, "target_layers": target_layers, "seconds_all_experts_extrapolated": scaled,
            "calibration_seconds_extrapolated": calibration_seconds, "ratio_to_calibration": scaled / calibration_seconds}


def render_generation(entry: dict) -> list[str]:
    return [
        "",
        f"generate: (each expert writes its own {entry['tokens_per_expert']} tokens; {entry['backend']} generate, KV cache, batches of {entry['batch']}): "
        f"{entry['tokens_per_second']:.1f} tokens/s at {entry['layers']} layers, {entry['seconds_per_expert']:.2f} s per expert "
        f"(fixed {entry['fixed_seconds']:.2f} s + {entry['per_layer_seconds']:.2f} s per layer)",
        f"  extrapolated to {entry['target_layers']} layers: {entry['seconds_all_experts_extrapolated']:.1f} s for {entry['experts']} experts "
        f"vs calibration {entry['calibration_seconds_extrapolated']:.1f} s  →  generation is {entry['ratio_to_calibration']:.2f}× the calibration "
        "(vLLM, on a GPU, is not measured here)",
    ]
