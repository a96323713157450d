"""Fitting k-bit bucket tables for any derivative: what FewBit's tables are, for a new activation.

A table approximates a derivative f′ by a step function with 2**bits levels: borders
t_0 < … < t_{K−2} and levels L_0 … L_{K−1} (interval i is (t_{i−1}, t_i]), chosen to minimise
∫ (f′ − q)² w over the weighting w. `fit_buckets` runs the global solver the op library's tables
come from (abp/_bucket_solver.py; docs/algorithms.md §2.2–2.5: a DP over a 0.01 grid, then
continuous refinement), and returns the table with its `#abp.buckets<...>` attribute for an
operator's `abp.quantize`/`abp.dequantize`:

    table = abp.buckets.fit_buckets(lambda x: torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x))),
                                    bits=3)
    ir = f"#t = {table.attribute}\\n" + OPERATOR_TEXT   # then abp.compile_operators(ir)

Weightings: "normal" (N(0, 1) on [−12, 12], the library's default), "uniform" (1 on [−100, 100],
FewBit's published choice), or a histogram of real pre-activations, given as (counts, edges) as
`torch.histogram` and `numpy.histogram` return them, inside [−100, 100].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Tuple, Union

import numpy as np
import torch

from . import _bucket_solver as solver

__all__ = ["BucketTable", "fit_buckets"]

Histogram = Tuple[Union[torch.Tensor, np.ndarray, Sequence[float]],
                  Union[torch.Tensor, np.ndarray, Sequence[float]]]


@dataclass(frozen=True)
class BucketTable:
    """A fitted table: `borders` (2**bits − 1, strictly increasing in fp32), `levels` (2**bits,
    the weighted mean of f′ over each interval), and `error`, ∫ (f′ − q)² w."""

    bits: int
    borders: Tuple[float, ...]
    levels: Tuple[float, ...]
    error: float

    @property
    def attribute(self) -> str:
        """The table as abp IR: `#abp.buckets<borders = [...], levels = [...]>` (exact in fp64)."""
        borders = ", ".join(solver.mlir_float(t) for t in self.borders)
        levels = ", ".join(solver.mlir_float(v) for v in self.levels)
        return f"#abp.buckets<borders = [{borders}], levels = [{levels}]>"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """q(x) = levels[#{borders < x}] (NaN gets code 0), as the compiled operator computes it."""
        borders = torch.tensor(self.borders, dtype=torch.float32, device=x.device)
        levels = torch.tensor(self.levels, dtype=torch.float32, device=x.device)
        code = (x.float().unsqueeze(-1) > borders).sum(-1)
        return levels[code]


def _as_numpy_function(derivative: Callable[[torch.Tensor], torch.Tensor]) -> solver.Fn:
    def f(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float64)
        y = derivative(torch.from_numpy(x))
        y = np.asarray(y.detach().cpu() if isinstance(y, torch.Tensor) else y, dtype=np.float64)
        if y.shape != x.shape:
            raise ValueError(f"derivative: expected a tensor of the input's shape {tuple(x.shape)} "
                             f"(it is called on float64 tensors), got shape {tuple(y.shape)}")
        if not np.all(np.isfinite(y)):
            bad = float(x[~np.isfinite(y)].flat[0])
            raise ValueError(f"derivative: not finite at x = {bad!r}; a table needs a finite f′ "
                             "over the whole weighting's domain")
        return y
    return f


def _histogram_weight(counts: np.ndarray, edges: np.ndarray) -> solver.Weight:
    if counts.ndim != 1 or edges.ndim != 1 or len(edges) != len(counts) + 1 or len(counts) == 0:
        raise ValueError("weight: a histogram is (counts, edges) with len(edges) == "
                         f"len(counts) + 1 >= 2, got {counts.shape} counts and {edges.shape} edges")
    if not (np.all(np.isfinite(edges)) and np.all(np.diff(edges) > 0)):
        raise ValueError("weight: histogram edges must be finite and strictly increasing")
    if not (np.all(np.isfinite(counts)) and np.all(counts >= 0) and counts.sum() > 0):
        raise ValueError("weight: histogram counts must be finite, >= 0 and not all 0")
    if edges[0] < -100.0 or edges[-1] > 100.0:
        raise ValueError(f"weight: histogram range [{edges[0]:g}, {edges[-1]:g}] must lie inside "
                         "[-100, 100] (the solver's grid); clip the data first")
    density = counts / (counts.sum() * np.diff(edges))  # a pdf: integrates to 1

    def pdf(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        i = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(counts) - 1)
        return np.where((x >= edges[0]) & (x <= edges[-1]), density[i], 0.0)

    def pdf_d(x: np.ndarray) -> np.ndarray:
        return np.zeros_like(np.asarray(x, dtype=np.float64))

    return solver.Weight(f"histogram of {int(round(counts.sum()))} values", float(edges[0]),
                         float(edges[-1]), pdf, pdf_d, "a data histogram",
                         breaks=tuple(float(e) for e in edges[1:-1]))


def _weight(weight: Union[str, Histogram]) -> solver.Weight:
    if isinstance(weight, str):
        return solver.weight(weight)
    if isinstance(weight, tuple) and len(weight) == 2:
        counts, edges = (np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                                    dtype=np.float64) for v in weight)
        return _histogram_weight(counts, edges)
    raise TypeError(f"weight: expected 'normal', 'uniform' or a (counts, edges) histogram, got "
                    f"{type(weight).__name__}")


def fit_buckets(derivative: Callable[[torch.Tensor], torch.Tensor], bits: int,
                weight: Union[str, Histogram] = "normal", *, breaks: Sequence[float] = (),
                jumps: Sequence[float] = ()) -> BucketTable:
    """The (near-)globally optimal `bits`-bit table (1–4) for `derivative`, a function of a
    float64 tensor, under `weight` ("normal", "uniform" or a (counts, edges) histogram).

    `breaks` lists the points where f′ has a kink or a jump (quadrature panels end there, so the
    integrals stay exact to ~1e-12); `jumps` the subset where f′ is discontinuous (a border may
    then settle exactly on the jump). Raises ValueError for bits outside 1–4, a weighting the
    solver cannot use, or a derivative that is not finite on the weighting's domain.
    """
    if not callable(derivative):
        raise TypeError(f"derivative: expected a function of a tensor, got "
                        f"{type(derivative).__name__}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= solver.MAX_BITS:
        raise ValueError(f"bits: expected an integer in [1, {solver.MAX_BITS}], got {bits!r}")
    for name, points in (("breaks", breaks), ("jumps", jumps)):
        if not all(isinstance(p, (int, float)) and math.isfinite(p) for p in points):
            raise ValueError(f"{name}: expected finite numbers, got {list(points)!r}")
    act = solver.Activation(
        name=getattr(derivative, "__name__", "derivative"), forward=_no_forward,
        derivative=_as_numpy_function(derivative),
        breaks=tuple(sorted(set(float(b) for b in breaks) | set(float(j) for j in jumps))),
        jumps=tuple(sorted(float(j) for j in jumps)))
    w = _weight(weight)
    nodes = solver.quadrature_nodes(act, w)
    candidates = int(np.sum((nodes > max(w.lo, -solver.INNER)) & (nodes < min(w.hi, solver.INNER))))
    if candidates < 2 ** bits - 1:
        raise ValueError(f"weight: its domain [{w.lo:g}, {w.hi:g}] holds {candidates} candidate "
                         f"border(s) of the solver's {solver.GRID_STEP} grid inside [-12, 12], "
                         f"fewer than the {2 ** bits - 1} a {bits}-bit table needs; rescale the "
                         "input or use fewer bits")
    table = solver.solve(act, bits, w)
    return BucketTable(bits, table.borders, table.levels, table.J)


def _no_forward(x: np.ndarray) -> np.ndarray:
    raise NotImplementedError("fit_buckets needs only the derivative")
