"""Run model-written code in its own subprocess (`harness.py`), with limits, and read what it returns.

What this is: isolation against accidents, and a grader the program cannot talk into a pass. Each
program runs in a fresh interpreter (`python -I`) in a new temporary directory and session, with
EvalPlus's memory and stack limits, a CPU-time limit per input and per run, a file-size limit, a cap
on new processes/threads (RLIMIT_NPROC) and EvalPlus's guard (harness.py). The child receives only
the inputs and sends back records (one JSON line each, size-capped, read here without running any
code: codec.py); the expected outputs never leave this process and the verdict is computed here
(judge.py). A record the program forges is at most an output it could have returned.

What this is not: a security boundary. The program runs as the current user, with the machine's
network and read access to its files (a copy of the dataset included); Python-level guards can be
undone by code written to undo them (ctypes). RLIMIT_NPROC does not bind root. Only run models you
would run code from, or run the whole evaluation in a container or VM.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).with_name("harness.py")
EXTRA_TASKS = 16  # new processes/threads a program may start (numpy's, a small pool)
OUTPUT_CAP_BYTES = 128 * 1024 * 1024  # all records of one run; a program over it fails
_TAIL_BYTES = 2000


@dataclass
class Execution:
    """What one child run gave back: its records (parsed JSON, not yet values) and how it ended."""

    records: list[dict] = field(default_factory=list)
    returncode: int | None = None
    signal_name: str | None = None
    duration_s: float = 0.0
    stopped: bool = False        # the parent stopped it (a wrong output: EvalPlus's fast check)
    wall_timeout: bool = False
    problem: str = ""            # the stream broke a rule (not JSON, too large)
    stderr_tail: str = ""


def _tail(path: Path, size: int = _TAIL_BYTES) -> str:
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - size))
        return handle.read().decode("utf-8", errors="replace")


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Reader:
    """Splits the pipe's bytes into JSON records, enforcing the size cap."""

    def __init__(self, cap: int, on_record: Callable[[dict], bool] | None, execution: Execution):
        self.buffer, self.total, self.cap = b"", 0, cap
        self.on_record, self.execution = on_record, execution

    def feed(self, chunk: bytes) -> bool:
        """False when the run should stop (a rule broken, or the consumer has its answer)."""
        self.total += len(chunk)
        if self.total > self.cap:
            self.execution.problem = f"the program's outputs exceed {self.cap // (1024 * 1024)} MiB"
            return False
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                self.execution.problem = "unreadable record from the program's process"
                return False
            self.execution.records.append(record)
            if self.on_record is not None and not self.on_record(record):
                self.execution.stopped = True
                return False
        return True


def execute(job: dict, *, cap_s: float, wall_s: float, memory_mib: int = 4096,
            output_cap_bytes: int = OUTPUT_CAP_BYTES, on_record: Callable[[dict], bool] | None = None) -> Execution:
    """Run one harness job (see harness.py); never raises for anything the program does.

    `cap_s` is the CPU-time limit of the whole run; `wall_s` a wall-clock backstop for programs
    that block without using CPU (set it with the machine's load in mind). `on_record` sees each
    record as it arrives and returns False to stop the program there."""
    execution = Execution()
    with tempfile.TemporaryDirectory(prefix="featcal-exec-") as workdir:
        work = Path(workdir)
        read_end, write_end = os.pipe()
        process, ours = None, False
        try:
            (work / "job.json").write_text(json.dumps({**job, "channel_fd": write_end, "cap_s": cap_s,
                                                       "memory_mib": memory_mib, "extra_tasks": EXTRA_TASKS}))
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0",
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "HOME": workdir, "TMPDIR": workdir}
            started = time.monotonic()
            with (work / "stdout").open("wb") as out, (work / "stderr").open("wb") as err:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-B", str(HARNESS)], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=err, start_new_session=True, pass_fds=(write_end,),
                )
            os.close(write_end)
            write_end = -1
            reader = _Reader(output_cap_bytes, on_record, execution)
            poller = select.poll()
            poller.register(read_end, select.POLLIN | select.POLLHUP)
            end_of_stream = False
            while not execution.wall_timeout:
                remaining = wall_s - (time.monotonic() - started)
                if remaining <= 0:
                    execution.wall_timeout = True
                elif poller.poll(min(remaining, 0.5) * 1000):
                    chunk = os.read(read_end, 1 << 20)
                    end_of_stream = not chunk
                    if end_of_stream or not reader.feed(chunk):
                        break  # the child (and anything it left) closed the pipe, or a stop
            if end_of_stream:
                try:
                    process.wait(timeout=max(0.0, wall_s - (time.monotonic() - started)))
                except subprocess.TimeoutExpired:
                    execution.wall_timeout = True
            ours = process.poll() is None  # still running: the kill below is ours, not the program's end
            _kill_group(process)  # whatever is left of the program goes, with its session
            execution.returncode = process.wait()
            execution.duration_s = time.monotonic() - started
            execution.stderr_tail = _tail(work / "stderr").strip()
        finally:
            if process is not None and process.returncode is None:
                _kill_group(process)
                process.wait()
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
    if execution.returncode is not None and execution.returncode < 0 and not ours:
        number = -execution.returncode
        known = number in signal.Signals._value2member_map_
        execution.signal_name = signal.Signals(number).name if known else str(number)
    return execution
