"""The LM head's re-fit after the last layer (the `head:` option), as pure functions over tensors.

The head is one more linear module whose input is the final norm's output, so
the layers' rule applies unchanged: with x_cal the calibrated model's final
features, x_exp expert i's, G_i = Σ x_cal x_calᵀ / n_i, C_i = Σ x_exp x_calᵀ / n_i
and W_i expert i's head,

    W* (Σ ω_i G_i + (λ + eps) I) = Σ ω_i W_i (α C_i + (1 − α) G_i) + λ W_anc.

Only d × d sums per expert are kept: the vocabulary-wide right-hand side is
formed and solved a block of rows at a time, so a 128k-token head never needs
a second vocabulary × d float64 matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featcal_llm.maths.objective import Hyperparameters
from featcal_llm.maths.solve import SOLVE_DTYPE, RidgeSolver, anchor, task_weight

HEAD_ROWS = 16384  # vocabulary rows per solve block


def differs_at_stored_precision(tensor: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether `tensor` is not `reference` as stored: bit for bit in one dtype; across dtypes, by more than one unit in
    the last place of the coarser one (a float32 base saved again in bfloat16 is the same head, a fine-tuned one is not).
    """
    if tensor.shape != reference.shape:
        return True
    if tensor.dtype == reference.dtype:
        return not torch.equal(tensor, reference)
    coarse = max(tensor.dtype, reference.dtype, key=lambda dtype: torch.finfo(dtype).eps)
    ulp, tiny = torch.finfo(coarse).eps, torch.finfo(coarse).tiny
    a, b = tensor.to(torch.float64), reference.to(torch.float64)
    return bool(((a - b).abs() > ulp * torch.maximum(a.abs(), b.abs()) + tiny).any())


@dataclass
class HeadStatistics:
    """One expert's sums over its non-padding tokens (float64)."""

    gram: torch.Tensor  # Σ x_cal x_calᵀ
    moment: torch.Tensor  # Σ x_exp x_calᵀ
    tokens: int

    @classmethod
    def empty(cls, dim: int, device: torch.device) -> "HeadStatistics":
        zeros = lambda: torch.zeros(dim, dim, device=device, dtype=SOLVE_DTYPE)  # noqa: E731
        return cls(zeros(), zeros(), 0)


def solve_head(
    statistics: list[HeadStatistics], expert_heads: list[torch.Tensor], merged_head: torch.Tensor, base_head: torch.Tensor,
    hyper: Hyperparameters, shares: list[float] | None = None, dtype: torch.dtype = SOLVE_DTYPE, rows: int = HEAD_ROWS,
) -> torch.Tensor:
    """W* of the formula above, on the statistics' device, each block solved in float64 and kept in `dtype`.

    `shares`: each expert's weight from the recipe, multiplying its ω_i (default: all 1).
    """
    device = statistics[0].gram.device
    lhs = torch.zeros_like(statistics[0].gram)
    mixes, omegas = [], []
    for stats, share in zip(statistics, shares or [1.0] * len(statistics)):
        gram = stats.gram / stats.tokens
        omega = task_weight(gram, hyper.eps) * share
        lhs.add_(gram, alpha=omega)
        mixes.append(torch.lerp(gram, stats.moment / stats.tokens, hyper.alpha))  # α C_i + (1 − α) G_i
        omegas.append(omega)
    solver = RidgeSolver(keep_lhs=True)  # one factor of lhs + (λ + eps) I serves every block
    blocks = []
    for start in range(0, merged_head.shape[0], rows):
        stop = min(start + rows, merged_head.shape[0])
        rhs = torch.zeros(stop - start, lhs.shape[0], device=device, dtype=SOLVE_DTYPE)
        for omega, mix, head in zip(omegas, mixes, expert_heads):
            rhs.addmm_(head[start:stop].to(device=device, dtype=SOLVE_DTYPE), mix, alpha=omega)
        anchored = anchor(merged_head[start:stop].to(device), base_head[start:stop].to(device), hyper.rho)
        blocks.append(solver.solve("lm_head", lhs, {"head": rhs}, {"head": anchored}, hyper.lam, hyper.eps, where=f"LM head rows {start}-{stop - 1}")["head"].to(dtype))
    return torch.cat(blocks)
