"""Run the recipe's merge through mergekit, or reuse a merged model only when it was made from the recipe's merge.

mergekit writes the configuration it merged into its output (`mergekit_config.yml`);
an existing merged directory is reused only when that configuration, parsed, equals
the recipe's, with each model reference standing for the model's files by content
(so a moved expert, or a hub reference to the same files, is the same model; a hub
reference stands for the files of the snapshot it resolves to; a merge featcal-llm made
records its models' files in `featcal_merge.json`, so an expert whose files changed
since, or a newer snapshot, is a different model). When they differ, a merge featcal-llm made
is merged again, and a directory the user supplied is refused with the differing keys
named (`validate` says the same for local models: `check_supplied_merge`). A directory
without `mergekit_config.yml` cannot be checked: it is used, with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from featcal_llm.io.mergekit_config import merge_config_dict
from featcal_llm import runlog
from featcal_llm.errors import QUIET, FeatCalError, RunFailure, warn
from featcal_llm.io.names import parse_parameter_count
from featcal_llm.io.recipe import Recipe

MERGEKIT_CONFIG = "mergekit_config.yml"
MARKER = "featcal_merge.json"  # written by featcal-llm after a merge it made succeeded
STAGING_MARKER = "featcal_merging"  # written into the staging folder before mergekit writes there: the folder is ours
_settled: dict[str, Any] = {}  # merged directory → the configuration and seed it was found (or made) to match, in this process
# mergekit's merge methods that draw random numbers: dare_* (Bernoulli masks, mergekit/sparsify.py), della* (magnitude-ranked
# Bernoulli masks) and arcee_fusion (quantiles from a random sample of a tensor over 1M elements). Every other method
# gives the same weights under any seed. tests/test_evidence.py checks the list against mergekit's registry and sources.
RANDOM_METHODS = frozenset({"dare_ties", "dare_linear", "della", "della_linear", "arcee_fusion"})


def spell_out_adapters(merge_config: Any, sources: dict[str, Any] | None) -> Any:
    """A copy of the configuration in which plain PEFT adapter directories read `base+adapter`, mergekit's spelling.

    mergekit cannot load an adapter directory as a model; featcal-llm applies such an
    adapter to the recipe's base model, so the merge must see the same expert. Always mergekit's own models
    (validate's copy of its schema, io/mergekit_config.py, is read back through mergekit).
    """
    from mergekit.config import MergeConfiguration

    plain = {
        name: f"{source.directory}+{source.adapter}"
        for name, source in (sources or {}).items()
        if source.adapter is not None and "+" not in source.reference
    }
    if not plain and isinstance(merge_config, MergeConfiguration):
        return merge_config.model_copy(deep=True)  # run_merge rewrites the configuration it is given

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (plain.get(v, v) if k == "model" and isinstance(v, str) else rewrite(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        return node

    return MergeConfiguration.model_validate(rewrite(merge_config_dict(merge_config)))


def _say(message: str) -> None:
    """A line of the run's own (time-stamped in a --log file, as every other line)."""
    if not QUIET["warnings"]:
        runlog.stage(f"merge: {message}")


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


def _local_files(reference: str) -> list | None:
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


def _recipe_side(sources: dict[str, Any] | None):
    def identify(reference: str) -> Any:
        local = _local_files(reference)
        if local is not None:
            return {"files": local}
        source = (sources or {}).get(reference)  # a hub reference, resolved to its snapshot
        if source is None:
            return None
        return {"files": [_files(str(source.directory)), *([_files(str(source.adapter))] if source.adapter is not None else [])]}

    return identify


def _stored_side(merged: Path, current):
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


def _recorded_seed(merged: Path) -> int | None:
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


def _stale(recipe: Recipe, merged: Path, sources: dict[str, Any] | None) -> list[str] | None:
    """None when `merged` may be used as it is; else the keys in which its configuration differs from the recipe's.

    The seed is compared only for a random merge method: a deterministic merge under another seed is the same merge."""
    wanted, seed = merge_config_dict(recipe.merge_config), seed_that_matters(recipe)
    if _settled.get(str(merged.resolve())) == (wanted, seed):
        return None
    try:
        stored = stored_configuration(merged)
    except FeatCalError as error:
        if not (merged / MARKER).is_file():
            raise FeatCalError(f"{recipe.path}: featcal.merged: {error}") from None
        return [MERGEKIT_CONFIG]
    if stored is None:
        warn(f"featcal.merged: {merged} has no {MERGEKIT_CONFIG}, so whether it was merged from this recipe cannot be checked; using it as it is")
    elif differing := _differing_models(wanted, stored, merged, sources):
        return differing
    elif seed is not None and _recorded_seed(merged) not in (None, seed):  # a random merge drawn with another seed
        return ["featcal.merge_options.random_seed"]
    else:
        _say(f"reusing {merged} (its {MERGEKIT_CONFIG} is the recipe's merge)")
    _settled[str(merged.resolve())] = (wanted, seed)
    return None


def _differing_models(wanted: dict, stored: dict, merged: Path, sources: dict[str, Any] | None) -> list[str]:
    """The keys in which `merged`'s stored configuration differs from the recipe's, each model reference standing for
    its files by content."""
    current = _recipe_side(sources)
    return differing_keys(_with_files(wanted, current), _with_files(stored, _stored_side(merged, current)))


def _model_references(config: dict) -> list[str]:
    """Every model reference a parsed configuration names: those `_with_files` identifies, by its own walk."""
    found: list[str] = []
    _with_files(config, found.append)  # identifies nothing (None): only the references it meets are kept
    return found


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _supplied_refusal(recipe_path: Any, merged: Path, differing: list[str]) -> FeatCalError:
    return FeatCalError(f"{recipe_path}: featcal.merged: {merged} was merged from another configuration (its {MERGEKIT_CONFIG} differs "
                        f"in {_listed(differing)}); remove it to merge again, or point featcal.merged elsewhere")


def staging_folder(merged: Path) -> Path:
    """Where mergekit writes the merge before it is moved into place (a stopped merge leaves no half-merged `merged`)."""
    return merged.with_name(merged.name + ".merging")


def staging_in_the_way(merged: Path) -> str | None:
    """Why the merge cannot be staged beside `merged`: a file, a link or a folder of things no merge of featcal-llm left
    there is in the way (the folder is emptied before a merge: a user's folder would be deleted without a word)."""
    partial = staging_folder(merged)
    if partial.is_symlink() or (partial.exists() and not partial.is_dir()):
        return f"{partial} is in the way: the merge is staged in a folder of that name; move it"
    if partial.is_dir() and not (partial / STAGING_MARKER).is_file() and any(partial.iterdir()):
        return (f"{partial} holds files that no merge of featcal-llm left there, and the merge is staged in a folder of "
                "that name, emptied first; move it")
    return None


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
    if any(_local_files(reference) is None for reference in _model_references(wanted) + _model_references(stored)):
        return
    differing = _differing_models(wanted, stored, merged, None)
    if differing:
        raise _supplied_refusal(recipe_path, merged, differing)


def ensure_merged(recipe: Recipe, merged: Path, device: str, sources: dict[str, Any] | None = None, trust_remote_code: bool = False) -> Path:
    """The merged model directory, made by mergekit (into a temporary sibling, then renamed) unless it is there already.

    An existing directory is checked against the recipe (see the module's docstring).
    `sources` (each model's reference → ModelSource: the experts', and the base's) lets
    plain adapter directories be merged as `base+adapter`, and identifies a hub model
    by the files of its snapshot; mergekit merges LoRA experts into a scratch cache
    beside the output, removed afterwards.
    """
    lock = _merge_lock(recipe, merged)
    try:
        if merged.exists():
            differing = _stale(recipe, merged, sources)
            if differing is None:
                return merged
            if not (merged / MARKER).is_file():
                raise _supplied_refusal(recipe.path, merged, differing)
            _say(f"{merged} was made from other inputs than the recipe's (differs in {_listed(differing)}); merging again")
        _merge(recipe, merged, device, sources, trust_remote_code)
        _settled[str(merged.resolve())] = (merge_config_dict(recipe.merge_config), seed_that_matters(recipe))
        return merged
    finally:
        if lock is not None:
            lock.release()


def _merge_lock(recipe: Recipe, merged: Path) -> Any:
    """The merge directory's lock (io/output_lock.py), waited for while another run checks or writes it: two runs
    merging into one directory at once would write into one `.merging` folder. None where a supplied merge's folder
    cannot hold the lock file (read-only): nothing is written there then, unless a stale merge of ours is re-made,
    which fails on its own."""
    from featcal_llm.io.output_lock import OutputLock

    def waiting(holder: str) -> None:
        _say(f"waiting for another featcal-llm run (pid {holder}), which holds {merged}")

    try:
        return OutputLock.acquire(merged, f"{recipe.path}: featcal.merged", waiting=waiting)
    except OSError as error:
        if merged.is_dir():
            return None
        raise RunFailure(f"{recipe.path}: featcal.merged: {merged}: cannot lock it for the merge ({error.strerror or error})") from None


def _check_tokenizer_written(recipe: Recipe, partial: Path, sources: dict[str, Any] | None) -> None:
    """mergekit logs a failure to copy or build the tokenizer ("the merge was still successful") and writes the merge
    without one: refused here, where the base had one, instead of a checkpoint no runtime can serve."""
    from featcal_llm.io.model_files import has_tokenizer_files

    base = (sources or {}).get(str(recipe.merge_config.base_model))
    base_dir = base.tokenizer_directory if base is not None else Path(str(recipe.merge_config.base_model.model.path))
    if base_dir.is_dir() and has_tokenizer_files(base_dir) and not has_tokenizer_files(partial):
        raise FeatCalError(f"{recipe.path}: mergekit wrote the merge without a tokenizer (it could not copy or build it; "
                           "check tokenizer_source, tokenizer and chat_template)")


def _merge(recipe: Recipe, merged: Path, device: str, sources: dict[str, Any] | None, trust_remote_code: bool) -> None:
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from featcal_llm import __version__

    partial = staging_folder(merged)
    lora_cache = merged.with_name(f".{merged.name}.lora-cache")
    in_the_way = staging_in_the_way(merged)  # validate refuses it first; a caller that skipped it still loses nothing
    if in_the_way is not None:
        raise FeatCalError(f"{recipe.path}: featcal.merged: {in_the_way}")
    shutil.rmtree(partial, ignore_errors=True)
    settings = recipe.featcal.merge_options
    options = MergeOptions(
        cuda=device.startswith("cuda"),
        copy_tokenizer=True,
        random_seed=recipe.featcal.merge_seed,  # dare/della draw their masks from it: a re-merge gives the same weights
        out_shard_size=parse_parameter_count(settings.out_shard_size),
        lazy_unpickle=settings.lazy_unpickle,
        write_model_card=False,  # mergekit's card looks models up on the hub, which fails offline
        quiet=True,
        trust_remote_code=trust_remote_code,
        lora_merge_cache=str(lora_cache),
    )
    try:
        partial.mkdir(parents=True)
        (partial / STAGING_MARKER).write_text("a merge featcal-llm stages here; removed once it is in place\n")
        with contextlib.redirect_stderr(io.StringIO()):  # mergekit's tokenizer permutations draw a progress bar even when quiet
            run_merge(spell_out_adapters(recipe.merge_config, sources), str(partial), options=options, config_source=recipe.text)
        _check_tokenizer_written(recipe, partial, sources)
        (partial / MERGEKIT_CONFIG).write_text(recipe.text, encoding="utf-8")
        marker = {"made_by": "featcal-llm", "version": __version__, "recipe": str(recipe.path), "inputs": input_identities(recipe, sources),
                  "random_seed": recipe.featcal.merge_seed}
        (partial / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        (partial / STAGING_MARKER).unlink()
    except FeatCalError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise RunFailure(f"{recipe.path}: featcal.merged: {merged}: cannot write the merge ({error.strerror or error})") from None
    except Exception as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise RunFailure(f"{recipe.path}: mergekit failed to merge the recipe: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from error  # the CLI shows mergekit's full error
    finally:
        shutil.rmtree(lora_cache, ignore_errors=True)
    from featcal_llm.io.checkpoint import move_into_place  # torch: `validate` imports this module without it

    move_into_place(partial, merged, "stale")  # a stale merge featcal-llm made is swapped out, then removed
