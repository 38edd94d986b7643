"""The method as an objective over the recorded statistics: how each task is folded into a group's system, how it is solved.

FeatCal (featcal_method.md, Eq. 10-17 and 55, plus our RMSNorm adaptation)
folds task i of one input group as

    lhs += ω_i G_i,   rhs_p += ω_i R_i,p,   R_i,p = α S_i,p + (1 − α) W_i,p G_i

with G_i = Σ x_cal x_calᵀ / n_i, S_i,p = Σ y_exp,p x_calᵀ / n_i and
ω_i = 1 / max(‖G_i‖_F, eps), then solves W*_p (lhs + (λ + eps) I) = rhs_p + λ A_p
towards the anchor A = ρ W_mer + (1 − ρ) W_base. One arithmetic serves a
fixed run and a tuned one; they differ only in where the targets go
(`MixedTargets`: α is known, one sum per projection; `SplitTargets`: the
α = 1 and α = 0 parts kept apart, so any α is one lerp) and in whether the
solver keeps Cholesky factors across candidates (`RidgeSolver`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from featcal_llm.errors import FeatCalError
from featcal_llm.maths.solve import SOLVE_DTYPE, task_weight
from featcal_llm.maths.stats import GroupStatistics

@dataclass(frozen=True)
class Hyperparameters:
    lam: float
    alpha: float
    rho: float
    eps: float

    def values(self) -> dict[str, float]:
        """The searched keys' values, as reports and written recipes name them."""
        return {"lambda": self.lam, "alpha": self.alpha, "rho": self.rho}


def _accumulate(sums: dict[str, torch.Tensor], name: str, term: torch.Tensor, weight: float) -> None:
    if name not in sums:
        sums[name] = torch.zeros_like(term)
    sums[name].add_(term, alpha=weight)


class MixedTargets:
    """Σ ω_i (α e_i + (1 − α) c_i) per name, α fixed when folding: one running sum per projection."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, name: str, expert_part: torch.Tensor, cal_part: torch.Tensor, weight: float) -> None:
        """Consumes `expert_part` (the mix is formed in its storage)."""
        _accumulate(self.sums, name, expert_part.mul_(self.alpha).add_(cal_part, alpha=1.0 - self.alpha), weight)

    def add_bias(self, name: str, bias: torch.Tensor, weight: torch.Tensor, sum_exp: torch.Tensor, mean_cal: torch.Tensor, n: float, omega: float) -> None:
        """Σ ω_i (b_i + W_i μ_tgt,i), μ_tgt = α μ_exp + (1 − α) μ_cal."""
        mean_target = self.alpha * sum_exp / n + (1.0 - self.alpha) * mean_cal
        _accumulate(self.sums, name, bias + weight @ mean_target, omega)

    def at(self, alpha: float) -> dict[str, torch.Tensor]:
        if alpha != self.alpha:
            raise FeatCalError(f"internal: targets were folded with alpha {self.alpha:g}, asked for {alpha:g}")
        return self.sums


class SplitTargets:
    """Σ ω_i e_i and Σ ω_i c_i kept apart (twice the memory), so every α of a tuned run is one lerp."""

    def __init__(self) -> None:
        self.expert: dict[str, torch.Tensor] = {}
        self.cal: dict[str, torch.Tensor] = {}

    def add(self, name: str, expert_part: torch.Tensor, cal_part: torch.Tensor, weight: float) -> None:
        _accumulate(self.expert, name, expert_part, weight)
        _accumulate(self.cal, name, cal_part, weight)

    def add_bias(self, name: str, bias: torch.Tensor, weight: torch.Tensor, sum_exp: torch.Tensor, mean_cal: torch.Tensor, n: float, omega: float) -> None:
        _accumulate(self.expert, name, bias + weight @ (sum_exp / n), omega)
        _accumulate(self.cal, name, bias + weight @ mean_cal, omega)

    def at(self, alpha: float) -> dict[str, torch.Tensor]:
        return {name: torch.lerp(self.cal[name], self.expert[name], alpha) for name in self.expert}  # (1 − α) cal + α exp


Targets = MixedTargets | SplitTargets


@dataclass
class GroupSystem:
    """One input group's normal equations, summed over the tasks seen so far."""

    lhs: torch.Tensor  # Σ ω_i G_i
    targets: Targets  # rhs_p = Σ ω_i R_i,p
    biases: Targets  # Σ ω_i (b_i + W_i μ_tgt,i)
    omega_sum: float = 0.0
    weighted_mean_cal: torch.Tensor | None = None  # Σ ω_i μ_cal,i
    norm_numerator: torch.Tensor | None = None  # Σ q_i ⊙ γ_i
    norm_denominator: torch.Tensor | None = None  # Σ q_i


@dataclass(frozen=True)
class ExpertGroup:
    """Expert i's tensors of one input group: the selected projections' weights and biases, and the group's norm."""

    weights: dict[str, torch.Tensor]
    biases: dict[str, torch.Tensor] = field(default_factory=dict)
    norm: torch.Tensor | None = None


def fold(system: GroupSystem, stats: GroupStatistics, expert: ExpertGroup, eps: float, share: float = 1.0) -> None:
    """Add one task's statistics of one group to its system, consuming them (G_i is formed in the Gram's storage).

    `share` is the task's weight from the recipe (`data.<expert>.weight`): it multiplies ω_i, and q_i in the norm update.
    """
    if stats.tokens == 0:
        raise FeatCalError("internal: a task contributed no tokens")
    crosses = stats.expert_crosses(expert.weights)
    n = float(stats.tokens)
    device = stats.gram.device
    stats.gram.div_(n)
    gram_mean = stats.gram.to(SOLVE_DTYPE)
    omega = task_weight(gram_mean, eps) * share
    if system.lhs is None:
        system.lhs = torch.zeros_like(gram_mean)
    system.lhs.add_(gram_mean, alpha=omega)
    system.omega_sum += omega
    for name, cross in crosses.items():
        # W_i G_i in the totals' precision (float64)
        weight_gram = (expert.weights[name].to(device=device, dtype=stats.gram.dtype) @ stats.gram).to(SOLVE_DTYPE)
        system.targets.add(name, cross.to(SOLVE_DTYPE).div_(n), weight_gram, omega)
    if stats.sum_cal is not None:
        mean_cal = stats.sum_cal.to(SOLVE_DTYPE) / n
        if system.weighted_mean_cal is None:
            system.weighted_mean_cal = torch.zeros_like(mean_cal)
        system.weighted_mean_cal.add_(mean_cal, alpha=omega)
        for name, bias in expert.biases.items():
            weight = expert.weights[name].to(device=device, dtype=SOLVE_DTYPE)
            system.biases.add_bias(name, bias.to(device=device, dtype=SOLVE_DTYPE), weight, stats.sum_exp.to(SOLVE_DTYPE), mean_cal, n, omega)
    if stats.norm_sq is not None and expert.norm is not None:  # q_i: per-coordinate mean of (x / rms(x))² over the task's tokens
        q = stats.norm_sq.to(SOLVE_DTYPE) / n
        gamma = expert.norm.to(device=q.device, dtype=SOLVE_DTYPE)
        if system.norm_numerator is None:
            system.norm_numerator, system.norm_denominator = torch.zeros_like(q), torch.zeros_like(q)
        system.norm_numerator.add_(q * gamma, alpha=share)
        system.norm_denominator.add_(q, alpha=share)


def solve_bias(system: GroupSystem, bias_sum: torch.Tensor, solved_weight: torch.Tensor, bias_anchor: torch.Tensor, lam: float) -> torch.Tensor:
    """b* = (Σ ω_i (b_i + W_i μ_tgt,i − W* μ_cal,i) + λ b_anc) / (Σ ω_i + λ)  (Eq. 55)."""
    numerator = bias_sum - solved_weight @ system.weighted_mean_cal + lam * bias_anchor
    return numerator / (system.omega_sum + lam)


def solve_norm(system: GroupSystem, norm_anchor: torch.Tensor, lam: float) -> torch.Tensor:
    """γ* = (Σ q_i γ_i + λ γ_anc) / (Σ q_i + λ), element-wise.

    The weights of γ_i and γ_anc sum to one, so the update commutes with a
    constant offset: for Gemma's (1 + w) norms, solving on the stored w is
    solving on the effective scale 1 + w.
    """
    return (system.norm_numerator + lam * norm_anchor) / (system.norm_denominator + lam)
