"""How noisy is a row-sampled dW on the language model, and how much would ‖dY‖-aware
probabilities help? (measurement, CPU; why WTA-CRS keep 0.3 misses parity on charlm)

Trains the charlm task of real_tasks.py exactly (seed 0, AdamW lr 3e-3, batch 32 of 64 bytes) and,
at a few steps, reads every sampled layer's input rows x_t and output gradients g_t. For i.i.d.
row sampling with k draws and probabilities p, the estimate of dW = Σ_t g_t x_tᵀ has

    E‖dW_est − dW‖² = (1/k) (Σ_t ‖x_t‖²‖g_t‖² / p_t − ‖dW‖²)

(docs/algorithms.md §8). Printed per layer, as k · E‖error‖² / ‖dW‖² (divide by k for the
relative error of one step; keep 0.3 of 2048 rows is k = 614), for uniform p, p ∝ ‖x_t‖ (what
abp samples with: the norms are known in forward) and p ∝ ‖x_t‖‖g_t‖ (the optimum, which needs the
gradient: the best any cache of ‖dY‖ could reach), with the coefficient of variation of ‖x_t‖
and ‖g_t‖. WTA-CRS's deterministic winners lower the first two only as far as the third.

Usage (either torch lane): PYTHONPATH=bindings/python python bench/wtacrs_variance.py [steps...]
(default 0 100 300). The committed output: results/wtacrs-variance-*.txt.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_tasks  # noqa: E402

#: The TinyLlama linear maps WTA-CRS samples (abp._roles finds them): attention output and SwiGLU.
PROJECTIONS = ("o", "gate", "up", "down")


def variance_ratios(x: torch.Tensor, g: torch.Tensor) -> Dict[str, float]:
    """k · E‖dW_est − dW‖² / ‖dW‖² of i.i.d. row sampling under three probability choices."""
    x, g = x.double(), g.double()
    xn, gn = x.norm(dim=1), g.norm(dim=1)
    a2 = (xn * gn).pow(2)
    exact = float((g.t() @ x).pow(2).sum())

    def ratio(p: torch.Tensor) -> float:
        return (float((a2 / p).sum()) - exact) / exact

    n = x.shape[0]
    return {"uniform": ratio(torch.full((n,), 1.0 / n, dtype=x.dtype)), "norm_x": ratio(xn / xn.sum()),
            "optimal": ratio(xn * gn / (xn * gn).sum()), "cv_x": float(xn.std() / xn.mean()),
            "cv_g": float(gn.std() / gn.mean())}


def main(report_at: List[int]) -> None:
    torch.manual_seed(0)
    train_text, _ = real_tasks.python_source()
    model = real_tasks.TinyLlama(context=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000)
    sampled = [n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n.rpartition(".")[2] in PROJECTIONS]
    rows: Dict[str, Dict[str, torch.Tensor]] = {n: {} for n in sampled}
    for name in sampled:
        layer = model.get_submodule(name)
        layer.register_forward_hook(
            lambda m, args, out, name=name: rows[name].update(x=args[0].detach().flatten(0, -2)))
        layer.register_full_backward_hook(
            lambda m, gin, gout, name=name: rows[name].update(g=gout[0].detach().flatten(0, -2)))
    print("step  layer            cv‖x‖  cv‖g‖   uniform  p∝‖x‖  p∝‖x‖‖g‖   (k · E‖error‖² / ‖dW‖²)")
    for step in range(max(report_at) + 1):
        starts = torch.randint(0, len(train_text) - 65, (32,), generator=gen)
        window = torch.stack([train_text[s:s + 65] for s in starts.tolist()])
        out = model(window[:, :-1])
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step in report_at:
            for name in sampled:
                r = variance_ratios(rows[name]["x"], rows[name]["g"])
                print(f"{step:4d}  {name:15s}  {r['cv_x']:5.2f}  {r['cv_g']:5.2f}  {r['uniform']:8.1f} "
                      f"{r['norm_x']:7.1f}  {r['optimal']:8.1f}")
        opt.step()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [0, 100, 300])
