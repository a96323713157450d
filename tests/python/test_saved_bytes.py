"""Saved bytes are exactly the packed codes, and the input is freed after forward (docs/algorithms.md §9.4)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import abp
from abp_reference import (
    bucket_codes,
    f32,
    library_or_skip,
    manifest_table,
    packed,
    retains_input,
    tail_bits_are_zero,
    unpack_codes,
)


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


SIZES = [0, 1, 2, 3, 5, 7, 8, 9, 255, 256, 257, 2**20 + 3]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_fewbit_saves_exactly_k_bits_per_element(bits, n):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 2).requires_grad_()
    for weight in ("normal", "uniform"):
        saved = abp.memory.saved_bytes(abp.functional.gelu, x, bits=bits, weight=weight)
        # ceil(b*N/8): FewBit's original stored bit_length(2^b) = b + 1 bits and must fail here.
        assert saved == packed(bits, n), (bits, n, weight, saved)
        if n >= 8:
            assert saved != packed(bits + 1, n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codes_follow_the_packing_layout_and_the_tail_is_zero(bits, n):
    op = abp.functional.fewbit_operator("silu", bits)
    x = (torch.randn(n, generator=torch.Generator().manual_seed(bits * n)) * 2).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = abp.functional.silu(x, bits=bits)
    (codes,) = saved
    assert codes.dtype == torch.uint8 and codes.numel() == packed(bits, n)
    assert tail_bits_are_zero(codes, bits, n)
    borders, levels = (f32(v) for v in manifest_table(op))
    assert torch.equal(unpack_codes(codes, bits, n), bucket_codes(x.detach(), borders))
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(x))
    assert torch.equal(dx, levels[bucket_codes(x.detach(), borders)])


def test_the_layout_decoder_itself():
    # Negative control for unpack_codes: a hand-packed 3-bit stream (codes 2 and 5 straddle bytes).
    codes = [1, 2, 3, 4, 5, 6, 7, 0, 5]
    stream = 0
    for e, c in enumerate(codes):
        stream |= c << (3 * e)
    data = torch.tensor(list(stream.to_bytes(packed(3, len(codes)), "little")), dtype=torch.uint8)
    assert unpack_codes(data, 3, len(codes)).tolist() == codes
    assert tail_bits_are_zero(data, 3, len(codes))
    assert not tail_bits_are_zero(torch.tensor([0xFF, 0xFF, 0xFF, 0xFF], dtype=torch.uint8), 3, 9)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op,bits", [("regelu2", 2), ("resilu2", 2), ("relu", 1), ("hardsigmoid", 1)])
def test_bucket_and_piecewise_operators_save_their_codes_only(op, bits, n):
    x = torch.randn(n, requires_grad=True)
    assert abp.memory.saved_bytes(abp.functional.apply, op, x) == packed(bits, n)


@pytest.mark.parametrize("n", SIZES)
def test_gelu_tanh_form_saves_2_bits_regelu2_and_k_bits_fewbit(n):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n + 1)) * 2).requires_grad_()
    assert abp.memory.saved_bytes(abp.functional.regelu2, x, approximate="tanh") == packed(2, n)
    assert abp.memory.saved_bytes(abp.nn.ReGELU2(approximate="tanh"), x) == packed(2, n)
    for bits in (1, 2, 3, 4):
        for weight in ("normal", "uniform"):
            saved = abp.memory.saved_bytes(abp.functional.gelu, x, approximate="tanh", bits=bits, weight=weight)
            assert saved == packed(bits, n), (bits, n, weight, saved)
            if n >= 8:
                assert saved != packed(bits + 1, n)
        assert abp.memory.saved_bytes(abp.nn.GELU(approximate="tanh", bits=bits), x) == packed(bits, n)


def test_gelu_tanh_codes_follow_the_packing_layout():
    n = 1003
    x = (torch.randn(n, generator=torch.Generator().manual_seed(11)) * 3).requires_grad_()
    for op, bits, fn in [("regelu2_tanh", 2, lambda t: abp.functional.regelu2(t, approximate="tanh"))] + [
        (f"gelu_tanh_b{b}", b, lambda t, b=b: abp.functional.gelu(t, approximate="tanh", bits=b)) for b in (1, 2, 3, 4)
    ]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(x)
        (codes,) = saved
        assert codes.dtype == torch.uint8 and codes.numel() == packed(bits, n) and tail_bits_are_zero(codes, bits, n)
        borders, _ = (f32(v) for v in manifest_table(op))
        assert torch.equal(unpack_codes(codes, bits, n), bucket_codes(x.detach(), borders)), op


@pytest.mark.parametrize("op,params", [("leaky_relu", (0.2,)), ("threshold", (0.1, 5.0)), ("hardtanh", (-2.0, 2.0))])
def test_parameters_are_not_saved_per_element(op, params):
    n = 1001
    x = torch.randn(n, requires_grad=True)
    # A scalar residual (leaky_relu's slope) lives on ctx as a float: no tensor, no bytes.
    assert abp.memory.saved_bytes(abp.functional.apply, op, x, params) == packed(1, n)


def test_every_module_saves_its_manifest_bits_per_element():
    n = 4099
    x = torch.randn(n, requires_grad=True)
    modules = [abp.nn.ReGELU2(), abp.nn.ReSiLU2(), abp.nn.ReLU(), abp.nn.LeakyReLU(0.3), abp.nn.Softshrink()]
    modules += [getattr(abp.nn, cls)(bits=b) for cls in ("GELU", "SiLU", "Tanh", "Mish") for b in (1, 2, 3, 4)]
    for module in modules:
        expected = packed(int(module.saved_bits_per_element), n)
        assert abp.memory.saved_bytes(module, x) == expected, module


def test_counter_tags_attribute_saves_to_parts_of_a_model():
    x = torch.randn(100, requires_grad=True)
    with abp.memory.SavedTensorsCounter() as counter:
        counter.tag = "act"
        h = abp.functional.regelu2(x)
        counter.tag = None
        F.gelu(h)
    assert counter.bytes_tagged("act") == packed(2, 100)
    assert counter.bytes_tagged(None) == 400 and counter.total_bytes == 400 + packed(2, 100)


def test_nothing_is_saved_without_grad():
    x = torch.randn(1000, requires_grad=True)
    with torch.no_grad():
        assert abp.memory.saved_bytes(abp.functional.regelu2, x) == 0
    assert abp.memory.saved_bytes(abp.functional.regelu2, x.detach()) == 0


def test_counter_sees_the_exact_ops_residual_and_counts_storages_once():
    # Negative control for the counter itself: torch's exact GELU saves its fp32 input (4 bytes/element).
    x = torch.randn(1000, requires_grad=True)
    assert abp.memory.saved_bytes(F.gelu, x) == 4000

    with abp.memory.SavedTensorsCounter() as counter:
        _SavesViews.apply(x)
    assert len(counter.tensors) == 4
    assert counter.total_bytes == 4000 + 40  # u's storage once (three views of it), plus v


class _SavesViews(torch.autograd.Function):
    """Saves one 1000-element storage through three views, and a separate 10-element tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        u = x * 2
        v = x[:10] * 3
        ctx.save_for_backward(u, u[:10], u.view(10, 100), v)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


class _KeepsInputOnCtx(torch.autograd.Function):
    """Negative control: the mistake abp must not make (ctx.x = x)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.x = x
        return abp.functional.relu(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * (ctx.x > 0)


def test_the_retention_check_catches_a_kept_input():
    assert retains_input(_KeepsInputOnCtx.apply)
    assert retains_input(F.gelu)  # torch's exact GELU saves x
    assert not retains_input(lambda x: x * 2.0)


@pytest.mark.parametrize(
    "fn",
    [
        abp.functional.regelu2,
        abp.functional.resilu2,
        lambda x: abp.functional.gelu(x, bits=3),
        lambda x: abp.functional.silu(x, bits=1, weight="uniform"),
        abp.functional.relu,
        lambda x: abp.functional.leaky_relu(x, 0.2),
        lambda x: abp.functional.hardtanh(x, -0.5, 0.5),
    ],
    ids=["regelu2", "resilu2", "gelu_b3", "silu_b1_uniform", "relu", "leaky_relu", "hardtanh"],
)
def test_input_is_freed_after_forward(fn):
    assert not retains_input(fn)
    # A non-contiguous input is copied for the kernel; neither the copy nor the original is kept.
    assert not retains_input(fn, view=lambda t: t.t())


def test_input_is_freed_inside_a_model():
    model = torch.nn.Sequential(abp.nn.GELU(bits=2), abp.nn.ReSiLU2(), abp.nn.Hardshrink(0.1))
    assert not retains_input(model)
    # The model's retained bytes are its codes only: 2 + 2 + 1 bits per element.
    x = torch.randn(64, 4096).mul(1.0).requires_grad_()
    n = x.numel()
    assert abp.memory.saved_bytes(model, x) == packed(2, n) + packed(2, n) + packed(1, n)
