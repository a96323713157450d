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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_cuda_headers_of_nan_and_zero_groups_equal_the_cpu_paths_bits(dtype):
    """From sm_80 on the range sweep combines with max.NaN / min.NaN (a canonical NaN, either
    zero), the CPU path with the IEEE maximum (the NaN operand itself): each reduction leaves as
    the one quiet NaN and +0 (abp::reduceResult), so the headers are the same bits. torch.equal
    would not tell: it takes -0 for +0 and NaN for unequal to itself, hence the bit views."""
    x = torch.rand(64 * 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 1
    x[5] = torch.tensor([-2**63 + 0x7FF8_0000_0000_1234], dtype=torch.int64).view(torch.float64)[0]
    x[16:32] = 0.5
    x[16 + 3] = -0.0  # a -0 minimum
    x[32:48] = -0.5
    x[32 + 7] = -0.0  # a -0 maximum
    x[48 + 2] = math.inf
    x = x.to(dtype)
    bits = torch.int64 if dtype == torch.float64 else torch.int32
    cpu = C.quantize(x, 4, 16, seed=3)
    gpu = C.quantize(x.to(CUDA), 4, 16, seed=3)
    for p, q in zip(cpu.parts, gpu.parts):
        assert torch.equal(p.codes, q.codes.cpu())
        assert torch.equal(p.mins.view(bits), q.mins.cpu().view(bits))
        assert torch.equal(p.scales.view(bits), q.scales.cpu().view(bits))


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


@pytest.mark.parametrize("recompute", [False, True])
def test_cuda_compress_saved_bytes_and_gradients(recompute):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(CUDA)
    x = torch.randn(64, 1024, device=CUDA)
    model(x).square().mean().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with C.compress_saved(bits=8, recompute=recompute) as saved:
        model(x).square().mean().backward()
    # x (for dW1) is off the gradient path (a constant of backward): kept as it is. Compressed: the
    # GELU's input, its output (for dW2; recomputed from the input instead, with recompute) and the
    # output (for the square).
    sizes = [64 * 1024, 64 * 256] if recompute else [64 * 1024, 64 * 1024, 64 * 256]
    assert saved.stats["compressed"] == len(sizes)
    assert saved.stats["derived"] == int(recompute)
    assert saved.stats["bytes_compressed"] == sum(n + math.ceil(n / 256) * 8 for n in sizes)
    assert saved.stats["bytes_stored"] == saved.stats["bytes_compressed"] + 64 * 1024 * 4
    for p, g in zip(model.parameters(), exact):
        assert (p.grad - g).norm() <= 0.05 * g.norm()


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_fused_attention_is_recomputed_from_its_decoded_inputs(backend, dtype):
    """Under compress_saved, each CUDA fused-attention kernel's output and logsumexp are recomputed
    by the same kernel from the decoded q, k and v (abp._save_rules.attention_kernel): the
    gradients are exactly those of that kernel at the decoded values."""
    attention = pytest.importorskip("torch.nn.attention")
    kind = getattr(attention.SDPBackend, backend, None)
    if kind is None:
        pytest.skip(f"torch has no {backend}")
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(2, 4, 128, 64, generator=g).to(CUDA, dtype).requires_grad_() for _ in range(3)]
    q, k, v = (t * 1.0 for t in leaves)  # activations (a leaf that requires grad counts as a parameter)
    d_out = torch.randn(2, 4, 128, 64, generator=g).to(CUDA, dtype)
    try:
        with attention.sdpa_kernel(kind), C.compress_saved(bits=4, min_numel=1) as block:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except RuntimeError as e:  # this GPU or build has no such kernel for these inputs
        pytest.skip(f"{backend}: {e}")
    assert block.stats["derived"] == 1, (backend, type(out.grad_fn).__name__, block.stats)
    node = out.grad_fn
    decoded = [getattr(node, name).detach().requires_grad_() for name in ("_saved_query", "_saved_key", "_saved_value")]
    got = torch.autograd.grad(out, (q, k, v), d_out)
    with attention.sdpa_kernel(kind):
        reference = torch.nn.functional.scaled_dot_product_attention(*decoded, is_causal=True)
    want = torch.autograd.grad(reference, decoded, d_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), backend
