"""Whether a merged directory is the recipe's merge: its stored mergekit configuration against the recipe's, each
model reference standing for the model's files by content (io/merge.py's docstring says how a run uses it). Without
torch, so `validate` asks the same questions of a supplied merge as `run`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.io.mergekit_config import merge_config_dict
from featcal_llm.io.recipe import Recipe

MERGEKIT_CONFIG = "mergekit_config.yml"
MARKER = "featcal_merge.json"  # written by featcal-llm after a merge it made succeeded
# mergekit's merge methods that draw random numbers: dare_* (Bernoulli masks, mergekit/sparsify.py), della* (magnitude-ranked
# Bernoulli masks) and arcee_fusion (quantiles from a random sample of a tensor over 1M elements). Every other method
# gives the same weights under any seed. tests/test_evidence.py checks the list against mergekit's registry and sources.
RANDOM_METHODS = frozenset({"dare_ties", "dare_linear", "della", "della_linear", "arcee_fusion"})



def stored_configuration(merged: Path, schema: Any = None) -> dict | None:
    """The merge configuration a merged directory was made from (parsed and normalised); None when it does not say.

    `schema`: the class to parse it with (mergekit's MergeConfiguration, or the torch-free copy `validate` uses).
    Raises FeatCalError when `mergekit_config.yml` is there but is not a mergekit configuration.
    """
    if schema is None:
        from mergekit.config import MergeConfiguration as schema

    path = merged / MERGEKIT_CONFIG
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("not a mapping")
        raw.pop("featcal", None)  # featcal-llm stores the whole recipe
        return merge_config_dict(schema.model_validate(raw))
    except Exception as error:
        raise FeatCalError(f"{path}: not a mergekit configuration ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None


def differing_keys(ours: Any, theirs: Any, where: str = "") -> list[str]:
    """Dotted paths (with [i] for list items) at which two parsed configurations differ."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        keys = sorted(set(ours) | set(theirs))
        return [d for k in keys for d in differing_keys(ours.get(k), theirs.get(k), f"{where}.{k}" if where else str(k))]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in differing_keys(a, b, f"{where}[{i}]")]
    return [] if ours == theirs else [where or "(the whole configuration)"]


def merge_identity(merged: Path) -> dict | None:
    """What a run's fingerprint records of the merge: the parsed configuration it was made from (None: unknown)."""
    try:
        return stored_configuration(merged)
    except FeatCalError:
        return None


def _files(part: str) -> Any:
    """A local model or adapter directory's files by content."""
    from featcal_llm.io.identity import content_digest, weights_identity

    directory = Path(part)
    return weights_identity(directory) or [[f.name, content_digest(f)] for f in sorted(directory.glob("adapter_*")) if f.is_file()]


def local_files(reference: str) -> list | None:
    parts = str(reference).split("+")
    return [_files(part) for part in parts] if all(Path(part).is_dir() for part in parts) else None


def input_identities(recipe: Recipe, sources: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each model (or adapter) the merge reads → its files by content: a local directory's, and a hub reference's
    snapshot as `sources` resolved it (reference → ModelSource); a hub reference not among them is left out."""
    identities = {}
    for reference in [recipe.base, *(e.reference for e in recipe.experts)]:
        parts = str(reference).split("+") if reference else []
        source = (sources or {}).get(str(reference))
        resolved = [source.directory, source.adapter] if source is not None else []
        for index, part in enumerate(parts):
            if Path(part).is_dir():
                identities[part] = _files(part)
            elif index < len(resolved) and resolved[index] is not None:
                identities[part] = _files(str(resolved[index]))
    return identities


def _with_files(config: dict, identify) -> dict:
    """The configuration with each model reference replaced by what `identify` says of it (None: left as written)."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: _digest(identify(v)) or v if k in ("model", "base_model") and isinstance(v, str) else walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    return walk(config)


def _digest(files: Any) -> str | None:
    return None if files is None else "files " + hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def recipe_side(sources: dict[str, Any] | None):
    def identify(reference: str) -> Any:
        local = local_files(reference)
        if local is not None:
            return {"files": local}
        source = (sources or {}).get(reference)  # a hub reference, resolved to its snapshot
        if source is None:
            return None
        return {"files": [_files(str(source.directory)), *([_files(str(source.adapter))] if source.adapter is not None else [])]}

    return identify


def stored_side(merged: Path, current):
    """What each model reference of `merged`'s configuration was: the files featcal-llm recorded when it merged,
    else what `current` (the recipe side) says of it now (the files of a local directory, or of a hub snapshot)."""
    try:
        recorded = json.loads((merged / MARKER).read_text(encoding="utf-8")).get("inputs", {})
    except (OSError, ValueError, AttributeError):
        recorded = {}

    def identify(reference: str) -> Any:
        parts = reference.split("+")
        if all(part in recorded for part in parts):  # the files the merge was made from, as recorded then
            return {"files": [recorded[part] for part in parts]}
        return current(reference)

    return identify


def recorded_seed(merged: Path) -> int | None:
    """The random seed a merge featcal-llm made was drawn with (None: not made by featcal-llm, or before seeds were kept)."""
    try:
        return json.loads((merged / MARKER).read_text(encoding="utf-8")).get("random_seed")
    except (OSError, ValueError, AttributeError):
        return None


def merge_methods(config: Any) -> set[str]:
    """Every `merge_method` a parsed configuration names (the top level's, and any nested one's)."""
    if isinstance(config, dict):
        named = {config["merge_method"]} if isinstance(config.get("merge_method"), str) else set()
        return named.union(*(merge_methods(value) for value in config.values()))
    if isinstance(config, list):
        return set().union(*(merge_methods(item) for item in config))
    return set()


def seed_that_matters(recipe: Recipe) -> int | None:
    """The seed the merge's weights depend on: the merge seed for a random method (RANDOM_METHODS), else None."""
    return recipe.featcal.merge_seed if merge_methods(merge_config_dict(recipe.merge_config)) & RANDOM_METHODS else None


def differing_models(wanted: dict, stored: dict, merged: Path, sources: dict[str, Any] | None) -> list[str]:
    """The keys in which `merged`'s stored configuration differs from the recipe's, each model reference standing for
    its files by content."""
    current = recipe_side(sources)
    return differing_keys(_with_files(wanted, current), _with_files(stored, stored_side(merged, current)))


def _model_references(config: dict) -> list[str]:
    """Every model reference a parsed configuration names: those `_with_files` identifies, by its own walk."""
    found: list[str] = []
    _with_files(config, found.append)  # identifies nothing (None): only the references it meets are kept
    return found


def listed(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def supplied_refusal(recipe_path: Any, merged: Path, differing: list[str]) -> FeatCalError:
    return FeatCalError(f"{recipe_path}: featcal.merged: {merged} was merged from another configuration (its {MERGEKIT_CONFIG} differs "
                        f"in {listed(differing)}); remove it to merge again, or point featcal.merged elsewhere")


def supplied_merge(merged: Path) -> bool:
    """A merge directory featcal-llm did not make: run uses it as it is or refuses it, and never merges into it. One it
    made is merged again where its inputs changed, so the checks made before a merge still apply there."""
    return merged.exists() and not (merged / MARKER).is_file()


def check_supplied_merge(recipe_path: Any, merge_config: Any, merged: Path) -> None:
    """Refuse, in run's words, a merged directory featcal-llm did not make whose configuration is not the recipe's
    merge (run would stop there before any layer). Without torch, for `validate`: the recipe's own schema parses the
    stored file, and a configuration naming a model that is not a local directory is left to run, which resolves it."""
    if (merged / MARKER).is_file() or not (merged / MERGEKIT_CONFIG).is_file():
        return  # featcal-llm merges its own again; a merge without the file is used with a warning
    try:
        stored = stored_configuration(merged, type(merge_config))
    except FeatCalError as error:
        raise FeatCalError(f"{recipe_path}: featcal.merged: {error}") from None
    wanted = merge_config_dict(merge_config)
    if not differing_keys(wanted, stored):
        return  # the same references, so the same files: nothing to read
    if any(local_files(reference) is None for reference in _model_references(wanted) + _model_references(stored)):
        return
    differing = differing_models(wanted, stored, merged, None)
    if differing:
        raise supplied_refusal(recipe_path, merged, differing)
