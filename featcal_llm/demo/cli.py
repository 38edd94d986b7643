"""`featcal-llm demo`: the whole pipeline on a tiny locally built scenario, on a laptop CPU."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("demo")
@click.option("--workdir", default="demo-work", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where the scenario, models and results are built and cached.")
@click.option("--quick", is_flag=True, help="A seconds-long reduced scenario (used by the test suite).")
@click.option("--device", default="cpu", show_default=True, help="Device for training, calibration and scoring.")
@click.option("--threads", type=int, default=None, help="Torch threads per process (default 1); expert workers are min(cores, THREADS or 2).")
@click.option("--auto", "auto", is_flag=True, help="Let FeatCal choose lambda, alpha and rho on held-out cal records (recipes/demo-auto.yaml).")
@click.option("--baselines/--no-baselines", default=None, help="Also run and score RegMean and RegMean++ on a linear merge (default: on, off with --quick).")
def demo(workdir: Path, quick: bool, device: str, threads: int | None, auto: bool, baselines: bool | None) -> None:
    """Build base + 3 experts, merge with mergekit, calibrate with FeatCal and score every model."""
    from featcal_llm.demo.config import FULL, QUICK
    from featcal_llm.demo.run import run_demo

    config = (QUICK if quick else FULL).replace(auto=auto)
    if baselines is not None:
        config = config.replace(baselines=baselines)
    run_demo(workdir, quick=quick, device=device, threads=threads, config=config, echo=lambda line: click.echo(line))
