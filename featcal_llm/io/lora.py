"""A LoRA expert read as if it were a full checkpoint: W + scale·B·A built tensor by tensor on `get`.

An expert written `org/base+org/adapter` (mergekit's syntax) or given as a plain
PEFT adapter directory is never merged into a copy on disk or in RAM: the engine
reads it through `LoraReader`, which has `CheckpointReader`'s interface and
adds the adapter's delta to each base tensor as the layer is streamed. The
adapter config is parsed by peft's own `LoraConfig`; what it honours is what
peft's `merge_and_unload` does (scale α/r or α/√r with rslora, per-module
`rank_pattern`/`alpha_pattern`, `modules_to_save`, trained biases, embedding
LoRA, `lora_bias`); any other setting that changes the merged weights is
refused by name.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from featcal_llm.errors import FeatCalError
from featcal_llm.io.checkpoint import CheckpointReader, owned_tensor


@contextmanager
def peft_quietly():
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model: its FutureWarning is
    transformers' word to peft, not to a user (`run -q` promised warnings of the run's own)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield
from featcal_llm.io.lora_layout import ADAPTER_WEIGHTS, read_adapter_layout
from featcal_llm.io.references import ADAPTER_CONFIG, NAMED_REFUSALS, adapter_config_problem

# LoraConfig fields that either are honoured below or do not change the merged weights.
HARMLESS_FIELDS = {
    "r", "lora_alpha", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save",
    "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "bias", "lora_bias",
    "lora_dropout", "init_lora_weights", "inference_mode", "base_model_name_or_path", "revision", "task_type",
    "peft_type", "auto_mapping", "peft_version", "runtime_config", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "megatron_core", "qalora_group_size", "ensure_weight_tying",
}
def adapter_identity(directory: Path) -> list:
    """An adapter's identity for run fingerprints: its config and weight files by content (a touch or a move keeps it)."""
    from featcal_llm.io.identity import content_digest

    return [[item.name, content_digest(item)] for item in [directory / ADAPTER_CONFIG, *sorted(directory.glob("*.safetensors"))]]


def load_lora_config(directory: Path, what: str) -> Any:
    """peft's LoraConfig for the adapter, refusing other adapter types and settings that change the merge."""
    path = directory / ADAPTER_CONFIG
    problem = adapter_config_problem(directory)  # the adapter type and the named refusals, as validate reads them
    if problem is not None:
        raise FeatCalError(f"{what}: {problem}")
    from peft import LoraConfig

    try:
        config = LoraConfig.from_pretrained(str(directory))
    except Exception as error:
        raise FeatCalError(f"{what}: {path}: not a LoRA config peft can read ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    defaults = LoraConfig()
    for field in sorted(vars(config)):
        if field in HARMLESS_FIELDS or field in NAMED_REFUSALS or field.startswith("_"):
            continue
        if getattr(config, field) != getattr(defaults, field, None):
            raise FeatCalError(f"{what}: {path}: {field}: {getattr(config, field)!r} is a LoRA setting featcal-llm does not support")
    return config


@dataclass(frozen=True)
class Delta:
    """target += scale · B·A (transposed for embeddings, whose A is r × vocabulary)."""

    a: str
    b: str
    scale: float
    transpose: bool


def _scale(config: Any, module: str) -> float:
    """peft's scaling for one module: α/r, or α/√r with rslora, with its rank and alpha patterns."""
    from peft.utils.other import get_pattern_key

    rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
    return alpha / math.sqrt(rank) if config.use_rslora else alpha / rank


class LoraReader:
    """`CheckpointReader`'s interface over a base checkpoint plus a LoRA adapter; nothing merged is kept."""

    def __init__(self, base: CheckpointReader, adapter: Path, what: str):
        self.base = base
        self.adapter = Path(adapter)
        self.directory = self.adapter
        self.what = what
        self.config = load_lora_config(self.adapter, what)
        base_shapes = {name: shape for name, (shape, _) in base.layout().items()}
        layout = read_adapter_layout(self.adapter, base_shapes, base.directory, what)
        self._handle = safe_open(self.adapter / ADAPTER_WEIGHTS, framework="pt")
        self.replacements: dict[str, str] = layout.replacements
        self.deltas = {target: [Delta(keys.a, keys.b, _scale(self.config, keys.module), keys.transpose) for keys in deltas]
                       for target, deltas in layout.deltas.items()}

    def names(self) -> list[str]:
        return self.base.names()

    def shards(self) -> dict[str, list[str]]:
        return self.base.shards()

    def layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self.base.layout()

    def get(self, name: str) -> torch.Tensor:
        """The base tensor (or the adapter's replacement) plus every LoRA update of it, in the base tensor's dtype."""
        tensor = self.base.get(name)
        if name in self.replacements:
            tensor = owned_tensor(self._handle, self.replacements[name]).to(tensor.dtype)
        deltas = self.deltas.get(name)
        if not deltas:
            return tensor
        # As peft merges (adapter weights up-cast to float32 for half-precision bases): a linear layer adds the
        # float32 update and rounds once; an embedding rounds the update to the base dtype first, then adds in it.
        work = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        total = tensor.to(work)
        for delta in deltas:
            b = owned_tensor(self._handle, delta.b).to(work)
            update = b if not delta.a else b @ owned_tensor(self._handle, delta.a).to(work)
            update = update.T * delta.scale if delta.transpose else delta.scale * update
            if delta.transpose:  # embedding
                total = (total.to(tensor.dtype) + update.to(tensor.dtype)).to(work)
            else:
                total = total + update
        return total.to(tensor.dtype)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {name[len(prefix):]: self.get(name) for name in self.base.names() if name.startswith(prefix)}

    def close(self) -> None:
        self.base.close()
        self._handle = None  # type: ignore[assignment]
