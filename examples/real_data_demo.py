"""Trains a small transformer on real data (scikit-learn's digits) exact and with compressed saves.

    PYTHONPATH=bindings/python python3 examples/real_data_demo.py [--steps 88] [--seeds 1]

The digits task of bench/real_tasks.py (1,437 training images as 16 patches, 360 held out), the
same seed and data for each setting: exact; ``abp.compress_saved`` at 8, 4 and 2 bits (2 bits
needs ``allow_low_bits=True``), and at 4 bits without recomputing what cheap ops derive
(``recompute=False``); ``abp.CompressionController`` at an average of 4 and 2 bits. Prints each
one's test accuracy, the bytes a step saves for backward (counted by ``abp.memory``), the step time, and
whether the divergence guard warned. bench/bench_compressed_training.py runs the full comparison
(both tasks, several seeds); docs/compressed-training.md has its results.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import real_tasks  # noqa: E402

SETTINGS = ("exact", "compress-8", "compress-4", "compress-4-no-recompute", "compress-2", "controller-4",
            "controller-2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=88, help="training steps (22 per epoch)")
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args()
    print(f"digits (scikit-learn), pre-LN transformer, {args.steps} steps, {args.seeds} seed(s); "
          f"test accuracy on 360 held-out images:")
    exact_bytes = None
    for setting in SETTINGS:
        runs = [real_tasks.train("digits", setting, seed, steps=args.steps) for seed in range(args.seeds)]
        accuracy = statistics.mean(r["test_accuracy"] for r in runs)
        saved = runs[0]["saved_bytes"]
        exact_bytes = exact_bytes or saved
        warned = any(r["divergence_warning"] for r in runs)
        print(f"  {setting:<23} accuracy {100 * accuracy:5.1f} %  saved {saved / 2**20:6.2f} MiB "
              f"({exact_bytes / saved:4.1f}x less)  {statistics.mean(r['step_ms'] for r in runs):6.1f} ms/step"
              f"{'  (divergence guard warned)' if warned else ''}  [{real_tasks.recipe(setting).label}]")


if __name__ == "__main__":
    main()
