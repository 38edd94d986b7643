"""What this machine's CPU can do, read without torch (so that `validate` can plan with it)."""

from __future__ import annotations

from pathlib import Path


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): there bf16 layers run 3-4× faster than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_refusal(on_gpu: bool) -> str | None:
    """Why vLLM cannot sample here (None: it can): it needs its package and a CUDA device."""
    if not vllm_installed():
        return "vllm requested but it is not installed (pip install 'featcal-llm[vllm]')"
    return None if on_gpu else "vllm requested but the device is not a GPU"
