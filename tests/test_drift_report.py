"""The drift report and the search's `output` criterion, each against whole-model forward passes of the family's own
model (Llama, and Gemma-2 with its logit soft-capping)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from featcal_llm.engine.tuning import split_holdout
from featcal_llm.pipeline import run_recipe

SINGLE = {"lambda": [1e-3, 1e-2], "alpha": 0.3, "rho": 0.5}  # two candidates: a search (one would be a fixed value)


@pytest.mark.parametrize("head", [None, True])
def test_drift_report_matches_whole_model_forward_passes(merged_scenario, tmp_path, head):
    """featcal_drift.json of a fixed run against transformers' own full models on the same probe records; with the LM
    head re-fitted, the calibrated model's divergence is through its own head."""
    from test_exactness import calibration_sequences, load

    from featcal_llm.engine.drift import drift_sample

    keys = {} if head is None else {"head": head}
    output = run_recipe(merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **keys), progress=False)
    report = json.loads((output / "featcal_drift.json").read_text())
    assert report["probe"] == "calibration subsample" and (output / "featcal_drift.png").stat().st_size > 0
    models = {"merged": load(merged_scenario.root / "merged"), "calibrated": load(output)}
    heads = [model.get_output_embeddings().weight for model in models.values()]
    assert torch.equal(*heads) != bool(head)  # head: true re-fits it
    checked = 0
    for name, sequences in drift_sample(calibration_sequences(merged_scenario, 16, 64)).items():
        key = str(merged_scenario.experts[name])
        expert = load(merged_scenario.experts[name])
        for sequence in sequences:  # one probe record per expert here, so no padding and no token averaging across records
            ids = torch.tensor([sequence])
            with torch.no_grad():
                reference = expert(ids, output_hidden_states=True)
                for kind, model in models.items():
                    ours = model(ids, output_hidden_states=True)
                    for layer in range(len(report["layers"]) - 1):  # the last entry of hidden_states is after the final norm
                        h, e = ours.hidden_states[layer + 1].double(), reference.hidden_states[layer + 1].double()
                        expected = float((h - e).norm() / e.norm())
                        assert abs(report["layers"][layer][kind][key] - expected) <= 1e-5 * expected, (kind, layer)
                    log_p, log_q = reference.logits.double().log_softmax(-1), ours.logits.double().log_softmax(-1)
                    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
                    assert abs(report["output_divergence"][kind][key] - kl) <= 1e-4 * kl, kind
                    checked += 1
    assert checked == 6
    assert [row["layer"] for row in report["layers"]] == list(range(len(report["layers"])))  # layer 0 is the first
    merged_drift = [row["merged"][key] for row in report["layers"]]
    assert all(row["calibrated"][key] < row["merged"][key] for row in report["layers"]), merged_drift


def test_output_criterion_is_the_geometric_mean_of_each_experts_kl_from_full_model_forwards(merged_scenario, tmp_path):
    """The last layer's winning `output` criterion against transformers' full models on the held-out records.

    After the last layer the winner's held-out stream is the calibrated model's, so its criterion is the next-token
    KL(expert i ‖ calibrated) per expert over its held-out tokens, combined by the geometric mean (float32 models:
    5e-9 apart). The experts' KLs differ by a few per cent, so their arithmetic mean lies about 1e-4 away: ten times
    the tolerance is the bar that tells the two means apart on every CPU (at 100 times one CI machine fell just short).
    """
    from test_exactness import calibration_sequences, load

    recipe = merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), tune={"criterion": "output"}, **SINGLE)
    output = run_recipe(recipe, progress=False)
    chosen = json.loads((output / "featcal_tuning.json").read_text())["layers"][-1]["chosen"]["criterion"]
    sequences = {str(merged_scenario.experts[name]): records for name, records in calibration_sequences(merged_scenario, 16, 64).items()}
    _, held_out = split_holdout(sequences, 0.25, 0, "test")  # drawn per expert as the recipe names it
    calibrated = load(output)
    kls = []
    for name, records in held_out.items():
        expert = load(name)
        total = tokens = 0.0
        for sequence in records:  # one record at a time: no padding
            ids = torch.tensor([sequence])
            with torch.no_grad():
                log_p, log_q = expert(ids).logits.double().log_softmax(-1), calibrated(ids).logits.double().log_softmax(-1)
            total += float((log_p.exp() * (log_p - log_q)).sum())
            tokens += len(sequence)
        kls.append(total / tokens)
    geometric, arithmetic = math.exp(sum(map(math.log, kls)) / len(kls)), sum(kls) / len(kls)
    assert abs(chosen - geometric) <= 1e-6 * geometric, (chosen, geometric, kls)
    assert abs(arithmetic - geometric) > 1e-5 * geometric, kls  # 10 × the tolerance above


def test_geometric_mean_keeps_an_exact_match_finite_and_a_nan_a_nan():
    from featcal_llm.engine.tuned import geometric_mean

    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0, rel=1e-15)
    assert 0.0 < geometric_mean([0.0, 1.0]) < 1e-150  # a perfect candidate still wins, by a finite score
    assert math.isnan(geometric_mean([math.nan, 1.0]))  # a failed candidate stays failed (+inf in the search)


def test_output_divergence_follows_gemma2_logit_softcapping(tmp_path):
    """The drift report's next-token KL uses the family's own logits: Gemma-2 soft-caps them (a small cap makes it matter)."""
    from scenario import build_scenario
    from test_exactness import calibration_sequences, load

    from featcal_llm.engine.drift import drift_sample

    gemma = build_scenario(tmp_path / "gemma", experts=2, layers=1, samples=12, words=(4, 10), family="gemma2",
                           sliding_window=8, final_logit_softcapping=0.5)
    output = run_recipe(gemma.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out")), progress=False)
    report = json.loads((output / "featcal_drift.json").read_text())
    models = {"merged": load(gemma.root / "merged"), "calibrated": load(output)}
    for name, sequences in drift_sample(calibration_sequences(gemma, 12, 64)).items():
        key, expert = str(gemma.experts[name]), load(gemma.experts[name])
        for kind, model in models.items():
            total = tokens = 0.0
            for sequence in sequences:
                ids = torch.tensor([sequence])
                with torch.no_grad():
                    log_p = expert(ids).logits.double().log_softmax(-1)
                    log_q = model(ids).logits.double().log_softmax(-1)
                total += float((log_p.exp() * (log_p - log_q)).sum())
                tokens += len(sequence)
            assert abs(report["output_divergence"][kind][key] - total / tokens) <= 1e-4 * total / tokens, (kind, key)


def test_the_probe_is_an_evenly_spaced_share_of_each_experts_records():
    """spaced_sample takes records across the file (not its head), and the probe's share rounds up."""
    from featcal_llm.engine.drift import SAMPLE_SHARE, drift_sample, spaced_sample

    assert spaced_sample(list(range(32)), 2) == [0, 16] and spaced_sample(list(range(10)), 3) == [0, 3, 6]
    count = 20
    assert len(drift_sample({"a": [[i] for i in range(count)]})["a"]) == math.ceil(count * SAMPLE_SHARE) >= 2
