"""Progress that survives a crash: calibrated layers staged on disk, fingerprinted.

After each layer its calibrated tensors are written to `layers/layer-NNNNN.safetensors`
(written under a temporary name, then renamed) and `state.json` records how
many layers are done and the fingerprint of everything that determines the
result. A rerun with the same fingerprint continues after the last finished
layer, rebuilding the hidden-state streams by replaying the finished layers
(forward passes only, much cheaper than storing the streams). Anything else
in the staging directory is discarded with a message.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.utils.serialization import config as serialization_config
from safetensors import safe_open
from safetensors.torch import save_file

from featcal_llm.errors import warn
from featcal_llm.io.checkpoint import owned_tensor
from featcal_llm.io.records import Record, response_from

STATE_FILE = "state.json"


def _write_atomically(path: Path, write) -> None:
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def fingerprint(parts: Iterable[Any]) -> str:
    """sha256 over a JSON rendering of `parts` (strings, numbers, lists, dicts)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def checkpoint_identity(directory: Path) -> list:
    """A checkpoint's identity by content: config, index and weight files (io/identity.py; a touch or a move keeps it)."""
    from featcal_llm.io.identity import weights_identity

    return weights_identity(directory)


# The packages whose code decides the calibrated weights (not the evaluation, the CLI or the benchmarks), and the
# modules beside them that do: pipeline.py decides the passes, the teachers, the skip and the refinement; stages/ opens
# the models, reads the data and writes the checkpoint.
WEIGHT_CODE = ("maths", "engine", "family", "generation", "io", "stages")
WEIGHT_MODULES = ("pipeline.py",)
# The libraries whose code computes the weights (forward passes, the merge, the files read): another release may round
# otherwise, so progress saved under one is not resumed under another.
WEIGHT_LIBRARIES = ("torch", "transformers", "mergekit", "safetensors", "peft")
PACKAGE = Path(__file__).resolve().parents[1]


def weight_code_files(package: Path = PACKAGE) -> list[Path]:
    """The source files `source_digest` reads, in a fixed order."""
    files = [path for folder in WEIGHT_CODE for path in sorted((package / folder).rglob("*.py"))]
    return files + [package / name for name in WEIGHT_MODULES]


@functools.cache
def source_digest(package: Path = PACKAGE) -> str:
    """sha256 of the code that computes the weights: progress saved by another version of it is not resumed."""
    digest = hashlib.sha256()
    for path in weight_code_files(package):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _installed(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    """The installed release of each library in WEIGHT_LIBRARIES (None: not installed; peft is optional)."""
    return {name: _installed(name) for name in WEIGHT_LIBRARIES}


def sequences_digest(sequences: dict[str, list[list[int]]]) -> str:
    digest = hashlib.sha256()
    for task in sorted(sequences):
        digest.update(task.encode())
        for sequence in sequences[task]:
            digest.update(torch.tensor(sequence, dtype=torch.int64).numpy().tobytes())
            if isinstance(sequence, Record) and sequence.spans not in ((), ((response_from(sequence), len(sequence)),)):
                # a conversation's assistant turns: each span, so that a change of the judged tokens starts over
                digest.update(("@" + ",".join(f"{start}-{end}" for start, end in sequence.spans)).encode())
            elif response_from(sequence):  # where a prompt/response record's scored tokens start
                digest.update(f"@{response_from(sequence)}".encode())
            digest.update(b"|")
    return digest.hexdigest()


def resuming_line(root: Path, completed: int, num_layers: int) -> str:
    """What a resumed run says it keeps: the LM head's re-fit is staged as one more "layer", not counted as one."""
    if completed > num_layers:
        return f"resuming from {root}: all {num_layers} layers and the LM head already calibrated"
    return f"resuming from {root}: {completed} of {num_layers} layers already calibrated"


def remove_staging(root: Path) -> None:
    """Remove a run's saved progress, its state file first: a removal stopped half-way leaves no state that names
    layers already deleted (a rerun would resume from it and fail on the missing files), only files no state names."""
    (root / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)


def holds_no_layer(root: Path) -> bool:
    """No calibrated layer saved there (no state, or none completed): nothing a rerun could resume but the passes
    before the layers, which a fixed input recomputes anyway (its fingerprint changes)."""
    try:
        return int(json.loads((root / STATE_FILE).read_text()).get("completed_layers", 0)) == 0
    except (OSError, ValueError, AttributeError):
        return True


class StagingArea:
    """The `layers/` directory of a run's partial output, plus its state file."""

    def __init__(self, root: Path, run_fingerprint: str):
        self.root = root
        self.layers = root / "layers"
        self.fingerprint = run_fingerprint
        self.threads = torch.get_num_threads()  # in the fingerprint (CPU sums round by it): kept to say so when it differs
        state = self._read_state()
        if state is not None and state.get("fingerprint") != run_fingerprint:
            warn(self._starting_over(state.get("threads")))
            state = None
        if state is None:
            remove_staging(root)
            self.layers.mkdir(parents=True)
            self.completed = 0
            self._write_state()
        else:
            self.completed = int(state["completed_layers"])  # engine/calibrate says so, knowing the decoder's layer count

    def _starting_over(self, saved_threads: int | None) -> str:
        """Why the saved progress is not resumed: torchrun gives each rank one thread unless OMP_NUM_THREADS says
        otherwise and one process takes every core, so a rerun on another world size is told how to resume."""
        if saved_threads is None or saved_threads == self.threads:
            return f"saved progress in {self.root} was made with a different recipe, data, models or settings; starting over"
        plural = "s" if saved_threads > 1 else ""
        return (f"saved progress in {self.root} was made with {saved_threads} thread{plural} a process, this run has "
                f"{self.threads}; starting over (to resume it instead, stop this run and rerun with OMP_NUM_THREADS={saved_threads})")

    def _read_state(self) -> dict | None:
        try:
            return json.loads((self.root / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _write_state(self) -> None:
        state = {"fingerprint": self.fingerprint, "completed_layers": self.completed, "threads": self.threads}
        _write_atomically(self.root / STATE_FILE, lambda p: p.write_text(json.dumps(state, indent=1)))

    def layer_file(self, layer: int) -> Path:
        return self.layers / f"layer-{layer:05d}.safetensors"

    def record_file(self, layer: int) -> Path:
        return self.layers / f"layer-{layer:05d}.json"

    def commit(self, layer: int, tensors: dict[str, torch.Tensor], record: dict | None = None) -> None:
        """Persist one calibrated layer (full tensor names) and what was measured on it, and mark it done."""
        if layer != self.completed:
            raise RuntimeError(f"internal: layer {layer} committed after {self.completed} completed layers")
        if record is not None:
            _write_atomically(self.record_file(layer), lambda p: p.write_text(json.dumps(record, sort_keys=True)))
        _write_atomically(self.layer_file(layer), lambda p: save_file({k: v.contiguous() for k, v in tensors.items()}, p))
        self.completed = layer + 1
        self._write_state()

    def pass_file(self, name: str) -> Path:
        return self.root / f"pass-{name}.pt"

    def save_pass(self, name: str, result: dict) -> None:
        """Keep what a pass before the layers computed (tensors, numbers, dicts and lists), for a resume.

        Written without the zip records' CRC-32: torch.load never checks it, and computing it took half to two thirds
        of a save (refine's 1.6 GB progress for SmolLM2-135M alone: 2.0-3.3 s with it, 0.7 s without, on two CPU cores);
        the temporary file, fsync and rename are what keep a crash from leaving a damaged one."""
        with serialization_config.patch({"save.compute_crc32": False}):
            _write_atomically(self.pass_file(name), lambda p: torch.save(result, p))

    def load_pass(self, name: str) -> dict | None:
        """What `save_pass` kept under this fingerprint, or None."""
        path = self.pass_file(name)
        if not path.is_file():
            return None
        try:
            return torch.load(path, weights_only=True, map_location="cpu")  # a GPU's tensors, on whichever GPUs are visible now
        except Exception:  # a damaged file: the pass runs again
            return None

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        with safe_open(self.layer_file(layer), framework="pt") as handle:
            return {name: owned_tensor(handle, name) for name in handle.keys()}

    def record(self, layer: int) -> dict | None:
        """What `commit` recorded with the layer (tuning table, drift), if anything."""
        path = self.record_file(layer)
        return json.loads(path.read_text()) if path.is_file() else None

    def replacements(self) -> dict[str, Path]:
        """Tensor name → staged file, for every completed layer."""
        mapping = {}
        for layer in range(self.completed):
            with safe_open(self.layer_file(layer), framework="pt") as handle:
                mapping.update({name: self.layer_file(layer) for name in handle.keys()})
        return mapping


class StagingReader(StagingArea):
    """A non-zero rank's view of rank 0's staging area (on a filesystem every rank reads): it reads staged layers, never writes."""

    def __init__(self, root: Path, run_fingerprint: str, completed: int):
        self.root = root
        self.layers = root / "layers"
        self.fingerprint = run_fingerprint
        self.completed = completed

    def commit(self, layer: int, tensors: dict[str, torch.Tensor], record: dict | None = None) -> None:
        self.completed = layer + 1
