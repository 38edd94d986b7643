"""`refine:`'s data plumbing as pure pieces: the teachers' store at k below the vocabulary (the stage's end-to-end tests
keep every token, so the "rest" bin is empty there), micro-batches within their token budget, and the top-k KL without
a stored rest. The stage end to end: test_refine.py."""

from __future__ import annotations

import pytest
import torch


def test_the_teachers_store_holds_each_records_top_k_and_rest_as_its_own_forward_gives_them(tiny_model):
    """Records of mixed lengths, several micro-batches, k (5) below the vocabulary (64): each record's rows are its own
    unpadded forward's top-k log-probabilities (float16), ids (int32) and rest log-mass (float32), at its judged
    positions; `batch` concatenates them in the keys' order, and the store counts 6k + 4 bytes a judged token."""
    from featcal_llm.engine.refine_data import TeacherStore, teach
    from featcal_llm.maths.topk_kl import topk_teacher

    generator = torch.Generator().manual_seed(0)
    sequences = {"a": [torch.randint(1, 64, (n,), generator=generator).tolist() for n in (7, 3, 12)],
                 "b": [torch.randint(1, 64, (n,), generator=generator).tolist() for n in (5, 9)]}
    keys = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    store = TeacherStore(5, {}, {}, {})
    teach(store, tiny_model, keys, sequences, batch_tokens=16, device=torch.device("cpu"), autocast=None)
    judged = 0
    for task, index in keys:
        row = sequences[task][index]
        with torch.no_grad():
            logits = tiny_model(torch.tensor([row])).logits[0, :-1]  # position p predicts token p + 1: every one judged
        top, ids, rest = topk_teacher(logits, 5)
        key = (task, index)
        assert store.logp[key].dtype == torch.float16 and store.ids[key].dtype == torch.int32 and store.rest[key].dtype == torch.float32
        assert torch.equal(store.ids[key].long(), ids)
        assert torch.allclose(store.logp[key].double(), top, atol=2e-3, rtol=1e-3)
        assert torch.allclose(store.rest[key].double(), rest, atol=1e-6, rtol=1e-6) and (rest > -30).all()  # mass outside the top 5
        judged += len(row) - 1
    assert store.nbytes() == judged * (6 * 5 + 4)
    order = [("b", 1), ("a", 0), ("b", 0)]
    logp, ids, rest = store.batch(order)
    assert torch.equal(rest, torch.cat([store.rest[key] for key in order]))
    assert torch.equal(ids, torch.cat([store.ids[key] for key in order])) and logp.shape == (8 + 6 + 4, 5)


def test_micro_batches_keep_their_padded_tokens_within_the_budget():
    """A long record after short ones starts a batch of its own: padded to the longest, the short ones' batch would
    exceed `batch_tokens` (the GPU's micro-batch bound); only a record alone may be longer than the budget."""
    from featcal_llm.engine.refine_data import micro_batches

    sequences = {"a": [[1] * 2, [1] * 2, [1] * 10, [1] * 3, [1] * 20, [1] * 4]}
    keys = [("a", index) for index in range(6)]
    batches = list(micro_batches(keys, sequences, batch_tokens=12))
    assert [batch.keys for batch in batches] == [[("a", 0), ("a", 1)], [("a", 2)], [("a", 3)], [("a", 4)], [("a", 5)]]
    assert all(batch.input_ids.numel() <= 12 or len(batch.keys) == 1 for batch in batches)
    assert [key for batch in batches for key in batch.keys] == keys
    # after a long record's batch the next one starts from its own longest: three short records share one (3 × 2 ≤ 12)
    sequences = {"a": [[1] * 10, [1] * 2, [1] * 2, [1] * 2]}
    assert [batch.keys for batch in micro_batches([("a", i) for i in range(4)], sequences, 12)] == [[("a", 0)], [("a", 1), ("a", 2), ("a", 3)]]


def test_the_top_k_kl_without_a_stored_rest_is_the_full_kl_at_k_equal_to_the_vocabulary():
    """Where the teacher's rest is derived from its k values (no stored rest) and k is the vocabulary, the rest's bin
    is empty: the KL and its gradient are finite and equal the full-vocabulary KL's."""
    from featcal_llm.maths.topk_kl import topk_kl, topk_teacher

    generator = torch.Generator().manual_seed(1)
    teacher, student = torch.randn(6, 11, generator=generator, dtype=torch.float64), torch.randn(6, 11, generator=generator, dtype=torch.float64)
    top, ids, _ = topk_teacher(teacher, 11)
    student.requires_grad_(True)
    value = topk_kl(student, top, ids)
    value.backward()
    p = torch.softmax(teacher, -1)
    full = (p * (torch.log_softmax(teacher, -1) - torch.log_softmax(student.detach(), -1))).sum()
    assert torch.isfinite(value) and torch.isfinite(student.grad).all()
    assert value.item() == pytest.approx(full.item(), rel=1e-10)
    assert torch.allclose(student.grad, torch.softmax(student.detach(), -1) - p, atol=1e-10)

