"""Where each model a recipe names lives: mergekit's `ModelReference`, read completely.

A reference is `path[@revision][+adapter[@revision]]`, optionally with
`override_architecture` (parsed by mergekit itself). Hub ids are fetched at
their revision through mergekit (`ModelReference.local_path`, i.e.
huggingface_hub's `snapshot_download`); a revision on a local directory is
refused, since nothing could check it out. `+adapter` and plain PEFT adapter
directories become a LoRA source: the engine reads them through
`io/lora.LoraReader`, never through the base alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError, warn

ADAPTER_CONFIG = "adapter_config.json"


# Initialisations that leave the base weights as they are (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA rewrite them).
SAFE_INITS = (True, False, "gaussian", "orthogonal", "eva")
NAMED_REFUSALS = {  # field → what it is, for the one-line refusal
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "use_qalora": "QALoRA",
    "trainable_token_indices": "trainable token indices",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on nn.Parameter targets",
    "megatron_config": "Megatron-parallel LoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
}


def adapter_config_problem(directory: Path) -> str | None:
    """What io/lora.py refuses of an adapter's adapter_config.json as written (None: a LoRA it reads further with peft):
    read without torch or peft, so that `validate` says it too."""
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        return f"{directory}: not a PEFT adapter ({ADAPTER_CONFIG} is missing)"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return f"{path}: not valid JSON"
    if not isinstance(raw, dict):
        return f"{path}: not valid JSON (not an object)"
    if str(raw.get("peft_type", "")).upper() != "LORA":
        return (f"{path}: peft_type {raw.get('peft_type')} adapters are not supported (LoRA only; merge it into a full "
                "checkpoint with peft's merge_and_unload and name that instead)")
    for field, label in NAMED_REFUSALS.items():
        if raw.get(field) not in (None, False, [], {}):
            return (f"{path}: {field}: {label} adapters are not supported (merge it with peft's merge_and_unload and name "
                    "the merged checkpoint instead)")
    for field in ("r", "lora_alpha"):  # the scale α/r (or α/√r) io/lora.py computes
        value = raw.get(field, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            return f"{path}: {field}: expected a positive number, got {value!r}"
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = raw.get(field) or {}
        if not isinstance(pattern, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in pattern.values()):
            return f"{path}: {field}: expected a mapping of module patterns to positive numbers, got {pattern!r}"
    init = raw.get("init_lora_weights", True)
    if not any(init is safe or init == safe for safe in SAFE_INITS):
        return (f"{path}: init_lora_weights: {init!r} rewrites the base weights; convert the adapter (save_pretrained with "
                "path_initial_model_for_weight_conversion) or merge it first")
    return None


def is_adapter_directory(directory: Path) -> bool:
    """A PEFT adapter rather than a model: adapter_config.json and no model config (io/lora.py's rule, here without torch:
    `validate` resolves references without importing it)."""
    return (directory / ADAPTER_CONFIG).is_file() and not (directory / "config.json").is_file()


@dataclass(frozen=True)
class ModelSource:
    """One model of the recipe: a full checkpoint directory, optionally with a LoRA adapter applied on the fly."""

    reference: str  # as mergekit prints it: path[@rev][+adapter[@rev]]
    directory: Path  # the full checkpoint (for a plain adapter directory: the recipe's base model)
    adapter: Path | None = None
    revisions: tuple[str | None, str | None] = (None, None)  # model's, adapter's

    @property
    def tokenizer_directory(self) -> Path:
        """The adapter's own tokenizer when it ships one (added tokens), else the checkpoint's."""
        if self.adapter is not None and (self.adapter / "tokenizer_config.json").is_file():
            return self.adapter
        return self.directory

    def open(self, what: str) -> Any:
        """A CheckpointReader, or a LoraReader over it (imported here: they need torch)."""
        from featcal_llm.io.checkpoint import CheckpointReader
        from featcal_llm.io.lora import LoraReader

        base = CheckpointReader(self.directory, what)
        return base if self.adapter is None else LoraReader(base, self.adapter, what)

    def identity(self) -> dict[str, Any]:
        """What a run fingerprint records besides the checkpoint's files: the reference, its revisions, the adapter's files.

        Not the directory's location: the files' contents identify it, so a moved model keeps its saved work.
        """
        identity: dict[str, Any] = {"reference": self.reference, "revisions": list(self.revisions)}
        if self.adapter is not None:
            from featcal_llm.io.lora import adapter_identity

            identity["adapter"] = adapter_identity(self.adapter)
        return identity

    def describe(self) -> dict[str, Any]:
        """The model card's record of it."""
        record: dict[str, Any] = {"reference": self.reference}
        if self.revisions[0]:
            record["revision"] = self.revisions[0]
        if self.adapter is not None:
            record["lora_adapter"] = str(self.adapter)
            if self.revisions[1]:
                record["lora_revision"] = self.revisions[1]
        return record


def _naming(what: str, model_path: Any) -> str:
    """`what: path`, unless `what` already ends with the path (an expert is named by its path)."""
    return what if what.endswith((f": {model_path}", f" {model_path}")) else f"{what}: {model_path}"


def hub_id(path: str) -> str | None:
    """`org/name` of a model or dataset path that is not on this machine (its `@revision` dropped), else None."""
    name = path.split("@")[0]
    if not name or name.startswith(("/", ".", "~")) or name.count("/") != 1 or Path(name).exists():
        return None
    return name


def is_hub_reference(model_path: Any) -> bool:
    """A mergekit ModelPath that is not on disk and reads as `org/name`: what mergekit would fetch from the hub."""
    return hub_id(str(model_path.path)) is not None


def _local_directory(model_path: Any, what: str) -> Path:
    """A local directory for a mergekit ModelPath: the path itself, or the hub snapshot at its revision."""
    path = Path(model_path.path)
    if path.exists():
        if model_path.revision:
            raise FeatCalError(f"{what}: {model_path}: a revision applies to hub ids only and {path} is a local directory (check that revision out there and drop @{model_path.revision})")
        if not path.is_dir():
            raise FeatCalError(f"{what}: {path}: expected a model directory")
        return path
    if not is_hub_reference(model_path):
        raise FeatCalError(f"{_naming(what, path)}: model directory does not exist")
    from mergekit.common import ModelReference

    try:  # mergekit's own download: snapshot_download(path, revision=...) of configs, tokenizer and safetensors
        return Path(ModelReference(model=model_path).local_path())
    except Exception as error:
        raise FeatCalError(f"{_naming(what, model_path)}: not a local directory and could not be fetched from the hub at revision {model_path.revision or 'main'} ({type(error).__name__})") from None


def resolve_source(reference: Any, what: str, base: ModelSource | None = None) -> ModelSource:
    """The `ModelSource` of a mergekit ModelReference; `base` is where a plain adapter directory applies."""
    directory = _local_directory(reference.model, what)
    revisions = (reference.model.revision, reference.lora.revision if reference.lora else None)
    if reference.lora is not None:
        adapter = _local_directory(reference.lora, f"{what} (LoRA adapter)")
        if not (adapter / "adapter_config.json").is_file():
            raise FeatCalError(f"{what}: {reference.lora}: not a PEFT adapter (adapter_config.json is missing)")
        if is_adapter_directory(directory):
            raise FeatCalError(f"{what}: {reference.model}: is itself a PEFT adapter; write the full model before '+'")
        return ModelSource(str(reference), directory, adapter, revisions)
    if is_adapter_directory(directory):
        if base is None:
            raise FeatCalError(f"{what}: {directory}: a PEFT adapter cannot be the base model; name the full base checkpoint")
        if base.adapter is not None:
            raise FeatCalError(f"{what}: {directory}: a plain adapter on a base that is itself base+adapter is ambiguous; write it as model+adapter")
        _warn_other_base(directory, base, what)
        return ModelSource(str(reference), base.directory, directory, (base.revisions[0], reference.model.revision))
    return ModelSource(str(reference), directory, None, revisions)


def _warn_other_base(adapter: Path, base: ModelSource, what: str) -> None:
    """A plain adapter directory applies to the recipe's base; say so when its config names another one.

    Names are compared by their last component, since the same model is a hub id on one machine and a local
    directory on another; shapes are checked strictly when the adapter is opened.
    """
    try:
        trained_on = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except ValueError:
        return  # reported by load_lora_config
    if trained_on and Path(str(trained_on)).name not in (Path(base.reference.split("@")[0]).name, base.directory.name):
        warn(f"{what}: adapter {adapter} names {trained_on} as its base; it is applied to the recipe's base_model {base.reference}")


def check_override_architecture(reference: Any, config: Any, what: str) -> None:
    """mergekit's override_architecture only renames the architecture it merges as; FeatCal runs the model's own class.

    A no-op override (the config's own architecture) is accepted; any other is refused, since the layers would
    run as a class their config does not describe.
    """
    override = getattr(reference, "override_architecture", None)
    if override is None:
        return
    own = list(getattr(config, "architectures", None) or [])
    if own[:1] != [override]:
        raise FeatCalError(f"{what}: override_architecture {override} differs from the config's {own or 'unknown'}: featcal-llm runs every layer with the model's own transformers class (edit config.json instead, or drop override_architecture)")
