"""`refine: true` on the demo: the demo's own recipe with the stage on, scored as the demo scores (exact match, dev and
test), beside the demo's FeatCal row. One of the settings the issue asks `refine:` to win on before it is a default.

    python -m featcal_llm demo --workdir W --no-baselines      # builds, merges, calibrates and scores
    python -m studies.demo_refine --workdir W --json docs/studies/results/demo-refine.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from studies.common import log, save_json

REFINED_DIR = "featcal-refine"
REFINE_RECIPE = "recipe-refine.yaml"


def refine_recipe(recipe: str) -> str:
    """The demo's recipe with `refine: true` and its own output directory."""
    from featcal_llm.demo.run import OUTPUT_DIR

    lines = [f"  output: {REFINED_DIR}" if line.strip() == f"output: {OUTPUT_DIR}" else line for line in recipe.splitlines()]
    return "\n".join(lines) + "\n  refine: true\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    from featcal_llm.demo.config import FULL
    from featcal_llm.demo.report import gap_recovery
    from featcal_llm.demo.run import CALIBRATED_ROW, MERGED_ROW, RECIPE_FILE, RESULTS_JSON, _score_model
    from featcal_llm.pipeline import run_recipe

    work = args.workdir
    demo = json.loads((work / RESULTS_JSON).read_text())
    scores = {name: {"dev": demo["dev"][name], "test": demo["test"][name]} for name in demo["test"]}
    (work / REFINE_RECIPE).write_text(refine_recipe((work / RECIPE_FILE).read_text()))
    started = time.perf_counter()
    with contextlib.chdir(work):
        run_recipe(Path(REFINE_RECIPE), force=True, device="cpu", progress=False)
    seconds = time.perf_counter() - started
    row = "merged + FeatCal, then refine: true"
    scores[row] = _score_model(work / REFINED_DIR, work / "data", FULL.tasks, ("dev", "test"), "cpu")
    refined = json.loads((work / REFINED_DIR / "featcal_refine.json").read_text())
    result = {"tasks": list(FULL.tasks), "metric": demo["metric"], "scores": scores, "refine_seconds": round(seconds, 1),
              "closed_form_seconds": demo["timings_s"]["merge_and_featcal"],
              "refine": {k: refined[k] for k in ("params", "lr", "steps_run", "chosen_step", "held_out_kl", "records", "records_left_out")}}
    for split in ("dev", "test"):
        split_scores = {name: values[split] for name, values in scores.items()}
        result[f"recovered_{split}"] = {name: gap_recovery(split_scores, list(FULL.tasks), MERGED_ROW, name)["recovered"]
                                        for name in (CALIBRATED_ROW, row)}
    save_json(args.json, result)
    log(f"demo: {json.dumps({k: result[k] for k in ('recovered_dev', 'recovered_test', 'refine_seconds')})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
