"""What closes the 2-bit gap? Each of compress_saved's mechanisms turned off in turn (measurement, CPU).

The language model and the digits classifier of bench/real_tasks.py train with every saved tensor
at 2 bits (`abp.compress_saved(bits_for=lambda t: 2)`: per-tensor widths, so the floors that one
width for every tensor adds do not apply; those that keep training stable do) and these variants:

  stored          recompute=False: every saved tensor stored as its own codes (fused attention's
                  query and key at 8 bits by the op rules, its output and logsumexp stored)
  full            recompute=True (the default): what cheap functions made from stored tensors is
                  recomputed in backward, fused attention's output and logsumexp from the decoded
                  query, key and value, log_softmax's output stored as probabilities
  no-attention    full, but fused attention's output and logsumexp stored (its query and key at
                  8 bits again)
  attention-only  full, but no cheap function recomputed (only fused attention's output and
                  logsumexp)
  row-statistics  full, and per-row statistics (a norm's 1/rms) recomputed from the decoded rows
  log-codes       full, but log_softmax's output stored as codes of the log-probabilities
                  themselves (as every other tensor is)

and, to see what fused attention's backward needs, attention written as an autograd.Function of
its own (what a fused kernel computes, with causal softmax; it saves q, k, v, its output and the
row logsumexp, all compressed but the logsumexp), language model only:

  manual-lse      its backward as the fused kernels': P = exp(q kᵀ·s − lse) with the stored
                  logsumexp, D = rowsum(dO ∘ O) with the stored output
  manual-output   P = softmax(q kᵀ·s) from the decoded q and k, D with the stored output
  manual-none     P = softmax(q kᵀ·s), D = rowsum(P ∘ dP): nothing stored that must agree with q, k, v

Per run: the final metric, the saved bytes of a step, the largest gradient norm, the gradient-norm
trace (every 10 steps) and whether the divergence guard warned. The variants reach into abp's
internals (a knob each, restored after the run); they measure, they are not settings to use.
Usage (torch 2.x lane):

  PYTHONPATH=bindings/python ABP_LIBRARY=build/lib/libabp.so ABP_KERNEL_DIR=build/kernels \\
      ~/.cache/abp/venv-torch2/bin/python bench/consistency_ablation.py \\
      [--tasks charlm,digits] [--variants ...] [--seeds 2] [--steps N] [--bits 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import torch

import abp
from abp import _derived, _save_rules
from abp import compress as C

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_tasks  # noqa: E402


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class _ManualAttention(torch.autograd.Function):
    """Causal attention whose backward reads its saved logsumexp and output or not (`mode`)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(_future(q), float("-inf"))
        lse = torch.logsumexp(scores, -1, keepdim=True)
        out = torch.exp(scores - lse) @ v
        ctx.mode = mode
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        scale = 1 / math.sqrt(q.shape[-1])
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(_future(q), float("-inf"))
        p = torch.exp(scores - lse) if ctx.mode == "lse" else torch.softmax(scores, -1)
        d_p = d_out @ v.transpose(-1, -2)
        d = (p * d_p).sum(-1, keepdim=True) if ctx.mode == "none" else (d_out * out).sum(-1, keepdim=True)
        d_s = p * (d_p - d)
        return d_s @ k * scale, d_s.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ d_out, None


def _future(q: torch.Tensor) -> torch.Tensor:
    n = q.shape[-2]
    return torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)


def _manual(mode: str) -> Callable[[], Any]:
    return lambda: _patched(real_tasks, "_causal_attention", lambda q, k, v: _ManualAttention.apply(q, k, v, mode))


#: Each variant: (recompute, the knob it turns while the run trains).
VARIANTS: Dict[str, Any] = {
    "stored": (False, contextlib.nullcontext),
    "full": (True, contextlib.nullcontext),
    "no-attention": (True, lambda: _patched(_save_rules, "recomputable_attention", lambda node: False)),
    "attention-only": (True, lambda: _patched(_derived, "kind_of", lambda func: None)),
    "row-statistics": (True, lambda: _patched(C, "DERIVE_ROW_STATISTICS", True)),
    "log-codes": (True, lambda: _patched(C, "_LOG_PROBABILITY_PRODUCERS", frozenset())),
    "manual-lse": (True, _manual("lse")),
    "manual-output": (True, _manual("output")),
    "manual-none": (True, _manual("none")),
}
#: Variants that replace the language model's attention.
MANUAL = ("manual-lse", "manual-output", "manual-none")
METRIC = {"digits": "test_accuracy", "charlm": "val_loss"}


def run(task: str, variant: str, bits: int, seed: int, steps: Any) -> Dict[str, Any]:
    recompute, knob = VARIANTS[variant]

    def context(model: torch.nn.Module, spec: real_tasks.Task) -> Callable[[], Any]:
        return lambda: abp.compress_saved(bits_for=lambda t: bits, recompute=recompute)

    setting = real_tasks.Recipe(f"{variant}-{bits}", f"compress_saved(bits={bits}) {variant}", context=context)
    with knob():
        return real_tasks.train(task, setting, seed, steps=steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="charlm,digits")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: each task's own)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    results: Dict[str, Any] = {}
    for task in args.tasks.split(","):
        metric = METRIC[task]
        exact = [real_tasks.train(task, "exact", seed, steps=args.steps) for seed in range(args.seeds)]
        rows: Dict[str, List[Dict[str, Any]]] = {"exact": exact}
        for variant in args.variants.split(","):
            if task != "charlm" and variant in MANUAL:
                continue
            rows[variant] = [run(task, variant, args.bits, seed, args.steps) for seed in range(args.seeds)]
        results[task] = {}
        for variant, rs in rows.items():
            values = [r[metric] for r in rs]
            results[task][variant] = {
                metric: values, f"mean_{metric}": statistics.mean(values), "saved_bytes": rs[0]["saved_bytes"],
                "grad_norm_max": max(r["grad_norm_max"] for r in rs),
                "divergence_warnings": sum(r["divergence_warning"] is not None for r in rs),
                "grad_norm_traces": [r["grad_norm_trace"] for r in rs],
            }
            print(f"{task:>7} {variant:>15}: {metric} {statistics.mean(values):.4f} ({', '.join(f'{v:.4f}' for v in values)})"
                  f"  saved {rs[0]['saved_bytes'] / 2**20:.2f} MiB  max |g| {results[task][variant]['grad_norm_max']:.3g}"
                  f"  warnings {results[task][variant]['divergence_warnings']}", flush=True)
    out = {
        "what": f"compress_saved(bits={args.bits}) with each mechanism off in turn (bench/consistency_ablation.py)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit, "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()} cpu, {os.cpu_count()} cores, {torch.get_num_threads()} threads",
        "seeds": args.seeds, "steps": args.steps, "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
