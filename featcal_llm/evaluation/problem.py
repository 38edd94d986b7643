"""One HumanEval+/MBPP+ problem as the grader holds it, in the grader's own process.

The inputs go to every program's process; the expected outputs never do. Where EvalPlus runs the
base inputs and the plus inputs as two executions (evalplus/evaluate.py, check_correctness), so do
we, when the row says where they split:
- EvalPlus's release rows (`base_input`, `plus_input`, `atol`): exactly, and the expected outputs
  are the canonical solution's, as EvalPlus's get_groundtruth computes them;
- MBPP+ hub rows: the exporter joined (and deduplicated) both lists; the base inputs are the
  original MBPP asserts' arguments (`test_list`), taken as the split when they are exactly the first
  inputs of the row (oracle.mbpp_base_count);
- HumanEval+ hub rows do not say, and are run as one execution (docs/evaluation.md, deviations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from featcal_llm.evaluation.codec import CodecError, decode, encode
from featcal_llm.evaluation.judge import ExecutionResult, RunJudge
from featcal_llm.evaluation.oracle import HubTestError, mbpp_base_count, oracle_for, parse_hub_test
from featcal_llm.evaluation.sandbox import Execution

# EvalPlus's MBPP_OUTPUT_NOT_NONE_TASKS: the ground truth is whether the output is not None.
NOT_NONE_ENTRY_POINTS = ("check_str", "text_match_three", "text_starta_endb")

Executor = Callable[..., Execution]


class ProblemError(ValueError):
    """The row's data or its canonical solution cannot be used."""


@dataclass(frozen=True)
class Problem:
    entry_point: str
    oracle: str
    atol: float
    encoded: list                  # the inputs as a program's process receives them (codec form)
    inputs: list                   # the same, decoded here (for the oracles that read the input)
    expected: list                 # decoded expected outputs: never sent to a program
    runs: list[tuple[int, int]]    # [start, end) of each execution: EvalPlus's base, then plus
    times: list[float] | None      # the canonical solution's CPU time per input
    reference: ExecutionResult     # the canonical solution graded like any program
    error: str = ""


def _runs(total: int, base: int | None) -> list[tuple[int, int]]:
    if base is None or base <= 0 or base >= total:
        return [(0, total)]
    return [(0, base), (base, total)]


def _hub_data(doc: dict, dataset: str, execute: Executor, cap_s: float):
    try:
        test = parse_hub_test(doc["test"], doc.get("entry_point") if dataset == "humaneval" else None)
    except HubTestError as error:
        raise ProblemError(f"hub test not understood: {error}") from None
    execution = execute({"mode": "data", "setup": test.setup}, cap_s)
    if execution.returncode != 0 or execution.problem or execution.wall_timeout:
        reason = execution.problem or execution.stderr_tail[-300:] or f"exit code {execution.returncode}"
        raise ProblemError(f"the hub test's data did not load: {reason}")
    try:
        encoded = [record["inp"] for record in execution.records]
        inputs = [decode(form) for form in encoded]
        expected = [decode(record["exp"]) for record in execution.records]
    except (KeyError, CodecError) as error:
        raise ProblemError(f"the hub test's data did not load: {error}") from None
    base = mbpp_base_count(doc.get("test_list") or [], test.entry_point, inputs) if dataset == "mbpp" else None
    return test.entry_point, test.atol, encoded, inputs, expected, _runs(len(inputs), base)


def _release_data(doc: dict):
    base, plus = list(doc["base_input"]), list(doc.get("plus_input") or [])
    inputs = base + plus
    return doc["entry_point"], float(doc.get("atol") or 0), [encode(x) for x in inputs], inputs, None, \
        _runs(len(inputs), len(base))


def build_problem(doc: dict, dataset: str, solution: str, execute: Executor, cap_s: float) -> Problem:
    """Load the row's data, run the canonical solution on every input (each EvalPlus execution in
    its own process, every input under the whole cap, going on past failures to time them all)."""
    try:
        if "test" in doc:
            entry_point, atol, encoded, inputs, expected, runs = _hub_data(doc, dataset, execute, cap_s)
        else:
            entry_point, atol, encoded, inputs, expected, runs = _release_data(doc)
    except (ProblemError, KeyError, TypeError, ValueError) as error:
        message = str(error) if isinstance(error, ProblemError) else f"row not understood: {type(error).__name__} {error}"
        failed = ExecutionResult("failed", None, 0.0, message)
        return Problem("", "default", 0.0, [], [], [], [], None, failed, message)
    oracle = oracle_for(dataset, entry_point)
    records, duration, executions = [], 0.0, []
    for start, end in runs:
        job = {"mode": "run", "solution": solution, "entry_point": entry_point, "inputs": encoded[start:end],
               "limits": [cap_s] * (end - start), "keep_going": True}
        execution = execute(job, cap_s)
        executions.append(execution)
        duration += execution.duration_s
        by_index = {record.get("i"): record for record in execution.records if "i" in record}
        records.extend(by_index.get(index - start, {"i": index - start, "error": "no output"}) for index in range(start, end))
    times = [float(record.get("t", cap_s)) if "out" in record else cap_s for record in records]
    error = ""
    if expected is None:  # EvalPlus's release rows: the canonical solution's outputs are the truth
        failing = next((index for index, record in enumerate(records) if "out" not in record), None)
        if failing is not None:
            error = f"the canonical solution fails on input {failing}: {records[failing].get('error') or records[failing].get('timeout')}"
            expected = [None] * len(inputs)
        else:
            expected = [decode(record["out"]) for record in records]
            if dataset == "mbpp" and entry_point in NOT_NONE_ENTRY_POINTS:
                expected = [out is not None for out in expected]
    status, detail = "passed", error
    for (start, end), execution in zip(runs, executions):
        judge = RunJudge(oracle, inputs[start:end], expected[start:end], atol, start)
        for record in records[start:end]:
            if not judge(record):
                break
        status, detail = judge.verdict(execution)
        if status != "passed":
            break
    if error:
        status = "failed"
    reference = ExecutionResult(status, executions[-1].returncode if executions else None, duration, detail,
                                {"n": len(inputs), "times": times, "runs": [end - start for start, end in runs]})
    return Problem(entry_point, oracle, atol, encoded, inputs, expected, runs, times, reference, error)
