"""The ridge solve shared by every objective: W*_p = (rhs_p + λ A_p)(lhs + (λ + eps) I)⁻¹.

One Cholesky factorisation per input group serves all of its projections;
each solution is checked by a sketched residual, and a failed or inaccurate
solve is retried with a larger λ, with a warning (errors.warn: the one effect
here besides the tensors returned), never returned silently.
What goes into lhs and rhs is the objective's business (objective.py).
"""

from __future__ import annotations

import torch

from featcal_llm.errors import FeatCalError, warn

SOLVE_DTYPE = torch.float64
RESIDUAL_TOLERANCE = 1e-6
MAX_RIDGE_RETRIES = 6
SKETCH_COLUMNS = 8
FIRST_RIDGE = 1e-6  # a solve without ridge (λ = 0) retries first with λ = 1e-6 × the mean of lhs's diagonal


def task_weight(gram_mean: torch.Tensor, eps: float) -> float:
    """ω_i = 1 / max(‖G_i‖_F, eps) (Eq. 14): makes λ a relative ridge. A Gram of zeros (every token of the expert's
    records weighs 0) gives ω_i = 0: the expert counts for nothing, where 1/eps would let it set the biases and means."""
    norm = float(torch.linalg.matrix_norm(gram_mean.to(SOLVE_DTYPE)))
    return 0.0 if norm == 0.0 else 1.0 / max(norm, eps)


def anchor(merged: torch.Tensor, base: torch.Tensor, rho: float) -> torch.Tensor:
    """W_anc = ρ W_mer + (1 − ρ) W_base (Eq. 11), in the solve dtype."""
    merged, base = merged.to(SOLVE_DTYPE), base.to(device=merged.device, dtype=SOLVE_DTYPE)
    return rho * merged + (1.0 - rho) * base


def residual_sketch(system: torch.Tensor) -> torch.Tensor:
    """A fixed, seeded random sketch P (d × k) for the residual check: cheap and deterministic."""
    generator = torch.Generator(device=system.device).manual_seed(0)
    return torch.randn(system.shape[0], SKETCH_COLUMNS, generator=generator, device=system.device, dtype=system.dtype)


def _sketched_residual(solution: torch.Tensor, system_sketch: torch.Tensor, target: torch.Tensor, sketch: torch.Tensor) -> float:
    """‖(W S − T) P‖ / ‖T P‖ from S P: the relative residual at O(m·d·k), not O(m·d²)."""
    residual = solution @ system_sketch - target @ sketch
    return float(torch.linalg.matrix_norm(residual)) / max(float(torch.linalg.matrix_norm(target @ sketch)), 1e-300)


def solve_checked(
    factor: torch.Tensor, system_sketch: torch.Tensor, sketch: torch.Tensor,
    rhs: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor], lam: float,
) -> tuple[dict[str, torch.Tensor], float]:
    """W*_p = (rhs_p + λ A_p) S⁻¹ from S's Cholesky factor, and the worst relative residual (inf if any is not finite)."""
    solutions, worst = {}, 0.0
    for name, right in rhs.items():
        target = right + lam * anchors[name]
        solution = torch.cholesky_solve(target.T, factor).T
        worst = max(worst, _sketched_residual(solution, system_sketch, target, sketch))
        solutions[name] = solution
    if not all(bool(torch.isfinite(s).all()) for s in solutions.values()):
        worst = float("inf")
    return solutions, worst


class RidgeSolver:
    """Ridge solves of one layer's groups, checked and retried with a larger λ when they fail.

    `keep_lhs=False` (a run with one setting): the ridge goes onto lhs's diagonal
    in place, so no second d × d matrix exists. `keep_lhs=True` (a tuned run):
    lhs stays intact and each group's factor of lhs + (λ + eps) I is kept for the
    most recent λ, so every (α, ρ) at that λ costs triangular solves only
    (O(one layer) memory: one factor per group).

    A retry solves the same problem with the larger λ' on both sides,
    W* = (rhs + λ' A)(lhs + (λ' + eps) I)⁻¹: a stronger pull toward the
    anchor, never toward zero.
    """

    def __init__(self, keep_lhs: bool = False):
        self.keep_lhs = keep_lhs
        self._factors: dict[str, tuple[float, torch.Tensor | None]] = {}

    def _factor(self, group: str, lhs: torch.Tensor, shift: float, on_diagonal: float) -> torch.Tensor | None:
        """Cholesky factor of lhs + shift I (None if not positive definite); `on_diagonal`: what lhs already carries."""
        if not self.keep_lhs:
            lhs.diagonal().add_(shift - on_diagonal)
            factor, info = torch.linalg.cholesky_ex(lhs)
            return factor if int(info) == 0 else None
        cached = self._factors.get(group)
        if cached is None or cached[0] != shift:
            system = lhs.clone()
            system.diagonal().add_(shift)
            factor, info = torch.linalg.cholesky_ex(system)
            self._factors[group] = cached = (shift, factor if int(info) == 0 else None)
        return cached[1]

    def solve(
        self, group: str, lhs: torch.Tensor, rhs: dict[str, torch.Tensor], anchors: dict[str, torch.Tensor],
        lam: float, eps: float, where: str,
    ) -> dict[str, torch.Tensor]:
        """W*_p = (rhs_p + λ A_p)(lhs + (λ + eps) I)⁻¹ for every projection p of the group."""
        sketch = residual_sketch(lhs)
        lhs_sketch = lhs @ sketch  # (lhs + s I) P = lhs P + s P for every shift s tried
        ridge, on_diagonal = lam, 0.0
        for attempt in range(MAX_RIDGE_RETRIES + 1):
            factor = self._factor(group, lhs, ridge + eps, on_diagonal)
            on_diagonal = 0.0 if self.keep_lhs else ridge + eps
            worst = 0.0
            if factor is not None:
                solutions, worst = solve_checked(factor, lhs_sketch + (ridge + eps) * sketch, sketch, rhs, anchors, ridge)
                if worst <= RESIDUAL_TOLERANCE:
                    return solutions
            reason = "not positive definite" if factor is None else f"relative residual {worst:.2e}"
            if attempt == MAX_RIDGE_RETRIES:
                break
            ridge = ridge * 10 if ridge > 0 else FIRST_RIDGE * max(float(lhs.diagonal().mean()), eps)  # λ = 0 (RegMean): start small
            warn(f"{where}: solve {reason}; retrying with lambda {ridge:.3g}")
        raise FeatCalError(f"{where}: closed-form solve failed ({reason}) even with lambda {ridge:.3g}")
