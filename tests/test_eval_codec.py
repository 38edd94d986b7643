"""The grader's parent side: values from the program's process (codec), EvalPlus's check per
execution (judge), where MBPP+ hub rows split base from plus inputs, and the sanitizer against
EvalPlus's own."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featcal_llm.evaluation.codec import CodecError, Opaque, decode, dumps, encode, loads
from featcal_llm.evaluation.judge import RunJudge, check_output
from featcal_llm.evaluation.oracle import mbpp_base_count
from featcal_llm.evaluation.sandbox import Execution
from featcal_llm.evaluation.sanitize import sanitize

_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10 ** 40), max_value=10 ** 40),
                     st.floats(allow_nan=False), st.text(), st.binary(), st.complex_numbers(allow_nan=False))
_hashable = st.recursive(_scalars, lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3), max_leaves=8)
_values = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.sets(_hashable, max_size=3)
                   | st.dictionaries(_hashable, inner, max_size=3)),
    max_leaves=12,
)


def _typed(value):
    """The value with every type spelled out: equal only if types match all the way down."""
    if isinstance(value, dict):
        return ("dict", sorted((repr(_typed(k)), repr(_typed(v))) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, sorted(repr(_typed(v)) for v in value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_typed(v) for v in value])
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, complex):
        return ("complex", value.real.hex(), value.imag.hex())
    return (type(value).__name__, value)


@settings(max_examples=300, deadline=None)
@given(_values)
def test_round_trip_keeps_types_and_bits(value):
    assert _typed(loads(dumps(value))) == _typed(value)


def test_special_values():
    for value in (math.inf, -math.inf, -0.0, 10 ** 5000, -(2 ** 53), 2 ** 53 - 1):
        back = loads(dumps(value))
        assert type(back) is type(value) and back == value
        assert back.hex() == value.hex() if isinstance(value, float) else True
    assert math.isnan(loads(dumps(math.nan)))
    assert dumps(10 ** 5000).startswith('["I","')  # hex: no 4,300-digit limit on either side
    scalar = loads(dumps(np.float32(1.5)))
    assert type(scalar) is np.float32 and scalar == 1.5
    array = loads(dumps(np.arange(6, dtype=np.int16).reshape(2, 3)))
    assert array.dtype == np.int16 and array.shape == (2, 3) and array.tolist() == [[0, 1, 2], [3, 4, 5]]
    counter = loads(dumps(collections.Counter("abca")))
    assert type(counter) is collections.Counter and counter == {"a": 2, "b": 1, "c": 1}
    assert type(loads(dumps(collections.OrderedDict(a=1)))) is collections.OrderedDict


def test_program_types_lose_their_methods():
    class Liar(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Anything:
        def __eq__(self, other):
            return True

    liar = loads(dumps(Liar(3)))
    assert liar == 3 and liar != 4 and type(liar).__name__ == "Liar" and type(liar) is not int
    opaque = loads(dumps(Anything()))
    assert isinstance(opaque, Opaque) and opaque != opaque.__class__("x") and not (opaque == 0)
    point = collections.namedtuple("Point", "x y")(1, 2)
    assert loads(dumps(point)) == (1, 2)
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(CodecError, match="contains itself"):
        encode(cyclic)


@pytest.mark.parametrize("text", ['["Z", 1]', '["I", "xyz"]', '["L", 3]', '["N", "|O", 1]', '["D", [[["L", []], 1]]]',
                                  "[1, 2]", '{"a": 1}', "1" * 5000, "[" * 100000])
def test_malformed_documents_are_refused(text):
    with pytest.raises(CodecError):
        loads(text)


def _feed(judge: RunJudge, outputs: list) -> tuple[str, str]:
    for index, out in enumerate(outputs):
        if not judge({"i": index, "out": encode(out), "t": 0.0}):
            break
    return judge.verdict(Execution(returncode=0))


def test_tolerance_lasts_one_execution():
    inputs = [[0], [1]]
    expected = [0.5, 10 ** 12]  # a float switches EvalPlus's tolerance on, for the rest of that run
    assert _feed(RunJudge("default", inputs, expected, 0.0), [0.5, 10 ** 12 + 1])[0] == "passed"
    # the same integer at the start of a new execution: exact again
    status, detail = _feed(RunJudge("default", inputs[1:], expected[1:], 0.0, offset=1), [10 ** 12 + 1])
    assert status == "failed" and detail.startswith("input 1: wrong output 1000000000001")
    assert check_output("default", 1.0000001, 1.0, [0], 0.0) == 1e-6
    with pytest.raises(AssertionError, match="type int, expected float"):
        check_output("default", 1, 1.5, [0], 0.0)


def test_judge_refuses_records_out_of_order_and_unreadable_outputs():
    judge = RunJudge("default", [[1], [2]], [1, 2], 0.0)
    assert not judge({"i": 1, "out": 2})
    assert judge.verdict(Execution())[1] == "input 0: unexpected record from the program's process"
    judge = RunJudge("default", [[1]], [1], 0.0)
    assert not judge({"i": 0, "out": ["Q"]})
    assert "unreadable output" in judge.verdict(Execution())[1]
    judge = RunJudge("default", [[1], [2]], [1, 2], 0.0)
    assert judge({"i": 0, "out": 1}) and judge.verdict(Execution(returncode=0)) == ("failed", "exited before the tests finished")
    assert judge.verdict(Execution(signal_name="SIGXCPU"))[0] == "timeout"
    assert judge.verdict(Execution(signal_name="SIGSEGV"))[0] == "crashed"


def test_mbpp_split_from_test_list():
    tests = ["assert f([3, 1]) == 2", "assert math.isclose(f([1, 2]), 1.5)", "assert f([3, 1]) == 2"]
    inputs = [[[3, 1]], [[1, 2]], [[9]], [[1, 1]]]
    assert mbpp_base_count(tests, "f", inputs) == 2  # the duplicate assert was deduplicated by the exporter
    assert mbpp_base_count(tests, "f", [[[1, 2]], [[3, 1]], [[9]]]) is None  # not the first inputs
    assert mbpp_base_count(["assert g(1) == 1"], "f", inputs) is None
    assert mbpp_base_count(["assert f(x) == 1"], "f", inputs) is None  # not a literal


SANITIZER_CASES = [
    "def helper(x):\n    return x * 2\n\ndef f(x):\n    return f'{helper(x)!r:>{WIDTH}}'\n\nWIDTH = 4\n",
    "A = B = 2\n\ndef f(x):\n    return x + A\n",
    "A = B = 2\n\ndef f(x):\n    return x + B\n",
    "import math\nfrom __future__ import annotations\n\ndef f(x: int) -> int:\n    return math.floor(x)\n",
    "x: int = 3\nclass K:\n    pass\n\ndef f():\n    return K, x\n",
    "def g(key=None):\n    return 1\ndef f(a):\n    return sorted(a, key=g)\n",
    "Sure!\n```python\nimport numpy as np\ndef f(a):\n    return np.sum(a)\n```\nprint(f([1]))\n",
    "a, b = 1, 2\ndef f():\n    return a\n",
    "def f(x):\n    return obj.helper(x)\ndef helper(x):\n    return x\n",
    "async def f():\n    return await g()\nasync def g():\n    return 1\n",
    "def f(x):\n    try:\n        return h(x)\n    except ValueError as h:\n        return 0\ndef h(x):\n    return x\n",
]


@pytest.mark.parametrize("code", SANITIZER_CASES)
def test_sanitizer_matches_evalplus(code):
    from evalplus.sanitize import sanitize as evalplus_sanitize

    assert sanitize(code, "f") == evalplus_sanitize(code, "f")


def test_jobs_carry_json_only():
    assert json.loads(dumps({(1, 2): {3.5}})) == ["D", [[["T", [1, 2]], ["S", [3.5]]]]]
    assert decode(["X", "collections.defaultdict", ["D", [["a", 1]]]]) == {"a": 1}
