"""The verdict, computed in the grader's process from the outputs a run sent back.

EvalPlus compares inside the child (evalplus/eval/__init__.py, unsafe_execute); here the same oracle
runs in the parent on decoded outputs (codec.py), so nothing the program writes is a verdict and
no method it defined is called. One `RunJudge` per execution: EvalPlus's tolerance switches to
1e-6 at the first float expected output and stays on until the end of that run, and a new run
(EvalPlus's plus inputs, after its base inputs) starts with the problem's own tolerance again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from featcal_llm.evaluation.codec import CodecError, decode
from featcal_llm.evaluation.sandbox import Execution

_MESSAGE_CHARS = 300


def is_floats(x) -> bool:
    """EvalPlus's is_floats: a float, a non-empty list/tuple of floats, or a float numpy array."""
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    if isinstance(x, np.ndarray):
        return x.dtype == np.float64 or x.dtype == np.float32
    return False


def _poly(xs, x):
    return sum(coefficient * math.pow(x, power) for power, coefficient in enumerate(xs))


def _surface_area(base_edge, height):
    """Mbpp/581's alternative reading: `height` is the pyramid's perpendicular height."""
    slant = math.sqrt((base_edge / 2) ** 2 + height ** 2)
    return round(base_edge ** 2 + 2 * base_edge * slant)


def _digit_distance(first, second):
    """Mbpp/558's alternative reading: digits compared after zero-padding to the same length."""
    a, b = str(first), str(second)
    width = max(len(a), len(b))
    return sum(abs(int(x) - int(y)) for x, y in zip(a.zfill(width), b.zfill(width)))


def check_output(oracle: str, out, exp, inp, atol: float) -> float:
    """Assert `out` is right for `inp` (EvalPlus's oracle, special cases included); returns the
    tolerance for the rest of the run."""
    if oracle == "poly_root":
        assert abs(_poly(*inp, out)) <= atol
        return atol
    exact = out == exp
    if oracle == "any_output":
        exact = True
    elif oracle == "or_zero":
        exact = exact or out == 0
    elif oracle == "surface_area":
        exact = exact or abs(out - _surface_area(*inp)) <= atol
    elif oracle == "digit_distance":
        exact = exact or out == _digit_distance(*inp)
    elif oracle == "set_equal":
        exact = set(out) == set(exp)
    elif oracle == "not_none":
        exact = out == exp if isinstance(out, bool) else exp == (out is not None)
    if atol == 0 and is_floats(exp):
        atol = 1e-6
    if not exact and atol != 0:
        assert type(out) == type(exp), f"type {type(out).__name__}, expected {type(exp).__name__}"  # noqa: E721
        if isinstance(exp, (list, tuple)):
            assert len(out) == len(exp), f"length {len(out)}, expected {len(exp)}"
        assert np.allclose(out, exp, rtol=1e-07, atol=atol)
    else:
        assert exact
    return atol


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class RunJudge:
    """EvalPlus's check of one run, fed record by record (sandbox.execute's `on_record`); returns
    False at the first failure, so the program is stopped there (EvalPlus's fast check)."""

    def __init__(self, oracle: str, inputs: list, expected: list, atol: float, offset: int = 0):
        self.oracle, self.inputs, self.expected, self.atol, self.offset = oracle, inputs, expected, atol, offset
        self.passed = 0
        self.failure: tuple[str, str] | None = None
        self.times: list[float] = []
        self.outputs: list = []

    def __call__(self, record: dict) -> bool:
        if self.failure is not None:
            return False
        if "define_error" in record:
            self.failure = ("failed", str(record["define_error"])[:_MESSAGE_CHARS])
            return False
        index, label = self.passed, f"input {self.offset + self.passed}"
        if record.get("i") != index or index >= len(self.inputs):
            self.failure = ("failed", f"{label}: unexpected record from the program's process")
        elif "timeout" in record:
            self.failure = ("timeout", f"{label}: {str(record['timeout'])[:_MESSAGE_CHARS]}")
        elif "error" in record:
            self.failure = ("failed", f"{label}: {str(record['error'])[:_MESSAGE_CHARS]}")
        else:
            out = None
            try:
                out = decode(record["out"])
                self.atol = check_output(self.oracle, out, self.expected[index], self.inputs[index], self.atol)
            except (CodecError, KeyError) as error:
                self.failure = ("failed", f"{label}: unreadable output ({error})")
            except Exception as error:  # noqa: BLE001 - a comparison that raises is a failure, as in EvalPlus
                detail = f" {error}" if str(error) else ""
                self.failure = ("failed", f"{label}: wrong output {_short(out)}{detail}"[:_MESSAGE_CHARS])
            else:
                self.passed += 1
                self.outputs.append(out)
                self.times.append(float(record.get("t", 0.0)))
        return self.failure is None

    def verdict(self, execution: Execution) -> tuple[str, str]:
        """(status, detail) of the run: passed only if every input's output was right."""
        if self.failure is not None:
            return self.failure
        if execution.problem:
            return "failed", execution.problem
        if self.passed == len(self.inputs):
            return "passed", ""
        if execution.wall_timeout:
            return "timeout", "no result within the wall-clock backstop"
        if execution.signal_name == "SIGXCPU":
            return "timeout", "over the run's CPU-time limit"
        if execution.signal_name:
            return "crashed", f"killed by {execution.signal_name}. {execution.stderr_tail[-300:]}".strip()
        if execution.returncode:
            return "failed", execution.stderr_tail[-300:] or f"exit code {execution.returncode}"
        return "failed", "exited before the tests finished"


@dataclass(frozen=True)
class ExecutionResult:
    """A program's grade: status, how long it ran, the first failure, and details for the record."""

    status: str  # passed | failed | timeout | crashed
    returncode: int | None
    duration_s: float
    detail: str
    verdict: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return asdict(self)
