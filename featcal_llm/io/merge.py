"""Run the recipe's merge through mergekit when the merged model does not exist yet."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError
from featcal_llm.io.recipe import Recipe


def _spell_out_adapters(merge_config: Any, sources: dict[str, Any] | None) -> Any:
    """A copy of the configuration in which plain PEFT adapter directories read `base+adapter`, mergekit's spelling.

    mergekit cannot load an adapter directory as a model; featcal-llm applies such an
    adapter to the recipe's base model, so the merge must see the same expert.
    """
    from mergekit.config import MergeConfiguration

    plain = {
        name: f"{source.directory}+{source.adapter}"
        for name, source in (sources or {}).items()
        if source.adapter is not None and "+" not in source.reference
    }
    if not plain:
        return merge_config.model_copy(deep=True)  # run_merge rewrites the configuration it is given

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (plain.get(v, v) if k == "model" and isinstance(v, str) else rewrite(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        return node

    return MergeConfiguration.model_validate(rewrite(merge_config.model_dump(mode="json", exclude_none=True)))


def ensure_merged(recipe: Recipe, merged: Path, device: str, sources: dict[str, Any] | None = None, trust_remote_code: bool = False) -> Path:
    """The merged model directory, created by mergekit (into a temporary sibling, then renamed) if absent.

    `sources` (expert name → ModelSource) lets plain adapter directories be merged
    as `base+adapter`; mergekit merges LoRA experts into a scratch cache beside the
    output, removed afterwards.
    """
    if merged.exists():
        return merged
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    partial = merged.with_name(merged.name + ".merging")
    lora_cache = merged.with_name(f".{merged.name}.lora-cache")
    shutil.rmtree(partial, ignore_errors=True)
    options = MergeOptions(
        cuda=device.startswith("cuda"),
        copy_tokenizer=True,
        lazy_unpickle=False,
        write_model_card=False,  # mergekit's card looks models up on the hub, which fails offline
        quiet=True,
        trust_remote_code=trust_remote_code,
        lora_merge_cache=str(lora_cache),
    )
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # mergekit's tokenizer permutations draw a progress bar even when quiet
            run_merge(_spell_out_adapters(recipe.merge_config, sources), str(partial), options=options, config_source=recipe.text)
    except FeatCalError:
        raise
    except Exception as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise FeatCalError(f"{recipe.path}: mergekit failed to merge the recipe: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from error  # the CLI shows mergekit's full error
    finally:
        shutil.rmtree(lora_cache, ignore_errors=True)
    (partial / "mergekit_config.yml").write_text(recipe.text, encoding="utf-8")
    partial.rename(merged)
    return merged
