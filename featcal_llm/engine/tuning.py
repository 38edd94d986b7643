"""Choosing λ, α and ρ without labels: candidate sets, the held-out split and the per-layer coordinate search.

A tuned run selects per layer (see calibrate.py): the layer's statistics are
recorded once on the calibration records, every candidate is solved from them
(candidates.py), and each is scored on the held-out records by how far its
layer output drifts from the expert's (criterion `hidden`, averaged over
experts) or by the next-token KL divergence through the final norm and LM head
(criterion `output`, a logit lens; the geometric mean over experts, tuned.py says
why). The winner advances the streams. The candidates evaluated per layer
follow a coordinate search: every λ at the starting (α, ρ), then every α at the
best λ, then every ρ at the best (λ, α).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from featcal_llm.errors import FeatCalError

if TYPE_CHECKING:
    from featcal_llm.maths.objective import Hyperparameters
    from featcal_llm.maths.regmean import RegMeanSetting

# `auto`: λ log-spaced, seven values a decade apart (the paper used 1e-5 and 3), α across [0, 1] without the
# extremes the demo found harmful, ρ around 1 with one extrapolating value. 7 + 3 + 2 = 12 evaluations.
AUTO = {
    "lambda": (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0),
    "alpha": (0.15, 0.3, 0.5, 0.8),
    "rho": (0.5, 1.0, 1.5),
}
# RegMean's off-diagonal scaling r (G̃ = r G + (1 − r) diag G): 5 evaluations per layer. 1.0 (no reduction) is left out:
# MergeBench pinv-s its near-singular sums (regmean_plusplus.py, step 2.2); give it in a list to try it.
AUTO_REGMEAN = {"reduction": (0.1, 0.3, 0.5, 0.7, 0.9)}
KEYS = ("lambda", "alpha", "rho")  # FeatCal's; a RegMean search has ("reduction",)


@dataclass(frozen=True)
class Search:
    """The candidate values of each hyper-parameter and how to choose among them."""

    values: dict[str, tuple[float, ...]]  # key → candidates (one value for a fixed key)
    eps: float
    holdout: float
    budget: int
    criterion: str

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.values)

    def hyper(self, values: dict[str, float]) -> Hyperparameters | RegMeanSetting:
        """The objective's setting for these values of the searched keys."""
        from featcal_llm.maths.objective import Hyperparameters  # torch: the module stays light for validate's checks
        from featcal_llm.maths.regmean import RegMeanSetting

        if "reduction" in values:
            return RegMeanSetting(reduction=values["reduction"], eps=self.eps)
        return Hyperparameters(lam=values["lambda"], alpha=values["alpha"], rho=values["rho"], eps=self.eps)

    def start(self) -> dict[str, float]:
        """The lower middle candidate of each list: where the coordinate search starts."""
        return {key: values[(len(values) - 1) // 2] for key, values in self.values.items()}

    def evaluations(self) -> int:
        """Candidates the coordinate search evaluates per layer (the first stage's includes the start)."""
        return 1 + sum(len(values) - 1 for values in self.values.values())

    def describe(self) -> dict:
        return {"values": {k: list(v) for k, v in self.values.items()}, "start": self.start(), "holdout": self.holdout,
                "budget": self.budget, "criterion": self.criterion, "evaluations_per_layer": self.evaluations()}


def build_search(featcal, where: str) -> Search:
    """The search a tuned recipe asks for; the budget must cover the coordinate search."""
    tune = featcal.tune_settings()
    given = featcal.hyper_values()
    values = {}
    for key in given:
        value = given[key]
        candidates = {**AUTO, **AUTO_REGMEAN}[key] if value == "auto" else (value if isinstance(value, tuple) else (value,))
        values[key] = tuple(dict.fromkeys(sorted(candidates)))  # sorted, duplicates dropped
    search = Search(values, featcal.eps, tune.holdout, tune.budget, tune.criterion)
    if search.evaluations() > tune.budget:
        raise FeatCalError(
            f"{where}: featcal.tune.budget: the coordinate search over {', '.join(f'{len(v)} {k}' for k, v in values.items())} "
            f"candidates evaluates {search.evaluations()} settings per layer, more than the budget of {tune.budget} "
            "(raise the budget or shorten the lists)"
        )
    return search


def holdout_problem(share: float, count: int, task: str) -> str | None:
    """Why `tune.holdout` cannot split an expert's `count` records (None when it can): the held-out records score
    a search or stop refinement, the rest fit the statistics, and each side needs two."""
    kept = round(share * count)
    if kept >= 2 and count - kept >= 2:
        return None
    return (f"featcal.tune.holdout: {share:g} of expert {task}'s {count} records leaves {kept} held out and {count - kept} "
            "for calibration (need at least 2 on each side)")


def split_holdout(
    sequences: dict[str, list[list[int]]], share: float, seed: int, where: str
) -> tuple[dict[str, list[list[int]]], dict[str, list[list[int]]]]:
    """(calibration, held-out) records per expert: a seeded, per-expert draw of round(share · n) records.

    `sequences` comes in the recipe's order, and each expert's draw is keyed by the seed and its position there (as
    its generation stream is), never by its name: the name is the expert's path, and moving the experts' folders or
    writing their paths another way must not change the split. Both parts keep file order. Held-out records never
    enter the statistics.
    """
    calibration, held_out = {}, {}
    for position, (task, task_sequences) in enumerate(sequences.items()):
        count = len(task_sequences)
        problem = holdout_problem(share, count, task)
        if problem is not None:
            raise FeatCalError(f"{where}: {problem}")
        kept = round(share * count)
        chosen = set(random.Random(f"featcal-holdout:{seed}:{position}").sample(range(count), kept))
        calibration[task] = [s for i, s in enumerate(task_sequences) if i not in chosen]
        held_out[task] = [s for i, s in enumerate(task_sequences) if i in chosen]
    return calibration, held_out


Evaluated = list[tuple["Hyperparameters", float]]


def coordinate_search(search: Search, score: Callable[[Hyperparameters], float]) -> tuple[Hyperparameters, Evaluated]:
    """Minimise `score` one hyper-parameter at a time (λ, then α, then ρ; or RegMean's reduction); ties keep the earlier candidate.

    A score that is NaN counts as +inf, so it loses to every finite one. Returns
    the winner and every evaluated (candidate, score) in evaluation order.
    """
    current = search.start()
    table: Evaluated = []
    seen: dict[tuple, float] = {}

    hyper = search.hyper
    keys = search.keys
    for key in keys:
        best_value, best_score = current[key], None
        for value in search.values[key]:
            trial = {**current, key: value}
            identity = tuple(trial[k] for k in keys)
            if identity not in seen:
                scored = score(hyper(trial))
                seen[identity] = math.inf if math.isnan(scored) else scored
                table.append((hyper(trial), seen[identity]))
            if best_score is None or seen[identity] < best_score:
                best_value, best_score = value, seen[identity]
        current[key] = best_value
    return hyper(current), table


def summary(chosen: list[dict[str, float]], keys: tuple[str, ...] = KEYS) -> dict[str, float]:
    """The most common chosen value of each hyper-parameter over layers (the smaller one on a tie)."""
    result = {}
    for key in keys:
        counts = Counter(layer[key] for layer in chosen)
        result[key] = min(counts, key=lambda value: (-counts[value], value))
    return result


def as_values(hyper: Hyperparameters | RegMeanSetting) -> dict[str, float]:
    return hyper.values()


def criterion_value(value: float) -> float | None:
    """A criterion as JSON holds it: None for a candidate that failed (+inf), so the file stays standard JSON."""
    return value if math.isfinite(value) else None


def tuning_report(search: Search, records: list[dict]) -> dict:
    """The featcal_tuning.json payload: the search, every layer's candidates and winner, and a summary."""
    chosen = [record["chosen"] for record in records]
    return {
        "search": search.describe(),
        "layers": [{"layer": layer, **record} for layer, record in enumerate(records)],
        "chosen": {key: [layer[key] for layer in chosen] for key in search.keys},
        "most_common": summary(chosen, search.keys),
    }


def tuning_table(report: dict) -> str:
    """Every layer's evaluated candidates with their held-out criterion; the winner marked."""
    keys = tuple(report["search"]["values"])
    lines = [f"featcal-llm: tuning ({report['search']['criterion']} criterion on held-out records, lower is better)",
             f"{'layer':>5} " + " ".join(f"{k:>9}" for k in keys) + f" {'criterion':>12}"]
    for layer in report["layers"]:
        winner = tuple(layer["chosen"][k] for k in keys)
        for row in layer["candidates"]:
            mark = "  <- chosen" if tuple(row[k] for k in keys) == winner else ""
            value = "failed" if row["criterion"] is None else f"{row['criterion']:.6g}"
            lines.append(f"{layer['layer']:>5} " + " ".join(f"{row[k]:>9.3g}" for k in keys) + f" {value:>12}{mark}")
    common = report["most_common"]
    lines.append("most common choice: " + ", ".join(f"{k} {common[k]:g}" for k in keys))
    return "\n".join(lines)
