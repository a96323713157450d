"""The per-call lane of the eager autograd path: operators of one dense input, decided once per dtype.

Most abp calls are one-input operators (activations, norms) whose forward is one kernel reading
its input densely; the affine norms add per-column inputs (a gain and a bias, abp._affine_norm),
whose gradients are the backward kernel's row-wide values summed over the rows. For those,
everything _launch works out per call from the manifest (where
each argument comes from, what to allocate, what is saved, which checks apply) is fixed by the
operator and the launch dtype; a Plan works it out once, and its forward and backward are
straight-line code around one launch each. What is left per call is what varies: the tensors,
their shape and device, and the checks a tensor from outside needs.

A plan never decides an error: whatever it does not expect (another dtype, an output gradient
of another shape, a saved tensor that a saved-tensor hook handed back changed) makes it return
None, and OperatorFunction runs the general path (_launch.forward / backward), which handles
it or raises the error that names it. test_eager.py holds both paths to the same bytes for
every operator a plan serves.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import _lib
from ._launch import _f32_bits, binding, column_sum, compute_dtype, device_and_stream
from ._manifest import Operator, packed_bytes, parse_ref

__all__ = ["Plan", "plan", "native_plan"]

# Where a kernel argument or a produced value comes from (a column sum: the sum over the rows of a
# backward value, a per-column input's gradient).
_INPUT, _PARAM, _RESULT, _RESIDUAL, _GRAD, _COLSUM = range(6)
_KINDS = {"input": _INPUT, "param": _PARAM, "result": _RESULT, "residual": _RESIDUAL, "grad": _GRAD,
          "colsum": _COLSUM}


def plan(op: Operator, dtype: torch.dtype) -> Optional["Plan"]:
    """The plan of `op` for launch dtype `dtype`, or None if the operator is not one a plan
    serves (then OperatorFunction always takes the general path). Cached on the operator."""
    key = ("eager plan", dtype)
    found = op.bindings.get(key)
    if found is None:
        found = op.bindings[key] = Plan.build(op, dtype) or False
    return found or None


def native_plan(op: Operator, dtype: torch.dtype) -> Optional[Any]:
    """The C++ lane's plan of `op` for launch dtype `dtype` (abp._plan_lane), or None where no
    plan serves the operator or the C++ lane is not built. Cached on the Plan."""
    found = plan(op, dtype)
    if found is None:
        return None
    native = found.native
    if native is _UNSET:
        from . import _plan_lane
        native = found.native = _plan_lane.native_plan(found)
    return native


_UNSET = object()


class Plan:
    """Operator `op` at launch dtype `dtype`, resolved for the per-call lane: one input read
    densely, then any number read per column (`inputs` in all)."""

    __slots__ = ("op", "dtype", "compute", "inputs", "params", "forward_kernel", "forward_args", "forward_produces",
                 "outputs", "forward_allocs", "rows_kernel", "backward_kernel", "backward_args", "backward_checks",
                 "backward_allocs", "col_sums", "backward_produces", "native")

    @staticmethod
    def build(op: Operator, dtype: torch.dtype) -> Optional["Plan"]:
        forward, backward = op.forward, op.backward
        if (op.inputs < 1 or op.outputs == 0 or forward is None or forward.kernel is None or forward.totals
                or backward is not None and (backward.kernel is None or backward.totals) or op.no_grad):
            return None
        if op.input_args[0] is None or op.input_args[0].layout != "dense":
            return None
        if any(spec is None or spec.layout != "cols" for spec in op.input_args[1:]):
            return None
        if any(layout != "dense" for layout in op.output_layouts):
            return None
        if any(r.kind not in ("codes", "tensor", "rows", "cols", "shared", "scalar") for r in op.residuals):
            return None
        fwd = binding(op, False, dtype)
        sources = [_source(ref) for ref in forward.args]
        if any(kind not in (_INPUT, _PARAM) for kind, _ in sources) or fwd.gathered:
            return None
        produces = [_source(ref) for ref in forward.produces]
        if any(kind not in (_INPUT, _PARAM, _RESULT) for kind, _ in produces):
            return None
        if any(kind != _RESULT or fwd.packed_bits[i] != -1 for kind, i in produces[: op.outputs]):
            return None  # an output that is not a dense result of the kernel
        self = Plan()
        self.native = _UNSET  # the C++ lane's plan, made on first use (native_plan)
        self.op, self.dtype, self.compute = op, dtype, compute_dtype(dtype)
        self.inputs = op.inputs
        self.params = len(op.params)
        self.forward_kernel = fwd.address
        # Per kernel input: (_INPUT, input index, None) or (_PARAM, param index, "i64" or "f32").
        self.forward_args = tuple((kind, i, (scalar or "f32") if kind == _PARAM else None)
                                  for (kind, i), scalar in zip(sources, fwd.scalars))
        self.forward_produces = tuple(produces)
        self.outputs = op.outputs
        self.forward_allocs = fwd.packed_bits
        self.rows_kernel = fwd.rows_kernel
        self.backward_kernel = 0  # no backward: the general path returns no gradients
        self.backward_args, self.backward_checks, self.backward_allocs = (), (), ()
        self.col_sums, self.backward_produces = (), ()
        if backward is not None:
            bwd = binding(op, True, dtype)
            if bwd.gathered or bwd.rows_kernel != fwd.rows_kernel or any(bits != -1 for bits in bwd.packed_bits):
                return None
            # One gradient per input: the dense input's a result of the kernel, a per-column
            # input's a column sum of a result or of the output gradient.
            self.col_sums = tuple(_source(ref) for ref in backward.col_sums)
            if any(kind not in (_RESULT, _GRAD) or kind == _GRAD and i != 0 for kind, i in self.col_sums):
                return None
            self.backward_produces = tuple(_source(ref) for ref in backward.produces)
            if (len(self.backward_produces) != op.inputs or self.backward_produces[0] != (_RESULT, 0)
                    or any(kind != _COLSUM for kind, _ in self.backward_produces[1:])):
                return None
            args = [_source(ref) for ref in backward.args]
            if any(kind not in (_RESIDUAL, _GRAD) for kind, _ in args):
                return None
            if any(scalar is not None and kind != _RESIDUAL for (kind, _), scalar in zip(args, bwd.scalars)):
                return None
            self.backward_kernel = bwd.address
            self.backward_args = tuple(args)
            # Per argument, what a tensor handed to it must be (its layout, and a packed one's
            # width), or how a saved scalar is passed ("f32" or "i64").
            self.backward_checks = tuple((spec.layout, spec.bits) if scalar is None else (scalar, None)
                                         for spec, scalar in zip(bwd.inputs, bwd.scalars))
            if any(layout not in ("dense", "packed", "rows", "cols", "f32", "i64") for layout, _ in self.backward_checks):
                return None
            self.backward_allocs = bwd.packed_bits
        return self

    def forward(self, x: torch.Tensor, params: Sequence[Any],
                cols: Sequence[torch.Tensor] = ()) -> Optional[Tuple[List[Any], List[Any]]]:
        """(outputs, residuals) of the forward on `x` (checked by the caller: a dense CPU or CUDA
        tensor) and the per-column inputs `cols` (one value per column of x each, contiguous, of
        the launch dtype: else the general path), or None for the general path."""
        if (x.dtype != self.dtype or len(params) != self.params or len(cols) != self.inputs - 1
                or (self.rows_kernel and x.dim() == 0)):
            return None
        if not x.is_contiguous() or x.is_neg():  # a negative-bit view: see _launch.forward
            x = x.resolve_neg().contiguous()
        shape = x.shape
        n = x.numel()
        device = x.device
        width = shape[-1] if shape else 1
        for c in cols:
            if (type(c) is not torch.Tensor or c.dtype != self.dtype or c.numel() != width or not c.is_contiguous()
                    or c.is_neg() or c.device != device):
                return None
        inputs = (x, *cols)
        device_index, stream = device_and_stream(device)
        args: List[Any] = []
        for kind, i, scalar in self.forward_args:
            if kind == _INPUT:
                args.append(inputs[i])
            else:
                value = params[i]
                args.append(int(value) if scalar == "i64" else _f32_bits(float(value)))
        results = self._allocate(self.forward_allocs, x, shape, n, device)
        if self.rows_kernel:
            rows = math.prod(shape[:-1])
            if rows:
                args.extend(results)
                args.append(rows)
                args.append(width)
                _lib.launch(self.forward_kernel, device_index, n, stream, args)
        elif n:
            args.extend(results)
            args.append(n)
            _lib.launch(self.forward_kernel, device_index, n, stream, args)
        produced = [results[i] if kind == _RESULT else inputs[i] if kind == _INPUT else params[i]
                    for kind, i in self.forward_produces]
        return produced[: self.outputs], produced[self.outputs:]

    def backward(self, residuals: Sequence[Any], grads: Sequence[Optional[torch.Tensor]], shape: torch.Size,
                 device: torch.device) -> Optional[List[torch.Tensor]]:
        """One gradient per input (the dense input's, then each per-column input's) from the saved
        `residuals` and the output gradients, or None for the general path (a missing or unusual
        gradient, a saved tensor not as the kernel reads it)."""
        g = grads[0]
        if (not self.backward_kernel or len(grads) != 1 or g is None or g.layout != torch.strided
                or g.dtype != self.dtype or g.shape != shape or g.device != device):
            return None
        if not g.is_contiguous() or g.is_neg():
            g = g.resolve_neg().contiguous()
        n = g.numel()
        device_index, stream = device_and_stream(device)
        cols = shape[-1] if shape else 1
        rows = math.prod(shape[:-1]) if self.rows_kernel else 0
        args: List[Any] = []
        for (kind, i), (layout, bits) in zip(self.backward_args, self.backward_checks):
            value = g if kind == _GRAD else residuals[i]
            if layout == "f32" or layout == "i64":  # a saved scalar (a parameter)
                if isinstance(value, torch.Tensor):
                    return None
                args.append(_f32_bits(float(value)) if layout == "f32" else int(value))
                continue
            if not isinstance(value, torch.Tensor) or not value.is_contiguous() or value.device != device:
                return None
            if layout == "dense":
                if value.dtype != self.dtype or value.numel() != n:
                    return None
            elif layout == "packed":
                if value.dtype != torch.uint8 or value.numel() < packed_bytes(bits, n):
                    return None
            elif layout == "cols":
                if value.dtype != self.dtype or value.numel() != cols or value.is_neg():
                    return None
            elif value.dtype != self.compute or value.numel() != rows:
                return None
            args.append(value)
        results = self._allocate(self.backward_allocs, g, shape, n, device)
        if (rows if self.rows_kernel else n):
            args.extend(results)
            if self.rows_kernel:
                args.append(rows)
                args.append(cols)
            else:
                args.append(n)
            _lib.launch(self.backward_kernel, device_index, n, stream, args)
        if not self.col_sums:
            return results
        sums = [column_sum(results[i] if kind == _RESULT else g, shape, self.dtype) for kind, i in self.col_sums]
        return [results[i] if kind == _RESULT else sums[i] for kind, i in self.backward_produces]

    def _allocate(self, allocs: Tuple[int, ...], like: torch.Tensor, shape: torch.Size, n: int,
                  device: torch.device) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []
        for bits in allocs:
            if bits > 0:
                out.append(torch.empty(packed_bytes(bits, n), dtype=torch.uint8, device=device))
            elif bits == 0:
                out.append(torch.empty(shape[:-1], dtype=self.compute, device=device))
            else:
                out.append(torch.empty_like(like))  # `like` is contiguous, of the launch dtype
        return out


def _source(ref: str) -> Tuple[int, int]:
    kind, index = parse_ref(ref)
    return _KINDS.get(kind, -1), index
