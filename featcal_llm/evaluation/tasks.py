"""Turn a suite task into the exact lm-eval task config that runs (inside the worker).

The task's YAML (lm-eval's, found through a TaskManager whose include_path holds our
`featcal_llm/evaluation/suites/tasks/`, or ours) is loaded with lm-eval's own loader, then the suite's settings and the
user's local-data override are applied on top. The resulting dict is what lm-eval builds the
Task from, and what the result file records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation.provenance import find_task_yaml
from featcal_llm.evaluation.suite import Suite

DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def task_manager(suite: Suite):
    """A TaskManager over our `featcal_llm/evaluation/suites/tasks/` only: indexing lm-eval's ~14,000 task YAMLs costs
    seconds per call, and lm-eval's own tasks are found by `lm_eval_task_yaml` instead."""
    from lm_eval.tasks import TaskManager

    assert suite.path is not None
    include = suite.path.parent / "tasks"
    return TaskManager(include_path=str(include) if include.is_dir() else None, include_defaults=False)


def lm_eval_task_yaml(name: str) -> Path | None:
    """The YAML in lm-eval's task tree that defines `task: <name>`; falls back to lm-eval's
    full index for tasks defined some other way."""
    path = find_task_yaml(name)
    if path is not None:
        return path
    from lm_eval.tasks import TaskManager

    entry = TaskManager().task_index.get(name)
    return Path(entry.yaml_path) if entry is not None and entry.yaml_path else None


def base_config_path(suite: Suite, task_id: str) -> Path:
    own = suite.task_path(task_id)
    if own is not None:
        return own
    name = suite.tasks[task_id].lm_eval_task
    path = lm_eval_task_yaml(name)
    if path is None:
        raise FeatCalError(f"{suite.path}: tasks.{task_id}.lm_eval_task: '{name}' is not a task of this lm-eval")
    return path


def apply_data_override(config: dict[str, Any], path: Path, task_id: str) -> None:
    """A directory replaces dataset_path (a local copy of the hub dataset repository); a file
    becomes the test split, loaded with the `datasets` builder its suffix names."""
    if not path.exists():
        raise FeatCalError(f"data.{task_id}: {path} does not exist")
    if path.is_dir():
        config["dataset_path"] = str(path)
        return
    builder = DATA_BUILDERS.get(path.suffix)
    if builder is None:
        raise FeatCalError(f"data.{task_id}: {path.name}: expected one of {', '.join(DATA_BUILDERS)} or a directory")
    fewshot = config.get("fewshot_config") or {}
    if config.get("num_fewshot") and not fewshot.get("samples"):
        raise FeatCalError(
            f"data.{task_id}: a single file holds only the test split, but this task draws "
            f"{config['num_fewshot']} few-shot examples from its dataset; give a directory"
        )
    config["dataset_path"] = builder
    config["dataset_name"] = None
    config["dataset_kwargs"] = {"data_files": {config["test_split"]: str(path)}}
    for split in ("training_split", "validation_split", "fewshot_split"):
        config[split] = None


def declared_config(suite: Suite, task_id: str) -> dict[str, Any]:
    """The task's YAML as written, its includes followed and its functions left as names: nothing of the task's own
    code is imported (IFEval's would reach for NLTK's downloads), so `validate` can read it."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(base_config_path(suite, task_id), resolve_func=False)


def reported_metrics(config: dict[str, Any]) -> set[str] | None:
    """The `<metric>,<filter>` keys lm-eval reports for a task config: each metric of its metric_list under each of
    its filters (`none` without a filter_list); None where it lists no metrics (its output type's defaults apply)."""
    metrics = [entry.get("metric") for entry in config.get("metric_list") or [] if isinstance(entry, dict)]
    if not metrics or not all(isinstance(metric, str) and "/" not in metric for metric in metrics):
        return None  # a `!function` metric (read unresolved, a path) is reported under its function's name: not known here
    filters = [entry.get("name") for entry in config.get("filter_list") or [] if isinstance(entry, dict)] or ["none"]
    return {f"{metric},{name}" for metric in metrics for name in filters}


def check_metric(suite: Suite, task_id: str, config: dict[str, Any]) -> None:
    """The suite's reported metric is one lm-eval computes for the task: known before any generation."""
    reported, metric = reported_metrics(config), suite.tasks[task_id].metric
    if reported is not None and metric not in reported:
        raise FeatCalError(f"{suite.path}: tasks.{task_id}.metric: '{metric}' is not a result lm-eval reports for "
                           f"{config.get('task', task_id)} (it reports {', '.join(sorted(reported))})")


def resolve_task_config(suite: Suite, task_id: str, *, data: Path | None,
                        max_gen_toks: int | None, revision: str | None = None) -> dict[str, Any]:
    """The task's config with the suite's settings; `revision` pins the hub dataset's commit."""
    from lm_eval.tasks._yaml_loader import load_yaml

    spec = suite.tasks[task_id]
    config = load_yaml(base_config_path(suite, task_id), resolve_func=True)
    for structural in ("tag", "group", "task_list"):
        config.pop(structural, None)
    config["num_fewshot"] = spec.num_fewshot
    generation = dict(config.get("generation_kwargs") or {})
    generation.update(spec.generation_kwargs)
    if max_gen_toks is not None:
        generation["max_gen_toks"] = max_gen_toks
    if config.get("output_type") == "generate_until":
        config["generation_kwargs"] = generation
    if data is not None:
        apply_data_override(config, data, task_id)
    elif revision and revision != "unresolved":
        config["dataset_kwargs"] = {**(config.get("dataset_kwargs") or {}), "revision": revision}
    return config


def describe(config: dict[str, Any]) -> dict[str, Any]:
    """A JSON-able copy of a task config (functions by their qualified names)."""

    def plain(value: Any) -> Any:
        if callable(value):
            return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)

    return plain(config)
