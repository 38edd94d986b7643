"""Runs the engine's layer loop on synthetic checkpoints with a per-layer phase timer.

The engine is driven directly (Models, CalibrationPlan, LayerRunner and token
batches, as `pipeline.run_recipe` builds them) so that every number belongs to
`calibrate()` itself. Layer boundaries are observed through the merged
model's reader: `calibrate` reads layer l of the merged model first thing in
layer l, at which point the timer's accumulated phase seconds are snapshotted.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from featcal_llm.benchmark import costs, machine
from featcal_llm.benchmark.instruments import BenchReader, LayerTimer, ReadCounter
from featcal_llm.benchmark.synthetic import SyntheticSpec, ensure_checkpoints
from featcal_llm.io.checkpoint import CheckpointReader
from featcal_llm.maths.solve import SOLVE_DTYPE



@dataclass
class BenchOptions:
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    layers: int = 2
    distinct_layers: int | None = None  # layers physically stored; layer l reads stored layer l mod this
    vocab: int = 128
    experts: int = 3
    sequences: int = 2
    seq_len: int = 256
    tokens: int | None = None  # tokens per expert; overrides sequences (whole sequences of seq_len)
    batch_tokens: int = 16384
    device: str = "auto"
    dtype: str = "auto"
    stats_dtype: str = "auto"
    workdir: str | None = None
    rebuild: bool = False
    clean: bool = False
    seed: int = 0
    shard_mb: int = 500
    peak_size: int | None = None
    probe_mb: int | None = None
    warm_cache: bool = False
    lam: float = 3.0
    alpha: float = 0.15
    rho: float = 0.5
    finalize: bool = True
    extrapolate_to: int = 32
    generation: bool = True  # also time `generate:` (each expert writing its tokens) on these shapes
    progress: bool = False
    threads: int | None = None
    host_memory_gb: float | None = None
    gram_triangle: bool | None = None  # a GPU's Grams from their lower block triangle (None: the engine's rule, the square)
    notes: list[str] = field(default_factory=list)


def _call_calibrate(calibrate, models, plan, runner, batches, layers, run_dir: Path, options, progress, timer):
    """Run the engine's loop as `run` does; returns (replacements, host store)."""
    from featcal_llm.hardware import stream_budget
    from featcal_llm.engine.resume import StagingArea
    from featcal_llm.engine.streams import HostStore

    from featcal_llm.engine.context import RunContext

    staging = StagingArea(run_dir / "partial", f"bench-{run_dir.name}")
    store = HostStore(stream_budget(options.host_memory_gb), run_dir / "spill", pin=runner.device.type == "cuda")
    return calibrate(RunContext(models, plan, runner, store, staging, batches, timer=timer), layers, progress=progress), store


def stretch_to_layers(config, layers: int) -> None:
    """Make a config of the few stored layers describe `layers` decoder layers (per-layer kinds repeated cyclically)."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        config.layer_types = [kinds[layer % len(kinds)] for layer in range(layers)]
    config.num_hidden_layers = layers


def statistics_matmul_dtype(device: torch.device, dtype: torch.dtype, stats_dtype: torch.dtype) -> torch.dtype:
    """The dtype the statistics matmuls run in: bf16/fp16 tensor cores into float32 on GPUs that can, else the accumulator's."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and stats_dtype == torch.float32:
        from featcal_llm.maths.stats import _half_inputs_float_output

        if _half_inputs_float_output(device):
            return dtype
    return stats_dtype


def _stored_layers(options: BenchOptions, spec_for: Callable[[int], SyntheticSpec], workdir: Path, log) -> int:
    if options.distinct_layers:
        return max(1, min(options.distinct_layers, options.layers))
    spec = spec_for(options.layers)
    if (workdir / f"ckpt-{spec.key()}" / "complete.json").is_file():
        return options.layers
    models = options.experts + 2
    free = shutil.disk_usage(workdir).free
    if models * spec.model_bytes() <= 0.8 * free:
        return options.layers
    fit = int((0.8 * free / models) // spec.layer_bytes())
    if fit < 1:
        from featcal_llm.errors import FeatCalError

        raise FeatCalError(f"bench: {workdir}: not enough disk for even one layer of {models} checkpoints")
    note = f"only {fit} of {options.layers} layers fit on disk ({free / 1e9:.0f} GB free): layer l reads stored layer l mod {fit}"
    options.notes.append(note)
    log(f"bench: {note}")
    return fit


def run_benchmark(options: BenchOptions, log: Callable[[str], None]) -> dict:
    """Build (or reuse) the checkpoints, measure the machine, run the layer loop; raw measurements as a dict."""
    from featcal_llm.maths import stats

    engine_rule = stats.GRAM_TRIANGLE_ON_GPU
    if options.gram_triangle is not None:
        stats.GRAM_TRIANGLE_ON_GPU = options.gram_triangle
    try:
        return _measure(options, log)
    finally:
        stats.GRAM_TRIANGLE_ON_GPU = engine_rule


def _measure(options: BenchOptions, log: Callable[[str], None]) -> dict:
    from transformers import AutoConfig

    from featcal_llm.family.architectures import architecture_for, select_projections
    from featcal_llm.engine.calibrate import calibrate
    from featcal_llm.engine.context import Models
    from featcal_llm.io.checkpoint import copy_side_files, write_calibrated_checkpoint
    from featcal_llm.family.layers import LayerRunner
    from featcal_llm.engine.devices import resolve_device, resolve_dtype, resolve_stats_dtype
    from featcal_llm.engine.plan import CalibrationPlan
    from featcal_llm.engine.objectives import FeatCal
    from featcal_llm.maths.objective import Hyperparameters
    from featcal_llm.maths.stats import TOTAL_DTYPE, gram_triangle
    from featcal_llm.engine.streams import make_batches
    from featcal_llm.tiny import SPECIAL_TOKENS

    if options.threads:
        torch.set_num_threads(options.threads)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device, torch.bfloat16)  # the synthetic checkpoints are stored in bf16
    stats_dtype = resolve_stats_dtype(options.stats_dtype, options.lam, dtype, device)
    if options.tokens is not None:
        options.seq_len = min(options.seq_len, options.tokens)
        options.sequences = math.ceil(options.tokens / options.seq_len)
    workdir = Path(options.workdir) if options.workdir else Path(tempfile.gettempdir()) / "featcal-llm-bench"
    workdir.mkdir(parents=True, exist_ok=True)

    def spec_for(layers: int) -> SyntheticSpec:
        return SyntheticSpec(
            hidden=options.hidden, intermediate=options.intermediate, heads=options.heads, kv_heads=options.kv_heads,
            layers=layers, vocab=options.vocab, experts=options.experts, seed=options.seed, shard_mb=options.shard_mb,
        )

    stored_layers = _stored_layers(options, spec_for, workdir, log)
    spec = spec_for(stored_layers)
    start = time.perf_counter()
    checkpoints = ensure_checkpoints(spec, workdir, options.rebuild, log, device)
    build_seconds = time.perf_counter() - start

    # The machine's own limits, measured now.
    probe_mb = options.probe_mb or max(64, min(2048, spec.layer_bytes() * 2 >> 20))
    log(f"bench: measuring disk rates ({probe_mb} MiB probe file)")
    disk = machine.disk_rates(workdir, probe_mb)
    peak_size = options.peak_size or (8192 if device.type == "cuda" else 2048)
    stats_matmul = statistics_matmul_dtype(device, dtype, stats_dtype)
    triangle = gram_triangle(device)  # what accumulate_gram multiplies on this device (bench --gram-triangle)
    used_dtypes = list(dict.fromkeys([dtype, stats_matmul, SOLVE_DTYPE]))

    def measure_rates() -> dict[str, float]:
        log(f"bench: measuring matmul rates ({peak_size}², {', '.join(str(dt).removeprefix('torch.') for dt in used_dtypes)})")
        return {str(dt).removeprefix("torch."): machine.matmul_rate(device, dt, peak_size) for dt in used_dtypes}

    rates_before = measure_rates()

    config = AutoConfig.from_pretrained(checkpoints.merged)
    stretch_to_layers(config, options.layers)  # layer l reads stored layer l mod stored_layers (BenchReader)
    architecture = architecture_for(config, "bench")
    plan = CalibrationPlan(
        architecture=architecture,
        projections=select_projections(architecture, None, "bench"),
        norms=False,
        biases=True,
        objective=FeatCal(Hyperparameters(lam=options.lam, alpha=options.alpha, rho=options.rho, eps=1e-8)),
    )
    runner = LayerRunner(architecture, config, device, dtype, stats_dtype)
    shape = costs.layer_shape(architecture, config, plan)

    low = len(SPECIAL_TOKENS)
    batches, task_sequences = {}, {}
    for index, task in enumerate(checkpoints.experts):
        generator = torch.Generator().manual_seed(options.seed + 1 + index)
        sequences = [
            torch.randint(low, options.vocab, (options.seq_len,), generator=generator).tolist() for _ in range(options.sequences)
        ]
        batches[task] = make_batches(sequences, options.batch_tokens, pad_id=0)
        task_sequences[task] = [len(s) for s in sequences]

    cold = not options.warm_cache
    dropped = [machine.drop_from_page_cache(p) for p in checkpoints.shard_files()] if cold else []
    sync = machine.synchronizer(device)
    timer = LayerTimer(sync)
    counter = ReadCounter()

    def reader(directory: Path, what: str) -> BenchReader:
        return BenchReader(directory, what, counter, stored_layers, cold)

    models = Models(
        merged=reader(checkpoints.merged, "merged model"),
        base=reader(checkpoints.base, "base model"),
        experts={task: reader(path, f"expert {task}") for task, path in checkpoints.experts.items()},
    )
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    store = None
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        rss_reset = machine.reset_peak_rss()
        log(f"bench: calibrating {options.layers} layers, {len(batches)} experts × {options.sequences} × {options.seq_len} tokens on {device} ({dtype})")
        timer.start = time.perf_counter()
        replacements, store = _call_calibrate(calibrate, models, plan, runner, batches, options.layers, run_dir, options, options.progress, timer)
        sync()
        end = time.perf_counter()
        rss_hwm, rss_lifetime = machine.peak_rss_bytes()
        gpu = (
            {"allocated": torch.cuda.max_memory_allocated(device), "reserved": torch.cuda.max_memory_reserved(device)}
            if device.type == "cuda"
            else None
        )
        layers = timer.layers(end)
        rates_after = measure_rates()  # again after the run; the peak is the better of the two
        rates = {name: max(rate, rates_after[name]) for name, rate in rates_before.items()}
        for record in layers:
            record["bytes_read"] = counter.bytes.get(record["layer"], 0)
            record["read_seconds_background"] = counter.seconds.get(record["layer"], 0.0)
            record["bytes_written"] = sum(p.stat().st_size for p in run_dir.rglob(f"layer-{record['layer']:05d}.safetensors"))
        finalize = None
        if options.finalize:
            log("bench: writing the calibrated checkpoint (write_calibrated_checkpoint)")
            output = run_dir / "checkpoint"
            output.mkdir()
            merged_reader = CheckpointReader(checkpoints.merged, "merged model")
            if cold:
                for shard in checkpoints.merged.glob("*.safetensors"):
                    machine.drop_from_page_cache(shard)
            started = time.perf_counter()
            write_calibrated_checkpoint(merged_reader, replacements, output)
            copy_side_files(checkpoints.merged, output)
            finalize = {
                "seconds": time.perf_counter() - started,
                "bytes_read": sum(p.stat().st_size for p in checkpoints.merged.glob("*.safetensors")),
                "bytes_written": sum(p.stat().st_size for p in output.glob("*.safetensors")),
                "stored_layers": stored_layers,
            }
            merged_reader.close()
    finally:
        for model in (models.merged, models.base, *models.experts.values()):
            model.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        if options.clean:
            shutil.rmtree(checkpoints.root, ignore_errors=True)

    generation = None
    if options.generation:
        from featcal_llm.benchmark.generation_cost import measure_generation

        log(f"bench: timing generation ({options.sequences} × {options.seq_len} new tokens per expert, transformers generate)")
        generation = measure_generation(config, options.layers, options.sequences, options.seq_len, len(checkpoints.experts), device, dtype)

    itemsize = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
    padded_tokens = sum(b.input_ids.numel() for task_batches in batches.values() for b in task_batches)
    largest_batch = max(b.input_ids.numel() for task_batches in batches.values() for b in task_batches)
    layer_params = spec.layer_bytes() // itemsize(getattr(torch, spec.dtype))
    estimates = {
        "layer_weights": layer_params * itemsize(dtype),
        "task_statistics": costs.statistics_bytes(shape, itemsize(TOTAL_DTYPE)),  # float64 totals whatever the products
        "group_systems": costs.statistics_bytes(shape, itemsize(SOLVE_DTYPE), moments=False),
        # hidden in/out, q/k/v/attention output, gate/up/act: an approximate working set of one batch
        "batch_activations": largest_batch * (6 * options.hidden + 3 * options.intermediate) * itemsize(dtype),
        "host_streams": 2 * padded_tokens * options.hidden * itemsize(dtype),
    }
    return {
        "options": {k: v for k, v in asdict(options).items() if k != "notes"},
        "notes": options.notes,
        "shapes": {
            "hidden": options.hidden, "intermediate": options.intermediate, "heads": options.heads,
            "kv_heads": options.kv_heads, "vocab": options.vocab, "layer_params": layer_params,
            "linear_params": shape.linear_params,
            "groups": [{"name": g.name, "input_dim": g.input_dim, "outputs": g.outputs} for g in shape.groups],
        },
        "run": {
            "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "stats_dtype": str(stats_dtype).removeprefix("torch."),
            "stats_matmul_dtype": str(stats_matmul).removeprefix("torch."), "solve_dtype": str(SOLVE_DTYPE).removeprefix("torch."),
            "threads": torch.get_num_threads(), "layers": options.layers, "stored_layers": stored_layers,
            "experts": len(batches), "tokens_per_expert": {t: sum(s) for t, s in task_sequences.items()},
            "padded_tokens": padded_tokens, "build_seconds": build_seconds, "workdir": str(workdir),
            "checkpoint_bytes_per_model": spec.model_bytes(), "cold_reads": cold,
            "cache_dropped": bool(dropped) and all(dropped),
        },
        "machine": {
            "matmul_flops": rates, "matmul_size": peak_size,
            "matmul_flops_before": rates_before, "matmul_flops_after": rates_after,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "disk": disk,
        },
        "flops_per_layer": costs.layer_flops(shape, task_sequences, symmetric=triangle),
        "gram_triangle": triangle,
        "setup_seconds": timer.marks[0][0] - timer.start if timer.marks else 0.0,
        "calibrate_seconds": end - timer.start,
        "layers": layers,
        "finalize": finalize,
        "generation": generation,
        "memory": {
            "peak_rss": rss_hwm if rss_reset else None,
            "peak_rss_lifetime": rss_lifetime,
            "peak_rss_scope": "calibrate() only (VmHWM reset before it)" if rss_reset else "whole process (getrusage)",
            "peak_gpu": gpu,
            "host_store": None if store is None else {
                "budget": store.budget, "peak_in_ram": getattr(store, "peak_in_ram", None), "spilled": getattr(store, "spilled", None),
            },
            "estimates": estimates,
        },
    }
