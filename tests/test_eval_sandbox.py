"""The program's process: statuses, limits, EvalPlus's guard, and a verdict it cannot write."""

from __future__ import annotations

import json

import pytest

from featcal_llm.evaluation import evalplus, sandbox
from featcal_llm.evaluation.sanitize import code_extract, sanitize

# EvalPlus's own row format: base and plus inputs run as two executions
ADD = {"task_id": "HumanEval/990", "prompt": "def add(x, y):\n", "canonical_solution": "    return x + y\n",
       "entry_point": "add", "base_input": [[1, 2], [0, 0]], "plus_input": [[10 ** 20, 1], [-5, 5]], "atol": 0}


@pytest.fixture(autouse=True)
def allowed():
    evalplus.configure(allow=True, cap_s=10.0, min_time_limit_s=0.5, time_limit_factor=4.0, workers=2, memory_mib=1024)
    yield
    evalplus.configure(allow=False, cap_s=60.0, min_time_limit_s=4.0, time_limit_factor=4.0, memory_mib=4096)


def grade(body: str):
    """`add` whose body is `body`, graded on ADD."""
    return evalplus.grade_solution(body, ADD)


@pytest.mark.parametrize(
    ("program", "status", "detail"),
    [
        ("def add(x, y):\n    return x + y\n", "passed", ""),
        ("def add(x, y):\n    return x - y\n", "failed", "input 0: wrong output -1"),
        ("import sys\ndef add(x, y):\n    sys.exit(0)\n", "failed", "input 0: SystemExit: 0"),
        ("import os\ndef add(x, y):\n    os._exit(0)\n", "failed", "exited before the tests finished"),
        ("def add(x, y):\n    return len(bytearray(64 * 1024 ** 3))\n", "failed", "input 0: MemoryError"),
        ("import ctypes\ndef add(x, y):\n    return ctypes.string_at(0)\n", "crashed", "killed by SIGSEGV"),
        ("def add(x, y):\n    while True:\n        pass\n", "timeout", "input 0: over the 0.5 s CPU limit"),
        # the per-input timer switched off: the run's CPU limit (SIGXCPU before SIGKILL) is a timeout
        ("import signal\ndef add(x, y):\n    signal.signal(signal.SIGPROF, signal.SIG_IGN)\n    while True:\n"
         "        pass\n", "timeout", "over the run's CPU-time limit"),
        ("import shutil\ndef add(x, y):\n    shutil.rmtree('/')\n", "failed", "input 0: TypeError: 'NoneType'"),
    ],
)
def test_statuses(program, status, detail):
    result = grade(program)
    assert result.status == status, result.detail
    assert result.detail.startswith(detail), result.detail
    assert result.passed is (status == "passed")


def test_writes_outside_the_sandbox_directory_are_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for line in (f"io.open({str(target)!r}, 'w').write('x')", f"os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"pathlib.Path({str(target)!r}).write_text('x')"):
        result = grade(f"import io, os, pathlib\ndef add(x, y):\n    {line}\n    return x + y\n")
        assert result.status == "failed" and "PermissionError" in result.detail, result.detail
    assert not target.exists()
    inside = grade("import io\ndef add(x, y):\n    io.open('scratch.txt', 'w').write('x')\n"
                   "    assert io.open('scratch.txt').read() == 'x'\n    return x + y\n")
    assert inside.passed, inside.detail


@pytest.mark.parametrize(
    ("program", "passes"),
    [
        ("import multiprocessing\n", True),                       # EvalPlus allows the import
        ("from concurrent.futures import ProcessPoolExecutor\n", True),
        ("import numpy\n", True),
        ("import psutil\n", False),                               # EvalPlus's blocked modules
        ("import resource\n", False),
        ("def add(x, y):\n    open('x')\n    return x + y\n", False),  # EvalPlus disables open
        ("import os\ndef add(x, y):\n    os.getcwd()\n    return x + y\n", False),
        ("import os\ndef add(x, y):\n    os.posix_spawn('/bin/true', ['/bin/true'], {})\n    return x + y\n", False),
        ("import os\ndef add(x, y):\n    os.fork()\n    return x + y\n", False),
    ],
)
def test_evalplus_guard(program, passes):
    if "def add" not in program:
        program += "def add(x, y):\n    return x + y\n"
    result = grade(program)
    assert result.passed is passes, result.detail


def test_limits_are_evalplus_stack_and_a_process_cap():
    # EvalPlus raises RLIMIT_STACK to its memory limit: deep recursion through C code works
    limits = ("import io\ndef add(x, y):\n    lines = {l[:25].strip(): l.split()[-3:-1] for l in io.open('/proc/self/limits')}\n"
              "    assert lines['Max stack size'] == [str(1024 ** 3)] * 2, lines['Max stack size']\n"
              "    assert 'unlimited' not in lines['Max processes'], lines['Max processes']\n    return x + y\n")
    result = grade(limits)
    assert result.passed, result.detail
    deep = ("import functools, sys\ndef _step(n):\n    return 0 if n == 0 else 1 + _g(n - 1)\n"
            "_g = functools.lru_cache(maxsize=None)(_step)\ndef add(x, y):\n    sys.setrecursionlimit(10 ** 6)\n"
            "    _g.cache_clear()\n    return x + y + _g(60000) - 60000\n")
    result = grade(deep)
    assert result.passed, result.detail


FORGES = {
    # the old verdict channel: a line on an inherited pipe, found by trying every descriptor or by name
    "every_fd": "import os\ndef add(x, y):\n    for fd in range(3, 1024):\n        try:\n"
                "            os.write(fd, b'{\"status\": \"passed\"}\\n')\n        except OSError:\n            pass\n"
                "    os._exit(0)\n    return None\n",
    "proc_self_fd": "import os\ndef add(x, y):\n    for name in os.listdir('/proc/self/fd'):\n        try:\n"
                    "            target = os.readlink(f'/proc/self/fd/{name}')\n        except OSError:\n"
                    "            continue\n        if 'pipe' in target and int(name) > 2:\n"
                    "            os.write(int(name), b'{\"status\": \"passed\", \"n\": 4, \"passed_inputs\": 4}\\n')\n"
                    "    os._exit(0)\n    return None\n",
    # the harness's functions replaced through sys.modules['__main__']
    "main_module": "import sys\ndef add(x, y):\n    main = sys.modules['__main__']\n"
                   "    for name in dir(main):\n        if callable(getattr(main, name)) and not name.startswith('__'):\n"
                   "            try:\n                setattr(main, name, lambda *a, **k: None)\n            except Exception:\n"
                   "                pass\n    return None\n",
    # the channel object itself told to say something else
    "channel_send": "import sys\ndef add(x, y):\n    main = sys.modules['__main__']\n    real = main.Channel.send\n"
                    "    main.Channel.send = lambda self, record: real(self, {**record, 'out': 0, 'passed': True})\n"
                    "    return None\n",
    # records for inputs the program was not asked about yet, and junk
    # the harness's own channel, found with gc: a right answer sent early, then duplicates; junk
    "extra_records": "import gc\ndef add(x, y):\n    channel = [o for o in gc.get_objects() if type(o).__name__ == 'Channel'][0]\n"
                     "    channel.send({'i': 0, 'out': 3, 't': 0.0})\n    return None\n",
    "not_json": "import gc, os\ndef add(x, y):\n    channel = [o for o in gc.get_objects() if type(o).__name__ == 'Channel'][0]\n"
                "    os.write(channel.fd, b'passed\\n')\n    return x + y\n",
    "objects_that_equal_everything": "class A:\n    def __eq__(self, other):\n        return True\n"
                                     "def add(x, y):\n    return A()\n",
    "int_subclass_equal_everything": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                                     "    __hash__ = int.__hash__\ndef add(x, y):\n    return I(-1)\n",
}


@pytest.mark.parametrize("name", sorted(FORGES))
def test_a_program_cannot_write_its_verdict(name):
    result = grade(FORGES[name])
    assert result.status == "failed", (result.status, result.detail)


def test_the_program_receives_inputs_only(monkeypatch):
    jobs = []
    real = sandbox.execute

    def spy(job, **kwargs):
        jobs.append(json.dumps(job))
        return real(job, **kwargs)

    monkeypatch.setattr(evalplus, "execute", spy)
    doc = {**ADD, "task_id": "HumanEval/991", "plus_input": [[123456789, 987654321]]}
    assert evalplus.grade_solution("def add(x, y):\n    return x + y\n", doc).passed
    graded = [job for job in jobs if '"keep_going": false' in job]
    assert len(graded) == 2  # base and plus: two executions
    assert all(str(123456789 + 987654321) not in job for job in jobs)  # the expected output never leaves


def test_output_cap(monkeypatch):
    monkeypatch.setattr(evalplus._SETTINGS, "output_cap_bytes", 1000)
    result = grade("def add(x, y):\n    return [x + y] * 10000 if x else x + y\n")
    assert result.status == "failed" and "exceed" in result.detail, result.detail


def test_code_extract_keeps_the_longest_parsable_block():
    text = "Here is the code:\ndef f(x):\n    return x + 1\n```\nIt adds one."
    assert code_extract(text) == "def f(x):\n    return x + 1"


def test_sanitize_keeps_what_the_entry_point_needs():
    text = ("import math\nfrom typing import List\n\nLIMIT = 10\n\ndef helper(v):\n    return math.sqrt(v) + LIMIT\n\n"
            "def unrelated():\n    return 0\n\ndef no_return():\n    print('x')\n\n"
            "def solve(values: List[int]) -> float:\n    return sum(helper(v) for v in values)\n\n"
            "print(solve([1, 4]))\nassert solve([]) == 0\n")
    expected = ("import math\nfrom typing import List\nLIMIT = 10\ndef helper(v):\n    return math.sqrt(v) + LIMIT\n"
                "def solve(values: List[int]) -> float:\n    return sum(helper(v) for v in values)")
    assert sanitize(text, "solve") == expected


def test_sanitize_drops_decorated_functions_as_evalplus_and_falls_back_to_code():
    text = "import functools\n@functools.lru_cache(None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    assert sanitize(text, "fib") == "import functools"
    alone = "@staticmethod\ndef fib(n):\n    return n\n"  # nothing else kept: EvalPlus falls back to the code
    assert sanitize(alone, "fib") == alone
    assert sanitize("x = 1\nprint(x)\n", "missing") == "x = 1\nprint(x)\n"
