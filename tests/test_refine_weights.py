"""`refine.token_weights: expert_lead`: each judged token's KL weighed as the closed form weighs the token (its
expert's lead over the merge), on test_refine.py's far scenario."""

from __future__ import annotations

import json

import torch
import test_refine
from test_refine import REFINE, run

far_scenario = test_refine.far_scenario  # its fixture, under the name the tests ask for



def test_lead_weighted_tokens_weigh_each_kl_as_the_closed_form_weighs_the_token(far_scenario, monkeypatch):
    """`refine.token_weights: expert_lead`: with every weight 1 the loss is the token mean (the same bytes as `equal`);
    with the closed form's weights the refinement lands elsewhere, and its record says which it ran."""
    import featcal_llm.pipeline as pipeline

    lead = {**REFINE, "token_weights": "expert_lead"}
    plain = run(far_scenario, "lead-plain", token_weights="expert_lead", refine=REFINE)
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "record_token_weights", lambda tokens, keep: {
            task: [torch.ones(len(values), dtype=torch.float64) for index, values in enumerate(tokens["records"][task]) if index in keep[task]]
            for task in keep})
        ones = run(far_scenario, "lead-ones", token_weights="expert_lead", refine=lead)
    assert (ones / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    weighted = run(far_scenario, "lead-weighted", token_weights="expert_lead", refine=lead)
    record = json.loads((weighted / "featcal_refine.json").read_text())
    assert record["token_weights"] == "expert_lead" and record["chosen_step"] > 0
    assert (weighted / "model.safetensors").read_bytes() != (plain / "model.safetensors").read_bytes()
    assert "each weighed as the closed form weighs it" in (weighted / "README.md").read_text()


def test_record_token_weights_are_the_closed_forms_and_leave_dropped_records_out():
    from featcal_llm.engine.passes import record_token_weights

    advantages = [torch.tensor([0.0, 0.4, 0.2], dtype=torch.float64), torch.tensor([0.1, 0.0], dtype=torch.float64),
                  torch.tensor([0.3], dtype=torch.float64)]
    weights = record_token_weights({"records": {"a": advantages}, "scales": {"a": 2.0}}, {"a": frozenset({0, 2})})
    assert [w.tolist() for w in weights["a"]] == [[0.5, 0.5 + 0.5 * 0.8, 0.5 + 0.5 * 0.4], [0.5 + 0.5 * 0.6]]


def test_lead_weighted_refinement_needs_the_lead_pass(far_scenario, tmp_path):
    from click.testing import CliRunner

    from featcal_llm.cli import main

    recipe = far_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), refine={"token_weights": "expert_lead"})
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, str(recipe)])
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert result.exit_code == 2 and len(errors) == 1, result.output
        assert errors[0].endswith("featcal.refine.token_weights: expert_lead weighs each token as the closed form does, by the lead "
                                  "its pass measures; featcal.token_weights is equal")
