"""KL(teacher ‖ student) from a teacher kept as its top-k next-token log-probabilities and the mass of the rest.

The refine stage (engine/refine.py) keeps each teacher's next-token
distribution on the host, not the full vocabulary (128k floats a token at
8B) but its k most likely tokens and "the rest": k + 1 bins. The KL over
those bins is exact for the coarsened distributions: it equals the full KL
when k is the vocabulary and is at most the full KL otherwise (merging bins
never raises a divergence, the log-sum inequality). The student's mass on the
rest is computed from its own logits with the teacher's k tokens masked out,
so it is exact and stable, not 1 − Σ of k probabilities. The teacher's k + 1
bins are normalised before use: kept in float16, its top-k log-probabilities
and the rest's float32 log-mass sum to 1 only within float16's rounding, and
against an unnormalised teacher a student that matches it reads a KL below 0
(down to −3.5e-4 a token against a float16 copy of itself; the demo printed −1.2e-5).
"""

from __future__ import annotations

import torch

MASKED = -1e30  # finite, so that a row whose every token is a teacher's top-k has a finite (zero-weighted) gradient


def topk_teacher(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A teacher's (n, vocab) logits → (top-k log-probs (n, k), their token ids (n, k) int64, log-mass of the rest (n,)),
    in float32 (float64 for float64 logits)."""
    logp = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    k = min(k, logp.shape[-1])
    top, index = logp.topk(k, dim=-1)
    rest = logp.scatter(-1, index, MASKED).logsumexp(-1)
    return top, index, rest


def topk_kl(
    student_logits: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    teacher_topk_idx: torch.Tensor,
    mask: torch.Tensor | None = None,
    teacher_rest_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ over the rows where `mask` is true of KL(teacher ‖ student) over k + 1 bins (the teacher's k tokens and the rest).

    student_logits (n, vocab); teacher_topk_logp / teacher_topk_idx (n, k); mask (n,) bool (None: every row);
    teacher_rest_logp (n,): the teacher's log-mass outside its k tokens (None: 1 − Σ exp(top-k), from the k values;
    ignored where k is the vocabulary: derived, 1 − Σ rounds to ±1e-16 by machine, which against the student's
    empty rest read 1e14).
    Returns a scalar in float32 (float64 for float64 logits), differentiable in the student's logits.
    """
    per_row = topk_kl_rows(student_logits, teacher_topk_logp, teacher_topk_idx, teacher_rest_logp)
    if mask is not None:
        per_row = per_row[mask.to(per_row.device)]
    return per_row.sum()


def topk_kl_rows(
    student_logits: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    teacher_topk_idx: torch.Tensor,
    teacher_rest_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's KL(teacher ‖ student) over the k + 1 bins, (n,): `topk_kl` before the sum (a record's share of it)."""
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    logits = student_logits.to(dtype)
    index = teacher_topk_idx.long()
    log_norm = logits.logsumexp(-1, keepdim=True)
    student_top = logits.gather(-1, index) - log_norm
    student_rest = logits.scatter(-1, index, MASKED).logsumexp(-1) - log_norm.squeeze(-1)
    teacher_top = teacher_topk_logp.to(dtype)
    if index.shape[-1] >= logits.shape[-1]:  # k is the vocabulary: the rest's bin is empty, whatever 1 − Σ p rounds to
        teacher_rest_logp = torch.full_like(teacher_top[..., 0], -torch.inf)
    elif teacher_rest_logp is None:
        teacher_rest_logp = torch.log1p(-teacher_top.exp().sum(-1).clamp(max=1.0))
    teacher_rest = teacher_rest_logp.to(dtype)
    teacher_norm = torch.cat([teacher_top, teacher_rest.unsqueeze(-1)], dim=-1).logsumexp(-1)  # 0 for an exact teacher
    teacher_top, teacher_rest = teacher_top - teacher_norm.unsqueeze(-1), teacher_rest - teacher_norm
    p_top, p_rest = teacher_top.exp(), teacher_rest.exp()
    per_row = (p_top * (teacher_top - student_top)).sum(-1)
    # the rest's bin: 0 where the teacher puts no mass there (k = vocab), without 0 · ∞ in the value or the gradient
    rest_term = torch.where(p_rest > 0, p_rest * (teacher_rest.clamp(min=MASKED) - student_rest), torch.zeros_like(p_rest))
    return per_row + rest_term


__all__ = ["topk_kl", "topk_kl_rows", "topk_teacher"]
