"""The eager autograd path: one generic torch.autograd.Function that runs any manifest operator."""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import _eager, _launch, _lib

__all__ = ["OperatorFunction", "apply_eager", "run_lane", "lane_plan"]


class OperatorFunction(torch.autograd.Function):
    """Runs operator `op_name` forward, saves only its residuals, and runs its backward.

    What crosses from forward to backward is exactly the manifest's residuals: tensors (packed codes,
    dense tensors, per-row statistics) through ``ctx.save_for_backward`` so that ``saved_tensors_hooks``
    see them, and scalar residuals as floats on ``ctx``. A *shared* residual is the very output tensor
    this function returns, so a consumer that saves its input (the next Linear) saves the same storage.
    The inputs are *not* kept: only their shape, dtype and device.

    ``out_dtype`` (e.g. autocast's bf16 for a norm feeding a Linear) casts the outputs before they are
    returned and saved: the consumer then saves that tensor itself, not a second, cast copy.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, op_name: str, params: Tuple[float, ...], out_dtype: Optional[torch.dtype], *inputs: torch.Tensor
    ) -> Any:
        op = _lib.kernel_library().operator(op_name)
        # One-input operators take the per-call lane (abp._eager) unless the outputs are cast.
        one = len(inputs) == 1 == op.inputs and out_dtype is None and isinstance(inputs[0], torch.Tensor)
        plan = _eager.plan(op, inputs[0].dtype) if one else None
        done = plan.forward(inputs[0], params) if plan is not None else None
        if done is None:
            plan = None
            done = _launch.forward(op, inputs, params)
        outputs, residuals = done
        first = _launch.launch_input(op, inputs)  # its shape, dtype and device are the backward's
        if out_dtype is not None and out_dtype != first.dtype:
            outputs = [o.to(out_dtype) if layout == "dense" else o for o, layout in zip(outputs, op.output_layouts)]
        for i, residual in enumerate(op.residuals):
            if residual.kind == "shared":
                assert residual.output is not None
                residuals[i] = outputs[residual.output]
        is_tensor = tuple(isinstance(r, torch.Tensor) for r in residuals)
        ctx.save_for_backward(*(r for r, t in zip(residuals, is_tensor) if t))
        ctx.abp_op = op_name
        ctx.abp_plan = plan
        ctx.abp_is_tensor = is_tensor
        ctx.abp_scalars = tuple(float(r) for r, t in zip(residuals, is_tensor) if not t)
        ctx.abp_input_shapes = tuple(x.shape for x in inputs)
        ctx.abp_shape = _launch.forward_shape(op, inputs) if _launch.reads_gathered(op) else first.shape
        ctx.abp_dtype = first.dtype
        ctx.abp_device = first.device
        ctx.set_materialize_grads(False)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        # Grad mode is on only under backward(create_graph=True): the kernels are not
        # differentiable, so once_differentiable makes a second backward fail loudly. It is
        # applied only then: its no_grad context costs more than the launch itself.
        if torch.is_grad_enabled():
            return _backward_once(ctx, *grads)
        return _backward(ctx, *grads)


def _backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    op = _lib.kernel_library().operator(ctx.abp_op)
    tensors = iter(ctx.saved_tensors)
    scalars = iter(ctx.abp_scalars)
    residuals = [next(tensors) if is_tensor else next(scalars) for is_tensor in ctx.abp_is_tensor]
    plan = ctx.abp_plan
    dxs = plan.backward(residuals, grads, ctx.abp_shape, ctx.abp_device) if plan is not None else None
    if dxs is None:
        dxs = _launch.backward(op, residuals, grads, ctx.abp_shape, ctx.abp_dtype, ctx.abp_device)
    # Gradients come back in the launch shape; an input of another shape (a per-row input,
    # or one only saved) gets its own back.
    shaped = tuple(
        dx if dx is None or dx.shape == shape else dx.reshape(shape) for dx, shape in zip(dxs, ctx.abp_input_shapes)
    )
    return (None, None, None) + shaped


_backward_once = once_differentiable(_backward)


def apply_eager(
    op_name: str, params: Tuple[float, ...], inputs: Sequence[torch.Tensor], out_dtype: Optional[torch.dtype] = None
) -> Any:
    """Runs `op_name` eagerly: one output as a tensor, several as a tuple. A one-input operator
    whose outputs are not cast takes the C++ lane (run_lane) where it can; anything else runs
    through OperatorFunction, which gives the same bytes."""
    if out_dtype is None and len(inputs) == 1 and type(inputs[0]) is torch.Tensor:
        out = run_lane(op_name, inputs[0], params)
        if out is not None:
            return out
    return OperatorFunction.apply(op_name, params, out_dtype, *inputs)


def run_lane(op_name: str, x: torch.Tensor, params: Tuple[float, ...]) -> Any:
    """The outputs of one-input operator `op_name` on `x` (a plain tensor) by the C++ lane
    (abp._plan_lane), or None where it does not serve the call: an operator no plan serves, a
    dtype or device it was not made for, the lane not built. It raises only the runtime's own
    errors (a failed launch); the caller's general path checks the arguments and names what is
    wrong. `params` are floats (checked by the caller)."""
    lane = lane_plan(op_name, x.dtype)
    return None if lane is None else lane[0].run(lane[1], x, params)


def lane_plan(op_name: str, dtype: torch.dtype) -> Optional[Tuple[Any, Any]]:
    """(the C++ lane's module, its plan of `op_name` for launch dtype `dtype`), or None where no
    plan serves the operator, the operator is unknown or the lane is not built."""
    key = (op_name, dtype)
    lane = _lanes.get(key, _UNSET)
    if lane is _UNSET:
        op = _lib.kernel_library().operators.get(op_name)
        if op is None:
            return None  # not cached: an operator of that name may be defined later
        lane = _lanes[key] = _make_lane(op, dtype)
    return lane


def _make_lane(op: Any, dtype: torch.dtype) -> Optional[Tuple[Any, Any]]:
    if dtype not in _launch.torch_dtypes(op.dtypes):
        return None  # the general path names the dtype
    from . import _plan_lane
    try:
        native = _eager.native_plan(op, dtype)
    except Exception as e:  # a plan the C++ lane refuses: the Python lane runs it, as without the lane
        warnings.warn(f"abp: operator {op.name} ({dtype}) takes the Python lane: the C++ lane refused its plan "
                      f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=3)
        return None
    return None if native is None else (_plan_lane.module(), native)


# (operator name, dtype) -> (the lane's module, its plan), or None. Operators are never replaced in
# a process (abp._lib.KernelLibrary refuses a second definition), so entries never go stale.
_lanes: Dict[Tuple[str, torch.dtype], Optional[Tuple[Any, Any]]] = {}
_UNSET = object()
