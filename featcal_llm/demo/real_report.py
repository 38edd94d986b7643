"""The real-model study's results: NLL per model and kind, gap recovered per setting, phase wall times."""

from __future__ import annotations

import json
from pathlib import Path

from featcal_llm.demo.real_data import KINDS, recovery


def _cell(value: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def report(state: dict, settings: list[str], labels: dict[str, str], options: dict, work: Path) -> str:
    """Markdown tables to ``results.md`` and the same numbers to ``results.json``; returns the markdown."""
    nll = state["nll"]
    rows = {s: recovery(nll, KINDS, f"featcal:{s}") for s in settings if f"featcal:{s}" in nll}
    kinds = " | ".join(KINDS)
    lines = ["## Share of the merge→expert NLL gap recovered (held-out test split of each expert's own text)", "",
             f"| calibration data | {kinds} | mean |", "|---" + "|---:" * (len(KINDS) + 1) + "|"]
    for setting, rec in rows.items():
        cells = " | ".join(_cell(rec["per_kind"][k], "{:.2f}") for k in KINDS)
        lines.append(f"| {labels[setting]} | {cells} | {_cell(rec['mean'], '{:.2f}')} |")
    lines += ["", "## Held-out NLL (nats/token) on each kind's test split", "",
              f"| model | {kinds} |", "|---" + "|---:" * len(KINDS) + "|"]
    for model, row in nll.items():
        name = labels.get(model.split(":", 1)[1], model) if model.startswith("featcal:") else model
        name = f"merged + FeatCal, {name}" if model.startswith("featcal:") else name
        lines.append(f"| {name} | " + " | ".join(_cell(row.get(k)) for k in KINDS) + " |")
    lines += ["", "## Wall time per phase (s)", "", "| phase | seconds |", "|---|---:|"]
    lines += [f"| {phase} | {seconds:.0f} |" for phase, seconds in state["timings"].items()]
    text = "\n".join(lines) + "\n"
    (work / "results.md").write_text(text)
    payload = {"options": options, "nll": nll, "recovered": rows, "timings": state["timings"],
               "training": state["training"]}
    (work / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    return text
