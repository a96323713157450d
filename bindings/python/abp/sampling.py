"""Sampled linear layers: an exact forward whose backward estimates dW = dYᵀX without bias from
a sample of X's token rows (WTA-CRS, CRS) or a random sketch of them (RMM), so that forward
saves about `keep` of the input instead of all of it (docs/algorithms.md §3, §8).

    y = abp.sampling.sampled_linear(x, weight, bias, method="wtacrs", keep=0.3)

- dX = dY·W and db = Σ dY are exact; only dW is estimated.
- "wtacrs": the winners (highest p ∝ ‖x_t‖) are kept whole, the rest sampled i.i.d. with the
  1/p rescale; "crs": i.i.d. draws only; "uniform": i.i.d. draws with p = 1/N. Both save the kept rows, already weighted, and their
  int32 indices: k·d_in elements + 4k bytes, k = min(max(⌊N·keep⌋, 10), N), whatever was drawn
  (a row drawn twice fills two of the k slots): the plan is made on the device without a host
  synchronisation, so a CUDA graph can capture the layer (`plan_rows`).
- "gaussian" / "rademacher": X̃ = S·X/k with S regenerated in backward from its Philox key;
  saves X̃ (k × d_in), k = min(max(⌊N·keep⌋, 3), N).
- With k = N, X is saved whole: the exact gradient. A non-finite input row makes dW non-finite,
  as it would the exact product.

Randomness: one Philox key per call, drawn from `generator` (torch's default generator if
None) unless `seed` is given, so torch.manual_seed(s) reproduces a run and every call and layer
draws afresh. The kernels (row norms, draws, gather-and-scale, sketches) are generated from
ops/sample/sample.mlir; the plan over the N scores is abp._selection's (run as the same ATen ops in C++
where the C++ lane is built, abp/_row_plan.cpp: the same bits without ~70 Python op calls); the
products are torch's.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _amp, _custom_ops, _plan_lane, _scale, autograd
from . import _sample_kernels as kernels
from . import _selection as selection
from ._launch import check_device, compute_dtype
from .compress import check_generator, draw_seed, mark_activation

__all__ = ["METHODS", "sampled_linear", "plan_rows", "sketch_product", "GradNormCache"]

#: The dW estimators of sampled_linear.
METHODS: Tuple[str, ...] = ("wtacrs", "crs", "uniform", "gaussian", "rademacher")
_ROW_METHODS = ("wtacrs", "crs", "uniform")
#: The share of the ‖x‖-only distribution mixed into p ∝ ‖x_t‖·γ_t (§8.2; integer_masses' floor).
_NORM_FLOOR = 0.1
#: Smallest keep counts (docs/algorithms.md §8.2: 10 rows; §3: sketches of at least 3 rows).
MINIMUM_KEPT = {"wtacrs": 10, "crs": 10, "uniform": 10, "gaussian": 3, "rademacher": 3}


def minimum_kept(method: str) -> int:
    """MINIMUM_KEPT[method], or 1 while abp.convert counts an example call's saved bytes as a large
    batch would save them (abp._scale)."""
    return MINIMUM_KEPT[method] if _scale.apply() else 1


def check_method(method: Any) -> str:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    return method


check_keep = selection.check_keep


def plan_rows(x: torch.Tensor, k: int, method: str, seed: int, offset: int = 0,
              gamma: Optional[torch.Tensor] = None) -> selection.Slots:
    """The k slots (row, weight) that `method` ("wtacrs", "crs" or "uniform") keeps of the 2-d
    `x`: p ∝ ‖x_t‖, or ‖x_t‖·γ_t (mixed with 0.1 of the ‖x‖-only distribution) given γ, one value
    per row (§8.2), as `selection.integer_masses`; slot r's 48-bit uniform from Philox at
    (seed, offset + r) and (seed, offset + k + r).

    Made on x's device with no host synchronisation (a CUDA graph captures it), and the same
    rows and weights on every device: the kernels give the same norms and draws on the CPU and
    the GPU, and the plan's sums are exact. A NaN row norm gives NaN weights (dW is then not
    finite, as the exact product would be); an infinite one takes nearly all the mass (and its
    infinity into dW); all-zero scores, uniform draws of zero rows."""
    norms = kernels.row_norms(x)  # also for "uniform": a non-finite row makes dW non-finite
    draws = kernels.uniform(2 * k, seed, offset, x.device)
    lane = _plan_lane.module()
    if (lane is not None and k >= 1 and norms.numel() > 0 and method in _ROW_METHODS
            and (gamma is None or (type(gamma) is torch.Tensor and gamma.dim() == 1 and gamma.is_floating_point()
                                   and gamma.numel() == norms.numel()))):
        # The same ops in C++ (abp/_row_plan.cpp): the same bits, without ~60 Python op calls.
        return selection.Slots(*lane.row_plan(norms, gamma, draws, k, method, _NORM_FLOOR))
    masses, usable = selection.integer_masses(norms, gamma, _NORM_FLOOR)
    if method == "uniform":  # every row alike; a row with an infinite norm is drawn (its infinity reaches dW)
        masses = torch.where(torch.isinf(norms).to(masses.device), masses, torch.ones_like(masses))
    return selection.plan_slots(masses, usable, k, selection.uniforms48(draws), method)


def sampled_residuals(x2: torch.Tensor, method: str, keep: float, seed: int,
                      gamma: Optional[torch.Tensor]) -> Tuple[str, List[torch.Tensor]]:
    """What backward's dW needs of the 2-d input x2: ("exact", [x2]) when k = N, ("rows", [the k
    slots' rows weighted, their indices]) or ("sketch", [S·x2 / k]). The shapes depend on N and
    keep alone."""
    n = x2.shape[0]
    k = selection.keep_count(n, keep, minimum=minimum_kept(method))
    if k >= n:
        return "exact", [x2.contiguous()]
    if method in _ROW_METHODS:
        plan = plan_rows(x2, k, method, seed, gamma=gamma)
        weight_rows = plan.weight.to(compute_dtype(x2.dtype))
        return "rows", [kernels.sample_rows(x2, plan.index, weight_rows, trusted=True), plan.index]
    return "sketch", [sketch_product(method, k, seed, x2) / k]


def sampled_weight_grad(mode: str, saved: List[torch.Tensor], g: torch.Tensor, method: str, seed: int) -> torch.Tensor:
    """dW from the 2-d output gradient g and what sampled_residuals saved in `mode`."""
    if mode == "exact":
        return g.t() @ _as(saved[0], g.dtype)
    if mode == "rows":
        kept, index = saved
        g = _as(g, kept.dtype)
        # The plan's rows of dY (a plan over x's own rows: every index is one of g's rows).
        dw = g.index_select(0, index).t() @ kept
        # A non-finite dY in a row the plan did not keep must still reach dW, as it would the
        # exact product (AMP's overflow check reads it): without a host sync.
        return torch.where(torch.isfinite(g).all(), dw, math.nan)
    (projected,) = saved
    g = g.to(projected.dtype).contiguous()
    return sketch_product(method, projected.shape[0], seed, g).t() @ projected


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as (token rows, features); also with no features (a layer of in_features 0), where
    reshape(-1, 0) cannot infer the rows. A 2-d `t` is itself (no view op on the per-call path)."""
    return t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`; itself, with no op call, where it already is."""
    return t if t.dtype == dtype else t.to(dtype)


class _SampledLinear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], method: str, keep: float, seed: int,
        gamma: Optional[torch.Tensor], record: Optional[Callable[[torch.Tensor], None]],
    ) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        ctx.x_shape, ctx.x_dtype, ctx.method, ctx.seed, ctx.record = x.shape, x.dtype, method, seed, record
        ctx.has_bias = bias is not None
        ctx.mode, saved = "none", []
        if ctx.needs_input_grad[1]:
            # The input as the product used it (autocast may have cast it): what backward needs.
            ctx.mode, saved = sampled_residuals(_as(_rows(x), y.dtype), method, keep, seed, gamma)
            # Detached: with k = N the residual is a view of x made here with grad off, which on
            # torch 1.13 a saved-tensor hook (compress_saved's) could not give back to backward
            # ("No grad accumulator for a saved leaf").
            saved = [t.detach() for t in saved]
            # The kept rows (or the sketch, or x) are an activation's values, computed here with grad
            # off: compress_saved may code them, when it would code x itself (its min_numel is
            # tested on x's size). An input that requires no grad (the batch) is a constant of
            # backward, kept as it is.
            if x.requires_grad:
                for t in saved:
                    if t.is_floating_point():
                        mark_activation(t, sampled_from=x.numel())
        ctx.save_for_backward(weight, *saved)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        try:
            return _SampledLinear._backward(ctx, grad)
        except RuntimeError as e:
            autograd.raise_naming_batched("sampled_linear", e)

    @staticmethod
    def _backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        weight, *saved = ctx.saved_tensors
        g = _rows(grad)
        if ctx.record is not None:  # ‖dY_t‖ for the next visit of these examples (§8.2)
            ctx.record(kernels.row_norms(g.contiguous()))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = g @ _as(weight, g.dtype)
            dx = dx if grad.dim() == 2 else dx.reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        if ctx.mode != "none":
            with torch.no_grad():
                dw = sampled_weight_grad(ctx.mode, saved, g, ctx.method, ctx.seed)
            if torch.is_grad_enabled():
                dw = _not_differentiable_again(dw, grad, weight)
        return dx, dw, db, None, None, None, None, None


def _not_differentiable_again(dw: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dW under backward(create_graph=True). dX = dY·W and db = ΣdY are the exact formulas, recorded
    as they run, so their second derivatives are exact (a gradient penalty on the input). dW is
    the estimate from rows saved without their graph (even at keep 1, the exact product): a second
    derivative through it would miss its dependence on x and be silently wrong, so it raises
    (abp.autograd.not_twice, joined to dY and W so that every path through dW meets the error).
    With a constant dY nothing would lead from dW towards x: that raises at once."""
    if not grad.requires_grad:
        autograd.refuse_twice("the sampled linear layer's weight gradient: backward(create_graph=True) reached it "
                              "with a constant incoming gradient, so nothing would lead a second derivative from it "
                              "back to the layer's input; keep a layer whose output the loss takes linearly (a "
                              "critic's last layer under a gradient penalty) a torch.nn.Linear")
    return autograd.not_twice((dw,), [t for t in (grad, weight) if t.requires_grad])[0]


#: Entries of the sketch generated at once: S·M is formed a block of S's rows at a time, so the
#: k × N sketch (k ∝ N) never exists whole.
SKETCH_BLOCK = 1 << 24


def sketch_product(method: str, k: int, seed: int, mat: torch.Tensor, block: int = SKETCH_BLOCK) -> torch.Tensor:
    """S·mat for RMM's k × N sketch S (N = mat's rows) of key `seed`, in mat's dtype (fp64
    products use an fp32 draw, widened), generated `block` entries of S at a time."""
    n = mat.shape[0]
    dtype = mat.dtype if mat.dtype != torch.float64 else torch.float32
    rows = max(1, block // max(1, n))
    out = torch.empty((k, mat.shape[1]), dtype=mat.dtype, device=mat.device)
    for r0 in range(0, k, rows):
        r1 = min(k, r0 + rows)
        s = kernels.sketch(method, r1 - r0, n, seed, r0 * n, mat.device, dtype, second_offset=k * n + r0 * n)
        out[r0:r1] = s.to(mat.dtype) @ mat
    return out


def sampled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    method: str = "wtacrs",
    keep: float = 0.3,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    gamma: Optional[torch.Tensor] = None,
    record: Optional[Callable[[torch.Tensor], None]] = None,
) -> torch.Tensor:
    """y = x·Wᵀ + b exactly; backward's dW is `method`'s unbiased estimate (module docstring).

    x: (..., in_features), fp32/fp16/bf16/fp64; weight: (out_features, in_features); bias:
    (out_features,) or None. keep ∈ (0, 1]: the kept fraction of the N = x.numel() / in_features
    token rows. seed: the Philox key of this call (else drawn from `generator`). gamma: one
    value ≥ 0 per token row, WTA-CRS's cached ‖dY_t‖ (p ∝ ‖x_t‖·γ_t); where one is negative or
    not finite, the plan uses ‖x_t‖ alone (decided on the device: the values are not checked on
    the host, which would synchronise); record(norms) receives ‖dY_t‖ per row in backward
    (GradNormCache uses both). x and weight have one dtype, as for F.linear, unless autocast is on.
    """
    method = check_method(method)
    keep = check_keep(keep)
    check_generator(generator)
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("x and weight must be tensors")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected (out_features, in_features), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x: expected shape (..., {weight.shape[1]}) (in_features last), got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    allowed = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in allowed:
            raise ValueError(f"{name}: expected dtype float32, float16, bfloat16 or float64, got {t.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}; expected the same device")
    if x.dtype != weight.dtype and _amp.dtype(x.device.type) is None:
        raise ValueError(f"x is {x.dtype} but weight {weight.dtype}; expected the same dtype (as F.linear), "
                         "or autocast on")
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad or
                                           (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)
    check_device("x", x)  # a model moved to "meta": its plan and kernels need data
    if gamma is not None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not isinstance(gamma, torch.Tensor) or gamma.dim() != 1 or gamma.numel() != rows:
            raise ValueError(f"gamma: expected one value per token row ({rows}), got "
                             f"{tuple(gamma.shape) if isinstance(gamma, torch.Tensor) else type(gamma).__name__}")
    autograd.refuse_jit_trace("sampled_linear")
    if _custom_ops.compiling() and seed is None and gamma is None and record is None:
        # Under torch.compile: the key stays a tensor and the host work hides in custom ops, so
        # the layer costs dynamo no graph break (abp._sampled_ops). GradNormCache's gamma/record
        # are Python state and take the eager path below.
        from ._sampled_ops import CompiledSampledLinear

        device = generator.device if generator is not None else "cpu"
        key = torch.randint(0, 2**63 - 1, (1,), generator=generator, device=device)
        return CompiledSampledLinear.apply(x, weight, bias, key, method, keep)
    if seed is None:
        seed = draw_seed(generator)
    return autograd.apply_function("abp's sampled linear layer", _SampledLinear, x, weight, bias, method, keep,
                                   kernels.check_key(seed, 0)[0], gamma, record)


class GradNormCache:
    """WTA-CRS's γ_t = ‖dY_t‖ of every token of every training example, from its previous visit,
    one table per sampled layer (docs/algorithms.md §8.2): p ∝ ‖x_t‖·γ_t, mixed with 0.1 of the
    ‖x‖-only distribution so a stale γ_t = 0 cannot make 1/p explode.

        cache = abp.sampling.GradNormCache(num_examples=len(dataset), tokens=seq_len)
        cache.attach(model)                      # every abp.nn.SampledLinear of the model
        for ids, batch in loader:                # the loader yields each example's index
            with cache.batch(ids):
                loss_fn(model(batch)).backward()

    A layer's input must then hold len(ids) × tokens rows (batch-first). Until every example of a
    batch has been seen once, that layer uses ‖x_t‖ alone (the paper's first epoch). The tables
    (`nbytes`, in `dtype`) live on the device of the first batch; they are not saved activations.
    """

    def __init__(self, num_examples: int, tokens: int, dtype: torch.dtype = torch.bfloat16) -> None:
        for name, v in (("num_examples", num_examples), ("tokens", tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ValueError(f"dtype: expected a floating dtype, got {dtype}")
        self.num_examples, self.tokens, self.dtype = num_examples, tokens, dtype
        self.tables: Dict[int, torch.Tensor] = {}  # layer slot -> [examples, tokens]
        self._slots = 0
        self._ids: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables.values())

    def __getstate__(self) -> Dict[str, Any]:
        # A model pickled inside `batch()` (torch.save(model) mid-step) must not come back inside
        # that batch: its ids belong to the block that was open.
        return {**self.__dict__, "_ids": None}

    def attach(self, model: torch.nn.Module) -> int:
        """Makes every SampledLinear and SampledConv1D of `model` read and update a table of this
        cache; returns how many layers it attached."""
        from .nn import SAMPLED_LAYERS  # abp.nn imports this module

        layers = [m for m in model.modules() if isinstance(m, SAMPLED_LAYERS)]
        if not layers:
            raise ValueError("model: has no sampled layer (SampledLinear or SampledConv1D) to attach the cache to; "
                             "attach it to the model abp.convert(model, 'sampled') returned (a copy, unless "
                             "inplace=True), after converting")
        for layer in layers:
            attached = layer.grad_norm_cache
            if attached is None or attached[0] is not self:
                layer.grad_norm_cache = (self, self._slots)
                self._slots += 1
        return len(layers)

    @contextlib.contextmanager
    def batch(self, ids: torch.Tensor) -> Iterator["GradNormCache"]:
        """The examples of the batch run inside this block (1-d integer indices in
        [0, num_examples), one per sample, in batch order)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(f"ids: expected a 1-d integer tensor of example indices, got "
                             f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_examples):
            raise ValueError(f"ids: every index must lie in [0, {self.num_examples}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        previous, self._ids = self._ids, ids.long()
        try:
            yield self
        finally:
            self._ids = previous

    def state_dict(self) -> Dict[str, Any]:
        """The tables (‖dY_t‖ of every example's last visit, per attached layer), for a resumed run
        to sample as the uninterrupted one; attach a new cache to the resumed model in the same
        order (the model's modules, as attach takes them), then load_state_dict."""
        return {"version": 1, "num_examples": self.num_examples, "tokens": self.tokens, "dtype": str(self.dtype),
                "layers": self._slots,
                "tables": {slot: table.clone() for slot, table in self.tables.items()}}  # a snapshot

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("state: expected what GradNormCache.state_dict() returned (a dict with version 1), "
                             f"got {type(state).__name__}")
        if (state["num_examples"], state["tokens"], state["dtype"]) != (self.num_examples, self.tokens, str(self.dtype)):
            raise ValueError(f"state: saved for {state['num_examples']} examples x {state['tokens']} tokens in "
                             f"{state['dtype']}; this cache holds {self.num_examples} x {self.tokens} in {self.dtype}")
        # States saved before the layer count was kept hold none: their tables' slots are checked.
        layers = state.get("layers")
        if layers is not None and layers != self._slots:
            raise ValueError(f"state: saved from a cache attached to {layers} sampled layers; {self._slots} are "
                             "attached to this one: attach it to the resumed model (the same sampled layers) "
                             "before loading")
        beyond = sorted(int(slot) for slot in state["tables"] if not 0 <= int(slot) < self._slots)
        if beyond:
            raise ValueError(f"state: holds tables for layer slots {beyond}, but {self._slots} layers are attached to "
                             "this cache: attach it to the resumed model (the same sampled layers) before loading")
        self.tables = {int(slot): table.to(self.dtype, copy=True) for slot, table in state["tables"].items()}

    def _table(self, slot: int, device: torch.device) -> torch.Tensor:
        table = self.tables.get(slot)
        if table is None:  # NaN: not visited yet
            table = torch.full((self.num_examples, self.tokens), float("nan"), dtype=self.dtype, device=device)
            self.tables[slot] = table
        elif table.device != device:  # loaded elsewhere (torch.load's map_location): moved once
            table = self.tables[slot] = table.to(device)
        return table

    def lookup(self, slot: int, rows: int, device: torch.device) -> Tuple[Optional[torch.Tensor], Optional[Callable[[torch.Tensor], None]]]:
        """(γ for the current batch's rows, NaN for examples not visited yet, and the function
        storing ‖dY_t‖ after backward); (None, None) outside `batch()`."""
        ids = self._ids
        if ids is None:
            return None, None
        if rows != ids.numel() * self.tokens:
            raise ValueError(f"x: a layer under GradNormCache.batch got {rows} token rows; expected "
                             f"len(ids) x tokens = {ids.numel()} x {self.tokens} (batch-first)")
        table = self._table(slot, device)
        ids = ids.to(table.device)
        # NaN where an example was not visited yet: the plan then uses ‖x_t‖ alone
        # (selection.integer_masses), decided on the device.
        gamma = table[ids].reshape(-1)

        def record(norms: torch.Tensor) -> None:
            table[ids] = norms.reshape(ids.numel(), self.tokens).to(table.dtype)

        return gamma, record
