#!/usr/bin/env python3
"""The global solver for k-bit derivative tables (FewBit, docs/algorithms.md §2.2–2.5).

The op library's tables (tools/fewbit_solver.py writes them into ops/fewbit/) and a user's own
(abp.buckets.fit_buckets) both come from here. Pure numpy, fp64; nothing here imports torch or
the rest of abp, so the tool loads this file on its own.

A k-bit table approximates f′ by a step function with K = 2**k levels: inner borders
t_0 < … < t_{K-2} and levels L_0 … L_{K-1}, where interval i is (t_{i-1}, t_i]. The solver
minimises

    J(t, L) = ∫_D (f′(x) − q(x))² w(x) dx,   q = L_i on interval i,

for two weightings:

* ``normal``:  w = N(0, 1) pdf on D = [−12, 12] (not renormalised);
* ``uniform``: w = 1 on D = [−100, 100] (FewBit's published weighting).

Method (all fp64, numpy only):

1. **Quadrature grid.** Nodes every 0.01 on [−12, 12]; for the uniform weight also every 0.1 on
   the tails [−100, −12] and [12, 100]; plus every point where f′ is not smooth (celu/elu/selu at
   0, softsign at 0, hardswish at ±3, softplus at its threshold 20). Every cell is integrated
   with 8-point Gauss–Legendre, so kinks and jumps of f′ are always panel boundaries.
2. **Prefix integrals** W, F, F2 of w, f′w, f′²w at the nodes (compensated running sums), kept
   both from the left (prefix) and from the right (suffix). A segment [a, b] uses the prefix
   difference when a < 0 and the suffix difference otherwise, which avoids cancellation in the
   far tails.
3. **Global DP** over the candidate borders: every node strictly inside (−12, 12), plus the domain
   ends. The first and last DP cells therefore absorb the tails for the uniform weight
   ([−100, −11.99] and [11.99, 100]). GELU/SiLU optima lie in |x| < 6 and all of them in
   |x| < 9.5; a DP over every node of [−100, 100] finds the same optima. Segment
   cost c(i, j) = (F2_j − F2_i) − (F_j − F_i)² / (W_j − W_i) (0 when W_j − W_i ≤ 0, which only
   happens in the normal weight's far tails). dp_k[j] = min_{i<j} dp_{k−1}[i] + c(i, j) for
   k = 1..16, vectorised row-wise; the 1-, 2-, 3- and 4-bit tables are read from the same DP by
   backtracking from dp_K[M]. Ties are broken by ``np.argmin`` (lowest index), so the result is
   deterministic. Because i < j, no DP segment is ever empty.
4. **Continuous refinement** from the DP result, levels always the weighted interval means:
   a. block coordinate descent (Lloyd–Max with exact line minimisation): the even borders, then
      the odd ones (each group's 1-D problems are independent), each moved along its descent
      direction to the first sign change of ∂J/∂t_i = w(t_i)[(f′(t_i) − L_i)² − (f′(t_i) −
      L_{i+1})²], located by geometric step-out then bisection. This converges onto jumps of f′
      too (hardswish ±3, selu 0), where the optimum can sit with a non-zero one-sided gradient;
   b. a border sitting on a jump of f′ whose one-sided gradients bracket 0 is *pinned* there;
   c. Levenberg–Marquardt-safeguarded Newton steps on the free borders, with the analytic
      tridiagonal Hessian of the profile J(t) (f″ by central differences), accepted only if J
      does not increase.
   Cycles of (a–c) run until a cycle changes J by < 1e-14. A border is never moved closer than
   1e-6·max(1, |x|) to a neighbour (nor to a domain end), so borders stay strictly increasing in
   fp32 as ``#abp.buckets`` requires; a border that would collide stops at that gap (reported as
   ``collided`` in the verbose log; it does not happen for the shipped tables).
5. **Accurate J** and levels by composite Gauss–Legendre over the quadrature cells clipped to the
   table's intervals (integrand (f′ − L_i)² w, no cancellation). The refined table is kept only if
   its J does not exceed the DP table's J.
6. **Mirror pairs.** Where f′(−x) = c + s·f′(x) (gelu, gelu_tanh, silu, hardswish, logsigmoid,
   softplus: f′(x) + f′(−x) = 1; sigmoid, softsign, tanh, tanhshrink: even), the mirrored table
   t_i → −t_{K−2−i}, L_i → c + s·L_{K−1−i} has the same J, so an asymmetric optimum is one of a
   pair. The solver never forces symmetry; it only picks, between a table and its mirror of equal
   J (relative 1e-9), the one with the smaller sum of borders, so the choice does not depend on
   rounding. (Softplus's threshold breaks its symmetry by ~1e-18 in J.)

Degenerate cases (all handled deterministically):
- Under the uniform weight the bell-shaped derivatives (sigmoid, tanh, softsign) have all their
  variation in a small part of a long, nearly flat domain: their tables have near-zero end levels
  and asymmetric optima that come in mirror pairs (sigmoid 1-bit: border −5.34, levels
  (5.0e−5, 0.00945), or its mirror), canonicalised as in 6. Softsign's heavy tails put borders
  out to |x| ≈ 9.5, still inside the candidate range; a DP over the whole domain finds the same
  optima.
- Optima on a jump of f′ (hardswish ±3, selu 0) are pinned there (4b); those on a grid point
  (hardswish uniform 3-bit: −3, −2, …, 3, J = 1/18) are reproduced to ~1e-12.
- DP segments are never empty (i < j); refined borders keep the gap of 4, so they stay strictly
  increasing (in fp32 too, which ``--check`` verifies).
- If refinement ever ended above the DP table's J (it can only do so by rounding, e.g. when the
  DP border is already optimal), the DP table is kept.

Borders are converged to ~1e-12 (the noise floor of the prefix differences; the compiler rounds
them to fp32 anyway), J to ~1e-16 relative. On one machine the output is byte-for-byte
deterministic.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

Array = np.ndarray
Fn = Callable[[Array], Array]

GRID_STEP = 0.01  # candidate-border and quadrature step on [-INNER, INNER]
INNER = 12.0  # candidate borders lie strictly inside (-INNER, INNER)
TAIL_STEP = 0.1  # quadrature step on the uniform weight's tails
GL_POINTS = 8  # Gauss–Legendre points per quadrature cell
MAX_BITS = 4
MIN_GAP = 1e-6  # minimum border separation, relative to max(1, |x|)
J_TOL = 1e-14  # refinement stops when a whole cycle changes J by less than this
MIRROR_RTOL = 1e-9  # a table and its mirror count as equally good within this relative J


# ----------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------

SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946
SOFTPLUS_THRESHOLD = 20.0
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)
_erfc_ufunc = np.frompyfunc(math.erfc, 1, 1)


def _erfc(x: Array) -> Array:
    """Elementwise erfc in fp64 (math.erfc is accurate to a few ulp; numpy has no erf)."""
    x = np.asarray(x, dtype=np.float64)
    return np.asarray(_erfc_ufunc(x), dtype=np.float64).reshape(x.shape)


def _normal_cdf(x: Array) -> Array:
    """Φ(x), accurate in both tails."""
    return 0.5 * _erfc(-np.asarray(x, dtype=np.float64) * _INV_SQRT2)


def _normal_pdf(x: Array) -> Array:
    """φ(x) = exp(−x²/2)/√(2π)."""
    x = np.asarray(x, dtype=np.float64)
    return np.exp(-0.5 * x * x) * _INV_SQRT2PI


def _sigmoid(x: Array) -> Array:
    """σ(x) without overflow and with full relative accuracy in both tails."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softplus(x: Array) -> Array:
    """log(1 + eˣ) without overflow."""
    return np.logaddexp(0.0, np.asarray(x, dtype=np.float64))


def _sech2(x: Array) -> Array:
    """1/cosh²(x), = 1 − tanh²(x) without cancellation (|x| ≤ 100 here, no overflow)."""
    c = np.cosh(np.asarray(x, dtype=np.float64))
    return 1.0 / (c * c)


@dataclass(frozen=True)
class Activation:
    """A continuous activation f with its analytic derivative f′ (both fp64, vectorised).

    ``breaks`` are the points where f′ is not smooth (quadrature panel boundaries); ``jumps`` the
    subset where f′ is discontinuous. ``mirror = (s, c)`` declares f′(−x) = c + s·f′(x)
    (None: no such symmetry).
    """

    name: str
    forward: Fn
    derivative: Fn
    breaks: Tuple[float, ...] = ()
    jumps: Tuple[float, ...] = ()
    mirror: Optional[Tuple[float, float]] = None


def _gelu(x: Array) -> Array:
    return x * _normal_cdf(x)


def _gelu_d(x: Array) -> Array:
    return _normal_cdf(x) + x * _normal_pdf(x)


# GELU, tanh form (torch's approximate="tanh", GPT-2's gelu_new): f = ½x(1 + tanh u) with
# u = √(2/π)(x + 0.044715x³). Since ½(1 + tanh u) = σ(2u) and ½sech²u = 2σ(2u)σ(−2u), both are
# evaluated through σ, which keeps full relative accuracy in the far tails (no 1 + tanh ≈ 0
# cancellation and no cosh overflow).
GELU_TANH_BETA = math.sqrt(2.0 / math.pi)
GELU_TANH_KAPPA = 0.044715


def _gelu_tanh_u(x: Array) -> Tuple[Array, Array]:
    """u(x) = √(2/π)(x + 0.044715x³) and u′(x)."""
    x = np.asarray(x, dtype=np.float64)
    return (GELU_TANH_BETA * (x + GELU_TANH_KAPPA * x * x * x),
            GELU_TANH_BETA * (1.0 + 3.0 * GELU_TANH_KAPPA * x * x))


def _gelu_tanh(x: Array) -> Array:
    u, _ = _gelu_tanh_u(x)
    return np.asarray(x, dtype=np.float64) * _sigmoid(2.0 * u)


def _gelu_tanh_d(x: Array) -> Array:  # σ(2u)(1 + 2x·u′·σ(−2u))
    u, du = _gelu_tanh_u(x)
    x = np.asarray(x, dtype=np.float64)
    return _sigmoid(2.0 * u) * (1.0 + 2.0 * x * du * _sigmoid(-2.0 * u))


def _silu(x: Array) -> Array:
    return x * _sigmoid(x)


def _silu_d(x: Array) -> Array:
    return _sigmoid(x) * (1.0 + x * _sigmoid(-x))


def _elu1(x: Array) -> Array:  # elu and celu with alpha = 1 coincide
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


def _elu1_d(x: Array) -> Array:
    return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0)))


def _hardswish(x: Array) -> Array:
    return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0


def _hardswish_d(x: Array) -> Array:  # torch: x < -3 -> 0; x <= 3 -> x/3 + 1/2; else 1
    return np.where(x < -3.0, 0.0, np.where(x <= 3.0, x / 3.0 + 0.5, 1.0))


def _logsigmoid(x: Array) -> Array:
    return -_softplus(-x)


def _logsigmoid_d(x: Array) -> Array:
    return _sigmoid(-x)


def _mish(x: Array) -> Array:
    return x * np.tanh(_softplus(x))


def _mish_d(x: Array) -> Array:
    sp = _softplus(x)
    return np.tanh(sp) + x * _sigmoid(x) * _sech2(sp)


def _selu(x: Array) -> Array:
    return SELU_SCALE * np.where(x > 0, x, SELU_ALPHA * np.expm1(np.minimum(x, 0.0)))


def _selu_d(x: Array) -> Array:
    return SELU_SCALE * np.where(x > 0, 1.0, SELU_ALPHA * np.exp(np.minimum(x, 0.0)))


def _sigmoid_d(x: Array) -> Array:
    return _sigmoid(x) * _sigmoid(-x)


def _softplus_t(x: Array) -> Array:  # beta = 1, threshold = 20 (torch's default)
    return np.where(x > SOFTPLUS_THRESHOLD, x, _softplus(x))


def _softplus_t_d(x: Array) -> Array:
    return np.where(x > SOFTPLUS_THRESHOLD, 1.0, _sigmoid(x))


def _softsign(x: Array) -> Array:
    return x / (1.0 + np.abs(x))


def _softsign_d(x: Array) -> Array:
    d = 1.0 + np.abs(x)
    return 1.0 / (d * d)


def _tanh_d(x: Array) -> Array:
    return _sech2(x)


def _tanhshrink(x: Array) -> Array:
    return x - np.tanh(x)


def _tanhshrink_d(x: Array) -> Array:
    t = np.tanh(x)
    return t * t


_COMPLEMENT = (-1.0, 1.0)  # f′(−x) = 1 − f′(x)
_EVEN = (1.0, 0.0)  # f′(−x) = f′(x)

ACTIVATIONS: Dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("gelu", _gelu, _gelu_d, mirror=_COMPLEMENT),
        Activation("gelu_tanh", _gelu_tanh, _gelu_tanh_d, mirror=_COMPLEMENT),
        Activation("silu", _silu, _silu_d, mirror=_COMPLEMENT),
        Activation("celu", _elu1, _elu1_d, breaks=(0.0,)),
        Activation("elu", _elu1, _elu1_d, breaks=(0.0,)),
        Activation("hardswish", _hardswish, _hardswish_d, breaks=(-3.0, 3.0),
                   jumps=(-3.0, 3.0), mirror=_COMPLEMENT),
        Activation("logsigmoid", _logsigmoid, _logsigmoid_d, mirror=_COMPLEMENT),
        Activation("mish", _mish, _mish_d),
        Activation("selu", _selu, _selu_d, breaks=(0.0,), jumps=(0.0,)),
        Activation("sigmoid", _sigmoid, _sigmoid_d, mirror=_EVEN),
        Activation("softplus", _softplus_t, _softplus_t_d, breaks=(SOFTPLUS_THRESHOLD,),
                   jumps=(SOFTPLUS_THRESHOLD,), mirror=_COMPLEMENT),
        Activation("softsign", _softsign, _softsign_d, breaks=(0.0,), mirror=_EVEN),
        Activation("tanh", np.tanh, _tanh_d, mirror=_EVEN),
        Activation("tanhshrink", _tanhshrink, _tanhshrink_d, mirror=_EVEN),
    )
}


def activation(act: ActLike) -> Activation:
    """The named activation (or `act` itself), or ValueError listing the known names."""
    if isinstance(act, Activation):
        return act
    try:
        return ACTIVATIONS[act]
    except KeyError:
        raise ValueError(f"unknown activation {act!r}; expected one of {sorted(ACTIVATIONS)}")


def derivative(act: ActLike) -> Fn:
    """The analytic fp64 derivative f′ of the named activation (vectorised)."""
    return activation(act).derivative


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Weight:
    """A weight w ≥ 0 on the domain [lo, hi], with its derivative (for the Hessian). ``breaks``
    are points where w is not smooth (a histogram's bin edges): quadrature panel boundaries."""

    name: str
    lo: float
    hi: float
    pdf: Fn
    pdf_d: Fn
    description: str
    breaks: Tuple[float, ...] = ()


ActLike = Union[str, Activation]  # a name of ACTIVATIONS, or an Activation of one's own
WeightLike = Union[str, Weight]  # a name of WEIGHTS, or a Weight of one's own


def _ones(x: Array) -> Array:
    return np.ones_like(np.asarray(x, dtype=np.float64))


def _zeros(x: Array) -> Array:
    return np.zeros_like(np.asarray(x, dtype=np.float64))


def _normal_pdf_d(x: Array) -> Array:
    return -np.asarray(x, dtype=np.float64) * _normal_pdf(x)


WEIGHTS: Dict[str, Weight] = {
    "normal": Weight("normal", -12.0, 12.0, _normal_pdf, _normal_pdf_d, "N(0,1) pdf"),
    "uniform": Weight("uniform", -100.0, 100.0, _ones, _zeros, "1"),
}


def weight(name: WeightLike) -> Weight:
    """The named weighting (or `name` itself), or ValueError listing the known names."""
    if isinstance(name, Weight):
        return name
    try:
        return WEIGHTS[name]
    except KeyError:
        raise ValueError(f"unknown weight {name!r}; expected one of {sorted(WEIGHTS)}")


# ----------------------------------------------------------------------------------------------
# Quadrature and prefix integrals
# ----------------------------------------------------------------------------------------------

_GL_X, _GL_W = np.polynomial.legendre.leggauss(GL_POINTS)


@dataclass(frozen=True)
class Problem:
    """Everything precomputed for one (activation, weight): quadrature nodes and the prefix and
    suffix integrals of (w, f′w, f′²w) at them, shape (3, len(nodes))."""

    act: Activation
    weight: Weight
    nodes: Array
    prefix: Array
    suffix: Array

    @property
    def lo(self) -> float:
        return self.weight.lo

    @property
    def hi(self) -> float:
        return self.weight.hi


def quadrature_nodes(act: Activation, w: Weight) -> Array:
    """Sorted cell boundaries: step GRID_STEP on [−INNER, INNER], TAIL_STEP beyond (inside the
    domain), the domain ends and every break of f′ and of w. Built from integers, so
    mirror-symmetric."""
    n = int(round(INNER / GRID_STEP))
    parts = [np.arange(-n, n + 1) / round(1.0 / GRID_STEP)]
    reach = max(-w.lo, w.hi)
    if reach > INNER:
        m_in, m_out = int(round(INNER / TAIL_STEP)), int(math.ceil(reach / TAIL_STEP))
        tail = np.arange(m_in + 1, m_out + 1) / round(1.0 / TAIL_STEP)
        parts += [-tail, tail]
    parts.append(np.array([w.lo, w.hi]))
    breaks = act.breaks + w.breaks
    parts.append(np.array([b for b in breaks if w.lo < b < w.hi], dtype=np.float64))
    nodes = np.unique(np.concatenate(parts))
    return nodes[(nodes >= w.lo) & (nodes <= w.hi)]


def _moment_integrands(pb: Problem, x: Array) -> Array:
    """(w, f′w, f′²w) at x, stacked on a new leading axis."""
    g = pb.act.derivative(x)
    w = pb.weight.pdf(x)
    gw = g * w
    return np.stack([w, gw, g * gw])


def _gl_moments(pb: Problem, a: Array, b: Array) -> Array:
    """∫_a^b (w, f′w, f′²w) by one 8-point Gauss–Legendre panel per (a, b) pair; shape (3,)+a.shape.
    Only valid when no break of f′ lies strictly inside (a, b)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    half = 0.5 * (b - a)
    x = (0.5 * (a + b))[..., None] + half[..., None] * _GL_X
    return (_moment_integrands(pb, x) @ _GL_W) * half


def _compensated_cumsum(v: Array) -> Array:
    """Running sums along the last axis with Neumaier compensation: each prefix is the correctly
    rounded (±1 ulp) sum, where np.cumsum drifts by ~n ulp (5e-12 at 100 after 3000 cells)."""
    out = np.empty_like(v)
    s = np.zeros(v.shape[:-1])
    c = np.zeros(v.shape[:-1])
    for k in range(v.shape[-1]):
        x = v[..., k]
        t = s + x
        c += np.where(np.abs(s) >= np.abs(x), (s - t) + x, (x - t) + s)
        s = t
        out[..., k] = s + c
    return out


@functools.lru_cache(maxsize=64)  # the op library's 14 × 2, and a few of a user's
def problem(act: ActLike, weight_name: WeightLike) -> Problem:
    """The precomputed quadrature for one (activation, weight) (cached)."""
    a, w = activation(act), weight(weight_name)
    nodes = quadrature_nodes(a, w)
    empty = Problem(a, w, nodes, np.zeros((3, 0)), np.zeros((3, 0)))
    cells = _gl_moments(empty, nodes[:-1], nodes[1:])
    zero = np.zeros((3, 1))
    prefix = np.concatenate([zero, _compensated_cumsum(cells)], axis=1)
    suffix = np.concatenate([_compensated_cumsum(cells[:, ::-1])[:, ::-1], zero], axis=1)
    return Problem(a, w, nodes, prefix, suffix)


def _cumulative(pb: Problem, x: Array) -> Tuple[Array, Array]:
    """Prefix ∫_lo^x and suffix ∫_x^hi of (w, f′w, f′²w) at arbitrary x in the domain."""
    x = np.asarray(x, dtype=np.float64)
    k = np.clip(np.searchsorted(pb.nodes, x, side="right") - 1, 0, len(pb.nodes) - 2)
    part = _gl_moments(pb, pb.nodes[k], x)
    return pb.prefix[:, k] + part, pb.suffix[:, k] - part


def _segment(pre_a: Array, suf_a: Array, pre_b: Array, suf_b: Array, a: Array) -> Array:
    """Moments over [a, b] from the cumulatives at a and b: prefix difference left of 0, suffix
    difference right of it (the smaller numbers, hence less cancellation)."""
    return np.where(np.asarray(a) < 0, pre_b - pre_a, suf_a - suf_b)


def _cost(m: Array) -> Array:
    """Segment cost c = F2 − F²/W (0 where W ≤ 0, i.e. a weightless segment)."""
    wm, fm, f2m = m
    ok = wm > 0
    return np.where(ok, f2m - fm * fm / np.where(ok, wm, 1.0), 0.0)


def _mean(pb: Problem, m: Array, a: Array, b: Array) -> Array:
    """Level = F/W (f′ at the midpoint where W ≤ 0)."""
    wm, fm, _ = m
    ok = wm > 0
    mid = pb.act.derivative(0.5 * (np.asarray(a) + np.asarray(b)))
    return np.where(ok, fm / np.where(ok, wm, 1.0), mid)


def _panels(pb: Problem, edges: Array, points: int = GL_POINTS) -> Tuple[Array, Array, Array]:
    """Composite Gauss–Legendre over [lo, hi] with panels = quadrature cells cut at the edges:
    returns nodes x (P, points), weights (P, points) and the interval index of each panel."""
    cuts = np.unique(np.concatenate([pb.nodes, edges[(edges > pb.lo) & (edges < pb.hi)]]))
    a, b = cuts[:-1], cuts[1:]
    gx, gw = np.polynomial.legendre.leggauss(points)
    half = 0.5 * (b - a)
    x = (0.5 * (a + b))[:, None] + half[:, None] * gx
    seg = np.searchsorted(edges, 0.5 * (a + b), side="left") - 1
    return x, half[:, None] * gw, seg


def _edges(pb: Problem, borders: Sequence[float]) -> Array:
    t = np.asarray(borders, dtype=np.float64)
    return np.concatenate([[pb.lo], t, [pb.hi]])


def _check_table_shape(edges: Array, levels: Optional[Array] = None) -> None:
    """edges = [lo, borders…, hi]: finite, strictly increasing; levels one per interval."""
    if edges.ndim != 1 or not np.all(np.isfinite(edges)) or np.any(np.diff(edges) <= 0):
        raise ValueError(f"borders must be finite, strictly increasing and inside the domain "
                         f"({edges[0]}, {edges[-1]}), got {edges[1:-1]}")
    if levels is not None and levels.shape != (len(edges) - 1,):
        raise ValueError(f"expected {len(edges) - 1} levels for {len(edges) - 2} borders, "
                         f"got {levels.shape}")


def optimal_levels(act: ActLike, weight_name: WeightLike, borders: Sequence[float],
                   points: int = GL_POINTS) -> Array:
    """Levels that minimise J for fixed borders: the weighted mean of f′ over each interval,
    by composite Gauss–Legendre (no prefix differences)."""
    pb = problem(act, weight_name)
    edges = _edges(pb, borders)
    _check_table_shape(edges)
    x, wts, seg = _panels(pb, edges, points)
    m = (_moment_integrands(pb, x) * wts).sum(axis=-1)
    k = len(edges) - 1
    sums = np.stack([np.bincount(seg, weights=m[i], minlength=k) for i in range(3)])
    return _mean(pb, sums, edges[:-1], edges[1:])


def objective(act: ActLike, weight_name: WeightLike, borders: Sequence[float], levels: Sequence[float],
              points: int = GL_POINTS) -> float:
    """J = ∫_D (f′ − q)² w for the table (borders, levels), by composite Gauss–Legendre with the
    integrand (f′ − L_i)² w (no cancellation). Interval i is (t_{i−1}, t_i]."""
    pb = problem(act, weight_name)
    edges = _edges(pb, borders)
    lv = np.asarray(levels, dtype=np.float64)
    _check_table_shape(edges, lv)
    x, wts, seg = _panels(pb, edges, points)
    r = pb.act.derivative(x) - lv[seg][:, None]
    return float(np.sum((r * r * pb.weight.pdf(x) * wts).sum(axis=-1)))


# ----------------------------------------------------------------------------------------------
# Global DP
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DPResult:
    """Candidate borders x (M+1 incl. domain ends), dp values and argmins per segment count."""

    x: Array
    dp: Array  # (kmax+1, M+1): dp[k, j] = best cost of k segments covering [x_0, x_j]
    arg: Array  # (kmax+1, M+1): the i attaining dp[k, j]


def _cost_matrix_t(pb: Problem, idx: Array, block: int = 256) -> Array:
    """T[j, i] = c(i, j) over candidate node indices idx (inf where i ≥ j)."""
    x = pb.nodes[idx]
    pre, suf = pb.prefix[:, idx], pb.suffix[:, idx]
    n = len(idx)
    out = np.empty((n, n))
    left = (x < 0)[None, :]
    cols = np.arange(n)
    for j0 in range(0, n, block):
        j1 = min(n, j0 + block)
        m = np.where(left, pre[:, j0:j1, None] - pre[:, None, :],
                     suf[:, None, :] - suf[:, j0:j1, None])
        c = _cost(m)
        c[cols[None, :] >= np.arange(j0, j1)[:, None]] = np.inf
        out[j0:j1] = c
    return out


@functools.lru_cache(maxsize=64)
def dp_solve(act: ActLike, weight_name: WeightLike,
             kmax: int = 2 ** MAX_BITS) -> DPResult:
    """Exact minimum over candidate borders of J with k = 1..kmax segments (cached)."""
    pb = problem(act, weight_name)
    lo, hi = max(-INNER, pb.lo), min(INNER, pb.hi)  # strictly inside: no empty end segment
    inner = np.nonzero((pb.nodes > lo) & (pb.nodes < hi))[0]
    idx = np.concatenate([[0], inner, [len(pb.nodes) - 1]])
    t = _cost_matrix_t(pb, idx)
    n = len(idx)
    dp = np.full((kmax + 1, n), np.inf)
    arg = np.zeros((kmax + 1, n), dtype=np.int64)
    dp[1] = t[:, 0]
    rows = np.arange(n)
    for k in range(2, kmax + 1):
        tot = dp[k - 1][None, :] + t
        arg[k] = np.argmin(tot, axis=1)
        dp[k] = tot[rows, arg[k]]
    return DPResult(pb.nodes[idx], dp, arg)


def dp_borders(act: ActLike, weight_name: WeightLike, bits: int) -> Array:
    """Inner borders of the DP optimum for K = 2**bits levels (backtracked)."""
    res = dp_solve(act, weight_name)
    k = 2 ** bits
    j = len(res.x) - 1
    out: List[int] = []
    for level in range(k, 1, -1):
        j = int(res.arg[level, j])
        out.append(j)
    return res.x[np.array(out[::-1], dtype=np.int64)]


# ----------------------------------------------------------------------------------------------
# Continuous refinement
# ----------------------------------------------------------------------------------------------


def _gap(x: Array) -> Array:
    return MIN_GAP * np.maximum(1.0, np.abs(x))


@dataclass
class _Profile:
    """J(t) with optimal levels, and the per-border quantities of its gradient and Hessian."""

    J: float
    levels: Array
    mass: Array
    grad: Array


def _profile(pb: Problem, t: Array) -> _Profile:
    e = np.concatenate([[pb.lo], t, [pb.hi]])
    pre, suf = _cumulative(pb, e)
    m = _segment(pre[:, :-1], suf[:, :-1], pre[:, 1:], suf[:, 1:], e[:-1])
    lv = _mean(pb, m, e[:-1], e[1:])
    g = pb.act.derivative(t)
    w = pb.weight.pdf(t)
    a, b = g - lv[:-1], g - lv[1:]
    return _Profile(float(np.sum(_cost(m))), lv, m[0], w * (a * a - b * b))


def _hessian(pb: Problem, t: Array, prof: _Profile) -> Array:
    """Analytic Hessian of J(t) (levels optimal), tridiagonal; f″ by central differences."""
    g = pb.act.derivative(t)
    h = 1e-5 * np.maximum(1.0, np.abs(t))
    gd = (pb.act.derivative(t + h) - pb.act.derivative(t - h)) / (2 * h)
    w, wd = pb.weight.pdf(t), pb.weight.pdf_d(t)
    lv, ms = prof.levels, np.maximum(prof.mass, np.finfo(float).tiny)
    a, b = g - lv[:-1], g - lv[1:]
    n = len(t)
    hess = np.zeros((n, n))
    hess[np.arange(n), np.arange(n)] = (wd * (a * a - b * b) + 2 * w * gd * (a - b)
                                        - 2 * w * w * (a * a / ms[:-1] + b * b / ms[1:]))
    if n > 1:
        # segment i+1 = (t_i, t_{i+1}]: 2 w(t_i) w(t_{i+1}) (g(t_i) − L)(g(t_{i+1}) − L) / W
        off = 2 * w[:-1] * w[1:] * (g[:-1] - lv[1:-1]) * (g[1:] - lv[1:-1]) / ms[1:-1]
        hess[np.arange(n - 1), np.arange(1, n)] = off
        hess[np.arange(1, n), np.arange(n - 1)] = off
    return hess


def _local_eval(pb: Problem, x: Array, ca: Tuple[Array, Array], cb: Tuple[Array, Array],
                a: Array, b: Array) -> Tuple[Array, Array]:
    """For border positions x (shape (B, P)) between fixed neighbours a, b (shape (B,)):
    the local cost h = c(a, x) + c(x, b) and its derivative h′(x)."""
    pre_x, suf_x = _cumulative(pb, x)
    pa, sa = ca[0][:, :, None], ca[1][:, :, None]
    pbb, sb = cb[0][:, :, None], cb[1][:, :, None]
    ml = _segment(pa, sa, pre_x, suf_x, np.broadcast_to(a[:, None], x.shape))
    mr = _segment(pre_x, suf_x, pbb, sb, x)
    ll = _mean(pb, ml, a[:, None], x)
    lr = _mean(pb, mr, x, b[:, None])
    g = pb.act.derivative(x)
    hp = pb.weight.pdf(x) * (lr - ll) * (2 * g - ll - lr)
    return _cost(ml) + _cost(mr), hp


_PROBES = 1e-9 * 2.0 ** np.arange(38)  # step-out distances, 1e-9 … 1.4e2


def _coordinate_step(pb: Problem, t: Array, which: Array) -> Tuple[Array, int]:
    """Move the borders t[which] (pairwise non-adjacent) each to the first local minimum of J
    along its descent direction, neighbours fixed. Returns new borders and #collisions."""
    e = np.concatenate([[pb.lo], t, [pb.hi]])
    a, b, x0 = e[which], e[which + 2], t[which]
    lo_b, hi_b = a + _gap(a), b - _gap(b)
    ca, cb = _cumulative(pb, a), _cumulative(pb, b)
    h0, d0 = _local_eval(pb, x0[:, None], ca, cb, a, b)
    h0, d0 = h0[:, 0], d0[:, 0]
    s = -np.sign(d0)
    probes = np.clip(x0[:, None] + s[:, None] * _PROBES[None, :], lo_b[:, None], hi_b[:, None])
    _, dp = _local_eval(pb, probes, ca, cb, a, b)
    crossed = s[:, None] * dp >= 0
    first = np.where(crossed.any(axis=1), crossed.argmax(axis=1), -1)
    rows = np.arange(len(which))
    u = np.where(first > 0, probes[rows, np.maximum(first - 1, 0)], x0)
    v = np.where(first >= 0, probes[rows, np.maximum(first, 0)], probes[:, -1])
    active = (first >= 0) & (s != 0)
    for _ in range(80):  # bisection: s·h′(u) < 0 ≤ s·h′(v)
        mid = 0.5 * (u + v)
        if not np.any(active & (mid != u) & (mid != v)):
            break
        _, dm = _local_eval(pb, mid[:, None], ca, cb, a, b)
        right = s * dm[:, 0] < 0
        u = np.where(active & right, mid, u)
        v = np.where(active & ~right, mid, v)
    cand = np.where(active, 0.5 * (u + v), v)
    cand = np.where(s == 0, x0, cand)
    h1, _ = _local_eval(pb, cand[:, None], ca, cb, a, b)
    keep = h1[:, 0] <= h0
    out = t.copy()
    out[which] = np.where(keep, cand, x0)
    collided = int(np.sum(keep & (s != 0) & (first < 0)))
    return out, collided


def _sweep(pb: Problem, t: Array) -> Tuple[Array, int]:
    """One Lloyd–Max-style block coordinate sweep: even borders, then odd borders."""
    n = len(t)
    col = 0
    for parity in (0, 1):
        which = np.arange(parity, n, 2)
        if len(which):
            t, c = _coordinate_step(pb, t, which)
            col += c
    return t, col


def _pinned(pb: Problem, t: Array) -> Array:
    """Borders sitting on a jump of f′ where the one-sided gradients bracket 0 (a kink optimum):
    snaps them exactly onto the jump (in place) and returns the mask."""
    pin = np.zeros(len(t), dtype=bool)
    for xb in pb.act.jumps:
        near = np.nonzero(np.abs(t - xb) <= 1e-9 * max(1.0, abs(xb)))[0]
        for i in near:
            trial = t.copy()
            trial[i] = xb
            prof = _profile(pb, trial)
            lv, w = prof.levels, pb.weight.pdf(np.array([xb]))[0]
            gl = pb.act.derivative(np.array([np.nextafter(xb, -np.inf)]))[0]
            gr = pb.act.derivative(np.array([np.nextafter(xb, np.inf)]))[0]
            d_left = w * ((gl - lv[i]) ** 2 - (gl - lv[i + 1]) ** 2)
            d_right = w * ((gr - lv[i]) ** 2 - (gr - lv[i + 1]) ** 2)
            if d_left <= 0 <= d_right:
                t[i] = xb
                pin[i] = True
    return pin


def _ordered(pb: Problem, t: Array) -> bool:
    e = np.concatenate([[pb.lo], t, [pb.hi]])
    return bool(np.all(np.diff(e) >= np.minimum(_gap(e[:-1]), _gap(e[1:]))))


def _newton(pb: Problem, t: Array, free: Array, iters: int = 60) -> Array:
    """Levenberg–Marquardt-safeguarded Newton on the free borders; never increases J beyond
    rounding noise, never breaks the ordering."""
    if not np.any(free):
        return t
    f_idx = np.nonzero(free)[0]
    noise = 64 * np.finfo(float).eps * float(abs(pb.prefix[2, -1]) + abs(pb.prefix[1, -1]))
    lam = 0.0
    prof = _profile(pb, t)
    for _ in range(iters):
        hess = _hessian(pb, t, prof)[np.ix_(f_idx, f_idx)]
        grad = prof.grad[f_idx]
        scale = np.maximum(np.abs(np.diag(hess)), 1e-30)
        accepted = False
        for _ in range(30):
            m = hess + lam * np.diag(scale)
            try:
                np.linalg.cholesky(m)
                step = np.linalg.solve(m, -grad)
            except np.linalg.LinAlgError:
                lam = max(lam * 10.0, 1e-6)
                continue
            trial = t.copy()
            trial[f_idx] += step
            if _ordered(pb, trial):
                p_new = _profile(pb, trial)
                if p_new.J <= prof.J + noise:
                    accepted = True
                    break
            lam = max(lam * 10.0, 1e-6)
        if not accepted:
            break
        small = np.all(np.abs(step) <= 1e-13 * np.maximum(1.0, np.abs(t[f_idx])))
        t, prof = trial, p_new
        lam = lam / 10.0 if lam > 1e-6 else 0.0
        if small:
            break
    return t


@dataclass(frozen=True)
class Table:
    """A k-bit derivative table: inner borders, levels (interval means) and its error J."""

    borders: Tuple[float, ...]
    levels: Tuple[float, ...]
    J: float


@dataclass(frozen=True)
class SolveInfo:
    """Diagnostics of one solve."""

    J_dp: float
    cycles: int
    sweeps: int
    collisions: int
    pinned: Tuple[float, ...]
    mirrored: bool
    kept_dp: bool


@dataclass(frozen=True)
class RefineInfo:
    """What the refinement did: cycles of (3 sweeps, pinning, Newton), collisions, pins."""

    cycles: int
    sweeps: int
    collisions: int
    pinned: Tuple[float, ...]


def refine(act: ActLike, weight_name: WeightLike, borders: Sequence[float],
           max_cycles: int = 40) -> Tuple[Array, RefineInfo]:
    """Continuous refinement of borders (levels always optimal) to |ΔJ| < J_TOL per cycle."""
    pb = problem(act, weight_name)
    t = np.array(borders, dtype=np.float64)
    j_prev = _profile(pb, t).J
    sweeps = collisions = cycles = 0
    pin = np.zeros(len(t), dtype=bool)
    for cycles in range(1, max_cycles + 1):
        for _ in range(3):
            t_new, c = _sweep(pb, t)
            sweeps += 1
            collisions += c
            t = np.where(pin, t, t_new)
        pin = _pinned(pb, t)
        t = _newton(pb, t, ~pin)
        j = _profile(pb, t).J
        if abs(j_prev - j) < J_TOL:
            break
        j_prev = j
    return t, RefineInfo(cycles, sweeps, collisions, tuple(float(x) for x in t[pin]))


def mirror_table(act: ActLike, borders: Sequence[float], levels: Sequence[float]
                 ) -> Tuple[Array, Array]:
    """The mirror t_i → −t_{K−2−i}, L_i → c + s·L_{K−1−i} for f′(−x) = c + s·f′(x)."""
    m = activation(act).mirror
    if m is None:
        raise ValueError(f"{act} has no mirror symmetry")
    s, c = m
    t = -np.asarray(borders, dtype=np.float64)[::-1]
    lv = c + s * np.asarray(levels, dtype=np.float64)[::-1]
    return t + 0.0, lv + 0.0  # + 0.0 turns −0.0 into 0.0


def _check_bits(bits: int) -> None:
    if not (isinstance(bits, (int, np.integer)) and 1 <= bits <= MAX_BITS):
        raise ValueError(f"bits must be an integer in [1, {MAX_BITS}], got {bits!r}")


def solve_with_info(act: ActLike, bits: int, weight_name: WeightLike) -> Tuple[Table, SolveInfo]:
    """Global DP, then refinement; returns the table and diagnostics."""
    _check_bits(bits)
    t_dp = dp_borders(act, weight_name, bits)
    l_dp = optimal_levels(act, weight_name, t_dp)
    j_dp = objective(act, weight_name, t_dp, l_dp)
    t, info = refine(act, weight_name, t_dp)
    lv = optimal_levels(act, weight_name, t)
    j = objective(act, weight_name, t, lv)
    kept_dp = not j <= j_dp
    if kept_dp:
        t, lv, j = t_dp, l_dp, j_dp
    mirrored = False
    if activation(act).mirror is not None:
        mt, _ = mirror_table(act, t, lv)
        if np.max(np.abs(mt - t)) > 1e-9 and np.sum(mt) < np.sum(t):
            ml = optimal_levels(act, weight_name, mt)
            mj = objective(act, weight_name, mt, ml)
            if mj <= j * (1 + MIRROR_RTOL):
                t, lv, j, mirrored = mt, ml, mj, True
    # + 0.0 turns a −0.0 into 0.0 (same code for every x) and changes nothing else.
    table = Table(tuple(float(x) + 0.0 for x in t), tuple(float(x) + 0.0 for x in lv), float(j))
    return table, SolveInfo(j_dp, info.cycles, info.sweeps, info.collisions, info.pinned,
                            mirrored, kept_dp)


def solve(act: ActLike, bits: int, weight_name: WeightLike) -> Table:
    """The (near-)global optimum k-bit table for activation ``act`` under weighting
    ``weight_name`` ("normal" or "uniform")."""
    return solve_with_info(act, bits, weight_name)[0]


# ----------------------------------------------------------------------------------------------
# Self-checks
# ----------------------------------------------------------------------------------------------


def derivative_fd_error(act: ActLike) -> float:
    """Max |f′ − FD(f)| / (1 + |f′|) over [−30, 30] (away from breaks), 4-point central
    differences with h = 1e-3 (truncation O(h⁴), rounding ~1e-13)."""
    a = activation(act)
    x = np.linspace(-30.0, 30.0, 6001) + 0.0013
    for b in a.breaks:
        x = x[np.abs(x - b) > 0.01]
    h = 1e-3
    fd = (8 * (a.forward(x + h) - a.forward(x - h)) - (a.forward(x + 2 * h) - a.forward(x - 2 * h))
          ) / (12 * h)
    d = a.derivative(x)
    return float(np.max(np.abs(d - fd) / (1.0 + np.abs(d))))


def self_check(acts: Sequence[str], weights: Sequence[str]) -> List[str]:
    """Derivative, quadrature and mirror checks; returns a list of failures (empty = pass)."""
    errors: List[str] = []
    for act in acts:
        err = derivative_fd_error(act)
        if err > 1e-9:
            errors.append(f"{act}: f′ differs from finite differences of f by {err:.3g}")
        for wn in weights:
            t = dp_borders(act, wn, 3)
            lv = optimal_levels(act, wn, t)
            j8 = objective(act, wn, t, lv)
            j16 = objective(act, wn, t, lv, points=16)
            l16 = optimal_levels(act, wn, t, points=16)
            if abs(j8 - j16) > 1e-12 * max(j16, 1e-300) or np.max(np.abs(lv - l16)) > 1e-13:
                errors.append(f"{act}/{wn}: 8- and 16-point quadrature disagree "
                              f"(J {j8!r} vs {j16!r})")
            if activation(act).mirror is not None:
                mt, ml = mirror_table(act, t, lv)
                jm = objective(act, wn, mt, ml)
                if abs(jm - j8) > 1e-9 * j8:
                    errors.append(f"{act}/{wn}: mirror J {jm!r} != J {j8!r}")
    return errors


def validate_table(act: ActLike, weight_name: WeightLike, table: Table) -> List[str]:
    """Checks a solved table: fp32-strict borders inside the domain, levels = interval means,
    J reproduced, J not above the DP optimum."""
    errors: List[str] = []
    t = np.array(table.borders)
    t32 = t.astype(np.float32)
    w = weight(weight_name)
    if np.any(np.diff(t32) <= 0) or not (w.lo < t[0] and t[-1] < w.hi):
        errors.append(f"{act}/{weight_name}: borders not strictly increasing in fp32")
    lv = optimal_levels(act, weight_name, t)
    if not np.array_equal(lv, np.array(table.levels)):
        errors.append(f"{act}/{weight_name}: levels are not the interval means")
    if objective(act, weight_name, t, lv) != table.J:
        errors.append(f"{act}/{weight_name}: J does not reproduce")
    return errors


def mlir_float(v: float) -> str:
    """repr() of the float64, with '.0' inserted where repr has no '.' (MLIR lexes '1e-05' as an
    integer followed by garbage; '1.0e-05' is the same value)."""
    s = repr(float(v))
    if not np.isfinite(v):
        raise ValueError(f"non-finite table value {v}")
    if "." not in s:
        s = s.replace("e", ".0e") if "e" in s else s + ".0"
    return s
