"""Independent references for the abp pytest suite: torch's exact activations, the bucket rule, ulps,
and the toy pre-LN block several suites train."""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import abp

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# FewBit continuous activations: torch's exact forward at the default parameters.
CONTINUOUS_TORCH: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "silu": F.silu,
    "celu": F.celu,
    "elu": F.elu,
    "hardswish": F.hardswish,
    "logsigmoid": F.logsigmoid,
    "mish": F.mish,
    "selu": F.selu,
    "sigmoid": torch.sigmoid,
    "softplus": F.softplus,
    "softsign": F.softsign,
    "tanh": torch.tanh,
    "tanhshrink": F.tanhshrink,
}

# Piecewise-linear activations: (operator, params, torch forward with those params).
PIECEWISE_CASES: List[Tuple[str, Tuple[float, ...], Callable[[torch.Tensor], torch.Tensor]]] = [
    ("relu", (), F.relu),
    ("relu6", (), F.relu6),
    ("hardsigmoid", (), F.hardsigmoid),
    ("leaky_relu", (0.01,), lambda x: F.leaky_relu(x, 0.01)),
    ("leaky_relu", (0.2,), lambda x: F.leaky_relu(x, 0.2)),
    ("threshold", (0.5, -2.0), lambda x: F.threshold(x, 0.5, -2.0)),
    ("threshold", (-1.0, 3.0), lambda x: F.threshold(x, -1.0, 3.0)),
    ("hardtanh", (-1.0, 1.0), F.hardtanh),
    ("hardtanh", (-0.5, 2.0), lambda x: F.hardtanh(x, -0.5, 2.0)),
    ("hardshrink", (0.5,), F.hardshrink),
    ("hardshrink", (1.3,), lambda x: F.hardshrink(x, 1.3)),
    ("softshrink", (0.5,), F.softshrink),
    ("softshrink", (0.3,), lambda x: F.softshrink(x, 0.3)),
]

# The breakpoints of each piecewise operator, for the tests at and around them.
def piecewise_breakpoints(op: str, params: Tuple[float, ...]) -> List[float]:
    if op in ("relu", "leaky_relu"):
        return [0.0]
    if op == "relu6":
        return [0.0, 6.0]
    if op == "hardsigmoid":
        return [-3.0, 3.0]
    if op == "threshold":
        return [params[0]]
    if op == "hardtanh":
        return [params[0], params[1]]
    return [-params[0], params[0]]  # hardshrink, softshrink


# ReGELU2 / ReSiLU2 (docs/algorithms.md §4): c1..c3 and L0..L3, rounded to fp32 by the kernels.
REGELU2_BORDERS = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
REGELU2_LEVELS = (0.0, -0.04922261145617846, 1.0487405950855513, 1.0)
RESILU2_BORDERS = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)
RESILU2_LEVELS = (0.0, -0.04060357190528599, 1.0403218566243821, 1.0)

BUCKET_TORCH: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"regelu2": F.gelu, "resilu2": F.silu}
BUCKET_DOC_TABLES = {
    "regelu2": (REGELU2_BORDERS, REGELU2_LEVELS),
    "resilu2": (RESILU2_BORDERS, RESILU2_LEVELS),
}


def fewbit_ops() -> List[Tuple[str, str, int, str]]:
    """(operator, activation, bits, weight) of every FewBit operator."""
    out = []
    for act in CONTINUOUS_TORCH:
        for bits in (1, 2, 3, 4):
            for weight in ("normal", "uniform"):
                out.append((abp.functional.fewbit_operator(act, bits, weight), act, bits, weight))
    return out


def library_or_skip() -> None:
    """Skips when no native library was built and none was named (ABP_LIBRARY unset); fails otherwise."""
    try:
        abp.operators()
    except abp.AbpError as e:
        if os.environ.get("ABP_LIBRARY"):
            raise
        pytest.skip(f"abp native library not available (build it, or set ABP_LIBRARY): {e}")


def built_lane() -> Any:
    """The C++ lane's module (abp._plan_lane); fails where it is not built (scripts/test installs
    what building it needs)."""
    from abp import _plan_lane

    lane = _plan_lane.module()
    assert lane is not None, _plan_lane.status()
    return lane


def library_on_one_thread() -> Iterator[None]:
    """The body of an autouse fixture: the library (else skip), and torch on one thread while the
    test runs. Tiny tensors gain nothing from a second thread, and on a 2-core machine busy with
    other work every parallel region waits for a descheduled OpenMP thread (test_checkpointing.py:
    38 s against 5 s)."""
    library_or_skip()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def compiler_or_skip() -> None:
    """Skips where the run-time IR compiler (libabp_compiler.so, linked against LLVM/MLIR) was not
    carried along, e.g. on a GPU machine that only has the MLIR-free runtime; CI builds it, so
    there the tests run."""
    path = os.environ.get("ABP_COMPILER_LIBRARY") or os.path.join(
        os.path.dirname(os.environ.get("ABP_LIBRARY", "")), "libabp_compiler.so")
    if os.environ.get("ABP_LIBRARY") and not os.path.exists(path):
        pytest.skip(f"the IR compiler library {path} is not here (built with MLIR; not carried)")


@functools.lru_cache(maxsize=None)
def manifest_table(op: str) -> Tuple[List[float], List[float]]:
    """The first table of `op` as written in its manifest file (read directly, not via the registry)."""
    info = abp.inspect(op)
    manifest = json.loads(Path(info["manifest_path"]).read_text())
    record = next(o for o in manifest["operators"] if o["name"] == op)
    table = record["tables"][0]
    return [float(b) for b in table["borders"]], [float(v) for v in table["levels"]]


def f32(values: Sequence[float]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32)


def bucket_codes(x: torch.Tensor, borders: torch.Tensor) -> torch.Tensor:
    """code(x) = #{i : borders[i] < x} in fp32 (NaN compares false: code 0; +inf: top; -inf: 0)."""
    xf = x.float().reshape(-1, 1)
    return (xf > borders.reshape(1, -1)).sum(dim=1).reshape(x.shape)


def bucket_backward(x: torch.Tensor, dy: torch.Tensor, borders: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """dx = levels[code(x)] * dy, computed in fp32 and rounded to dy's dtype."""
    code = bucket_codes(x, borders)
    return (levels[code] * dy.float()).to(dy.dtype)


def torch_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """torch autograd's input gradient of fn at x (fp32) for output gradient dy."""
    xr = x.detach().float().requires_grad_()
    y = fn(xr)
    (dx,) = torch.autograd.grad(y, xr, dy.float())
    return dx


_MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_MIN_SUBNORMAL_EXP = {torch.float32: -149, torch.float16: -24, torch.bfloat16: -133}


def ulp(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The spacing of `dtype` (default t's) at |t|, as float32, for finite t (subnormals included)."""
    dtype = dtype or t.dtype
    _, exponent = torch.frexp(t.float().abs())  # |t| = m * 2^e, m in [0.5, 1)
    power = (exponent - 1 - _MANTISSA_BITS[dtype]).clamp_min(_MIN_SUBNORMAL_EXP[dtype])
    power = torch.where(t == 0, torch.full_like(power, _MIN_SUBNORMAL_EXP[dtype]), power)
    return torch.pow(2.0, power.float())


def assert_forward_close(actual: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, exact: bool) -> None:
    """abp's forward vs torch's result `expected` (rounded to actual's dtype).

    Piecewise (`exact`): equal, NaNs in the same places (`expected` is torch's fp32 result).
    Transcendental: `expected` is torch's op in fp64, the reference METHOD.md asks for: torch's own
    fp32 kernels differ between versions and devices by more than abp does from the truth (torch
    2.11's fp32 GELU is 6e-7 off at x = -3.79). Within 2 ulp of it in fp32 (1 ulp of the dtype for
    fp16/bf16), plus 2^-23 * max(1, |x|): the erf form loses relative precision where
    1 + erf(x/sqrt 2) cancels, so ulps of a tiny result carry no meaning there.
    """
    assert actual.dtype == x.dtype and actual.shape == x.shape
    a, e = actual.float(), expected.to(actual.dtype).float()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"NaN mismatch at x={x[nan_a != nan_e][:8].tolist()}"
    finite = ~nan_e
    a, e, xf = a[finite], e[finite], x.float()[finite]
    if exact:
        bad = a != e
        assert not bad.any(), f"forward differs at x={xf[bad][:8].tolist()}: {a[bad][:8].tolist()} vs {e[bad][:8].tolist()}"
        return
    inf = torch.isinf(e)
    assert torch.equal(a[inf], e[inf]), "forward differs where torch returns +-inf"
    a, e, xf = a[~inf], e[~inf], xf[~inf]
    steps = 2.0 if actual.dtype == torch.float32 else 1.0
    tol = steps * ulp(e, actual.dtype) + 2.0**-23 * xf.abs().clamp_min(1.0)
    diff = (a - e).abs()
    bad = diff > tol
    assert not bad.any(), (
        f"forward differs beyond tolerance at x={xf[bad][:8].tolist()}: abp {a[bad][:8].tolist()} "
        f"torch {e[bad][:8].tolist()}"
    )


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal bit patterns (NaN payloads aside: NaN == NaN)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, expected.dtype)
    a, e = actual.float(), expected.float()
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    # -0.0 == 0.0 numerically; compare signs of zeros too.
    same &= (torch.signbit(a) == torch.signbit(e)) | torch.isnan(a)
    if not same.all():
        idx = (~same).nonzero().flatten()[:8]
        raise AssertionError(f"{what}: differ at {idx.tolist()}: {a.flatten()[idx].tolist()} vs {e.flatten()[idx].tolist()}")


def sample_inputs(n: int, dtype: torch.dtype, extra: Optional[Sequence[float]] = None, seed: int = 0) -> torch.Tensor:
    """n normal(0, 3) values plus `extra` points, in `dtype` (generated in fp32, then rounded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3.0
    if extra:
        x = torch.cat([x, f32(extra)])
    return x.to(dtype)


def packed(bits: int, n: int) -> int:
    """ceil(bits * n / 8): the bytes of n packed codes (docs/algorithms.md §2.6)."""
    return (bits * n + 7) // 8


def unpack_codes(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Decodes n codes of an LSB-first bit stream (docs/algorithms.md §2.6), written out independently:
    v = byte[floor(b*e/8)] >> sh with sh = b*e mod 8; if sh + b > 8, v |= byte[next] << (8 - sh)."""
    stream = data.to(torch.int64)
    e = torch.arange(n, dtype=torch.int64)
    start = bits * e
    index, shift = start // 8, start % 8
    v = stream[index] >> shift
    straddles = shift + bits > 8
    following = stream[(index + 1).clamp_max(max(stream.numel() - 1, 0))] << (8 - shift)
    v = torch.where(straddles, v | following, v)
    return v & ((1 << bits) - 1)


def tail_bits_are_zero(data: torch.Tensor, bits: int, n: int) -> bool:
    """True if the stream bits past the last code (in the last byte) are zero."""
    used = (bits * n) % 8
    return used == 0 or int(data[-1]) >> used == 0


class _FromArray(torch.autograd.Function):
    """A non-leaf tensor whose storage is a numpy array, so a weakref tells when that storage dies."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, array: np.ndarray) -> torch.Tensor:  # type: ignore[override]
        return torch.from_numpy(array)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.sum(), None


def retains_input(fn: Callable[[torch.Tensor], torch.Tensor], shape=(64, 4096), view=lambda t: t) -> bool:
    """True if the graph of ``fn(x)`` keeps x's storage alive after the caller drops x.

    x is a non-leaf (so no AccumulateGrad node holds it) backed by a numpy array; with x and the array
    dropped, the array survives only if something the forward left behind (ctx, saved tensors, a
    closure) references x or its storage. Backward must still run afterwards.
    """
    array = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    alive = weakref.ref(array)
    w = torch.zeros((), requires_grad=True)
    x = view(_FromArray.apply(w, array))
    del array
    y = fn(x)
    del x
    gc.collect()
    retained = alive() is not None
    y.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad)
    return retained


class MlpBlock(nn.Module):
    """x + fc2(GELU(fc1(LayerNorm(x)))): a pre-LN residual MLP block (3 convertible modules:
    the norm, the GELU, and with the next block's norm a stack for convert's block roles)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


#: The launch dtypes of the per-call lanes' tests (test_eager, test_plan_lane).
PLAN_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaN included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def plan_served(dtype: torch.dtype, inputs: int = 1) -> List[str]:
    """The operators of `inputs` inputs (1: one-input operators, which OperatorFunction's lane
    takes; more: a dense input and per-column ones, the affine norms') that abp._eager's per-call
    plans serve at launch dtype `dtype`, by name."""
    from abp import _eager, _launch, _lib
    library_or_skip()
    return [name for name, op in sorted(_lib.kernel_library().operators.items())
            if op.inputs == inputs and _launch.DTYPE_NAMES[dtype] in op.dtypes and _eager.plan(op, dtype) is not None]


def _sequences(seed: int, length: int) -> torch.Tensor:
    """A batch of noisy arithmetic sequences mod 100: a task a tiny model learns in 30 steps."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, 100, (4, 1), generator=g), torch.randint(1, 4, (4, 1), generator=g)
    ids = (start + stride * torch.arange(length)) % 100
    return torch.where(torch.rand(4, length, generator=g) < 0.1, torch.randint(0, 100, (4, length), generator=g), ids)


def train_tiny_llama(controller: bool, checkpointed: bool = False, lengths: Sequence[int] = (32,)) -> float:
    """Mean loss of the last 5 of 30 AdamW steps of bench/model_zoo's test-size LLaMA (4 batches
    cycled, batch i of length lengths[i % len(lengths)]), exact or under the controller at 2 bits,
    with transformers' non-reentrant checkpointing if `checkpointed`."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import model_zoo

    torch.manual_seed(0)
    model, _ = model_zoo.build("llama")
    model.train()
    if checkpointed:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        kwargs = "activation_checkpointing_kwargs" if enable.__name__.startswith("activation") else "gradient_checkpointing_kwargs"
        enable(**{kwargs: {"use_reentrant": False}})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctrl = abp.CompressionController(model, avg_bits=2, interval=10) if controller else None
    batches, losses = [_sequences(i, lengths[i % len(lengths)]) for i in range(4)], []
    for step in range(30):
        optimizer.zero_grad(set_to_none=True)
        ids = batches[step % 4]
        with ctrl if ctrl is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses[-5:]) / 5
