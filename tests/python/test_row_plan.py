"""The sampled layers' row plan in C++ (abp/_row_plan.cpp) against the Python functions it mirrors.

abp.sampling.plan_rows takes the C++ lane's row_plan where the lane is built, and abp._selection's
integer_masses, uniforms48 and plan_slots otherwise. Both must give the same slots bit for bit
(index, weight, NaN included, and winner count): the CPU and GPU plans are held equal elsewhere,
and a plan must not depend on whether a machine could build the lane."""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from abp import _plan_lane, sampling
from abp import _selection as S
from abp_reference import built_lane as _lane, library_or_skip

METHODS = ("wtacrs", "crs", "uniform")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def _plans(monkeypatch: pytest.MonkeyPatch, x: torch.Tensor, k: int, method: str, seed: int,
           gamma: Optional[torch.Tensor]) -> tuple:
    """plan_rows through the C++ lane, then through the Python functions (the lane turned off)."""
    lane = _lane()
    calls = []
    real = lane.row_plan

    class Spy:
        def __getattr__(self, name: str):
            return getattr(lane, name)

        def row_plan(self, *args):
            calls.append(args)
            return real(*args)
    with monkeypatch.context() as m:
        m.setattr(_plan_lane, "module", lambda: Spy())
        native = sampling.plan_rows(x, k, method, seed, gamma=gamma)
    assert len(calls) == 1, "plan_rows did not take the C++ lane's row plan"
    with monkeypatch.context() as m:
        m.setattr(_plan_lane, "module", lambda: None)
        python = sampling.plan_rows(x, k, method, seed, gamma=gamma)
    return native, python


def _assert_same(native: S.Slots, python: S.Slots) -> None:
    assert native.index.dtype == python.index.dtype == torch.int32
    assert native.weight.dtype == python.weight.dtype == torch.float64
    assert native.winners.dtype == python.winners.dtype == torch.int64 and native.winners.dim() == 0
    assert torch.equal(native.index, python.index)
    assert torch.equal(native.weight.view(torch.int64), python.weight.view(torch.int64)), "weights differ in bits"
    assert torch.equal(native.winners, python.winners)


def _rows(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, 8, generator=gen) * torch.rand(n, 1, generator=gen) ** 4
    if kind == "special" and n < 8:  # a zero row
        x[0] = 0.0
    elif kind == "special":  # a zero row, an infinite one, a NaN one, one whose norm overflows
        x[1] = 0.0
        x[3, 2] = math.inf
        x[5, 0] = math.nan
        x[6] = 3e38
    elif kind == "zeros":
        x.zero_()
    elif kind == "skewed":  # a few rows hold nearly all the mass: WTA-CRS keeps them as winners
        x[:4] *= 1e4
    elif kind == "ties":  # equal norms: ties go to the lower index
        x = torch.ones(n, 8)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["random", "special", "zeros", "skewed", "ties"])
def test_the_lanes_plans_are_the_same_bits(monkeypatch: pytest.MonkeyPatch, device: str, method: str,
                                          kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    for n, k in ((64, 19), (12, 10), (300, 90), (2, 1), (1000, 999)):
        x = _rows(kind, n, gen).to(device)
        for gamma in (None, torch.rand(n, generator=gen, dtype=torch.float64).to(device)):
            native, python = _plans(monkeypatch, x, k, method, seed=n * 31 + k, gamma=gamma)
            _assert_same(native, python)


@pytest.mark.parametrize("method", METHODS)
def test_gamma_without_information_and_fp64_rows(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """γ all zero, negative or not finite (‖x‖ alone), fp32 γ, and fp64 rows (fp64 norms)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(50, 6, generator=gen)
    for gamma in (torch.zeros(50), -torch.ones(50), torch.full((50,), math.nan), torch.rand(50, generator=gen)):
        _assert_same(*_plans(monkeypatch, x, 20, method, seed=3, gamma=gamma))
    _assert_same(*_plans(monkeypatch, x.double(), 20, method, seed=4, gamma=None))


def test_more_slots_than_rows_and_negative_scores() -> None:
    """What plan_rows never asks (k > N, negative scores) still matches the Python functions:
    every row may win, and a negative score makes every weight NaN."""
    lane = _lane()
    u = torch.rand(2 * 9, generator=torch.Generator().manual_seed(9))
    for scores in (torch.tensor([3.0, 1.0, 2.0, 0.5]), torch.tensor([3.0, -1.0, 2.0, 0.5])):
        for method in METHODS:
            masses, usable = S.integer_masses(scores, None, 0.1)
            if method == "uniform":
                masses = torch.where(torch.isinf(scores), masses, torch.ones_like(masses))
            python = S.plan_slots(masses, usable, 9, S.uniforms48(u), method)
            native = S.Slots(*lane.row_plan(scores, None, u, 9, method, 0.1))
            _assert_same(native, python)


def test_declined_gammas_take_the_python_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A γ the lane does not take (integer, wrong length) reaches the Python functions' errors."""
    x = torch.randn(20, 4)
    with pytest.raises(ValueError, match="other: expected a floating-point tensor"):
        sampling.plan_rows(x, 8, "wtacrs", 1, gamma=torch.ones(20, dtype=torch.int64))
    with pytest.raises(ValueError, match="other: expected 20 entries"):
        sampling.plan_rows(x, 8, "wtacrs", 1, gamma=torch.ones(19))
