"""Start-up of `featcal-llm run`: wall and CPU seconds from spawning the process to its progress bar.

    python -m studies.startup_benchmark RECIPE RUNS NAME=SOURCE_TREE [NAME=SOURCE_TREE ...]

runs `python -m featcal_llm run RECIPE --force` with each source tree on
PYTHONPATH (e.g. `before=/tmp/before` from `git archive`, `after=.`),
interleaved, RUNS times each; stops each run when `FeatCal` (the progress bar)
appears on stderr and reads the process's CPU time from /proc at that moment,
so contention from other processes counts in wall seconds only. A tiny recipe:
`featcal_llm.benchmark.wholerun.build(WholeRunSpec(hidden=64, intermediate=128,
heads=4, kv_heads=2, vocab=128, layers=4, experts=3, sequences=128, seq_len=64), ...)`.
Linux only (/proc).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time


def to_progress_bar(source: str, recipe: str) -> tuple[float, float]:
    """(wall s, CPU s) of one run until the progress bar; the run is then killed."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(source))
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "featcal_llm", "run", recipe, "--force"], cwd=source, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    seen = b""
    while chunk := os.read(process.stderr.fileno(), 65536):
        seen = seen[-4096:] + chunk
        if b"FeatCal" in seen:
            wall = time.perf_counter() - started
            fields = open(f"/proc/{process.pid}/stat").read().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
            process.kill()
            process.wait()
            return wall, cpu
    process.wait()
    raise SystemExit(f"{source}: no progress bar (exit code {process.returncode}): {seen.decode(errors='replace')[-1000:]}")


def main() -> None:
    recipe, runs, trees = sys.argv[1], int(sys.argv[2]), dict(arg.split("=", 1) for arg in sys.argv[3:])
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    load = os.getloadavg()[0]
    for _ in range(runs):
        for name, source in trees.items():
            results[name].append(to_progress_bar(source, recipe))
    print(f"load average {load:.2f} → {os.getloadavg()[0]:.2f}")
    for name, pairs in results.items():
        runs_text = ", ".join(f"{wall:.2f} w / {cpu:.2f} CPU" for wall, cpu in pairs)
        print(f"{name}: {runs_text}; median {statistics.median(w for w, _ in pairs):.2f} s wall, {statistics.median(c for _, c in pairs):.2f} CPU s")


if __name__ == "__main__":
    from studies.common import answer_help

    answer_help(__doc__)
    main()
