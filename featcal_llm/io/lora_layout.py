"""Which base tensor each tensor of a PEFT LoRA adapter changes, and whether the shapes fit.

Read from the safetensors headers alone, without torch: `io/lora.LoraReader`
builds on it when run reads the adapter, and `validate` calls it to refuse an
adapter trained for another base in run's words, before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from featcal_llm.errors import FeatCalError
from featcal_llm.io.model_files import INDEX_FILE, SINGLE_FILE, index_weight_map, missing_weights, read_config_json

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_PAIRED = ((".lora_A.weight", "A"), (".lora_B.weight", "B"), (".lora_embedding_A", "EA"), (".lora_embedding_B", "EB"))


@dataclass(frozen=True)
class DeltaKeys:
    """target += scale · B·A of one module (A is r × vocabulary for embeddings, so B·A is transposed); `a` is empty
    for `lora_bias`, whose update is B's bias alone."""

    module: str
    a: str
    b: str
    transpose: bool


@dataclass
class AdapterLayout:
    replacements: dict[str, str] = field(default_factory=dict)  # base tensor → adapter tensor that replaces it
    deltas: dict[str, list[DeltaKeys]] = field(default_factory=dict)  # base tensor → the updates added to it


def tensor_shapes(path: Path, what: str) -> dict[str, tuple[int, ...]]:
    """Name → shape from one safetensors file's header."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as error:
        raise FeatCalError(f"{what}: {path}: not a readable safetensors file ({error})") from None


def checkpoint_shapes(directory: Path, what: str) -> dict[str, tuple[int, ...]]:
    """Name → shape of the tensors a checkpoint's index names (or of its one file), from the shards' headers."""
    problem = missing_weights(directory)  # CheckpointReader's refusal, in its words
    if problem is not None:
        raise FeatCalError(f"{what}: {directory}: {problem}")
    if not (directory / INDEX_FILE).is_file():
        return tensor_shapes(directory / SINGLE_FILE, what)
    weight_map = index_weight_map(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted(set(weight_map.values())):
        found = tensor_shapes(directory / shard, what)
        shapes.update({name: found[name] for name, where in weight_map.items() if where == shard and name in found})
    return shapes


def adapter_weights(adapter: Path, what: str) -> Path:
    weights = adapter / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = (adapter / "adapter_model.bin").is_file()
        raise FeatCalError(f"{what}: {adapter}: {'only a pickled adapter_model.bin found; featcal-llm reads safetensors only' if pickled else f'{ADAPTER_WEIGHTS} is missing'}")
    return weights


def read_adapter_layout(adapter: Path, base_shapes: dict[str, tuple[int, ...]], base_directory: Path, what: str) -> AdapterLayout:
    """Each adapter tensor's base target, refusing what peft's merge_and_unload could not merge into this base."""
    weights = adapter_weights(adapter, what)
    shapes = tensor_shapes(weights, what)
    layout = _parse(list(shapes), set(base_shapes), weights, base_directory, what)
    _check_shapes(layout, shapes, base_shapes, weights, what)
    return layout


def _parse(keys: list[str], names: set[str], weights: Path, base_directory: Path, what: str) -> AdapterLayout:
    layout, pairs = AdapterLayout(), {}
    for key in keys:
        if not key.startswith(PREFIX):
            raise FeatCalError(f"{what}: {weights}: tensor {key} is not a PEFT adapter tensor (expected the prefix {PREFIX})")
        rest = key[len(PREFIX):]
        for suffix, role in _PAIRED:
            if rest.endswith(suffix):
                pairs.setdefault(rest[: -len(suffix)], {})[role] = key
                break
        else:
            if rest.endswith(".lora_B.bias"):
                module = rest[: -len(".lora_B.bias")]
                if f"{module}.bias" not in names:
                    raise FeatCalError(f"{what}: {weights}: lora_bias on {module}, which has no bias in the base model {base_directory} (peft cannot merge it either)")
                layout.deltas.setdefault(f"{module}.bias", []).append(DeltaKeys(module, "", key, False))
                continue
            if ".lora_" in rest:
                raise FeatCalError(f"{what}: {weights}: tensor {key} is not a LoRA tensor featcal-llm supports")
            target = rest.replace(".base_layer.", ".").replace(".modules_to_save.", ".")
            if target not in names:
                raise FeatCalError(f"{what}: {weights}: tensor {key}" + (_tied_head(target, base_directory) or f" has no counterpart {target} in the base model {base_directory}"))
            layout.replacements[target] = key
    for module, roles in pairs.items():
        embedding = "EA" in roles or "EB" in roles
        a, b = (roles.get("EA"), roles.get("EB")) if embedding else (roles.get("A"), roles.get("B"))
        if a is None or b is None:
            raise FeatCalError(f"{what}: {weights}: {module} has only one of the LoRA matrices A and B")
        target = f"{module}.weight"
        if target not in names:
            tied = _tied_head(target, base_directory)
            raise FeatCalError(f"{what}: {weights}: LoRA on {module}" + (tied or f", which the base model {base_directory} does not have"))
        layout.deltas.setdefault(target, []).append(DeltaKeys(module, a, b, embedding))
    return layout


def _tied_head(target: str, base_directory: Path) -> str | None:
    """Why a base lacks `lm_head.weight` where its config ties the head (Gemma-2, Llama-3.2-1B): peft's modules_to_save
    or a LoRA on lm_head trains a head of its own, untying it, which the layers' shared embedding cannot hold."""
    if target != "lm_head.weight":
        return None
    try:
        tied = read_config_json(base_directory).get("tie_word_embeddings", True)  # no lm_head.weight and no key: tied, the default
    except ValueError:
        return None
    if not tied:
        return None
    return (f": the base model {base_directory} ties its LM head to its input embeddings (tie_word_embeddings) and "
            "stores no lm_head.weight; an adapter that trains lm_head unties it, which featcal-llm does not read (train "
            "embed_tokens, which the tie shares, instead)")


def _check_shapes(layout: AdapterLayout, shape: dict, base_shapes: dict, weights: Path, what: str) -> None:
    """B·A the shape of W, replacements the shape of what they replace."""
    for target, key in layout.replacements.items():
        if shape[key] != base_shapes[target]:
            raise FeatCalError(f"{what}: {weights}: {key} has shape {list(shape[key])}, the base model's {target} has {list(base_shapes[target])} (adapter trained on another base?)")
    for target, deltas in layout.deltas.items():
        expected = base_shapes[target]
        for delta in deltas:
            if not delta.a:
                product = shape[delta.b]
            else:
                a, b = shape[delta.a], shape[delta.b]
                if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
                    raise FeatCalError(f"{what}: {weights}: {delta.a} {list(a)} and {delta.b} {list(b)} do not multiply")
                product = (a[1], b[0]) if delta.transpose else (b[0], a[1])
            if product != expected:
                raise FeatCalError(f"{what}: {weights}: the LoRA update of {target} has shape {list(product)}, the base model's has {list(expected)} (adapter trained on another base?)")
