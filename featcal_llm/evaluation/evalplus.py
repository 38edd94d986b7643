"""HumanEval+ / MBPP+ graded as EvalPlus grades them, as lm-eval task hooks.

The task YAMLs in `featcal_llm/evaluation/suites/tasks/` point here (`!function featcal_llm.evaluation.evalplus.*`).
`*_process_docs` read each hub row as EvalPlus's grader would (oracle.py: the entry point from the
test's own call, the tolerance, EvalPlus's special oracle, and which known-bad hub rows that
patches); a custom filter turns each completion into a verdict (sanitize, then EvalPlus's
differential test: the program runs in the sandbox on the inputs only, harness.py, and its outputs
are judged here, judge.py, per EvalPlus execution, problem.py) and `process_results` reads pass@1
off the verdict.
Verdicts are JSON strings, so lm-eval's per-sample log keeps the sanitized solution, the status, the
first failing input and the time limits next to the raw completion.

Time limits are EvalPlus's: per input max(min_time_limit, factor x the canonical solution's time
on that input) (4 s and 4 by default), each execution capped at `cap_s`; all in CPU seconds, so a
verdict does not depend on how many programs run in parallel. The canonical solution's times are
measured once per problem per process.

Programs run only after `configure(allow=True, ...)`, which the evaluation worker calls when the
user passed the opt-in flag; otherwise the filter refuses before running anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from featcal_llm.evaluation.codec import encode
from featcal_llm.evaluation.judge import ExecutionResult, RunJudge
from featcal_llm.evaluation.oracle import HUB_PATCHES, HubTestError, oracle_for, parse_hub_test
from featcal_llm.evaluation.problem import Problem, build_problem
from featcal_llm.evaluation.sandbox import OUTPUT_CAP_BYTES, Execution, execute
from featcal_llm.evaluation.sanitize import sanitize


class CodeExecutionRefused(RuntimeError):
    """Raised when a code task is graded without the user's opt-in."""


@dataclass
class _Settings:
    allow: bool = False
    cap_s: float = 60.0            # EvalPlus's EVALPLUS_TIMEOUT_PER_TASK
    min_time_limit_s: float = 4.0  # EvalPlus's DEFAULT_MIN_TIME_LIMIT
    time_limit_factor: float = 4.0  # EvalPlus's DEFAULT_GT_TIME_LIMIT_FACTOR
    workers: int = max(1, min(8, os.cpu_count() or 1))
    memory_mib: int = 4096
    output_cap_bytes: int = OUTPUT_CAP_BYTES  # all outputs of one execution; a program over it fails


_SETTINGS = _Settings()


def configure(*, allow: bool, cap_s: float | None = None, min_time_limit_s: float | None = None,
              time_limit_factor: float | None = None, workers: int | None = None, memory_mib: int | None = None) -> None:
    """Set by the evaluation worker before each code task runs (None keeps a value)."""
    _SETTINGS.allow = allow
    for name, value in (("cap_s", cap_s), ("min_time_limit_s", min_time_limit_s),
                        ("time_limit_factor", time_limit_factor), ("memory_mib", memory_mib)):
        if value is not None:
            setattr(_SETTINGS, name, value)
    if workers is not None:
        _SETTINGS.workers = max(1, workers)


def configure_task(spec, *, allow: bool, workers: int | None = None, **overrides) -> None:
    """The limits a suite task sets (TaskSpec.code_*), with per-call overrides (tests, re-grading)."""
    limits = {"cap_s": spec.code_timeout_s, "min_time_limit_s": spec.code_min_time_limit_s,
              "time_limit_factor": spec.code_time_limit_factor}
    configure(allow=allow, workers=workers, **{**limits, **overrides})


def wall_backstop_s() -> float:
    """Wall-clock backstop for a program that blocks without using CPU; scaled by the load, so a
    busy machine never turns a CPU-bounded program into a timeout."""
    load = max(1.0, _SETTINGS.workers / (os.cpu_count() or 1))
    return 2 * _SETTINGS.cap_s * load + 5


# --------------------------------------------------------------------------- documents


def _add_fields(doc: dict, dataset: str) -> dict:
    """A row whose test cannot be read is kept (its samples fail with the reason; --check-graders
    reports it) rather than stopping the whole task. EvalPlus's own release rows (`base_input`,
    `plus_input`, `atol`, no `test`) name their entry point."""
    if "test" not in doc and "base_input" in doc:
        return {"evalplus_entry_point": doc["entry_point"], "evalplus_oracle": oracle_for(dataset, doc["entry_point"]),
                "evalplus_patch": ""}
    try:
        test = parse_hub_test(doc["test"], doc.get("entry_point") if dataset == "humaneval" else None)
    except HubTestError as error:
        return {"evalplus_entry_point": doc.get("entry_point") or "", "evalplus_oracle": "unreadable",
                "evalplus_patch": f"hub test not understood: {error}"}
    oracle = oracle_for(dataset, test.entry_point)
    return {"evalplus_entry_point": test.entry_point, "evalplus_oracle": oracle,
            "evalplus_patch": HUB_PATCHES.get(oracle, "")}


def humaneval_process_docs(dataset):
    """evalplus/humanevalplus rows, with the fields EvalPlus's grader needs."""
    return dataset.map(lambda doc: _add_fields(doc, "humaneval"))


def mbpp_process_docs(dataset):
    """evalplus/mbppplus rows: EvalPlus's MBPP+ prompt, and the entry point the test itself calls."""

    def add(doc: dict) -> dict:
        return {"evalplus_prompt": f'"""\n{doc["prompt"]}\n{doc["test_list"][0]}\n"""\n', **_add_fields(doc, "mbpp")}

    return dataset.map(add)


# --------------------------------------------------------------------------- grading


def _dataset(doc: dict) -> str:
    return "mbpp" if "test_list" in doc or str(doc.get("task_id", "")).startswith("Mbpp/") else "humaneval"


def reference_solution(doc: dict) -> str:
    """EvalPlus's ground truth: prompt + canonical_solution (HumanEval+, and EvalPlus's own release
    rows), the MBPP `code` (MBPP+ hub rows)."""
    if "code" in doc and "test" in doc:
        return doc["code"]
    return doc["prompt"] + doc["canonical_solution"]


def _execute(job: dict, cap_s: float, on_record=None) -> Execution:
    return execute(job, cap_s=cap_s, wall_s=wall_backstop_s(), memory_mib=_SETTINGS.memory_mib,
                   output_cap_bytes=_SETTINGS.output_cap_bytes, on_record=on_record)


def _run_job(solution: str, entry_point: str, inputs: list, limits: list[float], keep_going: bool = False) -> dict:
    return {"mode": "run", "solution": solution, "entry_point": entry_point, "inputs": inputs, "limits": limits,
            "keep_going": keep_going}


_REFERENCE: dict[str, Problem] = {}
_REFERENCE_LOCKS: dict[str, threading.Lock] = {}
_LOCK = threading.Lock()


def _fingerprint(doc: dict) -> str:
    if "test" in doc:
        data = doc["test"]
    else:
        data = json.dumps([encode(doc.get("base_input")), encode(doc.get("plus_input")), doc.get("atol")])
    return hashlib.sha256(json.dumps([reference_solution(doc), data, _SETTINGS.cap_s]).encode()).hexdigest()


def load_problem(doc: dict) -> Problem:
    """The row as EvalPlus grades it, with the canonical solution's outputs and CPU times
    (memoized per problem)."""
    key = _fingerprint(doc)
    with _LOCK:
        lock = _REFERENCE_LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _REFERENCE:
            _REFERENCE[key] = build_problem(doc, _dataset(doc), reference_solution(doc), _execute, _SETTINGS.cap_s)
        return _REFERENCE[key]


def reference_run(doc: dict) -> ExecutionResult:
    """The canonical solution graded like any program, with its CPU time per input."""
    return load_problem(doc).reference


def grade_solution(solution: str, doc: dict) -> ExecutionResult:
    """EvalPlus's differential test of an already sanitized solution: base and plus inputs in
    separate executions (when the row says where they split), each judged here with its own
    tolerance; the first failing run stops the grading."""
    if doc.get("evalplus_oracle") == "unreadable":
        return ExecutionResult("failed", None, 0.0, doc["evalplus_patch"])
    problem = load_problem(doc)
    if problem.error:
        return ExecutionResult("failed", None, 0.0, problem.error)
    times = problem.times
    limits = ([max(_SETTINGS.min_time_limit_s, _SETTINGS.time_limit_factor * t) for t in times]
              if times is not None else [_SETTINGS.cap_s] * len(problem.inputs))
    duration, passed, returncode = 0.0, 0, None
    status, detail = "passed", ""
    for start, end in problem.runs:
        run_limits = limits[start:end]
        judge = RunJudge(problem.oracle, problem.inputs[start:end], problem.expected[start:end], problem.atol, start)
        # EvalPlus's limit per execution: min(cap, sum of the per-input limits) + 1
        cap = min(_SETTINGS.cap_s, sum(run_limits)) + 1 if times is not None else _SETTINGS.cap_s
        execution = _execute(_run_job(solution, problem.entry_point, problem.encoded[start:end], run_limits), cap, judge)
        status, detail = judge.verdict(execution)
        duration, passed, returncode = duration + execution.duration_s, passed + judge.passed, execution.returncode
        if status != "passed":
            break
    verdict = {"n": len(problem.inputs), "passed_inputs": passed, "runs": [end - start for start, end in problem.runs],
               "limits_s": [min(limits), max(limits)] if limits else []}
    return ExecutionResult(status, returncode, duration, detail, verdict)


def grade(completion: str, doc: dict, prompt: str = "") -> dict:
    """Sanitize one completion (after `prompt`, for completion-style tasks), run EvalPlus's test,
    return a JSON-able verdict."""
    entry_point = doc.get("evalplus_entry_point") or doc.get("entry_point") or None
    solution = sanitize((prompt + completion).replace("\t", "    "), entry_point)
    result = grade_solution(solution, doc)
    verdict = {"passed": result.passed, "status": result.status, "detail": result.detail,
               "duration_s": round(result.duration_s, 3), "solution": solution}
    for key in ("n", "passed_inputs", "runs", "limits_s"):
        if key in result.verdict:
            verdict[key] = result.verdict[key]
    if doc.get("evalplus_patch"):
        verdict["patch"] = doc["evalplus_patch"]
    return verdict


def _verdicts(resps: list[list[str]], docs: list[dict], prompt=lambda doc: "") -> list[list[str]]:
    if not _SETTINGS.allow:
        raise CodeExecutionRefused(
            "code execution is off: pass --allow-code-execution (or eval.allow_code_execution: true)"
        )
    jobs = [(completion, doc) for responses, doc in zip(resps, docs) for completion in responses]
    with ThreadPoolExecutor(max_workers=_SETTINGS.workers) as pool:
        verdicts = list(pool.map(lambda job: json.dumps(grade(job[0], job[1], prompt(job[1]))), jobs))
    grouped, position = [], 0
    for responses in resps:
        grouped.append(verdicts[position : position + len(responses)])
        position += len(responses)
    return grouped


def humaneval_verdicts(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    return _verdicts(resps, docs)


def mbpp_verdicts(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    return _verdicts(resps, docs)


def humaneval_completion_verdicts(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """Completion-style (bigcode, MergeBench): the program is the stripped prompt + the completion."""
    return _verdicts(resps, docs, lambda doc: doc["prompt"].strip())


def mbpp_completion_verdicts(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """Completion-style MBPP+: the docstring prompt + the completion."""
    return _verdicts(resps, docs, lambda doc: doc["evalplus_prompt"])


def process_results(doc: dict, results: list) -> dict[str, float]:
    """pass@1: the fraction of an item's samples whose program passed every EvalPlus test (one
    greedy sample: 0 or 1; n samples: c/n, the unbiased pass@1 estimator)."""
    def flat(items):
        for item in items:
            yield from (flat(item) if isinstance(item, list) else [item])

    verdicts = list(flat(results))
    return {"pass@1": sum(1.0 for v in verdicts if json.loads(v)["passed"]) / len(verdicts)}
