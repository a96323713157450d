"""Runs one direction of a manifest operator on torch tensors: checks, allocates, packs args, launches."""
from __future__ import annotations

import math
import struct
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import _lib
from ._manifest import KernelArg, KernelRecord, Operator, packed_bytes

__all__ = [
    "DTYPE_NAMES",
    "ELEMENTWISE_DTYPES",
    "ROW_DTYPES",
    "compute_dtype",
    "device_and_stream",
    "check_device",
    "check_float_tensor",
    "torch_dtypes",
    "check_inputs",
    "check_param",
    "Binding",
    "binding",
    "launch_input",
    "launch_shape",
    "forward_shape",
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


# The torch dtypes of every set of manifest dtype names an operator can have (op.dtypes keeps
# the order f32, f16, bf16, f64), built once: a constant lookup that torch.compile traces through.
_TORCH_DTYPES: Dict[Tuple[str, ...], Tuple[torch.dtype, ...]] = {}
for _mask in range(16):
    _names = tuple(name for bit, name in enumerate(("f32", "f16", "bf16", "f64")) if _mask >> bit & 1)
    _TORCH_DTYPES[_names] = tuple(d for d, name in DTYPE_NAMES.items() if name in _names)


def torch_dtypes(names: Tuple[str, ...]) -> Tuple[torch.dtype, ...]:
    """The torch dtypes of manifest dtype names (an Operator's ``dtypes``)."""
    found = _TORCH_DTYPES.get(names)
    return found if found is not None else tuple(d for d, name in DTYPE_NAMES.items() if name in names)


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
        hint = ""
        if value.dtype == torch.float64:
            # The usual way here: a model cast with .double() after abp.convert (for gradcheck, say).
            hint = ("; abp's generated elementwise kernels have no float64 form: run the model in float32, "
                    "float16 or bfloat16, or where float64 is needed use the unconverted model (abp.convert of a "
                    "float64 model keeps torch's activations)")
        raise TypeError(f"{name}: expected dtype {_dtype_list(dtypes)}, got {value.dtype}{hint}")
    if value.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {value.layout}")
    check_device(name, value)
    return value


def check_device(name: str, value: torch.Tensor) -> None:
    """abp's kernels and plans read data on the CPU or a CUDA device: a tensor elsewhere (a model
    moved to "meta") is named, not launched."""
    if not (value.is_cpu or value.is_cuda):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got a tensor on {value.device}")



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


def bind_arguments(names: Sequence[str], args: Sequence[Any], kwargs: Dict[str, Any], what: str,
                   defaults: Optional[Dict[str, Any]] = None, takes: str = "") -> List[Any]:
    """`args` and `kwargs` as one value per name of `names`, in order, as Python binds a call
    (names not given take their `defaults`); a TypeError naming `what` and the mistake otherwise,
    `takes` saying what the callee takes where an argument is missing."""
    defaults = defaults or {}
    if len(args) > len(names):
        raise TypeError(f"{what}: takes {list(names)}, got {len(args)} positional argument(s)")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"{what}: unexpected keyword argument {key!r}; its arguments are {list(names)}")
        if key in bound:
            raise TypeError(f"{what}: got {key!r} both by position and by keyword")
        bound[key] = value
    missing = [n for n in names if n not in bound and n not in defaults]
    if missing:
        raise TypeError(f"{what}: missing {missing}" + (f"; {takes}" if takes else ""))
    return [bound[n] if n in bound else defaults[n] for n in names]


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
    if device == _CPU:
        return -1, None
    if device.type != "cuda":  # a meta (or other) tensor that reached a launch past its caller's checks
        raise ValueError(f"abp's kernels run on CPU and CUDA tensors, got a tensor on {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    # The raw handle without building a torch.cuda.Stream (a few microseconds per launch).
    stream = _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream
    return index, (stream or None)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CPU = torch.device("cpu")


class Binding:
    """One direction of one operator for one launch dtype, resolved once: the kernel handle, the
    value each argument takes (by manifest reference: input0, param1, residual0, grad0, ...) and
    the outputs' layouts. Every kernel launch of abp goes through one: the autograd path below,
    abp.sampling's kernels and the GACT codec (abp.compress).

    Arguments reach the kernel as 8-byte words (the compiled launcher, _lib.launcher): tensors
    as their addresses, i64 scalars, and f32 scalars as their bits in the low half (a kernel
    reads the 4 bytes it declares, as cuLaunchKernel copies them).
    """

    __slots__ = ("op", "record", "handle", "address", "refs", "inputs", "scalars", "tensor_args", "gathered",
                 "outputs", "packed_bits", "template", "rows_kernel", "total_kernel", "want_outputs", "only_tensors")

    def __init__(self, op: Operator, record: KernelRecord, refs: Tuple[str, ...], dtype: torch.dtype) -> None:
        self.op, self.record = op, record
        self.refs = refs
        self.inputs = record.inputs  # resolved once: KernelRecord.inputs builds a tuple per read
        # Per kernel input: None (a tensor address), "i64" or "f32" (a scalar).
        self.scalars = tuple((spec.type or "f32") if spec.role == "scalar" else None for spec in self.inputs)
        # (reference, spec) of every tensor input: what a launch checks.
        self.tensor_args = tuple((ref, spec) for ref, spec in zip(refs, self.inputs) if spec.role != "scalar")
        # (reference of the rows read by index, reference of their indices) per gathered input.
        self.gathered = tuple((ref, self.refs[spec.by]) for ref, spec in zip(self.refs, self.inputs)
                              if spec.layout == "gathered" and spec.by is not None)
        self.outputs = record.outputs
        # Per output: the code width of a packed one, 0 for one value per row, -1 for a dense one.
        self.packed_bits = tuple((spec.bits or 0) if spec.layout == "packed" else (0 if spec.layout == "rows" else -1)
                                 for spec in record.outputs)
        # A dense input whose shape dense outputs usually have: empty_like of it is the cheapest
        # allocation (torch.empty of a shape parses it, a few microseconds more per call).
        self.template = next((ref for ref, spec in self.tensor_args if spec.layout == "dense"), None)
        self.rows_kernel = record.kind == "rows"
        self.total_kernel = record.kind == "total"
        self.want_outputs = len(self.outputs) + self.total_kernel  # a total kernel's scratch too
        self.only_tensors = all(scalar is None for scalar in self.scalars)
        self.handle = _lib.kernel_library().kernel(record.name, DTYPE_NAMES[dtype])
        self.address: int = self.handle.value

    def arguments(self, values: Mapping[str, Any]) -> List[Any]:
        """The input arguments by reference: tensors (or addresses), i64 and f32 scalars (as bits)."""
        if self.only_tensors:
            return [values[ref] for ref in self.refs]
        args: List[Any] = []
        for ref, scalar in zip(self.refs, self.scalars):
            value = values[ref]
            if scalar is None:
                args.append(value)
            elif scalar == "i64":
                args.append(int(value))  # negative: taken modulo 2^64 by the launcher
            else:
                args.append(_f32_bits(float(value)))
        return args

    def launch(self, values: Mapping[str, Any], outputs: Sequence[Any], shape: Tuple[int, ...],
               device: int, stream: Optional[int]) -> None:
        """Launches over `shape` ((rows, cols) for a row kernel, (n,) for an elementwise one) with
        the inputs from `values` and the outputs `outputs` (tensors or addresses; a total
        kernel's: its result, then its zeroed scratch); nothing runs when empty, except a total
        kernel, whose result is then the reduction's identity."""
        want = self.want_outputs
        if len(shape) != 1 + self.rows_kernel or len(outputs) != want:
            raise RuntimeError(f"operator {self.op.name}: kernel {self.record.name} takes "
                               f"{want} output address(es) over {'(rows, cols)' if self.rows_kernel else '(n,)'}")
        if shape[0] == 0 and not self.total_kernel:  # no rows (a row kernel still runs rows of 0 columns) or no elements
            return
        n = shape[0] * shape[1] if self.rows_kernel else shape[0]
        args = self.arguments(values)
        args.extend(outputs)
        args.extend(shape)
        _lib.launch(self.address, device, n, stream, args)


_F32, _F32_BITS = struct.Struct("<f"), struct.Struct("<I")


def _f32_bits(value: float) -> int:
    """The bits of `value` as an f32, as C's conversion gives them (beyond the range: ±inf)."""
    try:
        packed = _F32.pack(value)
    except OverflowError:
        packed = _F32.pack(math.copysign(math.inf, value))
    return _F32_BITS.unpack(packed)[0]


def binding(op: Operator, backward: bool, dtype: torch.dtype, total: Optional[int] = None) -> Binding:
    """The cached Binding of `op`'s forward (or backward) kernel for launch dtype `dtype`, or of
    its total kernel number `total`."""
    key = (backward, dtype, total)
    bound = op.bindings.get(key)
    if bound is None:
        direction = op.backward if backward else op.forward
        what = "backward" if backward else "forward"
        if direction is None or (direction.kernel is None if total is None else total >= len(direction.totals)):
            raise RuntimeError(f"operator {op.name}: the {what} launches no "
                               f"{'kernel' if total is None else f'total kernel {total}'}")
        name, refs = (direction.kernel, direction.args) if total is None else direction.totals[total]
        bound = op.bindings[key] = Binding(op, op.kernels[name], refs, dtype)
    return bound


def _got(ref: str, value: torch.Tensor) -> str:
    """What a refused argument is, for the error: its dtype, size and, where that is what is wrong,
    its strides; for a saved tensor, where a changed one usually comes from."""
    what = f"{value.dtype} with {value.numel()} elements"
    if not value.is_contiguous():
        what += f", not contiguous (shape {tuple(value.shape)}, strides {value.stride()})"
    if ref.startswith("residual"):
        what += ("; it is a tensor saved for backward: a saved_tensors_hooks unpack must give back what "
                 "its pack was given (dtype, shape and a contiguous layout)")
    return what


def _check_argument(op: Operator, ref: str, value: Any, spec: KernelArg, n: int, rows: int, cols: int,
                    dtype: torch.dtype, device: torch.device) -> None:
    """Checks the tensor feeding kernel argument `spec` (named by its reference `ref`)."""
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"{op.name}: {ref} feeds a tensor argument but is {type(value).__name__}")
    layout = spec.layout
    if layout == "dense":  # the common case first: this runs for every argument of every launch
        if value.dtype != dtype or value.numel() != n or not value.is_contiguous():
            raise ValueError(f"{op.name}: {ref} must be a contiguous {dtype} tensor of {n} elements, got "
                             f"{_got(ref, value)}")
    elif layout == "packed":
        assert spec.bits is not None
        need = packed_bytes(spec.bits, n)
        if value.dtype != torch.uint8 or value.numel() < need or not value.is_contiguous():
            raise ValueError(
                f"{op.name}: {ref} must be {need} contiguous uint8 bytes of {spec.bits}-bit codes for "
                f"{n} elements, got {_got(ref, value)}"
            )
    elif layout == "gathered":
        # Read a row at a time, by index: any number of rows of the launch's columns.
        if value.dtype != dtype or not value.is_contiguous() or value.dim() == 0 or value.shape[-1] != cols:
            raise ValueError(
                f"{op.name}: {ref} must be a contiguous {dtype} tensor of rows of {cols} elements "
                f"(its rows are read by index), got {value.dtype} of shape {tuple(value.shape)}"
            )
    elif layout == "total":
        if value.dtype != compute_dtype(dtype) or value.numel() != 1:
            raise ValueError(f"{op.name}: {ref} must hold one {compute_dtype(dtype)} value (a whole-tensor "
                             f"reduction), got {value.dtype} with {value.numel()} elements")
    elif layout == "cols":
        if value.dtype != dtype or value.numel() != cols or not value.is_contiguous():
            raise ValueError(
                f"{op.name}: {ref} must be a contiguous {dtype} tensor of one value per column "
                f"({cols}), got {_got(ref, value)}"
            )
    elif layout == "rows":
        row_dtype = torch.int32 if spec.type == "i32" else compute_dtype(dtype)
        if value.dtype != row_dtype or value.numel() != rows or not value.is_contiguous():
            raise ValueError(
                f"{op.name}: {ref} must be a contiguous {row_dtype} tensor of one value per row "
                f"({rows}), got {_got(ref, value)}"
            )
    else:
        raise RuntimeError(f"{op.name}: {ref} feeds an argument of unknown layout {layout!r}")
    if value.device != device:
        raise ValueError(f"{op.name}: {ref} is on {value.device}, expected {device}")


def _check_arguments(bound: Binding, values: Mapping[str, Any], n: int, rows: int, shape: Sequence[int],
                     dtype: torch.dtype, device: torch.device) -> None:
    """Checks every tensor argument of one launch of `bound` over `n` elements (`rows` rows)."""
    cols = shape[-1] if shape else 1
    op = bound.op
    for ref, spec in bound.tensor_args:
        _check_argument(op, ref, values[ref], spec, n, rows, cols, dtype, device)


def launch_shape(bound: Binding, values: Mapping[str, Any], shape: Sequence[int]) -> torch.Size:
    """The shape a direction runs over: `shape` (its dense inputs'), except for a row kernel
    that reads rows gathered by index, which runs one row per index: (len(index), the gathered
    tensor's columns)."""
    for ref, by in bound.gathered:
        index, source = values[by], values[ref]
        for what, value in (("the row indices", index), ("the rows read by index", source)):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise ValueError(f"{bound.op.name}: {what} must be a tensor with at least one "
                                 f"dimension, got {_describe(value)}")
        return torch.Size((index.numel(), source.shape[-1]))
    return torch.Size(shape)


def _describe(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _check_gathered_indices(op: Operator, bound: Binding, values: Mapping[str, Any]) -> None:
    """Every row index lies in [-1, rows of the tensor it indexes) (-1: a row of zeros): a kernel
    would read outside the tensor otherwise. The check syncs with the device once per launch;
    abp.sampling's own launchers skip it for plans made from the tensor's own rows."""
    for ref, by in bound.gathered:
        index, source = values[by], values[ref]
        rows = source.numel() // source.shape[-1] if source.shape[-1] else 0
        if index.numel() and (int(index.min()) < -1 or int(index.max()) >= rows):
            raise ValueError(f"{op.name}: {by} holds row indices of {ref}, which must lie "
                             f"in [-1, {rows}), got [{int(index.min())}, {int(index.max())}]")


def _launch_kernel(
    op: Operator,
    backward: bool,
    values: Dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    shape: torch.Size,
    device_index: int,
    stream: Optional[int],
) -> List[torch.Tensor]:
    """Checks the direction's inputs, allocates its outputs and launches its kernel; returns the
    outputs. A row kernel works on rows of ``shape[-1]`` elements: its per-row arguments hold one
    value per row (shape ``shape[:-1]``) in the compute dtype (or int32 row indices).

    This is every eager abp call's path, so it is one function: the arguments are checked and
    collected in one pass (a dense tensor by four attribute reads; anything else, or a failure,
    by _check_argument, which names what is wrong).
    """
    bound = op.bindings.get((backward, dtype, None)) or binding(op, backward, dtype)
    if bound.gathered:
        shape = launch_shape(bound, values, shape)
    n = math.prod(shape)
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if bound.rows_kernel else 0
    args: List[Any] = []
    for ref, spec, scalar in zip(bound.refs, bound.inputs, bound.scalars):
        value = values[ref]
        if scalar is None:
            if (spec.layout != "dense" or not isinstance(value, torch.Tensor) or value.dtype != dtype
                    or value.numel() != n or not value.is_contiguous() or value.device != device):
                _check_argument(op, ref, value, spec, n, rows, cols, dtype, device)
        elif scalar == "i64":
            value = int(value)  # negative: taken modulo 2^64 by the launcher
        else:
            value = _f32_bits(float(value))
        args.append(value)
    if bound.gathered:  # the indices' range, once their dtype and device are known to be right
        _check_gathered_indices(op, bound, values)
    template = values[bound.template] if bound.template is not None else None
    if template is not None and template.shape != shape:
        template = None
    results: List[torch.Tensor] = []
    for bits in bound.packed_bits:
        if bits > 0:
            results.append(torch.empty(packed_bytes(bits, n), dtype=torch.uint8, device=device))
        elif bits == 0:
            results.append(torch.empty(shape[:-1], dtype=compute_dtype(dtype), device=device))
        elif template is not None:  # checked above: contiguous (so is its empty_like), of the launch dtype and device
            results.append(torch.empty_like(template))
        else:
            results.append(torch.empty(shape, dtype=dtype, device=device))
    if n or (bound.rows_kernel and rows):  # no elements: nothing to run (rows of 0 columns still run)
        args.extend(results)
        args.extend((rows, cols) if bound.rows_kernel else (n,))
        _lib.launch(bound.address, device_index, n, stream, args)
    return results


def _launch_totals(
    op: Operator,
    backward: bool,
    values: Dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    shape: torch.Size,
    device_index: int,
    stream: Optional[int],
) -> None:
    """Runs the direction's total kernels in order, each over every element of the tensors it
    reduces (its dense inputs; `shape` when it reads none, e.g. draws only); their results (0-d
    tensors of the compute dtype, on the device: no host sync) become total0, ..."""
    direction = op.backward if backward else op.forward
    assert direction is not None
    compute = compute_dtype(dtype)
    for i in range(len(direction.totals)):
        bound = binding(op, backward, dtype, i)
        dense = next((values[ref] for ref, spec in zip(bound.refs, bound.inputs) if spec.layout == "dense"), None)
        # A matrix a row kernel reads by index is reduced whole: its own elements.
        n = dense.numel() if isinstance(dense, torch.Tensor) else math.prod(shape)
        _check_arguments(bound, values, n, 0, shape, dtype, device)
        total = torch.empty((), dtype=compute, device=device)
        # The partials and the completion counter, which must start at zero.
        scratch_values = bound.record.args[-2].values
        assert scratch_values, "the runtime checked the total kernel's scratch record"
        scratch = torch.zeros(scratch_values, dtype=compute, device=device)
        bound.launch(values, (total, scratch), (n,), device_index, stream)
        values[f"total{i}"] = total


def column_sum(value: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A per-column input's gradient: `value`, row-wide over launch `shape`, summed over the rows
    in the compute dtype (as autograd reduces a broadcast operand's), in launch dtype `dtype`."""
    rows, cols = (math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1)
    return value.reshape(rows, cols).sum(0, dtype=compute_dtype(dtype)).to(dtype)


def _run(
    op: Operator,
    backward: bool,
    values: Dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    shape: torch.Size,
) -> List[Any]:
    direction = op.backward if backward else op.forward
    assert direction is not None
    device_index, stream = device_and_stream(device)
    if direction.totals:
        _launch_totals(op, backward, values, dtype, device, shape, device_index, stream)
    if direction.kernel is not None:
        values.update(zip(_RESULT_REFS, _launch_kernel(op, backward, values, dtype, device, shape, device_index, stream)))
    for i, ref in enumerate(direction.col_sums):
        values[f"colsum{i}"] = column_sum(values[ref], shape, dtype)
    try:
        return [values[ref] for ref in direction.produces]
    except KeyError:
        missing = [ref for ref in direction.produces if ref not in values]
        raise RuntimeError(f"operator {op.name}: the manifest refers to {', '.join(missing)}, "
                           "which this direction lacks") from None


# The manifest's references by index, spelled once (kernels take at most 64 arguments).
_INPUT_REFS, _PARAM_REFS, _RESIDUAL_REFS, _GRAD_REFS, _RESULT_REFS = (
    tuple(f"{kind}{i}" for i in range(64)) for kind in ("input", "param", "residual", "grad", "result"))


def forward_shape(op: Operator, inputs: Sequence[torch.Tensor]) -> torch.Size:
    """The shape the forward of `op` runs over (launch_shape): its outputs' shape, and the shape
    its backward's output gradients have."""
    first = launch_input(op, inputs)
    if not reads_gathered(op):
        return first.shape
    values = {f"input{i}": x for i, x in enumerate(inputs)}
    return launch_shape(binding(op, False, first.dtype), values, first.shape)


def launch_input(op: Operator, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The input whose shape and dtype a launch of `op` runs over: its first input read densely
    (per-row inputs hold one value per row of it, in the compute dtype), else its first read by
    row index, else its first."""
    index = op.bindings.get("launch input")
    if index is None:
        index = op.bindings["launch input"] = _launch_index(op)
    return inputs[index]


def _launch_index(op: Operator) -> int:
    for layout in ("dense", "gathered"):
        for i, spec in enumerate(op.input_args):
            if spec is not None and spec.layout == layout:
                return i
    return 0


def reads_gathered(op: Operator) -> bool:
    """True if the forward of `op` reads an input's rows by index (its launch shape is then the
    index's, not its inputs')."""
    gathered = op.bindings.get("gathered")
    if gathered is None:
        gathered = op.bindings["gathered"] = any(spec is not None and spec.layout == "gathered"
                                                 for spec in op.input_args)
    return gathered


def forward(
    op: Operator,
    inputs: Sequence[torch.Tensor],
    params: Sequence[Union[float, int]],
) -> Tuple[List[torch.Tensor], List[Any]]:
    """Runs the forward of `op` (inputs already type-checked); returns (outputs, residuals).

    The launch runs over the shape and dtype of launch_input: dense outputs are
    new contiguous tensors of that shape, per-row outputs and inputs hold one value per row
    (its shape without the last dimension); codes are ceil(bits * n / 8) uint8 bytes; a scalar
    residual is a float. Parameters are passed as the kernel declares them (f32, or i64 for
    seeds and offsets). No reference to the inputs is kept.
    """
    if op.forward is None:
        raise RuntimeError(f"operator {op.name} has no forward direction")
    if op.inputs == 0:
        raise ValueError(f"operator {op.name}: its shapes do not follow from its inputs (draws without "
                         f"an input); use abp.sampling, which launches it")
    if len(inputs) != op.inputs:
        raise TypeError(f"{op.name}: expected {op.inputs} tensor inputs, got {len(inputs)}")
    if len(params) != len(op.params):
        raise TypeError(f"{op.name}: expected {len(op.params)} parameters ({', '.join(op.params)}), got {len(params)}")
    first = launch_input(op, inputs)
    if op.row_wise and first.dim() == 0:
        raise ValueError(f"{op.name}: input0 must have at least one dimension (its rows run along the last), got a 0-d tensor")
    # resolve_neg: a negative-bit view (torch._neg_view, a conjugate's imaginary part) holds the
    # un-negated values in memory, which is what a kernel reads.
    values: Dict[str, Any] = dict(zip(_INPUT_REFS, [x.resolve_neg().contiguous() for x in inputs]))
    values.update(zip(_PARAM_REFS, params))
    produced = _run(op, False, values, first.dtype, first.device, first.shape)
    return produced[: op.outputs], produced[op.outputs :]


def backward(
    op: Operator,
    residuals: Sequence[Any],
    grads: Sequence[Optional[torch.Tensor]],
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
) -> List[Optional[torch.Tensor]]:
    """Runs the backward of `op`; returns one gradient per tensor input (None for no_grad ones).

    `shape`, `dtype` and `device` are the forward launch's (launch_input). A missing output
    gradient (None) counts as zeros; gradients are made contiguous and must have their output's
    shape (a per-row output's: `shape` without its last dimension) and device.
    """
    if op.backward is None:
        return [None] * op.inputs
    values: Dict[str, Any] = {}
    for ref, r, residual in zip(_RESIDUAL_REFS, residuals, op.residuals):
        # A shared residual is the forward's output, possibly handed on in another dtype
        # (autocast): the kernel reads it in the launch dtype.
        if residual.kind == "shared" and isinstance(r, torch.Tensor) and r.is_floating_point() and r.dtype != dtype:
            r = r.to(dtype)
        values[ref] = r
    grad_dtypes = ROW_DTYPES if op.row_wise else ELEMENTWISE_DTYPES
    for i, (g, layout) in enumerate(zip(grads, op.output_layouts)):
        want_shape, want_dtype = (shape[:-1], compute_dtype(dtype)) if layout == "rows" else (shape, dtype)
        if g is None:
            g = torch.zeros(want_shape, dtype=want_dtype, device=device)
        elif not isinstance(g, torch.Tensor) or g.shape != want_shape or g.device != device or g.dtype not in grad_dtypes or g.layout != torch.strided:
            name = "grad_output" if len(grads) == 1 else f"grad_output{i}"
            check_float_tensor(name, g, grad_dtypes)
            if g.shape != want_shape:
                raise ValueError(f"{name}: expected shape {tuple(want_shape)} (the output's), got {tuple(g.shape)}")
            raise ValueError(f"{name}: expected a tensor on {device} (the output's device), got {g.device}")
        if g.dtype != want_dtype:
            g = g.to(want_dtype)
        values[_GRAD_REFS[i]] = g.resolve_neg().contiguous()
    produced = iter(_run(op, True, values, dtype, device, shape))
    return [None if i in op.no_grad else next(produced) for i in range(op.inputs)]
