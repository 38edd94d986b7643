"""Which held-out check `refine:` keeps: the lowest mean KL to the teachers, among the checks that raise no expert's KL
above the closed form's beyond the noise of its held-out records. Pure functions over per-record KL sums
(`{"sums": [...], "counts": [...]}` per expert, as engine/refine.heldout_kl measures them)."""

from __future__ import annotations

import math

import torch

from featcal_llm.maths.advantage import lead_margin, lead_moments

KEPT_RULE = "lowest mean held-out KL, no expert raised beyond two standard errors over its records"


def expert_kls(records: dict[str, dict[str, list]]) -> dict[str, float]:
    """Per expert: the token mean of the held-out KL over its records' judged tokens."""
    return {task: sum(kl["sums"]) / max(sum(kl["counts"]), 1) for task, kl in records.items()}


def mean_kl(records: dict[str, dict[str, list]]) -> float:
    """The stopping criterion: the experts' held-out KLs averaged, each expert once."""
    per_expert = expert_kls(records)
    return sum(per_expert.values()) / max(len(per_expert), 1)


def raised(records: dict[str, dict[str, list]], before: dict[str, dict[str, list]]) -> list[str]:
    """The experts whose held-out KL a check finds above the closed form's (before the first step) beyond doubt: the
    rise, Σ (record's KL sum − its sum before) / Σ judged tokens, above two standard errors counted over the held-out
    records, as an expert's lead over the merge is judged (maths/advantage.lead_margin); with one record, any rise.
    A rise within the records' noise (4 % on one expert of the data-free study setting, while the mean fell 6 %) does not
    stop a refinement that lowers the others."""
    found = []
    for task, kl in records.items():
        rise = torch.tensor(kl["sums"], dtype=torch.float64) - torch.tensor(before[task]["sums"], dtype=torch.float64)
        moments = lead_moments(rise, torch.tensor(kl["counts"], dtype=torch.float64))
        if moments[2] > 0 and moments[1] / moments[2] > lead_margin(moments):
            found.append(task)
    return found


def improves(mean: float, above: list[str], best_kl: float) -> bool:
    """Whether a check's state becomes the best: its mean held-out KL (`mean_kl`) below the best so far, and no expert's
    above the closed form's beyond doubt (`above`: `raised`). A step that buys the average with one expert's loss is
    never written (measured on the broad study setting: a step that lowered the mean by 5 % had raised the broad
    expert's KL by 68 %, and the manpage text's NLL by 0.27 nats a token)."""
    return mean < best_kl and not above


def spread(values: list[float]) -> float | None:
    """The sample standard deviation of a check's step losses (None for one step): each step draws other records."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1))


def why_none_kept(history: list[dict], lr: float) -> str:
    """Why no check was kept, read from the checks (`featcal_refine.json`'s history), with what to try: a user whose
    refinement kept the closed form had only "no check improved" to go on. A check that lowered the mean but raised
    an expert trades one expert for the others; checks that raise every expert, or a training KL above the closed form's (step 0's: the first step's
    records before any update) means the steps overshoot their own objective, which a smaller learning rate cures
    (measured: docs/refine.md); one that fell while the held-out one did not means the steps fit records that do not
    carry. Each step draws other records, so the training KL moves by itself: a change counts beyond two standard
    errors of the difference, one batch against the last check's mean of n (sd · √(1 + 1/n), sd over those n steps)."""
    start, checks = history[0], history[1:]
    traded = [check for check in checks if check["held_out_kl"] < start["held_out_kl"] and check["above_closed_form"]]
    if traded:
        raised_experts = sorted({task for check in traded for task in check["above_closed_form"]})
        steps = ", ".join(str(check["step"]) for check in traded)
        return (f"{'the checks at steps' if len(traded) > 1 else 'the check at step'} {steps} lowered the mean but raised "
                f"{', '.join(raised_experts)}: here the steps fit some experts at another's cost")
    smaller = f"a smaller refine.lr (say {lr / 10:g})"
    experts = set(start.get("per_expert", {}))
    if checks and experts and all(set(check["above_closed_form"]) == experts for check in checks):
        return (f"every check raised every expert's held-out KL above the closed form's beyond two standard errors: the "
                f"steps overshoot; {smaller} may help")
    first, last = start.get("train_kl"), checks[-1].get("train_kl") if checks else None
    if first is None or last is None:
        return "no check ran"
    window = checks[-1]["step"] - (checks[-2]["step"] if len(checks) > 1 else 0)
    sd = checks[-1].get("train_kl_sd")
    margin = 2 * sd * math.sqrt(1 + 1 / window) if sd is not None and math.isfinite(sd) else 0.0
    moved = (f"from {first:.4g} (the closed form, on the first step's records) to {last:.4g} (the steps before the last "
             f"check{f'; ± {margin:.2g} is its noise' if margin else ''})")
    if not math.isfinite(last) or last - first > margin:
        return f"the training KL rose as well, {moved}: the steps overshoot; {smaller} may help"
    if first - last > margin:
        return (f"the training KL fell, {moved}, while the held-out KL did not: the steps fit the training records "
                "without carrying to the held-out ones")
    return f"the training KL did not move beyond its noise, {moved}: the checks do not tell why; {smaller} is the cheapest try"


__all__ = ["KEPT_RULE", "expert_kls", "improves", "mean_kl", "raised", "spread", "why_none_kept"]
