"""MS-LayerNorm / MS-RMSNorm (docs/algorithms.md §5): exact forward and backward, shared saved output.

Tolerances: fp64 runs the kernels' fp64 specialisation and must match torch's autograd of the exact
norm to 1e-10 (docs/algorithms.md §9.3). eps is an fp32 kernel parameter (like every operator parameter),
so the reference uses eps rounded to fp32: with a nearly constant row, 1e-5 vs its fp32 rounding
alone would move the gradient by ~1e-9. fp32 is checked to a few ulp of the row's scale, fp16/bf16
to their storage precision.
"""
from __future__ import annotations

import math
from typing import Callable, Tuple

import pytest
import torch
import torch.nn.functional as F

import abp
from abp_reference import compiler_or_skip, library_or_skip


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def layer_norm_ref(x: torch.Tensor, shape: Tuple[int, ...], eps: float) -> torch.Tensor:
    return F.layer_norm(x, shape, eps=f32(eps))


def rms_norm_ref(x: torch.Tensor, shape: Tuple[int, ...], eps: float) -> torch.Tensor:
    dims = tuple(range(-len(shape), 0))
    return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + f32(eps))


NORMS = [
    ("layer", abp.functional.ms_layer_norm, layer_norm_ref, 1e-5),
    ("rms", abp.functional.ms_rms_norm, rms_norm_ref, 1e-6),
]
# Columns: 1, odd tails, exactly one chunk, warp mode (<= 1024) and block mode (> 1024, partial
# vectors, rows whose starts are not 16-byte aligned).
COLS = [1, 2, 7, 8, 9, 33, 255, 256, 257, 768, 1024, 1025, 3001, 8192]


def _grads(y: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    (dx,) = torch.autograd.grad(y, x, g)
    return dx


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("name,fn,ref,eps", NORMS)
def test_fp64_forward_and_backward_equal_the_exact_norm(name, fn, ref, eps, cols):
    gen = torch.Generator().manual_seed(cols)
    rows = 5
    x = (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 3 + 1).requires_grad_()
    g = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    y = fn(x, cols, eps)
    y_ref = ref(x, (cols,), eps)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(_grads(y, x, g), _grads(y_ref, x, g), rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("name,fn,ref,eps", NORMS)
@pytest.mark.parametrize("cols", [7, 768, 1025, 4096])
def test_low_precision_matches_fp64_reference_to_storage_precision(name, fn, ref, eps, dtype, atol, cols):
    gen = torch.Generator().manual_seed(100 + cols)
    x64 = torch.randn(9, cols, generator=gen, dtype=torch.float64)
    g64 = torch.randn(9, cols, generator=gen, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    y = fn(x, cols, eps)
    assert y.dtype == dtype and y.shape == x.shape
    # The reference sees the same rounded input, in fp64.
    xr = x.detach().double().requires_grad_()
    y_ref = ref(xr, (cols,), eps)
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=atol * 4)
    g = g64.to(dtype)
    dx = _grads(y, x, g)
    assert dx.dtype == dtype
    dx_ref = _grads(y_ref, xr, g.double())
    torch.testing.assert_close(dx.double(), dx_ref, rtol=atol * 4, atol=atol * 4)


@pytest.mark.parametrize("name,fn,ref,eps", NORMS)
def test_multi_dimensional_normalized_shape_and_leading_dims(name, fn, ref, eps):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    y = fn(x, (4, 5), eps)
    y_ref = ref(x, (4, 5), eps)
    assert y.shape == x.shape
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(_grads(y, x, g), _grads(y_ref, x, g), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name,fn,ref,eps", NORMS)
def test_non_contiguous_input(name, fn, ref, eps):
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(300, 6, generator=gen, dtype=torch.float64)
    x = base.t().requires_grad_()  # (6, 300), column-major
    assert not x.is_contiguous()
    g = torch.randn(6, 300, generator=gen, dtype=torch.float64)
    y = fn(x, 300, eps)
    y_ref = ref(x, (300,), eps)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(_grads(y, x, g), _grads(y_ref, x, g), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name,fn,ref,eps", NORMS)
def test_saves_only_its_output_and_one_fp32_value_per_row(name, fn, ref, eps):
    x = torch.randn(4, 7, 96, requires_grad=True)
    with abp.memory.SavedTensorsCounter() as counter:
        y = fn(x, 96, eps)
    key = abp.memory.storage_key(y)
    saved_keys = [(s.device, s.storage_ptr, s.storage_bytes) for s in counter.tensors]
    assert key in saved_keys, "the saved output must be the returned tensor's own storage"
    rows = 4 * 7
    assert counter.total_bytes == y.numel() * 4 + rows * 4
    # Nothing of the input's storage is kept.
    assert abp.memory.storage_key(x) not in saved_keys
    y.sum().backward()


@pytest.mark.parametrize("name,fn,ref,eps", NORMS)
def test_a_following_linear_saves_the_identical_tensor(name, fn, ref, eps):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)
    exact = torch.nn.LayerNorm(64, elementwise_affine=False, eps=eps) if name == "layer" else None

    with abp.memory.SavedTensorsCounter() as shared:
        lin(fn(x, 64, eps)).sum().backward()
    # Output y (8*64*4) once for both, the per-row value (8*4) and the Linear's weight (saved for
    # grad_input). The exact LayerNorm adds its input and its mean on top.
    assert shared.total_bytes == 8 * 64 * 4 + 8 * 4 + lin.weight.numel() * 4
    if exact is not None:
        with abp.memory.SavedTensorsCounter() as baseline:
            lin(exact(x)).sum().backward()
        assert baseline.total_bytes - shared.total_bytes == 8 * 64 * 4 + 8 * 4


@pytest.mark.parametrize("name,fn,ref,eps", NORMS)
def test_under_cpu_autocast_the_linear_saves_the_norm_output_itself(name, fn, ref, eps):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 16)
    x = torch.randn(8, 64, requires_grad=True)
    with abp.memory.SavedTensorsCounter() as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x, 64, eps)
            out = lin(y)
    assert y.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    y_key = abp.memory.storage_key(y)
    # Every saved tensor shaped like y is y itself: no second, cast copy is kept.
    like_y = [s for s in counter.tensors if s.shape == tuple(y.shape)]
    assert like_y and all((s.device, s.storage_ptr, s.storage_bytes) == y_key for s in like_y)
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    # The gradient is the exact one up to bf16 rounding of y and of the incoming gradient.
    xr = x.detach().double().requires_grad_()
    y_ref = ref(xr, (64,), eps)
    gy = torch.ones(8, 16, dtype=torch.float64) @ lin.weight.detach().to(torch.bfloat16).double()
    (dx_ref,) = torch.autograd.grad(y_ref, xr, gy)
    torch.testing.assert_close(x.grad.double(), dx_ref, rtol=5e-2, atol=5e-2)


def test_nan_stays_in_its_row_and_zero_rows_are_finite():
    x = torch.randn(4, 40, dtype=torch.float64)
    x[1, 3] = math.nan
    x[2] = 0.0
    for fn, eps in ((abp.functional.ms_layer_norm, 1e-5), (abp.functional.ms_rms_norm, 1e-6)):
        y = fn(x, 40, eps)
        assert torch.isnan(y[1]).all()
        assert torch.isfinite(y[[0, 2, 3]]).all()
        assert (y[2] == 0).all()


def test_zero_rows_per_row_statistic_is_eps_to_the_minus_half():
    from abp import _launch, _lib

    for name in ("ms_layernorm", "ms_rmsnorm"):
        op = _lib.kernel_library().operator(name)
        assert [r.kind for r in op.residuals] == ["shared", "rows"] and op.saved_bits_per_row == 32
        for dtype in (torch.float32, torch.float64):
            x = torch.zeros(3, 16, dtype=dtype)
            (y,), (shared, r) = _launch.forward(op, [x], [1e-4])
            assert shared is y and (y == 0).all()
            assert r.shape == (3,) and r.dtype == dtype
            # 1/sqrt(0 + eps) with eps the fp32 parameter, computed in the compute type.
            want = 1.0 / torch.sqrt(torch.tensor(f32(1e-4), dtype=dtype))
            assert torch.equal(r, want.expand(3))


def test_empty_inputs():
    x = torch.randn(0, 16, requires_grad=True)
    y = abp.functional.ms_layer_norm(x, 16)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 16)


@pytest.mark.parametrize("name,fn,ref,eps", NORMS)
def test_deterministic(name, fn, ref, eps):
    x = torch.randn(33, 3001, dtype=torch.float32, requires_grad=True)
    g = torch.randn(33, 3001)
    y1, y2 = fn(x, 3001, eps), fn(x, 3001, eps)
    assert torch.equal(y1, y2)
    assert torch.equal(_grads(y1, x, g), _grads(y2, x, g))


def test_modules():
    ln = abp.nn.MSLayerNorm(64)
    rms = abp.nn.MSRMSNorm([4, 16], eps=1e-5)
    assert list(ln.parameters()) == [] and list(rms.parameters()) == []
    assert ln.normalized_shape == (64,) and ln.eps == 1e-5
    assert rms.normalized_shape == (4, 16) and rms.eps == 1e-5
    assert abp.nn.MSRMSNorm(8).eps == 1e-6
    assert "eps=1e-05" in repr(ln)
    assert ln.saved_bits_per_row == 32
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    torch.testing.assert_close(rms(x), rms_norm_ref(x, (4, 16), 1e-5), rtol=0, atol=1e-10)
    torch.testing.assert_close(abp.nn.MSLayerNorm(16)(x), layer_norm_ref(x, (16,), 1e-5), rtol=0, atol=1e-10)


def test_an_affine_norm_of_one_row_gives_torchs_gradients():
    # A 1-d input is one row: its weight and bias gradients are that row's terms, not a scalar
    # (a sum over no row dimension would sum everything).
    torch.manual_seed(0)
    mine, theirs = abp.nn.MSLayerNorm(16, elementwise_affine=True), torch.nn.LayerNorm(16)
    with torch.no_grad():
        for m in (mine, theirs):
            m.weight.copy_(torch.linspace(0.5, 1.5, 16))
            m.bias.copy_(torch.linspace(-1, 1, 16))
    x = torch.randn(16, dtype=torch.float32)
    g = torch.randn(16)
    for m in (mine, theirs):
        m(x).backward(g)
    torch.testing.assert_close(mine.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine.bias.grad, theirs.bias.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: abp.nn.MSLayerNorm(0), ValueError, "normalized_shape: expected one or more positive ints"),
        (lambda: abp.nn.MSLayerNorm(-3), ValueError, "normalized_shape"),
        (lambda: abp.nn.MSLayerNorm("a"), ValueError, "normalized_shape"),
        (lambda: abp.nn.MSLayerNorm(3.5), TypeError, "normalized_shape: expected an int or a sequence"),
        (lambda: abp.nn.MSLayerNorm([]), ValueError, "normalized_shape"),
        (lambda: abp.nn.MSLayerNorm(8, eps=0), ValueError, "eps: expected a positive, finite number"),
        (lambda: abp.nn.MSRMSNorm(8, eps=-1e-6), ValueError, "eps"),
        (lambda: abp.nn.MSRMSNorm(8, eps=float("nan")), ValueError, "eps"),
        (lambda: abp.nn.MSRMSNorm(8, eps=float("inf")), ValueError, "eps"),
        (lambda: abp.nn.MSRMSNorm(8, eps=1e-50), ValueError, "representable in float32"),
        (lambda: abp.nn.MSRMSNorm(8, eps="x"), TypeError, "eps: expected a number"),
    ],
)
def test_bad_arguments_give_clear_errors(make: Callable[[], object], error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_inputs_give_clear_errors():
    ln = abp.nn.MSLayerNorm(16)
    with pytest.raises(ValueError, match=r"input: expected a tensor whose last 1 dimension\(s\) are \(16,\).*got shape \(4, 15\)"):
        ln(torch.randn(4, 15))
    with pytest.raises(ValueError, match="got shape"):
        abp.nn.MSRMSNorm((2, 8))(torch.randn(8))
    with pytest.raises(TypeError, match="input: expected dtype torch.float32, torch.float16, torch.bfloat16 or torch.float64, got torch.int64"):
        ln(torch.ones(4, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="input: expected a torch.Tensor"):
        ln([1.0] * 16)
    # Elementwise operators keep their own dtype set: fp64 is for row kernels only.
    with pytest.raises(TypeError, match="input: expected dtype torch.float32, torch.float16 or torch.bfloat16, got torch.float64"):
        abp.functional.regelu2(torch.randn(4, dtype=torch.float64))


ROW_RANGE_IR = """
abp.operator @test_row_range forward {
^bb0(%x: tensor<?x?xf32>):
  %mx = abp.reduce_rows max %x : tensor<?x?xf32> -> tensor<?xf32>
  %mn = abp.reduce_rows min %x : tensor<?x?xf32> -> tensor<?xf32>
  %mxb = abp.broadcast_rows %mx : tensor<?xf32> -> tensor<?x?xf32>
  %mnb = abp.broadcast_rows %mn : tensor<?xf32> -> tensor<?x?xf32>
  %y = abp.map(%x, %mxb, %mnb) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %d = arith.subf %a, %b : f32
    %e = arith.addf %d, %c : f32
    abp.yield %e : f32
  }
  abp.return %y : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}
"""


@pytest.mark.parametrize("cols", [1, 9, 1000, 1025, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_max_and_min_reductions(cols, dtype):
    if "test_row_range" not in abp.operators():
        compiler_or_skip()
        abp.compile_operators(ROW_RANGE_IR)
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(6, cols, generator=gen, dtype=dtype) * 100
    x[2, cols // 2] = math.nan
    if cols > 1:
        x[3, 0] = math.inf
    y = abp.functional.apply("test_row_range", x)
    want = x - x.amax(-1, keepdim=True) + x.amin(-1, keepdim=True)
    assert torch.isnan(y[2]).all(), "max/min propagate a NaN to its whole row"
    rows = [0, 1, 4, 5] + ([3] if cols > 1 else [])
    assert torch.equal(torch.nan_to_num(y[rows]), torch.nan_to_num(want[rows]))


@pytest.mark.parametrize("cls", [abp.nn.MSLayerNorm, abp.nn.MSRMSNorm])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_reset_parameters_initialises_as_torchs_norms(cls, offset):
    # The meta-device pattern: made on "meta", materialised with to_empty(), then reset_parameters().
    norm = cls(8, elementwise_affine=True, bias=True, weight_offset=offset, device="meta").to_empty(device="cpu")
    norm.reset_parameters()
    assert torch.equal(norm.weight + offset, torch.ones(8)) and torch.equal(norm.bias, torch.zeros(8))
    plain = cls(8)
    plain.reset_parameters()  # nothing to initialise
    assert plain.weight is None and plain.bias is None


@pytest.mark.parametrize("offset", [float("nan"), float("inf"), -float("inf"), 1e40])
def test_a_non_finite_weight_offset_is_named(offset):
    x, w = torch.randn(3, 8), torch.randn(8)
    for fn in (abp.functional.ms_layer_norm, abp.functional.ms_rms_norm):
        with pytest.raises(ValueError, match="weight_offset: expected a finite number representable in float32"):
            fn(x, 8, weight=w, weight_offset=offset)
    with pytest.raises(ValueError, match="weight_offset"):
        abp.nn.MSRMSNorm(8, elementwise_affine=True, weight_offset=offset)
