"""What this machine can do (its CPU's bf16 units, which optional packages are installed), read without importing
torch or those packages (so that `validate` can ask)."""

from __future__ import annotations

import os
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


def cuda_refusal() -> str | None:
    """Why `device: cuda` cannot run on this machine, where that is certain without starting CUDA (None: it may).
    `run` asks torch itself, which also refuses a driver too old for the build."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None  # without torch, run cannot start at all: the set-up, not the recipe, is at fault
    try:
        version = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    driver = any(Path(path).exists() for path in ("/proc/driver/nvidia/version", "/dev/nvidiactl"))
    return cuda_refusal_for(version, driver)


def cuda_refusal_for(torch_version_file: str, nvidia_driver_loaded: bool) -> str | None:
    """`cuda_refusal` from torch's `version.py` (which records the CUDA or ROCm version it was built for, or None)."""
    import re

    built = lambda name: re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]", torch_version_file, re.MULTILINE) is not None  # noqa: E731
    if built("hip"):
        return None  # ROCm serves `cuda` devices through its own driver
    if not built("cuda"):
        return "CUDA is not available (torch is a CPU-only build)"
    if not nvidia_driver_loaded:
        return "CUDA is not available (no NVIDIA driver is loaded)"
    return None


def machine_ram() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def stream_budget(host_memory_gb: float | None) -> int:
    """Bytes of RAM the hidden-state streams may use before spilling: `host_memory_gb` in decimal GB (as the memory
    plan prints every size), or half the machine."""
    return int(host_memory_gb * 1e9) if host_memory_gb is not None else int(machine_ram() * 0.5)
