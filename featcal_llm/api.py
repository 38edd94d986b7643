"""The Python API: what `featcal-llm run` and `featcal-llm eval` do, callable from a script or a notebook.

    import featcal_llm

    result = featcal_llm.calibrate("recipe.yaml")        # or a dict holding the recipe
    print(result.table())                                # drift and next-token KL, merged vs calibrated
    scores = featcal_llm.evaluate({"calibrated": result.output}, tasks=["gsm8k"])

Heavy libraries (torch, transformers, mergekit) load on the first call, not on `import featcal_llm`.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from featcal_llm import runlog
from featcal_llm.calibration_result import CalibrationResult, ExpertSummary, RefineSummary, refine_summary, summarize_report
from featcal_llm.errors import FeatCalError, QuietExit, collected_warnings
from featcal_llm.io.output_dir import TEMPORARY_RECIPE_PREFIX, argument_problem
from featcal_llm.io.problems import Problem, RecipeProblems

__all__ = ["CalibrationResult", "EvaluationResult", "ExpertSummary", "FeatCalError", "Problem", "RefineSummary", "ValidationResult", "calibrate",
           "evaluate", "validate"]


class _PeakMemory:
    """The run's peak resident memory: Linux's high-water mark, reset at the start where the kernel allows it."""

    def __init__(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
            self.reset = True
        except OSError:
            self.reset = False
        self.start_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def host(self) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                    return peak if self.reset or peak > self.start_peak else None
        except OSError:
            pass
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak if peak > self.start_peak else None  # an earlier, higher peak says nothing about this run


def _gpu_peak(reset: bool) -> int | None:
    """The run's peak CUDA memory, the largest over the visible GPUs: a run on `cuda:1` leaves the current device (0)
    untouched, whose peak alone read as nothing."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    devices = range(torch.cuda.device_count())
    if reset:
        for device in devices:
            torch.cuda.reset_peak_memory_stats(device)
        return None
    return max(int(torch.cuda.max_memory_allocated(device)) for device in devices)


def _recipe_file(recipe: str | os.PathLike | Mapping[str, Any], caller: str) -> tuple[Path, Path | None]:
    """A path to the recipe; a dict is written to a hidden file in the working directory (removed after the run),
    so that its relative paths mean what they would in a recipe file there."""
    if isinstance(recipe, Mapping):
        import yaml

        try:
            text = yaml.safe_dump(_plain(dict(recipe)), sort_keys=False)  # before the file exists: nothing left on failure
        except yaml.representer.RepresenterError as error:
            value = error.args[1] if len(error.args) > 1 else error
            raise FeatCalError(f"{DICT_RECIPE}: a value YAML cannot write ({type(value).__name__} {value!r}); give strings, "
                               "numbers, lists and mappings") from None
        try:  # in the working directory, so that relative paths in it mean what they would in a recipe file there
            handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=TEMPORARY_RECIPE_PREFIX, dir=Path.cwd(),
                                                 delete=False, encoding="utf-8")
        except OSError as error:
            raise FeatCalError(f"{DICT_RECIPE}: the working directory cannot take the recipe's temporary file "
                               f"({error.strerror}); run from a folder you can write to, or give a recipe file") from None
        with handle:
            handle.write(text)
        return Path(handle.name), Path(handle.name)
    if isinstance(recipe, (str, os.PathLike)):
        return Path(recipe), None
    raise FeatCalError(f"{caller}: recipe must be a path or a mapping, got {type(recipe).__name__}")


DICT_RECIPE = "<recipe>"  # how errors and notes name a recipe given as a dict (its temporary file is gone by then)


def _plain(value: Any) -> Any:
    """A dict recipe's values as YAML writes them: a path as its string, a numpy scalar as its Python number."""
    if isinstance(value, Mapping):
        return {_plain_key(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():  # numpy or torch scalar
        return value.item()
    return value


def _plain_key(key: Any) -> Any:
    """A dict recipe's key as YAML writes it: a path as its string; a key a recipe file could not hold, refused."""
    if isinstance(key, os.PathLike):
        return os.fspath(key)
    if key is None or isinstance(key, (str, int, float, bool)):
        return key
    raise FeatCalError(f"{DICT_RECIPE}: key {key!r}: a {type(key).__name__}, which no recipe file holds; keys are strings")


def _dict_named(text: str, path: Path) -> str:
    """`text` with the temporary file of a dict recipe named `<recipe>`."""
    return text.replace(str(path), DICT_RECIPE)


def _dict_named_problem(problem: Problem, path: Path) -> Problem:
    return Problem(DICT_RECIPE if problem.file == str(path) else problem.file, problem.key, _dict_named(problem.message, path))


def _name_dict_recipe(error: FeatCalError, path: Path) -> FeatCalError:
    """`error` with the temporary file of a dict recipe named `<recipe>` in its text and problems (changed in place)."""
    if isinstance(error, RecipeProblems):
        error.problems = [_dict_named_problem(problem, path) for problem in error.problems]
    error.args = tuple(_dict_named(arg, path) if isinstance(arg, str) else arg for arg in error.args)
    return error


def calibrate(recipe: str | os.PathLike | Mapping[str, Any], *, output: str | os.PathLike | None = None,
              device: str | None = None, force: bool = False, progress: bool = True,
              push_to_hub: str | None = None, public: bool = False, keep_layers: bool = False,
              eval_only: bool = False) -> CalibrationResult:
    """Merge (if the merged model does not exist yet) and calibrate the model a recipe describes.

    `recipe`: a recipe file, or the same content as a dict. `output` overrides
    `featcal.output`, `device` overrides `featcal.device`; `force` replaces an
    existing output; `progress=False` silences the progress bar and the stage
    lines. A run that stops is resumed by calling again with the same recipe.
    `push_to_hub`: upload the calibrated model to this Hub repository (created
    private unless `public`) after the run succeeded. `keep_layers` keeps the
    run's saved progress (the calibrated layers, refine's teachers), so that a
    rerun with other `refine:` settings starts from them. `eval_only` runs the recipe's
    `eval:` on the output a finished run wrote, without calibrating again (its
    evaluation had failed, say). Errors in the input raise
    `FeatCalError` with a one-line message.
    """
    from featcal_llm.startup import heavy_import

    if eval_only and force:
        raise FeatCalError("--force (force=True): --eval-only (eval_only=True) replaces nothing; drop one of them")
    if push_to_hub is not None:
        from featcal_llm.io.hub import check_push

        check_push(push_to_hub)  # the id and the login, before any work
    path, temporary = _recipe_file(recipe, "calibrate")
    start = time.perf_counter()
    memory = _PeakMemory()
    _gpu_peak(reset=True)
    quiet = contextlib.nullcontext() if runlog.in_session() else runlog.session(None, runlog.NORMAL if progress else runlog.QUIET)
    try:
        with collected_warnings() as warnings:
            from featcal_llm.io.validate import check_recipe

            refused = check_recipe(path, plan=False, output=output, device=device, keep_layers=keep_layers,
                                   eval_only=eval_only).problems  # validate's problems, before torch and mergekit load
            if refused:
                if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 reports them for every rank
                    raise QuietExit()
                raise RecipeProblems(refused)
            with quiet:
                outcome = heavy_import("featcal_llm.pipeline").run_recipe_outcome(path, force=force, device=device,
                                                                                  progress=progress, output=output,
                                                                                  keep_layers=keep_layers, eval_only=eval_only)
                if push_to_hub is not None and os.environ.get("RANK", "0") == "0":
                    from featcal_llm.io.hub import push_folder

                    push_folder(outcome.output, push_to_hub, private=not public)
    except FeatCalError as error:
        if temporary is None:
            raise
        raise _name_dict_recipe(error, path)
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
    report_file = outcome.output / "featcal_drift.json"
    report = json.loads(report_file.read_text(encoding="utf-8")) if report_file.is_file() else {}
    return CalibrationResult(
        output=outcome.output, merged=outcome.merged, experts=summarize_report(report), seconds=time.perf_counter() - start,
        peak_host_memory=memory.host(), peak_gpu_memory=_gpu_peak(reset=False), evaluation=outcome.evaluation,
        warnings=tuple(_dict_named(warning, path) if temporary is not None else warning for warning in warnings),
        unchanged=outcome.unchanged, head_changed=outcome.head_changed, probe=report.get("probe"), refined=refine_summary(outcome.refined), start=outcome.start,
    )


@dataclass(frozen=True)
class EvaluationResult:
    """Each model's summary (as written to OUTPUT/LABEL.json) and the leaderboard table over them."""

    summaries: dict[str, dict]
    table: str
    output: Path

    def __str__(self) -> str:
        return f"{self.table.rstrip()}\n(summaries in {self.output})"


def evaluate(models: str | os.PathLike | Iterable[str | os.PathLike] | Mapping[str, str | os.PathLike], *,
             suite: str = "mergebench", tasks: list[str] | None = None, backend: str | Mapping[str, Any] = "auto",
             output: str | os.PathLike = "eval-results", quiet: bool = False, **settings: Any) -> EvaluationResult:
    """Score models on an evaluation suite, one subprocess per model, reusing cached results.

    `models`: a model directory, a list of them (labelled by directory name), or
    {label: directory}. `backend`: auto, vllm or hf, or a mapping of backend
    settings (name, dtype, batch_size, device, ...). Other keyword arguments are
    the settings of a recipe's `eval:` block (limit, max_gen_toks, data,
    allow_code_execution, chat_template, ...); relative paths are read from the
    working directory.
    """
    from featcal_llm.evaluation.config import section_from_options
    from featcal_llm.evaluation.leaderboard import build_leaderboard
    from featcal_llm.evaluation.modelinfo import check_model_dirs
    from featcal_llm.evaluation.runner import evaluate_model, safe_label

    wanted = "a model directory (a string or os.PathLike), a list of them, or {label: directory}"
    if isinstance(models, Mapping):
        entries = list(models.items())
    elif isinstance(models, (str, os.PathLike)) and not isinstance(os.fspath(models), bytes):
        entries = [(None, models)]
    elif isinstance(models, Iterable) and not isinstance(models, (str, bytes)):
        entries = [(None, path) for path in models]
    else:
        raise FeatCalError(f"evaluate: models: expected {wanted}, got {type(models).__name__} {models!r}")
    for _, path in entries:
        if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
            raise FeatCalError(f"evaluate: models: expected {wanted}; an entry is {type(path).__name__} {path!r}")
    labelled = [(str(label) if label is not None else Path(path).resolve().name, Path(path)) for label, path in entries]
    if not labelled:
        raise FeatCalError("evaluate: give at least one model directory")
    if len({safe_label(label) for label, _ in labelled}) < len(labelled):  # as the summary files name them
        raise FeatCalError("evaluate: two models have the same label (as a file name: 'a b' is 'a_b'); pass {label: directory}")
    check_model_dirs([path for _, path in labelled], "evaluate")  # every one, before the suite's checks and any scoring
    if not isinstance(backend, (str, Mapping)):
        raise FeatCalError(f"evaluate: backend: expected 'auto', 'vllm', 'hf' or a mapping of backend settings, got "
                           f"{type(backend).__name__} {backend!r}")
    if (problem := argument_problem(output)) is not None:  # worded for a calibration's output: here, the results'
        said = problem.replace("the output directory", "the results directory")
        raise FeatCalError(f"evaluate: output: {said.replace('the directory the calibrated model is written to', 'the results directory')}")
    options = {"suite": suite, "tasks": tasks, "backend": {"name": backend} if isinstance(backend, str) else dict(backend),
               "output": os.fspath(output), **settings}
    section = section_from_options(options, "evaluate()")
    echo = (lambda line: None) if quiet else (lambda line: print(line, file=__import__("sys").stderr))
    summaries = {}
    for label, path in labelled:
        summary = evaluate_model(path, label, section, echo=echo)
        summaries[summary["label"]] = summary
    files = [Path(section.output) / f"{label}.json" for label in summaries]
    table, _ = build_leaderboard(files, Path(section.output), stem="last-eval")
    return EvaluationResult(summaries, table, Path(section.output))


class ValidationResult(list):
    """The problems of a recipe (a list of `Problem`, empty when it is clean), with what else validation found.

    `notes`: what was not checked or needs attention (hub ids left for --online, an existing output);
    `warnings`: what was printed as a warning (a top-level key mergekit would ignore, say).
    """

    def __init__(self, problems: Iterable[Problem], notes: Iterable[str] = (), warnings: Iterable[str] = ()):
        super().__init__(problems)
        self.notes, self.warnings = list(notes), list(warnings)

    @property
    def ok(self) -> bool:
        return not self

    def __str__(self) -> str:
        lines = [f"error: {problem}" for problem in self] + [f"warning: {text}" for text in self.warnings]
        lines += [f"note: {text}" for text in self.notes]
        count = len(self)
        return "\n".join([*lines, "ok" if self.ok else f"{count} problem{'s' * (count > 1)}"])


def validate(recipe: str | os.PathLike | Mapping[str, Any], *, online: bool = False, output: str | os.PathLike | None = None,
             device: str | None = None, keep_layers: bool = False, eval_only: bool = False) -> ValidationResult:
    """Every problem of a recipe, found without loading any weights (as `featcal-llm validate`).

    `recipe`: a recipe file, or the same content as a dict (as `calibrate` takes it; its problems then
    name the file `<recipe>`). Checks the schema, recipe forms, calibration files and their fields, model
    references and adapters, and the output location (`output`, `device`, `keep_layers`, `eval_only`: as `calibrate`
    takes them, in place of featcal.output and featcal.device; a problem with either, or with a dict no recipe file could
    hold, is returned as `calibrate` refuses it). Hub model and dataset ids
    are looked up only with `online=True`; local paths never touch the network.
    """
    from featcal_llm.io.validate import check_recipe

    try:
        path, temporary = _recipe_file(recipe, "validate")
    except FeatCalError as refused:  # a dict no recipe file could hold: its one problem (another type: a caller's error)
        if not isinstance(recipe, Mapping):
            raise
        return ValidationResult([Problem.from_error(DICT_RECIPE, refused)])
    try:
        with collected_warnings() as warnings:
            report = check_recipe(path, online=online, plan=False, output=output, device=device, keep_layers=keep_layers,
                                  eval_only=eval_only)
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
    if temporary is None:
        return ValidationResult(report.problems, report.summary_notes(), warnings)
    return ValidationResult([_dict_named_problem(problem, path) for problem in report.problems],
                            [_dict_named(note, path) for note in report.summary_notes()], [_dict_named(warning, path) for warning in warnings])
