"""Whole-run benchmark: `featcal-llm run` (start-up included) against a straightforward baseline, same model and data.

Builds (once; cached) a random Llama of the requested shapes with real
safetensors checkpoints (base, experts = base + seeded noise, merge = Task
Arithmetic), one JSONL calibration file per expert and a recipe; then times
`python -m featcal_llm run` in a subprocess (so imports count) and
`featcal_llm/benchmark/baseline.py` (whole models in memory, hooks, one sequence at a
time) on the same recipe, and compares their updates ΔW = W* − W_mer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from featcal_llm.startup import child_environment

TA_WEIGHT = 0.3  # Task Arithmetic weight per expert (the paper's MergeBench setting)
EXPERT_NOISE = 0.1  # expert delta, relative to each weight's mean magnitude
BASELINE_MODULE = "featcal_llm.benchmark.baseline"
PRESETS = {
    # SmolLM2-135M's shapes (random weights): 30 layers, hidden 576, 9/3 heads, tied embeddings
    "smollm2-135m": dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, vocab=49152, layers=30, experts=3, sequences=64, seq_len=128, lam=1e-5, tied=True),
}


@dataclass(frozen=True)
class WholeRunSpec:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int
    experts: int
    sequences: int
    seq_len: int
    tied: bool = False
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def build(spec: WholeRunSpec, workdir: Path, lam: float, log, dtype: str = "auto", stats_dtype: str = "auto", method: str = "featcal") -> Path:
    """The cached models, data and recipe for `spec` (the recipe is rewritten with the method, λ and the dtypes); returns its path."""
    from featcal_llm.tiny import CHARACTERS, build_char_tokenizer, new_tiny_llama, perturbed_copy, save_model, tiny_llama_config

    root = workdir / f"whole-{spec.key()}"
    recipe = root / "recipe.yaml"
    if not (root / "complete.json").is_file():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        log(f"bench: building base, merge and {spec.experts} experts ({spec.layers} layers, hidden {spec.hidden}) in {root}")
        tokenizer = build_char_tokenizer()
        config = tiny_llama_config(
            spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.hidden // spec.heads,
            tie_word_embeddings=spec.tied, max_position_embeddings=max(2048, spec.seq_len),
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        )
        config.architectures = ["LlamaForCausalLM"]
        base = new_tiny_llama(config, seed=spec.seed)
        merged = {name: tensor.clone() for name, tensor in base.state_dict().items()}
        for index in range(spec.experts):
            expert = perturbed_copy(base, seed=spec.seed + 100 + index, scale=EXPERT_NOISE)
            for name, tensor in expert.state_dict().items():
                merged[name].add_(tensor - base.state_dict()[name], alpha=TA_WEIGHT)
            save_model(expert, tokenizer, root / f"expert{index}", dtype=torch.float32)
            del expert
            rng = random.Random(spec.seed + index)
            with (root / f"data{index}.jsonl").open("w") as handle:
                for _ in range(spec.sequences):
                    handle.write(json.dumps({"text": "".join(rng.choice(CHARACTERS) for _ in range(spec.seq_len))}) + "\n")
        save_model(base, tokenizer, root / "base", dtype=torch.float32)
        base.load_state_dict(merged)
        save_model(base, tokenizer, root / "merged", dtype=torch.float32)
        del base, merged
        (root / "complete.json").write_text(json.dumps(asdict(spec)))
    experts = [str(root / f"expert{i}") for i in range(spec.experts)]
    import yaml

    recipe.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic",
        "base_model": str(root / "base"),
        "models": [{"model": e, "parameters": {"weight": TA_WEIGHT}} for e in experts],
        "dtype": "float32",
        "featcal": {
            "merged": str(root / "merged"), "output": str(root / "out-product"),
            "data": {e: {"path": str(root / f"data{i}.jsonl"), "format": "text"} for i, e in enumerate(experts)},
            "samples": spec.sequences, "max_length": spec.seq_len, "device": "cpu",
            "dtype": dtype, "stats_dtype": stats_dtype,
            # the baseline weighs every expert and token 1 and each expert teaches its records: so does the product run it is compared with
            **({"lambda": lam, "expert_weights": "equal", "token_weights": "equal", "trailing_experts": "keep",
                "teachers": "own"} if method == "featcal"
               else {"method": method}),
        },
    }, sort_keys=False))
    return recipe


def _timed(command: list[str], cwd: Path, log, progress_pattern: str | None = None) -> dict:
    """Run a command; wall and CPU seconds, and when the first stderr line matching each marker appeared."""
    env = child_environment()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marks: dict[str, float] = {}
    tail: list[str] = []

    def watch() -> None:
        buffer = b""
        while chunk := process.stderr.read1(65536):
            buffer += chunk
            now = time.perf_counter() - started
            text = buffer.decode(errors="replace")
            if progress_pattern and "start" not in marks and progress_pattern in text:
                marks["start"] = now
            # the first line after layer 0 finished: the bar moves on to layer 2 (tqdm may fold it into a later refresh)
            if progress_pattern and "first_layer" not in marks and re.search(r"FeatCal layer (?:[2-9]|\d{2,})/\d+|layer \d+/\d+ calibrated", text):
                marks["first_layer"] = now
            buffer = buffer[-4096:]
            tail[:] = text.splitlines()[-5:]

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    code = process.wait()
    reader.join()
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        from featcal_llm.errors import FeatCalError

        raise FeatCalError(f"bench: {' '.join(command[:4])}… failed with exit code {code}: {' / '.join(tail)}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # ru_maxrss of children is the largest of any child so far: exact for the first command this process runs
    peak = after.ru_maxrss / 1024 if after.ru_maxrss > before.ru_maxrss else None
    return {"seconds": wall, "cpu_seconds": cpu, "startup_seconds": marks.get("start"), "first_layer_seconds": marks.get("first_layer"), "peak_rss_mb": peak}


def _delta_difference(product: Path, baseline: Path, merged: Path) -> dict:
    """Relative difference of the two updates ΔW = W* − W_mer, per calibrated projection: worst and median."""
    from safetensors.torch import load_file

    def weights(directory: Path) -> dict[str, torch.Tensor]:
        tensors = {}
        for file in sorted(directory.glob("*.safetensors")):
            tensors.update(load_file(file))
        return tensors

    ours, theirs, start = weights(product), weights(baseline), weights(merged)
    errors = []
    for name, tensor in ours.items():
        if name.endswith("proj.weight") and name in theirs:
            delta = tensor.double() - start[name].double()
            errors.append(float(torch.linalg.matrix_norm(theirs[name].double() - start[name].double() - delta) / torch.linalg.matrix_norm(delta)))
    errors.sort()
    return {"projections": len(errors), "worst": errors[-1] if errors else None, "median": errors[len(errors) // 2] if errors else None}


def run_whole(spec: WholeRunSpec, workdir: Path, lam: float, baseline: bool, log, dtype: str = "auto", stats_dtype: str = "auto", method: str = "featcal") -> dict:
    """Build (cached), run the product with `method` and (optionally, FeatCal only) the baseline; raw measurements as a dict."""
    from featcal_llm.engine.devices import resolve_dtype, resolve_stats_dtype

    workdir.mkdir(parents=True, exist_ok=True)
    recipe = build(spec, workdir, lam, log, dtype, stats_dtype, method)
    baseline = baseline and method == "featcal"  # the baseline is FeatCal's
    lam = lam if method == "featcal" else 0.0  # RegMean solves without ridge: float64 statistics under `auto`
    compute = resolve_dtype(dtype, torch.device("cpu"), torch.float32)  # the preset's checkpoints are float32
    precision = {"dtype": str(compute).removeprefix("torch."), "stats_products": str(resolve_stats_dtype(stats_dtype, lam, compute, torch.device("cpu"))).removeprefix("torch.")}
    root = recipe.parent
    load_average = [os.getloadavg()]
    log(f"bench: featcal-llm run ({spec.layers} layers, {spec.experts} experts × {spec.sequences} × {spec.seq_len} tokens)")
    product = _timed([sys.executable, "-m", "featcal_llm", "run", str(recipe), "--force"], root, log, progress_pattern="FeatCal")
    product["per_layer_seconds"] = (product["seconds"] - (product["startup_seconds"] or 0.0)) / spec.layers
    result = {"mode": "whole-run", "method": method, "spec": asdict(spec), "lambda": lam, "precision": precision, "product": product, "baseline": None, "speedup": None, "delta_difference": None}
    if baseline:
        shutil.rmtree(root / "out-baseline", ignore_errors=True)
        log("bench: baseline (whole models, hooks, one sequence at a time)")
        result["baseline"] = _timed([sys.executable, "-m", BASELINE_MODULE, str(recipe), str(root / "out-baseline")], root, log)
        result["speedup"] = result["baseline"]["seconds"] / product["seconds"]
        result["delta_difference"] = _delta_difference(root / "out-product", root / "out-baseline", root / "merged")
    load_average.append(os.getloadavg())
    result["load_average"] = load_average
    return result


def render_whole(result: dict) -> str:
    spec, product, baseline = result["spec"], result["product"], result["baseline"]
    fmt = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
    lines = [
        f"{result.get('method', 'featcal')} whole run: {spec['layers']} layers, hidden {spec['hidden']}, intermediate {spec['intermediate']}, heads {spec['heads']}/{spec['kv_heads']}, "
        f"vocab {spec['vocab']}{' (tied)' if spec['tied'] else ''}, {spec['experts']} experts × {spec['sequences']} × {spec['seq_len']} tokens, λ {result['lambda']:g}",
        f"product: compute {result['precision']['dtype']}, statistics products {result['precision']['stats_products']} (float64 totals);"
        f" {fmt(product['per_layer_seconds'])} s per layer after start-up; peak RSS {fmt(product.get('peak_rss_mb'))} MB",
        f"{'':<34}{'wall s':>10}{'CPU s':>10}{'start-up s':>12}{'first layer s':>15}",
        f"{'featcal-llm run':<34}{fmt(product['seconds']):>10}{fmt(product['cpu_seconds']):>10}{fmt(product['startup_seconds']):>12}{fmt(product['first_layer_seconds']):>15}",
    ]
    if baseline:
        lines.append(f"{'baseline (featcal_llm/benchmark/baseline.py)':<34}{fmt(baseline['seconds']):>10}{fmt(baseline['cpu_seconds']):>10}")
        lines.append(f"speed-up: {result['speedup']:.2f}× (baseline wall ÷ product wall)")
        diff = result["delta_difference"]
        lines.append(f"ΔW product vs baseline (float32 baseline): worst {diff['worst']:.2e}, median {diff['median']:.2e} relative, {diff['projections']} projections")
    lines.append(f"load average before/after: {result['load_average'][0][0]:.2f} / {result['load_average'][-1][0]:.2f}")
    return "\n".join(lines)
