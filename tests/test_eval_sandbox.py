"""The per-sample code runner and the EvalPlus-style sanitizer."""

from __future__ import annotations

import pytest

from featcal_llm.evaluation.sandbox import run_program
from featcal_llm.evaluation.sanitize import code_extract, sanitize


@pytest.mark.parametrize(
    ("program", "status"),
    [
        ("assert sum([1, 2]) == 3\n", "passed"),
        ("assert sum([1, 2]) == 4\n", "failed"),
        ("import sys\nsys.exit(0)\nassert False\n", "failed"),        # leaving early is not passing
        ("import os\nos._exit(0)\n", "failed"),
        ("x = bytearray(64 * 1024 ** 3)\n", "failed"),                # MemoryError under the limit
        ("import ctypes\nctypes.string_at(0)\n", "crashed"),          # segfault
        ("while True:\n    pass\n", "timeout"),
        ("import shutil\nshutil.rmtree('/')\n", "failed"),             # disabled by the guard
    ],
)
def test_run_program_verdicts(program, status):
    result = run_program(program, timeout_s=1.5, memory_mib=1024)
    assert result.status == status, result.detail
    assert result.passed is (status == "passed")
    assert result.duration_s < 10


def test_writes_outside_the_sandbox_directory_are_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for program in (f"open({str(target)!r}, 'w').write('x')\n",
                    f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\n",
                    f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')\n"):
        result = run_program(program, timeout_s=5)
        assert result.status == "failed" and "PermissionError" in result.detail, result.detail
    assert not target.exists()
    inside = run_program("open('scratch.txt', 'w').write('x')\nassert open('scratch.txt').read() == 'x'\n", timeout_s=5)
    assert inside.passed, inside.detail


def test_posix_spawn_is_disabled_and_processes_are_capped():
    spawn = run_program("import os\nos.posix_spawn('/bin/true', ['/bin/true'], dict(os.environ))\n", timeout_s=5)
    assert spawn.status == "failed" and "NoneType" in spawn.detail
    limits = "line = [l for l in open('/proc/self/limits') if l.startswith('Max processes')][0]\nassert 'unlimited' not in line, line\n"
    assert run_program(limits, timeout_s=5).passed


def test_a_program_cannot_pass_by_printing_what_the_harness_would():
    # the verdict travels over a pipe: printing tokens from the command line (the old check) is not passing
    forged = ("import json, os\nparts = open('/proc/self/cmdline').read().split('\\0')\n"
              "print(json.dumps({'status': 'passed'}))\nprint(parts[-4], flush=True)\nos._exit(0)\n")
    result = run_program(forged, timeout_s=5)
    assert result.status == "failed" and result.detail == "exited before the tests finished"


def test_process_spawning_is_disabled():
    result = run_program("import os\nos.fork()\n", timeout_s=5)
    assert result.status == "failed" and "NoneType" in result.detail


def test_code_extract_keeps_the_longest_parsable_block():
    text = "Here is the code:\ndef f(x):\n    return x + 1\n```\nIt adds one."
    assert code_extract(text) == "def f(x):\n    return x + 1"


def test_sanitize_keeps_what_the_entry_point_needs():
    text = (
        "import math\n"
        "from typing import List\n\n"
        "LIMIT = 10\n\n"
        "def helper(v):\n    return math.sqrt(v) + LIMIT\n\n"
        "def unrelated():\n    return 0\n\n"
        "def no_return():\n    print('x')\n\n"
        "def solve(values: List[int]) -> float:\n    return sum(helper(v) for v in values)\n\n"
        "print(solve([1, 4]))\n"
        "assert solve([]) == 0\n"
    )
    expected = (
        "import math\nfrom typing import List\n"
        "LIMIT = 10\n"
        "def helper(v):\n    return math.sqrt(v) + LIMIT\n"
        "def solve(values: List[int]) -> float:\n    return sum(helper(v) for v in values)"
    )
    assert sanitize(text, "solve") == expected


def test_sanitize_drops_decorated_functions_as_evalplus_and_falls_back_to_code():
    text = "import functools\n@functools.lru_cache(None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    assert sanitize(text, "fib") == "import functools"
    alone = "@staticmethod\ndef fib(n):\n    return n\n"  # nothing else kept: EvalPlus falls back to the code
    assert sanitize(alone, "fib") == alone
    assert sanitize("x = 1\nprint(x)\n", "missing") == "x = 1\nprint(x)\n"
