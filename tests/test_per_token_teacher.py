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


def test_no_token_handed_over_is_the_product_s_run(scenario, tmp_path, monkeypatch):
    import featcal_llm.pipeline as pipeline

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    ours = _run(scenario, tmp_path / "a")
    monkeypatch.setattr(pipeline, "_weights", pipeline._weights)  # undone after the test
    monkeypatch.setattr(pipeline, "write_report", pipeline.write_report)
    monkeypatch.setattr(pipeline, "drift_report", pipeline.drift_report)
    per_token_teacher.install(lambda roots, batches: [torch.zeros_like(b.keep) for b in batches])
    theirs = _run(scenario, tmp_path / "b")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
