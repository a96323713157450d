"""Independent references for the GACT codec tests: Philox-4x32-10 and the per-group scheme in numpy.

Written from the definitions (Salmon et al. SC'11 for Philox; docs/algorithms.md §6.2 and the
abp.uniform / abp.quantize_groups docs for the rest), not from the generated kernels, so the tests
compare two implementations. fp32 arithmetic in numpy rounds every operation once, with no fused
multiply-add, which is also what the kernels are compiled to do.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch

_MASK = np.uint64(0xFFFFFFFF)
_CANONICAL_NAN = {np.float32: np.array([0x7FFFFFFF], dtype=np.uint32).view(np.float32)[0],
                  np.float64: np.array([0x7FFFFFFFFFFFFFFF], dtype=np.uint64).view(np.float64)[0]}


def philox4x32_10(counters: np.ndarray, key0: int, key1: int) -> np.ndarray:
    """Philox-4x32-10 of each row of `counters` (shape (n, 4), uint32) under the key; (n, 4) uint32."""
    c = [counters[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = np.uint64(key0), np.uint64(key1)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    for _ in range(10):
        p0, p1 = m0 * c[0], m1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + w0) & _MASK, (k1 + w1) & _MASK
    return np.stack(c, axis=1).astype(np.uint32)


def uniform_at(seed: int, positions: np.ndarray, bits: int = 24) -> np.ndarray:
    """abp.uniform. 24 bits: word c mod 4 of Philox at counter (c / 4, 0) under key (seed lo,
    seed hi), as (w >> 8) * 2^-24 in fp32. 16 bits: half-word c mod 8 of Philox at counter
    (c / 8, 0), the low half of word (c mod 8) / 2 for even c and the high half for odd c, as
    h * 2^-16."""
    positions = positions.astype(np.uint64)
    per_block = 4 if bits == 24 else 8
    blocks = positions // np.uint64(per_block)
    counters = np.zeros((positions.size, 4), dtype=np.uint32)
    counters[:, 0] = (blocks & _MASK).astype(np.uint32)
    counters[:, 1] = (blocks >> np.uint64(32)).astype(np.uint32)
    words = philox4x32_10(counters, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    within = positions % np.uint64(per_block)
    if bits == 24:
        word = words[np.arange(positions.size), within.astype(np.int64)]
        return (word >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    assert bits == 16, bits
    word = words[np.arange(positions.size), (within >> np.uint64(1)).astype(np.int64)]
    half = np.where((within & np.uint64(1)) == 1, word >> np.uint32(16), word & np.uint32(0xFFFF))
    return half.astype(np.float32) * np.float32(1.0 / 65536.0)


def quantize_groups(
    x: torch.Tensor, bits: int, group_size: int, seed: int, offset: int = 0
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes per element, per-group minima, per-group scales) of the flattened `x`, in the compute
    type (fp32; fp64 for fp64 tensors); the last group holds the remainder."""
    ctype = np.float64 if x.dtype == torch.float64 else np.float32
    flat = x.detach().reshape(-1).to(torch.float64 if ctype is np.float64 else torch.float32).numpy()
    n = flat.size
    groups = math.ceil(n / group_size)
    top = ctype((1 << bits) - 1)
    # The quantizer draws 16-bit uniforms (abp.uniform {bits = 16}).
    u = uniform_at(seed, np.arange(n, dtype=np.uint64) + np.uint64(offset), bits=16).astype(ctype)
    codes = np.zeros(n, dtype=np.uint8)
    mins = np.zeros(groups, dtype=ctype)
    scales = np.zeros(groups, dtype=ctype)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for g in range(groups):
            sl = slice(g * group_size, min(n, (g + 1) * group_size))
            v = flat[sl]
            # A row reduction's NaN is the quiet NaN with every mantissa bit set, and its zero +0
            # (abp.reduce_rows).
            lo = _CANONICAL_NAN[ctype] if np.isnan(v).any() else ctype(v.min() + ctype(0))
            hi = _CANONICAL_NAN[ctype] if np.isnan(v).any() else ctype(v.max() + ctype(0))
            rng = ctype(hi - lo)
            s = top / ctype(rng + ctype(np.float32(2e-6))) if abs(rng) < np.inf else ctype(np.nan)
            mins[g], scales[g] = lo, s
            q = np.floor(((v - lo) * s).astype(ctype) + u[sl])
            q = np.where(np.isnan(q), 0, np.minimum(q, top))
            codes[sl] = q.astype(np.uint8)
    return codes, mins, scales


def dequantize_groups(codes: np.ndarray, mins: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """(q * (0.5 / s) + 0.5 * m) * 2 per element (q / s + m with the reciprocal once per group, in
    halves so that a range near the largest float does not overflow), in the dtype of `mins`."""
    g = np.arange(codes.size) // group_size
    t = mins.dtype.type
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        half_steps = (t(0.5) / scales).astype(mins.dtype)
        half_mins = (mins * t(0.5)).astype(mins.dtype)
        half = (codes.astype(mins.dtype) * half_steps[g]).astype(mins.dtype) + half_mins[g]
        return (half * t(2)).astype(mins.dtype)


def variance(x: torch.Tensor, bits: int, group_size: int) -> np.ndarray:
    """Var[x̂] per element: φ(1 - φ) / s² with φ = frac((x - m) s), in fp64 (docs/algorithms.md §6.2)."""
    flat = x.detach().reshape(-1).double().numpy()
    n = flat.size
    out = np.zeros(n)
    top = (1 << bits) - 1
    for g in range(math.ceil(n / group_size)):
        sl = slice(g * group_size, min(n, (g + 1) * group_size))
        v = flat[sl]
        s = top / (v.max() - v.min() + 2e-6)
        t = (v - v.min()) * s
        phi = t - np.floor(t)
        out[sl] = phi * (1 - phi) / s**2
    return out


def rounding_outcomes(x: torch.Tensor, bits: int, group_size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact law of each element's dequantized value under the codec's 16-bit draws: (lower
    value, upper value, probability of the upper one). Every one of the 65536 draws h * 2^-16 is
    put through the quantizer's fp32 arithmetic (floor((x - m) * s + u), clamped), then decoded as
    q * (1 / s) + m; stochastic rounding gives at most two adjacent codes. fp32 tensors only."""
    flat = x.detach().reshape(-1).float().numpy()
    n = flat.size
    top = np.float32((1 << bits) - 1)
    _, mins, scales = quantize_groups(x.float(), bits, group_size, seed=0)  # the groups' headers
    u = (np.arange(65536, dtype=np.float32) * np.float32(1.0 / 65536.0))[None, :]
    q_lo, q_hi, p_upper = np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.zeros(n)
    for g in range(math.ceil(n / group_size)):
        sl = slice(g * group_size, min(n, (g + 1) * group_size))
        scaled = ((flat[sl] - mins[g]) * scales[g]).astype(np.float32)[:, None]
        q = np.minimum(np.floor((scaled + u).astype(np.float32)), top)  # (elements, 65536)
        q_lo[sl], q_hi[sl] = q.min(1), q.max(1)
        p_upper[sl] = (q == q.max(1)[:, None]).mean(1) * (q.max(1) > q.min(1))
    assert np.all(q_hi.astype(int) - q_lo <= 1), "stochastic rounding reaches two adjacent codes at most"
    return (dequantize_groups(q_lo, mins, scales, group_size), dequantize_groups(q_hi, mins, scales, group_size),
            p_upper)


def binomial_two_sided(k: np.ndarray, n: int, p: np.ndarray) -> np.ndarray:
    """Two-sided exact tail probability 2 * min(P[X <= k], P[X >= k]) (capped at 1) of
    X ~ Binomial(n, p), per element."""
    j = np.arange(n + 1)
    with np.errstate(divide="ignore", invalid="ignore"):  # p = 0 or 1: log 0, and 0 * -inf masked below
        logp, log1p = np.log(p)[:, None], np.log1p(-p)[:, None]
        terms = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in j])[None, :]
        log_pmf = terms + np.where(j > 0, j * logp, 0.0) + np.where(j < n, (n - j) * log1p, 0.0)
    pmf = np.exp(log_pmf)
    below = np.where(j[None, :] <= k[:, None], pmf, 0).sum(1)
    above = np.where(j[None, :] >= k[:, None], pmf, 0).sum(1)
    return np.minimum(1.0, 2 * np.minimum(below, above))
