"""VCAS (abp.vcas): the activation and weight-gradient samplers and the controller, on the CPU
path (docs/algorithms.md §7, §9): samplers unbiased (§9.1 z-test over R seeds, with negative controls)
with the closed-form variance (§9.2); ratio 1 exact; the controller's ratios moving the right way
when the added variance is planted high or low; determinism; the HF Trainer callback.
"""
from __future__ import annotations

import math
import sys
import types
from statistics import NormalDist
from typing import Any, List, Tuple

import pytest
import torch
import torch.nn.functional as F

import abp
from abp import _selection as selection
from abp import vcas
from abp.memory import storage_key
from abp_reference import library_or_skip


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def _z(draws: torch.Tensor, exact: torch.Tensor) -> float:
    """max |z| of §9.1; infinite when an entry without spread (always kept) is not exact."""
    reps = draws.shape[0]
    sd = draws.std(dim=0)
    live = sd > 0
    if not torch.allclose(draws.mean(0)[~live], exact[~live], rtol=1e-12, atol=1e-12):
        return math.inf
    return ((draws.mean(0) - exact)[live] * math.sqrt(reps) / sd[live]).abs().max().item()


def _bound(m: int) -> float:
    return NormalDist().inv_cdf(1 - 1e-4 / (2 * m))


def _skewed_grad(samples: int = 12, shape: Tuple[int, ...] = (3, 2)) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    grad = torch.randn(samples, *shape, generator=g, dtype=torch.float64)
    return grad * torch.logspace(0, 1.5, samples, dtype=torch.float64).reshape(-1, *([1] * len(shape)))


# --- activation sampler -------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.5, 0.3, 0.05])
def test_activation_sampler_is_unbiased_with_the_closed_form_variance(ratio: float) -> None:
    # 0.3: a budget of 3.6 samples, not ⌊3.6⌋; 0.05: less than one sample, floored at one (a
    # budget of 0 would zero every draw).
    grad = _skewed_grad()
    reps = 2000
    draws = torch.stack([vcas.sample_activation_grad(grad, ratio, 100 + r) for r in range(reps)])
    assert _z(draws, grad) <= _bound(grad.numel())
    assert vcas.activation_budget(12, ratio) == max(12 * ratio, 1.0)
    p = selection.water_fill(grad.reshape(12, -1).norm(dim=1), vcas.activation_budget(12, ratio))
    v = selection.variance_bernoulli(grad.reshape(12, -1), None, p)
    errors = ((draws - grad) ** 2).flatten(1).sum(1)
    assert abs(errors.mean().item() - v) <= 5 * errors.std().item() / math.sqrt(reps)
    # Each draw keeps whole samples: a sample's rows are all kept (rescaled by 1/p) or all zero.
    kept = draws[0].reshape(12, -1).abs().sum(1) > 0
    assert torch.allclose(draws[0][kept], grad[kept] / p[kept].float().double()[:, None, None], rtol=1e-6)


def test_activation_sampler_negative_control() -> None:
    grad = _skewed_grad()
    draws = torch.stack([0.9 * vcas.sample_activation_grad(grad, 0.5, 100 + r) for r in range(2000)])
    assert _z(draws, grad) > _bound(grad.numel())


def test_a_chain_of_two_samplers_is_unbiased() -> None:
    # Top block keeps ρ = 0.6, the block below 0.4; between them a per-sample linear map (a block's
    # backward without cross-sample ops), so the chain stays conditionally unbiased (§7.1).
    grad = _skewed_grad(shape=(4,))
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    exact = grad @ a
    draws = torch.stack([vcas.sample_activation_grad(vcas.sample_activation_grad(grad, 0.6, 2 * r) @ a, 0.4, 2 * r + 1)
                         for r in range(2000)])
    assert _z(draws, exact) <= _bound(exact.numel())


def test_activation_sampler_exact_cases() -> None:
    grad = _skewed_grad()
    assert vcas.sample_activation_grad(grad, 1.0, 1) is grad
    nan = grad.clone()
    nan[3, 0, 1] = float("nan")
    assert vcas.sample_activation_grad(nan, 0.3, 1) is nan  # non-finite scores: pass through
    zero = torch.zeros(5, 3)
    assert vcas.sample_activation_grad(zero, 0.3, 1) is zero
    # A draw that keeps nothing gives the zero gradient (the unbiased answer, not a pass-through);
    # with a budget of one sample some draws keep nothing, and some keep one.
    outcomes = [vcas.sample_activation_grad(grad, 0.05, seed) for seed in range(20)]
    assert any(torch.equal(o, torch.zeros_like(grad)) for o in outcomes)
    assert any(not torch.equal(o, torch.zeros_like(grad)) for o in outcomes)
    # Samples along another dimension.
    moved = grad.movedim(0, 1)
    torch.testing.assert_close(vcas.sample_activation_grad(moved, 0.5, 7, batch_dim=1),
                               vcas.sample_activation_grad(grad, 0.5, 7).movedim(0, 1))


def test_keep_fraction() -> None:
    norms = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert vcas.keep_fraction(norms, 1.0) == 1.0
    assert vcas.keep_fraction(norms, 0.7) == 0.5  # 4 + 3 = 7 of 10
    assert vcas.keep_fraction(norms, 0.71) == 0.75
    assert vcas.keep_fraction(norms, 0.0) == 0.25
    assert vcas.keep_fraction(torch.tensor([1.0, float("nan")]), 0.5) == 1.0


# --- weight-gradient sampler ------------------------------------------------------------------------------


def _linear_case(samples: int = 6, tokens: int = 4, d_in: int = 3, d_out: int = 2):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples * tokens, d_in, generator=g, dtype=torch.float64)
    grad = torch.randn(samples * tokens, d_out, generator=g, dtype=torch.float64)
    grad *= torch.logspace(0, 1, samples * tokens, dtype=torch.float64)[:, None]
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    return x, grad, w, (samples, tokens)


def test_weight_sampler_is_unbiased_and_dx_db_exact() -> None:
    x, grad, w, lead = _linear_case()
    reps = 2000
    results = [vcas.sampled_linear_grads(x, grad, w, 0.4, 500 + r, lead) for r in range(reps)]
    exact = grad.t() @ x
    draws = torch.stack([r.dw for r in results])
    assert _z(draws, exact) <= _bound(exact.numel())
    errors = ((draws - exact) ** 2).flatten(1).sum(1)
    v = results[0].variance
    assert abs(errors.mean().item() - v) <= 5 * errors.std().item() / math.sqrt(reps)
    scores = grad.norm(dim=1) * x.norm(dim=1)
    assert v == pytest.approx(selection.variance_bernoulli(grad, x, selection.water_fill(scores, math.floor(24 * 0.4))))
    assert torch.equal(results[0].dx, grad @ w) and torch.equal(results[0].db, grad.sum(0))
    control = torch.stack([0.9 * r.dw for r in results])
    assert _z(control, exact) > _bound(exact.numel())


def test_weight_sampler_skips_dropped_samples() -> None:
    x, grad, w, lead = _linear_case()
    grad.reshape(6, 4, -1)[[1, 4]] = 0.0  # two samples dropped by an activation sampler above
    out = vcas.sampled_linear_grads(x, grad, w, 1.0, 0, lead)
    assert torch.equal(out.dx.reshape(6, 4, -1)[[1, 4]], torch.zeros(2, 4, 3, dtype=torch.float64))
    torch.testing.assert_close(out.dx, grad @ w, rtol=0, atol=0)
    torch.testing.assert_close(out.dw, grad.t() @ x, rtol=1e-12, atol=1e-12)
    assert out.variance == 0.0
    # ν applies to the K' tokens of the live samples: 16 tokens at ν = 0.5 -> 8 expected.
    sampled = vcas.sampled_linear_grads(x, grad, w, 0.5, 3, lead)
    live = grad.norm(dim=1) * x.norm(dim=1)
    q = selection.water_fill(live[live > 0], 8)
    assert sampled.variance == pytest.approx(float(((1 / q - 1) * live[live > 0] ** 2).sum()))


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_weight_sampler_of_an_all_zero_gradient_gives_zero_gradients(ratio: float) -> None:
    """Every sample's output gradient zero (a LoRA path's B starts at 0, so its A sees none): no
    token is alive, and gathering none then putting back from an empty matrix failed on its NULL
    data pointer, so VCAS's first calibration on any LoRA model raised."""
    x, grad, w, lead = _linear_case()
    out = vcas.sampled_linear_grads(x, torch.zeros_like(grad), w, ratio, 0, lead)
    assert torch.equal(out.dx, torch.zeros_like(x)) and torch.equal(out.dw, torch.zeros_like(w))
    assert torch.equal(out.db, torch.zeros(w.shape[0], dtype=x.dtype)) and out.variance == 0.0


# --- the controller -------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self, d: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(5, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(depth))
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).mean(1)


def _data(n: int = 6, batch: int = 16) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 7, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(n)]


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def test_controller_wraps_block_linears_only_and_starts_exact() -> None:
    net, reference = _net(), _net()
    controller = vcas.Controller(net, Block)
    assert len(controller.linears) == 6 and type(net.embed) is torch.nn.Linear and type(net.head) is torch.nn.Linear
    assert net.blocks[0].fc1.weight is controller.linears[0].weight
    assert list(net.state_dict()) == list(reference.state_dict())
    x, y = _data(1)[0]
    F.cross_entropy(net(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    for a, b in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
    assert controller.flops_ratio() == 1.0 and controller.due()
    # A second controller would hook every block again and sample each activation gradient twice.
    with pytest.raises(RuntimeError, match="model: already has an abp.vcas.Controller.*remove\\(\\)"):
        vcas.Controller(net, Block)
    controller.remove()
    assert type(net.blocks[0].fc1) is torch.nn.Linear
    vcas.Controller(net, Block).remove()  # once removed, another may come


def test_a_model_with_its_samplers_pickles_with_its_controller() -> None:
    """torch.save(model) of a model whose Linears are VCAS's samplers saves the controller they
    report to (a closure made it fail); the loaded model computes what the original does, with
    its own controller's ratios."""
    import io

    controller = _calibrated(tau=0.025, s=0.8, rho=0.7, nu=0.6)
    net = controller.model
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = vcas.Controller.attached(loaded)  # the public handle on the unpickled controller
    assert twin is loaded.blocks[0].fc1._controller and vcas.Controller.attached(net) is controller
    assert twin is not controller and twin.activation_ratios == controller.activation_ratios
    assert twin.weight_ratios == controller.weight_ratios and twin.model is loaded
    x, y = _data(1)[0]
    torch.manual_seed(5)
    F.cross_entropy(net(x), y).backward()
    torch.manual_seed(5)
    F.cross_entropy(loaded(x), y).backward()
    for a, b in zip(net.parameters(), loaded.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    twin.remove()
    assert type(loaded.blocks[0].fc1) is torch.nn.Linear and type(net.blocks[0].fc1) is not torch.nn.Linear


def _calibrated(tau: float, s: float, rho: float, nu: float) -> vcas.Controller:
    net = _net()
    controller = vcas.Controller(net, Block, act_var_tau=tau, w_var_tau=tau, cal_var_freq=1, param_sample_ratio=0.5)
    controller.s = s
    for sampler in controller.samplers:
        sampler.ratio = rho
    for layer in controller.linears:
        layer.state.ratio = nu
    data = _data()
    torch.manual_seed(11)
    controller.calibrate(lambda b: F.cross_entropy(net(b[0]), b[1]), data[:2])
    return controller


def test_a_block_whose_second_linear_starts_at_zero_calibrates_and_trains() -> None:
    """LoRA's shape: B = 0 at the start, so the first linear of the path gets no output gradient at
    all (each block's fc2 zeroed here). Its weight sampler raised at the first calibration."""
    net = _net()
    with torch.no_grad():
        for block in net.blocks:
            block.fc2.weight.zero_()
            block.fc2.bias.zero_()
    controller = vcas.Controller(net, Block, cal_var_freq=1, param_sample_ratio=0.5)
    data = _data()
    controller.calibrate(lambda b: F.cross_entropy(net(b[0]), b[1]), data[:2])
    loss = F.cross_entropy(net(data[2][0]), data[2][1])
    loss.backward()
    assert all(torch.equal(b.fc1.weight.grad, torch.zeros_like(b.fc1.weight)) for b in net.blocks)
    assert all(b.fc2.weight.grad.abs().sum() > 0 for b in net.blocks)


def test_in_eval_mode_the_samplers_are_off_and_gradients_exact() -> None:
    """A gradient taken in eval mode (saliency, an adversarial example) was sampled: two backward
    passes gave two gradients. Eval mode is exact now, as recipe "sampled"'s layers are."""
    controller = _calibrated(tau=0.025, s=0.5, rho=0.3, nu=0.3)
    net, reference = controller.model, _net()
    reference.load_state_dict(net.state_dict())
    x, y = _data()[3]
    net.eval()
    reference.eval()
    grads = []
    for model in (net, net, reference):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b, c in zip(*grads):
        assert torch.equal(a, b) and torch.equal(a, c)
    net.train()
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    assert any(not torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads[0])), "train mode samples"


def test_forward_mode_ad_through_a_sampler_names_abp() -> None:
    """A dual input (torch.autograd.forward_ad) reaching a VCAS sampler in training mode: abp's
    words (no forward derivative, use reverse mode), not torch's request for a jvp method."""
    import torch.autograd.forward_ad as fwAD

    net = _net()
    controller = vcas.Controller(net, Block)
    x, _ = _data(1)[0]
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="abp's VCAS linear layer: forward-mode AD .* not supported"):
            net(dual)
    controller.remove()


def test_a_removed_controller_refuses_to_count_and_calibrate() -> None:
    """After remove(), due() said True and step() counted on, as if sampling went on."""
    controller = _calibrated(tau=0.025, s=0.8, rho=0.7, nu=0.6)
    controller.remove()
    for call in (controller.due, controller.step,
                 lambda: controller.calibrate(lambda b: F.cross_entropy(controller.model(b[0]), b[1]), _data()[:2])):
        with pytest.raises(RuntimeError, match=r"^abp.vcas.Controller: used after remove\(\)"):
            call()


def test_ratios_move_up_when_the_added_variance_is_planted_high() -> None:
    # τ tiny: any sampling variance is too much, so s, ρ and ν must all grow.
    controller = _calibrated(tau=1e-9, s=0.5, rho=0.3, nu=0.3)
    assert controller.last["v_act"] > 0 and all(v > 0 for v in controller.last["v_w"].values())
    assert controller.s == pytest.approx(0.51)
    assert all(r > 0.3 for r in controller.activation_ratios)
    assert all(v == pytest.approx(0.3 / 0.95) for v in controller.weight_ratios.values())


def test_ratios_move_down_when_the_added_variance_is_planted_low() -> None:
    controller = _calibrated(tau=1e9, s=1.0, rho=1.0, nu=1.0)
    assert controller.s == pytest.approx(0.99)
    assert all(v == pytest.approx(0.95) for v in controller.weight_ratios.values())
    ratios = controller.activation_ratios
    assert all(r <= 1.0 for r in ratios) and ratios == sorted(ratios)  # monotone, bottom to top


def test_a_non_finite_calibration_leaves_the_ratios_and_says_so() -> None:
    # A NaN compares as small: the ratios would fall (more sampling) on a batch that says nothing.
    net = _net()
    controller = vcas.Controller(net, Block, cal_var_freq=1, param_sample_ratio=0.5)
    controller.s = 0.8
    for sampler in controller.samplers:
        sampler.ratio = 0.7
    data = _data()[:2]
    data[0][0][0, 0, 0] = float("nan")
    before = (controller.s, controller.activation_ratios, controller.weight_ratios)
    with pytest.warns(RuntimeWarning, match=r"variances are not finite \(v_sgd=nan, v_act=nan\).*left as they were"):
        controller.calibrate(lambda b: F.cross_entropy(net(b[0]), b[1]), data)
    assert (controller.s, controller.activation_ratios, controller.weight_ratios) == before
    assert controller.calibrations == 1 and math.isnan(controller.last["v_sgd"])


def test_calibration_restores_grads_and_is_deterministic() -> None:
    a = _calibrated(tau=0.025, s=0.8, rho=0.7, nu=0.6)
    b = _calibrated(tau=0.025, s=0.8, rho=0.7, nu=0.6)
    assert a.last == b.last and a.activation_ratios == b.activation_ratios
    net = _net()
    controller = vcas.Controller(net, Block, cal_var_freq=1)
    marker = [torch.full_like(p, 7.0) for p in net.parameters()]
    for p, m in zip(net.parameters(), marker):
        p.grad = m
    controller.calibrate(lambda b: F.cross_entropy(net(b[0]), b[1]), _data()[:2])
    assert all(p.grad is m for p, m in zip(net.parameters(), marker))


def test_inner_passes_draw_independent_streams() -> None:
    # The original reseeded every inner pass identically (§7.3): each sampler call in a calibration
    # must get its own key, and two training steps must differ too.
    net = _net()
    controller = vcas.Controller(net, Block)
    for sampler in controller.samplers:
        sampler.ratio = 0.5
    keys: List[int] = []
    draw = controller._seed
    controller._seed = lambda: keys.append(draw()) or keys[-1]  # type: ignore[assignment]
    controller.calibrate(lambda b: F.cross_entropy(net(b[0]), b[1]), _data()[:2])
    # 2 batches x 2 inner passes x (3 activation samplers + 6 Linears reporting V_w).
    assert len(keys) == 2 * 2 * 9 and len(set(keys)) == len(keys)
    x, y = _data(1)[0]
    grads = []
    for _ in range(2):
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        grads.append(net.embed.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1])


class DropoutBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.3, self.training))


def test_calibration_replays_dropout_so_only_sampling_adds_variance() -> None:
    # With nothing sampled (ρ = ν = 1) the inner passes equal the exact one: V_act is exactly 0,
    # although every forward draws dropout masks.
    torch.manual_seed(0)
    net = Net().double()
    net.blocks = torch.nn.ModuleList(DropoutBlock(8).double() for _ in range(3))
    controller = vcas.Controller(net, DropoutBlock)
    last = controller.calibrate(lambda b: F.cross_entropy(net(b[0]), b[1]), _data()[:2])
    assert last["v_act"] == 0.0 and last["v_sgd"] > 0


def test_v_sgd_is_the_between_batch_variance_of_every_entry() -> None:
    # param_sample_ratio = 1 picks every entry: V_SGD = Σ over entries of the unbiased variance of
    # the M batch gradients, computed here with plain autograd on an unconverted copy.
    net, reference = _net(), _net()
    controller = vcas.Controller(net, Block, param_sample_ratio=1.0)
    data = _data()[:2]
    last = controller.calibrate(lambda b: F.cross_entropy(net(b[0]), b[1]), data)
    grads = []
    for x, y in data:
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        grads.append(torch.cat([p.grad.flatten() for p in reference.parameters()]))
    expected = float(torch.stack(grads).var(dim=0, unbiased=True).sum())
    assert last["v_sgd"] == pytest.approx(expected, rel=1e-9)
    assert last["v_act"] == 0.0  # ratios are 1 before the first calibration: nothing sampled


def test_schedule_update_follows_the_paper() -> None:
    # Hand-set candidates p_l(s') recorded over 2 exact passes: s moves by α towards more kept
    # norm when V_act > τ·V_SGD, the schedule is p(s_new) (not the release's p(s_new ∓ 2α)), made
    # monotone bottom to top, then 0.6·ρ + 0.4·p.
    controller = vcas.Controller(_net(), Block, s_update_step=0.1)
    controller.s = 0.5
    for sampler, p in zip(controller.samplers, ([0.2, 0.3, 0.4], [0.1, 0.2, 0.3], [0.5, 0.6, 0.7])):
        sampler.candidates = {0.4: 2 * p[0], 0.5: 2 * p[1], 0.6: 2 * p[2]}
        sampler.recorded = 2
        sampler.ratio = 0.8
    controller._update_activation_ratios(v_act=1.0, v_sgd=1.0)  # 1 > 0.025: keep more
    assert controller.s == pytest.approx(0.6)
    expected = [0.4, 0.4, 0.7]  # p(0.6) = (0.4, 0.3, 0.7), running max from the bottom
    assert controller.activation_ratios == pytest.approx([0.6 * 0.8 + 0.4 * e for e in expected])
    assert [s.active for s in controller.samplers] == [False, True, True]
    controller._update_activation_ratios(v_act=0.0, v_sgd=1.0)  # keep less: p(s − α)
    assert controller.s == pytest.approx(0.5)


def test_weight_ratio_update_is_capped_and_floored() -> None:
    controller = vcas.Controller(_net(), Block)
    state = controller.linears[0].state
    state.ratio, state.tokens = 0.5, 100
    controller._update_weight_ratio(state, too_noisy=True)
    assert state.ratio == pytest.approx(0.5 / 0.95)
    state.ratio = 0.99
    controller._update_weight_ratio(state, too_noisy=True)
    assert state.ratio == 1.0  # exact at most
    state.ratio = 0.0101
    controller._update_weight_ratio(state, too_noisy=False)
    assert state.ratio == pytest.approx(0.01)  # one token of 100: a smaller ν would change nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_controller_with_samples_along_dimension_one_and_low_precision(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    net = Net().to(dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:  # (tokens, batch, features)
        h = net.embed(x)
        for block in net.blocks:
            h = block(h)
        return net.head(h).mean(0)

    controller = vcas.Controller(net, Block, batch_dim=1, act_var_tau=1e9, w_var_tau=1e9)
    data = [(x.transpose(0, 1).to(dtype), y) for x, y in _data(3)]
    controller.calibrate(lambda b: F.cross_entropy(forward(b[0]).float(), b[1]), data[:2])
    assert controller.s < 1 and all(r <= 1 for r in controller.activation_ratios)
    for sampler in controller.samplers:
        sampler.ratio = 0.5
    F.cross_entropy(forward(data[2][0]).float(), data[2][1]).backward()
    assert all(torch.isfinite(p.grad).all() and p.grad.dtype == dtype for p in net.parameters())
    with pytest.raises(ValueError, match="batch_dim: expected the samples' dimension as an int >= 0, got -1"):
        vcas.Controller(_net(), Block, batch_dim=-1)


def test_block_outputs_may_be_modified_in_place() -> None:
    class InPlace(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
                h.mul_(0.5)  # the sampler is a gradient hook, not a view to protect
            return self.head(h).mean(1)

    torch.manual_seed(0)
    net = InPlace().double()
    controller = vcas.Controller(net, Block)
    for sampler in controller.samplers:
        sampler.ratio = 0.5
    x, y = _data(1)[0]
    F.cross_entropy(net(x), y).backward()
    assert torch.isfinite(net.embed.weight.grad).all()


def test_training_with_sampling_saves_what_exact_training_saves() -> None:
    net = _net()
    controller = vcas.Controller(net, Block)
    for sampler in controller.samplers:
        sampler.ratio = 0.5
    for layer in controller.linears:
        layer.state.ratio = 0.5
    x, y = _data(1)[0]
    sizes: List[int] = []

    def count() -> int:
        seen = {}
        params = {p.data_ptr() for p in net.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() not in params:
                _, ptr, nbytes = storage_key(t)  # untyped_storage on torch 2, storage on 1.13
                seen[ptr] = nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        return sum(seen.values())

    sizes.append(count())
    controller.remove()
    sizes.append(count())
    assert sizes[0] == sizes[1]


def test_controller_arguments_are_checked() -> None:
    net = _net()
    with pytest.raises(ValueError, match="block_type: model has no module of type"):
        vcas.Controller(net, torch.nn.Conv1d)
    with pytest.raises(TypeError, match=r"block_type: expected an nn.Module subclass .*got 'Block' \(pass the class itself"):
        vcas.Controller(net, "Block")
    with pytest.raises(TypeError, match=r"block_type: expected an nn.Module subclass or a tuple of them, got 3$"):
        vcas.Controller(net, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="act_var_tau: expected a positive variance fraction, got 0"):
        vcas.Controller(net, Block, act_var_tau=0)
    with pytest.raises(ValueError, match=r"cal_var_freq: expected an int >= 1"):
        vcas.Controller(net, Block, cal_var_freq=0)
    with pytest.raises(ValueError, match=r"cal_var_m: expected an int >= 2"):
        vcas.Controller(net, Block, cal_var_m=1)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        vcas.Controller(object(), Block)  # type: ignore[arg-type]
    controller = vcas.Controller(_net(), Block)
    with pytest.raises(ValueError, match="batches: expected at least 2 batches"):
        controller.calibrate(lambda b: b, [1])


def test_trainer_callback_calibrates_when_due(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers is not a dependency: a stand-in module supplies the TrainerCallback base.
    fake = types.ModuleType("transformers")

    class TrainerCallback:  # the real base class only defines no-op event methods
        pass

    fake.TrainerCallback = TrainerCallback  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", fake)
    net = _net()
    controller = vcas.Controller(net, Block, cal_var_freq=2, act_var_tau=1e9)

    class Output:
        def __init__(self, loss: torch.Tensor) -> None:
            self.loss = loss

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Any:
            return Output(F.cross_entropy(self.net(inputs), labels))

    model = Model()
    loader = [{"inputs": x, "labels": y} for x, y in _data(3)]
    callback = vcas.trainer_callback(controller)
    assert isinstance(callback, TrainerCallback)
    for step in range(3):
        callback.on_step_begin(None, None, "control", model=model, train_dataloader=loader)
        callback.on_step_end(None, None, "control")
    assert controller.steps == 3 and controller.calibrations == 2 and controller.s == pytest.approx(0.98)


def test_wrong_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="act_var_tau: expected a number, got str 'a'"):
        vcas.Controller(_net(), Block, act_var_tau="a")  # type: ignore[arg-type]
    for ratio in (0.0, 2.0, float("nan")):
        with pytest.raises(ValueError, match=r"ratio: expected the kept fraction of samples in \(0, 1\]"):
            vcas.sample_activation_grad(torch.randn(8, 4), ratio, 1)
    net = _net()
    vcas.Controller(net, Block, batch_dim=5)
    x, y = _data(1)[0]
    with pytest.raises(ValueError, match=r"batch_dim: 5 counts the samples, but the output of Block .* has 3 dimension"):
        net(x)


def _vcas_run(steps: int, state: Any = None) -> Any:
    """`steps` steps under a VCAS controller calibrating every 2 steps, resumed from `state` (what
    this returns) if given."""
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    controller = vcas.Controller(net, Block, cal_var_freq=2, param_sample_ratio=0.5, generator=torch.Generator().manual_seed(3))
    data = _data(8)
    start = 0
    if state is not None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        controller.load_state_dict(state["vcas"])
        controller.generator.set_state(state["generator"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
    loss = lambda batch: F.cross_entropy(net(batch[0]), batch[1])  # noqa: E731
    for step in range(start, start + steps):
        if controller.due():
            controller.calibrate(loss, data[step % 8: step % 8 + 2] if step % 8 < 7 else data[:2])
        loss(data[step % 8]).backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.step()
    return {"model": {k: v.clone() for k, v in net.state_dict().items()}, "optimizer": optimizer.state_dict(),
            "vcas": controller.state_dict(), "generator": controller.generator.get_state(), "rng": torch.get_rng_state(),
            "step": start + steps, "ratios": (controller.activation_ratios, controller.weight_ratios)}


def test_a_run_resumed_from_the_controllers_state_dict_continues_as_the_uninterrupted_one() -> None:
    whole = _vcas_run(7)
    resumed = _vcas_run(3, _vcas_run(4))
    assert resumed["ratios"] == whole["ratios"] and whole["vcas"]["calibrations"] == 4
    for name, value in whole["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    other = vcas.Controller(Net(depth=2).double(), Block, cal_var_freq=2, param_sample_ratio=0.5)
    with pytest.raises(ValueError, match="saved for 3 blocks.*this controller has 2 blocks"):
        other.load_state_dict(whole["vcas"])
    with pytest.raises(ValueError, match=r"other settings: cal_var_freq=2 \(this one 100\), param_sample_ratio=0.5 "
                                         r"\(this one 0.01\); build it with the saved settings"):
        vcas.Controller(_net(), Block).load_state_dict(whole["vcas"])
    # A state saved before the settings were kept loads (nothing to compare).
    vcas.Controller(_net(), Block).load_state_dict({k: v for k, v in whole["vcas"].items() if k != "settings"})
    mine = vcas.Controller(_net(), Block, cal_var_freq=2, param_sample_ratio=0.5)
    with pytest.raises(ValueError, match="does not read as such \\(KeyError"):
        mine.load_state_dict({k: v for k, v in whole["vcas"].items() if k != "s"})
    with pytest.raises(ValueError, match="every ratio in \\(0, 1\\]"):
        mine.load_state_dict({**whole["vcas"], "activations": [(-1.0, True)] * 3})
    with pytest.raises(ValueError, match="s must lie in"):
        mine.load_state_dict({**whole["vcas"], "s": float("nan")})
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got NoneType"):
        vcas.Controller.attached(None)


def test_the_weight_samplers_are_named_as_the_model_names_their_linears() -> None:
    """weight_ratios, `.last`'s variances and state_dict name each Linear by its name in the model
    (they were '<block index>.<name in the block>', renumbered across block types); a state saved
    with the old keys (version 1) still loads."""
    controller = _calibrated(tau=0.025, s=0.8, rho=0.7, nu=0.6)
    names = {n for n, m in controller.model.named_modules() if isinstance(m, vcas._VcasLinear)}
    assert set(controller.weight_ratios) == names == {f"blocks.{i}.fc{j}" for i in range(3) for j in (1, 2)}
    assert set(controller.last["v_w"]) == names
    state = controller.state_dict()
    assert state["version"] == 2 and set(state["weights"]) == names
    before = {k: v for k, v in state.items() if k != "settings"}  # version 1 kept no settings
    old = {**before, "version": 1, "weights": {f"{n.split('.')[1]}.{n.split('.')[2]}": v for n, v in state["weights"].items()}}
    twin = vcas.Controller(_net(), Block)
    twin.load_state_dict(old)
    assert twin.weight_ratios == controller.weight_ratios
    with pytest.raises(ValueError, match=r"a dict with version 1 or 2\), got dict with version 3"):
        twin.load_state_dict({**state, "version": 3})


def test_blocks_without_a_linear_are_refused_naming_their_layers() -> None:
    # On a CNN whose blocks hold convolutions only, the activation samplers dropped 5 % of the
    # samples' gradients (a step's gradient 7 % off exact) and nothing computed less: no weight
    # sampler had a Linear to replace.
    class ConvBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.relu(self.norm(self.conv(x)))

    model = torch.nn.Sequential(ConvBlock(), ConvBlock())
    with pytest.raises(ValueError, match=r"ConvBlock blocks hold no torch.nn.Linear \(their weighted layers: "
                                         r"BatchNorm2d, Conv2d\)"):
        vcas.Controller(model, ConvBlock)
    assert not any(isinstance(m, vcas._VcasLinear) for m in model.modules()) and vcas.Controller.attached(model) is None


def test_convert_refuses_a_model_that_holds_a_controllers_samplers() -> None:
    """A controller built before convert: the copy convert makes took a copy of the controller,
    which nothing calibrated (the caller's calibrated the original), so the trained model ran
    without VCAS, silently; recipe sampled found no Linear and blamed the example call. convert
    now says to build the controller after it; once removed, the model converts."""
    net = _net()
    controller = vcas.Controller(net, Block)
    for recipe in ("lowmembp", "sampled"):
        for inplace in (False, True):
            with pytest.raises(RuntimeError, match=r"model: has an abp.vcas.Controller .* convert first, then build "
                                                   r"the controller on the model convert returns"):
                abp.convert(net, recipe, inplace=inplace)
    controller.remove()
    converted, _ = abp.convert(net, "sampled", layers=["blocks.*.fc1"])
    assert vcas.Controller.attached(converted) is None
