"""refine: on two gloo ranks, with held-out records left out of its checks (`trailing_records: drop`) in numbers that
differ from expert to expert: each rank marks its shard of the held-out records and the marks are summed, so rank 0
leaves out and checks the records one process does and refines to the weights one process writes.

tests/test_distributed.py's refine test sees records left out too, but its checks keep the closed form (step 0), so
the refined weights themselves were never compared; here the last check is kept."""

from __future__ import annotations

import json

import pytest
import yaml
from distributed_world import launch
from scenario import build_scenario
from test_distributed import EQUAL, worst_delta

from featcal_llm.pipeline import run_recipe

SEED = 2  # a split whose held-out records left out differ by expert and whose last check is kept (asserted below)
KEYS = {"token_weights": "expert_lead", "trailing_experts": "keep", "seed": SEED,
        "refine": {"steps": 4, "eval_every": 2, "lr": 1e-4, "params": "full", "precision": "float32"}}


@pytest.fixture(scope="module")
def nine(tmp_path_factory):
    """Three experts of 9 records (2 held out each, so shards of one record a rank), two layers, float64."""
    scenario = build_scenario(tmp_path_factory.mktemp("dist-refine"), experts=3, layers=2, samples=9, words=(4, 10), dtype="float64")
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"].update(dtype="float64", norms=True, batch_tokens=150)
    scenario.recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return scenario


def test_two_ranks_leave_out_check_and_refine_as_one_process(nine, tmp_path):
    single = run_recipe(nine.write_recipe(tmp_path / "s.yaml", output=str(tmp_path / "single"), **KEYS), progress=False)
    ranks = launch(nine.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "two"), **KEYS), 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    theirs = json.loads((single / "featcal_refine.json").read_text())
    left_out = theirs["held_out_left_out"]
    assert len(set(left_out.values())) > 1 and 0 < max(left_out.values()) < sum(theirs["held_out_records"].values()), left_out
    assert theirs["chosen_step"] == theirs["steps_run"] > 0, theirs["chosen_step"]  # the refined weights are written
    # the counts, every check's per-expert KL and the kept step: the report is one process's, byte for byte
    assert (tmp_path / "two" / "featcal_refine.json").read_bytes() == (single / "featcal_refine.json").read_bytes()
    # the weights: the closed form's reductions over two ranks round otherwise (tests/test_distributed.py), not bit for bit
    worst = worst_delta(tmp_path / "two", single, nine.root / "merged")
    print(f"refined on 2 ranks vs 1 process: worst relative ΔW difference {worst:.2e}")
    assert worst <= EQUAL
