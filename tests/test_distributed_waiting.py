"""torchrun ranks that stop, wait or fail: a stopped rank named by its heartbeat and a failed one by its error, rank 0
waited for past the collective timeout and leaving the store last, a rank that gave up waiting named as such, and
what the agent stops."""

from __future__ import annotations

import json

import pytest
import yaml
from distributed_world import launch

from test_distributed import EQUAL, worst_delta


def test_a_stopped_rank_is_named_by_its_heartbeat_and_a_failed_one_by_its_error(monkeypatch):
    """Rank 0's view of a 3-rank world in which rank 1 stopped beating and rank 2 is alive (real TCPStore, no process group)."""
    import threading

    import torch.distributed as dist

    from featcal_llm.engine import torch_world as distributed


    master = _local_store(monkeypatch, 3)
    monkeypatch.setattr(distributed, "HEARTBEAT_S", 0.2)
    ranks = {}
    for rank in (0, 2):  # rank 1 never beats
        comm = object.__new__(distributed.TorchDistributed)
        comm.dist, comm.rank, comm.world, comm._stop = dist, rank, 3, threading.Event()
        comm._start_heartbeat()
        ranks[rank] = comm
    try:
        stopped = ranks[0]._peer_failure(RuntimeError("Connection closed by peer"))
        assert str(stopped) == "rank 1 of 3 stopped (no heartbeat); rerun the same command to resume after the last finished layer"
        ranks[2].report_failure("layer 1: calibrated layer produced NaN/Inf hidden states")
        assert str(ranks[0]._peer_failure(RuntimeError("x"))) == "rank 2 of 3 failed: layer 1: calibrated layer produced NaN/Inf hidden states"
    finally:
        for comm in ranks.values():
            comm._stop.set()
        del master


def test_a_dead_rank_stops_the_others_naming_it_and_a_rerun_resumes_on_one_rank(uneven, tmp_path):
    scenario, single = uneven
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    ranks = launch(recipe, 2, tmp_path / "logs", "--kill-at", "1:1", timeout=120)
    assert ranks[1].returncode == -9 and ranks[0].returncode != 0
    lines = [line for line in ranks[0].stderr.splitlines() if line.startswith("featcal-llm: error:")]
    assert len(lines) == 1 and "rank 1 of 2 stopped" in lines[0], ranks[0].stderr[-2000:]
    assert not (tmp_path / "out").exists()
    state = json.loads((tmp_path / ".out.featcal-partial" / "state.json").read_text())
    assert state["completed_layers"] == 1
    again = launch(recipe, 1, tmp_path / "logs1")  # the same command on another world size
    assert again[0].returncode == 0, again[0].stderr[-2000:]
    assert "resuming from" in again[0].stderr
    assert worst_delta(tmp_path / "out", single, scenario.root / "merged") <= EQUAL


LEAVE = """
import sys, time
from featcal_llm.engine.torch_world import TorchDistributed
comm = TorchDistributed()
time.sleep(float(sys.argv[1]) if comm.rank == 1 else 0.0)
started = time.monotonic()
comm.close()
print(f"closed after {time.monotonic() - started:.1f} s")
"""


def test_rank_0_leaves_the_store_last_so_a_slower_rank_closes_cleanly(tmp_path):
    """Rank 0 hosts the rendezvous store: leaving at once, it had left rank 1's heartbeat a C++ traceback (or an abort at exit)."""
    import sys

    from featcal_llm.benchmark.distributed import launch_world

    ranks = launch_world([sys.executable, "-c", LEAVE, "2.5"], 2, tmp_path / "logs", timeout=60)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    assert ranks[1][2] == "", ranks[1][2]  # no "recvValue failed ... Did the remote server shutdown or crash?"
    assert float(ranks[0][1].split()[2]) >= 2.0  # rank 0 waited for rank 1 to sign off


def test_rank_0_steps_longer_than_the_collective_timeout_are_waited_for(uneven, tmp_path):
    """Rank 0's merge and generation each take longer than FEATCAL_DISTRIBUTED_TIMEOUT: rank 1 waits on the store, both finish."""
    scenario, _ = uneven
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["data"][str(scenario.experts["expert0"])] = {"generate": {"samples": 4, "max_new_tokens": 6, "chat_template": "off"}}
    recipe["featcal"]["output"] = str(tmp_path / "out")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    ranks = launch(path, 2, tmp_path / "logs", "--slow-main", "9", env={"FEATCAL_DISTRIBUTED_TIMEOUT": "6"})  # 1.5 × the timeout, twice
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert "calibrated checkpoint written" in ranks[0].stdout and ranks[1].stderr == ""


def test_a_rank_that_gave_up_waiting_is_named_as_such(monkeypatch):
    """Rank 0's view when rank 1 timed out in a collective (it left a record and stopped beating): it gave up, it is not the cause."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from featcal_llm.engine import torch_world as distributed

    master = _local_store(monkeypatch, 2)
    monkeypatch.setattr(distributed, "HEARTBEAT_S", 0.2)
    ranks = {}
    for rank in (0, 1):
        comm = object.__new__(distributed.TorchDistributed)
        comm.dist, comm.rank, comm.world, comm._stop, comm.timeout = dist, rank, 2, threading.Event(), timedelta(seconds=6)
        ranks[rank] = comm
    ranks[0]._start_heartbeat()
    try:
        mine = ranks[1]._peer_failure(RuntimeError("[gloo] Timed out waiting 6000ms for recv operation to complete"))
        assert "rank 1 of 2 gave up: it waited 6 s in a collective" in str(mine)
        stopped = ranks[0]._peer_failure(RuntimeError("Connection closed by peer"))
        assert str(stopped) == (
            "rank 1 of 2 gave up: it waited 6 s in a collective (FEATCAL_DISTRIBUTED_TIMEOUT); "
            "raise FEATCAL_DISTRIBUTED_TIMEOUT if a step is legitimately that slow"
        )
    finally:
        ranks[0]._stop.set()
        del master


def test_a_waiting_rank_shows_it_waits_and_names_rank_0_when_its_heartbeat_stops(monkeypatch, capsys):
    """Rank 1 waiting for rank 0's step (real TCPStore): it notes the wait while rank 0 beats, and stops naming rank 0 once it does not."""
    import threading

    import torch.distributed as dist

    from featcal_llm.engine import torch_world as distributed

    master = _local_store(monkeypatch, 2)
    monkeypatch.setattr(distributed, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(distributed, "WAIT_NOTE_S", 0.2)
    comms = {}
    for rank in (0, 1):
        comm = object.__new__(distributed.TorchDistributed)
        comm.dist, comm.rank, comm.world, comm._stop, comm.is_main = dist, rank, 2, threading.Event(), rank == 0
        comms[rank] = comm
    comms[0]._start_heartbeat()
    try:
        threading.Timer(0.8, master.set, ("featcal/step/1", "null")).start()  # rank 0 finishes its step after 0.8 s
        comms[1]._wait_for_main("merge", "featcal/step/1")
        assert "featcal-llm: rank 1: waiting for rank 0's merge" in capsys.readouterr().err
        comms[0]._stop.set()  # rank 0's heartbeat stops during the next step
        with pytest.raises(distributed.WorldError, match=r"^rank 0 of 2 stopped \(no heartbeat for \d+ s\) during the generation"):
            comms[1]._wait_for_main("generation", "featcal/step/2")
    finally:
        comms[0]._stop.set()
        del master


def _local_store(monkeypatch, world: int):
    """A rendezvous store on a free loopback port, found by the code under test through MASTER_ADDR / MASTER_PORT."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    return dist.TCPStore("127.0.0.1", port, world, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def test_under_torchrun_the_ranks_the_agent_stops_say_so_and_release_the_lock(uneven, tmp_path):
    """torchrun's agent SIGTERMs the ranks left once one dies (or once it is stopped itself: `scancel`, `kill`): rank 0
    stops as a SIGTERM'd one-process run does, with the one line and its lock released, its saved layers kept."""
    from distributed_world import torchrun

    from featcal_llm.io.output_lock import lock_path

    scenario, _ = uneven
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    world = torchrun(recipe, 2, tmp_path / "logs", "--kill-at", "1:1", timeout=150)
    assert world.returncode != 0 and "exitcode  : -9" in world.stderr, world.stderr[-2000:]
    assert world.ranks[0].strip().splitlines()[-1] == (
        "featcal-llm: terminated (SIGTERM); what the run finished (a merge, generated records, calibrated layers, "
        "refinement steps) is kept, and the same command resumes from there"), world.ranks[0][-2000:]
    assert "featcal-llm: error" not in world.ranks[0] and world.ranks[1].count("featcal-llm:") == 0, world.ranks
    assert "Traceback" not in world.ranks[0] and "exitcode  : 143" in world.stderr
    assert not lock_path(tmp_path / "out").exists() and not (tmp_path / "out").exists()
    assert json.loads((tmp_path / ".out.featcal-partial" / "state.json").read_text())["completed_layers"] == 1
