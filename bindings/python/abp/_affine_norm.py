"""Memory-sharing norms that keep their affine parameters: y = gamma * n(x) + beta, backward from y.

The row statistics and the normalisation run in the compiler's ms_layernorm / ms_rmsnorm kernels;
only the per-feature affine map is torch code around them. Forward saves the returned output y
(the storage the next Linear keeps anyway), gamma and beta (parameters, kept by the module
anyway) and one value per row. Backward recovers the normalised value from the output,

    n = (y - beta) / gamma,

and hands ``dn = dy * gamma`` to the kernels' exact norm backward; ``dgamma = sum(dy * n)``,
``dbeta = sum(dy)`` over the rows. That is the exact derivative up to the rounding of the recovery:
an absolute error of about ulp(|y| + |beta|) / |gamma| in n (with a low-precision y under autocast,
that precision's ulp). Where gamma is exactly 0, n is not recoverable (it is taken as 0): the
gradients of x and gamma at that feature are wrong, those at every other feature stay exact
(dn = dy * 0 = 0 there, so the row means are unaffected). ``abp.convert`` refuses norms whose gamma
has zeros; no host synchronisation checks it during training.

``weight_offset`` covers Gemma-style norms, whose multiplier is ``1 + weight``.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import _custom_ops, _launch, _lib, autograd

__all__ = ["affine_ms_norm"]

# What the C++ lane takes for weight and bias; a tensor subclass (a sharded parameter) takes the
# Python lane, where torch's dispatch handles it.
_PLAIN = (type(None), torch.Tensor, torch.nn.Parameter)


def _forward_kernels(op_name: str, x: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """(n, r): the normalised rows and the per-row statistic, from the compiler's forward kernel."""
    if _custom_ops.compiling():
        n, r = _custom_ops.plan(op_name).fwd(x, eps)
        return n, r
    op = _lib.kernel_library().operator(op_name)
    outputs, residuals = _launch.forward(op, (x,), (eps,))
    rows = [t for i, t in enumerate(residuals) if op.residuals[i].kind == "rows"]
    return outputs[0], rows[0]


def _backward_kernels(op_name: str, n: Tensor, r: Tensor, dn: Tensor) -> Tensor:
    """dx from the normalised rows, the per-row statistic and dn, through the kernels' exact backward."""
    if _custom_ops.compiling():
        return _custom_ops.plan(op_name).bwd(n, r, dn)
    op = _lib.kernel_library().operator(op_name)
    dxs = _launch.backward(op, [n, r], [dn], n.shape, n.dtype, n.device)
    assert dxs[0] is not None
    return dxs[0]


class _AffineMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, op_name: str, eps: float, offset: float, out_dtype: Optional[torch.dtype],
        save_dtype: Optional[torch.dtype], x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
    ) -> Tensor:
        autograd.refuse_jit_trace(op_name)
        # Half-precision rows run the kernels in fp32 so that y is rounded once, as torch's norms do.
        compute = _launch.compute_dtype(x.dtype)
        n, r = _forward_kernels(op_name, x.to(compute), eps)
        y = n
        if weight is not None:
            y = y * (weight.to(n.dtype) + offset) if offset else y * weight.to(n.dtype)
        if bias is not None:
            y = y + bias.to(n.dtype)
        target = out_dtype if out_dtype is not None else x.dtype
        if target != y.dtype:
            y = y.to(target)
        # y is saved as the very tensor returned: the next Linear saves the same storage. With a
        # save_dtype (autocast, an output kept in fp32 for a residual stream) a copy in that dtype
        # is saved instead: half the bytes, as accurate as autocast's own matmuls.
        saved = y if save_dtype is None or save_dtype == y.dtype else y.to(save_dtype)
        ctx.save_for_backward(saved, r, weight, bias)
        ctx.abp = (op_name, offset, x.dtype)
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
    op_name, offset, dtype = ctx.abp
    y, r, weight, bias = ctx.saved_tensors
    compute = _launch.compute_dtype(dtype)
    centred = y.to(compute)
    if bias is not None:
        centred = centred - bias.to(compute)
    dy_c = dy.to(compute)
    if weight is not None:
        gamma = weight.to(compute) + offset if offset else weight.to(compute)
        # A zero gamma makes n unrecoverable there (module docstring); other features stay exact.
        n = centred / torch.where(gamma == 0, torch.ones_like(gamma), gamma)
        dn = dy_c * gamma
    else:
        n, dn = centred, dy_c
    dx = _backward_kernels(op_name, n, r, dn).to(dtype)
    rows = tuple(range(dy.dim() - 1))
    # Summed over the rows; one row (a 1-d input) is its own sum (sum over no dimension sums all).
    over_rows = (lambda t: t.sum(rows)) if rows else (lambda t: t)  # noqa: E731
    dweight = over_rows(dy_c * n).to(weight.dtype) if weight is not None and ctx.needs_input_grad[6] else None
    dbias = over_rows(dy_c).to(bias.dtype) if bias is not None and ctx.needs_input_grad[7] else None
    return None, None, None, None, None, dx, dweight, dbias


_backward_once = autograd.once_only(_backward)


def backward_under_create_graph(op_name: str, offset: float, like: Tensor, y: Tensor, r: Tensor,
                                weight: Optional[Tensor], bias: Optional[Tensor], dy: Tensor,
                                needs_weight: bool, needs_bias: bool) -> Tuple[Optional[Tensor], ...]:
    """The C++ lane's affine norm under backward(create_graph=True) (abp/_plan_lane.cpp): this
    module's backward, marked: (dx, dweight, dbias). `like` has the input's dtype."""
    ctx = _SavedContext((y, r, weight, bias), (op_name, offset, like.dtype), (False,) * 6 + (needs_weight, needs_bias))
    out = _backward_once(ctx, dy)
    return out[5], out[6], out[7]


class _SavedContext:
    """What _backward reads from an _AffineMSNorm's ctx."""

    def __init__(self, saved: Tuple[Any, ...], abp: Tuple[Any, ...], needs: Tuple[bool, ...]) -> None:
        self.saved_tensors, self.abp, self.needs_input_grad = saved, abp, needs


def affine_ms_norm(
    op_name: str, x: Tensor, eps: float, weight: Optional[Tensor], bias: Optional[Tensor],
    weight_offset: float, out_dtype: Optional[torch.dtype], save_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Runs the memory-sharing norm `op_name` on rows `x` (..., d) with gamma = weight + weight_offset
    and beta = bias (each (d,) or None), output in `out_dtype` (default: x's), saving it in
    `save_dtype` (default: itself); the arguments are checked by the caller. Plain tensors take
    the C++ lane (abp/_plan_lane.cpp's AffineNormFunction, the same ops in C++) where it is built."""
    if (type(x) is torch.Tensor and type(weight) in _PLAIN and type(bias) in _PLAIN
            and not _custom_ops.compiling()):
        lane = autograd.lane_plan(op_name, _launch.compute_dtype(x.dtype))
        if lane is not None:
            like = lambda dtype: None if dtype is None else torch.empty(0, dtype=dtype)  # noqa: E731
            y = lane[0].affine_norm(lane[1], x, weight, bias, eps, weight_offset, like(out_dtype), like(save_dtype))
            if y is not None:
                return y
    return autograd.apply_function("abp's memory-sharing norm", _AffineMSNorm, op_name, eps, weight_offset,
                                   out_dtype, save_dtype, x, weight, bias)
