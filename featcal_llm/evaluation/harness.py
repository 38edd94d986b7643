"""The child side of the sandbox: `python -I -B harness.py` in a fresh temporary directory.

Standard library only (it runs isolated from the package; `codec.py` is loaded by path).
It reads `job.json`, sets EvalPlus's limits and guard, and streams one JSON record per line to the
pipe fd the parent passed. It never sees an expected output and never writes a verdict: the parent
(judge.py) compares what comes back, so whatever the program writes to that pipe is at most an
output it could have returned. Jobs:

- `run`: define the solution in a fresh namespace (as EvalPlus's unsafe_execute: it must import
  what it uses), call the entry point on every input under that input's CPU-time limit, and send
  `{"i": k, "out": <codec>, "t": cpu_seconds}` per input, or `{"i": k, "error"|"timeout": text}`
  (then stop, unless `keep_going`, which the canonical solution's timing run sets).
- `data`: run a hub row's data statements (trusted dataset code) and send each input with its
  expected output (`results`, or `ref_func` on a copy of the input for the cross-check rows).

Limits are CPU seconds (ITIMER_PROF per input, RLIMIT_CPU per run), so they do not depend on how many
programs share the machine; the parent's wall-clock limit is only a backstop for programs that block.
"""

import builtins
import contextlib
import copy
import importlib.util
import io
import json
import math
import os
import signal
import sys
import time
import traceback

_ERROR_CHARS = 300
_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_codec():
    spec = importlib.util.spec_from_file_location("featcal_codec", os.path.join(_HERE, "codec.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TimeoutException(Exception):
    """Raised by SIGPROF when an input exceeds its CPU-time limit (an Exception, as in EvalPlus)."""


class _Discard(io.StringIO):
    """stdout/stderr/stdin for model code: writes vanish, reads fail (EvalPlus's swallow_io)."""

    def write(self, text):
        return len(text)

    def readable(self, *args, **kwargs):
        return False

    def read(self, *args, **kwargs):
        raise OSError("stdin is closed")

    readline = readlines = read


@contextlib.contextmanager
def swallow_io():
    stream = _Discard()
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        saved, sys.stdin = sys.stdin, stream
        try:
            yield
        finally:
            sys.stdin = saved


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
    """EvalPlus's memory and stack limits (RLIMIT_AS = RLIMIT_DATA = RLIMIT_STACK), a CPU-time limit
    whose soft limit (SIGXCPU, reported as a timeout) comes a second before the hard one (SIGKILL),
    a file-size limit and a cap on new processes/threads."""
    try:
        import resource
    except ImportError:
        return
    memory = memory_mib * 1024 * 1024
    cpu = int(math.ceil(cpu_s)) + 1
    limits = [("RLIMIT_AS", memory, memory), ("RLIMIT_DATA", memory, memory), ("RLIMIT_STACK", memory, memory),
              ("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_FSIZE", 64 * 1024 * 1024, 64 * 1024 * 1024)]
    for name, soft, hard in limits:
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError, AttributeError):
            pass
    try:  # at most `extra_tasks` new processes or threads (a fork bomb stops there)
        tasks = _user_tasks() + extra_tasks
        resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
    except (ValueError, OSError, AttributeError):
        pass


# EvalPlus's reliability_guard (evalplus/eval/utils.py), then ours: every way to start a process.
_DISABLED = {
    "os": ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
           "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
           "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir")
          + ("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe", "spawnl", "spawnle",
             "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp"),
    "shutil": ("rmtree", "move", "chown"),
    "subprocess": ("Popen",),
}
_BLOCKED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter")
# Loaded before the guard in EvalPlus's forked child (evalplus/eval/__init__.py and evaluate.py import
# them): here they are imported on first use as if the guard were not on yet, since importing them
# under it fails (multiprocessing.process calls os.getcwd at import, numpy calls os.putenv). Loading
# them only when a program imports them keeps a run from paying ~0.3 s for numpy it does not use.
_EVALPLUS_PRELOADED = ("numpy", "multiprocessing", "concurrent")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install_guard(workdir: str) -> None:
    """EvalPlus's guard: `open`, `os.getcwd` and destructive calls disabled. Added here: no exec/spawn
    either, and `io.open`/`os.open` (which EvalPlus leaves) refuse to write outside `workdir`. A
    guard against accidents, as in human-eval/EvalPlus, not a security boundary."""
    import shutil
    import subprocess

    realpath, real_io_open, real_os_open = os.path.realpath, io.open, os.open
    root = realpath(workdir)

    def inside(path) -> bool:
        resolved = realpath(os.path.join(root, os.fspath(path)))
        return resolved == root or resolved.startswith(root + os.sep)

    def guarded_io_open(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and any(flag in mode for flag in "wax+") and not inside(file):
            raise PermissionError(f"writing outside the sandbox directory is disabled: {file}")
        return real_io_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS and not inside(path):
            raise PermissionError(f"writing outside the sandbox directory is disabled: {path}")
        return real_os_open(path, flags, *args, **kwargs)

    replaced = {(io, "open"): guarded_io_open, (os, "open"): guarded_os_open, (builtins, "open"): None,
                (builtins, "help"): None, (builtins, "exit"): None, (builtins, "quit"): None}
    for module in (os, shutil, subprocess):
        for name in _DISABLED[module.__name__]:
            if hasattr(module, name):
                replaced[(module, name)] = None
    originals = {key: getattr(*key) for key in replaced}

    def apply(values: dict) -> None:
        for (module, name), value in values.items():
            setattr(module, name, value)

    real_import = builtins.__import__

    def evalplus_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.partition(".")[0] in _EVALPLUS_PRELOADED and name not in sys.modules:
            apply(originals)
            try:
                return real_import(name, globals, locals, fromlist, level)
            finally:
                apply(replaced)
        return real_import(name, globals, locals, fromlist, level)

    apply(replaced)
    builtins.__import__ = evalplus_import
    for name in _BLOCKED_MODULES:
        sys.modules[name] = None


# ------------------------------------------------------------------ running


class _CpuLimit:
    """SIGPROF after `seconds` of this process's CPU time."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        def expire(_signum, _frame):
            raise TimeoutException(f"over the {self.seconds:g} s CPU limit")

        signal.signal(signal.SIGPROF, expire)
        signal.setitimer(signal.ITIMER_PROF, max(self.seconds, 1e-3))

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_PROF, 0)
        return False


def _describe(error: BaseException) -> str:
    try:
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
    except BaseException:  # noqa: BLE001 - a program's exception may not even print
        text = type(error).__name__
    return text[:_ERROR_CHARS]


class Channel:
    """One JSON record per line to the parent's pipe; a write that blocks waits for the reader."""

    def __init__(self, fd: int):
        self.fd, self.write = fd, os.write

    def send(self, record: dict) -> None:
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[self.write(self.fd, view):]


def run_inputs(job: dict, channel: Channel, codec) -> None:
    """EvalPlus's loop over the inputs, outputs sent instead of compared."""
    namespace: dict = {}
    try:
        with swallow_io(), _CpuLimit(job["cap_s"]):
            exec(job["solution"], namespace)
        fn = namespace[job["entry_point"]]
    except BaseException as error:  # noqa: BLE001 - whatever the program raises is a failure
        channel.send({"define_error": "defining the solution: " + _describe(error)})
        return
    for index, encoded in enumerate(job["inputs"]):
        inp = codec.decode(encoded)
        record: dict = {"i": index}
        try:
            with swallow_io(), _CpuLimit(job["limits"][index]):
                started = time.thread_time()
                out = fn(*inp)
            record["t"] = time.thread_time() - started
            record["out"] = codec.encode(out)
        except TimeoutException as error:
            record = {"i": index, "timeout": str(error)}
        except BaseException as error:  # noqa: BLE001
            record = {"i": index, "error": _describe(error)}
        channel.send(record)
        if "out" not in record and not job.get("keep_going"):
            return


def run_data(job: dict, channel: Channel, codec) -> None:
    """The hub row's data statements: each input with its expected output."""
    namespace: dict = {"__name__": "evalplus_test"}
    exec(compile(job["setup"], "test.py", "exec"), namespace)
    inputs, results, ref_func = namespace["inputs"], namespace.get("results"), namespace.get("ref_func")
    for index, inp in enumerate(inputs):
        expected = results[index] if results is not None else ref_func(*copy.deepcopy(inp))
        channel.send({"i": index, "inp": codec.encode(inp), "exp": codec.encode(expected)})


def main() -> None:
    with open("job.json") as handle:
        job = json.load(handle)
    os.remove("job.json")
    sys.set_int_max_str_digits(0)  # the data may hold integers beyond Python's default 4,300 digits
    codec = _load_codec()
    channel = Channel(job["channel_fd"])
    set_limits(job["memory_mib"], job["cap_s"], job["extra_tasks"])
    if job["mode"] == "data":
        run_data(job, channel, codec)
    else:
        install_guard(os.getcwd())
        run_inputs(job, channel, codec)
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the program may have closed it
            pass
    os._exit(0)


if __name__ == "__main__":
    main()
