"""Which mergekit recipe forms FeatCal can calibrate, checked before any work.

FeatCal needs one base model, experts fine-tuned from it, and a merge whose
decoder layer l was made from layer l of every expert. Anything mergekit accepts
that breaks this (a frankenmerge, an interpolation whose `base_model` is one of
two endpoints, a multi-module recipe) is refused here in one line, naming the
method or the slice, instead of calibrating toward the wrong features.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError

# mergekit 0.1.5's registry → (FeatCal applies, why). docs/methods.md's table is this one.
MERGE_METHODS: dict[str, tuple[bool, str]] = {
    "task_arithmetic": (True, "base + weighted task vectors"),
    "ties": (True, "task vectors, trimmed and sign-elected"),
    "dare_linear": (True, "task vectors, randomly dropped and rescaled"),
    "dare_ties": (True, "DARE drop + TIES sign election"),
    "della": (True, "task vectors, magnitude-ranked drop + sign election"),
    "della_linear": (True, "task vectors, magnitude-ranked drop"),
    "breadcrumbs": (True, "task vectors without the largest and smallest changes"),
    "breadcrumbs_ties": (True, "breadcrumbs + sign election"),
    "sce": (True, "task vectors selected, weighted by variance, sign-elected"),
    "model_stock": (True, "experts averaged, pulled toward the base by their angle"),
    "ram": (True, "task vectors, overlap-rescaled (RL agents)"),
    "ramplus_tl": (True, "RAM+ with layer-wise rescaling"),
    "arcee_fusion": (True, "one expert's salient changes fused into the base"),
    "nuslerp": (True, "with base_model: SLERP of the two experts' task vectors"),
    "multislerp": (True, "with base_model: hyperspherical average of the task vectors"),
    "linear": (True, "weighted average of the experts; the recipe's base_model is FeatCal's anchor"),
    "karcher": (True, "Riemannian mean of the experts, with the base_model in too (mergekit adds it, an equal share); the recipe's base_model is FeatCal's anchor"),
    "slerp": (False, "base_model is one end of a two-model interpolation, not a common base: FeatCal would calibrate toward the other model only; use nuslerp with the common base as base_model"),
    "nearswap": (False, "base_model is one end of a two-model interpolation, not a common base: FeatCal would calibrate toward the other model only; use nuslerp or task_arithmetic with the common base"),
    "passthrough": (False, "copies layers without merging (frankenmerges): there is no merge for FeatCal to calibrate"),
}


def check_merge_method(merge_config: Any, path: Path) -> None:
    method = merge_config.merge_method
    if method not in MERGE_METHODS:
        raise FeatCalError(f"{path}: merge_method: {method} is not in featcal-llm's table of mergekit methods (known: {', '.join(MERGE_METHODS)})")
    applies, why = MERGE_METHODS[method]
    if not applies:
        raise FeatCalError(f"{path}: merge_method: {method} is not supported: {why}")


def check_forms(merge_config: Any, path: Path) -> None:
    """Everything about the recipe's shape that can be refused without reading a model."""
    if merge_config.modules:
        raise FeatCalError(f"{path}: modules: multi-module recipes are not supported (write the merge with models: or slices:)")
    check_merge_method(merge_config, path)
    if merge_config.slices:
        check_slices(merge_config, path)


def _same_reference(a: Any, b: Any) -> bool:
    return str(a) == str(b)


def check_slices(merge_config: Any, path: Path) -> None:
    """Slices calibrate only when output layer l is layer l of every source: aligned, identical, contiguous from 0."""
    expected_start, models = 0, None
    for index, output_slice in enumerate(merge_config.slices):
        where = f"{path}: slices[{index}]"
        if not output_slice.sources:  # mergekit-yaml stops on an IndexError
            raise FeatCalError(f"{where}: sources: empty (list the base model and every expert, each with its layer_range)")
        if output_slice.base_model is not None and merge_config.base_model is None:
            raise FeatCalError(f"{where}: base_model: given in this slice only; FeatCal needs the base model at the top level "
                               "(write it as the recipe's base_model:)")
        if output_slice.base_model is not None and not _same_reference(output_slice.base_model, merge_config.base_model):
            raise FeatCalError(f"{where}: base_model {output_slice.base_model} differs from the recipe's {merge_config.base_model} (FeatCal needs one base)")
        ranges = {tuple(source.layer_range) for source in output_slice.sources}
        if len(ranges) != 1:
            described = ", ".join(f"{source.model} {list(source.layer_range)}" for source in output_slice.sources)
            raise FeatCalError(f"{where}: sources take different layer ranges ({described}); FeatCal needs output layer l to be layer l of every source")
        start, end = ranges.pop()
        if start != expected_start or end <= start:
            raise FeatCalError(
                f"{where}: layer_range [{start}, {end}] does not continue the previous slices at layer {expected_start} "
                "(repeated, reordered or dropped layers: a passthrough/frankenmerge FeatCal cannot calibrate)"
            )
        names = sorted(str(source.model) for source in output_slice.sources)
        if models is not None and names != models:
            raise FeatCalError(f"{where}: merges {', '.join(names)}, the previous slices {', '.join(models)}; FeatCal needs every layer merged from the same models")
        models, expected_start = names, end


def check_slice_depth(merge_config: Any, num_layers: int, path: Path) -> None:
    """The slices end at the base's last layer (checked once the base config is read)."""
    if merge_config.slices:
        end = merge_config.slices[-1].sources[0].layer_range[1]
        if end != num_layers:
            raise FeatCalError(f"{path}: slices[{len(merge_config.slices) - 1}]: the slices end at layer {end}, the base model has {num_layers} (dropped layers cannot be calibrated)")


def merge_makes_tokenizer(merge_config: Any) -> bool:
    """Whether the merge's tokenizer may differ from the base's in anything the records' tokens depend on: its
    vocabulary (changes_tokenizer) or a chat template the recipe's `chat_template:` gives it. The records are then
    tokenised with the merge's own, made first: the calibrated model serves that template."""
    return changes_tokenizer(merge_config) or bool(getattr(merge_config, "chat_template", None))


def changes_tokenizer(merge_config: Any) -> bool:
    """Whether mergekit's output tokenizer may differ from the base's (tokenizer_source other than base, or a tokenizer: block)."""
    source = merge_config.tokenizer_source
    return merge_config.tokenizer is not None or (source is not None and source != "base")
