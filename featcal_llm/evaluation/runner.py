"""Evaluate models: plan (fingerprint, cache lookup), run missing tasks in a per-model worker
subprocess, and write the model's summary. This runs in the user's process and never imports
lm-eval, vLLM or torch's CUDA side (the worker does)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from featcal_llm.errors import EXIT_USAGE, FeatCalError, RunFailure, warn
from featcal_llm.evaluation import cache, provenance, uncertainty
from featcal_llm.evaluation.backends import check_generation_room, context_tokens, plan_backend, resolve_backend_name
from featcal_llm.evaluation.config import EvalSection
from featcal_llm.evaluation.modelinfo import (
    ChatDecision,
    check_model_dir,
    decide_chat_template,
    max_positions,
    model_fingerprint,
    config_dtype,
)
from featcal_llm.evaluation.suite import Suite, checked_suite
from featcal_llm.evaluation.worker import USER_ERROR_EXIT
from featcal_llm.io.output_dir import unwritable
from featcal_llm.startup import child_environment

SEEDS = {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}  # lm-eval's defaults
SUMMARY_SCHEMA = "featcal-llm/eval-summary/1"


def safe_label(label: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._")
    if not cleaned:
        raise FeatCalError(f"label '{label}': needs at least one letter or digit")
    return cleaned


@dataclass
class TaskPlan:
    task_id: str
    key: str
    key_fields: dict
    directory: Path
    data: Path | None

    @property
    def cached(self) -> bool:
        return cache.read_entry(self.directory) is not None


def key_fields(suite: Suite, task_id: str, section: EvalSection, fingerprint: str, backend_identity: dict,
               chat: ChatDecision) -> dict:
    """Everything a task's score depends on; its hash is the cache key."""
    data = Path(section.data[task_id]) if task_id in section.data else None
    local = cache.data_fingerprint(data) if data is not None and data.exists() else None
    source = provenance.task_source(suite, task_id)
    spec = suite.tasks[task_id]
    return {
        "model": fingerprint,
        "suite": suite.name,
        "suite_version": suite.version,
        "task": task_id,
        "task_definition": suite.task_fingerprint(task_id),
        "task_source": source["sha256"],
        "dataset": provenance.dataset_identity(suite, task_id, source, local),
        "grader": provenance.grader_source_sha256() if spec.executes_code else None,
        "backend": backend_identity,
        "chat_template": chat.applied,
        "limit": section.limit,
        "max_gen_toks": section.max_gen_toks,
        "seeds": SEEDS,
        "versions": provenance.package_versions(),
    }


def _task_plans(suite: Suite, task_ids: list[str], section: EvalSection, fingerprint: str,
                backend_identity: dict, chat: ChatDecision, output: Path) -> list[TaskPlan]:
    plans = []
    for task_id in task_ids:
        data = Path(section.data[task_id]) if task_id in section.data else None
        fields = key_fields(suite, task_id, section, fingerprint, backend_identity, chat)
        key = cache.cache_key(fields)
        plans.append(TaskPlan(task_id, key, fields, cache.entry_dir(output, key), data))
    return plans


def stop_worker(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Terminate the evaluation worker, then kill it if it has not exited within `grace_s` (vLLM shuts its engine
    down on SIGTERM)."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _run_worker(job: dict, output: Path, label: str, echo: Callable[[str], None]) -> None:
    logs = output / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{label}.log"
    with tempfile.TemporaryDirectory(prefix="featcal-eval-") as scratch:
        job_path, error_file = Path(scratch) / "job.json", Path(scratch) / "error.json"
        job["error_file"] = str(error_file)
        job_path.write_text(json.dumps(job, indent=1))
        env = child_environment()
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        last_line = ""
        with log_path.open("a") as log:
            log.write(f"\n===== worker for {label} ({job['model']['path']})\n")
            process = subprocess.Popen(
                [sys.executable, "-m", "featcal_llm.evaluation.worker", str(job_path)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1,
            )
            assert process.stdout is not None
            try:
                for line in process.stdout:
                    log.write(line)
                    if line.strip():
                        last_line = line.strip()[-300:]
                    echo(line.rstrip("\n"))
            except BaseException:  # stopped (SIGTERM reaches this process only): the worker must not go on holding the GPU
                stop_worker(process)
                raise
            returncode = process.wait()
        if returncode == USER_ERROR_EXIT and error_file.is_file():
            raise FeatCalError(json.loads(error_file.read_text())["message"])
        if returncode != 0:  # a failed run, not bad input: its logs stay
            raise RunFailure(
                f"{label}: the evaluation worker failed (exit {returncode}): {last_line}; full log: {log_path}; "
                "finished tasks are cached, and scoring again resumes after them"
            )


def evaluate_model(model_dir: Path, label: str, section: EvalSection, *, chat: ChatDecision | None = None,
                   echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> dict:
    """Score one model on the section's suite, reusing cached tasks; returns its summary. A results folder this call
    created is removed again when the input is refused (bad data or model found by the worker's checks): it would
    hold only a memo and logs."""
    output = Path(section.output)
    fresh = not output.exists()
    try:
        return _evaluate_model(model_dir, label, section, chat, echo)
    except FeatCalError as error:
        if fresh and output.is_dir() and error.exit_code == EXIT_USAGE and not any((output / "cache").glob("*/result.json")):
            shutil.rmtree(output, ignore_errors=True)
        raise


def _evaluate_model(model_dir: Path, label: str, section: EvalSection, chat: ChatDecision | None,
                    echo: Callable[[str], None]) -> dict:
    model_dir = check_model_dir(Path(model_dir))
    label = safe_label(label)
    suite, task_ids = checked_suite(section)
    output = Path(section.output)
    if output.exists() and not output.is_dir():
        raise FeatCalError(f"eval output {output}: a file, not a results directory")
    problem = unwritable(output)
    if problem is not None:
        raise FeatCalError(f"eval output {problem}")
    backend_name = resolve_backend_name(section.backend)
    chat = chat or decide_chat_template(model_dir, section.chat_template)
    if suite.apply_chat_template == "never":  # `on` was refused with the suite (checked_suite)
        chat = ChatDecision(False, f"suite {suite.name}: never", chat.template_sha256)
    positions = max_positions(model_dir)
    backend = plan_backend(backend_name, section.backend, model_dir, suite.context_length, positions,
                           suite.chat_template_args if chat.applied else None, config_dtype(model_dir))
    check_generation_room(suite, task_ids, section.max_gen_toks, context_tokens(section.backend, suite.context_length, positions))
    fingerprint = model_fingerprint(model_dir)
    label = _own_label(output, label, model_dir, fingerprint, echo)
    plans = _task_plans(suite, task_ids, section, fingerprint, backend.identity(), chat, output)

    pending = [plan for plan in plans if not plan.cached]
    for plan in plans:
        if plan.cached:
            echo(f"[featcal-eval] {label}: {plan.task_id} cached ({plan.directory.name})")
    if pending:
        job = {
            "label": label,
            "model": {"path": str(model_dir), "fingerprint": fingerprint},
            "suite_path": str(suite.path),
            "tasks": [{"id": p.task_id, "label": suite.tasks[p.task_id].label, "metric": suite.tasks[p.task_id].metric,
                       "lm_eval_task": suite.tasks[p.task_id].lm_eval_task or "",
                       "key": p.key, "key_fields": p.key_fields, "dir": str(p.directory),
                       "revision": (p.key_fields["dataset"].get("revision") or None),
                       "data": str(p.data) if p.data else None} for p in pending],
            "backend": {"name": backend.name, "model_args": backend.model_args, "batch_size": backend.batch_size},
            "chat": {"applied": chat.applied, "reason": chat.reason, "template_sha256": chat.template_sha256},
            "fewshot_as_multiturn": suite.fewshot_as_multiturn,
            "limit": section.limit,
            "max_gen_toks": section.max_gen_toks,
            "allow_code_execution": section.allow_code_execution,
            "code_workers": section.code_workers,
            "nltk_data": section.nltk_data,
            "seeds": SEEDS,
        }
        _run_worker(job, output, label, echo)
        missing = [p.task_id for p in pending if not p.cached]
        if missing:
            raise FeatCalError(f"{label}: the worker finished without results for {', '.join(missing)}")
    summary = _summary(label, model_dir, fingerprint, suite, plans, backend.identity(), chat, section, output)
    summary = _merge_previous(output / f"{label}.json", summary, suite, output, echo)
    (output / f"{label}.json").write_text(json.dumps(summary, indent=1))
    return summary


def _read_summary(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SUMMARY_SCHEMA else None


def _own_label(output: Path, label: str, model_dir: Path, fingerprint: str, echo: Callable[[str], None]) -> str:
    """A label whose summary belongs to another model (two `merged/` directories, say) gets the
    model's fingerprint appended instead of overwriting that summary."""
    previous = _read_summary(output / f"{label}.json")
    if previous is None or previous["model"]["path"] == str(model_dir):
        return label
    unique = f"{label}-{fingerprint[:8]}"
    echo(f"[featcal-eval] {label}.json belongs to {previous['model']['path']}; writing {unique}.json for {model_dir}")
    return unique


_SAME_RUN = ("backend", "chat_template", "limit", "max_gen_toks", "seeds")


def _merge_previous(path: Path, summary: dict, suite: Suite, output: Path, echo: Callable[[str], None]) -> dict:
    """`--tasks gsm8k` adds to the model's summary: tasks scored earlier for the same weights,
    suite version and settings (and still in the cache) are kept; others are dropped with a note."""
    previous = _read_summary(path)
    if previous is None:
        return summary
    same = (previous["model"]["fingerprint"] == summary["model"]["fingerprint"]
            and (previous["suite"]["name"], previous["suite"]["version"]) == (suite.name, suite.version)
            and all(previous.get(key) == summary.get(key) for key in _SAME_RUN))
    others = {task: entry for task, entry in previous["tasks"].items() if task not in summary["tasks"]}
    if not others:
        return summary
    if not same:  # said even with --quiet: scores leave the leaderboard (their cache entries stay)
        warn(f"{summary['label']}: dropping {', '.join(others)} from its summary in {output} (scored for other weights, "
             "suite version or settings; their cache entries stay, and rerunning those settings restores them)")
        return summary
    kept = {task: entry for task, entry in others.items()
            if task in suite.tasks and cache.read_entry(output / Path(entry["result"]).parent) is not None}
    tasks = {task: (summary["tasks"].get(task) or kept[task]) for task in suite.tasks
             if task in summary["tasks"] or task in kept}
    complete = set(tasks) == set(suite.tasks)
    return {**summary, "tasks": tasks, "complete": complete,
            "average": sum(t["score"] for t in tasks.values()) / len(tasks) if complete else None}


def _stderr(record: dict, samples: Path) -> float | None:
    """lm-eval's standard error of the reported metric, else the one of its per-item scores."""
    metric, filter_name = record["task"]["metric"].split(",", 1)
    value = (record.get("metrics") or {}).get(f"{metric}_stderr,{filter_name}")
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    if not samples.is_file():
        return None
    return uncertainty.stderr(uncertainty.per_item_scores(samples, record["task"]["metric"]).values())


def _summary(label: str, model_dir: Path, fingerprint: str, suite: Suite, plans: list[TaskPlan],
             backend: dict, chat: ChatDecision, section: EvalSection, output: Path) -> dict:
    scale = 100.0 if suite.report.scale == "percent" else 1.0
    tasks = {}
    for plan in plans:
        record = cache.read_entry(plan.directory)
        assert record is not None
        value = float(record["task"]["value"])
        error = _stderr(record, plan.directory / cache.SAMPLES_FILE)
        tasks[plan.task_id] = {
            "stderr": error * scale if error is not None else None,
            "label": suite.tasks[plan.task_id].label,
            "metric": record["task"]["metric"],
            "value": value,
            "score": value * scale,
            "n": (record["lm_eval"].get("n-samples") or {}).get("effective"),
            "cache_key": plan.key,
            "result": str((plan.directory / cache.RESULT_FILE).relative_to(output)),
            "samples": str((plan.directory / cache.SAMPLES_FILE).relative_to(output)),
        }
    complete = set(tasks) == set(suite.tasks)
    average = sum(t["score"] for t in tasks.values()) / len(tasks) if complete else None
    return {
        "schema": SUMMARY_SCHEMA,
        "label": label,
        "model": {"path": str(model_dir), "fingerprint": fingerprint},
        "suite": {"name": suite.name, "version": suite.version, "path": str(suite.path)},
        "report": suite.report.model_dump(),
        "backend": backend,
        "chat_template": {"applied": chat.applied, "reason": chat.reason, "template_sha256": chat.template_sha256},
        "limit": section.limit,
        "max_gen_toks": section.max_gen_toks,
        "seeds": SEEDS,
        "tasks": tasks,
        "complete": complete,
        "average": average,
    }
