"""HumanEval+ / MBPP+ grading on the full EvalPlus test suites, as lm-eval task hooks.

The task YAMLs in `eval/tasks/` point here (`!function featcal_llm.evaluation.evalplus.*`):
a custom filter turns each completion into a verdict (sanitize, build the program with the
dataset's EvalPlus `test` field, run it in a subprocess) and `process_results` reads pass@1
off the verdict. Verdicts are JSON strings, so lm-eval's per-sample log keeps the sanitized
solution, the status and the error next to the raw completion.

Programs run only after `configure(allow=True, ...)`, which the evaluation worker calls when the
user passed the opt-in flag; otherwise the filter refuses before running anything.
"""

from __future__ import annotations

import ast
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from featcal_llm.evaluation.sandbox import ExecutionResult, run_program
from featcal_llm.evaluation.sanitize import sanitize


class CodeExecutionRefused(RuntimeError):
    """Raised when a code task is graded without the user's opt-in."""


@dataclass
class _Settings:
    allow: bool = False
    timeout_s: float = 20.0
    workers: int = max(1, min(8, os.cpu_count() or 1))
    memory_mib: int = 4096


_SETTINGS = _Settings()


def configure(*, allow: bool, timeout_s: float, workers: int | None = None, memory_mib: int = 4096) -> None:
    """Set by the evaluation worker before each code task runs."""
    _SETTINGS.allow = allow
    _SETTINGS.timeout_s = timeout_s
    _SETTINGS.memory_mib = memory_mib
    if workers is not None:
        _SETTINGS.workers = max(1, workers)


# --------------------------------------------------------------------------- programs


def humaneval_program(solution: str, doc: dict) -> str:
    """EvalPlus/bigcode: the solution, the dataset's `test` (defines check), then the call."""
    return f"{solution}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def mbpp_program(solution: str, doc: dict) -> str:
    """The solution, the problem's `test_imports`, then the dataset's full `test` script."""
    imports = "\n".join(doc.get("test_imports") or [])
    return f"{solution}\n\n{imports}\n\n{doc['test']}\n"


def mbpp_entry_point(code: str, assertion: str) -> str | None:
    """EvalPlus's rule: the reference solution's function whose name the first assert uses."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    names = sorted(node.name for node in tree.body if isinstance(node, ast.FunctionDef))
    called = [name for name in names if re.search(rf"\b{re.escape(name)}\s*\(", assertion)]
    used = called or [name for name in names if name in assertion]
    return used[0] if used else None


def mbpp_process_docs(dataset):
    """Add EvalPlus's MBPP+ prompt and entry point to each row of evalplus/mbppplus."""

    def add_fields(doc: dict) -> dict:
        first_assert = doc["test_list"][0]
        return {
            "evalplus_prompt": f'"""\n{doc["prompt"]}\n{first_assert}\n"""\n',
            "entry_point": mbpp_entry_point(doc["code"], first_assert) or "",
        }

    return dataset.map(add_fields)


# --------------------------------------------------------------------------- grading


def grade(completion: str, doc: dict, build_program) -> dict:
    """Sanitize one completion, run it against the full tests, return a JSON-able verdict."""
    solution = sanitize(completion.replace("\t", "    "), doc.get("entry_point") or None)
    result: ExecutionResult = run_program(build_program(solution, doc), _SETTINGS.timeout_s, _SETTINGS.memory_mib)
    return {"passed": result.passed, "status": result.status, "detail": result.detail,
            "duration_s": round(result.duration_s, 3), "solution": solution}


def _verdicts(resps: list[list[str]], docs: list[dict], build_program) -> list[list[str]]:
    if not _SETTINGS.allow:
        raise CodeExecutionRefused(
            "code execution is off: pass --allow-code-execution (or eval.allow_code_execution: true)"
        )
    jobs = [(completion, doc) for responses, doc in zip(resps, docs) for completion in responses]
    with ThreadPoolExecutor(max_workers=_SETTINGS.workers) as pool:
        verdicts = list(pool.map(lambda job: json.dumps(grade(job[0], job[1], build_program)), jobs))
    grouped, position = [], 0
    for responses in resps:
        grouped.append(verdicts[position : position + len(responses)])
        position += len(responses)
    return grouped


def humaneval_verdicts(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    return _verdicts(resps, docs, humaneval_program)


def mbpp_verdicts(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    return _verdicts(resps, docs, mbpp_program)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """pass@1 of a greedy sample: 1.0 if its program passed every EvalPlus test."""
    return {"pass@1": 1.0 if json.loads(results[0])["passed"] else 0.0}
