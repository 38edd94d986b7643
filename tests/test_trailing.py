"""`trailing_experts: merge`: the merge teaches the records of an expert that predicts them worse than the merge does.

The scenario's expert0 is fine-tuned 24 steps on its records and leads the merge there; expert1, 6 steps, trails it
(both measured here from the whole models' forward, independently of the product's pass). The reference is the brute
force with the merged model in expert1's place and expert1's tokens weighed alike; the product's updates must match it
to 1e-8, and be far from the brute force that keeps expert1 as its teacher.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from reference import advantage_token_weights, behind_beyond_doubt, brute_force_featcal, brute_force_head, mean_leads
from test_coverage import card_front, exact_weights, trained_scenario
from test_exactness import TOLERANCE, delta_error, load, read_weights
from test_head import HEAD, reference_models

from featcal_llm.engine.teachers import trailing_experts
from featcal_llm.engine.tuning import split_holdout
from featcal_llm.maths import advantage
from featcal_llm.maths.advantage import lead_margin, lead_moments, trails
from featcal_llm.errors import FeatCalError
from featcal_llm.pipeline import run_recipe
from featcal_llm.io.validate import validate_recipe


def _updates_error(output, reference: dict[str, torch.Tensor], merged_dir, layers_only: bool = False) -> float:
    """The worst ΔW error over the tensors the run changed (over the decoder layers' alone with `layers_only`)."""
    ours, merged = read_weights(output), read_weights(merged_dir)
    changed = [name for name in ours if not torch.equal(ours[name], merged[name]) and (not layers_only or ".layers." in name)]
    assert changed
    return max(delta_error(ours[name], reference[name], merged[name]) for name in changed)


@pytest.fixture(scope="module")
def lead_and_trail(tmp_path_factory):
    """The scenario, its models and records in float64, and the leads measured from the whole models' forward."""
    root = tmp_path_factory.mktemp("trailing")
    scenario = trained_scenario(root / "scenario", "llama", (24, 6))
    run_recipe(scenario.write_recipe(root / "merge.yaml", output=str(root / "first")), progress=False)  # writes the merge
    merged, base, experts, sequences = reference_models(scenario)
    return scenario, merged, base, experts, sequences, mean_leads(merged, experts, sequences)


def test_the_scenario_has_one_expert_ahead_of_the_merge_and_one_behind(lead_and_trail):
    *_, leads = lead_and_trail
    first, second = leads.values()
    assert first > 0.05 and second < -0.05, leads
    assert list(trailing_experts(leads)) == [list(leads)[1]]
    assert trailing_experts({"a": 0.0, "b": 1e-12}) == {"a": 0.0}  # no lead at all is no reason to pull toward it


def test_the_lead_s_margin_is_two_standard_errors_over_records():
    """lead_margin's running moments against the spread of the records' leads computed directly."""
    leads, judged = torch.tensor([3.0, -1.0, 2.0, 0.5, -4.0], dtype=torch.float64), torch.tensor([10, 4, 8, 6, 12])
    mean = float(leads.sum() / judged.sum())
    residuals = leads.double() - mean * judged.double()
    direct = 2 * math.sqrt(float((residuals ** 2).sum()) / (4 * 5)) / float(judged.double().mean())
    moments = lead_moments(leads, judged)
    assert lead_margin(moments) == pytest.approx(direct, rel=1e-12)
    # equal lengths: the familiar standard error of a mean, sd / √R (records of one token each)
    same = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    assert lead_margin(lead_moments(same, torch.ones(4))) == pytest.approx(2 * float(same.std()) / 2, rel=1e-12)
    # a record with no judged token is no evidence; one record has no spread: the sign alone decides
    assert lead_moments(torch.tensor([1.0, 0.0]), torch.tensor([2, 0]))[0] == 1
    assert lead_margin(lead_moments(torch.tensor([-1.0]), torch.tensor([3]))) == 0.0
    assert trails(-0.5, 0.4) and not trails(-0.018, 0.025) and trails(0.0, 0.0) and not trails(1e-12)
    assert list(trailing_experts({"a": -0.5, "b": -0.018}, {"a": 0.4, "b": 0.025})) == ["a"]


def test_an_expert_too_close_to_the_merge_to_tell_teaches_its_own_records(lead_and_trail, tmp_path, monkeypatch, capsys):
    """With the margin at ten standard errors expert1's lead (−0.25) no longer tells its sign: it teaches its own records,
    those it trails on weigh 0, like any leading expert's (the reference decides with its own spread), and the card says so."""
    scenario, merged, base, experts, sequences, leads = lead_and_trail
    monkeypatch.setattr(advantage, "LEAD_STANDARD_ERRORS", 10.0)
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                              token_weights="expert_lead", trailing_experts="merge"), progress=False)
    weights = advantage_token_weights(merged, experts, sequences, standard_errors=10.0)
    second = list(experts)[1]
    assert any(float(w.sum()) == 0 for w in weights[second]) and any(float(w.sum()) > 0 for w in weights[second])
    reference = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8, token_weights=weights).state_dict()
    assert _updates_error(output, reference, scenario.root / "merged") <= TOLERANCE
    front = card_front(output)["featcal"]
    assert "taught_by_merge" not in front
    lead = front["expert_lead"]["expert1"]
    assert lead["net_lead"] == pytest.approx(leads[second], abs=1e-4) and lead["net_lead"] + lead["net_lead_margin"] > 0
    assert lead["records_dropped"] == sum(float(w.sum()) == 0 for w in weights[second])
    assert "expert1 (behind the merge by 0.2" in capsys.readouterr().err
    assert "net lead -0.2" in (output / "README.md").read_text()


def test_the_merge_teaches_a_trailing_expert_s_records_layers_and_head(lead_and_trail, tmp_path):
    scenario, merged, base, experts, sequences, leads = lead_and_trail
    first, second = experts
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                              token_weights="expert_lead", head=HEAD, trailing_experts="merge"), progress=False)
    weights = advantage_token_weights(merged, experts, sequences)
    teachers = {first: experts[first], second: merged}
    alike = {first: weights[first], second: [torch.ones(len(s), dtype=torch.float64) for s in sequences[second]]}
    cal = brute_force_featcal(merged, base, teachers, sequences, 1e-3, 0.3, 0.5, 1e-8, token_weights=alike)
    reference = {**cal.state_dict(), "lm_head.weight": brute_force_head(cal, merged, base, teachers, sequences, HEAD["lambda"], HEAD["alpha"],
                                                                        HEAD["rho"], 1e-8, token_weights=alike)}
    error = _updates_error(output, reference, scenario.root / "merged")
    kept = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8, token_weights=weights).state_dict()
    print(f"updates within {error:.1e} of the brute force with the merge teaching {second}; "
          f"{_updates_error(output, kept, scenario.root / 'merged', layers_only=True):.1e} from the one that keeps it")
    assert error <= TOLERANCE
    assert _updates_error(output, kept, scenario.root / "merged", layers_only=True) > 1e-2  # the lever changes the updates
    front = card_front(output)["featcal"]
    assert front["settings"]["trailing_experts"] == "merge"
    assert list(front["taught_by_merge"]) == ["expert1"]
    assert abs(exact_weights(output)["taught_by_merge"]["expert1"] - leads[second]) < 1e-10
    readme = (output / "README.md").read_text()
    assert "`expert1`" in readme and "so its records were calibrated toward the merged model (`trailing_experts: merge`)" in readme
    # the drift report measures expert1's records against their teacher, the merge (0 for the merge itself), and says so;
    # the run's table marks the row
    from featcal_llm.calibration_result import CalibrationResult, summarize_report

    report = json.loads((output / "featcal_drift.json").read_text())
    assert report["taught_by_merge"] == [second] and report["output_divergence"]["merged"][second] == 0.0
    assert report["output_divergence"]["merged"][first] > 0
    table = CalibrationResult(output, scenario.root / "merged", summarize_report(report)).table()
    rows = table.splitlines()[2:4]
    assert rows[0].split()[0] == "expert0" and rows[1].split()[:2] == ["expert1", "*"]
    assert "* the merge teaches expert1's records (trailing_experts: merge): drift and KL there are to the merged model, not to the expert" in table


def test_merge_is_the_default_and_keep_calibrates_toward_every_expert_and_leading_experts_change_nothing(
        lead_and_trail, tmp_path, capsys):
    scenario, merged, base, experts, sequences, _ = lead_and_trail
    first, second = experts
    weights = advantage_token_weights(merged, experts, sequences)
    default = run_recipe(scenario.write_recipe(tmp_path / "d.yaml", output=str(tmp_path / "default"), batch_tokens=150, dtype="float64",
                                               token_weights="expert_lead", trailing_experts=None), progress=False)
    alike = {first: weights[first], second: [torch.ones(len(s), dtype=torch.float64) for s in sequences[second]]}
    reference = brute_force_featcal(merged, base, {first: experts[first], second: merged}, sequences, 1e-3, 0.3, 0.5, 1e-8,
                                    token_weights=alike).state_dict()
    assert _updates_error(default, reference, scenario.root / "merged") <= TOLERANCE
    front = card_front(default)["featcal"]
    assert list(front["taught_by_merge"]) == ["expert1"] and front["settings"]["trailing_experts"] == "merge"
    kept = run_recipe(scenario.write_recipe(tmp_path / "k.yaml", output=str(tmp_path / "keep"), batch_tokens=150, dtype="float64",
                                            token_weights="expert_lead", trailing_experts="keep"), progress=False)
    reference = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8, token_weights=weights).state_dict()
    assert _updates_error(kept, reference, scenario.root / "merged") <= TOLERANCE
    assert "taught_by_merge" not in card_front(kept)["featcal"] and card_front(kept)["featcal"]["settings"]["trailing_experts"] == "keep"
    # the card says that keep calibrated toward the trailing expert (expert1), and of it alone
    lines = [line for line in (kept / "README.md").read_text().splitlines() if line.startswith("- `expert")]
    warned = [line for line in lines if "`trailing_experts: keep` calibrated toward it all the same" in line]
    assert len(warned) == 1 and warned[0].startswith("- `expert1`"), lines
    # expert0 alone leads: `merge` changes nothing, bit for bit, and says so
    only_first = yaml.safe_load(scenario.recipe.read_text())
    only_first["models"] = only_first["models"][:1]
    only_first["featcal"]["data"] = dict(list(only_first["featcal"]["data"].items())[:1])
    runs = {}
    for rule in ("merge", "keep"):
        only_first["featcal"].update(output=str(tmp_path / f"one-{rule}"), merged=str(tmp_path / "merged-one"), batch_tokens=150,
                                     dtype="float64", token_weights="expert_lead", trailing_experts=rule)
        (tmp_path / f"{rule}.yaml").write_text(yaml.safe_dump(only_first, sort_keys=False))
        runs[rule] = read_weights(run_recipe(tmp_path / f"{rule}.yaml", progress=False))
    assert all(torch.equal(runs["merge"][name], runs["keep"][name]) for name in runs["keep"])
    assert "every expert leads the merge on its own records" in capsys.readouterr().err


def test_equal_token_weights_still_let_the_merge_teach(lead_and_trail, tmp_path):
    """The lead is measured by the same pass when tokens weigh alike; only the teacher changes."""
    scenario, merged, base, experts, sequences, _ = lead_and_trail
    first, second = experts
    output = run_recipe(scenario.write_recipe(tmp_path / "e.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                              trailing_experts="merge"), progress=False)
    reference = brute_force_featcal(merged, base, {first: experts[first], second: merged}, sequences, 1e-3, 0.3, 0.5, 1e-8).state_dict()
    assert _updates_error(output, reference, scenario.root / "merged") <= TOLERANCE
    front = card_front(output)["featcal"]
    assert front["settings"]["token_weights"] == "equal" and "expert_lead" not in front and list(front["taught_by_merge"]) == ["expert1"]


def test_every_expert_behind_the_merge_leaves_the_merge_unchanged_and_says_so(tmp_path, capsys):
    """Every target would be the merge's own features; only the anchor (toward the base) would move the weights. So no
    layer is fitted and the output is the merged checkpoint, bit for bit, with a card that says why."""
    from test_token_weights import merge_of_one_expert

    from click.testing import CliRunner

    from featcal_llm.cli import main

    _, recipe = merge_of_one_expert(tmp_path, 1, 4, trailing_experts=None)  # one expert at weight 1: the merge itself
    result = CliRunner().invoke(main, ["run", str(recipe)])
    output = Path(yaml.safe_load(Path(recipe).read_text())["featcal"]["output"])
    err = result.stderr
    assert any("featcal.trailing_experts: every expert predicts its own records worse than the merged model, so the output is "
               "the merged model, unchanged" in line and "set trailing_experts: keep" not in line
               for line in err.splitlines() if "warning" in line), err
    assert result.exit_code == 0 and result.stdout.strip().splitlines()[-1] == (  # the last line says so too
        f"checkpoint written to {output}: the merged model, unchanged (every expert predicts its own records worse than "
        "the merge; see the warning above)")
    assert "no layer is re-fitted" in err and "layer 0" not in err
    ours, merged = read_weights(output), read_weights(tmp_path / "scenario" / "merged")
    assert ours.keys() == merged.keys() and all(torch.equal(ours[name], merged[name]) for name in merged)
    front = card_front(output)["featcal"]
    assert front["unchanged"] is True and list(front["taught_by_merge"]) == ["expert0"]
    assert not (output / "featcal_drift.json").exists() and "this model is the merged model, unchanged" in (output / "README.md").read_text()



@pytest.mark.parametrize("featcal, message", [
    ({"trailing_experts": "expert"}, r"featcal\.trailing_experts.*'keep' or 'merge'"),
    ({"trailing_experts": "merge", "method": "regmean", "lambda": None, "alpha": None, "rho": None, "head": None},
     r"featcal\.trailing_experts: only method featcal reads it \(method is regmean\)"),
])
def test_bad_trailing_experts_are_one_line(tmp_path, featcal, message):
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"].update(output=str(tmp_path / "out"), **featcal)
    recipe["featcal"] = {k: v for k, v in recipe["featcal"].items() if v is not None}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(FeatCalError, match=message) as error:
        run_recipe(tmp_path / "r.yaml", progress=False)
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


def test_regmean_accepts_keep_which_is_what_it_does(tmp_path):
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"].update(output=str(tmp_path / "out"), method="regmean", trailing_experts="keep", token_weights="equal")
    for key in ("lambda", "alpha", "rho", "head"):
        recipe["featcal"].pop(key)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert validate_recipe(tmp_path / "r.yaml") == []


def test_a_run_the_merge_teaches_in_resumes_to_the_same_bytes(lead_and_trail, tmp_path, monkeypatch, capsys):
    """The leads are saved with the passes: a resumed run lets the merge teach the same expert without measuring again."""
    from test_reliability import resumes_to_the_same_bytes

    scenario, *_ = lead_and_trail
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                   token_weights="expert_lead", head=HEAD, trailing_experts="merge")
    resumes_to_the_same_bytes(recipe, tmp_path / "out", 1, monkeypatch)
    log = capsys.readouterr().err
    assert log.count("reused from the saved progress") == 1
    assert log.count("the merged model teaches the records of expert1") == 3  # the run, the crashed run, the resumed run
    assert list(card_front(tmp_path / "out")["featcal"]["taught_by_merge"]) == ["expert1"]


def test_refine_trains_on_the_records_the_closed_form_weighs(lead_and_trail, tmp_path, monkeypatch):
    """`refine:` leaves out the records that weigh 0 (`trailing_records: drop`): with the margin at ten standard errors
    expert1 keeps its records, and the ones it trails the merge on (summed lead below 0, from the whole models' forward,
    on the statistics records the run kept after holding some out) are exactly the ones refine does not train on; the
    card names how many."""
    import featcal_llm.engine.refine as refine_module
    import featcal_llm.pipeline as pipeline

    scenario, merged, base, experts, sequences, leads = lead_and_trail
    monkeypatch.setattr(advantage, "LEAD_STANDARD_ERRORS", 10.0)
    seen = {}
    staged, stage = pipeline._refine, refine_module.refine
    monkeypatch.setattr(pipeline, "_refine", lambda context, resolved, data, *rest: seen.update(kept=data.sequences) or staged(context, resolved, data, *rest))
    monkeypatch.setattr(refine_module, "refine", lambda job: seen.update(job=job) or stage(job))
    second = list(experts)[1]

    def dropped_of(kept: dict) -> dict:
        weights = advantage_token_weights(merged, experts, kept, standard_errors=10.0)
        return {task: [i for i, w in enumerate(weights[task]) if float(w.sum()) == 0] for task in kept}

    # the held-out split is seeded by featcal.seed and the expert's position in the recipe: the first seed whose kept
    # records of expert1 hold some it trails the merge on and some it does not
    seed = next(seed for seed in range(64)
                if 0 < len(dropped_of(split_holdout(sequences, 0.25, seed, "x")[0])[second]) < len(sequences[second]) * 3 // 4)
    refine = {"steps": 2, "eval_every": 2, "lr": 1e-4, "params": "full", "precision": "float32"}
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                              token_weights="expert_lead", trailing_experts="merge", refine=refine, seed=seed),
                        progress=False)
    kept, job = seen["kept"], seen["job"]
    assert kept == split_holdout(sequences, 0.25, seed, "x")[0]  # the split predicted above is the run's
    dropped = dropped_of(kept)
    assert dropped[second] and len(dropped[second]) < len(kept[second])
    for task in kept:
        assert job.train[task] == [s for i, s in enumerate(kept[task]) if i not in dropped[task]], task
        assert job.left_out[task] == len(dropped[task])
    assert f"{len(dropped[second])} of `expert1`'s records" in (output / "README.md").read_text()


def test_refines_held_out_check_leaves_out_the_records_the_expert_trails_on(lead_and_trail, tmp_path, monkeypatch):
    """`trailing_records: drop` leaves out of refine's held-out check the held-out records the same rule marks: an
    expert not behind the merge beyond doubt (judged on the statistics records, the margin at ten standard errors)
    whose leads over a held-out record's judged tokens sum below 0 (from the whole models' forward). The stage's
    held-out KL before the first step is the closed form's full-vocabulary KL(expert ‖ model) over exactly the other
    held-out records' judged tokens (transformers alone), not over all of them; the report and the card count them."""
    from reference import _token_leads
    from test_refine import full_kl

    import featcal_llm.engine.refine as refine_module

    scenario, merged, base, experts, sequences, leads = lead_and_trail
    monkeypatch.setattr(advantage, "LEAD_STANDARD_ERRORS", 10.0)
    second = list(experts)[1]
    record_leads = {task: [float(_token_leads(merged, experts[task], row).sum()) for row in rows] for task, rows in sequences.items()}

    def split(seed: int):
        kept, held = split_holdout(sequences, 0.25, seed, "x")
        lead_of = {task: dict(zip(map(tuple, sequences[task]), record_leads[task])) for task in sequences}
        leading = [task for task in kept if not behind_beyond_doubt(
            [_token_leads(merged, experts[task], row) for row in kept[task]], [len(row) - 1 for row in kept[task]], 10.0)]
        trailing = {task: [i for i, row in enumerate(held[task]) if task in leading and lead_of[task][tuple(row)] < 0] for task in held}
        return kept, held, trailing

    # the first seed whose held-out records of expert1 hold some it trails the merge on and some it does not
    seed = next(seed for seed in range(64) if 0 < len(split(seed)[2][second]) < len(split(seed)[1][second]))
    kept, held, trailing = split(seed)
    top_k = 1000  # every token of the scenario's vocabulary: the stage's KL is the full one (its teachers in float16)
    keys = dict(batch_tokens=150, dtype="float64", token_weights="expert_lead", trailing_experts="merge", seed=seed,
                refine={"steps": 2, "eval_every": 2, "lr": 1e-4, "params": "full", "precision": "float32", "top_k": top_k})
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **keys), progress=False)

    def stand_in(job):  # the closed form's output: what the check before the first step measures
        return job.replacements, {"params": "full", "lr": 0.0, "steps_run": 0, "chosen_step": 0, "max_steps": 0, "top_k": 1,
                                  "held_out_kl": {"before": 0.0, "after": 0.0}, "teachers": {}}

    monkeypatch.setattr(refine_module, "refine", stand_in)
    closed = run_recipe(scenario.write_recipe(tmp_path / "c.yaml", output=str(tmp_path / "closed"), **keys), progress=False)
    model = load(closed, torch.float64)

    @torch.no_grad()
    def kl_over(task: str, rows: list[list[int]]) -> float:
        """The token mean over the rows' judged tokens (every token but the last) of KL(expert ‖ closed form)."""
        ids = [torch.tensor([row]) for row in rows]
        total = sum(float(full_kl(model(row).logits[0, :-1], experts[task](row).logits[0, :-1])) for row in ids)
        return total / sum(len(row) - 1 for row in rows)

    report = json.loads((output / "featcal_refine.json").read_text())
    for task in held:
        name = Path(task).name
        counted = [row for i, row in enumerate(held[task]) if i not in trailing[task]]
        # the stage's top-100 of a 100-token vocabulary is every token; its teachers' log-probabilities are float16
        assert report["per_expert"]["before"][name] == pytest.approx(kl_over(task, counted), rel=1e-3), name
        if trailing[task]:  # the trailing records move the KL well beyond that tolerance (1.3 % and 2.4 % here)
            assert kl_over(task, held[task]) != pytest.approx(kl_over(task, counted), rel=5e-3), name
    assert report["held_out_left_out"] == {Path(task).name: len(trailing[task]) for task in held}
    assert report["held_out_records"] == {Path(task).name: len(held[task]) for task in held}  # the split, as before
    card = " ".join((output / "README.md").read_text().split())
    counts = ", ".join(f"{len(trailing[task])} of `{Path(task).name}`'s" for task in held if trailing[task])
    assert ("Held-out records left out of the checks, as of the training, since the expert trails the merge on them "
            f"(`trailing_records: drop`): {counts}.") in card


def test_an_expert_with_a_lead_of_exactly_zero_is_said_to_be_no_better_not_behind(capsys):
    """A copy of the merge leads it by exactly 0 with no spread: `trails` counts it (the merge teaching its records is the
    same pull), and the log says it is no better than the merge rather than "behind it by 0.000"."""
    from types import SimpleNamespace

    from featcal_llm.engine.context import Models
    from featcal_llm.engine.teachers import let_the_merge_teach

    ctx = SimpleNamespace(models=Models(merged="M", base="B", experts={"copy": "C", "lead": "L", "behind": "D"}), token_roots=None, teachers={},
                          plan=SimpleNamespace(task_weight=lambda task: 1.0))
    behind = let_the_merge_teach(ctx, {"copy": 0.0, "lead": 0.2, "behind": -0.3}, "r.yaml: featcal.trailing_experts",
                                 {"copy": 0.0, "lead": 0.05, "behind": 0.1})
    assert behind == {"copy": 0.0, "behind": -0.3} and ctx.models.experts == {"copy": "M", "lead": "L", "behind": "M"}
    err = capsys.readouterr().err
    assert "copy (no better than it: a lead of exactly 0" in err and "behind (behind it by 0.300 nats a token)" in err
    assert "behind it by 0.000" not in err
