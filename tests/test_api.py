"""The Python API (`featcal_llm.calibrate`, `featcal_llm.validate`; `evaluate`: test_api_evaluate.py; the output argument:
test_api_outputs.py; what `featcal-llm run` shows: test_run_display.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml



def test_import_stays_light_and_the_api_is_reexported():
    code = textwrap.dedent(
        """
        import json, sys
        import featcal_llm
        light = [m for m in ("torch", "transformers", "mergekit", "featcal_llm.api") if m in sys.modules]
        from featcal_llm import api
        same = featcal_llm.calibrate is api.calibrate and featcal_llm.evaluate is api.evaluate
        same = same and featcal_llm.CalibrationResult is api.CalibrationResult
        from featcal_llm.errors import FeatCalError, RunFailure
        same = same and featcal_llm.FeatCalError is FeatCalError and "FeatCalError" in featcal_llm.__all__
        same = same and featcal_llm.RunFailure is RunFailure and "RunFailure" in featcal_llm.__all__
        heavy = [m for m in ("torch", "transformers", "mergekit") if m in sys.modules]
        print(json.dumps({"light": light, "same": same, "heavy": heavy, "all": "calibrate" in featcal_llm.__all__}))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == {"light": [], "same": True, "heavy": [], "all": True}


def test_calibrate_takes_a_dict_and_returns_paths_and_the_drift_summary(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    result = featcal_llm.calibrate(recipe, output="calibrated", progress=False)
    assert result.output == Path("calibrated") and (tmp_path / "calibrated" / "config.json").is_file()
    assert result.merged == small.root / "merged"
    assert not list(tmp_path.glob(".featcal-recipe-*"))  # the dict's temporary recipe file is gone
    report = json.loads((tmp_path / "calibrated" / "featcal_drift.json").read_text())
    last = report["layers"][-1]
    assert list(result.experts) == [str(path) for path in small.experts.values()]
    for name, summary in result.experts.items():
        assert summary.drift_merged == last["merged"][name] and summary.drift_calibrated == last["calibrated"][name]
        assert summary.kl_merged == report["output_divergence"]["merged"][name]
        assert summary.kl_calibrated == report["output_divergence"]["calibrated"][name]
        assert summary.drift_calibrated < summary.drift_merged and summary.kl_calibrated < summary.kl_merged
    assert result.seconds > 0 and result.peak_host_memory > 100 * 2**20 and result.peak_gpu_memory is None
    table = result.table().splitlines()
    assert table[0].split() == ["expert", "drift", "merged", "drift", "calibrated", "KL", "merged", "KL", "calibrated"]
    first = result.experts[str(small.experts["expert0"])]
    assert table[2].split() == ["expert0", *(f"{v:.4g}" for v in (first.drift_merged, first.drift_calibrated, first.kl_merged,
                                                                     first.kl_calibrated))]
    assert table[-1].startswith("time ") and "peak memory: host" in table[-1]
    text = str(result)  # readable, not a dataclass repr
    assert text.splitlines()[0] == f"calibrated checkpoint: calibrated (from the merged model {small.root / 'merged'})"
    assert result.table() in text and "CalibrationResult(" not in text


def test_calibrate_returns_its_warnings(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["base_modle"] = "x"  # mergekit ignores it: a warning, not an error
    result = featcal_llm.calibrate(recipe, output="calibrated", progress=False)
    said = [w for w in result.warnings if "base_modle: not a mergekit or featcal key" in w and "did you mean 'base_model'" in w]
    assert said == ["<recipe>: base_modle: not a mergekit or featcal key (mergekit ignores it); did you mean 'base_model'?"]  # once, as <recipe>
    assert "warning: " in str(result) and "base_modle" in str(result)


def test_calibrate_names_a_dict_recipe_as_validate_does_not_by_its_deleted_temporary_file(small, tmp_path, monkeypatch):
    import featcal_llm
    from featcal_llm.api import _name_dict_recipe

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"]["refine"] = {"stepz": 3}
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(recipe, output="calibrated", progress=False)
    assert str(caught.value).startswith("<recipe>: featcal.refine.stepz: unknown key"), str(caught.value)
    assert [(p.file, p.key) for p in caught.value.problems] == [("<recipe>", "featcal.refine.stepz")]
    assert ".featcal-recipe-" not in str(caught.value) and not (tmp_path / "calibrated").exists()
    temporary = tmp_path / ".featcal-recipe-x.yaml"
    failure = _name_dict_recipe(featcal_llm.RunFailure(f"{temporary}: featcal.data.a: gone mid-run"), temporary)
    assert isinstance(failure, featcal_llm.RunFailure) and str(failure) == "<recipe>: featcal.data.a: gone mid-run"


def test_a_dict_recipe_takes_paths_and_numpy_numbers_and_leaves_no_file_when_it_cannot(small, tmp_path, monkeypatch):
    """A `Path` or a numpy number in a dict recipe had been a YAML RepresenterError, leaving a half-written hidden recipe
    file in the working directory: they are written as their string and number; what YAML still cannot write is one
    FeatCalError, and nothing is left behind."""
    import numpy as np

    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"].update(output=tmp_path / "calibrated", samples=np.int64(8))
    assert featcal_llm.validate(recipe) == []
    recipe["featcal"]["samples"] = object()
    [problem] = featcal_llm.validate(recipe)  # validate returns it, as every problem
    assert str(problem).startswith("<recipe>: a value YAML cannot write (object <object object at"), str(problem)
    with pytest.raises(featcal_llm.FeatCalError, match=r"^<recipe>: a value YAML cannot write \(object <object object at"):
        featcal_llm.calibrate(recipe, progress=False)
    assert not list(tmp_path.glob(".featcal-recipe-*"))


@pytest.mark.parametrize("device, message", [("tpu", "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
                                             (0, "--device: expected a string such as 'cpu' or 'cuda:0', got 0")])
def test_calibrates_device_is_checked_before_any_work(small, tmp_path, monkeypatch, device, message):
    """calibrate(device=...) had passed the recipe's checks and failed in the pipeline with no key named (`tpu`), or been
    ignored (`0`)."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(small.recipe, output=str(tmp_path / "out"), device=device, progress=False)
    assert [str(problem) for problem in caught.value.problems] == [f"{small.recipe}: {message}"]
    assert not (tmp_path / "out").exists()


def test_model_paths_beside_the_recipe_are_no_hub_ids(small, tmp_path, monkeypatch):
    """Run reads model paths from the working directory, as mergekit does; a relative one that exists only beside the
    recipe had passed validate as an unchecked hub id, then failed at the hub after retries."""
    import shutil

    import featcal_llm

    folder = tmp_path / "project"
    shutil.copytree(small.base, folder / "models" / "base", symlinks=True)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["base_model"] = "models/base"
    (folder / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    assert [str(problem) for problem in featcal_llm.validate(folder / "r.yaml")] == [
        f"{folder / 'r.yaml'}: base_model: models/base: no such folder here, where run reads model paths (as mergekit "
        f"does), but {folder / 'models' / 'base'} is beside the recipe: run from {folder} or write the path out in full"]
    monkeypatch.chdir(folder)
    assert featcal_llm.validate(folder / "r.yaml") == []


def test_validate_takes_a_dict_and_returns_problems_notes_and_warnings(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    clean = featcal_llm.validate(recipe)
    assert clean == [] and clean.ok and str(clean).endswith("ok") and not list(tmp_path.glob(".featcal-recipe-*"))
    recipe["featcal"]["lamda"] = 1.0
    recipe["featcal"]["samples"] = 0
    recipe["base_modle"] = "x"
    result = featcal_llm.validate(recipe)
    assert [(p.file, p.key) for p in result] == [("<recipe>", "featcal.samples"), ("<recipe>", "featcal.lamda")]
    assert not result.ok and str(result).splitlines()[0] == "error: <recipe>: featcal.samples: Input should be greater than or equal to 1 (got 0)"
    assert str(result).endswith("2 problems") and not any("once the featcal: block is fixed" in n for n in result.notes)  # one round
    del recipe["featcal"]["lamda"], recipe["featcal"]["samples"]
    warned = featcal_llm.validate(recipe)
    assert warned.ok and any("base_modle" in w for w in warned.warnings), warned.warnings
    with pytest.raises(featcal_llm.FeatCalError, match="validate: recipe must be a path or a mapping, got int"):
        featcal_llm.validate(3)


def test_refine_on_generated_records_is_warned_of_and_on_real_ones_not(small, tmp_path, monkeypatch):
    """Refinement's held-out records are generated where its data is: validate says so, naming the experts; an expert at
    weight 0 (not calibrated toward) and real records are not named."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"]["refine"] = True
    assert not [w for w in featcal_llm.validate(recipe).warnings if "featcal.refine" in w]
    first, second = sorted(recipe["featcal"]["data"])[:2]
    recipe["featcal"]["data"][first] = {"generate": {"samples": 4}}
    recipe["featcal"]["data"][second] = {"generate": {"samples": 4}, "weight": 0}
    warned = [w for w in featcal_llm.validate(recipe).warnings if "featcal.refine" in w]
    assert len(warned) == 1 and f"featcal.refine: {first} calibrates on generated records" in warned[0], warned
    del recipe["featcal"]["refine"]
    assert not [w for w in featcal_llm.validate(recipe).warnings if "featcal.refine" in w]


def test_calibrate_refuses_what_is_not_a_recipe():
    import featcal_llm
    from featcal_llm.errors import FeatCalError

    with pytest.raises(FeatCalError, match="recipe must be a path or a mapping, got int"):
        featcal_llm.calibrate(3)


# --- API input audit: bad or edge inputs to calibrate / validate / evaluate (each test failed before its fix) ---


def _recipe_dict(small, tmp_path):
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"]["output"] = str(tmp_path / "out")
    return recipe


def test_validate_returns_a_device_that_is_no_string_as_calibrate_refuses_it(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    said = featcal_llm.validate(_recipe_dict(small, tmp_path), device=0)
    assert [problem.key for problem in said] == ["--device"], str(said)
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(_recipe_dict(small, tmp_path), device=0, progress=False)
    assert caught.value.problems == list(said)


def test_recipe_text_given_as_a_string_is_one_line(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(small.recipe.read_text(), progress=False)
    assert "\n" not in str(caught.value) and len(caught.value.problems) == 1
    result = featcal_llm.validate(small.recipe.read_text())
    assert len(result) == 1 and "\n" not in str(result[0])


def test_a_dict_recipe_takes_path_keys(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = _recipe_dict(small, tmp_path)
    recipe["featcal"]["data"] = {Path(name): spec for name, spec in recipe["featcal"]["data"].items()}
    assert featcal_llm.validate(recipe) == []


def test_a_dict_recipe_with_a_tuple_key_names_the_key(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = _recipe_dict(small, tmp_path)
    recipe[(1, 2)] = "x"
    result = featcal_llm.validate(recipe)
    assert len(result) == 1 and "line " not in str(result[0]) and "(1, 2)" in str(result[0]), str(result)


def test_a_dict_recipe_in_an_unwritable_working_directory_is_one_featcal_error(small, tmp_path, monkeypatch):
    import tempfile

    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = _recipe_dict(small, tmp_path)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".featcal-recipe-x.yaml"))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    [problem] = featcal_llm.validate(recipe)
    assert "the working directory cannot take the recipe's temporary file (Permission denied)" in str(problem)
    with pytest.raises(featcal_llm.FeatCalError, match=r"^<recipe>: the working directory cannot take"):
        featcal_llm.calibrate(recipe, progress=False)


def test_validate_returns_a_bad_device_as_a_problem_as_it_does_an_unavailable_one(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    result = featcal_llm.validate(_recipe_dict(small, tmp_path), device="tpu")
    assert [problem.key for problem in result] == ["--device"]
