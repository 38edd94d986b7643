"""`featcal-llm validate`: everything about a recipe that can be checked without loading weights, all at once, without torch.

The YAML, the schema (the `featcal:` block, mergekit's part and its merge parameters) and the
recipe forms (`recipe.read_recipe`), then what the recipe points at: calibration files exist,
have a known format and the fields their entry names; model references and adapters resolve to
directories with a config.json, of an architecture featcal-llm calibrates, whose shapes agree
with the base model's; the output can be written; and an estimate of the memory the run needs.
Local paths are checked on disk only; a hub id is looked up only with `online` (a hub out of
reach is a note), so a missing local model is reported at once instead of after hub retries.
`run` performs the same checks, with the same lines, before it loads torch or resolves any model
(docs/validate.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal_llm.io.problems import Problem, RecipeProblems, collect

from featcal_llm.io.recipe import Recipe, _experts_of, read_recipe
from featcal_llm.io.recipe_yaml import recipe_text
from featcal_llm.io.validate_data import check_data, short_file_findings
from featcal_llm.io.validate_eval import check_eval
from featcal_llm.io.validate_models import check_models
from featcal_llm.io.validate_outputs import check_first_stage, check_output, check_writes
from featcal_llm.io.output_dir import argument_problem, RECIPE_FILE, scored_merge
from featcal_llm.io.run_record import read_run_record
from featcal_llm.io.run_settings import changed_settings, made_from, settings_digest, settings_root


@dataclass
class Report:
    """What `validate` found: the problems (each one line), notes on what was not checked, and the memory estimate."""

    recipe: Recipe | None
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plan: Any = None  # benchmark.estimate.MemoryPlan
    unchecked: list[str] = field(default_factory=list)  # hub ids not looked up (offline)
    offline: list[str] = field(default_factory=list)  # hub ids `--online` could not look up: no network
    scored_tokenizer: Path | None = None  # where the evaluated models' tokenizer comes from, where known before the run
    scored_config: dict | None = None  # the evaluated models' config.json (the merge's, else the base's), where read

    def summary_notes(self) -> list[str]:
        """The notes, with the hub ids left unchecked gathered into one."""
        if not self.unchecked:
            return self.notes
        return [*self.notes, f"hub ids not looked up (pass --online to check them): {', '.join(dict.fromkeys(self.unchecked))}"]


def validate_recipe(path: str | Path, online: bool = False) -> list[Problem]:
    """Every problem of the recipe at `path` (empty when it is clean); hub ids are looked up only with `online`."""
    return check_recipe(path, online).problems


EVAL_ONLY = "--eval-only (eval_only=True)"  # the run's flags, as the CLI and the API name them
KEEP_LAYERS = "--keep-layers (keep_layers=True)"
NO_REFINE = ("featcal has no refine: block; the kept layers serve a rerun with other refine: settings (turning refine: "
             "on changes the records the closed form fits, so it calibrates the layers again)")


def check_run_flags(path: Path, featcal: Any, output: Path, keep_layers: bool, eval_only: bool, problems: list[Problem],
                    settings: dict | None = None) -> None:
    """What `run --keep-layers` and `run --eval-only` need of the recipe: a `refine:` block; an `eval:` block and a
    finished run's output to score, made from the recipe's `settings` as they are now (io/run_settings.made_from)."""
    if not eval_only:
        if keep_layers and featcal.refine is None:
            problems.append(Problem(str(path), KEEP_LAYERS, NO_REFINE))
        return
    scored = scored_merge(featcal, output)
    if keep_layers:
        problems.append(Problem(str(path), EVAL_ONLY, f"calibrates nothing, so {KEEP_LAYERS} does not apply"))
    elif featcal.eval is None:
        problems.append(Problem(str(path), EVAL_ONLY, "featcal has no eval: block to run"))
    elif not (output / RECIPE_FILE).is_file():
        problems.append(Problem(str(path), EVAL_ONLY, f"{output} is no finished run's output (no {RECIPE_FILE}); run the "
                                                      "recipe without --eval-only"))
    elif not scored.is_dir():
        what = (f"the stack's first stage ({featcal.method[0]}), removed once its run finished" if featcal.stacked
                else "the merged model")
        problems.append(Problem(str(path), EVAL_ONLY, f"{scored}, {what}, is not there to score beside the output"))
    elif settings is not None:
        changed = settings_since(path, output, settings, settings_root(recipe_text(path), settings))
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            problems.append(Problem(str(path), EVAL_ONLY, f"{output} was made from other settings than the recipe's now "
                                                          f"({shown}); run the recipe without --eval-only to calibrate with "
                                                          "them, or put them back"))


def settings_since(path: Path, output: Path, settings: dict, root: str) -> list[str]:
    """The recipe's settings that differ from those the output was made from; none where the recipe is the output's own
    (its featcal_recipe.yml, which pins the tuned values), where the two replay the same first settings (`root`: a
    recipe and the output of its saved recipe's run, or the other way round; io/run_settings.settings_root) or where
    the output does not say (one an earlier version wrote)."""
    if path.resolve() == (output / RECIPE_FILE).resolve():
        return []
    try:
        record = read_run_record(output)
    except (OSError, ValueError):
        return []
    recorded = record.get("made_from")
    if recorded is None or record.get("settings_root", settings_digest(recorded)) == root:
        return []
    return changed_settings(recorded, settings)


def check_before_run(path: str | Path, output: str | Path | None = None, device: str | None = None,
                     keep_layers: bool = False, eval_only: bool = False) -> Recipe:
    """The recipe parsed by mergekit, once every local check passed; else `RecipeProblems` listing all of them."""
    report = check_recipe(path, online=False, plan=False, mergekit=True, output=output, device=device,
                          keep_layers=keep_layers, eval_only=eval_only)
    if report.problems:
        raise RecipeProblems(report.problems)
    return report.recipe


def check_recipe(path: str | Path, online: bool = False, plan: bool = True, mergekit: bool = False,
                 output: str | Path | None = None, device: str | None = None, keep_layers: bool = False,
                 eval_only: bool = False) -> Report:
    """Every problem of the recipe in one round: its text, then what the parts that parsed point at.

    Without torch unless `mergekit` (then a clean recipe's mergekit part is parsed by mergekit itself, for `run`).
    `output` (`run RECIPE OUTPUT`) is checked in place of featcal.output, which that run never writes; `device`
    (`run --device`) in place of featcal.device; `keep_layers` and `eval_only` as `run --keep-layers` / `--eval-only`.
    """
    parsed = read_recipe(path, mergekit=mergekit)
    path, recipe, problems = Path(path), parsed.recipe, parsed.problems
    report = Report(recipe, problems)
    if parsed.merge_config is None and parsed.block is None:
        return report
    data = parsed.data_entries()
    experts = [str(reference) for reference in _experts_of(parsed.merge_config)] if parsed.merge_config is not None else None
    featcal = parsed.featcal
    # the records the run converts: the first `samples` of the file (any of them when it shuffles)
    read = None if featcal is None or featcal.shuffle else featcal.samples
    counts = {}  # expert → the records its file holds, where validate could count them
    for name, spec in data.items():
        if spec.path is not None and (experts is None or name in experts):
            where = f"{path}: featcal.data.{name}"
            taken = (spec.samples or read) if read is not None else None
            counts[name] = collect(problems, path, lambda spec=spec, where=where, taken=taken: check_data(
                spec, where, path.parent, online, report.unchecked, report.offline, taken))
    if featcal is not None:
        short_file_findings(path, featcal, {name: count for name, count in counts.items() if count is not None}, report.notes, problems)
    setting = parsed.setting
    configs = {}
    if parsed.merge_config is not None:
        configs = check_models(path, parsed.merge_config, setting("merged"), setting("tokenizer"), online, report, data, featcal)
    output_key = "OUTPUT" if output is not None else "featcal.output"
    unusable = argument_problem(output) if output is not None else None  # no path to test: the checks of it wait
    if unusable is not None:
        problems.append(Problem(str(path), "OUTPUT", unusable))
    written_to = None if unusable is not None else Path(output) if output is not None else \
        (Path(setting("output")) if setting("output") else None)
    if parsed.merge_config is not None and unusable is None and not eval_only:  # --eval-only writes the card alone
        check_writes(path, Path(output) if output is not None else None, setting, parsed.merge_config, data, problems)
    if featcal is not None and written_to is not None:
        settings = made_from(featcal, parsed.mergekit_part) if eval_only and parsed.mergekit_part is not None else None
        check_run_flags(path, featcal, written_to, keep_layers, eval_only, problems, settings)
    if written_to is not None and not eval_only and not any(problem.key == output_key for problem in problems):
        check_output(path, written_to, problems, report.notes, output_key)  # one line for it
        if featcal is not None and featcal.stacked and not any(problem.key == output_key for problem in problems):
            check_first_stage(path, written_to, featcal, problems)
    if featcal is not None and featcal.eval is not None:
        written = {output_key: written_to, "featcal.merged": setting("merged")}
        check_eval(path, featcal.eval, report, online, {key: Path(value) for key, value in written.items() if value})
    if featcal is not None:
        _check_device(path, device, featcal, report)
    if report.offline:
        report.notes.append(f"hub ids not checked: no network ({', '.join(dict.fromkeys(report.offline))})")
    base = configs.get("base_model")
    # the evaluation's problems (a backend this machine lacks: a recipe written for a GPU box, checked on a laptop) leave
    # the calibration's plan as it is, so it is still shown
    blocking = [problem for problem in problems if not problem.key.startswith("featcal.eval")]
    if plan and recipe is not None and base is None and not blocking:
        fetch = "the hub could not be reached" if report.offline else "--online fetches it"
        report.notes.append(f"{path}: base_model: no memory plan (its config.json is not on this machine; {fetch})")
    if plan and recipe is not None and base is not None and not blocking:
        from featcal_llm.benchmark.estimate import memory_plan

        from featcal_llm.hardware import cuda_refusal

        planned = device or recipe.featcal.device  # run --device, else the recipe's; auto is the CPU where CUDA is certainly absent
        planned = "cpu" if planned == "auto" and cuda_refusal() is not None else planned
        try:
            report.plan = memory_plan(base, recipe.featcal.model_copy(update={"device": planned}), len(recipe.experts),
                                      Path(recipe.featcal.merged).is_dir())
        except (KeyError, TypeError, ZeroDivisionError):
            report.notes.append(f"{path}: base_model: no memory plan (its config.json does not describe a dense decoder)")
    return report


def _check_device(path: Path, override: str | None, featcal: Any, report: Report) -> None:
    """What the device (`run --device`, else featcal.device) cannot do, where that is certain before run starts torch:
    CUDA named where there is none (run's `resolve_device` refuses it so), vLLM sampling on the CPU or uninstalled."""
    from featcal_llm.hardware import cuda_refusal, vllm_refusal
    from featcal_llm.io.block import check_device

    if override is not None and not isinstance(override, str):  # the CLI checks its option's form itself; the API's device= here
        report.problems.append(Problem(str(path), "--device", f"expected a string such as 'cpu' or 'cuda:0', got {override!r}"))
        return
    if override is not None and collect(report.problems, path, lambda: check_device(override, "--device")) is None:
        return
    device = override or featcal.device
    if device.startswith("cuda") and (refusal := cuda_refusal()) is not None:
        report.problems.append(Problem(str(path), "--device" if override else "featcal.device", f"{device} requested but {refusal}"))
    for name, spec in featcal.data.items():  # known before the merge and the passes
        if spec.generate is not None and spec.generate.backend == "vllm":
            refusal = vllm_refusal(on_gpu=device != "cpu")  # auto: a GPU when there is one, which run finds out
            if refusal is not None:
                report.problems.append(Problem(str(path), f"featcal.data.{name}.generate.backend", refusal))
