"""The closed-form FeatCal updates (Eq. 10-17, 55 and our RMSNorm adaptation), as pure functions.

Tasks are folded into a `GroupSystem` one at a time, so only one task's raw
statistics need to exist at once:

    lhs = Σ_i ω_i G_i                  rhs_p = Σ_i ω_i R_i,p
    W*_p (lhs + (λ + eps) I) = rhs_p + λ W_anc,p

with G_i = gram_i / n_i, R_i = α cross_i / n_i + (1 − α) W_i G_i and
ω_i = 1 / max(‖G_i‖_F, eps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from featcal_llm.errors import FeatCalError, warn
from featcal_llm.maths.stats import GroupStatistics, crosses_from_moment

SOLVE_DTYPE = torch.float64
RESIDUAL_TOLERANCE = 1e-6
MAX_RIDGE_RETRIES = 6
RESIDUAL_PROBES = 8


@dataclass
class GroupSystem:
    """One input group's normal equations, summed over the tasks seen so far."""

    lhs: torch.Tensor
    rhs: dict[str, torch.Tensor]
    omega_sum: float = 0.0
    bias_sum: dict[str, torch.Tensor] = field(default_factory=dict)  # Σ ω_i (b_i + W_i μ_tgt,i)
    weighted_mean_cal: torch.Tensor | None = None  # Σ ω_i μ_cal,i
    norm_numerator: torch.Tensor | None = None  # Σ q_i ⊙ γ_i
    norm_denominator: torch.Tensor | None = None  # Σ q_i


def task_weight(gram_mean: torch.Tensor, eps: float) -> float:
    """ω_i = 1 / max(‖G_i‖_F, eps) (Eq. 14): makes λ a relative ridge."""
    return 1.0 / max(float(torch.linalg.matrix_norm(gram_mean.to(SOLVE_DTYPE))), eps)


def add_task(
    system: GroupSystem | None,
    stats: GroupStatistics,
    expert_weights: dict[str, torch.Tensor],
    expert_biases: dict[str, torch.Tensor],
    expert_norm: torch.Tensor | None,
    alpha: float,
    eps: float,
) -> GroupSystem:
    """Fold one task's statistics of one input group into the running system (consuming the statistics)."""
    if stats.tokens == 0:
        raise FeatCalError("internal: a task contributed no tokens")
    crosses_from_moment(stats, expert_weights)
    n = float(stats.tokens)
    device = stats.gram.device
    stats.gram.div_(n)  # the statistics are consumed: G_i = Σ x xᵀ / n in place, no d × d copy
    gram_mean = stats.gram.to(SOLVE_DTYPE)
    omega = task_weight(gram_mean, eps)
    if system is None:
        system = GroupSystem(
            lhs=torch.zeros_like(gram_mean),
            rhs={name: torch.zeros(cross.shape, dtype=SOLVE_DTYPE, device=device) for name, cross in stats.cross.items()},
        )
    system.lhs.add_(gram_mean, alpha=omega)
    system.omega_sum += omega
    for name, cross in stats.cross.items():
        if stats.cross_is_target:  # already Σ (W_i x_tgt) x_calᵀ
            system.rhs[name].add_(cross.to(SOLVE_DTYPE), alpha=omega / n)
            continue
        # R_i = α Σ y_exp x_calᵀ / n + (1 − α) W_i G_i; W_i G_i in the totals' precision (float64).
        weight_gram = (expert_weights[name].to(device=device, dtype=stats.gram.dtype) @ stats.gram).to(SOLVE_DTYPE)
        target_cross = cross.to(SOLVE_DTYPE).div_(n).mul_(alpha).add_(weight_gram, alpha=1.0 - alpha)
        system.rhs[name].add_(target_cross, alpha=omega)
    if stats.sum_cal is not None:
        mean_cal = stats.sum_cal.to(SOLVE_DTYPE) / n
        mean_target = alpha * stats.sum_exp.to(SOLVE_DTYPE) / n + (1.0 - alpha) * mean_cal
        if system.weighted_mean_cal is None:
            system.weighted_mean_cal = torch.zeros_like(mean_cal)
        system.weighted_mean_cal.add_(mean_cal, alpha=omega)
        for name, bias in expert_biases.items():
            weight = expert_weights[name].to(device=device, dtype=SOLVE_DTYPE)
            term = bias.to(device=device, dtype=SOLVE_DTYPE) + weight @ mean_target
            system.bias_sum[name] = system.bias_sum.get(name, torch.zeros_like(term)).add_(term, alpha=omega)
    add_norm_terms(system, stats, expert_norm, n)
    return system


def add_norm_terms(system, stats: GroupStatistics, expert_norm: torch.Tensor | None, n: float) -> None:
    """Σ q_i ⊙ γ_i and Σ q_i of the RMSNorm update (q_i: per-coordinate mean of z² over task i's tokens)."""
    if stats.norm_sq is None or expert_norm is None:
        return
    q = stats.norm_sq.to(SOLVE_DTYPE) / n
    gamma = expert_norm.to(device=q.device, dtype=SOLVE_DTYPE)
    if system.norm_numerator is None:
        system.norm_numerator, system.norm_denominator = torch.zeros_like(q), torch.zeros_like(q)
    system.norm_numerator.add_(q * gamma)
    system.norm_denominator.add_(q)


def anchor(merged: torch.Tensor, base: torch.Tensor, rho: float) -> torch.Tensor:
    """W_anc = ρ W_mer + (1 − ρ) W_base (Eq. 11), in the solve dtype."""
    merged, base = merged.to(SOLVE_DTYPE), base.to(device=merged.device, dtype=SOLVE_DTYPE)
    return rho * merged + (1.0 - rho) * base


def residual_probe(system: torch.Tensor) -> torch.Tensor:
    """A fixed, seeded random probe P (d × k) for the sketched residual check: cheap and deterministic."""
    generator = torch.Generator(device=system.device).manual_seed(0)
    return torch.randn(system.shape[0], RESIDUAL_PROBES, generator=generator, device=system.device, dtype=system.dtype)


def _sketched_residual(solution: torch.Tensor, system_probe: torch.Tensor, target: torch.Tensor, probe: torch.Tensor) -> float:
    """‖(W S − T) P‖ / ‖T P‖ from S P: the relative residual at O(m·d·k), not O(m·d²)."""
    residual = solution @ system_probe - target @ probe
    return float(torch.linalg.matrix_norm(residual)) / max(float(torch.linalg.matrix_norm(target @ probe)), 1e-300)


def solve_checked(
    factor: torch.Tensor, system_probe: torch.Tensor, probe: torch.Tensor,
    rhs: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor], lam: float,
) -> tuple[dict[str, torch.Tensor], float]:
    """W*_p = (rhs_p + λ A_p) S⁻¹ from S's Cholesky factor, and the worst relative residual (inf if any is not finite)."""
    solutions, worst = {}, 0.0
    for name, right in rhs.items():
        target = right + lam * anchors[name]
        solution = torch.cholesky_solve(target.T, factor).T
        worst = max(worst, _sketched_residual(solution, system_probe, target, probe))
        solutions[name] = solution
    if not all(bool(torch.isfinite(s).all()) for s in solutions.values()):
        worst = float("inf")
    return solutions, worst


def ridge_solve(
    lhs: torch.Tensor, rhs: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor], lam: float, eps: float, where: str
) -> dict[str, torch.Tensor]:
    """W*_p = (rhs_p + λ A_p)(lhs + (λ + eps) I)⁻¹ by one Cholesky factorisation per group.

    `lhs` is consumed (the ridge is added to its diagonal in place). Each
    solution is checked by its residual (sketched with a seeded random
    probe, so the check is cheap and deterministic); a failed or inaccurate
    solve is retried with a ten times larger λ, with a warning, never
    returned silently. A retry solves the same problem with the larger λ'
    on both sides, W* = (rhs + λ' A)(lhs + (λ' + eps) I)⁻¹: a stronger pull
    toward the anchor, never toward zero.
    """
    probe = residual_probe(lhs)
    ridge, on_diagonal = lam, 0.0
    system = lhs  # the ridge goes onto lhs's diagonal in place: no second d × d matrix
    for attempt in range(MAX_RIDGE_RETRIES + 1):
        system.diagonal().add_(ridge + eps - on_diagonal)
        on_diagonal = ridge + eps
        factor, info = torch.linalg.cholesky_ex(system)
        worst = 0.0
        if int(info) == 0:
            solutions, worst = solve_checked(factor, system @ probe, probe, rhs, anchors, ridge)
            if worst <= RESIDUAL_TOLERANCE:
                return solutions
        del factor
        reason = "not positive definite" if int(info) != 0 else f"relative residual {worst:.2e}"
        if attempt == MAX_RIDGE_RETRIES:
            break
        warn(f"{where}: solve {reason}; retrying with lambda {ridge * 10:.3g}")
        ridge *= 10
    raise FeatCalError(f"{where}: closed-form solve failed ({reason}) even with lambda {ridge:.3g}")


def solve_bias(
    system: GroupSystem, name: str, solved_weight: torch.Tensor, bias_anchor: torch.Tensor, lam: float
) -> torch.Tensor:
    """b* = (Σ ω_i (b_i + W_i μ_tgt,i − W* μ_cal,i) + λ b_anc) / (Σ ω_i + λ)  (Eq. 55)."""
    numerator = system.bias_sum[name] - solved_weight @ system.weighted_mean_cal + lam * bias_anchor
    return numerator / (system.omega_sum + lam)


def solve_norm(system: GroupSystem, norm_anchor: torch.Tensor, lam: float) -> torch.Tensor:
    """γ* = (Σ q_i γ_i + λ γ_anc) / (Σ q_i + λ), element-wise.

    The weights of γ_i and γ_anc sum to one, so the update commutes with a
    constant offset: for Gemma's (1 + w) norms, solving on the stored w is
    solving on the effective scale 1 + w.
    """
    return (system.norm_numerator + lam * norm_anchor) / (system.norm_denominator + lam)
