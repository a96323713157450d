"""abp.buckets.fit_buckets: the op library's solver, for a user's derivative (docs/python.md).

The library's tables are the reference: fitting GELU's derivative through the public function
must reproduce ops/fewbit/tables.json. A user's table then compiles into an operator whose
backward is exactly levels[code(x)]·dy, and a histogram weighting fits the data it describes
better than the N(0, 1) default does.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import abp
from abp import _bucket_solver as solver
from abp.buckets import BucketTable, fit_buckets
from abp_reference import compiler_or_skip

ROOT = Path(__file__).resolve().parents[2]


def gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    return cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def mish_derivative(x: torch.Tensor) -> torch.Tensor:
    sp = torch.nn.functional.softplus(x)
    t = torch.tanh(sp)
    return t + x * torch.sigmoid(x) * (1 - t * t)


@pytest.mark.parametrize("weight,bits", [("normal", 2), ("uniform", 3)])
def test_gelu_reproduces_the_library_table(weight: str, bits: int) -> None:
    shipped = json.loads((ROOT / "ops/fewbit/tables.json").read_text())["tables"]["gelu"]
    expected = shipped[weight][str(bits)]
    table = fit_buckets(gelu_derivative, bits, weight)
    np.testing.assert_allclose(table.borders, expected["borders"], rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(table.levels, expected["levels"], rtol=1e-7, atol=1e-8)
    assert table.error == pytest.approx(expected["J"], rel=1e-6)


def test_the_table_is_the_interval_means_and_beats_nearby_tables() -> None:
    table = fit_buckets(mish_derivative, 2)
    assert len(table.borders) == 3 and len(table.levels) == 4
    assert np.all(np.diff(np.float32(table.borders)) > 0)
    # A local optimum: moving any border by ±0.05 (levels re-fitted) raises the error.
    act = solver.Activation("mish", lambda x: x, lambda x: mish_derivative(
        torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy())
    for i in range(3):
        for step in (-0.05, 0.05):
            moved = list(table.borders)
            moved[i] += step
            levels = solver.optimal_levels(act, "normal", moved)
            assert solver.objective(act, "normal", moved, levels) > table.error


def test_a_histogram_weight_fits_its_data_better_than_the_default() -> None:
    torch.manual_seed(0)
    data = torch.randn(200_000) * 0.5 + 1.5  # pre-activations far from N(0, 1)
    counts, edges = torch.histogram(data.clamp(-2, 5), bins=140, range=(-2.0, 5.0))
    fitted = fit_buckets(mish_derivative, 3, (counts, edges))
    default = fit_buckets(mish_derivative, 3)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1)) * 0.5 + 1.5
    exact = mish_derivative(x.double()).float()

    def error(table: BucketTable) -> float:
        return float(((table(x) - exact) ** 2).mean())

    assert error(fitted) < 0.5 * error(default)
    assert -2.0 < fitted.borders[0] and fitted.borders[-1] < 5.0


def test_a_fitted_table_compiles_into_an_operator_with_the_defined_backward() -> None:
    compiler_or_skip()
    table = fit_buckets(mish_derivative, 3)
    ir = f"""
#t = {table.attribute}
func.func private @mish(%x: f32) -> f32 {{
  %e = math.exp %x : f32
  %sp = math.log1p %e : f32
  %t = math.tanh %sp : f32
  %y = arith.mulf %x, %t : f32
  return %y : f32
}}
"""
    ir += """
func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}
abp.operator @test_fitted_mish forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @mish(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #t} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #t} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
"""
    if "test_fitted_mish" not in abp.operators():
        abp.compile_operators(ir, origin="fitted_mish.mlir")
    torch.manual_seed(0)
    x = (torch.randn(4001) * 2).requires_grad_(True)
    dy = torch.randn(4001)
    abp.functional.apply("test_fitted_mish", x).backward(dy)
    assert torch.equal(x.grad, table(x.detach()) * dy)


@pytest.mark.parametrize("call,message", [
    (lambda: fit_buckets(mish_derivative, 5), "bits: expected an integer in [1, 4], got 5"),
    (lambda: fit_buckets(mish_derivative, 0), "bits: expected an integer in [1, 4], got 0"),
    (lambda: fit_buckets(lambda x: 1 / x, 2), "derivative: not finite at x = 0.0"),
    (lambda: fit_buckets(lambda x: x.sum(), 2), "derivative: expected a tensor of the input's shape"),
    (lambda: fit_buckets(mish_derivative, 2, "laplace"), "unknown weight 'laplace'"),
    (lambda: fit_buckets(mish_derivative, 2, ([1.0, 2.0], [0.0, 1.0])),
     "len(edges) == len(counts) + 1"),
    (lambda: fit_buckets(mish_derivative, 2, ([1.0], [0.0, 500.0])), "must lie inside [-100, 100]"),
    (lambda: fit_buckets(mish_derivative, 4, ([1.0], [0.0, 0.05])), "fewer than the 15"),
    (lambda: fit_buckets(mish_derivative, 2, breaks=[float("nan")]), "breaks: expected finite"),
])
def test_bad_arguments_are_named(call, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert message in str(info.value)
