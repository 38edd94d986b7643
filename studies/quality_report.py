"""The quality study's tables: per setting, NLL and KL per domain, gap recovered, and the bar of the best expert."""

from __future__ import annotations

import json
from pathlib import Path

from studies.quality_setup import SETTINGS, Setting, expert_label
from studies.real_data import KINDS


def _cell(value, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def setting_summary(state: dict, setting: Setting) -> dict:
    """Every scored model of the setting with its NLL, KL, gap recovered, and whether it beats every expert."""
    nll, kl = state["nll"], state.get("kl", {}).get(setting.name, {})
    merged = f"{setting.name}:merged"
    experts = [expert_label(k) for k in setting.experts]
    averages = {e: _mean(nll[e].get(k) for k in KINDS) for e in experts if e in nll}
    best = min(averages, key=averages.get) if averages else None
    owners = {d: expert_label(o) for d, o in setting.owners.items()}
    models = ["base", *experts, merged] + [m for m in state.get("rows", {}).get(setting.name, {})
                                           if m in nll and m != merged]
    failed = {m: r["error"] for m, r in state.get("rows", {}).get(setting.name, {}).items() if r.get("error")}
    out = {"failed": failed, "best_expert": best, "best_expert_average": averages.get(best), "owners": owners, "models": {}}
    for model in models:
        if model not in nll:
            continue
        row = {"nll": nll[model], "average": _mean(nll[model].get(k) for k in KINDS), "kl": kl.get(model, {})}
        if merged in nll and all(o in nll for o in owners.values()):
            gaps = {d: nll[merged][d] - nll[o][d] for d, o in owners.items()}
            row["gap"] = gaps
            row["recovered"] = {d: (nll[merged][d] - nll[model][d]) / g if g > 0 else None for d, g in gaps.items()}
            row["recovered_mean"] = _mean(row["recovered"].values())
        merged_kl = kl.get(merged, {})
        if merged_kl and row["kl"]:
            row["kl_recovered"] = {d: (merged_kl[d] - row["kl"][d]) / merged_kl[d] if merged_kl.get(d) else None
                                   for d in KINDS if d in row["kl"]}
            row["kl_recovered_mean"] = _mean(row["kl_recovered"].values())
        if best is not None and row["average"] is not None:
            row["beats_every_expert"] = row["average"] < averages[best]
        row.update(state.get("rows", {}).get(setting.name, {}).get(model, {}))
        out["models"][model] = row
    return out


def setting_table(summary: dict, setting: Setting) -> list[str]:
    best = summary["best_expert"]
    owners = ", ".join(f"{d} → {o}" for d, o in summary["owners"].items())
    lines = [f"### Setting `{setting.name}`: experts {', '.join(expert_label(k) for k in setting.experts)}", "",
             f"Gap per domain: NLL(TA merge) − NLL(the domain's expert: {owners}); share recovered = "
             "(merge − model) / gap, mean over domains with a gap. KL(domain's expert ‖ model) per token. "
             f"Best single expert on the average over domains: **{best}** "
             f"({_cell(summary['best_expert_average'])}).", "",
             f"| model | NLL {' | NLL '.join(KINDS)} | NLL avg | recovered {' | rec. '.join(KINDS)} | rec. mean "
             f"| KL {' | KL '.join(KINDS)} | KL rec. mean | beats every expert (avg) | s |",
             "|---" + "|---:" * (3 * len(KINDS) + 3) + "|---|---:|"]
    for model, row in summary["models"].items():
        rec = row.get("recovered", {})
        beats = row.get("beats_every_expert")
        lines.append(
            f"| {model.split(':', 1)[1] if model.startswith(setting.name + ':') else model} | "
            + " | ".join(_cell(row["nll"].get(k)) for k in KINDS) + f" | {_cell(row['average'])} | "
            + " | ".join(_cell(rec.get(k), "{:.2f}") for k in KINDS) + f" | {_cell(row.get('recovered_mean'), '{:.2f}')} | "
            + " | ".join(_cell(row["kl"].get(k), "{:.4f}") for k in KINDS)
            + f" | {_cell(row.get('kl_recovered_mean'), '{:.2f}')} | {'–' if beats is None else 'yes' if beats else 'no'}"
            + f" | {_cell(row.get('seconds'), '{:.0f}')} |")
    lines += [f"- {m}: failed: {e}" for m, e in summary["failed"].items()]
    return lines


def write_report(state: dict, options: dict, work: Path) -> str:
    """results.md and results.json in the workdir; returns the markdown."""
    summaries = {name: setting_summary(state, s) for name, s in SETTINGS.items() if name in options["settings"]}
    lines = ["## Quality study: held-out NLL (nats/token), KL to each domain's expert, gap recovered", "",
             f"device {options['device']}, " + ", ".join(f"{k} {options[k]}" for k in
                                                        ("steps", "batch_size", "lr", "cal_records", "test_records",
                                                         "kl_records", "calibration_dtype", "quick")), ""]
    for name, summary in summaries.items():
        lines += setting_table(summary, SETTINGS[name]) + [""]
    skipped = state.get("skipped", [])
    if skipped:
        lines += ["Skipped (time budget): " + ", ".join(skipped), ""]
    lines += ["## Wall time per phase (s)", "", "| phase | seconds |", "|---|---:|"]
    lines += [f"| {phase} | {seconds:.1f} |" for phase, seconds in state["timings"].items()]
    text = "\n".join(lines) + "\n"
    (work / "results.md").write_text(text)
    payload = {"options": options, "settings": summaries, "state": state}
    (work / "results.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return text
