"""How well the held-out criteria pick settings on the demo: ``python -m studies.tune_sweep WORKDIR``.

After one ``python -m featcal_llm demo`` (its models are reused), this runs in the
workdir's ``tune-sweep/``:

* the hand-chosen fixed recipe (all cal records; the time reference),
* ``auto`` with each criterion (selection per layer on the held-out 25 % of the cal split),
* every candidate setting as a *global* constant, calibrated on the same 75 % of the cal
  split (a tuned run whose lists hold one value each), which also measures its held-out
  criteria: the last layer's drift and the output KL, averaged over experts;

then scores each on the **test** split (used only for this report) and prints the table
(candidate → held-out criteria → test gap recovery), the Spearman rank correlation of
each criterion with test recovery, and the wall-clock cost factor of ``auto``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from featcal_llm.demo.config import FULL
from featcal_llm.demo.report import average
from featcal_llm.demo.models import quiet_transformers
from featcal_llm.demo.run import RESULTS_JSON, recipe_text

AUTO_LAMBDA = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


def _points() -> list[tuple[str, dict]]:
    points = [("fixed (hand-chosen, all records)", {}), ("auto, criterion hidden", {"auto": "hidden"}),
              ("auto, criterion output", {"auto": "output"})]
    for lam in AUTO_LAMBDA:
        for alpha in (0.15, 0.3, 0.5, 0.8):
            points.append((f"λ {lam:g}, α {alpha:g}, ρ 1", {"single": (lam, alpha, 1.0)}))
    for rho in (0.5, 1.5):
        points.append((f"λ 0.001, α 0.3, ρ {rho:g}", {"single": (1e-3, 0.3, rho)}))
    return points


def _recipe(point: dict, tag: str) -> str:
    text = recipe_text(FULL).replace("output: featcal", f"output: tune-sweep/{tag}")
    hyper = "  lambda: 0.001\n  alpha: 0.3\n  rho: 1\n"
    if "auto" in point:
        return text.replace(hyper, f"  lambda: auto\n  alpha: auto\n  rho: auto\n  tune: {{criterion: {point['auto']}}}\n")
    if "single" in point:
        lam, alpha, rho = point["single"]
        return text.replace(hyper, f"  lambda: [{lam!r}]\n  alpha: [{alpha!r}]\n  rho: [{rho!r}]\n")
    return text


@contextlib.contextmanager
def _patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks on ties)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result
    rx, ry = ranks(xs), ranks(ys)
    mx, my = average(rx), average(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def sweep(workdir: str | Path, echo=print, limit: int | None = None) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from featcal_llm.demo.score import exact_match
    from featcal_llm.demo.tasks import read_jsonl
    from featcal_llm import pipeline
    from featcal_llm.engine.calibrate import calibrate
    from featcal_llm.pipeline import run_recipe

    torch.set_num_threads(1)
    quiet_transformers()
    workdir = Path(workdir).resolve()
    tasks = FULL.tasks
    reference = json.loads((workdir / RESULTS_JSON).read_text())["test"]
    experts = {t: reference[f"expert:{t}"][t] for t in tasks}
    merged = reference["merged (task arithmetic)"]
    gap = average(experts[t] - merged[t] for t in tasks)
    test = {t: read_jsonl(workdir / "data" / t / "test.jsonl") for t in tasks}
    tokenizer = AutoTokenizer.from_pretrained(workdir / "base")
    (workdir / "tune-sweep").mkdir(exist_ok=True)
    rows = []
    for index, (name, point) in enumerate(_points()[:limit]):
        tag = f"p{index:02d}"
        (workdir / "tune-sweep" / f"{tag}.yaml").write_text(_recipe(point, tag))
        loop = []

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return calibrate(*args, **kwargs)
            finally:
                loop.append(time.perf_counter() - start)

        with contextlib.chdir(workdir), _patched(pipeline, "calibrate", timed):
            start = time.perf_counter()
            output = workdir / run_recipe(Path("tune-sweep") / f"{tag}.yaml", force=True, progress=False)
            seconds = time.perf_counter() - start
        model = AutoModelForCausalLM.from_pretrained(output)
        scores = {t: exact_match(model, tokenizer, test[t]) for t in tasks}
        drift = json.loads((output / "featcal_drift.json").read_text())
        row = {
            "name": name, "point": point, "seconds": seconds, "loop_seconds": loop[0], "test": scores,
            "recovered": average(scores[t] - merged[t] for t in tasks) / gap,
            "last_layer_drift": average(drift["layers"][-1]["calibrated"].values()),
            "output_kl": average(drift["output_divergence"]["calibrated"].values()),
        }
        if (output / "featcal_tuning.json").is_file():
            row["chosen"] = json.loads((output / "featcal_tuning.json").read_text())["chosen"]
        rows.append(row)
        echo(f"| {name} | {row['last_layer_drift']:.4f} | {row['output_kl']:.4f} | "
             + " / ".join(f"{scores[t]:.1f}" for t in tasks) + f" | {100 * row['recovered']:.0f}% | {loop[0]:.2f} / {seconds:.1f} |"
             + (f" chosen {row['chosen']}" if "chosen" in row else ""))
    candidates = [r for r in rows if "single" in r["point"]]
    if len(candidates) > 2:
        for key in ("last_layer_drift", "output_kl"):
            rho = spearman([-r[key] for r in candidates], [r["recovered"] for r in candidates])
            echo(f"Spearman rank correlation of (lower {key}) with test recovery over {len(candidates)} candidates: {rho:.2f}")
    (workdir / "tune-sweep" / "results.json").write_text(json.dumps(rows, indent=1))
    return rows


HEADER = ("| setting | held-out last-layer drift | held-out output KL | test a / r / p | test gap recovered | seconds (layer loop / run) |\n"
          "|---|---:|---:|---|---:|---:|")

if __name__ == "__main__":
    from studies.common import answer_help

    answer_help(__doc__)
    print(HEADER)
    sweep(sys.argv[1] if len(sys.argv) > 1 else "demo-work", limit=int(sys.argv[2]) if len(sys.argv) > 2 else None)
