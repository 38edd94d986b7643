"""Launch a test world of ranks as torchrun does (env:// variables, gloo on 127.0.0.1), bounded in time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("dist_worker.py")
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Rank:
    returncode: int
    stdout: str
    stderr: str


def launch(recipe: Path, world: int, logs: Path, *extra: str, timeout: float = 150.0) -> list[Rank]:
    """Run `featcal-llm run RECIPE` on `world` ranks (one thread each); every rank is killed after `timeout` seconds."""
    port = str(free_port())
    logs.mkdir(parents=True, exist_ok=True)
    processes = []
    for rank in range(world):
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
            "FEATCAL_DISTRIBUTED_TIMEOUT": "60", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        out, err = open(logs / f"rank{rank}.out", "w"), open(logs / f"rank{rank}.err", "w")
        processes.append((subprocess.Popen([sys.executable, str(WORKER), str(recipe), *extra], env=env, stdout=out, stderr=err), out, err))
    ranks = []
    for rank, (process, out, err) in enumerate(processes):
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other, _, _ in processes:
                other.kill()
            process.wait()
        out.close(), err.close()
        ranks.append(Rank(process.returncode, (logs / f"rank{rank}.out").read_text(), (logs / f"rank{rank}.err").read_text()))
    return ranks
