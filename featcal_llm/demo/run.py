"""The demo orchestrator: data → base → experts → recipe → merge + FeatCal → scores → report.

Every stage writes into the workdir and records a key (a hash of everything it
depends on) in ``.demo-cache.json``; a rerun skips every stage whose key and
output are unchanged, so a cached demo only re-reads its scores and reprints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from featcal_llm.demo.config import FULL, QUICK, DemoConfig, digest
from featcal_llm.demo.models import TimedLog, build_base, quiet_transformers, set_threads, train_experts
from featcal_llm.engine.resume import source_digest

CACHE_FILE = ".demo-cache.json"
RECIPE_FILE = "recipe.yaml"
RESULTS_JSON = "results.json"
RESULTS_PNG = "results.png"
RESULTS_TABLE = "results.md"
MERGED_DIR = "merged"
OUTPUT_DIR = "featcal"
MERGED_ROW = "merged (task arithmetic)"
CALIBRATED_ROW = "merged + FeatCal"


def calibrated_row(cfg: DemoConfig) -> str:
    """The calibrated model's row: with `--auto` marked as the RegMean baselines' `auto` rows are (λ, α, ρ chosen by the run)."""
    return f"{CALIBRATED_ROW}, `auto`" if cfg.auto else CALIBRATED_ROW


class _Cache:
    def __init__(self, workdir: Path):
        self.path = workdir / CACHE_FILE
        self.workdir = workdir
        self.state = json.loads(self.path.read_text()) if self.path.exists() else {}

    def fresh(self, stage: str, key: str, *outputs: str) -> bool:
        return self.state.get(stage) == key and all((self.workdir / o).exists() for o in outputs)

    def mark(self, stage: str, key) -> None:
        self.state[stage] = key
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


def recipe_text(cfg: DemoConfig, device: str = "cpu") -> str:
    """The mergekit recipe with its featcal block; every path is relative to the workdir."""
    models = "\n".join(f"  - model: experts/{t}\n    parameters: {{weight: {cfg.ta_weight}}}" for t in cfg.tasks)
    data = "\n".join(f"    experts/{t}: {{path: data/{t}/cal.jsonl, format: completion, prompt: prompt, response: answer}}" for t in cfg.tasks)
    if cfg.auto:
        # the next-token KL criterion: cheap at this character vocabulary, and at least as good as the drift on every seed measured
        hyper = "  lambda: auto\n  alpha: auto\n  rho: auto\n  tune: {criterion: output}\n"
        chosen = ("featcal chooses lambda, alpha and rho itself on held-out cal records by the next-token KL "
                  "(`python -m featcal_llm demo --auto`).")
        title = "FeatCal demo recipe, lambda/alpha/rho chosen by the run (--auto)"
    else:
        hyper = f"  lambda: {cfg.lam:g}\n  alpha: {cfg.alpha:g}\n  rho: {cfg.rho:g}\n"
        chosen = "featcal hyper-parameters were chosen on the demo's dev split (docs/studies/demo-sweeps.md)."
        title = "FeatCal demo recipe, fixed lambda/alpha/rho"
    return f"""\
# {title}, written by `python -m featcal_llm demo` into its workdir.
# Every path is relative to that workdir (mergekit resolves model paths against the
# current directory), so run it from there:  cd demo-work && featcal-llm run {RECIPE_FILE} --force
# {chosen}
merge_method: task_arithmetic
base_model: base
models:
{models}
dtype: float32
featcal:
  merged: {MERGED_DIR}
  output: {OUTPUT_DIR}
  data:
{data}
  samples: {cfg.samples}
  max_length: {cfg.max_length}
{hyper}  eps: {cfg.eps:g}
  device: {device}
  batch_tokens: 4096
"""


def calibration_key(expert_keys: dict[str, str], recipe: str) -> str:
    """What the cached merge and calibration were made from: the experts, the recipe and the code that computes the
    weights (a default changed there changes the run without changing the recipe's text)."""
    return digest([expert_keys, recipe, source_digest()])


def _refuse_failed_experts(cfg: DemoConfig, workdir: Path, records: list[dict]) -> None:
    """No table from an expert that did not learn its task: remove stale results and stop with one line."""
    failed = [r for r in records if not r["reached"]]
    if not failed:
        return
    for name in (RESULTS_JSON, RESULTS_PNG, RESULTS_TABLE):
        (workdir / name).unlink(missing_ok=True)
    from featcal_llm.errors import FeatCalError

    missed = "; ".join(f"experts/{r['task']}: dev exact match {r['dev_accuracy']:.1f}% after {r['steps']} steps"
                       for r in failed)
    raise FeatCalError(f"{missed}; expected at least {cfg.expert_target:g}% (an expert that did not learn its task "
                       f"would make the table meaningless; raise --expert-max-steps or lower --expert-target)")


def _model_rows(cfg: DemoConfig) -> dict[str, str]:
    """Table row name → model directory, in table order."""
    rows = {"base": "base"}
    rows.update({f"expert:{t}": f"experts/{t}" for t in cfg.tasks})
    rows[MERGED_ROW] = MERGED_DIR
    rows[calibrated_row(cfg)] = OUTPUT_DIR
    return rows


def _score_model(path: Path, data: Path, tasks: tuple[str, ...], splits: tuple[str, ...], device: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from featcal_llm.demo.score import exact_match
    from featcal_llm.demo.tasks import read_jsonl

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").to(device)
    return {split: {t: exact_match(model, tokenizer, read_jsonl(data / t / f"{split}.jsonl")) for t in tasks}
            for split in splits}


def run_demo(workdir: str | Path = "demo-work", quick: bool = False, device: str = "cpu",
             config: DemoConfig | None = None, echo: Callable[[str], None] = print,
             threads: int | None = None) -> dict:
    """Build (or reuse) the scenario in ``workdir``, merge, calibrate, score and report; returns the results."""
    cfg = config or (QUICK if quick else FULL)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # One one-thread worker per expert (each stops at its own step); the main process uses the cores:
    # pre-training steps 143 ms at 2 threads vs 225 ms at 1 on 2 cores, bit-identical weights (docs/studies/demo-sweeps.md, section 4).
    workers = 1 if quick or device != "cpu" else min(threads or len(cfg.tasks), len(cfg.tasks))
    threads = threads or (1 if quick else min(os.cpu_count() or 1, 4))
    set_threads(threads)
    quiet_transformers()
    log = TimedLog(echo)
    cache = _Cache(workdir)
    timings: dict[str, float] = {}
    log(f"FeatCal demo in {workdir} ({'quick' if quick else 'full'}{', auto' if cfg.auto else ''} scenario, config {cfg.key()}, "
        f"{threads} thread{'s' * (threads > 1)}, {workers} expert worker{'s' * (workers > 1)}, device {device})")

    # 1. data
    t0 = time.perf_counter()
    data_key = cfg.key("seed", "tasks", "train_size", "cal_size", "dev_size", "test_size")
    if cache.fresh("data", data_key, "data"):
        log("data: cached")
    else:
        from featcal_llm.demo.tasks import TASKS, make_splits, write_jsonl

        sizes = {"train": cfg.train_size, "cal": cfg.cal_size, "dev": cfg.dev_size, "test": cfg.test_size}
        for task in cfg.tasks:
            for split, records in make_splits(TASKS[task], sizes, cfg.seed).items():
                write_jsonl(records, workdir / "data" / task / f"{split}.jsonl")
            log(f"data: {task}: {TASKS[task].description}; disjoint splits {sizes}")
        cache.mark("data", data_key)
    timings["data"] = time.perf_counter() - t0

    # 2. base
    t0 = time.perf_counter()
    base_key = digest([data_key, cfg.key("seed", "skill_fraction", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "pretrain_steps", "pretrain_batch", "pretrain_seq_len",
                               "pretrain_lr"), device])
    if cache.fresh("base", base_key, "base/config.json"):
        log("base: cached")
    else:
        build_base(cfg, workdir, device, log)
        cache.mark("base", base_key)
    timings["base"] = time.perf_counter() - t0

    # 3. experts
    t0 = time.perf_counter()
    expert_keys = {t: digest([base_key, data_key, t, cfg.key("finetune_max_steps", "finetune_batch", "finetune_lr",
                                                         "expert_target", "check_every")])
                   for t in cfg.tasks}
    todo = [t for t in cfg.tasks if not cache.fresh(f"expert:{t}", expert_keys[t], f"experts/{t}/config.json")]
    if len(todo) < len(cfg.tasks):
        log(f"experts: cached {', '.join(t for t in cfg.tasks if t not in todo)}")
    trained = train_experts(cfg, workdir, todo, device, min(workers, len(todo)), log)
    training = cache.state.get("training", {})
    for record in trained:
        if record["reached"]:
            training[record["task"]] = record
            cache.state["training"] = training
            cache.mark(f"expert:{record['task']}", expert_keys[record["task"]])
    _refuse_failed_experts(cfg, workdir, trained)
    timings["experts"] = time.perf_counter() - t0

    # 4. recipe, merge and calibration through the code path of `featcal-llm run`
    t0 = time.perf_counter()
    recipe = recipe_text(cfg, device)
    (workdir / RECIPE_FILE).write_text(recipe)
    merge_key = calibration_key(expert_keys, recipe)
    if cache.fresh("featcal", merge_key, f"{MERGED_DIR}/config.json", f"{OUTPUT_DIR}/config.json"):
        log("merge + FeatCal: cached")
    else:
        from featcal_llm.pipeline import run_recipe

        for stale in (MERGED_DIR, OUTPUT_DIR):
            shutil.rmtree(workdir / stale, ignore_errors=True)
        log(f"merge + FeatCal: featcal-llm run {RECIPE_FILE} (mergekit task_arithmetic, weight {cfg.ta_weight} each; "
            + ("lambda, alpha, rho auto" if cfg.auto else f"lambda {cfg.lam:g}, alpha {cfg.alpha:g}, rho {cfg.rho:g}")
            + f", {cfg.samples} samples per task)")
        with contextlib.chdir(workdir):
            run_recipe(Path(RECIPE_FILE), force=True, device=device)
        cache.mark("featcal", merge_key)
    timings["merge_and_featcal"] = time.perf_counter() - t0
    extra: dict[str, tuple[str, str]] = {}
    if cfg.baselines:  # RegMean and RegMean++ rows, same experts and records (demo/baselines.py)
        from featcal_llm.demo.baselines import run_baselines

        t0 = time.perf_counter()
        extra = run_baselines(cfg, workdir, device, log, cache, expert_keys)
        timings["regmean_baselines"] = time.perf_counter() - t0

    # 5. scores
    t0 = time.perf_counter()
    model_keys = {"base": base_key, **{f"expert:{t}": expert_keys[t] for t in cfg.tasks},
                  MERGED_ROW: digest([merge_key, "merged"]), calibrated_row(cfg): merge_key, **{r: k for r, (_, k) in extra.items()}}
    splits = ("dev", "test")
    scores_cache = cache.state.get("scores", {})
    results: dict[str, dict] = {}
    for row, directory in {**_model_rows(cfg), **{r: d for r, (d, _) in extra.items()}}.items():
        key = digest([model_keys[row], data_key])
        if scores_cache.get(row, {}).get("key") == key:
            results[row] = scores_cache[row]["scores"]
            log(f"score: {row}: cached")
            continue
        results[row] = _score_model(workdir / directory, workdir / "data", cfg.tasks, splits, device)
        scores_cache[row] = {"key": key, "scores": results[row]}
        cache.mark("scores", scores_cache)
        log(f"score: {row}: test " + "  ".join(f"{t} {results[row]['test'][t]:.1f}" for t in cfg.tasks))
    timings["scoring"] = time.perf_counter() - t0

    experts_training = {t: training.get(t) for t in cfg.tasks}
    return _report(cfg, workdir, results, timings, experts_training, log, echo)


def _report(cfg: DemoConfig, workdir: Path, results: dict, timings: dict, experts_training: dict, log, echo) -> dict:
    from featcal_llm.demo.report import (
        bar_chart,
        gap_recovery,
        recovery_sentence,
        table,
        write_json,
    )

    tasks = list(cfg.tasks)
    test = {row: scores["test"] for row, scores in results.items()}
    dev = {row: scores["dev"] for row, scores in results.items()}
    recovery = gap_recovery(test, tasks, MERGED_ROW, calibrated_row(cfg))
    experts_ok = {t: test[f"expert:{t}"][t] >= (cfg.expert_bar or 0) for t in tasks}
    text = table(test, tasks)
    sentence = recovery_sentence(recovery)
    (workdir / RESULTS_TABLE).write_text(
        "Greedy exact match (%) on the demo's test split\n\n" + text + "\n\n" + sentence + "\n")
    bar_chart(test, tasks, workdir / RESULTS_PNG, "FeatCal demo: exact match on the test split")
    payload = {
        "config": cfg.as_dict(),
        "config_key": cfg.key(),
        "metric": "greedy exact match (%)",
        "test": test,
        "dev": dev,
        "gap_recovery_test": recovery,
        "gap_recovery_dev": gap_recovery(dev, tasks, MERGED_ROW, calibrated_row(cfg)),
        "experts_meet_bar": experts_ok,
        "experts_training": experts_training,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "files": {"recipe": RECIPE_FILE, "calibrated": OUTPUT_DIR, "merged": MERGED_DIR, "chart": RESULTS_PNG,
                  "table": RESULTS_TABLE},
    }
    write_json(workdir / RESULTS_JSON, payload)
    echo("")
    echo("Greedy exact match (%) on the test split:")
    echo(text)
    echo("")
    echo(sentence)
    trained = [f"{t} {r['steps']} steps (dev {r['dev_accuracy']:.1f}%)" for t, r in experts_training.items() if r]
    if trained:
        echo("Experts' fine-tuning" + (f" to {cfg.expert_target:g}% dev exact match" if cfg.expert_target is not None
                                       else "") + ": " + ", ".join(trained) + ".")
    if cfg.expert_bar is not None and not all(experts_ok.values()):
        echo(f"warning: an expert is below {cfg.expert_bar:g}% on its own task: "
             + ", ".join(t for t, ok in experts_ok.items() if not ok))
    log(f"wrote {workdir / RESULTS_JSON}, {workdir / RESULTS_PNG}, {workdir / RESULTS_TABLE}; "
        f"calibrated model in {workdir / OUTPUT_DIR}")
    return payload
