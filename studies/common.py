"""What every study shares: its log line, its JSON files, its shares of a gap and their bootstrap.

One home for these, so that no study imports another's private helpers (the all-gap scripts used to import each
other in a circle). Pure functions over plain numbers; torch is not imported here.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Mapping, Sequence


def answer_help(doc: str | None) -> None:
    """`-h` for a study script that reads its arguments by position: its docstring, exit 0."""
    import sys

    if sys.argv[1:2] in (["-h"], ["--help"]):
        print((doc or "").strip())
        sys.exit(0)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def load_json(path: Path) -> dict:
    """The file's JSON, or {} when it does not exist yet (a study's state starts empty)."""
    return json.loads(path.read_text()) if path.exists() else {}


def save_json(path: Path, payload: dict) -> None:
    """Written whole or not at all (a killed study leaves the previous file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def shares(merged: Mapping[str, float], experts: Mapping[str, float], model: Mapping[str, float],
           domains: Sequence[str] | None = None) -> tuple[float, dict[str, float]]:
    """Ratio of sums over the domains, and the share per domain, of the merge → own-expert gap recovered.

    Σ_d (merge_d − model_d) / Σ_d (merge_d − expert_d): never a mean of per-domain ratios, which a domain with a
    tiny gap would dominate.
    """
    domains = tuple(domains or merged)
    gap = {d: merged[d] - experts[d] for d in domains}
    recovered = {d: merged[d] - model[d] for d in domains}
    return sum(recovered.values()) / sum(gap.values()), {d: recovered[d] / gap[d] for d in domains}


def mean_nll(records: Sequence[Sequence[float]], picks: Sequence[int] | None = None) -> float:
    """Token-weighted mean NLL of per-record ``(nll_sum, tokens)`` pairs (``picks``: a resample's indices)."""
    rows = records if picks is None else [records[i] for i in picks]
    return sum(r[0] for r in rows) / sum(r[1] for r in rows)


def bootstrap_shares(merged: Mapping[str, list], experts: Mapping[str, list], model: Mapping[str, list],
                     resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Percentile intervals of the share (ratio of sums) and of each domain's share, over test records.

    Each argument maps a domain to its per-record ``(nll_sum, tokens)`` on that domain's test records, in the same
    record order for every model; one resample draws each domain's records with replacement (the same indices for
    the merge, the expert and the model: paired), then recomputes every NLL and share from them.
    """
    rng = random.Random(seed)
    domains = tuple(merged)
    totals, per = [], {d: [] for d in domains}
    for _ in range(resamples):
        picks = {d: [rng.randrange(len(merged[d])) for _ in merged[d]] for d in domains}
        m = {d: mean_nll(merged[d], picks[d]) for d in domains}
        e = {d: mean_nll(experts[d], picks[d]) for d in domains}
        x = {d: mean_nll(model[d], picks[d]) for d in domains}
        total, each = shares(m, e, x, domains)
        totals.append(total)
        for d in domains:
            per[d].append(each[d])
    return {"share": percentile_interval(totals, level),
            "share_per_domain": {d: percentile_interval(v, level) for d, v in per.items()}}


def bootstrap_share_ratio(merged: Mapping[str, list], experts: Mapping[str, list], model: Mapping[str, list],
                          reference: Mapping[str, list], resamples: int = 1000, seed: int = 0, level: float = 0.95) -> list[float]:
    """Percentile interval of share(model) / share(reference) over test records, both shares from the same resample
    (paired), so that what the two rows have in common (the gap, the records) cancels."""
    rng = random.Random(seed)
    domains = tuple(merged)
    ratios = []
    for _ in range(resamples):
        picks = {d: [rng.randrange(len(merged[d])) for _ in merged[d]] for d in domains}
        m = {d: mean_nll(merged[d], picks[d]) for d in domains}
        e = {d: mean_nll(experts[d], picks[d]) for d in domains}
        ours, theirs = ({d: mean_nll(rows[d], picks[d]) for d in domains} for rows in (model, reference))
        ratios.append(shares(m, e, ours, domains)[0] / shares(m, e, theirs, domains)[0])
    return percentile_interval(ratios, level)


def share_ratio_table(pairs: Sequence[tuple[str, str]], shares_of: Mapping[str, float], records: Mapping[str, Mapping[str, list] | None],
                      merged: Mapping[str, list], experts: Mapping[str, list], resamples: int = 1000, digits: int = 4) -> dict:
    """Per (row, reference) pair whose two rows both have per-record scores: ``"row / reference"`` → the ratio of their
    shares and its paired-bootstrap 95 % interval (``bootstrap_share_ratio``)."""
    return {f"{a} / {b}": {"ratio": round(shares_of[a] / shares_of[b], digits),
                           "ci95": [round(v, digits) for v in bootstrap_share_ratio(merged, experts, records[a], records[b], resamples)]}
            for a, b in pairs if records.get(a) and records.get(b)}


def bootstrap_nll(model: Mapping[str, list], resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Percentile intervals of each domain's NLL and of their average, over test records."""
    rng = random.Random(seed)
    domains = tuple(model)
    per, avg = {d: [] for d in domains}, []
    for _ in range(resamples):
        values = {d: mean_nll(model[d], [rng.randrange(len(model[d])) for _ in model[d]]) for d in domains}
        for d in domains:
            per[d].append(values[d])
        avg.append(sum(values.values()) / len(domains))
    return {"nll_avg": percentile_interval(avg, level), "nll": {d: percentile_interval(v, level) for d, v in per.items()}}


def percentile_interval(values: Sequence[float], level: float = 0.95) -> list[float]:
    """[lo, hi]: the (1 − level)/2 and (1 + level)/2 percentiles, linearly interpolated (numpy's default)."""
    ordered = sorted(values)
    n = len(ordered)

    def at(q: float) -> float:
        position = q * (n - 1)
        low = int(position)
        high = min(low + 1, n - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return [at((1 - level) / 2), at((1 + level) / 2)]
