"""refine's resumable progress: what a held-out check saves in the staging area, when, and how a rerun reads it back.

A save holds the trainable state, AdamW's two moments, the schedule, the RNG and the history: 12 bytes a trained
parameter (1.6 GB for SmolLM2-135M in full, with a best state 2.2-2.5 s on two CPU cores, 4.6-5.2 s while the zip
records' CRC-32 was computed; the LM head's alone is 6 GB at 8B), and a new best state 4 more, once, in its own file.
Saving after every check spent a quarter of a CPU refinement writing files, so a check saves only when the time since
the last save ended is at least `1 / SAVE_SHARE - 1` times what that save took: saving stays near a twentieth of the
stage's time, whatever the model and the disk. (It was a tenth while a save took twice as long: the same time between
saves, about 45 s for SmolLM2-135M in full.) Nothing else depends on when saves happen: a rerun resumes after the last
saved check, and the steps it replays (records, RNG, schedule restored) write the same bytes as an unbroken run.
The best state is written once, in its own file, at the first save after a check finds it.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

import torch

from featcal_llm import runlog

SAVE_SHARE = 0.05  # the share of the refinement's time its progress saves may take


def save_due(since_last_save: float | None, last_save_seconds: float | None, share: float = SAVE_SHARE) -> bool:
    """Whether a check saves the progress: always before any save was timed, else once `since_last_save` (seconds since
    the last save ended) reaches last_save_seconds · (1 − share) / share, so that saves take `share` of the time."""
    if since_last_save is None or last_save_seconds is None:
        return True
    return since_last_save >= last_save_seconds * (1 - share) / share


def best_pass(step: int | str) -> str:
    return f"refine-best-{step}"


def rng_state(device: torch.device) -> dict[str, Any]:
    """The generators the refinement draws from: the CPU's and its own GPU's (not every visible GPU's: a resume with
    fewer GPUs visible, or another index, restores the one it runs on)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if isinstance(state.get("cuda"), torch.Tensor) and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class MissingBest(Exception):
    """The saved progress names a best state whose file is gone or unreadable (removed by hand, a damaged disk)."""


def load_best(staging, step: int) -> dict[str, torch.Tensor] | None:
    """The best state a resumed run had saved (its own file, written at the save after the check that found it), or
    None before any."""
    if step == 0:
        return None
    saved = staging.load_pass(best_pass(step))
    if saved is None or saved.get("step") != step:
        raise MissingBest(f"the saved progress names step {step} as best, but its state is missing from {staging.root}")
    return saved["state"]


def drop_older_bests(staging, keep: int | None) -> None:
    """Only the best state the progress file names is kept (None: none): the progress is saved before the older one is
    removed, so a crash between the two leaves a best state for whichever progress file survives."""
    kept = None if keep is None else staging.pass_file(best_pass(keep))
    for path in staging.root.glob(staging.pass_file(best_pass("*")).name):
        if path != kept:
            path.unlink()


REFINED_FOLDER = "refine"  # in the staging area: the refined tensors the output is written from


def forget_refinement(staging) -> None:
    """What only this refinement reads: its progress, best states and refined tensors (at 8B with the adapter, a model's
    size and 16 bytes a trained head parameter). A run that keeps its staging area for reruns with other `refine:`
    settings (`run --keep-layers`) drops them once its output is written: those reruns refine again from the layers."""
    forget_progress(staging)
    shutil.rmtree(staging.root / REFINED_FOLDER, ignore_errors=True)


def forget_progress(staging) -> None:
    """Remove a refinement's saved progress and best states: saved under other `refine:` settings, they must not mix
    with the new run's files (a best state of the same step written by either)."""
    staging.pass_file("refine").unlink(missing_ok=True)
    drop_older_bests(staging, None)


def saved_progress(staging, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The progress a rerun resumes from: the one saved under these `settings`, else None. Progress saved under other
    settings is removed first (the run fingerprint leaves `refine:`'s keys to this check, so the layers stay)."""
    saved = staging.load_pass("refine")
    if saved is not None and saved["settings"] != settings:
        runlog.stage("refine: its settings changed since the saved progress, so it starts over from the calibrated layers")
        forget_progress(staging)
        return None
    return saved


class ProgressSaver:
    """Saves the progress at the checks `save_due` picks, each best state once; tracks what is on disk."""

    def __init__(self, staging, best_on_disk: int = 0):
        self.staging = staging
        self.best_on_disk = best_on_disk  # the step whose best state is in its file (0: none)
        self.ended: float | None = None  # when the last save ended (perf_counter), None before the first
        self.cost: float | None = None  # how long it took
        self.saves = 0
        self.seconds = 0.0  # spent saving, all saves together

    def after_check(self, progress: dict[str, Any], snapshot) -> bool:
        """Save the progress if a save is due; `snapshot()` gives the rest of what resumes (state, optimizer, ...)."""
        now = time.perf_counter()
        if not save_due(None if self.ended is None else now - self.ended, self.cost):
            return False
        best_step = progress["best_step"]
        if best_step and best_step != self.best_on_disk:
            self.staging.save_pass(best_pass(best_step), {"step": best_step, "state": progress["best"]})
        self.staging.save_pass("refine", {**progress, "best": None, **snapshot()})
        drop_older_bests(self.staging, best_step)
        self.best_on_disk = best_step
        self.ended = time.perf_counter()
        self.cost = self.ended - now
        self.saves += 1
        self.seconds += self.cost
        return True
