"""What closes the 2-bit gap? Each of compress_saved's mechanisms turned off in turn (measurement, CPU).

The language model and the digits classifier of bench/real_tasks.py train with
`abp.compress_saved(bits=2)` (every saved tensor at 2 bits) and these variants:

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


#: Each variant: (recompute, the knob it turns while the run trains).
VARIANTS: Dict[str, Any] = {
    "stored": (False, contextlib.nullcontext),
    "full": (True, contextlib.nullcontext),
    "no-attention": (True, lambda: _patched(_save_rules, "recomputable_attention", lambda node: False)),
    "attention-only": (True, lambda: _patched(_derived, "kind_of", lambda func: None)),
    "row-statistics": (True, lambda: _patched(C, "DERIVE_ROW_STATISTICS", True)),
    "log-codes": (True, lambda: _patched(C, "_LOG_PROBABILITY_PRODUCERS", frozenset())),
}
METRIC = {"digits": "test_accuracy", "charlm": "val_loss"}


def run(task: str, variant: str, bits: int, seed: int, steps: Any) -> Dict[str, Any]:
    recompute, knob = VARIANTS[variant]

    def context(model: torch.nn.Module, spec: real_tasks.Task) -> Callable[[], Any]:
        return lambda: abp.compress_saved(bits=bits, allow_low_bits=True, recompute=recompute)

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
