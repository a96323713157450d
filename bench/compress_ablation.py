"""Which saved tensors make 2-bit compressed training diverge? (measurement, CPU)

A small pre-LN transformer on scikit-learn's digits (8x8 images as 16 patches of 2x2 = 4 pixels,
a learned position embedding, 2 blocks, d 64, 4 heads, torch.nn.MultiheadAttention, GELU MLP of
width 256, dropout 0.1, mean pooling, AdamW lr 1e-3, batch 64) is trained with
`abp.compress_saved(bits=2)` on everything, and with only one class of saved tensors compressed
(`filter=`), and with everything except one class. Each saved tensor's class is the op that saves
it (its consumer in backward): this script wraps torch.nn.functional's linear, layer_norm,
softmax, dropout, gelu and torch.bmm / torch.baddbmm (the functions MultiheadAttention and the
modules call) so that the pack hook, which runs inside them, knows which op is saving.

Classes:
  layernorm  what F.layer_norm saves: its input, and the per-row mean and 1/std
  attention  what MultiheadAttention's bmm / baddbmm / softmax save: q, k, v, the softmax output
             and the attention weights after dropout
  linear     what F.linear saves: the inputs of every Linear, MultiheadAttention's in/out projections
  gelu       what F.gelu saves: its input
  dropout    what F.dropout saves: on the CPU, the scaled keep-mask (a float tensor, 0 or 1/(1-p))
  other      anything else eligible; here only the final LayerNorm's output, which torch 1.13's
             mean(dim=1) (the pooling) saves although its backward does not read the values
             (counted per step in each run's saves_seen_per_class_per_step)

The op rules of compress_saved are off here (``op_rules=False``): this script measures what
each class costs without them (docs/compressed-training.md). On torch 2.x with ``--dropout 0``,
MultiheadAttention runs fused attention, whose saves are the classes fused-qk (query and key),
fused-v, fused-out and, with the per-row statistics, its logsumexp.

Tensors under compress_saved's min_numel (1024 elements) are never compressed: at batch 64 the
LayerNorm mean / 1/std (64 x 16 rows) just qualify; in the last, smaller batch of an epoch they do
not.

Per run: final test accuracy, final train loss (mean over the last epoch), and the total gradient
norm every 10 steps. Usage (torch 1.13 from Debian, built library):

  PYTHONPATH=bindings/python ABP_LIBRARY=build/lib/libabp.so ABP_KERNEL_DIR=build/kernels \
      python3 bench/compress_ablation.py [--seeds 3] [--epochs 12] [--batch 64] [--lr 1e-3] [--out FILE]

The committed results: compress-ablation-cpu-*.json with --seeds 2 --epochs 6 (one run of 12
epochs takes 45-60 s on a 2-core CPU; 12 configurations x 3 seeds x 12 epochs would take over 30
minutes), and compress-ablation-12ep-cpu-*.json with --seeds 3 --epochs 12 --only exact,all.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import abp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real_tasks  # noqa: E402

CLASSES = ("stats", "layernorm", "attention", "fused-qk", "fused-v", "fused-out", "linear", "gelu", "dropout")

# ---------------------------------------------------------------------------------------------
# Which op is saving: wrappers around the functions the model's ops go through.
_current: List[str] = []


def _tagged(tag: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        _current.append(tag)
        try:
            return fn(*args, **kwargs)
        finally:
            _current.pop()
    wrapper.__wrapped__ = fn
    return wrapper


def install_tags() -> None:
    if getattr(F.linear, "__wrapped__", None) is not None:
        return
    F.linear = _tagged("linear", F.linear)
    F.layer_norm = _tagged("layernorm", F.layer_norm)
    F.softmax = _tagged("attention", F.softmax)
    F.dropout = _tagged("dropout", F.dropout)
    F.gelu = _tagged("gelu", F.gelu)
    torch.bmm = _tagged("attention", torch.bmm)
    torch.baddbmm = _tagged("attention", torch.baddbmm)
    if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2: MultiheadAttention's fused path
        F.scaled_dot_product_attention = _tagged("fused", F.scaled_dot_product_attention)


_fused_inputs_seen = [0]


def current_class(t: torch.Tensor) -> str:
    """The class of a tensor being saved (the pack hook runs inside the op that saves it)."""
    c = _current[-1] if _current else "other"
    # A normalisation's or attention's per-row statistics (LayerNorm's mean and 1/std, fused
    # attention's logsumexp) are outputs that carry no gradient.
    if c in ("layernorm", "attention", "fused") and t.grad_fn is None and not t.requires_grad:
        return "stats"
    if c != "fused":
        return c
    # Fused attention (torch >= 2, no dropout: the CPU flash kernel) saves its inputs key,
    # query, value in that order, then its output (whose grad_fn is the fused node itself).
    if "Attention" in type(t.grad_fn).__name__:
        _fused_inputs_seen[0] = 0
        return "fused-out"
    _fused_inputs_seen[0] += 1
    return "fused-qk" if _fused_inputs_seen[0] <= 2 else "fused-v"


# ---------------------------------------------------------------------------------------------
def load_digits_patches():
    """The digits split of real_tasks.py (scikit-learn's CSV read with numpy: no sklearn import)."""
    return real_tasks.digits()


def make_filter(mode: str, cls: Optional[str], counts: Dict[str, int]) -> Optional[Callable]:
    """mode: exact | all | only | except."""
    def filt(t: torch.Tensor) -> bool:
        c = current_class(t)
        k = c if c != "other" else f"other:{type(t.grad_fn).__name__}:{tuple(t.shape)}"
        counts[k] = counts.get(k, 0) + 1
        if mode == "all":
            return True
        if mode == "only":
            return c == cls
        return c != cls  # except
    return filt


def run(config: dict, seed: int, data, epochs: int, batch: int, lr: float = 1e-3, log_every: int = 10,
        dropout: float = 0.1) -> dict:
    xtr, ytr, xte, yte = data
    torch.manual_seed(seed)
    model = real_tasks.PatchTransformer(p=dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    mode, cls = config["mode"], config.get("cls")
    counts: Dict[str, int] = {}
    filt = make_filter(mode, cls, counts)
    gen = torch.Generator().manual_seed(1000 + seed)  # shuffling
    trace, step, last_losses, t0 = [], 0, [], time.time()
    nonfinite = False
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(ytr), generator=gen)
        last_losses = []
        for i in range(0, len(ytr), batch):
            idx = order[i : i + batch]
            xb, yb = xtr[idx], ytr[idx]
            ctx = contextlib.nullcontext() if mode == "exact" else abp.compress_saved(bits=2, allow_low_bits=True, filter=filt, op_rules=False)
            with ctx:
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            if step % log_every == 0:
                norms = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
                trace.append([step, float(torch.norm(torch.stack(norms)))])
            opt.step()
            last_losses.append(float(loss))
            if not math.isfinite(float(loss)):
                nonfinite = True
            step += 1
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return {
        "seed": seed,
        "test_acc": acc,
        "train_loss_last_epoch": sum(last_losses) / len(last_losses),
        "nonfinite_loss": nonfinite,
        "steps": step,
        "grad_norm_trace": trace,
        "grad_norm_max": max(g for _, g in trace),
        "grad_norm_last": trace[-1][1],
        "saves_seen_per_class_per_step": {k: v / step for k, v in sorted(counts.items())},
        "seconds": round(time.time() - t0, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--only", default=None, help="comma-separated config names (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    install_tags()
    data = load_digits_patches()
    configs = [{"name": "exact", "mode": "exact"}, {"name": "all", "mode": "all"}]
    configs += [{"name": f"only-{c}", "mode": "only", "cls": c} for c in CLASSES]
    configs += [{"name": f"except-{c}", "mode": "except", "cls": c} for c in CLASSES]
    if args.only:
        keep = set(args.only.split(","))
        configs = [c for c in configs if c["name"] in keep]
    results = []
    for cfg in configs:
        runs = []
        for s in range(args.seeds):
            r = run(cfg, s, data, args.epochs, args.batch, args.lr, dropout=args.dropout)
            runs.append(r)
            print(f"{cfg['name']:>18} seed {s}: acc {r['test_acc']:.3f} loss {r['train_loss_last_epoch']:.3f} "
                  f"gnorm max {r['grad_norm_max']:.3g} last {r['grad_norm_last']:.3g} ({r['seconds']} s)",
                  flush=True)
        accs = [r["test_acc"] for r in runs]
        results.append({**cfg, "mean_test_acc": sum(accs) / len(accs), "runs": runs})
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        commit = "unknown"
    out = {
        "what": "2-bit compress_saved ablation by saved-tensor class, digits pre-LN transformer",
        "date": datetime.datetime.utcnow().strftime("%Y-%m-%d"),
        "commit": commit,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} cpu, {os.cpu_count()} cores",
        "settings": {"bits": 2, "group_size": 256, "min_numel": 1024, "epochs": args.epochs,
                     "batch": args.batch, "seeds": args.seeds, "lr": args.lr, "threads": torch.get_num_threads(), "weight_decay": 0.01,
                     "d": 64, "heads": 4, "blocks": 2, "mlp": 256, "dropout": 0.1,
                     "train": len(data[1]), "test": len(data[3])},
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps([{k: r[k] for k in ("name", "mean_test_acc")} for r in results]))


if __name__ == "__main__":
    main()
