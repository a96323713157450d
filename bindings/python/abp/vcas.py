"""VCAS: variance-controlled adaptive sampling of the backward pass (docs/algorithms.md §7).

VCAS saves compute, not memory. After each repeated block of a network an *activation sampler*
(identity in forward) keeps each sample's gradient with a water-filled probability p_i and
rescales it by 1/p_i; inside the blocks each Linear computes dX only for the samples still alive
and estimates dW from a water-filled Bernoulli sample of their tokens (q_t ∝ ‖G_t‖·‖X_t‖).
A controller estimates, every `cal_var_freq` steps, the SGD noise and the variance each sampler
adds, and moves the keep ratios so that the added variance stays a fixed fraction (τ) of SGD's.

    vcas = abp.vcas.Controller(model, block_type=MyBlock)
    for step, batch in enumerate(loader):
        if vcas.due():
            vcas.calibrate(lambda b: loss_fn(model, b), fresh_batches(vcas.cal_var_m))
        loss_fn(model, batch).backward()
        optimizer.step(); optimizer.zero_grad()
        vcas.step()

Where the released code differs from the paper, this follows the paper (§7.3): the new schedule
is p(s_new), each inner calibration pass draws its own stream, and keeping no sample gives the
zero gradient (the unbiased answer) rather than passing the gradient through. All draws come
from the shared Philox stream, keyed per call from torch's default generator (or `generator`).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sized
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F
import torch.utils.data

from . import _sample_kernels as kernels
from . import _selection as selection
from ._launch import check_device, compute_dtype
from .autograd import NotScriptable, apply_function
from .compress import check_generator, draw_seed, outside_blocks

__all__ = [
    "Controller",
    "activation_budget",
    "sample_activation_grad",
    "sampled_linear_grads",
    "keep_fraction",
    "trainer_callback",
]


_CPU = torch.device("cpu")


def activation_budget(n: int, ratio: float) -> float:
    """The expected number of samples the activation sampler keeps: N·ρ, at least one.

    docs/algorithms.md §7.1 writes ⌊N·ρ⌋; its floor spends a sample less than planned whenever N·ρ is
    not whole, and at ⌊N·ρ⌋ = 0 every p is 0, which zeroes the gradient on every draw (biased).
    Water-filling takes a real budget, so the budget is N·ρ itself, floored at one sample.
    """
    return max(n * ratio, 1.0)


def sample_activation_grad(grad: torch.Tensor, ratio: float, seed: int, batch_dim: int = 0) -> torch.Tensor:
    """The activation sampler's backward (§7.1): each sample (index along `batch_dim`) is kept
    with the water-filled probability p_i = min(1, c·‖G_i‖), Σp = activation_budget(N, ratio),
    and rescaled by 1/p_i; the others become zero. Unbiased, with variance Σ(1/p_i − 1)‖G_i‖².
    A draw that keeps nothing returns zeros (the unbiased answer, not a pass-through).

    Exact (the gradient itself) when the budget reaches N or when the norms are not finite or all
    zero.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio: expected the kept fraction of samples in (0, 1], got {ratio!r}")
    check_device("grad", grad)
    n = grad.shape[batch_dim] if grad.dim() else 0
    k = activation_budget(n, ratio)
    if n == 0 or k >= n:
        return grad
    g = grad.movedim(batch_dim, 0).reshape(n, -1).contiguous()
    norms = kernels.row_norms(g).cpu()  # plans are made on the host: the same choices on every device
    if not selection.scores_usable(norms):
        return grad
    plan = selection.plan_bernoulli(selection.water_fill(norms, k), kernels.uniform(n, seed, 0, _CPU))
    index = torch.full((n,), -1, dtype=torch.int32)
    index[plan.index.long()] = plan.index
    weight = torch.zeros(n, dtype=compute_dtype(g.dtype))
    weight[plan.index.long()] = plan.weight.to(weight.dtype)
    out = kernels.sample_rows(g, index.to(g.device), weight.to(g.device), trusted=True)
    return out.reshape(grad.movedim(batch_dim, 0).shape).movedim(0, batch_dim)


def keep_fraction(norms: torch.Tensor, s: float) -> float:
    """p(s): the smallest fraction of samples, by descending norm, whose norms sum to at least
    s·Σ norms (§7.3). 1 when the norms are not usable (nothing can be dropped)."""
    n = norms.numel()
    if n == 0 or not selection.scores_usable(norms):
        return 1.0
    ordered = norms.double().sort(descending=True).values
    cumulative = ordered.cumsum(0)
    needed = int(torch.searchsorted(cumulative, s * cumulative[-1] * (1 - 1e-12)).item()) + 1
    return min(needed, n) / n


@dataclass
class _WeightGrads:
    dx: Optional[torch.Tensor]
    dw: Optional[torch.Tensor]
    db: Optional[torch.Tensor]
    variance: float  # V_w of the token sample at this ratio (0 when exact)


def sampled_linear_grads(
    x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, ratio: float, seed: int,
    lead_shape: Optional[Sequence[int]] = None, batch_dim: int = 0, sample: bool = True,
) -> _WeightGrads:
    """The weight-gradient sampler's backward (§7.2) for y = x·Wᵀ + b over N tokens (rows of the
    2-d `x`, `grad`); `lead_shape` is the input's shape without its last dimension (N elements),
    whose `batch_dim` counts the samples (None: every token is a sample).

    dX is computed only for the samples whose gradient is not all zero (the others' is zero);
    dW = Σ_kept G_tᵀX_t / q_t over a Bernoulli sample of those samples' K′ tokens, q water-filled
    from ‖G_t‖·‖X_t‖ with Σq = ⌊K′·ratio⌋ (exact when that is K′ or 0, or when `sample` is
    False); db is exact. Also returns V_w = Σ_t (1/q_t − 1)‖G_t‖²‖X_t‖² for this ratio, which
    the controller needs even from exact passes.
    """
    check_device("x", x)
    n = x.shape[0]
    g = grad.contiguous()
    gn = kernels.row_norms(g)
    db = g.sum(0)
    if not bool(torch.isfinite(gn).all()):  # a non-finite score disables sampling for the call
        return _WeightGrads(g @ weight.to(g.dtype), g.t() @ x.to(g.dtype), db, 0.0)
    # A sample is alive while any of its tokens has a gradient; a dropped sample's is all zero.
    lead = tuple(lead_shape) if lead_shape is not None else (n,)
    positive = (gn > 0).reshape(lead)
    samples = lead[batch_dim]
    alive_samples = positive.movedim(batch_dim, 0).reshape(samples, -1).any(dim=1)
    all_alive = bool(alive_samples.all())
    if all_alive:
        tokens = None
        g_alive, x_alive = g, x
    else:
        view = [samples if i == batch_dim else 1 for i in range(len(lead))]
        token_alive = alive_samples.reshape(view).expand(lead).reshape(-1)
        tokens = torch.nonzero(token_alive).flatten().to(torch.int32)
        ones = torch.ones(tokens.numel(), dtype=compute_dtype(g.dtype), device=g.device)
        g_alive = kernels.sample_rows(g, tokens, ones, trusted=True)
        x_alive = kernels.sample_rows(x, tokens, ones, trusted=True)
    dx_alive = g_alive @ weight.to(g.dtype)
    if all_alive:
        dx = dx_alive
    else:
        slot = torch.full((n,), -1, dtype=torch.int32, device=g.device)
        slot[tokens.long()] = torch.arange(tokens.numel(), dtype=torch.int32, device=g.device)
        dx = kernels.unsample_rows(dx_alive, slot, trusted=True)
    alive = g_alive.shape[0]
    k = math.floor(alive * ratio)
    if k >= alive or k == 0:
        return _WeightGrads(dx, g_alive.t() @ x_alive.to(g.dtype), db, 0.0)
    gn_alive = gn if all_alive else gn[tokens.long()]
    scores = (gn_alive.double() * kernels.row_norms(x_alive).double()).cpu()  # the plan is made on the host
    if not selection.scores_usable(scores):
        return _WeightGrads(dx, g_alive.t() @ x_alive.to(g.dtype), db, 0.0)
    q = selection.water_fill(scores, k)
    kept = q > 0
    variance = float(((1.0 / q[kept] - 1.0) * scores[kept] ** 2).sum())
    if not sample:
        return _WeightGrads(dx, g_alive.t() @ x_alive.to(g.dtype), db, variance)
    plan = selection.plan_bernoulli(q, kernels.uniform(alive, seed, 0, _CPU)).to(g.device)
    rows = plan.index if all_alive else tokens[plan.index.long()]
    ones = torch.ones(len(plan), dtype=compute_dtype(x.dtype), device=x.device)
    x_kept = kernels.sample_rows(x, rows, ones, trusted=True)
    if g.dtype == torch.float16:
        # 1/q grows as ‖X_t‖ shrinks: a rescaled fp16 row could overflow where the product does
        # not, so fp16 rows are gathered as they are and weighted in fp32.
        g_kept = kernels.sample_rows(g, rows, ones.to(torch.float32), trusted=True).float() * plan.weight[:, None]
        return _WeightGrads(dx, (g_kept.t() @ x_kept.float()).to(g.dtype), db, variance)
    g_kept = kernels.sample_rows(g, rows, plan.weight.to(compute_dtype(g.dtype)), trusted=True)
    return _WeightGrads(dx, g_kept.t() @ x_kept.to(g.dtype), db, variance)


# --- controller state and the autograd pieces --------------------------------------------------------


@dataclass
class _Sampler:
    """One activation sampler (after block `depth`, 0 = the bottom block)."""

    depth: int
    ratio: float = 1.0
    active: bool = True  # resamples (the top sampler, or a ratio below the one above)
    candidates: Dict[float, float] = field(default_factory=dict)  # s' -> Σ p_l(s') over exact passes
    recorded: int = 0  # how many gradients the candidates sum (a block called twice records twice)


@dataclass
class _LinearState:
    name: str  # in its block
    depth: int
    key: str  # in the model: what weight_ratios, state_dict and `.last` call it
    ratio: float = 1.0  # ν
    variance: float = 0.0  # Σ V_w over the calibration's inner passes
    tokens: int = 0  # K′ of the last backward: ν below 1/K′ is a budget of 0 (exact)


class _VcasLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # type: ignore[override]
                controller: "Controller", state: _LinearState) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        ctx.controller, ctx.state, ctx.has_bias = controller, state, bias is not None
        ctx.x_shape = x.shape
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1]).to(grad.dtype).contiguous()
        g2 = grad.reshape(-1, grad.shape[-1])
        grads = ctx.controller._linear_backward(ctx.state, x2, g2, weight, ctx.x_shape[:-1])
        dx = grads.dx.reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw = grads.dw if ctx.needs_input_grad[1] else None
        db = grads.db if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


class _VcasLinear(NotScriptable, torch.nn.Linear):
    """A Linear inside a block, sharing the original's Parameters, whose backward is VCAS's."""

    def __init__(self, linear: torch.nn.Linear, controller: "Controller", state: _LinearState) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.train(linear.training)
        # Not a submodule: the state_dict keeps the original's keys (weight, bias) only.
        self.__dict__["original"] = linear
        self._controller, self.state = controller, state

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # In eval mode exact, as recipe "sampled"'s layers are: a gradient taken there (saliency, an
        # adversarial example) is the model's own.
        if not torch.is_grad_enabled() or not self.training:
            return F.linear(input, self.weight, self.bias)
        return apply_function("abp's VCAS linear layer", _VcasLinearFunction, input, self.weight, self.bias,
                              self._controller, self.state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vcas ratio={self.state.ratio:.3g}"


def _is_plain_linear(module: torch.nn.Module) -> bool:
    return type(module) is torch.nn.Linear


def _controller_of(module: torch.nn.Module) -> Optional["Controller"]:
    """The Controller sampling in `module` itself: as one of its Linears, or by a block's gradient hook."""
    if isinstance(module, _VcasLinear):
        return module._controller
    for hook in module._forward_hooks.values():
        if isinstance(hook, partial) and getattr(hook.func, "__func__", None) is Controller._block_output:
            return hook.func.__self__
    return None


def _controlled(block: torch.nn.Module) -> bool:
    """Whether a live Controller samples in `block`: its gradient hook, or one of its Linears."""
    return any(_controller_of(m) is not None for m in block.modules())


class Controller:
    """Inserts VCAS's samplers into `model` and adapts their ratios (docs/algorithms.md §7).

    block_type: the repeated block class (or a tuple of classes); an activation sampler follows
    each such module (its first tensor output, samples along `batch_dim`), and every plain
    nn.Linear inside one becomes a weight-gradient sampler (the Parameters are shared, so an
    existing optimizer keeps working). Layers outside the blocks stay exact. Until the first
    calibration every ratio is 1: training is exact.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        block_type: Union[Type[torch.nn.Module], Tuple[Type[torch.nn.Module], ...]],
        act_var_tau: float = 0.025,
        w_var_tau: float = 0.025,
        cal_var_freq: int = 100,
        *,
        s_update_step: float = 0.01,
        w_ratio_mul: float = 0.95,
        cal_var_m: int = 2,
        act_sched_decay: float = 0.6,
        param_sample_ratio: float = 0.01,
        batch_dim: int = 0,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        for name, value in (("act_var_tau", act_var_tau), ("w_var_tau", w_var_tau), ("s_update_step", s_update_step),
                            ("w_ratio_mul", w_ratio_mul), ("act_sched_decay", act_sched_decay),
                            ("param_sample_ratio", param_sample_ratio)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
        for name, value in (("act_var_tau", act_var_tau), ("w_var_tau", w_var_tau)):
            if not value > 0:
                raise ValueError(f"{name}: expected a positive variance fraction, got {value!r}")
        if isinstance(cal_var_freq, bool) or not isinstance(cal_var_freq, int) or cal_var_freq < 1:
            raise ValueError(f"cal_var_freq: expected an int >= 1 (steps between calibrations), got {cal_var_freq!r}")
        if isinstance(cal_var_m, bool) or not isinstance(cal_var_m, int) or cal_var_m < 2:
            raise ValueError(f"cal_var_m: expected an int >= 2 (batches per calibration), got {cal_var_m!r}")
        if not 0 < s_update_step < 1:
            raise ValueError(f"s_update_step: expected a value in (0, 1), got {s_update_step!r}")
        if not 0 < w_ratio_mul < 1:
            raise ValueError(f"w_ratio_mul: expected a value in (0, 1), got {w_ratio_mul!r}")
        if not 0 <= act_sched_decay < 1:
            raise ValueError(f"act_sched_decay: expected a value in [0, 1), got {act_sched_decay!r}")
        if not 0 < param_sample_ratio <= 1:
            raise ValueError(f"param_sample_ratio: expected a value in (0, 1], got {param_sample_ratio!r}")
        check_generator(generator)
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"batch_dim: expected the samples' dimension as an int >= 0, got {batch_dim!r}")
        self.model = model
        self.act_var_tau, self.w_var_tau, self.cal_var_freq = float(act_var_tau), float(w_var_tau), cal_var_freq
        self.s_update_step, self.w_ratio_mul, self.cal_var_m = s_update_step, w_ratio_mul, cal_var_m
        self.act_sched_decay, self.param_sample_ratio = act_sched_decay, param_sample_ratio
        self.batch_dim, self.generator = batch_dim, generator
        self.s = 1.0
        self.steps = 0
        self.calibrations = 0
        self.last: Dict[str, Any] = {}  # the last calibration's variances (for logs and tests)
        # "train": sample with the current ratios; "exact": no sampling (recording candidates);
        # "activations": activation samplers only, weight samplers report V_w.
        self._mode = "train"
        self._record = False
        self._keys: Optional[torch.Generator] = None
        try:
            isinstance(model, block_type)  # what isinstance takes: a class, a tuple or union of classes
        except TypeError:
            hint = " (pass the class itself, imported from the model's module, not its name)" if isinstance(block_type, str) else ""
            raise TypeError(f"block_type: expected an nn.Module subclass or a tuple of them, got {block_type!r}{hint}") from None
        self.blocks: List[torch.nn.Module] = [m for m in model.modules() if isinstance(m, block_type)]
        if not self.blocks:
            raise ValueError(f"block_type: model has no module of type {block_type}")
        if any(_controlled(block) for block in self.blocks):
            raise RuntimeError("model: already has an abp.vcas.Controller (its blocks hold its samplers); a second one "
                               "would sample every activation gradient twice. Call the first one's remove() before "
                               "making another")
        if not any(_is_plain_linear(m) for block in self.blocks for m in block.modules()):
            # Only the Linears' weight gradients are computed from fewer samples: without one,
            # sampling the blocks' activation gradients would add noise and save nothing.
            kinds = sorted({type(m).__name__ for block in self.blocks for m in block.modules()
                            if isinstance(getattr(m, "weight", None), torch.Tensor)})
            raise ValueError(f"block_type: the {type(self.blocks[0]).__name__} blocks hold no torch.nn.Linear "
                             f"(their weighted layers: {', '.join(kinds) or 'none'}); VCAS computes only a Linear's "
                             "weight gradient from fewer samples, so here it would add gradient noise and save "
                             "nothing (convolutions are not sampled; a layer abp.convert already made a "
                             "SampledLinear is not sampled twice)")
        self.samplers = [_Sampler(depth) for depth in range(len(self.blocks))]
        self.linears: List[_VcasLinear] = []
        self._hooks = []
        block_names = {id(m): n for n, m in model.named_modules()}
        for depth, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_hook(self._hook(self.samplers[depth])))
            for parent_name, parent in block.named_modules():
                for child_name, child in list(parent.named_children()):
                    if _is_plain_linear(child):
                        name = ".".join(n for n in (parent_name, child_name) if n)
                        key = ".".join(n for n in (block_names[id(block)], name) if n)
                        layer = _VcasLinear(child, self, _LinearState(name, depth, key))
                        setattr(parent, child_name, layer)
                        self.linears.append(layer)

    # --- wiring ---

    def _hook(self, sampler: _Sampler) -> Callable[..., Any]:
        # A bound method and its sampler, not a closure: a model holding the samplers pickles
        # (torch.save(model)) with its controller.
        return partial(self._block_output, sampler)

    def _block_output(self, sampler: _Sampler, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        # A gradient hook on the block's output (not a new autograd node), so the model may still
        # modify that output in place.
        first = output[0] if isinstance(output, tuple) and output else output
        if isinstance(first, torch.Tensor) and first.dim() <= self.batch_dim:
            raise ValueError(f"batch_dim: {self.batch_dim} counts the samples, but the output of "
                             f"{type(module).__name__} (a block_type module) has {first.dim()} dimension(s), shape "
                             f"{tuple(first.shape)}")
        if module.training and torch.is_grad_enabled() and isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(partial(self._activation_backward, sampler))

    def remove(self) -> None:
        """Puts the original Linears back and removes the samplers."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for block in self.blocks:
            for parent in block.modules():
                for child_name, child in list(parent.named_children()):
                    if isinstance(child, _VcasLinear):
                        setattr(parent, child_name, child.original)
        self.linears.clear()
        self._removed = True

    def _check_not_removed(self) -> None:
        if getattr(self, "_removed", False):  # getattr: a controller unpickled from before this flag
            raise RuntimeError("abp.vcas.Controller: used after remove(); build a new one on the model to sample again")

    @staticmethod
    def attached(model: torch.nn.Module) -> Optional["Controller"]:
        """The Controller whose samplers `model` holds (one unpickled with it: ``torch.save(model)``
        saves it), or None."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        return next((c for c in map(_controller_of, model.modules()) if c is not None), None)

    # --- resuming ---

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to continue as the uninterrupted one: the step count, the
        schedule's s and every sampler's ratio (activations bottom block first, weights by the
        Linear's name in the model). Plain values; save it with the model's and optimizer's."""
        return {"version": 2, "s": self.s, "steps": self.steps, "calibrations": self.calibrations,
                "activations": [(sampler.ratio, sampler.active) for sampler in self.samplers],
                "weights": {layer.state.key: (layer.state.ratio, layer.state.tokens) for layer in self.linears},
                "settings": self._settings()}

    def _settings(self) -> Dict[str, Any]:
        """The settings a state belongs to: a resumed run with others would calibrate and adapt
        differently from the uninterrupted one."""
        return {"act_var_tau": self.act_var_tau, "w_var_tau": self.w_var_tau, "cal_var_freq": self.cal_var_freq,
                "s_update_step": self.s_update_step, "w_ratio_mul": self.w_ratio_mul, "cal_var_m": self.cal_var_m,
                "act_sched_decay": self.act_sched_decay, "param_sample_ratio": self.param_sample_ratio,
                "batch_dim": self.batch_dim}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores what `state_dict` returned, into a Controller built on the resumed model (the
        same blocks and Linears). A version 1 state (weights by '<block index>.<name in the
        block>', as saved before the keys were the model's names) loads too."""
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (1, 2):
            raise ValueError("state: expected what abp.vcas.Controller.state_dict() returned (a dict with version 1 or "
                             f"2), got {type(state).__name__}" + (f" with version {version!r}" if isinstance(state, dict) else ""))
        try:
            s, steps, calibrations = float(state["s"]), int(state["steps"]), int(state["calibrations"])
            activations = [(float(ratio), bool(active)) for ratio, active in state["activations"]]
            weights = {name: (float(ratio), int(tokens)) for name, (ratio, tokens) in state["weights"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"state: expected what abp.vcas.Controller.state_dict() returned; this one does not read "
                             f"as such ({type(e).__name__}: {e})") from None
        # States saved before the settings were kept hold none: nothing to compare.
        saved_settings = state.get("settings") or {}
        differ = [f"{k}={saved_settings[k]!r} (this one {v!r})" for k, v in self._settings().items()
                  if k in saved_settings and saved_settings[k] != v]
        if differ:
            raise ValueError(f"state: saved by a controller with other settings: {', '.join(differ)}; build it with "
                             "the saved settings to resume")
        mine = {(layer.state.key if version == 2 else f"{layer.state.depth}.{layer.state.name}"): layer.state
                for layer in self.linears}
        if len(activations) != len(self.samplers) or set(weights) != set(mine):
            raise ValueError(f"state: saved for {len(activations)} blocks and the Linears {sorted(weights)}; this "
                             f"controller has {len(self.samplers)} blocks and {sorted(mine)}: build it on the same "
                             "model to resume")
        ratios = [r for r, _ in activations] + [r for r, _ in weights.values()]
        if not 0 <= s <= 1 or not all(0 < r <= 1 for r in ratios):
            raise ValueError(f"state: s must lie in [0, 1] and every ratio in (0, 1]; got s={s!r}, ratios from "
                             f"{min(ratios, default=1)!r} to {max(ratios, default=1)!r}")
        self.s, self.steps, self.calibrations = s, steps, calibrations
        for sampler, (ratio, active) in zip(self.samplers, activations):
            sampler.ratio, sampler.active = ratio, active
        for name, (ratio, tokens) in weights.items():
            mine[name].ratio, mine[name].tokens = ratio, tokens

    # --- the samplers' backward ---

    def _seed(self) -> int:
        # Calibration draws its keys from a private generator: it replays the forward's own RNG
        # (dropout) for every pass of a batch, and its inner passes must still differ.
        return draw_seed(self._keys if self._keys is not None else self.generator)

    def _activation_backward(self, sampler: _Sampler, grad: torch.Tensor) -> torch.Tensor:
        if self._record:
            g = grad.movedim(self.batch_dim, 0).reshape(grad.shape[self.batch_dim], -1).contiguous()
            norms = kernels.row_norms(g)
            for s in self._candidate_levels():
                sampler.candidates[s] = sampler.candidates.get(s, 0.0) + keep_fraction(norms, s)
            sampler.recorded += 1
        if self._mode == "exact" or not sampler.active:
            return grad
        return sample_activation_grad(grad, sampler.ratio, self._seed(), self.batch_dim)

    def _linear_backward(self, state: _LinearState, x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor,
                         lead_shape: Sequence[int]) -> _WeightGrads:
        if self._mode == "exact":
            return _WeightGrads(g @ weight.to(g.dtype), g.t() @ x, g.sum(0), 0.0)
        sample = self._mode == "train"
        batch_dim = self.batch_dim if len(lead_shape) > 1 else 0
        grads = sampled_linear_grads(x, g, weight, state.ratio, self._seed(), lead_shape, batch_dim, sample=sample)
        state.tokens = max(state.tokens, x.shape[0])
        if not sample:
            state.variance += grads.variance
        return grads

    def _candidate_levels(self) -> Tuple[float, ...]:
        a = self.s_update_step
        return tuple(sorted({max(0.0, self.s - a), self.s, min(1.0, self.s + a)}))

    # --- the schedule ---

    def due(self) -> bool:
        """True when this step should start with a calibration (every cal_var_freq steps)."""
        self._check_not_removed()
        return self.steps % self.cal_var_freq == 0

    def step(self) -> None:
        """Counts one training step."""
        self._check_not_removed()
        self.steps += 1

    @property
    def activation_ratios(self) -> List[float]:
        """ρ_l, bottom block first."""
        return [s.ratio for s in self.samplers]

    @property
    def weight_ratios(self) -> Dict[str, float]:
        """ν of every sampled Linear, by its name in the model."""
        return {layer.state.key: layer.state.ratio for layer in self.linears}

    def flops_ratio(self) -> float:
        """The step's GEMM cost relative to exact training, (1 + mean ρ + mean ρ·ν)/3 over the
        sampled Linears (§7.2; Linears outside blocks and the other ops not counted)."""
        if not self.linears:
            return 1.0
        rho = [self.samplers[layer.state.depth].ratio for layer in self.linears]
        nu = [min(1.0, layer.state.ratio) for layer in self.linears]
        return (1 + sum(rho) / len(rho) + sum(r * v for r, v in zip(rho, nu)) / len(rho)) / 3

    def calibrate(self, loss_fn: Callable[[Any], torch.Tensor], batches: Sequence[Any]) -> Dict[str, Any]:
        """Algorithm 1 (§7.3) over `batches` (M = cal_var_m fresh batches): for each, an exact
        backward, then M backwards with the activation samplers only; updates s, ρ and ν.

        loss_fn(batch) must run the model's forward and return the scalar loss. The 1 + M passes
        of a batch replay the same forward randomness (dropout masks), so only the samplers'
        draws, each pass its own, make them differ. Parameter .grad values are restored
        afterwards. Returns the variances it measured (also in `.last`).
        """
        self._check_not_removed()
        if not torch.is_grad_enabled():
            raise RuntimeError("calibrate: gradients are off (torch.no_grad() or torch.inference_mode() is active); a "
                               "calibration runs 1 + M backward passes per batch: call it where gradients are on")
        batches = list(batches)
        m = len(batches)
        if m < 2:
            raise ValueError(f"batches: expected at least 2 batches to estimate the SGD variance, got {m}")
        params = [p for p in self.model.parameters() if p.requires_grad]
        saved_grads = [p.grad for p in params]
        keys = torch.Generator().manual_seed(draw_seed(self.generator))
        # Entries are picked from what this rank holds of each parameter: all of it, or its shard
        # under FSDP2 (its gradients are the shard's, reduced over the ranks).
        local = [_local(p) for p in params]
        picks = [torch.randperm(t.numel(), generator=keys)[: max(1, round(self.param_sample_ratio * t.numel()))]
                 .to(t.device) for t in local]
        # Each parameter's sampled sum, scaled to all its entries by the fraction really picked.
        scale = [p.numel() / len(i) for p, i in zip(params, picks)]
        layer_params = {id(layer.weight): layer for layer in self.linears}
        for sampler in self.samplers:
            sampler.candidates.clear()
            sampler.recorded = 0
        for layer in self.linears:
            layer.state.variance = 0.0

        def gradient(batch: Any) -> List[torch.Tensor]:
            for p in params:
                p.grad = None
            loss = loss_fn(batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
                hint = " (a model's output: return its .loss)" if hasattr(loss, "loss") else ""
                raise TypeError(f"loss_fn(batch): expected the scalar loss tensor, got {what}{hint}")
            loss.backward()
            return [(_local(p.grad).flatten()[i].double() if p.grad is not None
                     else torch.zeros(len(i), dtype=torch.float64, device=i.device))
                    for p, i in zip(params, picks)]

        exact: List[List[torch.Tensor]] = []
        v_act = 0.0
        self._keys = keys
        # Outside any compress block or CompressionController step around the call (a callback
        # of the Trainer's before this one, `with controller:`): the passes measure exact
        # gradients, and are no training step to compress or replay.
        with outside_blocks():
            try:
                for batch in batches:
                    state = _rng_state()
                    self._mode, self._record = "exact", True
                    g = gradient(batch)
                    exact.append(g)
                    self._mode, self._record = "activations", False
                    for _ in range(m):
                        _set_rng_state(state)
                        sampled = gradient(batch)
                        v_act += sum(float(((a - b) ** 2).sum()) * c for a, b, c in zip(sampled, g, scale))
            finally:
                self._mode, self._record, self._keys = "train", False, None
                for p, grad in zip(params, saved_grads):
                    p.grad = grad
        # V_SGD: the between-batch variance of the sampled entries, unbiased, scaled to all entries.
        sgd_param = [float(torch.stack([e[j] for e in exact]).var(dim=0, unbiased=True).sum()) * scale[j]
                     for j in range(len(params))]
        v_sgd = sum(sgd_param)
        v_act /= m * m
        v_w: Dict[str, float] = {}
        too_noisy: List[Tuple[_LinearState, bool]] = []
        for j, p in enumerate(params):
            layer = layer_params.get(id(p))
            if layer is None:
                continue
            key = layer.state.key
            v_w[key] = layer.state.variance / (m * m)
            too_noisy.append((layer.state, v_w[key] > self.w_var_tau * sgd_param[j]))
        if all(math.isfinite(v) for v in (v_sgd, v_act, *v_w.values())):
            self._update_activation_ratios(v_act, v_sgd)
            for state, noisy in too_noisy:
                self._update_weight_ratio(state, noisy)
        else:
            # A NaN compares as small: the ratios would fall (more sampling) on a batch that says nothing.
            warnings.warn(f"abp.vcas.Controller.calibrate: the measured variances are not finite (v_sgd={v_sgd:g}, "
                          f"v_act={v_act:g}): a calibration batch gave a non-finite gradient. The sampling ratios "
                          "are left as they were", RuntimeWarning, stacklevel=2)
        self.calibrations += 1
        self.last = {"v_sgd": v_sgd, "v_act": v_act, "v_w": v_w, "s": self.s}
        return self.last

    def _update_weight_ratio(self, state: _LinearState, too_noisy: bool) -> None:
        """ν ← ν/β when V_w is above τ_w·V_SGD, else ν·β; at most 1 (exact), and not below one
        token's worth (1/K′), where the budget would be 0 and dW exact while ν kept shrinking."""
        nu = state.ratio / self.w_ratio_mul if too_noisy else state.ratio * self.w_ratio_mul
        floor = 1.0 / state.tokens if state.tokens else 0.0
        state.ratio = min(1.0, max(nu, floor))

    def _update_activation_ratios(self, v_act: float, v_sgd: float) -> None:
        """s ← clip(s ± α) by V_act against τ_act·V_SGD; the new schedule is p_l(s_new) from the
        exact passes, made monotone (ρ_l = max_{j ≤ l} p_j, bottom block first), then the EMA."""
        a = self.s_update_step
        direction = 1.0 if v_act > self.act_var_tau * v_sgd else -1.0
        s_new = min(1.0, max(0.0, self.s + direction * a))
        levels = self._candidate_levels()
        level = min(levels, key=lambda s: abs(s - s_new))
        schedule: List[float] = []
        for sampler in self.samplers:
            p = sampler.candidates[level] / sampler.recorded if sampler.recorded else 1.0
            schedule.append(max(schedule[-1], p) if schedule else p)
        decay = self.act_sched_decay
        for sampler, p in zip(self.samplers, schedule):
            sampler.ratio = decay * sampler.ratio + (1 - decay) * p
        # Resample only at the top, or where the ratio drops below the one above (§7.1).
        for lower, upper in zip(self.samplers, self.samplers[1:]):
            lower.active = lower.ratio < upper.ratio
        self.samplers[-1].active = True
        self.s = s_new


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of `t`: its local shard where it is a DTensor (FSDP2), else itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _rng_state() -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """torch's CPU and (when initialised) CUDA generator states, to replay a forward's dropout."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def _set_rng_state(state: Tuple[torch.Tensor, List[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def _indexable(dataset: Any) -> bool:
    """A map-style dataset with items to draw (an IterableDataset may define a length, or a wrapper
    one that raises, but cannot be indexed)."""
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not isinstance(dataset, Sized):
        return False
    try:
        return len(dataset) > 0
    except TypeError:
        return False


def trainer_callback(controller: Controller, loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None) -> Any:
    """A transformers.TrainerCallback that calibrates `controller` when due (on fresh batches
    from the trainer's training set, drawn so that a resumed run draws the same) and counts steps. loss_fn(model, batch) defaults to
    model(**batch).loss. Raises ImportError when transformers is not installed."""
    import transformers  # noqa: F401  (an ImportError here says what is missing)

    def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return model(**batch).loss

    compute = loss_fn or default_loss

    class VcasCallback(transformers.TrainerCallback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            self._batches: Optional[Iterable[Any]] = None

        def _fresh(self, seed: int, dataloader: Iterable[Any], device: torch.device) -> List[Any]:
            """cal_var_m batches for a calibration. Drawn from the dataset by a generator seeded from
            the Trainer's seed and the controller's count of calibrations (in its state_dict), and
            put together by the dataloader's collate_fn: a resumed run draws what the uninterrupted
            one drew (the position of an iterator of our own is in no checkpoint). A dataset
            without a length (an IterableDataset) is read from an iterator of its own instead."""
            dataset, collate = getattr(dataloader, "dataset", None), getattr(dataloader, "collate_fn", None)
            size = getattr(dataloader, "batch_size", None) or getattr(getattr(dataloader, "batch_sampler", None),
                                                                     "batch_size", None)
            if _indexable(dataset) and callable(collate) and size:
                draws = torch.Generator().manual_seed((int(seed) * 1_000_003 + controller.calibrations) % (1 << 63))
                n, wanted = len(dataset), size * controller.cal_var_m
                order = torch.cat([torch.randperm(n, generator=draws) for _ in range(-(-wanted // n))])[:wanted]
                return [self._to(collate([dataset[int(i)] for i in order[b * size:(b + 1) * size]]), device)
                        for b in range(controller.cal_var_m)]
            out: List[Any] = []
            while len(out) < controller.cal_var_m:
                if self._batches is None:
                    self._batches = iter(dataloader)
                try:
                    batch = next(self._batches)  # type: ignore[call-overload]
                except StopIteration:
                    self._batches = None
                    continue
                out.append(self._to(batch, device))
            return out

        @staticmethod
        def _to(batch: Any, device: torch.device) -> Any:
            return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Optional[torch.nn.Module] = None,
                          train_dataloader: Optional[Iterable[Any]] = None, **kwargs: Any) -> Any:
            if controller.due() and model is not None and train_dataloader is not None:
                device = next(model.parameters()).device
                seed = getattr(args, "seed", 0)  # the TrainingArguments' (a caller of its own may pass none)
                controller.calibrate(lambda b: compute(model, b), self._fresh(seed, train_dataloader, device))
            return control

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            controller.step()
            return control

    return VcasCallback()
