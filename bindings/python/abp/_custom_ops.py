"""torch.library registration (torch >= 2.4): abp::<op>_fwd / abp::<op>_bwd with fake kernels and autograd.

torch.compile sees these as opaque operators with known output shapes, keeps them in its graph and
saves exactly the residuals their setup_context saves (the packed codes), so the memory saving
survives compilation. On older torch this module reports `enabled() == False` and abp runs through
the eager autograd.Function (abp.autograd).

Both ops end in an optional dtype, as abp.autograd.OperatorFunction's out_dtype: the fwd op's
``out_dtype`` casts the outputs (autocast's dtype for a norm feeding a Linear, which then saves
that very tensor), and the bwd op's ``dtype`` is the dtype its kernels run in (the input's; by
default the gradients').
"""
from __future__ import annotations

import inspect
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _launch, _lib
from ._manifest import Operator, packed_bytes, parse_ref

__all__ = ["enabled", "compiling", "custom_op", "supported_torch", "registered", "registrable", "register", "plan", "apply_custom"]


def _torch_version() -> Tuple[int, int]:
    base = torch.__version__.split("+")[0]
    parts = base.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def supported_torch() -> bool:
    """True on torch >= 2.4 with torch.library.custom_op / register_fake / register_autograd."""
    library = getattr(torch, "library", None)
    return (
        _torch_version() >= (2, 4)
        and library is not None
        and all(hasattr(library, name) for name in ("custom_op", "register_fake", "register_autograd"))
    )


_SUPPORTED = supported_torch()


def enabled() -> bool:
    """True if abp registers its operators with torch.library (torch >= 2.4)."""
    return _SUPPORTED


def compiling() -> bool:
    """True while torch.compile / torch.export trace, or under a FakeTensorMode or a proxy (make_fx)
    mode: tensors without data, which only the custom ops' fake implementations can take. Then abp
    calls its custom ops, else the cheaper eager autograd.Function (~10 us instead of ~30 us of
    host overhead per call)."""
    return _SUPPORTED and (torch.compiler.is_compiling() or _tracing_mode())


def custom_op(name: str, **options: Any) -> Any:
    """torch.library.custom_op(name, **options) for a function whose schema torch infers from its
    annotations, evaluated first: abp's modules postpone them (``from __future__ import
    annotations``), whose strings torch 2.4 refused ("Parameter x has unsupported type
    torch.Tensor", at ``import abp``); later torch evaluates them itself."""
    def define(fn: Any) -> Any:
        fn.__signature__ = inspect.signature(fn, eval_str=True)
        return torch.library.custom_op(name, **options)(fn)
    return define


# The dispatch-mode keys of fake and proxy tracing, looked up once (compiling() is on every call's path).
_MODE_KEYS = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY")
                   if hasattr(getattr(torch._C, "_TorchDispatchModeKey", None), k))


def _tracing_mode() -> bool:
    for key in _MODE_KEYS:  # a loop, not any(<genexpr>): this runs on every eager call
        if _GET_MODE(key) is not None:
            return True
    return False


_GET_MODE = getattr(torch._C, "_get_dispatch_mode", None)


@dataclass(frozen=True)
class _Plan:
    """How one operator maps onto its two custom ops."""

    op: Operator
    # For each residual: ("tensor", k) = the k-th tensor the fwd op returns after the outputs,
    # ("output", k) = forward output k itself (a shared residual: custom ops may not return
    # aliases, so it is saved from the outputs), ("input", k) = input k itself (a per-column
    # input, saved as it is), or ("param", k) = the operator's k-th parameter.
    residual_sources: Tuple[Tuple[str, int], ...]
    tensor_residuals: Tuple[int, ...]  # indices of the residuals that are tensors
    scalar_residuals: Tuple[int, ...]  # indices of the residuals that are scalars
    fwd: Any  # the OpOverload torch.ops.abp.<op>_fwd.default
    bwd: Any  # the OpOverload torch.ops.abp.<op>_bwd.default
    definitions: Tuple[Any, ...]  # the CustomOpDefs (kept alive with the plan)


_lock = threading.RLock()
_plans: Dict[str, _Plan] = {}


def registered(op_name: str) -> bool:
    """True if `op_name` already has its abp::<op>_fwd / abp::<op>_bwd custom ops."""
    return op_name in _plans


def registrable(op: Operator) -> bool:
    """True for the operators abp registers: those with an output whose shapes follow from a dense
    input (dense outputs like it, per-row ones without its last dimension; per-row, per-column
    and no_grad inputs too). Ones reading rows by index run eagerly (their row count is the
    index's); draws without an input are abp.sampling's, and codecs without an output (gact_b<k>:
    input to codes) are abp.compress's."""
    if op.inputs == 0 or op.outputs == 0 or op.forward is None:
        return False
    layouts = [spec.layout if spec is not None else None for spec in op.input_args]
    return "gathered" not in layouts and "dense" in layouts


def param_kinds(op: Operator) -> Tuple[str, ...]:
    """Per parameter, "int" (an i64 kernel scalar: seeds, offsets) or "float", as the kernels that
    read it (directly, or as a saved scalar residual) declare it."""
    kinds = ["float"] * len(op.params)
    saved_from = {}
    if op.forward is not None:
        for i, ref in enumerate(op.forward.produces[op.outputs:]):
            kind, index = parse_ref(ref)
            if kind == "param":
                saved_from[f"residual{i}"] = index
    launches = []  # (kernel record, its argument references), total kernels included
    for direction in (op.forward, op.backward):
        if direction is None:
            continue
        launches += [(op.kernels[name], refs) for name, refs in direction.totals]
        if direction.kernel is not None:
            launches.append((op.kernels[direction.kernel], direction.args))
    for record, refs in launches:
        for ref, spec in zip(refs, record.inputs):
            kind, index = parse_ref(ref)
            param = index if kind == "param" else saved_from.get(ref)
            if param is not None and spec.role == "scalar" and spec.type == "i64":
                kinds[param] = "int"
    return tuple(kinds)


def _residual_sources(op: Operator) -> Tuple[Tuple[str, int], ...]:
    assert op.forward is not None
    sources: List[Tuple[str, int]] = []
    tensors = 0
    for i, residual in enumerate(op.residuals):
        ref = op.forward.produces[op.outputs + i]
        kind, index = parse_ref(ref)
        if residual.kind == "scalar":
            if kind != "param":
                raise RuntimeError(f"operator {op.name}: scalar residual{i} is {ref}, not a parameter")
            sources.append(("param", index))
        elif residual.kind == "shared":
            assert residual.output is not None
            sources.append(("output", residual.output))
        elif kind == "input":
            sources.append(("input", index))
        else:
            sources.append(("tensor", tensors))
            tensors += 1
    return tuple(sources)


def _schema(args: Sequence[str], returns: int) -> str:
    result = "Tensor" if returns == 1 else "(" + ", ".join(["Tensor"] * returns) + ")"
    return "(" + ", ".join(args) + ") -> " + result


def _fake_residual(op: Operator, index: int, like: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as residual `index` of a launch over `like` (the launch input)."""
    residual = op.residuals[index]
    if residual.kind == "codes":
        assert residual.bits is not None
        return like.new_empty(packed_bytes(residual.bits, like.numel()), dtype=torch.uint8)
    if residual.kind == "rows":
        return like.new_empty(like.shape[:-1], dtype=_launch.compute_dtype(like.dtype))
    if residual.kind == "total":
        return like.new_empty((), dtype=_launch.compute_dtype(like.dtype))
    return like.new_empty(like.shape)


def register(op: Operator) -> _Plan:
    """Defines abp::<op>_fwd and abp::<op>_bwd for `op` (once) with fake kernels and autograd."""
    with _lock:
        plan = _plans.get(op.name)
        if plan is not None:
            return plan
        plan = _define(op)
        _plans[op.name] = plan
        return plan


# Integer parameters (seeds, offsets) are SymInts: a seed that changes per call then becomes
# symbolic under torch.compile instead of specialising the graph (a compile per seed).
_SCHEMA_TYPES = {"float": "float", "int": "SymInt"}


def _define(op: Operator) -> _Plan:
    if not registrable(op):
        raise ValueError(
            f"operator {op.name}: only operators with an output whose shapes follow from a dense input "
            f"become custom ops ({op.outputs} outputs)"
        )
    sources = _residual_sources(op)
    tensor_residuals = tuple(i for i, s in enumerate(sources) if s[0] == "tensor")
    scalar_residuals = tuple(i for i, s in enumerate(sources) if s[0] == "param")
    # The bwd op takes every tensor residual (returned or shared) in residual order.
    saved_residuals = tuple(i for i, s in enumerate(sources) if s[0] != "param")
    n_in, n_out, n_params = op.inputs, op.outputs, len(op.params)
    kinds = param_kinds(op)
    per_row_outputs = tuple(layout == "rows" for layout in op.output_layouts)
    per_row_inputs = tuple(spec is not None and spec.layout == "rows" for spec in op.input_args)
    per_column_inputs = tuple(spec is not None and spec.layout == "cols" for spec in op.input_args)
    differentiated = tuple(i for i in range(n_in) if i not in op.no_grad)
    name = op.name

    def launch_input(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return _launch.launch_input(op, inputs)

    def like(first: torch.Tensor, per_row: bool, dtype: torch.dtype, shape: Sequence[Any]) -> torch.Tensor:
        """An empty tensor shaped as a dense (or per-row) value of a launch over `shape`."""
        if per_row:
            return first.new_empty(tuple(shape)[:-1], dtype=_launch.compute_dtype(dtype))
        return first.new_empty(tuple(shape), dtype=dtype)

    def gradient_like(first: torch.Tensor, i: int, dtype: torch.dtype, shape: Sequence[Any]) -> torch.Tensor:
        """An empty tensor shaped as input i's gradient: a per-column input's holds one value per column."""
        if per_column_inputs[i]:
            return first.new_empty(tuple(shape)[-1:], dtype=dtype)
        return like(first, per_row_inputs[i], dtype, shape)

    # abp::<op>_fwd(Tensor input0, ..., float|SymInt param0, ..., ScalarType? out_dtype=None)
    #   -> (outputs..., tensor residuals...)
    fwd_args = (
        [f"Tensor input{i}" for i in range(n_in)]
        + [f"{_SCHEMA_TYPES[kind]} param{i}" for i, kind in enumerate(kinds)]
        + ["ScalarType? out_dtype=None"]
    )

    def fwd_impl(*args: Any) -> Any:
        inputs, params = args[:n_in], args[n_in : n_in + n_params]
        out_dtype = args[n_in + n_params] if len(args) > n_in + n_params else None
        outputs, residuals = _launch.forward(op, inputs, params)
        if out_dtype is not None and out_dtype != launch_input(inputs).dtype:
            outputs = [o if per_row else o.to(out_dtype) for o, per_row in zip(outputs, per_row_outputs)]
        produced = list(outputs) + [residuals[i] for i in tensor_residuals]
        # An op's returns must not alias its inputs or each other: copy any input passed through
        # unchanged, and an output that is also saved (row_norms saves its norms).
        unique: List[torch.Tensor] = []
        for t in produced:
            unique.append(t.clone() if any(t is u for u in (*inputs, *unique)) else t)
        produced = unique
        return produced[0] if len(produced) == 1 else tuple(produced)

    fwd = torch.library.custom_op(
        f"abp::{name}_fwd", mutates_args=(), schema=_schema(fwd_args, n_out + len(tensor_residuals))
    )(fwd_impl)

    @fwd.register_fake
    def _(*args: Any) -> Any:
        first = launch_input(args[:n_in])
        out_dtype = args[n_in + n_params] if len(args) > n_in + n_params else None
        produced = [like(first, per_row, first.dtype if per_row else out_dtype or first.dtype, first.shape)
                    for per_row in per_row_outputs]
        produced += [_fake_residual(op, i, first) for i in tensor_residuals]
        return produced[0] if len(produced) == 1 else tuple(produced)

    # abp::<op>_bwd(Tensor residual..., Tensor grad0, ..., float|SymInt scalar residual...,
    #               ScalarType? dtype=None, SymInt[]? shape=None)
    #   -> one gradient per differentiated input, in `dtype` (by default the gradients'), over
    #      the launch `shape` (by default grad0's: the shape of a dense output 0)
    bwd_args = (
        [f"Tensor residual{i}" for i in saved_residuals]
        + [f"Tensor grad{i}" for i in range(n_out)]
        + [f"{_SCHEMA_TYPES[kinds[sources[i][1]]]} residual{i}" for i in scalar_residuals]
        + ["ScalarType? dtype=None", "SymInt[]? shape=None"]
    )
    n_tensors = len(saved_residuals) + n_out
    n_bwd = n_tensors + len(scalar_residuals)

    def bwd_options(args: Sequence[Any]) -> Tuple[torch.Tensor, torch.dtype, Sequence[Any]]:
        first = args[len(saved_residuals)]
        dtype = args[n_bwd] if len(args) > n_bwd and args[n_bwd] is not None else first.dtype
        shape = args[n_bwd + 1] if len(args) > n_bwd + 1 and args[n_bwd + 1] is not None else first.shape
        return first, dtype, shape

    def bwd_impl(*args: Any) -> Any:
        tensors = iter(args[: len(saved_residuals)])
        grads = args[len(saved_residuals) : n_tensors]
        scalars = iter(args[n_tensors:n_bwd])
        residuals = [next(scalars) if s[0] == "param" else next(tensors) for s in sources]
        first, dtype, shape = bwd_options(args)
        dxs = _launch.backward(op, residuals, grads, torch.Size(shape), dtype, first.device)
        dxs = [dx if dx is not None else gradient_like(first, i, dtype, shape)
               for i, dx in enumerate(dxs) if i in differentiated]
        return dxs[0] if len(dxs) == 1 else tuple(dxs)

    bwd = torch.library.custom_op(
        f"abp::{name}_bwd", mutates_args=(), schema=_schema(bwd_args, len(differentiated))
    )(bwd_impl)
    bwd_op = getattr(torch.ops.abp, f"{name}_bwd").default

    @bwd.register_fake
    def _(*args: Any) -> Any:
        first, dtype, shape = bwd_options(args)
        dxs = [gradient_like(first, i, dtype, shape) for i in differentiated]
        return dxs[0] if len(dxs) == 1 else tuple(dxs)

    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        produced = output if isinstance(output, tuple) else (output,)
        returned = iter(produced[n_out:])
        ctx.save_for_backward(*[produced[sources[i][1]] if sources[i][0] == "output" else
                                inputs[sources[i][1]] if sources[i][0] == "input" else next(returned)
                                for i in saved_residuals])
        ctx.abp_scalars = tuple(inputs[n_in + sources[i][1]] for i in scalar_residuals)
        ctx.abp_input_shapes = tuple(inputs[i].shape for i in range(n_in))
        first = launch_input(inputs[:n_in])
        ctx.abp_shape, ctx.abp_input_dtype = first.shape, first.dtype
        ctx.abp_non_tensors = len(inputs) - n_in  # the parameters and out_dtype: no gradient

    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        output_grads = list(grads[:n_out])
        saved = ctx.saved_tensors
        for i, g in enumerate(output_grads):
            if g is None:
                # dtype from a saved tensor is not reliable (codes are uint8), so take it from
                # any given gradient.
                given = next(x for x in output_grads if x is not None)
                output_grads[i] = torch.zeros(
                    ctx.abp_shape[:-1] if per_row_outputs[i] else ctx.abp_shape,
                    dtype=_launch.compute_dtype(ctx.abp_input_dtype) if per_row_outputs[i] else given.dtype,
                    device=given.device)
        result = bwd_op(*saved, *output_grads, *ctx.abp_scalars, ctx.abp_input_dtype, list(ctx.abp_shape))
        dxs = iter(result if isinstance(result, tuple) else (result,))
        shaped = tuple(next(dxs).reshape(s) if i in differentiated else None
                       for i, s in enumerate(ctx.abp_input_shapes))
        return shaped + (None,) * ctx.abp_non_tensors

    fwd.register_autograd(backward, setup_context=setup_context)
    fwd_op = getattr(torch.ops.abp, f"{name}_fwd").default
    return _Plan(op, sources, tensor_residuals, scalar_residuals, fwd_op, bwd_op, (fwd, bwd))


def _register_on_open(library: _lib.KernelLibrary) -> None:
    # Every operator is registered when the library opens (abp opens it at import on torch >= 2.4),
    # so torch.compile finds them all and never traces a registration (which would break its graph).
    for op in library.operators.values():
        if not registrable(op):
            continue  # launched directly by abp.sampling or abp.compress, never through the generic path
        try:
            register(op)
        except Exception as e:  # one odd operator must not make the others unusable
            warnings.warn(f"abp: cannot register operator {op.name} with torch.library: {e}", RuntimeWarning)


if _SUPPORTED:
    _lib.on_open(_register_on_open)


def plan(op_name: str) -> _Plan:
    """The custom ops of `op_name`, read without taking the lock (torch.compile cannot trace one):
    every operator is registered when the kernel library opens; a later one is registered here."""
    found = _plans.get(op_name)
    return found if found is not None else register(_lib.kernel_library().operator(op_name))


def apply_custom(
    op_name: str, params: Sequence[float], inputs: Sequence[torch.Tensor], out_dtype: Optional[torch.dtype] = None
) -> Any:
    """Runs `op_name` through abp::<op>_fwd: one output as a tensor, several as a tuple.
    ``out_dtype`` casts the outputs (as abp.autograd.OperatorFunction's)."""
    plan_ = plan(op_name)
    produced = plan_.fwd(*inputs, *params) if out_dtype is None else plan_.fwd(*inputs, *params, out_dtype)
    if not isinstance(produced, tuple):
        return produced
    n_out = plan_.op.outputs
    return produced[0] if n_out == 1 else tuple(produced[:n_out])

