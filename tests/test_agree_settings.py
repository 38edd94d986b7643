"""`validate` says what `run` will say about the values a recipe sets: mergekit's merge parameters as mergekit merges
them, union keys, rho, the refine: block (each test one edit, both commands asked)."""

from __future__ import annotations


import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from agreement import error_lines, recipe_of, refused_alike


def test_a_yaml_merge_key_may_be_overridden_but_not_repeated(scenario, tmp_path):
    """`<<: *shared` then a key of the shared mapping is YAML's override, not a key given twice; a key the mapping itself
    repeats still is. (The check had run after construction, which flattens the merge key's keys into the mapping.)"""
    import featcal_llm

    text = scenario.recipe.read_text()
    shared = "shared: &shared\n  samples: 16\n  max_length: 64\n"
    block = text.replace("featcal:\n", "featcal:\n  <<: *shared\n", 1).replace("  samples: 16\n", "  samples: 12\n", 1)
    recipe = tmp_path / "merge-key.yaml"
    recipe.write_text(shared + block.replace("  output: ", "  output: ", 1))
    problems = [str(problem) for problem in featcal_llm.validate(recipe)]
    assert not any("given twice" in line for line in problems), problems
    assert not any("shared" in line for line in problems), problems  # mergekit would ignore it: at most a warning
    repeated = tmp_path / "repeated.yaml"
    repeated.write_text(shared + block.replace("  samples: 12\n", "  samples: 12\n  samples: 8\n", 1))
    assert any("featcal.samples: given twice" in str(problem) for problem in featcal_llm.validate(repeated))


@pytest.mark.parametrize("where, value, key, says", [
    (("eval", "backend"), {"batch_size": "max"}, "featcal.eval.backend.batch_size", "a valid integer or 'auto' (got 'max')"),
    (("merge_options",), {"out_shard_size": [1]}, "featcal.merge_options.out_shard_size", "a valid integer or a valid string (got [1])"),
])
def test_a_wrong_value_of_a_union_key_is_one_line_naming_the_key(scenario, tmp_path, where, value, key, says):
    """A key that takes one of two types (`batch_size: integer or auto`, `out_shard_size: integer or string`) given a
    value of neither: both commands printed two lines, one per member of pydantic's union, with its name in the key
    (`featcal.eval.backend.batch_size.constrained-int: ...`, `featcal.eval.backend.batch_size.literal['auto']: ...`)."""
    recipe = recipe_of(scenario, tmp_path)
    block = recipe["featcal"]
    if where[0] == "eval":
        block["eval"] = {"tasks": ["arc_challenge"], "backend": {"name": "hf", **value}}
    else:
        block["merge_options"] = value
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    validated = CliRunner().invoke(main, ["validate", str(path)])
    ran = CliRunner().invoke(main, ["run", str(path)])
    assert validated.exit_code == ran.exit_code == 2 and error_lines(ran) == error_lines(validated)
    assert len(error_lines(validated)) == 1 and error_lines(validated)[0].startswith(f"{path}: {key}: "), error_lines(validated)
    assert error_lines(validated)[0].endswith(says), error_lines(validated)  # every member the key takes, in one line


@pytest.mark.parametrize("where, rho", [("rho", 1e300), ("rho", -1e300), ("rho", 1e30), ("head.rho", 1e300)])
def test_a_rho_the_weights_cannot_hold_is_refused_alike(scenario, tmp_path, where, rho):
    """`rho: 1e300` (docs: "any real"): validate passed it; run merged, calibrated, then stopped with exit 1 ("layer 0:
    calibrated layer produced NaN/Inf hidden states"; for head.rho "LM head: the solution has NaN/Inf"). rho 1e20 ran.
    Now |rho| is at most 100 (the anchor extrapolates the task vector rho times: past that it is no anchor)."""
    recipe = recipe_of(scenario, tmp_path)
    if where == "rho":
        recipe["featcal"]["rho"] = rho
    else:
        recipe["featcal"]["head"] = {"rho": rho}
    [line] = refused_alike(recipe, tmp_path)
    assert f"featcal.{where}: " in line and "100" in line, line
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("site, weight", [
    ("models.1", [{"filter": "self_attn", "value": 0.3}]),  # no catch-all entry: the other tensors have no weight
    ("models.1", {"filter": "self_attn", "value": 0.3}),
    ("models.1", []),
    ("parameters", [{"filter": "mlp", "value": 0.3}]),
])
def test_a_weight_that_leaves_tensors_without_a_value_is_refused_alike(scenario, tmp_path, site, weight):
    """A conditional `weight:` with no entry without a filter (or an empty list): validate counted the parameter as given;
    run started mergekit's merge and stopped with exit 1, "mergekit failed to merge the recipe: Missing required
    parameter weight for .../expert1.model.embed_tokens.weight"."""
    recipe = recipe_of(scenario, tmp_path)
    if site == "parameters":
        for entry in recipe["models"]:
            entry.pop("parameters")
        recipe["parameters"] = {"weight": weight}
    else:
        recipe["models"][1]["parameters"]["weight"] = weight
    [line] = refused_alike(recipe, tmp_path)
    assert f"{site}.parameters.weight" in line or f"{site}.weight" in line, line
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.merging").exists()


@pytest.mark.parametrize("method, parameters, key", [
    ("della", {"weight": 0.5, "density": 0.5, "epsilon": 0.9}, "epsilon"),  # mergekit: density +/- epsilon must lie in (0, 1)
    ("dare_linear", {"weight": 0.5, "density": -0.2}, "density"),  # torch.bernoulli: p_in >= 0 && p_in <= 1
])
def test_a_merge_parameter_out_of_mergekit_s_range_is_refused_alike(scenario, tmp_path, method, parameters, key):
    """Values mergekit's merge refuses only once it runs: validate passed them; run started the merge and stopped with
    exit 1 ("mergekit failed to merge the recipe: Epsilon must be chosen such that density +/- epsilon is in (0, 1)";
    for dare's density "Expected p_in >= 0 && p_in <= 1 to be true, but got false. (Could this error message be
    improved? ...)")."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["merge_method"] = method
    for entry in recipe["models"]:
        entry.pop("parameters", None)
    recipe["parameters"] = dict(parameters)  # for every expert: one line, where it is written
    errors = refused_alike(recipe, tmp_path)
    assert f"r.yaml: parameters.{key}: " in errors[0], errors
    assert not (tmp_path / "merged").exists()
    recipe["parameters"] = {**parameters, **({"epsilon": 0.2} if key == "epsilon" else {"density": 0.0})}  # in range: merges
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0


def test_linear_weights_that_sum_to_zero_are_refused_alike(scenario, tmp_path):
    """`merge_method: linear` with every weight 0 (normalize, mergekit's default, divides by their sum): validate passed
    it; run merged a model of NaNs, then refused it (exit 2, but after the merge): "merged model: the embedding of a
    calibration token contains NaN or Inf"."""
    recipe = recipe_of(scenario, tmp_path)
    recipe.update(merge_method="linear", parameters={"weight": 0.0})
    for entry in recipe["models"]:
        entry["parameters"] = {"weight": 0.0}
    [line] = refused_alike(recipe, tmp_path)
    assert "weight" in line, line
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), 1e300])
def test_a_merge_weight_that_is_not_finite_is_refused_alike(scenario, tmp_path, weight):
    """`weight: .nan`, `.inf` or 1e300 for one expert: validate passed it (a number); run merged a model of NaN/Inf into
    featcal.merged and then refused it (exit 2 after the merge, naming no key): "merged model: the embedding of a
    calibration token contains NaN or Inf". featcal: refuses rho: .inf before any work, in one line naming the key."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["models"][1]["parameters"]["weight"] = weight
    [line] = refused_alike(recipe, tmp_path)
    assert "models.1.parameters.weight" in line, line
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("weight, says", [
    (None, "expected {value, filter}, a list of {value, filter}, true or false, an integer, a number, a string or a list "
           "of values (got null)"),
    ([{"filter": "mlp"}], "expected {value, filter}, a list of {value, filter}, true or false, an integer, a number, a "
                          "string or a list of values; 0.value is missing"),
])
def test_a_merge_parameter_of_no_form_mergekit_takes_is_one_line(scenario, tmp_path, weight, says):
    """`weight: null`, or a filtered entry without its value: both commands printed 7 and 10 lines, one per member of
    mergekit's parameter union (`models.1.parameters.weight.list[union[bool,int,float,str]].0.bool: ...`)."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["models"][1]["parameters"]["weight"] = weight
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith(f"r.yaml: models.1.parameters.weight: {says}"), line


@pytest.mark.parametrize("refine, key, says", [
    ({"params": "full", "rank": 8}, "rank", "rank applies to params: adapter (or auto, which may choose it); params: full "
                                            "trains every weight (got 8)"),
    ({"lr": 2.0}, "lr", "Input should be less than or equal to 1 (got 2.0)"),
])
def test_a_refine_setting_the_run_would_ignore_or_diverge_on_is_refused_alike(scenario, tmp_path, refine, key, says):
    """`refine: {params: full, rank: 8}`: the rank was ignored without a word; `lr: 1e300` ran, its KL NaN, and the
    summary advised "a smaller refine.lr (say 1e+299)". Both commands now refuse each in one line."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["featcal"]["refine"] = refine
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith(f"r.yaml: featcal.refine.{key}: {says}"), line
    recipe["featcal"]["refine"] = {**refine, "params": "adapter"} if key == "rank" else {"lr": 1.0}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert CliRunner().invoke(main, ["validate", str(tmp_path / "r.yaml")]).exit_code == 0


def test_a_rank_beside_params_auto_resolved_to_full_is_dropped_from_the_saved_recipe_so_it_replays():
    """`refine: {rank: 8}` (params auto) on a machine where auto chose full: the saved recipe pins params: full, which
    refuses a rank beside it; the rank applied to nothing there, so the pinned recipe leaves it out and parses."""
    from featcal_llm.io.block_sections import RefineSpec
    from featcal_llm.io.saved_recipe import with_refine_pinned

    text = yaml.safe_dump({"featcal": {"output": "o", "refine": {"rank": 8, "steps": 5}}}, sort_keys=False)
    pinned = yaml.safe_load(with_refine_pinned(text, {"params": "full", "autocast": None}))["featcal"]["refine"]
    assert pinned == {"steps": 5, "params": "full", "precision": "float32"}
    RefineSpec.model_validate(pinned)
    kept = yaml.safe_load(with_refine_pinned(text, {"params": "adapter", "autocast": None}))["featcal"]["refine"]
    assert kept == {"rank": 8, "steps": 5, "params": "adapter", "precision": "float32"}  # the adapter's rank stays

