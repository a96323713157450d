"""GACT compression on CUDA tensors (NVRTC path); skipped without a CUDA build of torch and a GPU.

The GPU must store the very codes, minima and scales the CPU path stores for the same seed
(docs/algorithms.md §9.5), decode to the same values, keep unbiasedness, and count the same bytes.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import abp.compress as C
from abp_reference import library_or_skip, unpack_codes
import gact_reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA and a GPU")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


@pytest.mark.parametrize("bits", C.BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("n,group", [(1, 256), (257, 256), (100_003, 256), (5000, 2048), (4099, 8)])
def test_cuda_codes_equal_the_cpu_path_bit_for_bit(bits, dtype, n, group):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4).to(dtype)
    x[n // 2] = 0.0
    cpu = C.quantize(x, bits, group, seed=77)
    gpu = C.quantize(x.to(CUDA), bits, group, seed=77)
    for p, q in zip(cpu.parts, gpu.parts):
        assert torch.equal(p.codes, q.codes.cpu())
        assert torch.equal(p.mins, q.mins.cpu()) and torch.equal(p.scales, q.scales.cpu())
    assert gpu.nbytes == cpu.nbytes
    assert torch.equal(C.dequantize(gpu).cpu(), C.dequantize(cpu))


def test_cuda_codes_equal_the_numpy_reference():
    x = torch.randn(3 * 256 + 17, generator=torch.Generator().manual_seed(1))
    c = C.quantize(x.to(CUDA), 4, 256, seed=123456789)
    codes, mins, scales = ref.quantize_groups(x, 4, 256, 123456789)
    got = np.concatenate([unpack_codes(p.codes.cpu(), 4, p.numel).numpy() for p in c.parts])
    assert np.array_equal(got, codes)
    assert np.array_equal(torch.cat([p.mins for p in c.parts]).cpu().numpy(), mins)
    assert np.array_equal(torch.cat([p.scales for p in c.parts]).cpu().numpy(), scales)


def test_cuda_dequantize_is_unbiased():
    x = torch.randn(512, generator=torch.Generator().manual_seed(2)).to(CUDA)
    runs = 2000
    mean = torch.zeros(512, dtype=torch.float64, device=CUDA)
    for r in range(runs):
        mean += C.dequantize(C.quantize(x, 2, 128, seed=r)).double()
    mean /= runs
    v = torch.from_numpy(ref.variance(x.cpu(), 2, 128)).to(CUDA)
    t = runs * ((mean - x.double()) ** 2).sum() / v.sum()
    lam = v / v.sum()
    assert t <= 1 + 2 * math.sqrt(10 * (lam**2).sum()) + 20 * lam.max()


def test_cuda_compress_saved_bytes_and_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(CUDA)
    x = torch.randn(64, 1024, device=CUDA)
    model(x).square().mean().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with C.compress_saved(bits=8) as saved:
        model(x).square().mean().backward()
    # x (for dW1), the GELU's input, its output (for dW2) and the output (for the square).
    sizes = [64 * 1024, 64 * 1024, 64 * 1024, 64 * 256]
    assert saved.stats["compressed"] == 4
    assert saved.stats["bytes_compressed"] == sum(n + math.ceil(n / 256) * 8 for n in sizes)
    for p, g in zip(model.parameters(), exact):
        assert (p.grad - g).norm() <= 0.05 * g.norm()
