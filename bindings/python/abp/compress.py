"""Compressed saved activations (GACT / ActNN, ALGORITHMS.md §6) for any model.

`quantize` stores a floating-point tensor as per-group affine codes: the flattened tensor is cut
into groups of `group_size` elements (the last group holds the remainder, with its own range),
each group keeps its minimum m and scale s = (2^b - 1) / (max - m + 2e-6) in fp32, and every
element keeps the `bits`-bit code q = floor((x - m) * s + u), u ~ U[0, 1) drawn from the shared
Philox stream, so that `dequantize` (q / s + m) is unbiased. Both directions are one generated row
kernel each (ops/gact/gact.mlir: a group is a row). Bool tensors (dropout and ReLU masks) are
packed to 1 bit, exactly.

`compress_saved` applies this to every eligible tensor autograd saves for backward.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _launch, _lib
from ._manifest import packed_bytes

__all__ = [
    "BITS",
    "CompressedTensor",
    "compress_saved",
    "dequantize",
    "draw_seed",
    "eligible",
    "quantize",
]

#: The code widths of the per-group scheme; 32 means "store the tensor as it is".
BITS: Tuple[int, ...] = (1, 2, 4, 8)
_FLOAT_DTYPES = _launch.ROW_DTYPES
# grad_fn names of a view or cast of a parameter: autocast's fp16 copy of a weight, a Linear's
# transposed weight. Such tensors are the parameter (or a copy the caster caches), not activations.
_PARAMETER_VIEWS = frozenset(
    {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
     "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0", "ReshapeAliasBackward0"})


@dataclass(frozen=True)
class _Part:
    """Codes, per-group minima and scales of consecutive whole groups (or of the tail group)."""

    codes: torch.Tensor  # uint8, ceil(bits * numel / 8) bytes
    mins: torch.Tensor  # one per group, fp32 (fp64 for fp64 tensors)
    scales: torch.Tensor
    numel: int
    group_size: int


@dataclass(frozen=True)
class CompressedTensor:
    """A tensor stored as `bits`-bit group codes (kind "groups") or a 1-bit bool mask (kind "mask")."""

    kind: str
    bits: int
    group_size: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    parts: Tuple[_Part, ...] = ()
    mask: Optional[torch.Tensor] = None  # kind "mask": ceil(numel / 8) bytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes plus two per-group values (minimum and scale) per group."""
        if self.mask is not None:
            return self.mask.numel()
        return sum(p.codes.numel() + (p.mins.numel() + p.scales.numel()) * p.mins.element_size() for p in self.parts)

    def tensors(self) -> List[torch.Tensor]:
        """The tensors that hold the data (for byte accounting by storage)."""
        if self.mask is not None:
            return [self.mask]
        return [t for p in self.parts for t in (p.codes, p.mins, p.scales)]


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """A 63-bit Philox key from `generator` (torch's default CPU generator if None), as torch's own
    random ops draw theirs: torch.manual_seed(s) makes every draw reproducible."""
    return int(torch.randint(0, 2**63 - 1, (1,), generator=generator).item())


def _check_bits(bits: Any, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, BITS))}, got {bits!r}")
    return bits


def _check_group_size(group_size: Any) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        raise ValueError(f"group_size: expected a positive multiple of 8, got {group_size!r}")
    return group_size


class _Codec:
    """The two kernels of operator gact_b<bits> for one dtype, resolved once.

    quantize/dequantize launch them directly: on small tensors the generic launch path's per-call
    work (manifest lookups, checks, three allocations) costs more than the kernels. The argument
    order still comes from the manifest; it is checked here, once, against what this code fills.
    """

    _cache: Dict[Tuple[int, torch.dtype], "_Codec"] = {}

    @classmethod
    def get(cls, bits: int, dtype: torch.dtype) -> "_Codec":
        codec = cls._cache.get((bits, dtype))
        if codec is None:
            codec = cls._cache[(bits, dtype)] = cls(bits, dtype)
        return codec

    def __init__(self, bits: int, dtype: torch.dtype) -> None:
        library = _lib.kernel_library()
        op = library.operator(f"gact_b{bits}")
        fwd, bwd = op.forward, op.backward
        if fwd is None or bwd is None or fwd.kernel is None or bwd.kernel is None:
            raise RuntimeError(f"operator {op.name}: expected a forward and a backward kernel")
        fwd_record, bwd_record = op.kernels[fwd.kernel], op.kernels[bwd.kernel]
        # Forward results in residual order (codes, minima, scales), as kernel output indices.
        self.result_of_residual = [int(ref[len("result"):]) for ref in fwd.produces]
        layouts = [fwd_record.outputs[i].layout for i in self.result_of_residual]
        if layouts != ["packed", "rows", "rows"] or sorted(fwd.args) != ["input0", "param0", "param1"] or \
                list(bwd.args) != ["residual0", "residual1", "residual2"] or bwd.produces != ("result0",):
            raise RuntimeError(f"operator {op.name}: unexpected kernel interface {fwd.args} -> {fwd.produces}, "
                               f"{bwd.args} -> {bwd.produces} (abp.compress expects ops/gact/gact.mlir's)")
        # Kernel input i takes (x, seed, offset)[forward_inputs[i]].
        self.forward_inputs = tuple(("input0", "param0", "param1").index(ref) for ref in fwd.args)
        self.bits = bits
        self.meta_dtype = _launch.compute_dtype(dtype)
        self.meta_size = torch.empty(0, dtype=self.meta_dtype).element_size()
        name = _launch.DTYPE_NAMES[dtype]
        self.forward_kernel = library.kernel(fwd_record.name, name)
        self.backward_kernel = library.kernel(bwd_record.name, name)

    def quantize(self, x2d: torch.Tensor, seed: int, offset: int, device: int, stream: Optional[int]) -> _Part:
        rows, cols = x2d.shape
        n = rows * cols
        head = rows * self.meta_size
        # One allocation: minima, scales, then the codes.
        buffer = torch.empty(2 * head + packed_bytes(self.bits, n), dtype=torch.uint8, device=x2d.device)
        mins, scales = buffer[:head].view(self.meta_dtype), buffer[head : 2 * head].view(self.meta_dtype)
        codes = buffer[2 * head :]
        values = (_lib.c_void_p(x2d.data_ptr()), _lib.c_int64(seed), _lib.c_int64(offset))
        args: List[Any] = [values[i] for i in self.forward_inputs]
        outputs: List[Any] = [None, None, None]
        for residual, tensor in zip(self.result_of_residual, (codes, mins, scales)):
            outputs[residual] = tensor
        args += [_lib.c_void_p(t.data_ptr()) for t in outputs]
        args += [_lib.c_int64(rows), _lib.c_int64(cols)]
        _lib.launch(self.forward_kernel, device, args, n, stream)
        return _Part(codes, mins, scales, n, cols)

    def dequantize(self, part: _Part, out: torch.Tensor, device: int, stream: Optional[int]) -> None:
        rows, cols = part.numel // part.group_size, part.group_size
        args = [_lib.c_void_p(t.data_ptr()) for t in (part.codes, part.mins, part.scales, out)]
        args += [_lib.c_int64(rows), _lib.c_int64(cols)]
        _lib.launch(self.backward_kernel, device, args, part.numel, stream)


def quantize(
    x: torch.Tensor,
    bits: int = 2,
    group_size: int = 256,
    *,
    seed: Optional[int] = None,
    offset: int = 0,
    generator: Optional[torch.Generator] = None,
) -> CompressedTensor:
    """Compresses `x` (fp32, fp16, bf16 or fp64; any shape, any strides) to `bits`-bit group codes.

    The random stream is Philox keyed by `seed` (drawn from `generator`, or torch's default
    generator, when None); element e of the flattened `x` draws at counter `offset + e`, so
    tensors sharing a seed at disjoint offsets draw independent numbers.
    """
    _launch.check_float_tensor("x", x, _FLOAT_DTYPES)
    bits = _check_bits(bits)
    group_size = _check_group_size(group_size)
    if seed is None:
        seed = draw_seed(generator)
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed: expected an int in [0, 2**63), got {seed!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**63:
        raise ValueError(f"offset: expected an int in [0, 2**63), got {offset!r}")
    return _quantize(x, bits, group_size, seed, offset)


def _quantize(x: torch.Tensor, bits: int, group_size: int, seed: int, offset: int) -> CompressedTensor:
    """quantize() after its argument checks (the saved-tensor hook's path)."""
    codec = _Codec.get(bits, x.dtype)
    flat = x.detach()
    flat = flat.view(-1) if flat.is_contiguous() else flat.reshape(-1)
    n = flat.numel()
    full = n // group_size
    device, stream = _launch.device_and_stream(x.device)
    parts: List[_Part] = []
    # Whole groups in one launch, the tail group (if any) in a second that continues the stream
    # at its first flat index; both parts pack to whole bytes.
    if full:
        parts.append(codec.quantize(flat[: full * group_size].view(full, group_size), seed, offset, device, stream))
    if n > full * group_size:
        tail = flat[full * group_size :].view(1, n - full * group_size)
        parts.append(codec.quantize(tail, seed, offset + full * group_size, device, stream))
    return CompressedTensor("groups", bits, group_size, tuple(x.shape), x.dtype, x.device, tuple(parts))


def dequantize(c: CompressedTensor) -> torch.Tensor:
    """The tensor `c` stands for: q / s + m per element (exact for a mask); contiguous, c's shape."""
    if not isinstance(c, CompressedTensor):
        raise TypeError(f"c: expected an abp.compress.CompressedTensor, got {type(c).__name__}")
    if c.kind == "mask":
        assert c.mask is not None
        bits = (c.mask.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=c.device)) & 1
        return bits.reshape(-1)[: c.numel].to(torch.bool).reshape(c.shape)
    codec = _Codec.get(c.bits, c.dtype)
    out = torch.empty(c.numel, dtype=c.dtype, device=c.device)
    device, stream = _launch.device_and_stream(c.device)
    start = 0
    for part in c.parts:
        codec.dequantize(part, out[start : start + part.numel], device, stream)
        start += part.numel
    return out.reshape(c.shape)


def _pack_mask(m: torch.Tensor) -> CompressedTensor:
    """A bool tensor as a 1-bit LSB-first stream (ALGORITHMS.md §2.6), ceil(n / 8) bytes."""
    flat = m.reshape(-1)
    n = flat.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=m.device)
    padded[:n] = flat
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=m.device)
    packed = (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)
    return CompressedTensor("mask", 1, 8, tuple(m.shape), torch.bool, m.device, mask=packed)


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view or cast of one (ALGORITHMS.md §6.1: autocast's weight copy)."""
    if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    base = t._base
    if base is not None and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)):
        return True
    node = t.grad_fn
    for _ in range(3):  # a short chain of views and casts ending at a leaf's gradient accumulator
        if node is None or type(node).__name__ not in _PARAMETER_VIEWS:
            return False
        nexts = [f for f, _ in node.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
        if type(node).__name__ == "AccumulateGrad":
            return True
    return False


def eligible(t: torch.Tensor, min_numel: int) -> bool:
    """The default rule of `compress_saved` (docs/python.md): a floating-point (fp32, fp16, bf16,
    fp64) or bool tensor on the CPU or a CUDA device, dense, with at least `min_numel` elements,
    that is not a parameter (nor a view or autocast copy of one)."""
    if t.layout != torch.strided or t.device.type not in ("cpu", "cuda") or t.numel() < max(min_numel, 1):
        return False
    if t.dtype != torch.bool and t.dtype not in _FLOAT_DTYPES:
        return False
    return not _is_parameter(t)


class compress_saved:
    """``with abp.compress_saved(bits=2, group_size=256):`` compresses what autograd saves.

    Every eligible saved tensor (see `eligible`, or a custom ``filter(tensor) -> bool``) is stored
    as `bits`-bit group codes when saved and dequantized when backward reads it; bool masks are
    packed to 1 bit. `bits_for(tensor) -> int` (1, 2, 4, 8, or 32 for "keep as is") overrides
    the width per tensor: this is how `abp.CompressionController` applies its allocation. Each
    block draws one Philox key from `generator` (torch's default generator if None) when it first
    compresses a tensor; its tensors use consecutive stretches of that key's counters.

    A tensor saved twice (a ReLU's output that the next Linear saves as its input) is compressed
    once: both saves get the same CompressedTensor, so backward reads one reconstruction.

    After the block, `stats` holds the count and bytes of what was saved, each distinct tensor
    counted once: ``tensors`` and ``bytes_in`` (all saved tensors as they were), ``bytes_stored``
    (what is kept instead), and ``compressed`` with ``bytes_compressed`` (the compressed ones and
    the bytes of their codes and group headers).
    """

    def __init__(
        self,
        bits: int = 2,
        group_size: int = 256,
        *,
        min_numel: int = 1024,
        filter: Optional[Callable[[torch.Tensor], bool]] = None,
        bits_for: Optional[Callable[[torch.Tensor], int]] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        self.bits = _check_bits(bits)
        self.group_size = _check_group_size(group_size)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel: expected an int >= 0, got {min_numel!r}")
        if filter is not None and not callable(filter):
            raise TypeError(f"filter: expected a callable taking a tensor, got {type(filter).__name__}")
        if bits_for is not None and not callable(bits_for):
            raise TypeError(f"bits_for: expected a callable taking a tensor, got {type(bits_for).__name__}")
        self.min_numel = min_numel
        self.filter = filter
        self.bits_for = bits_for
        self.generator = generator
        self.stats: Dict[str, int] = {}
        self._hooks: Optional[Any] = None
        # The tensors packed in this block by identity, so a second save reuses the first's codes.
        self._packed: Dict[Tuple[Any, ...], Any] = {}
        self._seed: Optional[int] = None
        self._offset = 0

    def _choose(self, t: torch.Tensor) -> int:
        if self.bits_for is None:
            return self.bits
        bits = self.bits_for(t)
        if bits == 32:
            return 32
        return _check_bits(bits, "bits_for(tensor)")

    @staticmethod
    def _identity(t: torch.Tensor) -> Tuple[Any, ...]:
        return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)

    def pack(self, t: torch.Tensor) -> Any:
        """The saved_tensors_hooks pack hook: a CompressedTensor, or `t` itself if not eligible."""
        key = self._identity(t)
        seen = self._packed.get(key)
        # The same tensor object (a weak reference: memory freed and reused is another tensor).
        if seen is not None and seen[0]() is t:
            return seen[1] or t
        result = self._pack_new(t)
        # Only the codes are kept here; a tensor stored as is is remembered by identity alone.
        self._packed[key] = (weakref.ref(t), result if isinstance(result, CompressedTensor) else None)
        return result

    def _pack_new(self, t: torch.Tensor) -> Any:
        self.stats["tensors"] += 1
        self.stats["bytes_in"] += t.numel() * t.element_size()
        wanted = eligible(t, self.min_numel) and (self.filter is None or bool(self.filter(t)))
        if wanted and t.dtype == torch.bool:
            c = _pack_mask(t)
        elif wanted and (bits := self._choose(t)) != 32:
            if self._seed is None:
                self._seed = draw_seed(self.generator)
            c = _quantize(t, bits, self.group_size, self._seed, self._offset)
            self._offset += t.numel()
        else:
            self.stats["bytes_stored"] += t.numel() * t.element_size()
            return t
        self.stats["compressed"] += 1
        self.stats["bytes_compressed"] += c.nbytes
        self.stats["bytes_stored"] += c.nbytes
        return c

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        """The saved_tensors_hooks unpack hook."""
        return dequantize(saved) if isinstance(saved, CompressedTensor) else saved

    def __enter__(self) -> "compress_saved":
        self.stats = {"tensors": 0, "compressed": 0, "bytes_in": 0, "bytes_stored": 0, "bytes_compressed": 0}
        # One key per block, drawn (at its first compression, as torch's own random ops draw
        # theirs) from the generator; each tensor takes the next stretch of counters, so tensors
        # and blocks draw independent numbers.
        self._seed = None
        self._offset = 0
        self._packed = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        assert hooks is not None
        hooks.__exit__(*exc)
        self._packed = {}  # the graph keeps what it saved; this block holds nothing after it
