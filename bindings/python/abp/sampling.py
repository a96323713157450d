"""Sampled linear layers: an exact forward whose backward estimates dW = dYᵀX without bias from
a sample of X's token rows (WTA-CRS, CRS) or a random sketch of them (RMM), so that forward
saves about `keep` of the input instead of all of it (ALGORITHMS.md §3, §8).

    y = abp.sampling.sampled_linear(x, weight, bias, method="wtacrs", keep=0.3)

- dX = dY·W and db = Σ dY are exact; only dW is estimated.
- "wtacrs": the winners (highest p ∝ ‖x_t‖) are kept whole, the rest sampled i.i.d. with the
  1/p rescale; "crs": i.i.d. draws only. Both save the kept rows, already weighted, and their
  int32 indices: k·d_in elements + 4k bytes, k = min(max(⌊N·keep⌋, 10), N). Duplicate draws are
  merged into one row (same estimator, fewer rows).
- "gaussian" / "rademacher": X̃ = S·X/k with S regenerated in backward from its Philox key;
  saves X̃ (k × d_in), k = min(max(⌊N·keep⌋, 3), N).
- With k = N (or a non-finite or all-zero score vector) X is saved whole: the exact gradient.

Randomness: one Philox key per call, drawn from `generator` (torch's default generator if
None) unless `seed` is given, so torch.manual_seed(s) reproduces a run and every call and layer
draws afresh. The kernels (row norms, draws, gather-and-scale, sketches) are generated from
ops/sample/sample.mlir; the plan over the N scores is abp._selection's; the products are torch's.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _sample_kernels as kernels
from . import _selection as selection
from .compress import draw_seed

__all__ = ["METHODS", "sampled_linear", "plan_rows"]

#: The dW estimators of sampled_linear.
METHODS: Tuple[str, ...] = ("wtacrs", "crs", "gaussian", "rademacher")
_ROW_METHODS = ("wtacrs", "crs")
#: Smallest keep counts (ALGORITHMS.md §8.2: 10 rows; §3: sketches of at least 3 rows).
_MINIMUM = {"wtacrs": 10, "crs": 10, "gaussian": 3, "rademacher": 3}


def check_method(method: Any) -> str:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    return method


def check_keep(keep: Any) -> float:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0.0 < float(keep) <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep!r}")
    return float(keep)


def plan_rows(x: torch.Tensor, k: int, method: str, seed: int, offset: int = 0) -> Optional[selection.Plan]:
    """The rows of the 2-d `x` that `method` ("wtacrs" or "crs") keeps, with their weights; None
    when the scores cannot drive a sample (a non-finite or all-zero row norm vector), in which
    case the caller keeps every row. Draws come from Philox at (seed, offset + t)."""
    norms = kernels.row_norms(x)
    if not selection.scores_usable(norms):
        return None
    p = selection.norm_probabilities(norms)
    u = kernels.uniform(k, seed, offset, x.device)
    if method == "wtacrs":
        return selection.plan_wtacrs(p, k, u)
    return selection.plan_crs(p, k, u)


class _SampledLinear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], method: str, keep: float, seed: int
    ) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        ctx.x_shape, ctx.x_dtype, ctx.method, ctx.seed = x.shape, x.dtype, method, seed
        ctx.has_bias = bias is not None
        # The input as the product used it (autocast may have cast it): what backward needs.
        x2 = x.reshape(-1, x.shape[-1]).to(y.dtype)
        n = x2.shape[0]
        ctx.mode, saved = "none", []
        if ctx.needs_input_grad[1]:
            k = selection.keep_count(n, keep, minimum=_MINIMUM[method])
            plan = plan_rows(x2, k, method, seed) if method in _ROW_METHODS and k < n else None
            if k >= n or (method in _ROW_METHODS and plan is None):
                ctx.mode, saved = "exact", [x2.contiguous()]
            elif plan is not None:
                weight_rows = plan.weight.to(torch.float64 if x2.dtype == torch.float64 else torch.float32)
                ctx.mode, saved = "rows", [kernels.sample_rows(x2, plan.index, weight_rows), plan.index]
            else:
                sketch = _sketch(method, k, n, seed, x2)
                ctx.mode, saved = "sketch", [(sketch @ x2) / k]
        ctx.save_for_backward(weight, *saved)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        weight, *saved = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g @ weight.to(g.dtype)).reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        if ctx.mode == "exact":
            dw = g.t() @ saved[0].to(g.dtype)
        elif ctx.mode == "rows":
            kept, index = saved
            g = g.to(kept.dtype).contiguous()
            ones = torch.ones(index.numel(), dtype=torch.float64 if g.dtype == torch.float64 else torch.float32,
                              device=g.device)
            dw = kernels.sample_rows(g, index, ones).t() @ kept
            # A non-finite dY in a row the plan did not keep must still reach dW, as it would the
            # exact product (AMP's overflow check reads it): without a host sync.
            dw = torch.where(torch.isfinite(g).all(), dw, torch.full_like(dw, float("nan")))
        elif ctx.mode == "sketch":
            (projected,) = saved
            k, n = projected.shape[0], g.shape[0]
            g = g.to(projected.dtype)
            dw = (_sketch(ctx.method, k, n, ctx.seed, g) @ g).t() @ projected
        return dx, dw, db, None, None, None


def _sketch(method: str, k: int, n: int, seed: int, like: torch.Tensor) -> torch.Tensor:
    """RMM's k x n sketch in `like`'s dtype (fp64 products use an fp32 draw, widened)."""
    dtype = like.dtype if like.dtype != torch.float64 else torch.float32
    return kernels.sketch(method, k, n, seed, 0, like.device, dtype).to(like.dtype)


def sampled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    method: str = "wtacrs",
    keep: float = 0.3,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """y = x·Wᵀ + b exactly; backward's dW is `method`'s unbiased estimate (module docstring).

    x: (..., in_features), fp32/fp16/bf16/fp64; weight: (out_features, in_features); bias:
    (out_features,) or None. keep ∈ (0, 1]: the kept fraction of the N = x.numel() / in_features
    token rows. seed: the Philox key of this call (else drawn from `generator`).
    """
    method = check_method(method)
    keep = check_keep(keep)
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
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad or
                                           (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)
    if seed is None:
        seed = draw_seed(generator)
    return _SampledLinear.apply(x, weight, bias, method, keep, kernels._key(seed, 0)[0])
