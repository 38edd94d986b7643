"""Property tests of the closed-form solve on random symmetric positive semi-definite systems (issue 4)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from featcal_llm.maths.objective import ExpertGroup, GroupSystem, MixedTargets, fold
from featcal_llm.maths.solve import RidgeSolver, anchor, task_weight
from featcal_llm.maths.stats import GroupStatistics



def ridge_solve(lhs, rhs, anchors, lam, eps, where):
    return RidgeSolver().solve("group", lhs, rhs, anchors, lam, eps, where)


dimensions = st.integers(min_value=1, max_value=12)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def random_psd(d: int, rank: int, generator: torch.Generator) -> torch.Tensor:
    factor = torch.randn(d, rank, generator=generator, dtype=torch.float64)
    return factor @ factor.T


@settings(max_examples=60, deadline=None)
@given(d=dimensions, m=dimensions, rank=st.integers(0, 12), lam=st.floats(1e-6, 1e3), seed=seeds)
def test_solution_satisfies_the_normal_equations(d, m, rank, lam, seed):
    generator = torch.Generator().manual_seed(seed)
    lhs = random_psd(d, min(rank, d), generator)
    lhs = lhs / max(float(torch.linalg.matrix_norm(lhs)), 1.0)
    rhs = torch.randn(m, d, generator=generator, dtype=torch.float64)
    target = torch.randn(m, d, generator=generator, dtype=torch.float64)
    eps = 1e-8
    solution = ridge_solve(lhs.clone(), {"p": rhs}, {"p": target}, lam, eps, "test")["p"]
    system = lhs + (lam + eps) * torch.eye(d, dtype=torch.float64)
    residual = solution @ system - (rhs + lam * target)
    assert float(torch.linalg.matrix_norm(residual)) <= 1e-8 * (1 + float(torch.linalg.matrix_norm(rhs + lam * target)))


@settings(max_examples=40, deadline=None)
@given(d=dimensions, m=dimensions, seed=seeds)
def test_huge_lambda_returns_the_anchor_and_tiny_lambda_the_unregularised_fit(d, m, seed):
    generator = torch.Generator().manual_seed(seed)
    lhs = random_psd(d, d, generator) + 0.5 * torch.eye(d, dtype=torch.float64)  # full rank
    rhs = torch.randn(m, d, generator=generator, dtype=torch.float64)
    target = torch.randn(m, d, generator=generator, dtype=torch.float64)
    far = ridge_solve(lhs.clone(), {"p": rhs}, {"p": target}, 1e12, 1e-12, "test")["p"]
    assert torch.allclose(far, target, rtol=1e-6, atol=1e-6)
    near = ridge_solve(lhs.clone(), {"p": rhs}, {"p": target}, 1e-12, 1e-12, "test")["p"]
    assert torch.allclose(near, rhs @ torch.linalg.inv(lhs), rtol=1e-6, atol=1e-8)


@settings(max_examples=40, deadline=None)
@given(d=dimensions, m=dimensions, tokens=st.integers(1, 30), alpha=st.floats(0, 1), seed=seeds)
def test_fold_builds_omega_g_and_omega_w_c(d, m, tokens, alpha, seed):
    """The folded system equals ω G and ω W_i x_tgt x_calᵀ / n written out token by token."""
    generator = torch.Generator().manual_seed(seed)
    x_cal = torch.randn(tokens, d, generator=generator, dtype=torch.float64)
    x_exp = torch.randn(tokens, d, generator=generator, dtype=torch.float64)
    weight = torch.randn(m, d, generator=generator, dtype=torch.float64)
    stats = GroupStatistics.empty(d, {"p": m}, with_means=False, with_norm=False, device=torch.device("cpu"), dtype=torch.float64)
    stats.gram += x_cal.T @ x_cal
    stats.cross["p"] += (x_exp @ weight.T).T @ x_cal
    stats.tokens = tokens
    system = GroupSystem(lhs=None, targets=MixedTargets(alpha), biases=MixedTargets(alpha))
    fold(system, stats, ExpertGroup({"p": weight}), 1e-8)
    gram = x_cal.T @ x_cal / tokens
    omega = task_weight(gram, 1e-8)
    x_target = alpha * x_exp + (1 - alpha) * x_cal
    assert torch.allclose(system.lhs, omega * gram)
    assert torch.allclose(system.targets.at(alpha)["p"], omega * (x_target @ weight.T).T @ x_cal / tokens)


@given(rho=st.floats(-2, 3))
def test_anchor_interpolates_and_extrapolates(rho):
    merged, base = torch.tensor([2.0]), torch.tensor([1.0])
    assert torch.allclose(anchor(merged, base, rho), torch.tensor([1.0 + rho], dtype=torch.float64))


def test_failed_factorisation_is_retried_with_a_larger_lambda_on_both_sides_and_a_warning(monkeypatch, capsys):
    """Issue 10 bug 1: the retry solves (rhs + λ' A)(lhs + (λ' + eps) I)⁻¹, pulled toward the anchor A, not zero."""
    import featcal_llm.maths.solve as solve

    real = torch.linalg.cholesky_ex
    calls = []

    def fail_first(matrix):
        calls.append(float(matrix[0, 0]))
        factor, info = real(matrix)
        return factor, (torch.tensor(1) if len(calls) == 1 else info)

    monkeypatch.setattr(solve.torch.linalg, "cholesky_ex", fail_first)
    lhs = torch.eye(3, dtype=torch.float64)
    anchor_weights = torch.full((2, 3), 2.0, dtype=torch.float64)
    solution = ridge_solve(lhs, {"p": torch.ones(2, 3, dtype=torch.float64)}, {"p": anchor_weights}, 1.0, 1e-3, "layer 7 mlp_input")["p"]
    assert calls == [1.0 + 1.0 + 1e-3, 1.0 + 10.0 + 1e-3]  # λ 1 → 10, eps stays eps
    assert torch.allclose(solution, torch.full((2, 3), (1 + 10 * 2.0) / (1 + 10 + 1e-3), dtype=torch.float64), rtol=1e-14)
    assert "featcal-llm: warning: layer 7 mlp_input: solve not positive definite; retrying with lambda 10" in capsys.readouterr().err


def test_a_solve_that_never_succeeds_is_an_error_not_a_silent_write():
    import pytest

    from featcal_llm.errors import FeatCalError

    lhs = torch.full((2, 2), float("nan"), dtype=torch.float64)
    with pytest.raises(FeatCalError, match="layer 3 attention_input: closed-form solve failed"):
        ridge_solve(lhs, {"p": torch.ones(1, 2, dtype=torch.float64)}, {"p": torch.zeros(1, 2, dtype=torch.float64)}, 1.0, 0.0, "layer 3 attention_input")


def test_the_retries_grow_lambda_tenfold_six_times_then_give_up(monkeypatch, capsys):
    """A system that is never positive definite: λ 1 then 10, 100, … 1e6 (six retries), then one error naming the
    last λ. A ridge-free solve (λ = 0, RegMean) retries first at 1e-6 × the mean of lhs's diagonal."""
    import pytest

    import featcal_llm.maths.solve as solve
    from featcal_llm.errors import FeatCalError

    shifts = []

    def never(matrix):
        shifts.append(float(matrix[0, 0]) - 4.0)  # lhs = 4 I: the shift added to its diagonal
        return matrix, torch.tensor(1)

    monkeypatch.setattr(solve.torch.linalg, "cholesky_ex", never)
    arguments = ({"p": torch.ones(1, 3, dtype=torch.float64)}, {"p": torch.zeros(1, 3, dtype=torch.float64)})
    with pytest.raises(FeatCalError, match=r"layer 0 mlp_hidden: closed-form solve failed \(not positive definite\) even with lambda 1e\+06$"):
        ridge_solve(4.0 * torch.eye(3, dtype=torch.float64), *arguments, 1.0, 0.0, "layer 0 mlp_hidden")
    assert shifts == pytest.approx([10.0**k for k in range(7)], rel=1e-12)
    assert capsys.readouterr().err.count("retrying with lambda") == 6
    shifts.clear()
    with pytest.raises(FeatCalError):
        ridge_solve(4.0 * torch.eye(3, dtype=torch.float64), *arguments, 0.0, 0.0, "layer 0 mlp_hidden")
    assert shifts == pytest.approx([0.0, *(4e-6 * 10.0**k for k in range(6))], rel=1e-9, abs=1e-15)


def test_an_expert_whose_tokens_all_weigh_0_counts_for_nothing():
    """Every token weighs 0 (its records dropped by `trailing_records: drop`): its Gram and sums are zeros, and folding
    it leaves the system as the other expert alone makes it. ω = 1/eps instead let it set the biases (1e8 against ~1)."""
    d, m, tokens = 4, 3, 6

    def expert(seed: int, weighted: bool) -> tuple[GroupStatistics, ExpertGroup]:
        generator = torch.Generator().manual_seed(seed)
        stats = GroupStatistics.empty(d, {"p": m}, with_means=True, with_norm=False, device=torch.device("cpu"), dtype=torch.float64)
        x = torch.randn(tokens, d, generator=generator, dtype=torch.float64) * float(weighted)
        stats.gram += x.T @ x
        stats.cross["p"] += x[:, :m].T @ x
        stats.sum_cal += x.sum(0)
        stats.sum_exp += x.sum(0)
        stats.tokens = tokens  # the tokens counted, each weighing 0 where not `weighted`
        group = ExpertGroup({"p": torch.randn(m, d, generator=generator, dtype=torch.float64)},
                            {"p": torch.randn(m, generator=generator, dtype=torch.float64)})
        return stats, group

    alone = GroupSystem(lhs=None, targets=MixedTargets(0.5), biases=MixedTargets(0.5))
    both = GroupSystem(lhs=None, targets=MixedTargets(0.5), biases=MixedTargets(0.5))
    fold(alone, *expert(0, True), 1e-8)
    fold(both, *expert(0, True), 1e-8)
    fold(both, *expert(1, False), 1e-8)
    assert task_weight(torch.zeros(d, d, dtype=torch.float64), 1e-8) == 0.0
    assert both.omega_sum == alone.omega_sum and torch.equal(both.lhs, alone.lhs)
    assert torch.equal(both.biases.at(0.5)["p"], alone.biases.at(0.5)["p"])


def test_a_solution_that_misses_its_system_is_retried_whichever_projection_and_however_it_misses(monkeypatch, capsys):
    """The residual check: a solve whose answer does not satisfy (W S = T) beyond 1e-6 (an ill-conditioned system in
    practice; here the first solve is made to miss), or holds a NaN, is retried with a larger λ, for the first
    projection of a group as for the last; the retry's answer is the exact one."""
    import featcal_llm.maths.solve as solve

    real = torch.cholesky_solve
    lhs, anchors = 2.0 * torch.eye(3, dtype=torch.float64), {p: torch.zeros(2, 3, dtype=torch.float64) for p in "ab"}
    rhs = {p: torch.ones(2, 3, dtype=torch.float64) for p in "ab"}
    for miss in (lambda x: x + 1.0, lambda x: torch.full_like(x, float("nan"))):
        calls = []
        monkeypatch.setattr(solve.torch, "cholesky_solve", lambda b, f: (calls.append(1), miss(real(b, f)) if len(calls) == 1 else real(b, f))[1])
        solution = ridge_solve(lhs.clone(), rhs, anchors, 1.0, 0.0, "layer 2 mlp_input")
        assert "layer 2 mlp_input: solve " in capsys.readouterr().err and len(calls) == 4  # two projections, twice
        for p in "ab":  # the retry at λ 10: W = T / (2 + 10)
            assert torch.allclose(solution[p], torch.full((2, 3), 1 / 12, dtype=torch.float64), rtol=1e-12)


def test_a_solution_beyond_the_merges_dtype_is_refused_naming_the_tensor_and_dtype():
    """Finite as solved (float64), infinite as a float16 merge stores it: refused before anything is written, naming the
    tensor, the dtype and the lever; one in range is stored in the merge's dtype."""
    from featcal_llm.engine.objectives import LAMBDA_REMEDY, stored_solutions
    from featcal_llm.errors import RunFailure

    merged = {"mlp.down_proj.weight": torch.zeros(2, 2, dtype=torch.float16)}
    fine = stored_solutions(3, {"mlp.down_proj.weight": torch.full((2, 2), 6.0e4, dtype=torch.float64)}, merged)
    assert fine["mlp.down_proj.weight"].dtype == torch.float16 and torch.isfinite(fine["mlp.down_proj.weight"]).all()
    huge = torch.tensor([[1.0, -1.0e6], [0.0, 2.0]], dtype=torch.float64)
    with pytest.raises(RunFailure) as error:
        stored_solutions(3, {"mlp.down_proj.weight": huge}, merged, LAMBDA_REMEDY)
    assert str(error.value) == ("layer 3: solution for mlp.down_proj.weight reaches 1e+06, beyond float16, the merged "
                                "model's dtype, which stores it; a larger featcal.lambda keeps the solution nearer its anchor")
    assert stored_solutions(3, {"w": huge}, {"w": torch.zeros(2, 2, dtype=torch.bfloat16)})["w"].dtype == torch.bfloat16
