"""How much noise does an unbiased b-bit group code add? (measurement, CPU, issue #12)

Stochastic rounding between a group's levels is unbiased whatever the levels are; its variance
per element is (x - lo)(hi - x) for the two levels around x. This prints that variance, in units
of the data's variance, for Gaussian groups (the shape of normalised activations, and of any
group after a random rotation): min-max uniform levels at 1 to 4 bits and group sizes 32 to 1024
(with what a per-group minimum and scale cost in bits per element, fp16 or fp32), and the best
symmetric non-uniform 2-bit levels {min, c - f*h, c + f*h, max} over f. It bounds what any change
of levels or groups within unbiased rounding can buy at 2 bits, against the step to 3 or 4 bits.

Usage: python bench/sr_variance.py [groups]. Committed output: results/sr-variance-*.txt.
"""
from __future__ import annotations

import sys

import torch


def rounding_variance(x: torch.Tensor, levels: torch.Tensor) -> float:
    """Mean over elements of (x - lo)(hi - x): the variance of stochastic rounding of each row
    of x between the adjacent values of the same row of levels (sorted, covering the row)."""
    idx = torch.searchsorted(levels.contiguous(), x.contiguous()).clamp(1, levels.shape[1] - 1)
    lo, hi = levels.gather(1, idx - 1), levels.gather(1, idx)
    return float(((x - lo) * (hi - x)).mean())


def main(groups: int = 4000) -> None:
    torch.manual_seed(0)
    print("variance of unbiased stochastic rounding per element / data variance (Gaussian groups)")
    print(f"{'group':>6} {'bits':>4} {'uniform':>9} {'header b/elem fp16':>19} {'fp32':>5}")
    for size in (32, 64, 256, 1024):
        x = torch.randn(groups, size, dtype=torch.float64)
        lo, hi = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
        for bits in (1, 2, 3, 4):
            levels = lo + (hi - lo) * torch.linspace(0, 1, 2**bits, dtype=torch.float64)
            print(f"{size:>6} {bits:>4} {rounding_variance(x, levels):>9.4f} {32 / size:>19.3f} {64 / size:>5.3f}")
        centre, half = (lo + hi) / 2, (hi - lo) / 2
        best = min((rounding_variance(x, torch.cat([lo, centre - f * half, centre + f * half, hi], 1)), f)
                   for f in [i / 40 for i in range(1, 40)])
        print(f"{size:>6} {2:>4} {best[0]:>9.4f}  best non-uniform levels (inner at {best[1]:.3f} of the half range)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4000)
