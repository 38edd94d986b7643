"""EvalPlus's own conversion of its problems to the hub's row format, for the differential test.

The exporters are not in the `evalplus` wheel: they are tools/humaneval/to_original_fmt.py and
tools/mbpp/to_original_fmt.py of github.com/evalplus/evalplus (read at commit 26d6d00). This module
writes the same rows from the same pieces: inputs = base_input + plus_input deduplicated by
f"{input}" (first occurrence kept), expected outputs from EvalPlus's own `trusted_exec` (what its
`get_groundtruth` calls), the `assertion` helper built around `inspect.getsource` of the installed
package's `is_floats`, `_poly`, `_surface_Area` and `_digit_distance_nums`, the cross-check layout
(`ref_func`) for the entry points the exporters list, and their special-oracle helpers.
"""

from __future__ import annotations

import inspect

from evalplus.eval import is_floats
from evalplus.eval._special_oracle import (
    MBPP_OUTPUT_NOT_NONE_TASKS,
    MBPP_OUTPUT_SET_EQ_TASKS,
    _digit_distance_nums,
    _poly,
    _surface_Area,
)
from evalplus.gen.util import trusted_exec

HE_CROSSCHECK = ("tri", "string_sequence", "starts_one_ends", "make_a_pile", "special_factorial", "all_prefixes")
MBPP_CROSSCHECK = ("combinations_colors", "freq_count", "get_coordinates")


def _assertion_fn(mbpp: bool) -> str:
    message = ', f"out: {out}, exp: {exp}"' if mbpp else ""
    return (f"import numpy as np\n\n{inspect.getsource(is_floats)}\n\ndef assertion(out, exp, atol):\n"
            "    exact_match = out == exp\n\n    if atol == 0 and is_floats(exp):\n        atol = 1e-6\n"
            "    if not exact_match and atol != 0:\n        assert np.allclose(out, exp, rtol=1e-07, atol=atol)\n"
            f"    else:\n        assert exact_match{message}\n")


def groundtruth(problem: dict, not_none: bool = False) -> dict:
    """EvalPlus's get_groundtruth for one problem (base and plus separately, with times)."""
    code = problem["prompt"] + problem["canonical_solution"]
    truth = {}
    for part in ("base", "plus"):
        truth[part], truth[f"{part}_time"] = trusted_exec(code, problem[f"{part}_input"], problem["entry_point"],
                                                          record_time=True, output_not_none=not_none)
    return truth


def deduplicate(inputs: list, results: list) -> tuple[list, list]:
    seen, kept_inputs, kept_results = set(), [], []
    for inp, res in zip(inputs, results):
        if f"{inp}" not in seen:
            seen.add(f"{inp}")
            kept_inputs.append(inp)
            kept_results.append(res)
    return kept_inputs, kept_results


def humaneval_row(problem: dict, truth: dict) -> dict:
    entry, atol = problem["entry_point"], problem["atol"]
    inputs, results = deduplicate(problem["base_input"] + problem["plus_input"], truth["base"] + truth["plus"])
    row = {key: problem[key] for key in ("task_id", "prompt", "canonical_solution", "entry_point")}
    if entry in HE_CROSSCHECK:
        simplified = ""
        for line in problem["prompt"].split("\n"):
            if not line:
                continue
            if '"""' in line or "'''" in line:
                break
            simplified += line + "\n"
        ref_func = (simplified + problem["canonical_solution"]).replace(f" {entry}(", " ref_func(")
        row["test"] = (f"{_assertion_fn(False)}\n\n{ref_func}\n\ndef check(candidate):\n    inputs = {inputs}\n"
                       f"    for i, inp in enumerate(inputs):\n        assertion(candidate(*inp), ref_func(*inp), {atol})\n")
        return row
    imports, aux, assertion = "", _assertion_fn(False), f"assertion(candidate(*inp), exp, {atol})"
    if entry == "find_zero":
        imports, aux = "import math", inspect.getsource(_poly) + "\n"
        assertion = f"assert _poly(*candidate(*inp), inp) <= {atol}"
    row["test"] = (f"{imports}\n\n{aux}\n\ndef check(candidate):\n    inputs = {inputs}\n    results = {results}\n"
                   f"    for i, (inp, exp) in enumerate(zip(inputs, results)):\n        {assertion}\n")
    return row


def _mbpp_aux(entry: str, atol: float) -> tuple[list[str], str, str]:
    imports, aux, assertion = ["import numpy as np", "from math import inf"], _assertion_fn(True), \
        f"assertion({entry}(*inp), exp, {atol})"
    if entry in MBPP_OUTPUT_SET_EQ_TASKS:
        aux = (f"{inspect.getsource(is_floats)}\n\ndef assertion(out, exp, atol):\n    if atol == 0 and is_floats(exp):\n"
               "        atol = 1e-6\n    out = set(out)\n    exp = set(exp)\n    if out != exp and atol != 0:\n"
               "        assert np.allclose(out, exp, rtol=1e-07, atol=atol)\n    else:\n"
               '        assert out == exp, f"out: {out}, exp: {exp}"\n')
    elif entry in MBPP_OUTPUT_NOT_NONE_TASKS:
        aux = ("def assertion(out, exp, atol):\n    if isinstance(out, bool):\n        exact_match = out == exp\n"
               "    else:\n        exact_match = exp == (out is not None)\n")
    elif entry == "surface_Area":
        imports.append("import math")
        aux = (inspect.getsource(_surface_Area) + "\ndef assertion(out, exp_0, exp_1, atol):\n"
               "    assert abs(out - exp_0) <= atol or abs(out - exp_1) <= atol\n")
        assertion = f"assertion(surface_Area(*inp), exp, _surface_Area(*inp), {atol})"
    elif entry == "digit_distance_nums":
        aux = (inspect.getsource(_digit_distance_nums) + "\ndef assertion(out, exp_0, exp_1, atol):\n"
               "    assert out == exp_0 or out == exp_1\n")
        assertion = f"assertion(digit_distance_nums(*inp), exp, _digit_distance_nums(*inp), {atol})"
    return imports, aux, assertion


def mbpp_row(problem: dict, truth: dict) -> dict:
    """`problem` carries the original MBPP row's `text` and `test_list` next to EvalPlus's fields."""
    entry, atol = problem["entry_point"], problem["atol"]
    number = int(problem["task_id"].split("/")[-1])
    row = {"task_id": number, "code": problem["canonical_solution"], "prompt": problem["text"],
           "source_file": "fixture", "test_imports": [], "test_list": problem["test_list"]}
    joined = problem["base_input"] + problem["plus_input"] if problem["plus_input"] else problem["base_input"]
    inputs, results = deduplicate(joined, truth["base"] + truth["plus"])
    if entry in MBPP_CROSSCHECK:
        ref_func = problem["canonical_solution"].replace(f" {entry}(", " ref_func(")
        row["test"] = (f"import numpy as np\nfrom math import inf\n\n{_assertion_fn(True)}\n\n{ref_func}\n\n"
                       f"inputs = {inputs}\nfor i, inp in enumerate(inputs):\n"
                       f"    assertion({entry}(*inp), ref_func(*inp), {atol})\n")
        return row
    imports, aux, assertion = _mbpp_aux(entry, atol)
    row["test"] = ("\n".join(imports) + f"\n\n{aux}\n\ninputs = {inputs}\nresults = {results}\n"
                   f"for i, (inp, exp) in enumerate(zip(inputs, results)):\n    {assertion}\n")
    return row


def export(problem: dict) -> tuple[dict, dict]:
    """(hub row, EvalPlus's ground truth) for an EvalPlus-format problem."""
    mbpp = problem["task_id"].startswith("Mbpp/")
    truth = groundtruth(problem, not_none=mbpp and problem["entry_point"] in MBPP_OUTPUT_NOT_NONE_TASKS)
    return (mbpp_row if mbpp else humaneval_row)(problem, truth), truth
