"""Safetensors checkpoints read one tensor at a time, and the calibrated checkpoint written shard by shard.

Reading never materialises a model: `CheckpointReader.tensors(prefix)` opens the
shards lazily (memory-mapped by safetensors) and copies out only what is asked.
Writing keeps the merged checkpoint's shard layout, names, shapes and dtypes,
so anything that loads the merged model loads the calibrated one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from featcal_llm.errors import FeatCalError

from featcal_llm.io.model_files import INDEX_FILE, SINGLE_FILE, index_weight_map, missing_weights
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


class CheckpointReader:
    """Name → shard map of a safetensors checkpoint (sharded with an index, or a single file)."""

    def __init__(self, directory: str | Path, what: str):
        self.directory = Path(directory)
        self.what = what
        if not self.directory.is_dir():
            raise FeatCalError(f"{what}: {self.directory}: model directory does not exist")
        problem = missing_weights(self.directory)  # validate's words: no weights, a bad index, a missing shard
        if problem is not None:
            raise FeatCalError(f"{what}: {self.directory}: {problem}")
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            self.weight_map: dict[str, str] = index_weight_map(self.directory)
        else:
            with safe_open(self.directory / SINGLE_FILE, framework="pt") as handle:
                self.weight_map = {name: SINGLE_FILE for name in handle.keys()}
        self._handles: dict[str, object] = {}

    def _handle(self, shard: str):
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.directory / shard, framework="pt")
        return self._handles[shard]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shards(self) -> dict[str, list[str]]:
        """Shard file → tensor names, in the order the index lists them."""
        layout: dict[str, list[str]] = {}
        for name, shard in self.weight_map.items():
            layout.setdefault(shard, []).append(name)
        return layout

    def get(self, name: str) -> torch.Tensor:
        shard = self.weight_map.get(name)
        if shard is None:
            raise FeatCalError(f"{self.what}: {self.directory}: tensor {name} is missing")
        try:
            return owned_tensor(self._handle(shard), name)
        except Exception as error:
            raise FeatCalError(f"{self.what}: {self.directory / shard}: cannot read tensor {name} ({error})") from None

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with `prefix`, keyed by the rest of its name."""
        return {name[len(prefix):]: self.get(name) for name in self.weight_map if name.startswith(prefix)}

    def layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name → (shape, dtype) from the shard headers alone; checks the index against the shards."""
        layout = {}
        for shard, names in self.shards().items():
            try:
                handle = self._handle(shard)
                present = set(handle.keys())
            except Exception as error:
                raise FeatCalError(f"{self.what}: {self.directory / shard}: not a readable safetensors file ({error})") from None
            for name in names:
                if name not in present:
                    raise FeatCalError(f"{self.what}: {self.directory / shard}: tensor {name} listed in the index is missing from the shard")
                tensor = handle.get_slice(name)
                layout[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
        return layout

    def shard_metadata(self, shard: str) -> dict[str, str] | None:
        return self._handle(shard).metadata()

    def close(self) -> None:
        self._handles.clear()


def owned_tensor(handle: Any, name: str) -> torch.Tensor:
    """`name` from a safetensors handle as a tensor of its own, in fresh (64-byte aligned) memory. safetensors 0.8 hands
    out views of the file's mapping at the file's offsets; a kernel takes another path for a misaligned operand, so two
    copies of one tensor (a merge and its copy, an expert of the same weights) computed results a rounding apart, and a
    view would change with a file rewritten under it."""
    return handle.get_tensor(name).clone()


def check_same_layers(reference: dict, other: dict, prefix: str, what: str) -> None:
    """Every decoder-layer tensor of the merged model exists in `other` with the same shape."""
    for name, (shape, _) in reference.items():
        if not name.startswith(prefix):
            continue
        if name not in other:
            raise FeatCalError(f"{what}: tensor {name} is missing")
        if other[name][0] != shape:
            raise FeatCalError(f"{what}: {name} has shape {list(other[name][0])}, the merged model has {list(shape)}")


def checkpoint_tensors(reader: Any, replacements: dict[str, Path] | None = None) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """Every tensor name of `reader` (and tensors the closed form added, a head untied from the embeddings), and a getter
    that takes a replaced tensor from its staged file."""
    replacements = replacements or {}
    names = list(dict.fromkeys([*reader.names(), *replacements]))
    handles: dict[Path, Any] = {}

    def get(name: str) -> torch.Tensor:
        source = replacements.get(name)
        if source is None:
            return reader.get(name)
        if source not in handles:
            handles[source] = safe_open(source, framework="pt")
        return owned_tensor(handles[source], name)

    return names, get


def write_calibrated_checkpoint(
    merged: CheckpointReader, replacements: dict[str, Path], output: Path, copies: dict[str, str] | None = None
) -> None:
    """Write every merged shard again, taking calibrated tensors from their staging files.

    `replacements` maps a tensor name to the safetensors file that holds its new
    value; `copies` a stored tensor to the tensor whose written value it repeats
    (a head kept tied: lm_head.weight → the input embedding). Peak memory is one shard.
    """
    copies = copies or {}
    layout = merged.shards()
    added = [name for name in replacements if name not in merged.weight_map]  # a head untied from the embeddings
    last, added_bytes, added_parameters = list(layout)[-1], 0, 0
    _, written = checkpoint_tensors(merged, replacements)
    for shard, names in layout.items():
        tensors: dict[str, torch.Tensor] = {}
        for name in names + (added if shard == last else []):
            if name in copies:  # a copy of its own: safetensors stores no two names over one memory
                tensors[name] = written(copies[name]).clone()
                continue
            if name not in replacements:
                tensors[name] = merged.get(name)
                continue
            value = written(name)
            original = merged.get(name) if name in merged.weight_map else value
            if value.shape != original.shape or value.dtype != original.dtype:
                raise FeatCalError(f"internal: calibrated {name} is {value.dtype}{tuple(value.shape)}, merged is {original.dtype}{tuple(original.shape)}")
            tensors[name] = value
            if name in added:
                added_bytes += value.numel() * value.element_size()
                added_parameters += value.numel()
        save_file(tensors, output / shard, metadata=merged.shard_metadata(shard) or {"format": "pt"})
        del tensors
    if (merged.directory / INDEX_FILE).is_file():
        index = json.loads((merged.directory / INDEX_FILE).read_text(encoding="utf-8"))
        index["weight_map"].update({name: last for name in added})
        if added and "total_size" in index.get("metadata", {}):
            index["metadata"]["total_size"] += added_bytes
        if added and "total_parameters" in index.get("metadata", {}):  # transformers 5 writes it beside total_size
            index["metadata"]["total_parameters"] += added_parameters
        (output / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def head_needs_untying(head_replaced: bool, config_ties: bool, head_stored: bool) -> bool:
    """Whether a checkpoint whose LM head was re-fitted must be written untied.

    Where the config ties the head to the input embeddings, a runtime that honours the flag (vLLM's loaders skip
    `lm_head.*` then) serves the embedding as the head, whatever `lm_head.weight` the files hold; mergekit writes that
    tensor whenever an input stores it and copies `tie_word_embeddings: true`. Where the files lack it, transformers
    would tie it back. Either way the calibrated head is served only from an untied config.
    """
    return head_replaced and (config_ties or not head_stored)


def stores_its_own_head(merged: CheckpointReader, replacements: dict, embed_tokens: str) -> bool:
    """Whether a merge whose config ties the head stores an `lm_head.weight` that differs from the embedding the output
    keeps (a random merge method drops other entries of the two): transformers then serves the stored head, which the
    calibration used too, while vLLM, honouring the flag, would serve the embedding."""
    if "lm_head.weight" not in merged.weight_map or "lm_head.weight" in replacements:
        return False
    embedding = replacements[embed_tokens] if embed_tokens in replacements else merged.get(embed_tokens)
    return not torch.equal(merged.get("lm_head.weight"), embedding)


def untie_head(directory: Path) -> None:
    """The checkpoint now holds an LM head of its own: transformers must not tie it back to the input embeddings."""
    path = directory / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tie_word_embeddings"] = False
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def copy_side_files(source: Path, output: Path) -> None:
    """Config, generation config, tokenizer and anything else that is not weights. Not the card, nor any `featcal_*`
    file: a merge that is itself an earlier run's output (a stack run as two recipes) would hand its report of that run
    (`featcal_refine.json`, `featcal_tuning.json`, ...) to an output whose run did no such thing."""
    for item in sorted(source.iterdir()):
        if item.name == "README.md" or item.name.startswith("featcal_") or item.name == INDEX_FILE or item.name.endswith(WEIGHT_SUFFIXES):
            continue
        if item.is_file():
            shutil.copy2(item, output / item.name)


def current_umask() -> int:
    """The process's umask, read from /proc where Linux has it (setting it to read it, the fallback, changes it for
    every thread for a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def with_umask_mode(directory: Path) -> None:
    """Every file below `directory` readable and writable as the umask lets a new file be (0644 under umask 022)."""
    mode = 0o666 & ~current_umask()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink() and (path.stat().st_mode & 0o777) != mode:
            path.chmod(mode)


def move_into_place(finished: Path, target: Path, trash_suffix: str) -> None:
    """Rename a finished directory onto `target`; an existing target is swapped out first, then removed.

    A rename cannot replace a non-empty directory, and removing the old one first would leave
    nothing in place if the process died between the two steps. The files get the mode the user's
    umask gives new files: safetensors (0.8) writes its files 0600, which a server running as
    another user (vLLM in a container, a shared model folder) cannot read.
    """
    with_umask_mode(finished)
    trash = target.with_name(f".{target.name}.{trash_suffix}")
    if target.exists():
        _remove(trash)
        target.rename(trash)
    finished.rename(target)
    _remove(trash)  # also what a run killed between the two renames left there


def _remove(path: Path) -> None:
    """A swapped-out target: a folder, removed, or a link to one (an output given as a link), itself unlinked and the
    folder it names left as it is (rmtree refuses a link, which would stay and block the next run)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
