"""Cheaper CPU statistics keep their precision and batching invariance (issue 11).

Grams are built from their lower block triangle on a CPU (`stats.accumulate_gram`),
float64 products stay float64: the result must equal the full product and
batch 1 must agree with mixed lengths on the update ΔW = W* − W_mer.
"""

from __future__ import annotations

import torch
from test_exactness import read_weights, relative_error

import featcal_llm.stats as stats
from featcal_llm.pipeline import run_recipe
from featcal_llm.stats import accumulate_gram, gram_blocks


def test_blocked_gram_equals_the_full_product_and_is_symmetric():
    assert gram_blocks(64) == 1 and gram_blocks(576) == 3 and gram_blocks(1536) == 8 and gram_blocks(14336) == 8
    for dim in (64, 577, 1536):
        x = torch.randn(300, dim, generator=torch.Generator().manual_seed(dim))
        total = torch.zeros(dim, dim, dtype=torch.float64)
        for rows in x.split(70):
            accumulate_gram(total, rows)
        exact = x.double().T @ x.double()
        assert torch.equal(total, total.T)
        assert float((total - exact).abs().max()) <= 1e-12 * float(exact.abs().max()), dim


def _delta_error(first: dict, second: dict, merged: dict) -> float:
    return max(relative_error(second[n] - merged[n], first[n] - merged[n]) for n in first if not torch.equal(first[n], merged[n]))


def test_batch_one_and_mixed_lengths_agree_on_the_update(merged_scenario, tmp_path, monkeypatch):
    """The tiny scenario's groups (d = 64, 128) are below the blocking threshold: force 4 blocks, and compare with 1."""
    def run(name: str, batch_tokens: int) -> dict:
        recipe = merged_scenario.write_recipe(tmp_path / f"{name}.yaml", output=str(tmp_path / name), batch_tokens=batch_tokens)
        return read_weights(run_recipe(recipe, progress=False))

    merged = read_weights(merged_scenario.root / "merged")
    whole = run("whole", 4096)
    monkeypatch.setattr(stats, "gram_blocks", lambda dim: 4)
    single, mixed = run("one", 1), run("mixed", 4096)
    worst = _delta_error(single, mixed, merged)
    blocked_vs_whole = _delta_error(whole, mixed, merged)
    print(f"ΔW, batch 1 vs mixed lengths: {worst:.2e}; blocked vs whole Grams: {blocked_vs_whole:.2e}")
    assert worst <= 1e-5 and blocked_vs_whole <= 1e-9
