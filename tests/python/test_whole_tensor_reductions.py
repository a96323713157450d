"""Whole-tensor reductions (abp.reduce_tensor; abp.author's sum_all, mean_all, max_all, min_all).

Each reduction runs as its own total kernel before the direction's kernel, on the device, with
no host sync. Forward must equal the maths with the reduced value in place; backward the
derivative the operator defines; a saved reduction costs one value (no bits per element). Sums
accumulate in the compute type in an order fixed by the element count alone, so they are checked
against fp64 references with a tolerance, and for repeatability bit for bit.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import abp
from abp import _custom_ops
from abp.author import (AuthoringError, dequantize, max_all, max_rows, mean_all, mean_rows, min_all,
                        min_rows, operator, quantize, sum_all, sum_rows, uniform, where)
from abp_reference import compiler_or_skip

_names = itertools.count()


def fresh(stem: str) -> str:
    return f"test_total_{stem}_{next(_names)}"


@pytest.fixture(autouse=True)
def _compiler() -> None:
    compiler_or_skip()


# 16 levels evenly over [-1, 1] and the midpoints between them: 4-bit absmax codes.
LEVELS = [-1.0 + 2.0 * k / 15 for k in range(16)]
BORDERS = [(a + b) / 2 for a, b in zip(LEVELS, LEVELS[1:])]


def _codes_reference(v: torch.Tensor) -> torch.Tensor:
    """levels[#{borders < v}] in fp32, as the kernels compare and look up."""
    borders = torch.tensor(BORDERS, dtype=torch.float32)
    levels = torch.tensor(LEVELS, dtype=torch.float32)
    return levels[(v.unsqueeze(-1) > borders).sum(-1)]


def _absmax_product():
    """x * y with both inputs saved as 4-bit codes of x / max|x| and y / max|y| (per-tensor
    scales): the authoring issue's third operator, without a host sync for the scales."""
    @operator(name=fresh("absmax_product"))
    def product(x, y):
        ax, ay = max_all(abs(x)), max_all(abs(y))
        cx, cy = quantize(x / ax, (BORDERS, LEVELS)), quantize(y / ay, (BORDERS, LEVELS))

        def backward(dz):
            return dz * dequantize(cy) * ay, dz * dequantize(cx) * ax
        return x * y, backward
    return product


def test_absmax_codes_with_per_tensor_scales() -> None:
    product = _absmax_product()
    assert product.ir.count("abp.reduce_tensor max") == 2
    # Two 4-bit code streams per element; the two scales cost one value each, no bits per element.
    assert product.saved_bits == 8
    assert sorted(r["kind"] for r in product.manifest["residuals"]) == ["codes", "codes", "total", "total"]
    assert f"{product.name}_fwd_total0" in product.cuda and f"{product.name}_fwd_total1" in product.cuda
    torch.manual_seed(0)
    for n in (1, 7, 5000, 2048 * 300 + 3):
        x = (torch.randn(n) * 3).requires_grad_(True)
        y = torch.randn(n).requires_grad_(True)
        z = product(x, y)
        assert torch.equal(z, x * y)
        dz = torch.randn(n)
        z.backward(dz)
        ax, ay = x.detach().abs().max(), y.detach().abs().max()
        assert torch.equal(x.grad, dz * _codes_reference(y.detach() / ay) * ay)
        assert torch.equal(y.grad, dz * _codes_reference(x.detach() / ax) * ax)


def _centre():
    """y = x - mean(x) over the whole tensor; its exact derivative is dy - mean(dy): a reduction
    of a backward value."""
    @operator(name=fresh("centre"))
    def centre(x):
        return x - mean_all(x), lambda dy: dy - mean_all(dy)
    return centre


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_mean_in_forward_and_in_backward(dtype: torch.dtype) -> None:
    centre = _centre()
    assert centre.saved_bits == 0 and centre.manifest["residuals"] == []
    torch.manual_seed(1)
    # One block, several, and more than the 1024 blocks a total kernel runs on (a grid stride).
    for n in (1, 3, 2048, 2049, 2048 * 1024 + 77):
        x = (torch.randn(n) + 0.5).to(dtype).requires_grad_(True)
        y = centre(x)
        mean = x.detach().double().mean()
        expected = (x.detach().float() - mean.float()).to(dtype)
        torch.testing.assert_close(y, expected, rtol=0, atol=float(torch.finfo(dtype).eps) * 4)
        dy = torch.randn(n).to(dtype)
        y.backward(dy)
        expected_grad = (dy.float() - dy.double().mean().float()).to(dtype)
        torch.testing.assert_close(x.grad, expected_grad, rtol=0, atol=float(torch.finfo(dtype).eps) * 4)
        # The order depends on n alone: the same bits every time.
        assert torch.equal(centre(x.detach()), y.detach())


def test_every_kind_exactly_where_exact_and_nan_propagates() -> None:
    @operator(name=fresh("extremes"))
    def extremes(x):
        # max and min are exact; the sum of small integers is exact in fp32.
        return (x - min_all(x)) / (max_all(x) - min_all(x)) + sum_all(x * 0.0 + 1.0), lambda dy: dy

    x = torch.tensor([3.0, -2.0, 7.0, 0.5] * 1001)
    y = extremes(x)
    assert torch.equal(y, (x - x.min()) / (x.max() - x.min()) + float(x.numel()))
    x[2001] = float("nan")  # max and min see it; every output is NaN
    assert torch.isnan(extremes(x)).all()
    # An empty tensor still runs (the totals are the identities, read by no element).
    assert extremes(torch.empty(0)).shape == (0,)


# Totals in fp32 only: an operator of elementwise kernels has no fp64 form.
@pytest.mark.parametrize("reduce,dtype", [(r, d) for r in ("max_rows", "min_rows", "max_all", "min_all")
                                          for d in (torch.float32, torch.float64)
                                          if r.endswith("rows") or d == torch.float32])
def test_maxima_and_minima_leave_as_one_nan_and_a_positive_zero(dtype: torch.dtype, reduce: str) -> None:
    # A GPU from sm_80 on combines with max.NaN / min.NaN (a canonical NaN, either zero), the CPU
    # path with the IEEE maximum (the NaN operand itself): each reduction then leaves as the quiet
    # NaN with every mantissa bit set and +0, the same bits on every device (abp.reduce_rows).
    # x * 0 + m shows m's bits: +-0 + a NaN is that NaN, and -0 + m is -0 only if m is -0.
    of = {"max_rows": max_rows, "min_rows": min_rows, "max_all": max_all, "min_all": min_all}[reduce]

    @operator(name=fresh(reduce), rows=reduce.endswith("rows"))
    def shifted(x):
        return x * 0.0 + of(x), lambda dy: dy

    int_type, canonical = (torch.int64, 0x7FFF_FFFF_FFFF_FFFF) if dtype == torch.float64 else (torch.int32, 0x7FFF_FFFF)
    negative_nan = torch.tensor([-2**63 + 0x7FF8_0000_0000_1234], dtype=torch.int64).view(torch.float64)
    x = torch.rand(2, 64, dtype=torch.float64) + 1
    x[0, 5] = negative_nan[0]
    x = x.to(dtype)
    y = shifted(x).view(int_type)
    holding = torch.isfinite(x) & (torch.arange(2)[:, None] == 0 if reduce.endswith("rows") else True)
    assert (y[holding] == canonical).all(), "a row (a tensor) holding NaN gives the one NaN"
    # Rows of negatives up to a -0 (a maximum of -0), or of positives down to one (a minimum).
    sign = -1.0 if reduce.startswith("max") else 1.0
    x = (sign * (torch.rand(2, 64, dtype=torch.float64) + 1)).to(dtype)
    x[:, 7] = -0.0
    y = shifted(x).view(int_type)
    assert (y == 0).all(), "a zero maximum or minimum is +0: -0 + m is +0 everywhere"


def test_a_row_operator_reads_a_total_and_runs_in_fp64() -> None:
    # Rows centred on their own mean, scaled by the largest magnitude anywhere in the tensor.
    @operator(name=fresh("row_centre_scaled"), rows=True)
    def scaled(x):
        s = max_all(abs(x))
        return (x - mean_rows(x)) / s, lambda dy: (dy - mean_rows(dy)) / s

    torch.manual_seed(2)
    x = torch.randn(37, 129, dtype=torch.float64, requires_grad=True)
    y = scaled(x)
    s = x.detach().abs().max()
    torch.testing.assert_close(y, (x.detach() - x.detach().mean(-1, keepdim=True)) / s, rtol=1e-14, atol=1e-14)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, (dy - dy.mean(-1, keepdim=True)) / s, rtol=1e-14, atol=1e-14)
    assert scaled.saved_bits == 0 and [r["kind"] for r in scaled.manifest["residuals"]] == ["total"]


def test_a_total_over_draws_sees_the_elements_draws() -> None:
    import gact_reference as ref

    # Dropout rescaled by the fraction actually kept, not by its expectation: the total kernel
    # draws each element's number again, from the same (seed, offset + index).
    @operator(name=fresh("kept_fraction"), params={"seed": int, "offset": int})
    def dropout(x, seed, offset):
        keep = uniform(seed, offset) < 0.5
        fraction = mean_all(where(keep, 1.0, 0.0))
        return where(keep, x / fraction, 0.0), lambda dy: where(keep, dy / fraction, 0.0)

    seed, offset, n = 1234, 99, 10007
    x = torch.randn(n, requires_grad=True)
    y = dropout(x, seed, offset)
    keep = torch.from_numpy(ref.uniform_at(seed, np.arange(n, dtype=np.uint64) + np.uint64(offset)) < 0.5)
    fraction = torch.tensor(float(keep.sum()), dtype=torch.float32) / n
    assert torch.equal(y, torch.where(keep, x.detach() / fraction, torch.zeros(())))
    dy = torch.randn(n)
    y.backward(dy)
    assert torch.equal(x.grad, torch.where(keep, dy / fraction, torch.zeros(())))


def test_totals_of_rows_read_by_index_reduce_the_tensors_themselves() -> None:
    from abp.author import sample, unsample

    # Forward keeps k rows of an N-row x scaled by 1 / max|x| over all of x (not only the kept
    # rows); backward puts the gradient back, shifted by the mean of the k rows it got and
    # scaled by the same.
    @operator(name=fresh("gather_scaled"), rows=True, index=("index", "slot"), per_row=("weight",),
              no_grad=("weight",))
    def gather(x, index, weight, slot):
        s = max_all(abs(x))
        return sample(x, index, weight) / s, lambda g: (unsample(g, slot) - mean_all(g)) / s

    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([5, -1, 0, 3], dtype=torch.int32)
    weight = torch.tensor([2.0, 1.0, -0.5, 3.0], dtype=torch.float64)
    slot = torch.tensor([2, -1, -1, 3, -1, 0], dtype=torch.int32)
    kept = gather(x, index, weight, slot)
    s = x.detach().abs().max()
    rows = torch.where(index[:, None] >= 0, x.detach()[index.clamp(min=0).long()], torch.zeros(()))
    torch.testing.assert_close(kept, rows * weight[:, None] / s, rtol=1e-15, atol=1e-15)
    g = torch.randn(4, 5, dtype=torch.float64)
    kept.backward(g)
    put_back = torch.where(slot[:, None] >= 0, g[slot.clamp(min=0).long()], torch.zeros(()))
    expected = (put_back - g.mean()) / s
    torch.testing.assert_close(x.grad, expected, rtol=1e-14, atol=1e-14)


def _authoring_error_at_this_file(build) -> str:
    with pytest.raises(AuthoringError) as info:
        build()
    assert f"{__file__}:" in str(info.value)
    return str(info.value)


def test_mistakes_with_whole_tensor_reductions_are_named() -> None:
    def of_a_per_row_value():
        @operator(name=fresh("total_of_rows"), rows=True)
        def f(x):
            return x * sum_all(sum_rows(x)), lambda dy: dy

    assert "sum_all: expected a tensor of the operator's shape" in \
        _authoring_error_at_this_file(of_a_per_row_value)

    def of_a_value_computed_along_rows():
        @operator(name=fresh("total_of_centred_rows"), rows=True)
        def f(x):
            return x * max_all(x - mean_rows(x)), lambda dy: dy

    # The compiler finds this one, at the line that traced the reduction.
    with pytest.raises(abp.CompileError) as info:
        of_a_value_computed_along_rows()
    assert f"{__file__}:{of_a_value_computed_along_rows.__code__.co_firstlineno + 3}:" in str(info.value)
    assert "a whole-tensor reduction recomputes its operand element by element" in str(info.value)

    for argument, message in ((lambda x: x > 0, "reduce where(mask, 1.0, 0.0) to count it"),
                              (lambda x: quantize(x, (BORDERS, LEVELS)), "reduce dequantize(codes)"),
                              (lambda x: max_all(x), "got a single value"),
                              (lambda x: 1.5, "expected a traced tensor of an @abp.author.operator, got float")):
        def wrong_argument():
            @operator(name=fresh("wrong_argument"))
            def f(x):
                return x * sum_all(argument(x)), lambda dy: dy

        assert message in _authoring_error_at_this_file(wrong_argument)

    def compared_alone():
        @operator(name=fresh("compared_alone"))
        def f(x):
            return where(sum_all(x) > 0, x, -x), lambda dy: dy

    assert "compare x * 0.0 + value" in _authoring_error_at_this_file(compared_alone)

    def returned():
        @operator(name=fresh("returns_total"))
        def f(x):
            return sum_all(x), lambda dy: dy

    assert "output 0 must be a traced float tensor of the forward, got one number for every element" \
        in _authoring_error_at_this_file(returned)


def test_float64_is_refused_by_name_where_a_kernel_lacks_it() -> None:
    # A row operator without a row reduction compiles to an elementwise kernel (no f64 symbol):
    # the dtype check lists what its kernels have, instead of a failed kernel lookup.
    @operator(name=fresh("global_scale_rows"), rows=True)
    def scaled(x):
        s = max_all(abs(x))
        return x / s, lambda dy: dy / s

    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"x: expected dtype torch.float32, torch.float16 or torch.bfloat16, "
                                        r"got torch.float64"):
        scaled(x)
    assert torch.equal(scaled(x.float()), x.float() / x.float().abs().max())


@pytest.mark.skipif(not _custom_ops.supported_torch(), reason="torch.library needs torch >= 2.4")
def test_it_compiles_without_graph_breaks() -> None:
    product = _absmax_product()
    x, y = torch.randn(300, requires_grad=True), torch.randn(300, requires_grad=True)
    compiled = torch.compile(lambda a, b: product(a, b).sum(), backend="aot_eager", fullgraph=True)
    compiled(x, y).backward()
    ax, ay = x.detach().abs().max(), y.detach().abs().max()
    assert torch.equal(x.grad, _codes_reference(y.detach() / ay) * ay)
    assert torch.equal(y.grad, _codes_reference(x.detach() / ax) * ax)
