"""No host synchronisation in abp's ops and recipes (issue #16 item 3), checked on the CPU.

On a GPU, tests/python/test_cuda_capture.py runs each case of bench/capture_probe.py under
torch.cuda.set_sync_debug_mode("error") and captures it in a CUDA graph. Here the same cases run
on the CPU under capture_probe.HostReads, a torch function mode that records every call reading
tensor values on the host (item, bool, nonzero, unique, .cpu(), ...): what would synchronise on
a GPU. A step of each case (after warm-up steps, as the probe does) must make none. The sampled
layers make their plans on the device (abp.sampling.plan_rows); a controller's estimation step
replays the model and is left out (capture_probe.NOT_YET).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import abp
from abp_reference import library_or_skip

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import capture_probe  # noqa: E402

CPU = torch.device("cpu")
CASES = [pytest.param(name, make, id=name)
         for name, make, _ in capture_probe.cases(CPU) if name not in capture_probe.NOT_YET]


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def _reads(make, steps: int = 3):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    x = torch.randn(capture_probe.ROWS, capture_probe.COLS, requires_grad=True)
    step = make()
    for _ in range(steps):
        x.grad = None
        step(x)
    x.grad = None
    with capture_probe.HostReads() as reads:
        step(x)
    return reads.reads


@pytest.mark.parametrize("name, make", CASES)
def test_a_step_reads_nothing_on_the_host(name, make) -> None:  # type: ignore[no-untyped-def]
    assert _reads(make) == [], name


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):  # type: ignore[no-untyped-def, override]
        return a * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        float(g.sum())  # a host read in backward
        return g * 2


def test_the_shim_sees_host_reads() -> None:
    """The negative control: reads a synchronising step would make are recorded, in forward and
    in backward; casts, sized ops and a key drawn on the host are not."""
    x = torch.randn(8)
    with capture_probe.HostReads() as reads:
        bool(x.sum() > 0)
        int(x.argmax())
        x.nonzero()
        x.cpu()
        x[x > 0]
        torch.where(x > 0)
        f"{x.sum():.3f}"
        x.to(torch.float64)  # a cast, no read
        torch.where(x > 0, x, 0.0)  # a select, no read
        torch.repeat_interleave(x, 2, output_size=16)  # sized: no read
        int(torch.randint(0, 10, (1,)).item())  # a key drawn on the host
    expected = ["__bool__", "__int__", "nonzero", "cpu", "__getitem__", "where", "__format__"]
    if not hasattr(torch, "compile"):  # torch 1.13 does not hand a mode a mask's indexing
        expected.remove("__getitem__")
    assert reads.reads == expected
    a = torch.randn(4, requires_grad=True)
    with capture_probe.HostReads() as reads:
        _ReadsInBackward.apply(a).sum().backward()
    assert reads.reads == ["__float__"] and torch.equal(a.grad, torch.full((4,), 2.0))


def test_sampled_layer_with_a_grad_norm_cache_reads_nothing() -> None:
    """WTA-CRS with cached ‖dY_t‖ (p ∝ ‖x_t‖·γ_t): the γ lookup and record stay on the device."""
    layer = abp.nn.SampledLinear(capture_probe.COLS, capture_probe.COLS)
    cache = abp.sampling.GradNormCache(num_examples=8, tokens=capture_probe.ROWS // 4, dtype=torch.float32)
    cache.attach(layer)
    ids = torch.arange(4)
    x = torch.randn(4, capture_probe.ROWS // 4, capture_probe.COLS, requires_grad=True)
    for _ in range(2):  # the second visit has every example's γ
        with cache.batch(ids):
            layer(x).square().sum().backward()
    with cache.batch(ids):
        with capture_probe.HostReads() as reads:
            layer(x).square().sum().backward()
    assert reads.reads == []
