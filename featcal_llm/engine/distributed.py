"""Many ranks, same weights: data parallel over calibration tokens with torch.distributed (`torchrun … -m featcal_llm run`).

Every rank owns a token-balanced shard of every expert's calibration (and
probe) sequences and runs each layer on it. Input groups are owned by ranks
(balanced by d³); each task's statistics of a group are summed in float64 onto
its owner (`reduce`, or `all_reduce` with FEATCAL_DISTRIBUTED_REDUCE=all), the
owner folds and solves the group, and broadcasts the solution. Criterion and
drift sums are all-reduced, so every rank chooses the same candidate. Only
rank 0 writes. `Single` is the one-process communicator: every operation is a
no-op, so `python -m featcal_llm run` is unchanged; `torch_world.TorchDistributed`
is torchrun's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import torch

from featcal_llm.errors import FeatCalError

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext
    from featcal_llm.engine.plan import CalibrationPlan
    from featcal_llm.maths.stats import GroupStatistics

def shard_indices(lengths: list[int], rank: int, world: int) -> list[int]:
    """Indices (in file order) of the sequences rank `rank` owns: greedy longest-first onto the least-loaded rank (ties: lower rank)."""
    loads = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(world), key=lambda r: (loads[r], r))
        loads[target] += lengths[index]
        owned[target].append(index)
    return sorted(owned[rank])


def group_owners(plan: "CalibrationPlan", layer: torch.nn.Module, world: int) -> dict[str, int]:
    """Input group → the rank that folds and solves it, greedy largest-first by d³ (the Cholesky's cost)."""
    cost = {g.name: layer.get_submodule(g.projections[0]).in_features ** 3 for g in plan.groups()}
    loads = [0] * world
    owners = {}
    for name in sorted(cost, key=lambda n: (-cost[n], n)):
        owners[name] = min(range(world), key=lambda r: (loads[r], r))
        loads[owners[name]] += cost[name]
    return owners


def statistics_tensors(stats: "GroupStatistics") -> list[torch.Tensor]:
    """The tensors of one group's statistics that the solve needs, in a fixed order (moment instead of crosses if recorded so)."""
    expert = [stats.moment] if stats.via_moment else [stats.cross[p] for p in sorted(stats.cross)]
    return [t for t in (stats.gram, *expert, stats.sum_cal, stats.sum_exp, stats.norm_sq) if t is not None]


class Single:
    """One process: owns everything, reduces nothing."""

    rank, world, is_main, ready = 0, 1, True, True

    def __init__(self) -> None:
        self.traffic: list[dict[str, int]] = []  # per calibrated layer: payload bytes by kind

    def shard(self, sequences: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        return sequences

    def sum_int(self, value: int) -> int:
        return value

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor summed over every rank, on its own device."""
        return tensor

    def sum_floats(self, values: list[float]) -> list[float]:
        return values

    def all_true(self, flag: bool) -> bool:
        return flag

    def owners(self, plan: "CalibrationPlan", layer: torch.nn.Module) -> dict[str, int]:
        return {g.name: 0 for g in plan.groups()}

    def local_plan(self, plan: "CalibrationPlan", owners: dict[str, int]) -> "CalibrationPlan":
        return plan

    def reduce_statistics(self, stats: dict[str, "GroupStatistics"], owners: dict[str, int]) -> None:
        return None

    def solve_layer(self, ctx: "RunContext", layer: int, systems, tensors, hyper=None, solver=None) -> dict[str, torch.Tensor]:
        return ctx.plan.objective.solve_layer(ctx.plan, layer, systems, tensors, hyper, solver)

    def broadcast_object(self, value: Any) -> Any:
        return value

    def gather_objects(self, value: Any) -> list[Any] | None:
        """Every rank's `value`, in rank order, on rank 0 (None on the others)."""
        return [value]

    def agree(self, fingerprint: str | None, error: str | None = None) -> None:
        if error is not None:
            raise FeatCalError(error)

    def use(self, device: torch.device) -> None:
        return None

    def run_on_main(self, step: str, work: Callable[[], Any]) -> Any:
        """Run `work` on rank 0 only (a long step: the merge, generation); every rank returns its result (others: None)."""
        return work()

    def report_failure(self, message: str) -> None:
        return None

    def barrier(self) -> None:
        return None

    def new_layer(self) -> None:
        self.traffic.append({})

    def close(self) -> None:
        return None


class WorldError(FeatCalError):
    """An error every rank already knows of (a failed handshake, a rank that stopped): raised as is, not passed on again."""


def communicator() -> Single:
    """The world this process is part of: torchrun's (WORLD_SIZE > 1) or a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from featcal_llm.engine.torch_world import TorchDistributed  # torch.distributed only under torchrun

        return TorchDistributed()
    return Single()


def rank_device(device: torch.device) -> torch.device:
    """Under torchrun each rank computes on its local GPU (cuda:LOCAL_RANK); CPUs are shared. A GPU named by index would
    hold every rank, and NCCL refuses that at its first collective, after every rank has loaded its models."""
    if device.type == "cuda" and device.index is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise FeatCalError(f"featcal.device: {device} under torchrun would put every rank on that one GPU; write cuda "
                           "(each rank takes its LOCAL_RANK's GPU) and choose the GPUs with CUDA_VISIBLE_DEVICES")
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    return device
