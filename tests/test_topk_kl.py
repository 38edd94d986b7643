"""maths/topk_kl.py: refine's KL over a teacher's top-k tokens and the rest, against the full-vocabulary KL."""

from __future__ import annotations

import pytest
import torch

from featcal_llm.maths.topk_kl import topk_kl, topk_teacher


def full_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Σ over rows of KL(teacher ‖ student) over the whole vocabulary, the textbook way."""
    p_log = torch.log_softmax(teacher_logits.double(), -1)
    q_log = torch.log_softmax(student_logits.double(), -1)
    return (p_log.exp() * (p_log - q_log)).sum()


def test_topk_kl_is_the_full_kl_at_k_vocab_and_below_it_otherwise():
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(7, 50, generator=generator, dtype=torch.float64) * 3, torch.randn(7, 50, generator=generator, dtype=torch.float64) * 3
    exact = full_kl(student, teacher)
    top, index, rest = topk_teacher(teacher, 50)
    assert float(topk_kl(student, top.double(), index, None, rest.double())) == pytest.approx(float(exact), rel=1e-10)
    previous = float(exact)
    for k in (40, 20, 5, 1):  # fewer bins: a lower bound (log-sum inequality), never above the full KL, falling with k
        top, index, rest = topk_teacher(teacher, k)
        value = float(topk_kl(student, top.double(), index, None, rest.double()))
        assert 0 <= value <= previous + 1e-12
        previous = value
    # the k + 1 bins by hand, for k = 5: the teacher's five tokens and "the rest"
    top, index, rest = topk_teacher(teacher, 5)
    q = torch.log_softmax(student, -1)
    q_top = q.gather(-1, index)
    q_rest = torch.log1p(-q_top.exp().sum(-1))
    by_hand = (top.double().exp() * (top.double() - q_top)).sum() + (rest.double().exp() * (rest.double() - q_rest)).sum()
    assert float(topk_kl(student, top.double(), index, None, rest.double())) == pytest.approx(float(by_hand), rel=1e-9)
    # the mask selects rows; the rest's mass from the k values alone when it is not given
    mask = torch.tensor([True, False, True, False, False, True, True])
    assert float(topk_kl(student, top.double(), index, mask, rest.double())) == pytest.approx(
        float(sum(topk_kl(student[i:i + 1], top[i:i + 1].double(), index[i:i + 1], None, rest[i:i + 1].double()) for i in (0, 2, 5, 6))))
    assert float(topk_kl(student, top.double(), index)) == pytest.approx(float(by_hand), rel=1e-6)


def test_topk_kl_gradient_is_finite_when_k_is_the_vocabulary():
    student = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 8, dtype=torch.float64)
    top, index, rest = topk_teacher(teacher, 8)
    topk_kl(student, top.double(), index, None, rest.double()).backward()
    expected = torch.softmax(student.detach(), -1) - torch.softmax(teacher, -1)  # ∂KL/∂logits = q − p
    assert torch.allclose(student.grad, expected, atol=1e-12)


def test_a_teacher_kept_in_float16_reads_no_kl_below_zero_against_itself():
    """The store keeps the top-k log-probabilities in float16 (engine/refine_data.py): normalised again, the k + 1
    bins give a student equal to its teacher a KL of 0 within float32 rounding, never below it (KL ≥ 0 for distributions),
    and a near-copy the same KL as the exact teacher does, within float16's precision."""
    from featcal_llm.maths.topk_kl import topk_kl_rows

    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(256, 1000, generator=generator) * 4
    top, index, rest = topk_teacher(teacher, 64)
    stored = top.to(torch.float16)
    same = topk_kl_rows(teacher, stored, index.to(torch.int32), rest)
    assert float(same.min()) > -1e-6 and float(same.abs().max()) < 1e-5, float(same.min())
    student = teacher + 0.3 * torch.randn(256, 1000, generator=generator)
    exact = topk_kl_rows(student.double(), top.double(), index, rest.double())
    assert torch.allclose(topk_kl_rows(student, stored, index, rest).double(), exact, rtol=2e-2, atol=1e-4)


def test_bf16_logits_are_measured_in_float32():
    """Under bf16 autocast the student's logits (and a GPU teacher's) are bf16: the KL and the teacher's store are
    computed in float32 from them, as the float64 computation of the same values gives."""
    from featcal_llm.maths.topk_kl import topk_kl_rows

    generator = torch.Generator().manual_seed(3)
    student = (4 * torch.randn(6, 50, generator=generator)).bfloat16()
    teacher = (4 * torch.randn(6, 50, generator=generator)).bfloat16()
    logp, ids, rest = topk_teacher(teacher, 8)
    exact = topk_teacher(teacher.double(), 8)
    assert logp.dtype == rest.dtype == torch.float32
    assert torch.allclose(logp.double(), exact[0], atol=1e-6) and torch.allclose(rest.double(), exact[2], atol=1e-6)
    rows = topk_kl_rows(student, logp, ids, rest)
    reference = topk_kl_rows(student.double(), exact[0], exact[1], exact[2])
    assert rows.dtype == torch.float32 and bool((rows >= 0).all())
    assert torch.allclose(rows.double(), reference, rtol=1e-5, atol=1e-6)


def test_a_k_above_the_vocabulary_keeps_the_whole_vocabulary():
    """refine's `top_k` may exceed a small model's vocabulary: the teacher keeps every token, and the KL is the full one."""
    generator = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(3, 8, generator=generator, dtype=torch.float64), torch.randn(3, 8, generator=generator, dtype=torch.float64)
    top, index, rest = topk_teacher(teacher, 20)
    assert top.shape == index.shape == (3, 8)
    assert sorted(index[0].tolist()) == list(range(8))
    assert float(topk_kl(student, top, index, None, rest)) == pytest.approx(float(full_kl(student, teacher)), rel=1e-10)


def test_k_at_the_vocabulary_without_the_rest_reads_the_full_kl_in_float32():
    """At k = vocab in float32, 1 − Σ exp(top-k) rounds to ±1e-7 (above 0 on some rows of this teacher): the rest's bin
    is empty whatever it rounds to, and the KL is the full-vocabulary one, not 1e-7 · 1e30."""
    from featcal_llm.maths.topk_kl import topk_kl_rows

    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 8, generator=generator) * 3
    student = torch.randn(64, 8, generator=generator) * 3
    top, index, _ = topk_teacher(teacher, 8)
    assert bool(((1 - top.exp().sum(-1)) > 0).any())  # the case this guards
    p_log, q_log = torch.log_softmax(teacher.double(), -1), torch.log_softmax(student.double(), -1)
    by_hand = (p_log.exp() * (p_log - q_log)).sum(-1)
    assert torch.allclose(topk_kl_rows(student, top, index).double(), by_hand, rtol=1e-4, atol=1e-5)


def test_float16_top_k_summing_past_one_leave_the_rest_empty():
    """A float16 teacher whose k tokens hold nearly all its mass: their probabilities can sum past 1 by rounding, and
    without the rest given, the rest's bin is then empty (log1p(−1)), not log1p of a negative number (NaN): the KL is
    over the k tokens alone, the teacher's normalised."""
    from featcal_llm.maths.topk_kl import topk_kl_rows

    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 50, generator=generator) * 3
    teacher[:, :4] += 40
    student = torch.randn(64, 50, generator=generator)
    top, index, _ = topk_teacher(teacher, 4)
    stored = top.to(torch.float16)
    past_one = stored.double().exp().sum(-1) > 1
    assert int(past_one.sum()) > 10  # the case this guards
    rows = topk_kl_rows(student, stored, index)
    assert bool(torch.isfinite(rows).all())
    p_log = torch.log_softmax(stored.double(), -1)  # the k tokens normalised, the rest empty
    q_top = torch.log_softmax(student.double(), -1).gather(-1, index)
    by_hand = (p_log.exp() * (p_log - q_top)).sum(-1)
    assert torch.allclose(rows.double()[past_one], by_hand[past_one], rtol=1e-5, atol=1e-6)
