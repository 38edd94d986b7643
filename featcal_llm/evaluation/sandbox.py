"""Run model-written code in its own subprocess (`harness.py`), with limits, and read its verdict.

What this is: isolation against accidents. Each program runs in a fresh interpreter (`python -I`) in
a new temporary directory and session, with a memory limit, a CPU-time limit per input and per run,
a file-size limit, a cap on new processes/threads (RLIMIT_NPROC), process creation and destructive
`os`/`shutil`/`subprocess` functions disabled, and `open`/`os.open` refusing to write outside its
directory. The verdict comes back over a pipe, never from the program's stdout, and the job file
(with the expected outputs) is deleted before the program runs.

What this is not: a security boundary. The program runs as the current user, with the machine's
network and read access to its files; Python-level guards can be undone by code written to undo
them (ctypes, a forged write to the verdict pipe). RLIMIT_NPROC does not bind root. Only run models
you would run code from, or run the whole evaluation in a container or VM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Status = Literal["passed", "failed", "timeout", "crashed"]

HARNESS = Path(__file__).with_name("harness.py")
EXTRA_TASKS = 16  # new processes/threads a program may start (numpy's, a small pool)
_TAIL_BYTES = 2000


@dataclass(frozen=True)
class ExecutionResult:
    status: Status
    returncode: int | None
    duration_s: float
    detail: str
    verdict: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return asdict(self)


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
    process.wait()


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_verdict(raw: bytes) -> dict | None:
    lines = raw.decode("utf-8", errors="replace").splitlines()
    if len(lines) != 1:  # none (it died), or more than the harness writes (someone else wrote too)
        return None
    try:
        verdict = json.loads(lines[0])
    except ValueError:
        return None
    return verdict if isinstance(verdict, dict) and verdict.get("status") in ("passed", "failed", "timeout") else None


def run_job(job: dict, *, cap_s: float, wall_s: float, memory_mib: int = 4096) -> ExecutionResult:
    """Run one harness job (see harness.py); never raises for anything the program does.

    `cap_s` is the CPU-time limit of the whole run; `wall_s` a wall-clock backstop for programs
    that block without using CPU (set it with the machine's load in mind)."""
    with tempfile.TemporaryDirectory(prefix="featcal-exec-") as workdir:
        work = Path(workdir)
        read_end, write_end = os.pipe()
        try:
            (work / "job.json").write_text(json.dumps({**job, "verdict_fd": write_end, "cap_s": cap_s,
                                                       "memory_mib": memory_mib, "extra_tasks": EXTRA_TASKS}))
            stdout_path, stderr_path = work / "stdout", work / "stderr"
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0",
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "HOME": workdir, "TMPDIR": workdir}
            started = time.monotonic()
            with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-B", str(HARNESS)], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=err, start_new_session=True, pass_fds=(write_end,),
                )
                os.close(write_end)
                write_end = -1
                try:
                    returncode = process.wait(timeout=wall_s)
                except subprocess.TimeoutExpired:
                    _kill_group(process)
                    return ExecutionResult("timeout", None, time.monotonic() - started,
                                           f"no result within {wall_s:g} s (wall clock)")
            elapsed = time.monotonic() - started
            try:  # grandchildren the program may have left behind go with its session
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            verdict = _parse_verdict(_read_all(read_end))
            stderr_tail = _tail(stderr_path).strip()
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
    if returncode < 0:
        number = -returncode
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
        status = "timeout" if name == "SIGXCPU" else "crashed"
        return ExecutionResult(status, returncode, elapsed, f"killed by {name}. {stderr_tail[-500:]}".strip())
    if verdict is None:
        detail = "exited before the tests finished" if returncode == 0 else (stderr_tail[-500:] or f"exit code {returncode}")
        return ExecutionResult("failed", returncode, elapsed, detail)
    return ExecutionResult(verdict["status"], returncode, elapsed, verdict.get("error", ""), verdict)


def run_program(program: str, timeout_s: float, memory_mib: int = 4096) -> ExecutionResult:
    """Execute a whole program; it passes only if it runs to its end within `timeout_s` CPU seconds."""
    return run_job({"mode": "script", "program": program}, cap_s=timeout_s, wall_s=2 * timeout_s + 5,
                   memory_mib=memory_mib)
