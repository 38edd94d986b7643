"""Issue 22's defects of the layer loop, each pinned by a test that failed before its fix.

(Defect 1, Gemma-2's float64 √hidden embedding scale, is covered by the Gemma-2 case of
test_exactness.py, whose hidden size 72 has an inexact square root.)
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml
from test_exactness import read_weights

import featcal_llm.engine.tuned as tuned_module
from featcal_llm.engine.objectives import FeatCal
from featcal_llm.pipeline import run_recipe

TWO_LAMBDAS = {"lambda": [1e-3, 1e-1], "alpha": 0.3, "rho": 0.5}  # the search starts at λ = 1e-3


def _chosen(output) -> list[float]:
    return json.loads((output / "featcal_tuning.json").read_text())["chosen"]["lambda"]


def test_a_nan_criterion_loses_to_every_finite_one(merged_scenario, tmp_path, monkeypatch, capsys):
    """Defect 2: NaN < x is false, so a NaN candidate evaluated first used to win the search."""
    real = tuned_module.criterion

    def nan_at_start(*args):
        value = real(*args)
        return math.nan if nan_at_start.current == 1e-3 else value

    real_solve = FeatCal.solve_layer

    def remember(self, plan, layer, systems, tensors, hyper=None, solver=None):
        nan_at_start.current = hyper.lam if hyper else None
        return real_solve(self, plan, layer, systems, tensors, hyper, solver)

    monkeypatch.setattr(tuned_module, "criterion", nan_at_start)
    monkeypatch.setattr(FeatCal, "solve_layer", remember)
    output = run_recipe(merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **TWO_LAMBDAS), progress=False)
    assert _chosen(output) == [0.1, 0.1, 0.1]
    layers = json.loads((output / "featcal_tuning.json").read_text())["layers"]
    assert all(layer["candidates"][0] == {"lambda": 1e-3, "alpha": 0.3, "rho": 0.5, "criterion": None} for layer in layers)
    assert capsys.readouterr().err.count("scored +inf") == 3


def test_a_candidate_with_non_finite_weights_loses_instead_of_aborting(merged_scenario, tmp_path, monkeypatch):
    """Defect 2: non-finite weights of one candidate must not abort a run that has finite candidates."""
    real = FeatCal.solve_layer

    def broken_at_small_lambda(self, plan, layer, systems, tensors, hyper=None, solver=None):
        solved = real(self, plan, layer, systems, tensors, hyper, solver)
        if hyper is not None and hyper.lam == 1e-3:
            solved["mlp.down_proj.weight"] = torch.full_like(solved["mlp.down_proj.weight"], float("inf"))
        return solved

    monkeypatch.setattr(FeatCal, "solve_layer", broken_at_small_lambda)
    output = run_recipe(merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **TWO_LAMBDAS), progress=False)
    assert _chosen(output) == [0.1, 0.1, 0.1]
    assert all(bool(torch.isfinite(t).all()) for t in read_weights(output).values())


def test_a_run_fails_only_when_no_candidate_is_finite(merged_scenario, tmp_path, monkeypatch):
    from featcal_llm.errors import FeatCalError

    monkeypatch.setattr(tuned_module, "criterion", lambda *args: math.nan)
    with pytest.raises(FeatCalError, match="^layer 0: no candidate setting gave finite weights, hidden states and criterion"):
        run_recipe(merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **TWO_LAMBDAS), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_one_element_list_is_a_fixed_value(merged_scenario, tmp_path):
    """Defect 3: `lambda: [1e-3]` holds out no records and searches nothing: the same bytes as `lambda: 1e-3`."""
    listed = run_recipe(merged_scenario.write_recipe(tmp_path / "a.yaml", output=str(tmp_path / "listed"),
                                                     **{"lambda": [1e-3], "alpha": [0.3, 0.3], "rho": 0.5}), progress=False)
    fixed = run_recipe(merged_scenario.write_recipe(tmp_path / "b.yaml", output=str(tmp_path / "fixed"),
                                                    **{"lambda": 1e-3, "alpha": 0.3, "rho": 0.5}), progress=False)
    assert not (listed / "featcal_tuning.json").exists()
    assert json.loads((listed / "featcal_drift.json").read_text())["probe"] == "calibration subsample"
    assert (listed / "model.safetensors").read_bytes() == (fixed / "model.safetensors").read_bytes()


def test_the_written_recipe_of_a_tuned_run_replays_it_without_a_search(merged_scenario, tmp_path, monkeypatch):
    """Defect 4: featcal_recipe.yml holds the winners per layer; running it gives the same weights and drift, no search."""
    tuned = run_recipe(merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "tuned"),
                                                    **{"lambda": [1e-3, 1e-1, 3.0], "alpha": [0.3, 0.8], "rho": 0.5}), progress=False)
    written = yaml.safe_load((tuned / "featcal_recipe.yml").read_text())
    chosen = json.loads((tuned / "featcal_tuning.json").read_text())["chosen"]
    assert {key: written["featcal"][key] for key in chosen} == {key: {"per_layer": values} for key, values in chosen.items()}
    assert written["featcal"]["stats_dtype"] == "float64" and written["featcal"]["dtype"] == "float32"  # `auto` pinned as resolved
    written["featcal"]["output"] = str(tmp_path / "replayed")
    (tmp_path / "replay.yaml").write_text(yaml.safe_dump(written, sort_keys=False))

    def no_search(*args, **kwargs):
        raise AssertionError("a replay must not search")

    monkeypatch.setattr(tuned_module, "coordinate_search", no_search)
    replayed = run_recipe(tmp_path / "replay.yaml", progress=False)
    assert (replayed / "model.safetensors").read_bytes() == (tuned / "model.safetensors").read_bytes()
    assert (replayed / "featcal_drift.json").read_bytes() == (tuned / "featcal_drift.json").read_bytes()
    assert not (replayed / "featcal_tuning.json").exists()


def test_per_layer_values_must_cover_every_layer(merged_scenario, tmp_path):
    from featcal_llm.errors import FeatCalError

    recipe = merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **{"lambda": {"per_layer": [1e-3, 1e-2]}})
    with pytest.raises(FeatCalError, match=r"featcal.lambda.per_layer: 2 values for a model of 3 decoder layers"):
        run_recipe(recipe, progress=False)


def test_an_expert_named_merged_keeps_the_merged_models_head(merged_scenario, tmp_path, monkeypatch):
    """Defect 5: heads were keyed by name, so an expert called `merged` replaced the merged model's head."""
    monkeypatch.chdir(tmp_path)
    first, second = list(merged_scenario.experts.values())[:2]
    shutil.copytree(first, tmp_path / "merged")  # an expert whose recipe name is `merged`
    recipe = yaml.safe_load(merged_scenario.recipe.read_text())
    recipe["models"] = [{"model": "merged", "parameters": {"weight": 0.5}}, {"model": str(second), "parameters": {"weight": 0.5}}]
    data = recipe["featcal"]["data"]
    recipe["featcal"].update(
        merged=str(tmp_path / "the-merge"), output=str(tmp_path / "out"),
        data={"merged": data[str(first)], str(second): data[str(second)]}, tune={"criterion": "output"}, **TWO_LAMBDAS,
    )
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    seen = []
    real = tuned_module.criterion

    def spy(name, probe, candidate, expert, heads, *rest):
        seen.append(heads.merged if hasattr(heads, "merged") else heads["merged"])
        return real(name, probe, candidate, expert, heads, *rest)

    monkeypatch.setattr(tuned_module, "criterion", spy)
    run_recipe(tmp_path / "r.yaml", progress=False)
    merged_head = read_weights(tmp_path / "the-merge")["lm_head.weight"]
    assert seen and all(torch.equal(head.weight, merged_head) for head in seen)
    assert not torch.equal(read_weights(tmp_path / "merged")["lm_head.weight"], merged_head)
