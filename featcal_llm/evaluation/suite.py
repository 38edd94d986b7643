"""Evaluation suites: versioned YAML data shipped in `featcal_llm/evaluation/suites/`, validated here.

A suite pins, per task, the lm-eval task (a registry name or a task YAML of ours), the few-shot
count, generation kwargs and the one metric that is reported. Everything that changes a score
is in the file, so the file (with its version) is what a result is cached and compared by.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    model_validator,
)

from featcal_llm.errors import FeatCalError


SHIPPED = Path(__file__).resolve().parent / "suites"  # installed with the package: suites, their task files, paper rows


def eval_root() -> Path:
    """The folder suites are looked up in by name: $FEATCAL_EVAL_DIR when set, else the suites shipped with featcal-llm.

    FEATCAL_EVAL_DIR points at a folder of your own suites (`NAME.yaml`, task files beside them);
    a name it does not hold is still found among the shipped suites.
    """
    override = os.environ.get("FEATCAL_EVAL_DIR")
    return Path(override) if override else SHIPPED


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scale: Literal["percent", "fraction"] = "percent"
    decimals: int = Field(1, ge=0, le=4)
    average: Literal["mean"] = "mean"


class TaskSpec(BaseModel):
    """One benchmark of a suite."""

    model_config = ConfigDict(extra="forbid")

    label: str
    lm_eval_task: str | None = Field(None, description="a task name in lm-eval's registry")
    task_file: str | None = Field(None, description="a task YAML of ours, relative to the suite")
    num_fewshot: int = Field(ge=0)
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)
    metric: str = Field(description="the lm-eval results key reported, '<metric>,<filter>'")
    dataset_revision: str | None = Field(
        None, description="hub dataset commit (40 hex) or tag to read; recorded and part of the cache key")
    executes_code: bool = False
    code_timeout_s: float | None = Field(None, gt=0, description="CPU seconds per program, all inputs (EvalPlus: 60)")
    code_min_time_limit_s: float = Field(4.0, ge=0, description="EvalPlus's minimum CPU seconds per input")
    code_time_limit_factor: float = Field(4.0, gt=0, description="EvalPlus's factor on the canonical time per input")
    why: str

    @model_validator(mode="after")
    def _one_definition(self) -> "TaskSpec":
        if (self.lm_eval_task is None) == (self.task_file is None):
            raise ValueError("give exactly one of lm_eval_task or task_file")
        if "," not in self.metric:
            raise ValueError("metric must be '<metric>,<filter>' as in lm-eval's results")
        if self.executes_code and self.code_timeout_s is None:
            raise ValueError("a task that executes code needs code_timeout_s")
        return self


class Suite(BaseModel):
    """A set of tasks scored by one identical pipeline."""

    model_config = ConfigDict(extra="forbid")

    name: str
    version: str
    description: str
    context_length: PositiveInt
    fewshot_as_multiturn: bool = True
    apply_chat_template: Literal["per_model", "never"] = Field(
        "per_model", description="never: a protocol that scores every model without its chat template")
    chat_template: str = Field(description="the rule for applying the chat template (documentation)")
    chat_template_args: dict[str, Any] = Field(
        default_factory=dict, description="extra chat-template variables, e.g. a fixed date_string")
    report: Report = Field(default_factory=Report)
    tasks: dict[str, TaskSpec]

    path: Path | None = Field(None, exclude=True)

    def task_path(self, task_id: str) -> Path | None:
        spec = self.tasks[task_id]
        if spec.task_file is None:
            return None
        assert self.path is not None
        return (self.path.parent / spec.task_file).resolve()

    def select(self, task_ids: list[str] | None, origin: str) -> list[str]:
        """The task ids to run, in suite order; unknown ids are a user error naming `origin`."""
        if not task_ids:
            return list(self.tasks)
        unknown = [task for task in task_ids if task not in self.tasks]
        if unknown:
            raise FeatCalError(
                f"{origin}: unknown task {', '.join(unknown)}; the suite has {', '.join(self.tasks)}"
            )
        return [task for task in self.tasks if task in task_ids]

    def task_fingerprint(self, task_id: str) -> str:
        """Hash of everything in the suite that defines this task, including our task YAML."""
        spec = self.tasks[task_id].model_dump(exclude={"why", "label"})
        task_path = self.task_path(task_id)
        if task_path is not None:
            spec["task_file_sha256"] = hashlib.sha256(task_path.read_bytes()).hexdigest()
        blob = json.dumps(
            {"suite": self.name, "version": self.version, "fewshot_as_multiturn": self.fewshot_as_multiturn,
             "task": task_id, "spec": spec},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


def code_opt_in_problem(suite: Suite, task_ids: list[str], allowed: bool) -> str | None:
    """The message for running code tasks without the user's opt-in, or None."""
    code = [task for task in task_ids if suite.tasks[task].executes_code]
    if not code or allowed:
        return None
    return (
        f"{', '.join(code)} execute model-written code: pass --allow-code-execution "
        "(recipe: allow_code_execution: true) to run each program in a subprocess with a time limit, "
        "or leave them out with --tasks / tasks:"
    )


def checked_suite(section: Any, where: str = "eval") -> tuple[Suite, list[str]]:
    """The suite an `eval` section (paths resolved) names and the task ids it runs, once its tasks, code opt-in, chat
    template and data overrides fit that suite; `where` prefixes each error's key (`featcal.eval` in a recipe)."""
    suite = load_suite(section.suite)
    task_ids = suite.select(section.tasks, f"{where}.tasks" if where != "eval" else "tasks")
    problem = code_opt_in_problem(suite, task_ids, section.allow_code_execution)
    if problem:
        raise FeatCalError(f"{where}: {problem}")
    if suite.apply_chat_template == "never" and section.chat_template == "on":
        key = "--chat-template on:" if where == "eval" else f"{where}.chat_template: on, but"
        raise FeatCalError(f"{key} suite {suite.name} scores every model without its chat template")
    prefix = "" if where == "eval" else f"{where}."
    for task_id, path in section.data.items():
        if task_id not in suite.tasks:
            raise FeatCalError(f"{prefix}data.{task_id}: not a task of suite {suite.name} ({', '.join(suite.tasks)})")
        if not Path(path).exists():
            raise FeatCalError(f"{prefix}data.{task_id}: {path} does not exist")
    return suite, task_ids


def resolve_suite_path(name_or_path: str) -> Path:
    """A suite name (`mergebench`) means `<name>.yaml` in $FEATCAL_EVAL_DIR or among the shipped suites; anything else is a path."""
    candidate = Path(name_or_path).expanduser()
    if candidate.suffix in {".yaml", ".yml"} or candidate.is_file():  # a folder of that name here is no suite file
        return candidate
    own = eval_root() / f"{name_or_path}.yaml"
    return own if own.is_file() else SHIPPED / f"{name_or_path}.yaml"


def load_suite(name_or_path: str) -> Suite:
    path = resolve_suite_path(name_or_path)
    if not path.is_file():
        raise FeatCalError(f"{path}: suite file not found (give a suite name such as mergebench, or a YAML path)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise FeatCalError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise FeatCalError(f"{path}: expected a mapping with name, version, tasks")
    try:
        suite = Suite.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise FeatCalError(f"{path}: {where}: {first['msg']}") from None
    suite.path = path.resolve()
    for task_id in suite.tasks:
        task_path = suite.task_path(task_id)
        if task_path is not None and not task_path.is_file():
            raise FeatCalError(f"{path}: tasks.{task_id}.task_file: {task_path} does not exist")
    return suite
