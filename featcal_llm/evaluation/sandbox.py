"""Run one model-written program in its own subprocess, with a wall-clock limit.

This is isolation against accidents (infinite loops, crashes, runaway memory, stray file
deletes), not a security boundary: the program runs as the current user, with the network the
machine has. That is why code execution is off unless the user opts in.

A program passes only if it runs to its end: the bootstrap prints a random token after the
program returns, so `sys.exit(0)` or `os._exit(0)` half-way is a failure, as is any exception,
signal, memory error or timeout. The verdict never depends on the program's own output.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Status = Literal["passed", "failed", "timeout", "crashed"]

# Runs in the child: limits, a reliability guard in the spirit of human-eval/EvalPlus, then the
# program. argv: program path, token, memory limit (MiB), CPU seconds.
_BOOTSTRAP = r"""
import builtins, os, sys
path, token, memory_mib, cpu_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
del sys.argv[1:]
try:
    import resource
    limit = memory_mib * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024 * 1024, 64 * 1024 * 1024))
except (ImportError, ValueError, OSError):
    pass
try:
    import numpy  # EvalPlus tests import it; load it before the guard below
except ImportError:
    pass
source = open(path).read()
import shutil, subprocess
for module, names in (
    (os, ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir",
          "setuid", "fork", "forkpty", "rename", "renames", "truncate", "replace", "unlink",
          "fchmod", "fchown", "chmod", "chown", "chroot", "lchown", "execv", "execve",
          "spawnv", "spawnve", "popen")),
    (shutil, ("rmtree", "move", "chown")),
    (subprocess, ("Popen", "run", "call", "check_call", "check_output")),
):
    for name in names:
        if hasattr(module, name):
            setattr(module, name, None)
builtins.help = None
for name in ("ipdb", "joblib", "psutil", "tkinter"):
    sys.modules[name] = None
try:
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
except BaseException as error:
    import traceback
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr, limit=-3)
    sys.stderr.flush()
    os._exit(1)
sys.stdout.write("\n" + token + "\n")
sys.stdout.flush()
os._exit(0)
"""

_TAIL_BYTES = 2000


@dataclass(frozen=True)
class ExecutionResult:
    status: Status
    returncode: int | None
    duration_s: float
    detail: str

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


def run_program(program: str, timeout_s: float, memory_mib: int = 4096) -> ExecutionResult:
    """Execute `program` in a fresh interpreter in a temporary directory; never raises for
    anything the program does."""
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="featcal-exec-") as workdir:
        work = Path(workdir)
        (work / "program.py").write_text(program)
        stdout_path, stderr_path = work / "stdout", work / "stderr"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "HOME": workdir, "TMPDIR": workdir}
        started = time.monotonic()
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(work / "program.py"), token,
                 str(memory_mib), str(int(timeout_s) + 1)],
                cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True,
            )
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                elapsed = time.monotonic() - started
                return ExecutionResult("timeout", None, elapsed, f"no result within {timeout_s:g} s")
        elapsed = time.monotonic() - started
        # Grandchildren the program may have left behind go with its session.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        stdout_tail, stderr_tail = _tail(stdout_path), _tail(stderr_path).strip()
    finished = stdout_tail.rstrip("\n").rsplit("\n", 1)[-1] == token
    if returncode == 0 and finished:
        return ExecutionResult("passed", 0, elapsed, "")
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else str(-returncode)
        return ExecutionResult("crashed", returncode, elapsed, f"killed by {name}. {stderr_tail[-500:]}".strip())
    if returncode == 0:
        return ExecutionResult("failed", 0, elapsed, "exited before the tests finished")
    return ExecutionResult("failed", returncode, elapsed, stderr_tail[-500:] or f"exit code {returncode}")
