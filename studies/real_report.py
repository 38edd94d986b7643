"""The real-model study's results: NLL per model and kind, gap recovered per setting, phase wall times."""

from __future__ import annotations

import json
from pathlib import Path

from studies.real_data import KINDS, recovery


def _cell(value: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def _name(model: str, labels: dict[str, str]) -> str:
    return f"merged + FeatCal, {labels[model.split(':', 1)[1]]}" if model.startswith("featcal:") else model


def report(state: dict, settings: list[str], labels: dict[str, str], options: dict, work: Path) -> str:
    """Markdown tables to ``results.md`` and the same numbers to ``results.json``; returns the markdown."""
    nll = state["nll"]
    rows = {s: recovery(nll, KINDS, f"featcal:{s}") for s in settings if f"featcal:{s}" in nll}
    kinds = " | ".join(KINDS)
    gaps = {k: nll["merged"][k] - nll[f"expert:{k}"][k] for k in KINDS} if "merged" in nll else {}
    with_gap = sum(1 for g in gaps.values() if g > 0)
    lines = ["## Share of the merge→expert NLL gap recovered (held-out test split of each expert's own text)", "",
             "(merged − calibrated) / (merged − expert); `–` where the merge is not worse than the expert (no gap); "
             f"the mean is over the {with_gap} of {len(KINDS)} experts with a gap.", "",
             f"| calibration data | {kinds} | mean |", "|---" + "|---:" * (len(KINDS) + 1) + "|"]
    if gaps:
        lines.append("| *gap: NLL merged − NLL expert* | " + " | ".join(f"{gaps[k]:+.3f}" for k in KINDS) + " | |")
    for setting, rec in rows.items():
        cells = " | ".join(_cell(rec["per_kind"][k], "{:.2f}") for k in KINDS)
        lines.append(f"| {labels[setting]} | {cells} | {_cell(rec['mean'], '{:.2f}')} |")
    kl = state.get("kl", {})
    kl_rows = {}
    if "merged" in kl and all(k in kl["merged"] for k in KINDS):
        zero = {f"expert:{k}": {k: 0.0} for k in KINDS}  # KL(expert ‖ expert) = 0: the gap is the merge's KL
        kl_rows = {s: recovery({**kl, **zero}, KINDS, f"featcal:{s}") for s in settings
                   if all(k in kl.get(f"featcal:{s}", {}) for k in KINDS)}
        lines += ["", "## Share of the KL(expert ‖ merged) gap recovered (first test records of each kind)", "",
                  "(KL merged − KL calibrated) / KL merged, KL(expert ‖ model) per token: how much closer to each "
                  "expert's own predictions calibration brought the merge.", "",
                  f"| calibration data | {kinds} | mean |", "|---" + "|---:" * (len(KINDS) + 1) + "|"]
        for setting, rec in kl_rows.items():
            cells = " | ".join(_cell(rec["per_kind"][k], "{:.2f}") for k in KINDS)
            lines.append(f"| {labels[setting]} | {cells} | {_cell(rec['mean'], '{:.2f}')} |")
        lines += ["", "| model | " + " | ".join(f"KL on {k}" for k in KINDS) + " |", "|---" + "|---:" * len(KINDS) + "|"]
        for model, row in kl.items():
            lines.append(f"| {_name(model, labels)} | " + " | ".join(_cell(row.get(k), "{:.4f}") for k in KINDS) + " |")
    lines += ["", "## Held-out NLL (nats/token) on each kind's test split", "",
              f"| model | {kinds} |", "|---" + "|---:" * len(KINDS) + "|"]
    for model, row in nll.items():
        lines.append(f"| {_name(model, labels)} | " + " | ".join(_cell(row.get(k)) for k in KINDS) + " |")
    lines += ["", "## Wall time per phase (s)", "", "| phase | seconds |", "|---|---:|"]
    lines += [f"| {phase} | {seconds:.0f} |" for phase, seconds in state["timings"].items()]
    text = "\n".join(lines) + "\n"
    (work / "results.md").write_text(text)
    payload = {"options": options, "nll": nll, "recovered": rows, "kl": kl, "kl_recovered": kl_rows,
               "timings": state["timings"], "training": state["training"], "generation": state.get("generation", {})}
    (work / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    return text
