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
