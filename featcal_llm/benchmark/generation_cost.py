"""What `generate:` costs next to the calibration itself, on the benchmark's shapes (issue 17).

Each expert writing as many tokens as the benchmark calibrates on, with
transformers `generate` (KV cache, one batch of the benchmark's sequences, from
the BOS token, every sample run to its full length), timed on a model of the
benchmark's hidden sizes and measured layer count, and scaled to the
extrapolated depth as the calibration time is. Weights are random (from the
config): the cost of a decode step does not depend on their values.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def measure_generation(config: Any, layers: int, sequences: int, seq_len: int, experts: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Seconds for one expert's sequences × seq_len new tokens at `layers` layers, and the rate."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = config.__class__.from_dict(config.to_dict())
    config.num_hidden_layers = layers
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    settings = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=seq_len, min_new_tokens=seq_len,
                                pad_token_id=0, eos_token_id=None)
    start = torch.full((sequences, 1), 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        model.generate(input_ids=start[:, :1], attention_mask=torch.ones_like(start), generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=2, min_new_tokens=2, pad_token_id=0, eos_token_id=None))  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        out = model.generate(input_ids=start, attention_mask=torch.ones_like(start), generation_config=settings)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
    tokens = (out.shape[1] - 1) * sequences
    del model
    return {"backend": "transformers", "layers": layers, "batch": sequences, "tokens_per_expert": tokens, "experts": experts,
            "seconds_per_expert": seconds, "tokens_per_second": tokens / seconds}


def compare_with_calibration(generation: dict, calibration_seconds: float, target_layers: int) -> dict:
    """Generation for every expert scaled from the measured to the extrapolated depth, against calibration there.

    Linear in layers: right where decode steps are compute- or bandwidth-bound (real shapes); an overestimate
    where the per-step overhead of `generate` dominates (tiny shapes).
    """
    scaled = generation["seconds_per_expert"] * generation["experts"] * target_layers / generation["layers"]
    return {**generation, "target_layers": target_layers, "seconds_all_experts_extrapolated": scaled,
            "calibration_seconds_extrapolated": calibration_seconds, "ratio_to_calibration": scaled / calibration_seconds}


def render_generation(entry: dict) -> list[str]:
    return [
        "",
        f"generate: (each expert writes its own {entry['tokens_per_expert']} tokens; {entry['backend']} generate, KV cache, batch {entry['batch']}, "
        f"{entry['layers']} layers measured): {entry['tokens_per_second']:.1f} tokens/s, {entry['seconds_per_expert']:.2f} s per expert",
        f"  extrapolated to {entry['target_layers']} layers: {entry['seconds_all_experts_extrapolated']:.1f} s for {entry['experts']} experts "
        f"vs calibration {entry['calibration_seconds_extrapolated']:.1f} s  →  generation is {entry['ratio_to_calibration']:.2f}× the calibration "
        "(vLLM, on a GPU, is not measured here)",
    ]
