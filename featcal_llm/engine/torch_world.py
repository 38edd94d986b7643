"""The torch.distributed world behind `torchrun … -m featcal_llm run`: collectives, and naming the rank that failed.

Collectives go through `_call`, which turns a peer's failure (gloo/NCCL: a closed peer, a time-out) into one line
naming the rank: its own error left in the rendezvous store, else a rank whose heartbeat stopped, else a rank that only
gave up waiting. Long steps of rank 0 alone (the merge, generation) are waited for through the store, not a
collective, so `FEATCAL_DISTRIBUTED_TIMEOUT` bounds collectives only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch

from featcal_llm.engine.distributed import Single, WorldError, group_owners, shard_indices, statistics_tensors
from featcal_llm.errors import FeatCalError, QuietExit

if TYPE_CHECKING:
    from featcal_llm.engine.context import RunContext
    from featcal_llm.engine.plan import CalibrationPlan
    from featcal_llm.maths.stats import GroupStatistics

TIMEOUT_ENV = "FEATCAL_DISTRIBUTED_TIMEOUT"  # seconds a collective may wait for a rank that hangs (default 1800)
REDUCE_ENV = "FEATCAL_DISTRIBUTED_REDUCE"  # "owner" (default): reduce to each group's owner; "all": all-reduce
HEARTBEAT_S = 1.0
STALL_BEATS = 30  # a waiting rank gives rank 0 up for dead after this many heartbeat periods without a beat
WAIT_NOTE_S = 300.0  # a rank waiting for rank 0's long step says so this often
LEAVE_WAIT_S = 5.0  # rank 0, which hosts the rendezvous store, waits this long at most for the others to leave it
LEFT_KEY = "featcal/left"  # how many ranks other than 0 have made their last call to the store
GAVE_UP = "gave up: "  # a failure record of a rank that only timed out waiting (not the cause of the stop)



class TorchDistributed(Single):
    """A torch.distributed world (env:// rendezvous, as torchrun sets it up): gloo on CPUs, NCCL on GPUs."""

    def __init__(self) -> None:
        import torch.distributed as dist

        super().__init__()
        self.dist = dist
        self.timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "1800")))
        self.mode = os.environ.get(REDUCE_ENV, "owner")
        # Collectives go by the tensors' device: gloo for host tensors (handshakes, objects), NCCL for GPU ones.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=self.timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.device = torch.device("cpu")  # where reductions happen: the compute GPU once `use` is called
        self.ready = False  # True once every rank agreed on the run's fingerprint: errors after it are one rank's own
        self._beats: Any = None
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self._steps = 0
        if self.mode not in ("owner", "all"):
            self.close()
            raise FeatCalError(f"{REDUCE_ENV}: expected 'owner' or 'all', got {self.mode!r}")
        self._start_heartbeat()

    def use(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else torch.device("cpu")

    # ---- failures -------------------------------------------------------------------------------------------
    def _store(self):
        return self.dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world, False, timeout=timedelta(seconds=10))

    def _start_heartbeat(self) -> None:
        """A thread bumps this rank's counter in the rendezvous store every second: a rank whose counter stops is dead."""
        try:
            self._beats = self._store()
        except Exception:  # no store reachable (not an env:// world): failures are reported without the rank
            return

        def beat(store=self._beats) -> None:
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    store.add(f"featcal/alive/{self.rank}", 1)
                except Exception:
                    return

        self._heartbeat = threading.Thread(target=beat, name="featcal-heartbeat", daemon=True)
        self._heartbeat.start()

    def _peer_failure(self, error: BaseException) -> "WorldError":
        """The one-line error for a collective that failed because another rank stopped: which rank, and why.

        A rank's own error (left in the store) comes first, then a rank whose heartbeat stopped, then a rank that
        only gave up waiting (its collective timed out); this rank's own time-out is named when nothing else is known.
        """
        timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
        if timed_out:
            self.report_failure(f"{GAVE_UP}waited {self.timeout.total_seconds():g} s in a collective (FEATCAL_DISTRIBUTED_TIMEOUT)")
        gave_up = {}
        try:
            store = self._store()
            for rank in range(self.world):
                key = f"featcal/failed/{rank}"
                if rank != self.rank and store.check([key]):
                    message = store.get(key).decode()
                    if not message.startswith(GAVE_UP):
                        return WorldError(f"rank {rank} of {self.world} failed: {message}")
                    gave_up[rank] = message[len(GAVE_UP):]
            before = [store.add(f"featcal/alive/{r}", 0) for r in range(self.world)]
            time.sleep(3 * HEARTBEAT_S)
            after = [store.add(f"featcal/alive/{r}", 0) for r in range(self.world)]
            dead = [r for r in range(self.world) if r != self.rank and after[r] == before[r] and r not in gave_up]
        except Exception:
            dead = [0] if self.rank != 0 else []  # the store lives with rank 0 (or torchrun's agent)
        if dead:
            names = ", ".join(str(r) for r in dead)
            return WorldError(f"rank {names} of {self.world} stopped (no heartbeat); rerun the same command to resume after the last finished layer")
        if gave_up:
            rank, why = next(iter(gave_up.items()))
            return WorldError(f"rank {rank} of {self.world} gave up: it {why}; raise FEATCAL_DISTRIBUTED_TIMEOUT if a step is legitimately that slow")
        if timed_out:
            return WorldError(f"rank {self.rank} of {self.world} gave up: it waited {self.timeout.total_seconds():g} s in a collective (FEATCAL_DISTRIBUTED_TIMEOUT)")
        return WorldError(f"rank {self.rank} of {self.world}: a collective failed ({str(error).splitlines()[0][:200]})")

    def run_on_main(self, step: str, work: Callable[[], Any]) -> Any:
        """Rank 0 runs `work` (the merge, generation: as long as it takes); the others wait without a time limit.

        The waiting ranks poll the rendezvous store for the end of rank 0's step while rank 0's heartbeat
        goes on (a stopped heartbeat stops them, naming rank 0), so the collective timeout bounds only
        collectives. Rank 0's error (one line) then stops every rank alike, through `agree`.
        """
        self._steps += 1
        key = f"featcal/step/{self._steps}"
        if self.is_main:
            result, error = None, None
            try:
                result = work()
            except FeatCalError as failure:
                error = str(failure)
            except Exception as failure:  # an unexpected error must still meet the waiting ranks
                error = f"{step}: {type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
            try:
                self._store().set(key, json.dumps(error))
            except Exception:
                pass
            self.agree(None, error)
            return result
        self._wait_for_main(step, key)
        self.agree(None)
        return None

    def _wait_for_main(self, step: str, key: str) -> None:
        try:
            store = self._store()
        except Exception:
            return  # no store: the collective in `agree` is the only wait
        began = noted = time.monotonic()
        last_beat, last_change = store.add("featcal/alive/0", 0), time.monotonic()
        while not store.check([key]):
            time.sleep(HEARTBEAT_S)
            if store.check(["featcal/failed/0"]):
                return  # rank 0 stopped with an error before the step: it says why in `agree`
            beat = store.add("featcal/alive/0", 0)
            now = time.monotonic()
            if beat != last_beat:
                last_beat, last_change = beat, now
            elif now - last_change > STALL_BEATS * HEARTBEAT_S:
                raise WorldError(f"rank 0 of {self.world} stopped (no heartbeat for {now - last_change:.0f} s) during the {step}; rerun the same command")
            if now - noted >= WAIT_NOTE_S:
                noted = now
                print(f"featcal-llm: rank {self.rank}: waiting for rank 0's {step} ({(now - began) / 60:.0f} min so far; rank 0 is alive)", file=sys.stderr, flush=True)

    def report_failure(self, message: str) -> None:
        """Leave this rank's error in the store so the others can name it (called before exiting on an error)."""
        try:
            self._store().set(f"featcal/failed/{self.rank}", message)
        except Exception:
            pass

    def _call(self, operation, *args, **kwargs):
        try:
            return operation(*args, **kwargs)
        except Exception as error:  # gloo/NCCL: peer closed, timeout
            raise self._peer_failure(error) from None

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        if self.traffic:
            self.traffic[-1][kind] = self.traffic[-1].get(kind, 0) + tensor.numel() * tensor.element_size()

    # ---- collectives ----------------------------------------------------------------------------------------
    def shard(self, sequences: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        return {task: [seqs[i] for i in shard_indices([len(s) for s in seqs], self.rank, self.world)] for task, seqs in sequences.items()}

    def _all_reduce(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        on = tensor.to(self.device)
        self._count(kind, on)
        self._call(self.dist.all_reduce, on)
        return on

    def sum_int(self, value: int) -> int:
        return int(self._all_reduce(torch.tensor([value], dtype=torch.int64), "counts").item())

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, "statistics").to(tensor.device)

    def sum_floats(self, values: list[float]) -> list[float]:
        return self._all_reduce(torch.tensor(values, dtype=torch.float64), "criterion").cpu().tolist()

    def all_true(self, flag: bool) -> bool:
        return bool(self._all_reduce(torch.tensor([0 if flag else 1], dtype=torch.int64), "counts").item() == 0)

    def owners(self, plan: "CalibrationPlan", layer: torch.nn.Module) -> dict[str, int]:
        return group_owners(plan, layer, self.world)

    def local_plan(self, plan: "CalibrationPlan", owners: dict[str, int]) -> "CalibrationPlan":
        return dataclasses.replace(plan, only=frozenset(name for name, rank in owners.items() if rank == self.rank))

    def reduce_statistics(self, stats: dict[str, "GroupStatistics"], owners: dict[str, int]) -> None:
        """Sum every statistic of every group (float64) onto its owner, in group then tensor order."""
        for name in sorted(stats):
            group = stats[name]
            for tensor in [*statistics_tensors(group), torch.tensor([group.tokens], dtype=torch.int64)]:
                on = tensor if tensor.device == self.device else tensor.to(self.device)
                self._count("statistics", on)
                if self.mode == "all":
                    self._call(self.dist.all_reduce, on)
                else:
                    self._call(self.dist.reduce, on, dst=owners[name])
                if on is not tensor:
                    tensor.copy_(on)
            group.tokens = int(tensor.item())

    def solve_layer(self, ctx: "RunContext", layer: int, systems, tensors, hyper=None, solver=None) -> dict[str, torch.Tensor]:
        """Each rank solves the groups it owns; every solution is broadcast from its owner (a failed solve fails everywhere alike)."""
        plan = ctx.plan
        owners = ctx.owners
        solved: dict[str, torch.Tensor] = {}
        error = None
        try:
            solved = plan.objective.solve_layer(self.local_plan(plan, owners), layer, systems, tensors, hyper, solver)
        except FeatCalError as failure:
            error = str(failure)
        manifests: list[Any] = [None] * self.world
        self._call(self.dist.all_gather_object, manifests, (error, [(n, tuple(t.shape), str(t.dtype)) for n, t in solved.items()]))
        for failure, _ in manifests:
            if failure is not None:
                raise WorldError(failure)
        result: dict[str, torch.Tensor] = {}
        for rank, (_, manifest) in enumerate(manifests):
            for name, shape, dtype in manifest:
                if rank == self.rank:
                    buffer = solved[name].to(self.device)
                else:
                    buffer = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=self.device)
                self._count("solutions", buffer)
                self._call(self.dist.broadcast, buffer, src=rank)
                result[name] = buffer.cpu()
        return result

    def broadcast_object(self, value: Any) -> Any:
        box = [value]
        self._call(self.dist.broadcast_object_list, box, src=0)
        return box[0]

    def gather_objects(self, value: Any) -> list[Any] | None:
        answers: list[Any] = [None] * self.world  # all-gathered, the object path `agree` already takes on every backend
        self._call(self.dist.all_gather_object, answers, value)
        return answers if self.is_main else None

    def agree(self, fingerprint: str | None, error: str | None = None) -> None:
        """Every rank says it got this far (with its run's fingerprint, at the last step) or why not; any error or mismatch stops all alike.

        Every rank calls it at the same steps of the setup, so a rank that
        fails (bad input) meets the others here instead of leaving them
        waiting: rank 0 prints one line, the others exit quietly.
        """
        if error is not None:
            self.report_failure(error)  # ranks waiting for rank 0's long step stop waiting and meet it here
        answers: list[Any] = [None] * self.world
        self._call(self.dist.all_gather_object, answers, (fingerprint, error))
        for rank, (_, failure) in enumerate(answers):
            if failure is not None:
                if self.is_main:
                    raise WorldError(failure if rank == 0 else f"rank {rank}: {failure}")
                raise QuietExit()
        differing = [rank for rank, (print_, _) in enumerate(answers) if print_ != answers[0][0]]
        if differing:
            message = f"ranks {differing} see a different recipe, data, models or settings than rank 0 (run fingerprints differ)"
            if self.is_main:
                raise WorldError(message)
            raise QuietExit()
        self.ready = fingerprint is not None

    def barrier(self) -> None:
        self._call(self.dist.barrier)

    def close(self) -> None:
        """Leave the world; rank 0 last, since its exit takes the rendezvous store down under the others' feet.

        A rank that still calls the store once rank 0 has gone gets a C++ traceback on stderr, or an abort
        at exit: so every other rank signs off in the store after its last store call, and rank 0 waits for
        them (LEAVE_WAIT_S at most: a rank that died never signs).
        """
        self._stop.set()
        if self._heartbeat is not None:  # no store call may be in flight when the process exits (C++ would abort it)
            self._heartbeat.join(timeout=10 * HEARTBEAT_S)
        if self.is_main:
            self._wait_for_the_others_to_leave()
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
        if not self.is_main and self._beats is not None:
            try:
                self._beats.add(LEFT_KEY, 1)
            except Exception:
                pass
        self._beats = None

    def _wait_for_the_others_to_leave(self) -> None:
        if self._beats is None:
            return
        deadline = time.monotonic() + LEAVE_WAIT_S
        try:
            while self._beats.add(LEFT_KEY, 0) < self.world - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        except Exception:
            pass
