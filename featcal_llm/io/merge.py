"""Run the recipe's merge through mergekit when the merged model does not exist yet."""

from __future__ import annotations

import shutil
from pathlib import Path

from featcal_llm.errors import FeatCalError
from featcal_llm.io.recipe import Recipe


def ensure_merged(recipe: Recipe, merged: Path, device: str) -> Path:
    """The merged model directory, created by mergekit (into a temporary sibling, then renamed) if absent."""
    if merged.exists():
        return merged
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    partial = merged.with_name(merged.name + ".merging")
    shutil.rmtree(partial, ignore_errors=True)
    options = MergeOptions(
        cuda=device.startswith("cuda"),
        copy_tokenizer=True,
        lazy_unpickle=False,
        write_model_card=False,  # mergekit's card looks models up on the hub, which fails offline
        quiet=True,
        trust_remote_code=False,
    )
    try:
        # run_merge rewrites the configuration it is given, so hand it a copy.
        run_merge(recipe.merge_config.model_copy(deep=True), str(partial), options=options, config_source=recipe.text)
    except FeatCalError:
        raise
    except Exception as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise FeatCalError(f"{recipe.path}: mergekit failed to merge the recipe: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    (partial / "mergekit_config.yml").write_text(recipe.text, encoding="utf-8")
    partial.rename(merged)
    return merged
