"""Runs one direction of a manifest operator on torch tensors: checks, allocates, packs args, launches."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _lib
from ._manifest import Direction, KernelRecord, Operator, packed_bytes

__all__ = [
    "DTYPE_NAMES",
    "ELEMENTWISE_DTYPES",
    "ROW_DTYPES",
    "compute_dtype",
    "device_and_stream",
    "check_float_tensor",
    "check_inputs",
    "check_param",
    "forward",
    "backward",
]

# The launch dtypes of kernels, by their manifest names (f64: row kernels only).
DTYPE_NAMES: Dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
}
#: What elementwise kernels support; row kernels add torch.float64.
ELEMENTWISE_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
ROW_DTYPES: Tuple[torch.dtype, ...] = ELEMENTWISE_DTYPES + (torch.float64,)


def _dtype_list(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kernels compute in (and store per-row values in) for a launch dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_float_tensor(
    name: str, value: Any, dtypes: Sequence[torch.dtype] = ELEMENTWISE_DTYPES
) -> torch.Tensor:
    """Checks that `value` is a dense CPU or CUDA tensor of one of `dtypes`; names `name`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtype_list(dtypes)}, got {value.dtype}")
    if value.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {value.layout}")
    if value.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got a tensor on {value.device}")
    return value



def check_inputs(
    inputs: Sequence[Any], names: Sequence[str], dtypes: Sequence[torch.dtype] = ELEMENTWISE_DTYPES
) -> None:
    """Checks every input, and that they share one dtype, one device and one element count."""
    if len(inputs) != len(names):
        raise TypeError(f"expected {len(names)} tensor inputs ({', '.join(names)}), got {len(inputs)}")
    for value, name in zip(inputs, names):
        check_float_tensor(name, value, dtypes)
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


def device_and_stream(device: torch.device) -> Tuple[int, Optional[int]]:
    """(device index, or -1 for the CPU path; the current CUDA stream handle, or None)."""
    if device.type == "cpu":
        return -1, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    # The raw handle without building a torch.cuda.Stream (a few microseconds per launch).
    stream = _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream
    return index, (stream or None)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


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
    """Launches `record` with the direction's inputs; returns its freshly allocated outputs.

    A row kernel works on rows of ``shape[-1]`` elements: its per-row arguments hold one value
    per row (shape ``shape[:-1]``) in the compute dtype.
    """
    rows_kernel = record.kind == "rows"
    cols = int(shape[-1]) if rows_kernel else 0
    rows = math.prod(shape[:-1]) if rows_kernel else 0
    row_dtype = compute_dtype(dtype)
    args: List[Any] = []
    for ref, spec in zip(direction.args, record.inputs):
        value = values[ref]
        if spec.role == "scalar":
            args.append(_lib.c_int64(int(value)) if spec.type == "i64" else _lib.c_float(float(value)))
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
        elif spec.layout == "rows":
            if value.dtype != row_dtype or value.numel() != rows or not value.is_contiguous():
                raise ValueError(
                    f"{op.name}: {ref} must be a contiguous {row_dtype} tensor of one value per row "
                    f"({rows}), got {value.dtype} with {value.numel()} elements"
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
        elif spec.layout == "rows":
            out = torch.empty(shape[:-1], dtype=row_dtype, device=device)
        else:
            out = torch.empty(shape, dtype=dtype, device=device)
        results.append(out)
        args.append(_pointer(out))
    if rows_kernel:
        args += [_lib.c_int64(rows), _lib.c_int64(cols)]
    else:
        args.append(_lib.c_int64(n))
    if (rows if rows_kernel else n) > 0:
        library = _lib.kernel_library()
        handle = library.kernel(record.name, DTYPE_NAMES[dtype])
        device_index, stream = device_and_stream(device)
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


def forward(
    op: Operator,
    inputs: Sequence[torch.Tensor],
    params: Sequence[Union[float, int]],
) -> Tuple[List[torch.Tensor], List[Any]]:
    """Runs the forward of `op` (inputs already checked); returns (outputs, residuals).

    Dense outputs are new contiguous tensors of the inputs' shape; codes are ceil(bits * n / 8)
    uint8 bytes; a scalar residual is a float. Parameters are passed as the kernel declares them
    (f32, or i64 for seeds and offsets). No reference to the inputs is kept.
    """
    if op.forward is None:
        raise RuntimeError(f"operator {op.name} has no forward direction")
    if not op.same_shape:
        raise ValueError(f"operator {op.name}: its tensors differ in shape (rows gathered by index, per-row "
                         f"outputs or draws without an input); use abp.sampling, which launches it")
    if len(params) != len(op.params):
        raise TypeError(f"{op.name}: expected {len(op.params)} parameters ({', '.join(op.params)}), got {len(params)}")
    first = inputs[0]
    if op.row_wise and first.dim() == 0:
        raise ValueError(f"{op.name}: input0 must have at least one dimension (its rows run along the last), got a 0-d tensor")
    values: Dict[str, Any] = {}
    for i, x in enumerate(inputs):
        values[f"input{i}"] = x.contiguous()
    for i, p in enumerate(params):
        values[f"param{i}"] = p
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
    n = math.prod(shape)
    if op.backward is None:
        return [None] * op.inputs
    values: Dict[str, Any] = {}
    for i, r in enumerate(residuals):
        # A shared residual is the forward's output, possibly handed on in another dtype
        # (autocast): the kernel reads it in the launch dtype.
        if isinstance(r, torch.Tensor) and r.is_floating_point() and r.dtype != dtype and op.residuals[i].kind == "shared":
            r = r.to(dtype)
        values[f"residual{i}"] = r
    for i, g in enumerate(grads):
        if g is None:
            g = torch.zeros(shape, dtype=dtype, device=device)
        name = "grad_output" if len(grads) == 1 else f"grad_output{i}"
        check_float_tensor(name, g, ROW_DTYPES if op.row_wise else ELEMENTWISE_DTYPES)
        if g.shape != shape:
            raise ValueError(f"{name}: expected shape {tuple(shape)} (the output's), got {tuple(g.shape)}")
        if g.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the output's device), got {g.device}")
        if g.dtype != dtype:
            g = g.to(dtype)
        values[f"grad{i}"] = g.contiguous()
    return list(_run(op, op.backward, values, n, dtype, device, shape))
