"""`refine:`: the top-k KL against the full one, the block's errors, and the stage end to end on a tiny merge.

The end-to-end runs share one scenario (two experts, two layers, experts far from the merge so that the closed form leaves
a gap for the gradient steps to close); each run is a few seconds of CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

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


@pytest.mark.parametrize("value, message", [
    ({"stpes": 3}, "featcal.refine.stpes: unknown key; did you mean 'steps'?"),
    ({"lr": -1}, "featcal.refine.lr: Input should be greater than 0"),
    ({"top_k": 0}, "featcal.refine.top_k: Input should be greater than or equal to 1"),
    ({"params": "lora"}, "featcal.refine.params:"),
    ("yes", "featcal.refine: expected true, false or a mapping"),
])
def test_bad_refine_keys_are_one_line(tmp_path, value, message):
    from scenario import build_scenario

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.validate import check_before_run

    scenario = build_scenario(tmp_path / "s", experts=2, layers=1, samples=4)
    recipe = scenario.write_recipe(tmp_path / "bad.yaml", refine=value)
    with pytest.raises(FeatCalError) as error:
        check_before_run(recipe)
    text = str(error.value)
    assert message in text and "\n" not in text.strip()


def test_refine_true_takes_the_defaults_and_holds_records_out(tmp_path):
    from featcal_llm.io.block import FeatCalConfig

    block = {"merged": "m", "output": "o", "data": {}}
    assert FeatCalConfig(**block).refine is None and not FeatCalConfig(**block).holds_out
    on = FeatCalConfig(**block, refine=True)
    assert on.refine.steps == 40 and on.refine.learning_rate("full") == 1e-4 and on.refine.learning_rate("adapter") == 3e-4
    assert on.holds_out  # the held-out records choose the step count
    assert FeatCalConfig(**block, refine=False).refine is None
