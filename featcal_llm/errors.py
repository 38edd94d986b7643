"""User-facing errors: one line naming the file or key and what was expected."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


# The CLI's exit codes (README, "Exit codes"): a script can tell "fix the input" from "the run failed".
EXIT_FAILED = 1  # the run started and failed: non-finite values, an upload, a library error, out of memory, a full disk
EXIT_USAGE = 2  # the command line or the input (recipe, data, models) is wrong
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15): a scheduler's stop (SLURM, `docker stop`, `kill`)


class Terminated(KeyboardInterrupt):
    """SIGTERM in the command-line process: the run stops as Ctrl-C stops it (its locks released, its temporary
    files removed, its progress kept), not at once with nothing cleaned up."""


class FeatCalError(Exception):
    """A problem with the user's input; the CLI prints it on one line and exits with EXIT_USAGE."""

    exit_code = EXIT_USAGE


class RunFailure(FeatCalError):
    """The run began and could not finish (not the input's fault as far as the checks can tell): EXIT_FAILED."""

    exit_code = EXIT_FAILED


def float16_cause(dtype: object) -> str:
    """What a NaN/Inf error adds where the run computes in float16 (`dtype`, a torch dtype): its likely cause and the key
    to change, since finite weights and activations that float32 and bfloat16 hold overflow float16 (65504 at most)."""
    if str(dtype) != "torch.float16":
        return ""
    return " in float16 (featcal.dtype: float16 holds at most 65504; set featcal.dtype: bfloat16 or float32)"


LAYERS_REMEDY = ("`featcal-llm validate RECIPE` prints what the run needs: lower featcal.batch_tokens, or run on a larger device, "
                 "then rerun the same command to resume")
REFINE_REMEDY = ("in the refinement: set featcal.refine.gradient_checkpointing: true (or featcal.refine.params: adapter where it "
                 "trains every parameter) and rerun the same command: the calibrated layers are kept")


def out_of_memory(error: BaseException, remedy: str = LAYERS_REMEDY) -> RunFailure | None:
    """torch's OutOfMemoryError (a RuntimeError; named, so that the CLI need not import torch) or the host's MemoryError
    as one line that says what to change (`remedy`: the stage's own levers); None for any other error."""
    if not isinstance(error, MemoryError) and type(error).__name__ != "OutOfMemoryError":
        return None
    where = (str(error).strip().splitlines() or ["the host's RAM"])[0]
    return RunFailure(f"out of memory ({where[:200]}); {remedy}")


class QuietExit(Exception):
    """A non-zero torchrun rank stops because of an error rank 0 reports (bad input): exit non-zero without printing."""


QUIET = {"warnings": False}  # set on the non-zero ranks of a distributed run: rank 0 speaks for all
_COLLECTORS: list[list[str]] = []  # open `collected_warnings` lists


@contextmanager
def collected_warnings() -> Iterator[list[str]]:
    """Inside: every warning is also appended to the yielded list, so that the Python API can return them."""
    found: list[str] = []
    _COLLECTORS.append(found)
    try:
        yield found
    finally:
        _COLLECTORS.remove(found)


_SILENCED = [0]  # open `silenced_warnings` blocks


@contextmanager
def silenced_warnings() -> Iterator[None]:
    """Inside: no warning is shown or kept (a recipe read again to digest what the run wrote, its warnings said)."""
    _SILENCED[0] += 1
    try:
        yield
    finally:
        _SILENCED[0] -= 1


def warn(message: str) -> None:
    """A one-line warning on stderr, in the same voice as errors (and kept for the API's result)."""
    import sys

    if _SILENCED[0]:
        return
    if _COLLECTORS and all(message in found for found in _COLLECTORS):
        return  # said once a run: the recipe is read by validate's checks and again by the run
    for found in _COLLECTORS:
        found.append(message)
    if QUIET["warnings"]:
        return
    print(f"featcal-llm: warning: {message}", file=sys.stderr)
