"""`featcal-llm bench`: time the layer loop per phase on synthetic Llama-3.1-8B-shaped checkpoints,
or (`--whole-run`) a whole `featcal-llm run`, start-up included, against the straightforward baseline in `featcal_llm.benchmark.baseline`.

Thin command; the work is in `featcal_llm.benchmark`. Heavy imports stay inside the command.
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from featcal_llm.errors import FeatCalError
from featcal_llm.io.output_dir import unwritable

POSITIVE = click.IntRange(min=1)  # a count of 0 would build checkpoints for seconds before failing
# what only the layer loop reads, and what only a whole run reads: given to the other, an option would be ignored
LAYER_LOOP_ONLY = ("distinct_layers", "tokens", "batch_tokens", "device", "rebuild", "clean", "warm_cache", "no_finalize",
                   "peak_size", "probe_mb", "shard_mb", "extrapolate_to", "threads", "generation", "host_memory_gb", "progress", "gram_triangle")
WHOLE_RUN_ONLY = ("baseline", "method", "tied_embeddings")


def _refuse_ignored(context: click.Context, whole_run: bool) -> None:
    """A usage error naming the options given on the command line that this mode would ignore."""
    ignored = [name for name in (LAYER_LOOP_ONLY if whole_run else WHOLE_RUN_ONLY)
               if context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        mode = "a whole run (--whole-run)" if whole_run else "the layer loop (without --whole-run)"
        raise click.UsageError(f"{flags}: not read by {mode}")


def _check_shapes(options: dict) -> None:
    """What the synthetic model could not be (a traceback after the checkpoints were built), or a recipe would refuse."""
    from featcal_llm.io.block import check_device

    if options["hidden"] % options["heads"]:
        raise FeatCalError(f"--hidden {options['hidden']}: expected a multiple of --heads {options['heads']}")
    if options["heads"] % options["kv_heads"]:
        raise FeatCalError(f"--kv-heads {options['kv_heads']}: expected a divisor of --heads {options['heads']}")
    if not options["lam"] > 0:
        raise FeatCalError(f"--lam {options['lam']:g}: expected a ridge above 0, as featcal.lambda")
    budget = options.get("host_memory_gb")
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise FeatCalError(f"--host-memory-gb {budget:g}: expected a positive number of GB (the streams' RAM before they spill)")
    if options.get("workdir") and (problem := unwritable(Path(options["workdir"]))) is not None:
        raise FeatCalError(f"--workdir {problem}")
    check_device(options["device"], "--device")


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]}, epilog="""\b
Examples:
  featcal-llm bench --layers 2 --device cuda            the layer loop at 8B shapes
  featcal-llm bench --preset smollm2-135m --whole-run   a whole run against the baseline
  featcal-llm bench --json > bench.json""")
@click.option("--layers", type=POSITIVE, default=2, show_default=True, help="Decoder layers to calibrate.")
@click.option("--distinct-layers", type=POSITIVE, default=None, help="Layers stored on disk (layer l reads stored layer l mod this); default: all, or what fits on disk.")
@click.option("--experts", type=POSITIVE, default=3, show_default=True, help="Number of experts (tasks).")
@click.option("--sequences", type=POSITIVE, default=2, show_default=True, help="Calibration sequences per expert.")
@click.option("--seq-len", type=POSITIVE, default=256, show_default=True, help="Tokens per sequence.")
@click.option("--tokens", type=POSITIVE, default=None, help="Tokens per expert (overrides --sequences; whole sequences of --seq-len).")
@click.option("--batch-tokens", type=POSITIVE, default=16384, show_default=True, help="Padded tokens per forward batch (featcal.batch_tokens).")
@click.option("--hidden", type=POSITIVE, default=4096, show_default=True, help="Hidden size (Llama-3.1-8B: 4096).")
@click.option("--intermediate", type=POSITIVE, default=14336, show_default=True, help="MLP intermediate size (Llama-3.1-8B: 14336).")
@click.option("--heads", type=POSITIVE, default=32, show_default=True, help="Attention heads.")
@click.option("--kv-heads", type=POSITIVE, default=8, show_default=True, help="Key/value heads.")
@click.option("--vocab", type=POSITIVE, default=128, show_default=True, help="Vocabulary size (kept small).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16", "float64"]), help="Compute dtype (auto: bfloat16 on GPU and on CPUs with bf16 units for bf16 checkpoints, else float32).")
@click.option("--stats-dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "float64"]), help="Precision of the statistics products, summed in float64 (auto: float32 when λ ≥ 1e-2, else float64).")
@click.option("--lam", default=3.0, show_default=True, help="Ridge λ (paper's 8B setting).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where checkpoints are cached and probe files written [default: $TMPDIR/featcal-llm-bench].")
@click.option("--rebuild", is_flag=True, help="Rebuild the synthetic checkpoints even if cached.")
@click.option("--clean", is_flag=True, help="Delete the synthetic checkpoints after the run.")
@click.option("--warm-cache", is_flag=True, help="Do not drop checkpoint files from the page cache before reading them.")
@click.option("--no-finalize", is_flag=True, help="Skip timing write_calibrated_checkpoint (the final full-checkpoint write).")
@click.option("--peak-size", type=POSITIVE, default=None, help="Square matmul size for the peak rate [default: 2048 on CPU, 8192 on GPU].")
@click.option("--probe-mb", type=POSITIVE, default=None, help="Size of the disk probe file in MiB [default: two layers' weights, 64..2048].")
@click.option("--shard-mb", type=POSITIVE, default=500, show_default=True, help="Maximum shard size of the synthetic checkpoints (MB).")
@click.option("--extrapolate-to", type=POSITIVE, default=32, show_default=True, help="Layer count for the extrapolated total.")
@click.option("--threads", type=POSITIVE, default=None, help="torch.set_num_threads for the run.")
@click.option("--generation/--no-generation", default=True, show_default=True, help="Also time `generate:` (each expert writing as many tokens as are calibrated on) with transformers generate, against the calibration.")
@click.option("--host-memory-gb", type=float, default=None, help="RAM budget of the hidden-state streams before they spill to memory-mapped files [default: the engine's, half the RAM].")
@click.option("--gram-triangle/--gram-square", default=None, help="On a GPU, build each Gram from its lower block triangle as a CPU does (31 % fewer statistics FLOPs at 8B) or multiply the whole square [default: the engine's rule, the square].")
@click.option("--seed", default=0, show_default=True)
@click.option("--progress/--no-progress", default=False, show_default=True, help="Show the engine's per-layer progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON on stdout instead of the table.")
@click.option("--preset", type=click.Choice(["smollm2-135m"]), default=None, help="Real-depth shapes: smollm2-135m = 30 layers, hidden 576, intermediate 1536, heads 9/3, vocab 49152, tied embeddings (a whole run's), 3 experts × 64 × 128 tokens, λ 1e-5 (options given explicitly win).")
@click.option("--whole-run", is_flag=True, help="Time a whole `featcal-llm run` (subprocess, start-up included) on a random model of these shapes, against featcal_llm/benchmark/baseline.py.")
@click.option("--baseline/--no-baseline", default=True, show_default=True, help="With --whole-run: also run the baseline and compare.")
@click.option("--method", type=click.Choice(["featcal", "regmean", "regmean++"]), default="featcal", show_default=True, help="With --whole-run: the method the run uses (the baseline is FeatCal's only).")
@click.option("--tied-embeddings", is_flag=True, default=None, help="With --whole-run: tie input and output embeddings (as SmolLM2).")
def bench(**kwargs) -> None:
    """Benchmark the FeatCal layer loop on synthetic 8B-shaped checkpoints: per-phase time, FLOPs, bytes, roofline ratios."""
    import json
    from pathlib import Path
    import tempfile

    from featcal_llm.benchmark.wholerun import PRESETS

    as_json = kwargs.pop("as_json")
    preset, whole_run, baseline, tied = kwargs.pop("preset"), kwargs.pop("whole_run"), kwargs.pop("baseline"), kwargs.pop("tied_embeddings")
    method = kwargs.pop("method")
    context = click.get_current_context()
    _refuse_ignored(context, whole_run)
    for key, value in PRESETS.get(preset, {}).items():
        if key == "tied":
            tied = value if tied is None else tied
        elif context.get_parameter_source(key) == click.core.ParameterSource.DEFAULT:
            kwargs[key] = value
    _check_shapes(kwargs)
    if whole_run:
        from featcal_llm.benchmark.wholerun import WholeRunSpec, render_whole, run_whole

        spec = WholeRunSpec(
            hidden=kwargs["hidden"], intermediate=kwargs["intermediate"], heads=kwargs["heads"], kv_heads=kwargs["kv_heads"],
            vocab=kwargs["vocab"], layers=kwargs["layers"], experts=kwargs["experts"], sequences=kwargs["sequences"],
            seq_len=kwargs["seq_len"], tied=bool(tied), seed=kwargs["seed"],
        )
        workdir = Path(kwargs["workdir"]) if kwargs["workdir"] else Path(tempfile.gettempdir()) / "featcal-llm-bench"
        result = run_whole(
            spec, workdir, kwargs["lam"], baseline, log=lambda message: click.echo(message, err=True),
            dtype=kwargs["dtype"], stats_dtype=kwargs["stats_dtype"], method=method,
        )
        click.echo(json.dumps(result, indent=1, default=str) if as_json else render_whole(result))
        return

    from featcal_llm.benchmark.driver import BenchOptions, run_benchmark
    from featcal_llm.benchmark.report import render, summarize

    finalize = not kwargs.pop("no_finalize")
    options = BenchOptions(finalize=finalize, **kwargs)
    summary = summarize(run_benchmark(options, log=lambda message: click.echo(message, err=True)))
    if as_json:
        click.echo(json.dumps(summary, indent=1, default=str))
    else:
        click.echo(render(summary))
