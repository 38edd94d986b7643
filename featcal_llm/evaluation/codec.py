"""Values between the grader and the sandboxed program as tagged JSON: never pickle, never code.

The child (harness.py, which loads this file by path) encodes the inputs it receives and the
outputs the program returns; the parent decodes them into plain builtins it builds itself, so
comparing an output with its expected value never runs a method the program defined (an `__eq__`
that returns True is compared by the value of its builtin base, or not at all). Types survive the
trip exactly (EvalPlus's oracle checks `type(out) == type(exp)`): list/tuple/set/frozenset/dict,
big ints, float bits (inf, nan, -0.0), complex, bytes, numpy scalars and numeric arrays.

Forms: JSON null/bool/str/small int/float as themselves, else [TAG, ...]:
  I big int (hex) · L list · T tuple · S set · F frozenset · D dict (pairs) · C complex ·
  B bytes (hex) · N numpy scalar (dtype, value) · A numpy array (dtype, shape, nested values) ·
  X subclass of a builtin (type name, base value) · O any other object (type name).
Standard library and numpy only: the child runs isolated from the package.
"""

from __future__ import annotations

import json
import math

_SMALL_INT = 2 ** 53
_MAX_DEPTH = 200
_NUMERIC_KINDS = "biufc"


class CodecError(ValueError):
    """A value that cannot be encoded, or a document that is not in the format above."""


class Opaque:
    """An output the codec does not carry (a class instance, a generator, a regex match): it is
    not None and not a bool, and equals nothing but itself."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name} object>"


_BASES = (bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict)


def _qualname(value) -> str:
    kind = type(value)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', kind.__name__)}"


def _numpy(load: bool = True):
    """numpy, if installed; `load=False` (encoding) only finds it if the program imported it: no
    numpy value can exist otherwise, and the program's process does not pay for the import."""
    import sys

    if not load:
        return sys.modules.get("numpy")
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def encode(value, depth: int = 0, _active: set | None = None):
    """JSON-able form of `value` (raises CodecError on cycles or nesting deeper than 200)."""
    if depth > _MAX_DEPTH:
        raise CodecError("value nested too deeply")
    active = set() if _active is None else _active
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -_SMALL_INT < value < _SMALL_INT else ["I", format(value, "x")]
    if kind is float:
        return value if math.isfinite(value) else ["f", value.hex()]
    if kind is complex:
        return ["C", value.real.hex(), value.imag.hex()]
    if kind is bytes:
        return ["B", value.hex()]
    numpy = _numpy(load=False)
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        dtype = value.dtype
        if dtype.kind not in _NUMERIC_KINDS:
            return ["O", _qualname(value)]
        if isinstance(value, numpy.ndarray):
            return ["A", dtype.str, list(value.shape), encode(value.tolist(), depth + 1, active)]
        return ["N", dtype.str, encode(value.item(), depth + 1, active)]
    if kind in (list, tuple, set, frozenset, dict):
        if id(value) in active:
            raise CodecError("value contains itself")
        active.add(id(value))
        try:
            if kind is dict:
                body = [[encode(k, depth + 1, active), encode(v, depth + 1, active)] for k, v in value.items()]
            else:
                body = [encode(item, depth + 1, active) for item in value]
        finally:
            active.discard(id(value))
        return [{list: "L", tuple: "T", set: "S", frozenset: "F", dict: "D"}[kind], body]
    for base in _BASES:
        if isinstance(value, base):  # a subclass: carried as its builtin value, under its own name
            return ["X", _qualname(value), encode(base(value.items()) if base is dict else base(value), depth + 1, active)]
    return ["O", _qualname(value)]


def dumps(value) -> str:
    return json.dumps(encode(value), separators=(",", ":"))


_SUBCLASSES: dict[tuple[str, type], type] = {}


def _subclass(name: str, base: type) -> type:
    """A stand-in class named as the program's subclass, with the builtin's own methods only."""
    if base in (bool,):
        return base
    key = (name, base)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(name.rsplit(".", 1)[-1][:100] or "subclass", (base,), {"__module__": "program"})
    return _SUBCLASSES[key]


def _stdlib_subclass(name: str, base_value):
    import collections

    if isinstance(base_value, dict):
        if name == "collections.OrderedDict":
            return collections.OrderedDict(base_value)
        if name == "collections.defaultdict":
            return collections.defaultdict(None, base_value)
        if name == "collections.Counter":
            return collections.Counter(base_value)
    return None


def decode(form, depth: int = 0):
    """The value `form` encodes, built from builtins (and numpy) only; CodecError if malformed."""
    if depth > _MAX_DEPTH + 2:
        raise CodecError("document nested too deeply")
    if form is None or isinstance(form, (bool, str, int, float)):
        return form
    if not isinstance(form, list) or not form or not isinstance(form[0], str):
        raise CodecError(f"not an encoded value: {str(form)[:80]}")
    tag, rest = form[0], form[1:]
    try:
        if tag == "I":
            return int(rest[0], 16)
        if tag == "f":
            return float.fromhex(rest[0])
        if tag == "C":
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        if tag == "B":
            return bytes.fromhex(rest[0])
        if tag in ("L", "T", "S", "F"):
            items = [decode(item, depth + 1) for item in rest[0]]
            return {"L": list, "T": tuple, "S": set, "F": frozenset}[tag](items)
        if tag == "D":
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in rest[0]}
        if tag in ("N", "A"):
            numpy = _numpy()
            dtype = numpy.dtype(rest[0])
            if dtype.kind not in _NUMERIC_KINDS:
                raise CodecError(f"numpy dtype {rest[0]!r} is not numeric")
            if tag == "N":
                return dtype.type(decode(rest[1], depth + 1))
            return numpy.array(decode(rest[2], depth + 1), dtype=dtype).reshape([int(n) for n in rest[1]])
        if tag == "X":
            name, value = str(rest[0]), decode(rest[1], depth + 1)
            known = _stdlib_subclass(name, value)
            if known is not None:
                return known
            base = type(value)
            if base not in _BASES:
                raise CodecError(f"subclass of {base.__name__}")
            return _subclass(name, base)(value.items() if base is dict else value)
        if tag == "O":
            return Opaque(str(rest[0])[:200])
    except CodecError:
        raise
    except (TypeError, ValueError, IndexError, KeyError, OverflowError, AttributeError) as error:
        raise CodecError(f"malformed {tag!r} value ({type(error).__name__})") from None
    raise CodecError(f"unknown tag {tag!r}")


def loads(text: str | bytes):
    try:
        return decode(json.loads(text))
    except (ValueError, RecursionError) as error:
        raise CodecError(str(error)[:200]) from None
