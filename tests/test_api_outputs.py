"""The API's `output` argument: of the wrong type, empty, existing, the working directory, too long a name for the file
system (with the folders the run keeps beside it) or holding a NUL byte: one FeatCalError, judged alike by validate
and calibrate."""

from __future__ import annotations


import pytest

from test_api import _recipe_dict


@pytest.mark.parametrize("call", ["validate", "calibrate"])
@pytest.mark.parametrize("output", [123, b"out"])
def test_an_output_of_the_wrong_type_is_one_featcal_error(small, tmp_path, monkeypatch, call, output):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    if call == "validate":  # validate returns every problem, the arguments' too (as it does an unavailable device)
        result = featcal_llm.validate(_recipe_dict(small, tmp_path), output=output)
        assert [(problem.key, "output directory" in problem.message) for problem in result] == [("OUTPUT", True)], str(result)
        assert not list(tmp_path.iterdir())
        return
    with pytest.raises(featcal_llm.FeatCalError, match="output") as caught:
        featcal_llm.calibrate(_recipe_dict(small, tmp_path), output=output, progress=False)
    assert "\n" not in str(caught.value) and not list(tmp_path.iterdir())


def test_an_empty_output_is_judged_alike_by_validate_and_calibrate(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = _recipe_dict(small, tmp_path)
    if featcal_llm.validate(recipe, output="").ok:
        featcal_llm.calibrate(recipe, output="", progress=False)  # what validate passes, calibrate runs
    else:
        with pytest.raises(featcal_llm.FeatCalError):
            featcal_llm.calibrate(recipe, output="", progress=False)


def test_an_existing_output_argument_is_named_as_the_argument(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    existing = tmp_path / "earlier"
    existing.mkdir()
    (existing / "featcal_recipe.yml").write_text(small.recipe.read_text())  # an earlier featcal-llm output
    recipe = _recipe_dict(small, tmp_path)
    noted = [note for note in featcal_llm.validate(recipe, output=existing).notes if "already exists" in note]
    assert noted and "OUTPUT" in noted[0]
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(recipe, output=existing, progress=False)
    assert "already exists" in str(caught.value) and "featcal.output" not in str(caught.value), str(caught.value)


def test_a_name_of_255_bytes_is_one_a_file_system_takes(small, tmp_path, monkeypatch):
    """NAME_MAX is 255 bytes: a recipe named in 255 is looked for (and found missing), one of 256 is refused."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    said = featcal_llm.validate("é" * 125 + ".yaml")  # 255 bytes
    assert len(said) == 1 and "past the 255" not in str(said[0]) and str(said[0]).endswith("recipe file not found"), str(said)
    said = featcal_llm.validate("é" * 125 + "x.yaml")
    assert len(said) == 1 and "a name of 256 bytes (éééééééééééééééééééééééé...), past the 255 a file system takes" in str(said[0]), str(said)


def test_an_output_name_leaves_room_for_the_folders_the_run_keeps_beside_it(small, tmp_path, monkeypatch):
    """The run keeps .NAME.featcal-partial (its progress) beside the output NAME: 17 bytes more, so an output's name
    may take 238 of a file system's 255 bytes; one longer is one problem from validate and one error from calibrate."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    assert featcal_llm.validate(_recipe_dict(small, tmp_path), output="x" * 238) == []
    line = ("a name of 239 bytes (xxxxxxxxxxxxxxxxxxxxxxxx...), past the 238 an output's name may take: the run keeps "
            ".NAME.featcal-partial beside it, in the 255 bytes a file system takes; name a shorter directory")
    said = featcal_llm.validate(_recipe_dict(small, tmp_path), output="x" * 239)
    assert len(said) == 1 and str(said[0]).endswith(line), str(said)
    said = featcal_llm.validate(small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / ("x" * 250))))
    assert len(said) == 1 and "a name of 250 bytes" in str(said[0]) and "past the 238" in str(said[0]), str(said)
    with pytest.raises(featcal_llm.FeatCalError, match="past the 238 an output's name may take"):
        featcal_llm.calibrate(_recipe_dict(small, tmp_path), output="x" * 239, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".x")) == []


@pytest.mark.parametrize("probe", ["validate recipe", "calibrate recipe", "validate output", "evaluate model"])
def test_a_name_too_long_for_the_file_system_is_one_featcal_error(small, tmp_path, monkeypatch, probe):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    long = "x" * 300
    if probe.startswith("validate"):  # returned as the one problem, as validate returns every problem
        said = featcal_llm.validate(long + ".yaml") if probe == "validate recipe" else \
            featcal_llm.validate(_recipe_dict(small, tmp_path), output=long)
        assert len(said) == 1 and "past the 255 a file system takes" in str(said[0]), str(said)
        return
    with pytest.raises(featcal_llm.FeatCalError, match="past the 255 a file system takes"):
        if probe == "calibrate recipe":
            featcal_llm.calibrate(long + ".yaml", progress=False)
        else:
            featcal_llm.evaluate(long, tasks=["arc_challenge"], quiet=True)


def test_an_output_with_a_nul_byte_is_one_featcal_error(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError, match="output|OUTPUT"):
        featcal_llm.calibrate(_recipe_dict(small, tmp_path), output="o\x00ut", progress=False)


def test_an_output_of_the_working_directory_is_refused_for_itself_not_for_the_temporary_recipe(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    result = featcal_llm.validate(_recipe_dict(small, tmp_path), output=".")
    assert len(result) == 1 and "holds the recipe" not in str(result[0]), str(result)
