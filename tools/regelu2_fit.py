#!/usr/bin/env python3
"""Fits ReGELU2-style 2-bit derivative tables: the derivative of three shifted ReLUs.

LowMemoryBP's ReGELU2 / ReSiLU2 replace the backward of an activation h by the derivative of a
surrogate forward

    ĥ(x) = Σ_{i=1..3} a_i·max(x − c_i, 0),   c1 < c2 < c3,

constrained by Σa_i = 1 (ĥ = x right of c3) and Σa_i·c_i = 0 (ĥ = 0 left of c1). Backward is then
the 4-level step ĥ′: code(x) = #{i : c_i < x}, dx = L[code]·dy with L = (0, a1, a1 + a2, 1), i.e.
FewBit's bucket rule with borders (c1, c2, c3), stored as 2-bit codes.

**Criterion** (the one the published ReGELU2/ReSiLU2 constants were fitted by): the *primitive*
error, not the pointwise derivative error,

    E(c, a) = ∫_{−T}^{T} (h(x) − ĥ(x))² dx,

on the domain truncated at T, the point beyond which |h − relu| < 1e-8 (for these activations
h − relu is even and decays monotonically there, so T solves |h(T) − relu(T)| = 1e-8). Outside
[c1, c3] the surrogate is exactly relu, so the truncation changes E by less than 1e-15.

**Parametrisation.** Under the two constraints ĥ is the continuous piecewise-linear function that is
0 left of c1, x right of c3, and interpolates the nodes (c1, 0), (c2, y2), (c3, c3), where
y2 = ĥ(c2) is the only free value: a1 = y2/(c2 − c1), a1 + a2 = (c3 − y2)/(c3 − c2) and
a3 = 1 − (a1 + a2). For fixed borders E is a quadratic in y2, so the optimal y2 is closed-form and
the search is over the three borders only.

**Method** (fp64, numpy only, deterministic; the solver does not force symmetry):

1. *Global grid search.* Candidate borders on the grid z_k = k·0.1, |z_k| ≤ min(T, 8)
   (c1 ≤ 0 ≤ c3; every optimum here lies well inside). With every kink of ĥ − relu (c1, c2, c3,
   0) on the grid, ĥ − relu = Σ_k w_k ψ_k in the hat basis ψ_k of the grid, so
   E = ∫ g² − 2 βᵀw + wᵀMw exactly, with g = h − relu, β_k = ∫ g ψ_k (8-point Gauss–Legendre per
   grid cell) and M the tridiagonal mass matrix. Every triple is evaluated (vectorised, with its
   optimal y2); the lowest E wins (ties: the first in lexicographic order).
2. *Newton refinement* of the continuous borders from the grid optimum. E and its gradient
   dE/dc_i = −2∫ (h − ĥ)·∂ĥ/∂c_i (y2 held at its optimum: envelope theorem) by composite
   8-point Gauss–Legendre on 0.01 cells cut at c1, c2, c3 and 0; the Hessian by central
   differences of the gradient (step 1e-5). A step is halved until E does not increase or the
   gradient shrinks; iteration stops when a step moves the borders by < 1e-13. The refined table
   is kept only if its E does not exceed the grid optimum's.

For the erf GELU and SiLU this reproduces LowMemoryBP's published ReGELU2/ReSiLU2 constants (found
there by simulated annealing) to about 1e-2 in the borders and 1e-3 in the levels, at an E no
larger than theirs (tests/python/test_regelu2_fit.py checks both); so the same criterion gives the
tanh-form table that ``ops/lowmembp/regelu2_tanh.mlir`` ships.

Usage::

    /usr/bin/python3 tools/regelu2_fit.py [--activation gelu_tanh] [--write-ops] [--check]

Without options it prints the fitted table (borders, a, levels, E) as JSON. ``--write-ops``
rewrites the block between ``// BEGIN GENERATED TABLE`` and ``// END GENERATED TABLE`` in
ops/lowmembp/regelu2_tanh.mlir (the only operator whose table comes from this tool: ReGELU2 and
ReSiLU2 keep LowMemoryBP's published constants). ``--check`` compares that block with a fresh fit
instead of writing (exit status 1 on a difference; numbers to 1e-9 relative + 1e-10 absolute, as
tools/fewbit_solver.py --check).
"""

from __future__ import annotations

import os

# Single-threaded on purpose, like tools/fewbit_solver.py.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fewbit_solver as fs  # noqa: E402

Array = np.ndarray

REPO_ROOT = Path(__file__).resolve().parent.parent
OPS_FILE = "ops/lowmembp/regelu2_tanh.mlir"
OPS_ACTIVATION = "gelu_tanh"  # the activation whose table OPS_FILE holds
OPS_ALIAS = "regelu2_tanh"  # the #alias of that table in OPS_FILE
REGENERATE_COMMAND = "/usr/bin/python3 tools/regelu2_fit.py --write-ops"
BEGIN_MARKER = "// BEGIN GENERATED TABLE"
END_MARKER = "// END GENERATED TABLE"

TAIL_TOL = 1e-8  # the domain ends where |h − relu| drops below this
SEARCH_STEP = 0.1  # grid of candidate borders (step 1)
SEARCH_MAX = 8.0  # candidate borders satisfy |c| ≤ min(T, SEARCH_MAX)
QUAD_STEP = 0.01  # quadrature cells of the refinement (step 2)
FD_STEP = 1e-5  # central-difference step of the Hessian
STEP_TOL = 1e-13  # refinement stops when a Newton step moves the borders by less
MAX_NEWTON = 60
CHUNK = 4096  # grid triples evaluated at once

#: Activations the tool fits: the erf GELU and SiLU (to check against the published ReGELU2 and
#: ReSiLU2 constants) and the tanh-form GELU (the shipped regelu2_tanh table).
ACTIVATIONS = ("gelu", "gelu_tanh", "silu")

_GL_X, _GL_W = np.polynomial.legendre.leggauss(8)


@dataclass(frozen=True)
class Fit:
    """A fitted surrogate: borders c1 < c2 < c3, slopes a (Σa = 1, Σa·c = 0), the 4 derivative
    levels (0, a1, a1 + a2, 1) indexed by the 2-bit code, the primitive error E, the domain end
    T and the grid optimum's E (before refinement)."""

    activation: str
    borders: Tuple[float, float, float]
    a: Tuple[float, float, float]
    levels: Tuple[float, float, float, float]
    E: float
    T: float
    E_grid: float


def _forward(act: str) -> Callable[[Array], Array]:
    if act not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {act!r}")
    return fs.activation(act).forward


def _g(act: str, x: Array) -> Array:
    """g = h − relu (even and decaying for GELU, tanh-form GELU and SiLU)."""
    x = np.asarray(x, dtype=np.float64)
    return _forward(act)(x) - np.maximum(x, 0.0)


@functools.lru_cache(maxsize=None)
def domain_end(act: str) -> float:
    """T > 0 with |h(±T) − relu(±T)| = TAIL_TOL (bisection on the decaying tail, to 1e-12)."""
    lo, hi = 1.0, 100.0
    if not (abs(_g(act, np.array(lo))) > TAIL_TOL > abs(_g(act, np.array(hi)))):
        raise ValueError(f"{act}: |h − relu| does not cross {TAIL_TOL} on [{lo}, {hi}]")
    while hi - lo > 1e-12:
        mid = 0.5 * (lo + hi)
        if abs(_g(act, np.array(mid))) > TAIL_TOL:
            lo = mid
        else:
            hi = mid
    return hi


def _gl(a: Array, b: Array) -> Tuple[Array, Array]:
    """Gauss–Legendre nodes (P, 8) and weights (P, 8) of the panels [a_p, b_p]."""
    half = 0.5 * (b - a)
    return (0.5 * (a + b))[:, None] + half[:, None] * _GL_X, half[:, None] * _GL_W


# ----------------------------------------------------------------------------------------------
# Step 1: the grid search
# ----------------------------------------------------------------------------------------------


def _grid(act: str) -> Tuple[Array, Array, float, float]:
    """Candidate nodes z, β_k = ∫ g ψ_k, ∫_{−T}^{T} g², and the grid step."""
    t = domain_end(act)
    n = int(np.floor(min(t, SEARCH_MAX) / SEARCH_STEP))
    z = np.arange(-n, n + 1) * SEARCH_STEP
    # β_k = ∫ g ψ_k over the two cells around z_k (ψ_k is linear on each).
    x, w = _gl(z[:-1], z[1:])
    gx = _g(act, x)
    left_cell = ((gx * (x - z[:-1, None]) / SEARCH_STEP) * w).sum(axis=1)  # ψ_{k+1} on cell k
    right_cell = ((gx * (z[1:, None] - x) / SEARCH_STEP) * w).sum(axis=1)  # ψ_k on cell k
    beta = np.zeros_like(z)
    beta[1:] += left_cell
    beta[:-1] += right_cell
    # ∫ g² over the whole domain [−T, T], on QUAD_STEP cells.
    m = int(np.ceil(t / QUAD_STEP))
    edges = np.unique(np.concatenate([np.arange(-m, m + 1) * QUAD_STEP, [-t, t]]))
    edges = edges[(edges >= -t) & (edges <= t)]
    x, w = _gl(edges[:-1], edges[1:])
    g2 = float(((_g(act, x) ** 2) * w).sum())
    return z, beta, g2, SEARCH_STEP


def _mass(v: Array, step: float) -> Array:
    """M·v for the hat-basis mass matrix (step/6)·tridiag(1, 4, 1), along the last axis."""
    out = 4.0 * v
    out[..., 1:] += v[..., :-1]
    out[..., :-1] += v[..., 1:]
    return out * (step / 6.0)


def grid_search(act: str) -> Tuple[Tuple[float, float, float], float]:
    """The grid triple (c1 ≤ 0 ≤ c3, c1 < c2 < c3) of least E, with that E."""
    z, beta, g2, step = _grid(act)
    relu = np.maximum(z, 0.0)
    zero = int(np.argmin(np.abs(z)))
    best = (np.inf, (0, 0, 0))
    for i1 in range(0, zero + 1):
        # All (i2, i3) with i1 < i2 < i3 and i3 ≥ zero, as flat arrays.
        i2, i3 = np.meshgrid(np.arange(i1 + 1, len(z)), np.arange(max(zero, i1 + 2), len(z)),
                             indexing="ij")
        keep = i2 < i3
        for start in range(0, int(keep.sum()), CHUNK):
            j2, j3 = i2[keep][start:start + CHUNK], i3[keep][start:start + CHUNK]
            e, k = _grid_chunk(z, beta, g2, step, relu, i1, j2, j3)
            if e < best[0]:
                best = (e, (i1, int(j2[k]), int(j3[k])))
    e, (i1, i2, i3) = best
    return (float(z[i1]), float(z[i2]), float(z[i3])), e


def _grid_chunk(z: Array, beta: Array, g2: float, step: float, relu: Array, i1: int, i2: Array,
                i3: Array) -> Tuple[float, int]:
    """E (optimal y2) of the triples (i1, i2[j], i3[j]): the least one and its index j."""
    c1, c2, c3 = z[i1], z[i2][:, None], z[i3][:, None]
    # ĥ0: ĥ with y2 = 0 (0 up to c2, then linear to (c3, c3), then x); φ: the hat at c2.
    up = (z - c2) / (c3 - c2)
    h0 = np.where(z <= c2, 0.0, np.where(z < c3, c3 * up, z))
    phi = np.where((z > c1) & (z <= c2), (z - c1) / (c2 - c1),
                   np.where((z > c2) & (z < c3), 1.0 - up, 0.0))
    w0 = h0 - relu
    w0[:, : i1 + 1] = 0.0  # left of c1: ĥ = 0 = relu (c1 ≤ 0)
    m_phi = _mass(phi, step)
    y2 = (phi @ beta - (m_phi * w0).sum(axis=1)) / (m_phi * phi).sum(axis=1)
    w = w0 + y2[:, None] * phi
    e = g2 - 2.0 * (w @ beta) + (_mass(w, step) * w).sum(axis=1)
    k = int(np.argmin(e))
    return float(e[k]), k


# ----------------------------------------------------------------------------------------------
# Step 2: continuous refinement
# ----------------------------------------------------------------------------------------------


def _panels(act: str, c: Sequence[float]) -> Tuple[Array, Array]:
    t = domain_end(act)
    m = int(np.ceil(t / QUAD_STEP))
    edges = np.concatenate([np.arange(-m, m + 1) * QUAD_STEP, [-t, t, 0.0], np.asarray(c)])
    edges = np.unique(edges[(edges >= -t) & (edges <= t)])
    return _gl(edges[:-1], edges[1:])


def _surrogate(x: Array, c: Sequence[float], y2: float) -> Array:
    """ĥ at x: 0 left of c1, x right of c3, linear through (c1, 0), (c2, y2), (c3, c3)."""
    c1, c2, c3 = c
    return np.where(x >= c3, x, np.interp(x, [c1, c2, c3], [0.0, y2, c3], left=0.0))


def optimal_y2(act: str, c: Sequence[float]) -> float:
    """The y2 = ĥ(c2) minimising E for borders c: ∫(h − ĥ0)φ / ∫φ², ∫φ² = (c3 − c1)/3."""
    c1, c2, c3 = c
    x, w = _panels(act, c)
    phi = np.interp(x, [c1, c2, c3], [0.0, 1.0, 0.0], left=0.0, right=0.0)
    h = _forward(act)(x)
    return float(((h - _surrogate(x, c, 0.0)) * phi * w).sum() / ((c3 - c1) / 3.0))


def primitive_error(act: str, c: Sequence[float], a: Optional[Sequence[float]] = None) -> float:
    """E = ∫_{−T}^{T} (h − ĥ)² for borders c and slopes a (default: the optimal ones)."""
    c1, c2, c3 = (float(v) for v in c)
    x, w = _panels(act, (c1, c2, c3))
    if a is None:
        hs = _surrogate(x, (c1, c2, c3), optimal_y2(act, (c1, c2, c3)))
    else:
        hs = sum(ai * np.maximum(x - ci, 0.0) for ai, ci in zip(a, (c1, c2, c3)))
    return float((((_forward(act)(x) - hs) ** 2) * w).sum())


def gradient(act: str, c: Sequence[float]) -> Array:
    """dE/dc at the optimal y2 (envelope theorem): −2∫(h − ĥ)·∂ĥ/∂c_i."""
    c1, c2, c3 = c
    y2 = optimal_y2(act, c)
    x, w = _panels(act, c)
    e = (_forward(act)(x) - _surrogate(x, c, y2)) * w
    s1, s2 = y2 / (c2 - c1), (c3 - y2) / (c3 - c2)
    left = (x > c1) & (x < c2)
    right = (x > c2) & (x < c3)
    d1 = np.where(left, -s1 * (c2 - x) / (c2 - c1), 0.0)
    d2 = (np.where(left, -s1 * (x - c1) / (c2 - c1), 0.0)
          + np.where(right, -s2 * (c3 - x) / (c3 - c2), 0.0))
    d3 = np.where(right, (1.0 - s2) * (x - c2) / (c3 - c2), 0.0)
    return np.array([-2.0 * float((e * d).sum()) for d in (d1, d2, d3)])


def refine(act: str, c0: Sequence[float]) -> Tuple[float, float, float]:
    """Damped Newton on dE/dc = 0 from c0 (Hessian by central differences of the gradient)."""
    c = np.array(c0, dtype=np.float64)
    e, g = primitive_error(act, c), gradient(act, c)
    for _ in range(MAX_NEWTON):
        hess = np.empty((3, 3))
        for j in range(3):
            dc = np.zeros(3)
            dc[j] = FD_STEP
            hess[:, j] = (gradient(act, c + dc) - gradient(act, c - dc)) / (2 * FD_STEP)
        hess = 0.5 * (hess + hess.T)
        try:
            step = -np.linalg.solve(hess, g)
        except np.linalg.LinAlgError:
            break
        if not np.all(np.linalg.eigvalsh(hess) > 0):
            step = -g * (FD_STEP / max(np.max(np.abs(g)), 1e-300))  # not convex here: descend
        accepted = False
        for _halving in range(40):
            cn = c + step
            if cn[0] < cn[1] < cn[2]:
                en, gn = primitive_error(act, cn), gradient(act, cn)
                if en <= e or np.linalg.norm(gn) < np.linalg.norm(g):
                    accepted = True
                    break
            step = step / 2
        if not accepted:
            break
        moved = float(np.max(np.abs(cn - c)))
        c, e, g = cn, en, gn
        if moved < STEP_TOL:
            break
    return (float(c[0]), float(c[1]), float(c[2]))


def table_from(c: Sequence[float], y2: float) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Slopes a and levels (0, a1, a1 + a2, 1) of the surrogate through (c1, 0), (c2, y2),
    (c3, c3)."""
    c1, c2, c3 = c
    a1 = y2 / (c2 - c1)
    l2 = (c3 - y2) / (c3 - c2)
    return (a1, l2 - a1, 1.0 - l2), (0.0, a1, l2, 1.0)


@functools.lru_cache(maxsize=None)
def fit(act: str) -> Fit:
    """The fitted 2-bit table of ``act`` ("gelu", "gelu_tanh" or "silu")."""
    c_grid, _ = grid_search(act)
    e_grid = primitive_error(act, c_grid)  # accurate quadrature, as for the refined table
    c = refine(act, c_grid)
    e = primitive_error(act, c)
    if not e <= e_grid:
        c, e = c_grid, e_grid
    a, levels = table_from(c, optimal_y2(act, c))
    # + 0.0 turns a −0.0 into 0.0.
    return Fit(act, tuple(v + 0.0 for v in c), tuple(v + 0.0 for v in a),
               tuple(v + 0.0 for v in levels), e, domain_end(act), e_grid)


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def generated_block(f: Fit) -> List[str]:
    """The lines between the markers of OPS_FILE."""
    b = ", ".join(fs.mlir_float(v) for v in f.borders)
    lv = ", ".join(fs.mlir_float(v) for v in f.levels)
    a = ", ".join(repr(v) for v in f.a)
    return [f"// regenerate: {REGENERATE_COMMAND}",
            f"// a = [{a}], E = {f.E!r} on [-T, T], T = {f.T!r}",
            f"#{OPS_ALIAS} = #abp.buckets<borders = [{b}], levels = [{lv}]>"]


def rewrite_ops_text(text: str, block: List[str], path: str) -> str:
    """The solver's marker rewrite with this tool's markers; ValueError without exactly one pair."""
    return fs.rewrite_ops_text(text, block, path, BEGIN_MARKER, END_MARKER)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--activation", default=OPS_ACTIVATION, choices=ACTIVATIONS)
    p.add_argument("--write-ops", action="store_true",
                   help=f"rewrite the table block of {OPS_FILE}")
    p.add_argument("--check", action="store_true",
                   help=f"compare the table block of {OPS_FILE} with a fresh fit; writes nothing")
    args = p.parse_args(argv)
    if (args.write_ops or args.check) and args.activation != OPS_ACTIVATION:
        print(f"error: {OPS_FILE} holds the {OPS_ACTIVATION} table", file=sys.stderr)
        return 2
    f = fit(args.activation)
    print(json.dumps({"activation": f.activation, "borders": f.borders, "a": f.a,
                      "levels": f.levels, "E": f.E, "E_grid": f.E_grid, "T": f.T}, indent=2))
    if not (args.write_ops or args.check):
        return 0
    path = REPO_ROOT / OPS_FILE
    new = rewrite_ops_text(path.read_text(), generated_block(f), str(path))
    if args.check:
        if not fs.equivalent(path.read_text(), new):
            print(f"FAIL: {path} is not up to date (regenerate with {REGENERATE_COMMAND})",
                  file=sys.stderr)
            return 1
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
