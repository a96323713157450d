"""Runs one direction of a manifest operator on torch tensors: checks, allocates, packs args, launches."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _lib
from ._manifest import Direction, KernelRecord, Operator, packed_bytes

__all__ = [
    "DTYPE_NAMES",
    "check_float_tensor",
    "check_inputs",
    "check_param",
    "forward",
    "backward",
]

# The launch dtypes of every kernel, by their manifest names.
DTYPE_NAMES: Dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
}
_EXPECTED_DTYPES = "torch.float32, torch.float16 or torch.bfloat16"


def check_float_tensor(name: str, value: Any) -> torch.Tensor:
    """Checks that `value` is a dense CPU or CUDA tensor of a supported floating dtype; names `name`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name}: expected dtype {_EXPECTED_DTYPES}, got {value.dtype}")
    if value.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {value.layout}")
    if value.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got a tensor on {value.device}")
    return value


def check_inputs(inputs: Sequence[Any], names: Sequence[str]) -> None:
    """Checks every input, and that they share one dtype, one device and one element count."""
    if len(inputs) != len(names):
        raise TypeError(f"expected {len(names)} tensor inputs ({', '.join(names)}), got {len(inputs)}")
    for value, name in zip(inputs, names):
        check_float_tensor(name, value)
    first, first_name = inputs[0], names[0]
    for value, name in zip(inputs[1:], names[1:]):
        if value.device != first.device:
            raise ValueError(f"{name}: expected a tensor on {first.device} (the device of {first_name}), got {value.device}")
        if value.dtype != first.dtype:
            raise TypeError(f"{name}: expected dtype {first.dtype} (the dtype of {first_name}), got {value.dtype}")
        if value.shape != first.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(first.shape)} (the shape of {first_name}), got {tuple(value.shape)}"
            )


def check_param(name: str, value: Any) -> float:
    """A float parameter (a Python or 0-d tensor number); TypeError naming `name` otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name}: expected a number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    return float(value)


def _device_and_stream(device: torch.device) -> Tuple[int, Optional[int]]:
    if device.type == "cpu":
        return -1, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index).cuda_stream
    return index, (stream or None)


def _pointer(t: torch.Tensor) -> _lib.c_void_p:
    return _lib.c_void_p(t.data_ptr())


def _launch_kernel(
    op: Operator,
    record: KernelRecord,
    direction: Direction,
    values: Dict[str, Any],
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    shape: torch.Size,
) -> List[torch.Tensor]:
    """Launches `record` with the direction's inputs; returns its freshly allocated outputs."""
    args: List[Any] = []
    for ref, spec in zip(direction.args, record.inputs):
        value = values[ref]
        if spec.role == "scalar":
            args.append(_lib.c_float(float(value)))
            continue
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"{op.name}: {ref} feeds tensor argument of {record.name} but is {type(value).__name__}")
        if spec.layout == "packed":
            assert spec.bits is not None
            need = packed_bytes(spec.bits, n)
            if value.dtype != torch.uint8 or value.numel() < need or not value.is_contiguous():
                raise ValueError(
                    f"{op.name}: {ref} must be {need} contiguous uint8 bytes of {spec.bits}-bit codes for "
                    f"{n} elements, got {value.numel()} {value.dtype} elements"
                )
        elif value.dtype != dtype or value.numel() != n or not value.is_contiguous():
            raise ValueError(
                f"{op.name}: {ref} must be a contiguous {dtype} tensor of {n} elements, got "
                f"{value.dtype} with {value.numel()} elements"
            )
        if value.device != device:
            raise ValueError(f"{op.name}: {ref} is on {value.device}, expected {device}")
        args.append(_pointer(value))
    results: List[torch.Tensor] = []
    for spec in record.outputs:
        if spec.layout == "packed":
            assert spec.bits is not None
            out = torch.empty(packed_bytes(spec.bits, n), dtype=torch.uint8, device=device)
        else:
            out = torch.empty(shape, dtype=dtype, device=device)
        results.append(out)
        args.append(_pointer(out))
    args.append(_lib.c_int64(n))
    if n > 0:
        library = _lib.kernel_library()
        handle = library.kernel(record.name, DTYPE_NAMES[dtype])
        device_index, stream = _device_and_stream(device)
        _lib.launch(handle, device_index, args, n, stream)
    return results


def _run(
    op: Operator,
    direction: Direction,
    values: Dict[str, Any],
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    shape: torch.Size,
) -> List[Any]:
    record = op.kernel(direction)
    if record is not None:
        for i, result in enumerate(_launch_kernel(op, record, direction, values, n, dtype, device, shape)):
            values[f"result{i}"] = result
    missing = [ref for ref in direction.produces if ref not in values]
    if missing:
        raise RuntimeError(f"operator {op.name}: the manifest refers to {', '.join(missing)}, which this direction lacks")
    return [values[ref] for ref in direction.produces]


def forward(op: Operator, inputs: Sequence[torch.Tensor], params: Sequence[float]) -> Tuple[List[torch.Tensor], List[Any]]:
    """Runs the forward of `op` (inputs already checked); returns (outputs, residuals).

    Dense outputs are new contiguous tensors of the inputs' shape; codes are ceil(bits * n / 8) uint8
    bytes; a scalar residual is a float. No reference to the inputs is kept.
    """
    if op.forward is None:
        raise RuntimeError(f"operator {op.name} has no forward direction")
    if len(params) != len(op.params):
        raise TypeError(f"{op.name}: expected {len(op.params)} parameters ({', '.join(op.params)}), got {len(params)}")
    first = inputs[0]
    values: Dict[str, Any] = {}
    for i, x in enumerate(inputs):
        values[f"input{i}"] = x.contiguous()
    for i, p in enumerate(params):
        values[f"param{i}"] = float(p)
    produced = _run(op, op.forward, values, first.numel(), first.dtype, first.device, first.shape)
    return produced[: op.outputs], produced[op.outputs :]


def backward(
    op: Operator,
    residuals: Sequence[Any],
    grads: Sequence[Optional[torch.Tensor]],
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
) -> List[Optional[torch.Tensor]]:
    """Runs the backward of `op`; returns one gradient (of `shape`) per tensor input.

    A missing output gradient (None) counts as zeros; gradients are made contiguous and must have
    `shape`, `dtype` and `device` (those of the forward's output).
    """
    n = 1
    for d in shape:
        n *= int(d)
    if op.backward is None:
        return [None] * op.inputs
    values: Dict[str, Any] = {}
    for i, r in enumerate(residuals):
        values[f"residual{i}"] = r
    for i, g in enumerate(grads):
        if g is None:
            g = torch.zeros(shape, dtype=dtype, device=device)
        name = "grad_output" if len(grads) == 1 else f"grad_output{i}"
        check_float_tensor(name, g)
        if g.shape != shape:
            raise ValueError(f"{name}: expected shape {tuple(shape)} (the output's), got {tuple(g.shape)}")
        if g.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the output's device), got {g.device}")
        if g.dtype != dtype:
            g = g.to(dtype)
        values[f"grad{i}"] = g.contiguous()
    return list(_run(op, op.backward, values, n, dtype, device, shape))
