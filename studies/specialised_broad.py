"""The broad setting: a broad expert trained on a mix of the three kinds beside two narrow experts, one of which
trails the merge on its own kind (so the merge teaches its records), Task Arithmetic ½ each.

What it asks of the defaults: below the broad expert on the average NLL, and no domain worse than the merge. Rows
that change one default at a time (``ROWS`` in studies/specialised_setup.py) locate where a domain's harm comes from.

    python -m studies.specialised_broad prepare --source W_SPECIALISED --workdir W   # base and text linked, the mix written
    python -m studies.specialised train --workdir W --kinds broad --steps 64 --batch 8 --lr 1e-3
    python -m studies.specialised train --workdir W --kinds manpage --steps 6 --batch 8 --lr 1e-3   # trails the merge
    ln -s W_SPECIALISED/experts/changelog W/experts/changelog                                      # leads it
    python -m studies.specialised row --workdir W --experts broad,manpage,changelog --row "featcal defaults"
    python -m studies.specialised score --workdir W --experts broad,manpage,changelog
    python -m studies.specialised_broad report --workdir W --json docs/studies/results/broad.json
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from studies.common import bootstrap_nll, load_json, log, mean_nll, percentile_interval, save_json
from studies.real_data import interleave, read_jsonl, write_jsonl
from studies.specialised_data import KINDS
from studies.specialised_setup import AS_TRAINED, CAL_RECORDS, SCORED, TA_WEIGHT, slug

EXPERTS = ("broad", "manpage", "changelog")
BROAD = "broad"


def prepare(args) -> None:
    work, source = args.workdir.resolve(), args.source.resolve()
    (work / "data").mkdir(parents=True, exist_ok=True)
    for name in ["base", *(f"data/{kind}" for kind in KINDS)]:
        if not (work / name).exists():
            os.symlink(source / name, work / name)
    for split in ("train", "cal", f"cal{AS_TRAINED}"):
        mixed = interleave([read_jsonl(source / "data" / kind / f"{split}.jsonl") for kind in KINDS])
        write_jsonl(mixed, work / "data" / BROAD / f"{split}.jsonl")
    log(f"{work / 'data' / BROAD}: {len(read_jsonl(work / 'data' / BROAD / 'train.jsonl'))} train records, the kinds in turn")


def _paired_interval(model: list, reference: list, resamples: int, seed: int = 0) -> list[float]:
    """95 % interval of mean NLL(model) − mean NLL(reference) over resampled test records (the same records for both)."""
    import random

    rng = random.Random(seed)
    n = len(model)
    values = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        values.append(mean_nll(model, picks) - mean_nll(reference, picks))
    return percentile_interval(values)


def _average_interval(model: dict, reference: dict, resamples: int, seed: int = 0) -> list[float]:
    """95 % interval of the domains' average NLL difference, each domain's records resampled."""
    import random

    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        total = 0.0
        for kind in KINDS:
            picks = [rng.randrange(len(model[kind])) for _ in range(len(model[kind]))]
            total += mean_nll(model[kind], picks) - mean_nll(reference[kind], picks)
        values.append(total / len(KINDS))
    return percentile_interval(values)


PAIRS = (("featcal teachers best", "featcal defaults"), ("featcal teachers best + refine", "featcal defaults + refine"),
         ("featcal defaults", "featcal teachers own"), ("featcal defaults + refine", "featcal teachers own + refine"))
# the choices a default follows: each row against the one it would replace, on val (which chooses) and test (reported)


def _scores(work: Path, split: str) -> dict[str, dict]:
    """Every model's and row's records' (NLL, tokens) on `split`, by name (the first SCORED[split] records of a kind)."""
    models = {}
    for name in ("base", "merged", *(f"expert:{e}" for e in EXPERTS)):
        scores = load_json(work / "scores" / f"{slug(name)}.json")
        if scores and split in scores["scores"]:
            models[name] = {k: v[: SCORED[split]] for k, v in scores["scores"][split].items()}
    for path in sorted((work / "rows").glob("*.json")):
        record = load_json(path)
        if split in record["scores"]:
            models[record["name"]] = {k: v[: SCORED[split]] for k, v in record["scores"][split].items()}
    return models


def _average(model: dict) -> float:
    return sum(mean_nll(model[k]) for k in KINDS) / len(KINDS)


def report(args) -> None:
    work = args.workdir.resolve()
    models, val = _scores(work, "test"), _scores(work, "val")
    rows_meta = {}
    for path in sorted((work / "rows").glob("*.json")):
        record = load_json(path)
        rows_meta[record["name"]] = {k: record.get(k) for k in ("seconds", "featcal_effective", "record_leads", "record_lead_margins")}
    merged, broad = models["merged"], models[f"expert:{BROAD}"]
    table = []
    for name, test in models.items():
        nll = {k: mean_nll(test[k]) for k in KINDS}
        average = sum(nll.values()) / len(KINDS)
        entry = {"name": name, "nll": {k: round(v, 4) for k, v in nll.items()}, "average": round(average, 4),
                 "nll_ci95": bootstrap_nll(test, args.resamples),
                 "minus_merge": {k: round(nll[k] - mean_nll(merged[k]), 4) for k in KINDS},
                 "minus_merge_ci95": {k: [round(x, 4) for x in _paired_interval(test[k], merged[k], args.resamples)] for k in KINDS},
                 "average_minus_broad": round(average - _average(broad), 4),
                 "average_minus_broad_ci95": [round(x, 4) for x in _average_interval(test, broad, args.resamples)],
                 **rows_meta.get(name, {})}
        if name in val and f"expert:{BROAD}" in val:  # the split the choices are made on
            entry["val"] = {"nll": {k: round(mean_nll(val[name][k]), 4) for k in KINDS}, "average": round(_average(val[name]), 4),
                            "average_minus_broad": round(_average(val[name]) - _average(val[f"expert:{BROAD}"]), 4),
                            "average_minus_broad_ci95": [round(x, 4) for x in _average_interval(val[name], val[f"expert:{BROAD}"], args.resamples)]}
        table.append(entry)
        log(f"{name:<40} avg {average:.4f} (vs broad {entry['average_minus_broad']:+.4f}) " +
            " ".join(f"{k} {nll[k]:.4f} ({entry['minus_merge'][k]:+.4f})" for k in KINDS))
    pairs = []
    for row, against in PAIRS:
        if row in models and against in models:
            pair = {"row": row, "against": against}
            for split, scores in (("val", val), ("test", models)):
                if row in scores and against in scores:
                    pair[split] = {"average_difference": round(_average(scores[row]) - _average(scores[against]), 4),
                                   "ci95": [round(x, 4) for x in _average_interval(scores[row], scores[against], args.resamples)],
                                   "per_kind": {k: round(mean_nll(scores[row][k]) - mean_nll(scores[against][k]), 4) for k in KINDS}}
            pairs.append(pair)
            log(f"{row} against {against}: " + "; ".join(f"{split} {pair[split]['average_difference']:+.4f} {pair[split]['ci95']}"
                                                        for split in ("val", "test") if split in pair))
    save_json(args.json, {"setting": "broad", "experts": list(EXPERTS), "ta_weight": TA_WEIGHT, "cal_records": CAL_RECORDS,
                          "test_records_per_domain": SCORED["test"], "val_records_per_domain": SCORED["val"],
                          "training": {e: load_json(work / f"training-{e}.json") for e in EXPERTS},
                          "rows": table, "pairs": pairs})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.specialised_broad", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="link the base and the kinds' text from a specialised workdir; write the mix")
    prep.add_argument("--source", type=Path, required=True)
    rep = sub.add_parser("report", help="the results file")
    rep.add_argument("--json", type=Path, default=Path("docs/studies/results/broad.json"))
    rep.add_argument("--resamples", type=int, default=1000)
    for q in (prep, rep):
        q.add_argument("--workdir", type=Path, required=True)
    args = p.parse_args(argv)
    {"prepare": prepare, "report": report}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
