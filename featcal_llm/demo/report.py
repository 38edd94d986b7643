"""The demo's results: a text table, a JSON file, a PNG bar chart and the gap-recovery line."""

from __future__ import annotations

import json
from pathlib import Path


def average(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def table(scores: dict[str, dict[str, float]], tasks: list[str]) -> str:
    """Rows: models; columns: tasks and their average (exact match, %)."""
    header = ["model", *tasks, "average"]
    rows = [[model, *(f"{row[t]:.1f}" for t in tasks), f"{average(row[t] for t in tasks):.1f}"]
            for model, row in scores.items()]
    widths = [max(len(str(line[i])) for line in [header, *rows]) for i in range(len(header))]

    def fmt(line):
        return "| " + " | ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                 for i, (c, w) in enumerate(zip(line, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(header), rule, *(fmt(line) for line in rows)])


def gap_recovery(scores: dict[str, dict[str, float]], tasks: list[str], merged: str, calibrated: str) -> dict:
    """How much of the gap between the merge and each expert on its own task the calibration closed."""
    per_task = {}
    for task in tasks:
        expert = scores[f"expert:{task}"][task]
        gap = expert - scores[merged][task]
        gain = scores[calibrated][task] - scores[merged][task]
        per_task[task] = {"expert": expert, "merged": scores[merged][task], "calibrated": scores[calibrated][task],
                          "gap": gap, "gain": gain, "recovered": gain / gap if gap > 0 else None}
    gap = average(v["gap"] for v in per_task.values())
    gain = average(v["gain"] for v in per_task.values())
    return {
        "per_task": per_task,
        "mean_gap": gap,
        "mean_gain": gain,
        "recovered": gain / gap if gap > 0 else None,
        "worst_drop": min(v["gain"] for v in per_task.values()),
    }


def recovery_sentence(recovery: dict) -> str:
    if recovery["recovered"] is None:
        return "The merge is not below the experts on average: there is no gap to recover."
    worst = recovery["worst_drop"]
    return (f"FeatCal recovered {100 * recovery['recovered']:.0f}% of the gap between the merge and the experts' "
            f"own-task accuracy ({recovery['mean_gain']:+.1f} of {recovery['mean_gap']:.1f} points on average); "
            + (f"its worst task moved {worst:+.1f} points." if worst < 0 else "no task lost accuracy."))


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def bar_chart(scores: dict[str, dict[str, float]], tasks: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [*tasks, "average"]
    models = list(scores)
    width = 0.8 / len(models)
    figure, axes = plt.subplots(figsize=(2.2 + 1.6 * len(columns), 4.2))
    for index, model in enumerate(models):
        values = [scores[model][t] for t in tasks]
        values.append(average(values))
        positions = [c + (index - (len(models) - 1) / 2) * width for c in range(len(columns))]
        axes.bar(positions, values, width, label=model)
    axes.set_xticks(range(len(columns)), columns)
    axes.set_ylabel("exact match on test (%)")
    axes.set_ylim(0, 105)
    axes.set_title(title)
    axes.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
