"""The scalar operations added to codegen compute what torch computes, on the CPU path.

Each operator below applies one operation elementwise (compiled at run time, so through the
verifier's scalar-op list, the emitter and the host prelude). Rounding, sign, remainder and
conversions are exact; sin, exp2 and log2 are libm calls on both sides, compared to 2 ulp.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import pytest
import torch

import abp
from abp_reference import compiler_or_skip


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.copysign(torch.floor(x.abs() + 0.5), x)  # the sign of -0.0 and -0.25 kept


def _fptosi(x: torch.Tensor) -> torch.Tensor:
    # arith.fptosi to i32 as abp defines it: truncation, saturating at i32's range, NaN to 0;
    # then back to f32 (sitofp), where 2^31 - 1 rounds to 2^31.
    top, bottom = 2.0**31 - 1, -(2.0**31)
    clamped = torch.nan_to_num(x.double(), nan=0.0).clamp(bottom, top).trunc()
    return clamped.float() + 0.0  # an integer has no -0: -0.5 converts to +0.0


# name -> (body computing %r from %v, the torch reference, whether equality is exact)
CASES: Dict[str, Tuple[str, Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "ceil": ("%r = math.ceil %v : f32", torch.ceil, True),
    "trunc": ("%r = math.trunc %v : f32", torch.trunc, True),
    "round": ("%r = math.round %v : f32", _round_half_away, True),
    "roundeven": ("%r = math.roundeven %v : f32", torch.round, True),  # torch: half to even
    "copysign": ("%c = arith.constant 1.5 : f32\n    %r = math.copysign %c, %v : f32",
                 lambda x: torch.copysign(torch.full_like(x, 1.5), x), True),
    "remf": ("%c = arith.constant 0.75 : f32\n    %r = arith.remf %v, %c : f32",
             lambda x: torch.fmod(x, 0.75), True),
    "fptosi": ("%i = arith.fptosi %v : f32 to i32\n    %r = arith.sitofp %i : i32 to f32",
               _fptosi, True),
    "sin": ("%r = math.sin %v : f32", torch.sin, False),
    "exp2": ("%r = math.exp2 %v : f32", torch.exp2, False),
    "log2": ("%r = math.log2 %v : f32", torch.log2, False),
}

OPERATOR = """
abp.operator @test_scalar_{name} forward {{
^bb0(%x: tensor<?xf32>):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {{
  ^bb0(%v: f32):
    {body}
    abp.yield %r : f32
  }}
  abp.return %y : tensor<?xf32>
}} backward {{
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}}
"""


@pytest.fixture(scope="module")
def compiled() -> None:
    compiler_or_skip()
    if "test_scalar_ceil" not in abp.operators():
        ir = "".join(OPERATOR.format(name=n, body=b) for n, (b, _, _) in CASES.items())
        abp.compile_operators(ir, origin="scalar_ops.mlir")


def _inputs() -> torch.Tensor:
    grid = torch.arange(-8.0, 8.0, 0.25)  # quarters: every .5 tie, both signs, exact sums
    special = [0.0, -0.0, 2.5, -2.5, 0.5, -0.5, 1e10, -1e10, 3e9, float("inf"), float("-inf"),
               float("nan")]
    torch.manual_seed(0)
    return torch.cat([grid, torch.tensor(special), torch.randn(500) * 20])


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_operation_matches_torch(compiled: None, name: str) -> None:
    _, reference, exact = CASES[name]
    x = _inputs()
    if name == "log2":
        x = x.abs()
    y = abp.functional.apply(f"test_scalar_{name}", x)
    expected = reference(x)
    if exact:
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
        # -0.0 and 0.0 compare equal: the sign bit must match too.
        assert torch.equal(torch.signbit(y[~y.isnan()]), torch.signbit(expected[~y.isnan()]))
    else:
        torch.testing.assert_close(y, expected, rtol=2.5e-7, atol=1e-7, equal_nan=True)
