"""Compressed training against exact training on two real tasks (bench/real_tasks.py), several seeds.

For each task and setting: the final metric (digits: test accuracy; charlm: validation loss in
nats per byte) per seed, its mean, the exact runs' spread, whether the setting is within it, the
saved activation bytes of a step (as stored), the step time (forward + backward, CPU), the
largest gradient norm seen, and whether the divergence guard warned. Usage (torch 2.x lane):

  PYTHONPATH=bindings/python ABP_LIBRARY=build/lib/libabp.so ABP_KERNEL_DIR=build/kernels \\
      ~/.cache/abp/venv-torch2/bin/python bench/bench_compressed_training.py \\
      [--tasks digits,charlm] [--settings exact,compress-4,...] [--seeds 3] [--steps N] [--out FILE]

The committed results are bench/results/compressed-training-cpu-<date>-<commit>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_tasks  # noqa: E402
from timing import commit_id  # noqa: E402

METRIC = {"digits": ("test_accuracy", +1), "digits-vit": ("test_accuracy", +1), "charlm": ("val_loss", -1)}


def summarise(task: str, runs: Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Per setting: mean metric, seeds, and whether it is within the exact runs' spread (as good as
    the worst exact seed, or better)."""
    metric, sign = METRIC[task]
    exact = [r[metric] for r in runs.get("exact", [])]
    worst = min(exact, key=lambda v: sign * v) if exact else None
    rows = []
    for setting, rs in runs.items():
        values = [r[metric] for r in rs]
        mean = statistics.mean(values)
        rows.append({
            "setting": setting,
            metric: values,
            f"mean_{metric}": mean,
            "within_exact_spread": None if worst is None else sign * mean >= sign * worst,
            "saved_bytes": rs[0]["saved_bytes"],
            "step_ms": statistics.mean(r["step_ms"] for r in rs),
            "grad_norm_max": max(r["grad_norm_max"] for r in rs),
            "divergence_warnings": sum(r["divergence_warning"] is not None for r in rs),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="digits,charlm")
    ap.add_argument("--settings", default=",".join(real_tasks.SETTINGS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: each task's own)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the model and data live")
    ap.add_argument("--stdlib", default=None, help="charlm's corpus: this directory's *.py (default: this Python's stdlib)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    commit = commit_id(str(Path(__file__).resolve().parents[1]))  # the code this run loads: HEAD now
    results: Dict[str, Any] = {}
    for task in args.tasks.split(","):
        runs: Dict[str, List[Dict[str, Any]]] = {}
        for setting in args.settings.split(","):
            for seed in range(args.seeds):
                r = real_tasks.train(task, setting, seed, steps=args.steps, device=args.device,
                                     stdlib=args.stdlib)
                runs.setdefault(setting, []).append(r)
                metric = METRIC[task][0]
                print(f"{task:>7} {setting:>20} seed {seed}: {metric} {r[metric]:.4f}  saved {r['saved_bytes'] / 2**20:.2f} MiB"
                      f"  {r['step_ms']:.1f} ms/step  max |g| {r['grad_norm_max']:.3g}"
                      f"{'  DIVERGENCE WARNING' if r['divergence_warning'] else ''}", flush=True)
        results[task] = {"summary": summarise(task, runs), "runs": runs}
        for row in results[task]["summary"]:
            metric = METRIC[task][0]
            print(f"{task:>7} {row['setting']:>20}: mean {row[f'mean_{metric}']:.4f}  within exact spread: "
                  f"{row['within_exact_spread']}  saved {row['saved_bytes'] / 2**20:.2f} MiB  {row['step_ms']:.1f} ms/step",
                  flush=True)
    out = {
        "what": "compressed vs exact training on real data (bench/real_tasks.py)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": (torch.cuda.get_device_name() if args.device.startswith("cuda") else
                    f"{platform.machine()} cpu, {os.cpu_count()} cores, {torch.get_num_threads()} threads"),
        "seeds": args.seeds,
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
