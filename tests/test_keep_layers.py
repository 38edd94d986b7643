"""`run --keep-layers` (stages/keep_layers.py) on its own: the refusal without `refine:`, the flag on a copy of the
block, and the warning that names every kept folder and their size (disk the user must free)."""

from __future__ import annotations

import pytest
import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.io.recipe import load_recipe
from featcal_llm.stages.keep_layers import kept_folders, kept_layers, say_kept


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    from scenario import build_scenario

    return build_scenario(tmp_path_factory.mktemp("keep") / "scenario", experts=2, layers=1, samples=8)


def _recipe(scenario, path, **featcal):
    raw = yaml.safe_load(scenario.recipe.read_text())
    raw["featcal"].update(featcal)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_recipe(path)


def test_kept_layers_refuses_a_recipe_without_refine_and_flags_a_copy(scenario, tmp_path):
    """The refusal is kept_layers' own too (a Recipe object skips validate's check); the recipe it was given is left as
    it was, so a caller that runs it again without the flag does not keep progress by accident."""
    bare = _recipe(scenario, tmp_path / "bare.yaml", output=str(tmp_path / "out"))
    with pytest.raises(FeatCalError) as error:
        kept_layers(bare)
    assert str(error.value).startswith(f"{tmp_path / 'bare.yaml'}: --keep-layers (keep_layers=True): featcal has no refine: block;")
    refined = _recipe(scenario, tmp_path / "refined.yaml", output=str(tmp_path / "out"), refine={"steps": 1, "eval_every": 1})
    kept = kept_layers(refined)
    assert kept.featcal._keeps_progress and not refined.featcal._keeps_progress


def test_say_kept_names_a_stacks_three_folders_and_their_size_in_gib(scenario, tmp_path, capsys):
    """A stack keeps its saved progress, stage 1's output and that output's progress; the size is in GiB (2**30 bytes):
    sparse files (1.5 GiB and 3 × 0.25 GiB) cost no disk here. A folder the run did not leave is not named."""
    output = tmp_path / "stack"
    stack = _recipe(scenario, tmp_path / "stack.yaml", output=str(output), method=["regmean++", "featcal"],
                    refine={"steps": 1, "eval_every": 1})
    assert kept_folders(stack) == []
    folders = [tmp_path / ".stack.featcal-partial", tmp_path / ".stack.regmean++", tmp_path / "..stack.regmean++.featcal-partial"]
    for folder in folders:
        (folder / "inner").mkdir(parents=True)
        with open(folder / "inner" / "sparse", "wb") as sparse:
            sparse.truncate(2**28)  # 0.25 GiB each
    with open(folders[0] / "sparse", "wb") as sparse:
        sparse.truncate(3 * 2**29)
    assert kept_folders(stack) == folders
    say_kept(stack)
    err = capsys.readouterr().err
    assert f"kept {folders[0]}, {folders[1]}, {folders[2]} (2.25 GiB): rerunning this recipe into {output}" in err
