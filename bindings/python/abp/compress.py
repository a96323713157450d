"""Compressed saved activations (GACT / ActNN, docs/algorithms.md §6) for any model.

`quantize` stores a floating-point tensor as per-group affine codes: the flattened tensor is cut
into groups of `group_size` elements (the last group holds the remainder, with its own range),
each group keeps its minimum m and scale s = (2^b - 1) / (max - m + 2e-6) in fp32, and every
element keeps the `bits`-bit code q = floor((x - m) * s + u), u ~ U[0, 1) drawn from the shared
Philox stream, so that `dequantize` (q / s + m) is unbiased. Each direction is one
generated row kernel (ops/gact/gact.mlir: a group is a row). Bool tensors (dropout masks) are
packed to 1 bit, exactly, and a ReLU's output also keeps its support (x > 0) at 1 bit.

`compress_saved` applies this to every eligible tensor autograd saves for backward, with groups
that never span two planes: a convolution's channels, a token's row (`plane_groups`, which pads
planes no group divides).
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch

from . import _derived, _guard, _launch, _lib, _save_rules, _scale, memory
from ._manifest import packed_bytes

__all__ = [
    "BITS",
    "CompressedTensor",
    "compress_saved",
    "dequantize",
    "draw_seed",
    "rank_key",
    "eligible",
    "quantize",
]

#: The code widths of the per-group scheme; 32 means "store the tensor as it is".
BITS: Tuple[int, ...] = (1, 2, 4, 8)
_FLOAT_DTYPES = _launch.ROW_DTYPES
# Producers whose output's backward reads only where it is positive: ReLU's backward keeps dy
# where its saved output is > 0, and stochastic rounding would flip small positives to the group
# minimum 0. Their outputs keep that support exactly, at one more bit per element.
_SUPPORT_PRODUCERS = frozenset({"ReluBackward0"})
# Producers of log-probabilities, whose backward reads exp(y) (log_softmax: dx = dy - exp(y)·Σdy).
# Their outputs are stored as the probabilities exp(y), so that the rounding stays unbiased where
# backward uses them, and decoded to log(p).
_LOG_PROBABILITY_PRODUCERS = frozenset({"LogSoftmaxBackward0"})
#: Ops that re-view, copy or re-label a value (its layout aside, the same value), by their ATen
#: names: what compiled graphs' FX nodes call them (abp._compiled_saves).
VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "_reshape_alias", "detach", "alias", "t", "transpose",
                      "permute", "unsqueeze", "squeeze", "expand", "clone", "_to_copy"})
#: Ops that re-view or cast a value: a parameter seen through at most PARAMETER_CHAIN of them is
#: the parameter still (autocast's low-precision weight copy, a Linear's transposed weight), not an
#: activation. Eager saves are told by their autograd ancestry (_parameter_of), compiled ones by
#: their FX graph (abp._compiled_saves): one table and one length for both, so that the two store
#: the same tensors. Not a clone: eager cannot tell a parameter from an input that requires grad
#: (both are leaves), and a clone of such an input is an activation.
PARAMETER_VIEW_OPS = (VIEW_OPS - {"clone"}) | {"convert_element_type"}
PARAMETER_CHAIN = 8


def op_key(name: str) -> str:
    """An op's name as an autograd node's class and an ATen op name share it: ``UnsqueezeBackward0``
    and ``unsqueeze``, ``ToCopyBackward0`` and ``_to_copy`` give the same key."""
    return re.sub(r"Backward\d*$", "", name).replace("_", "").lower()


# Autograd node keys of PARAMETER_VIEW_OPS (a node's class name is asked once per class).
_PARAMETER_NODE_KEYS = frozenset(op_key(op) for op in PARAMETER_VIEW_OPS)
_node_is_view: Dict[type, bool] = {}


def _parameter_view_node(node: Any) -> bool:
    kind = type(node)
    known = _node_is_view.get(kind)
    if known is None:
        known = _node_is_view[kind] = op_key(kind.__name__) in _PARAMETER_NODE_KEYS
    return known


class _Part:
    """Consecutive whole groups (or the tail group) of a CompressedTensor, as views of its buffer."""

    __slots__ = ("codes", "mins", "scales", "numel", "group_size")

    def __init__(self, codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int):
        self.codes = codes  # uint8, ceil(bits * numel / 8) bytes
        self.mins = mins  # one per group, fp32 (fp64 for fp64 tensors)
        self.scales = scales
        self.numel = numel
        self.group_size = group_size


class CompressedTensor:
    """A tensor stored as `bits`-bit group codes (kind "groups") or a 1-bit bool mask (kind "mask").

    Everything lives in one uint8 `buffer`: the minima of all groups, their scales, then the codes
    of all elements (ceil(bits * numel / 8) bytes, the tail group's right after the whole
    groups'); for a mask, ceil(numel / 8) bytes. `layout` holds, per part (whole groups, then the
    tail group), (numel, group_size, byte offset of its minima, of its scales, of its codes).
    """

    __slots__ = ("kind", "bits", "group_size", "shape", "dtype", "device", "buffer", "layout", "support", "logs",
                 "padded", "region")

    def __init__(self, kind: str, bits: int, group_size: int, shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, buffer: torch.Tensor, layout: Tuple[Tuple[int, int, int, int, int], ...] = (),
                 padded: int = 0):
        self.kind, self.bits, self.group_size = kind, bits, group_size
        self.shape, self.dtype, self.device = shape, dtype, device
        self.buffer, self.layout = buffer, layout
        # 0, or the length each plane (`plane_dims`: a channel's pixels, a token's row) was padded
        # to before coding, so that no group spans two planes (`plane_groups`).
        self.padded = padded
        # Optionally the exact support (x > 0) as a 1-bit mask: see compress_saved (ReLU outputs);
        # with `region`, where the value lay in that interval instead (kinked activations' saves).
        self.support: Optional["CompressedTensor"] = None
        self.region: Optional[_save_rules.Region] = None
        # True if the codes hold exp(x) and x is their log (log-probabilities: see compress_saved).
        self.logs = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def coded_numel(self) -> int:
        """The elements the codes hold: numel, or with padded planes, the padded planes' elements."""
        return coded_numel(self.shape, self.padded)

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes plus two per-group values (minimum and scale) per group (plus the
        1-bit support, if kept)."""
        return self.buffer.numel() + (self.support.nbytes if self.support is not None else 0)

    def tensors(self) -> List[torch.Tensor]:
        """The tensors that hold the data (for byte accounting by storage)."""
        return [self.buffer] + (self.support.tensors() if self.support is not None else [])

    @property
    def parts(self) -> Tuple[_Part, ...]:
        """Views of the codes, minima and scales of each part (for inspection and tests)."""
        meta = _launch.compute_dtype(self.dtype)
        out = []
        size = _element_size(meta)
        for numel, cols, mins_at, scales_at, codes_at in self.layout:
            head = numel // cols * size
            out.append(_Part(self.buffer[codes_at : codes_at + packed_bytes(self.bits, numel)],
                             self.buffer[mins_at : mins_at + head].view(meta),
                             self.buffer[scales_at : scales_at + head].view(meta), numel, cols))
        return tuple(out)


def check_generator(generator: Any, name: str = "generator") -> Optional[torch.Generator]:
    """`generator` if it is None or a torch.Generator of the CPU or a CUDA device (where abp's keys
    are drawn); TypeError or ValueError naming `name` otherwise."""
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{name}: expected a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a generator of the CPU or a CUDA device, got one of {generator.device}")
    return generator


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """A 63-bit Philox key from `generator` (torch's default CPU generator if None), as torch's own
    random ops draw theirs: torch.manual_seed(s) makes every draw reproducible. Under
    torch.distributed it is this rank's key (`rank_key`)."""
    device = generator.device if generator is not None else "cpu"  # a CUDA generator draws on its device
    return rank_key(int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=device).item()))


_MASK64 = (1 << 64) - 1


def rank_key(key: int) -> int:
    """`key` as this process's rank draws it: unchanged on rank 0 and without an initialised
    torch.distributed process group; on rank r > 0, mixed with r (splitmix64's finaliser of
    key + r·φ·2⁶⁴). Data-parallel ranks are usually seeded alike (for identical initial weights):
    they then still draw independent sampling and rounding noise, which averaging their gradients
    reduces, and each reproduces its own stream from the seed."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return key
    rank = dist.get_rank()
    if rank == 0:
        return key
    z = (key + rank * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _check_bits(bits: Any, name: str = "bits", raw: bool = False) -> int:
    """`bits` if it is one of BITS (or, with `raw`, 32: "keep as is"); ValueError naming `name`."""
    widths = BITS + ((32,) if raw else ())
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in widths:
        allowed = ", ".join(map(str, BITS)) + (" or 32" if raw else "")
        raise ValueError(f"{name}: expected one of {allowed}, got {bits!r}")
    return bits


#: The longest group: one scale for 16M elements already codes a whole activation at once.
MAX_GROUP_SIZE = 1 << 24


def _check_group_size(group_size: Any) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 0 < group_size <= MAX_GROUP_SIZE \
            or group_size % 8:
        raise ValueError(f"group_size: expected a positive multiple of 8 of at most {MAX_GROUP_SIZE}, got {group_size!r}")
    return group_size


class _Codec:
    """The two bindings of operator gact_b<bits> for one dtype (abp._launch.binding).

    quantize/dequantize launch them with addresses inside one buffer per compressed tensor: on
    small tensors the autograd path's per-call work (checks, three allocations) costs more than
    the kernels. Which residual each forward output is comes from the manifest; the interface
    is checked here, once, against what this code fills.
    """

    _cache: Dict[Tuple[int, torch.dtype], "_Codec"] = {}

    @classmethod
    def get(cls, bits: int, dtype: torch.dtype) -> "_Codec":
        codec = cls._cache.get((bits, dtype))
        if codec is None:
            codec = cls._cache[(bits, dtype)] = cls(bits, dtype)
        return codec

    def __init__(self, bits: int, dtype: torch.dtype) -> None:
        op = _lib.kernel_library().operator(f"gact_b{bits}")
        fwd, bwd = op.forward, op.backward
        if fwd is None or bwd is None or fwd.kernel is None or bwd.kernel is None:
            raise RuntimeError(f"operator {op.name}: expected a forward and a backward kernel")
        self.forward = _launch.binding(op, False, dtype)
        self.backward = _launch.binding(op, True, dtype)
        # Forward results in residual order (codes, minima, scales), as kernel output indices.
        self.result_of_residual = [int(ref[len("result"):]) for ref in fwd.produces]
        layouts = [self.forward.outputs[i].layout for i in self.result_of_residual]
        if layouts != ["packed", "rows", "rows"] or sorted(fwd.args) != ["input0", "param0", "param1"] or \
                sorted(bwd.args) != ["residual0", "residual1", "residual2"] or bwd.produces != ("result0",):
            raise RuntimeError(f"operator {op.name}: unexpected kernel interface {fwd.args} -> {fwd.produces}, "
                               f"{bwd.args} -> {bwd.produces} (abp.compress expects ops/gact/gact.mlir's)")
        self.bits = bits

    def quantize(self, x: int, rows: int, cols: int, seed: int, offset: int, buffer: int,
                 at: Tuple[int, int, int], device: int, stream: Optional[int]) -> Tuple[int, int, int, int, int]:
        """Launches the forward over rows x cols elements at address `x`, writing the minima, the
        scales and the codes at the byte offsets `at` of the buffer at address `buffer`; returns
        the part's layout."""
        mins_at, scales_at, codes_at = at
        residuals = (buffer + codes_at, buffer + mins_at, buffer + scales_at)  # codes, minima, scales
        outputs = [0, 0, 0]
        for residual, address in zip(self.result_of_residual, residuals):
            outputs[residual] = address
        self.forward.launch({"input0": x, "param0": seed, "param1": offset}, outputs, (rows, cols), device, stream)
        return (rows * cols, cols, mins_at, scales_at, codes_at)

    def dequantize(self, buffer: int, layout: Tuple[int, int, int, int, int], out: int, device: int,
                   stream: Optional[int]) -> None:
        n, cols, mins_at, scales_at, codes_at = layout
        residuals = {"residual0": buffer + codes_at, "residual1": buffer + mins_at, "residual2": buffer + scales_at}
        self.backward.launch(residuals, [out], (n // cols, cols), device, stream)


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
        seed = draw_seed(check_generator(generator))
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed: expected an int in [0, 2**63), got {seed!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**63:
        raise ValueError(f"offset: expected an int in [0, 2**63), got {offset!r}")
    return quantize_unchecked(x, bits, group_size, seed, offset)


def quantize_unchecked(x: torch.Tensor, bits: int, group_size: int, seed: int, offset: int,
                       padded: int = 0) -> CompressedTensor:
    """quantize() after its argument checks (the saved-tensor hook's path). `padded`: 0, or the
    length each plane of `x` (`plane_dims`, at least 2-d) is padded to first, repeating its last value
    (so that the padding widens no group's range), in groups of `group_size` (`plane_groups`);
    element e of the padded planes draws at counter offset + e."""
    codec = _Codec.get(bits, x.dtype)
    flat = x.detach()
    if padded:
        planes = flat.reshape(-1, math.prod(plane_dims(x.shape)))
        flat = torch.cat([planes, planes[:, -1:].expand(-1, padded - planes.shape[1])], 1)
    elif not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    size, layout = group_layout(n, bits, group_size, x.dtype)
    buffer = torch.empty(size, dtype=torch.uint8, device=x.device)
    device, stream = _launch.device_and_stream(x.device)
    base, address = buffer.data_ptr(), flat.data_ptr()
    for i, (numel, cols, mins_at, scales_at, codes_at) in enumerate(layout):
        start = i * (n // group_size) * group_size  # the tail part starts after the whole groups
        codec.quantize(address + start * flat.element_size(), numel // cols, cols, seed, offset + start, base,
                       (mins_at, scales_at, codes_at), device, stream)
    return CompressedTensor("groups", bits, group_size, tuple(x.shape), x.dtype, x.device, buffer, layout, padded)


_ELEMENT_SIZES: Dict[torch.dtype, int] = {}


def _element_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (asked once per dtype: torch 1.13's dtypes have no itemsize,
    and an empty tensor to ask costs a microsecond on every save)."""
    size = _ELEMENT_SIZES.get(dtype)
    if size is None:
        size = _ELEMENT_SIZES[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def codes_pay(shape: Sequence[Any], dtype: torch.dtype, bits: int, group_size: int, padded: int) -> bool:
    """Whether `bits`-bit codes of a tensor (groups of `group_size`, planes padded to `padded`)
    take fewer bytes than the tensor as it is. Short groups may not: each has an 8-byte header
    (minimum and scale in fp32, for half dtypes too), so (N, C, 2, 2) in fp16, each plane padded to
    one group of 8, takes 12 bytes at 4 bits against 8 raw, and rows of 8 in bf16 take 16 at 8
    bits, as many as raw; compress_saved keeps such a tensor as it is. Nor do planes
    `plane_groups` cannot keep apart (group 0: a dynamic plane size under torch.compile)."""
    if not group_size:
        return False
    if not padded and group_size >= MIN_ROW_GROUP:
        return True  # a header on 64 elements or more: at most 1 bit of 8 per element
    raw = math.prod(shape) * _element_size(dtype)
    return group_layout(coded_numel(shape, padded), bits, group_size, dtype)[0] < raw


def code_layout(shape: Sequence[Any], dtype: torch.dtype, bits: int, group_size: int) -> Optional[Tuple[int, int]]:
    """(group size, padded plane) of `bits`-bit codes of a tensor of `shape` and `dtype` with
    groups of at most `group_size` (`plane_groups`), or None where it is stored as it is because
    codes would not pay (`codes_pay`): how compress_saved stores it, eagerly or compiled, and
    what the CompressionController budgets."""
    group, padded = plane_groups(shape, group_size)
    return (group, padded) if codes_pay(shape, dtype, bits, group, padded) else None


def coded_numel(shape: Sequence[Any], padded: int) -> int:
    """The elements a tensor of `shape` is coded as: all of them, or with its planes
    (`plane_dims`) padded to `padded` elements each, the padded planes'."""
    return math.prod(shape[:len(shape) - len(plane_dims(shape))]) * padded if padded else math.prod(shape)


def plane_dims(shape: Sequence[Any]) -> Sequence[Any]:
    """The dimensions of one plane no code group may span: those after the first two of a
    tensor of at least three dimensions (a convolution's channel plane, (N, C, H, W) or (N, C, L);
    a token's row, (B, T, D)), a row of a 2-d one ((tokens, D)); none of a 1-d one."""
    return shape[2:] if len(shape) > 2 else shape[1:]


#: The shortest code group `row_group_size` aligns with rows: a group's header (its minimum and
#: scale) costs 64 bits for float32, so shorter groups would cost more than a bit per element.
MIN_ROW_GROUP = 64

#: The shortest row (of a tensor of two or three dimensions) `plane_groups` gives groups of its
#: own: a header on fewer elements costs over 4 bits per element, and rows that narrow (a LoRA
#: rank's 4 or 8, a handful of class scores) feed no row norm that would scale a small row's
#: noise up. A convolution's channel planes (four dimensions) get their own groups at any size:
#: a BatchNorm divides each channel by its spread.
MIN_PLANE_ROW = 16


def row_group_size(shape: Sequence[Any], group_size: int) -> int:
    """The code group size compress_saved uses for a tensor of `shape`: the largest multiple of 8
    that divides a row and is at most `group_size`, if that is at least ``min(MIN_ROW_GROUP,
    group_size)``; otherwise `group_size` (`plane_groups` then pads the planes). A row is the last dimension
    or, where that is too short, the trailing dimensions after the first two: a convolution's
    (N, C, H, W) activation is grouped within each channel's H x W plane (28 x 28: groups of 112),
    never across channels, where any group fits the plane.

    Why: one group's range is set by its largest values, and a row of small scale (a zero padding
    token's embedding, a ViT's class token, a channel a depthwise convolution scaled down) that
    shares a group with larger rows decodes to that group's rounding noise; a normalisation's row
    (or channel) statistic then scales the noise up to full size (docs/compressed-training.md). A
    dimension that is not a plain int (a dynamic shape under torch.compile) keeps `group_size`:
    choosing by its value would specialise the graph on it.
    """
    if len(shape) < 2 or not isinstance(shape[-1], int) or shape[-1] % group_size == 0:
        return group_size
    row = 1
    # The trailing dimensions past the batch and channel dimensions, from the last one outwards.
    for dim in reversed(plane_dims(shape)):
        if not isinstance(dim, int):
            break
        row *= dim
        if row % group_size == 0:
            return group_size
        # No divisor of the row is longer than the row: the search starts there.
        for size in range(min(group_size, row // 8 * 8), min(MIN_ROW_GROUP, group_size) - 1, -8):
            if row % size == 0:
                return size
    return group_size


def plane_groups(shape: Sequence[Any], group_size: int) -> Tuple[int, int]:
    """(group size, padded plane) for compress_saved's codes of a tensor of `shape`:
    (`row_group_size`, 0), unless no group of a multiple of 8 elements divides its planes
    (`plane_dims`: 7 x 7 or 14 x 14 pixels of a convolution's channel, 49 and 196 elements; a
    1-d convolution's 49 steps; a token's row of 37 features). Groups of `group_size` would then
    span planes, and a plane of small scale (a channel a depthwise convolution scaled down, before
    a BatchNorm that divides by its spread; a class token, a padding token's row before a norm)
    would decode to its neighbours' rounding noise: on timm's MobileOne, gradients hundreds of
    times the exact ones. Each plane is then padded, by repeating its last value: a plane of at
    most `group_size` elements to the next multiple of 8, as one group (49 -> 56; one of 32 is
    one group of 32, unpadded; rows shorter than MIN_PLANE_ROW keep groups spanning them); a longer one to a
    multiple of the group in [min(MIN_ROW_GROUP, group_size), group_size] whose codes and
    headers take fewest bits (`_padded_cost`: 900 -> 928, groups of 232; a vocabulary of 50257
    -> 50432, groups of 256). Planes whose size is a symbol (torch.compile's dynamic shapes)
    cannot be padded by value: (0, 0) unless the last dimension's groups divide it, and
    `codes_pay` then keeps the tensor as it is (groups spanning channels made MobileOne's
    compiled gradients 1e15 times off)."""
    group = row_group_size(shape, group_size)
    planes = plane_dims(shape)
    if not planes:
        return group, 0
    if not all(isinstance(d, int) for d in planes):
        # Planes of a size torch.compile traces as a symbol (dynamic H, W): the groups of the last
        # dimension keep planes apart only where they divide it; otherwise (0, 0), no coding.
        last = shape[-1]
        return (group, 0) if isinstance(last, int) and last % group == 0 else (0, 0)
    plane = math.prod(planes)
    if plane == 0 or plane % group == 0:
        return group, 0
    if len(shape) < 4 and plane < MIN_PLANE_ROW:
        return group, 0  # rows too narrow to pay a header each (a LoRA rank's): groups span them
    if plane <= group_size:
        padded = -(-plane // 8) * 8
        return (plane, 0) if padded == plane else (padded, padded)
    candidates = range(min(MIN_ROW_GROUP, group_size), group_size + 1, 8)
    best = min(candidates, key=lambda g: (_padded_cost(plane + -plane % g, g), -g))
    return best, plane + -plane % best


def _padded_cost(padded: int, group: int) -> float:
    """Bits a plane padded to `padded` elements takes in groups of `group`, at 4-bit codes with
    fp32 headers (64 bits a group): what `plane_groups` minimises. Counting the padding alone
    chose groups of 120 for a vocabulary of 50257 (23 elements of padding, 4.53 bits per element)
    over groups of 256 (175 elements, 4.26 bits)."""
    return padded * (4 + 64 / group)


def group_layout(n: int, bits: int, group_size: int, dtype: torch.dtype) -> Tuple[int, Tuple[Tuple[int, int, int, int, int], ...]]:
    """(buffer bytes, layout) of `n` elements of `dtype` as `bits`-bit codes in groups of `group_size`.

    Whole groups form one part, the tail group (if any) a second that continues the stream at its
    first flat index. One buffer, no padding: all minima, all scales, all codes (the whole groups'
    codes fill whole bytes, so the tail's start on a byte). Works on torch.SymInts (compiled shapes).
    """
    # Minima and scales are stored in the compute dtype of the launch.
    meta_size = _element_size(_launch.compute_dtype(dtype))
    full = n // group_size
    tail = n - full * group_size
    groups = (n + group_size - 1) // group_size
    meta = groups * meta_size
    layout = []
    if full:
        layout.append((full * group_size, group_size, 0, meta, 2 * meta))
    if tail:
        head = full * meta_size
        layout.append((tail, tail, head, meta + head, 2 * meta + full * group_size * bits // 8))
    return 2 * meta + packed_bytes(bits, n), tuple(layout)


def dequantize(c: CompressedTensor) -> torch.Tensor:
    """The tensor `c` stands for: q / s + m per element (exact for a mask); contiguous, c's shape."""
    if not isinstance(c, CompressedTensor):
        raise TypeError(f"c: expected an abp.compress.CompressedTensor, got {type(c).__name__}")
    _check_consistent(c)
    if c.kind == "mask":
        return mask_from_bits(c.buffer, c.shape)
    codec = _Codec.get(c.bits, c.dtype)
    out = torch.empty(c.coded_numel if c.padded else c.shape, dtype=c.dtype, device=c.device)
    device, stream = _launch.device_and_stream(c.device)
    base, address, size = c.buffer.data_ptr(), out.data_ptr(), out.element_size()
    start = 0
    for part in c.layout:
        codec.dequantize(base, part, address + start * size, device, stream)
        start += part[0]
    if c.padded:  # the planes without their padding
        # contiguous: the MS norms' backward reads its saved output as one dense row-major block
        out = out.view(-1, c.padded)[:, : math.prod(plane_dims(c.shape))].contiguous().view(c.shape)
    if c.support is not None:
        mask = dequantize(c.support)
        out = with_support(out, mask) if c.region is None else with_region(out, mask, c.region)
    if c.logs:
        out = out.log_()
    return out


def _check_consistent(c: CompressedTensor) -> None:
    """Refuses a CompressedTensor whose fields were edited out of step (the kernels would read past
    its buffer): the buffer must be uint8, contiguous, and as long as its shape, bits and layout say."""
    if not isinstance(c.buffer, torch.Tensor) or c.buffer.dtype != torch.uint8 or not c.buffer.is_contiguous():
        raise ValueError("c.buffer: expected a contiguous uint8 tensor")
    if c.kind == "mask":
        want, layout = (c.numel + 7) // 8, tuple(c.layout)
    elif c.kind == "groups":
        if c.dtype not in _FLOAT_DTYPES or c.bits not in (1, 2, 4, 8):
            raise ValueError(f"c: dtype {c.dtype} and bits {c.bits} are not a codec's")
        if not isinstance(c.padded, int) or c.padded < 0 or (c.padded and (
                len(c.shape) < 2 or c.padded < math.prod(plane_dims(c.shape)) or c.padded % c.group_size)):
            raise ValueError(f"c.padded: {c.padded!r} is not a padding of the planes of shape {tuple(c.shape)} "
                             f"into groups of {c.group_size}: it was edited")
        want, layout = group_layout(c.coded_numel, c.bits, c.group_size, c.dtype)
    else:
        raise ValueError(f"c.kind: expected 'groups' or 'mask', got {c.kind!r}")
    device = torch.device(c.device)
    moved = c.buffer.device.type != device.type or (device.index is not None and c.buffer.device.index != device.index)
    if c.buffer.numel() != want or tuple(c.layout) != layout or moved:
        raise ValueError(f"c: its buffer ({c.buffer.numel()} bytes on {c.buffer.device}, layout {c.layout}) does not "
                         f"match its shape {tuple(c.shape)}, {c.bits} bits and group size {c.group_size} "
                         f"({want} bytes, layout {layout}): it was edited")


def _pack_mask(m: torch.Tensor) -> CompressedTensor:
    """A bool tensor as a 1-bit LSB-first stream (docs/algorithms.md §2.6), ceil(n / 8) bytes."""
    return CompressedTensor("mask", 1, 8, tuple(m.shape), torch.bool, m.device, mask_bits(m))


def mask_bits(m: torch.Tensor) -> torch.Tensor:
    """The bool tensor `m` in its logical order as a 1-bit LSB-first stream of ceil(n / 8) uint8
    bytes, in torch ops that torch.compile traces (abp._compiled_saves packs a ReLU's support so)."""
    flat = m.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=m.device)
    return (flat.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def mask_from_bits(bits: torch.Tensor, shape: Sequence[Any]) -> torch.Tensor:
    """The bool tensor of `shape` that `mask_bits` made `bits` from."""
    n = math.prod(shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n].to(torch.bool).reshape(shape)


def with_support(values: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Decoded `values` of a tensor whose support (where it is > 0) is `positive`: exact zeros off
    it, and a positive value rounded down to its group's minimum 0 stays positive (the dtype's
    smallest normal: a bias of at most that much)."""
    tiny = torch.finfo(values.dtype).tiny
    # By comparison, not clamp_min: torch 1.13 has no float16 clamp on the CPU.
    raised = torch.where(values < tiny, values.new_full((), tiny), values)
    return torch.where(positive, raised, torch.zeros((), dtype=values.dtype, device=values.device))


def _beside(bound: float, direction: float, dtype: torch.dtype) -> float:
    """A value of `dtype` just beside `bound` in `direction` (+1 above, -1 below): within a few
    units in the last place, never a subnormal (a GPU may flush one to zero)."""
    info = torch.finfo(dtype)
    step = max(abs(bound) * info.eps, info.tiny)
    while True:
        value = float(torch.tensor(bound + direction * step, dtype=torch.float64).to(dtype))
        if (value - bound) * direction > 0:
            return value
        step *= 2


@functools.lru_cache(maxsize=None)
def _region_ends(region: "_save_rules.Region", dtype: torch.dtype) -> Tuple[float, float, float, float]:
    """Values of `dtype` just inside the interval at each end and just outside it (an infinite end
    stays infinite). Strictly beyond both the end and its rounding to `dtype`: backward may test
    against either (clamp's backward compares with its double bound, a Python comparison with the
    bound rounded to the tensor's dtype), and a value on either would fall on the wrong side."""
    def beyond(bound: float, direction: float) -> float:
        if math.isinf(bound):
            return bound
        rounded = float(torch.tensor(bound, dtype=torch.float64).to(dtype))
        return _beside(max(bound, rounded) if direction > 0 else min(bound, rounded), direction, dtype)
    return beyond(region.lo, 1), beyond(region.hi, -1), beyond(region.lo, -1), beyond(region.hi, 1)


def with_region(values: torch.Tensor, inside: torch.Tensor, region: "_save_rules.Region") -> torch.Tensor:
    """Decoded `values` of a tensor a kinked activation's backward tests against `region`, of which
    `inside` says where each value lay: each value not safely on its own side (on an end counts as
    not) moved just past the nearer end onto it (clamped into the interval, or pushed out of it),
    so that backward takes the piece it took on the tensor; a value already there is unchanged
    (a move is at most one code step)."""
    lo_in, hi_in, lo_out, hi_out = _region_ends(region, values.dtype)
    clamped = values  # by comparisons: torch 1.13 has no float16 clamp on the CPU
    if not math.isinf(lo_in):
        clamped = torch.where(clamped < lo_in, values.new_full((), lo_in), clamped)
    if not math.isinf(hi_in):
        clamped = torch.where(clamped > hi_in, values.new_full((), hi_in), clamped)
    below, above = values.new_full((), lo_out), values.new_full((), hi_out)
    if math.isinf(region.hi):
        nearer_end, safe = below, values <= lo_out
    elif math.isinf(region.lo):
        nearer_end, safe = above, values >= hi_out
    else:
        nearer_end = torch.where(values - region.lo <= region.hi - values, below, above)
        safe = (values <= lo_out) | (values >= hi_out)
    return torch.where(inside, clamped, torch.where(safe, values, nearer_end))


def _parameter_of(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter `t` is, or is a view or cast of (docs/algorithms.md §6.1: autocast's weight
    copy); None for an activation."""
    # A Parameter is a leaf; Parameter's isinstance runs Python (its metaclass), so it is asked last.
    if t.is_leaf and (t.requires_grad or isinstance(t, torch.nn.Parameter)):
        return t
    base = t._base
    if base is not None and base.is_leaf and (base.requires_grad or isinstance(base, torch.nn.Parameter)):
        return base
    node = t.grad_fn
    for _ in range(PARAMETER_CHAIN):  # a short chain of views and casts ending at a leaf's gradient accumulator
        if node is None or not _parameter_view_node(node):
            return None
        nexts = [f for f, _ in node.next_functions if f is not None]
        if len(nexts) != 1:
            return None
        node = nexts[0]
        if type(node).__name__ == "AccumulateGrad":
            return node.variable
    return None


def _is_parameter(t: torch.Tensor) -> bool:
    return _parameter_of(t) is not None


#: Whether compress_saved(recompute=True) recomputes per-row statistics (a norm's 1/rms) from the
#: decoded rows too. Off: measured, the bias it brings costs more than the consistency it buys
#: (bench/consistency_ablation.py).
DERIVE_ROW_STATISTICS = False


# Activations that abp's own autograd Functions computed inside their forward (where grad is
# off, so they do not require grad): id -> (weak reference, the elements min_numel is tested on),
# dropped with the tensor.
_ACTIVATIONS: Dict[int, Tuple["weakref.ref[torch.Tensor]", int]] = {}


def mark_activation(t: torch.Tensor, sampled_from: int = 0) -> torch.Tensor:
    """Marks `t`, computed from activations inside an autograd Function's forward (a sampled
    layer's kept rows), as an activation for compress_saved, which otherwise keeps a tensor that
    requires no grad as a constant of backward. `sampled_from`: the elements of the activation
    `t` was sampled from; `min_numel` is tested on that size, so that kept rows are coded exactly
    when the whole input would be (a narrow layer's 30 % of rows may fall under `min_numel` where
    its input does not: kept raw, they would cost more than the input's codes). Returns `t`."""
    key = id(t)
    _ACTIVATIONS[key] = (weakref.ref(t, lambda _, key=key: _ACTIVATIONS.pop(key, None)), max(t.numel(), sampled_from))
    return t


def _marked_numel(t: torch.Tensor) -> Optional[int]:
    """The elements `min_numel` is tested on for a tensor mark_activation marked; None if unmarked."""
    entry = _ACTIVATIONS.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def keeps_support(t: torch.Tensor) -> bool:
    """Whether compress_saved (with exact_relu) keeps `t`'s support (x > 0) beside its codes, a bit
    per element: `t` is a ReLU's output, whose backward reads it for the sign."""
    return t.grad_fn is not None and type(t.grad_fn).__name__ in _SUPPORT_PRODUCERS


def _compressible(t: torch.Tensor, min_numel: int, row_statistics: bool = False) -> bool:
    """`eligible` without the parameter test (which compress_saved makes first, once)."""
    # abp.convert's count of an example call leaves no small tensor raw (abp._scale).
    smallest = max(min_numel, 1) if _scale.apply() else 1
    # is_cpu / is_cuda: t.device.type makes a new string on every call (about 0.4 µs, on each save).
    if t.layout != torch.strided or not (t.is_cpu or t.is_cuda) or t.numel() < 1:
        return False
    marked = _marked_numel(t) if _ACTIVATIONS else None
    if (t.numel() if marked is None else marked) < smallest:
        return False
    if t.dtype == torch.bool:
        return True
    # A floating tensor off the gradient path (an attention mask, a rotary table, the input batch,
    # a logsumexp) is a constant of backward, not an activation: the caller or the model usually
    # holds it anyway, and it may hold values group codes cannot carry (a mask's -inf decodes to
    # NaN). As GACT does, only tensors that require grad are compressed, and what abp's own
    # Functions mark as activations (mark_activation).
    if not t.requires_grad and marked is None:
        return False
    return t.dtype in _FLOAT_DTYPES and (row_statistics or not row_statistic_shape(t.shape))


def row_statistic_shape(shape: Sequence[Any]) -> bool:
    """True for the shape of a per-row statistic: at least 2-D with a last dimension of 1 (a
    reduction kept with its dimension, a norm's mean or 1/std). It scales a whole row in backward
    and costs 1/width of that row, so compress_saved keeps it as it is, eager or compiled. (A
    convolution's activations at 1x1 pixels, (N, C, 1, 1), look the same and are kept too.) A last
    dimension torch.compile traces as dynamic is never 1 (dynamo specialises sizes 0 and 1)."""
    return len(shape) >= 2 and isinstance(shape[-1], int) and shape[-1] == 1


def eligible(t: torch.Tensor, min_numel: int) -> bool:
    """The default rule of `compress_saved` (docs/python.md): a bool tensor, or a floating-point
    (fp32, fp16, bf16, fp64) one that requires grad, on the CPU or a CUDA device, dense, with at
    least `min_numel` elements, that is not a parameter (nor a view or autocast copy of one)."""
    return _compressible(t, min_numel) and not _is_parameter(t)


_compiling = _derived._compiling


_WARNED: Set[str] = set()


def _warn_once(what: str, message: str) -> None:
    """A RuntimeWarning about a block that compresses nothing, once per process and kind."""
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


#: The compress_saved block open in this thread, if any (blocks do not nest). Its hooks read it
#: too: the GraphModule pack hook of a compiling block hands eager saves to it.
_OPEN = threading.local()


def open_block() -> Optional["compress_saved"]:
    """The compress_saved block open in this thread, or None."""
    return getattr(_OPEN, "block", None)


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def outside_blocks() -> Iterator[None]:
    """Runs what is inside as if no compress_saved block were open in this thread: its saves are
    kept as they are (saved-tensor hooks that keep them, innermost, take them from the open
    block), and a CompressionController's step ignores the model's calls made inside (neither
    compressed nor replayed). VCAS's calibration passes run so: they measure exact gradients and
    are no training step, whichever callback or block is around them."""
    _OPEN.outside = getattr(_OPEN, "outside", 0) + 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(memory.without_node, _unpacked) \
                if open_block() is not None else contextlib.nullcontext():
            yield
    finally:
        _OPEN.outside -= 1


def inside_outside_blocks() -> bool:
    """True within outside_blocks() in this thread."""
    return getattr(_OPEN, "outside", 0) > 0

#: The narrowest uniform width compress_saved accepts unless told otherwise (`allow_low_bits`).
MIN_UNIFORM_BITS = 4


def check_uniform_bits(bits: int, allow_low_bits: bool, name: str = "bits") -> None:
    """Refuses one width below 4 bits for every saved tensor, unless `allow_low_bits`."""
    if bits < MIN_UNIFORM_BITS and not allow_low_bits:
        raise ValueError(
            f"{name}={bits}: one width of 2 bits or fewer for every saved tensor did not train a language model to "
            "exact training's loss (docs/compressed-training.md: 1.72 at 2 bits against 1.63 nats per byte) although "
            "it does on small image classifiers. Use bits=4 (as exact there), or abp.CompressionController("
            "model, avg_bits=2), which picks a width per tensor by its measured sensitivity and came within about "
            "0.7 % of exact training's loss there at 2 bits on average. Or pass allow_low_bits=True to accept the risk (the divergence guard "
            "still watches)")


class _Deferred:
    """What the pack hook returns for a tensor to compress: the tensor until the op saving it has
    saved everything (its rule may then ask for more bits), then what it is stored as."""

    __slots__ = ("value", "bits", "choice", "tags", "pending", "version", "modified", "exact", "region")

    def __init__(self, t: torch.Tensor, bits: int, choice: int, tags: memory.Tags) -> None:
        self.value: Any = t
        self.bits = bits
        self.choice = choice  # the index of its bits_for call in the block, -1 without bits_for
        self.tags = tags  # the memory counters active at the save, with their tags
        self.pending = True
        # torch checks a saved tensor's version when backward reads it, but not when hooks packed
        # it: a tensor held back and changed in place before it is stored must fail as torch would.
        self.version = t._version
        self.modified = False
        # Its op's rule keeps it as it is (KEPT_BITS): stored, neither coded nor recomputed.
        self.exact = False
        # The interval a kinked activation's backward tests it against (_save_rules.region_of).
        self.region: Optional[_save_rules.Region] = None


#: Switches torch function handling off, modes included (torch >= 2; the recorder needs torch >= 2).
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
#: Tensors whose properties need no torch function (a subclass's may: its hook keeps it on).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

try:
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # torch 1.13
    def _is_fake(t: torch.Tensor) -> bool:
        return False


_is_functional = getattr(torch, "_is_functional_tensor", lambda t: False)
try:
    from torch._subclasses.functional_tensor import FunctionalTensor as _FunctionalTensor
except ImportError:  # torch < 2.2
    _FunctionalTensor = ()  # type: ignore[assignment,misc]


def _without_data(t: torch.Tensor) -> bool:
    """A tensor of tracing, with no data to code: a fake tensor, or a functional wrapper (of one)."""
    return bool(_is_functional(t)) or (type(t) not in _PLAIN_TENSORS and (
        isinstance(t, _FunctionalTensor) or bool(_is_fake(t))))


class _Kept:
    """What the pack hook returns for a tensor kept as it is (a parameter, a small activation): the
    tensor and its version when it was saved. With saved-tensor hooks autograd checks no versions,
    so unpack does: a tensor changed in place before backward reads it (an optimizer stepping a
    model whose graph another loss still holds) must fail as torch fails without the block."""

    __slots__ = ("value", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.value = memory.without_node(t)
        self.version = t._version


def _modified_error(version: int, now: Optional[int] = None) -> RuntimeError:
    at = f"at version {version}" + (f", now {now}" if now is not None else "")
    return RuntimeError(
        "compress_saved: one of the tensors needed for gradient computation was modified by an in-place "
        f"operation after it was saved ({at}); torch raises the same error without "
        "compress_saved. Use the out-of-place op, clone the tensor before changing it, or (an optimizer step "
        "between a forward and its backward) run the backward first")


#: What unpack returns to `_peek` (which wants the packed object, not a tensor).
_NOTHING = torch.empty(0)


def _reads_projection(kept: Any) -> bool:
    """Whether `kept` (what a block packed for a tensor) is recomputed through a matrix product."""
    value = kept.value if isinstance(kept, _Deferred) else kept
    return isinstance(value, _derived.Derived) and value.reads_projection


def _kept_tensors(kept: Any) -> List[torch.Tensor]:
    """The tensors that hold what is stored for a saved tensor."""
    if isinstance(kept, _Deferred):
        kept = kept.value
    if isinstance(kept, _derived.Derived):
        return []  # what it refers to is counted where it is stored
    return kept.tensors() if isinstance(kept, CompressedTensor) else [kept]


class compress_saved(contextlib.ContextDecorator):
    """``with abp.compress_saved(bits=4, group_size=256):`` compresses what autograd saves. As a
    decorator (``@abp.compress_saved(bits=4)`` on a training step), the one block is entered at
    each call of the function (a recursive call, or two threads calling it at once, find it open
    and raise).

    A uniform width below 4 bits (`bits` 1 or 2 without `bits_for`) raises ValueError unless
    `allow_low_bits=True`: measured on a language model it does not train as exact training does
    (docs/compressed-training.md).

    Every eligible saved tensor (see `eligible`, or a custom ``filter(tensor) -> bool``) is stored
    as `bits`-bit group codes when saved and dequantized when backward reads it; bool masks are
    packed to 1 bit. `group_size` is the longest group, and no group spans two planes (a token's
    row, a convolution's channel; `plane_groups`, which pads planes no group divides, and leaves
    rows narrower than MIN_PLANE_ROW to groups that span them), so that a plane of small scale
    does not share its range with larger ones.
    With `exact_relu` (the default) the output of a ReLU also keeps its support (x > 0) at one
    more bit per element, so that ReLU's backward, which reads only where its saved output is
    positive, stays exact; without it that backward is biased (docs/python.md).
    `bits_for(tensor) -> int` (1, 2, 4, 8, or 32 for "keep as is") overrides
    the width per tensor: this is how `abp.CompressionController` applies its allocation. Each
    block draws one Philox key from `generator` (torch's default generator if None) when it first
    compresses a tensor; its tensors use consecutive stretches of that key's counters.

    A tensor saved twice (a ReLU's output that the next Linear saves as its input, or the 2-D
    views of one 3-D input that the q, k and v projections save) is compressed once: both saves
    get the same CompressedTensor, so backward reads one reconstruction.

    **Op rules** (`op_rules`, on by default; torch >= 2, where autograd numbers its nodes): some
    ops' backward passes are not linear in what they save, and compressing that damages training.
    Fused scaled-dot-product attention recomputes its probabilities from the saved query, key and
    logsumexp through exp(): the query and key are stored at 8 bits at least (abp._save_rules;
    docs/compressed-training.md has the measurements; the logsumexp needs no gradient and is
    kept as it is). An activation checkpoint's inputs (torch.utils.checkpoint, reentrant or not),
    from which backward reruns its whole block, are kept as they are, and not offered to
    `bits_for`: like parameters, they are out of a budget. To know the op, a tensor is stored when
    the op saving it has saved everything: at the next op's first save, the block's end, or the
    first read in backward, whichever comes first, so one op's saves are held as they are a
    little longer. `floors` maps the index of each `bits_for` call of the last block whose width
    a rule raised to that width (the controller counts it against its budget).

    **Divergence guard** (`guard`: "warn", the default, "raise", or False): when backward ends,
    the norm of the gradients of the parameters the block saw is recorded for that model; if it
    is not finite, or the median of the last 20 steps exceeds 8 times the median of steps 5-24,
    a `DivergenceWarning` (with "raise", a `DivergenceError`) says so once, naming this setting
    and what to use instead. Norms are read on the host every 20 steps.

    After the block, `stats` holds the count and bytes of the activations saved, each distinct
    tensor counted once (parameters, their views and autocast copies are left out: the modules
    keep them anyway; abp.memory counts the same way): ``tensors`` and ``bytes_in`` (all saved tensors as they were), ``bytes_stored``
    (what is kept instead: the compressed buffers, and the storages of the tensors kept as they
    are, each storage once), and ``compressed`` with ``bytes_compressed`` (the compressed ones and
    the bytes of their codes and group headers); ``derived`` with ``numel_derived`` (the tensors
    recomputed in backward and their elements) and ``numel_checkpointed`` (the elements of the
    activation checkpoints' inputs, kept as they are).
    """

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 256,
        *,
        min_numel: int = 1024,
        filter: Optional[Callable[[torch.Tensor], bool]] = None,
        bits_for: Optional[Callable[[torch.Tensor], int]] = None,
        generator: Optional[torch.Generator] = None,
        exact_relu: bool = True,
        op_rules: bool = True,
        guard: Union[bool, str] = "warn",
        allow_low_bits: bool = False,
        recompute: bool = True,
    ) -> None:
        for flag, value in (("exact_relu", exact_relu), ("op_rules", op_rules), ("allow_low_bits", allow_low_bits),
                            ("recompute", recompute)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag}: expected True or False, got {value!r}")
        self.bits = _check_bits(bits)
        if bits_for is None:
            check_uniform_bits(bits, allow_low_bits)
        self.group_size = _check_group_size(group_size)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel: expected an int >= 0, got {min_numel!r}")
        if filter is not None and not callable(filter):
            raise TypeError(f"filter: expected a callable taking a tensor, got {type(filter).__name__}")
        check_generator(generator)
        if bits_for is not None and not callable(bits_for):
            raise TypeError(f"bits_for: expected a callable taking a tensor, got {type(bits_for).__name__}")
        self.min_numel = min_numel
        self.filter = filter
        self.bits_for = bits_for
        self.generator = generator
        self.exact_relu = exact_relu
        self.op_rules = op_rules
        self.recompute = recompute
        if guard is True:
            guard = "warn"
        if guard not in (False, None, "warn", "raise"):
            raise ValueError(f"guard: expected 'warn', 'raise', or False or None (off), got {guard!r}")
        self.guard: Union[bool, str] = guard or False
        #: What the guard's message calls this block.
        self.label = f"abp.compress_saved(bits={self.bits})" if bits_for is None else "abp.compress_saved(bits_for=...)"
        self._guarded: Optional[Dict[int, torch.Tensor]] = None
        # Whether a guarded parameter was saved in float16 (autocast's copy, a half model): a
        # GradScaler then scales the gradients the guard reads (abp._guard, `scaled`).
        self._guarded_half = False
        self.stats: Dict[str, int] = {}
        #: The last block's bits_for call index → the width an op's rule raised that tensor to.
        self.floors: Dict[int, int] = {}
        #: The last block's bits_for call index → the least width its op's rule allows, whatever
        #: was asked (a controller's first step asks 32 for everything and still learns them).
        self.rule_floors: Dict[int, int] = {}
        #: The last block's bits_for call indices whose tensor was recomputed instead (no width).
        self.derived_choices: Set[int] = set()
        # bits_for indices of the saves stored with a region bit (a kinked activation's), which a
        # controller's budget counts as it counts a ReLU output's support.
        self.region_choices: Set[int] = set()
        self._hooks: Optional[Any] = None
        self._outer: Optional["compress_saved"] = None  # an outer block, open again when an inert one exits
        #: Warn when a block compressed nothing because what it saw were constants (a compiled
        #: model's saves); off for blocks abp runs itself (the controller's replays).
        self.explains_constants = True
        #: Raise, as torch does, when a tensor kept as it is changed in place before backward read
        #: it; off for the controller's replays, which put the model's buffers back between calls.
        self.checks_versions = True
        self._reset()

    def _reset(self) -> None:
        """The per-block state, empty: what a block has packed, its Philox key and next offset."""
        # The tensors packed in this block by identity, so a second save reuses the first's codes.
        self._packed: Dict[Tuple[Any, ...], Any] = {}
        # Storages of tensors kept as they are, each counted once in stats.
        self._raw_storages: Set[Tuple[str, int, int]] = set()
        # One key per block, drawn (at its first compression, as torch's own random ops draw
        # theirs) from the generator; each tensor takes the next stretch of counters, so tensors
        # and blocks draw independent numbers.
        self._seed: Optional[int] = None
        self._offset = 0
        # Bytes of floating tensors kept only because they do not require grad (compiled saves).
        self._constant_bytes = 0
        # The saves of the op saving now, not yet stored, and that op's rule once it is known.
        self._group: List[_Deferred] = []
        self._group_sequence: Optional[int] = None
        self._group_rule: Optional[Tuple[Any, _save_rules.Floors]] = None
        # That op's autograd node, once a save of its own output shows it.
        self._group_node: Any = None
        # Saves of the op before, not yet told, stored at the next op's end (_flush).
        self._waiting: List[_Deferred] = []
        # Set by the first unpack: a save after it is a rerun's (a reentrant checkpoint's).
        self._backward_begun = False
        # Where torch cannot say whether backward runs (1.13): set when a backward through this
        # block has ended, so that the next save is the next step's forward.
        self._backward_ended = False
        # True if the op saving now is fused attention whose output and logsumexp are recomputed.
        self._group_attention = False
        # Set while the block reads an autograd node's saves (_peek): unpack hands back what it gets.
        self._peeking: Optional[List[Any]] = None
        # bits_for calls in this block (their indices key `floors`).
        self._choices = 0
        # What cheap functions made in this block's forward (recompute=True; abp._derived).
        self._recorder: Optional[_derived.Recorder] = None

    def _choose(self, t: torch.Tensor) -> int:
        if self.bits_for is None:
            return self.bits
        self._choices += 1
        return _check_bits(self.bits_for(t), "bits_for(tensor)", raw=True)

    @staticmethod
    def _identity(t: torch.Tensor) -> Tuple[Any, ...]:
        return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)

    @staticmethod
    def _owner(t: torch.Tensor) -> torch.Tensor:
        """The tensor whose storage `t` lives in: its base for a view. Two saves with the same
        identity and the same live owner are the same memory, unchanged since (views share their
        base's version counter): a Linear given a 3-D input saves a new 2-D view of it, so the
        q, k and v projections of one input would otherwise be stored three times."""
        base = t._base
        return t if base is None else base

    def pack(self, t: torch.Tensor) -> Any:
        """The saved_tensors_hooks pack hook: a `_Deferred` for a tensor to compress, a `_Kept`
        for one kept as it is, or a CompressedTensor (a mask, or where ops are not told apart)."""
        if _compiling() or _without_data(t):
            # torch.compile tracing a model inside the block on a torch whose AOTAutograd does not
            # take saved-tensor hooks (2.4 and before): its fake tensors pass through the eager hooks.
            # So does a save dynamo traces itself, outside AOTAutograd's hook context (FSDP2 sharded
            # per layer under inductor, torch 2.15: traced, this hook's Python failed in the graph).
            return t
        if self._recorder is not None and type(t) in _PLAIN_TENSORS:
            # The recorder's torch function mode would see every tensor property this hook reads
            # (a Python call each, some 30 per save), although it records nothing while packing.
            with _NO_TORCH_FUNCTION():
                return self._pack_kept(t)
        return self._pack_kept(t)

    def _pack_kept(self, t: torch.Tensor) -> Any:
        packed = self._pack(t)
        return _Kept(packed) if packed is t else packed

    def _pack(self, t: torch.Tensor) -> Any:
        # A save once backward has begun, by a reentrant checkpoint rerunning its block: kept as
        # it is, as a non-reentrant checkpoint's rerun keeps its saves (torch's own hooks take
        # them). Its block's backward reads it at once: checkpointing's peak is one block's
        # tensors either way, and codes would add their error where the two kinds should agree
        # (a T5 under the controller at 2 bits: 2.24 reentrant, 1.91 non-reentrant and exact).
        if self._backward_begun and (_save_rules.outside_backward() or (
                self._backward_ended and not _save_rules.recomputing_checkpoint())):
            self._forward_again()
        if self._backward_begun and self.op_rules and _save_rules.recomputing_checkpoint():
            return t  # neither counted nor offered: a non-reentrant rerun's saves are not seen either
        sequence = _save_rules.sequence_number() if self.op_rules else None
        if (self._group or self._waiting) and t.grad_fn is not None:
            self._mark_region(t.grad_fn)  # this op may save the output of a kinked activation
        if sequence != self._group_sequence:
            self._flush(final=False)  # the previous op has saved all it saves
        self._group_sequence = sequence
        if sequence is not None and t.grad_fn is not None and self._group_rule is None \
                and t.grad_fn._sequence_nr() == sequence - 1:  # a save of the op saving now, by its node
            node = t.grad_fn
            self._group_node = node
            # Fused attention's output and logsumexp will be recomputed from the stored query,
            # key and value (_flush), unless that turns out impossible there.
            self._group_attention = self._recorder is not None and _save_rules.recomputable_attention(node)
            rule = _save_rules.rule_for(node, recomputed=self._group_attention, uniform=self.bits_for is None)
            if rule is not None or self._group_attention:
                self._group_rule = (node, rule or _save_rules.NO_FLOORS)
                for box in self._group:
                    self._raise_to_floor(box)
        # A checkpoint's inputs, told by the checkpoint on the stack (a short walk of frames on
        # every save: torch runs every pack hook with grad off, so that cannot tell them apart).
        if self.op_rules and _save_rules.saving_checkpoint_inputs():
            return self._keep_checkpoint_input(t)
        key = self._identity(t)
        seen = self._packed.get(key)
        # The same memory: a weak reference to its owner (memory freed and reused is another tensor).
        # Not what fused attention reads recomputed through a projection: for another op's save
        # it is stored (that op's backward may come when the projection's weight is gone).
        if seen is not None and seen[0]() is self._owner(t) and not _reads_projection(seen[1]):
            kept = seen[1]
            if isinstance(kept, _Deferred):
                self._raise_to_floor(kept)
                if kept.pending:
                    return kept  # its bytes are noted when it is stored
            memory.note_saved(_kept_tensors(kept) if kept is not None else [t])
            _derived.claim(kept)
            return kept if kept is not None else t
        result = self._result_of_input(t, sequence)
        if result is None:
            result = self._derive(t)
        if result is None:
            result = self._pack_new(t, sequence is not None)
        else:
            _derived.claim(result)
        if not (isinstance(result, _Deferred) and result.pending):
            memory.note_saved(_kept_tensors(result) if result is not t else [t])
        # Only what replaces the tensor is kept here; a tensor kept as is is remembered by identity.
        self._packed[key] = (weakref.ref(self._owner(t)), result if result is not t else None)
        return result

    def _forward_again(self) -> None:
        """A save after a backward, outside any backward: a block kept open over several steps
        runs its next forward. What the first backward switched off comes back on: the recorder
        records again (the tensors it makes are recomputed, not stored) and the guard watches
        the parameters this forward saves (what the last forward packed is not reused: its
        codes belong to that step's graph)."""
        self._backward_begun = self._backward_ended = False
        self._packed = {}
        if self._recorder is not None:
            self._recorder.recording = True
        if self.guard and self._guarded is None:
            self._guarded, self._guarded_half = {}, False

    def _saw_result(self, out: Any) -> None:
        """A result of the model's call (the recorder's, torch >= 2): a kinked activation's output
        tells the saves of its input, which are still pending (where nothing saves that output:
        a scale, a pooling after it)."""
        if self.op_rules and (self._group or self._waiting) and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            self._mark_region(out.grad_fn)

    def _mark_region(self, node: Any) -> None:
        """If `node` is a kinked activation's (_save_rules.region_of), the pending save it holds
        takes its interval, which it is then stored with (a bit per element beside the codes). The
        save is told by what it is, never by reading the node's saves (under a checkpoint's hooks
        that would run its recomputation): the node's result (an in-place form), else its input,
        or the copy of its input an in-place form saves."""
        region = _save_rules.region_of(node)
        if region is None:
            return
        result = _save_rules.saves_result(node)
        edge = node.next_functions[0] if node.next_functions else (None, 0)
        for box in (*self._group, *self._waiting):
            value = box.value
            if not box.pending or box.region is not None or not isinstance(value, torch.Tensor):
                continue
            made = value.grad_fn
            if result:
                found = made is node
            else:
                found = made is not None and ((made is edge[0] and value.output_nr == edge[1]) or (
                    type(made).__name__ == "CloneBackward0" and made.next_functions[:1] == (edge,)))
            if found:
                box.region = region

    def _keep_checkpoint_input(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, an activation checkpoint's input, kept as it is: backward reruns the block from it.
        Not the codes or the recomputation another op's save of it made (that save keeps them);
        counted as a saved tensor once, its storage once, its elements in numel_checkpointed."""
        key, owner = self._identity(t), self._owner(t)
        seen = self._packed.get(key)
        if _parameter_of(t) is None:
            if seen is None or seen[0]() is not owner:
                self._count_saved(t)
                self.stats["numel_checkpointed"] += t.numel()
                self._packed[key] = (weakref.ref(owner), None)
            self._store(t, 32)
        memory.note_saved([t])
        return t

    def _result_of_input(self, t: torch.Tensor, sequence: Optional[int]) -> Optional[_derived.Derived]:
        """`t` recomputed from what this block packed for its op's input, if `t` is the result of a
        reduction whose backward reads the two together (amax's ``self == result``, logsumexp's
        exp(self - result): _save_rules.result_from_input), saved by that reduction itself and
        unchanged since, counted as a new saved tensor; else None. Stored as it was, the result
        would not agree with a coded or recomputed input: amax's gradient would be NaN, logsumexp's
        weights would not sum to one. Recomputed, they agree whatever the input is stored as. The
        input is kept as it is where its op's rule reaches it (torch >= 2, an input this op saves
        first): then the gradient is exact; where an earlier op stored it (a ReLU's output) or it
        is recomputed, and on torch 1.13, it is the reduction's gradient at the decoded input."""
        node = t.grad_fn
        if node is None or t.output_nr != 0 or t._version != 0:
            return None
        if sequence is not None and node._sequence_nr() != sequence - 1:
            return None  # a later op's save of the result (the reduction's own comes with its node)
        reduction = _save_rules.result_from_input(node)
        if reduction is None:
            return None
        packed = self._peek(node, "_saved_self")
        if packed is None:
            return None
        # A tensor kept as it is stands for itself (stored for its own save: not counted again).
        use = _derived.Use(packed, packed._version if isinstance(packed, torch.Tensor) else None)
        recompute, dtype = reduction[0], t.dtype
        leaves, spec = _derived.flatten((use,))
        # In the result's dtype: a norm may compute in a wider one than its input's (dtype=, autocast).
        derived = _derived.Derived(lambda x: recompute(x).to(dtype), spec, leaves, None, None, tuple(t.shape), dtype)
        self._count_saved(t)
        self.stats["derived"] += 1
        self.stats["numel_derived"] += t.numel()
        return derived

    def _derive(self, t: torch.Tensor) -> Optional[_derived.Derived]:
        """`_derivation(t)`, counted as a new saved tensor."""
        derived = self._derivation(t)
        if derived is not None:
            self._count_saved(t)
            self._count_derived(t, derived, None)
        return derived

    def _derivation(self, t: torch.Tensor, projections: bool = False) -> Optional[_derived.Derived]:
        """A Derived for `t` if a cheap function made it (or a view of what one made, or of a
        packed tensor) from what this block can give back; None otherwise. `projections`: `t` is
        what recomputed fused attention reads as its query, key or value, which may be recomputed
        through a matrix product (abp._derived) if every parameter it reads is present."""
        recorder = self._recorder
        # What would be compressed. Not a per-row statistic (DERIVE_ROW_STATISTICS): recomputed
        # from a decoded row, a norm's 1/rms would carry the codes' variance as a bias (E[x̃²] =
        # x² + σ²; docs/compressed-training.md); kept as it is, it is exact.
        if recorder is None or t.dtype == torch.bool or not _compressible(t, self.min_numel, DERIVE_ROW_STATISTICS):
            return None
        if (self.filter is not None and not self.filter(t)) or _parameter_of(t) is not None:
            return None  # a parameter's view or cast (w.t()) is kept by its module anyway
        derived = recorder.derivation(t)
        if derived is None:
            # A view with its base's very geometry (what a custom autograd Function that returns
            # its input gives, FSDP2's hooks among them) is the base's memory under the same
            # identity: what was packed "for the base" is then this tensor itself.
            derived = self._view_derivation(t, packed=self._identity(t._base) != self._identity(t)
                                            if t._base is not None else False)
        if derived is None:
            return None
        # A matrix product only for attention's inputs (abp._derived); and only with every
        # parameter present, which a sharding wrapper may have freed after its module's forward.
        if (derived.reads_projection and not projections) or not _derived.parameters_present(derived):
            return None
        if derived.projection:
            _derived.accept_projections(derived)
        return derived

    def _view_derivation(self, t: torch.Tensor, packed: bool) -> Optional[_derived.Derived]:
        """`t` as a view of its dense base, if a cheap function made the base (or, with `packed`, the
        block stored it): how a view no recorded function made is recomputed (torch's own views
        are recorded; a custom autograd Function that returns its input makes one unseen)."""
        base = t._base
        if base is None or not _derived.dense(base):
            return None
        assert self._recorder is not None
        whole = self._recorder.derivation(base)
        if whole is None and packed:
            seen = self._packed.get(self._identity(base))
            if seen is not None and seen[0]() is self._owner(base) and seen[1] is not None \
                    and not _reads_projection(seen[1]):
                whole = seen[1]
        return None if whole is None else _derived.view_of(whole, base, t)

    def _count_saved(self, t: torch.Tensor) -> None:
        """`t` as a saved tensor in stats: once per distinct tensor, as it was given."""
        self.stats["tensors"] += 1
        self.stats["bytes_in"] += t.numel() * t.element_size()

    def _count_derived(self, t: torch.Tensor, derived: _derived.Derived, tags: Optional[memory.Tags]) -> None:
        self.stats["derived"] += 1
        self.stats["numel_derived"] += t.numel()
        # The constants it holds (the tensors it refers to are stored for their own saves).
        for use in _derived.uses_of(derived):
            value = use.value
            if use.version is not None and not use.parameter and isinstance(value, torch.Tensor) and not value.requires_grad:
                self._store(value, 32)
                memory.note_saved([value], tags)

    def _resolve(self, a: torch.Tensor, budget: int) -> Optional[_derived.Use]:
        """What a recomputed function's tensor argument `a` becomes (abp._derived.Recorder): a
        parameter, what this block packed for it, its own derivation, or (a constant of at most a
        quarter of the `budget` bytes the function makes) itself; None if none of these."""
        if _without_data(a):
            return None  # tracing's fake tensors (pack): nothing is recorded from them
        if _parameter_of(a) is not None:
            return _derived.Use(a, a._version, parameter=True)
        seen = self._packed.get(self._identity(a))
        if seen is not None and seen[0]() is self._owner(a):
            if _reads_projection(seen[1]):
                return None  # fused attention's own recomputed input: nothing else is made from it
            return _derived.Use(a, a._version) if seen[1] is None else _derived.Use(seen[1], None)
        assert self._recorder is not None
        # An argument no recorded function made may be an unseen view of what one made (a custom
        # autograd Function returning its input): recomputing goes on through it.
        derived = self._recorder.derivation(a)
        if derived is None and a.requires_grad:
            derived = self._view_derivation(a, packed=False)
        if derived is not None:
            return _derived.Use(derived, None)
        if not a.requires_grad and 4 * memory.storage_key(a)[2] <= budget:
            return _derived.Use(a, a._version)
        return None

    def _pack_new(self, t: torch.Tensor, defer: bool) -> Any:
        parameter = _parameter_of(t)
        if parameter is not None:
            if self.guard and self._guarded is not None:
                self._guarded.setdefault(id(parameter), parameter)
                self._guarded_half = self._guarded_half or t.dtype == torch.float16
            return t  # kept by its module anyway: neither compressed nor counted in stats
        self._count_saved(t)
        wanted = _compressible(t, self.min_numel) and (self.filter is None or bool(self.filter(t)))
        if not wanted and not t.requires_grad and t.dtype in _FLOAT_DTYPES and _marked_numel(t) is None:
            self._constant_bytes += t.numel() * t.element_size()
        if wanted and t.dtype == torch.bool:
            return self._count_compressed(_pack_mask(t))
        if self._group_attention and t.grad_fn is self._group_rule[0]:  # type: ignore[index]
            wanted = False  # fused attention's output, to be recomputed (_derive_attention): no width
        bits = self._choose(t) if wanted else 32
        # Recomputing, a floating tensor kept as it is waits for its op too: fused attention's
        # output and logsumexp are recomputed whatever their width (_derive_attention). So does
        # one a bits_for asked 32 for: its op's floor is reported (rule_floors) all the same.
        waits = self._recorder is not None or (self.bits_for is not None and wanted)
        if bits == 32 and not (defer and waits and t.dtype in _FLOAT_DTYPES):
            return self._store(t, bits)
        # Its bits_for call's index, if it had one (a tensor not offered keeps none: a rule's floor
        # on it must not land on the call before it).
        choice = self._choices - 1 if self.bits_for is not None and wanted else -1
        box = _Deferred(t, bits, choice, memory.current_tags())
        if not defer:  # ops are not told apart (torch 1.13): stored at once
            # The op saving it is unknown; a kinked activation's own saved result is told by its node.
            node = t.grad_fn
            region = _save_rules.region_of(node) if self.op_rules and node is not None \
                and _save_rules.saves_result(node) else None
            if region is not None and choice >= 0:
                self.region_choices.add(choice)
            box.value, box.pending = self._store(t, bits, region), False
            return box
        # Stored when the op saving it has saved everything (the next op's first save, the
        # block's end or backward's first read): by then the op's rule is known.
        self._group.append(box)
        self._raise_to_floor(box)
        return box

    def _peek(self, node: Any, name: Optional[str]) -> Any:
        """What this block packed for the save `name` of autograd node `node` (None if the node
        holds None there or `name` is None)."""
        if name is None:
            return None
        self._peeking = []
        try:
            getattr(node, name)
        finally:
            peeked, self._peeking = self._peeking, None
        return peeked[0] if peeked else None

    def _derive_attention(self, node: Any, group: List[_Deferred]) -> Optional[List[Any]]:
        """Makes the output and logsumexp that fused attention (`node`) saved, pending in `group`,
        Derived: the same kernel run again on the decoded query, key and value (and its mask), so
        that backward reads an output and a logsumexp consistent with them. Returns what that
        kernel reads (what was packed for q, k, v and the mask); None if they cannot be derived
        (then nothing changed)."""
        kernel, names = _save_rules.attention_kernel(node)
        q, k, v, mask, out, lse = (self._peek(node, name) for name in names)
        if any(x is None for x in (q, k, v, out, lse)) or not all(any(x is box for box in group) for x in (out, lse)):
            return None
        uses = []
        for x in (q, k, v, mask):
            if x is None or isinstance(x, torch.Tensor) and _parameter_of(x) is not None:
                uses.append(None if x is None else _derived.Use(x, x._version, parameter=True))
            else:
                uses.append(_derived.Use(x, x._version if isinstance(x, torch.Tensor) else None))
        q_use, k_use, v_use, mask_use = uses
        leaves, spec = _derived.flatten((q_use, k_use, v_use, mask_use, float(node._saved_dropout_p),
                                         bool(node._saved_is_causal), node._saved_scale))
        shared = _derived.Shared(2)
        for index, box in enumerate((out, lse)):
            t = box.value
            box.value = _derived.Derived(kernel, spec, leaves, index, None, tuple(t.shape), t.dtype, shared)
            box.pending = False
            if index == 0:
                self.stats["derived"] += 1
                self.stats["numel_derived"] += t.numel()
        return [x for x in (q, k, v, mask) if x is not None]

    def _raise_to_floor(self, box: "_Deferred") -> None:
        """Raises a pending tensor's width to the floor of the op saving it, if that op is known."""
        if self._group_rule is None or not box.pending:  # pending: in the current op's group
            return
        node, rule = self._group_rule
        floor = _save_rules.floor_of(box.value, node, rule)
        if floor is not None and box.choice >= 0:
            self.rule_floors[box.choice] = max(self.rule_floors.get(box.choice, 0), floor)
        if floor is not None and box.bits != 32 and box.bits < floor:
            box.bits = floor
            if box.choice >= 0:
                self.floors[box.choice] = floor
        if floor == _save_rules.KEPT_BITS:
            box.exact = True

    def _store(self, t: torch.Tensor, bits: int, region: Optional[_save_rules.Region] = None) -> Any:
        """`t` at `bits` (32: as it is), counted in stats; codes keep `region` (where `t` lies in
        the interval a kinked activation's backward tests it against) exactly, a bit per element."""
        if bits == 32:
            # A tensor kept as it is costs its storage, once however many views of it are saved.
            storage = memory.storage_key(t)
            if storage not in self._raw_storages:
                self._raw_storages.add(storage)
                self.stats["bytes_stored"] += storage[2]
            return t
        layout = code_layout(t.shape, t.dtype, bits, self.group_size)
        if layout is None:
            return self._store(t, 32)
        group, padded = layout
        if self._seed is None:
            self._seed = draw_seed(self.generator)
        logs = t.grad_fn is not None and type(t.grad_fn).__name__ in _LOG_PROBABILITY_PRODUCERS
        c = quantize_unchecked(t.detach().exp() if logs else t, bits, group, self._seed, self._offset, padded)
        c.logs = logs
        if self.exact_relu and keeps_support(t):
            c.support = _pack_mask(t > 0)
        elif region is not None and t.is_floating_point():
            c.support, c.region = _pack_mask(region.inside(t)), region
        # Stretches start on multiples of 8, where the kernels draw four elements per Philox call.
        self._offset += (c.coded_numel + 7) // 8 * 8
        return self._count_compressed(c)

    def _count_compressed(self, c: CompressedTensor) -> CompressedTensor:
        self.stats["compressed"] += 1
        self.stats["bytes_compressed"] += c.nbytes
        self.stats["bytes_stored"] += c.nbytes
        return c

    def _flush(self, final: bool = True) -> None:
        """Stores the pending tensors of the last op, in the order it saved them. Not `final` (the
        next op's first save): without the recorder, the saves of an op not yet told wait for the
        next op's saves, one of which may be that op's output and tell a kinked activation
        (_mark_region); those of the op before are stored now."""
        waiting, self._waiting = self._waiting, []
        for box in waiting:
            if box.pending:
                self._store_box(box, None)
        group, rule = self._group, self._group_rule
        # A kinked activation's own output (an in-place one's: its backward reads its result).
        node = rule[0] if rule is not None else self._group_node
        region = _save_rules.region_of(node) if node is not None and _save_rules.saves_result(node) else None
        self._group_node = None
        attention_reads = self._derive_attention(rule[0], group) if self._group_attention and rule is not None else None
        if self._group_attention and attention_reads is None:
            # Recomputing was planned and turned out impossible: the stored rule's floors.
            assert rule is not None
            self._group_rule = (rule[0], _save_rules.rule_for(rule[0], uniform=self.bits_for is None))
            for box in group:
                self._raise_to_floor(box)
        self._group, self._group_attention, self._group_rule = [], False, None
        # Recomputed attention's query, key and value may be recomputed through their projections.
        projections = attention_reads is not None and self._recorder is not None and self._recorder.projections
        for box in group:
            if not box.pending:  # made Derived above
                continue
            # An op's own output (rsqrt's, a norm's) is saved before its function returns, and
            # only now can its derivation be known.
            derived = self._derivation(box.value, projections) if self._recorder is not None and not box.exact else None
            if derived is not None:
                self._count_derived(box.value, derived, box.tags)
                _derived.claim(derived)  # its op's read (a later save of it claims its own)
                if box.choice >= 0:
                    self.derived_choices.add(box.choice)
                box.value, box.pending = derived, False
                continue
            if not final and region is None and self._recorder is None and self.op_rules and box.region is None:
                self._waiting.append(box)
                continue
            self._store_box(box, region if region is not None and box.value.grad_fn is node else None)
        if attention_reads:
            _derived.claim(*attention_reads)  # the recomputed attention's own read of its inputs

    def _store_box(self, box: _Deferred, own: Optional[_save_rules.Region]) -> None:
        """Stores a pending save at its width, with the interval a kinked activation tests it
        against (the one that saved it as its input, `box.region`; or as its own result, `own`)."""
        box.modified = box.value._version != box.version
        region = box.region or own
        if region is not None and box.choice >= 0:
            self.region_choices.add(box.choice)  # at every width: a controller's budget counts the bit
        stored = self._store(box.value, box.bits, region)
        box.value = memory.without_node(stored) if isinstance(stored, torch.Tensor) else stored
        box.pending = False
        memory.note_saved(_kept_tensors(box.value), box.tags)

    def unpack(self, saved: Any, memo: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
        """The saved_tensors_hooks unpack hook; `memo`: what this unpack has recomputed so far
        (Derived.materialize), when it decodes the stored values a recomputation reads."""
        if isinstance(saved, _Kept):
            if self._peeking is None and self.checks_versions and saved.value._version != saved.version:
                raise _modified_error(saved.version, saved.value._version)
            saved = saved.value
        if self._peeking is not None:
            self._peeking.append(saved)
            return _NOTHING
        if not self._backward_begun and _save_rules.cannot_tell_backward():
            _guard.after_backward(self._note_backward_ended)
        self._backward_begun = True
        if self._recorder is not None and self._recorder.recording:
            self._recorder.recording = False  # backward has begun: nothing more is recorded
            self._recorder.clear()
        if self._guarded:
            # Backward has begun: check the gradients of the parameters the block saw when it ends.
            parameters, self._guarded = list(self._guarded.values()), None
            half = self._guarded_half
            _guard.after_backward(lambda: self._check_gradients(parameters, half))
        if isinstance(saved, _Deferred):
            if saved.pending:
                self._flush()  # backward has begun: the forward's last op saved all it saves
            if saved.modified:
                raise _modified_error(saved.version)
            # Stored as it is, it may still change before backward reads it.
            if self.checks_versions and isinstance(saved.value, torch.Tensor) and saved.value._version != saved.version:
                raise _modified_error(saved.version, saved.value._version)
            saved = saved.value
        if isinstance(saved, _derived.Derived):
            return saved.materialize(self.unpack, memo)
        return dequantize(saved) if isinstance(saved, CompressedTensor) else saved

    def _note_backward_ended(self) -> None:
        self._backward_ended = True

    def _check_gradients(self, parameters: List[torch.Tensor], half: bool = False) -> None:
        widest = self.bits_for is None and self.bits == 8
        _guard.check_after_backward(parameters, half,
                                    lambda reason: _guard.alarm(self.guard, self.label, reason, widest=widest))

    def __enter__(self) -> "compress_saved":
        if self._hooks is not None:
            raise RuntimeError("compress_saved: this block is already open (a `with` block of the same object "
                               "cannot be entered again before it exits)")
        outer = open_block()
        inert = torch.is_grad_enabled() and _save_rules.inside_checkpoint_hooks()
        if outer is not None and not inert:
            # saved_tensors_hooks nest with the innermost winning: the outer block would see nothing
            # and its stats, guard and (a controller's) allocation would silently be void.
            raise RuntimeError(
                f"{self.label}: opened inside {outer.label}, whose block is still open; the inner block would take "
                "every saved tensor and the outer one see none. Use one block (abp.convert's compress and all "
                "recipes open one in the model's forward: do not wrap such a model in another)")
        self.stats = {"tensors": 0, "compressed": 0, "bytes_in": 0, "bytes_stored": 0, "bytes_compressed": 0,
                      "derived": 0, "numel_derived": 0, "numel_checkpointed": 0}
        self._reset()
        self.floors, self.rule_floors = {}, {}
        self.derived_choices, self.region_choices = set(), set()
        self._guarded = {} if self.guard and not inert else None  # id → parameter, until backward reads the first save
        self._guarded_half = False
        self._outer = None
        if inert:
            # Inside a non-reentrant checkpoint (its forward or its recomputation) hooks of this
            # block would take every save from the checkpoint's. With grad off (a reentrant
            # checkpoint's forward) nothing is saved, and this is no concern.
            _warn_once("checkpoint", f"{self.label} is opened inside a non-reentrant activation checkpoint (its forward "
                       "or its recomputation in backward): it compresses nothing there, so that the checkpoint keeps "
                       "only its inputs and recomputes the rest. To compress what the checkpoint keeps, open the block "
                       "around the checkpointed call (a model converted with recipe compress or all, checkpointed "
                       "inside, does so)")
            self._hooks = contextlib.nullcontext()
            self._hooks.__enter__()
            self._outer, _OPEN.block = outer, self  # an outer block (around the checkpoint) is open again after
            return self
        if _compiling():
            _warn_once("traced", f"{self.label} is entered inside code torch.compile traces: the compiled graph "
                       "saves its tensors without these hooks, so nothing is compressed. Open the block around "
                       "the compiled call (abp.convert's compress recipe does so itself)")
        if self.compiles():
            # GraphModule hooks: AOTAutograd inlines them into compiled graphs; eager saves reach self.pack.
            from . import _compiled_saves

            pair = _compiled_saves.hooks(self.bits, self.group_size, self.min_numel, self.op_rules, self.exact_relu)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(*pair)
        else:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        if self.recompute and _derived.AVAILABLE and not _compiling():
            recorder = _derived.Recorder(self._resolve, projections=self.bits_for is not None)
            recorder.watch = self._saw_result
            recorder.__enter__()
            self._recorder = recorder
        _OPEN.block = self
        return self

    def compiles(self) -> bool:
        """True if graphs torch.compile builds inside this block compress their saves too: a
        uniform width (no bits_for, no filter) on a torch whose AOTAutograd inlines saved-tensor
        hooks (abp._compiled_saves), once torch._dynamo is loaded (before, nothing has been
        compiled); otherwise they save as they would without the block."""
        from . import _compiled_saves

        return self.bits_for is None and self.filter is None and _compiled_saves.in_use()

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is None:
            raise RuntimeError(f"{self.label}: exited, but this block is not open (exited twice, or never entered)")
        _OPEN.block, self._outer = self._outer, None
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.clear()
            recorder.__exit__(*exc)
        hooks.__exit__(*exc)
        self._flush()
        failed = bool(exc) and exc[0] is not None  # the block's own error says what went wrong
        if not failed and self.explains_constants and not self.stats["compressed"] and self._constant_bytes and \
                self._constant_bytes * 2 >= self.stats["bytes_in"]:
            _warn_once("constants", f"{self.label} saw {self.stats['tensors']} saved tensors and compressed none: most "
                       "were floating tensors that do not require grad, which it keeps as they are, as constants of "
                       "backward (masks, tables). Activations look so too where no gradient reaches them: the input "
                       "of a trainable layer after frozen ones (a linear probe), or what a torch.compile'd model "
                       "saves (detached from autograd: a uniform-width block compresses compiled graphs itself, a "
                       "block with bits_for or filter, the controller's, does not; docs/python.md, torch.compile)")
        self._reset()  # the graph keeps what it saved; this block holds nothing after it
