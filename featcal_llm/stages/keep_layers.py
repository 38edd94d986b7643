"""`run --keep-layers`: keep a finished run's saved progress, so that trying other `refine:` settings refines again
from the closed form instead of calibrating every layer again.

A finished run removes its hidden `.OUTPUT.featcal-partial/`. Its fingerprint leaves out `refine:`'s keys (only
whether it runs enters), so a rerun into the same output finds the calibrated layers, the passes before them and,
where `top_k` and the precision are unchanged, the teachers, and runs only the refinement (docs/reuse.md).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from featcal_llm.errors import FeatCalError, warn
from featcal_llm.io.output_dir import partial_dir
from featcal_llm.io.recipe import Recipe


def kept_layers(recipe: Recipe) -> Recipe:
    """The recipe whose run keeps its saved progress; refused without `refine:`, where nothing a rerun may change reuses it."""
    if recipe.featcal.refine is None:
        raise FeatCalError(f"--keep-layers: {recipe.path}: featcal has no refine: block; the kept layers serve a rerun with "
                           "other refine: settings (turning refine: on changes the records the closed form fits, so it "
                           "calibrates the layers again)")
    featcal = recipe.featcal.model_copy()
    featcal._keeps_progress = True
    return replace(recipe, featcal=featcal)


def kept_folders(recipe: Recipe) -> list[Path]:
    """What the run kept: its saved progress, and for a stack the first stage's output and progress as well."""
    output = Path(recipe.featcal.output)
    folders = [partial_dir(output)]
    if recipe.featcal.stacked:
        from featcal_llm.engine.stack import intermediate_dir

        intermediate = intermediate_dir(output, recipe.featcal.method[0])
        folders += [intermediate, partial_dir(intermediate)]
    return [folder for folder in folders if folder.is_dir()]


def keep_for_rerun(recipe: Recipe) -> None:
    """Drop what no rerun with other `refine:` settings reads (the refinement's progress, best state and refined tensors:
    at 8B with the adapter, a model's size and 16 bytes a trained head parameter), then say, as a warning (it is disk
    the user must free, so `-q` shows it too), what was kept, its size, what reuses it and that it is theirs to remove."""
    from featcal_llm.engine.refine import REFINED_FOLDER
    from featcal_llm.engine.refine_progress import forget_progress
    from featcal_llm.engine.resume import StagingReader

    partial = partial_dir(Path(recipe.featcal.output))
    if partial.is_dir():
        forget_progress(StagingReader(partial, "", 0))
        shutil.rmtree(partial / REFINED_FOLDER, ignore_errors=True)
    folders = kept_folders(recipe)
    size = sum(path.stat().st_size for folder in folders for path in folder.rglob("*") if path.is_file())
    warn(f"kept {', '.join(str(folder) for folder in folders)} ({size / 2**30:.2f} GiB): rerunning this recipe into "
         f"{recipe.featcal.output} (with --force, or after moving it aside) with other refine: settings starts from its "
         "calibrated layers; a rerun without --keep-layers removes them, or remove them yourself")
