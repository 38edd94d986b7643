"""Command line: thin wrappers that parse options, call the library and print.

Sub-package commands (demo, eval, leaderboard, bench) are imported only when
they are invoked (or listed by --help), so `run` starts without them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from featcal_llm.errors import FeatCalError

# command name → "module:attribute" of its click command
LAZY_COMMANDS = {
    "bench": "featcal_llm.benchmark.cli:bench",
    "demo": "featcal_llm.demo.cli:demo",
    "eval": "featcal_llm.evaluation.cli:eval_command",
    "leaderboard": "featcal_llm.evaluation.cli:leaderboard",
}


class _Group(click.Group):
    """Lazy sub-commands; FeatCalError becomes a one-line message and exit code 2, as click does for usage errors."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands or name not in LAZY_COMMANDS:
            return super().get_command(ctx, name)
        module, attribute = LAZY_COMMANDS[name].split(":")
        command = getattr(importlib.import_module(module), attribute)
        self.add_command(command, name)
        return command

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except FeatCalError as error:
            for line in str(error).splitlines():  # several problems: one error line each
                click.echo(f"featcal-llm: error: {line}", err=True)
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
    import os

    from featcal_llm.errors import QuietExit
    from featcal_llm.io.recipe import check_device
    from featcal_llm.startup import freezing_imports, heavy_import

    if device is not None:
        check_device(device, "--device")
    try:
        with freezing_imports():
            output = heavy_import("featcal_llm.pipeline").run_recipe(recipe, force=force, device=device)
    except QuietExit:  # a torchrun rank whose error rank 0 reports
        sys.exit(2)
    if os.environ.get("RANK", "0") == "0":
        click.echo(f"calibrated checkpoint written to {output}")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--online", is_flag=True, help="Also look up hub model and dataset ids (needs the network).")
def validate(recipe: Path, online: bool) -> None:
    """Check RECIPE without loading any weights: every problem, one line each (exit 2), and a memory estimate."""
    from featcal_llm.io.validate import check_recipe

    report = check_recipe(recipe, online=online)
    for note in report.summary_notes():
        click.echo(f"featcal-llm: note: {note}", err=True)
    for problem in report.problems:
        click.echo(f"featcal-llm: error: {problem}", err=True)
    if report.problems:
        count = len(report.problems)
        click.echo(f"{recipe}: {count} problem{'s' if count > 1 else ''}", err=True)
        sys.exit(2)
    for line in report.plan.lines() if report.plan is not None else []:
        click.echo(line)
    click.echo(f"{recipe}: ok")
