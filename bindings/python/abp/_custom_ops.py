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

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _launch, _lib
from ._manifest import Operator, packed_bytes, parse_ref

__all__ = ["enabled", "compiling", "supported_torch", "registered", "registrable", "register", "plan", "apply_custom"]


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


# The dispatch-mode keys of fake and proxy tracing, looked up once (compiling() is on every call's path).
_MODE_KEYS = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY")
                   if hasattr(getattr(torch._C, "_TorchDispatchModeKey", None), k))


def _tracing_mode() -> bool:
    return any(torch._C._get_dispatch_mode(key) is not None for key in _MODE_KEYS)


@dataclass(frozen=True)
class _Plan:
    """How one operator maps onto its two custom ops."""

    op: Operator
    # For each residual: ("tensor", k) = the k-th tensor the fwd op returns after the outputs,
    # ("output", k) = forward output k itself (a shared residual: custom ops may not return
    # aliases, so it is saved from the outputs), or ("param", k) = the operator's k-th parameter.
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
    """True for the operators abp registers: same-shaped ones with at least one output. Gathered
    or per-row ones run eagerly (their outputs are not shaped like their inputs), and codecs
    without an output (gact_b<k>: input to codes) are abp.compress's."""
    return op.same_shape and op.outputs > 0


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
        else:
            sources.append(("tensor", tensors))
            tensors += 1
    return tuple(sources)


def _schema(args: Sequence[str], returns: int) -> str:
    result = "Tensor" if returns == 1 else "(" + ", ".join(["Tensor"] * returns) + ")"
    return "(" + ", ".join(args) + ") -> " + result


def _fake_residual(op: Operator, index: int, like: torch.Tensor) -> torch.Tensor:
    residual = op.residuals[index]
    if residual.kind == "codes":
        assert residual.bits is not None
        return like.new_empty(packed_bytes(residual.bits, like.numel()), dtype=torch.uint8)
    if residual.kind == "rows":
        return like.new_empty(like.shape[:-1], dtype=_launch.compute_dtype(like.dtype))
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


def _define(op: Operator) -> _Plan:
    if not registrable(op):
        raise ValueError(
            f"operator {op.name}: only same-shaped operators with at least one output become custom ops "
            f"({op.outputs} outputs, same_shape={op.same_shape})"
        )
    sources = _residual_sources(op)
    tensor_residuals = tuple(i for i, s in enumerate(sources) if s[0] == "tensor")
    scalar_residuals = tuple(i for i, s in enumerate(sources) if s[0] == "param")
    # The bwd op takes every tensor residual (returned or shared) in residual order.
    saved_residuals = tuple(i for i, s in enumerate(sources) if s[0] != "param")
    n_in, n_out, n_params = op.inputs, op.outputs, len(op.params)
    name = op.name

    # abp::<op>_fwd(Tensor input0, ..., float param0, ..., ScalarType? out_dtype=None)
    #   -> (outputs..., tensor residuals...)
    fwd_args = (
        [f"Tensor input{i}" for i in range(n_in)]
        + [f"float param{i}" for i in range(n_params)]
        + ["ScalarType? out_dtype=None"]
    )

    def fwd_impl(*args: Any) -> Any:
        inputs, params = args[:n_in], args[n_in : n_in + n_params]
        out_dtype = args[n_in + n_params] if len(args) > n_in + n_params else None
        outputs, residuals = _launch.forward(op, inputs, params)
        if out_dtype is not None and out_dtype != inputs[0].dtype:
            outputs = [o.to(out_dtype) for o in outputs]
        produced = list(outputs) + [residuals[i] for i in tensor_residuals]
        # An op's outputs must not alias its inputs: copy any input passed through unchanged.
        produced = [t.clone() if any(t is x for x in inputs) else t for t in produced]
        return produced[0] if len(produced) == 1 else tuple(produced)

    fwd = torch.library.custom_op(
        f"abp::{name}_fwd", mutates_args=(), schema=_schema(fwd_args, n_out + len(tensor_residuals))
    )(fwd_impl)

    @fwd.register_fake
    def _(*args: Any) -> Any:
        first = args[0]
        out_dtype = args[n_in + n_params] if len(args) > n_in + n_params else None
        produced = [first.new_empty(first.shape, dtype=out_dtype or first.dtype) for _ in range(n_out)]
        produced += [_fake_residual(op, i, first) for i in tensor_residuals]
        return produced[0] if len(produced) == 1 else tuple(produced)

    # abp::<op>_bwd(Tensor residual..., Tensor grad0, ..., float scalar residual...,
    #               ScalarType? dtype=None) -> grads (in `dtype`, by default the gradients')
    bwd_args = (
        [f"Tensor residual{i}" for i in saved_residuals]
        + [f"Tensor grad{i}" for i in range(n_out)]
        + [f"float residual{i}" for i in scalar_residuals]
        + ["ScalarType? dtype=None"]
    )
    n_tensors = len(saved_residuals) + n_out
    n_bwd = n_tensors + len(scalar_residuals)

    def bwd_impl(*args: Any) -> Any:
        tensors = iter(args[: len(saved_residuals)])
        grads = args[len(saved_residuals) : n_tensors]
        scalars = iter(args[n_tensors:n_bwd])
        residuals = [next(scalars) if s[0] == "param" else next(tensors) for s in sources]
        first = grads[0]
        dtype = args[n_bwd] if len(args) > n_bwd and args[n_bwd] is not None else first.dtype
        dxs = _launch.backward(op, residuals, grads, first.shape, dtype, first.device)
        dxs = [torch.zeros_like(first) if dx is None else dx for dx in dxs]
        return dxs[0] if len(dxs) == 1 else tuple(dxs)

    bwd = torch.library.custom_op(f"abp::{name}_bwd", mutates_args=(), schema=_schema(bwd_args, n_in))(bwd_impl)
    bwd_op = getattr(torch.ops.abp, f"{name}_bwd").default

    @bwd.register_fake
    def _(*args: Any) -> Any:
        first = args[len(saved_residuals)]
        dtype = args[n_bwd] if len(args) > n_bwd and args[n_bwd] is not None else first.dtype
        dxs = [first.new_empty(first.shape, dtype=dtype) for _ in range(n_in)]
        return dxs[0] if len(dxs) == 1 else tuple(dxs)

    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        produced = output if isinstance(output, tuple) else (output,)
        returned = iter(produced[n_out:])
        ctx.save_for_backward(
            *[produced[sources[i][1]] if sources[i][0] == "output" else next(returned) for i in saved_residuals]
        )
        ctx.abp_scalars = tuple(float(inputs[n_in + sources[i][1]]) for i in scalar_residuals)
        ctx.abp_input_shapes = tuple(inputs[i].shape for i in range(n_in))
        ctx.abp_input_dtype = inputs[0].dtype
        ctx.abp_non_tensors = len(inputs) - n_in  # the parameters and out_dtype: no gradient

    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        output_grads = list(grads[:n_out])
        saved = ctx.saved_tensors
        shape = ctx.abp_input_shapes[0]
        for i, g in enumerate(output_grads):
            if g is None:
                # Outputs share the first input's shape (elementwise operators); dtype from a saved
                # tensor is not reliable (codes are uint8), so take it from any given gradient.
                like = next(x for x in output_grads if x is not None)
                output_grads[i] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        result = bwd_op(*saved, *output_grads, *ctx.abp_scalars, ctx.abp_input_dtype)
        dxs = result if isinstance(result, tuple) else (result,)
        shaped = tuple(dx.reshape(s) for dx, s in zip(dxs, ctx.abp_input_shapes))
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

