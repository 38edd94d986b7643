"""The run's lifecycle as a user stumbles into it: progress and outputs beside one another, and files rewritten under
the digests the saved progress is keyed by."""

from __future__ import annotations

import os

import pytest

import featcal_llm
from featcal_llm.errors import FeatCalError
from featcal_llm.pipeline import run_recipe
from scenario import build_scenario


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build_scenario(tmp_path_factory.mktemp("lifecycle"), experts=2, layers=1, samples=4)


def test_a_file_rewritten_in_place_at_its_size_and_mtime_is_read_again(tmp_path, monkeypatch):
    from featcal_llm.io import identity

    monkeypatch.setenv(identity.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(identity, "_memory", {})
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"a" * 64)
    before = os.stat(path)
    first = identity.content_digest(path)
    with open(path, "r+b") as handle:  # the same inode and size
        handle.write(b"b" * 64)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_ino == before.st_ino
    monkeypatch.setattr(identity, "_memory", {})  # a later run: only the on-disk cache remembers
    assert identity.content_digest(path) != first


@pytest.mark.parametrize("where", [".out.featcal-partial", ".out.featcal-partial/inner", ".out.featcal-old/inner"])
def test_an_output_in_another_outputs_progress_folder_is_refused(small, tmp_path, where):
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    output = tmp_path / where
    problems = [str(problem) for problem in featcal_llm.validate(recipe, output=output)]
    assert any("OUTPUT" in problem and "featcal-" in problem for problem in problems), problems
    with pytest.raises(FeatCalError, match="OUTPUT"):
        run_recipe(recipe, progress=False, output=output)


def test_a_merge_in_the_outputs_progress_folder_is_refused_before_any_work(small, tmp_path):
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"),
                                merged=str(tmp_path / ".out.featcal-partial" / "merged"))
    problems = [str(problem) for problem in featcal_llm.validate(recipe)]
    assert any("featcal.merged" in problem and ".out.featcal-partial" in problem for problem in problems), problems
    with pytest.raises(FeatCalError, match="featcal.merged"):
        run_recipe(recipe, progress=False)
    assert not (tmp_path / ".out.featcal-partial").exists()


def test_an_output_given_as_a_link_can_be_replaced_again_and_again(small, tmp_path):
    earlier = tmp_path / "earlier"
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(earlier))
    run_recipe(recipe, progress=False)
    (tmp_path / "out").symlink_to(earlier, target_is_directory=True)
    for _ in range(2):
        run_recipe(recipe, progress=False, force=True, output=tmp_path / "out")
        assert (tmp_path / "out" / "featcal_recipe.yml").is_file()
        assert not os.path.lexists(tmp_path / ".out.featcal-old")
    assert (earlier / "featcal_recipe.yml").is_file()  # the link's folder is swapped out, not deleted


def _generating_recipe(small, tmp_path, reads_the_set_as: str):
    """expert0 writes its own records; the set's file, where the run writes it, is also read (`reads_the_set_as`:
    expert1's calibration file, or expert0's own prompts)."""
    import shutil

    import yaml

    from featcal_llm.generation.store import generated_set_paths

    output = tmp_path / "out"
    experts = [str(path) for path in small.experts.values()]
    samples_path = generated_set_paths(output, experts)[experts[0]][0]
    samples_path.parent.mkdir()
    shutil.copy(small.data["expert1"], samples_path)
    if reads_the_set_as == "prompts":
        samples_path.write_text("".join(f'{{"prompt": "the merge {i}"}}\n' for i in range(2)))
    recipe = yaml.safe_load(small.recipe.read_text())
    generate = {"samples": 2, "max_new_tokens": 4, "chat_template": "off"}
    if reads_the_set_as == "prompts":
        generate = {"samples": 2, "max_new_tokens": 4, "prompts": str(samples_path)}
    recipe["featcal"]["data"][experts[0]] = {"generate": generate}
    if reads_the_set_as == "data":
        recipe["featcal"]["data"][experts[1]] = {"path": str(samples_path), "format": "text"}
    recipe["featcal"]["output"] = str(output)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return tmp_path / "r.yaml", samples_path


@pytest.mark.parametrize("reads_the_set_as", ["data", "prompts"])
def test_a_file_the_run_reads_where_a_generated_set_goes_is_refused_and_kept(small, tmp_path, reads_the_set_as):
    recipe, samples_path = _generating_recipe(small, tmp_path, reads_the_set_as)
    before = samples_path.read_bytes()
    problems = [str(problem) for problem in featcal_llm.validate(recipe)]
    assert any(str(samples_path) in problem and "generate" in problem for problem in problems), problems
    with pytest.raises(FeatCalError, match="generate"):
        run_recipe(recipe, progress=False)
    assert samples_path.read_bytes() == before


def test_a_lora_cache_left_by_a_killed_merge_is_not_reused(tmp_path):
    from mergekit.common import ModelReference
    from test_lora import _build_adapter, _recipe

    scenario = build_scenario(tmp_path / "lora", experts=2, layers=1, samples=4, dtype="float64")
    adapter, _ = _build_adapter(scenario, "plain", {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    written = f"{scenario.base}+{adapter}"
    merged = tmp_path / "merged"
    reference = ModelReference.parse(written)
    leftover = tmp_path / ".merged.lora-cache" / f"{reference.model._unique_id()}_{reference.lora._unique_id()}"
    leftover.mkdir(parents=True)  # what mergekit had made when the run was killed, before it saved the merged expert
    output = run_recipe(_recipe(scenario, tmp_path, written, merged, "out"), progress=False)
    assert (output / "featcal_recipe.yml").is_file()
    assert not (tmp_path / ".merged.lora-cache").exists()
