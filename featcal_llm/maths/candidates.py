"""One layer's FeatCal solution for many (λ, α, ρ) from one set of statistics (pure tensor functions).

What is shared (featcal_method.md, "How the hyper-parameters enter"): with the
cal stream fixed, G_i, S_i = Σ y_exp x_calᵀ / n_i, W_i G_i, the token means and
ω_i do not depend on λ, α or ρ. So per input group we fold the tasks once into

    lhs = Σ ω_i G_i,   rhs_exp,p = Σ ω_i S_i,p,   rhs_cal,p = Σ ω_i W_i,p G_i

and any α gives rhs_p = α rhs_exp,p + (1 − α) rhs_cal,p (the same for the bias
sums). The ridge system (lhs + (λ + eps) I) depends on λ only: one Cholesky
factor per distinct λ serves every (α, ρ), one triangular solve per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from featcal_llm.errors import FeatCalError, warn
from featcal_llm.maths.solve import (
    RESIDUAL_TOLERANCE,
    SOLVE_DTYPE,
    GroupSystem,
    add_norm_terms,
    residual_probe,
    ridge_solve,
    solve_checked,
    task_weight,
)
from featcal_llm.maths.stats import GroupStatistics, crosses_from_moment


@dataclass
class SharedSystem:
    """One input group's candidate-independent sums over tasks."""

    lhs: torch.Tensor
    rhs_exp: dict[str, torch.Tensor]  # Σ ω_i S_i (the α = 1 target)
    rhs_cal: dict[str, torch.Tensor]  # Σ ω_i W_i G_i (the α = 0 target)
    omega_sum: float = 0.0
    bias_exp: dict[str, torch.Tensor] = field(default_factory=dict)  # Σ ω_i (b_i + W_i μ_exp,i)
    bias_cal: dict[str, torch.Tensor] = field(default_factory=dict)  # Σ ω_i (b_i + W_i μ_cal,i)
    weighted_mean_cal: torch.Tensor | None = None
    norm_numerator: torch.Tensor | None = None
    norm_denominator: torch.Tensor | None = None


def add_task_shared(
    system: SharedSystem | None,
    stats: GroupStatistics,
    expert_weights: dict[str, torch.Tensor],
    expert_biases: dict[str, torch.Tensor],
    expert_norm: torch.Tensor | None,
    eps: float,
) -> SharedSystem:
    """Fold one task's statistics (consumed) into the shared sums; the arithmetic of `solve.add_task` split by α."""
    if stats.tokens == 0:
        raise FeatCalError("internal: a task contributed no tokens")
    if stats.cross_is_target:
        raise FeatCalError("internal: a tuned run needs Σ y_exp x_calᵀ, not per-token targets")
    crosses_from_moment(stats, expert_weights)
    n = float(stats.tokens)
    device = stats.gram.device
    stats.gram.div_(n)
    gram_mean = stats.gram.to(SOLVE_DTYPE)
    omega = task_weight(gram_mean, eps)
    if system is None:
        zeros = {name: torch.zeros(cross.shape, dtype=SOLVE_DTYPE, device=device) for name, cross in stats.cross.items()}
        system = SharedSystem(lhs=torch.zeros_like(gram_mean), rhs_exp=zeros, rhs_cal={k: v.clone() for k, v in zeros.items()})
    system.lhs.add_(gram_mean, alpha=omega)
    system.omega_sum += omega
    for name, cross in stats.cross.items():
        weight_gram = (expert_weights[name].to(device=device, dtype=stats.gram.dtype) @ stats.gram).to(SOLVE_DTYPE)
        system.rhs_exp[name].add_(cross.to(SOLVE_DTYPE).div_(n), alpha=omega)
        system.rhs_cal[name].add_(weight_gram, alpha=omega)
    if stats.sum_cal is not None:
        mean_cal = stats.sum_cal.to(SOLVE_DTYPE) / n
        mean_exp = stats.sum_exp.to(SOLVE_DTYPE) / n
        if system.weighted_mean_cal is None:
            system.weighted_mean_cal = torch.zeros_like(mean_cal)
        system.weighted_mean_cal.add_(mean_cal, alpha=omega)
        for name, bias in expert_biases.items():
            weight = expert_weights[name].to(device=device, dtype=SOLVE_DTYPE)
            bias = bias.to(device=device, dtype=SOLVE_DTYPE)
            for sums, mean in ((system.bias_exp, mean_exp), (system.bias_cal, mean_cal)):
                term = bias + weight @ mean
                sums[name] = sums.get(name, torch.zeros_like(term)).add_(term, alpha=omega)
    add_norm_terms(system, stats, expert_norm, n)
    return system


def system_for(shared: SharedSystem, alpha: float) -> GroupSystem:
    """The `GroupSystem` of one α (lhs shared, not copied): rhs = α rhs_exp + (1 − α) rhs_cal."""
    mix = lambda exp, cal: torch.lerp(cal, exp, alpha)  # noqa: E731 - (1 − α) cal + α exp
    return GroupSystem(
        lhs=shared.lhs,
        rhs={name: mix(shared.rhs_exp[name], shared.rhs_cal[name]) for name in shared.rhs_exp},
        omega_sum=shared.omega_sum,
        bias_sum={name: mix(shared.bias_exp[name], shared.bias_cal[name]) for name in shared.bias_exp},
        weighted_mean_cal=shared.weighted_mean_cal,
        norm_numerator=shared.norm_numerator,
        norm_denominator=shared.norm_denominator,
    )


class RidgeFactors:
    """Cholesky factors of lhs + (λ + eps) I, one per group for the most recent λ (O(one layer) memory)."""

    def __init__(self) -> None:
        self._factors: dict[str, tuple[float, torch.Tensor | None]] = {}

    def solve(
        self, group: str, lhs: torch.Tensor, rhs: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor],
        lam: float, eps: float, where: str,
    ) -> dict[str, torch.Tensor]:
        """W*_p = (rhs_p + λ A_p)(lhs + (λ + eps) I)⁻¹, checked by its residual; `lhs` is not modified.

        A factorisation that fails or a solution that does not meet the residual
        tolerance goes to `solve.ridge_solve` (larger ridge, with a warning).
        """
        cached = self._factors.get(group)
        if cached is None or cached[0] != lam:
            system = lhs.clone()
            system.diagonal().add_(lam + eps)
            factor, info = torch.linalg.cholesky_ex(system)
            self._factors[group] = cached = (lam, factor if int(info) == 0 else None)
            del system
        factor = cached[1]
        if factor is not None:
            probe = residual_probe(lhs)
            solutions, worst = solve_checked(factor, lhs @ probe + (lam + eps) * probe, probe, rhs, anchors, lam)
            if worst <= RESIDUAL_TOLERANCE:
                return solutions
            warn(f"{where}: λ = {lam:g}: relative residual {worst:.2e}; solving again with a checked larger ridge")
        return ridge_solve(lhs.clone(), rhs, anchors, lam, eps, where)

