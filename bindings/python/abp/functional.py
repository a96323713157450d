"""Activations with approximate (k-bit) or exact 1-bit backward passes, by their torch.nn.functional names.

Every function computes the exact forward (fp32 maths, stored in the input's dtype) and saves only
packed codes for the backward (docs/algorithms.md §2, §4):

- ``regelu2`` / ``resilu2``: 2-bit codes, LowMemoryBP's tables; ``regelu2(x, approximate="tanh")``
  is GELU's tanh form with its own fitted table (operator ``regelu2_tanh``).
- FewBit continuous activations (``gelu``, ``silu``, ``celu``, ``elu``, ``hardswish``, ``logsigmoid``,
  ``mish``, ``selu``, ``sigmoid``, ``softplus``, ``softsign``, ``tanh``, ``tanhshrink``): ``bits``-bit
  codes (1..4); ``weight="normal"`` (default) uses the tables fitted under a standard-normal weight,
  ``weight="uniform"`` the uniform-weight tables (parity with the published FewBit tables). The
  tables are fitted for torch's default parameters only; ``gelu(x, approximate="tanh")`` uses tables
  fitted for the tanh form (operators ``gelu_tanh_b<bits>``).
- Piecewise-linear activations (``relu``, ``relu6``, ``hardsigmoid``, ``leaky_relu``, ``threshold``,
  ``hardtanh``, ``hardshrink``, ``softshrink``): their exact derivative in 1 bit per element.

``inplace=True`` writes the result into the input and returns the input, as torch's functions do
(the codes are taken from the input before it is written; an input that is a leaf requiring grad
raises, as torch's in-place ops do).

Memory-sharing norms (docs/algorithms.md §5): ``ms_layer_norm`` and ``ms_rms_norm`` normalize over the
trailing ``normalized_shape`` dimensions without affine parameters and save only their own output
(which the next Linear keeps anyway) plus one statistic per row; fp32/fp16/bf16/fp64.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _affine_norm, _amp, _custom_ops, _launch, autograd

__all__ = [
    "CONTINUOUS",
    "PIECEWISE",
    "GELU_FORMS",
    "fewbit_operator",
    "gelu_form",
    "apply",
    "regelu2",
    "resilu2",
    "gelu",
    "silu",
    "celu",
    "elu",
    "hardswish",
    "logsigmoid",
    "mish",
    "selu",
    "sigmoid",
    "softplus",
    "softsign",
    "tanh",
    "tanhshrink",
    "relu",
    "relu6",
    "hardsigmoid",
    "leaky_relu",
    "threshold",
    "hardtanh",
    "hardshrink",
    "softshrink",
    "ms_layer_norm",
    "ms_rms_norm",
    "check_normalized_shape",
    "check_eps",
    "check_inplace",
    "in_place",
]

#: FewBit continuous activations: operators ``<name>_b<bits>`` and ``<name>_b<bits>_uniform``.
CONTINUOUS: Tuple[str, ...] = (
    "gelu",
    "silu",
    "celu",
    "elu",
    "hardswish",
    "logsigmoid",
    "mish",
    "selu",
    "sigmoid",
    "softplus",
    "softsign",
    "tanh",
    "tanhshrink",
)
#: Piecewise-linear activations with an exact 1-bit derivative (operator name = function name).
PIECEWISE: Tuple[str, ...] = (
    "relu",
    "relu6",
    "hardsigmoid",
    "leaky_relu",
    "threshold",
    "hardtanh",
    "hardshrink",
    "softshrink",
)
_WEIGHTS = ("normal", "uniform")
#: GELU's two forms by torch's ``approximate=`` name: (FewBit table family, ReGELU2 operator).
#: "gelu_tanh" is a table family without a torch.nn.functional name of its own.
GELU_FORMS: Dict[str, Tuple[str, str]] = {"none": ("gelu", "regelu2"), "tanh": ("gelu_tanh", "regelu2_tanh")}
_FEWBIT_FAMILIES = CONTINUOUS + ("gelu_tanh",)


def gelu_form(approximate: str) -> Tuple[str, str]:
    """(FewBit table family, ReGELU2 operator) of GELU's ``approximate`` form: ("gelu", "regelu2")
    for "none" (erf form), ("gelu_tanh", "regelu2_tanh") for "tanh". Raises ValueError naming
    ``approximate`` for anything else."""
    form = GELU_FORMS.get(approximate) if isinstance(approximate, str) else None
    if form is None:
        raise ValueError(f"approximate: expected 'none' (erf form) or 'tanh' (tanh form), as torch's GELU, got {approximate!r}")
    return form


def fewbit_operator(activation: str, bits: int, weight: str = "normal") -> str:
    """The operator name of a FewBit activation: ``gelu_b3``, ``gelu_b3_uniform``, ``gelu_tanh_b2``, ...

    ``activation`` is a name of CONTINUOUS or "gelu_tanh" (GELU's tanh form). Raises ValueError naming
    ``activation``, ``bits`` (not in 1..4) or ``weight`` (not "normal" or "uniform").
    """
    if activation not in _FEWBIT_FAMILIES:
        raise ValueError(f"activation: expected one of {', '.join(_FEWBIT_FAMILIES)}, got {activation!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (1, 2, 3, 4):
        raise ValueError(f"bits: expected 1, 2, 3 or 4 (bits per element of the saved codes), got {bits!r}")
    if weight not in _WEIGHTS:
        raise ValueError(f"weight: expected 'normal' or 'uniform' (the table's fitting weight), got {weight!r}")
    return f"{activation}_b{bits}" + ("_uniform" if weight == "uniform" else "")


def check_inplace(inplace: Any) -> bool:
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace: expected True or False, got {inplace!r}")
    return inplace


def in_place(input: Tensor, output: Tensor, inplace: bool) -> Tensor:
    """`output`, or with `inplace` the input with `output` written into it (torch's in-place
    semantics: a caller reading the input afterwards sees the result; autograd records the write)."""
    return input.copy_(output) if inplace else output


def apply(
    op_name: str,
    input: Union[Tensor, Sequence[Tensor]],
    params: Sequence[float] = (),
    out_dtype: Optional[torch.dtype] = None,
) -> Any:
    """Runs manifest operator ``op_name`` on ``input`` with f32 ``params``, differentiably.

    ``input`` is the operator's one tensor input, or a tuple of its tensor inputs in order
    (``apply("mul2", (x, y))``): matrices and tensors read densely or by row index in the launch
    dtype, one value per row in the compute dtype (fp32, fp64 for fp64), row indices in int32.
    One output is returned as a tensor, several as a tuple.

    Eagerly this runs the C++ lane (abp/_plan_lane.cpp) for a one-input operator it serves, else the
    autograd.Function abp.autograd.OperatorFunction (the same bytes); while torch.compile traces
    (torch >= 2.4) it calls the ``torch.ops.abp.<op>_fwd`` custom op instead, which the compiled graph
    keeps (operators whose outputs are not shaped like their inputs run eagerly). Both launch the
    same kernels and save the same residuals. A row-wise operator (a norm) works on rows along the
    last dimension. ``out_dtype`` casts the output (see OperatorFunction; the custom op's
    ``out_dtype`` does the same under torch.compile).
    """
    # The common call (one plain tensor, float parameters, no cast, not tracing) goes straight to
    # the C++ lane, which declines (None) whatever it does not serve; the checks below then run.
    # An elementwise operator runs on a permuted dense input in its memory order (_permuted).
    if out_dtype is None and isinstance(input, torch.Tensor) and not input.is_contiguous() and _elementwise(op_name):
        order = _dense_order(input)
        if order is not None:
            return _permuted(op_name, input, params, order)
    if (out_dtype is None and type(input) is torch.Tensor and type(params) is tuple
            and all(type(p) is float for p in params) and not _custom_ops.compiling()):
        out = autograd.run_lane(op_name, input, params)
        if out is not None:
            return out
    from . import _lib

    op = _lib.kernel_library().operator(op_name)
    # One input is the tensor itself (a list given for it is an error naming `input`).
    inputs = tuple(input) if op.inputs > 1 and isinstance(input, (tuple, list)) else (input,)
    if len(inputs) != op.inputs:
        raise TypeError(f"{op_name}: takes {op.inputs} tensor input(s), got {len(inputs)}"
                        + ("; pass several as one tuple: apply(name, (x, y), params)" if op.inputs > 1 else ""))
    dtypes = _launch.torch_dtypes(op.dtypes)
    for i, (x, spec) in enumerate(zip(inputs, op.input_args)):
        name = "input" if len(inputs) == 1 else f"input[{i}]"
        if spec is not None and spec.layout in ("dense", "gathered"):
            _launch.check_float_tensor(name, x, dtypes)
        elif not isinstance(x, torch.Tensor):  # per row, or only saved: checked where read
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence) and not (
            isinstance(params, torch.Tensor) and params.dim() == 1):
        raise TypeError(f"params: expected a sequence of numbers, one per parameter of {op_name} "
                        f"({list(op.params)}), got {type(params).__name__}")
    if not (isinstance(params, tuple) and not params):  # () is the common case: nothing to check
        params = tuple(_launch.check_param(f"params[{i}]", p) for i, p in enumerate(params))
    if _custom_ops.compiling() and _custom_ops.registrable(op):
        return _custom_ops.apply_custom(op_name, params, inputs, out_dtype)
    return autograd.apply_eager(op_name, params, inputs, out_dtype)


# Operator name -> whether it works element by element: one dense input, dense outputs of its
# shape, no row kernels and no totals (a sum over the elements would change with their order).
_ELEMENTWISE: Dict[str, bool] = {}


def _elementwise(op_name: str) -> bool:
    found = _ELEMENTWISE.get(op_name)
    if found is None:
        from . import _lib
        op = _lib.kernel_library().operators.get(op_name)
        if op is None:
            return False  # the general path names the unknown operator
        found = _ELEMENTWISE[op_name] = (
            op.inputs == 1 and not op.row_wise and op.forward is not None and not op.forward.totals
            and (op.backward is None or not op.backward.totals)
            and op.input_args[0] is not None and op.input_args[0].layout == "dense"
            and all(layout == "dense" for layout in op.output_layouts))
    return found


def _dense_order(t: Tensor) -> Optional[Tuple[int, ...]]:
    """The permutation of `t`'s dimensions under which it is contiguous (channels_last:
    (0, 2, 3, 1)), or None if it is not a permutation of a contiguous tensor (a gap, an overlap,
    an expanded dimension)."""
    strides = t.stride()
    if not all(type(st) is int for st in strides):  # symbolic (a dynamic shape under torch.compile)
        return None
    order = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))
    return order if t.permute(order).is_contiguous() else None


def _permuted(op_name: str, input: Tensor, params: Sequence[float], order: Tuple[int, ...]) -> Any:
    """`op_name` on a dense input that is not contiguous (a channels_last activation), in the
    input's own memory order: run on the contiguous view that permutes it, the outputs permuted
    back. They keep the input's layout (the next convolution reads channels_last without a copy)
    and its gradient comes back in that order, with no copy either way; the values are the
    element-by-element ones a contiguous copy gives."""
    inverse = tuple(sorted(range(len(order)), key=order.__getitem__))
    out = apply(op_name, input.permute(order), params)
    if isinstance(out, tuple):
        return tuple(o.permute(inverse) for o in out)
    return out.permute(inverse)


def _require_default(function: str, name: str, value: Any, default: float) -> None:
    if _launch.check_param(name, value) != default:
        raise ValueError(
            f"{name}: abp.functional.{function} supports only {name}={default:g} (got {value!r}): its k-bit "
            f"derivative tables are fitted for torch's default {name}; use torch.nn.functional.{function} "
            "for other values"
        )


def regelu2(input: Tensor, approximate: str = "none") -> Tensor:
    """GELU forward (erf form; ``approximate="tanh"``: tanh form); ReGELU2 backward from 2-bit codes
    (docs/algorithms.md §4; the tanh form's table is fitted by tools/regelu2_fit.py)."""
    return apply(gelu_form(approximate)[1], input)


def resilu2(input: Tensor) -> Tensor:
    """SiLU forward; ReSiLU2 backward from 2-bit codes (docs/algorithms.md §4)."""
    return apply("resilu2", input)


def gelu(input: Tensor, approximate: str = "none", *, bits: int = 3, weight: str = "normal") -> Tensor:
    """GELU, erf form (``approximate="none"``) or tanh form (``"tanh"``), each exact; FewBit
    ``bits``-bit backward with the tables fitted for that form."""
    return apply(fewbit_operator(gelu_form(approximate)[0], bits, weight), input)


def silu(input: Tensor, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """SiLU; FewBit ``bits``-bit backward."""
    output = apply(fewbit_operator("silu", bits, weight), input)
    return in_place(input, output, check_inplace(inplace))


def celu(input: Tensor, alpha: float = 1.0, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """CELU with alpha=1 (the tables' parameter); FewBit ``bits``-bit backward."""
    _require_default("celu", "alpha", alpha, 1.0)
    output = apply(fewbit_operator("celu", bits, weight), input)
    return in_place(input, output, check_inplace(inplace))


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """ELU with alpha=1 (the tables' parameter); FewBit ``bits``-bit backward."""
    _require_default("elu", "alpha", alpha, 1.0)
    output = apply(fewbit_operator("elu", bits, weight), input)
    return in_place(input, output, check_inplace(inplace))


def hardswish(input: Tensor, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """Hardswish; FewBit ``bits``-bit backward."""
    output = apply(fewbit_operator("hardswish", bits, weight), input)
    return in_place(input, output, check_inplace(inplace))


def logsigmoid(input: Tensor, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """LogSigmoid; FewBit ``bits``-bit backward."""
    return apply(fewbit_operator("logsigmoid", bits, weight), input)


def mish(input: Tensor, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """Mish; FewBit ``bits``-bit backward."""
    output = apply(fewbit_operator("mish", bits, weight), input)
    return in_place(input, output, check_inplace(inplace))


def selu(input: Tensor, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """SELU; FewBit ``bits``-bit backward."""
    output = apply(fewbit_operator("selu", bits, weight), input)
    return in_place(input, output, check_inplace(inplace))


def sigmoid(input: Tensor, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """Sigmoid; FewBit ``bits``-bit backward."""
    return apply(fewbit_operator("sigmoid", bits, weight), input)


def softplus(
    input: Tensor, beta: float = 1.0, threshold: float = 20.0, *, bits: int = 3, weight: str = "normal"
) -> Tensor:
    """Softplus with beta=1, threshold=20 (the tables' parameters); FewBit ``bits``-bit backward."""
    _require_default("softplus", "beta", beta, 1.0)
    _require_default("softplus", "threshold", threshold, 20.0)
    return apply(fewbit_operator("softplus", bits, weight), input)


def softsign(input: Tensor, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """Softsign; FewBit ``bits``-bit backward."""
    return apply(fewbit_operator("softsign", bits, weight), input)


def tanh(input: Tensor, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """Tanh; FewBit ``bits``-bit backward."""
    return apply(fewbit_operator("tanh", bits, weight), input)


def tanhshrink(input: Tensor, *, bits: int = 3, weight: str = "normal") -> Tensor:
    """Tanhshrink; FewBit ``bits``-bit backward."""
    return apply(fewbit_operator("tanhshrink", bits, weight), input)


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """ReLU; exact backward from 1-bit codes."""
    output = apply("relu", input)
    return in_place(input, output, check_inplace(inplace))


def relu6(input: Tensor, inplace: bool = False) -> Tensor:
    """ReLU6; exact backward from 1-bit codes."""
    output = apply("relu6", input)
    return in_place(input, output, check_inplace(inplace))


def hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:
    """Hardsigmoid; exact backward from 1-bit codes."""
    output = apply("hardsigmoid", input)
    return in_place(input, output, check_inplace(inplace))


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """LeakyReLU; exact backward from 1-bit codes (the slope is saved as one scalar)."""
    output = apply("leaky_relu", input, (_launch.check_param("negative_slope", negative_slope),))
    return in_place(input, output, check_inplace(inplace))


def threshold(input: Tensor, threshold: float, value: float, inplace: bool = False) -> Tensor:
    """Threshold (y = x if x > threshold else value); exact backward from 1-bit codes."""
    output = apply(
        "threshold", input, (_launch.check_param("threshold", threshold), _launch.check_param("value", value))
    )
    return in_place(input, output, check_inplace(inplace))


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> Tensor:
    """Hardtanh (clamp to [min_val, max_val]); exact backward from 1-bit codes."""
    lo = _launch.check_param("min_val", min_val)
    hi = _launch.check_param("max_val", max_val)
    if lo > hi:
        raise ValueError(f"min_val: expected min_val <= max_val, got min_val={min_val!r} > max_val={max_val!r}")
    output = apply("hardtanh", input, (lo, hi))
    return in_place(input, output, check_inplace(inplace))


def hardshrink(input: Tensor, lambd: float = 0.5) -> Tensor:
    """Hardshrink; exact backward from 1-bit codes."""
    return apply("hardshrink", input, (_launch.check_param("lambd", lambd),))


def softshrink(input: Tensor, lambd: float = 0.5) -> Tensor:
    """Softshrink; exact backward from 1-bit codes. `lambd` must be >= 0, as torch requires (with a
    negative one, its piecewise definition overlaps and is not softshrink)."""
    value = _launch.check_param("lambd", lambd)
    if not value >= 0:
        raise ValueError(f"lambd: expected a value >= 0 (as torch.nn.functional.softshrink), got {lambd!r}")
    return apply("softshrink", input, (value,))


def check_normalized_shape(normalized_shape: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    """``normalized_shape`` as a tuple of positive ints (an int means one trailing dimension)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(
            f"normalized_shape: expected an int or a sequence of ints, got {type(normalized_shape).__name__}"
        ) from None
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
        raise ValueError(f"normalized_shape: expected one or more positive ints, got {normalized_shape!r}")
    return shape


# Rounding to fp32 (nearest, ties to even) makes (0, 2^-150] zero and [2^128 - 2^103, inf) infinite.
_F32_ROUNDS_TO_ZERO = 2.0**-150
_F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def check_eps(eps: Any) -> float:
    """``eps`` as a float: finite, > 0, and not 0 once rounded to fp32 (the kernels' parameter type)."""
    value = _launch.check_param("eps", eps)
    # Comparisons only (NaN fails them): under torch.compile(dynamic=True) eps is a symbolic float,
    # which comparisons guard on but struct.pack and math.isfinite cannot take.
    if not (_F32_ROUNDS_TO_ZERO < value < _F32_ROUNDS_TO_INF):
        raise ValueError(f"eps: expected a positive, finite number representable in float32, got {eps!r}")
    return value


def check_weight_offset(weight_offset: Any) -> float:
    """``weight_offset`` as a float: finite and finite once rounded to fp32 (the kernels' parameter
    type: gamma = weight + weight_offset is computed there)."""
    value = _launch.check_param("weight_offset", weight_offset)
    if not (-_F32_ROUNDS_TO_INF < value < _F32_ROUNDS_TO_INF):
        raise ValueError(f"weight_offset: expected a finite number representable in float32, got {weight_offset!r}")
    return value


def _check_affine(name: str, value: Optional[Tensor], shape: Tuple[int, ...], input: Tensor) -> Optional[Tensor]:
    """`value` (gamma or beta): None, or a floating tensor of `shape` on `input`'s device."""
    if value is None:
        return None
    _launch.check_float_tensor(name, value, _launch.ROW_DTYPES)
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} (normalized_shape), got {tuple(value.shape)}")
    if value.device != input.device:
        raise ValueError(f"{name}: expected a tensor on {input.device} (the input's device), got {value.device}")
    return value


def _ms_norm(
    op_name: str, input: Tensor, normalized_shape: Union[int, Sequence[int]], eps: float,
    weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, weight_offset: float = 0.0,
    autocast_output: bool = True,
) -> Tensor:
    # The common call (a module's: one trailing dimension, plain tensors, nothing for autocast to
    # cast, not tracing) goes straight to the C++ lane, which declines (None) what it does not
    # serve; the checks below then run. The conditions are the checks' own, so nothing the checks
    # would refuse gets here. (Not input.device.type: on torch 2 that string alone added about 4 us
    # to a 4x32 step, bench/host_overhead.py.)
    if (type(input) is torch.Tensor and type(normalized_shape) is tuple
            and len(normalized_shape) == 1 and type(normalized_shape[0]) is int and normalized_shape[0] > 0
            and input.dim() >= 1 and input.shape[-1] == normalized_shape[0] and type(eps) is float
            and _F32_ROUNDS_TO_ZERO < eps < _F32_ROUNDS_TO_INF and type(weight_offset) in (float, int)
            and -_F32_ROUNDS_TO_INF < weight_offset < _F32_ROUNDS_TO_INF
            and type(autocast_output) is bool and (input.is_cpu or input.is_cuda)
            and not _custom_ops.compiling()):
        if weight is None and bias is None:
            plain = input.dtype != torch.float32 or _amp.dtype("cpu" if input.is_cpu else "cuda") is None
            out = autograd.run_lane(op_name, input, (eps,)) if weight_offset == 0 and plain else None
        elif weight is not None or weight_offset == 0:
            # The lane declines a gamma or beta that _check_affine would refuse, and an fp32 input
            # under autocast (abp/_plan_lane.cpp: one C++ read of autocast's state).
            out = _affine_norm.lane(op_name, input, eps, weight, bias, float(weight_offset), unless_autocast=True)
        else:
            out = None
        if out is not None:
            return out
    shape = check_normalized_shape(normalized_shape)
    _launch.check_float_tensor("input", input, _launch.ROW_DTYPES)
    k = len(shape)
    if input.dim() < k or tuple(input.shape[-k:]) != shape:
        raise ValueError(
            f"input: expected a tensor whose last {k} dimension(s) are {shape} (normalized_shape), "
            f"got shape {tuple(input.shape)}"
        )
    eps = check_eps(eps)
    weight = _check_affine("weight", weight, shape, input)
    bias = _check_affine("bias", bias, shape, input)
    offset = check_weight_offset(weight_offset)
    if offset and weight is None:
        raise ValueError("weight_offset: needs a weight (gamma = weight + weight_offset)")
    cols = math.prod(shape)
    rows_view = input if k == 1 else input.reshape(*input.shape[: input.dim() - k], cols)
    if not isinstance(autocast_output, bool):
        raise TypeError(f"autocast_output: expected True or False, got {autocast_output!r}")
    # Under autocast the consumer (a Linear) would cast an fp32 output and save that copy; emit
    # its compute dtype directly so that it saves this very tensor (docs/algorithms.md §5). Where the
    # output also feeds something else (a residual stream), autocast_output=False keeps the
    # input's dtype, so an fp32 residual stream stays fp32.
    autocast = _amp.dtype(input.device.type) if input.dtype == torch.float32 else None
    out_dtype = autocast if autocast_output else None
    # An fp32 output kept for a residual stream is saved in the autocast dtype (affine norms): the
    # Linear reading it saves its own cast copy anyway, and backward is then bf16-accurate, as
    # autocast's matmuls are.
    save_dtype = None if autocast_output else autocast
    if weight is None and bias is None:
        y = apply(op_name, rows_view, (eps,), out_dtype)
    else:
        # One trailing dimension: gamma and beta as they are (a reshape would add a view node to
        # every backward).
        flat = lambda t: t if t is None or k == 1 else t.reshape(cols)  # noqa: E731
        y = _affine_norm.affine_ms_norm(op_name, rows_view, eps, flat(weight), flat(bias), offset, out_dtype, save_dtype)
    return y if k == 1 else y.view(input.shape)


def ms_layer_norm(
    input: Tensor, normalized_shape: Union[int, Sequence[int]], eps: float = 1e-5, *,
    weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, weight_offset: float = 0.0,
    autocast_output: bool = True,
) -> Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims: y = gamma * (x - mean) / sqrt(var + eps) + beta,
    gamma = weight + weight_offset (none without weight), beta = bias.

    Backward is exact (docs/algorithms.md §5) and reads only y — the returned tensor itself, which the next
    Linear keeps — and 1/sqrt(var + eps), one value per row (fp32; fp64 for fp64 input). With an
    affine, it recovers the normalised value as (y - beta) / gamma (abp._affine_norm: exact up to that
    division's rounding). Under autocast an fp32 input gives an output in the autocast dtype (what
    the next Linear would cast it to) unless ``autocast_output=False``.
    """
    return _ms_norm("ms_layernorm", input, normalized_shape, eps, weight, bias, weight_offset, autocast_output)


def ms_rms_norm(
    input: Tensor, normalized_shape: Union[int, Sequence[int]], eps: float = 1e-6, *,
    weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, weight_offset: float = 0.0,
    autocast_output: bool = True,
) -> Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims: y = gamma * x / sqrt(mean(x^2) + eps) + beta,
    gamma = weight + weight_offset (1 + weight for Gemma-style norms), beta = bias.

    Backward is exact and reads only y (the returned tensor) and one value per row; with an affine,
    as for ms_layer_norm.
    """
    return _ms_norm("ms_rmsnorm", input, normalized_shape, eps, weight, bias, weight_offset, autocast_output)
