"""Where and in which precisions a run computes: the device, the layers' dtype and the statistics' dtype.

`auto` resolves by what the hardware does fast (bf16 units, float64 rate) and by how far the ridge lets float32
statistics move the update; a recipe's explicit value always wins.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from featcal_llm.errors import FeatCalError, warn
from featcal_llm.hardware import native_bf16_matmul
from featcal_llm.io.block import check_device


def release_memory() -> None:
    """Collect what a stage dropped and hand the CUDA caching allocator's free blocks back to the driver, so that the
    next engine (a vLLM evaluation or sampler in another process, which asks for a share of the free memory) finds it."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)  # pinned host blocks, kept by the allocator
        if empty_host_cache is not None:
            empty_host_cache()


def resolve_device(requested: str) -> torch.device:
    check_device(requested, "device")  # a caller's override, checked as the recipe key is
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise FeatCalError(f"featcal.device: {requested} requested but CUDA is not available")
    return torch.device(requested)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bfloat16 natively: a GPU that supports it, or a CPU with AVX512-BF16 or AMX
    (`native_bf16_matmul`, the one CPU rule the layers' dtype and refine's autocast share); elsewhere bf16 is emulated
    and slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and native_bf16_matmul()


def resolve_dtype(requested: str, device: torch.device, stored: torch.dtype | None = None) -> torch.dtype:
    """Compute dtype: bfloat16 on GPUs; on CPUs the checkpoint's bfloat16 where the CPU has bf16 units, else float32."""
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda" or (stored == torch.bfloat16 and native_bf16_matmul()):
        return torch.bfloat16
    return torch.float32


# float32 statistics are used only where the ridge keeps their rounding near 1e-5 relative on ΔW (≤ 1.5e-5 measured on
# an AVX-512 MKL CPU; tests/test_statistics_precision.py bounds it at 2e-5; docs/benchmark.md)
FLOAT32_STATS_MIN_LAMBDA = 1e-2


def stored_dtype(config: Any) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are stored in (transformers 5: `dtype`; older: `torch_dtype`)."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def fast_float64(device: torch.device) -> bool:
    """CPUs and data-centre GPUs (A100, H100/H200, B100/B200) multiply float64 at a useful rate; other GPUs at 1/64 of float32."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) in {(8, 0), (9, 0), (10, 0)}


def resolve_stats_dtype(requested: str, smallest_lambda: float, compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Precision of the statistics products: float32 where the ridge bounds what its rounding does to ΔW, float64 below.

    The solve amplifies a perturbation of the Grams by up to about ‖Σ ω G‖ / λ,
    and float32 sums perturb them by the products' own rounding (not by the
    order of the additions: a float64 running total per batch or Kahan
    summation change nothing, measured). On SmolLM2-135M shapes float32 products
    move ΔW by ≤ 3.8e-6 relative at λ = 1e-2 but by 5.6e-4 at λ = 1e-5
    (`python -m featcal_llm.benchmark.precision`). A tuned run passes its smallest
    candidate; float64 features always get float64 sums. A GPU without fast
    float64 keeps float32 below λ = 1e-2 (float64 would cost hours per model there), with a warning.
    """
    if requested != "auto":
        return getattr(torch, requested)
    if compute_dtype == torch.float64:
        return torch.float64
    if smallest_lambda >= FLOAT32_STATS_MIN_LAMBDA:
        return torch.float32
    if not fast_float64(device):
        warn(
            f"featcal.stats_dtype: lambda {smallest_lambda:g} < {FLOAT32_STATS_MIN_LAMBDA:g} on a GPU without fast float64: "
            "statistics use float32 products, which can move the update by ~1e-4-1e-3 relative; set stats_dtype: float64 to avoid it"
        )
        return torch.float32
    return torch.float64


def head_stats_dtype(head_lambda: float, compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Precision of the LM head's statistics products: float64 whatever `stats_dtype` gives the layers, so that a tuned
    replay, which pins the layers' precision, re-fits the head alike; its λ is 1e-5 by default and its products are
    one d × d Gram per expert. A GPU without fast float64 keeps float32, with a warning."""
    if compute_dtype == torch.float64 or fast_float64(device):
        return torch.float64
    warn(f"featcal.head: the LM head's statistics use float32 products on a GPU without fast float64, which can move its "
         f"update by ~1e-4-1e-3 relative at its lambda {head_lambda:g}")
    return torch.float32
