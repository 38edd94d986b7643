"""Launch a test world of `featcal-llm run` ranks as torchrun does (env:// variables, gloo on 127.0.0.1), bounded in time."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from featcal_llm.benchmark.distributed import launch_world

WORKER = Path(__file__).with_name("dist_worker.py")
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Rank:
    returncode: int
    stdout: str
    stderr: str


def launch(
    recipe: Path, world: int, logs: Path, *extra: str, timeout: float = 150.0, recipes: dict[int, Path] | None = None, env: dict | None = None
) -> list[Rank]:
    """`featcal-llm run RECIPE` (through dist_worker.py's optional faults) on `world` ranks of one thread each; `env` adds variables."""
    env = {"FEATCAL_DISTRIBUTED_TIMEOUT": "60", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    command = [sys.executable, str(WORKER), str(recipe), *extra]
    return [Rank(*result) for result in launch_world(command, world, logs, threads=1, timeout=timeout, env=env)]


@dataclass
class World:
    returncode: int
    stderr: str  # the agent's own
    ranks: list[str]  # each rank's stderr, by rank


def torchrun(recipe: Path, world: int, logs: Path, *extra: str, timeout: float = 150.0) -> World:
    """`featcal-llm run RECIPE` (through dist_worker.py) under torchrun itself, whose agent SIGTERMs the ranks left when
    one fails: `launch` has no agent. Each rank's stderr goes to its own file (--redirects), so it can be read alone."""
    import subprocess

    env = {**os.environ, "FEATCAL_DISTRIBUTED_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), "--redirects", "3",
               "--log-dir", str(logs), str(WORKER), str(recipe), *extra]
    agent = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = [next(logs.rglob(f"attempt_0/{rank}/stderr.log")).read_text() for rank in range(world)]
    return World(agent.returncode, agent.stderr, ranks)
