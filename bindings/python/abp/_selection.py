"""Row-selection plans for the sampling methods (docs/algorithms.md §3, §7, §8).

The samplers of abp (VCAS, WTA-CRS, uniform and norm-proportional column-row sampling) all reduce to
the same question: given one score or probability per row (a token or a sample), which rows are kept
and by how much is each kept row multiplied so that the kept sum stays an unbiased estimate of the
full sum Σ_i A_i? This module answers it in plain PyTorch (CPU or CUDA tensors, torch >= 1.13). The
sampled linear layers use `plan_slots`: k slots (row, weight) made on the device without a host
synchronisation, from whole-number masses whose sums are exact on every device. `plan_crs`,
`plan_wtacrs` and `plan_uniform` give the same draws as a `Plan`, merged on the host (tests and
tools); VCAS uses `water_fill` and `plan_bernoulli`. A `Plan` holds the sorted, unique kept row
indices (int32) and their Horvitz–Thompson weights (float32), so that

    Σ_r plan.weight[r] · A[plan.index[r]]   is unbiased for   Σ_i A[i].

Nothing here draws random numbers. Every function that needs randomness takes `u`, a 1-D tensor of
U[0, 1) draws (produced by the caller from the shared Philox stream: `uniforms48` joins two of
its 24-bit float32 draws into one of 48 bits for `plan_slots`), so a plan is a
deterministic function of its inputs: the CPU and GPU paths, and forward and backward, agree when
they are handed the same draws.

Probabilities are handled in float64 throughout: a cumulative sum over many rows in float32 loses
the small probabilities that the 1/p rescale divides by. The draws of `plan_slots` use whole-number
masses (`integer_masses`) for the same reason and one more: their sums are exact.

Also here: water-filling (§7.1), the WTA winner count (§8.1), the WTA-CRS probabilities with a floor
(§8.2), the keep count (§8.2) and the closed-form variances of every estimator (§3, §7, §8.1) that
the statistical tests (§9) compare against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "Plan",
    "Slots",
    "integer_masses",
    "plan_slots",
    "uniforms48",
    "keep_count",
    "norm_probabilities",
    "plan_bernoulli",
    "plan_crs",
    "plan_uniform",
    "plan_wtacrs",
    "scores_usable",
    "variance_bernoulli",
    "variance_crs",
    "variance_sketch",
    "variance_wtacrs",
    "water_fill",
    "winners_count",
]

#: Smoothing of `norm_probabilities`: the smallest share of the ‖x‖-only distribution mixed in, so
#: that a row with ‖x_t‖ > 0 never gets p_t = 0 (the original added 1e-8 to every score, §8.2).
SMOOTHING = 1e-8


@dataclass(frozen=True)
class Plan:
    """Which rows to keep and how to weight them.

    Attributes:
        index: int32, unique and sorted ascending, on the device of the probabilities; the kept rows.
        weight: float32, same length as `index`, every entry > 0: the factor each kept row is
            multiplied by (1 for winners, count·(mass)/(draws·p) for sampled rows, 1/p for Bernoulli
            keeps), so that Σ_r weight[r]·A[index[r]] is unbiased for Σ_i A[i].
        draws: how many uniform draws of `u` the plan consumed (u[:draws]).
        winners: how many rows are kept deterministically with weight 1 (the WTA winners, the rows
            with p = 1 in a Bernoulli plan; 0 for CRS).

    len(plan) is the number of kept rows (so an empty plan is falsy).
    """

    index: Tensor
    weight: Tensor
    draws: int
    winners: int

    def __len__(self) -> int:
        return int(self.index.numel())

    def to(self, device: torch.device) -> "Plan":
        """The same plan with its tensors on `device`."""
        return Plan(self.index.to(device), self.weight.to(device), self.draws, self.winners)


# ---------------------------------------------------------------------------------------------------
# Argument checks. They raise ValueError naming the argument and what was expected.


def _check_vector(name: str, value: Tensor) -> None:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {value.dtype}")


def _check_count(name: str, value: int, lowest: int = 0) -> int:
    # bool is an int subclass; True as a sample count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name}: expected an int >= {lowest}, got {value!r}")
    return value


def _check_probabilities(p: Tensor) -> Tensor:
    """`p` as float64, after checking it is a 1-D distribution (not necessarily normalised)."""
    _check_vector("p", p)
    p = p.to(torch.float64)
    # One host sync for all three conditions instead of one each.
    bad = ~torch.isfinite(p).all() | (p < 0).any() | (p.sum() <= 0)
    if p.numel() == 0 or bool(bad):
        raise ValueError("p: expected finite probabilities >= 0 with a positive sum")
    return p


def _uniforms(u: Tensor, needed: int, device: torch.device) -> Tensor:
    """The first `needed` draws of `u`, as float64 on `device`."""
    _check_vector("u", u)
    if u.numel() < needed:
        raise ValueError(f"u: expected at least {needed} uniform draws, got {u.numel()}")
    u = u if u.numel() == needed else u[:needed]
    # No op call where u already is float64 on `device` (the sampled layers' per-call path).
    return u if u.dtype == torch.float64 and u.device == device else u.to(device=device, dtype=torch.float64)


def _empty_plan(device: torch.device, draws: int = 0, winners: int = 0) -> Plan:
    return Plan(
        index=torch.empty(0, dtype=torch.int32, device=device),
        weight=torch.empty(0, dtype=torch.float32, device=device),
        draws=draws,
        winners=winners,
    )


# ---------------------------------------------------------------------------------------------------
# Scores, probabilities and budgets.


def scores_usable(scores: Tensor) -> bool:
    """Whether `scores` can drive a sampler (docs/algorithms.md §7.1, §9.6).

    False when any score is non-finite or they sum to 0: the caller then passes the gradient through
    exactly for that call (sampling would turn NaN/inf into finite garbage, or divide by 0).
    Raises ValueError when a finite score is negative: scores are norms, so that is a caller's bug
    rather than a data condition. `water_fill` itself does not check (it would cost another host
    synchronisation); call this first.
    """
    _check_vector("scores", scores)
    if scores.numel() == 0:
        return False
    if not bool(torch.isfinite(scores).all()):
        return False
    if bool((scores < 0).any()):
        raise ValueError("scores: expected scores >= 0 (row norms), got a negative score")
    return bool(scores.to(torch.float64).sum() > 0)


def water_fill(scores: Tensor, k: float) -> Tensor:
    """Inclusion probabilities p_i = min(1, c·g_i) with Σp = k (docs/algorithms.md §7.1), in float64.

    This is the variance-minimising Poisson-sampling design for a budget of k expected rows. The
    heavy rows H (p = 1) are the largest scores; c = (k − |H|)/Σ_{i∉H} g_i. |H| is the first h (in
    descending-score order) with c_h·g_(h+1) ≤ 1, which is where the iterative rule of §7.1 ("while
    c·g_max(rest) > 1 move the largest into H") stops; tied scores enter H together, so the result
    does not depend on the order of equal scores.

    Edge cases:
      * k >= N: all ones.
      * k >= the number of positive scores: the positive scores get p = 1 and zero scores stay 0,
        so Σp = #positive < k. A zero score means a zero row, whose term contributes nothing; giving
        it probability would only spend budget on it.
      * k == 0: all zeros.
    Precondition: `scores_usable(scores)` (finite, >= 0); not rechecked here.
    """
    _check_vector("scores", scores)
    k = float(k)
    if not k >= 0 or math.isinf(k):
        raise ValueError(f"k: expected a finite budget >= 0, got {k!r}")
    g = scores.to(torch.float64)
    n = g.numel()
    if k >= n:
        return torch.ones_like(g)
    positive = g > 0
    npos = int(positive.sum())
    if k >= npos:
        return positive.to(torch.float64)
    if k == 0:
        return torch.zeros_like(g)

    # Here 0 < k < npos <= n. Sorted descending: sorted_g[h] is g_(h+1) in 1-based notation.
    sorted_g, order = torch.sort(g, descending=True)
    # rest[h] = Σ_{i >= h} sorted_g[i]; summed from the small end so the tail sums keep precision.
    rest = torch.flip(torch.cumsum(torch.flip(sorted_g, [0]), 0), [0])
    # Only h < k can be the number of heavy rows (each costs 1 of the budget and c must stay > 0),
    # and h = ceil(k) − 1 always satisfies the stopping rule: c_h·g_(h+1) ≤ (k − h)·g/Σrest ≤ 1.
    # Also h < npos there, so rest[h] > 0 and c_h is finite.
    last = math.ceil(k) - 1
    h = torch.arange(last + 1, dtype=torch.float64, device=g.device)
    c = (k - h) / rest[: last + 1]
    stops = c * sorted_g[: last + 1] <= 1
    # The first True is where the rule stops. `stops[last]` is True (see above) up to rounding, so
    # force it rather than trust the last ulp.
    stops[last] = True
    heavy = int(torch.nonzero(stops)[0, 0])
    scale = c[heavy]
    p_sorted = torch.clamp(scale * sorted_g, max=1.0)
    p_sorted[:heavy] = 1.0
    p = torch.empty_like(g)
    p[order] = p_sorted
    return p


def winners_count(p_sorted_desc: Tensor, k: int) -> int:
    """The WTA-CRS winner count |C| of docs/algorithms.md §8.1, over the distribution
    `p_sorted_desc` (sorted descending, not necessarily normalised), as `plan_slots` chooses it.

    With Q_c the sum of the c largest probabilities (Q_0 = 0), returns the first minimiser over
    c ∈ [0, k) of (1 − Q_c)/(k − c), ties within a relative 1e-12 going to the smaller c. That is the
    minimiser of the upper bound Var_WTA(c) ≤ (1 − P_C)/(k − c) · Σ_i ‖A_i‖²‖B_i‖²/p_i. It is not
    always the minimiser of the exact variance (§8.1 says it matched in a check; it does not in
    general), but c = 0 (plain CRS) is a candidate, so the chosen bound never exceeds its value for
    CRS. Computed on `integer_masses` (exact sums: equal probabilities tie exactly, on every
    device). When k > N, c = N (every row a winner) is also a candidate, with objective 0.
    """
    _check_vector("p_sorted_desc", p_sorted_desc)
    _check_count("k", k, lowest=1)
    masses, _ = integer_masses(p_sorted_desc)
    return int(_winners(masses, masses.sum(), k))


def norm_probabilities(row_norms: Tensor, other: Optional[Tensor] = None, floor: float = 0.1) -> Tensor:
    """WTA-CRS row probabilities from ‖x_t‖ and an optional cached γ_t = ‖dY_t‖ (docs/algorithms.md §8.2).

    Exactly:
        p_x  = ‖x‖ / Σ‖x‖
        p_xγ = ‖x‖·γ / Σ‖x‖·γ        (p_x when `other` is None, or when Σ‖x‖·γ is 0 or not finite:
                                      a cache that is empty or broken is no information)
        f    = max(floor, 1e-8)
        p    = (1 − f)·p_xγ + f·p_x
    The floor keeps a stale γ_t = 0 from giving p_t ≈ 0 and a huge 1/p_t. Clamping it at 1e-8 plays
    the part of the original's "+ 1e-8": every row with ‖x_t‖ > 0 keeps p_t > 0 even for floor = 0.
    Unlike "+ 1e-8" it leaves p_t = 0 where ‖x_t‖ = 0; such a row's term g_tᵀx_t is exactly 0, so
    skipping it keeps every estimator unbiased. If every norm is 0 the result is uniform.

    Returns float64 probabilities summing to 1. `row_norms` must be finite and >= 0 (check with
    `scores_usable`); `other` must have the same length and be >= 0.
    """
    _check_vector("row_norms", row_norms)
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor: expected a weight in [0, 1], got {floor!r}")
    n = row_norms.numel()
    if n == 0:
        raise ValueError("row_norms: expected at least one row, got none")
    x = row_norms.to(torch.float64)
    x_total = x.sum()
    if not bool(x_total > 0):
        return torch.full_like(x, 1.0 / n)
    p_x = x / x_total
    if other is None:
        return p_x
    _check_vector("other", other)
    if other.numel() != n:
        raise ValueError(f"other: expected {n} entries (one per row), got {other.numel()}")
    xg = x * other.to(device=x.device, dtype=torch.float64)
    xg_total = xg.sum()
    if not bool(torch.isfinite(xg_total) & (xg_total > 0)):
        return p_x
    f = max(float(floor), SMOOTHING)
    return (1.0 - f) * (xg / xg_total) + f * p_x


def keep_count(n: int, keep: float, minimum: int = 10) -> int:
    """The number of rows WTA-CRS keeps: min(max(⌊n·keep⌋, minimum), n) (docs/algorithms.md §8.2).

    ⌊n·keep⌋ is computed as the original does (a float product, then floor), so e.g. n = 100,
    keep = 0.29 gives 28. Returns n when the whole input should be saved exactly.
    """
    _check_count("n", n)
    _check_count("minimum", minimum)
    keep = check_keep(keep)
    return min(max(math.floor(n * keep), minimum), n)


def check_keep(keep: Any) -> float:
    """`keep` as a float, if it is a number in (0, 1]: TypeError for another type, ValueError
    for a number outside (NaN included)."""
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise TypeError(f"keep: expected a float in (0, 1], got {type(keep).__name__} {keep!r}")
    if not 0.0 < float(keep) <= 1.0:
        raise ValueError(f"keep: expected a float in (0, 1], got {keep!r}")
    return float(keep)


# ---------------------------------------------------------------------------------------------------
# Plans.


@dataclass(frozen=True)
class Slots:
    """A plan of fixed size: k slots, slot r keeping row index[r] with weight weight[r], so that
    Σ_r weight[r]·A[index[r]] is unbiased for Σ_i A[i]. Its shapes depend on k alone and it is made
    on the device of the scores without a host synchronisation (what a CUDA graph can capture):
    a row drawn twice fills two slots, a slot with nothing to draw has weight 0, and a NaN or
    negative score gives NaN weights (the estimate is then not finite, as the exact sum would be;
    an infinite score is the largest finite one, `integer_masses`).

    Attributes:
        index: int32, k entries in [0, N).
        weight: float64, k entries, each >= 0 (or NaN).
        winners: int64 0-d tensor, the slots kept deterministically (the first ones; 0 for CRS).
    """

    index: Tensor
    weight: Tensor
    winners: Tensor


def integer_masses(scores: Tensor, other: Optional[Tensor] = None, floor: float = 0.1) -> Tuple[Tensor, Tensor]:
    """(masses, usable): the sampling distribution of the row scores as whole numbers (float64),
    and a 0-d bool that is False when a score is NaN or negative. Made without a host
    synchronisation, and bit for bit the same on every device.

    Row t is drawn with probability m_t/Σm. m_t = ceil(s_t/max(s)·2^K), K = 48 − (bit length of
    N), so Σm < 2^48: every sum of masses is exact in float64 whatever the order a device adds in
    (the CPU and the GPU draw the same rows from the same uniforms; max is exact anyway), and
    `plan_slots`' 48-bit uniforms reach every unit of mass. Given `other` (γ, one value per row),
    the distribution is `norm_probabilities`' mix, (1 − f)·s·γ/Σs·γ + f·s/Σs with f = max(floor,
    1e-8), taken to masses the same way (s·γ without information, all zero, negative or not
    finite: s alone). The ceiling keeps every row with a positive score drawable; a zero score
    gets mass 0 (its row's term is 0). All scores zero: every row mass 1 (uniform). An infinite
    score (a row with an infinite value, or one whose norm overflowed) counts as the largest finite
    value: such rows take nearly all the mass, and a drawn one carries its infinity into the
    estimate as into the exact sum.
    """
    _check_vector("scores", scores)
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor: expected a weight in [0, 1], got {floor!r}")
    x = scores.to(torch.float64)
    n = x.numel()
    if n == 0:
        raise ValueError("scores: expected at least one row, got none")
    scale = float(2 ** (48 - n.bit_length()))
    usable = (x >= 0).all()  # False where a score is NaN or negative
    largest = torch.finfo(torch.float64).max
    x = torch.nan_to_num(x, nan=math.nan, posinf=largest, neginf=largest)  # an infinity counts as the largest value

    def masses(v: Tensor) -> Tensor:
        top = v.max()
        positive = top > 0
        return torch.where(positive, torch.ceil(v / torch.where(positive, top, 1.0) * scale), 1.0)

    a = masses(x)
    if other is None:
        return a, usable
    _check_vector("other", other)
    if other.numel() != n:
        raise ValueError(f"other: expected {n} entries (one per row), got {other.numel()}")
    xg = x * other.to(device=x.device, dtype=torch.float64)
    informative = torch.isfinite(xg).all() & (xg >= 0).all() & (xg.max() > 0)
    b = masses(torch.where(informative, xg, x))
    f = max(float(floor), SMOOTHING)
    mixed = torch.ceil(((1.0 - f) * (b / b.sum()) + f * (a / a.sum())) * scale)
    return torch.where(informative, mixed, a), usable


def uniforms48(u: Tensor) -> Tensor:
    """k uniforms of 48 bits (float64, multiples of 2^-48 in [0, 1)) from 2k float32 draws of 24
    bits each (multiples of 2^-24, as abp's Philox kernel makes them): u[:k] + u[k:]·2^-24, exact."""
    k = u.numel() // 2
    return u[:k].to(torch.float64) + u[k:2 * k].to(torch.float64) * 2.0 ** -24


def _draw(masses: Tensor, u: Tensor) -> Tensor:
    """Rows drawn with probability masses_j/Σmasses for uniforms u (int64); never a row of mass 0
    while any has mass (then every draw is row 0). The masses are whole numbers with Σ < 2^48,
    so the cumulative sum is exact and floor(u·Σ) < Σ: searchsorted gives the first j whose
    cumulative mass exceeds it. With 48-bit uniforms every unit of mass is reached: row j's
    probability is within one unit of masses_j/Σ (with coarser uniforms, within Σ·2^-bits)."""
    cdf = torch.cumsum(masses, 0)
    u = u if u.dtype == torch.float64 else u.to(torch.float64)
    j = torch.searchsorted(cdf, torch.floor(u * cdf[-1]), right=True)
    rows = torch.arange(masses.numel(), device=masses.device)
    return torch.minimum(j, (rows * (masses > 0)).max())  # a sum of 0: row 0, weight 0 at the caller


def _winners(sorted_masses: Tensor, total: Tensor, k: int) -> Tensor:
    """The WTA-CRS winner count (`winners_count`) over masses sorted descending, as a 0-d int64
    tensor: the first c in [0, k) minimising (Σm − Q_c)/(k − c), ties within a relative 1e-12 to
    the smaller c (Q_c: the c largest masses; both exact)."""
    top = sorted_masses[: min(k, sorted_masses.numel())]
    q = torch.cumsum(top, 0) - top  # Q_c, the c largest before c: whole numbers below 2^48, exact
    if top.numel() < k:  # fewer rows than slots: every row may win, c = N too (Q_N = Σm)
        q = torch.cat([q, total.reshape(1)])
    c = torch.arange(q.numel(), dtype=torch.float64, device=q.device)
    objective = (total - q) / (k - c)
    near = objective <= objective.min() * (1.0 + 1e-12)
    return torch.argmax(near.to(torch.uint8))  # the first True


def plan_slots(masses: Tensor, usable: Tensor, k: int, u: Tensor, method: str,
               winners: Optional[int] = None) -> Slots:
    """The k slots of `method` over the rows' `masses` (`integer_masses`), from uniforms u[:k]
    (`uniforms48` of abp's draws: each unit of mass reachable):

    - "crs" (and "uniform", with masses of 1): k i.i.d. draws j ~ m_j/Σm, weight Σm/(k·m_j);
    - "wtacrs": the |C| rows of largest mass (ties: lower index first) in the first slots with
      weight 1, |C| = `winners` or `_winners`' choice; the other s = k − |C| slots draw i.i.d. from
      the rest, j ~ m_j/M (M: the rest's mass), with u[0], u[1], ... in slot order, weight
      M/(s·m_j); with M = 0 they hold weight 0.

    Unbiased for any |C| (C is fixed before the draws, and every rest row of positive mass can be
    drawn) up to the resolution of the draws: a row's probability is within one unit of mass
    (2^-K of the largest score's share, `integer_masses`) of m_j/M with 48-bit uniforms. No host
    synchronisation: every count stays on the device.
    """
    _check_count("k", k, lowest=1)
    n = masses.numel()
    device = masses.device
    draws = _uniforms(u, k, device)
    slots = torch.arange(k, device=device)
    total = masses.sum()
    if method == "wtacrs":
        ordered, order = torch.sort(masses, descending=True, stable=True)
        if winners is None:
            count = _winners(ordered, total, k)
        else:
            count = torch.tensor(winners, dtype=torch.int64, device=device)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n, device=device)
        rest = torch.where(rank < count, 0.0, masses)
        mass = rest.sum()
        j = _draw(rest, draws[(slots - count).clamp(min=0)])
        drawn = torch.where(mass > 0, mass / ((k - count) * rest[j]), 0.0)
        won = slots < count
        index = torch.where(won, order[slots.clamp(max=n - 1)], j)
        weight = torch.where(won, 1.0, drawn)
    elif method in ("crs", "uniform"):
        count = torch.zeros((), dtype=torch.int64, device=device)
        index = _draw(masses, draws)
        weight = torch.where(total > 0, total / (k * masses[index]), 0.0)
    else:
        raise ValueError(f"method: expected 'wtacrs', 'crs' or 'uniform', got {method!r}")
    weight = torch.where(usable, weight, math.nan)
    return Slots(index.to(torch.int32), weight, count)


def _merged(slots: Slots, draws: int, winners: int) -> Plan:
    """`slots` as a Plan: each row once, its slots' weights summed, slots of weight 0 left out."""
    kept = slots.weight > 0
    index, inverse = torch.unique(slots.index[kept].to(torch.int64), sorted=True, return_inverse=True)
    weight = torch.zeros(index.numel(), dtype=torch.float64, device=index.device)
    weight.index_add_(0, inverse, slots.weight[kept])
    return Plan(index.to(torch.int32), weight.to(torch.float32), draws=draws, winners=winners)


def plan_crs(p: Tensor, k: int, u: Tensor) -> Plan:
    """Column-row sampling: k i.i.d. draws j_t ~ p, each weighted 1/(k·p_j) (docs/algorithms.md §8.1).

    `plan_slots` over `integer_masses(p)` (so p's proportions to 2^-K of its largest), with
    duplicates merged into one kept row of weight count/(k·p_j): `index` is unique and len(plan)
    <= k. Uses u[:k]. k = 0 gives an empty plan, which estimates 0: callers take the exact path
    for k = 0. A host-side view of the slots (it synchronises), for tests and tools.
    """
    p = _check_probabilities(p)
    _check_count("k", k)
    if k == 0:
        _uniforms(u, 0, p.device)
        return _empty_plan(p.device)
    masses, usable = integer_masses(p)
    return _merged(plan_slots(masses, usable, k, u, "crs"), draws=k, winners=0)


def plan_wtacrs(p: Tensor, k: int, u: Tensor, winners: Optional[int] = None) -> Plan:
    """Winner-take-all column-row sampling (docs/algorithms.md §8.1): `plan_slots` over
    `integer_masses(p)`, duplicates merged as in `plan_crs`.

    The winners C are the |C| rows of largest p (by `integer_masses`: rows within one unit of mass
    tie, and ties go to the lower index), kept with weight 1.
    The other s = k − |C| draws are i.i.d. from p restricted to the rest, j ~ p_j/(1 − P_C), each
    weighted (1 − P_C)/(s·p_j). `winners` defaults to `winners_count`; an explicit value must lie in
    [0, min(k, N)]. |C| = k (no draws left) is accepted only when the rest holds probability mass
    exactly 0, because dropping positive mass would bias the estimate (the "winners hold > 1 − 1e−3"
    shortcut of §8.3). A rest with tiny but positive mass is still sampled. Uses u[:s].
    """
    p = _check_probabilities(p)
    _check_count("k", k)
    n = p.numel()
    if k == 0:
        _uniforms(u, 0, p.device)
        return _empty_plan(p.device)
    if winners is not None and (isinstance(winners, bool) or not isinstance(winners, int) or not 0 <= winners <= min(k, n)):
        raise ValueError(f"winners: expected an int in [0, {min(k, n)}], got {winners!r}")
    masses, usable = integer_masses(p)
    # The slots read a uniform per slot; the winners' slots draw nothing (padded here, checked below).
    padded = torch.cat([u.reshape(-1)[:k], u.new_zeros(max(0, k - u.numel()))])
    slots = plan_slots(masses, usable, k, padded, "wtacrs", winners)
    count = int(slots.winners)
    _uniforms(u, k - count, p.device)
    rest = slots.weight[count:]
    if count == k:
        others = masses.clone()
        others[slots.index.to(torch.int64)] = 0
        if bool(others.sum() > 0):
            raise ValueError(f"winners: {count} winners leave no draws (k = {k}) for a rest with probability "
                             "mass > 0; dropping it would bias the estimate")
    return _merged(slots, draws=(k - count) if bool((rest > 0).any()) else 0, winners=count)


def plan_bernoulli(p: Tensor, u: Tensor) -> Plan:
    """Poisson (independent Bernoulli) sampling: keep row i when u_i < p_i, weight 1/p_i (§7.1).

    `p` holds inclusion probabilities in [0, 1] (e.g. from `water_fill`; they need not sum to 1).
    Rows with p_i = 1 are always kept (u < 1) and rows with p_i = 0 never are. Uses u[:N]. Keeping
    nothing is a valid outcome whose unbiased estimate is 0 (not the pass-through of the original).
    A kept p_i below ~3e-39 would give a float32 weight of inf; water-filled p never gets there
    unless the scores span that range.
    """
    _check_vector("p", p)
    p = p.to(torch.float64)
    if bool(~torch.isfinite(p).all() | (p < 0).any() | (p > 1).any()):
        raise ValueError("p: expected inclusion probabilities in [0, 1]")
    draws = _uniforms(u, p.numel(), p.device)
    index = torch.nonzero(draws < p).flatten()  # nonzero returns ascending indices
    kept = p[index]
    return Plan(
        index.to(torch.int32),
        (1.0 / kept).to(torch.float32),
        draws=p.numel(),
        winners=int((p >= 1).sum()),
    )


def plan_uniform(n: int, k: int, u: Tensor, device: torch.device) -> Plan:
    """Uniform column-row sampling: `plan_crs` with p = 1/n, i.e. weight count·n/k per kept row."""
    _check_count("n", n, lowest=1)
    return plan_crs(torch.full((n,), 1.0 / n, dtype=torch.float64, device=device), k, u)


# ---------------------------------------------------------------------------------------------------
# Closed-form variances E‖Ĝ − G*‖_F² of the estimators above.
#
# They are stated for the unmerged estimator (one term per draw). Merging duplicate draws into one
# row of summed weight does not change the estimate's value for any draw, so the same variances hold
# for the plans. G and X are N×a and N×b (leading dimension the rows; further dimensions are
# flattened, so G may be a batch of per-sample gradient matrices), and the target is
# GᵀX = Σ_t g_tᵀx_t.


def _rows(name: str, m: Tensor) -> Tensor:
    if not isinstance(m, Tensor) or m.dim() < 1:
        raise ValueError(f"{name}: expected a tensor with a leading row dimension")
    return m.reshape(m.shape[0], -1).to(torch.float64)


def _pair(G: Tensor, X: Tensor) -> Tuple[Tensor, Tensor]:
    g, x = _rows("G", G), _rows("X", X)
    if g.shape[0] != x.shape[0]:
        raise ValueError(f"X: expected {g.shape[0]} rows (as many as G), got {x.shape[0]}")
    return g, x.to(g.device)


def _term_norms_sq(g: Tensor, x: Tensor) -> Tensor:
    """a_t = ‖g_t‖²‖x_t‖² = ‖g_tᵀx_t‖_F² for every row."""
    return (g * g).sum(1) * (x * x).sum(1)


def _sum_over(a: Tensor, p: Tensor, rows: Tensor) -> float:
    """Σ_rows a/p, and inf when some row has p = 0 but a term a > 0 (the estimator is then biased,
    as that term can never be drawn)."""
    a, p = a[rows], p[rows]
    if bool(((p == 0) & (a > 0)).any()):
        return math.inf
    drawn = p > 0  # rows with p = 0 have a = 0 here; skip them rather than divide 0 by 0
    return float((a[drawn] / p[drawn]).sum())


def variance_crs(G: Tensor, X: Tensor, p: Tensor, k: int) -> float:
    """E‖Ĝ − GᵀX‖_F² of `plan_crs` (docs/algorithms.md §8.1):

        (1/k)·(Σ_t ‖g_t‖²‖x_t‖²/p_t − ‖GᵀX‖_F²),   p normalised to sum 1.
    """
    g, x = _pair(G, X)
    p = _check_probabilities(p).to(g.device)
    _check_count("k", k, lowest=1)
    p = p / p.sum()
    a = _term_norms_sq(g, x)
    total = _sum_over(a, p, torch.arange(p.numel(), device=p.device))
    exact = g.T @ x
    return (total - float((exact * exact).sum())) / k


def variance_wtacrs(G: Tensor, X: Tensor, p: Tensor, k: int, winners: int) -> float:
    """E‖Ĝ − GᵀX‖_F² of `plan_wtacrs` with |C| = `winners` (docs/algorithms.md §8.1):

        (1/s)·[(1 − P_C)·Σ_{j∉C} ‖g_j‖²‖x_j‖²/p_j − ‖Σ_{j∉C} g_jᵀx_j‖_F²],   s = k − |C|,

    with C the |C| rows of largest p (by integer mass, ties to the lower index, as in `plan_wtacrs`). 0 when the rest
    has no mass and no draws are made.
    """
    g, x = _pair(G, X)
    p = _check_probabilities(p).to(g.device)
    _check_count("k", k, lowest=1)
    n = p.numel()
    if isinstance(winners, bool) or not isinstance(winners, int) or not 0 <= winners <= min(k, n):
        raise ValueError(f"winners: expected an int in [0, {min(k, n)}], got {winners!r}")
    p = p / p.sum()
    # The winners as plan_slots picks them: by integer mass, ties to the lower index.
    rest = torch.sort(integer_masses(p)[0], descending=True, stable=True).indices[winners:]
    mass = p[rest].sum()
    s = k - winners
    if not bool(mass > 0):
        return 0.0
    if s == 0:
        return math.inf
    a = _term_norms_sq(g, x)
    rest_sum = g[rest].T @ x[rest]
    return (float(mass) * _sum_over(a, p, rest) - float((rest_sum * rest_sum).sum())) / s


def variance_bernoulli(G: Tensor, X: Optional[Tensor], p: Tensor) -> float:
    """E‖Ĝ − G*‖_F² of `plan_bernoulli` (docs/algorithms.md §7.1, §7.2):

        Σ_t (1/p_t − 1)·‖g_t‖²‖x_t‖²          (weight sampler, target GᵀX)
        Σ_t (1/p_t − 1)·‖G_t‖²                (X = None: activation sampler, target G itself)

    The keeps are independent, so the variance of the sum is the sum of the per-row variances.
    """
    g = _rows("G", G)
    if X is None:
        a = (g * g).sum(1)
    else:
        g, x = _pair(G, X)
        a = _term_norms_sq(g, x)
    _check_vector("p", p)
    p = p.to(device=g.device, dtype=torch.float64)
    if p.numel() != a.numel():
        raise ValueError(f"p: expected {a.numel()} entries (one per row), got {p.numel()}")
    all_rows = torch.arange(p.numel(), device=p.device)
    return _sum_over(a, p, all_rows) - float(a[p > 0].sum())


def variance_sketch(G: Tensor, X: Tensor, k: int, kind: str) -> float:
    """E‖GᵀSᵀSX/k − GᵀX‖_F² of the RMM sketch with k rows (docs/algorithms.md §3):

        gaussian:   (‖G‖_F²‖X‖_F² + ‖GᵀX‖_F²)/k
        rademacher: the same − (2/k)·Σ_n ‖g_n‖²‖x_n‖²   (E s⁴ = 1 instead of 3)
    """
    g, x = _pair(G, X)
    _check_count("k", k, lowest=1)
    exact = g.T @ x
    base = float((g * g).sum()) * float((x * x).sum()) + float((exact * exact).sum())
    if kind == "gaussian":
        return base / k
    if kind == "rademacher":
        return (base - 2.0 * float(_term_norms_sq(g, x).sum())) / k
    raise ValueError(f"kind: expected 'gaussian' or 'rademacher', got {kind!r}")
