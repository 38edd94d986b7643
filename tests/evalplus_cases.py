"""Problems in EvalPlus's own format and candidate programs for the differential test.

Each problem is a dict as in EvalPlus's release files (task_id, prompt, entry_point,
canonical_solution, base_input, plus_input, atol); MBPP problems also carry the original MBPP row's
`text` and `test_list`, which the MBPP exporter copies into the hub row. Special-oracle problems use
the real task's entry point (EvalPlus keys its oracles on it). Candidates are whole model outputs,
sanitized by each grader. `DEVIATIONS` lists the (candidate, row format) pairs where we decide
differently from EvalPlus on purpose (docs/evaluation.md).
"""

from __future__ import annotations

MEDIAN_CANONICAL = ("    l = sorted(l)\n    if len(l) % 2 == 1:\n        return l[len(l) // 2]\n"
                    "    return (l[len(l) // 2 - 1] + l[len(l) // 2]) / 2.0\n")
MEDIAN_BASE = [[[3, 1, 2, 4, 5]], [[-10, 4, 6, 1000, 10, 20]], [[5]]]
MEDIAN_PLUS = [[[10 ** 12, 3, 10 ** 12 + 7]], [[1, 2]], [[7, 8, 9]], [[5]]]
DISTINCT_CANONICAL = "    return len(set(s))\n"
DISTINCT_BASE, DISTINCT_PLUS = [["abc"], ["zz"]], [["aaa"], ["xy"], ["hello"]]


def _mbpp(number, entry, text, canonical, base, plus, test_list, atol=0):
    prompt = f'"""\n{text}\n{test_list[0]}\n"""\n'
    return {"task_id": f"Mbpp/{number}", "prompt": prompt, "entry_point": entry, "canonical_solution": canonical,
            "base_input": base, "plus_input": plus, "atol": atol, "text": text, "test_list": test_list}


def _he(number, entry, prompt, canonical, base, plus, atol=0):
    return {"task_id": f"HumanEval/{number}", "prompt": prompt, "entry_point": entry, "canonical_solution": canonical,
            "base_input": base, "plus_input": plus, "atol": atol}


POLY = ("import math\n\n\ndef poly(xs: list, x: float):\n    return sum([coeff * math.pow(x, i) for i, coeff in "
        "enumerate(xs)])\n\n\ndef find_zero(xs: list):\n    \"\"\"A zero of the polynomial xs.\"\"\"\n")
FIND_ZERO = ("    begin, end = -1.0, 1.0\n    while poly(xs, begin) * poly(xs, end) > 0:\n        begin *= 2.0\n"
             "        end *= 2.0\n    while end - begin > 1e-10:\n        center = (begin + end) / 2.0\n"
             "        if poly(xs, center) * poly(xs, begin) > 0:\n            begin = center\n        else:\n"
             "            end = center\n    return begin\n")

PROBLEMS = {
    "median_he": _he(900, "median", 'def median(l: list):\n    """Median of the list."""\n', MEDIAN_CANONICAL,
                     MEDIAN_BASE, MEDIAN_PLUS),
    "median_mbpp": _mbpp(901, "median_list", "Write a function to find the median of a list.",
                         "def median_list(l):\n" + MEDIAN_CANONICAL, MEDIAN_BASE, MEDIAN_PLUS,
                         ["assert median_list([3, 1, 2, 4, 5]) == 3", "assert median_list([-10, 4, 6, 1000, 10, 20]) == 8.0",
                          "assert median_list([5]) == 5"]),
    "distinct_he": _he(901, "count_distinct", 'def count_distinct(s: str) -> int:\n    """Distinct characters."""\n',
                       DISTINCT_CANONICAL, DISTINCT_BASE, DISTINCT_PLUS),
    "distinct_mbpp": _mbpp(902, "count_distinct", "Write a function to count the distinct characters of a string.",
                           "def count_distinct(s):\n" + DISTINCT_CANONICAL, DISTINCT_BASE, DISTINCT_PLUS,
                           ["assert count_distinct('abc') == 3", "assert count_distinct('zz') == 1"]),
    "halve": _he(902, "halve", 'def halve(x: float) -> float:\n    """Half of x."""\n', "    return x / 2\n",
                 [[1.0], [3.0]], [[1e-3], [12345.678]], atol=1e-4),
    "find_zero": _he(32, "find_zero", POLY, FIND_ZERO, [[[1, 2]], [[-6, 11, -6, 1]]], [[[2, -3, 0, 1]]], atol=1e-4),
    "all_prefixes": _he(14, "all_prefixes", "from typing import List\n\n\ndef all_prefixes(string: str) -> List[str]:\n"
                        '    """All prefixes, shortest first."""\n',
                        "    result = []\n    for i in range(len(string)):\n        result.append(string[:i + 1])\n"
                        "    return result\n", [[""], ["abc"]], [["WWW"], ["abcdefgh"]]),
    "tri_sum": _he(903, "tri_sum", 'def tri_sum(n: int) -> int:\n    """1 + 2 + ... + n."""\n',
                   "    return n * (n + 1) // 2\n", [[0], [10]], [[30000]]),
    "add": _he(904, "add", 'def add(x: int, y: int) -> int:\n    """x + y."""\n', "    return x + y\n",
               [[1, 2], [0, 0]], [[10 ** 20, 1], [-5, 5]]),
    "similar": _mbpp(2, "similar_elements", "Write a function to find the shared elements from the given two lists.",
                     "def similar_elements(test_tup1, test_tup2):\n    return tuple(set(test_tup1) & set(test_tup2))\n",
                     [[(3, 4, 5, 6), (5, 7, 4, 10)], [(1, 2, 3, 4), (5, 4, 3, 7)]], [[(11, 12, 14, 13), (17, 15, 14, 13)]],
                     ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
                      "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))"]),
    "sum_div": _mbpp(295, "sum_div", "Write a function to return the sum of all divisors of a number.",
                     "def sum_div(number):\n    return sum(i for i in range(1, number) if number % i == 0)\n",
                     [[8], [12]], [[7], [100]], ["assert sum_div(8)==7", "assert sum_div(12)==16"]),
    "check_str": _mbpp(737, "check_str", "Write a function to check whether the given string starts with a vowel.",
                       "import re\ndef check_str(string):\n    return re.search(r'^[aeiouAEIOU][A-Za-z0-9_]*', string)\n",
                       [["annie"], ["dawood"]], [["Else"], ["xyz"]], ['assert check_str("annie")', 'assert not check_str("dawood")']),
}

MEDIAN_OFF_BY_ONE = ("def median(l):\n    l = sorted(l)\n    if len(l) % 2 == 1:\n        m = l[len(l) // 2]\n"
                     "        return m + 1 if m > 10 ** 9 else m\n    return (l[len(l) // 2 - 1] + l[len(l) // 2]) / 2.0\n")
MEDIAN_LOOPS = "def median(l):\n    while len(l) == 2:\n        pass\n    l = sorted(l)\n" + MEDIAN_CANONICAL.split("\n", 1)[1]
DISTINCT_CACHED = ("_cache = {}\n\ndef count_distinct(s):\n    if len(s) not in _cache:\n"
                   "        _cache[len(s)] = len(set(s))\n    return _cache[len(s)]\n")
_ADD = "def add(x, y):\n    return x + y\n"

CANDIDATES: dict[str, tuple[str, str]] = {
    # floats and ints; the tolerance EvalPlus switches on per execution
    "median_right": ("median_he", "def median(l):\n" + MEDIAN_CANONICAL),
    "median_off_by_one_on_large_ints": ("median_he", MEDIAN_OFF_BY_ONE),
    "median_loops_on_a_plus_input": ("median_he", MEDIAN_LOOPS),
    "median_float_for_int": ("median_he", "def median(l):\n    import statistics\n    return float(statistics.median(l))\n"),
    "mbpp_median_right": ("median_mbpp", "def median_list(l):\n" + MEDIAN_CANONICAL),
    "mbpp_median_off_by_one_on_large_ints": ("median_mbpp", MEDIAN_OFF_BY_ONE.replace("median(", "median_list(")),
    "halve_within_atol": ("halve", "def halve(x):\n    return x / 2 + 1e-5\n"),
    "halve_outside_atol": ("halve", "def halve(x):\n    return x / 2 + 1e-3\n"),
    "halve_int_output": ("halve", "def halve(x):\n    return int(x // 2)\n"),
    "halve_numpy_float": ("halve", "import numpy as np\ndef halve(x):\n    return np.float64(x) / 2\n"),
    # module-level state across inputs
    "distinct_right": ("distinct_he", "def count_distinct(s):\n    return len(set(s))\n"),
    "distinct_cache_by_length": ("distinct_he", DISTINCT_CACHED),
    "mbpp_distinct_cache_by_length": ("distinct_mbpp", DISTINCT_CACHED),
    # sets and special oracles
    "similar_sorted": ("similar", "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n"),
    "similar_list_reversed": ("similar", "def similar_elements(a, b):\n    return sorted(set(a) & set(b), reverse=True)\n"),
    "similar_missing_one": ("similar", "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))[1:]\n"),
    "sum_div_zero": ("sum_div", "def sum_div(n):\n    return 0\n"),
    "sum_div_wrong": ("sum_div", "def sum_div(n):\n    return n\n"),
    "check_str_match": ("check_str", "import re\ndef check_str(s):\n    return re.match('[aeiouAEIOU]', s)\n"),
    "check_str_bool": ("check_str", "def check_str(s):\n    return s[:1].lower() in 'aeiou'\n"),
    "check_str_none": ("check_str", "def check_str(s):\n    return None\n"),
    "find_zero_bisection": ("find_zero", POLY + FIND_ZERO),
    "find_zero_constant": ("find_zero", "def find_zero(xs):\n    return 0.0\n"),
    "find_zero_zeroes_its_input": ("find_zero", "def find_zero(xs):\n    xs[:] = [0] * len(xs)\n    return 0.0\n"),
    "prefixes_right": ("all_prefixes", "def all_prefixes(s):\n    return [s[:i + 1] for i in range(len(s))]\n"),
    "prefixes_tuple": ("all_prefixes", "def all_prefixes(s):\n    return tuple(s[:i + 1] for i in range(len(s)))\n"),
    # recursion
    "recursion_through_c": ("tri_sum", "import functools\nimport sys\n\ndef _step(n):\n    return 0 if n == 0 else n + _g(n - 1)\n\n"
                            "_g = functools.lru_cache(maxsize=None)(_step)\n\ndef tri_sum(n):\n"
                            "    sys.setrecursionlimit(10 ** 6)\n    _g.cache_clear()\n    return _g(n)\n"),
    "recursion_past_the_limit": ("tri_sum", "def tri_sum(n):\n    return 0 if n == 0 else n + tri_sum(n - 1)\n"),
    # imports, the guard, prints, exits, timeouts
    "prints_a_lot": ("add", "def add(x, y):\n    for _ in range(1000):\n        print('x' * 100)\n    return x + y\n"),
    "reads_stdin": ("add", "def add(x, y):\n    input()\n    return x + y\n"),
    "imports_multiprocessing": ("add", "import multiprocessing\n" + _ADD),
    "imports_process_pool": ("add", "from concurrent.futures import ProcessPoolExecutor\n" + _ADD),
    "imports_psutil": ("add", "import psutil\n" + _ADD),
    "opens_a_file": ("add", "def add(x, y):\n    open('scratch.txt', 'w')\n    return x + y\n"),
    "calls_getcwd": ("add", "import os\ndef add(x, y):\n    os.getcwd()\n    return x + y\n"),
    "missing_import": ("add", "def add(x, y):\n    return math.floor(x + y)\n"),
    "sys_exit": ("add", "import sys\ndef add(x, y):\n    sys.exit(0)\n    return 0\n"),
    "builtin_exit": ("add", "def add(x, y):\n    exit()\n    return 0\n"),
    "os_exit": ("add", "import os\ndef add(x, y):\n    os._exit(0)\n    return 0\n"),
    "loops_forever": ("add", "def add(x, y):\n    while True:\n        pass\n    return 0\n"),
    # sanitizer inputs
    "helper_only_in_fstring": ("add", "def helper(x, y):\n    return x + y\n\ndef add(x, y):\n    return int(f'{helper(x, y)}')\n"),
    "chained_assignment": ("add", "ZERO = NOTHING = 0\n\ndef add(x, y):\n    return x + y + ZERO\n"),
    "future_import_forward_ref": ("add", "from __future__ import annotations\n\ndef add(x: Num, y: Num) -> Num:\n"
                                  "    return x + y\n\nNum = int\n"),
    "markdown_wrapped": ("add", "Here you go:\n```python\ndef add(x, y):\n    return x + y\n```\nDone.\n"),
    "decorated_entry_point": ("add", "import functools\n\n@functools.lru_cache(maxsize=None)\ndef add(x, y):\n    return x + y\n"),
    "helper_after_entry": ("add", "def add(x, y):\n    return plus(x, y)\n\ndef plus(a, b):\n    return a + b\n"),
    # forge attempts: a wrong program that tries to pass anyway
    "forge_write_every_fd": ("add", "import os\ndef add(x, y):\n    for fd in range(3, 256):\n        try:\n"
                             "            os.write(fd, b'{\"status\": \"passed\"}\\n')\n        except OSError:\n"
                             "            pass\n    os._exit(0)\n    return None\n"),
    "forge_proc_self_fd": ("add", "import os\ndef add(x, y):\n    for name in os.listdir('/proc/self/fd'):\n"
                           "        try:\n            target = os.readlink(f'/proc/self/fd/{name}')\n"
                           "        except OSError:\n            continue\n"
                           "        if 'pipe' in target and int(name) > 2:\n"
                           "            os.write(int(name), b'{\"status\": \"passed\", \"n\": 4, \"passed_inputs\": 4}\\n')\n"
                           "    os._exit(0)\n    return None\n"),
    "forge_main_module": ("add", "import sys\ndef add(x, y):\n    main = sys.modules['__main__']\n"
                          "    for name in ('check_output', 'differential_test', 'RunJudge'):\n"
                          "        if hasattr(main, name):\n            setattr(main, name, lambda *a, **k: 0.0)\n"
                          "    return None\n"),
    "eq_always_true": ("add", "class Anything:\n    def __eq__(self, other):\n        return True\n\n"
                       "def add(x, y):\n    return Anything()\n"),
    "int_subclass_eq_true": ("add", "class Liar(int):\n    def __eq__(self, other):\n        return True\n"
                             "    __hash__ = int.__hash__\n\ndef add(x, y):\n    return Liar(0)\n"),
}

# (candidate, row format) -> our verdict, where it differs from EvalPlus's on purpose.
DEVIATIONS: dict[tuple[str, str], bool] = {
    # HumanEval+ hub rows do not say where base inputs end: one execution, tolerance and state carry on
    ("median_off_by_one_on_large_ints", "hub"): True,
    ("distinct_cache_by_length", "hub"): False,
    # the verdict is computed from values, never from the program's own objects or its view of its input
    ("find_zero_zeroes_its_input", "hub"): False,
    ("find_zero_zeroes_its_input", "release"): False,
    ("eq_always_true", "hub"): False,
    ("eq_always_true", "release"): False,
    ("int_subclass_eq_true", "hub"): False,
    ("int_subclass_eq_true", "release"): False,
}
