"""Memory-sharing norms that keep their affine parameters: y = gamma * n(x) + beta, backward from y.

The compiler's ms_<norm>_gain (gamma only) and ms_<norm>_affine (gamma and beta) operators
(ops/lowmembp/*_affine.mlir) run it in one row kernel each way: gamma = weight + offset and beta
are per-column inputs of the launch. Forward saves the returned output y (the storage the next
Linear keeps anyway), weight and bias (parameters, kept by the module anyway) and one value per
row. Backward recovers the normalised value from the output,

    n = (y - beta) / gamma,

and runs the exact norm backward on dn = dy * gamma; ``dgamma = sum(dy * n)`` and
``dbeta = sum(dy)`` over the rows are column sums after the kernel. That is the exact derivative
up to the rounding of the recovery: an absolute error of about ulp(|y| + |beta|) / |gamma| in n
(with a low-precision y under autocast, that precision's ulp). Where gamma is exactly 0, n is not
recoverable (it is taken as 0): the gradients of x and gamma at that feature are wrong, those at
every other feature stay exact (dn = dy * 0 = 0 there, so the row means are unaffected).
``abp.convert`` refuses norms whose gamma has zeros; no host synchronisation checks it during
training. A bias without a weight runs the affine operator with a gamma of ones.

``weight_offset`` covers Gemma-style norms, whose multiplier is ``1 + weight``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _custom_ops, _eager, _launch, _lib, autograd
from ._manifest import Operator, parse_ref

__all__ = ["affine_ms_norm", "affine_operator"]

# What the C++ lane takes for weight and bias; a tensor subclass (a sharded parameter) takes the
# Python lane, where torch's dispatch handles it.
_PLAIN = (type(None), torch.Tensor, torch.nn.Parameter)


def affine_operator(op_name: str, bias: bool) -> str:
    """The operator of norm `op_name` (ms_layernorm, ms_rmsnorm) with a gamma, and a beta if `bias`."""
    return op_name + ("_affine" if bias else "_gain")


def _column_inputs(weight: Optional[Tensor], bias: Optional[Tensor], columns: int, compute: torch.dtype,
                   device: torch.device) -> List[Tensor]:
    """gamma's weight (ones without one) and beta where given, contiguous in the launch dtype."""
    gain = torch.ones(columns, dtype=compute, device=device) if weight is None else weight.to(compute).contiguous()
    return [gain] if bias is None else [gain, bias.to(compute).contiguous()]


def _residuals(op: Operator, y: Tensor, statistic: Tensor, columns: Sequence[Tensor], params: Sequence[float]) -> List[Any]:
    """The saved values in the operator's residual order: y (its shared output), the per-row
    statistic, the per-column inputs and the parameters (as forward produces them)."""
    assert op.forward is not None
    out: List[Any] = []
    for residual, ref in zip(op.residuals, op.forward.produces[op.outputs:]):
        kind, index = parse_ref(ref)
        out.append(y if residual.kind == "shared" else statistic if kind == "result"
                   else columns[index - 1] if kind == "input" else params[index])
    return out


def _forward_kernels(op: Operator, x: Tensor, columns: Sequence[Tensor], params: Tuple[float, float]) -> Tuple[Tensor, Tensor]:
    """(y, the per-row statistic) from the operator's forward kernel."""
    if _custom_ops.compiling():
        y, statistic = _custom_ops.plan(op.name).fwd(x, *columns, *params)
        return y, statistic
    plan = _eager.plan(op, x.dtype)
    done = plan.forward(x, params, columns) if plan is not None else None
    outputs, residuals = done if done is not None else _launch.forward(op, (x, *columns), params)
    return outputs[0], next(r for r, spec in zip(residuals, op.residuals) if spec.kind == "rows")


def _backward_kernels(op: Operator, residuals: List[Any], dy: Tensor) -> List[Tensor]:
    """(dx, dgamma, dbeta where the operator has it) in the launch dtype, from the kernels."""
    if _custom_ops.compiling():
        tensors = [r for r in residuals if isinstance(r, torch.Tensor)]
        scalars = [r for r in residuals if not isinstance(r, torch.Tensor)]
        return list(_custom_ops.plan(op.name).bwd(*tensors, dy, *scalars))
    plan = _eager.plan(op, dy.dtype)
    grads = plan.backward(residuals, (dy,), dy.shape, dy.device) if plan is not None else None
    if grads is None:
        grads = _launch.backward(op, residuals, (dy,), dy.shape, dy.dtype, dy.device)
    return grads


class _AffineMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, op_name: str, eps: float, offset: float, out_dtype: Optional[torch.dtype],
        save_dtype: Optional[torch.dtype], x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
    ) -> Tensor:
        autograd.refuse_jit_trace(op_name)
        op = _lib.kernel_library().operator(op_name)
        # Half-precision rows run the kernels in fp32 so that y is rounded once, as torch's norms do.
        compute = _launch.compute_dtype(x.dtype)
        columns = _column_inputs(weight, bias, x.shape[-1], compute, x.device)
        y, statistic = _forward_kernels(op, x.to(compute), columns, (eps, offset))
        target = out_dtype if out_dtype is not None else x.dtype
        if target != y.dtype:
            y = y.to(target)
        # y is saved as the very tensor returned: the next Linear saves the same storage. With a
        # save_dtype (autocast, an output kept in fp32 for a residual stream) a copy in that dtype
        # is saved instead: half the bytes, as accurate as autocast's own matmuls.
        saved = y if save_dtype is None or save_dtype == y.dtype else y.to(save_dtype)
        ctx.save_for_backward(saved, statistic, weight, bias)
        ctx.abp = (op_name, (eps, offset), x.dtype)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        # Under backward(create_graph=True) the gradients are marked not differentiable (the
        # norm kernels' backward is not), as every abp operator's are (abp.autograd.once_only).
        try:
            return (_backward_once if torch.is_grad_enabled() else _backward)(ctx, dy)
        except RuntimeError as e:
            autograd.raise_naming_batched(ctx.abp[0], e)


def _backward(ctx: Any, dy: Tensor) -> Tuple[Optional[Tensor], ...]:
    op_name, params, dtype = ctx.abp
    y, statistic, weight, bias = ctx.saved_tensors
    op = _lib.kernel_library().operator(op_name)
    compute = _launch.compute_dtype(dtype)
    y = y.to(compute).contiguous()
    columns = _column_inputs(weight, bias, y.shape[-1], compute, y.device)
    residuals = _residuals(op, y, statistic, columns, params)
    grads = _backward_kernels(op, residuals, dy.to(compute).contiguous())
    dx = grads[0].to(dtype)
    dweight = grads[1].to(weight.dtype) if weight is not None and ctx.needs_input_grad[6] else None
    dbias = grads[-1].to(bias.dtype) if bias is not None and ctx.needs_input_grad[7] else None
    return None, None, None, None, None, dx, dweight, dbias


_backward_once = autograd.once_only(_backward)


def backward_in_python(op_name: str, eps: float, offset: float, like: Tensor, y: Tensor, statistic: Tensor,
                       weight: Optional[Tensor], bias: Optional[Tensor], dy: Tensor, needs_weight: bool,
                       needs_bias: bool, create_graph: bool) -> Tuple[Optional[Tensor], ...]:
    """The C++ lane's affine norm backward by this module (abp/_plan_lane.cpp): under
    backward(create_graph=True), marked, and where the C++ plan declines: (dx, dweight, dbias).
    `like` has the input's dtype."""
    ctx = _SavedContext((y, statistic, weight, bias), (op_name, (eps, offset), like.dtype),
                        (False,) * 6 + (needs_weight, needs_bias))
    out = (_backward_once if create_graph else _backward)(ctx, dy)
    return out[5], out[6], out[7]


class _SavedContext:
    """What _backward reads from an _AffineMSNorm's ctx."""

    def __init__(self, saved: Tuple[Any, ...], abp: Tuple[Any, ...], needs: Tuple[bool, ...]) -> None:
        self.saved_tensors, self.abp, self.needs_input_grad = saved, abp, needs


def lane(op_name: str, x: Tensor, eps: float, weight: Optional[Tensor], bias: Optional[Tensor],
         weight_offset: float, out_dtype: Optional[torch.dtype] = None,
         save_dtype: Optional[torch.dtype] = None, unless_autocast: bool = False) -> Optional[Tensor]:
    """y by the C++ lane (abp/_plan_lane.cpp's affineApply and AffineNode, the same steps in C++), or None
    where it does not serve the call (a tensor subclass, a dtype, shape or device it was not made
    for, tracing, the lane not built; with `unless_autocast`, an fp32 x under autocast). Arguments
    as affine_ms_norm's; `x` a plain tensor, not under torch.compile (the caller's checks)."""
    if type(weight) not in _PLAIN or type(bias) not in _PLAIN:
        return None
    found = autograd.lane_plan(affine_operator(op_name, bias is not None), _launch.compute_dtype(x.dtype))
    if found is None:
        return None
    out_like = None if out_dtype is None else torch.empty(0, dtype=out_dtype)
    save_like = None if save_dtype is None else torch.empty(0, dtype=save_dtype)
    return found[0].affine_norm(found[1], x, weight, bias, eps, weight_offset, out_like, save_like, unless_autocast)


def affine_ms_norm(
    op_name: str, x: Tensor, eps: float, weight: Optional[Tensor], bias: Optional[Tensor],
    weight_offset: float, out_dtype: Optional[torch.dtype], save_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Runs the memory-sharing norm `op_name` on rows `x` (..., d) with gamma = weight + weight_offset
    and beta = bias (each (d,) or None, not both), output in `out_dtype` (default: x's), saving it
    in `save_dtype` (default: itself); the arguments are checked by the caller. Plain tensors take
    the C++ lane where it is built."""
    if type(x) is torch.Tensor and not _custom_ops.compiling():
        y = lane(op_name, x, eps, weight, bias, weight_offset, out_dtype, save_dtype)
        if y is not None:
            return y
    return autograd.apply_function("abp's memory-sharing norm", _AffineMSNorm, affine_operator(op_name, bias is not None),
                                   eps, weight_offset, out_dtype, save_dtype, x, weight, bias)
