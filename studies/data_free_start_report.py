"""The markdown report of `studies.data_free_start`: shares of the gap per family and kind, NLLs, the starts chosen."""

from __future__ import annotations

from studies import real_data as rd


def report(results: dict, settings: tuple[str, ...]) -> str:
    """The share of the merge→expert gap each setting recovered, per family and kind, the NLLs, and the starts chosen
    (settings in `settings` order)."""
    options = results.get("options", {})
    lines = []
    if options.get("quick"):
        lines += ["**Quick smoke test: the numbers mean nothing.**", ""]
    lambdas = ", ".join(f"{k} {options.get(o)}" for k, o in (("lambda", "lam"), ("alpha", "alpha"), ("rho", "rho"))
                        if options.get(o) is not None) or "the product's defaults"
    if options:
        lines += [f"FeatCal: {lambdas}; {options.get('cal_records')} records or samples per expert, max_length "
                  f"{options.get('max_length')}, max_new_tokens {options.get('max_new_tokens') or 'default'}; "
                  f"experts: {options.get('steps')} steps × {options.get('batch_size')}; device {options.get('device')}.", ""]
    for family, nll in results["nll"].items():
        order = ["merged", *(f"featcal:{s}" for s in settings)]
        nll = {m: nll[m] for m in sorted(nll, key=lambda m: order.index(m) if m in order else len(order))}
        lines += [f"## {family} experts: share of the merge→expert NLL gap recovered", "",
                  "| setting | " + " | ".join(rd.KINDS) + " | mean |", "|---|" + "---|" * (len(rd.KINDS) + 1)]
        for model in [m for m in nll if m.startswith("featcal:")]:
            shares = [rd.gap_recovered(nll[f"expert:{k}"][k], nll["merged"][k], nll[model][k])
                      if k in nll.get(f"expert:{k}", {}) and k in nll.get("merged", {}) and k in nll[model] else None
                      for k in rd.KINDS]
            valid = [s for s in shares if s is not None]
            cells = [("–" if s is None else f"{s:.2f}") for s in shares]
            setting = model.split(":")[1]
            same = " (= auto)" if results["runs"].get(f"{family}_{setting}", {}).get("same_as") else ""
            lines.append(f"| {setting}{same} | " + " | ".join(cells) + f" | {(f'{sum(valid) / len(valid):.2f}' if valid else '–')} |")
        lines += ["", f"Held-out NLL (nats/token) on the {family} family's test texts:", "",
                  "| model | " + " | ".join(rd.KINDS) + " |", "|---|" + "---|" * len(rd.KINDS)]
        experts = {k: nll.get(f"expert:{k}", {}).get(k) for k in rd.KINDS}
        lines.append("| own expert | " + " | ".join("–" if v is None else f"{v:.4f}" for v in experts.values()) + " |")
        for model in [m for m in nll if not m.startswith("expert:")]:
            lines.append(f"| {model} | " + " | ".join("–" if k not in nll[model] else f"{nll[model][k]:.4f}" for k in rd.KINDS) + " |")
        lines.append("")
        for name, run in results["runs"].items():
            if not name.startswith(family + "_"):
                continue
            if run.get("same_as"):
                lines.append(f"- {name}: not run: {run['same_as']} chose this start for every expert, so its samples "
                             "(same seed and settings) and its result are that run's (`--no-reuse` runs it)")
                continue
            lines.append(f"- {name}: FeatCal run {run['seconds']:.0f} s" + (" (merging first)" if run.get("merged_first") else ""))
            for expert, record in run["generated"].items():
                lines.append(f"  - {expert}: {record['kept']} samples from the {record['start']}, {record['generated_tokens']} "
                             f"tokens in {record['seconds']:.1f} s")
            for line in run.get("choices", []):
                lines.append(f"  - {line.removeprefix('featcal-llm: generation: ')}")
            for warning in run.get("warnings", []):
                lines.append(f"  - {warning.strip()}")
        lines.append("")
    for name, failure in results.get("failed", {}).items():
        lines.append(f"- FAILED {name} (exit {failure['returncode']}): {failure['log_tail'][-1] if failure['log_tail'] else ''}")
    if results.get("skipped"):
        lines.append(f"- skipped (budget): {', '.join(results['skipped'])}")
    if results.get("timings"):
        lines += ["", "Timings (s): " + ", ".join(f"{k} {v}" for k, v in results["timings"].items())]
    lines.append("")
    return "\n".join(lines)
