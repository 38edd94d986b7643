"""Per-task calibration statistics, accumulated batch by batch (pure tensor functions).

For one task and one input group (projections reading the same input) we keep
sums over the task's non-padding tokens t, in float32 or better:

* ``gram``     Σ_t x_cal x_calᵀ                      (d × d, shared by the group)
* ``cross[p]`` Σ_t y_exp,p x_calᵀ                     (m_p × d, never d × d)
* ``sum_cal``, ``sum_exp``  Σ_t x_cal, Σ_t x_exp       (bias update only)
* ``norm_sq``  Σ_t (x / rms(x))² of the group's norm input (RMSNorm update only)

where y_exp,p = W_i x_exp is projection p's output in the expert (bias removed).
R_i = W_i C_i is recovered later from ``cross`` and ``gram`` without any
d × d cross moment: W_i x_tgt = α y_exp + (1 − α) W_i x_cal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GroupStatistics:
    gram: torch.Tensor
    cross: dict[str, torch.Tensor]
    sum_cal: torch.Tensor | None = None
    sum_exp: torch.Tensor | None = None
    norm_sq: torch.Tensor | None = None
    tokens: int = 0

    @classmethod
    def empty(
        cls,
        input_dim: int,
        output_dims: dict[str, int],
        *,
        with_means: bool,
        with_norm: bool,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> "GroupStatistics":
        zeros = lambda *shape: torch.zeros(shape, device=device, dtype=dtype)  # noqa: E731
        return cls(
            gram=zeros(input_dim, input_dim),
            cross={name: zeros(rows, input_dim) for name, rows in output_dims.items()},
            sum_cal=zeros(input_dim) if with_means else None,
            sum_exp=zeros(input_dim) if with_means else None,
            norm_sq=zeros(input_dim) if with_norm else None,
        )


@dataclass
class TaskStatistics:
    """Everything one task contributes to one layer's solve."""

    groups: dict[str, GroupStatistics] = field(default_factory=dict)


def masked_tokens(features: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(batch, seq, d) features and a (batch, seq) keep-mask → (tokens, d) rows of real tokens."""
    return features[keep]


def accumulate_gram(gram: torch.Tensor, x_cal: torch.Tensor) -> None:
    gram.addmm_(x_cal.T.to(gram.dtype), x_cal.to(gram.dtype))


def accumulate_cross(cross: torch.Tensor, y_exp: torch.Tensor, x_cal: torch.Tensor) -> None:
    cross.addmm_(y_exp.T.to(cross.dtype), x_cal.to(cross.dtype))


def accumulate_sum(total: torch.Tensor, rows: torch.Tensor) -> None:
    total.add_(rows.to(total.dtype).sum(dim=0))


def accumulate_normalized_square(total: torch.Tensor, x: torch.Tensor, epsilon: float) -> None:
    """Σ (x / rms(x))² per coordinate, with the norm module's own epsilon."""
    x = x.to(total.dtype)
    z = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    total.add_(z.pow(2).sum(dim=0))
