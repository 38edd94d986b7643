"""`run --keep-layers`: keep a finished run's saved progress, so that trying other `refine:` settings refines again
from the closed form instead of calibrating every layer again.

A finished run removes its hidden `.OUTPUT.featcal-partial/`. Its fingerprint leaves out `refine:`'s keys (only
whether it runs enters), so a rerun into the same output finds the calibrated layers, the passes before them and,
where `top_k` and the precision are unchanged, the teachers, and runs only the refinement (docs/reuse.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from featcal_llm.errors import FeatCalError, warn
from featcal_llm.io.output_dir import partial_dir
from featcal_llm.io.recipe import Recipe
from featcal_llm.io.validate import KEEP_LAYERS, NO_REFINE


def kept_layers(recipe: Recipe) -> Recipe:
    """The recipe whose run keeps its saved progress; refused without `refine:`, where nothing a rerun may change reuses
    it (validate's check, io/validate.check_run_flags, says so first)."""
    if recipe.featcal.refine is None:
        raise FeatCalError(f"{recipe.path}: {KEEP_LAYERS}: {NO_REFINE}")
    featcal = recipe.featcal.model_copy()
    featcal._keeps_progress = True
    return replace(recipe, featcal=featcal)


def kept_folders(recipe: Recipe) -> list[Path]:
    """What the run kept: its saved progress, and for a stack the first stage's output and progress as well."""
    output = Path(recipe.featcal.output)
    folders = [partial_dir(output)]
    if recipe.featcal.stacked:
        from featcal_llm.io.output_dir import intermediate_dir

        intermediate = intermediate_dir(output, recipe.featcal.method[0])
        folders += [intermediate, partial_dir(intermediate)]
    return [folder for folder in folders if folder.is_dir()]


def say_kept(recipe: Recipe) -> None:
    """A warning (it is disk the user must free, so `-q` shows it too): what was kept, its size, what reuses it and that it
    is theirs to remove. The refinement's own progress was dropped as the output was written (stages/outputs.py)."""
    folders = kept_folders(recipe)
    size = sum(path.stat().st_size for folder in folders for path in folder.rglob("*") if path.is_file())
    warn(f"kept {', '.join(str(folder) for folder in folders)} ({size / 2**30:.2f} GiB): rerunning this recipe into "
         f"{recipe.featcal.output} (with --force, or after moving it aside) with other refine: settings starts from its "
         "calibrated layers; a rerun without --keep-layers removes them, or remove them yourself")
