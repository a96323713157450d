"""The same properties on CUDA tensors (NVRTC path); skipped without a CUDA build of torch and a GPU."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import abp
from abp import _custom_ops
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
    library_or_skip,
    manifest_table,
    packed,
    sample_inputs,
    torch_grad,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA and a GPU")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def bucket_cases():
    cases = [(op, lambda x, op=op: getattr(abp.functional, op)(x), BUCKET_TORCH[op]) for op in BUCKET_TORCH]
    for act in CONTINUOUS_TORCH:
        for bits in (1, 2, 3, 4):
            op = abp.functional.fewbit_operator(act, bits)
            cases.append((op, lambda x, a=act, b=bits: getattr(abp.functional, a)(x, bits=b), CONTINUOUS_TORCH[act]))
    cases.append(("gelu_b3_uniform", lambda x: abp.functional.gelu(x, bits=3, weight="uniform"), F.gelu))
    # GELU's tanh form: ReGELU2-tanh and the FewBit tables (tables from the manifests).
    gelu_tanh = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731
    cases.append(("regelu2_tanh", lambda x: abp.functional.regelu2(x, approximate="tanh"), gelu_tanh))
    for bits in (1, 2, 3, 4):
        op = abp.functional.fewbit_operator("gelu_tanh", bits)
        cases.append((op, lambda x, b=bits: abp.functional.gelu(x, approximate="tanh", bits=b), gelu_tanh))
    return cases


BUCKETS = bucket_cases()


def table(op: str):
    if op in BUCKET_DOC_TABLES:
        return tuple(f32(v) for v in BUCKET_DOC_TABLES[op])
    return tuple(f32(v) for v in manifest_table(op))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("op,fn,torch_fn", BUCKETS, ids=[c[0] for c in BUCKETS])
def test_cuda_bucket_forward_backward_and_codes_equal_the_cpu_path(op, fn, torch_fn, dtype):
    borders, levels = table(op)
    up = torch.nextafter(borders, torch.full_like(borders, math.inf))
    extra = [math.nan, math.inf, -math.inf, 0.0] + borders.tolist() + up.tolist()
    x_cpu = sample_inputs(100_003, dtype, extra=extra, seed=21)
    dy_cpu = sample_inputs(x_cpu.numel(), dtype, seed=22)
    x = x_cpu.to(CUDA).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fn(x)
    assert y.device.type == "cuda" and len(saved) == 1 and saved[0].numel() == packed(int(math.log2(levels.numel())), x.numel())
    assert_forward_close(y.detach().cpu(), torch_fn(x_cpu.double()), x_cpu, exact=False)
    (dx,) = torch.autograd.grad(y, x, dy_cpu.to(CUDA))
    assert_bitwise_equal(dx.cpu(), bucket_backward(x_cpu, dy_cpu, borders, levels), f"{op} backward on CUDA")
    # CPU and GPU produce the same codes, byte for byte (docs/algorithms.md §9.5).
    cpu_saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: cpu_saved.append(t) or t, lambda t: t):
        fn(x_cpu.clone().requires_grad_())
    assert torch.equal(saved[0].cpu(), cpu_saved[0])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("op,params,torch_fn", PIECEWISE_CASES, ids=[f"{c[0]}{c[1]}" for c in PIECEWISE_CASES])
def test_cuda_piecewise_equals_torch(op, params, torch_fn, dtype):
    x_cpu = sample_inputs(50_001, dtype, extra=[math.nan, math.inf, -math.inf, 0.0, 6.0, -3.0, 3.0, 0.5, -0.5], seed=23)
    dy_cpu = sample_inputs(x_cpu.numel(), dtype, seed=24)
    x = x_cpu.to(CUDA).requires_grad_()
    y = abp.functional.apply(op, x, params)
    expected = torch_fn(x_cpu.float())
    if op == "softshrink":
        expected[torch.isnan(x_cpu)] = math.nan  # see test_activations: NaN stays NaN
    assert_forward_close(y.detach().cpu(), expected, x_cpu, exact=True)
    (dx,) = torch.autograd.grad(y, x, dy_cpu.to(CUDA))
    assert_bitwise_equal(dx.cpu(), torch_grad(torch_fn, x_cpu, dy_cpu).to(dtype), f"{op} backward on CUDA")


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_cuda_saved_bytes(bits):
    for n in [0, 1, 7, 9, 257, 2**20 + 3]:
        x = torch.randn(n, device=CUDA, requires_grad=True)
        assert abp.memory.saved_bytes(abp.functional.silu, x, bits=bits) == packed(bits, n)


def test_cuda_forward_keeps_only_output_and_codes():
    torch.cuda.synchronize()
    n = 1 << 24  # 64 MiB of fp32: keeping x would show
    w = torch.zeros((), device=CUDA, requires_grad=True)
    base = torch.cuda.memory_allocated()
    x = torch.randn(n, device=CUDA) + w  # a non-leaf: nothing but x references its storage
    y = abp.functional.gelu(x, bits=3)
    del x
    torch.cuda.synchronize()
    retained = torch.cuda.memory_allocated() - base
    expected = 4 * n + packed(3, n)
    assert expected <= retained <= expected + 2 * 512, (retained, expected)
    y.sum().backward()
    assert w.grad is not None
    # Negative control: torch's exact GELU keeps its input as well.
    del y
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    x = torch.randn(n, device=CUDA) + w
    y = F.gelu(x)
    del x
    assert torch.cuda.memory_allocated() - base >= 8 * n and y.numel() == n


def test_cuda_noncontiguous_misaligned_and_large_inputs():
    base = torch.randn(513, 1031, device=CUDA)
    for x in (base.t(), base[:, ::3], base.flatten()[3:]):
        x = x.requires_grad_()
        y = abp.functional.regelu2(x)
        yc = abp.functional.regelu2(x.detach().contiguous())
        assert torch.equal(y, yc) and y.shape == x.shape
        y.backward(torch.ones_like(y))
        assert x.grad.shape == x.shape
    big = torch.randn((1 << 27) + 3, device=CUDA, requires_grad=True)  # more blocks than the grid cap
    y = abp.functional.gelu(big, bits=4)
    y.backward(torch.ones_like(y))
    borders, levels = (f32(v).to(CUDA) for v in manifest_table("gelu_b4"))
    tail = big.detach()[-1000:]
    code = (tail.reshape(-1, 1) > borders).sum(1)
    assert torch.equal(big.grad[-1000:], levels[code])


def test_cuda_runs_on_the_current_stream_and_is_deterministic():
    stream = torch.cuda.Stream()
    x = torch.randn(1 << 20, device=CUDA)
    stream.wait_stream(torch.cuda.current_stream())
    results = []
    for _ in range(2):
        with torch.cuda.stream(stream):
            xs = (x * 1.0).requires_grad_()  # produced on `stream`: the kernel must run after it
            y = abp.functional.silu(xs, bits=2)
            (dx,) = torch.autograd.grad(y, xs, torch.ones_like(y))
        stream.synchronize()
        results.append((y.detach(), dx))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][0], F.silu(x), rtol=1e-5, atol=1e-6)


def test_cuda_empty_tensor_and_device_mismatch():
    x = torch.empty(0, 3, device=CUDA, requires_grad=True)
    y = abp.functional.relu(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    with pytest.raises(ValueError, match=r"^input1: expected a tensor on cuda"):
        abp._launch.check_inputs([torch.zeros(3, device=CUDA), torch.zeros(3)], ["input0", "input1"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_second_device():
    x = torch.randn(1000, device="cuda:1", requires_grad=True)
    y = abp.functional.regelu2(x)
    assert y.device == x.device
    y.sum().backward()
    assert x.grad.device == x.device
    torch.testing.assert_close(y, F.gelu(x), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not _custom_ops.supported_torch(), reason="torch.compile with custom ops needs torch >= 2.4")
def test_cuda_inductor_compile_keeps_the_saving():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), abp.nn.GELU(bits=2), torch.nn.Linear(1024, 256)).to(CUDA)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(512, 256, device=CUDA)
    compiled(x).sum().backward()  # compile (forward and backward) before measuring
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = compiled(x)
    torch.cuda.synchronize()
    retained = torch.cuda.memory_allocated() - base - out.numel() * 4
    # Newly kept for backward (x and the weights existed before): the GELU output (the second
    # Linear's input, for dW2) and the 2-bit codes; not the GELU input (another 2 MiB).
    expected = 4 * 512 * 1024 + packed(2, 512 * 1024)
    assert retained <= expected + 64 * 1024, (retained, expected)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)
