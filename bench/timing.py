"""Timing shared by the benchmarks: median of timed calls after warm-up (CUDA events on a GPU)."""
from __future__ import annotations

import os
import subprocess
import time
from typing import Callable

import torch


def median_time(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    """Seconds per call of `fn`: median of `reps` timed calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def commit_id(root: str) -> str:
    """The commit the numbers belong to: $BENCH_COMMIT where the tree travels without .git (to a
    lent GPU machine; not an ABP_* name, which the runtime would warn about), else
    `git rev-parse --short HEAD`."""
    return os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def write_results(results: dict, root: str, prefix: str, out: str = "") -> str:
    """Writes `results` (with "device", "date", "commit") as JSON to `out`, by default
    bench/results/<prefix><device>-<date>-<commit>.json; returns the path."""
    import json

    path = out or os.path.join(root, "bench", "results",
                               f"{prefix}{str(results['device']).replace(' ', '_')}-{results['date']}-{results['commit']}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")
    return path
