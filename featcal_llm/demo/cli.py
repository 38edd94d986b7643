"""`featcal-llm demo`: the whole pipeline on a tiny locally built scenario, on a laptop CPU."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("demo", context_settings={"help_option_names": ["-h", "--help"]}, epilog="""\b
Examples:
  featcal-llm demo --quick     seconds: a reduced scenario
  featcal-llm demo             the full demo on a laptop CPU
  featcal-llm demo --auto      FeatCal chooses lambda, alpha and rho itself""")
@click.option("--workdir", default="demo-work", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where the scenario, models and results are built and cached.")
@click.option("--quick", is_flag=True, help="A seconds-long reduced scenario that checks every step runs (used by the test "
                                           "suite); its experts train for seconds, so its scores (often 0.0 for every model) "
                                           "say nothing of what FeatCal recovers: run without --quick for that.")
@click.option("--device", default="cpu", show_default=True, help="Device for training, calibration and scoring.")
@click.option("--threads", type=click.IntRange(1), default=None, help="Torch threads of the main process (default min(cores, 4); --quick: 1); the experts train in one-thread workers, one per expert (at most THREADS).")
@click.option("--auto", "auto", is_flag=True, help="Let FeatCal choose lambda, alpha and rho on held-out cal records (featcal-llm recipes demo-auto).")
@click.option("--baselines/--no-baselines", default=None, help="Also run and score RegMean and RegMean++ on a linear merge (default: on, off with --quick).")
@click.option("--seed", type=int, default=None, help="Seed of the data, the base and the experts (default 0).")
@click.option("--expert-target", type=click.FloatRange(0, 100), default=None,
              help="Dev exact match (%) each expert must reach, or the demo stops (default 95; --quick: none).")
@click.option("--expert-max-steps", type=click.IntRange(1), default=None,
              help="Fine-tuning steps an expert may take to reach its target (default 1200; --quick: 12).")
def demo(workdir: Path, quick: bool, device: str, threads: int | None, auto: bool, seed: int | None,
         expert_target: float | None, expert_max_steps: int | None, baselines: bool | None) -> None:
    """Build base + 3 experts trained to skill, merge with mergekit, calibrate with FeatCal and score every model."""
    from featcal_llm.demo.config import FULL, QUICK
    from featcal_llm.demo.run import run_demo
    from featcal_llm.errors import FeatCalError
    from featcal_llm.hardware import cuda_refusal
    from featcal_llm.io.block import check_device
    from featcal_llm.io.output_dir import unwritable

    if (problem := unwritable(workdir)) is not None:
        raise FeatCalError(f"--workdir {problem}")
    if check_device(device, "--device") == "auto":  # before the data and the experts are built
        raise FeatCalError("--device auto: the demo takes cpu, cuda or cuda:N")
    if device.startswith("cuda") and (refusal := cuda_refusal()) is not None:
        raise FeatCalError(f"--device {device} requested but {refusal}")

    config = (QUICK if quick else FULL).replace(auto=auto)
    given = {"seed": seed, "expert_target": expert_target, "finetune_max_steps": expert_max_steps}
    config = config.replace(**{name: value for name, value in given.items() if value is not None})
    if baselines is not None:
        config = config.replace(baselines=baselines)
    run_demo(workdir, quick=quick, device=device, threads=threads, config=config, echo=lambda line: click.echo(line))
