"""What a run says, and where: the terminal (quiet, normal or verbose) and an optional log file.

`session(log, verbosity)` copies everything the run prints on stdout and stderr
into the log file, except progress-bar redraws (a bar writes its state after a
carriage return many times a second); the progress reporter writes a plain
line per layer to the log instead (`note`). `stage` announces a phase of the
run (merge, calibration, evaluation, upload) on the terminal, unless quiet.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, TextIO

QUIET, NORMAL, VERBOSE = 0, 1, 2
_state: dict = {"verbosity": NORMAL, "log": None, "session": False}


def verbosity() -> int:
    return _state["verbosity"]


def in_session() -> bool:
    """Whether a caller (the CLI) has already set where the run's messages go."""
    return _state["session"]


def wants_notes() -> bool:
    """Whether `note` lines go anywhere (a log file, or a verbose terminal)."""
    return _state["log"] is not None or verbosity() >= VERBOSE


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


def note(line: str) -> None:
    """A line for the log file only (and the terminal when verbose)."""
    _emit(line, VERBOSE)


def stage(line: str) -> None:
    """A phase of the run starts or ends: on the terminal unless quiet, always in the log."""
    _emit(line, NORMAL)


def table(text: str) -> None:
    """A table the run prints (a search's choices): on the terminal unless quiet, always in the log."""
    log: IO[str] | None = _state["log"]
    if log is not None:
        log.write(text.rstrip("\n") + "\n")
        log.flush()
    if verbosity() >= NORMAL:
        print(text, file=_original_stderr())


def _emit(line: str, level: int) -> None:
    """Always into the log file (time-stamped); on the terminal from `level` of verbosity up."""
    log: IO[str] | None = _state["log"]
    if log is not None:
        log.write(f"{_stamp()} {line}\n")
        log.flush()
    if verbosity() >= level:
        _terminal(line)


def _terminal(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"featcal-llm: {line}", file=_original_stderr())  # above a live progress bar, not through it


def _original_stderr() -> TextIO:
    stream = sys.stderr
    return stream.terminal if isinstance(stream, _Tee) else stream


class _Tee:
    """A text stream that writes to the terminal stream and, without progress-bar redraws, to the log."""

    def __init__(self, terminal: TextIO, log: IO[str]):
        self.terminal, self.log = terminal, log

    def write(self, text: str) -> int:
        written = self.terminal.write(text)
        if "\r" not in text and "\x1b[" not in text:  # bar redraws and cursor moves stay on the terminal
            self.log.write(text)
        return written

    def flush(self) -> None:
        self.terminal.flush()
        self.log.flush()

    def __getattr__(self, name: str):
        return getattr(self.terminal, name)


@contextmanager
def library_silenced(logger: str, printed: bool = False) -> Iterator[None]:
    """A library's own log lines (and, with `printed`, what it writes to stderr: a progress bar) hidden while it works:
    featcal-llm reports the outcome in a line of its own."""
    import contextlib
    import io
    import logging

    handle = logging.getLogger(logger)
    level = handle.level
    handle.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stderr(io.StringIO()) if printed else contextlib.nullcontext():
            yield
    finally:
        handle.setLevel(level)


@contextmanager
def session(log_path: Path | None = None, level: int = NORMAL) -> Iterator[IO[str] | None]:
    """Inside: the run's verbosity is `level`, and with `log_path` its output is copied to that file (appended)."""
    previous = dict(_state)
    log = None
    out, err = sys.stdout, sys.stderr
    try:
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "a", encoding="utf-8")
            sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        _state.update(verbosity=level, log=log, session=True)
        yield log
    finally:
        sys.stdout, sys.stderr = out, err
        _state.update(previous)
        if log is not None:
            log.close()


def failure(error: BaseException) -> None:
    """A failed run: the one-line error, then the full text of what caused it (mergekit's own error, say).

    The cause's traceback follows with --verbose and always goes to the log file.
    """
    import traceback

    lines = [f"featcal-llm: error: {line}" for line in str(error).splitlines() or [""]]  # every problem of a recipe, one line each
    cause = error.__cause__
    if cause is not None:
        detail = str(cause).strip() or type(cause).__name__
        if len(detail.splitlines()) > 1 or detail not in str(error):  # more than the error line already says
            lines += [f"  {type(cause).__name__}: " + detail.splitlines()[0], *(f"  {line}" for line in detail.splitlines()[1:])]
    text = "\n".join(lines)
    print(text, file=_original_stderr())
    trace = "".join(traceback.format_exception(cause)) if cause is not None else ""
    log: IO[str] | None = _state["log"]
    if log is not None:
        log.write(f"{_stamp()} {text}\n{trace}")
        log.flush()
    if trace and verbosity() >= VERBOSE:
        print(trace, file=_original_stderr(), end="")
