"""`python -m featcal_llm eval MODEL_DIR...` and `python -m featcal_llm leaderboard`.

Thin: parse options into an `EvalSection` (the same model a recipe's `eval:` block uses, so
both paths validate identically), call the runner, print. Heavy imports stay in the bodies.
"""

from __future__ import annotations

import re

from pathlib import Path

import click

from featcal_llm.errors import FeatCalError
from featcal_llm.io.output_dir import unwritable


def _parse_pairs(values: tuple[str, ...], option: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, sep, path = value.partition("=")
        if not sep or not key or not path:
            raise FeatCalError(f"{option} {value}: expected TASK={'LABEL' if option == '--expert' else 'PATH'}")
        pairs[key] = path
    return pairs


def _models(arguments: tuple[str, ...]) -> list[tuple[str, Path]]:
    """MODEL_DIR or LABEL=MODEL_DIR; the label defaults to the directory name."""
    from featcal_llm.evaluation.runner import safe_label

    models, labels = [], set()
    for argument in arguments:
        label, sep, path = argument.partition("=")
        if not sep or _is_dir(argument):  # a model folder whose name holds `=` (alpha=0.3) is a folder
            label, path = Path(argument).resolve().name, argument
        if safe_label(label) in labels:  # as its summary file names it: `a b` and `a_b` would share one
            raise FeatCalError(f"{argument}: label '{label}' is used twice (as a file name, {safe_label(label)!r}); name "
                               "models with LABEL=MODEL_DIR")
        labels.add(safe_label(label))
        models.append((label, Path(path)))
    return models


def _is_dir(argument: str) -> bool:
    try:
        return Path(argument).is_dir()
    except (OSError, ValueError):  # a name past the file system's limit, a NUL byte: check_model_dirs says which
        return False


def _engine_args(values: tuple[str, ...]) -> dict:
    """KEY=VALUE with YAML scalars (true, 8, 0.5, text)."""
    import yaml

    parsed = {}
    for value in values:
        key, sep, raw = value.partition("=")
        if not sep or not key.isidentifier():
            raise FeatCalError(f"--engine-arg {value}: expected KEY=VALUE")
        try:
            parsed[key] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as error:
            raise FeatCalError(f"--engine-arg {value}: expected KEY=VALUE with VALUE a YAML value ({str(error).splitlines()[0]})") from None
    return parsed


# the backend's settings as the recipe's eval: block names them, and the option that sets each on the command line
_BACKEND_OPTIONS = {"device": "--device", "gpu_memory_utilization": "--gpu-memory-utilization",
                    "tensor_parallel_size": "--tensor-parallel-size", "data_parallel_size": "--data-parallel-size",
                    "max_model_len": "--max-model-len"}


def _in_option_words(error: FeatCalError) -> FeatCalError:
    """A backend refusal (`backend.tensor_parallel_size: ...`, `backend.engine_args.KEY: ...`, worded for a recipe's
    eval: block) in the words of the option given: `--tensor-parallel-size: ...`, `--engine-arg KEY: ...`."""
    text = str(error)
    if text.startswith("backend.engine_args."):
        key, _, rest = text.removeprefix("backend.engine_args.").partition(": ")
        text = f"--engine-arg {key}: {rest.replace('not through engine_args', 'not through --engine-arg')}"
    else:
        key, _, rest = text.removeprefix("backend.").partition(": ")
        if not text.startswith("backend.") or key not in _BACKEND_OPTIONS:
            return error
        text = f"{_BACKEND_OPTIONS[key]}: {rest}"
    return type(error)(text)


def _batch_size(value: str | None):
    if value is None or value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise FeatCalError(f"--batch-size {value}: expected a positive integer or auto")
    return int(value)


@click.command("eval", context_settings={"help_option_names": ["-h", "--help"]}, epilog="""\b
Examples:
  featcal-llm eval out/calibrated --tasks gsm8k,arc_challenge
  featcal-llm eval merged=out/merged calibrated=out/calibrated --backend vllm
  featcal-llm eval out/calibrated --allow-code-execution   with HumanEval+/MBPP+""")
@click.argument("models", nargs=-1)
@click.option("--suite", default="mergebench", show_default=True, help="Suite name (shipped: mergebench, mergebench-protocol; $FEATCAL_EVAL_DIR names a folder of your own) or a suite YAML.")
@click.option("--tasks", default=None, help="Comma-separated task ids of the suite (default: all).")
@click.option("--backend", type=click.Choice(["auto", "vllm", "hf"]), default="auto", show_default=True,
              help="auto = vllm when CUDA is present, else lm-eval's hf.")
@click.option("--dtype", default="auto", show_default=True, help="auto (the checkpoint config's dtype, on either backend), bfloat16, float16 or float32.")
@click.option("--batch-size", default=None, help="Integer or auto (default: vllm auto; hf auto on CUDA, 1 on CPU).")
@click.option("--tensor-parallel-size", type=int, default=1, show_default=True, help="vLLM GPUs per model.")
@click.option("--data-parallel-size", type=int, default=1, show_default=True,
              help="vLLM model replicas (needs ray; GPUs used = tensor x data parallel size).")
@click.option("--engine-arg", "engine_args", multiple=True,
              help="KEY=VALUE passed through to vllm.LLM / the hf model (repeatable), e.g. enforce_eager=true; a key the backend does not take is refused before any model loads.")
@click.option("--gpu-memory-utilization", type=float, default=None, help="vLLM memory fraction (default 0.9; vllm only).")
@click.option("--max-model-len", type=int, default=None, help="Context length (default: the suite's, capped by the model).")
@click.option("--device", default=None, help="hf backend device (cuda, cuda:N, cpu).")
@click.option("--chat-template", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="auto = on for -Instruct/-chat/-it models; recorded either way.")
@click.option("--allow-code-execution", is_flag=True,
              help="Run model-written code for HumanEval+/MBPP+ (one subprocess per sample, with a time limit).")
@click.option("--limit", type=int, default=None, help="First N items per task (smoke runs; recorded).")
@click.option("--max-gen-toks", type=int, default=None, help="Override every task's max_gen_toks (smoke runs; recorded).")
@click.option("--output", default="eval-results", show_default=True, help="Results directory.")
@click.option("--data", "data", multiple=True, help="TASK=PATH: a local file or dataset directory for a task.")
@click.option("--nltk-data", default=None, help="Directory holding NLTK's punkt_tab (needed by IFEval).")
@click.option("--code-workers", type=int, default=None, help="Programs graded in parallel (default: min(8, CPUs)).")
@click.option("--quiet", is_flag=True, help="Do not echo the worker's log (it is still written to OUTPUT/logs).")
@click.option("--check-graders", is_flag=True,
              help="Run no model: check that the HumanEval+/MBPP+ canonical solutions pass and known-wrong ones fail "
                   "(hub data, or --data humaneval_plus=FILE --data mbpp_plus=FILE). Runs model-free code from the datasets.")
def eval_command(models, suite, tasks, backend, dtype, batch_size, tensor_parallel_size, data_parallel_size,
                 engine_args, gpu_memory_utilization,
                 max_model_len, device, chat_template, allow_code_execution, limit, max_gen_toks, output, data,
                 nltk_data, code_workers, quiet, check_graders) -> None:
    """Score MODEL_DIR... (or LABEL=MODEL_DIR) on a suite, one subprocess per model, with a cache."""
    if check_graders:
        if models:
            raise FeatCalError(f"eval --check-graders runs no model, so {models[0]} would not be scored: check the graders "
                               "and score models in two commands")
        if code_workers is not None and code_workers < 1:
            raise FeatCalError(f"eval --code-workers {code_workers}: expected a positive number of programs graded at once")
        _check_graders(_parse_pairs(data, "--data"), code_workers)
        return
    if not models:
        raise FeatCalError("eval: give at least one MODEL_DIR (or --check-graders)")
    from featcal_llm.evaluation.modelinfo import check_model_dirs

    labelled = _models(models)
    check_model_dirs([path for _, path in labelled], "eval")  # before the suite's own checks (code execution, data)
    if nltk_data is not None and not Path(nltk_data).is_dir():
        raise FeatCalError(f"eval: --nltk-data {nltk_data}: directory not found")
    from featcal_llm.evaluation.config import section_from_options
    from featcal_llm.evaluation.leaderboard import build_leaderboard
    from featcal_llm.evaluation.runner import evaluate_model

    section = section_from_options(
        {
            "suite": suite,
            "tasks": [t.strip() for t in tasks.split(",") if t.strip()] if tasks else None,
            "backend": {"name": backend, "dtype": dtype, "batch_size": _batch_size(batch_size),
                        "tensor_parallel_size": tensor_parallel_size, "data_parallel_size": data_parallel_size,
                        "engine_args": _engine_args(engine_args),
                        "max_model_len": max_model_len, "device": device,
                        **({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization is not None else {})},
            "chat_template": chat_template,
            "allow_code_execution": allow_code_execution,
            "limit": limit,
            "max_gen_toks": max_gen_toks,
            "output": output,
            "data": _parse_pairs(data, "--data"),
            "nltk_data": nltk_data,
            "code_workers": code_workers,
        },
    )
    echo = (lambda line: None) if quiet else (lambda line: click.echo(line, err=True))
    summaries = []
    for label, path in labelled:
        try:
            summaries.append(evaluate_model(path, label, section, echo=echo))
        except FeatCalError as error:
            raise _in_option_words(error) from None
        click.echo(f"{label}: summary written to {Path(section.output) / (summaries[-1]['label'] + '.json')}")
    files = [Path(section.output) / f"{s['label']}.json" for s in summaries]
    markdown, _ = build_leaderboard(files, Path(section.output), stem="last-eval")
    click.echo(markdown, nl=False)


def _check_graders(data: dict[str, str], workers: int | None) -> None:
    import os

    from featcal_llm.evaluation.canary import check_graders

    reports = check_graders(data, workers or max(1, min(8, os.cpu_count() or 1)))
    for report in reports:
        click.echo(report.line())
    if not all(report.ok for report in reports):
        raise SystemExit(1)


@click.command("leaderboard", context_settings={"help_option_names": ["-h", "--help"]}, epilog="""\b
Examples:
  featcal-llm leaderboard eval-results
  featcal-llm leaderboard eval-results --reference Llama-3.2-3B-Instruct --compare merged:calibrated""")
@click.argument("results", nargs=-1)
@click.option("--output", default=None, help="Where to write leaderboard.md/.csv/.png (default: the first RESULTS dir).")
@click.option("--reference", "references", multiple=True,
              help="Add the paper's rows: Llama-3.2-3B-Instruct, Llama-3.1-8B-Instruct or all.")
@click.option("--suite", default=None, help="Suite (default: the one the results were scored with).")
@click.option("--name", "stem", default="leaderboard", show_default=True, help="Output file stem.")
@click.option("--compare", "comparisons", multiple=True,
              help="BASE:OTHER labels: a difference row with paired-bootstrap intervals and McNemar p (repeatable).")
@click.option("--expert", "experts", multiple=True,
              help="TASK=LABEL: the expert for a task, for MergeBench's normalized score (repeatable).")
def leaderboard(results, output, references, suite, stem, comparisons, experts) -> None:
    """Turn RESULTS (summary files or results directories; default: eval-results) into a table."""
    from featcal_llm.evaluation.leaderboard import build_leaderboard

    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", stem):  # a file name beside the results, not a path
        raise FeatCalError(f"--name {stem!r}: expected a file stem of letters, digits, '.', '_' or '-' (no path)")
    paths = [Path(p) for p in results] or [Path("eval-results")]
    target = Path(output) if output else (paths[0] if paths[0].is_dir() else paths[0].parent)
    if target.exists() and not target.is_dir():
        raise FeatCalError(f"--output {target}: a file, not a directory")
    if (problem := unwritable(target)) is not None:
        raise FeatCalError(f"--output {problem}")
    pairs = []
    for value in comparisons:
        base, sep, other = value.partition(":")
        if not sep or not base or not other:
            raise FeatCalError(f"--compare {value}: expected BASE:OTHER (two summary labels)")
        pairs.append((base, other))
    markdown, files = build_leaderboard(paths, target, references=list(references), suite_name=suite, stem=stem,
                                        comparisons=pairs, experts=_parse_pairs(experts, "--expert"))
    click.echo(markdown, nl=False)
    click.echo(f"written: {files['markdown']}, {files['csv']}, {files['png']}", err=True)
