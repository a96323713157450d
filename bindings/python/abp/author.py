"""Authoring elementwise operators in Python: traced functions become abp IR (docs/python.md).

    from abp.author import operator, where, exp, log1p, tanh, quantize, dequantize

    @operator(params=("slope",))
    def my_leaky(x, slope):
        positive = x > 0                      # a mask: saved with 1 bit if backward uses it
        y = where(positive, x, x * slope)
        def backward(dy):
            return where(positive, dy, dy * slope)
        return y, backward

    y = my_leaky(torch.randn(10, requires_grad=True), 0.1)   # autograd-capable
    print(my_leaky.ir, my_leaky.saved_bits)

The decorated function runs once, on traced values, and its operations are written out as an
`abp.operator` (IR text: the IR stays the single source of truth), compiled by
`abp.compile_operators` (the run-time compiler and its cache) and then run like any operator of
the library. What crosses from forward to backward is whatever the backward closure uses of the
forward values: a float tensor is saved whole (32 bits per element), a mask packed to 1 bit,
`quantize`'s codes with their b bits, a parameter as one scalar. Every op carries the Python
file and line that traced it, so compiler diagnostics point at the user's code.

`@operator(rows=True)` makes a row-wise operator (a norm): inputs, outputs and gradients are
matrices whose rows (the last dimension) the reductions `sum_rows`, `mean_rows`, `max_rows` and
`min_rows` reduce to one value per row; per-row values combine with matrices elementwise (each
row sees its own value). A forward output that backward uses is shared, not copied: the saved
tensor is the output its consumer keeps (LowMemoryBP's memory sharing), at no cost.
"""
from __future__ import annotations

import functools
import hashlib
from operator import index as _index
import itertools
import math
import numbers
import os
import re
import warnings
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _bucket_solver, _custom_ops, _launch, _lib
from ._errors import AbpError, Status
from .autograd import NotScriptable

__all__ = ["operator", "Operator", "AuthoringError", "where", "quantize", "dequantize", "uniform",
           "sample", "unsample", "sum_rows", "mean_rows", "max_rows", "min_rows", "sum_all", "mean_all",
           "max_all", "min_all", "maximum", "minimum",
           "exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "erf", "sqrt", "rsqrt", "abs",
           "sin", "cos", "floor", "ceil", "trunc", "round", "sigmoid"]

_FUNCTIONS = ", ".join(n for n in __all__ if n[0].islower() and n != "operator")

# The shapes of traced tensors: elementwise operators see flat tensors; row operators matrices
# and per-row vectors.
_DIMS = {"flat": "?", "rows": "?x?", "per_row": "?"}


def _tensor_type(shape: str, element: str = "f32") -> str:
    return f"tensor<{_DIMS[shape]}x{element}>"


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _user_frame() -> Optional[Any]:
    """The innermost frame outside the abp package: the user's line that is being traced."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE:
        frame = frame.f_back
    return frame


def _user_location() -> str:
    """` loc("file":line:1)` of the user's line: compiler diagnostics then point at it."""
    frame = _user_frame()
    if frame is None:
        return ""
    path = frame.f_code.co_filename.replace("\\", "\\\\").replace('"', '\\"')
    return f' loc("{path}":{frame.f_lineno}:1)'


class AuthoringError(AbpError):
    """A mistake in a traced operator, with the user's file and line."""

    def __init__(self, message: str) -> None:
        frame = _user_frame()
        where_ = f"{frame.f_code.co_filename}:{frame.f_lineno}: " if frame is not None else ""
        super().__init__(Status.INVALID_ARGUMENT, where_ + message)


class _NoAttribute(AuthoringError, AttributeError):
    """A missing attribute of a traced value: an AuthoringError that hasattr() still reads as absent."""


@dataclass
class _Region:
    """One direction being traced: its IR lines and fresh SSA names."""

    prefix: str
    lines: List[str] = field(default_factory=list)
    count: int = 0

    def fresh(self) -> str:
        self.count += 1
        return f"%{self.prefix}{self.count}"


class Value:
    """A traced value: a float tensor, a mask (a comparison), b-bit codes, an f32 parameter or
    an i64 one (a draw's seed or offset); tensors and masks have an extent (flat, rows, per_row):
    not `shape`, which a user would take for a tensor's."""

    def __init__(self, trace: "_Trace", region: _Region, name: str, kind: str, extent: str = "",
                 bits: int = 0, scheme: str = "") -> None:
        self.trace, self.region, self.name, self.kind, self.extent = trace, region, name, kind, extent
        self.bits, self.scheme = bits, scheme
        # kind "scalar": arithmetic on parameters alone, kept as an expression and computed inside
        # each map that uses it (an operator region holds no scalar arithmetic of its own).
        self.operands: Sequence[Any] = ()
        self.body: Optional[Callable[[List[str]], Tuple[List[str], str]]] = None

    @property
    def type(self) -> str:
        if self.kind == "param":
            return "f32"
        if self.kind == "int_param":
            return "i64"
        if self.kind == "codes":
            return f"!abp.codes<{self.bits}>"
        return _tensor_type(self.extent, {"mask": "i8", "index": "i32"}.get(self.kind, "f32"))

    # Python operators: arithmetic on tensors and parameters, comparisons give masks.
    def __add__(self, other: Any) -> "Value": return _binary("arith.addf", self, other)
    def __radd__(self, other: Any) -> "Value": return _binary("arith.addf", other, self)
    def __sub__(self, other: Any) -> "Value": return _binary("arith.subf", self, other)
    def __rsub__(self, other: Any) -> "Value": return _binary("arith.subf", other, self)
    def __mul__(self, other: Any) -> "Value": return _binary("arith.mulf", self, other)
    def __rmul__(self, other: Any) -> "Value": return _binary("arith.mulf", other, self)
    def __truediv__(self, other: Any) -> "Value": return _binary("arith.divf", self, other)
    def __rtruediv__(self, other: Any) -> "Value": return _binary("arith.divf", other, self)
    def __neg__(self) -> "Value": return _unary("arith.negf", self)
    def __pow__(self, other: Any) -> "Value": return _binary("math.powf", self, other)
    def __gt__(self, other: Any) -> "Value": return _compare("ogt", self, other)
    def __ge__(self, other: Any) -> "Value": return _compare("oge", self, other)
    def __lt__(self, other: Any) -> "Value": return _compare("olt", self, other)
    def __le__(self, other: Any) -> "Value": return _compare("ole", self, other)
    def __eq__(self, other: Any) -> "Value": return _compare("oeq", self, other)  # type: ignore[override]
    def __ne__(self, other: Any) -> "Value": return _compare("une", self, other)  # type: ignore[override]
    def __abs__(self) -> "Value": return _unary("math.absf", self)
    def __rpow__(self, other: Any) -> "Value": return _binary("math.powf", other, self)
    def __mod__(self, other: Any) -> "Value": return _remainder(self, other)
    def __rmod__(self, other: Any) -> "Value": return _remainder(other, self)
    def __floordiv__(self, other: Any) -> "Value": return _floor_divide(self, other)
    def __rfloordiv__(self, other: Any) -> "Value": return _floor_divide(other, self)

    # round(x), math.floor(x), math.ceil(x), math.trunc(x): abp.author's (round: half to even, as Python's).
    def __floor__(self) -> "Value": return _unary("math.floor", self)
    def __ceil__(self) -> "Value": return _unary("math.ceil", self)
    def __trunc__(self) -> "Value": return _unary("math.trunc", self)

    def __round__(self, ndigits: Optional[int] = None) -> "Value":
        if ndigits is not None:
            raise AuthoringError("round(x, ndigits) has no traced form: round(x * 10**n) / 10**n rounds "
                                 "to n decimals")
        return _unary("math.roundeven", self)

    def _combine(self, *_: Any) -> Any:
        raise AuthoringError("masks (comparisons) are not combined with &, |, ^ or ~: nest where() "
                             "instead, e.g. where(x > 0, where(x < 1, a, b), b) for 0 < x < 1")
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __invert__ = _combine

    def __getattr__(self, attribute: str) -> Any:
        # Only for names a Value lacks (its own are found first); protocols (dunders) stay
        # AttributeErrors, which hasattr() and copy expect.
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        raise _NoAttribute(f"a traced value has no attribute or method {attribute!r} (it is no tensor: "
                           f"its shape and values exist only when the kernels run): use the functions of "
                           f"abp.author ({_FUNCTIONS}) and Python's arithmetic")

    def __bool__(self) -> bool:
        raise AuthoringError("a traced value has no truth value while tracing (it is known only "
                             "per element at run time): use abp.author.where(mask, a, b)")

    def __float__(self) -> float:
        raise AuthoringError(f"a traced value is not a number while tracing: use the functions of "
                             f"abp.author ({_FUNCTIONS}), not math's or numpy's")
    __int__ = __index__ = __float__  # type: ignore[assignment]

    def __array_ufunc__(self, ufunc: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        raise AuthoringError(f"numpy's {ufunc.__name__} cannot run on a traced value: use the "
                             f"functions of abp.author ({_FUNCTIONS})")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AuthoringError(f"{getattr(func, '__name__', func)} (torch) cannot run on a traced "
                             f"value: use the functions of abp.author ({_FUNCTIONS})")
    __hash__ = object.__hash__


#: The operators being traced now, innermost last (an operator defined inside another's definition).
_TRACING: List["_Trace"] = []

_FOREIGN = ("a value traced by another operator's definition is used here (kept in a global, a closure or "
            "an attribute from an earlier @operator, or from an operator not being traced now): an "
            "operator's forward and backward may use only its own inputs and parameters and what they "
            "compute from them; trace the value again inside this operator")


def _tracing(value: "Value") -> "_Trace":
    """The trace `value` belongs to, if that operator is the one being traced now."""
    if not _TRACING or value.trace is not _TRACING[-1]:
        raise AuthoringError(_FOREIGN)
    return value.trace


@dataclass
class _Trace:
    rows: bool
    forward: _Region = field(default_factory=lambda: _Region("f"))
    backward: _Region = field(default_factory=lambda: _Region("b"))
    # forward value name -> (the forward value saved, its backward block argument)
    residuals: Dict[str, Tuple[str, Value]] = field(default_factory=dict)
    # The inputs whose rows are a sample's (sample's index and weight), not the matrices'.
    sampled_rows: List[str] = field(default_factory=list)
    outputs: Tuple[str, ...] = ()  # the forward outputs' names, once forward is traced
    current: Optional[_Region] = None

    def arrive(self, value: Value) -> Value:
        """`value` as seen by the region being traced: a forward value used in backward becomes
        a residual (masks are packed to 1 bit on the way; an output is shared, not copied)."""
        if _tracing(value) is not self:
            raise AuthoringError(_FOREIGN)
        assert self.current is not None
        if value.region is self.current or self.current is self.forward:
            if value.region is not self.current:
                raise AuthoringError("a backward value is used in forward")
            return value
        if value.kind == "int_param":
            raise AuthoringError("an integer parameter (a draw's seed or offset) is not saved for "
                                 "backward: save what the draws decided (a mask, say) instead")
        if value.name not in self.residuals:
            saved, kind, bits = value.name, value.kind, value.bits
            if value.kind == "mask":  # an i8 tensor cannot be a residual: store it with 1 bit
                saved = self.forward.fresh()
                self.forward.lines.append(f"  {saved} = abp.pack {value.name} : {value.type} -> "
                                          f"!abp.codes<1>")
                kind, bits = "codes", 1
            arg = Value(self, self.backward, f"%r{len(self.residuals)}", kind, value.extent, bits,
                        value.scheme)
            self.residuals[value.name] = (saved, arg)
        saved, arg = self.residuals[value.name]
        if value.kind != "mask":
            return arg
        mask = Value(self, self.backward, self.backward.fresh(), "mask", value.extent)
        self.backward.lines.append(f"  {mask.name} = abp.unpack {arg.name} : !abp.codes<1> -> "
                                   f"{mask.type}")
        return mask

    def share_outputs(self) -> None:
        """Saves the forward outputs backward uses as shared (abp.share_saved: the tensor their
        consumer keeps, no memory of its own) when nothing else is saved per element; an output
        shared in place of an input leaves backward only per-row values and parameters besides
        it (the dialect's rule). Otherwise they are saved like any tensor."""
        def per_element(value_name: str, arg: Value) -> bool:
            return value_name not in self.outputs and arg.kind in ("tensor", "codes", "mask") \
                and arg.extent != "per_row"
        if any(per_element(name, arg) for name, (_, arg) in self.residuals.items()):
            return
        for name, (saved, arg) in list(self.residuals.items()):
            if name in self.outputs:
                shared = self.forward.fresh()
                self.forward.lines.append(f"  {shared} = abp.share_saved {name} : {arg.type}")
                self.residuals[name] = (shared, arg)

    def broadcast(self, value: Value) -> Value:
        """A per-row value seen by every element of its row (abp.broadcast_rows)."""
        region = self.current
        assert region is not None
        out = Value(self, region, region.fresh(), value.kind, "rows")
        region.lines.append(f"  {out.name} = abp.broadcast_rows {value.name} : {value.type} -> "
                            f"{out.type}")
        return out


def _float(value: float) -> str:
    if not math.isfinite(value):
        raise AuthoringError(f"the constant {value!r} is not finite")
    try:
        rounded = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # older Pythons refuse to pack it; newer ones give inf
        rounded = math.inf
    if math.isinf(rounded):  # finite in Python, infinite once the kernels' float32 holds it
        raise AuthoringError(f"the constant {value!r} is not finite in float32 (the kernels' type: at most "
                             f"3.4028235e+38 in magnitude)")
    return _bucket_solver.mlir_float(value)


def _map(results_kind: str, operands: Sequence[Any], body: Callable[[List[str]], Tuple[List[str], str]],
         mask_at: int = -1) -> Value:
    """One `abp.map` over the traced operands (Python numbers become constants in its body);
    `body(scalar names)` returns the body's lines and its result. Only operand `mask_at` may be a
    mask. On parameters alone it is a deferred scalar expression, computed in the maps using it."""
    first = next((v for v in operands if isinstance(v, Value)), None)
    if first is None:
        raise AuthoringError("expected at least one traced value (a tensor or a parameter)")
    trace = _tracing(first)
    region = trace.current
    assert region is not None
    for position, v in enumerate(operands):
        if isinstance(v, Value):
            if v.kind == "codes":
                raise AuthoringError("codes of abp.author.quantize are read by dequantize, not "
                                     "used in arithmetic")
            if v.kind == "index":
                raise AuthoringError("row indices (an index= input) are read by sample and unsample, "
                                     "not used in arithmetic")
            if v.kind == "int_param":
                raise AuthoringError("an integer parameter only keys draws (abp.author.uniform(seed, "
                                     "offset)); derive other seeds or offsets in Python and pass "
                                     "them as parameters of their own")
            if (v.kind == "mask") != (position == mask_at):
                raise AuthoringError("a mask (a comparison) selects, it is not a number: use "
                                     "where(mask, a, b)" if v.kind == "mask" else
                                     "where: expected a mask (a comparison of traced values) first")
        elif not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise AuthoringError(f"expected a traced value or a number, got {type(v).__name__}")
    if not any(isinstance(v, Value) and v.kind in ("tensor", "mask") for v in operands):
        if results_kind != "tensor":
            raise AuthoringError("compare a tensor: a comparison of parameters (or whole-tensor "
                                 "reductions) alone is one value for every element; compare "
                                 "x * 0.0 + value to get one per element")
        expression = Value(trace, region, "", "scalar")
        expression.operands, expression.body = tuple(operands), body
        return expression

    inputs: List[Value] = []
    lines: List[str] = []
    uid = itertools.count()

    def expand(v: Any) -> str:
        """The body's scalar for operand `v`: a block argument, a constant, or an inlined
        parameter expression (its local names made unique)."""
        if isinstance(v, Value) and v.kind == "scalar":
            assert v.body is not None
            names = [expand(o) for o in v.operands]
            inner, result = v.body(names)
            tag = next(uid)
            rename = functools.partial(re.sub, r"%(r|c|z|q\d+)\b", lambda m: f"%{m.group(1)}_{tag}")
            lines.extend(rename(line) for line in inner)
            return rename(result)
        if isinstance(v, Value):
            v = trace.arrive(v)
            for i, seen in enumerate(inputs):  # by identity: == on traced values traces a compare
                if seen is v:
                    return f"%s{i}"
            inputs.append(v)
            return f"%s{len(inputs) - 1}"
        name = f"%k{next(uid)}"
        lines.append(f"    {name} = arith.constant {_float(float(v))} : f32")
        return name

    scalars = [expand(v) for v in operands]
    shapes = {v.extent for v in inputs if v.kind != "param"}
    if "rows" in shapes:  # each row's elements see that row's per-row values
        inputs = [trace.broadcast(v) if v.extent == "per_row" else v for v in inputs]
        shape = "rows"
    else:
        shape = shapes.pop()
    body_lines, result = body(scalars)
    args = ", ".join(f"%s{i}: {'i8' if v.kind == 'mask' else 'f32'}" for i, v in enumerate(inputs))
    out = Value(trace, region, region.fresh(), results_kind, shape)
    operand_types = ", ".join(v.type for v in inputs)
    region.lines.append(
        f"  {out.name} = abp.map({', '.join(v.name for v in inputs)}) : ({operand_types}) -> "
        f"{out.type} {{\n  ^bb0({args}):\n" + "\n".join(lines + body_lines) +
        f"\n    abp.yield {result} : {'i8' if results_kind == 'mask' else 'f32'}\n  }}"
        + _user_location())
    return out


def _unary(op: str, x: Any) -> Value:
    return _map("tensor", [x], lambda s: ([f"    %r = {op} {s[0]} : f32"], "%r"))


def _binary(op: str, a: Any, b: Any) -> Value:
    return _map("tensor", [a, b], lambda s: ([f"    %r = {op} {s[0]}, {s[1]} : f32"], "%r"))


def _compare(predicate: str, a: Any, b: Any) -> Value:
    return _map("mask", [a, b], lambda s: ([f"    %c = arith.cmpf {predicate}, {s[0]}, {s[1]} : f32",
                                            "    %r = arith.extui %c : i1 to i8"], "%r"))


def where(mask: Value, a: Any, b: Any) -> Value:
    """a where mask holds, else b (elementwise)."""
    if not (isinstance(mask, Value) and mask.kind == "mask"):
        raise AuthoringError("where: expected a mask (a comparison of traced values) first")
    return _map("tensor", [mask, a, b], lambda s: (
        ["    %z = arith.constant 0 : i8", f"    %c = arith.cmpi ne, {s[0]}, %z : i8",
         f"    %r = arith.select %c, {s[1]}, {s[2]} : f32"], "%r"), mask_at=0)


def _fmod_lines(a: str, b: str) -> List[str]:
    """Map-body lines shared by % and //: %q0 = fmod(a, b) (arith.remf, the dividend's sign),
    %q1 = 1, and the i1 %q6: %q0 is non-zero and of the other sign than b (signs compared by
    copysign, which no underflow touches), where torch.remainder adds b once."""
    return [f"    %q0 = arith.remf {a}, {b} : f32",
            "    %q1 = arith.constant 1.0 : f32",
            "    %q2 = math.copysign %q1, %q0 : f32",
            f"    %q3 = math.copysign %q1, {b} : f32",
            "    %q4 = arith.mulf %q2, %q3 : f32",
            "    %z = arith.constant 0.0 : f32",
            "    %c = arith.cmpf olt, %q4, %z : f32",
            "    %q5 = arith.cmpf une, %q0, %z : f32",
            "    %q6 = arith.andi %c, %q5 : i1"]


def _remainder(a: Any, b: Any) -> Value:
    """a % b as torch.remainder computes it (Python's up to the sign of a zero result): fmod,
    then b added once where its result is non-zero and of the other sign than b (an infinite b
    with a of the other sign gives that infinity, as there). One map body, so that it also serves
    parameters alone (a deferred expression)."""
    def body(s: List[str]) -> Tuple[List[str], str]:
        a_, b_ = s
        return _fmod_lines(a_, b_) + [f"    %q7 = arith.addf %q0, {b_} : f32",
                                      "    %r = arith.select %q6, %q7, %q0 : f32"], "%r"
    return _map("tensor", [a, b], body)


def _floor_divide(a: Any, b: Any) -> Value:
    """a // b as torch.floor_divide computes it on floats, so that (a // b) * b + a % b is a up to
    rounding: (a − fmod(a, b)) / b, one less where fmod's result is non-zero and of the other sign
    than b, then rounded to the nearest whole number (the quotient of an exact difference, off by
    at most one ulp from it); a zero quotient keeps the sign of a / b, and b = 0 gives a / b.
    floor(a / b) differs: 1.0 // 0.1 is 9 (a / b rounds up to 10 in float32)."""
    def body(s: List[str]) -> Tuple[List[str], str]:
        a_, b_ = s
        return _fmod_lines(a_, b_) + [
            f"    %q7 = arith.subf {a_}, %q0 : f32",
            f"    %q8 = arith.divf %q7, {b_} : f32",
            "    %q9 = arith.subf %q8, %q1 : f32",
            "    %q10 = arith.select %q6, %q9, %q8 : f32",
            "    %q11 = math.floor %q10 : f32",
            "    %q12 = arith.subf %q10, %q11 : f32",
            "    %q13 = arith.constant 0.5 : f32",
            "    %q14 = arith.cmpf ogt, %q12, %q13 : f32",
            "    %q15 = arith.addf %q11, %q1 : f32",
            "    %q16 = arith.select %q14, %q15, %q11 : f32",
            f"    %q17 = arith.divf {a_}, {b_} : f32",
            "    %q18 = math.copysign %z, %q17 : f32",
            "    %q19 = arith.cmpf une, %q10, %z : f32",
            "    %q20 = arith.select %q19, %q16, %q18 : f32",
            f"    %q21 = arith.cmpf oeq, {b_}, %z : f32",
            "    %r = arith.select %q21, %q17, %q20 : f32"], "%r"
    return _map("tensor", [a, b], body)


def maximum(a: Any, b: Any) -> Value:
    """Elementwise maximum (NaN if either is NaN)."""
    return _binary("arith.maximumf", a, b)


def minimum(a: Any, b: Any) -> Value:
    """Elementwise minimum (NaN if either is NaN)."""
    return _binary("arith.minimumf", a, b)


def _math(op: str) -> Callable[[Any], Value]:
    def f(x: Any) -> Value:
        return _unary(op, x)
    f.__name__ = op.split(".")[1]
    f.__doc__ = f"Elementwise `{op}` (docs/dialect.md#scalar-operations)."
    return f


exp, exp2, expm1 = _math("math.exp"), _math("math.exp2"), _math("math.expm1")
log, log1p, log2 = _math("math.log"), _math("math.log1p"), _math("math.log2")
tanh, erf, sqrt, rsqrt = _math("math.tanh"), _math("math.erf"), _math("math.sqrt"), _math("math.rsqrt")
abs, sin, cos = _math("math.absf"), _math("math.sin"), _math("math.cos")
floor, ceil, trunc, round = (_math("math.floor"), _math("math.ceil"), _math("math.trunc"),
                             _math("math.roundeven"))


def sigmoid(x: Any) -> Value:
    """1 / (1 + exp(−x))."""
    return 1.0 / (1.0 + exp(-x))


def sample(x: Value, index: Value, weight: Value) -> Value:
    """Rows weight[r] * x[index[r]], one per index (-1: a row of zeros): abp.sample, which reads
    the rows of `x` through the index as it goes (no gathered copy). `x` is a matrix input of a
    row operator, read only through its index in that direction; `index` an index= input;
    `weight` one value per kept row. The result and `index` have the sample's rows, not x's."""
    if not (isinstance(x, Value) and x.kind == "tensor" and x.extent == "rows"):
        raise AuthoringError("sample: x must be a matrix of a row operator (@operator(rows=True))")
    if not (isinstance(index, Value) and index.kind == "index"):
        raise AuthoringError("sample: index must be an input named in index= (int32 row indices)")
    if not (isinstance(weight, Value) and weight.kind == "tensor" and weight.extent == "per_row"):
        raise AuthoringError("sample: weight must be one value per row (a per_row input, or a "
                             "row reduction)")
    trace = x.trace
    x, index, weight = trace.arrive(x), trace.arrive(index), trace.arrive(weight)
    region = trace.current
    assert region is not None
    for v in (index, weight):
        if v.name.startswith("%x") and v.name not in trace.sampled_rows:
            trace.sampled_rows.append(v.name)
    out = Value(trace, region, region.fresh(), "tensor", "rows")
    region.lines.append(f"  {out.name} = abp.sample {x.name}, {index.name}, {weight.name} : {x.type}, "
                        f"{index.type}, {weight.type} -> {out.type}" + _user_location())
    return out


def unsample(kept: Value, slot: Value) -> Value:
    """Row i = kept[slot[i]], or zeros where slot[i] < 0: abp.unsample, which puts a sample's rows
    back (one row per slot). `slot` is an index= input with one value per row of the result."""
    if not (isinstance(kept, Value) and kept.kind == "tensor" and kept.extent == "rows"):
        raise AuthoringError("unsample: kept must be a matrix of a row operator (@operator(rows=True))")
    if not (isinstance(slot, Value) and slot.kind == "index"):
        raise AuthoringError("unsample: slot must be an input named in index= (int32 row indices)")
    trace = kept.trace
    kept, slot = trace.arrive(kept), trace.arrive(slot)
    region = trace.current
    assert region is not None
    out = Value(trace, region, region.fresh(), "tensor", "rows")
    region.lines.append(f"  {out.name} = abp.unsample {kept.name}, {slot.name} : {kept.type}, {slot.type} "
                        f"-> {out.type}" + _user_location())
    return out


def _reduce(kind: str, x: Value) -> Value:
    if not (isinstance(x, Value) and x.kind == "tensor" and x.extent == "rows"):
        raise AuthoringError(f"{kind}_rows: expected a matrix of a row operator "
                             "(@operator(rows=True))")
    x = x.trace.arrive(x)
    out = Value(x.trace, x.region, x.region.fresh(), "tensor", "per_row")
    x.region.lines.append(f"  {out.name} = abp.reduce_rows {kind} {x.name} : {x.type} -> "
                          f"{out.type}" + _user_location())
    return out


def sum_rows(x: Value) -> Value:
    """The sum of each row (one value per row, accumulated in the compute type)."""
    return _reduce("sum", x)


def mean_rows(x: Value) -> Value:
    """The mean of each row."""
    return _reduce("mean", x)


def max_rows(x: Value) -> Value:
    """The maximum of each row (NaN if the row has one)."""
    return _reduce("max", x)


def min_rows(x: Value) -> Value:
    """The minimum of each row (NaN if the row has one)."""
    return _reduce("min", x)


def _reduce_all(kind: str, x: Value) -> Value:
    what = f"{kind}_all"
    if not isinstance(x, Value):
        raise AuthoringError(f"{what}: expected a traced tensor of an @abp.author.operator, got "
                             f"{type(x).__name__}")
    if x.kind == "mask":
        raise AuthoringError(f"{what}: a mask (a comparison) is not a number: reduce "
                             f"where(mask, 1.0, 0.0) to count it")
    if x.kind == "codes":
        raise AuthoringError(f"{what}: codes are read by dequantize; reduce dequantize(codes)")
    if x.kind != "tensor":
        raise AuthoringError(f"{what}: expected a tensor, got a single value (a parameter or a "
                             f"reduction), which needs no reducing")
    if x.extent not in ("flat", "rows"):
        raise AuthoringError(f"{what}: expected a tensor of the operator's shape (a per-row value "
                             f"is reduced along rows already; reduce the tensor itself)")
    x = x.trace.arrive(x)
    # One f32 for the whole tensor: maps read it like a parameter, backward may save it.
    out = Value(x.trace, x.region, x.region.fresh(), "param")
    x.region.lines.append(f"  {out.name} = abp.reduce_tensor {kind} {x.name} : {x.type} -> f32"
                          + _user_location())
    return out


def sum_all(x: Value) -> Value:
    """The sum of every element (one value, accumulated in the compute type, in an order that
    depends only on the element count: no host sync, the same bits on every device)."""
    return _reduce_all("sum", x)


def mean_all(x: Value) -> Value:
    """The mean of every element (NaN for an empty tensor)."""
    return _reduce_all("mean", x)


def max_all(x: Value) -> Value:
    """The maximum of every element (NaN if there is one; -inf for an empty tensor): a
    per-tensor absmax scale is max_all(abs(x))."""
    return _reduce_all("max", x)


def min_all(x: Value) -> Value:
    """The minimum of every element (NaN if there is one; +inf for an empty tensor)."""
    return _reduce_all("min", x)


def uniform(seed: Value, offset: Value) -> Value:
    """U[0, 1) draws, one per element, from the Philox stream of abp (the same on the CPU and
    the GPU): element e draws at counter offset + e under key `seed`. `seed` and `offset` are
    integer parameters (``params={"seed": int, "offset": int}``) of the forward."""
    for what, v in (("seed", seed), ("offset", offset)):
        if not (isinstance(v, Value) and v.kind == "int_param"):
            raise AuthoringError(f"uniform: {what} must be an integer parameter: declare it with "
                                 f"params={{..., {what!r}: int}}")
    trace = _tracing(seed)
    region = trace.current
    if region is not trace.forward:
        raise AuthoringError("uniform: draws are made in forward; save what they decided for "
                             "backward")
    out = Value(trace, region, region.fresh(), "tensor", "rows" if trace.rows else "flat")
    region.lines.append(f"  {out.name} = abp.uniform {seed.name}, {offset.name} : i64, i64 -> "
                        f"{out.type}" + _user_location())
    return out


def _scheme(table: Any) -> Tuple[str, int]:
    borders, levels = getattr(table, "borders", None), getattr(table, "levels", None)
    if borders is None and isinstance(table, tuple) and len(table) == 2:
        borders, levels = table
    if borders is None:
        raise AuthoringError("expected a bucket table: abp.buckets.fit_buckets(...)'s result, or "
                             "(borders, levels)")
    borders, levels = [float(t) for t in borders], [float(v) for v in levels]
    bits = int(math.log2(len(levels))) if levels else 0
    if not 1 <= bits <= 8 or len(levels) != 2 ** bits or len(borders) != len(levels) - 1:
        raise AuthoringError(f"a bucket table has 2^b levels (b in 1..8) and one border fewer, got "
                             f"{len(borders)} borders and {len(levels)} levels")
    as_f32 = [struct.unpack("f", struct.pack("f", t))[0] for t in borders]
    if any(b <= a for a, b in zip(as_f32, as_f32[1:])):
        raise AuthoringError(f"a bucket table's borders must increase strictly in fp32, got "
                             f"{borders}")
    text = (f"#abp.buckets<borders = [{', '.join(_float(t) for t in borders)}], "
            f"levels = [{', '.join(_float(v) for v in levels)}]>")
    return text, bits


def quantize(x: Value, table: Any) -> Value:
    """The bucket codes #{borders < x} of `x`, stored with log2(len(levels)) bits per element."""
    if not (isinstance(x, Value) and x.kind == "tensor" and x.extent != "per_row"):
        raise AuthoringError("quantize: expected a traced float tensor")
    scheme, bits = _scheme(table)
    x = x.trace.arrive(x)
    region = x.region
    out = Value(x.trace, region, region.fresh(), "codes", x.extent, bits, scheme)
    region.lines.append(f"  {out.name} = abp.quantize {x.name} {{scheme = {scheme}}} : {x.type} "
                        f"-> !abp.codes<{bits}>" + _user_location())
    return out


def dequantize(codes: Value, table: Optional[Any] = None) -> Value:
    """levels[code] for each element (the table `quantize` used, unless another is given)."""
    if not (isinstance(codes, Value) and codes.kind == "codes"):
        raise AuthoringError("dequantize: expected the codes of abp.author.quantize")
    scheme = _scheme(table)[0] if table is not None else codes.scheme
    codes = codes.trace.arrive(codes)
    region = codes.region
    out = Value(codes.trace, region, region.fresh(), "tensor", codes.extent)
    region.lines.append(f"  {out.name} = abp.dequantize {codes.name} {{scheme = {scheme}}} : "
                        f"!abp.codes<{codes.bits}> -> {out.type}" + _user_location())
    return out


class Operator:
    """A compiled operator written in Python: call it on tensors (and its parameters)."""

    def __init__(self, name: str, ir: str, inputs: int, params: Tuple[str, ...],
                 param_types: Tuple[type, ...] = (), input_names: Tuple[str, ...] = (),
                 per_row: Tuple[str, ...] = (), rows: bool = False, index: Tuple[str, ...] = (),
                 sampled_rows: Tuple[str, ...] = (), defaults: Optional[Dict[str, Any]] = None) -> None:
        self.name, self.ir, self.inputs, self.params = name, ir, inputs, params
        #: The parameters' default values, from the function's signature.
        self.defaults = dict(defaults or {})
        self.param_types = param_types or (float,) * len(params)
        self.input_names = input_names or tuple(f"input{i}" for i in range(inputs))
        self.per_row, self.rows = per_row, rows
        # Row indices (int32), and the per-row inputs that have a sample's rows (its index and
        # weight) instead of one value per row of the matrices.
        self.index, self.sampled_rows = index, sampled_rows
        # Every operator the front end makes has a dense input, so it is a torch.library op
        # under torch.compile (no graph break) where torch has torch.library.custom_op.
        compiled = _lib.kernel_library().operator(name)
        self._library_op = _custom_ops.registrable(compiled)
        # The launch dtypes its kernels have: float64 needs every kernel to be a row or a total
        # kernel (a row operator without a row reduction compiles to an elementwise one).
        self._dtypes = tuple(d for d in _launch.ROW_DTYPES if _launch.DTYPE_NAMES[d] in compiled.dtypes)

    # Pickled (torch.save of a model holding its module): the IR and what __init__ takes, not the
    # kernel library's handles. Loaded, the IR is compiled in the loading process unless an
    # operator of the same maths is there already; where its name holds other maths there (an
    # operator defined otherwise, or an op library's), it takes the name of its maths, as a
    # redefinition does: the module runs what was pickled, never what the name means here.
    _STATE = ("name", "ir", "inputs", "params", "param_types", "input_names", "per_row", "rows", "index",
              "sampled_rows", "defaults")

    def __getstate__(self) -> Dict[str, Any]:
        return {key: getattr(self, key) for key in self._STATE}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        missing = [key for key in ("name", "ir", "inputs", "params") if key not in state]
        if missing:
            raise AuthoringError(f"a pickled abp.author operator without {missing}: not one this abp wrote")
        name, ir = _compile_once(state["name"], state["ir"], origin=f"pickled operator {state['name']}",
                                 pickled=True)
        self.__init__(name, ir, **{key: state[key] for key in self._STATE[2:] if key in state})  # type: ignore[misc]

    def _check_params(self, values: Sequence[Any], what: str) -> Tuple[Any, ...]:
        checked: List[Any] = []
        for name, kind, value in zip(self.params, self.param_types, values):
            if kind is int:  # a seed or an offset: Python, numpy or 0-d torch integers
                if _custom_ops.compiling() and isinstance(value, int) and not isinstance(value, bool):
                    # Under torch.compile a seed that changes per call becomes a symbolic integer:
                    # __index__ would specialise the graph on its value (a compile per seed);
                    # the range check below only guards its sign and size.
                    number = value
                else:
                    try:
                        number = None if isinstance(value, bool) else _index(value)
                    except TypeError:
                        number = None
                if number is None:
                    raise TypeError(f"{what}: parameter {name!r} must be an int, got {type(value).__name__}")
                if not 0 <= number < 2**63:
                    raise ValueError(f"{what}: parameter {name!r} must lie in [0, 2**63), got {number}")
                checked.append(number)
                continue
            # A Python, numpy or 0-d torch number, as an int parameter takes its integers.
            if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{what}: parameter {name!r} must be a number, got {type(value).__name__}")
            checked.append(float(value))
        return tuple(checked)

    def _check_tensors(self, tensors: Sequence[Any]) -> None:
        """Names the user's arguments: dense ones share dtype, device and shape; per-row ones
        hold one value per row of them, in the compute dtype."""
        dtypes = self._dtypes
        first: Optional[Tuple[str, torch.Tensor]] = None
        for name, t in zip(self.input_names, tensors):
            if name in self.per_row or name in self.index:
                continue
            _launch.check_float_tensor(f"{self.name}: {name}", t, dtypes)
            if first is None:
                first = (name, t)
                continue
            for what, mine, theirs in (("dtype", t.dtype, first[1].dtype), ("device", t.device, first[1].device),
                                       ("shape", tuple(t.shape), tuple(first[1].shape))):
                if mine != theirs:
                    raise ValueError(f"{self.name}: {name}: expected the {what} of {first[0]}, {theirs}, got {mine}")
        assert first is not None
        if self.rows and first[1].dim() == 0:
            raise ValueError(f"{self.name}: {first[0]}: expected at least one dimension (rows run along the last)")
        sample: Optional[Tuple[str, int]] = None  # the first input with a sample's rows, and their count
        for name, t in zip(self.input_names, tensors):
            if name not in self.per_row and name not in self.index:
                continue
            dtype = torch.int32 if name in self.index else _launch.compute_dtype(first[1].dtype)
            if name in self.sampled_rows:
                # A sample's rows: one value each, as many as the sample's first such input has.
                if sample is None and isinstance(t, torch.Tensor) and t.dim() == 1:
                    sample = (name, t.numel())
                rows, of = ((sample[1],), f"the sample's rows ({sample[0]})") if sample else ((-1,), "the sample's rows")
            else:
                rows, of = tuple(first[1].shape[:-1]), first[0]
            want = (rows, dtype, first[1].device)
            got = (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else None
            if got != want:
                shape = "a 1-d shape" if rows == (-1,) else f"shape {rows}"
                raise ValueError(f"{self.name}: {name}: expected one value per row of {of}: a tensor of {shape}, "
                                 f"dtype {dtype}, on {want[2]}, got "
                                 + (f"shape {got[0]}, dtype {got[1]}, on {got[2]}" if got else type(t).__name__))

    def _bind(self, names: Sequence[str], args: Sequence[Any], kwargs: Dict[str, Any], what: str) -> List[Any]:
        """`args` and `kwargs` bound to `names` as Python binds a call, with the signature's defaults."""
        return _launch.bind_arguments(names, args, kwargs, what, self.defaults,
                                      f"it takes {self.inputs} tensor(s) {list(self.input_names)} and the "
                                      f"parameters {list(self.params)}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .autograd import apply_eager

        if kwargs or len(args) != self.inputs + len(self.params):
            args = tuple(self._bind(self.input_names + self.params, args, kwargs, self.name))
        tensors = args[:self.inputs]
        self._check_tensors(tensors)
        params = self._check_params(args[self.inputs:], self.name)
        if self._library_op and _custom_ops.compiling():
            return _custom_ops.apply_custom(self.name, params, tensors)
        return apply_eager(self.name, params, tensors)

    def module(self, *params: Any, **kwparams: Any) -> "torch.nn.Module":
        """An nn.Module applying this operator with `params` fixed (by position or by name; those
        not given take their defaults), with no parameters or buffers of its own, so it drops
        into a model and its state dict unchanged."""
        values = self._bind(self.params, params, kwparams, f"{self.name}.module")
        return _OperatorModule(self, self._check_params(values, f"{self.name}.module"))

    def _inspect(self) -> Dict[str, Any]:
        from . import inspect
        return inspect(self.name)

    @property
    def cuda(self) -> str:
        """The generated CUDA C++ (the CPU path is built from the same text)."""
        return str(self._inspect()["source"])

    @property
    def manifest(self) -> Dict[str, Any]:
        """The operator's manifest record (kernels, arguments, residuals)."""
        return dict(self._inspect()["operator"])

    @property
    def saved_bits(self) -> int:
        """Bits kept per element between forward and backward (a shared output costs none), at
        float32 launches: a float residual is kept in the launch dtype, so 16 of its 32 bits at
        float16 and bfloat16 (codes and masks keep their widths at any dtype)."""
        return int(self.manifest["saved_bits_per_element"])

    @property
    def saved_bits_per_row(self) -> int:
        """Bits kept per row (per-row statistics of a row operator)."""
        return int(self.manifest["saved_bits_per_row"])


class _OperatorModule(NotScriptable, torch.nn.Module):
    def __init__(self, op: Operator, params: Tuple[Any, ...]) -> None:
        super().__init__()
        self.op, self.params = op, params

    # Its parameters by name: `module.slope` reads one, `module.slope = 0.2` sets it (checked as
    # .module() checks it; it was an attribute the module never read).
    def _param_index(self, name: str) -> Optional[int]:
        op = self.__dict__.get("op")
        if op is None or name not in op.params or name in ("op", "params") or hasattr(torch.nn.Module, name):
            return None
        return op.params.index(name)

    def __getattr__(self, name: str) -> Any:
        index = self._param_index(name)
        return super().__getattr__(name) if index is None else self.params[index]

    def __setattr__(self, name: str, value: Any) -> None:
        index = self._param_index(name)
        if index is None:
            super().__setattr__(name, value)
            return
        values = list(self.params)
        values[index] = value
        super().__setattr__("params", self.op._check_params(values, f"{self.op.name}.module: {name}"))

    def forward(self, *tensors: torch.Tensor) -> Any:
        return self.op(*tensors, *self.params)

    def extra_repr(self) -> str:
        return f"{self.op.name}" + "".join(f", {n}={v}" for n, v in zip(self.op.params, self.params))


def operator(fn: Optional[Callable[..., Any]] = None, *, name: Optional[str] = None,
             params: Any = (), rows: bool = False, per_row: Sequence[str] = (),
             no_grad: Sequence[str] = (), index: Sequence[str] = ()) -> Any:
    """Traces `fn(*tensors, *params) -> (outputs, backward)` into an abp operator and compiles it.

    `fn` takes its tensor inputs, then its parameters: `params` names them, all floats
    (``("slope",)``), or maps each name to float or int (``{"p": float, "seed": int,
    "offset": int}``; integer parameters key `uniform`'s draws). It returns its output (or a
    tuple of outputs) and `backward`, a function of one gradient per output that returns one
    gradient per tensor input, except those named in `no_grad` (inputs without a gradient).
    `rows=True` makes a row-wise operator (rows along the last dimension; `mean_rows` and the
    other reductions); its inputs named in `per_row` hold one value per row, and its outputs may
    too (a per-row output's gradient is per row). Its inputs named in `index` hold int32 row
    indices, one per row, for `sample` and `unsample` (they have no gradient). Use as `@operator`
    or `@operator(name=..., params=..., rows=..., per_row=..., no_grad=..., index=...)`.
    """
    for what, names in (("params", params), ("per_row", per_row), ("no_grad", no_grad), ("index", index)):
        if isinstance(names, str):
            raise AuthoringError(f"{what}: expected a sequence of names, e.g. ({names!r},), got the "
                                 "string itself")
    if fn is None:
        return lambda f: operator(f, name=name, params=params, rows=rows, per_row=per_row, no_grad=no_grad,
                                  index=index)
    return _build(fn, name or fn.__name__, _param_types(params), rows, tuple(per_row), tuple(no_grad),
                  tuple(index))


def _param_types(params: Any) -> Dict[str, type]:
    """`params` as {name: float or int}, in order."""
    if isinstance(params, dict):
        for key, kind in params.items():
            if kind not in (float, int):
                raise AuthoringError(f"params: the type of {key!r} must be float or int, got {kind!r}")
        return dict(params)
    return {p: float for p in params}


def _tensors(name: str, what: str, values: Any, trace: _Trace, region: _Region,
             shapes: Optional[Sequence[str]] = None, labels: Sequence[str] = ()) -> List[Value]:
    """`values` (one or a tuple) as the traced tensors of `region` an operator returns; `shapes`:
    the shape each must have (default: any matrix or per-row value of a row operator, else flat);
    `labels`: what each is (the input a gradient is for), for the error."""
    values = list(values) if isinstance(values, (tuple, list)) else [values]
    allowed = ("rows", "per_row") if trace.rows else ("flat",)
    for i, v in enumerate(values):
        want = (shapes[i],) if shapes is not None and i < len(shapes) else allowed
        if not (isinstance(v, Value) and v.kind == "tensor" and v.region is region and v.extent in want):
            direction = "forward" if region is trace.forward else "backward"
            kind = {"rows": "a matrix", "per_row": "one value per row", "flat": "a tensor"}
            which = f"{what[:-1]} {i}" + (f" (for {labels[i]})" if i < len(labels) else "")
            raise AuthoringError(f"{name}: {which} must be a traced float tensor of the {direction}"
                                 + (f" ({' or '.join(kind[w] for w in want)})" if trace.rows else "")
                                 + f", got {_describe(v, trace, region)}")
    return values


def _describe(v: Any, trace: _Trace, region: _Region) -> str:
    """What an operator returned where a traced tensor of `region` belongs, for an error."""
    if v is None:
        return "None (an input without a gradient is named in no_grad=)"
    if isinstance(v, Value) and v.trace is not trace:
        return "a value of another operator's trace (" + _FOREIGN.split("(", 1)[1]
    if isinstance(v, Value):
        if v.kind in ("param", "int_param"):
            return ("one number for every element (a parameter or a whole-tensor reduction): make a tensor of it, "
                    "e.g. x * 0 + it")
        if v.kind != "tensor":
            return f"a {v.kind} (make a float tensor of it, e.g. with where())"
        shape = {"rows": "a matrix", "per_row": "one value per row"}.get(v.extent, "a tensor")
        return f"{shape} of the {'forward' if v.region is trace.forward else 'backward'}"
    if isinstance(v, (int, float)):
        tensor = "x" if region is trace.forward else "dy"
        return f"the number {v!r} (a constant: make a tensor of it, e.g. {tensor} * 0 + {v!r})"
    return type(v).__name__


def _warn_unread_gradients(name: str, fn: Callable[..., Any], grads: Sequence[Value], lines: Sequence[str]) -> None:
    """Warns where backward never reads an output's gradient: the input gradients it returns then
    do not depend on the loss through that output, which is a mistake unless nothing reads it."""
    text = "\n".join(lines)
    unread = [i for i, g in enumerate(grads) if not re.search(re.escape(g.name) + r"\b", text)]
    if unread:
        which = ", ".join(f"output {i}" for i in unread)
        warnings.warn_explicit(f"{name}: backward never reads the gradient of {which} (its dy): the gradients it "
                               "returns do not depend on the loss through it", UserWarning,
                               fn.__code__.co_filename, fn.__code__.co_firstlineno)


def _build(fn: Callable[..., Any], name: str, param_types: Dict[str, type], rows: bool,
           per_row: Tuple[str, ...], no_grad: Tuple[str, ...], index: Tuple[str, ...] = ()) -> Operator:
    import inspect as pyinspect

    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise AuthoringError(f"name: {name!r} is not an identifier (letters, digits and _, not beginning with a "
                             "digit): it names the operator's kernels and torch ops" +
                             ("; a lambda needs name=..." if name == "<lambda>" else ""))
    params = tuple(param_types)
    signature = pyinspect.signature(fn).parameters
    loose = [f"{'*' if p.kind is p.VAR_POSITIONAL else '**' if p.kind is p.VAR_KEYWORD else ''}{n}"
             for n, p in signature.items() if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if loose:
        raise AuthoringError(f"{name}: takes {', '.join(loose)}: an operator's function names each tensor input, "
                             "then each parameter, as plain positional arguments (no *args, **kwargs or "
                             "keyword-only ones)")
    arguments = list(signature)
    inputs = len(arguments) - len(params)
    if inputs < 1:
        raise AuthoringError(f"{name}: takes {len(arguments)} argument(s) but names {len(params)} "
                             f"parameter(s); at least one tensor input comes first")
    if tuple(arguments[inputs:]) != params:
        raise AuthoringError(f"{name}: params= names {list(params)}, but its last {len(params)} argument(s) are "
                             f"{arguments[inputs:]}: the parameters come after the tensor inputs, with the same names "
                             "in the same order")
    defaults = {n: signature[n].default for n in arguments if signature[n].default is not pyinspect.Parameter.empty}
    tensor_defaults = [n for n in arguments[:inputs] if n in defaults]
    if tensor_defaults:
        raise AuthoringError(f"{name}: tensor input(s) {tensor_defaults} have a default value; only parameters may")
    tensor_names = arguments[:inputs]
    for what, names in (("per_row", per_row), ("no_grad", no_grad), ("index", index)):
        unknown = [n for n in names if n not in tensor_names]
        if unknown:
            raise AuthoringError(f"{name}: {what} names {unknown}, which are not among its tensor "
                                 f"inputs {tensor_names}")
    if per_row and not rows:
        raise AuthoringError(f"{name}: per_row inputs need a row operator (@operator(rows=True))")
    if index and not rows:
        raise AuthoringError(f"{name}: index inputs need a row operator (@operator(rows=True))")
    both = [n for n in index if n in per_row]
    if both:
        raise AuthoringError(f"{name}: {both} named in both per_row and index: row indices are per row "
                             "already; name them in index only")
    # Row indices have no gradient.
    no_grad = no_grad + tuple(n for n in index if n not in no_grad)
    if len(no_grad) == inputs:
        raise AuthoringError(f"{name}: every input is in no_grad; an operator differentiates at "
                             "least one")
    trace = _Trace(rows)
    shape = "rows" if rows else "flat"
    if rows and all(n in per_row or n in index for n in tensor_names):
        raise AuthoringError(f"{name}: a row operator needs at least one matrix input (its rows)")
    # Values are refused outside the trace they belong to (_Trace.arrive): one kept from another
    # operator's definition would otherwise be read by its SSA name, another value of this one.
    _TRACING.append(trace)
    try:
        trace.current = trace.forward
        xs = [Value(trace, trace.forward, f"%x{i}", "index" if n in index else "tensor",
                    "per_row" if n in per_row or n in index else shape)
              for i, n in enumerate(tensor_names)]
        ps = [Value(trace, trace.forward, f"%p{i}", "int_param" if kind is int else "param")
              for i, kind in enumerate(param_types.values())]
        returned = fn(*xs, *ps)
        if not (isinstance(returned, tuple) and len(returned) == 2 and callable(returned[1])):
            raise AuthoringError(f"{name}: expected `return outputs, backward`")
        outputs = _tensors(name, "outputs", returned[0], trace, trace.forward)
        trace.outputs = tuple(o.name for o in outputs)
        backward = returned[1]
        try:
            pyinspect.signature(backward).bind(*range(len(outputs)))
        except TypeError:
            raise AuthoringError(f"{name}: backward must take one gradient per output "
                                 f"({len(outputs)})") from None
        except ValueError:
            pass  # a builtin without a signature: let the call say
        trace.current = trace.backward
        grads = [Value(trace, trace.backward, f"%g{i}", "tensor", o.extent) for i, o in enumerate(outputs)]
        returned_grads = backward(*grads)
        differentiated = [x for n, x in zip(tensor_names, xs) if n not in no_grad]
        count = len(returned_grads) if isinstance(returned_grads, (tuple, list)) else 1
        if count != len(differentiated):
            hint = (f" (its first {inputs} argument(s) are tensors; name parameters in params=)"
                    if count < len(differentiated) and not no_grad else "")
            without = (f", {len(no_grad)} of them in no_grad: expected {len(differentiated)}, for "
                       f"{[n for n in tensor_names if n not in no_grad]}") if no_grad else ""
            raise AuthoringError(f"{name}: backward returns {count} gradient(s) for {inputs} tensor "
                                 f"input(s){without}{hint}")
        if not isinstance(returned_grads, (tuple, list)):
            returned_grads = [returned_grads]
        dxs = _tensors(name, "gradients", [trace.arrive(g) if isinstance(g, Value) else g
                                           for g in returned_grads], trace, trace.backward,
                       [x.extent for x in differentiated], [n for n in tensor_names if n not in no_grad])

        _warn_unread_gradients(name, fn, grads, trace.backward.lines + [g.name for g in dxs])
        trace.share_outputs()
        saved = list(trace.residuals.values())
        fwd_args = [f"{x.name}: {x.type}" for x in xs] + [f"{p.name}: {p.type}" for p in ps]
        saves = (f" saves {', '.join(s for s, _ in saved)} : {', '.join(a.type for _, a in saved)}"
                 if saved else "")
        bwd_args = [f"{a.name}: {a.type}" for _, a in saved] + [f"{g.name}: {g.type}" for g in grads]
        attributes = []
        if params:
            attributes.append(f"params = [{', '.join(chr(34) + p + chr(34) for p in params)}]")
        if no_grad:
            attributes.append(f"no_grad = array<i64: {', '.join(str(tensor_names.index(n)) for n in no_grad)}>")
        attrs = f" attributes {{{', '.join(attributes)}}}" if attributes else ""
        ir = "\n".join(
            [f"abp.operator @{name}{attrs} forward {{", f"^bb0({', '.join(fwd_args)}):"]
            + trace.forward.lines
            + [f"  abp.return {', '.join(o.name for o in outputs)} : "
               f"{', '.join(o.type for o in outputs)}{saves}", "} backward {",
               f"^bb0({', '.join(bwd_args)}):"]
            + trace.backward.lines
            + [f"  abp.return {', '.join(g.name for g in dxs)} : {', '.join(g.type for g in dxs)}",
               "}", ""])
    finally:
        _TRACING.remove(trace)
        trace.current = None
    name, ir = _compile_once(name, ir, origin=f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}")
    sampled = tuple(tensor_names[int(v[2:])] for v in trace.sampled_rows)
    return Operator(name, ir, inputs, params, tuple(param_types.values()), tuple(tensor_names),
                    per_row, rows, index, sampled, {n: v for n, v in defaults.items() if n in params})


def _compile_once(name: str, ir: str, origin: str, pickled: bool = False) -> Tuple[str, str]:
    """(name, IR) of the operator `ir` (named `name`) in this process, compiled once: under its
    own name, or where that name holds other maths (redefined; or, for a `pickled` one, defined
    otherwise in this process, or an op library's), under its name and the digest of its maths."""
    from . import compile_operators, operators

    if name not in _compiled_ir and name in operators() and not pickled:
        raise AuthoringError(f"operator name {name!r} is taken by the op library or by IR compiled "
                             "with compile_operators; pass name=...")
    maths = _without_locations(ir)
    if (name in _compiled_ir and _without_locations(_compiled_ir[name]) != maths) or (
            pickled and name not in _compiled_ir and name in operators()):
        # Redefined with other maths (a loop over variants, an edited notebook cell): operators
        # cannot be replaced, so this one is named after its maths, and .name says so. The same
        # maths written on other lines is the same operator (the locations only point diagnostics).
        digest = hashlib.sha256(maths.encode()).hexdigest()[:8]
        ir = ir.replace(f"abp.operator @{name} ", f"abp.operator @{name}_{digest} ", 1)
        name = f"{name}_{digest}"
    if name not in _compiled_ir:
        compile_operators(ir, origin=origin)
        _compiled_ir[name] = ir
    else:
        ir = _compiled_ir[name]  # what was compiled under that name (its locations)
    return name, ir


_LOCATION = re.compile(r' loc\("[^"]*":\d+:\d+\)')


def _without_locations(ir: str) -> str:
    """`ir` without its source locations: what the operator computes."""
    return _LOCATION.sub("", ir)


_compiled_ir: Dict[str, str] = {}
