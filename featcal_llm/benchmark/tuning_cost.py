"""Cost of `auto` and of the drift diagnostics versus a plain fixed run, on the bench's synthetic checkpoints.

    python -m featcal_llm.benchmark.tuning_cost [--hidden 4096 --intermediate 14336 ...]

Runs the engine's layer loop (`calibrate`) on the same records in three modes,
interleaved and repeated: `fixed` (no held-out probe, no drift diagnostics),
`fixed+drift` (what `run` does with fixed values: diagnostics on a 1/16
subsample) and `auto` (all three hyper-parameters auto; 25 % of the records held
out for selection). Prints the median seconds and the factor to `fixed`.
The defaults are small shapes; at Llama-3.1-8B shapes (the `bench` defaults) it
needs about as much RAM as `bench`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch


def _modes(sequences, search_for):
    from featcal_llm.engine.drift import drift_sample
    from featcal_llm.engine.tuning import split_holdout

    calibration, held_out = split_holdout(sequences, 0.25, 0, "bench")
    return {
        "fixed": (sequences, None, None, ""),
        "fixed+drift": (sequences, drift_sample(sequences), None, "calibration subsample"),
        "auto": (calibration, held_out, search_for(), "held-out records"),
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--hidden", default=256, show_default=True)
@click.option("--intermediate", default=768, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--layers", default=2, show_default=True)
@click.option("--vocab", default=128, show_default=True, help="Vocabulary (Llama-3: 128256; matters for --criterion output).")
@click.option("--experts", default=3, show_default=True)
@click.option("--sequences", default=16, show_default=True, help="Calibration records per expert (25 % are held out by auto).")
@click.option("--seq-len", default=256, show_default=True)
@click.option("--batch-tokens", default=16384, show_default=True)
@click.option("--criterion", default="hidden", show_default=True, type=click.Choice(["hidden", "output"]))
@click.option("--repeats", default=3, show_default=True, help="Interleaved repetitions; medians are reported.")
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--threads", type=int, default=None)
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="[default: $TMPDIR/featcal-llm-bench]")
@click.option("--json", "as_json", is_flag=True)
def main(hidden, intermediate, heads, kv_heads, layers, vocab, experts, sequences, seq_len, batch_tokens, criterion, repeats,
         device, dtype, threads, workdir, as_json) -> None:
    """Seconds of the layer loop for fixed, fixed+drift and auto on the same synthetic records."""
    from transformers import AutoConfig

    from featcal_llm.family.architectures import architecture_for, select_projections
    from featcal_llm.benchmark.synthetic import SyntheticSpec, ensure_checkpoints
    from featcal_llm.engine.calibrate import calibrate
    from featcal_llm.engine.context import Models, RunContext
    from featcal_llm.io.checkpoint import CheckpointReader
    from featcal_llm.engine.drift import Probe
    from featcal_llm.family.layers import LayerRunner
    from featcal_llm.engine.devices import resolve_device, resolve_dtype, resolve_stats_dtype
    from featcal_llm.engine.plan import CalibrationPlan
    from featcal_llm.engine.objectives import FeatCal
    from featcal_llm.maths.objective import Hyperparameters
    from featcal_llm.engine.resume import StagingArea
    from featcal_llm.engine.streams import HostStore, make_batches
    from featcal_llm.tiny import SPECIAL_TOKENS
    from featcal_llm.engine.tuning import AUTO, Search

    if threads:
        torch.set_num_threads(threads)
    log = lambda message: click.echo(message, err=True)  # noqa: E731
    compute = resolve_device(device)
    root = Path(workdir) if workdir else Path(tempfile.gettempdir()) / "featcal-llm-bench"
    root.mkdir(parents=True, exist_ok=True)
    spec = SyntheticSpec(hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads, layers=layers, vocab=vocab, experts=experts)
    checkpoints = ensure_checkpoints(spec, root, log=log, device=compute)
    config = AutoConfig.from_pretrained(checkpoints.merged)
    architecture = architecture_for(config, "bench")
    compute_dtype = resolve_dtype(dtype, compute, torch.bfloat16)  # the synthetic checkpoints are stored in bf16
    runner = LayerRunner(architecture, config, compute, compute_dtype, resolve_stats_dtype("auto", min(AUTO["lambda"]), compute_dtype, compute))
    records = {}
    for index, task in enumerate(checkpoints.experts):
        generator = torch.Generator().manual_seed(1 + index)
        records[task] = [torch.randint(len(SPECIAL_TOKENS), spec.vocab, (seq_len,), generator=generator).tolist() for _ in range(sequences)]
    modes = _modes(records, lambda: Search(dict(AUTO), 1e-8, 0.25, 12, criterion))
    models = Models(
        merged=CheckpointReader(checkpoints.merged, "merged model"),
        base=CheckpointReader(checkpoints.base, "base model"),
        experts={task: CheckpointReader(path, f"expert {task}") for task, path in checkpoints.experts.items()},
    )
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode, (calibration, probe_records, search, source) in modes.items():
            plan = CalibrationPlan(architecture, select_projections(architecture, None, "bench"), False, True,
                                   FeatCal(Hyperparameters(3.0, 0.15, 0.5, 1e-8), search=search))
            batches = {task: make_batches(seqs, batch_tokens) for task, seqs in calibration.items()}
            probe = None if probe_records is None else Probe({t: make_batches(s, batch_tokens) for t, s in probe_records.items()}, source)
            with tempfile.TemporaryDirectory(dir=root) as run_dir:
                staging = StagingArea(Path(run_dir) / "partial", f"tuning-cost-{mode}")
                store = HostStore(None, None, pin=compute.type == "cuda")
                if compute.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                calibrate(RunContext(models, plan, runner, store, staging, batches, probe), layers, progress=False)
                if compute.type == "cuda":
                    torch.cuda.synchronize()
                seconds[mode].append(time.perf_counter() - start)
            log(f"repeat {repeat + 1}/{repeats} {mode}: {seconds[mode][-1]:.2f} s")
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    result = {"shapes": {"hidden": hidden, "intermediate": intermediate, "layers": layers, "vocab": vocab, "experts": experts,
                         "sequences": sequences, "seq_len": seq_len}, "device": str(compute), "criterion": criterion,
              "seconds": seconds, "median": median, "factor": {mode: median[mode] / median["fixed"] for mode in median}}
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        click.echo(f"{'mode':<12} {'median s':>9} {'factor':>7}   (all runs)")
        for mode in modes:
            click.echo(f"{mode:<12} {median[mode]:>9.2f} {result['factor'][mode]:>7.2f}   {', '.join(f'{s:.2f}' for s in seconds[mode])}")


if __name__ == "__main__":
    main()
