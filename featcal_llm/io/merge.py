"""Run the recipe's merge through mergekit, or reuse a merged model only when it was made from the recipe's merge.

mergekit writes the configuration it merged into its output (`mergekit_config.yml`);
an existing merged directory is reused only when that configuration, parsed, equals
the recipe's, with each model reference standing for the model's files by content
(so a moved expert, or a hub reference to the same files, is the same model; a hub
reference stands for the files of the snapshot it resolves to; a merge featcal-llm made
records its models' files in `featcal_merge.json`, so an expert whose files changed
since, or a newer snapshot, is a different model). When they differ, a merge featcal-llm made
is merged again, and a directory the user supplied is refused with the differing keys
named (`validate` says the same for local models: `merge_identity.check_supplied_merge`). A directory
without `mergekit_config.yml` cannot be checked: it is used, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shutil
from pathlib import Path
from typing import Any

from featcal_llm.io.mergekit_config import merge_config_dict
from featcal_llm import runlog
from featcal_llm.errors import QUIET, FeatCalError, RunFailure, warn
from featcal_llm.io.names import parse_parameter_count
from featcal_llm.io.recipe import Recipe
from featcal_llm.io.merge_identity import (MARKER, MERGEKIT_CONFIG, differing_models, input_identities, listed,
                                          recorded_seed, seed_that_matters, stored_configuration, supplied_refusal)

STAGING_MARKER = "featcal_merging"  # written into the staging folder before mergekit writes there: the folder is ours
_settled: dict[str, Any] = {}  # merged directory → the configuration and seed it was found (or made) to match, in this process


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
    elif differing := differing_models(wanted, stored, merged, sources):
        return differing
    elif seed is not None and recorded_seed(merged) not in (None, seed):  # a random merge drawn with another seed
        return ["featcal.merge_options.random_seed"]
    else:
        _say(f"reusing {merged} (its {MERGEKIT_CONFIG} is the recipe's merge)")
    _settled[str(merged.resolve())] = (wanted, seed)
    return None


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
                raise supplied_refusal(recipe.path, merged, differing)
            _say(f"{merged} was made from other inputs than the recipe's (differs in {listed(differing)}); merging again")
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


def _keep_generation_config(recipe: Recipe, partial: Path, sources: dict[str, Any] | None) -> None:
    """mergekit copies its donor's generation_config.json (the base model, else the first model) only where it copies
    the tokenizer's files as they are: a recipe with `tokenizer_source` or `chat_template`, which has it build the
    tokenizer, lost the sampling defaults and the extra stop ids (Llama-3's `<|eot_id|>`) that runtimes read there."""
    from featcal_llm.io.model_files import lend_generation_config

    donor = recipe.merge_config.base_model or recipe.merge_config.referenced_models()[0]
    source = (sources or {}).get(str(donor))
    lend_generation_config(source.directory if source is not None else Path(str(donor.model.path)), partial)


WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)  # a write that fails names no file where Python's own does
HUB_MODULES = ("huggingface_hub", "httpx", "httpcore", "requests", "urllib3")  # where a download's errors come from


def _failed_to_write(error: OSError, staging: tuple[Path, ...]) -> bool:
    """Whether the merge failed writing its own files (the disk, the folder): not reading an input, nor fetching one
    from the hub (huggingface_hub's errors are OSErrors too)."""
    if type(error).__module__.startswith(HUB_MODULES):
        return False
    named = [Path(name) for name in (error.filename, error.filename2) if isinstance(name, (str, Path))]
    if not named:
        return error.errno in WRITE_ERRORS
    return any(path.absolute().is_relative_to(folder.absolute()) for path in named for folder in staging)


def _merge_failure(recipe: Recipe, error: Exception) -> str:
    """The one line for mergekit's failure: its first line, naming the hub where a download failed."""
    first = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    if type(error).__module__.startswith(HUB_MODULES):
        return (f"{recipe.path}: mergekit could not download an input from the Hugging Face hub during the merge "
                f"({first}); check the connection and the model ids, then run again")
    return f"{recipe.path}: mergekit failed to merge the recipe: {first}"


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
    shutil.rmtree(lora_cache, ignore_errors=True)  # a killed merge's: mergekit takes any folder there as the merged expert
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
        _keep_generation_config(recipe, partial, sources)
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
        if not _failed_to_write(error, (partial, lora_cache)):
            raise RunFailure(_merge_failure(recipe, error)) from error
        raise RunFailure(f"{recipe.path}: featcal.merged: {merged}: cannot write the merge ({error.strerror or error})") from None
    except Exception as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise RunFailure(_merge_failure(recipe, error)) from error  # the CLI shows mergekit's full error
    finally:
        shutil.rmtree(lora_cache, ignore_errors=True)
    from featcal_llm.io.checkpoint import move_into_place  # torch: `validate` imports this module without it

    move_into_place(partial, merged, "stale")  # a stale merge featcal-llm made is swapped out, then removed
