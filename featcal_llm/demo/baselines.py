"""The demo's data-based baselines: RegMean and RegMean++ on the same experts and calibration records as FeatCal.

Both start from a mergekit `linear` merge (equal weights): MergeBench's RegMean
averages every tensor it does not regress (biases, norms), and featcal-llm's
RegMean keeps those from `merged`, so a linear merge gives the classic method.
Each run goes through `featcal-llm run` like the FeatCal row; the recipes are
written into the workdir (`featcal_llm/recipes/demo-regmean.yaml`, `featcal_llm/recipes/demo-regmeanpp.yaml`
are the shipped copies).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from featcal_llm.demo.config import DemoConfig, digest

LINEAR_DIR = "merged-linear"
LINEAR_ROW = "merged (linear)"
# row → (method, recipe file, output directory)
METHODS = {
    "merged (linear) + RegMean": ("regmean", "recipe-regmean.yaml", "regmean"),
    "merged (linear) + RegMean++": ("regmean++", "recipe-regmeanpp.yaml", "regmeanpp"),
}


def baseline_recipe(cfg: DemoConfig, method: str, output: str, device: str = "cpu") -> str:
    """A linear merge of the experts plus a featcal block that runs `method` on it; paths relative to the workdir.

    With `cfg.auto` the reduction is `auto`: chosen per layer on held-out cal records, as `demo --auto` chooses FeatCal's.
    """
    models = "\n".join(f"  - model: experts/{t}\n    parameters: {{weight: 1.0}}" for t in cfg.tasks)
    models += "\n  - model: base\n    parameters: {weight: 0.0}"  # mergekit's linear weighs every model it reads, the base included
    data = "\n".join(f"    experts/{t}: {{path: data/{t}/cal.jsonl, format: completion, prompt: prompt, response: answer}}" for t in cfg.tasks)
    return f"""\
# {method} demo recipe, written by `python -m featcal_llm demo` into its workdir (run it from there).
# The classic {method}: a linear merge (equal weights, normalised) supplies every tensor {method} does not regress.
merge_method: linear
base_model: base
models:
{models}
dtype: float32
featcal:
  method: {method}
  merged: {LINEAR_DIR}
  output: {output}
  data:
{data}
  samples: {cfg.samples}
  max_length: {cfg.max_length}
  reduction: {"auto" if cfg.auto else f"{cfg.reduction:g}"}
  eps: {cfg.eps:g}
  device: {device}
  batch_tokens: 4096
"""


def run_baselines(cfg: DemoConfig, workdir: Path, device: str, log, cache, expert_keys: dict) -> dict[str, tuple[str, str]]:
    """Run (or reuse) RegMean and RegMean++; returns row → (model directory, cache key), the linear merge first."""
    from featcal_llm.pipeline import run_recipe

    rows: dict[str, tuple[str, str]] = {}
    linear_key = None
    for row, (method, recipe_file, output) in METHODS.items():
        if cfg.auto:
            row, recipe_file, output = f"{row}, `auto`", recipe_file.replace(".yaml", "-auto.yaml"), f"{output}-auto"
        recipe = baseline_recipe(cfg, method, output, device)
        (workdir / recipe_file).write_text(recipe)
        key = digest([expert_keys, recipe])
        linear_key = linear_key or digest([expert_keys, recipe.split("featcal:")[0]])
        if cache.fresh(f"baseline:{output}", key, f"{LINEAR_DIR}/config.json", f"{output}/config.json"):
            log(f"{method}: cached")
        else:
            if not cache.fresh("linear", linear_key, f"{LINEAR_DIR}/config.json"):
                shutil.rmtree(workdir / LINEAR_DIR, ignore_errors=True)
            log(f"{method}: featcal-llm run {recipe_file} (mergekit linear merge, reduction {'auto' if cfg.auto else cfg.reduction})")
            with contextlib.chdir(workdir):
                run_recipe(Path(recipe_file), force=True, device=device)
            cache.mark("linear", linear_key)
            cache.mark(f"baseline:{output}", key)
        rows[row] = (output, key)
    return rows if cfg.auto else {LINEAR_ROW: (LINEAR_DIR, linear_key), **rows}
