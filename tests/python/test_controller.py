"""GACT bit allocation and the sensitivity-driven CompressionController (docs/algorithms.md §6.3, §6.6).

The allocation tests are pure Python. The controller tests run small models on the CPU path and
need the GACT kernels (gact_b1..gact_b8) of the native library.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import math
import random
import re
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abp
import abp.compress as C
import abp._replay as replay_engine
import abp.controller as ctl
from abp.controller import RUNGS, CompressionController, TensorKey, allocate_bits
from abp_reference import library_or_skip, train_tiny_llama


def _variance(c: Sequence[float], bits: Sequence[int]) -> float:
    """Σ C/(2^b − 1)², raw tensors adding nothing (the random cases have no NaN or huge C)."""
    return sum(0.0 if b == 32 else x / ((1 << b) - 1) ** 2 for x, b in zip(c, bits))


def _total(bits: Sequence[int], d: Sequence[int]) -> int:
    return sum(b * n for b, n in zip(bits, d))


# ---------------------------------------------------------------------------------------------------
# allocate_bits


@pytest.mark.parametrize("avg_bits, expected", [(4, [8, 4, 4, 8, 2]), (2, [4, 2, 2, 8, 1])])
def test_reproduces_the_6_3_test_vector(avg_bits, expected):
    c, d = (10, 1, 0.1, 100, 0.01), (1000, 4000, 4000, 500, 8000)
    bits = allocate_bits(c, d, avg_bits)
    assert bits == expected
    assert _total(bits, d) / sum(d) == pytest.approx({4: 3.43, 2: 1.83}[avg_bits], abs=0.005)


def _random_case(rng: random.Random, n_max: int) -> Tuple[List[float], List[int], float]:
    n = rng.randint(1, n_max)
    c = [0.0 if rng.random() < 0.1 else 10 ** rng.uniform(-6, 6) for _ in range(n)]
    d = [rng.choice([1, 7, 256, 1000, rng.randint(1, 10000)]) for _ in range(n)]
    avg = rng.choice([1, 1.0, 2, 3, 4, 8, 31.5, 32, rng.uniform(1, 32), rng.uniform(1, 4)])
    return c, d, avg


def _cost(c: float, d: int, high: int, low: int) -> float:
    """Variance added per bit saved by lowering one tensor from `high` to `low` bits."""
    return (_variance([c], [low]) - _variance([c], [high])) / (d * (high - low))


def _raising_cost(c: float, d: int, bits: int) -> Optional[float]:
    """The cost of the step that lowered a tensor to `bits` (None at 32: no step taken)."""
    i = RUNGS.index(bits)
    return None if i == 0 else _cost(c, d, RUNGS[i - 1], bits)


def test_budget_is_never_exceeded_and_the_greedy_stops_at_the_first_feasible_point():
    rng = random.Random(1234)
    for _ in range(2000):
        c, d, avg = _random_case(rng, 12)
        bits = allocate_bits(c, d, avg)
        assert len(bits) == len(c) and all(b in RUNGS for b in bits)
        assert _total(bits, d) <= avg * sum(d)
        # It lowers only while over the budget: undoing one lowering (raising one tensor one rung)
        # of the last lowered tensor would exceed it, unless nothing was lowered at all.
        if _total(bits, d) < 32 * sum(d):
            assert any(b < 32 and _total(bits[:i] + [RUNGS[RUNGS.index(b) - 1]] + bits[i + 1:], d) > avg * sum(d)
                       for i, b in enumerate(bits))


def test_result_has_the_threshold_structure_of_the_marginal_costs():
    # The ladder's per-bit costs grow down the rungs, so the greedy takes lowering steps in order
    # of cost: every step taken costs no more than any step not taken.
    rng = random.Random(99)
    for _ in range(2000):
        c, d, avg = _random_case(rng, 10)
        bits = allocate_bits(c, d, avg)
        taken = [_raising_cost(c[i], d[i], b) for i, b in enumerate(bits)]
        not_taken = [_cost(c[i], d[i], b, RUNGS[RUNGS.index(b) + 1]) for i, b in enumerate(bits) if b != 1]
        taken = [t for t in taken if t is not None]
        if taken and not_taken:
            assert max(taken) <= min(not_taken) * (1 + 1e-12)


def test_greedy_is_optimal_for_the_bits_it_uses_and_brute_force_is_never_worse():
    rng = random.Random(7)
    for _ in range(300):
        c, d, avg = _random_case(rng, 5)
        bits = allocate_bits(c, d, avg)
        greedy, used = _variance(c, bits), _total(bits, d)
        best_budget = best_used = math.inf
        for combo in itertools.product(RUNGS, repeat=len(c)):
            v, t = _variance(c, combo), _total(combo, d)
            if t <= avg * sum(d):
                best_budget = min(best_budget, v)
            if t <= used:
                best_used = min(best_used, v)
        # The greedy may undershoot the budget (coarse rungs), so it is not always optimal for it...
        assert best_budget <= greedy * (1 + 1e-12) + 1e-300
        # ...but it is a Lagrangian point: nothing with as few bits has less variance.
        assert best_used == pytest.approx(greedy, rel=1e-9, abs=1e-300)


def test_the_greedy_budgets_stored_bits_and_passes_over_rungs_that_save_none():
    """compress_saved pads planes no group divides (each code element costs b bits, the padding
    too) and keeps a tensor as it is where its codes would take its bytes (a 2 x 2 plane at 8
    bits): the greedy counts those bits, and passes over a rung that saves none to the next that
    does (ResNet-18 at 48 px kept its 2 x 2 layer at 32 bits, and the allocation averaged 4.5 bits
    at avg_bits=4)."""
    rng = random.Random(11)
    for _ in range(1000):
        n = rng.randint(1, 8)
        c = [rng.choice([0.0, rng.random(), 10 ** rng.uniform(-6, 3)]) for _ in range(n)]
        d = [rng.randint(1, 1000) for _ in range(n)]
        costs = []
        for numel in d:
            padded = numel * rng.choice([1, 1, 8 / 7, 2])
            raw_at = rng.choice([0, 0, 1, 2])  # rungs 1..raw_at (8, 4) keep the tensor as it is
            costs.append([32 * numel] + [32 * numel if r <= raw_at else math.ceil(RUNGS[r] * padded)
                                         for r in range(1, len(RUNGS))])
        avg = rng.uniform(1, 12)
        budget = math.floor(avg * sum(d))
        bits = ctl._greedy(c, costs, budget, strict=False)
        rungs = [RUNGS.index(b) for b in bits]
        spent = sum(cost[r] for cost, r in zip(costs, rungs))
        fewest = sum(min(cost) for cost in costs)
        assert spent <= budget or spent == fewest
        # Never at a rung that saves nothing over a wider one.
        assert all(cost[r] < cost[0] or r == 0 for cost, r in zip(costs, rungs))
    # A tensor whose codes pay only from 4 bits on goes from 32 to 4 where the budget needs it.
    assert ctl._greedy([1.0, 1.0], [[3200, 3200, 1200, 800, 400], [3200, 800, 400, 200, 100]], 2400) == [4, 8]


def test_the_allocation_does_not_depend_on_the_loss_scale():
    # A GradScaler multiplies the loss by S and so every sensitivity by S² (2^32 at its default
    # scale); with an absolute cap (1e10) the larger ones became ties and 8 of 12 keys of a ViT
    # changed width. Powers of two scale exactly, so the allocations must be equal, not close.
    rng = random.Random(5)
    for _ in range(500):
        c, d, avg = _random_case(rng, 12)
        bits = allocate_bits(c, d, avg)
        for scale in (2.0 ** 32, 2.0 ** 48, 2.0 ** -30):
            assert allocate_bits([v * scale for v in c], d, avg) == bits
    wide = [10.0 ** e for e in range(4, 10)]  # an absolute cap at 1e10 flattened these at 2^32
    assert allocate_bits([v * 2.0 ** 32 for v in wide], [100] * 6, 3) == allocate_bits(wide, [100] * 6, 3)
    assert len(set(allocate_bits(wide, [100] * 6, 3))) > 1


def test_edges_ties_and_clamping():
    assert allocate_bits([], [], 2) == []
    assert allocate_bits([5.0, 1.0], [10, 10], 32) == [32, 32]
    assert allocate_bits([5.0, 1.0], [10, 10], 1) == [1, 1]
    # Equal costs go to the smaller index first: 64 bits over a budget of 40 lower tensor 0.
    assert allocate_bits([1.0, 1.0], [1, 1], 20) == [8, 32]
    assert allocate_bits([0.0, 0.0, 0.0], [3, 3, 3], 2.5) == [1, 1, 4]
    # NaN and infinities count as 1e10 times the largest finite sensitivity.
    base = allocate_bits([3e10, 1.0, 3.0], [100, 100, 100], 3)
    for odd in (math.nan, math.inf, -math.inf):
        assert allocate_bits([odd, 1.0, 3.0], [100, 100, 100], 3) == base
    assert allocate_bits([torch.tensor(2.0), 1], (4, 4), 4.0) == allocate_bits([2.0, 1.0], [4, 4], 4)


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (([1.0], [1, 2], 2), ValueError, r"^numels: expected one per sensitivity \(1\), got 2"),
        (([1.0], [0], 2), ValueError, r"^numels\[0\]: expected an int > 0, got 0"),
        (([1.0], [-3], 2), ValueError, r"^numels\[0\]"),
        (([1.0], [2.5], 2), TypeError, r"^numels\[0\]: expected an int, got float"),
        (([1.0], [True], 2), TypeError, r"^numels\[0\]: expected an int, got bool"),
        ((["1"], [4], 2), TypeError, r"^sensitivities\[0\]: expected a number, got str"),
        (([-1.0], [4], 2), ValueError, r"^sensitivities\[0\]: expected a number >= 0"),
        (("abc", [4], 2), TypeError, r"^sensitivities: expected a sequence, got str"),
        (([1.0], 4, 2), TypeError, r"^numels: expected a sequence, got int"),
        (([1.0], [4], "2"), TypeError, r"^avg_bits: expected a number, got str"),
        (([1.0], [4], True), TypeError, r"^avg_bits: expected a number, got bool"),
        (([1.0], [4], 0), ValueError, r"^avg_bits: expected a number > 0"),
        (([1.0], [4], -2), ValueError, r"^avg_bits: expected a number > 0"),
        (([1.0], [4], math.nan), ValueError, r"^avg_bits"),
        (([1.0], [4], 0.5), ValueError, r"^avg_bits: 0.5 is below 1 bit per element"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(args, error, pattern):
    with pytest.raises(error, match=pattern):
        allocate_bits(*args)


# ---------------------------------------------------------------------------------------------------
# CompressionController: models



#: Most tests here exercise the mechanism at GACT's own settings: budgets below 2 bits (refused
#: by default), the full ladder down to 1 bit (off by default: min_bits=2), and every saved tensor
#: stored (abp recomputes what cheap ops derive from stored tensors by default, and these small
#: models are mostly such ops: test_recompute_* below).
GACT_LADDER: Dict[str, Any] = {"allow_low_bits": True, "min_bits": 1, "recompute": False}

@pytest.fixture
def kernels() -> None:
    library_or_skip()


class Scale(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class Planted(nn.Module):
    """Two twin Linear layers a and b read the same hidden state; a's input is scaled ×100 (and
    its weights ÷100, so the output is unchanged in law): a's saved input is ~10^4× as sensitive."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.up = Scale(100.0)
        self.same = Scale(1.0)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            self.a.weight.div_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        return self.head(self.act2(self.a(self.up(h)) + self.b(self.same(h))))


class Skippable(nn.Module):
    """fc1 → GELU → (block, unless skip) → fc2 → GELU → fc3; `skip` is a keyword argument. Every
    module saves a tensor of its own (GELU saves its input, Linear its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.GELU()
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU())
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.GELU()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, *, skip: bool = False) -> torch.Tensor:
        h = self.act1(self.fc1(x))
        if not skip:
            h = self.block(h)
        return self.fc3(self.act2(self.fc2(h)))


class Constant(nn.Module):
    """h · 3, as a product with a constant tensor on the gradient path (h · 0 + 3): the saved
    constant quantises exactly at any width, so its sensitivity is exactly 0 if and only if the
    replays are deterministic."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * (h * 0.0 + 3.0)


def stochastic_model() -> nn.Module:
    return nn.Sequential(nn.Dropout(0.3), nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), Constant(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def batch(seed: int, n: int = 64, d_in: int = 16, d_out: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # The input on the gradient path (a clone of a leaf that requires grad), as the hidden state
    # of a larger model would be: compress_saved keeps an input that requires no grad as it is.
    return torch.randn(n, d_in, generator=g).requires_grad_().clone(), torch.randn(n, d_out, generator=g)


def train_step(controller: CompressionController, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               **kwargs: Any) -> torch.Tensor:
    model.zero_grad()
    with controller:
        loss = F.mse_loss(model(x, **kwargs), y)
        loss.backward()
    return loss.detach()


def keys_of(bits: Dict[TensorKey, int], module: str) -> List[TensorKey]:
    return [k for k in bits if k.module == module]


# ---------------------------------------------------------------------------------------------------
# CompressionController: behaviour


def test_planted_sensitive_tensor_gets_more_bits_and_the_budget_holds(kernels):
    torch.manual_seed(0)
    model = Planted()
    x, y = batch(0)
    controller = CompressionController(model, 2.0, **GACT_LADDER, interval=100)
    train_step(controller, model, x, y)
    assert controller.estimates == 1 and controller.step == 1
    bits, sens = controller.bits, controller.sensitivity
    (ka,), (kb,) = keys_of(bits, "a"), keys_of(bits, "b")
    assert ka.shape == kb.shape == (64, 32) and ka.dtype == kb.dtype == torch.float32
    assert sens[ka] > 100 * sens[kb] > 0
    assert bits[ka] > bits[kb]
    assert controller.average_bits() <= 2.0
    numels = controller.last_step_keys
    assert sum(b * numels[k] for k, b in bits.items()) <= 2.0 * sum(numels.values())
    # The allocation applies from the next step on, to the same keys.
    before = controller.stats
    train_step(controller, model, x, y)
    assert set(controller.last_step_keys) == set(bits)
    assert controller.stats["bytes_compressed"] != before["bytes_compressed"]


def test_min_bits_keeps_the_allocation_off_narrower_codes(kernels):
    """With GACT's ladder the planted model's insensitive tensors go to 1 bit so that the sensitive
    one can have more; with min_bits=2 (the default) none goes below 2, and a 2-bit budget leaves
    every tensor at 2. The ReLUs' outputs keep their support besides their codes, a bit per
    element: at min_bits=2 they take 3, which a 2-bit budget cannot give, and the controller says so."""
    widths = {}
    for min_bits, avg_bits in ((1, 2.5), (2, 2.0)):
        torch.manual_seed(0)
        model = Planted()
        x, y = batch(0)
        controller = CompressionController(model, avg_bits, allow_low_bits=True, min_bits=min_bits, interval=100,
                                           recompute=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(controller, model, x, y)
        widths[min_bits] = controller.bits
        over = [w for w in caught if "exceed the budget" in str(w.message)]
        if min_bits == 1:
            assert controller.average_bits() <= avg_bits and not over
        else:
            # It names what applies, with its share: no op rule raised a width here.
            assert controller.average_bits() > avg_bits and over
            message = str(over[0].message)
            assert "ReLU outputs' support and kinked activations' sides of their breakpoints, a bit per element: 44% of " \
                "the elements" in message, message
            assert "op rules" not in message and "padded" not in message, message
    assert min(widths[1].values()) == 1 and max(widths[1].values()) > 2
    assert set(widths[2].values()) == {2}
    assert CompressionController(Planted()).avg_bits == 4.0  # the default budget is not refused


def test_keys_are_printable_and_stable_across_steps_and_estimates(kernels):
    torch.manual_seed(1)
    model = Planted()
    controller = CompressionController(model, 3.0, **GACT_LADDER, interval=2)
    allocations = []
    for step in range(5):
        x, y = batch(step)
        train_step(controller, model, x, y)
        assert set(controller.last_step_keys) <= set(controller.bits)
        if step % 2 == 0:
            allocations.append(controller.bits)
    assert controller.estimates == 3
    assert all(set(a) == set(allocations[0]) for a in allocations)
    for key in allocations[0]:
        assert re.fullmatch(r"[\w.]*:\((\d+, )*\d*\):torch\.float32#\d+", str(key)), str(key)
        assert key == TensorKey(key.module, key.shape, key.dtype, key.index) and hash(key) == hash(
            TensorKey(key.module, key.shape, key.dtype, key.index))
    assert "fc1:(64, 16):torch.float32#0" in {str(k) for k in allocations[0]}
    assert controller.average_bits() <= 3.0


def expected_compressed_bytes(key: TensorKey, bits: int) -> int:
    # docs/algorithms.md §9.4: ⌈n·b/8⌉ + groups·2·4 per fp32 tensor. The tensors here have rows of
    # 16 or 32 elements: one group per row (compress.plane_groups keeps groups within rows). The
    # ReLUs' outputs (saved in `act` and `act2`) keep their support besides, ⌈n/8⌉ bytes.
    shape = key.shape
    assert shape[-1] in (16, 32)
    n = math.prod(shape)
    support = math.ceil(n / 8) if key.module in ("act", "act2") else 0
    return math.ceil(n * bits / 8) + n // shape[-1] * 2 * 4 + support


@pytest.mark.parametrize("avg_bits, width", [(1, 1), (1.5, 1), (2, 2), (3, 2), (4, 4), (7.9, 4), (8, 8), (31.5, 8), (32, 32)])
def test_iteration_0_stores_its_tensors_as_they_are_and_the_next_the_allocation(kernels, avg_bits, width):
    torch.manual_seed(2)
    model = Planted()
    x, y = batch(2)
    controller = CompressionController(model, avg_bits, **GACT_LADDER, interval=10)
    assert controller.initial_bits == width
    assert controller.average_bits() == 32  # nothing estimated: stored as it is
    train_step(controller, model, x, y)
    stats = controller.stats
    # Its estimate replays every tensor as it is anyway: step 0 holds no more than that.
    assert stats["compressed"] == 0 and stats["tensors"] > 0
    with C.compress_saved(bits_for=lambda t: 32, exact_relu=False, recompute=False) as raw:
        F.mse_loss(model(x), y).backward()
    assert stats["bytes_stored"] == raw.stats["bytes_stored"]
    # The fewest bits it can store: 1 per element, and the ReLUs' supports (act's and act2's
    # outputs, 2 x 64 x 32 of the 9216 elements) a bit each besides.
    assert controller.estimates == 1 and controller.average_bits() <= max(avg_bits, 1 + 4096 / 9216)
    # Step 1 stores each key at its allocated width.
    train_step(controller, model, x, y)
    stats = controller.stats
    numels = controller.last_step_keys
    assert set(numels) == set(controller.bits)
    coded = {k: b for k, b in controller.bits.items() if b < 32}
    assert stats["compressed"] == len(coded) and (len(coded) > 0) == (avg_bits < 32)  # 32: everything fits raw
    assert stats["bytes_compressed"] == sum(expected_compressed_bytes(k, b) for k, b in coded.items())


class PaddedPlanes(nn.Module):
    """A convolution's output at 7 x 7 pixels (codes pad each channel's 49 pixels to a group of 56)
    and a Linear to 3 features seen as (N, 1, 1, 3) planes, which code to as many bytes as they
    take at 4 or 8 bits (one group of 8 and an 8-byte header: 12 bytes, or 16; raw 12), so they are
    kept as they are there."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv2d(4, 16, 3, padding=1), nn.SiLU()
        self.fc, self.act2, self.head = nn.Linear(16 * 49, 3), nn.Tanh(), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc(self.act(self.conv(x)).flatten(1)).view(-1, 1, 1, 3)).flatten(1))


@pytest.mark.parametrize("avg_bits", [2, 4])
def test_the_budget_counts_padded_planes_and_tensors_kept_as_they_are(kernels, avg_bits):
    """The budget is of what is stored: a padded plane's codes cost b bits per padded element, a
    tensor whose codes would not pay costs 32 per element whatever width it was given. (Before,
    the allocation counted b per element for both: ResNet-18 at 48 px and avg_bits=4 stored 4.04
    bits per element of codes while average_bits() said 3.63.)"""
    torch.manual_seed(0)
    model, n = PaddedPlanes(), 512
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, 7, 7, generator=g).requires_grad_().clone(), torch.randn(n, 1, generator=g)
    controller = CompressionController(model, avg_bits, **GACT_LADDER, interval=10)
    for _ in range(2):
        train_step(controller, model, x, y)
    bits = controller.bits
    by_shape = {k.shape: b for k, b in bits.items()}
    assert (n, 16, 7, 7) in by_shape and (n, 1, 1, 3) in by_shape and (n, 16 * 49) in by_shape

    def stored(shape: Tuple[int, ...], b: int) -> int:  # what compress_saved stores, by hand
        if b == 32 or (shape == (n, 1, 1, 3) and b >= 4):
            return 32 * math.prod(shape)
        if shape[2:] == (7, 7):  # the convolution's input and output
            return b * shape[0] * shape[1] * 56
        if shape == (n, 1, 1, 3):
            return b * n * 8
        return b * math.prod(shape)  # rows of 784 (groups of 112), or of 3 (narrow: groups span them)

    assert all(controller.stored_bits(k, b) == stored(k.shape, b) for k in bits for b in RUNGS)
    total = sum(math.prod(k.shape) for k in bits) + controller._numel_at_zero_bits
    real = sum(stored(k.shape, b) for k, b in bits.items())
    assert controller.average_bits() == real / total
    assert real <= math.floor(avg_bits * total)  # within the budget, counted as stored
    assert by_shape[(n, 16, 7, 7)] < 32  # the padded planes are coded (their padding counts)
    # What the last step compressed is what the allocation says it codes.
    coded = [k for k, b in bits.items() if b < 32 and stored(k.shape, b) < 32 * math.prod(k.shape)]
    assert controller.stats["compressed"] == len(coded)


def test_relu_outputs_keep_their_support_within_the_budget_and_the_gradient_is_unbiased(kernels):
    """A ReLU's backward reads its output for the sign; stored as plain codes, a code of a zero
    decodes above zero and the gradient is biased (a Conv-BatchNorm-ReLU net at avg_bits=4: the
    mean of 8 draws 0.146 off exact, about the single draws' 0.199). The controller keeps the
    support exactly, a bit per element it budgets: the mean of 8 draws falls as 1/sqrt(8) of a
    single draw's error would (0.031 against 0.081)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 5))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)
    start = copy.deepcopy(model.state_dict())

    def grads(block: Any) -> torch.Tensor:
        model.load_state_dict(start)  # BatchNorm's running statistics too
        model.zero_grad(set_to_none=True)
        with block:
            F.cross_entropy(model(x), y).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    exact = grads(contextlib.nullcontext())
    controller = CompressionController(model, 4.0, interval=1000)
    grads(controller)  # the estimate
    draws = [grads(controller) for _ in range(8)]
    relus = [k for k in controller.bits if k.module in ("2", "5", "8")]
    assert relus and all(controller.bits[k] < 32 for k in relus)
    assert controller.average_bits() <= 4.0
    single = sum(float((d - exact).norm() / exact.norm()) for d in draws) / len(draws)
    mean = float((torch.stack(draws).mean(0) - exact).norm() / exact.norm())
    assert mean < 0.5 * single, (mean, single)


def test_a_batch_of_another_size_takes_the_widths_of_the_same_positions(kernels):
    """Keys carry shapes; a batch of another length (dynamic padding) makes other keys, whose
    saves take the width the last estimate gave the save at the same place: same module, dtype
    and rank, same ordinal among that place's saves."""
    torch.manual_seed(2)
    model = Planted()
    controller = CompressionController(model, 2.0, **GACT_LADDER, interval=10)
    x, y = batch(2)
    train_step(controller, model, x, y)  # step 0: the estimate
    widths = controller.bits
    assert len(set(widths.values())) > 1, widths  # the planted sensitivity: not one width for all
    given: List[int] = []
    bits_for = controller._saver.bits_for
    controller._saver.bits_for = lambda t: given.append(bits_for(t)) or given[-1]
    x, y = batch(3, n=40)  # 40 rows instead of 64
    train_step(controller, model, x, y)
    numels = controller.last_step_keys
    assert numels and not set(numels) & set(widths)  # other keys
    by_place = {(k.module, k.dtype, len(k.shape), k.index): b for k, b in widths.items()}
    want = {k: by_place[(k.module, k.dtype, len(k.shape), k.index)] for k in numels}
    assert dict(zip(controller._order, given)) == want
    coded = {k: b for k, b in want.items() if b < 32}
    stats = controller.stats
    assert stats["compressed"] == len(coded)
    assert stats["bytes_compressed"] == sum(expected_compressed_bytes(k, b) for k, b in coded.items())
    # Not all at the initial width, as keys nobody estimated would be.
    assert set(want.values()) != {controller.initial_bits}


def test_the_controller_at_two_bits_trains_on_batches_of_varying_length() -> None:
    """Dynamic padding (a Trainer's default collator) gives each batch its own length, so its
    own keys; they take the estimate's widths by position. Deterministic (fixed seeds, CPU).
    Measured with torch 2.15: exact 1.940, the controller 1.940; 2.211 when such keys took the
    initial width (every tensor at 2 bits, the estimate's allocation never used)."""
    pytest.importorskip("transformers")
    lengths = (32, 27, 30, 24)
    exact, controlled = train_tiny_llama(controller=False, lengths=lengths), train_tiny_llama(True, lengths=lengths)
    assert controlled < 1.03 * exact, (exact, controlled)


def test_keys_do_not_shift_when_a_branch_is_skipped(kernels):
    torch.manual_seed(3)
    model = Skippable()
    x, _ = batch(3)
    y = torch.randn(64, 4)
    controller = CompressionController(model, 2.0, **GACT_LADDER, interval=3)
    train_step(controller, model, x, y, skip=False)  # probe step, with a keyword argument
    full = controller.last_step_keys
    assert controller.estimates == 1 and set(controller.bits) == set(full)
    assert keys_of(full, "block.0") and keys_of(full, "block.1")
    train_step(controller, model, x, y, skip=True)
    skipped = controller.last_step_keys
    assert not keys_of(skipped, "block.0") and not keys_of(skipped, "block.1")
    # The tensors after the skipped block keep their keys, hence their allocated widths.
    assert set(skipped) == {k for k in full if not k.module.startswith("block")}
    for name in ("fc1", "act1", "fc2", "act2", "fc3"):
        assert len(keys_of(skipped, name)) == 1 and keys_of(skipped, name) == keys_of(full, name)
    # An estimate on a skipping step allocates over that step's keys; the others fall back.
    train_step(controller, model, x, y, skip=True)
    train_step(controller, model, x, y, skip=True)
    assert controller.estimates == 2 and set(controller.bits) == set(skipped)
    assert controller.average_bits() <= 2.0


def test_a_module_called_twice_gets_two_indices(kernels):
    torch.manual_seed(4)
    inner = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
    model = nn.Sequential(nn.Linear(16, 32), inner, nn.Linear(32, 1))

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body[1](self.body[0](x))
            return self.body[2](self.body[1](h))

    twice = Twice()
    x, y = batch(4)
    controller = CompressionController(twice, 2.0, **GACT_LADDER)
    train_step(controller, twice, x, y)
    indices = sorted(k.index for k in controller.bits if k.module == "body.1.1")
    assert indices == [0, 1]
    assert all(math.isfinite(v) for v in controller.sensitivity.values())


def test_estimates_happen_at_step_0_and_every_interval_steps(kernels):
    torch.manual_seed(5)
    model = Planted()
    calls: List[int] = []
    model.head.register_forward_pre_hook(lambda m, a: calls.append(1))
    controller = CompressionController(model, 2.0, **GACT_LADDER, interval=3)
    estimates, passes = [], []
    for step in range(7):
        before = len(calls)
        x, y = batch(step)
        train_step(controller, model, x, y)
        estimates.append(controller.estimates)
        passes.append(len(calls) - before)
    assert estimates == [1, 1, 1, 2, 2, 2, 3]
    keys = len(controller.bits)
    # A probe step: the user's pass, one exact replay and one replay per key.
    assert passes == [keys + 2, 1, 1, keys + 2, 1, 1, keys + 2]
    assert controller.step == 7


def test_the_automatic_interval_spaces_estimates_by_twenty_steps_per_replay(kernels):
    """interval="auto" (the default): an estimate replays the step once exact and once per probed
    key, and the next comes AUTO_STEPS_PER_REPLAY steps per replay later, so estimates stay near
    5 % of the training time however many keys a model has (a fixed 1000 steps did not)."""
    from abp.controller import AUTO_STEPS_PER_REPLAY

    torch.manual_seed(5)
    model = Planted()
    calls: List[int] = []
    model.head.register_forward_pre_hook(lambda m, a: calls.append(1))
    controller = CompressionController(model, 2.0, **GACT_LADDER)
    assert controller.interval == "auto" and controller.next_estimate == 0
    x, y = batch(0)
    train_step(controller, model, x, y)
    replays = len(calls) - 1  # the exact replay and one per key (the user's own pass aside)
    assert replays == len(controller.bits) + 1 >= 3
    due = AUTO_STEPS_PER_REPLAY * replays
    assert controller.estimates == 1 and controller.next_estimate == due
    for step in range(1, due + 1):
        before = len(calls)
        x, y = batch(step)
        train_step(controller, model, x, y)
        assert (len(calls) - before > 1) == (step == due), step  # only step `due` replays
    assert controller.estimates == 2 and controller.next_estimate == 2 * due


def test_probe_steps_leave_grad_rng_and_buffers_as_the_users_step_left_them(kernels):
    x, y = batch(6)

    def run(use_controller: bool) -> Tuple[List[torch.Tensor], List[torch.Tensor], torch.Tensor, Dict[str, Any]]:
        torch.manual_seed(6)
        model = stochastic_model()
        g = torch.Generator().manual_seed(11)
        inside: List[torch.Tensor] = []
        model.zero_grad()
        if use_controller:
            controller = CompressionController(model, 2.0, **GACT_LADDER, generator=g, min_numel=512)
            with controller:
                F.mse_loss(model(x), y).backward()
                inside = [p.grad.clone() for p in model.parameters()]
            assert controller.estimates == 1
        else:
            F.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        return grads, inside, torch.get_rng_state(), {k: v.clone() for k, v in model.state_dict().items()}

    grads, inside, rng, state = run(True)
    ref_grads, _, ref_rng, ref_state = run(False)
    # The probes use torch.autograd.grad: .grad is what the user's backward left...
    assert all(torch.equal(a, b) for a, b in zip(grads, inside))
    # ...which is exactly the uncompressed step (step 0 stores its tensors as they are).
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    # Dropout's stream continues as if there had been no probe; BatchNorm saw one batch.
    assert torch.equal(rng, ref_rng)
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in state)
    assert int(state["2.num_batches_tracked"]) == 1


def test_replays_are_deterministic_under_dropout(kernels, monkeypatch):
    x, y = batch(7)

    def constant_sensitivity() -> float:
        torch.manual_seed(7)
        model = stochastic_model()
        controller = CompressionController(model, 2.0, **GACT_LADDER, min_numel=512)
        train_step(controller, model, x, y)
        (key,) = keys_of(controller.sensitivity, "4")
        return controller.sensitivity[key]

    assert constant_sensitivity() == 0.0
    # Negative control: without restoring the RNG before each replay, dropout masks differ.
    monkeypatch.setattr(replay_engine, "set_rng_state", lambda state: None)
    assert constant_sensitivity() > 0.0


def test_replays_run_under_the_autocast_of_the_recorded_call(kernels, monkeypatch):
    def probe() -> CompressionController:
        torch.manual_seed(11)
        model = Planted()
        x, y = batch(11)
        controller = CompressionController(model, 2.0, **GACT_LADDER)
        with controller:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            F.mse_loss(out.float(), y).backward()
        return controller

    controller = probe()
    assert len(controller.bits) == 5 and {k.dtype for k in controller.bits} == {torch.bfloat16}
    # The replays (outside the user's autocast block) saved every key again, so all were probed.
    assert set(controller.sensitivity) == set(controller.bits)
    assert all(math.isfinite(v) for v in controller.sensitivity.values())
    # Negative control: replayed without autocast, the saved tensors are fp32 and match no key.
    monkeypatch.setattr(replay_engine, "_autocast", lambda state: contextlib.nullcontext())
    assert probe().sensitivity == {}


def test_tensors_saved_outside_the_model_keep_the_initial_width(kernels):
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
    x, _ = batch(8)
    target = torch.randn(64, 32)
    controller = CompressionController(model, 3.0, **GACT_LADDER)
    with controller:
        out = model(x)
        loss = (out - target).pow(2).mean()  # pow saves out − target: a (64, 32) tensor outside
        loss.backward()
    outside = keys_of(controller.bits, ctl.OUTSIDE)
    assert len(outside) == 1 and outside[0].shape == (64, 32)
    assert controller.bits[outside[0]] == controller.initial_bits == 2
    assert outside[0] not in controller.sensitivity
    assert set(controller.sensitivity) == set(controller.bits) - set(outside)
    assert controller.average_bits() <= 3.0


def test_nothing_recorded_survives_the_probe(kernels, monkeypatch):
    alive: List[weakref.ref] = []

    class Tracked(replay_engine.Call):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            alive.append(weakref.ref(self))

    monkeypatch.setattr(replay_engine, "Call", Tracked)
    torch.manual_seed(9)
    model = Planted()
    x, y = batch(9)
    controller = CompressionController(model, 2.0, **GACT_LADDER)
    with controller:
        out = model(x)  # the user keeps the output (and its graph) beyond the step
        F.mse_loss(out, y).backward(retain_graph=True)
    assert controller.estimates == 1 and len(alive) == 1
    gc.collect()
    assert alive[0]() is None  # the recorded inputs and output gradients went with it
    assert "forward" not in model.__dict__
    # A later backward through the kept output reaches none of the controller's hooks.
    F.mse_loss(out, y).backward()
    assert alive[0]() is None


def test_an_evaluation_block_postpones_the_estimate(kernels):
    torch.manual_seed(10)
    model = Planted()
    x, y = batch(10)
    controller = CompressionController(model, 2.0, **GACT_LADDER, interval=5)
    with controller, torch.no_grad():
        model(x)
    assert controller.step == 1 and controller.estimates == 0
    train_step(controller, model, x, y)
    assert controller.step == 2 and controller.estimates == 1
    for _ in range(4):
        train_step(controller, model, x, y)
    assert controller.estimates == 1
    train_step(controller, model, x, y)
    assert controller.estimates == 2


def test_training_with_the_controller_reduces_the_loss(kernels):
    torch.manual_seed(12)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    controller = CompressionController(model, 2.0, **GACT_LADDER, interval=20, min_numel=256)
    x = torch.randn(256, 16)
    with torch.no_grad():
        y = teacher(x)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        with controller:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    assert controller.estimates == 3 and controller.average_bits() <= 2.0
    assert sum(losses[-5:]) / 5 < 0.3 * losses[0]


# ---------------------------------------------------------------------------------------------------
# CompressionController: errors and removal


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(model=object()), TypeError, r"^model: expected a torch.nn.Module, got object"),
        (dict(avg_bits="2"), TypeError, r"^avg_bits: expected a number, got str"),
        (dict(avg_bits=True), TypeError, r"^avg_bits: expected a number, got bool"),
        (dict(avg_bits=0.5), ValueError, r"^avg_bits: expected a number >= 1"),
        (dict(avg_bits=33), ValueError, r"^avg_bits: expected a number in \[1, 32\]"),
        (dict(avg_bits=math.nan), ValueError, r"^avg_bits"),
        (dict(interval=0), ValueError, r"^interval: expected 'auto' or an int >= 1, got 0"),
        (dict(interval=2.0), TypeError, r"^interval: expected 'auto' or an int >= 1, got float"),
        (dict(interval="every 100"), ValueError, r"^interval: expected 'auto' or an int >= 1, got 'every 100'"),
        (dict(group_size=7), ValueError, r"^group_size"),
        (dict(min_numel=-1), ValueError, r"^min_numel"),
        (dict(filter=3), TypeError, r"^filter"),
        (dict(generator=0), TypeError, r"^generator: expected a torch.Generator or None, got int"),
        (dict(avg_bits=1.5, min_bits=1), ValueError, r"^avg_bits=1.5: budgets below 2 bits did not train .* "
                                                     r"allow_low_bits=True"),
        (dict(avg_bits=2, recompute=False), ValueError, r"^avg_bits=2: budgets below 4 bits did not train .* without "
                                                        r"recompute .* allow_low_bits=True"),
        (dict(avg_bits=3.5, recompute=False), ValueError, r"^avg_bits=3.5: budgets below 4 bits"),
        (dict(recompute=1), TypeError, r"^recompute: expected True or False, got 1"),
        (dict(min_bits=3), ValueError, r"^min_bits: expected one of 8, 4, 2, 1, got 3"),
        (dict(min_bits=True), ValueError, r"^min_bits: expected one of"),
        (dict(avg_bits=3, min_bits=4, allow_low_bits=True), ValueError,
         r"^avg_bits: 3 is below min_bits=4, which no allocation meets; pass min_bits=2 \(or fewer\)"),
        # The default min_bits=2 with a 1-bit budget: the message names the min_bits that fits.
        (dict(avg_bits=1, allow_low_bits=True), ValueError, r"^avg_bits: 1 is below min_bits=2.*pass min_bits=1 "),
        (dict(allow_low_bits=1), TypeError, r"^allow_low_bits: expected True or False, got 1"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(kwargs, error, pattern):
    args = dict(model=nn.Linear(2, 2))
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        CompressionController(args.pop("model"), **args)


@pytest.mark.parametrize("recipe", ["compress", "all"])
def test_a_model_converted_with_a_compress_recipe_is_refused_where_the_controller_is_made(kernels, recipe):
    # The recipe's block would open inside the controller's at the first step; the constructor says so.
    model, _ = abp.convert(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), recipe, bits=8)
    with pytest.raises(ValueError, match=r"^model: its forward runs inside the compress_saved\(bits=8\) block .*"
                                         r"convert with recipe lowmembp and/or sampled"):
        CompressionController(model)
    # A converted submodule is named.
    outer = nn.Sequential(nn.Linear(8, 8), model)
    with pytest.raises(ValueError, match=r"^model: its module '1' runs inside"):
        CompressionController(outer)
    CompressionController(abp.convert(nn.Sequential(nn.Linear(8, 8), nn.GELU()), "lowmembp")[0]).remove()


def test_usage_errors_and_remove(kernels):
    model = Planted()
    x, y = batch(13)
    controller = CompressionController(model, 2.0, **GACT_LADDER)
    with pytest.raises(RuntimeError, match="cannot nest"):
        with controller:
            with controller:
                pass
    assert controller.step == 0  # a block that raised is not a step
    # At a probe step, backward must run inside the block.
    with pytest.raises(RuntimeError, match=r"call loss.backward\(\) inside it"):
        with controller:
            loss = F.mse_loss(model(x), y)
    loss.backward()
    assert controller.estimates == 0
    train_step(controller, model, x, y)
    assert controller.estimates == 1
    controller.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert "forward" not in model.__dict__
    with pytest.raises(RuntimeError, match="after remove"):
        with controller:
            pass


def test_probes_measure_each_key_at_its_fewest_bits_and_scale_to_the_one_bit_coefficient():
    # C_l is the coefficient of C/(2^b - 1)^2: a probe at b = min_bits = 2 measures about C/9 and
    # scales it by 9, so on linear-regime tensors (an MLP's) it estimates what a 1-bit probe does.
    # Unscaled, the 2-bit estimates would be ~9 times smaller.
    library_or_skip()
    estimates = {}
    for min_bits in (1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 8))
        controller = CompressionController(model, avg_bits=4.0, min_bits=min_bits, allow_low_bits=True)
        x, y = torch.randn(128, 32), torch.randint(0, 8, (128,))
        with controller:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        estimates[min_bits] = controller.sensitivity
    assert estimates[1].keys() == estimates[2].keys() and len(estimates[1]) == 2  # the two Tanh outputs
    ratios = sorted(estimates[2][k] / estimates[1][k] for k in estimates[1])
    assert all(1 / 3 < r < 3 for r in ratios), ratios


# ---------------------------------------------------------------------------------------------------
# Mistakes and compiled models (a new user's trial).


class _LossAndLogits(nn.Module):
    """Returns (loss, logits), the loss computed from the logits: two outputs needing gradients,
    as a transformers model called with labels."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = self.b(torch.relu(self.a(x)))
        return F.cross_entropy(logits, y), logits


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch >= 2")
def test_a_compiled_model_with_two_outputs_trains_under_the_controller() -> None:
    """Dynamo traces the controller's module hooks with a compiled model: they stand aside there
    (a compiled graph's saves get no per-tensor width; the block says so), and the step trains."""
    library_or_skip()
    torch.manual_seed(0)
    model = _LossAndLogits()
    compiled = torch.compile(model, backend="aot_eager")
    controller = CompressionController(model, avg_bits=2, min_numel=1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(2):
        model.zero_grad()
        with warnings.catch_warnings(), controller:
            warnings.simplefilter("ignore")  # the compiled graph's saves: "compressed none", once
            loss, _ = compiled(x, y)
            loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(model.b(torch.relu(model.a(x))), y).backward()
    assert all(torch.allclose(a, p.grad) for a, p in zip(expected, model.parameters()))
    controller.remove()


def test_a_controller_of_a_model_that_never_runs_says_so() -> None:
    """Built on one model object, trained with another (abp.convert returns a copy): the first
    step warns instead of allocating from nothing, and convert names the controller's hooks."""
    library_or_skip()
    import abp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    controller = CompressionController(model, avg_bits=2)
    other, changes = abp.convert(model, recipe="lowmembp")
    assert any("abp.CompressionController's: build it on the model abp.convert returns" in c.detail
               for c in changes if c.action == "refused")
    # The copy carries the controller's hooks, inert: they do not act for it.
    assert other[0]._forward_pre_hooks
    with pytest.warns(RuntimeWarning, match=r"the model this controller was built on never ran .* measures nothing "
                                            r".* abp.convert returns a converted copy"):
        with controller:
            other(torch.randn(32, 16)).square().mean().backward()
    assert all(key.module == ctl.OUTSIDE for key in controller.last_step_keys)
    # An evaluation block (nothing saved) is no mistake, and the model itself trains.
    with controller, torch.no_grad():
        other(torch.randn(32, 16))
    with controller:
        model(torch.randn(32, 16)).square().mean().backward()
    assert controller.estimates == 1
    controller.remove()


def test_a_failing_block_does_not_also_warn_about_compiled_models(recwarn: Any) -> None:
    library_or_skip()
    C._WARNED.discard("constants")  # said once per process
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    controller = CompressionController(model, avg_bits=2)
    with pytest.raises(RuntimeError, match="dtype"):
        with controller:
            model(torch.randn(32, 64, dtype=torch.float64)).sum().backward()
    assert not [w for w in recwarn if "compressed none" in str(w.message)]
    controller.remove()


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch >= 2")
@pytest.mark.parametrize("zero_grad_inside", [False, True])
def test_a_compiled_model_that_runs_is_not_taken_for_another(zero_grad_inside: bool) -> None:
    """The model's own hook runs eagerly around a compiled call, so a step whose optimizer clears
    the gradients inside the block is not mistaken for a controller of a model that never ran."""
    library_or_skip()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    compiled = torch.compile(model, backend="aot_eager")
    controller = CompressionController(model, avg_bits=2, min_numel=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with controller:
                compiled(torch.randn(8, 16)).square().mean().backward()
                if zero_grad_inside:
                    opt.step()
                    opt.zero_grad()
    assert not [w for w in caught if "never ran" in str(w.message)]
    controller.remove()


def test_remove_lets_the_model_go_though_a_copy_keeps_the_hooks() -> None:
    """copy.deepcopy of a controlled model copies its hooks as inert ones (the controller trains
    the original only); after remove() the controller holds no model, so the original is freed
    while the copy lives."""
    import copy

    library_or_skip()
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    controller = CompressionController(model, avg_bits=2)
    twin = copy.deepcopy(model)
    assert twin[0]._forward_pre_hooks and copy.deepcopy(controller) is controller
    assert all(isinstance(hook, ctl._Inert) for module in twin.modules() for hook in module._forward_pre_hooks.values())
    controller.remove()
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
    twin(torch.randn(4, 16)).sum().backward()  # its stale hooks do no harm
    with pytest.raises(RuntimeError, match="used after remove"):
        with controller:
            pass


def test_a_controlled_model_pickles_and_the_loaded_copy_is_not_controlled(kernels) -> None:
    """torch.save(model) with a controller attached (a checkpoint mid-training) failed on the
    compile-safe hook's local function; the loaded model carries inert hooks, trains and leaves
    the controller's keys as they were."""
    import io

    torch.manual_seed(2)
    model = Planted()
    x, y = batch(2)
    controller = CompressionController(model, 2.0, **GACT_LADDER, interval=2)
    train_step(controller, model, x, y)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    hooks = [h for m in loaded.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    assert hooks and all(isinstance(h, ctl._Inert) for h in hooks)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    F.mse_loss(loaded(x), y).backward()
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in loaded.parameters())
    step = controller.step
    train_step(controller, model, x, y)  # the original trains on under its controller
    assert controller.step == step + 1 and controller.last_step_keys


def test_an_evaluation_block_at_a_probe_step_is_not_taken_for_a_compiled_model(kernels):
    """A no_grad block at an estimation step saves nothing and records no call; gradients left
    from the last training step must not make it warn that no call could be recorded."""
    torch.manual_seed(2)
    model = Planted()
    x, y = batch(2)
    controller = CompressionController(model, 2.0, **GACT_LADDER, interval=2)
    train_step(controller, model, x, y)  # step 0: estimates
    train_step(controller, model, x, y)  # step 1
    assert all(p.grad is not None for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with controller, torch.no_grad():  # step 2, an estimation step: an evaluation
            model(x)
    assert not [w for w in caught if "could be recorded" in str(w.message)]
    assert controller.estimates == 1
    train_step(controller, model, x, y)  # the estimate comes at the next training step
    assert controller.estimates == 2


def test_the_estimates_replays_say_nothing_about_constants() -> None:
    # A replay stores what it does not probe as it is; its "compressed none ... torch.compile'd
    # model" warning, about a model nobody compiled, was noise.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5), torch.nn.GELU(), torch.nn.Linear(64, 64))
    controller = CompressionController(model, avg_bits=2.0, interval=1, min_numel=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with controller:
                model(torch.randn(32, 64)).pow(2).sum().backward()
    assert controller.stats["compressed"] > 0


def test_an_estimate_on_a_batch_with_nothing_to_compress_keeps_the_allocation_and_comes_next_step() -> None:
    # A short last batch whose saved tensors are all under min_numel: an allocation made of it was
    # empty, and every tensor went to the initial width until the next estimate (1000 steps on).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    controller = CompressionController(model, avg_bits=4, interval=2)

    def step(rows: int) -> None:
        model.zero_grad()
        with controller:
            model(torch.randn(rows, 32)).pow(2).mean().backward()

    for _ in range(2):
        step(64)
    before, estimates = dict(controller.bits), controller.estimates
    assert before and estimates == 1
    step(2)  # a probe step; 2 x 64 = 128 elements, under min_numel
    assert controller.bits == before and controller.estimates == estimates
    step(64)  # the estimate comes now
    assert controller.estimates == estimates + 1 and controller.bits


def test_an_average_of_32_bits_is_exact_training() -> None:
    # A control run: nothing compressed after the first estimate either, the loss's log-softmax
    # outside the model (which no probe reaches) included; it took the 8-bit initial width.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    reference = copy.deepcopy(model)
    controller = CompressionController(model, avg_bits=32, interval=100, min_numel=16)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    assert controller.initial_bits == 32
    for _ in range(2):
        model.zero_grad()
        reference.zero_grad()
        with controller:
            F.cross_entropy(model(x), y).backward()
        F.cross_entropy(reference(x), y).backward()
        assert controller.stats["compressed"] == 0
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a.grad, b.grad)
    assert all(b == 32 for b in controller.bits.values()) and controller.bits


def _resumable_run(steps: int, state: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """`steps` steps of a small model under a controller (estimating every 3 steps, dropout on),
    from `state` (what this returns) if given; returns everything a checkpoint holds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    controller = CompressionController(model, avg_bits=4, interval=3, min_numel=64)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)) for _ in range(12)]
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        controller.load_state_dict(state["controller"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
    for step in range(start, start + steps):
        x, y = batches[step]
        with controller:
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict()),
            "controller": controller.state_dict(), "rng": torch.get_rng_state(), "step": start + steps}


def test_a_run_resumed_from_the_controllers_state_dict_continues_as_the_uninterrupted_one(tmp_path: Any) -> None:
    library_or_skip()
    whole = _resumable_run(8)
    path = tmp_path / "checkpoint.pt"
    torch.save(_resumable_run(4), path)  # through a file: plain values, weights_only loads them
    load = {"weights_only": True} if not torch.__version__.startswith("1.") else {}  # 1.13's refuses floats
    resumed = _resumable_run(4, torch.load(path, **load))
    assert whole["controller"]["estimates"] == resumed["controller"]["estimates"] == 3
    for name, value in whole["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    # Without the controller's state the allocation restarts (stored as it is, then re-estimated).
    same = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    unmeasured = CompressionController(same, avg_bits=4, interval=3, min_numel=64).state_dict()
    fresh = _resumable_run(4, {**torch.load(path, **load), "controller": unmeasured})
    assert any(not torch.equal(fresh["model"][n], v) for n, v in whole["model"].items())


def test_the_controller_refuses_pickling_and_a_wrong_state() -> None:
    import pickle

    model = nn.Sequential(nn.Linear(8, 8))
    controller = CompressionController(model, avg_bits=4)
    with pytest.raises(TypeError, match="cannot be pickled.*state_dict"):
        pickle.dumps({"controller": controller})
    pickle.loads(pickle.dumps(model))  # the model itself still pickles (its hooks go inert)
    with pytest.raises(ValueError, match="other settings: avg_bits=2.0 \\(this one 4.0\\)"):
        controller.load_state_dict(CompressionController(nn.Linear(1, 1), avg_bits=2).state_dict())
    with pytest.raises(ValueError, match="other settings: interval=5 \\(this one 'auto'\\)"):
        controller.load_state_dict(CompressionController(nn.Linear(1, 1), interval=5).state_dict())
    with pytest.raises(ValueError, match="state: expected what CompressionController.state_dict"):
        controller.load_state_dict({"step": 3})
    state = _resumable_run(1)["controller"]
    with pytest.raises(ValueError, match="state: expected what .*does not read as such \\(KeyError"):
        controller.load_state_dict({k: v for k, v in state.items() if k != "bits"})
    other = CompressionController(nn.Sequential(nn.Conv1d(2, 2, 3)), avg_bits=4, interval=3, min_numel=64)
    with pytest.raises(ValueError, match="saved on another model: 7 modules, this controller's model has 2"):
        other.load_state_dict(state)
    # A deeper model of the same layers: every saved key names a module it has, so only the module
    # list tells them apart (a 2-layer LLaMA's state loaded into a 3-layer one's controller).
    deeper = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4),
                           nn.GELU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"saved on another model: 7 modules, this controller's model has 9 \(only in "
                                         r"the saved one: \[\]; only in this one: \['6', '7'\]\)"):
        CompressionController(deeper, avg_bits=4, interval=3, min_numel=64).load_state_dict(state)
    # States saved before the module list was kept: the keys are checked.
    old = {k: v for k, v in state.items() if k != "modules"}
    with pytest.raises(ValueError, match="saved on another model: its tensors were saved in"):
        other.load_state_dict(old)


class _MaskedAttention(nn.Module):
    """Attention as XGLM's eager path writes it: the scores plus a causal mask of the float's
    most negative value, bounded below by it with torch.max (which saves that sum: groups of scores
    beside -3.4e38), then softmax."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        lowest = torch.finfo(x.dtype).min
        n = x.shape[-2]
        mask = torch.full((n, n), lowest).triu(1)
        scores = torch.max(q @ k.transpose(-1, -2) / 4 + mask, torch.tensor(lowest))
        return self.out(torch.softmax(scores, dim=-1) @ v)


def test_a_finite_mask_beside_the_scores_keeps_gradients_and_sensitivities_finite():
    # XGLM: the saved sum decoded to inf and NaN at 1 and 2 bits (q / s overflowed), so every
    # gradient was NaN under compress_saved(bits=2) and the controller's probe of that key gave a
    # NaN sensitivity, counted as the most sensitive: 32 bits for the scores, 2 for the final norm.
    library_or_skip()
    torch.manual_seed(0)
    model = nn.Sequential(_MaskedAttention(), nn.LayerNorm(16), _MaskedAttention())
    x = torch.randn(4, 32, 16)
    for bits in (1, 2):
        model.zero_grad(set_to_none=True)
        with C.compress_saved(bits=bits, allow_low_bits=True, min_numel=1, guard=False):
            model(x).square().mean().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), bits
    controller = CompressionController(model, avg_bits=2, interval=1, min_numel=1)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with controller:
            model(x).square().mean().backward()
    assert controller.sensitivity and all(math.isfinite(v) for v in controller.sensitivity.values()), controller.sensitivity


def _functional_call() -> Any:
    """torch.func.functional_call (torch >= 2.0), torch.nn.utils.stateless's before."""
    func = getattr(torch, "func", None)
    return func.functional_call if func is not None else torch.nn.utils.stateless.functional_call


def test_a_stateless_step_is_estimated_at_the_weights_it_ran_with(kernels):
    """A step that calls the model through functional_call (stateless, MAML-style or ensemble
    training) runs it with tensors of its own in the parameters' places. The replays ran the
    module's own parameters instead: here zeros, so every sensitivity came out 0 and the widths
    were allocated on no evidence. They now put the step's tensors back, and estimate exactly
    what the same step with those weights in the module estimates."""
    torch.manual_seed(5)
    model = Planted()
    weights = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    stateless = copy.deepcopy(model)
    with torch.no_grad():
        for p in stateless.parameters():
            p.zero_()  # not the weights the steps train
    direct = CompressionController(model, 2.0, **GACT_LADDER, interval=2)
    functional = CompressionController(stateless, 2.0, **GACT_LADDER, interval=2)
    call = _functional_call()
    for step in range(3):
        x, y = batch(step)
        torch.manual_seed(100 + step)  # the codes' keys
        train_step(direct, model, x, y)
        for w in weights.values():
            w.grad = None
        torch.manual_seed(100 + step)
        with functional:
            F.mse_loss(call(stateless, weights, (x,)), y).backward()
        for name, p in model.named_parameters():
            assert torch.equal(weights[name].grad, p.grad), (step, name)
    assert functional.estimates == direct.estimates == 2
    assert sum(direct.sensitivity.values()) > 0
    assert functional.sensitivity == direct.sensitivity
    assert functional.bits == direct.bits
    # The module's own parameters were put back in their places, untouched.
    assert all(isinstance(p, nn.Parameter) and not p.any() for p in stateless.parameters())
