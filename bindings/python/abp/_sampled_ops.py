"""sampled_linear under torch.compile (torch >= 2.4): its residual choice and its dW as two
torch.library custom ops, so that dynamo keeps a sampled layer in its graph.

Eager calls run abp.sampling's autograd.Function directly. Its forward draws a Philox key with
`.item()` and launches kernels through ctypes: graph breaks for dynamo. Here the key stays a tensor (torch.randint in the graph)
and the planning, gathering and launching live inside two opaque ops:

- abp::sampled_linear_save(x2, key, method, keep) -> (rows, index, key, -0.0): what dW needs of
  the 2-d input — the k kept rows, weighted, and their int32 indices ("rows"); or S·x2/k with an
  empty index ("sketch"); or a copy of x2 with an empty index ("exact", k = n). The shapes depend
  on n and keep only, as dynamo needs, and as the eager path's plans have them
  (abp.sampling.plan_rows). The layer's output adds the op's -0.0 (y + -0.0 is y, bit for bit):
  without that the forward's results would not depend on the op or on the key's torch.randint,
  and the partitioner may move both into the backward graph (it did where saving the input once
  cost less than two layers' rows: a gate and an up projection of one input), which then drew
  its keys from the generator when backward ran, in another order: not eager's plans.
- abp::sampled_linear_dw(g2, rows, index, key, method) -> dW: tells the three apart by the shapes
  (an index means rows; n rows without one, exact; fewer, a sketch — a sketch always has k < n).

Both compute exactly what the eager path does (abp.sampling.sampled_residuals / sampled_weight_grad) from the
same key.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _custom_ops
from . import _selection as selection
from . import sampling
from ._sample_kernels import check_key
from .compress import rank_key


def _seed(key: torch.Tensor) -> int:
    return check_key(rank_key(int(key.item())), 0)[0]  # as draw_seed would have drawn it


def _count(n: int, method: str, keep: float) -> int:
    return selection.keep_count(n, keep, minimum=sampling.minimum_kept(method))


def _traced_count(n: Any, method: str, keep: float) -> Any:
    """_count for the fake implementation, where n is a SymInt under dynamic shapes: the same
    min(max(⌊n·keep⌋, minimum), n) as one symbolic expression. int(n) there would specialise the
    graph on the token count, and dynamo would compile one graph per sequence length (then fall
    back to eager at its recompile limit)."""
    return torch.sym_min(torch.sym_max(math.floor(n * keep), sampling.minimum_kept(method)), n)


@_custom_ops.custom_op("abp::sampled_linear_save", mutates_args=())
def _save(x2: torch.Tensor, key: torch.Tensor, method: str, keep: float
          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, index, key, -0.0): the key comes back as an output for backward to read, so that the
    graph's partitioner cannot give backward a recomputed (that is, a fresh) torch.randint; the
    0-d -0.0 (x2's dtype) is added to the layer's output, which ties this op to the forward."""
    rows, index = _residual_rows(x2, key, method, keep)
    return rows, index, key.clone(), torch.full((), -0.0, dtype=x2.dtype, device=x2.device)


def _residual_rows(x2: torch.Tensor, key: torch.Tensor, method: str, keep: float) -> Tuple[torch.Tensor, torch.Tensor]:
    n, d = x2.shape
    k = _count(n, method, keep)
    no_index = torch.empty(0, dtype=torch.int32, device=x2.device)
    if k >= n:  # nothing to sample: x2 itself (a copy: custom ops may not return an input's alias)
        return x2.contiguous().clone(), no_index
    mode, saved = sampling.sampled_residuals(x2, method, keep, _seed(key), None)
    if mode == "sketch":
        return saved[0], no_index
    return saved[0], saved[1]  # the plan's k slots: shapes that depend on n and keep only


@_save.register_fake
def _(x2: torch.Tensor, key: torch.Tensor, method: str, keep: float
      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, d = x2.shape
    k = _traced_count(n, method, keep)
    rows, index = (n, 0) if k >= n else (k, 0 if method in ("gaussian", "rademacher") else k)
    return (x2.new_empty((rows, d)), x2.new_empty((index,), dtype=torch.int32), torch.empty_like(key),
            x2.new_empty(()))


@_custom_ops.custom_op("abp::sampled_linear_dw", mutates_args=())
def _dw(g2: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, key: torch.Tensor, method: str) -> torch.Tensor:
    if index.numel():
        return sampling.sampled_weight_grad("rows", [rows, index], g2, method, _seed(key))
    mode = "exact" if rows.shape[0] == g2.shape[0] else "sketch"
    return sampling.sampled_weight_grad(mode, [rows], g2, method, _seed(key))


@_dw.register_fake
def _(g2: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, key: torch.Tensor, method: str) -> torch.Tensor:
    return g2.new_empty((g2.shape[1], rows.shape[1]))


class CompiledSampledLinear(torch.autograd.Function):
    """sampled_linear for dynamo to trace: the product in torch, the rest in the two ops above."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # type: ignore[override]
                key: torch.Tensor, method: str, keep: float) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        ctx.x_shape, ctx.method, ctx.has_bias = x.shape, method, bias is not None
        ctx.sampled = ctx.needs_input_grad[1]
        if ctx.sampled:
            rows, index, used, negative_zero = _save(x.reshape(-1, x.shape[-1]).to(y.dtype), key, method, keep)
            ctx.save_for_backward(weight, rows, index, used)
            y = y + negative_zero  # the same bits (module docstring: keeps the op in the forward graph)
        else:
            ctx.save_for_backward(weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        weight, *saved = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        dx = (g @ weight.to(g.dtype)).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        db = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dw = _dw(g.contiguous(), *saved, ctx.method) if ctx.sampled else None
        return dx, dw, db, None, None, None
