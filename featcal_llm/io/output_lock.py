"""One run at a time on an output: a second `run` on the same OUTPUT would share its progress folder (each deleting
or overwriting the other's layers) and swap its output in place, so it is refused in one line while the first holds
the lock.

The lock is an advisory `flock` on a hidden sibling of the output (`.NAME.featcal-lock`, holding the holder's pid),
taken by rank 0 for the whole run and released, the file removed, when the run ends; the kernel releases it too when
the process dies, so a killed run leaves no lock that blocks its rerun. A merge directory the run makes
(`featcal.merged`) takes the same lock while it is checked and written, and a second run waits for it there: runs
with other outputs (a sweep) share one merge, made once.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable

from featcal_llm.errors import FeatCalError
from featcal_llm.io.output_dir import LOCK_SUFFIX, hidden_sibling


def lock_path(output: Path) -> Path:
    return hidden_sibling(output, LOCK_SUFFIX)


class OutputLock:
    """The held lock of one output (`acquire`), released by `release`."""

    def __init__(self, path: Path, descriptor: int):
        self.path, self.descriptor = path, descriptor

    @classmethod
    def acquire(cls, output: Path, where: str, recheck: Callable[[], None] = lambda: None,
                waiting: Callable[[str], None] | None = None) -> "OutputLock":
        """Take the output's lock, or refuse while another run holds it; with `waiting`, wait for it instead, having
        called `waiting` with the holder's pid. `recheck` runs once it is held: what was checked before (the output's
        absence, say) may have changed while another run finished."""
        path = lock_path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
                if waiting is None:
                    os.close(descriptor)
                    raise FeatCalError(f"{where}: {output}: another featcal-llm run (pid {holder}) is writing it; wait "
                                       "for it to end, or name another output") from None
                waiting(holder)
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            try:  # the holder before us may have removed the file it held after we opened it: lock the file now there
                same = os.fstat(descriptor).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(descriptor)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        lock = cls(path, descriptor)
        try:
            recheck()
        except BaseException:
            lock.release()
            raise
        return lock

    def release(self) -> None:
        try:
            self.path.unlink(missing_ok=True)  # before the unlock: a waiting opener then finds a new file (see acquire)
        finally:
            os.close(self.descriptor)
