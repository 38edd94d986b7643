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
