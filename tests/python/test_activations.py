"""Forward equals torch's exact activation; backward equals the defined approximation (docs/algorithms.md §9.3, §9.6)."""
from __future__ import annotations

import math
from typing import Callable, Tuple

import pytest
import torch
import torch.nn.functional as F

import abp
from abp_reference import (
    BUCKET_DOC_TABLES,
    BUCKET_TORCH,
    CONTINUOUS_TORCH,
    FLOAT_DTYPES,
    PIECEWISE_CASES,
    assert_bitwise_equal,
    assert_forward_close,
    bucket_backward,
    f32,
    fewbit_ops,
    library_or_skip,
    manifest_table,
    piecewise_breakpoints,
    sample_inputs,
    torch_grad,
)


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


DTYPE_IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
FEWBIT = fewbit_ops()
FEWBIT_IDS = [op for op, *_ in FEWBIT]
PIECEWISE_IDS = [f"{op}{'-' + '-'.join(f'{p:g}' for p in params) if params else ''}" for op, params, _ in PIECEWISE_CASES]


def fewbit_call(act: str, bits: int, weight: str) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = getattr(abp.functional, act)
    return lambda x: fn(x, bits=bits, weight=weight)


def gelu_tanh_torch(x: torch.Tensor) -> torch.Tensor:
    """torch's GELU, tanh form: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
    return F.gelu(x, approximate="tanh")


# GELU's tanh form: (operator, abp function). Their tables are the manifests' (regelu2_tanh's is tied
# to tools/regelu2_fit.py by test_regelu2_fit.py, the FewBit ones to the solver by test_fewbit_solver.py).
GELU_TANH_OPS = [("regelu2_tanh", lambda x: abp.functional.regelu2(x, approximate="tanh"))] + [
    (
        abp.functional.fewbit_operator("gelu_tanh", bits, weight),
        lambda x, b=bits, w=weight: abp.functional.gelu(x, approximate="tanh", bits=b, weight=w),
    )
    for bits in (1, 2, 3, 4)
    for weight in ("normal", "uniform")
]


def bucket_cases():
    """(operator, abp function, torch forward, (borders, levels) as fp32 tensors) of every bucket operator."""
    cases = []
    for op, torch_fn in BUCKET_TORCH.items():
        borders, levels = BUCKET_DOC_TABLES[op]
        cases.append(pytest.param(op, getattr(abp.functional, op), torch_fn, lambda b=borders, l=levels: (f32(b), f32(l)), id=op))
    for op, act, bits, weight in FEWBIT:
        cases.append(
            pytest.param(
                op,
                fewbit_call(act, bits, weight),
                CONTINUOUS_TORCH[act],
                lambda op=op: tuple(f32(v) for v in manifest_table(op)),
                id=op,
            )
        )
    for op, fn in GELU_TANH_OPS:
        cases.append(
            pytest.param(op, fn, gelu_tanh_torch, lambda op=op: tuple(f32(v) for v in manifest_table(op)), id=op)
        )
    return cases


BUCKETS = bucket_cases()
EDGE_POINTS = [0.0, -0.0, 1e-3, -1e-3, 0.5, -0.5, 10.0, -10.0, 20.0, -20.0, 50.0, -50.0, 1e-30, -1e-30]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("op,fn,torch_fn,table", BUCKETS)
def test_bucket_forward_matches_torch_and_backward_is_table_rule(op, fn, torch_fn, table, dtype):
    borders, levels = table()
    x = sample_inputs(3000, dtype, extra=EDGE_POINTS + borders.tolist(), seed=1).requires_grad_()
    y = fn(x)
    assert_forward_close(y.detach(), torch_fn(x.detach().double()), x.detach(), exact=False)
    dy = sample_inputs(x.numel(), dtype, seed=2)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_bitwise_equal(dx, bucket_backward(x.detach(), dy, borders, levels), f"{op} backward")


@pytest.mark.parametrize("op,fn,torch_fn,table", BUCKETS)
def test_bucket_value_on_a_border_takes_the_lower_level(op, fn, torch_fn, table):
    borders, levels = table()
    up = torch.nextafter(borders, torch.full_like(borders, math.inf))
    down = torch.nextafter(borders, torch.full_like(borders, -math.inf))
    x = torch.cat([borders, up, down]).requires_grad_()
    (dx,) = torch.autograd.grad(fn(x), x, torch.ones_like(x))
    k = borders.numel()
    # Written out, not through the reference's code(): border i is the top of interval i.
    assert torch.equal(dx[:k], levels[:k]), "x exactly on border i must take level i (the lower one)"
    assert torch.equal(dx[k : 2 * k], levels[1 : k + 1]), "the next float above border i takes level i + 1"
    assert torch.equal(dx[2 * k :], levels[:k]), "the float below border i takes level i"


@pytest.mark.parametrize("op,fn,torch_fn,table", BUCKETS)
def test_bucket_nonfinite_values(op, fn, torch_fn, table):
    borders, levels = table()
    top = levels.numel() - 1
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.25, -8.0, 8.0], requires_grad=True)
    y = fn(x)
    # Forward: whatever torch's exact activation returns, NaN and +-inf included.
    assert_forward_close(y.detach(), torch_fn(x.detach().double()), x.detach(), exact=False)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(x))
    assert dx[0] == levels[0], "NaN takes code 0"
    assert dx[1] == levels[top], "+inf takes the top code"
    assert dx[2] == levels[0], "-inf takes code 0"
    # A non-finite dy propagates: level * inf is +-inf, or NaN (0 * inf) where the level is 0.
    dy = torch.tensor([1.0, math.inf, -math.inf, math.nan, math.inf, -math.inf])
    y = fn(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_bitwise_equal(dx, bucket_backward(x.detach(), dy, borders, levels), f"{op} non-finite dy")
    assert torch.isnan(dx[3]), "a NaN dy gives a NaN dx"
    assert not torch.isfinite(dx[1:3]).any() and not torch.isfinite(dx[4:]).any()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("op,params,torch_fn", PIECEWISE_CASES, ids=PIECEWISE_IDS)
def test_piecewise_forward_and_backward_equal_torch(op, params, torch_fn, dtype):
    points = []
    for b in piecewise_breakpoints(op, params):
        bt = torch.tensor(b, dtype=torch.float32)
        points += [b, torch.nextafter(bt, torch.tensor(math.inf)).item(), torch.nextafter(bt, torch.tensor(-math.inf)).item()]
    x = sample_inputs(3000, dtype, extra=EDGE_POINTS + points, seed=3).requires_grad_()
    y = abp.functional.apply(op, x, params)
    assert_forward_close(y.detach(), torch_fn(x.detach().float()), x.detach(), exact=True)
    dy = sample_inputs(x.numel(), dtype, seed=4)
    (dx,) = torch.autograd.grad(y, x, dy)
    # torch's exact autograd in fp32, rounded to the dtype (bit-identical for fp32).
    assert_bitwise_equal(dx, torch_grad(torch_fn, x.detach(), dy).to(dtype), f"{op} backward")


@pytest.mark.parametrize("op,params,torch_fn", PIECEWISE_CASES, ids=PIECEWISE_IDS)
def test_piecewise_nonfinite_values_follow_torch(op, params, torch_fn):
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 2.0, -2.0], requires_grad=True)
    y = abp.functional.apply(op, x, params)
    expected = torch_fn(x.detach())
    if op == "softshrink":
        # softshrink(NaN) is NaN (torch >= 2.1 computes x * 0 in the dead zone; torch 1.13 returned 0).
        expected[0] = math.nan
    assert_bitwise_equal(y.detach(), expected, f"{op} forward")
    dy = torch.tensor([1.0, 1.0, 1.0, math.inf, math.nan, -math.inf])
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_bitwise_equal(dx, torch_grad(torch_fn, x.detach(), dy), f"{op} backward")


@pytest.mark.parametrize("op,fn", GELU_TANH_OPS, ids=[op for op, _ in GELU_TANH_OPS])
def test_gelu_tanh_forward_is_the_tanh_form_not_the_erf_form(op, fn):
    # The two forms differ by up to 4.7e-4 (near |x| = 2.7), far beyond the forward tolerance: an
    # operator computing the erf form would fail here, whatever its backward.
    x = torch.linspace(-4.0, 4.0, 801)
    y = fn(x).double()
    assert (y - gelu_tanh_torch(x.double())).abs().max() < 1e-6
    assert (y - F.gelu(x.double())).abs().max() > 1e-4


DETERMINISM_OPS = ["regelu2", "resilu2", "gelu_b3", "silu_b4", "tanh_b1", "relu", "leaky_relu", "regelu2_tanh", "gelu_tanh_b2"]


@pytest.mark.parametrize("op", DETERMINISM_OPS)
def test_two_runs_are_bit_identical(op):
    params: Tuple[float, ...] = (0.1,) if op == "leaky_relu" else ()
    x = sample_inputs(2**16 + 5, torch.float32, seed=5)
    dy = sample_inputs(x.numel(), torch.float32, seed=6)

    def run():
        saved = []

        def pack(t):
            saved.append(t.clone())
            return t

        xr = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = abp.functional.apply(op, xr, params)
        (dx,) = torch.autograd.grad(y, xr, dy)
        return y.detach(), dx, saved

    y1, dx1, codes1 = run()
    y2, dx2, codes2 = run()
    assert_bitwise_equal(y1, y2, "forward")
    assert_bitwise_equal(dx1, dx2, "backward")
    assert len(codes1) == len(codes2) == 1
    assert torch.equal(codes1[0], codes2[0])


def _views(base: torch.Tensor):
    return {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "offset": base.flatten()[1:],  # misaligned by one element
        "expanded_row": base[:1].expand(5, -1),
    }


@pytest.mark.parametrize("view", ["transposed", "strided", "offset", "expanded_row"])
@pytest.mark.parametrize("op,params", [("regelu2", ()), ("gelu_b2", ()), ("hardtanh", (-0.5, 1.5))])
def test_noncontiguous_inputs_and_gradients(op, params, view):
    base = sample_inputs(37 * 41, torch.float32, seed=7).reshape(37, 41)
    x = _views(base)[view].requires_grad_()
    # "offset" is contiguous but misaligned (off the 16-byte vector path); the others are strided.
    assert x.storage_offset() == 1 if view == "offset" else not x.is_contiguous()
    y = abp.functional.apply(op, x, params)
    assert y.shape == x.shape
    xc = x.detach().contiguous().requires_grad_()
    yc = abp.functional.apply(op, xc, params)
    assert_bitwise_equal(y.detach(), yc.detach(), "forward of a view")
    dy = sample_inputs(y.numel() * 2, torch.float32, seed=8).reshape(*y.shape, 2)[..., 0]
    assert not dy.is_contiguous()
    (dx,) = torch.autograd.grad(y, x, dy)
    (dxc,) = torch.autograd.grad(yc, xc, dy.contiguous())
    assert dx.shape == x.shape
    assert_bitwise_equal(dx, dxc, "backward of a view")


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "expanded"])
@pytest.mark.parametrize("op,params", [("silu_b3", ()), ("resilu2", ()), ("leaky_relu", (0.1,))])
def test_a_permuted_input_keeps_its_layout_and_its_gradient_comes_back_in_it(op, params, layout):
    """An elementwise operator runs on a dense input in its own memory order: a channels_last
    activation stays channels_last (the next convolution reads it without a copy) and the
    gradient comes back in that order; the values are those of a contiguous copy. An input that
    is no permutation of a dense tensor (expanded) gives a contiguous output, as before."""
    base = sample_inputs(2 * 6 * 5 * 7, torch.float32, seed=3).reshape(2, 6, 5, 7)
    x = {"channels_last": base.contiguous(memory_format=torch.channels_last),
         "transposed": base.transpose(1, 3),
         "expanded": base[:, :1].expand(2, 6, 5, 7)}[layout].requires_grad_()
    y = abp.functional.apply(op, x, params)
    xc = x.detach().contiguous().requires_grad_()
    yc = abp.functional.apply(op, xc, params)
    assert_bitwise_equal(y.detach(), yc.detach(), "forward")
    want = x.stride() if layout != "expanded" else yc.stride()
    assert y.stride() == want
    dy = sample_inputs(x.numel(), torch.float32, seed=4).reshape(x.shape)
    dy = dy.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else dy
    (dx,) = torch.autograd.grad(y, x, dy)
    (dxc,) = torch.autograd.grad(yc, xc, dy.contiguous())
    assert_bitwise_equal(dx, dxc, "backward")
    if layout == "channels_last":
        assert dx.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("shape", [(0,), (0, 7), (3, 0, 2)])
@pytest.mark.parametrize("op", ["regelu2", "gelu_b3", "relu", "leaky_relu"])
def test_empty_tensors_launch_nothing_and_keep_their_shape(op, shape):
    params = (0.01,) if op == "leaky_relu" else ()
    x = torch.empty(shape, requires_grad=True)
    with abp.memory.SavedTensorsCounter() as counter:
        y = abp.functional.apply(op, x, params)
    assert y.shape == x.shape and counter.total_bytes == 0
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("op", ["resilu2", "silu_b2_uniform", "softshrink"])
def test_shapes_are_preserved(op):
    params = (0.5,) if op == "softshrink" else ()
    for shape in [(), (1,), (2, 3, 4), (5, 1, 7, 2)]:
        x = sample_inputs(int(torch.Size(shape).numel()), torch.float32, seed=9).reshape(shape).requires_grad_()
        y = abp.functional.apply(op, x, params)
        y.sum().backward()
        assert y.shape == x.shape and x.grad.shape == x.shape


@pytest.mark.parametrize("lambd", [-0.5, float("nan")])
def test_softshrink_refuses_a_negative_lambda_as_torch_does(lambd):
    # With lambd < 0 the piecewise definition overlaps: abp returned values torch refuses to compute.
    with pytest.raises(RuntimeError):
        torch.nn.functional.softshrink(torch.randn(4), -0.5)
    with pytest.raises(ValueError, match="lambd: expected a value >= 0"):
        abp.functional.softshrink(torch.randn(4), lambd)
    with pytest.raises(ValueError, match="lambd: expected a value >= 0"):
        abp.nn.Softshrink(lambd)


# In-place: abp's activations honour inplace=True as torch's do. (module, torch module, args, exact
# derivative): the piecewise ones' 1-bit derivative is torch's, so their gradients must be too.
_IN_PLACE = [
    (abp.nn.ReLU, torch.nn.ReLU, (), True),
    (abp.nn.ReLU6, torch.nn.ReLU6, (), True),
    (abp.nn.Hardsigmoid, torch.nn.Hardsigmoid, (), True),
    (abp.nn.LeakyReLU, torch.nn.LeakyReLU, (0.2,), True),
    (abp.nn.Threshold, torch.nn.Threshold, (0.1, -1.0), True),
    (abp.nn.Hardtanh, torch.nn.Hardtanh, (), True),
    (abp.nn.ReSiLU2, torch.nn.SiLU, (), False),
    (abp.nn.SiLU, torch.nn.SiLU, (), False),
    (abp.nn.CELU, torch.nn.CELU, (), False),
    (abp.nn.ELU, torch.nn.ELU, (), False),
    (abp.nn.Hardswish, torch.nn.Hardswish, (), False),
    (abp.nn.Mish, torch.nn.Mish, (), False),
    (abp.nn.SELU, torch.nn.SELU, (), False),
]


@pytest.mark.parametrize("mine, theirs, args, exact", _IN_PLACE, ids=lambda v: getattr(v, "__name__", None))
def test_inplace_writes_the_input_as_torchs_module_does(mine, theirs, args, exact) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def run(act: torch.nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
        h = x * 2.0  # not a leaf: an in-place op may write it
        y = act(h)
        assert y is h  # returned as torch's in-place modules return it: the input, written
        return y + h, torch.autograd.grad((y + h).sum(), x)[0]

    out, grad = run(mine(*args, inplace=True))
    want, want_grad = run(theirs(*args, inplace=True))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    if exact:
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert mine(*args).inplace is False  # the default writes nothing


def test_inplace_functions_and_their_errors() -> None:
    h = torch.tensor([-1.0, 2.0])
    assert abp.functional.leaky_relu(h, 0.5, inplace=True) is h and h.tolist() == [-0.5, 2.0]
    leaf = torch.tensor([-1.0, 2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):  # as torch's in-place ops
        abp.nn.ReLU(inplace=True)(leaf)
    with pytest.raises(TypeError, match="inplace: expected True or False, got 1"):
        abp.nn.SiLU(inplace=1)
    with pytest.raises(TypeError, match="inplace: expected True or False, got 'yes'"):
        abp.functional.relu(h, inplace="yes")
