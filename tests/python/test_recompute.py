"""compress_saved(recompute=True): saved tensors that cheap functions made from stored tensors are
recomputed in backward (abp._derived), fused attention's output and logsumexp with them.

Kept raw, recomputing changes no gradient bit and stores less; compressed, the gradient is the
exact gradient at the decoded tensors (the relations backward relies on hold). Needs torch >= 2
(ATen's op tags); on torch 1.13 nothing is recomputed and these tests are skipped.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abp
import abp.compress as C
from abp import _derived
from abp_reference import library_or_skip

pytestmark = pytest.mark.skipif(not _derived.AVAILABLE, reason="recompute needs torch >= 2 (ATen op tags)")


@pytest.fixture(autouse=True)
def kernels() -> None:
    library_or_skip()


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    """Pre-norm attention (rotary-free, causal fused attention) and a SwiGLU MLP: the norms'
    outputs, SiLU's output, the SwiGLU product and the attention output's reshaped copy are what
    cheap functions make from tensors other ops store."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.gate, self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _step(model: nn.Module, x: torch.Tensor, **kw: Any) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
    model.zero_grad()
    torch.manual_seed(7)
    with C.compress_saved(min_numel=1, allow_low_bits=True, **kw) as block:
        model(x).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, dict(block.stats)


def _model_and_input(seed: int = 0) -> Tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Sequential(Block(), Block()), torch.randn(4, 16, 32).requires_grad_().clone()


def test_kinds_of_functions_recorded() -> None:
    kind = _derived.kind_of
    for f in (torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.add, F.silu, F.gelu, torch.rsqrt,
              torch.Tensor.pow, torch.where, torch.exp):
        assert kind(f) == "pointwise", f
    for f in (torch.Tensor.view, torch.Tensor.transpose, torch.Tensor.reshape, torch.Tensor.__getitem__,
              torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.clone):
        assert kind(f) == "layout", f
    for f in (F.layer_norm, F.softmax, F.log_softmax, torch.Tensor.mean, torch.cat):
        assert kind(f) == "rows", f
    # Matrix products: recorded only for fused attention's inputs under per-tensor widths.
    for f in (F.linear, torch.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.addmm, torch.mm):
        assert kind(f) == "projection", f
    # In place, random, or not cheap: never recomputed.
    for f in (torch.Tensor.mul_, torch.Tensor.__imul__, torch.Tensor.add_, F.dropout, torch.rand_like, torch.bernoulli,
              F.scaled_dot_product_attention, torch.bmm, torch.Tensor.addmm_):
        assert kind(f) is None, f


def test_raw_storage_gives_the_same_gradients_and_stores_less() -> None:
    model, x = _model_and_input()
    want, kept = _step(model, x, bits_for=lambda t: 32, recompute=False)
    got, derived = _step(model, x, bits_for=lambda t: 32, recompute=True)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert kept["derived"] == 0 and derived["derived"] >= 2 * 6  # per block: 2 norms, SiLU, product, o's input, Linear views
    assert derived["bytes_stored"] < 0.7 * kept["bytes_stored"]
    assert derived["tensors"] == kept["tensors"] and derived["bytes_in"] == kept["bytes_in"]


def test_compressed_recompute_stores_less_and_stays_close() -> None:
    model, x = _model_and_input(1)
    exact, _ = _step(model, x, bits_for=lambda t: 32, recompute=False)
    for bits in (8, 4):
        stored, s_stats = _step(model, x, bits=bits, recompute=False)
        derived, d_stats = _step(model, x, bits=bits, recompute=True)
        assert d_stats["bytes_stored"] < 0.7 * s_stats["bytes_stored"]

        def err(g: Dict[str, torch.Tensor]) -> float:
            return float(sum((g[n] - exact[n]).pow(2).sum() for n in g) / sum(exact[n].pow(2).sum() for n in g))

        # Fewer independent codes and consistent relations: no worse than storing everything.
        assert err(derived) <= 1.5 * err(stored), (bits, err(derived), err(stored))


def test_a_chain_that_reads_each_tensor_twice_is_recomputed_once_per_read(monkeypatch) -> None:
    """`y * sigmoid(y)` reads y twice: a chain of them has 2^depth paths through what is
    recomputed. Each unpack computes each recomputed tensor once (a depth of 20 took minutes when
    every path was walked), and kept raw the gradients are exact."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 16)
    x = torch.randn(8, 16)
    depth = 16

    calls = []
    call = _derived.Derived._call
    monkeypatch.setattr(_derived.Derived, "_call", lambda self, *a: calls.append(self) or call(self, *a))

    def run(**kw: Any) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
        linear.zero_grad()
        with C.compress_saved(min_numel=1, **kw) as block:
            y = linear(x)
            for _ in range(depth):
                y = y * torch.sigmoid(y)
            loss = y.pow(2).sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in linear.named_parameters()}, dict(block.stats)

    want, _ = run(bits_for=lambda t: 32, recompute=False)
    assert not calls
    got, stats = run(bits_for=lambda t: 32)
    assert stats["derived"] >= 2 * depth - 1  # every sigmoid and every product but the last
    assert all(torch.equal(got[n], want[n]) for n in want)
    # Backward reads 2 tensors per level, each recomputing at most the levels below it once
    # (walking every path: 2^16 calls for the last level alone).
    assert 0 < len(calls) <= 2 * depth * 2 * depth
    compressed, _ = run(bits=8)
    assert all(torch.isfinite(g).all() for g in compressed.values())


@pytest.mark.parametrize("same", [lambda t: t.to(t.dtype), lambda t: t.contiguous(), lambda t: t.float(),
                                  lambda t: t.type_as(t)], ids=["to", "contiguous", "float", "type_as"])
def test_a_function_that_returns_its_argument_is_not_recorded_as_made_from_it(same) -> None:
    """`x.to(x.dtype)` returns x itself: recorded, x would be derived from itself (an eager
    LLaMA's attention casts its softmax so, and backward recursed without end)."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 16)
    x = torch.randn(8, 16)

    def run(**kw: Any) -> Dict[str, torch.Tensor]:
        linear.zero_grad()
        with C.compress_saved(min_numel=1, **kw):
            h = torch.softmax(linear(x), -1)
            h = same(h)
            loss = (h * torch.sigmoid(h)).sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in linear.named_parameters()}

    want = run(bits_for=lambda t: 32, recompute=False)
    got = run(bits_for=lambda t: 32)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_recomputation_that_needs_its_own_result_fails_clearly() -> None:
    leaves, spec = _derived.flatten((None,))
    derived = _derived.Derived(torch.neg, spec, [None], None, None, (2,), torch.float32)
    derived.leaves[0] = _derived.Use(derived, None)
    with pytest.raises(RuntimeError, match="needs its own result; pass recompute=False"):
        derived.materialize(lambda value, memo: torch.zeros(2))


def test_a_norm_output_is_recomputed_from_the_decoded_input_and_the_exact_statistic() -> None:
    """RMSNorm's w·x and output h = (w·x)·r are recomputed from x's 2-bit codes x̃ and r, the
    1/rms kept as it is (a per-row statistic: recomputed from x̃ it would be biased, E[x̃²] =
    x² + σ²): the Linear reading h gets exactly d_yᵀ·(w·x̃·r) as its weight gradient."""
    torch.manual_seed(3)
    norm, lin = RMSNorm(64), nn.Linear(64, 16)
    x = torch.randn(8, 64).requires_grad_().clone()
    d_y = torch.randn(8, 16)
    with C.compress_saved(bits=2, allow_low_bits=True, min_numel=1) as block:
        squares = x.pow(2)  # pow saves x: the codes the products are recomputed from
        r = torch.rsqrt(squares.mean(-1, keepdim=True) + 1e-6)
        y = lin(norm.weight * x * r)
    assert block.stats["compressed"] == 1 and block.stats["derived"] == 2  # w·x and h
    x_decoded = squares.grad_fn._saved_self.detach()
    assert not torch.equal(x_decoded, x)
    got = torch.autograd.grad(y, lin.weight, d_y)[0]
    assert torch.equal(got, d_y.t() @ (norm.weight * x_decoded * r).detach())


def test_recomputed_attention_calls_its_kernel_once_per_backward(monkeypatch) -> None:
    from abp import _save_rules

    name = "ScaledDotProductFlashAttentionForCpuBackward0"
    kernel, names = _save_rules._ATTENTION_KERNELS[name]
    calls: List[int] = []
    monkeypatch.setitem(_save_rules._ATTENTION_KERNELS, name, (lambda *a: calls.append(1) or kernel(*a), names))
    model, x = _model_and_input(2)
    _, stats = _step(model, x, bits=4)
    assert len(calls) == 2  # one per block, for output and logsumexp together
    assert stats["derived"] >= 2


@pytest.mark.parametrize("name", ["ScaledDotProductFlashAttentionForCpuBackward0", "ScaledDotProductFlashAttentionBackward0",
                                  "ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductCudnnAttentionBackward0"])
def test_every_attention_kernel_call_binds_its_arguments(name: str) -> None:
    """The calls that recompute each fused kernel's output and logsumexp, run on meta tensors (the
    CUDA kernels cannot run here): ATen accepts their arguments and returns (output, logsumexp)."""
    from abp import _save_rules

    kernel, names = _save_rules._ATTENTION_KERNELS[name]
    assert len(names) == 6 and all(n is None or n.startswith("_saved_") for n in names)
    assert all(n is None or n in dir(getattr(torch._C._functions, name)) for n in names)
    q = torch.empty(2, 4, 16, 8, device="meta", dtype=torch.float16)
    out, lse = kernel(q, q, q, None, 0.0, True, None)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape[:3] in (
        (2, 4, 16), (2, 4, 32))


def test_a_view_of_a_non_contiguous_base_is_rebuilt_in_its_layout() -> None:
    base = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4).permute(2, 0, 1)  # dense, not contiguous
    assert _derived.dense(base) and not base.is_contiguous()
    assert not _derived.dense(torch.zeros(4, 4)[:, :2])  # a gap
    assert not _derived.dense(torch.zeros(1, 4).expand(3, 4))  # overlap
    view = base[1:3, :, 1]
    derived = _derived.view_of(base.contiguous(), base, view)  # the base's values, laid out anew
    assert torch.equal(derived.materialize(lambda value: value), view)


def test_random_ops_are_stored_never_recomputed() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64).requires_grad_().clone()
    with C.compress_saved(bits=8, min_numel=1) as block:
        dropped = F.dropout(x * 2.0, 0.5)  # saves its mask; Linear saves its output
        lin(dropped).sum().backward()
    assert block.stats["derived"] == 0 and block.stats["compressed"] >= 1  # dropout's output is stored


def test_an_input_changed_in_place_after_it_was_recorded_fails_as_torch_does() -> None:
    """A recomputed tensor's input kept as it is (not a snapshot) and changed in place after the
    recording would give a wrong recomputation: it fails as torch's own version check does."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64).requires_grad_().clone()
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        with C.compress_saved(bits=8, min_numel=1, bits_for=lambda t: 32, op_rules=False):
            s = torch.sigmoid(x)  # saves its output, kept as it is
            y = lin(s * 3.0)  # saves s·3: recomputed from s
            s.mul_(2.0)  # changes s after s·3 was made from it
            y.sum().backward()


def test_large_constants_are_not_held_small_ones_are() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64).requires_grad_().clone()
    small = torch.randn(64)
    large = torch.randn(32, 64)
    for constant, derived in ((small, True), (large, False)):
        with C.compress_saved(bits=8, min_numel=1) as block:
            y = lin(torch.tanh(x) + constant)  # tanh saves its output; the sum saves nothing
            y.sum().backward()
        # tanh(x) + c is derived if c is small (a quarter of the sum at most), else stored.
        assert (block.stats["derived"] >= 1) == derived, (constant.shape, block.stats)


def test_autocast_state_is_replayed() -> None:
    """Under bf16 autocast layer_norm runs in fp32 and returns fp32: recomputed outside autocast
    (backward) it must run under the forward's autocast again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    x = torch.randn(32, 64)

    def grads(recompute: bool) -> List[torch.Tensor]:
        model.zero_grad()
        with C.compress_saved(bits_for=lambda t: 32, min_numel=1, recompute=recompute) as block:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().sum().backward()
        assert (block.stats["derived"] > 0) == recompute
        return [p.grad.clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(True), grads(False)))


def test_nothing_is_left_behind_after_the_block() -> None:
    from torch.overrides import _get_current_function_mode_stack

    model, x = _model_and_input(3)
    before = len(_get_current_function_mode_stack())
    with pytest.raises(ValueError, match="boom"):
        with C.compress_saved(bits=4, min_numel=1) as block:
            model(x).sum()
            raise ValueError("boom")
    assert len(_get_current_function_mode_stack()) == before
    assert block._recorder is None


def test_controller_counts_recomputed_elements_in_its_budget() -> None:
    model, x = _model_and_input(4)
    controller = abp.CompressionController(model, avg_bits=2, interval=100, min_numel=1)  # accepted with recompute
    for _ in range(2):
        with controller:
            model(x).pow(2).mean().backward()
    derived = controller.stats["numel_derived"]
    keys = controller.last_step_keys
    assert derived > 0 and controller.average_bits() <= 2.0
    spent = sum(b * keys[k] for k, b in controller.bits.items())
    assert spent <= 2.0 * (sum(keys.values()) + derived)
    assert spent > 2.0 * sum(keys.values())  # the recomputed elements' share went to the stored ones
    assert min(controller.bits.values()) >= 2  # min_bits, the default


class _PassThrough(torch.autograd.Function):
    """Returns its input, as FSDP2's backward hooks do: autograd hands back a view of it with the
    very same geometry, which packs under the same identity as its base."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


@pytest.mark.parametrize("shape", [(8, 32), (2, 4, 32)])
def test_a_function_returning_its_input_is_not_derived_from_itself(shape: Tuple[int, ...]) -> None:
    torch.manual_seed(14)
    pre, norm, head = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 96)
    x = torch.randn(*shape)

    def grads(recompute: bool) -> List[torch.Tensor]:
        for m in (pre, norm, head):
            m.zero_grad()
        with C.compress_saved(bits_for=lambda t: 32, min_numel=1, recompute=recompute):
            head(norm(_PassThrough.apply(pre(x)))).pow(2).sum().backward()
        return [p.grad.clone() for m in (pre, norm, head) for p in m.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(True), grads(False)))


@pytest.mark.parametrize("shape", [(8, 32), (2, 4, 32)])
def test_recomputing_goes_on_through_a_function_returning_its_input(shape: Tuple[int, ...]) -> None:
    """A pass-through Function between cheap functions (a hook, a tracer's marker) hides how its
    output was made; the recorder does not see Function.apply, yet what follows it is recomputed
    as if it were not there: the same tensors derived, the same bytes stored, the same gradient bits."""
    torch.manual_seed(15)
    pre, head = nn.Linear(32, 32), nn.Linear(32, 16)
    x = torch.randn(*shape)

    def step(through: bool, recompute: bool = True) -> Tuple[List[torch.Tensor], Dict[str, int]]:
        for m in (pre, head):
            m.zero_grad()
        with C.compress_saved(bits_for=lambda t: 32, min_numel=1, recompute=recompute) as block:
            a = F.gelu(pre(x))
            b = _PassThrough.apply(a) if through else a
            head(torch.tanh(b * 1.5) + b).pow(2).sum().backward()
        return [p.grad.clone() for m in (pre, head) for p in m.parameters()], dict(block.stats)

    plain, plain_stats = step(False)
    through, stats = step(True)
    assert plain_stats["derived"] > 0
    assert stats["derived"] == plain_stats["derived"] and stats["bytes_stored"] == plain_stats["bytes_stored"]
    assert all(torch.equal(a, b) for a, b in zip(through, plain))
    assert all(torch.equal(a, b) for a, b in zip(through, step(True, recompute=False)[0]))


def test_a_parameter_changed_between_forward_and_backward_is_refused() -> None:
    """h + bias is recomputed in backward with the bias as it is then: torch, which saved the sum,
    would use the forward's; a bias changed in place in between (an optimizer step before
    backward) would silently give another gradient, so it raises, naming recompute=False."""
    torch.manual_seed(16)
    pre, head = nn.Linear(32, 32), nn.Linear(32, 16)
    bias = nn.Parameter(torch.randn(32))
    x = torch.randn(8, 32)

    def loss() -> torch.Tensor:
        h = pre(x)
        return head(F.gelu(h) * (h + bias)).pow(2).sum()

    with C.compress_saved(bits_for=lambda t: 32, min_numel=1) as block:
        loss().backward()
    assert block.stats["derived"] > 0  # unchanged, it goes through, recomputing
    with C.compress_saved(bits_for=lambda t: 32, min_numel=1):
        value = loss()
        with torch.no_grad():
            bias.add_(1.0)
        with pytest.raises(RuntimeError, match=r"a parameter of shape \(32,\) that recomputing .* was modified in place "
                                               r"between forward and backward .* recompute=False"):
            value.backward()
    # With recompute=False the sum is stored, and the changed bias is never read.
    with C.compress_saved(bits_for=lambda t: 32, min_numel=1, recompute=False):
        value = loss()
        with torch.no_grad():
            bias.add_(1.0)
        value.backward()


def _projection_calls_in_backward(model: nn.Module, x: torch.Tensor, **kw: Any) -> Tuple[int, C.compress_saved]:
    """Runs a step; returns how many matrix products backward recomputed."""
    calls: List[int] = []
    call = _derived.Derived._call

    def counting(self: _derived.Derived, *args: Any) -> Any:
        if _derived.kind_of(self.func) == "projection":
            calls.append(1)
        return call(self, *args)

    model.zero_grad()
    with C.compress_saved(min_numel=1, allow_low_bits=True, **kw) as block:
        loss = model(x).pow(2).mean()
    _derived.Derived._call = counting  # type: ignore[method-assign]
    try:
        loss.backward()
    finally:
        _derived.Derived._call = call  # type: ignore[method-assign]
    return len(calls), block


def _find_node(root: Any, prefix: str) -> Any:
    """The first autograd node whose type name starts with `prefix`, breadth first from `root`."""
    todo, seen = [root], set()
    while todo:
        node = todo.pop(0)
        if type(node).__name__.startswith(prefix):
            return node
        for f, _ in node.next_functions:
            if f is not None and id(f) not in seen:
                seen.add(id(f))
                todo.append(f)
    raise AssertionError(f"no {prefix} node")


def test_per_tensor_widths_recompute_attention_inputs_through_their_projection() -> None:
    """Under per-tensor widths, fused attention's query, key and value are recomputed from the
    projection's decoded input (no bits of their own), once per backward for the three (the
    Block's fused qkv projection); under one width they are stored, and nothing else a Linear
    makes is recomputed."""
    model, x = _model_and_input(5)
    calls, block = _projection_calls_in_backward(model, x, bits_for=lambda t: 4)
    uniform_calls, uniform = _projection_calls_in_backward(model, x, bits=4)
    assert calls == 2 and uniform_calls == 0  # one qkv projection per block
    assert block.stats["derived"] - uniform.stats["derived"] == 2 * 3
    assert block.stats["bytes_stored"] < uniform.stats["bytes_stored"]

    # What attention's backward reads is the projection of the decoded input the Linear saved.
    with C.compress_saved(min_numel=1, bits_for=lambda t: 4):
        y = model[0](x)
    node = _find_node(y.grad_fn, "ScaledDotProduct")
    linear = model[0].qkv
    h = _find_node(node, "AddmmBackward0")._saved_mat1  # the decoded, recomputed norm output the Linear saved
    b, n, d = x.shape
    q_want = F.linear(h, linear.weight, linear.bias).view(b, n, 3, 4, d // 4).permute(2, 0, 3, 1, 4)[0]
    q_got = node._saved_query
    assert torch.equal(q_got, q_want)
    exact_q = linear(model[0].n1(x)).view(b, n, 3, 4, d // 4).permute(2, 0, 3, 1, 4)[0]
    assert not torch.equal(q_got, exact_q)  # decoded at 4 bits, not the forward's own
    y.sum().backward()


def test_gradients_through_recomputed_projections_are_exact_at_full_width() -> None:
    model, x = _model_and_input(6)
    want, _ = _step(model, x, bits_for=lambda t: 32, recompute=False)
    calls, _ = _projection_calls_in_backward(model, x, bits_for=lambda t: 32)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert calls == 2
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_shared_recomputations_are_released_when_their_reads_are_done(monkeypatch) -> None:
    """A recomputed product (and attention's kernel call) is held until the reads the saves claimed
    are done, and then released: after backward(retain_graph=True) nothing is held, so a second
    backward recomputes (reading the parameters as they are then) instead of reusing it."""
    made: List[_derived.Shared] = []
    init = _derived.Shared.__init__

    def recording(self: _derived.Shared, reads: int) -> None:
        init(self, reads)
        made.append(self)

    monkeypatch.setattr(_derived.Shared, "__init__", recording)
    model, x = _model_and_input(9)
    with C.compress_saved(min_numel=1, bits_for=lambda t: 4) as block:
        loss = model(x).pow(2).mean()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    assert block.stats["derived"] > 0 and made
    assert all(shared.value is None for shared in made)
    second = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


class _SavesItsQuery(nn.Module):
    """Attention whose query another op saves too (a learnable scale of it)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm, self.q, self.k, self.v = RMSNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d // 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, n, 4, d // 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v) + (q * self.scale).tanh()


def test_what_another_op_saves_of_a_recomputed_query_is_stored() -> None:
    """Attention's inputs recomputed through their projections serve attention only: the same
    query saved by a later op is stored for it (that op's backward might come when the weight is
    gone), and gradients stay exact at full width."""
    torch.manual_seed(10)
    model, x = _SavesItsQuery(), torch.randn(2, 8, 32).requires_grad_().clone()
    want, kept = _step(model, x, bits_for=lambda t: 32, recompute=False)
    calls, block = _projection_calls_in_backward(model, x, bits_for=lambda t: 32)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert calls == 3  # q, k and v for attention
    assert all(torch.allclose(got[n], want[n], rtol=1e-6, atol=1e-7) for n in want)
    # Stored, the query is one save for both ops; recomputed for attention, the product's save of
    # it is a save of its own.
    assert block.stats["tensors"] == kept["tensors"] + 1


def test_zero3_parameters_are_read_in_backward_only_when_persistent() -> None:
    """DeepSpeed ZeRO-3 marks its parameters (`ds_id`): a persistent one keeps its data, another is
    gathered for its own module's passes only, so nothing recomputed may read it."""
    class Status:
        def __init__(self, name: str) -> None:
            self.name = name

    stats = {}
    for case, marks in (("plain", {}), ("persistent", {"ds_id": 1, "ds_persist": True}),
                        ("released", {"ds_id": 1, "ds_persist": False, "ds_status": Status("NOT_AVAILABLE")})):
        torch.manual_seed(11)
        norm, lin = RMSNorm(32), nn.Linear(32, 8)
        for name, value in marks.items():
            setattr(norm.weight, name, value)
        x = torch.randn(4, 32).requires_grad_().clone()
        with C.compress_saved(min_numel=1, bits_for=lambda t: 32) as block:
            y = lin(norm(x))
        y.sum().backward()
        stats[case] = block.stats["derived"]
    assert stats["plain"] == stats["persistent"] > stats["released"]


def _free_after_forward(linear: nn.Linear, how: str) -> List[Any]:
    """What a sharding wrapper does to a module sharded on its own: its weight's data is freed after
    its forward (FSDP2 resizes its storage to 0; FSDP1 swaps an empty tensor in as its .data) and
    gathered again before its own backward, without a version bump."""
    kept: Dict[str, torch.Tensor] = {}

    def free(module: nn.Module, args: Any, out: Any) -> None:
        kept["w"] = module.weight.detach().clone()
        if how == "resize":
            module.weight.untyped_storage().resize_(0)
        else:
            kept["data"] = module.weight.data
            module.weight.data = torch.empty(0)

    def gather(module: nn.Module, grad_output: Any) -> None:
        w = kept.pop("w")
        if how == "resize":
            module.weight.untyped_storage().resize_(w.numel() * w.element_size())
            module.weight.data.copy_(w)
        else:
            module.weight.data = kept.pop("data")

    return [linear.register_forward_hook(free), linear.register_full_backward_pre_hook(gather)]


@pytest.mark.parametrize("how", ["resize", "swap"])
def test_a_projection_whose_weight_is_freed_after_its_forward_is_stored_not_recomputed(how: str) -> None:
    model, x = _model_and_input(7)
    want, _ = _step(model, x, bits_for=lambda t: 32)
    handles = [h for block in model for h in _free_after_forward(block.qkv, how)]
    try:
        calls, block = _projection_calls_in_backward(model, x, bits_for=lambda t: 32)
    finally:
        for h in handles:
            h.remove()
    assert calls == 0  # the weight had no data when attention saved its inputs: they were stored
    got = {n: p.grad for n, p in model.named_parameters()}
    assert all(torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7) for n in want)


def test_a_projection_weight_freed_before_backward_fails_clearly() -> None:
    model, x = _model_and_input(8)
    with C.compress_saved(min_numel=1, bits_for=lambda t: 4):
        loss = model(x).pow(2).mean()
    weight = model[1].qkv.weight
    kept = weight.detach().clone()
    weight.untyped_storage().resize_(0)
    try:
        with pytest.raises(RuntimeError, match=r"has no data in backward.*sharded unit, or pass recompute=False"):
            loss.backward()
    finally:
        weight.untyped_storage().resize_(kept.numel() * kept.element_size())
        weight.data.copy_(kept)


def test_a_block_kept_open_over_several_steps_recomputes_and_guards_every_step() -> None:
    """A block left open across training steps: each forward after a backward records again (it
    recomputed only in the first step, storing codes after), and the guard watches each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    x = torch.randn(8, 32, 16)
    with C.compress_saved(bits=4) as alone:
        model(x).square().sum().backward()
    assert alone.stats["derived"] > 0
    block = C.compress_saved(bits=4)
    with block:
        for step in range(3):
            before = dict(block.stats)
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            assert block.stats["derived"] - before["derived"] == alone.stats["derived"], step
            assert block.stats["compressed"] - before["compressed"] == alone.stats["compressed"], step
            assert block._guarded is None  # armed by this forward, handed to the check by its backward


def test_exiting_a_block_that_is_not_open_says_so() -> None:
    block = C.compress_saved(bits=4)
    with pytest.raises(RuntimeError, match="exited, but this block is not open"):
        block.__exit__(None, None, None)
    with block:
        pass
    with pytest.raises(RuntimeError, match="exited, but this block is not open"):
        block.__exit__(None, None, None)


def test_the_recorder_sees_none_of_the_pack_hooks_own_tensor_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save whose op ran outside the recorder's handler (abp's C++ lane, an autograd Function)
    reaches the pack hook with the recorder's mode active: its property reads must not go through
    the recorder (a Python call each, ~30 per save), and what the block stores is the same."""
    seen: List[str] = []
    handler = _derived.Recorder.__torch_function__

    def counting(self: Any, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        seen.append(getattr(func, "__name__", str(func)))
        return handler(self, func, types, args, kwargs)

    monkeypatch.setattr(_derived.Recorder, "__torch_function__", counting)
    x = torch.randn(64, 64, requires_grad=True)
    with abp.compress_saved(bits=4) as block:
        y = x * 2  # recorded: the recorder is on
        assert seen
        seen.clear()
        small = torch.randn(4, 4, requires_grad=True) * 1.0  # kept as it is
        seen.clear()
        packed = block.pack(y)
        block.pack(small)
        assert seen == []
    torch.testing.assert_close(block.unpack(packed), y.detach())
