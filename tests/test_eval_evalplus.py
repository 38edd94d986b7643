"""HumanEval+/MBPP+ graded as EvalPlus grades them, on fixture rows in the hub's real `test` format
(eval/fixtures/evalplus/): the export's known-bad rows, EvalPlus's special oracles and rules.

Each case says what running the hub test as-is (the grader before issue 12) concluded; every case
where that differs from EvalPlus is a grading fix this file guards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featcal_llm.evaluation import evalplus
from featcal_llm.evaluation.oracle import HubTestError, parse_hub_test

FIXTURES = Path(__file__).resolve().parents[1] / "eval" / "fixtures"


def _rows(path) -> dict:
    rows = {}
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        doc.update(evalplus._add_fields(doc, "mbpp" if "test_list" in doc else "humaneval"))
        rows[str(doc["task_id"])] = doc
    return rows


DOCS = {**_rows(FIXTURES / "evalplus" / "humaneval_plus.jsonl"), **_rows(FIXTURES / "evalplus" / "mbpp_plus.jsonl"),
        **_rows(FIXTURES / "mergebench" / "humaneval_plus.jsonl"), **_rows(FIXTURES / "mergebench" / "mbpp_plus.jsonl")}

FIND_ZERO = DOCS["HumanEval/32"]["canonical_solution"]
# (task, completion, passes under EvalPlus, passed with the hub test run as-is)
CASES = {
    "find_zero_right": ("HumanEval/32", "import math\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in "
                        "enumerate(xs))\n\ndef find_zero(xs):\n" + FIND_ZERO, True, False),
    "find_zero_wrong": ("HumanEval/32", "def find_zero(xs):\n    return 0.0\n", False, False),
    "tuple_for_list": ("HumanEval/fixture-3", "def halves(numbers):\n    return tuple(n / 2 for n in numbers)\n", False, True),
    "list_right": ("HumanEval/fixture-3", "def halves(numbers):\n    return [n / 2 for n in numbers]\n", True, True),
    "decorated": ("HumanEval/fixture-0", "import functools\n\n@functools.lru_cache(maxsize=None)\ndef add(x, y):\n"
                  "    return x + y\n", False, True),
    "np_not_imported": ("HumanEval/fixture-1", "def mean(numbers):\n    return float(np.mean(numbers))\n", False, True),
    "math_not_imported": ("9002", "def circle_area(r):\n    return math.pi * r * r\n", False, True),
    "not_none_always_none": ("737", "def check_str(string):\n    return None\n", False, True),
    "not_none_always_true": ("794", "def text_starta_endb(text):\n    return True\n", False, True),
    "not_none_right": ("787", "import re\ndef text_match_three(text):\n    return re.search('abbb', text)\n", True, True),
    "any_output_oracle": ("164", "def are_equivalent(a, b):\n    return sum(i for i in range(1, a + 1) if a % i == 0) == "
                          "sum(i for i in range(1, b + 1) if b % i == 0)\n", True, False),
    "or_zero_oracle": ("295", "def sum_div(n):\n    return sum(i for i in range(1, n) if n % i == 0)\n", True, False),
    "entry_point_from_test_call": ("9004", "def base_area(side):\n    return side * side\n\n"
                                   "def prism_volume(area, height):\n    return area * height\n", True, False),
}


@pytest.fixture(autouse=True)
def allowed():
    evalplus.configure(allow=True, cap_s=10.0, min_time_limit_s=0.5, time_limit_factor=4.0, workers=2, memory_mib=1024)
    yield
    evalplus.configure(allow=False, cap_s=60.0, min_time_limit_s=4.0, time_limit_factor=4.0, memory_mib=4096)


@pytest.mark.parametrize("case", sorted(CASES))
def test_graded_as_evalplus(case):
    task, completion, passes, _hub_as_is = CASES[case]
    verdict = evalplus.grade(completion, DOCS[task])
    assert verdict["passed"] is passes, verdict


def test_canonical_solutions_pass_and_patched_rows_say_so():
    for task, doc in DOCS.items():
        reference = evalplus.reference_run(doc)
        assert reference.passed, (task, reference.detail)
        assert len(reference.verdict["times"]) == reference.verdict["n"]
    patched = {task for task, doc in DOCS.items() if doc["evalplus_patch"]}
    assert patched == {"HumanEval/32", "737", "787", "794", "164", "295"}
    assert "never asserts" in evalplus.grade(CASES["not_none_always_none"][1], DOCS["737"])["patch"]


def test_hub_rows_parse_as_evalplus_reads_them():
    he = parse_hub_test(DOCS["HumanEval/32"]["test"], "find_zero")
    assert (he.entry_point, he.atol, he.cross_check) == ("find_zero", 0.0001, False)
    assert "def check" not in he.setup and "inputs = [[[1, 2]]" in he.setup
    mbpp = parse_hub_test(DOCS["9004"]["test"])
    assert (mbpp.entry_point, mbpp.atol) == ("prism_volume", 0.0)  # the test's call, not test_list[0]'s first name
    assert DOCS["9004"]["evalplus_entry_point"] == "prism_volume"
    assert DOCS["164"]["evalplus_oracle"] == "any_output" and DOCS["9001"]["evalplus_oracle"] == "default"
    with pytest.raises(HubTestError, match="expected one entry point"):
        parse_hub_test("inputs = [[1]]\nresults = [1]\nfor i, (inp, exp) in enumerate(zip(inputs, results)):\n"
                       "    assertion(f(*inp) + g(*inp), exp, 0)\n")


def test_cross_check_rows_take_expected_outputs_from_ref_func():
    test = ("import numpy as np\nfrom math import inf\n\ndef assertion(out, exp, atol):\n    assert out == exp\n\n"
            "def ref_func(n):\n    return list(range(n))\n\ninputs = [[3], [5]]\nfor i, inp in enumerate(inputs):\n"
            "    assertion(upto(*inp), ref_func(*inp), 0)\n")
    doc = {"task_id": 9100, "code": "def upto(n):\n    return list(range(n))", "test": test, "test_list": ["assert upto(1) == [0]"]}
    assert parse_hub_test(test).cross_check
    assert evalplus.grade("def upto(n):\n    return [i for i in range(n)]\n", doc)["passed"]
    assert not evalplus.grade("def upto(n):\n    return list(range(n + 1))\n", doc)["passed"]


def test_time_limits_are_per_input_cpu_seconds_from_the_canonical_time():
    doc = DOCS["9001"]
    slow_on_last = ("def sum_of_squares(n):\n    if n == 100:\n        while True:\n            pass\n"
                    "    return sum(i * i for i in range(1, n + 1))\n")
    verdict = evalplus.grade(slow_on_last, doc)
    assert verdict["status"] == "timeout" and verdict["detail"].startswith("input 5: over the 0.5 s CPU limit")
    assert verdict["passed_inputs"] == 5 and verdict["limits_s"] == [0.5, 0.5]  # max(0.5 s, 4 x ~0 s)
    # a limit on CPU time, not wall time: a program that waits (as under a loaded machine) is not cut
    sleeper = "import time\n\ndef sum_of_squares(n):\n    time.sleep(0.8 if n == 0 else 0)\n    return sum(i * i for i in range(1, n + 1))\n"
    assert evalplus.grade(sleeper, doc)["passed"]
    # the limit follows the canonical solution's time: factor x its CPU time when that is larger
    evalplus.configure(allow=True, min_time_limit_s=0.0, time_limit_factor=1e7)
    limits = evalplus.grade(CASES["list_right"][1].replace("halves", "sum_of_squares").replace(
        "[n / 2 for n in numbers]", "sum(i * i for i in range(1, numbers + 1))"), doc)["limits_s"]
    assert limits[0] > 0 and limits[1] > limits[0]


def test_wall_backstop_grows_with_the_load(monkeypatch):
    monkeypatch.setattr(evalplus.os, "cpu_count", lambda: 2)
    evalplus.configure(allow=True, cap_s=10.0, workers=2)
    assert evalplus.wall_backstop_s() == 25.0
    evalplus.configure(allow=True, workers=8)
    assert evalplus.wall_backstop_s() == 85.0


def test_check_graders_canary_on_fixture_rows(monkeypatch):
    from click.testing import CliRunner

    from featcal_llm.cli import main
    from featcal_llm.evaluation import canary

    rows = {task: [json.loads(line) for name in ("evalplus", "mergebench")
                   for line in (FIXTURES / name / f"{task}.jsonl").read_text().splitlines()]
            for task in ("humaneval_plus", "mbpp_plus")}
    reports = [canary.check_task(task, rows[task], workers=2) for task in rows]
    assert [r.line() for r in reports] == [
        "humaneval_plus: canonical solutions pass 5/5; known-wrong solutions fail 5/5",
        "mbpp_plus: canonical solutions pass 9/9; known-wrong solutions fail 8/8",  # Mbpp/164 accepts any output
    ]
    # a grader that accepts anything is caught
    from featcal_llm.evaluation import judge

    with monkeypatch.context() as patched:
        patched.setattr(judge, "check_output", lambda oracle, out, exp, inp, atol: atol)
        broken = canary.check_task("mbpp_plus", rows["mbpp_plus"], workers=2)
    assert not broken.ok and broken.wrong_failed == 0 and "a solution returning None passes" in broken.line()
    # the command: local copies, exit 0 when all is well; a wrong --data key is a one-line error
    he, mbpp = FIXTURES / "evalplus" / "humaneval_plus.jsonl", FIXTURES / "evalplus" / "mbpp_plus.jsonl"
    result = CliRunner().invoke(main, ["eval", "--check-graders", "--code-workers", "2",
                                       "--data", f"humaneval_plus={he}", "--data", f"mbpp_plus={mbpp}"])
    assert result.exit_code == 0, result.output
    assert "humaneval_plus: canonical solutions pass 2/2" in result.output
    bad = CliRunner().invoke(main, ["eval", "--check-graders", "--data", f"gsm8k={he}"])
    assert bad.exit_code == 2 and "--check-graders checks humaneval_plus, mbpp_plus only" in bad.output


def test_huge_integers_and_unreadable_rows():
    big = "1" + "0" * 5000  # EvalPlus's exports hold expected outputs beyond Python's 4,300-digit default
    test = (f"import numpy as np\n\ndef assertion(out, exp, atol):\n    assert out == exp\n\n"
            f"inputs = [[5000]]\nresults = [{big}]\nfor i, (inp, exp) in enumerate(zip(inputs, results)):\n"
            "    assertion(power_of_ten(*inp), exp, 0)\n")
    doc = {"task_id": 9200, "code": "def power_of_ten(n):\n    return 10 ** n", "test": test, "test_list": ["x"]}
    doc.update(evalplus._add_fields(doc, "mbpp"))
    assert doc["evalplus_entry_point"] == "power_of_ten"
    assert evalplus.grade("def power_of_ten(n):\n    return 10 ** n\n", doc)["passed"]
    unreadable = {"task_id": 9201, "code": "", "test": "print('no loop here')\n", "test_list": ["x"]}
    unreadable.update(evalplus._add_fields(unreadable, "mbpp"))
    verdict = evalplus.grade("def f():\n    return 1\n", unreadable)
    assert not verdict["passed"] and verdict["detail"].startswith("hub test not understood: no `for")


# ------------------------------------------------------------------ audit: `eval --check-graders` on bad local copies

def _check_graders(tmp_path, humaneval_text: str | None, *extra: str):
    from click.testing import CliRunner

    from featcal_llm.cli import main

    local = tmp_path / "humaneval_plus.jsonl"
    if humaneval_text is not None:
        local.write_text(humaneval_text)
    else:
        local = FIXTURES / "evalplus" / "humaneval_plus.jsonl"
    return CliRunner().invoke(main, ["eval", "--check-graders", "--data", f"humaneval_plus={local}",
                                     "--data", f"mbpp_plus={FIXTURES / 'evalplus' / 'mbpp_plus.jsonl'}", *extra])


def test_check_graders_refuses_a_truncated_jsonl_in_one_line(tmp_path):
    result = _check_graders(tmp_path, '{"task_id": "HumanEval/0", "prompt": "de\n')
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "humaneval_plus.jsonl" in lines[0] and "Traceback" not in result.output


def test_check_graders_refuses_rows_of_another_schema_in_one_line(tmp_path):
    result = _check_graders(tmp_path, '{"question": "1+1?", "answer": "2"}\n')
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "humaneval_plus" in lines[0] and "test" in lines[0]


def test_check_graders_refuses_an_empty_local_copy(tmp_path):
    result = _check_graders(tmp_path, "")
    assert result.exit_code != 0 and "humaneval_plus" in result.output, result.output


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_check_graders_refuses_a_non_positive_worker_count(tmp_path, workers):
    result = _check_graders(tmp_path, None, "--code-workers", workers)
    assert result.exit_code == 2 and "--code-workers" in result.stderr, result.output


# ------------------------------------------------------------------ mutation round 8: tests a surviving mutation showed missing

EVALPLUS = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "evalplus"


def _rows(task):
    return [json.loads(line) for line in (EVALPLUS / f"{task}.jsonl").read_text().splitlines()]


def test_a_local_copy_may_hold_blank_lines_and_each_task_s_rows_are_its_own(tmp_path):
    """A blank line (an editor's trailing one) is no row; a HumanEval+ row names its entry_point, an MBPP+ row its
    prompt, and either its test (the hub's) or base_input (EvalPlus's release): another dataset's rows are refused."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.canary import local_rows

    humaneval = _rows("humaneval_plus")
    path = tmp_path / "he.jsonl"
    path.write_text("\n" + json.dumps(humaneval[0]) + "\n\n  \n" + json.dumps(humaneval[1]) + "\n\n")
    assert local_rows("humaneval_plus", path) == humaneval
    released = {key: value for key, value in humaneval[0].items() if key != "test"} | {"base_input": [[[1, 2]]]}
    path.write_text(json.dumps(released) + "\n")
    assert local_rows("humaneval_plus", path) == [released]
    for task, row, number in (
        ("humaneval_plus", {key: value for key, value in humaneval[0].items() if key != "test"}, 1),  # no test at all
        ("humaneval_plus", {key: value for key, value in humaneval[0].items() if key != "entry_point"}, 1),
        ("mbpp_plus", {key: value for key, value in _rows("mbpp_plus")[0].items() if key != "prompt"}, 1),
    ):
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(FeatCalError, match=rf"^--data {task}={path}: line {number} is not a row of evalplus/"):
            local_rows(task, path)
    mbpp = _rows("mbpp_plus")[0]
    assert "entry_point" not in mbpp
    path.write_text(json.dumps(mbpp) + "\n")
    assert local_rows("mbpp_plus", path) == [mbpp]


def test_a_canonical_solution_that_fails_is_counted_and_named():
    from featcal_llm.evaluation import canary

    rows = _rows("humaneval_plus")
    broken = dict(rows[1], canonical_solution="    return None\n")
    report = canary.check_task("humaneval_plus", [rows[0], broken], workers=1)
    assert (report.problems, report.canonical_passed, report.wrong_checked, report.wrong_failed) == (2, 1, 2, 2)
    assert not report.ok and len(report.failures) == 1
    assert report.failures[0].startswith(f"{broken['task_id']} canonical solution fails (")
    assert report.line().startswith("humaneval_plus: canonical solutions pass 1/2; known-wrong solutions fail 2/2; "
                                    f"1 problem(s): {broken['task_id']} canonical solution fails (")
