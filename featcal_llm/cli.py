"""Command line: thin wrappers that parse options, call the library and print."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from featcal_llm.errors import FeatCalError


class _Group(click.Group):
    """Turns FeatCalError into a one-line message and exit code 2, as click does for usage errors."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except FeatCalError as error:
            click.echo(f"featcal-llm: error: {error}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="featcal-llm")
def main() -> None:
    """FeatCal post-merge calibration for mergekit-merged LLMs."""


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--device", default=None, help="Override featcal.device (auto, cpu, cuda, cuda:N).")
def run(recipe: Path, force: bool, device: str | None) -> None:
    """Merge (if needed) and calibrate the model described by RECIPE."""
    from featcal_llm.pipeline import run_recipe

    output = run_recipe(recipe, force=force, device=device)
    click.echo(f"calibrated checkpoint written to {output}")


def _register_subcommands() -> None:
    """Commands owned by sub-packages; each keeps its heavy imports inside the command body."""
    from featcal_llm.bench import bench
    from featcal_llm.demo.cli import demo
    from featcal_llm.evaluation.cli import eval_command, leaderboard

    for command in (demo, eval_command, leaderboard, bench):
        main.add_command(command)


_register_subcommands()
