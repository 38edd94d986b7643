"""Per-task calibration statistics, accumulated batch by batch (pure tensor functions).

For one task and one input group (projections reading the same input) we keep
sums over the task's non-padding tokens t, in float32 or better:

* ``gram``     Σ_t x_cal x_calᵀ                      (d × d, shared by the group)
* ``cross[p]`` Σ_t y_exp,p x_calᵀ                     (m_p × d); always this, whichever way it was recorded
* ``moment``   Σ_t x_exp x_calᵀ                      (d × d, shared by the group), accumulated
                   instead of the crosses when that costs fewer FLOPs (`cross_moment_pays`);
                   `expert_crosses` then forms cross[p] = W_i,p · moment
* ``sum_cal``, ``sum_exp``  Σ_t x_cal, Σ_t x_exp       (bias update only)
* ``norm_sq``  Σ_t (x / rms(x))² of the group's norm input (RMSNorm update only)

where y_exp,p = W_i x_exp is projection p's output in the expert (bias removed).
With token weights (maths/advantage.py) every sum is Σ_t w_t (…): the rows come
scaled by √w_t, so each product of two of them carries w_t once.
The objective (objective.py) forms its targets from these sums: FeatCal's
R_i = α cross / n + (1 − α) W_i G_i, since W_i x_tgt = α y_exp + (1 − α) W_i x_cal.
A group whose projections' total output width m exceeds its input width d
(q/k/v, gate/up) costs m·d per token in crosses but only d² in one moment;
W_i,p · moment is the same cross (bias-free), exactly.

Sums are float64 totals. Each batch's products are computed in the run's
statistics precision (float32 or float64) and added to them, so the number
and size of batches do not change the result beyond the products' own
rounding, and everything formed from the totals afterwards (W_i G_i, W_i ·
moment) is float64.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

TOTAL_DTYPE = torch.float64  # running totals; the products of each batch are in the run's statistics precision


@dataclass
class GroupStatistics:
    gram: torch.Tensor
    cross: dict[str, torch.Tensor]
    sum_cal: torch.Tensor | None = None
    sum_exp: torch.Tensor | None = None
    norm_sq: torch.Tensor | None = None
    tokens: int = 0
    moment: torch.Tensor | None = None
    # How this task's expert side is being recorded: True while `moment` holds it and `cross` is not formed yet.
    via_moment: bool = False

    def reset(self) -> None:
        for tensor in (self.gram, *self.cross.values(), self.sum_cal, self.sum_exp, self.norm_sq, self.moment):
            if tensor is not None:
                tensor.zero_()
        self.tokens = 0
        self.via_moment = False

    def expert_crosses(self, expert_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """cross[p] = Σ y_exp,p x_calᵀ (bias-free), formed from the moment as W_i,p · moment if it was recorded that way.

        In the statistics' precision; idempotent.
        """
        if self.via_moment:
            for name, cross in self.cross.items():
                weight = expert_weights[name].to(device=cross.device, dtype=cross.dtype)
                torch.mm(weight, self.moment, out=cross)
            self.via_moment = False
        return self.cross

    @classmethod
    def empty(
        cls,
        input_dim: int,
        output_dims: dict[str, int],
        *,
        with_means: bool,
        with_norm: bool,
        device: torch.device,
        dtype: torch.dtype = TOTAL_DTYPE,
    ) -> "GroupStatistics":
        zeros = lambda *shape: torch.zeros(shape, device=device, dtype=dtype)  # noqa: E731
        return cls(
            gram=zeros(input_dim, input_dim),
            cross={name: zeros(rows, input_dim) for name, rows in output_dims.items()},
            sum_cal=zeros(input_dim) if with_means else None,
            sum_exp=zeros(input_dim) if with_means else None,
            norm_sq=zeros(input_dim) if with_norm else None,
            # only a group wider out than in can ever gain from the moment (`cross_moment_pays`)
            moment=zeros(input_dim, input_dim) if sum(output_dims.values()) > input_dim else None,
        )


def cross_moment_pays(tokens: int, input_dim: int, output_total: int) -> bool:
    """Accumulate one d × d moment Σ x_exp x_calᵀ and form the crosses W_i,p · moment after the task.

    Per projection the crosses cost Σ_p m_p·d FLOP-units per token, i.e.
    m·d·n in all; the moment costs d²·n plus m·d² once. The cheaper one wins:
    the moment for wide groups (q/k/v, gate/up) with many tokens. It never
    wins when n < d.
    """
    return output_total * tokens > input_dim * tokens + output_total * input_dim  # m·d·n > d²·n + m·d², over d


@functools.cache
def _half_inputs_float_output(device: torch.device) -> bool:
    """Whether this GPU multiplies bf16 matrices into a float32 result (tensor cores, no rounding to bf16)."""
    try:
        a = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
        product = torch.mm(a.T, a, out_dtype=torch.float32)
        reference = a.T.float() @ a.float()
        return product.dtype == torch.float32 and bool(torch.allclose(product, reference, rtol=1e-3, atol=1e-3))
    except Exception:  # older torch or a backend without aten::mm.dtype
        return False


def _on_tensor_cores(features: torch.Tensor, precision: torch.dtype) -> bool:
    """Whether products of these features in `precision` go through a GPU's tensor cores as they are (bf16/fp16 into float32)."""
    half = features.dtype in (torch.bfloat16, torch.float16) and precision == torch.float32
    return half and features.is_cuda and _half_inputs_float_output(features.device)


def _add_product(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor, precision: torch.dtype | None = None) -> None:
    """total += left @ right, the product computed in `precision` (default: the total's own).

    On a GPU, bf16/fp16 features go through the tensor cores with a float32
    result; everywhere else they are upcast first (exact) and multiplied in
    `precision`. A product in a narrower precision than the total is added
    to it as a whole (one rounding per batch and entry, not per token).
    """
    precision = precision or total.dtype
    if _on_tensor_cores(left, precision):
        total.add_(torch.mm(left, right, out_dtype=torch.float32))
    elif precision == total.dtype:
        total.addmm_(left.to(precision), right.to(precision))
    else:
        total.add_(torch.mm(left.to(precision), right.to(precision)))


GRAM_MAX_BLOCKS = 8
# A GPU multiplies the whole square until the triangle is timed there: `featcal-llm bench --gram-triangle` sets this
# (studies/gpu/cost.sh times both; 31 % fewer statistics FLOPs at Llama-3.1-8B's shapes).
GRAM_TRIANGLE_ON_GPU = False


def gram_triangle(device: torch.device) -> bool:
    """Whether Grams on `device` are built from their lower block triangle (CPUs always)."""
    return device.type != "cuda" or GRAM_TRIANGLE_ON_GPU


def gram_blocks(dim: int) -> int:
    """Column blocks of a d × d Gram built from its lower block triangle: k blocks cost (k + 1) / 2k of the full product.

    Blocks stay at least 192 wide so that each product still runs near the matmul peak.
    """
    return max(1, min(GRAM_MAX_BLOCKS, dim // 192))


def accumulate_gram(gram: torch.Tensor, x_cal: torch.Tensor, precision: torch.dtype | None = None) -> None:
    """gram += x_calᵀ x_cal, the batch's product in `precision` (default: the total's).

    On a CPU only the lower block triangle is multiplied and the rest is
    mirrored (the Gram is symmetric): at 8 blocks 56 % of the FLOPs, in the
    same precision. GPUs multiply the whole square (one large tensor-core call)
    unless `gram_triangle` says otherwise.
    """
    blocks = gram_blocks(gram.shape[0]) if gram_triangle(gram.device) else 1
    if blocks == 1:
        _add_product(gram, x_cal.T, x_cal, precision)
        return
    precision = precision or gram.dtype
    x = x_cal if _on_tensor_cores(x_cal, precision) else x_cal.to(precision)  # upcast once, not once a block
    edges = [i * gram.shape[0] // blocks for i in range(blocks + 1)]
    for start, end in zip(edges, edges[1:]):
        _add_product(gram[start:end, :end], x[:, start:end].T, x[:, :end], precision)
    for start, end in zip(edges[:-1], edges[1:-1]):
        gram[start:end, end:].copy_(gram[end:, start:end].T)


def accumulate_cross(cross: torch.Tensor, y_exp: torch.Tensor, x_cal: torch.Tensor, precision: torch.dtype | None = None) -> None:
    _add_product(cross, y_exp.T, x_cal, precision)


def accumulate_moment(moment: torch.Tensor, x_exp: torch.Tensor, x_cal: torch.Tensor, precision: torch.dtype | None = None) -> None:
    """moment += x_expᵀ x_cal (not symmetric: the whole square)."""
    _add_product(moment, x_exp.T, x_cal, precision)


def accumulate_sum(total: torch.Tensor, rows: torch.Tensor) -> None:
    total.add_(rows.to(total.dtype).sum(dim=0))


def accumulate_normalized_square(total: torch.Tensor, x: torch.Tensor, epsilon: float, root_weights: torch.Tensor | None = None) -> None:
    """Σ w (x / rms(x))² per coordinate, with the norm module's own epsilon (w = 1, or the square of `root_weights`)."""
    x = x.to(total.dtype)
    z = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if root_weights is not None:
        z = z * root_weights.to(z.dtype).unsqueeze(1)
    total.add_(z.pow(2).sum(dim=0))
