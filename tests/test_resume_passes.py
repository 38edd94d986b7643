"""The passes before the layers are saved by rank 0 and reused by a resume on any number of ranks (issue 56).

A run stopped after its first layer on one process resumes on two ranks (and one stopped on two ranks resumes in one
process): the resume says it reused the saved passes, runs none of them again, and gives the uninterrupted
one-process weights to 1e-10 (float64; the remaining layers' statistics are summed over another sharding).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from distributed_world import launch
from test_distributed import EQUAL, worst_delta

import featcal_llm.engine.calibrate as calibrate_module
from featcal_llm.engine.distributed import Single
from featcal_llm.engine.passes import by_batch, by_record, record_rows
from featcal_llm.engine.streams import make_batches
from featcal_llm.pipeline import run_recipe

REUSED = "expert and token weights: reused from the saved progress"


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """Three experts of 7, 7 and 1 records, float64, token weights by expert lead; merged, and run once uninterrupted."""
    from scenario import build_scenario

    scenario = build_scenario(tmp_path_factory.mktemp("passes"), experts=3, layers=2, samples=7, words=(4, 10), dtype="float64")
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["data"][str(scenario.experts["expert2"])]["samples"] = 1
    recipe["featcal"].update(dtype="float64", norms=True, batch_tokens=150, token_weights="expert_lead", trailing_experts="merge")
    scenario.recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
    single = run_recipe(scenario.write_recipe(scenario.root / "single.yaml", output=str(scenario.root / "single")), progress=False)
    return scenario, single


@pytest.fixture
def one_thread():
    """The thread count of one rank of a test world (it is part of the run fingerprint): this process as one rank."""
    from featcal_llm.engine.resume import source_digest

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    source_digest.cache_clear()  # the code as the ranks launched next will read it
    yield
    torch.set_num_threads(threads)


def _staged_layers(output) -> int:
    return json.loads((output.with_name(f".{output.name}.featcal-partial") / "state.json").read_text())["completed_layers"]


def test_a_run_stopped_on_one_process_resumes_on_two_ranks_reusing_its_passes(uneven, tmp_path, monkeypatch, capsys, one_thread):
    scenario, single = uneven
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    real = calibrate_module.calibrate_layer

    def crash(ctx, layer, *args, **kwargs):
        if layer == 1:
            raise RuntimeError("simulated crash")
        return real(ctx, layer, *args, **kwargs)

    monkeypatch.setattr(calibrate_module, "calibrate_layer", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_recipe(recipe, progress=False)
    monkeypatch.setattr(calibrate_module, "calibrate_layer", real)
    assert _staged_layers(tmp_path / "out") == 1 and REUSED not in capsys.readouterr().err
    ranks = launch(recipe, 2, tmp_path / "logs")
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert REUSED in ranks[0].stderr and "resuming from" in ranks[0].stderr, ranks[0].stderr[-2000:]
    assert "weighing each expert's tokens" not in ranks[0].stderr  # the token pass did not run again
    worst = worst_delta(tmp_path / "out", single, scenario.root / "merged")
    print(f"1 process, then 2 ranks: worst relative ΔW difference from the uninterrupted run {worst:.2e}")
    assert worst <= EQUAL


def test_a_run_stopped_on_two_ranks_resumes_in_one_process_reusing_its_passes(uneven, tmp_path, capsys, one_thread):
    scenario, single = uneven
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    ranks = launch(recipe, 2, tmp_path / "logs", "--kill-at", "1:1", timeout=120)
    assert ranks[1].returncode == -9 and ranks[0].returncode != 0
    assert _staged_layers(tmp_path / "out") == 1
    run_recipe(recipe, progress=False)
    log = capsys.readouterr().err
    assert REUSED in log and "weighing each expert's tokens" not in log, log[-2000:]
    worst = worst_delta(tmp_path / "out", single, scenario.root / "merged")
    print(f"2 ranks, then 1 process: worst relative ΔW difference from the uninterrupted run {worst:.2e}")
    assert worst <= EQUAL


class TwoRanks(Single):
    """Rank `rank` of 2 as far as sharding goes (no process group: what `record_rows` reads of the communicator)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.world = rank, 2

    def shard(self, sequences):
        from featcal_llm.engine.distributed import shard_indices

        return {task: [seqs[i] for i in shard_indices([len(s) for s in seqs], self.rank, 2)] for task, seqs in sequences.items()}


def test_records_go_back_to_the_same_rows_on_any_sharding():
    """Values saved record by record from one sharding's batches land on the same records' tokens in another's."""
    lengths = [5, 9, 3, 9, 1, 7, 4]
    sequences = {"a": [[10 + i] * n for i, n in enumerate(lengths)]}
    values = [torch.arange(n, dtype=torch.float64) + 100 * i for i, n in enumerate(lengths)]  # record i's token t: 100 i + t

    def batches_of(comm):
        return {task: make_batches(seqs, 20, pad_id=0) for task, seqs in comm.shard(sequences).items()}

    one = batches_of(Single())
    rows = record_rows(Single(), sequences, 20)
    saved = by_record(by_batch(values, one["a"], rows["a"]), one["a"], rows["a"])
    assert sorted(saved) == list(range(7)) and all(torch.equal(saved[i], values[i]) for i in range(7))
    for rank in (0, 1):
        comm = TwoRanks(rank)
        batches, rows = batches_of(comm), record_rows(comm, sequences, 20)
        for batch, batch_values, indices in zip(batches["a"], by_batch(values, batches["a"], rows["a"]), rows["a"]):
            for row, index in enumerate(indices):
                assert batch.input_ids[row, 0] == 10 + index  # the row is the record it is said to be
                assert torch.equal(batch_values[row][batch.keep[row]], values[index])
                assert not batch_values[row][~batch.keep[row]].any()


def test_progress_saved_on_another_thread_count_names_it_and_how_to_resume(tmp_path, monkeypatch):
    """torchrun gives each rank one thread (OMP_NUM_THREADS=1) unless told otherwise, and one process takes every core:
    a one-process rerun of a stopped torchrun run starts over (the thread count rounds the CPU's sums otherwise), and
    the warning says so and how to resume instead of naming only 'a different recipe, data, models or settings'."""
    import torch

    from featcal_llm.engine.resume import StagingArea
    from featcal_llm.errors import collected_warnings

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    staging = StagingArea(tmp_path / "partial", "under torchrun")
    staging.commit(0, {"w": torch.zeros(2)})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with collected_warnings() as found:
        again = StagingArea(tmp_path / "partial", "in one process")
    assert again.completed == 0
    assert found == [f"saved progress in {tmp_path / 'partial'} was made with 1 thread a process, this run has 2; starting "
                     "over (to resume it instead, stop this run and rerun with OMP_NUM_THREADS=1)"]
    with collected_warnings() as found:  # the same thread count: the general line
        StagingArea(tmp_path / "partial", "another recipe")
    assert found == [f"saved progress in {tmp_path / 'partial'} was made with a different recipe, data, models or settings; "
                     "starting over"]
