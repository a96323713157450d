"""How the 2-bit activations' defined derivative compounds with depth (docs/python.md, "Where the
2-bit activations hurt"). Chains of 12 Conv-BatchNorm-activation, Conv-GroupNorm-activation and
Conv-activation layers (CNNs without residual paths between them, as inside EfficientNet's and
MobileNet's stems or wav2vec2's feature encoder) against 12 pre-norm residual MLP blocks (a
transformer's layout): the relative error of the first layer's weight gradient,
‖g − g_exact‖ / ‖g_exact‖, and the gain ‖g‖ / ‖g_exact‖, for each replacement convert offers and
for convert's own choice (`default`, without an example call: the 3-bit form where the
activation's block holds a convolution or channel norm, the 2-bit one elsewhere); Hardswish and
Mish (`other_activations=` 2, 3 and 4 bits) beside them.

    python bench/activation_chains.py [--json out.json]

CPU, fixed seeds; the numbers are the models' at initialisation.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

import abp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import commit_id  # noqa: E402

DEPTH = 12


def conv_chain(norm: Optional[Callable[[], nn.Module]]) -> Callable[[Callable[[], nn.Module]], nn.Module]:
    def build(act: Callable[[], nn.Module]) -> nn.Module:
        torch.manual_seed(0)
        layers: List[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Conv2d(16, 16, 3, padding=1)] + ([norm()] if norm is not None else []) + [act()]
        return nn.Sequential(*layers)
    return build


class Residual(nn.Module):
    def __init__(self, act: Callable[[], nn.Module], d: int = 64) -> None:
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), act(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


def residual_chain(act: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Residual(act) for _ in range(DEPTH)])


def first_grad(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    first = next(m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    return first.weight.grad.flatten().clone()


def _named(family: str, names: Tuple[str, ...]) -> List[Tuple[str, Dict[str, object]]]:
    return [(name, {family: name}) for name in names] + [(f"{family} default", {})]


def _bits(family: str) -> List[Tuple[str, Dict[str, object]]]:
    return [(f"{family} {b}-bit", {"other_activations": b}) for b in (2, 3, 4)]


#: Each activation and the replacements convert offers for it: (label, convert's overrides).
_CHOICES = [(nn.SiLU, _named("silu", ("resilu2", "silu_b2", "silu_b3"))),
            (nn.GELU, _named("gelu", ("regelu2", "gelu_b2", "gelu_b3"))),
            (nn.Hardswish, _bits("hardswish")), (nn.Mish, _bits("mish"))]


def measure() -> List[Dict[str, object]]:
    rows = []
    image = torch.randn(4, 16, 16, 16, generator=torch.Generator().manual_seed(1))
    cases = [("conv-bn", conv_chain(lambda: nn.BatchNorm2d(16)), image),
             ("conv-gn", conv_chain(lambda: nn.GroupNorm(4, 16)), image),
             ("conv", conv_chain(None), image),
             ("pre-norm residual", residual_chain, torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1)))]
    for chain, build, x in cases:
        for act, choices in _CHOICES:
            base = build(act)
            exact = first_grad(base, x)
            for label, chosen in choices:
                model, _ = abp.convert(copy.deepcopy(base), "lowmembp", norms=False, **chosen)
                g = first_grad(model, x)
                rows.append({"chain": chain, "activation": label,
                             "relative_error": float((g - exact).norm() / exact.norm()),
                             "gain": float(g.norm() / exact.norm())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure()
    print(f"{'chain':<18} {'activation':<16} {'rel. error':>10} {'gain':>6}")
    for r in rows:
        print(f"{r['chain']:<18} {r['activation']:<16} {r['relative_error']:>10.3f} {r['gain']:>6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"commit": commit_id(str(Path(__file__).resolve().parents[1])), "torch": torch.__version__, "machine": platform.machine(),
                                         "depth": DEPTH, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
