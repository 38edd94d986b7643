"""What this machine can do (its CPU's bf16 units, which optional packages are installed), read without importing
torch or those packages (so that `validate` can ask)."""

from __future__ import annotations

from pathlib import Path


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): there bf16 layers run 3-4× faster than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def vllm_refusal(on_gpu: bool) -> str | None:
    """Why vLLM cannot sample here (None: it can): it needs its package and a CUDA device."""
    if not installed("vllm"):
        return "vllm requested but it is not installed (pip install 'featcal-llm[vllm]')"
    return None if on_gpu else "vllm requested but the device is not a GPU"
