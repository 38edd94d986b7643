"""`validate`'s checks of the `eval:` block: what the evaluation after the run would refuse, asked before the
calibration's hours (its files, the suite and its tasks as lm-eval's YAMLs declare them, the backend on this machine),
without torch and without importing any task's code. `report` is io/validate.Report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError
from featcal_llm.io.data_files import looks_like_hub_id
from featcal_llm.io.hub_lookup import hub_lookup
from featcal_llm.io.model_files import has_chat_template
from featcal_llm.io.output_dir import inside, same, unwritable
from featcal_llm.io.problems import Problem, collect


def check_eval(path: Path, section: Any, report: Any, online: bool = False, models: dict[str, Path] | None = None) -> None:
    """Files the eval: block names exist (beside the recipe, or from the current directory); its output can be written
    and is none of the `models` the run writes (the calibrated checkpoint, the merge), nor inside one."""
    places = lambda value: [(where / value).expanduser() for where in (path.parent, Path.cwd())]  # noqa: E731
    found = lambda value: any(place.exists() for place in places(value))  # noqa: E731
    is_dir = lambda value: any(place.is_dir() for place in places(value))  # noqa: E731
    before = len(report.problems)
    if section.suite.endswith((".yaml", ".yml")) and not found(section.suite):
        report.problems.append(Problem(str(path), "featcal.eval.suite", f"{section.suite}: suite file not found"))
    from featcal_llm.evaluation.tasks import DATA_BUILDERS

    for task, location in section.data.items():
        if not found(location):
            report.problems.append(Problem(str(path), f"featcal.eval.data.{task}", f"{location}: not found"))
        elif not is_dir(location) and Path(location).suffix not in DATA_BUILDERS:
            report.problems.append(Problem(str(path), f"featcal.eval.data.{task}", f"{location}: expected one of {', '.join(DATA_BUILDERS)} or a directory"))
    results = Path(section.output).expanduser()
    if results.exists() and not results.is_dir():  # run would fail after the calibration
        report.problems.append(Problem(str(path), "featcal.eval.output", f"{section.output}: a file, not a results directory"))
    elif unwritable(results) is not None:
        report.problems.append(Problem(str(path), "featcal.eval.output", unwritable(results)))
    elif results.is_dir() and not os.access(results, os.W_OK):
        report.problems.append(Problem(str(path), "featcal.eval.output", f"{section.output}: directory is not writable"))
    for key, model in (models or {}).items():  # its files would go into a checkpoint, which a --force run replaces
        if same(results, model) or inside(results, model):
            report.problems.append(Problem(str(path), "featcal.eval.output", f"{section.output}: {'is' if same(results, model) else 'lies inside'} "
                                          f"{key} {model}: the results would be written into a model's folder; name a results directory of its own"))
    if section.nltk_data and not is_dir(section.nltk_data):
        report.problems.append(Problem(str(path), "featcal.eval.nltk_data", f"{section.nltk_data}: directory not found"))
    if len(report.problems) == before:  # the suite's own checks, as run makes them after the calibration (its file read now)
        _check_eval_settings(path, section.resolve(path.parent), report, online)


def _check_eval_tasks(path: Path, section: Any, suite: Any, task_ids: list[str], report: Any, online: bool) -> None:
    """What the evaluation's worker refuses of each task before it generates, read from lm-eval's YAMLs (without
    importing any task's code): the task exists in this lm-eval, its metric is one lm-eval reports, IFEval's NLTK data."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:  # the backend's check says so
        return
    from featcal_llm.evaluation.tasks import check_metric, declared_config
    from featcal_llm.evaluation.worker import punkt_refusal

    for task_id in task_ids:
        config = collect(report.problems, path, lambda task_id=task_id: declared_config(suite, task_id))
        if config is None:
            continue
        collect(report.problems, path, lambda task_id=task_id, config=config: check_metric(suite, task_id, config))
        dataset = config.get("dataset_path")
        if task_id not in section.data and isinstance(dataset, str) and looks_like_hub_id(dataset) and not Path(dataset).exists():
            if online:  # the data the evaluation downloads after the calibration: there, and not gated for this login
                collect(report.problems, path, lambda dataset=dataset, task_id=task_id: hub_lookup(
                    "dataset", dataset, None, f"featcal.eval.tasks.{task_id}", report.offline))
            else:
                report.unchecked.append(f"{dataset} (dataset, eval task {task_id})")
        if str(config.get("task", "")).startswith("ifeval"):
            refusal = punkt_refusal(task_id, section.data.get(task_id), section.nltk_data)
            if refusal is not None:
                report.problems.append(Problem(str(path), f"featcal.eval.tasks.{task_id}", refusal))


def _check_eval_settings(path: Path, section: Any, report: Any, online: bool = False) -> None:
    """What the evaluation after the run would refuse of the block alone, asked before the calibration's hours."""
    from featcal_llm.evaluation import backends
    from featcal_llm.evaluation.backends import check_generation_room, check_settings, context_tokens, planned_backend_name
    from featcal_llm.evaluation.modelinfo import config_positions
    from featcal_llm.evaluation.vllm_arguments import check_vllm_engine_args
    from featcal_llm.evaluation.leaderboard import reference_rows
    from featcal_llm.evaluation.suite import checked_suite, load_suite

    checked = collect(report.problems, path, lambda: checked_suite(section, "featcal.eval"))
    if checked is not None:
        _check_eval_tasks(path, section, *checked, report, online)
    if checked is not None and isinstance(report.scored_config, dict):  # the scored model's positions, as run reads them

        def room() -> None:
            suite, task_ids = checked
            context = context_tokens(section.backend, suite.context_length, config_positions(report.scored_config))
            try:
                check_generation_room(suite, task_ids, section.max_gen_toks, context)
            except FeatCalError as error:
                raise FeatCalError(f"featcal.eval.tasks.{error}") from None

        collect(report.problems, path, room)
    if section.chat_template == "on" and report.scored_tokenizer is not None and not has_chat_template(report.scored_tokenizer):
        report.problems.append(Problem(str(path), "featcal.eval.chat_template", f"on, but the merged model's tokenizer "
                                                                               f"({report.scored_tokenizer}) has no chat template"))

    def backend() -> None:
        name = planned_backend_name(section.backend, "featcal.eval.backend.name")  # None: auto, where torch decides
        try:
            if name is not None:
                check_settings(name, section.backend, report.scored_config)
            elif backends._installed("vllm"):  # auto on a machine that may have CUDA: vLLM's keys, as auto picks it once CUDA is seen
                check_vllm_engine_args(section.backend.engine_args, "backend.engine_args")
        except FeatCalError as error:
            raise FeatCalError(f"featcal.eval.{error}") from None

    collect(report.problems, path, backend)
    if section.reference:
        collect(report.problems, path, lambda: reference_rows([section.reference], load_suite(section.suite), "featcal.eval.reference"))
