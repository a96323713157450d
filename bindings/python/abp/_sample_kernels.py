"""Launchers of ops/sample/sample.mlir's kernels: row norms, gather-and-scale, put-back, and the
Philox draws and sketches of the sampled linear layers.

These kernels' shapes do not follow from their inputs (k kept rows of an N-row matrix; draws
with no input at all), so the autograd path (_launch.forward/backward) cannot run them; they are
launched through the same bindings (_launch.binding), with the shapes given here. The words are
filled by reference name (input0, param1, residual0, ...), never by position.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from . import _lib
from ._launch import ELEMENTWISE_DTYPES, ROW_DTYPES, binding, compute_dtype, device_and_stream

__all__ = [
    "row_norms",
    "row_norms_backward",
    "sample_rows",
    "unsample_rows",
    "uniform",
    "sketch",
    "span",
    "SKETCHES",
]

#: Sketch kinds and the operator generating each (RMM, docs/algorithms.md §3).
SKETCHES: Mapping[str, str] = {"gaussian": "sketch_gaussian", "rademacher": "sketch_rademacher"}


def _launch(
    op_name: str,
    backward: bool,
    values: Mapping[str, int],
    outputs: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    shape: Tuple[int, ...],
) -> None:
    """Launches one direction of `op_name` through its binding: inputs by manifest reference
    from `values` (addresses or i64 values), then `outputs` (addresses, in the kernel's out
    order), over `shape`: (rows, cols) for a row kernel, (n,) for an elementwise one."""
    op = _lib.kernel_library().operator(op_name)
    device_index, stream = device_and_stream(device)
    binding(op, backward, dtype).launch(values, outputs, shape, device_index, stream)


def _matrix(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-d tensor (rows x cols), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in ROW_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in ROW_DTYPES)
        raise ValueError(f"{name}: expected dtype {names}, got {x.dtype}")
    return x.contiguous()


def _rows(name: str, t: torch.Tensor, dtype: torch.dtype, count: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != count or t.dtype != dtype:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a 1-d {dtype} tensor of {count} values, got {got}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    return t.contiguous()


def _check_indices(name: str, index: torch.Tensor, low: int, high: int) -> None:
    # An index out of range would read outside the matrix: checked here, once, on the host.
    if index.numel() and (int(index.min()) < low or int(index.max()) >= high):
        raise ValueError(f"{name}: every entry must lie in [{low}, {high}), got [{int(index.min())}, {int(index.max())}]")


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """‖x_r‖ for every row of the 2-d `x`, in the compute dtype (fp32, or fp64 for fp64 input)."""
    x = _matrix("x", x)
    out = torch.empty(x.shape[0], dtype=compute_dtype(x.dtype), device=x.device)
    _launch("row_norms", False, {"input0": x.data_ptr()}, [out.data_ptr()], x.dtype, x.device, tuple(x.shape))
    return out


def row_norms_backward(x: torch.Tensor, norms: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of row_norms: dx = grad_r · x_r / ‖x_r‖ (0 on a zero row)."""
    x = _matrix("x", x)
    rows = x.shape[0]
    row_dtype = compute_dtype(x.dtype)
    norms = _rows("norms", norms, row_dtype, rows, x.device)
    grad = _rows("grad", grad, row_dtype, rows, x.device)
    out = torch.empty_like(x)
    values = {"residual0": x.data_ptr(), "residual1": norms.data_ptr(), "grad0": grad.data_ptr()}
    _launch("row_norms", True, values, [out.data_ptr()], x.dtype, x.device, tuple(x.shape))
    return out


def sample_rows(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, trusted: bool = False) -> torch.Tensor:
    """Rows weight[r] · x[index[r]] (one per index) of the 2-d `x`: abp.sample's kernel.

    `index`: int32 in [-1, rows of x), -1 giving a row of zeros (a dropped row, never read);
    `weight`: the compute dtype (fp32, fp64 for fp64 `x`). `trusted`: the index comes from a plan
    over x's own rows, so its range check (a host sync) is skipped.
    """
    x = _matrix("x", x)
    k = index.numel() if isinstance(index, torch.Tensor) else -1
    index = _rows("index", index, torch.int32, k, x.device)
    weight = _rows("weight", weight, compute_dtype(x.dtype), k, x.device)
    if not trusted:
        _check_indices("index", index, -1, x.shape[0])
    if x.shape[0] == 0:  # every index is -1 (nothing to read): zeros, and no launch from an empty tensor
        return torch.zeros((k, x.shape[1]), dtype=x.dtype, device=x.device)
    out = torch.empty((k, x.shape[1]), dtype=x.dtype, device=x.device)
    values = {"input0": x.data_ptr(), "input1": index.data_ptr(), "input2": weight.data_ptr()}
    _launch("sample_rows", False, values, [out.data_ptr()], x.dtype, x.device, (k, x.shape[1]))
    return out


def unsample_rows(kept: torch.Tensor, slot: torch.Tensor, trusted: bool = False) -> torch.Tensor:
    """Row i = kept[slot[i]], or zeros where slot[i] < 0: abp.unsample's kernel (one row per slot).
    `trusted` skips the range check, as for sample_rows."""
    kept = _matrix("kept", kept)
    n = slot.numel() if isinstance(slot, torch.Tensor) else -1
    slot = _rows("slot", slot, torch.int32, n, kept.device)
    if not trusted:
        _check_indices("slot", slot, -1, kept.shape[0])
    if kept.shape[0] == 0:  # nothing was kept (VCAS: no sample's gradient was non-zero): every slot is -1
        return torch.zeros((n, kept.shape[1]), dtype=kept.dtype, device=kept.device)
    out = torch.empty((n, kept.shape[1]), dtype=kept.dtype, device=kept.device)
    values = {"residual0": kept.data_ptr(), "residual1": slot.data_ptr()}
    _launch("sample_rows", True, values, [out.data_ptr()], kept.dtype, kept.device, (n, kept.shape[1]))
    return out


def _count(name: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name}: expected a count >= 0, got {n!r}")
    return n


def check_key(seed: int, offset: int) -> Tuple[int, int]:
    for name, v in (("seed", seed), ("offset", offset)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            raise ValueError(f"{name}: expected an int in [0, 2**63), got {v!r}")
    return seed, offset


def uniform(n: int, seed: int, offset: int, device: torch.device) -> torch.Tensor:
    """n float32 U[0, 1) draws: draw e is Philox at (seed, offset + e), the same on CPU and GPU."""
    n = _count("n", n)
    seed, offset = check_key(seed, offset)
    out = torch.empty(n, dtype=torch.float32, device=device)
    _launch("philox_uniform", False, {"param0": seed, "param1": offset}, [out.data_ptr()], torch.float32,
            out.device, (n,))
    return out


def sketch(kind: str, rows: int, cols: int, seed: int, offset: int, device: torch.device,
           dtype: torch.dtype = torch.float32, second_offset: Optional[int] = None) -> torch.Tensor:
    """A rows x cols random sketch of `kind` ("gaussian": N(0, 1); "rademacher": ±1), a pure
    function of (seed, offset): backward regenerates forward's sketch instead of storing it.

    Entry e (row-major) draws at counter offset + e; a Gaussian entry also at
    second_offset + e (Box–Muller; default offset + rows * cols), so a caller advancing offsets
    by `span(kind, n)` never reuses a draw, and a block of rows of a larger sketch is that
    sketch's rows when both offsets point at its first row.
    """
    if kind not in SKETCHES:
        raise ValueError(f"kind: expected one of {', '.join(SKETCHES)}, got {kind!r}")
    if dtype not in ELEMENTWISE_DTYPES:
        raise ValueError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
    n = _count("rows", rows) * _count("cols", cols)
    seed, offset = check_key(seed, offset)
    out = torch.empty((rows, cols), dtype=dtype, device=device)
    values: Dict[str, int] = {"param0": seed, "param1": offset}
    if kind == "gaussian":
        values["param2"] = check_key(seed, offset + n if second_offset is None else second_offset)[1]
    _launch(SKETCHES[kind], False, values, [out.data_ptr()], dtype, out.device, (n,))
    return out


def span(kind: str, n: int) -> int:
    """The counters a sketch of n entries of `kind` consumes (2n for Gaussian, n for Rademacher)."""
    return 2 * n if kind == "gaussian" else n
