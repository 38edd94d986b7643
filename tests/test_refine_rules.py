"""`refine:`'s rules as pure functions: which check is kept (the mean, and no expert raised beyond two standard
errors), when progress is saved and which best stays on disk, and which tokens are judged. The stage end to end is
test_refine.py."""

from __future__ import annotations

import pytest
import torch


def _one_record(kl: float, tokens: int = 10) -> dict:
    return {"sums": [kl * tokens], "counts": [tokens]}


def test_the_kept_check_lowers_the_mean_and_raises_no_expert():
    from featcal_llm.engine.refine_rules import improves, mean_kl, raised

    def kept(check, best_kl):
        return improves(mean_kl(check), raised(check, before), best_kl)

    before = {"a": _one_record(0.2), "b": _one_record(0.1)}
    assert mean_kl(before) == pytest.approx(0.15)
    lower = {"a": _one_record(0.1), "b": _one_record(0.1)}
    assert kept(lower, 0.15) and raised(lower, before) == []
    bought = {"a": _one_record(0.01), "b": _one_record(0.11)}  # one record: any rise counts
    assert not kept(bought, 0.15) and raised(bought, before) == ["b"]
    assert not kept({"a": _one_record(0.19), "b": _one_record(0.1)}, 0.14)  # none above, the mean not below the best
    assert not improves(0.15, [], 0.15)  # a tie keeps the earlier (fewer steps) check
    assert mean_kl({"a": _one_record(0.2)}) == pytest.approx(0.2)  # one expert: its own KL, as logged
    assert mean_kl({"a": {"sums": [1.0, 6.0], "counts": [10, 30]}, "b": _one_record(0.4)}) == pytest.approx((0.175 + 0.4) / 2)


def test_why_no_check_was_kept_reads_the_checks():
    """Three reasons, each with its remedy: a check that traded an expert for the mean, a training KL that rose above
    the closed form's (the steps overshoot: a tenth of the learning rate), one that fell while the held-out KL did not."""
    from featcal_llm.engine.refine_rules import why_none_kept

    def check(step, held, train, above=()):
        return {"step": step, "held_out_kl": held, "train_kl": train, "above_closed_form": list(above)}

    start = {"step": 0, "held_out_kl": 0.10, "train_kl": 0.02, "per_expert": {}}
    traded = why_none_kept([start, check(5, 0.09, 0.01, ["b"]), check(10, 0.12, 0.01, ["a"]), check(15, 0.08, 0.01, ["a", "b"])], 1e-4)
    assert traded == "the checks at steps 5, 15 lowered the mean but raised a, b: here the steps fit some experts at another's cost"
    assert why_none_kept([start, check(5, 0.09, 0.01, ["b"])], 1e-4).startswith("the check at step 5 lowered the mean but raised b:")
    rose = why_none_kept([start, check(5, 0.11, 0.015), check(10, 0.2, 0.03)], 1e-4)
    assert rose == ("the training KL rose as well, from 0.02 (the closed form, on the first step's records) to 0.03 (the steps "
                    "before the last check): the steps overshoot; a smaller refine.lr (say 1e-05) may help")
    assert "rose as well" in why_none_kept([start, check(5, float("nan"), float("nan"))], 3e-4)  # diverged
    assert "say 3e-05" in why_none_kept([start, check(5, float("nan"), float("nan"))], 3e-4)
    # each step draws other records: a change within two standard errors of the difference (sd · √(1 + 1/5)) is noise
    noisy = {**check(10, 0.12, 0.03), "train_kl_sd": 0.01}
    assert why_none_kept([start, check(5, 0.11, 0.02), noisy], 1e-4) == (
        "the training KL did not move beyond its noise, from 0.02 (the closed form, on the first step's records) to 0.03 "
        "(the steps before the last check; ± 0.022 is its noise): the checks do not tell why; a smaller refine.lr (say "
        "1e-05) is the cheapest try")
    assert why_none_kept([start, check(5, 0.11, 0.02), {**noisy, "train_kl_sd": 0.004}], 1e-4).startswith(
        "the training KL rose as well, from 0.02 (the closed form, on the first step's records) to 0.03 (the steps before "
        "the last check; ± 0.0088 is its noise): the steps overshoot")  # 0.01 > 2 · 0.004 · √1.2 = 0.0088
    named = {**start, "per_expert": {"a": 0.1, "b": 0.1}}
    assert why_none_kept([named, check(5, 0.2, 0.01, ["a", "b"]), check(10, 0.3, 0.01, ["b", "a"])], 1e-4) == (
        "every check raised every expert's held-out KL above the closed form's beyond two standard errors: the steps "
        "overshoot; a smaller refine.lr (say 1e-05) may help")  # a diverging run, whatever its training KL's noise
    assert why_none_kept([named, check(5, 0.2, 0.01, ["a", "b"]), check(10, 0.3, 0.01, ["a"])], 1e-4).startswith("the training KL fell")
    fell = why_none_kept([start, check(5, 0.11, 0.03), check(10, 0.12, 0.019)], 1e-4)
    assert fell.startswith("the training KL fell, from 0.02") and fell.endswith(
        "while the held-out KL did not: the steps fit the training records without carrying to the held-out ones")


def test_a_rise_counts_only_beyond_two_standard_errors_over_the_records():
    """The rise of an expert's held-out KL is judged with its records as the unit: the token-weighted mean of the
    per-record differences against two standard errors of that ratio estimate (computed here with numpy)."""
    import numpy as np

    from featcal_llm.engine.refine_rules import raised

    counts = np.array([100, 80, 120, 60, 90, 110, 70, 100])
    before_kl = np.array([0.10, 0.30, 0.15, 0.25, 0.12, 0.20, 0.18, 0.22])  # per token, per record
    noise = np.array([0.02, -0.03, 0.025, -0.02, 0.03, -0.025, 0.015, -0.01])
    before = {"a": {"sums": list(before_kl * counts), "counts": list(counts)}}

    def bar(rise_per_token):
        after = before_kl + noise + rise_per_token
        diff = (after - before_kl) * counts
        mean = diff.sum() / counts.sum()
        residual = ((diff - mean * counts) ** 2).sum()
        r = len(counts)
        se = np.sqrt(residual / ((r - 1) * r)) / counts.mean()
        return {"a": {"sums": list(after * counts), "counts": list(counts)}}, mean, se

    for rise in (0.0, 0.005, 0.01, 0.02, 0.03, 0.05):
        check, mean, se = bar(rise)
        assert raised(check, before) == (["a"] if mean > 2 * se else []), (rise, mean, se)
    check, mean, se = bar(0.01)
    assert 0 < mean < 2 * se and raised(check, before) == []  # a rise within the noise: not raised
    check, mean, se = bar(0.05)
    assert mean > 2 * se and raised(check, before) == ["a"]


def test_saves_take_a_twentieth_of_the_time_and_write_each_best_once(tmp_path, monkeypatch):
    """The rule (the first check saves; then one once 19× the last save's time has passed) and the saver: a best found at
    a check that did not save is written by the next save, and only the best the progress names stays on disk."""
    import featcal_llm.engine.refine_progress as progress_module
    from featcal_llm.engine.refine_progress import ProgressSaver, save_due
    from featcal_llm.engine.resume import StagingArea

    assert save_due(None, None) and save_due(95.0, 5.0) and not save_due(94.0, 5.0) and save_due(5.0, 5.0, share=0.5)
    staging = StagingArea(tmp_path / "partial", "fingerprint")
    saver = ProgressSaver(staging)
    due = iter([True, False, True, True])
    monkeypatch.setattr(progress_module, "save_due", lambda since, cost, share=0.1: next(due))
    state = lambda step: {"w": torch.full((2,), float(step))}  # noqa: E731
    files = lambda: sorted(p.name for p in staging.root.glob("pass-*"))  # noqa: E731
    checks = [(2, 2), (4, 4), (6, 4), (8, 8)]  # (step, best step after its check)
    results = []
    for step, best in checks:
        progress = {"step": step, "best_step": best, "best": state(best)}
        results.append(saver.after_check(progress, lambda: {"current": state(step)}))
        if step == 4:
            assert files() == ["pass-refine-best-2.pt", "pass-refine.pt"]  # step 4's best waits for the next save
        if step == 6:
            assert files() == ["pass-refine-best-4.pt", "pass-refine.pt"]
            assert staging.load_pass("refine-best-4")["state"]["w"].tolist() == [4.0, 4.0]
    assert results == [True, False, True, True] and saver.saves == 3 and saver.seconds > 0  # the log line's saving time
    assert files() == ["pass-refine-best-8.pt", "pass-refine.pt"] and staging.load_pass("refine")["best"] is None
    written, save = [], staging.save_pass
    monkeypatch.setattr(staging, "save_pass", lambda name, result: written.append(name) or save(name, result))
    monkeypatch.setattr(progress_module, "save_due", lambda since, cost, share=0.1: True)
    for step in (10, 12):  # saves with the best unchanged: the best state (4 bytes a trained parameter) is not written again
        saver.after_check({"step": step, "best_step": 8, "best": state(8)}, lambda: {"current": state(step)})
    assert written == ["refine", "refine"] and files() == ["pass-refine-best-8.pt", "pass-refine.pt"]


def test_judged_tokens_are_the_responses_or_every_token():
    """A prompt/response record is judged on its response (position p predicts p + 1); plain text and generated records
    (plain token lists) on every token."""
    from featcal_llm.engine.refine_data import judged_positions, pad
    from featcal_llm.io.records import Record

    assert list(judged_positions([5, 6, 7, 8])) == [0, 1, 2]
    assert list(judged_positions(Record([5, 6, 7, 8, 9], response_from=3))) == [2, 3]
    batch = pad([("a", 0), ("b", 0)], {"a": [[5, 6, 7]], "b": [Record([5, 6, 7, 8, 9], response_from=3)]})
    assert batch.judged.tolist() == [[True, True, False, False, False], [False, False, True, True, False]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_only_the_best_state_the_progress_names_is_kept(tmp_path):
    """A check that finds a new best writes it once, in its own file; older ones go after the progress names the new one."""
    from featcal_llm.engine.refine_progress import best_pass as _best_pass
    from featcal_llm.engine.refine_progress import drop_older_bests as _drop_older_bests
    from featcal_llm.engine.refine_progress import load_best as _load_best
    from featcal_llm.engine.refine_progress import MissingBest
    from featcal_llm.engine.resume import StagingArea

    staging = StagingArea(tmp_path / "partial", "fingerprint")
    for step in (2, 4):
        staging.save_pass(_best_pass(step), {"step": step, "state": {"w": torch.full((2,), float(step))}})
    staging.save_pass("refine", {"step": 4})
    _drop_older_bests(staging, 4)
    assert sorted(p.name for p in staging.root.glob("pass-*")) == ["pass-refine-best-4.pt", "pass-refine.pt"]
    assert _load_best(staging, 4)["w"].tolist() == [4.0, 4.0] and _load_best(staging, 0) is None
    with pytest.raises(MissingBest, match="names step 2 as best, but its state is missing"):
        _load_best(staging, 2)


def test_a_pass_is_saved_without_the_zip_crc_and_the_global_setting_is_left_as_it_was(tmp_path):
    """The staging area's pass files skip torch.save's CRC-32 (torch.load never checks it; it was most of a save's
    time), round-trip exactly, and leave torch's process-wide option as the caller had it."""
    import zipfile

    from torch.utils.serialization import config

    from featcal_llm.engine.resume import StagingArea

    staging = StagingArea(tmp_path / "partial", "fingerprint")
    state = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(0)), "history": [{"step": 5}]}
    for caller_setting in (True, False):
        with config.patch({"save.compute_crc32": caller_setting}):
            staging.save_pass("refine", state)
            assert config.save.compute_crc32 is caller_setting
        tensor_records = [info for info in zipfile.ZipFile(staging.pass_file("refine")).infolist() if "/data/" in info.filename]
        assert tensor_records and all(info.CRC == 0 for info in tensor_records)
        loaded = staging.load_pass("refine")
        assert torch.equal(loaded["w"], state["w"]) and loaded["history"] == state["history"]


def test_the_record_order_is_drawn_as_needed_and_the_same_from_any_start():
    """Each step's records, drawn lazily, are the plan drawn whole (seeded epoch shuffles, one after another): read in
    order, from a resumed step, or again from an earlier one; the run never holds more than a step and an epoch."""
    import random

    from featcal_llm.engine.refine_schedule import record_order

    def whole(keys, steps, per_step, seed):  # every step drawn at once, as the plan reads
        rng, pending, batches = random.Random(f"featcal-refine:{seed}"), [], []
        for _ in range(steps):
            while len(pending) < per_step:
                epoch = list(keys)
                rng.shuffle(epoch)
                pending += epoch
            batches.append(pending[:per_step])
            pending = pending[per_step:]
        return batches

    keys = [("a", i) for i in range(5)] + [("b", i) for i in range(3)]
    for per_step in (3, 8, 20):
        expected = whole(keys, 12, per_step, 7)
        order = record_order(keys, 12, per_step, 7)
        assert [order[step] for step in range(12)] == expected and len(order) == 12
        resumed = record_order(keys, 12, per_step, 7)
        assert resumed[9] == expected[9] and resumed[4] == expected[4] and resumed[11] == expected[11]
    assert record_order(keys, 12, 3, 8)[0] != whole(keys, 1, 3, 7)[0] or record_order(keys, 12, 3, 8)[1] != whole(keys, 2, 3, 7)[1]
    with pytest.raises(IndexError):
        record_order(keys, 12, 3, 7)[12]
    huge = record_order(keys, 100_000, 65_536, 0)
    assert len(huge[2]) == 65_536 and len(huge._pending) < 65_536 + len(keys)


def test_the_learning_rate_warms_up_linearly_then_falls_by_a_cosine_to_a_tenth():
    """lr_factor against its closed form: steps 10, warm-up 0.2 (2 steps), then 0.1 + 0.9·(1 + cos(π·t/8))/2."""
    import math

    from featcal_llm.engine.refine_schedule import lr_factor

    assert [lr_factor(step, 10, 0.2) for step in (0, 1)] == [0.5, 1.0]
    for step in range(2, 11):
        expected = 0.1 + 0.9 * (1 + math.cos(math.pi * (step - 2) / 8)) / 2
        assert lr_factor(step, 10, 0.2) == pytest.approx(expected, abs=1e-15)
    assert lr_factor(10, 10, 0.2) == pytest.approx(0.1) and lr_factor(9, 10, 0.2) > 0.1  # the floor only after the last step
    assert lr_factor(0, 10, 0.0) == 1.0  # no warm-up still takes one step to reach the peak: the first step is at it
    for step in range(1, 11):  # then the cosine over the 9 steps after it
        assert lr_factor(step, 10, 0.0) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * (step - 1) / 9)) / 2, abs=1e-15)


def test_the_resume_fingerprint_knows_where_each_response_starts():
    """A data file that moves text between prompt and completion keeps every token id: the records' judged tokens
    change, so the saved layers (weighed on other tokens) may not be resumed."""
    from featcal_llm.engine.resume import sequences_digest
    from featcal_llm.io.records import Record

    ids = [5, 6, 7, 8, 9]
    digests = {sequences_digest({"a": [sequence]}) for sequence in (Record(ids, 2), Record(ids, 3), list(ids))}
    assert len(digests) == 3


def test_refines_saved_generators_are_the_cpus_and_its_own_gpus(monkeypatch):
    """Saving every visible GPU's generator made a resume with fewer GPUs visible fail (IndexError, a traceback):
    only the refinement's own GPU's is saved and restored, into whichever index it runs on now."""
    from featcal_llm.engine import refine_progress

    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: calls.append(("get", device)) or torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: calls.append(("set", device, int(state[0]))))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's generator saved"))
    saved = refine_progress.rng_state(torch.device("cuda", 3))
    assert set(saved) == {"cpu", "cuda"} and calls == [("get", torch.device("cuda", 3))]
    refine_progress.set_rng_state(saved, torch.device("cuda", 0))  # resumed where one GPU is visible
    assert calls[-1] == ("set", torch.device("cuda", 0), 7)
    assert set(refine_progress.rng_state(torch.device("cpu"))) == {"cpu"}


def test_the_warm_up_rounds_its_share_of_the_steps_to_the_nearest_step():
    """warm-up 0.3 of 9 steps is 2.7: 3 steps (1/3, 2/3, 1), then the cosine over the 6 after them; not 2 (truncated)."""
    import math

    from featcal_llm.engine.refine_schedule import lr_factor

    assert [lr_factor(step, 9, 0.3) for step in (0, 1, 2)] == pytest.approx([1 / 3, 2 / 3, 1.0], abs=1e-15)
    for step in range(3, 10):
        assert lr_factor(step, 9, 0.3) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * (step - 3) / 6)) / 2, abs=1e-15)


def test_the_scheduler_can_read_past_a_warm_up_that_fills_every_step():
    """torch's LambdaLR reads the factor once more after the last step (step = steps). Where the warm-up rounds to
    every step (one step; or 0.75 of 2 steps, 1.5 → 2), no cosine steps remain: the factor there is the peak's, not a
    division by zero that would end a finished refinement with a traceback."""
    from featcal_llm.engine.refine_schedule import lr_factor

    assert lr_factor(0, 1, 0.1) == 1.0 and lr_factor(1, 1, 0.1) == pytest.approx(1.0, abs=1e-15)
    assert [lr_factor(step, 2, 0.75) for step in (0, 1)] == [0.5, 1.0] and lr_factor(2, 2, 0.75) == pytest.approx(1.0, abs=1e-15)
    scheduled = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2.0),
                                                  lambda step: lr_factor(step, 1, 0.1))
    scheduled.optimizer.step()
    scheduled.step()  # after the only step: reads lr_factor(1, 1, 0.1)
    assert scheduled.get_last_lr() == pytest.approx([2.0])


def test_an_expert_with_no_judged_tokens_reads_zero_and_is_never_raised():
    """Held-out records can judge no token (a record of one token predicts nothing): the expert's KL is 0 / 1, not a
    ZeroDivisionError, and with no token there is no rise to judge. No expert at all: a mean of 0."""
    from featcal_llm.engine.refine_rules import expert_kls, mean_kl, raised

    empty = {"sums": [0.0, 0.0], "counts": [0, 0]}
    assert expert_kls({"a": empty, "b": _one_record(0.3)}) == {"a": 0.0, "b": pytest.approx(0.3)}
    assert mean_kl({"a": empty, "b": _one_record(0.3)}) == pytest.approx(0.15)
    assert mean_kl({}) == 0.0
    assert raised({"a": {"sums": [0.5, 0.0], "counts": [0, 0]}}, {"a": empty}) == []


def test_an_unchanged_expert_is_not_raised_by_rounding():
    """A check that leaves an expert's records as they were (sums 1.3, 2.7: not float32 numbers) finds no rise: the
    difference is taken in float64, where it is 0, not 4.8e-8 from a float32 copy of the sums before (one record: any
    rise counts)."""
    from featcal_llm.engine.refine_rules import raised

    same = {"a": {"sums": [1.3], "counts": [10]}, "b": {"sums": [1.3, 2.7], "counts": [10, 20]}}
    assert raised(same, same) == []
    assert raised({"a": {"sums": [1.3 + 1e-9], "counts": [10]}}, same) == ["a"]  # a real rise, however small, on one record


def test_the_spread_of_a_checks_step_losses_is_the_sample_standard_deviation():
    import statistics

    from featcal_llm.engine.refine_rules import spread

    assert spread([0.3]) is None and spread([]) is None
    losses = [0.12, 0.15, 0.11, 0.19]
    assert spread(losses) == pytest.approx(statistics.stdev(losses), rel=1e-12)
    assert spread([1.0, 3.0]) == pytest.approx(2 ** 0.5, rel=1e-12)  # √(((1 − 2)² + (3 − 2)²) / (2 − 1))


def test_why_no_check_was_kept_at_the_edges():
    """A check that ties the closed form's held-out KL did not lower it (no trade); a training KL that did not move at
    all, with no spread measured, moved neither way; a diverged run's spread (NaN) is no noise to quote; no check: says so."""
    from featcal_llm.engine.refine_rules import why_none_kept

    def check(step, held, train, above=(), sd=None):
        return {"step": step, "held_out_kl": held, "train_kl": train, "above_closed_form": list(above), "train_kl_sd": sd}

    start = {"step": 0, "held_out_kl": 0.10, "train_kl": 0.02, "per_expert": {}}
    assert why_none_kept([start], 1e-4) == "no check ran"
    assert why_none_kept([start, check(5, 0.10, 0.02, ["b"])], 1e-4) == (
        "the training KL did not move beyond its noise, from 0.02 (the closed form, on the first step's records) to 0.02 "
        "(the steps before the last check): the checks do not tell why; a smaller refine.lr (say 1e-05) is the cheapest try")
    nan = float("nan")
    assert why_none_kept([start, check(5, nan, nan, sd=nan)], 1e-4) == (
        "the training KL rose as well, from 0.02 (the closed form, on the first step's records) to nan (the steps before "
        "the last check): the steps overshoot; a smaller refine.lr (say 1e-05) may help")
