"""Every recipe form mergekit accepts calibrates exactly or is refused in one line (issue 16).

Merge methods (the installed mergekit's whole registry), `slices:`, `@revision`,
`override_architecture`, `trust_remote_code`, per-layer parameters. Runs that
calibrate are checked against the independent brute force (tests/reference.py)
on the merge mergekit made, in float64, ΔW within 1e-8 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from reference import brute_force_featcal
from test_exactness import delta_error, load, read_weights
from transformers import AutoTokenizer

from featcal_llm.cli import main
from featcal_llm.io.forms import MERGE_METHODS
from featcal_llm.pipeline import run_recipe

SAMPLES, MAX_LENGTH, HYPER = 4, 32, {"lambda": 1e-3, "alpha": 0.3, "rho": 0.5, "eps": 1e-8, "token_weights": "equal", "head": False,
                               "trailing_experts": "keep", "teachers": "own"}


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    """One tiny 2-layer float64 base with two experts, shared by every form."""
    from scenario import build_scenario

    return build_scenario(tmp_path_factory.mktemp("forms"), experts=2, layers=2, samples=SAMPLES, words=(3, 8), dtype="float64")


def write_recipe(scenario, directory: Path, name: str, merge: dict, experts: list[str] | None = None, data: list[Path] | None = None, **featcal) -> Path:
    """A recipe with `merge` as its mergekit part and calibration data keyed by `experts` (default: the two expert paths)."""
    names = experts or [str(p) for p in scenario.experts.values()]
    data = data or list(scenario.data.values())
    block = {
        "merged": str(directory / f"merged_{name}"), "output": str(directory / f"out_{name}"),
        "data": {expert: {"path": str(data[i]), "format": "text"} for i, expert in enumerate(names)},
        "samples": SAMPLES, "max_length": MAX_LENGTH, **HYPER, "device": "cpu", "dtype": "float64", "batch_tokens": 256, **featcal,
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**merge, "dtype": "float64", "featcal": block}, sort_keys=False))
    return path


def models_entries(scenario, parameters: dict | None, count: int = 2) -> list[dict]:
    entries = [{"model": str(p)} for p in list(scenario.experts.values())[:count]]
    return [{**e, "parameters": parameters} if parameters else e for e in entries]


_LOADED: dict[Path, torch.nn.Module] = {}


def load_cached(path: Path) -> torch.nn.Module:
    """Base and experts are shared by every form (the brute force copies what it is given)."""
    if path not in _LOADED:
        _LOADED[path] = load(path, torch.float64)
    return _LOADED[path]


def assert_matches_brute_force(scenario, recipe_path: Path, output: Path, experts: dict[str, Path]) -> float:
    """ΔW of every calibrated tensor against the brute force run on the same merged model; returns the worst."""
    recipe = yaml.safe_load(recipe_path.read_text())["featcal"]
    merged = Path(recipe["merged"])
    tokenizer = AutoTokenizer.from_pretrained(merged)
    sequences = {}
    for name in experts:
        texts = [json.loads(line)["text"] for line in Path(recipe["data"][name]["path"]).read_text().splitlines()][:SAMPLES]
        sequences[name] = [tokenizer(t, truncation=True, max_length=MAX_LENGTH)["input_ids"] for t in texts]
    reference = brute_force_featcal(
        load(merged, torch.float64), load_cached(scenario.base), {n: load_cached(p) for n, p in experts.items()},
        sequences, HYPER["lambda"], HYPER["alpha"], HYPER["rho"], HYPER["eps"],
    ).state_dict()
    ours, merged_weights = read_weights(output), read_weights(merged)
    changed = {n for n in ours if not torch.equal(ours[n], merged_weights[n])}
    expected = {n for n in merged_weights if n in reference and not torch.equal(reference[n], merged_weights[n])}
    assert changed == expected and len(changed) >= 14, sorted(changed ^ expected)
    worst = max(delta_error(ours[n], reference[n], merged_weights[n]) for n in changed)
    assert worst <= 1e-8, worst
    return worst


def refused(recipe: Path) -> str:
    """Runs the CLI; the one error line (exit 2)."""
    result = CliRunner().invoke(main, ["run", str(recipe)])
    stages = ("featcal-llm: warning", "featcal-llm: merging with mergekit", "featcal-llm: merged in")  # not the error
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith(stages)]
    assert result.exit_code == 2, (result.exit_code, lines, result.exception)
    assert len(lines) == 1 and lines[0].startswith("featcal-llm: error: "), lines
    return lines[0]


# method → the models: entries' parameters (None: the method takes none per model), number of experts, shared parameters
METHOD_SETTINGS = {
    "task_arithmetic": ({"weight": [0.3, 0.7]}, 2, None),  # a per-layer gradient: the merge changes, FeatCal reads it as is
    "ties": ({"weight": 0.5, "density": 0.7}, 2, None),
    "dare_linear": ({"weight": 0.5, "density": 0.7}, 2, None),
    "dare_ties": ({"weight": 0.5, "density": 0.7}, 2, None),
    "della": ({"weight": 0.5, "density": 0.7, "epsilon": 0.1}, 2, None),
    "della_linear": ({"weight": 0.5, "density": 0.7, "epsilon": 0.1}, 2, None),
    "breadcrumbs": ({"weight": 0.5, "density": 0.8, "gamma": 0.05}, 2, None),
    "breadcrumbs_ties": ({"weight": 0.5, "density": 0.8, "gamma": 0.05}, 2, None),
    "sce": (None, 2, {"select_topk": 0.5}),
    "model_stock": (None, 2, None),
    "ram": (None, 2, None),
    "ramplus_tl": (None, 2, None),
    "arcee_fusion": (None, 1, None),
    "nuslerp": ({"weight": 0.5}, 2, None),
    "multislerp": ({"weight": 0.5}, 2, None),
    # a filtered per-tensor weight; mergekit averages base_model in too, so it is listed with its own weight
    "linear": ({"weight": [{"filter": "mlp", "value": 0.3}, {"value": 0.4}]}, 2, None),
    "karcher": (None, 2, None),
    "slerp": (None, 1, {"t": 0.5}),
    "nearswap": (None, 1, {"t": 0.5}),
    "passthrough": (None, 1, None),
}


# Checked against the brute force: a per-layer gradient, the base averaged in with a filtered weight, one expert,
# a method that uses the experts' angles. The others check that mergekit's merge was calibrated in full (the
# calibration maths is the same for any merged weights; tests/test_exactness.py covers it per family).
BRUTE_FORCE_METHODS = ("task_arithmetic", "linear", "arcee_fusion", "model_stock")
# base_model is an interpolation endpoint (slerp, nearswap) or nothing is merged (passthrough); written here, not read
# from the product's table, so that a table entry flipped by mistake fails a test
REFUSED_METHODS = ("slerp", "nearswap", "passthrough")


def test_the_table_covers_the_installed_mergekit_registry():
    from mergekit.merge_methods import registered_methods

    registry = {(m.spec() if callable(m.spec) else m.spec).name for m in registered_methods()}
    assert set(MERGE_METHODS) == registry == set(METHOD_SETTINGS)


@pytest.mark.parametrize("method", [m for m in METHOD_SETTINGS if m not in REFUSED_METHODS])
def test_every_applicable_method_merges_and_calibrates_exactly(forms, tmp_path, method):
    parameters, count, shared = METHOD_SETTINGS[method]
    merge = {"merge_method": method, "base_model": str(forms.base), "models": models_entries(forms, parameters, count)}
    if shared:
        merge["parameters"] = shared
    if method == "linear":
        merge["models"].insert(0, {"model": str(forms.base), "parameters": {"weight": 0.2}})
    experts = {str(p): p for p in list(forms.experts.values())[:count]}
    recipe = write_recipe(forms, tmp_path, method, merge, list(experts))
    output = run_recipe(recipe, progress=False)
    merged = tmp_path / f"merged_{method}"
    assert yaml.safe_load((merged / "mergekit_config.yml").read_text())["merge_method"] == method
    if method in BRUTE_FORCE_METHODS:
        worst = assert_matches_brute_force(forms, recipe, output, experts)
        print(f"{method}: worst ΔW relative error {worst:.1e}")
    else:  # the maths does not depend on the method: every projection of the merge mergekit made is re-fitted
        ours, before = read_weights(output), read_weights(merged)
        changed = {n for n in ours if not torch.equal(ours[n], before[n])}
        assert changed == {n for n in before if n.endswith("_proj.weight")} and len(changed) == 14
        assert all(bool(torch.isfinite(ours[n]).all()) for n in changed)


@pytest.mark.parametrize("method", REFUSED_METHODS)
def test_every_other_method_is_refused_in_one_line(forms, tmp_path, method):
    parameters, count, shared = METHOD_SETTINGS[method]
    merge = {"merge_method": method, "base_model": str(forms.base), "models": models_entries(forms, parameters, count)}
    if shared:
        merge["parameters"] = shared
    recipe = write_recipe(forms, tmp_path, method, merge, [str(p) for p in list(forms.experts.values())[:count]])
    before = sorted(p.name for p in tmp_path.iterdir())
    line = refused(recipe)
    assert f"merge_method: {method} is not supported: " in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing merged, nothing written


def slices_recipe(scenario, ranges: list[list[tuple[int, int]]], models: list[list[str]] | None = None, slice_base: str | None = None) -> dict:
    """slices: one output slice per entry of `ranges`, each listing (base, expert0, expert1) with the given layer ranges."""
    everyone = [str(scenario.base)] + [str(p) for p in scenario.experts.values()]
    slices = []
    for index, slice_ranges in enumerate(ranges):
        names = models[index] if models else everyone
        sources = [
            {"model": name, "layer_range": list(r), **({"parameters": {"weight": 0.5}} if name != str(scenario.base) else {})}
            for name, r in zip(names, slice_ranges)
        ]
        slices.append({"sources": sources, **({"base_model": slice_base} if slice_base and index == 1 else {})})
    return {"merge_method": "task_arithmetic", "base_model": str(scenario.base), "slices": slices}


def test_aligned_contiguous_slices_calibrate_exactly(forms, tmp_path):
    """[0, 1] + [1, 2] of every source is the `models:` merge: same merged weights, calibrated exactly."""
    recipe = write_recipe(forms, tmp_path, "slices", slices_recipe(forms, [[(0, 1)] * 3, [(1, 2)] * 3]))
    output = run_recipe(recipe, progress=False)
    assert_matches_brute_force(forms, recipe, output, {str(p): p for p in forms.experts.values()})
    plain = write_recipe(forms, tmp_path, "models", {"merge_method": "task_arithmetic", "base_model": str(forms.base), "models": models_entries(forms, {"weight": 0.5})})
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    ensure_merged(load_recipe(plain), tmp_path / "merged_models", "cpu")
    sliced, merged = read_weights(tmp_path / "merged_slices"), read_weights(tmp_path / "merged_models")
    assert all(torch.equal(sliced[n], merged[n]) for n in merged)


SLICE_REFUSALS = {
    "mixed ranges": ([[(0, 1), (0, 1), (1, 2)], [(1, 2), (1, 2), (0, 1)]], None, None, "slices[0]: sources take different layer ranges"),
    "repeated layers": ([[(0, 2)] * 3, [(1, 2)] * 3], None, None, "slices[1]: layer_range [1, 2] does not continue the previous slices at layer 2"),
    "reordered layers": ([[(1, 2)] * 3, [(0, 1)] * 3], None, None, "slices[0]: layer_range [1, 2] does not continue the previous slices at layer 0"),
    "dropped last layer": ([[(0, 1)] * 3], None, None, "slices[0]: the slices end at layer 1, the base model has 2"),
    "other models per slice": ([[(0, 1)] * 3, [(1, 2)] * 2], "two", None, "slices[1]: merges"),
    "other base per slice": ([[(0, 1)] * 3, [(1, 2)] * 3], None, "expert", "slices[1]: base_model"),
}


@pytest.mark.parametrize("case", list(SLICE_REFUSALS))
def test_frankenmerge_slices_are_refused_naming_the_slice(forms, tmp_path, case):
    ranges, models, slice_base, expected = SLICE_REFUSALS[case]
    everyone = [str(forms.base)] + [str(p) for p in forms.experts.values()]
    merge = slices_recipe(forms, ranges, [everyone, everyone[:2]] if models else None, everyone[1] if slice_base else None)
    recipe = write_recipe(forms, tmp_path, "slices", merge)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert expected in refused(recipe)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_passthrough_frankenmerge_is_refused(forms, tmp_path):
    merge = {"merge_method": "passthrough", "slices": [{"sources": [{"model": str(forms.base), "layer_range": [0, 2]}]}, {"sources": [{"model": str(forms.base), "layer_range": [1, 2]}]}]}
    assert "merge_method: passthrough is not supported: copies layers without merging" in refused(write_recipe(forms, tmp_path, "pass", merge))


def test_multi_module_recipes_are_refused(forms, tmp_path):
    merge = {"merge_method": "task_arithmetic", "base_model": str(forms.base), "modules": {"text": {"models": models_entries(forms, {"weight": 0.5})}}}
    assert "modules: multi-module recipes are not supported" in refused(write_recipe(forms, tmp_path, "modules", merge))


def test_out_dtype_is_kept_by_the_calibrated_checkpoint(forms, tmp_path):
    """mergekit's dtype/out_dtype set the merged storage; every calibrated tensor keeps the merged model's dtype."""
    merge = {"merge_method": "task_arithmetic", "base_model": str(forms.base), "models": models_entries(forms, {"weight": 0.5}), "out_dtype": "bfloat16"}
    output = run_recipe(write_recipe(forms, tmp_path, "bf16", merge, dtype="float32"), progress=False)
    ours, merged = read_weights(output), read_weights(tmp_path / "merged_bf16")
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert all(ours[n].dtype == merged[n].dtype for n in merged)
    assert sum(not torch.equal(ours[n], merged[n]) for n in merged) >= 14
