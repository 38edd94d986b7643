"""Many ranks, same weights (issue 19): 2 gloo ranks on CPU against one process, a dead rank, resume on another world size.

Each world is launched as torchrun launches one (env:// variables, one thread
per rank) with bounded timeouts. Shards are uneven: 7 records per expert (not
divisible by 2) and one expert with a single record, so rank 1 owns none of
it. ΔW = W* − W_mer must match the one-process run to 1e-10 relative in float64.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from distributed_world import launch
from test_exactness import delta_error, read_weights

from featcal_llm.engine.distributed import group_owners, shard_indices
from featcal_llm.pipeline import run_recipe

EQUAL = 1e-10


def worst_delta(ours, reference, merged_dir) -> float:
    a, b, merged = read_weights(ours), read_weights(reference), read_weights(merged_dir)
    changed = {n for n in b if not torch.equal(b[n], merged[n])}
    assert changed and changed == {n for n in a if not torch.equal(a[n], merged[n])}
    return max(delta_error(a[n], b[n], merged[n]) for n in changed)


def test_shards_are_token_balanced_deterministic_and_complete():
    lengths = [50, 10, 40, 30, 30, 5, 20]
    shards = [shard_indices(lengths, rank, 3) for rank in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(7))
    assert [sum(lengths[i] for i in s) for s in shards] == [65, 60, 60]  # 50+10+5, 40+20, 30+30 (longest first)
    assert shards == [shard_indices(lengths, rank, 3) for rank in range(3)]
    assert shard_indices([12], 1, 2) == []  # fewer records than ranks: rank 1 owns none


def test_groups_are_owned_by_cost(uneven):
    from featcal_llm.engine.plan import CalibrationPlan
    from featcal_llm.family.architectures import architecture_for, select_projections
    from featcal_llm.engine.objectives import FeatCal
    from featcal_llm.maths.objective import Hyperparameters
    from transformers import AutoConfig, AutoModelForCausalLM

    scenario, _ = uneven
    config = AutoConfig.from_pretrained(scenario.base)
    architecture = architecture_for(config, "x")
    plan = CalibrationPlan(architecture, select_projections(architecture, None, "x"), True, True, FeatCal(Hyperparameters(1e-3, 0.3, 0.5, 1e-8)))
    layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    owners = group_owners(plan, layer, 2)
    widest = max(plan.groups(), key=lambda g: layer.get_submodule(g.projections[0]).in_features).name
    assert owners[widest] == 0 and set(owners.values()) == {0, 1}
    assert all(rank == 1 for name, rank in owners.items() if name != widest)  # d_ff³ > 3 · d³ here


def test_two_ranks_give_the_one_process_weights(uneven, tmp_path):
    scenario, single = uneven
    ranks = launch(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out")), 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert "calibrated checkpoint written" in ranks[0].stdout and ranks[1].stdout == "" and ranks[1].stderr == ""
    worst = worst_delta(tmp_path / "out", single, scenario.root / "merged")
    print(f"2 ranks vs 1 process: worst relative ΔW difference {worst:.2e}")
    assert worst <= EQUAL
    ours, theirs = (json.loads((d / "featcal_drift.json").read_text()) for d in (tmp_path / "out", single))
    assert ours["probe_tokens"] == theirs["probe_tokens"] and ours["probe_records"] == theirs["probe_records"]
    for row, reference in zip(ours["layers"], theirs["layers"]):
        for kind in ("merged", "calibrated"):
            assert row[kind] == pytest.approx(reference[kind], rel=1e-9)
    again = launch(scenario.write_recipe(tmp_path / "again.yaml", output=str(tmp_path / "again")), 2, tmp_path / "logs-again")
    assert [r.returncode for r in again] == [0, 0], again
    weights = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert weights and all((tmp_path / "again" / name).read_bytes() == (tmp_path / "out" / name).read_bytes() for name in weights)


def test_two_ranks_refit_the_head_as_one_process_does(uneven, tmp_path):
    """`head:`: each rank adds its shard's final features; the head and the output divergence match one process."""
    scenario, _ = uneven
    single = run_recipe(scenario.write_recipe(tmp_path / "s.yaml", output=str(tmp_path / "single"), head=True), progress=False)
    ranks = launch(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), head=True), 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    ours, theirs, merged = (read_weights(d) for d in (tmp_path / "out", single, scenario.root / "merged"))
    assert delta_error(ours["lm_head.weight"], theirs["lm_head.weight"], merged["lm_head.weight"]) <= EQUAL
    assert worst_delta(tmp_path / "out", single, scenario.root / "merged") <= EQUAL
    ours, theirs = (json.loads((d / "featcal_drift.json").read_text()) for d in (tmp_path / "out", single))
    for kind in ("merged", "calibrated"):
        assert ours["output_divergence"][kind] == pytest.approx(theirs["output_divergence"][kind], rel=1e-9)


def test_a_rank_whose_statistics_are_skipped_breaks_equality(uneven, tmp_path):
    """The guard of the test above: drop rank 1's statistics from the reduction and the weights move far beyond 1e-10."""
    scenario, single = uneven
    ranks = launch(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out")), 2, tmp_path / "logs", "--skip-rank", "1")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert worst_delta(tmp_path / "out", single, scenario.root / "merged") > 1e-4


def test_tuned_run_on_two_ranks_chooses_and_gives_what_one_process_does(uneven, tmp_path):
    scenario, _ = uneven
    tuned = {"lambda": [1e-3, 1e-1], "alpha": [0.3, 0.8], "rho": 0.5, "tune": {"holdout": 0.3}}
    data = yaml.safe_load(scenario.recipe.read_text())["featcal"]["data"]
    data[str(scenario.experts["expert2"])]["samples"] = 7  # a held-out split needs 2 records on each side
    single = run_recipe(scenario.write_recipe(tmp_path / "one.yaml", output=str(tmp_path / "one"), data=data, **tuned), progress=False)
    ranks = launch(scenario.write_recipe(tmp_path / "two.yaml", output=str(tmp_path / "two"), data=data, **tuned), 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert worst_delta(tmp_path / "two", single, scenario.root / "merged") <= EQUAL
    ours, theirs = (json.loads((d / "featcal_tuning.json").read_text()) for d in (tmp_path / "two", single))
    assert json.dumps(ours, sort_keys=True).count("criterion") == json.dumps(theirs, sort_keys=True).count("criterion")
    drift, reference = (json.loads((d / "featcal_drift.json").read_text()) for d in (tmp_path / "two", single))
    assert drift["probe_tokens"] == reference["probe_tokens"]
    for row, expected in zip(drift["layers"], reference["layers"]):  # held-out drift: every rank's sums reduced
        assert row["calibrated"] == pytest.approx(expected["calibrated"], rel=1e-9)
    for a, b in zip(ours["layers"], theirs["layers"]):
        assert {k: v for k, v in a["chosen"].items() if k != "criterion"} == {k: v for k, v in b["chosen"].items() if k != "criterion"}
        assert a["chosen"]["criterion"] == pytest.approx(b["chosen"]["criterion"], rel=1e-9)


def test_bad_input_is_one_line_from_rank_0_and_nothing_is_written(uneven, tmp_path):
    scenario, _ = uneven
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), alpha=2.5)
    ranks = launch(recipe, 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [2, 2]
    assert ranks[0].stderr.strip().count("\n") == 0 and ranks[0].stderr.startswith("featcal-llm: error:") and "alpha" in ranks[0].stderr
    assert ranks[1].stderr == "" and ranks[1].stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "r.yaml"]


def test_ranks_that_see_different_recipes_refuse_to_start(uneven, tmp_path):
    scenario, _ = uneven
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    other = scenario.write_recipe(tmp_path / "other.yaml", output=str(tmp_path / "out"), alpha=0.4)
    ranks = launch(recipe, 2, tmp_path / "logs", "--recipe-for", f"1:{other}")
    assert [r.returncode for r in ranks] == [2, 2]
    assert ranks[0].stderr.strip().splitlines()[-1] == (
        "featcal-llm: error: ranks [1] see a different recipe, data, models or settings than rank 0 (run fingerprints differ)"
    )
    assert ranks[1].stderr == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "other.yaml", "r.yaml"]


def test_generated_data_is_written_by_rank_0_and_calibrates_as_in_one_process(uneven, tmp_path):
    """`generate:` under torchrun: rank 0 samples (once), every rank calibrates on the same ids as one process does."""
    scenario, _ = uneven
    expert = str(scenario.experts["expert0"])
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["data"][expert] = {"generate": {"samples": 6, "max_new_tokens": 8, "chat_template": "off"}}
    paths = {}
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        recipe["featcal"]["output"] = str(tmp_path / name / "out")
        paths[name] = tmp_path / name / "r.yaml"
        paths[name].write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_recipe(paths["one"], progress=False)
    ranks = launch(paths["two"], 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert ranks[0].stderr.count("featcal-llm: generation: expert") == 1 and ranks[1].stderr == ""
    generated = lambda name: (tmp_path / name / "featcal_generated" / "expert0.jsonl").read_text()  # noqa: E731
    assert generated("one") == generated("two")
    assert worst_delta(tmp_path / "two" / "out", tmp_path / "one" / "out", scenario.root / "merged") <= EQUAL


def test_a_generating_expert_without_tokenizer_files_stops_both_ranks_in_one_line(uneven, tmp_path):
    import shutil

    scenario, _ = uneven
    expert = tmp_path / "expert0"
    shutil.copytree(scenario.experts["expert0"], expert)
    for item in expert.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            item.unlink()
    recipe = yaml.safe_load(scenario.recipe.read_text().replace(str(scenario.experts["expert0"]), str(expert)))
    recipe["featcal"]["data"][str(expert)] = {"generate": {"samples": 4, "max_new_tokens": 6}}
    recipe["featcal"].update(output=str(tmp_path / "out"), merged=str(tmp_path / "merged"))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    ranks = launch(path, 2, tmp_path / "logs", timeout=100)
    assert [r.returncode for r in ranks] == [2, 2], ranks
    lines = ranks[0].stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featcal-llm: error:") and f"expert {expert}" in lines[0] and "no tokenizer files" in lines[0]
    assert ranks[1].stderr == ""


def _two_ranks_and_one(uneven, tmp_path, **featcal) -> list[dict]:
    """The card's featcal front matter of a two-rank run and of one process, both with `featcal` keys; their updates agree."""
    scenario, _ = uneven
    single = run_recipe(scenario.write_recipe(tmp_path / "s.yaml", output=str(tmp_path / "single"), **featcal), progress=False)
    ranks = launch(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **featcal), 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert worst_delta(tmp_path / "out", single, scenario.root / "merged") <= EQUAL
    return [json.loads((d / "featcal_weights.json").read_text()) for d in (tmp_path / "out", single)]  # the run's record


def test_two_ranks_weigh_the_experts_by_coverage_as_one_process_does(uneven, tmp_path):
    """`expert_weights: coverage`: each rank scores its shard of the sample and the sums are added, so the NLLs (and weights) agree."""
    front = _two_ranks_and_one(uneven, tmp_path, expert_weights="coverage")
    ours, theirs = front[0]["coverage_nll"], front[1]["coverage_nll"]
    assert set(ours) == set(theirs) and len(ours) == 4  # three experts and the base
    for model, row in theirs.items():
        assert ours[model] == pytest.approx(row, rel=1e-12)


def test_two_ranks_weigh_the_tokens_by_expert_lead_as_one_process_does(uneven, tmp_path):
    """`token_weights: expert_lead`: each rank weighs its shard's tokens, scaled by the sums over both ranks."""
    front = _two_ranks_and_one(uneven, tmp_path, token_weights="expert_lead")
    assert front[0]["expert_lead"] == front[1]["expert_lead"] and len(front[0]["expert_lead"]) == 3


def test_two_ranks_leave_out_the_records_one_process_leaves_out_of_refine(uneven, tmp_path):
    """`refine:` runs on rank 0 with every record, less those weighing 0 (`trailing_records: drop`): the ranks gather
    which those are from their shards, so refine trains on the records one process trains on."""
    scenario, _ = uneven
    data = yaml.safe_load(scenario.recipe.read_text())["featcal"]["data"]
    data[str(scenario.experts["expert2"])]["samples"] = 7  # a held-out split needs 2 records on each side
    keys = {"data": data, "token_weights": "expert_lead", "trailing_experts": "keep",
            "refine": {"steps": 2, "eval_every": 2, "params": "full", "precision": "float32"}}
    single = run_recipe(scenario.write_recipe(tmp_path / "s.yaml", output=str(tmp_path / "single"), **keys), progress=False)
    ranks = launch(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **keys), 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    ours, theirs = (json.loads((d / "featcal_refine.json").read_text()) for d in (tmp_path / "out", single))
    assert ours["records_left_out"] == theirs["records_left_out"] and ours["records"] == theirs["records"]
    assert sum(theirs["records_left_out"].values()) > 0, theirs["records_left_out"]
    # the held-out records the experts trail on, marked on each rank's shard of the probe and gathered, are one process's
    assert ours.get("held_out_left_out") == theirs.get("held_out_left_out") and ours["held_out_kl"] == theirs["held_out_kl"]
    assert sum(theirs.get("held_out_left_out", {}).values()) > 0, theirs.get("held_out_left_out")  # a check that can fail


def test_a_stack_on_two_ranks_gives_the_one_process_weights_and_leaves_no_stage_behind(uneven, tmp_path):
    """`method: [regmean++, featcal]` on two ranks: both stages as one process runs them, and the first stage's output
    and saved layers (kept through the second stage, for a rerun) are removed once the stack has finished."""
    scenario, _ = uneven
    stack = {"method": ["regmean++", "featcal"], "reduction": 0.5, "norms": False, "head": False, "trailing_experts": "keep"}
    single = run_recipe(scenario.write_recipe(tmp_path / "single.yaml", output=str(tmp_path / "single"), **stack), progress=False)
    ranks = launch(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), **stack), 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert worst_delta(tmp_path / "out", single, scenario.root / "merged") <= EQUAL
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_gpu_named_by_index_under_torchrun_is_refused_before_any_model_loads(monkeypatch):
    """Every rank would compute on that one GPU, which NCCL refuses at its first collective, after the loading."""
    from featcal_llm.engine.distributed import rank_device
    from featcal_llm.errors import FeatCalError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(FeatCalError, match=r"^featcal\.device: cuda:1 under torchrun would put every rank on that one GPU; "
                                           r"write cuda \(each rank takes its LOCAL_RANK's GPU\)"):
        rank_device(torch.device("cuda", 1))
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_device(torch.device("cuda", 1)) == torch.device("cuda", 1)  # one process: the GPU it names


def test_run_s_log_option_has_a_spelling_torchrun_passes_on():
    """`torchrun ... -m featcal_llm run r.yaml --log run.log` stops in torchrun's parser ('ambiguous option: --log could
    match --log-dir, ...'): argparse matches abbreviations across the script's arguments too. `--log-file` passes."""
    from pathlib import Path

    from torch.distributed.run import get_args_parser

    from featcal_llm.cli import run

    words = ["run", "r.yaml", "--log-file", "run.log"]
    assert get_args_parser().parse_args(["--nproc-per-node", "2", "-m", "featcal_llm", *words]).training_script_args == words
    assert run.make_context("run", words[1:]).params["log_file"] == Path("run.log")
