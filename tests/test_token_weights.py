"""Token weights by the expert's advantage over the merge (`token_weights: expert_lead`, FeatCal's default).

The product's weights come from its streamed pass (one layer at a time, the family's final norm and head); the
reference's from each whole HF model's own forward, one sequence at a time (tests/reference.py). The calibrated
updates must agree to 1e-8, biases and norms included, and so must what the card reports.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from reference import advantage_token_weights, brute_force_featcal, brute_force_head
from test_coverage import card_front, trained_scenario
from test_exactness import TOLERANCE, calibration_sequences, delta_error, load, read_weights

from featcal_llm.errors import FeatCalError
from featcal_llm.maths.advantage import advantages, mean_one_scale, token_weights, weighted_rows
from featcal_llm.pipeline import run_recipe


def test_a_token_weighs_the_expert_lead_on_its_successor_and_nothing_where_the_merge_is_as_good():
    expert = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64)
    merged = torch.tensor([[-1.5, -1.0, -0.5, 0.0]], dtype=torch.float64)
    scored = torch.tensor([[True, True, True, False]])
    assert advantages(expert, merged, scored).tolist() == [[0.5, 0.0, 0.0, 0.0]]
    assert mean_one_scale(0.5, 4) == 8.0 and mean_one_scale(0.0, 4) == 0.0
    lead, keep = torch.tensor([[0.5, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64), torch.tensor([[True, True, True, True, False]])
    assert token_weights(lead, keep, mean_one_scale(0.5, 4)).tolist() == [[2.5, 0.5, 0.5, 0.5, 0.0]]  # ½ + ½ a / mean(a)
    assert token_weights(lead * 0, keep, 0.0).tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0]]  # nowhere ahead: every token 1
    rows, roots = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([2.0, 0.0], dtype=torch.float64)
    assert torch.equal(weighted_rows(rows, roots, torch.float64), torch.tensor([[2.0, 4.0], [0.0, 0.0]], dtype=torch.float64))
    assert weighted_rows(rows, None, torch.float64) is rows
    # bf16 rows are scaled in the statistics' precision: 1.5 × (1 + 2⁻⁸) is not a bf16 number, and must not be rounded to one
    scaled = weighted_rows(torch.tensor([[1.5]], dtype=torch.bfloat16), torch.tensor([1 + 2**-8], dtype=torch.float64), torch.float32)
    assert scaled.dtype == torch.float32 and float(scaled) == 1.5 * (1 + 2**-8)


def _check(scenario, output, norms: bool, samples: int = 12, max_length: int = 64, drop: bool = True) -> dict[str, float]:
    def load64(path):
        return load(path, torch.float64)

    merged_model = load64(scenario.root / "merged")
    experts = {str(p): load64(p) for p in scenario.experts.values()}
    sequences = {str(scenario.experts[n]): s for n, s in calibration_sequences(scenario, samples, max_length).items()}
    weights = advantage_token_weights(merged_model, experts, sequences, drop_trailing_records=drop)
    dropped = sum(float(w.sum()) == 0 for rows in weights.values() for w in rows)
    assert dropped > 0 or not drop, "the scenario must hold a record its expert trails on, or the rule is untested"
    reference = brute_force_featcal(merged_model, load64(scenario.base), experts, sequences, 1e-3, 0.3, 0.5, 1e-8, norms=norms,
                                    token_weights=weights).state_dict()
    unweighted = brute_force_featcal(merged_model, load64(scenario.base), experts, sequences, 1e-3, 0.3, 0.5, 1e-8,
                                     norms=norms).state_dict()
    ours, merged = read_weights(output), read_weights(scenario.root / "merged")
    changed = {n for n in ours if not torch.equal(ours[n], merged[n])}
    expected = {n for n in merged if n in reference and not torch.equal(reference[n].to(merged[n].dtype), merged[n])}
    assert changed == expected, sorted(changed ^ expected)
    errors = {name: delta_error(ours[name], reference[name], merged[name]) for name in changed}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])
    # the weights matter: the unweighted brute force is far from the product's updates
    assert max(delta_error(ours[n], unweighted[n], merged[n]) for n in changed) > 1e-2
    return advantage_token_weights(merged_model, experts, sequences, drop_trailing_records=False)  # every token's, for its summary


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # several padded batches and norms; q/k/v biases (the weighted means)
def test_weighted_updates_match_the_brute_force_with_weights_from_the_whole_models(family, tmp_path):
    scenario = trained_scenario(tmp_path / "scenario", family, (24, 6))
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                   norms=True, token_weights="expert_lead")
    output = run_recipe(recipe, progress=False)
    weights = _check(scenario, output, norms=True)
    card = card_front(output)["featcal"]
    assert card["settings"]["token_weights"] == "expert_lead"
    for index, (name, rows) in enumerate(weights.items()):
        lead = torch.cat(rows)
        scored = sum(len(row) - 1 for row in rows)
        summary = card["expert_lead"][f"expert{index}"]
        assert summary["tokens_ahead"] == round(float((lead > 0.5).sum()) / scored, 4)
        assert 0 < summary["tokens_ahead"] < 1


def test_expert_lead_is_the_default_and_equal_weighs_every_token_alike(tmp_path):
    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    recipe = yaml.safe_load(scenario.recipe.read_text())
    del recipe["featcal"]["token_weights"]
    recipe["featcal"].update(output=str(tmp_path / "default"), batch_tokens=150, dtype="float64")
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    default = run_recipe(tmp_path / "d.yaml", progress=False)
    assert card_front(default)["featcal"]["settings"]["token_weights"] == "expert_lead"
    _check(scenario, default, norms=False)
    equal = run_recipe(scenario.write_recipe(tmp_path / "e.yaml", output=str(tmp_path / "equal"), batch_tokens=150, dtype="float64"),
                       progress=False)
    front = card_front(equal)["featcal"]
    assert front["settings"]["token_weights"] == "equal" and "expert_lead" not in front


def test_the_head_re_fit_weighs_tokens_alike(family_scenarios, tmp_path):
    """`head:` takes the same weights: the LM head's update against the brute force's on its weighted calibration."""
    from test_head import HEAD, reference_models

    scenario = family_scenarios("llama")
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                              head=HEAD, token_weights="expert_lead"), progress=False)
    merged, base, experts, sequences = reference_models(scenario)
    weights = advantage_token_weights(merged, experts, sequences)
    cal = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8, token_weights=weights)
    expected = brute_force_head(cal, merged, base, experts, sequences, HEAD["lambda"], HEAD["alpha"], HEAD["rho"], 1e-8,
                                token_weights=weights)
    merged_head = merged.get_output_embeddings().weight
    assert delta_error(read_weights(output)["lm_head.weight"], expected, merged_head) <= TOLERANCE


def merge_of_one_expert(tmp_path, layers: int, samples: int, **featcal) -> tuple[dict, object]:
    """The recipe (raw) and its path for one expert merged at weight 1: the merge is the expert itself."""
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=1, layers=layers, samples=samples, words=(4, 10), dtype="float64")
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["models"][0]["parameters"]["weight"] = 1.0
    recipe["featcal"].update(output=str(tmp_path / "out"), **featcal)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return recipe, tmp_path / "r.yaml"


def test_an_expert_never_ahead_of_the_merge_is_warned_about(tmp_path, capsys):
    """One expert merged at weight 1 is the merge itself: it is ahead on no token, so its tokens weigh alike."""
    recipe, path = merge_of_one_expert(tmp_path, 2, 6, token_weights="expert_lead")
    output = run_recipe(path, progress=False)
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert any("featcal.token_weights: expert" in line and "predicts none of its records' tokens better than the merge" in line
               for line in warning), warning
    assert card_front(output)["featcal"]["expert_lead"]["expert0"] == {"tokens_ahead": 0.0, "mean_positive_lead": 0.0,
                                                                       "net_lead": 0.0, "net_lead_margin": 0.0}
    recipe["featcal"].update(output=str(tmp_path / "equal"), token_weights="equal")
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    equal, ours = read_weights(run_recipe(tmp_path / "e.yaml", progress=False)), read_weights(output)
    assert all(torch.allclose(ours[name], equal[name], rtol=1e-9, atol=1e-12) for name in equal)


@pytest.mark.parametrize("featcal, message", [
    ({"token_weights": "uniform"}, r"token_weights.*'expert_lead' or 'equal'"),
    ({"token_weights": "expert_lead", "method": "regmean++", "lambda": None, "alpha": None, "rho": None},
     r"featcal\.token_weights: expert_lead is FeatCal's; regmean\+\+ weighs every token alike"),
    ({"token_weights": "advantage"}, r"featcal\.token_weights: advantage was renamed: use expert_lead$"),
    ({"token_weights": "equal", "trailing_records": "drop"},  # a key that would do nothing
     r"featcal\.trailing_records: only token_weights: expert_lead reads it \(a trailing record weighs 0 through its token "
     r"weights\), and token_weights is equal$"),
])
def test_bad_token_weights_are_one_line(tmp_path, featcal, message):
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"].update(output=str(tmp_path / "out"))
    recipe["featcal"].update(featcal)
    recipe["featcal"] = {k: v for k, v in recipe["featcal"].items() if v is not None}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(FeatCalError, match=message) as error:
        run_recipe(tmp_path / "r.yaml", progress=False)
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


def test_a_record_its_expert_trails_on_weighs_nothing_and_one_without_judged_tokens_stays():
    from featcal_llm.maths.advantage import TRAILING_RECORD, mark_trailing_records

    lead = torch.tensor([[0.4, -0.1, 0.0], [-0.5, 0.2, 0.0], [0.3, -0.3, 0.0], [-2.0, 0.0, 0.0]], dtype=torch.float64)
    judged = torch.tensor([[True, True, False], [True, True, False], [True, True, False], [False, False, False]])
    marked = mark_trailing_records(lead.clamp(min=0), (lead * judged).sum(dim=1))
    assert marked.tolist() == [[0.4, 0.0, 0.0], [TRAILING_RECORD] * 3, [0.3, 0.0, 0.0], [0.0, 0.0, 0.0]]  # sums 0 and no judged: kept
    keep = torch.ones(4, 3, dtype=torch.bool)
    assert token_weights(marked, keep, 1.0).tolist() == [[0.7, 0.5, 0.5], [0.0] * 3, [0.65, 0.5, 0.5], [0.5, 0.5, 0.5]]


def test_trailing_records_keep_restores_every_record_and_the_card_names_the_rule(tmp_path):
    """In the trained scenario some records trail their expert: drop (the default) matches the brute force that weighs
    them 0 (the exactness tests above), keep the brute force that weighs them as any other."""
    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "keep"), batch_tokens=150, dtype="float64",
                                   token_weights="expert_lead", trailing_records="keep")
    output = run_recipe(recipe, progress=False)
    assert card_front(output)["featcal"]["settings"]["trailing_records"] == "keep"
    _check(scenario, output, norms=False, drop=False)


def test_an_expert_with_one_record_has_no_spread_to_print(tmp_path, capsys):
    """`samples: 1`: the lead's margin is counted over records, so one record has none; the log and the card say so instead of
    "± 0.000" (the sign alone decides whether the merge teaches it, as documented)."""
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4, dtype="float64")
    path = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), samples=1, token_weights="expert_lead")
    output = run_recipe(path, progress=False)
    line = next(line for line in capsys.readouterr().err.splitlines() if "tokens weighed by the expert's lead" in line)
    assert line.count("; one record, so no spread)") == 2 and "± 0.000" not in line, line
    card = (output / "README.md").read_text()
    assert card.count(" (one record, so no spread)") == 2 and "± 0;" not in card and "± 0\n" not in card
