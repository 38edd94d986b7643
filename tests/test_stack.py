"""`method: [regmean++, featcal]` in one run: the same weights as the two recipes run one after the other, replayed."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest
import torch
import yaml
from test_exactness import read_weights

from featcal_llm.errors import FeatCalError
from featcal_llm.io.recipe import load_recipe
from featcal_llm.pipeline import run_recipe
from featcal_llm.io.run_record import read_run_record

FEATCAL = {"lambda": 1e-3, "alpha": 0.5, "rho": 1.0}


def recipe(scenario, path, **featcal):
    """The scenario's recipe with FeatCal's keys dropped, then the given keys set (float64, small batches)."""
    raw = yaml.safe_load(scenario.recipe.read_text())
    block = raw["featcal"]
    for key in ("lambda", "alpha", "rho", "norms", "biases", "head"):
        block.pop(key, None)
    block.update(batch_tokens=150, dtype="float64", **featcal)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different[:5]


def two_recipes(scenario, tmp_path, regmean: dict, featcal: dict) -> dict:
    first = run_recipe(recipe(scenario, tmp_path / "first.yaml", method="regmean++", output=str(tmp_path / "regmeanpp"),
                              **regmean), progress=False)
    second = run_recipe(recipe(scenario, tmp_path / "second.yaml", merged=str(first), output=str(tmp_path / "two"),
                               **featcal), progress=False)
    return read_weights(second)


def test_stack_equals_two_recipes_and_leaves_no_intermediate(merged_scenario, tmp_path):
    """Fixed settings: bit for bit the weights of RegMean++ then FeatCal run as two recipes."""
    stacked = run_recipe(recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"],
                                output=str(tmp_path / "stack"), reduction=0.5, **FEATCAL), progress=False)
    reference = two_recipes(merged_scenario, tmp_path, {"reduction": 0.5}, FEATCAL)
    ours = read_weights(stacked)
    assert_same(ours, reference)
    merged = read_weights(merged_scenario.root / "merged")
    assert any(not torch.equal(ours[n], merged[n]) for n in ours)  # the stack changed the merge
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no stage left behind
    saved = yaml.safe_load((stacked / "featcal_recipe.yml").read_text())["featcal"]
    assert saved["method"] == ["regmean++", "featcal"]


def test_a_stack_whose_second_stage_failed_reruns_from_the_first_stages_saved_layers(merged_scenario, tmp_path, monkeypatch, capsys):
    """Stage 2 fails (out of memory in its refinement, say): stage 1's output and saved layers stay, and the rerun takes
    every stage-1 layer from them, writing what an uninterrupted stack writes; then nothing is left behind."""
    import featcal_llm.pipeline as pipeline
    from featcal_llm.errors import RunFailure

    path = recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "stack"),
                  reduction=0.5, **FEATCAL)
    calibrate, calls = pipeline.calibrate, []

    def failing_in_stage_2(context, *args):
        calls.append(context)
        if len(calls) == 2:
            raise RunFailure("stage 2 stopped")
        return calibrate(context, *args)

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "calibrate", failing_in_stage_2)
        with pytest.raises(RunFailure, match="stage 2 stopped"):
            run_recipe(path, progress=False)
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert kept == ["..stack.regmean++.featcal-partial", ".stack.featcal-partial", ".stack.regmean++"]
    capsys.readouterr()
    stacked = run_recipe(path, progress=False)
    assert f"resuming from {tmp_path / '..stack.regmean++.featcal-partial'}: 3 of 3 layers already calibrated" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    reference = run_recipe(recipe(merged_scenario, tmp_path / "again.yaml", method=["regmean++", "featcal"],
                                  output=str(tmp_path / "again"), reduction=0.5, **FEATCAL), progress=False)
    assert_same(read_weights(stacked), read_weights(reference))


def test_keep_layers_keeps_both_stages_and_a_rerun_with_another_refine_lr_calibrates_no_layer(merged_scenario, tmp_path, monkeypatch):
    """`--keep-layers` on a stack: stage 1's output and both stages' saved layers stay; the rerun with another `lr`
    replays every layer of both stages and refines again, writing what a fresh stack writes; then nothing is left."""
    import featcal_llm.engine.calibrate as calibrate_module

    refine = {"steps": 2, "eval_every": 1, "lr": 3e-4, "precision": "float32", "params": "full"}
    path = recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "stack"),
                  reduction=0.5, refine=refine, **FEATCAL)
    run_recipe(path, progress=False, keep_layers=True)
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert kept == ["..stack.regmean++.featcal-partial", ".stack.featcal-partial", ".stack.regmean++"]
    slower = recipe(merged_scenario, tmp_path / "slower.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "stack"),
                    reduction=0.5, refine={**refine, "lr": 1e-4}, **FEATCAL)
    layers, fit = [], calibrate_module.calibrate_layer
    with monkeypatch.context() as patch:
        patch.setattr(calibrate_module, "calibrate_layer", lambda *a, **k: layers.append(1) or fit(*a, **k))
        stacked = run_recipe(slower, force=True, progress=False)
    assert layers == [] and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert json.loads((stacked / "featcal_refine.json").read_text())["lr"] == 1e-4
    fresh = recipe(merged_scenario, tmp_path / "fresh.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "fresh"),
                   reduction=0.5, refine={**refine, "lr": 1e-4}, **FEATCAL)
    assert_same(read_weights(stacked), read_weights(run_recipe(fresh, progress=False)))


def test_tuned_stack_equals_two_recipes_and_replays_bit_for_bit(merged_scenario, tmp_path):
    """Both stages searched on held-out records: same as two tuned recipes; the saved recipe replays both choices."""
    regmean, featcal = {"reduction": [0.2, 0.9]}, {"lambda": [1e-4, 1e-1], "alpha": 0.5, "rho": 1.0}
    stacked = run_recipe(recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"],
                                output=str(tmp_path / "stack"), **regmean, **featcal), progress=False)
    assert_same(read_weights(stacked), two_recipes(merged_scenario, tmp_path, regmean, featcal))
    saved = yaml.safe_load((stacked / "featcal_recipe.yml").read_text())
    block = saved["featcal"]
    chosen = json.loads((stacked / "featcal_tuning.json").read_text())["chosen"]
    assert block["lambda"] == {"per_layer": chosen["lambda"]}
    assert set(block["reduction"]) == {"per_layer"} and len(block["reduction"]["per_layer"]) == 3
    card = (stacked / "README.md").read_text()
    shown = yaml.safe_load(card[card.index("```yaml") + 7:card.index("```", card.index("```yaml") + 7)])["featcal"]
    assert (shown["reduction"], shown["lambda"]) == ([0.2, 0.9], [1e-4, 1e-1])  # the stack as written, not a stage's mix
    block["output"] = str(tmp_path / "replayed")
    replay = tmp_path / "replay.yaml"
    replay.write_text(yaml.safe_dump(saved, sort_keys=False))
    assert_same(read_weights(run_recipe(replay, progress=False)), read_weights(stacked))


@pytest.mark.parametrize("method, message", [
    (["featcal", "regmean++"], "featcal.method: expected a stack [regmean, featcal] or [regmean++, featcal]"),
    (["regmean++", "featcal", "featcal"], "featcal.method: expected a stack [regmean, featcal] or [regmean++, featcal]"),
    ("stack", "featcal.method: expected one of featcal, regmean, regmean++, or a stack [regmean, featcal] or [regmean++, featcal]"),
])
def test_bad_stack_is_one_line(scenario, tmp_path, method, message):
    path = recipe(scenario, tmp_path / "bad.yaml", method=method)
    with pytest.raises(FeatCalError) as error:
        load_recipe(path)
    assert message in str(error.value) and "\n" not in str(error.value)
    done = subprocess.run([sys.executable, "-m", "featcal_llm", "run", str(path)], capture_output=True, text=True)
    assert done.returncode != 0 and message in done.stderr and not (tmp_path / "calibrated").exists()


def test_stack_takes_both_methods_keys_and_one_method_still_refuses_the_other(scenario, tmp_path):
    stack = load_recipe(recipe(scenario, tmp_path / "s.yaml", method=["regmean", "featcal"], reduction=0.3, **FEATCAL))
    first, second = stack.featcal.stage(0, "x"), stack.featcal.stage(1, "x")
    assert (first.method, first.output, first.hyper_values()) == ("regmean", "x", {"reduction": 0.3})
    assert (second.method, second.merged, second.hyper_values()) == ("featcal", "x", {"lambda": 1e-3, "alpha": 0.5, "rho": 1.0})
    with pytest.raises(FeatCalError, match="featcal.reduction: only methods regmean and regmean"):
        load_recipe(recipe(scenario, tmp_path / "f.yaml", reduction=0.3))


def test_a_tuned_stack_is_budgeted_stage_by_stage(scenario, tmp_path):
    """Each stage searches its own keys (RegMean 5 reductions, then FeatCal 12 settings), so the budget bounds each, not
    their sum: every key `auto` fits the default 12; a budget of 10 refuses the FeatCal stage's 12 only."""
    every = {"reduction": "auto", "lambda": "auto", "alpha": "auto", "rho": "auto"}
    stack = load_recipe(recipe(scenario, tmp_path / "s.yaml", method=["regmean", "featcal"], **every))
    assert stack.featcal.tune_settings().budget == 12
    with pytest.raises(FeatCalError) as error:
        load_recipe(recipe(scenario, tmp_path / "b.yaml", method=["regmean", "featcal"], tune={"budget": 10}, **every))
    assert "featcal.tune.budget: the coordinate search over 7 lambda, 4 alpha, 3 rho candidates evaluates 12 settings" \
        " per layer, more than the budget of 10" in str(error.value) and "reduction" not in str(error.value)


def test_existing_output_stops_the_stack_before_any_work(scenario, tmp_path):
    (tmp_path / "out").mkdir()
    path = recipe(scenario, tmp_path / "s.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "out"))
    with pytest.raises(FeatCalError, match="already exists"):
        run_recipe(path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "s.yaml"]


def test_card_names_the_stack(merged_scenario, tmp_path):
    stacked = run_recipe(recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean", "featcal"],
                                output=str(tmp_path / "stack"), **FEATCAL), progress=False)
    front = read_run_record(stacked)
    merged = yaml.safe_load(merged_scenario.recipe.read_text())["featcal"]["merged"]
    assert front["merged_model"] == f"{Path(merged).name} + regmean" and front["method"] == "featcal"


def _records_per_stage(monkeypatch) -> list[dict]:
    """Each stage's calibration records (task → sorted token tuples) and settings, as the layer loop receives them."""
    import featcal_llm.pipeline as pipeline

    seen, original = [], pipeline.calibrate

    def spy(ctx, *args, **kwargs):
        records = {task: sorted(tuple(row[keep].tolist()) for batch in batches for row, keep in zip(batch.input_ids, batch.keep))
                   for task, batches in ctx.batches.items()}
        seen.append({"records": records, "weights": dict(ctx.plan.task_weights or {}), "token_roots": ctx.token_roots})
        return original(ctx, *args, **kwargs)

    monkeypatch.setattr(pipeline, "calibrate", spy)
    return seen


def test_a_tuned_stack_holds_the_same_records_out_of_both_stages(merged_scenario, tmp_path, monkeypatch):
    """FeatCal's search scores λ on held-out records: RegMean++'s Grams must not have been fitted on them either."""
    seen = _records_per_stage(monkeypatch)
    run_recipe(recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "stack"),
                      reduction=0.5, **{"lambda": [1e-4, 1e-1], "alpha": 0.5, "rho": 1.0}), progress=False)
    regmean, featcal = seen
    assert regmean["records"] == featcal["records"]
    every = run_recipe(recipe(merged_scenario, tmp_path / "alone.yaml", method="regmean++", output=str(tmp_path / "alone"),
                              reduction=0.5), progress=False)
    assert every.is_dir() and len(seen) == 3
    held_out = {task: len(seen[2]["records"][task]) - len(records) for task, records in featcal["records"].items()}
    assert all(count > 0 for count in held_out.values()), held_out  # the stages did hold records out


def test_the_stack_regmean_stage_weighs_experts_and_tokens_alike(merged_scenario, tmp_path, monkeypatch):
    """`expert_weights:` and `token_weights:` are the FeatCal stage's: RegMean++ stays the published baseline."""
    seen = _records_per_stage(monkeypatch)
    run_recipe(recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "stack"),
                      reduction=0.5, expert_weights="coverage", token_weights="expert_lead", **FEATCAL), progress=False)
    regmean, featcal = seen
    assert set(regmean["weights"].values()) <= {1.0} and regmean["token_roots"] is None
    assert featcal["token_roots"] is not None and len(set(featcal["weights"].values())) > 1


def test_a_stack_whose_featcal_stage_keeps_its_input_is_not_called_the_merge_unchanged(merged_scenario, tmp_path, monkeypatch):
    """Stage 2 may find every expert behind its input (RegMean++'s output) and write that input unchanged; the stack's
    output is still RegMean++'s weights, not the merge's, and its last line says it was calibrated."""
    from click.testing import CliRunner

    import featcal_llm.pipeline as pipeline
    from featcal_llm.cli import main

    calls, original = [], pipeline.every_expert_taught_by_the_merge
    monkeypatch.setattr(pipeline, "every_expert_taught_by_the_merge",
                        lambda *args: calls.append(1) or (len(calls) == 2 or original(*args)))  # stage 2 trails
    path = recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "stack"),
                  reduction=0.5, **FEATCAL)
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 0 and len(calls) == 2, result.output
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"calibrated checkpoint written to {tmp_path / 'stack'}") and "unchanged" not in last, last
    ours, merged = read_weights(tmp_path / "stack"), read_weights(merged_scenario.root / "merged")
    assert any(not torch.equal(ours[name], merged[name]) for name in ours)  # RegMean++ changed the merge


def test_a_stacks_table_names_its_first_stage_as_the_start_it_measured(merged_scenario, tmp_path):
    """Stage 2's drift report measures RegMean++'s output, not the merge: the table's columns say so."""
    import featcal_llm

    path = recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "stack"),
                  reduction=0.5, **FEATCAL)
    result = featcal_llm.calibrate(path, progress=False)
    report = json.loads((tmp_path / "stack" / "featcal_drift.json").read_text())
    assert result.start == "regmean++" and result.table().splitlines()[0].split()[1:] == [
        "drift", "regmean++", "drift", "calibrated", "KL", "regmean++", "KL", "calibrated"]
    first = next(iter(result.experts.values()))
    assert first.kl_merged == next(iter(report["output_divergence"]["merged"].values()))  # the report's start column


@pytest.mark.parametrize("keep_layers", [False, True])
def test_a_stacks_failed_evaluation_is_run_alone_and_leaves_what_keep_layers_kept(merged_scenario, tmp_path, monkeypatch, keep_layers):
    """The stack's evaluation scores its first stage's merge beside the output, so a failed one leaves that merge for
    `--eval-only`; once scored, it goes, as after a stack that evaluated at once, unless --keep-layers kept the run."""
    import featcal_llm.evaluation
    from featcal_llm.api import calibrate
    from featcal_llm.errors import RunFailure
    from featcal_llm.evaluation.compare import AfterCalibration

    def failing(*args, **kwargs):
        raise RunFailure("merged: the evaluation worker failed (exit 1): ImportError")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(featcal_llm.evaluation, "run_after_calibration", failing)
    path = recipe(merged_scenario, tmp_path / "stack.yaml", method=["regmean++", "featcal"], output=str(tmp_path / "stack"),
                  reduction=0.5, eval={"tasks": ["arc_challenge"], "backend": {"name": "hf"}},
                  **({"refine": {"steps": 1, "eval_every": 1}} if keep_layers else {}), **FEATCAL)
    with pytest.raises(RunFailure, match="--eval-only"):
        calibrate(path, progress=False, keep_layers=keep_layers)
    first_stage = tmp_path / ".stack.regmean++"
    assert first_stage.is_dir()
    scored = []
    monkeypatch.setattr(featcal_llm.evaluation, "run_after_calibration",
                        lambda section, merged, calibrated, recipe_dir, echo=None: scored.append(Path(merged)) or AfterCalibration("| t |", {}))
    result = calibrate(path, progress=False, eval_only=True)
    assert scored == [first_stage] and result.merged == merged_scenario.root / "merged" and result.start == "regmean++"
    assert first_stage.is_dir() == keep_layers and (tmp_path / ".stack.featcal-partial").is_dir() == keep_layers
