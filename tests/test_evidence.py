"""Decisions only on evidence (issue 56): the skip counts the experts that pull, and no lead is read where none was measured."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from test_coverage import trained_scenario
from test_exactness import read_weights

from featcal_llm.engine.teachers import check_judged, every_expert_taught_by_the_merge
from featcal_llm.errors import FeatCalError
from featcal_llm.io.records import Record
from featcal_llm.maths.advantage import judged_tokens
from featcal_llm.pipeline import run_recipe


def test_the_skip_counts_only_experts_with_a_weight():
    assert every_expert_taught_by_the_merge({"a": -0.1}, {"a": 1.0, "b": 0.0})  # b leads at weight 0: it pulls nothing
    assert not every_expert_taught_by_the_merge({"a": -0.1}, {"a": 1.0, "b": 0.5})
    assert every_expert_taught_by_the_merge({"a": -0.1, "b": -0.2}, {"a": 1.0, "b": 0.5})
    assert not every_expert_taught_by_the_merge({}, {"a": 1.0})
    assert not every_expert_taught_by_the_merge({"a": -0.1}, {"a": 0.0})  # nothing pulls: not this rule's case


def test_a_leading_expert_at_weight_0_does_not_turn_the_skip_off(tmp_path, capsys):
    """expert0 is the merge itself (a linear merge at weights 1 and 0: 1·x + 0·y is x on every machine, so its lead is
    exactly 0, trailing; task arithmetic's base + 1·(x − base) is x only where the rounding happens to cancel: on CI's
    kernels it was not, and a lead of 0.000 ± 0.000 left the sign in doubt); expert1, trained on its records, leads by
    far but has `weight: 0` in the data. Only the anchor (the base) would move the layers: the output is the merge, bit
    for bit."""
    scenario = trained_scenario(tmp_path / "scenario", "llama", (0, 24))
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["merge_method"], recipe["parameters"] = "linear", {"weight": 0.0}  # the base (the anchor) at weight 0 too
    recipe["models"][0]["parameters"]["weight"] = 1.0
    recipe["models"][1]["parameters"]["weight"] = 0.0
    recipe["featcal"]["data"][str(scenario.experts["expert1"])]["weight"] = 0
    recipe["featcal"].update(output=str(tmp_path / "out"), trailing_experts="merge", dtype="float64", batch_tokens=150)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    output = run_recipe(tmp_path / "r.yaml", progress=False)
    log = capsys.readouterr().err
    assert "expert1 ahead on" in log and "(net of where it trails: +0." in log  # it does lead: the case the rule must ignore
    assert "expert0 (no better than it: a lead of exactly 0" in log
    assert "no layer is re-fitted and the output is the merged model, unchanged" in log
    ours, merged = read_weights(output), read_weights(scenario.root / "merged")
    assert ours.keys() == merged.keys() and all(torch.equal(ours[name], merged[name]) for name in merged)


@pytest.mark.parametrize(("length", "start", "judged"), [(5, 0, 4), (5, 1, 4), (5, 3, 2), (5, 4, 1), (5, 5, 0), (5, 9, 0), (1, 0, 0)])
def test_judged_tokens_are_those_whose_successor_is_a_response_token(length, start, judged):
    from featcal_llm.engine.scoring import response_positions
    from featcal_llm.engine.streams import make_batches

    record = Record(list(range(3, 3 + length)), start) if start else list(range(3, 3 + length))
    assert judged_tokens(length, [(start, length)]) == judged
    batch = make_batches([record, list(range(3, 10))], 64)[0]  # beside a longer plain record: the mask of a real batch
    row = [i for i in range(2) if int(batch.keep[i].sum()) == length][0]
    assert int(response_positions(batch)[row].sum()) == judged  # the pass counts the same positions


def test_check_judged_names_the_expert_and_what_to_do():
    check_judged({"a": [Record([5, 6, 7], 2)], "b": [[4, 5]]}, "r.yaml: featcal", held_out=True)
    check_judged({"b": [Record([4, 5], 2), Record([4, 5, 6, 7], 2)]}, "r.yaml: featcal", held_out=True)  # the second counts
    with pytest.raises(FeatCalError) as error:
        check_judged({"a": [Record([5, 6, 7], 2)], "b": [Record([4, 5], 2), Record([4, 5, 6], 3)]}, "r.yaml: featcal", held_out=True)
    assert str(error.value) == (
        "r.yaml: featcal.data.b: none of its 2 calibration records keeps a judged (response) token after the hold-out split, so "
        "whether it leads the merge (trailing_experts: merge) cannot be measured; give it more samples, a longer max_length or a "
        "smaller tune.holdout")


def test_an_expert_left_without_a_response_token_by_the_split_is_refused_before_any_pass(tmp_path, capsys):
    """Of expert0's four prompt/response records only the held-out ones keep a response within max_length: its lead would
    read 0.0 and it would be declared trailing. The run refuses it in one line, before any pass, writing nothing."""
    from scenario import build_scenario

    from featcal_llm.engine.tuning import split_holdout

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4, words=(4, 10), dtype="float64")
    expert = str(scenario.experts["expert0"])
    _, held = split_holdout({expert: [[i] for i in range(4)]}, 0.5, 0, "x")
    held_out = {sequence[0] for sequence in held[expert]}
    path = tmp_path / "completion.jsonl"
    with path.open("w") as handle:
        for index in range(4):
            prompt = "the merge of experts " if index in held_out else "the merge of experts loses skill calibration restores " * 3
            handle.write(json.dumps({"prompt": prompt, "response": "features layer by layer"}) + "\n")
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["data"][expert] = {"path": str(path), "format": "completion", "prompt": "prompt", "response": "response"}
    recipe["featcal"].update(output=str(tmp_path / "out"), trailing_experts="merge", seed=0, **{"lambda": [1e-3, 1e-2]},
                             tune={"holdout": 0.5})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(FeatCalError) as error:
        run_recipe(tmp_path / "r.yaml", progress=False)
    message = str(error.value)
    assert "\n" not in message and f"featcal.data.{expert}: none of its 2 calibration records keeps a judged (response) token" in message
    assert "more samples, a longer max_length or a smaller tune.holdout" in message
    assert "weighing each expert's tokens" not in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["completion.jsonl", "r.yaml", "scenario"]


def _fingerprint(recipe_path, merged_dir, probe=None) -> str:
    """The run fingerprint of a recipe with stand-ins for the opened models and the runner (what the pipeline records of them)."""
    from types import SimpleNamespace

    from featcal_llm.io.recipe import load_recipe
    from featcal_llm.stages.prepare import run_fingerprint

    models = SimpleNamespace(merged=SimpleNamespace(directory=merged_dir))
    runner = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, stats_dtype=torch.float64, head_stats_dtype=torch.float64)
    return run_fingerprint(load_recipe(recipe_path), {"a": [[1, 2, 3]]}, probe or {"a": [[4, 5]]}, models, runner, 256, {})


def test_other_held_out_records_beside_the_same_calibration_records_change_the_fingerprint(tmp_path):
    """The held-out records choose the hyper-parameters the saved layers were fitted with: a data file edited only in
    a record the split holds out leaves the calibration records as they were, and must still not resume."""
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    (tmp_path / "merged").mkdir()
    before = _fingerprint(scenario.recipe, tmp_path / "merged")
    assert _fingerprint(scenario.recipe, tmp_path / "merged", {"a": [[4, 5]]}) == before
    assert _fingerprint(scenario.recipe, tmp_path / "merged", {"a": [[4, 6]]}) != before


@pytest.mark.parametrize("library", ["torch", "transformers", "mergekit", "safetensors", "peft"])
def test_another_release_of_a_library_that_computes_the_weights_changes_the_fingerprint(library, tmp_path, monkeypatch):
    from scenario import build_scenario

    from featcal_llm.engine import resume

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    (tmp_path / "merged").mkdir()
    before = _fingerprint(scenario.recipe, tmp_path / "merged")
    assert before == _fingerprint(scenario.recipe, tmp_path / "merged")
    real = resume._installed
    monkeypatch.setattr(resume, "_installed", lambda name: "0.0.1-other" if name == library else real(name))
    assert _fingerprint(scenario.recipe, tmp_path / "merged") != before


def test_pipeline_py_is_part_of_the_weight_code_digest(tmp_path):
    import shutil

    from featcal_llm.engine import resume

    assert resume.PACKAGE / "pipeline.py" in resume.weight_code_files()
    copy = tmp_path / "featcal_llm"
    shutil.copytree(resume.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = resume.source_digest(copy)
    assert before == resume.source_digest(resume.PACKAGE)  # the copy's digest is the installed code's
    digests = {before}
    # one module of each package that decides the weights: the decisions, the data read, the merge, the samples written
    modules = ("pipeline.py", "io/data.py", "stages/prepare.py", "generation/run.py", "maths/solve.py", "family/__init__.py")
    for changed, module in enumerate(modules, start=1):
        (copy / module).write_text((copy / module).read_text() + "\n# a decision changed\n")
        resume.source_digest.cache_clear()
        digests.add(resume.source_digest(copy))
        assert len(digests) == 1 + changed, module  # a digest no earlier state of the code had
    resume.source_digest.cache_clear()


def test_the_random_merge_methods_are_those_that_draw_random_numbers_in_mergekit():
    """RANDOM_METHODS against mergekit itself: task-arithmetic methods by their sparsification (whose functions draw Bernoulli
    masks or not), every other method by whether its implementation's module draws random numbers."""
    import inspect
    import re

    import mergekit.sparsify as sparsify
    from mergekit.merge_methods import registry

    from featcal_llm.io.merge_identity import RANDOM_METHODS

    drawing = re.compile(r"torch\.(rand\w*|bernoulli|multinomial|normal)\b|\brandom\.")
    draws = {method: bool(drawing.search(inspect.getsource(function))) for method, function in (
        (sparsify.SparsificationMethod.random, sparsify.bernoulli), (sparsify.SparsificationMethod.della_magprune, sparsify.della_magprune),
        (sparsify.SparsificationMethod.magnitude, sparsify.magnitude),
        (sparsify.SparsificationMethod.magnitude_outliers, sparsify.magnitude_outliers))}
    assert draws == {sparsify.SparsificationMethod.random: True, sparsify.SparsificationMethod.della_magprune: True,
                     sparsify.SparsificationMethod.magnitude: False, sparsify.SparsificationMethod.magnitude_outliers: False}
    random = set()
    for method in registry.registered_methods():
        if hasattr(method, "sparsification_method"):  # the generalized task arithmetic family
            drawn = method.sparsification_method is not None and draws[method.sparsification_method]
        else:
            drawn = bool(drawing.search(inspect.getsource(inspect.getmodule(method.implementation))))
        if drawn:
            random.add(method.spec.name)
    assert random == RANDOM_METHODS


def _merge_with(scenario, tmp_path, name: str, method: str, **featcal):
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    raw = yaml.safe_load(scenario.recipe.read_text())
    raw["merge_method"] = method
    if method != "task_arithmetic":
        for model in raw["models"]:
            model["parameters"] = {"weight": 0.5, "density": 0.5}
    raw["featcal"].update(merged=str(tmp_path / f"merged-{method}"), **featcal)
    (tmp_path / name).write_text(yaml.safe_dump(raw, sort_keys=False))
    return ensure_merged(load_recipe(tmp_path / name), tmp_path / f"merged-{method}", "cpu")


def _stamp(directory) -> dict:
    return {"dir": directory.stat().st_ino, **{f.name: f.stat().st_mtime_ns for f in directory.iterdir()}}


@pytest.mark.parametrize(("method", "merged_again"), [("task_arithmetic", False), ("ties", False), ("dare_ties", True)])
def test_another_seed_merges_again_only_a_random_merge(scenario, tmp_path, monkeypatch, method, merged_again):
    from featcal_llm.io import merge

    first = _merge_with(scenario, tmp_path, "a.yaml", method)
    before, weights = _stamp(first), read_weights(first)
    monkeypatch.setattr(merge, "_settled", {})  # as in a new process
    again = _merge_with(scenario, tmp_path, "b.yaml", method, seed=5)
    assert (_stamp(again) != before) is merged_again
    if merged_again:  # drawn again with the other seed: other masks
        assert any(not torch.equal(weights[name], tensor) for name, tensor in read_weights(again).items())
