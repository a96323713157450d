"""MS-LayerNorm / MS-RMSNorm on CUDA tensors; skipped without a CUDA build of torch and a GPU.

The CPU path runs the same row kernels by loop fission with a host replay of the GPU's reduction
order, and the norms use only correctly rounded fp32 operations (+, -, *, /, sqrt; NVRTC compiles
with --fmad=false): so the GPU and the CPU path must agree bit for bit, in warp mode (rows <= 1024
columns) and in block mode (longer rows, shared memory and barriers).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import abp
from abp_reference import library_or_skip

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA and a GPU")

NORMS = [(abp.functional.ms_layer_norm, 1e-5), (abp.functional.ms_rms_norm, 1e-6)]


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("cols", [1, 7, 9, 256, 1000, 1024, 1025, 3001, 8192, 20000])
@pytest.mark.parametrize("fn,eps", NORMS)
def test_cuda_norms_equal_the_cpu_path_bit_for_bit(fn, eps, cols, dtype):
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(37, cols, generator=gen) * 2 + 0.5).to(dtype)
    g = torch.randn(37, cols, generator=gen).to(dtype)
    xc = x.clone().requires_grad_()
    xg = x.cuda().requires_grad_()
    yc, yg = fn(xc, cols, eps), fn(xg, cols, eps)
    assert torch.equal(yc, yg.cpu())
    (dc,) = torch.autograd.grad(yc, xc, g)
    (dg,) = torch.autograd.grad(yg, xg, g.cuda())
    assert torch.equal(dc, dg.cpu())


@pytest.mark.parametrize("fn,eps", NORMS)
def test_cuda_norms_match_torch_and_share_the_linear_input(fn, eps):
    torch.manual_seed(0)
    lin = torch.nn.Linear(768, 64).cuda()
    x = torch.randn(64, 768, device="cuda", requires_grad=True)
    with abp.memory.SavedTensorsCounter() as counter:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, 768, eps)
            out = lin(y)
    assert y.dtype == torch.bfloat16
    like_y = [s for s in counter.tensors if s.shape == tuple(y.shape)]
    assert like_y and all((s.device, s.storage_ptr, s.storage_bytes) == abp.memory.storage_key(y) for s in like_y)
    out.float().sum().backward()
    ref = F.layer_norm(x.detach(), (768,), eps=eps) if fn is abp.functional.ms_layer_norm else None
    if ref is not None:
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)


def test_cuda_norms_large_rows_and_streams():
    x = torch.randn(3, 1 << 20, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = abp.functional.ms_rms_norm(x, 1 << 20)
    s.synchronize()
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
