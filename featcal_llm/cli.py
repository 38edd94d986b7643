"""Command line: thin wrappers that parse options, call the library and print.

Sub-package commands (demo, eval, leaderboard, bench) are imported only when
they are invoked (or listed by --help), so `run` starts without them.
Exit codes (featcal_llm.errors): 0 done, 1 the run failed, 2 bad command line or
input, 130 interrupted, 143 stopped by SIGTERM.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import click

from featcal_llm.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE, FeatCalError, Terminated

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}  # sub-commands inherit it
EXIT_CODES = """\b
Exit codes: 0 done; 1 the run started and failed (non-finite values, an upload,
out of memory, a library error, a full disk); 2 bad command line or input
(recipe, data, models); 130 interrupted (Ctrl-C); 143 stopped by SIGTERM."""

# command name → "module:attribute" of its click command
LAZY_COMMANDS = {
    "bench": "featcal_llm.benchmark.cli:bench",
    "demo": "featcal_llm.demo.cli:demo",
    "eval": "featcal_llm.evaluation.cli:eval_command",
    "leaderboard": "featcal_llm.evaluation.cli:leaderboard",
}


class _Group(click.Group):
    """Lazy sub-commands; FeatCalError becomes a one-line message and its exit code (2 for input, 1 for a failed run)."""

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
            with stopping_on_sigterm():
                return super().invoke(ctx)
        except FeatCalError as error:
            for line in str(error).splitlines():  # several problems: one error line each
                click.echo(f"featcal-llm: error: {line}", err=True)
            sys.exit(error.exit_code)
        except KeyboardInterrupt as stop:
            click.echo(f"featcal-llm: {stopped(stop)}", err=True)
            sys.exit(stop_code(stop))


@contextlib.contextmanager
def stopping_on_sigterm():
    """SIGTERM raises Terminated (a KeyboardInterrupt) in the command's main thread, so a run a scheduler stops
    cleans up as after Ctrl-C; the handler before is restored after. Under torchrun too: its agent stops the ranks
    left with SIGTERM once one dies or it is stopped itself, and Python's default had ended them at once, without a
    line or their lock released. Not off the main thread (where Python takes no handler)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def stopped(stop: KeyboardInterrupt) -> str:
    return "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"


def stop_code(stop: KeyboardInterrupt) -> int:
    return EXIT_TERMINATED if isinstance(stop, Terminated) else EXIT_INTERRUPTED


@click.group(cls=_Group, context_settings=CONTEXT, epilog=f"""\b
Examples:
  featcal-llm validate recipe.yaml          check a recipe without loading a weight
  featcal-llm run recipe.yaml               merge (if needed) and calibrate
  featcal-llm run recipe.yaml out/my-model  the same, written to out/my-model
  featcal-llm recipes                       the shipped example recipes
  featcal-llm COMMAND -h                    one command's options

{EXIT_CODES}""")
@click.version_option(package_name="featcal-llm")
def main() -> None:
    """FeatCal post-merge calibration for mergekit-merged LLMs: a `featcal:` block after a mergekit recipe."""


@main.command(epilog=f"""\b
Examples:
  featcal-llm run recipe.yaml
  featcal-llm run recipe.yaml out/calibrated --force
  featcal-llm run recipe.yaml --device cuda:1 --log run.log
  torchrun --nproc-per-node 4 -m featcal_llm run recipe.yaml

{EXIT_CODES}""")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("output", required=False)  # as given: the checks judge it (a file, an empty name), in validate's words
@click.option("--force", is_flag=True, help="Replace an existing output (an earlier featcal-llm output, or an empty folder); "
                                             "also how a run stopped after its output was written resumes.")
@click.option("--device", default=None, help="Override featcal.device (auto, cpu, cuda, cuda:N).")
@click.option("--log", "--log-file", "log_file", type=click.Path(path_type=Path), default=None, metavar="FILE",  # a folder: check_log_file's one line
              help="Also write the run's messages, a line per layer and full errors to FILE (appended); under torchrun "
                   "write --log-file, as torchrun reads --log as its own --log-dir.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, stage lines or summary: warnings, errors and the result only.")
@click.option("--verbose", "-v", is_flag=True, help="Also a line per layer (time, tokens/s, ETA) and full tracebacks of failures.")
@click.option("--push-to-hub", "repo_id", default=None, metavar="REPO_ID",
              help="Upload the calibrated model to this Hugging Face Hub repository (created private); the login is checked "
                   "before the run, and nothing is pushed if the run fails.")
@click.option("--public", is_flag=True, help="With --push-to-hub: create the repository public.")
@click.option("--keep-layers", is_flag=True,
              help="Keep the calibrated layers (and refine:'s teachers) after the run, so that rerunning into the same OUTPUT "
                   "with other refine: settings refines again without calibrating the layers again.")
@click.option("--eval-only", is_flag=True,
              help="Run the recipe's eval: on the output a finished run wrote, without calibrating again (its evaluation "
                   "had failed, say), and add the table to its card.")
def run(recipe: Path, output: str | None, force: bool, device: str | None, log_file: Path | None, quiet: bool, verbose: bool,
        repo_id: str | None, public: bool, keep_layers: bool, eval_only: bool) -> None:
    """Merge (if needed) and calibrate the model described by RECIPE.

    OUTPUT, when given, replaces the recipe's featcal.output (as `mergekit-yaml CONFIG OUT` names its output).
    """
    import os
    import time

    from featcal_llm import __version__, runlog
    from featcal_llm.errors import QuietExit, out_of_memory
    from featcal_llm.io.block import check_device
    from featcal_llm.startup import freezing_imports, heavy_import

    if device is not None:
        check_device(device, "--device")
    if quiet and verbose:
        raise click.UsageError("--quiet and --verbose exclude each other")
    if public and repo_id is None:
        raise click.UsageError("--public applies to --push-to-hub REPO_ID")
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 speaks (and logs) for every rank
    level = runlog.QUIET if quiet or not main_rank else runlog.VERBOSE if verbose else runlog.NORMAL
    if log_file is not None and main_rank:
        from featcal_llm.io.validate_outputs import check_log_file

        try:  # before the log is opened: it appends from the first line
            check_log_file(recipe, output, log_file)
        except FeatCalError as error:
            runlog.failure(error)
            sys.exit(error.exit_code)
    with runlog.session(log_file if main_rank else None, level) as log:
        if log is not None:  # appended: where this run starts, on which day, and what it ran
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} featcal-llm {__version__}: {_command_line()}\n")
        try:
            with freezing_imports():
                result = heavy_import("featcal_llm.api").calibrate(recipe, output=output, device=device, force=force,
                                                                   progress=level > runlog.QUIET, push_to_hub=repo_id, public=public,
                                                                   keep_layers=keep_layers, eval_only=eval_only)
        except QuietExit:  # a torchrun rank whose error rank 0 reports
            sys.exit(EXIT_USAGE)
        except KeyboardInterrupt as stop:
            if isinstance(stop.__context__, QuietExit):  # stopped on its way out (by torchrun's agent, once a rank has exited)
                sys.exit(EXIT_USAGE)
            if isinstance(stop.__context__, FeatCalError):  # the error it was leaving with is why it stopped
                runlog.failure(stop.__context__)
                sys.exit(stop.__context__.exit_code)
            if main_rank:
                click.echo(_interrupted(recipe, Path(output) if output else None, stopped(stop)), err=True)
            sys.exit(stop_code(stop))
        except FeatCalError as error:
            runlog.failure(error)
            sys.exit(error.exit_code)
        except (MemoryError, RuntimeError) as error:
            failure = out_of_memory(error)
            if failure is None:
                raise
            runlog.failure(failure)
            sys.exit(failure.exit_code)
        if main_rank and eval_only:
            click.echo(f"{result.output}: evaluated; the table is in its card")
        elif main_rank:
            if result.experts:  # on the terminal unless quiet, always in the log
                runlog.table(result.table())
            click.echo(result.headline())


def _command_line() -> str:
    """The command as given (its arguments, then the options set), for the log's first line of a run."""
    context = click.get_current_context()
    words = [context.info_name]
    for param in context.command.params:
        value = context.params.get(param.name)
        if isinstance(param, click.Argument):
            words += [str(value)] if value is not None else []
        elif value not in (None, False):
            words += [max(param.opts, key=len)] + ([] if value is True else [str(value)])
    return " ".join(words)


def _interrupted(recipe: Path, output: Path | None, how: str = "interrupted") -> str:
    """What a stopped `run` leaves: progress the same command resumes, or (stopped in `eval:` or the push) the output."""
    if output is None:
        try:
            import yaml

            output = Path(yaml.safe_load(recipe.read_text(encoding="utf-8"))["featcal"]["output"])
        except Exception:  # noqa: BLE001 (a recipe that cannot say: the general line)
            output = None
    from featcal_llm.io.output_dir import RECIPE_FILE, partial_dir

    if output is not None and (output / RECIPE_FILE).is_file() and not partial_dir(output).exists():
        return (f"featcal-llm: {how}; {output} was written whole before the stop: rerun with --eval-only to run the "
                "recipe's eval: on it, or with --force to make it again")
    return (f"featcal-llm: {how}; what the run finished (a merge, generated records, calibrated layers, refinement "
            "steps) is kept, and the same command resumes from there")


@main.command(epilog="""\b
Examples:
  featcal-llm validate recipe.yaml
  featcal-llm validate recipe.yaml --online   also look up hub ids
  featcal-llm validate recipe.yaml OUT --device cpu   check what `run recipe.yaml OUT --device cpu` runs

\b
Exit codes: 0 the recipe is clean; 2 it has problems (each on its own line).""")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("output", required=False)
@click.option("--device", default=None, help="As run's --device: check the run on this device instead of featcal.device.")
@click.option("--online", is_flag=True, help="Also look up hub model and dataset ids (without a network: a note, not an error).")
@click.option("--keep-layers", is_flag=True, help="Check the recipe as run --keep-layers takes it (it needs refine:).")
@click.option("--eval-only", is_flag=True, help="Check the recipe as run --eval-only takes it (an eval: block, a finished output).")
def validate(recipe: Path, output: str | None, device: str | None, online: bool, keep_layers: bool, eval_only: bool) -> None:
    """Check RECIPE without loading any weights: every problem at once, one line each, and a memory estimate.

    The YAML, the featcal: block, the mergekit part (merge method and its parameters, as mergekit
    reads them), the models' configs and the data files, in one round and without torch; `run`
    refuses the same recipes with the same lines (docs/validate.md). OUTPUT and --device are
    checked as `run RECIPE OUTPUT --device ...` takes them, in place of featcal.output and featcal.device.
    """
    from featcal_llm.io.block import check_device
    from featcal_llm.io.validate import check_recipe

    if device is not None:
        check_device(device, "--device")
    report = check_recipe(recipe, online=online, output=output, device=device, keep_layers=keep_layers, eval_only=eval_only)
    for note in report.summary_notes():
        click.echo(f"featcal-llm: note: {note}", err=True)
    for problem in report.problems:
        click.echo(f"featcal-llm: error: {problem}", err=True)
    for line in report.plan.lines() if report.plan is not None else []:  # beside the eval block's problems too
        click.echo(line)
    if report.problems:
        count = len(report.problems)
        click.echo(f"{recipe}: {count} problem{'s' if count > 1 else ''}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(f"{recipe}: ok")


@main.command(epilog="""\b
Examples:
  featcal-llm recipes                                   list them
  featcal-llm recipes mergebench-llama-3.2-3b-ta-featcal > recipe.yaml
""")
@click.argument("name", required=False)
def recipes(name: str | None) -> None:
    """List the example recipes shipped with featcal-llm, or print recipe NAME (to copy and edit)."""
    from featcal_llm.recipes import recipe_text, shipped

    if name is None:
        for entry in shipped():
            click.echo(f"{entry.name:<40} {entry.title}")
        return
    click.echo(recipe_text(name), nl=False)
