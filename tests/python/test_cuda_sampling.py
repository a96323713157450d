"""Sampled linear layers and VCAS on CUDA tensors (NVRTC path); skipped without a CUDA build of
torch and a GPU.

The GPU must draw the very numbers, make the very choices (indices) and gather the very rows the
CPU path does for the same seed (docs/algorithms.md §9.5); forward stays exact, dW unbiased.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from abp import _sample_kernels as kernels
from abp import _plan_lane, sampling, vcas
from abp_reference import library_or_skip

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA and a GPU")

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def test_draws_and_rademacher_sketches_equal_the_cpu_path() -> None:
    for n, offset in ((1, 0), (1027, 5), (1 << 20, 3)):
        assert torch.equal(kernels.uniform(n, 42, offset, CUDA).cpu(), kernels.uniform(n, 42, offset, CPU))
    assert torch.equal(kernels.sketch("rademacher", 37, 129, 9, 0, CUDA).cpu(), kernels.sketch("rademacher", 37, 129, 9, 0, CPU))
    # Gaussian: same draws, cos/log may differ in the last ulps between the device and host libm.
    torch.testing.assert_close(kernels.sketch("gaussian", 37, 129, 9, 0, CUDA).cpu(),
                               kernels.sketch("gaussian", 37, 129, 9, 0, CPU), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("cols", [1, 100, 1024, 5000])
def test_kernels_equal_the_cpu_path(dtype: torch.dtype, cols: int) -> None:
    x = torch.randn(301, cols, generator=torch.Generator().manual_seed(cols), dtype=torch.float64).to(dtype)
    index = torch.tensor([300, -1, 0, 17, 17, 5], dtype=torch.int32)
    weight = torch.rand(6, dtype=torch.float64 if dtype == torch.float64 else torch.float32) + 0.5
    assert torch.equal(kernels.sample_rows(x.to(CUDA), index.to(CUDA), weight.to(CUDA)).cpu(), kernels.sample_rows(x, index, weight))
    slot = torch.full((301,), -1, dtype=torch.int32)
    slot[::7] = torch.arange(0, 301, 7, dtype=torch.int32) % 6
    kept = kernels.sample_rows(x, index, weight)
    assert torch.equal(kernels.unsample_rows(kept.to(CUDA), slot.to(CUDA)).cpu(), kernels.unsample_rows(kept, slot))
    # The plans rely on this: the CPU path replays the GPU's reduction order (as for the norms).
    assert torch.equal(kernels.row_norms(x.to(CUDA)).cpu(), kernels.row_norms(x))


def test_plans_are_the_same_choices_on_both_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(3))
    gamma = torch.rand(4096, generator=torch.Generator().manual_seed(4))
    for method, g in (("wtacrs", None), ("crs", None), ("wtacrs", gamma), ("uniform", None)):
        cpu = sampling.plan_rows(x, 1228, method, seed=11, gamma=g)
        gpu = sampling.plan_rows(x.to(CUDA), 1228, method, seed=11, gamma=None if g is None else g.to(CUDA))
        # Made on each device from the kernels' norms and draws (the same bits on both), with exact
        # sums (selection.integer_masses): the same slots.
        assert torch.equal(cpu.index, gpu.index.cpu()) and torch.equal(cpu.weight, gpu.weight.cpu()), method
        # The same from the Python functions on the GPU (the C++ lane's row plan turned off).
        with monkeypatch.context() as m:
            m.setattr(_plan_lane, "module", lambda: None)
            python = sampling.plan_rows(x.to(CUDA), 1228, method, seed=11, gamma=None if g is None else g.to(CUDA))
        assert torch.equal(python.index, gpu.index) and torch.equal(python.weight, gpu.weight), method


@pytest.mark.parametrize("method", sampling.METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sampled_linear_forward_exact_and_backward_runs(method: str, dtype: torch.dtype) -> None:
    x = torch.randn(8, 128, 256, device=CUDA, dtype=dtype, requires_grad=True)
    lin = torch.nn.Linear(256, 64).to(CUDA, dtype)
    y = sampling.sampled_linear(x, lin.weight, lin.bias, method=method, keep=0.3, seed=1)
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    y.float().square().mean().backward()
    assert lin.weight.grad.dtype == dtype and torch.isfinite(lin.weight.grad).all()


@pytest.mark.parametrize("method", sampling.METHODS)
def test_dw_is_unbiased_on_the_gpu(method: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(24, 4, generator=g, dtype=torch.float64) * torch.logspace(0, 2, 24, dtype=torch.float64)[:, None]).to(CUDA)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64).to(CUDA)
    grad = torch.randn(24, 3, generator=g, dtype=torch.float64).to(CUDA)
    draws = []
    for r in range(1000):
        wr = w.clone().requires_grad_()
        sampling.sampled_linear(x, wr, None, method=method, keep=0.5, seed=r).backward(grad)
        draws.append(wr.grad)
    draws = torch.stack(draws)
    exact = grad.t() @ x
    z = ((draws.mean(0) - exact) * math.sqrt(1000) / draws.std(0)).abs().max().item()
    from statistics import NormalDist
    assert z <= NormalDist().inv_cdf(1 - 1e-4 / (2 * exact.numel()))


def test_vcas_controller_on_the_gpu() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(32, 32)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + torch.relu(self.fc(h))

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(32, 1)).to(CUDA)
    controller = vcas.Controller(model, Block, act_var_tau=1e9, w_var_tau=1e9)
    data = [torch.randn(64, 16, 32, device=CUDA) for _ in range(3)]
    controller.calibrate(lambda b: model(b).square().mean(), data[:2])
    assert controller.s < 1 and all(v < 1 for v in controller.weight_ratios.values())
    model(data[2]).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_vcas_weight_sampler_fp16_rows_do_not_overflow() -> None:
    # 1/q grows as ‖X_t‖ shrinks: weighted in fp32, the fp16 estimate stays finite (no fp16 GEMM
    # on the CPU in torch 1.13, so this runs here).
    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 3, generator=g, dtype=torch.float64)
    grad = torch.randn(24, 2, generator=g, dtype=torch.float64) * 100
    x[3] *= 1e-4
    w = torch.randn(2, 3, generator=g, dtype=torch.float64)
    for seed in range(20):
        out = vcas.sampled_linear_grads(x.half().to(CUDA), grad.half().to(CUDA), w.half().to(CUDA), 0.3, seed, (6, 4))
        assert out.dw.dtype == torch.float16 and torch.isfinite(out.dw).all()
