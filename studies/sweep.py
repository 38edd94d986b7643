"""The dev-split sweep behind the demo's recipe: ``python -m studies.sweep WORKDIR``.

It reuses a demo workdir's base, experts and data, merges at each Task Arithmetic
weight, calibrates at each grid point through ``run_recipe`` and scores on the
**dev** split only (the test split is never read), then prints a markdown table.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from featcal_llm.demo.config import FULL, DemoConfig
from featcal_llm.demo.report import average
from featcal_llm.demo.models import quiet_transformers
from featcal_llm.demo.run import recipe_text


def _points() -> list[dict]:
    """Alpha x lambda at the recipe's TA weight and rho, then rho, TA weight and sample count one at a time."""
    base = {"ta_weight": 0.5, "lam": 1e-3, "alpha": 0.5, "rho": 1.0, "samples": 256}
    points = [{**base, "lam": lam, "alpha": alpha} for lam in (1e-3, 1e-2) for alpha in (0.15, 0.3, 0.5, 0.8)]
    points += [{**base, "rho": rho} for rho in (0.5, 1.5)]
    points += [{**base, "ta_weight": weight} for weight in (0.3, 0.7)]
    points += [{**base, "samples": 64}]
    return points


def sweep(workdir: str | Path, points: list[dict] | None = None, config: DemoConfig = FULL, echo=print) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from featcal_llm.demo.score import exact_match
    from featcal_llm.demo.tasks import read_jsonl
    from featcal_llm.pipeline import run_recipe

    torch.set_num_threads(2)
    quiet_transformers()
    workdir = Path(workdir).resolve()
    dev = {t: read_jsonl(workdir / "data" / t / "dev.jsonl") for t in config.tasks}
    tokenizer = AutoTokenizer.from_pretrained(workdir / "base")

    def score(path: Path) -> dict[str, float]:
        model = AutoModelForCausalLM.from_pretrained(path)
        return {t: exact_match(model, tokenizer, dev[t]) for t in config.tasks}

    experts = {t: score(workdir / "experts" / t)[t] for t in config.tasks}
    rows: list[dict] = []
    merged_scores: dict[float, dict] = {}
    echo("experts on their own dev task: " + ", ".join(f"{t} {v:.1f}" for t, v in experts.items()))
    echo(HEADER)
    for point in points or _points():
        cfg = config.replace(**point)
        tag = "_".join(f"{k}{v:g}" for k, v in point.items())
        text = recipe_text(cfg).replace("merged: merged", f"merged: sweep/merged_w{cfg.ta_weight:g}")
        text = text.replace("output: featcal", f"output: sweep/{tag}")
        (workdir / "sweep").mkdir(exist_ok=True)
        torch.manual_seed(0)
        (workdir / "sweep" / f"{tag}.yaml").write_text(text)
        with contextlib.chdir(workdir):
            output = run_recipe(Path("sweep") / f"{tag}.yaml", force=True, progress=False)
            if cfg.ta_weight not in merged_scores:
                merged_scores[cfg.ta_weight] = score(Path(f"sweep/merged_w{cfg.ta_weight:g}"))
            calibrated = score(output)
        merged = merged_scores[cfg.ta_weight]
        gap = average(experts[t] - merged[t] for t in config.tasks)
        gain = average(calibrated[t] - merged[t] for t in config.tasks)
        row = {**point, "merged": merged, "featcal": calibrated, "gap": gap, "gain": gain,
               "recovered": gain / gap if gap > 0 else None,
               "worst": min(calibrated[t] - merged[t] for t in config.tasks)}
        rows.append(row)
        echo(_line(row, config.tasks))
    return rows


def _line(row: dict, tasks) -> str:
    rec = "n/a" if row["recovered"] is None else f"{100 * row['recovered']:.0f}%"
    return (f"| {row['ta_weight']:g} | {row['lam']:g} | {row['alpha']:g} | {row['rho']:g} | {row['samples']} | "
            + " / ".join(f"{row['merged'][t]:.0f}" for t in tasks) + " | "
            + " / ".join(f"{row['featcal'][t]:.0f}" for t in tasks) + f" | {rec} | {row['worst']:+.1f} |")


HEADER = ("| TA weight | lambda | alpha | rho | samples | merged dev (a/r/p) | FeatCal dev (a/r/p) | gap recovered | "
          "worst task Δ |\n|---:|---:|---:|---:|---:|---|---|---:|---:|")

if __name__ == "__main__":
    from studies.common import answer_help

    answer_help(__doc__)
    sweep(sys.argv[1] if len(sys.argv) > 1 else "demo-work")
