"""compress_saved's op rules: fused attention's output and logsumexp recomputed from its stored
query, key and value (or, where that cannot be done or recompute=False, its query, key and
logsumexp at 8 bits at least), log_softmax's output stored as probabilities; the controller's
allocation under minimum widths; and the divergence guard.

The rules need autograd's node numbers (torch >= 2) and fused attention; those tests are skipped
on torch 1.13. The guard and allocation tests run in both lanes.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abp
import abp.compress as C
from abp import _guard, _save_rules
from abp.controller import allocate_bits
from abp_reference import library_or_skip

needs_rules = pytest.mark.skipif(
    _save_rules.sequence_number() is None or not hasattr(F, "scaled_dot_product_attention"),
    reason="op rules need torch >= 2 (autograd node numbers, fused attention)")


def _attention_inputs(seed: int = 0) -> Tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(4, 4, 32, 16, generator=g, requires_grad=True) for _ in range(3)]
    return tuple(base) + tuple(t * 1.0 for t in base)  # the leaves, then non-leaf views of them


def _saved_widths(op_rules: bool, recompute: bool = False) -> List[Tuple[str, int]]:
    """(what, stored width) for each tensor fused attention saves under compress_saved(bits=2)."""
    library_or_skip()
    _, _, _, q, k, v = _attention_inputs()
    asked: List[torch.Tensor] = []

    def bits_for(t: torch.Tensor) -> int:
        asked.append(t)
        return 2

    with C.compress_saved(bits=2, bits_for=bits_for, min_numel=1, op_rules=op_rules, recompute=recompute) as block:
        out = F.scaled_dot_product_attention(q, k, v)
    floors = block.floors
    names = []
    for i, t in enumerate(asked):
        what = ("query" if t is q else "key" if t is k else "value" if t is v else
                "output" if t.grad_fn is out.grad_fn else "logsumexp" if t.dim() == 3 else "other")
        names.append((what, floors.get(i, 2)))
    out.sum().backward()
    return sorted(names)


@needs_rules
def test_fused_attention_keeps_query_key_and_logsumexp_at_eight_bits_without_recompute() -> None:
    widths = dict(_saved_widths(op_rules=True))
    assert widths.get("query") == 8 and widths.get("key") == 8
    assert widths.get("value") == 2 and widths.get("output") == 2
    # The CPU flash kernel saves its row logsumexp; the math fallback saves none.
    assert widths.get("logsumexp", 8) == 8


@needs_rules
def test_recomputed_attention_needs_no_floors_and_stores_no_output() -> None:
    widths = _saved_widths(op_rules=True, recompute=True)
    assert sorted(widths) == [("key", 2), ("query", 2), ("value", 2)]


@needs_rules
def test_one_width_for_every_tensor_keeps_query_key_and_log_probabilities_at_eight_bits() -> None:
    """Recomputed, fused attention needs no floor to stay stable, but with one width for every
    tensor its query and key, and log_softmax's output, are stored at 8 bits: per bit they cost a
    language model the most (docs/compressed-training.md)."""
    library_or_skip()
    _, _, _, q, k, v = _attention_inputs()
    logits = torch.randn(512, 256, requires_grad=True) * 1.0
    with C.compress_saved(bits=2, allow_low_bits=True, min_numel=1) as block:
        out = F.scaled_dot_product_attention(q, k, v)
        loss = F.cross_entropy(logits, torch.randint(0, 256, (512,)))
    n = q.numel()
    # q and k at 8 bits, v at 2, the output recomputed; the log-probabilities at 8 bits.
    want = 2 * (8 * (n // 256) + n) + (8 * (n // 256) + n // 4) + (8 * 512 + 512 * 256)
    assert block.stats["derived"] == 1 and block.stats["bytes_compressed"] == want
    (out.sum() + loss).backward()


@needs_rules
@pytest.mark.parametrize("masked", [False, True])
def test_recomputed_attention_gives_the_exact_gradient_at_the_decoded_inputs(masked: bool) -> None:
    """With its output and logsumexp recomputed from the decoded query, key and value, fused
    attention's backward is exactly its backward at those values: the rows of the recomputed
    probabilities sum to one and D = rowsum(dO ∘ O) holds (with 8-bit query and key and the stored
    logsumexp, neither does)."""
    library_or_skip()
    _, _, _, q, k, v = _attention_inputs(4)
    mask = torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(1)) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True
    d_out = torch.randn(4, 4, 32, 16, generator=torch.Generator().manual_seed(2))
    with C.compress_saved(bits=2, allow_low_bits=True, min_numel=1) as block:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
    assert block.stats["compressed"] == 3 and block.stats["derived"] == 1
    node = out.grad_fn
    decoded = [getattr(node, name).detach().requires_grad_() for name in ("_saved_query", "_saved_key", "_saved_value")]
    assert not torch.equal(decoded[0], q)  # 2-bit codes
    got = torch.autograd.grad(out, (q, k, v), d_out)
    reference = F.scaled_dot_product_attention(*decoded, attn_mask=mask, is_causal=not masked)
    want = torch.autograd.grad(reference, decoded, d_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_rules
def test_without_op_rules_every_tensor_gets_the_bits_asked() -> None:
    assert all(bits == 2 for _, bits in _saved_widths(op_rules=False))


@needs_rules
def test_the_floors_are_stored_and_the_gradient_stays_close() -> None:
    """Stored bytes are those of the raised widths; the gradient of q through 8-bit q/k/lse and 2-bit
    v/out stays close to exact, where 2 bits on everything is far off (the damage of exp())."""
    library_or_skip()

    def grads(**kw) -> Tuple[List[torch.Tensor], dict]:
        torch.manual_seed(3)
        q0, k0, v0, q, k, v = _attention_inputs(1)
        ctx = C.compress_saved(bits=2, min_numel=1, allow_low_bits=True, **kw) if kw else None
        if ctx is None:
            out = F.scaled_dot_product_attention(q, k, v)
            stats = {}
        else:
            with ctx as block:
                out = F.scaled_dot_product_attention(q, k, v)
            stats = dict(block.stats)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return [q0.grad, k0.grad, v0.grad], stats

    exact, _ = grads()
    ruled, stats = grads(op_rules=True, recompute=False)
    unruled, _ = grads(op_rules=False, recompute=False)

    def rel(a: List[torch.Tensor]) -> float:
        return float(torch.norm(torch.cat([(x - y).flatten() for x, y in zip(a, exact)])) /
                     torch.norm(torch.cat([y.flatten() for y in exact])))

    assert rel(ruled) < 0.5 * rel(unruled)
    # bytes: q, k (8 bits), v, out (2 bits), lse (8 bits), each with fp32 (min, scale) per 256.
    n, rows = 4 * 4 * 32 * 16, 4 * 4 * 32

    def stored(numel: int, bits: int) -> int:
        groups = -(-numel // 256)
        return 8 * groups + -(-bits * numel // 8)

    lse = stored(rows, 8) if stats["compressed"] == 5 else 0
    assert stats["bytes_compressed"] == 2 * stored(n, 8) + 2 * stored(n, 2) + lse


@needs_rules
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kind", ["bool", "-inf", "finfo.min"])
def test_an_attention_mask_is_kept_as_it_is(kind: str, recompute: bool) -> None:
    """Fused attention saves its mask (a bool mask as a float one of 0 and -inf). Group codes of a
    group holding -inf decode to NaN, so a mask (which requires no grad) is never compressed: the
    gradients stay finite and as close to exact as without a mask."""
    library_or_skip()
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(4, 1, 32, 32, generator=g) > 0.3
    keep[..., 0] = True  # no fully masked row
    if kind == "bool":
        mask = keep
    else:
        fill = float("-inf") if kind == "-inf" else torch.finfo(torch.float32).min
        mask = torch.zeros(4, 1, 32, 32).masked_fill(~keep, fill)

    def grads(compressed: bool, attn_mask) -> Tuple[List[torch.Tensor], dict]:
        torch.manual_seed(3)
        q0, k0, v0, q, k, v = _attention_inputs(2)
        with C.compress_saved(bits=4, min_numel=1, recompute=recompute) if compressed else contextlib.nullcontext() as block:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return [q0.grad, k0.grad, v0.grad], dict(block.stats) if compressed else {}

    def error(attn_mask) -> List[float]:
        exact, _ = grads(False, attn_mask)
        approx, stats = grads(True, attn_mask)
        # q, k, v and the output (recomputed with recompute=True); neither a mask nor the logsumexp
        assert stats["compressed"] == (3 if recompute else 4)
        assert all(torch.isfinite(a).all() for a in approx)
        return [float((a - e).norm() / e.norm()) for a, e in zip(approx, exact)]

    # As close to exact as the same codes without a mask (without recompute, 4-bit v and output:
    # q's and k's gradients are some 20 % off in both cases, from D = rowsum(dO ∘ O)).
    for masked, unmasked in zip(error(mask), error(None)):
        assert masked < 2 * unmasked


@needs_rules
def test_a_floor_applies_to_the_op_that_saves_not_to_later_ones() -> None:
    """The op after attention (a product saving its inputs) keeps the asked width."""
    library_or_skip()
    _, _, _, q, k, v = _attention_inputs()
    w = torch.randn(4, 4, 32, 16, requires_grad=True)
    asked: List[torch.Tensor] = []
    with C.compress_saved(bits=2, bits_for=lambda t: asked.append(t) or 2, min_numel=1, recompute=False) as block:
        out = F.scaled_dot_product_attention(q, k, v)
        y = out * w
    raised = set(block.floors)
    later = [i for i, t in enumerate(asked) if t is out or t is w]
    assert later and not raised & set(later)
    y.sum().backward()


def test_log_softmax_stores_its_log_probabilities_as_probabilities() -> None:
    """Cross-entropy's log_softmax saves its output y and its backward reads exp(y): y is stored
    as codes of exp(y) at the asked width and decoded to their log, so the logits' gradient
    (p − onehot) / n is unbiased: the mean of 400 draws is within Hoeffding's bound (3 steps of the
    row's 2-bit grid / √400, probability 2e^-18 per element) of exact."""
    library_or_skip()
    torch.manual_seed(0)
    logits = (3 * torch.randn(64, 256)).requires_grad_()
    target = torch.randint(0, 256, (64,))
    x = logits * 1.0  # an activation (a leaf that requires grad counts as a parameter)
    exact = torch.autograd.grad(F.cross_entropy(x, target), logits)[0]
    draws = []
    for seed in range(400):
        # op_rules=False: at 2 bits (per-tensor widths raise log-probabilities to 4, as tested below)
        with C.compress_saved(bits_for=lambda t: 2, min_numel=1, op_rules=False,
                              generator=torch.Generator().manual_seed(seed)) as block:
            loss = F.cross_entropy(logits * 1.0, target)
        assert block.floors == {} and block.stats["compressed"] == 1 and block.stats["bytes_compressed"] == 64 * (64 + 8)
        node = loss.grad_fn.next_functions[0][0]  # nll_loss <- log_softmax
        assert type(node).__name__ == "LogSoftmaxBackward0"
        if seed == 0:
            decoded = node._saved_result
            assert decoded.exp().le(1.0 + 1e-6).all() and decoded.exp().sum(1).sub(1).abs().max() < 0.6
        draws.append(torch.autograd.grad(loss, logits)[0])
    draws = torch.stack(draws)
    p = logits.detach().softmax(1)  # a row is a group of 256: its codes step by (max - min) / 3
    step = (p.max(1, keepdim=True).values - p.min(1, keepdim=True).values) / 3
    error = (draws.mean(0) - exact).abs() * 64  # the mean over 64 rows scales the gradient by 1/64
    assert (error <= 3 * step / 20 + 1e-6).all()
    assert error.max() > 0  # the draws do differ


@needs_rules
def test_per_tensor_widths_keep_log_probabilities_at_four_bits_at_least() -> None:
    """No probe of the controller reaches a loss computed outside the model: log_softmax's output
    is raised to 4 bits (LOG_SOFTMAX_PER_TENSOR_MIN_BITS) from a narrower asked width, and kept
    at a wider one."""
    library_or_skip()
    logits = torch.randn(64, 256, requires_grad=True)
    target = torch.randint(0, 256, (64,))
    for asked, stored in ((2, 4), (1, 4), (8, 8)):
        with C.compress_saved(bits_for=lambda t: asked, min_numel=1, allow_low_bits=True) as block:
            loss = F.cross_entropy(logits * 1.0, target)
        assert block.floors == ({0: stored} if stored != asked else {})
        assert block.stats["bytes_compressed"] == 64 * (256 * stored // 8 + 8)
        loss.backward()


@needs_rules
def test_a_rule_on_a_tensor_not_offered_lands_on_no_other_tensor() -> None:
    """A classifier's log_softmax output below min_numel is never offered to bits_for: its floor
    must not be recorded against the call before it (the Linear's input), which a controller would
    then hold at 4 bits and count against its budget (a ResNet's 512-feature head, found by a
    new-user trial). The features come from a sort, which recompute does not record, so they are
    offered."""
    library_or_skip()
    torch.manual_seed(0)
    head = nn.Linear(512, 10)
    features = torch.randn(8, 512, requires_grad=True)
    asked: List[Tuple[int, ...]] = []

    def bits_for(t: torch.Tensor) -> int:
        asked.append(tuple(t.shape))
        return 2

    with C.compress_saved(bits_for=bits_for, allow_low_bits=True) as block:
        loss = F.cross_entropy(head(features.sort(1).values), torch.randint(0, 10, (8,)))
    assert asked == [(8, 512)]  # the Linear's input; the 80 log-probabilities are below min_numel
    assert block.rule_floors == {} and block.floors == {}
    loss.backward()


def _checkpointed_model() -> Tuple[nn.Module, nn.ModuleList, nn.Module]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU()) for _ in range(2))
    return nn.Linear(16, 64), blocks, nn.Linear(64, 8)


@pytest.mark.parametrize("variant", ["plain", "residual", "saved-before", "autocast"])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpoints_inputs_are_kept_as_they_are(variant: str, per_tensor: bool, reentrant: bool) -> None:
    """A checkpoint saves its block's inputs and backward reruns the block from them: they are
    kept as they are, so with the recomputation outside the block the blocks' gradients are
    exact, while the head's input, saved by a Linear, is compressed. Also where the checkpoint's
    output reaches the next save through another op (a residual add), where an op saved the
    input before (h * h, whose save keeps its codes), and under bf16 autocast (whose casts come
    between). Kept inputs are not offered to bits_for."""
    library_or_skip()
    from torch.utils.checkpoint import checkpoint

    torch2 = _save_rules.sequence_number() is not None
    if variant == "autocast" and not torch2:
        pytest.skip("torch 1.13's reentrant checkpoint fails under CPU autocast by itself")
    emb, blocks, head = _checkpointed_model()
    x, weights = torch.randn(8, 32, 16), torch.randn(8, 32, 8)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16) if variant == "autocast" else contextlib.nullcontext():
            h = emb(x)
            extra = (h * h).sum() if variant == "saved-before" else 0
            for block in blocks:
                out = checkpoint(block, h, use_reentrant=reentrant)
                h = out + h if variant == "residual" else out
            # The blocks' gradients read neither head's saved input nor h * h's.
            return (head(h).float() * weights).sum() + extra

    params = list(blocks.parameters()) + [head.weight]

    def grads(value: torch.Tensor) -> List[torch.Tensor]:  # (a reentrant checkpoint refuses autograd.grad)
        for p in params:
            p.grad = None
        value.backward()
        return [p.grad for p in params]

    exact = grads(loss())
    asked: List[Tuple[int, ...]] = []
    options = dict(bits_for=lambda t: asked.append(tuple(t.shape)) or 2) if per_tensor else dict(bits=4)
    with C.compress_saved(allow_low_bits=True, **options) as block:
        value = loss()
    got = grads(value)  # the recomputation runs outside the block
    for want, have in zip(exact[:-1], got[:-1]):
        assert torch.equal(want, have)
    assert not torch.equal(exact[-1], got[-1])
    n = 8 * 32 * 64
    # Kept: the two checkpoints' inputs; compressed: the head's input (and h for h * h).
    assert block.stats["compressed"] == (2 if variant == "saved-before" else 1)
    width = 2 if variant == "autocast" else 4
    if reentrant or torch2:  # torch 1.13's non-reentrant checkpoint holds its inputs out of the hooks' sight
        assert block.stats["bytes_stored"] >= 2 * n * width
    if per_tensor:
        assert len(asked) == block.stats["compressed"]


@needs_rules
@pytest.mark.parametrize("steps, interval", [(1, 10), (2, 1)], ids=["first-estimate", "second-estimate"])
def test_controller_counts_the_floors_against_its_budget(steps: int, interval: int) -> None:
    """The first estimate knows the floors too, though its step stored everything as it is
    (asked 32 bits, no rule raised anything): compress_saved reports each save's rule floor
    whatever was asked (rule_floors)."""
    library_or_skip()

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.out = nn.Linear(32, 32)
            self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 32)
            h = x + self.out(a)
            return h + self.mlp(h)

    torch.manual_seed(0)
    model = Attention()
    controller = abp.CompressionController(model, avg_bits=2, interval=interval, min_numel=1, allow_low_bits=True,
                                           min_bits=1, recompute=False)
    for _ in range(steps):
        x = torch.randn(8, 32, 32)
        with controller:
            model(x).pow(2).mean().backward()
    bits = controller.bits
    assert controller.average_bits() <= 2 + 1e-9
    floored = controller._floors  # the keys of q, k (and the CPU flash kernel's logsumexp)
    assert len(floored) >= 2 and all(bits[k] >= 8 for k in floored)
    assert any(b <= 2 for b in bits.values())
    # The probes store each key at its floor (q and k at 8 bits: at 1 bit, read through exp(), they
    # blow up in a way they never meet) and scale what they measure by (2^b - 1)^2 to the 1-bit
    # coefficient. Unscaled, q and k would look 255^2 times less sensitive than the rest.
    assert all(controller._probe_bits(k) == 8 for k in floored)
    sens = controller.sensitivity
    others = sorted(v for k, v in sens.items() if k not in floored)
    median = others[len(others) // 2]
    assert all(median / 100 < sens[k] < median * 100 for k in floored), (sens, floored)


@needs_rules
def test_a_budget_the_floors_exceed_is_said_with_the_floors_as_the_reason() -> None:
    library_or_skip()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU())

    class Attention(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = k = v = model(x).view(8, 32, 2, 16).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v)

    attention = Attention()
    controller = abp.CompressionController(attention, avg_bits=1, min_numel=1, allow_low_bits=True, min_bits=1,
                                           recompute=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with controller:
                attention(torch.randn(8, 32, 32)).pow(2).mean().backward()
    over = [str(w.message) for w in caught if "exceed the budget" in str(w.message)]
    assert len(over) == 1 and controller.average_bits() > 1, over
    assert "op rules' floors (fused attention's query and key, log_softmax's output, what amax-like reductions compare)" in over[0]
    assert "ReLU" not in over[0] and "padded" not in over[0]


def test_allocate_bits_respects_minimum_widths_and_the_budget() -> None:
    c, d = [1.0, 1.0, 100.0, 0.01], [100, 100, 100, 100]
    bits = allocate_bits(c, d, 3.0, minimum_bits=[8, 1, 1, 1])
    assert bits[0] >= 8 and sum(b * n for b, n in zip(bits, d)) <= 3 * sum(d)
    free = allocate_bits(c, d, 3.0)
    assert free[0] < 8
    with pytest.raises(ValueError, match="minimum widths"):
        allocate_bits(c, d, 2.0, minimum_bits=[8, 8, 1, 1])
    with pytest.raises(ValueError, match=r"minimum_bits\[1\]: expected one of 32, 8, 4, 2, 1, got 3"):
        allocate_bits(c, d, 3.0, minimum_bits=[8, 3, 1, 1])
    with pytest.raises(ValueError, match=r"minimum_bits: expected one per sensitivity \(4\), got 2"):
        allocate_bits(c, d, 3.0, minimum_bits=[8, 1])


# ---------------------------------------------------------------------------------------------------
# The divergence guard.


def test_watch_is_quiet_on_a_steady_norm_and_alarms_once_on_growth_or_nan() -> None:
    steady = _guard.GradientWatch()
    assert steady.add([2.0 + 0.5 * math.sin(i) for i in range(400)]) is None
    growing = _guard.GradientWatch()
    reason = growing.add([2.0 * 1.05 ** i for i in range(200)])
    assert reason is not None and "grew from" in reason and "median of steps 5-24" in reason
    assert growing.add([1e9] * 40) is None  # once
    nan = _guard.GradientWatch()
    assert nan.add([1.0, 1.0, 1.0, float("nan")]) == "the gradient norm is nan at step 3"
    # Never finite: a backward that does not work, which the alarm does not call divergence.
    first = _guard.GradientWatch().add([float("nan")])
    assert first == f"the gradient norm is nan at step 0, {_guard.FROM_THE_START}"
    with pytest.warns(_guard.DivergenceWarning, match="not a divergence .* Run one step without the block") as caught:
        _guard.alarm("warn", "abp.compress_saved(bits=8)", first, widest=True)
    assert "diverges does" not in str(caught[0].message)
    # After finite steps, a restart of the history (layers unfrozen) does not make a NaN the first.
    restarted = _guard.GradientWatch()
    assert restarted.add([1.0] * 30) is None
    restarted._restart()
    assert restarted.add([float("nan")]) == "the gradient norm is nan at step 0"
    # A norm that settles lower (fine-tuning) or grows 5-fold stays quiet.
    assert _guard.GradientWatch().add([10.0] * 25 + [1.0] * 100 + [5.0] * 100) is None


def test_a_watch_restarts_when_its_parameters_are_unfrozen_not_when_others_appear() -> None:
    # Gradual unfreezing: the norm over more parameters is another quantity, not divergence. A
    # parameter seen for the first time (a mixture of experts' expert routed to at last) is no flip.
    def record(watch: _guard.GradientWatch, norms: List[float], trains: Dict[int, bool]) -> Optional[str]:
        found = None
        for value in norms:
            found = watch.record(torch.tensor(value), trains=trains) or found
        return found

    watch = _guard.GradientWatch(window=4)
    assert record(watch, [0.01] * 40, {1: True, 2: False}) is None
    assert record(watch, [0.4] * 40, {1: True, 2: True}) is None  # 2 unfrozen: a new reference
    assert watch.reference == pytest.approx(0.4)
    assert "grew from" in (record(watch, [40.0] * 40, {1: True, 2: True}) or "")  # growth at the same set alarms
    routed = _guard.GradientWatch(window=4)
    assert record(routed, [0.01] * 40, {1: True}) is None
    assert "grew from" in (record(routed, [0.4] * 40, {1: True, 3: True}) or "")  # 3 newly seen: no restart
    # A long run keeps the readings the rule needs, not one per step.
    steady = _guard.GradientWatch()
    assert steady.add([1.0] * 5000) is None
    assert len(steady.norms) == steady.window and steady.steps == 5000


def test_the_guard_still_alarms_on_a_model_whose_saved_parameters_vary_by_step() -> None:
    """A mixture of experts saves the weights of the experts a step routes to: the parameters the
    block sees change every step, which must not keep restarting the watch (it never alarmed)."""
    library_or_skip()
    torch.manual_seed(0)

    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(32, 32)
            self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

        def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
            h = torch.relu(self.inp(x))
            out = self.experts[step % 4](h)  # one expert or two: the saved set varies in size too
            return out + self.experts[(step + 1) % 4](h) if step % 3 else out

    model = Routed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(64, 32)
    with pytest.raises(abp.DivergenceError):
        for step in range(200):
            if step == 30:
                with torch.no_grad():
                    model.inp.weight[0, 0] = float("nan")
            with C.compress_saved(bits=8, guard="raise"):
                loss = model(x, step).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
            optimizer.step()


def test_the_alarm_of_an_eight_bit_block_does_not_advise_more_bits() -> None:
    with pytest.warns(_guard.DivergenceWarning) as caught:
        _guard.alarm("warn", "abp.compress_saved(bits=8)", "the gradient norm is nan at step 3", widest=True)
        _guard.alarm("warn", "abp.compress_saved(bits=4)", "the gradient norm is nan at step 3")
    widest, narrower = (str(w.message) for w in caught)
    assert "stores 8 bits already" in widest and "more bits" not in widest
    assert "more bits" in narrower


def test_a_scaled_watch_skips_overflow_steps_and_scale_growth_and_alarms_on_lasting_overflow() -> None:
    # float16 under a GradScaler: an overflow step's norm is inf (skipped by the scaler, which
    # halves its scale), and the scale doubles after runs of clean steps; neither is divergence.
    def record(watch: _guard.GradientWatch, norms: List[float]) -> Optional[str]:
        found = None
        for value in norms:
            found = watch.record(torch.tensor(value), scaled=True) or found
        return found

    scaled = _guard.GradientWatch(window=4)
    overflows_then_growth = [float("inf")] * 3 + [8.0] * 10 + [16.0] * 10 + [32.0] * 10 + [float("inf")] + [64.0] * 40
    assert record(scaled, overflows_then_growth) is None
    assert float("inf") not in scaled.norms and scaled.norms[-1] == 64.0
    reason = record(scaled, [float("nan")] * 8)  # the scaler cannot rescue it: diverged
    assert reason is not None and "not finite for 4 steps in a row" in reason
    # Unscaled, the first overflow and an 8-fold growth alarm as before.
    assert "is inf at step 0" in (_guard.GradientWatch(window=4).add([float("inf")]) or "")


def test_read_at_backward_end_a_float16_block_is_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    # No torch.optim optimizer steps these models: after _WITHOUT_STEPS backwards the watch reads
    # at backward end (its earlier readings kept), where float16 saves make it scaled.
    library_or_skip()
    monkeypatch.setattr(_guard, "_WITHOUT_STEPS", 3)
    halves = (False,) if torch.__version__.startswith("1.") else (False, True)  # 1.13's CPU autocast: bfloat16 only
    for half in halves:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
        for _ in range(4):
            with C.compress_saved(bits=8):
                with torch.autocast("cpu", dtype=torch.float16) if half else contextlib.nullcontext():
                    loss = model(torch.randn(64, 64)).float().pow(2).mean()
                loss.backward()
            model.zero_grad()
        watch = _guard.watch_for(model[2].weight)  # the first parameter the block sees saved
        assert watch.mode == "backward"
        assert len(watch.norms) == 0 and len(watch._pending) == 4  # read every `window` (20) steps
        assert watch.scaled is half


def test_a_loss_scalers_overflow_and_growth_are_not_divergence_and_a_blow_up_still_is() -> None:
    # Read at the optimizer's step (torch >= 2), after the GradScaler unscaled the gradients; the
    # steps it skips for overflow never reach the guard. (Read at backward end, the first step's
    # inf and the scale's growth alarmed.)
    library_or_skip()
    if not _guard._STEP_HOOKS:
        pytest.skip("torch 1.13 runs no global optimizer step hooks: read at backward end")
    x, y = torch.randn(256, 32), torch.randint(0, 10, (256,))

    def train(steps: int, init_scale: float, growth_interval: int, blow_up: float) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))  # a model of its own: a watch of its own
        scale = [1.0]
        for p in model.parameters():
            p.register_hook(lambda g: g * scale[0])
        optimizer = torch.optim.SGD(model.parameters(), 1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        for step in range(steps):
            scale[0] *= blow_up
            optimizer.zero_grad()
            with C.compress_saved(bits=8, guard="raise"):
                loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
            try:
                scaler.step(optimizer)
            except abp.DivergenceError:
                return step
            scaler.update()
        return -1

    assert train(30, 2.0 ** 120, 2000, 1.0) == -1  # overflows first, then halves its way down
    assert train(70, 16.0, 4, 1.0) == -1  # the scale doubles every 4 steps: 2^17 over the run
    assert 40 <= train(200, 16.0, 2000, 1.1) < 120  # gradients growing 10 % a step: still caught


def test_a_guard_waiting_for_a_step_that_never_comes_keeps_no_model_alive() -> None:
    # The last backward of a run, gradients for analysis: no optimizer step reads the watch.
    library_or_skip()
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    with C.compress_saved(bits=8):
        model(torch.randn(16, 64, requires_grad=True)).sum().backward()
    weight = weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert weight() is None


def test_the_step_of_an_optimizer_of_the_trainable_parameters_reads_the_watch() -> None:
    # The first parameter a block sees may be frozen (a LoRA base weight, a linear probe's backbone)
    # and in no optimizer: any trainable one the optimizer holds makes the watch read at its step.
    library_or_skip()
    if not _guard._STEP_HOOKS:
        pytest.skip("torch 1.13 runs no global optimizer step hooks")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], 1e-3)
    with C.compress_saved(bits=8):
        model(torch.randn(16, 64, requires_grad=True)).sum().backward()
    watch = _guard.watch_for(model[0].weight)  # the first parameter saved: frozen
    assert watch.mode == "undecided" and watch._due is not None
    optimizer.step()
    assert watch.mode == "step" and watch._due is None and len(watch._pending) == 1


def test_gradient_norm_is_the_norm_of_every_gradient_in_fp32() -> None:
    """One foreach norm where torch has it (fp32 accumulation of fp32, bf16 and fp16 gradients),
    per-tensor norms elsewhere: the 2-norm of all gradients together; parameters without one skipped."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(4, dtype=torch.float16)), torch.nn.Parameter(torch.randn(2))]
    for p in params[:3]:
        p.grad = torch.randn_like(p) * 300  # fp16 squares overflow: the sum must be taken in fp32
    expected = torch.cat([p.grad.double().flatten() for p in params[:3]]).norm()
    norm = _guard.gradient_norm(params)
    assert norm is not None and norm.dtype == torch.float32
    assert math.isclose(float(norm), float(expected), rel_tol=1e-5)
    assert _guard.gradient_norm(params[3:]) is None


def test_gradient_norm_takes_float64_gradients_and_a_float64_model_trains_under_the_guard() -> None:
    """float64 gradients (alone or beside others) are normed in float64, which vector_norm will not
    narrow to float32: compress_saved's guard failed every float64 model's backward."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, dtype=torch.float64)), torch.nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn_like(p)
    for chosen in (params[:1], params):
        norm = _guard.gradient_norm(chosen)
        expected = torch.cat([p.grad.double() for p in chosen]).norm()
        assert norm is not None and norm.dtype == torch.float32 and math.isclose(float(norm), float(expected), rel_tol=1e-6)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).double()
    with abp.compress_saved(bits=4):
        model(torch.randn(8, 16, dtype=torch.float64)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_record_reads_the_device_every_window_steps() -> None:
    watch = _guard.GradientWatch(window=4)
    for i in range(3):
        assert watch.record(torch.tensor(1.0)) is None
    assert watch.norms == []
    watch.record(torch.tensor(1.0))
    assert watch.norms == [1.0] * 4


def _blow_up_training(guard) -> int:
    """A model whose gradients grow 10 % a step (a hook scales them), trained under a fresh
    compress_saved per step; returns the step the guard raised at (or -1)."""
    library_or_skip()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    scale = [1.0]
    for p in model.parameters():
        p.register_hook(lambda g: g * scale[0])
    x = torch.randn(64, 64)
    for step in range(200):
        scale[0] *= 1.1
        with C.compress_saved(bits=8, guard=guard):
            loss = model(x).pow(2).mean()
            model.zero_grad()
            try:
                loss.backward()
            except abp.DivergenceError as e:
                assert "abp.compress_saved(bits=8): the gradient norm grew from" in str(e)
                assert "stores 8 bits already" in str(e) and "guard=False" in str(e)
                return step
    return -1


def test_guard_raises_when_training_blows_up() -> None:
    step = _blow_up_training("raise")
    assert 40 <= step < 120  # 8-fold growth at 10 % a step: ~22 steps past the reference window


def test_guard_warns_by_default_and_can_be_turned_off() -> None:
    library_or_skip()
    advice = r"^abp\.compress_saved\(bits=8\): .*the gradient norm grew.*stores 8 bits already.*diverges too"
    with pytest.warns(abp.DivergenceWarning, match=advice):
        _blow_up_training("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error", abp.DivergenceWarning)
        assert _blow_up_training(False) == -1
    with pytest.raises(ValueError, match="guard: expected 'warn', 'raise', or False or None \\(off\\), got 'loud'"):
        C.compress_saved(guard="loud")


# --- kinked activations: the piece each saved value lies on is kept --------------------------

#: Activations whose derivative is constant on each piece: with the piece kept, backward is exact.
_PIECEWISE_CONSTANT = {
    "leaky_relu": lambda h: F.leaky_relu(h, 0.01),
    "leaky_relu_inplace": lambda h: F.leaky_relu(h * 1.0, 0.01, inplace=True),
    "prelu": lambda h: F.prelu(h, torch.tensor([0.25])),
    "rrelu_eval": lambda h: F.rrelu(h, training=False),
    "relu6": F.relu6,
    "relu6_inplace": lambda h: F.relu6(h * 1.0, inplace=True),
    "hardtanh": lambda h: F.hardtanh(h, -0.5, 1.0),
    "hardsigmoid": F.hardsigmoid,
    "threshold": lambda h: F.threshold(h, 0.2, -1.0),
    "clamp": lambda h: torch.clamp(h, -0.3, 0.4),
    "clamp_min": lambda h: torch.clamp(h, min=0.1),
    "hardshrink": lambda h: F.hardshrink(h, 0.3),
    "softshrink": lambda h: F.softshrink(h, 0.3),
}


def _input_grad(act, block: Optional[C.compress_saved], saved_output: bool) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """d/dx of act(x W1ᵀ) W2ᵀ against fixed data: x's gradient reads act's derivative at its
    saved value, the products' saved inputs only for the weights' gradients. `saved_output`:
    W2 trains, so the next op saves act's output; else a scale comes between and nothing does."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 64, generator=g) * 2).requires_grad_()
    w1, w2 = torch.randn(256, 64, generator=g) / 8, torch.randn(8, 256, generator=g) / 16
    w1.requires_grad_()
    w2.requires_grad_(saved_output)
    w = torch.randn(32, 8, generator=g)
    with block if block is not None else contextlib.nullcontext():
        a = act(F.linear(x, w1))
        y = F.linear(a if saved_output else a * 3.0, w2)
        (y * w).sum().backward()
    return x.grad


@pytest.mark.parametrize("told_by", ["result", "next-save"])
@pytest.mark.parametrize("name", sorted(_PIECEWISE_CONSTANT))
def test_a_kinked_activation_takes_its_exact_piece_from_codes(name: str, told_by: str) -> None:
    """LeakyReLU, ReLU6, Hardtanh, ... test which piece their saved value lies on; codes near a
    breakpoint used to land on the other piece (a LeakyReLU's derivative 1 for 0.01: a CNN's
    gradient 0.43 off at 8 bits). The block keeps the piece beside the codes, a bit per element,
    so backward takes the same derivative: x's gradient is exact at every width. The activation
    is told from its result (the recorder sees it, recompute=True) or, without the recorder, from
    the next op's save of its output; in-place forms save their result, whose node tells them."""
    library_or_skip()
    act = _PIECEWISE_CONSTANT[name]
    if name != "leaky_relu_inplace" and _save_rules.sequence_number() is None:
        pytest.skip("torch 1.13 cannot tell the op a save is for, only a kinked activation's own saved result")
    recompute, saved_output = (True, False) if told_by == "result" else (False, True)
    exact = _input_grad(act, None, saved_output)
    for bits in (1, 2, 8):
        block = C.compress_saved(bits=bits, allow_low_bits=True, min_numel=1, recompute=recompute)
        got = _input_grad(act, block, saved_output)
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
        assert block.stats["compressed"] >= 1
    plain = _input_grad(act, C.compress_saved(bits=2, allow_low_bits=True, min_numel=1, op_rules=False), saved_output)
    assert (plain - exact).norm() > 1e-3 * exact.norm(), "without the op rules the codes flip pieces"


@needs_rules
@pytest.mark.parametrize("act", [F.elu, F.hardswish, F.selu], ids=["elu", "hardswish", "selu"])
def test_a_kinked_activation_whose_derivative_also_reads_the_value_keeps_its_piece(act) -> None:  # type: ignore[no-untyped-def]
    """ELU's and Hardswish's derivative read the value on a piece too: the piece is kept, the value
    is its codes' (unbiased); the saved value comes back on its own side of every breakpoint."""
    library_or_skip()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=g).requires_grad_(), torch.randn(256, 32, generator=g) / 2
    nbytes = {}
    for rules in (True, False):
        with C.compress_saved(bits=2, allow_low_bits=True, min_numel=1, op_rules=rules) as block:
            h = F.linear(x, w)
            out = act(h)
        nbytes[rules] = block.stats["bytes_compressed"]
        if rules:
            region = _save_rules.region_of(out.grad_fn)
            assert region is not None
            assert torch.equal(region.inside(out.grad_fn._saved_self), region.inside(h))
    assert nbytes[True] - nbytes[False] == h.numel() // 8  # the piece: a bit per element


def test_with_region_moves_each_value_onto_its_own_side_and_no_further() -> None:
    """with_region on decoded values: inside ones clamped into the interval (an open end's next
    value inward), outside ones pushed to the nearer end (an open end itself, a closed end's next
    value outward); values already on their side, and exact breakpoints, unchanged."""
    g = torch.Generator().manual_seed(0)
    regions = [_save_rules.Region(0.0, math.inf, False), _save_rules.Region(0.0, 6.0, False),
               _save_rules.Region(-3.0, 3.0, True), _save_rules.Region(-math.inf, 0.4, True)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for region in regions:
            ends = [e for e in (region.lo, region.hi) if math.isfinite(e)]
            t = torch.cat([torch.randn(2000, generator=g) * 4, torch.tensor(ends * 8)]).to(dtype)
            noisy = (t.float() + torch.randn(t.shape, generator=g) * 0.3).to(dtype)
            inside = region.inside(t)
            fixed = C.with_region(noisy, inside, region)
            assert fixed.dtype == dtype
            assert torch.equal(region.inside(fixed), inside), (dtype, region)
            # A value on its side is unchanged, but for one within a few units in the last place
            # of an end (moved past the end and its rounding: _region_ends); one on the other side
            # moves no further than to where the decoded value had to be.
            same_side = region.inside(noisy) == inside
            near_end = 8 * torch.finfo(dtype).eps * 6
            assert bool(((fixed.float() - noisy.float()).abs()[same_side] <= near_end).all())
            moved = (fixed.float() - noisy.float()).abs()[~same_side]
            assert bool((moved <= (noisy.float() - t.float()).abs()[~same_side] + near_end).all())


@needs_rules
def test_the_controller_counts_the_piece_bit_in_its_budget() -> None:
    """A kinked activation's saved input costs its codes and a bit per element, as a ReLU
    output's support does (stored_bits)."""
    library_or_skip()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LeakyReLU(0.01), nn.Linear(256, 8))
    controller = abp.CompressionController(model, avg_bits=4, interval=1000)
    x = torch.randn(32, 64)
    with controller:
        model(x).square().sum().backward()
    keys = [k for k in controller.bits if k.shape == (32, 256)]
    assert keys and any(k in controller._supported for k in keys)
    key = next(k for k in keys if k in controller._supported)
    n = 32 * 256
    assert controller.stored_bits(key, 4) == 4 * n + n


@needs_rules
def test_telling_a_kinked_activation_reads_no_save_of_a_checkpoint() -> None:
    """A non-reentrant checkpoint whose last op is a LeakyReLU, inside a block: the block tells
    kinked activations by what their saves are, never by reading a node's saves, which under the
    checkpoint's hooks would run its recomputation in the middle of forward."""
    library_or_skip()
    import torch.utils.checkpoint as checkpoint

    calls = []
    lin = nn.Linear(64, 256)

    def segment(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return F.leaky_relu(lin(x), 0.01)

    x = torch.randn(32, 64, requires_grad=True)
    head = nn.Linear(256, 8)
    for recompute in (True, False):
        calls.clear()
        with C.compress_saved(bits=8, min_numel=1, recompute=recompute):
            y = head(checkpoint.checkpoint(segment, x, use_reentrant=False))
            assert len(calls) == 1, "forward ran the segment once"
            y.sum().backward()
        assert len(calls) == 2, "backward recomputed it once"
