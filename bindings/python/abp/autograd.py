"""The eager autograd path: one generic torch.autograd.Function that runs any manifest operator."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Dict, NoReturn, Optional, Sequence, Tuple

import torch

from . import _derived, _eager, _launch, _lib

__all__ = ["OperatorFunction", "NotScriptable", "apply_eager", "run_lane", "lane_plan", "not_twice", "once_only",
           "refuse_jit_trace", "refuse_twice"]


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
        refuse_jit_trace(op_name)
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
        # differentiable, so once_only makes a second backward fail loudly. It is applied only
        # then: its no_grad context costs more than the launch itself.
        try:
            if torch.is_grad_enabled():
                return _backward_once(ctx, *grads)
            return _backward(ctx, *grads)
        except RuntimeError as e:
            raise_naming_batched(ctx.abp_op, e)


def jit_alternative() -> str:
    """What to use instead of TorchScript, on this torch (1.13 has neither torch.compile nor
    torch.export)."""
    if hasattr(torch, "compile") and hasattr(torch, "export"):
        return ("use torch.compile or torch.export, which keep them, or script or trace the unconverted model "
                "(the converted model's state_dict loads into it)")
    return ("on this torch, script or trace the unconverted model (the converted model's state_dict loads into "
            "it); torch >= 2 compiles and exports abp's operators")


class NotScriptable:
    """Mixin of abp's modules: torch.jit.script asks each module to prepare itself before it
    compiles, and abp's forwards launch kernels from Python, which TorchScript cannot compile;
    this says so instead of TorchScript's error about some annotation deep inside."""

    def __prepare_scriptable__(self) -> Any:
        raise RuntimeError(f"{type(self).__name__}: torch.jit.script cannot compile abp modules (their kernels are "
                           f"launched from Python, outside TorchScript); {jit_alternative()}")


class RefuseScripting:
    """Set on a model (instance attribute ``__prepare_scriptable__``) whose forward runs inside a
    compress_saved block by abp.convert: the block's hooks are Python, which TorchScript cannot
    compile. Picklable, and no part of the state_dict."""

    def __call__(self) -> Any:
        raise RuntimeError("abp: this model's forward runs inside compress_saved (abp.convert's compress or all "
                           f"recipe), whose hooks TorchScript cannot compile; {jit_alternative()}")


def refuse_jit_trace(op_name: str) -> None:
    """Raises while torch.jit.trace records: a trace keeps torch's ops, not abp's launches (its
    graph would replay without them, or fail on the sizes it turned into values)."""
    if torch._C._get_tracing_state() is not None:
        raise RuntimeError(f"{op_name}: torch.jit.trace cannot record abp operators (their kernels are launched "
                           f"outside torch's dispatcher); {jit_alternative()}")


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


_TWICE = ("trying to differentiate twice an abp operator: its backward kernels are not differentiable, so no "
          "second derivative (a Hessian, a gradient penalty, a meta-learning step) can be taken through it; "
          "use torch's op where second derivatives are needed")


def once_only(backward: Any) -> Any:
    """`backward` (ctx, *grads) -> gradients, for backward(create_graph=True): run without
    recording, its gradients marked so that differentiating them again raises.

    The mark is an error node whose inputs are the gradients and every incoming gradient that
    requires grad, so that autograd reaches it on any path a second derivative takes: through
    ``.backward()``, and through ``autograd.grad(..., inputs)`` towards what the incoming
    gradients depend on (torch's once_differentiable joins only the gradients, which such a
    call never visits). With no incoming gradient that requires grad (a Hessian of a function
    linear after this operator), the gradients could only be differentiated again through this
    operator itself, which no node can express: that raises at once, instead of a silent zero.

    The gradients also depend on the operator's input, through what it saved. The node joins the
    saved tensors that carry the operator's graph (a norm's output, its weight), so a second
    derivative towards the input passes through it. An operator that saved none (an activation's
    codes) has no tensor to join: a Hessian whose incoming gradient does not depend on the input
    (sum(W·act(x))) would find no path and be silently zero, so such an operator raises at once."""
    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        single = not isinstance(outputs, tuple)
        outs = (outputs,) if single else outputs
        if not any(isinstance(o, torch.Tensor) for o in outs):
            return outputs
        upstream = [g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad]
        if not upstream:
            refuse_twice("backward(create_graph=True) reached it with a constant incoming gradient: "
                         "the gradient it gives could only be differentiated again through this operator")
        own = [t for t in ctx.saved_tensors if isinstance(t, torch.Tensor) and t.requires_grad]
        if not own:
            refuse_twice("backward(create_graph=True) reached it: its gradient depends on its input "
                         "through the codes it saved, which no second derivative can follow")
        result = not_twice(outs, upstream + own)
        return result[0] if single else result
    return wrapper


def refuse_twice(why: str) -> NoReturn:
    """Raises the error of a second derivative through an abp operator, saying `why` here."""
    raise RuntimeError(f"{_TWICE} ({why})")


def not_twice(values: Sequence[Any], joined: Sequence[torch.Tensor]) -> Tuple[Any, ...]:
    """`values` (gradients; None kept as None) behind one error node whose inputs are they and
    the tensors `joined`, so that a second derivative reaching the node, on a path through the
    values or towards what `joined` depends on, raises `_TWICE` (once_only)."""
    error = torch._C._functions.DelayedError(_TWICE.encode(), len(values) + len(joined))

    def marked(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return None
        value = value.detach()
        value.requires_grad = value.is_floating_point()
        return value
    wrapped = error(*[marked(v) for v in values], *joined)
    wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
    # DelayedError returns a tensor per input; a None given keeps its place as None.
    return tuple(w if isinstance(v, torch.Tensor) else v for w, v in zip(wrapped, values))


_backward_once = once_only(_backward)


def raise_naming_batched(what: str, error: RuntimeError) -> NoReturn:
    """Raises `error`, raised by the backward of `what`, or where a batched gradient caused it
    (jacobian or hessian with vectorize=True vmaps backward: a tensor without memory reached a
    launch) an error that says so. abp/_plan_lane.cpp's checkGradients says the same in the C++
    lane. Called from the backwards' `except RuntimeError` (a try costs nothing until it raises)."""
    if "doesn't have storage" not in str(error):
        raise error
    raise RuntimeError(
        f"{what}: its backward got a gradient that holds no memory (a batched tensor: jacobian or hessian with "
        "vectorize=True, or a torch.func / functorch transform over the backward); abp's backward runs its own "
        "kernels, which such transforms cannot batch. Use vectorize=False (the default), or torch's modules where a "
        "transform is needed") from None


def apply_function(what: str, function: Any, *args: Any) -> Any:
    """`function.apply(*args)` for one of abp's autograd Functions (`what` names it), with the error
    torch raises for it under torch.func (vmap, grad, jacrev, functional_call with grad), which asks
    for a `setup_context` the Function does not have (torch 1.13's functorch: refuses any Function;
    a vectorized jacobian: a batched tensor without storage at a launch), made one naming abp and
    what to do. Called
    only where the Python Function runs (the C++ lane's calls do not pay the try). Forward-mode AD
    (torch.autograd.forward_ad, which the C++ lane leaves to this path) gets abp's words too,
    instead of torch's request for a `jvp` method."""
    try:
        return function.apply(*args)
    except NotImplementedError as e:
        if "jvp" not in str(e):
            raise
        raise NotImplementedError(
            f"{what}: forward-mode AD (torch.autograd.forward_ad dual tensors: a jvp) is not supported: abp "
            "approximates the backward pass and defines no forward derivative. Use reverse mode "
            "(loss.backward() / torch.autograd.grad), or torch's modules where a jvp is needed (the unconverted "
            "model)") from None
    except RuntimeError as e:
        text = str(e)
        transform = ("functorch" in text and ("setup_context" in text or "autograd.Function" in text)) \
            or "doesn't have storage" in text  # a batched tensor reached a launch (jacobian(vectorize=True))
        if not transform:
            raise
        raise RuntimeError(
            f"{what}: torch.func transforms (vmap, grad, jacrev, functional_call under grad; functorch's on torch "
            "1.13; jacobian and hessian with vectorize=True) are not supported: abp's backward is its own kernels, "
            "which those transforms cannot trace. Train with loss.backward() / torch.autograd.grad, or use torch's "
            "modules where a transform is needed (per-sample gradients: the unconverted model)") from None


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
    return apply_function(f"abp operator {op_name}", OperatorFunction, op_name, params, out_dtype, *inputs)


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
        if _derived._compiling():
            # torch < 2.4 traces abp's Python here (no custom ops): building or loading the lane
            # inside the trace failed and left the process on the Python lane. Not cached: the
            # first eager call builds it.
            return None
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
