"""The per-token-teacher prototype (studies/per_token_teacher.py): with no token handed over it is the product's run,
bit for bit, so what it measures comes from the teachers it swaps, not from the split into two tasks."""

from __future__ import annotations

import pytest
import torch
from test_coverage import trained_scenario
from test_exactness import read_weights

from featcal_llm.pipeline import run_recipe
from studies import per_token_teacher


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    return trained_scenario(tmp_path_factory.mktemp("pt") / "scenario", "llama", (24, 6))


def _run(scenario, path, **featcal):
    return read_weights(run_recipe(scenario.write_recipe(path / "r.yaml", output=str(path / "out"), batch_tokens=150, dtype="float64",
                                                         token_weights="expert_lead", **featcal), progress=False))


@pytest.mark.parametrize("head_only", [False, True])
def test_no_token_handed_over_is_the_product_s_run(scenario, tmp_path, monkeypatch, head_only):
    import featcal_llm.engine.calibrate as calibrate_module
    import featcal_llm.pipeline as pipeline
    import featcal_llm.stages.outputs as outputs
    from test_head import HEAD

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    ours = _run(scenario, tmp_path / "a", head=HEAD)
    for module, name in ((pipeline, "_weights"), (outputs, "write_report"), (outputs, "drift_report"), (calibrate_module, "calibrate_head")):
        monkeypatch.setattr(module, name, getattr(module, name))  # undone after the test
    per_token_teacher.install(lambda roots, batches: [torch.zeros_like(b.keep) for b in batches], head_only=head_only)
    theirs = _run(scenario, tmp_path / "b", head=HEAD)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
