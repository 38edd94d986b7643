"""Every MergeBench task type scores canned completions exactly as expected, through the same
lm-eval task configs, filters and metrics a real run uses (the model is replaced by replay)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from featcal_llm.evaluation.evalplus import CodeExecutionRefused  # noqa: E402
from featcal_llm.evaluation.replay import grade_completions  # noqa: E402
from featcal_llm.evaluation.suite import load_suite  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench"


@pytest.fixture(scope="module")
def suite():
    return load_suite("mergebench")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def grade(suite, task_id, completions, **kwargs):
    return grade_completions(suite, task_id, completions, data=FIXTURES / f"{task_id}.jsonl", **kwargs)


def test_math500_latex_answers(suite):
    completions = [
        # 1/2 + 1/3: right, but written \dfrac inside \boxed, no Minerva "Final Answer" sentence
        "We get $\\frac{3}{6}+\\frac{2}{6}=\\boxed{\\dfrac{5}{6}}$.",
        # sqrt(144): wrong
        "Since $11^2 = 121$, the answer is $\\boxed{11}$.\nFinal Answer: The final answer is $11$. I hope it is correct.",
        # 3x - 5 = 10: right, in Minerva's format
        "Adding 5 gives $3x = 15$, so $x = 5$.\nFinal Answer: The final answer is $5$. I hope it is correct.",
    ]
    score, samples = grade(suite, "math500", completions)
    assert [s["primary"] for s in samples] == [1.0, 0.0, 1.0]
    assert score == pytest.approx(2 / 3)
    # Minerva's exact_match misses the boxed-only answer: why the suite reports math_verify
    assert [s["exact_match"] for s in samples] == [0, 0, 1]


def test_gsm8k_chain_of_thought(suite):
    completions = [
        "Tom has 3 * 4 = 12 apples. After eating 2 he has 12 - 2 = 10 apples. The final answer is 10",
        "3 pens cost 6 dollars and 2 notebooks cost 10 dollars. The final answer is 15",
        "Each student gets 1,200 / 30 = 40 stickers. So the total is $40.",
    ]
    score, samples = grade(suite, "gsm8k", completions)
    assert [s["primary"] for s in samples] == [1.0, 0.0, 1.0]
    assert score == pytest.approx(2 / 3)


def test_arc_challenge_letters(suite):
    # lm-eval's arc_challenge_chat appends "The best answer is" and stops at "."
    score, samples = grade(suite, "arc_challenge", [" B", " C", " C"])
    assert [s["primary"] for s in samples] == [1.0, 0.0, 1.0]  # item 3 has labels 1-4, key "3" = C
    assert score == pytest.approx(2 / 3)


def test_ifeval_meets_and_breaks_instructions(suite):
    completions = [
        "the sea is wide and deep and blue.",                 # all lowercase: follows
        "* Apple\n* Pear, Plum\n* Fig",                       # 3 bullets but a comma: breaks
        "A bicycle has a chain and a wheel at each end. Is there anything else I can help with?",
    ]
    score, samples = grade(suite, "ifeval", completions)
    assert [s["primary"] for s in samples] == [1.0, 0.0, 1.0]
    assert samples[1]["inst_level_strict_acc"] == [True, False]
    assert score == pytest.approx(2 / 3)


HUMANEVAL_COMPLETIONS = [
    # correct, with the markdown and prose a chat model adds around it
    "def add(x: int, y: int) -> int:\n    return x + y\n```\n\nThis adds the numbers.",
    # wrong: passes the docstring example (mean([1,2,3]) == 2) but is integer division
    "from typing import List\n\ndef mean(numbers: List[float]) -> float:\n    return sum(numbers) // len(numbers)\n",
    # correct, via a helper the sanitizer must keep, plus example usage it must drop
    "def _reverse(s):\n    return s[::-1]\n\ndef is_palindrome(text: str) -> bool:\n    return text == _reverse(text)\n\n"
    "assert is_palindrome('x') is False\n",
]


def test_humaneval_plus_full_evalplus_tests(suite):
    score, samples = grade(suite, "humaneval_plus", HUMANEVAL_COMPLETIONS, allow_code_execution=True)
    assert [s["primary"] for s in samples] == [1.0, 0.0, 1.0]
    verdicts = [json.loads(s["filtered_resps"][0]) for s in samples]
    assert [v["status"] for v in verdicts] == ["passed", "failed", "passed"]
    assert "assert is_palindrome" not in verdicts[2]["solution"]
    assert score == pytest.approx(2 / 3)


def test_mbpp_plus_grades_the_extended_tests_not_the_three_asserts(suite):
    completions = [
        # passes the three MBPP asserts (n = 2, 3, 4) but not EvalPlus's n = 0
        "def sum_of_squares(n):\n    return n * (n + 1) * (2 * n + 1) // 6 if n > 0 else -1\n",
        "import math\ndef circle_area(r):\n    return math.pi * r ** 2\n",
        "def first_repeated_char(s):\n    for i, c in enumerate(s):\n        if c in s[:i]:\n            return c\n    return None\n",
    ]
    score, samples = grade(suite, "mbpp_plus", completions, allow_code_execution=True)
    assert [s["primary"] for s in samples] == [0.0, 1.0, 1.0]
    assert score == pytest.approx(2 / 3)
    first = json.loads(samples[0]["filtered_resps"][0])
    assert first["status"] == "failed" and first["detail"] == "input 3: wrong output -1"  # n = 0, the first plus input
    assert first["runs"] == [3, 3]  # the three asserts' inputs, then the plus inputs: two executions


def test_code_is_not_run_without_opt_in(suite):
    with pytest.raises(CodeExecutionRefused, match="--allow-code-execution"):
        grade(suite, "humaneval_plus", HUMANEVAL_COMPLETIONS, allow_code_execution=False)


def test_hanging_and_crashing_programs_fail_without_stopping_the_run(suite):
    completions = [
        "def add(x: int, y: int) -> int:\n    while True:\n        pass\n    return 0\n",
        "import ctypes\n\ndef mean(numbers):\n    ctypes.string_at(0)\n    return 0.0\n",
        HUMANEVAL_COMPLETIONS[2],
    ]
    score, samples = grade(suite, "humaneval_plus", completions, allow_code_execution=True,
                           code_limits={"min_time_limit_s": 0.5, "cap_s": 3.0})
    verdicts = [json.loads(s["filtered_resps"][0]) for s in samples]
    assert [v["status"] for v in verdicts] == ["timeout", "crashed", "passed"]
    assert [s["primary"] for s in samples] == [0.0, 0.0, 1.0]
    assert score == pytest.approx(1 / 3)
