"""Would another 2-bit codec close the language model's gap? (measurement, CPU, issue #12)

compress_saved's codec is per-group (256 elements) min-max codes with stochastic rounding. Two
changes often proposed for low-bit activation compression, tried here on the charlm task of
real_tasks.py (300 steps, compress_saved(bits=2) with the op rules, the same seeds):

  plain  the codec as it is;
  rot    each group multiplied by random signs and an orthonormal Hadamard matrix before
         quantizing and rotated back after dequantizing (spreads a group's outliers, so its range
         shrinks; still unbiased, since the rotation is linear);
  det    round to the nearest code instead of stochastically (less variance, but biased).

The codec is swapped by wrapping abp.compress's quantize_unchecked and dequantize for the run:
a measurement only, not a mode of abp. Prints the validation loss (nats per byte) and the largest
sampled gradient norm per run. Usage (torch 2.x lane): PYTHONPATH=bindings/python ABP_LIBRARY=...
ABP_KERNEL_DIR=... python bench/codec_variants.py [steps] [seeds]. Committed output:
results/codec-variants-*.txt.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import abp  # noqa: E402
import abp.compress as codec  # noqa: E402
import real_tasks as rt  # noqa: E402

GROUP = 256


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _flat_groups_only(padded: int) -> None:
    """The variants code the flattened tensor's groups; padded channel planes (a convolution's
    activation, compress.plane_groups) are not part of this ablation on a language model."""
    if padded:
        raise NotImplementedError("codec_variants: a tensor with padded channel planes (4-d activations)")


def _rotated(quantize: Callable[..., Any], dequantize: Callable[..., Any]):
    """quantize/dequantize wrapped in a per-tensor random-sign Hadamard rotation of each group."""
    h = _hadamard(GROUP)
    shapes: Dict[int, Any] = {}

    def q(x: torch.Tensor, bits: int, group_size: int, seed: int, offset: int, padded: int = 0):
        _flat_groups_only(padded)
        n = x.numel()
        flat = x.reshape(-1).float()
        flat = torch.cat([flat, flat.new_zeros((-n) % GROUP)])
        g = torch.Generator().manual_seed((seed * 1000003 + offset) % (1 << 62))
        signs = (torch.randint(0, 2, (GROUP,), generator=g) * 2 - 1).float()
        c = quantize(((flat.view(-1, GROUP) * signs) @ h).reshape(-1).to(x.dtype), bits, group_size, seed, offset)
        shapes[id(c)] = (x.shape, n, signs, c)
        return c

    def dq(c: Any) -> torch.Tensor:
        out = dequantize(c)
        kept = shapes.get(id(c))
        if kept is None or kept[3] is not c:
            return out
        shape, n, signs, _ = kept
        back = (out.float().view(-1, GROUP) @ h.t()) * signs
        return back.reshape(-1)[:n].reshape(shape).to(out.dtype)

    return q, dq


def _nearest(quantize: Callable[..., Any]):
    """quantize of values already rounded to their group's nearest code (stochastic rounding of
    a value on a code is that code)."""

    def q(x: torch.Tensor, bits: int, group_size: int, seed: int, offset: int, padded: int = 0):
        _flat_groups_only(padded)
        n = x.numel()
        flat = x.reshape(-1).float()
        full = n // group_size * group_size

        def rnd(v: torch.Tensor) -> torch.Tensor:
            lo, hi = v.min(1, keepdim=True).values, v.max(1, keepdim=True).values
            scale = (2 ** bits - 1) / (hi - lo + 2e-6)
            return torch.round((v - lo) * scale) / scale + lo

        parts = [rnd(flat[:full].view(-1, group_size)).reshape(-1)] if full else []
        if n > full:
            parts.append(rnd(flat[full:].view(1, -1)).reshape(-1))
        return quantize(torch.cat(parts).view(x.shape).to(x.dtype), bits, group_size, seed, offset)

    return q


def run(variant: str, seed: int, steps: int) -> Dict[str, float]:
    saved = codec.quantize_unchecked, codec.dequantize
    try:
        if variant == "rot":
            codec.quantize_unchecked, codec.dequantize = _rotated(*saved)
        elif variant == "det":
            codec.quantize_unchecked = _nearest(saved[0])
        r = rt.train("charlm", lambda model: (lambda: abp.compress_saved(bits=2, allow_low_bits=True, guard=False)),
                     seed, steps=steps)
    finally:
        codec.quantize_unchecked, codec.dequantize = saved
    return {"val_loss": r["val_loss"], "grad_norm_max": r["grad_norm_max"]}


def main() -> None:
    torch.set_num_threads(2)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    for seed in range(seeds):
        for variant in ("plain", "rot", "det"):
            start = time.time()
            r = run(variant, seed, steps)
            print(f"{variant} seed={seed}: val={r['val_loss']:.3f} gmax={r['grad_norm_max']:.1f} "
                  f"({time.time() - start:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
