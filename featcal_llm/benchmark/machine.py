"""The machine's own limits, measured in the same run: matmul rate per dtype, disk rates, memory peaks."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import torch

CHUNK = 64 << 20


def synchronizer(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """FLOP/s of a square size×size matmul in `dtype` on `device`: the best of `repeats`, after a warm-up.

    The best, not the median: this is the peak the phases are compared with,
    and on a shared machine slower repeats measure other people's load.
    """
    sync = synchronizer(device)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((size, size), generator=generator, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn((size, size), generator=generator, device=device, dtype=torch.float32).to(dtype)
    out = torch.empty((size, size), device=device, dtype=dtype)
    torch.matmul(a, b, out=out)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        sync()
        times.append(time.perf_counter() - start)
    del a, b, out
    return 2.0 * size**3 / min(times)


def drop_from_page_cache(path: Path) -> bool:
    """Ask the kernel to forget the file's cached pages (they must be clean: written and fsync'ed)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _read_all(path: Path) -> int:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(view)
            if not count:
                break
            total += count
    return total


def disk_rates(directory: Path, megabytes: int) -> dict[str, float | bool]:
    """Write (fsync'ed) a fresh file, drop it from the page cache and read it back: bytes/s of each.

    `read_cold` is the disk read rate when the drop worked (`cache_dropped`);
    `read_cached` is a second read, i.e. the page-cache copy rate.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "disk-probe.bin"
    chunk = torch.randint(0, 256, (min(CHUNK, megabytes << 20),), dtype=torch.uint8).numpy().tobytes()
    size = megabytes << 20
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as handle:
            written = 0
            while written < size:
                piece = chunk[: min(len(chunk), size - written)]
                handle.write(piece)
                written += len(piece)
            handle.flush()
            os.fsync(handle.fileno())
        write = size / (time.perf_counter() - start)
        dropped = drop_from_page_cache(path)
        start = time.perf_counter()
        _read_all(path)
        cold = size / (time.perf_counter() - start)
        start = time.perf_counter()
        _read_all(path)
        cached = size / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)
    return {"write": write, "read_cold": cold, "read_cached": cached, "cache_dropped": dropped, "probe_bytes": size}


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> tuple[int | None, int]:
    """(VmHWM since the last reset, or None; lifetime peak RSS from getrusage)."""
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    hwm = None
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return hwm, lifetime
