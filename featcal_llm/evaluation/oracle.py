"""Read a hub row of evalplus/humanevalplus or evalplus/mbppplus as EvalPlus's own grader sees it.

The hub's `test` field is a script EvalPlus generated from its release data (tools/*/to_original_fmt.py):
data statements (`inputs = [...]`, `results = [...]`, or a `ref_func` for the cross-check rows), an
`assertion` helper, and a loop that calls the entry point on every input. Running that script as-is
differs from EvalPlus in ways that move scores:

- HumanEval/32's loop asserts `_poly(*candidate(*inp), inp)`, which raises for every program;
- Mbpp/737, 787 and 794 (EvalPlus's "output is not None" tasks) compute `exact_match` and never
  assert it, so any program that returns passes;
- Mbpp/164 and 295 lack EvalPlus's special oracles (any output; or 0 also accepted);
- the helper compares with `np.allclose` without EvalPlus's `type(out) == type(exp)` check;
- the solution runs in the test's module, so the test's `np`, `inf` and imports leak into it.

So we keep only the data from the hub row and grade with EvalPlus's oracle (`judge.py`, in the
grader's process): this module splits the script into its data statements and the facts the loop
states (entry point, `atol`), names the oracle EvalPlus applies to the problem (`ORACLES`), and
finds where an MBPP+ row's base inputs end (`mbpp_base_count`).
"""

from __future__ import annotations

import ast
import functools
import sys
import textwrap
from dataclasses import dataclass

# EvalPlus's special oracles (evalplus/eval/_special_oracle.py and eval/__init__.py), by dataset and
# entry point. Everything else is "default": exact match, else same type and np.allclose.
ORACLES: dict[tuple[str, str], str] = {
    ("humaneval", "find_zero"): "poly_root",               # HumanEval/32: |poly(xs, out)| <= atol
    ("mbpp", "are_equivalent"): "any_output",              # Mbpp/164
    ("mbpp", "sum_div"): "or_zero",                        # Mbpp/295: expected, or 0
    ("mbpp", "surface_Area"): "surface_area",              # Mbpp/581: expected, or the alternative reading
    ("mbpp", "digit_distance_nums"): "digit_distance",     # Mbpp/558: expected, or zero-padded digits
    **{("mbpp", name): "not_none" for name in ("check_str", "text_match_three", "text_starta_endb")},  # 737, 787, 794
    **{("mbpp", name): "set_equal" for name in (
        "similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly", "larg_nnum",
        "intersection_array", "find_dissimilar", "Diff")},
}

# The hub rows whose exported test is wrong without the oracle above: what we change, said in the
# per-sample record and in docs/evaluation.md.
HUB_PATCHES = {
    "poly_root": "hub test unpacks the candidate's float (_poly(*candidate(*inp), inp)); graded with EvalPlus's root check",
    "not_none": "hub test computes exact_match but never asserts it; graded with EvalPlus's asserted not-None oracle",
    "any_output": "hub test lacks EvalPlus's special oracle (any output is accepted)",
    "or_zero": "hub test lacks EvalPlus's special oracle (0 is also accepted)",
}

_LOOP_HELPERS = {"assertion", "ref_func", "_poly", "_surface_Area", "_digit_distance_nums", "abs", "set"}


class HubTestError(ValueError):
    """The `test` field is not in the layout EvalPlus exports."""


@dataclass(frozen=True)
class HubTest:
    setup: str          # data statements and helpers, run in a process of their own (harness `data` job)
    entry_point: str    # the function the loop calls with *inp
    atol: float
    cross_check: bool   # expected outputs come from `ref_func`, not a `results` list


def _called_with_star_inp(node: ast.AST) -> list[str]:
    """Names of functions called as NAME(*inp) anywhere under `node`."""
    names = []
    for call in ast.walk(node):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) == 1
                and isinstance(call.args[0], ast.Starred) and isinstance(call.args[0].value, ast.Name)
                and call.args[0].value.id == "inp"):
            names.append(call.func.id)
    return names


def _atol(loop: ast.For) -> float:
    """The tolerance the loop passes: assertion(..., ATOL), or `... <= ATOL` (find_zero)."""
    for node in ast.walk(loop):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "assertion" and node.args:
            return float(ast.literal_eval(node.args[-1]))
        if isinstance(node, ast.Compare) and len(node.comparators) == 1 and isinstance(node.ops[0], ast.LtE):
            return float(ast.literal_eval(node.comparators[0]))
    raise HubTestError("no tolerance in the test loop")


@functools.lru_cache(maxsize=1024)
def parse_hub_test(test: str, entry_point: str | None = None) -> HubTest:
    """Split a hub `test` script (HumanEval+: inside `def check(candidate)`; MBPP+: top level)."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # EvalPlus exported some expected outputs with more than 4,300 digits
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        raise HubTestError(f"test does not parse ({getattr(error, 'msg', error)})") from None
    finally:
        sys.set_int_max_str_digits(limit)
    body = list(tree.body)
    check = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is not None:  # HumanEval+: data assignments are the statements of check() before its loop
        body.remove(check)
        inner = check.body
    else:
        inner = body
    loops = [n for n in inner if isinstance(n, ast.For)]
    if not loops:
        raise HubTestError("no `for ... in ... inputs` loop")
    loop = loops[-1]
    data = [n for n in inner if n is not loop]
    if check is None:
        body = data
    else:
        body = body + data
    names = [name for name in _called_with_star_inp(loop) if name not in _LOOP_HELPERS]
    if check is not None:
        if not entry_point:
            raise HubTestError("a HumanEval+ test needs the row's entry_point")
        if names not in ([], ["candidate"]):
            raise HubTestError(f"unexpected calls in check(): {names}")
    else:
        if len(set(names)) != 1:
            raise HubTestError(f"expected one entry point called with *inp, found {names or 'none'}")
        entry_point = names[0]
    assigned = {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined = {n.name for n in body if isinstance(n, ast.FunctionDef)}
    if "inputs" not in assigned:
        raise HubTestError("no `inputs = [...]` assignment")
    cross_check = "results" not in assigned
    if cross_check and "ref_func" not in defined:
        raise HubTestError("neither `results = [...]` nor `ref_func`")
    setup = "\n".join(textwrap.dedent(ast.get_source_segment(test, n, padded=True) or ast.unparse(n)) for n in body)
    return HubTest(setup, entry_point, _atol(loop), cross_check)


def oracle_for(dataset: str, entry_point: str) -> str:
    return ORACLES.get((dataset, entry_point), "default")


def _key(value) -> str:
    return f"{value}"  # the exporter's deduplication key (tools/*/to_original_fmt.py, deduplicate)


def mbpp_base_count(test_list: list[str], entry_point: str, inputs: list) -> int | None:
    """How many of an MBPP+ hub row's inputs are EvalPlus's base inputs, or None if unknown.

    The exporter wrote base_input + plus_input as one deduplicated list; MBPP+'s base inputs are the
    arguments of the original MBPP asserts (`test_list`). The split is taken only if those
    arguments, deduplicated as the exporter does, are exactly the first inputs of the row."""
    base: list[str] = []
    for line in test_list:
        try:
            tree = ast.parse(line.strip())
        except SyntaxError:
            return None
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                 and node.func.id == entry_point and not node.keywords]
        if not calls:
            return None
        try:
            args = [ast.literal_eval(arg) for arg in calls[0].args]
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
        if _key(args) not in base:
            base.append(_key(args))
    if not base or len(base) > len(inputs) or [_key(list(inp)) for inp in inputs[:len(base)]] != base:
        return None
    return len(base)
