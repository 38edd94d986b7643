"""Coverage weights: an expert that does other experts' work counts for them too.

FeatCal's objective has one term per expert. Beside narrow experts, a broad one
(an instruction expert, trained on many kinds of text) is then one voice among
several, and the narrow experts pull the shared layers as hard as it does; the
calibrated merge stays behind the broad expert shipped alone. Coverage weighs
expert i by how much of every expert j's gain over the base it achieves on j's
own calibration text:

    s_ij = clip((NLL_base(D_j) − NLL_i(D_j)) / (NLL_base(D_j) − NLL_j(D_j)), 0, 1),   s_jj = 1,
    weight_i = Σ_j s_ij,

so a narrow expert weighs about 1 and an expert as good as each other expert on
its text weighs about the number of experts. Label-free: next-token NLL of the
models on the calibration records. An expert that is no better than the base on
its own text has no gain to share: s_ij = 0 for i ≠ j.
"""

from __future__ import annotations

COVERAGE_RECORDS = 16  # of each expert's calibration records, scored by the base and every expert
Losses = dict[str, dict[str, float]]  # model → expert whose records were scored → mean next-token NLL


def coverage_shares(losses: Losses, base: dict[str, float]) -> Losses:
    """s_ij for every pair: the share of expert j's gain over the base on j's records that expert i achieves."""
    shares: Losses = {}
    for i in losses:
        shares[i] = {}
        for j in losses:
            gain = base[j] - losses[j][j]
            if i == j:
                shares[i][j] = 1.0
            elif gain <= 0:
                shares[i][j] = 0.0
            else:
                shares[i][j] = min(1.0, max(0.0, (base[j] - losses[i][j]) / gain))
    return shares


def behind_the_base(losses: Losses, base: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The experts that predict their own records no better than the base does (expert → (its NLL, the base's)): they
    did not learn their kind of text, so calibrating toward them cannot help, whatever the merge does."""
    return {j: (losses[j][j], base[j]) for j in losses if j in losses[j] and j in base and losses[j][j] >= base[j]}


def coverage_weights(losses: Losses, base: dict[str, float]) -> dict[str, float]:
    """weight_i = Σ_j s_ij: 1 for an expert that only does its own work, up to the number of experts."""
    return {i: sum(row.values()) for i, row in coverage_shares(losses, base).items()}


def better_teachers(leads: dict[str, dict[str, list[float]]], standard_errors: float | None = None) -> dict[str, tuple[str, float, float]]:
    """`teachers: best`: for each expert i, the other expert j that predicts i's records best, where it does so beyond
    doubt (i → (j, its mean lead over i, the margin)); an expert whose own model is best, or not beaten beyond two
    standard errors, is left out (it teaches its own records).

    `leads[i][j]`: advantage.lead_moments of j's lead over i (log p_j − log p_i of the next token) on i's records,
    summed over ranks. The lead of j is judged as an expert's lead over the merge is (advantage.lead_margin, the record
    as the unit), with the sign reversed: j is ahead where its mean lead minus its margin is above 0. Of several such
    experts the one with the largest mean lead teaches (the first in the recipe's order on a tie).
    """
    from featcal_llm.maths.advantage import lead_margin

    chosen: dict[str, tuple[str, float, float]] = {}
    for i, row in leads.items():
        best = None
        for j, moments in row.items():
            if j == i or moments[0] < 2 or moments[2] <= 0:  # one record measures no spread: no doubt can be judged
                continue
            mean, margin = moments[1] / moments[2], lead_margin(moments, standard_errors)
            if mean - margin > 0 and (best is None or mean > best[1]):
                best = (j, mean, margin)
        if best is not None:
            chosen[i] = best
    return chosen
