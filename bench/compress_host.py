#!/usr/bin/env python3
"""compress_saved's host time per training step on bench_compress's encoder (issue #16, item 2).

On the CPU path the codec's kernels run on the host too, so a compressed step's extra time is
split in two: the kernels (the time spent inside the runtime's launch calls, counted in a second,
instrumented pass) and the rest, which is compress_saved's own host time: its pack and unpack
hooks, their bookkeeping, the recorder's torch function mode and the allocations around the
launches. On a GPU that rest is what delays the step; it is the number item 2 asks to shrink.

Run it twice side by side (this package and another, PYTHONPATH first) to compare two commits:
the numbers of one run are thread CPU time, best of `--rounds` rounds of `--steps` steps.
Prints one JSON line; not run by the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict

import torch

import abp  # noqa: E402  (first: bench_compress puts this checkout's package on the path)
import abp._lib as _lib  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_compress  # noqa: E402
from timing import commit_id, write_results  # noqa: E402


def best_step_time(step: Callable[[], None], steps: int, rounds: int) -> float:
    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(steps):
            step()
        best = min(best, (time.thread_time() - start) / steps)
    return best


@contextlib.contextmanager
def timing(owner: Any, name: str, totals: Dict[str, float], key: str) -> Any:
    """Adds the thread time spent inside owner.name to totals[key + "_ns"], its calls to totals[key];
    a call made inside another timed under the same key (dequantize decoding a support mask) is
    part of that one."""
    original = getattr(owner, name)
    depth = totals.setdefault(key + "_depth", 0)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if totals[key + "_depth"]:
            return original(*args, **kwargs)
        totals[key + "_depth"] = 1
        start = time.thread_time_ns()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key + "_ns"] += time.thread_time_ns() - start
            totals[key] += 1
            totals[key + "_depth"] = depth

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def counting_launches(totals: Dict[str, float]) -> Any:
    """Adds the thread time spent inside abp._lib.launch (the kernels, on the CPU path) to
    totals["kernel_ns"], the calls to totals["launches"]."""
    return timing(_lib, "launch", totals, "kernel")


def measure(d: int, layers: int, batch: int, seq: int, bits: int, steps: int, rounds: int) -> Dict[str, Any]:
    model = bench_compress.encoder(torch.device("cpu"), d, layers)
    x = torch.randn(batch, seq, d)
    exact = best_step_time(bench_compress.step_fn(model, x, contextlib.nullcontext), steps, rounds)
    compressed_step = bench_compress.step_fn(model, x, lambda: abp.compress_saved(bits=bits))
    compressed = best_step_time(compressed_step, steps, rounds)
    # Without the recorder (recompute=False): what its torch function mode costs the forward.
    plain = best_step_time(bench_compress.step_fn(model, x, lambda: abp.compress_saved(bits=bits, recompute=False)),
                           steps, rounds)
    totals = {"kernel_ns": 0.0, "kernel": 0, "codec_ns": 0.0, "codec": 0}
    with counting_launches(totals), timing(abp.compress, "quantize_unchecked", totals, "codec"), \
            timing(abp.compress, "dequantize", totals, "codec"):
        for _ in range(steps):
            compressed_step()
    kernels = totals["kernel_ns"] / steps / 1e9
    extra = compressed - exact
    return {"d_model": d, "layers": layers, "batch": batch, "seq": seq, "bits": bits,
            "exact_step_ms": exact * 1e3, "compressed_step_ms": compressed * 1e3, "extra_ms": extra * 1e3,
            "kernels_ms": kernels * 1e3, "launches_per_step": totals["kernel"] / steps,
            "host_ms": (extra - kernels) * 1e3,
            # Of the host time: the recorder's mode, and the codec calls' own work around their launches.
            "recorder_ms": (compressed - plain) * 1e3,
            "codec_host_ms": (totals["codec_ns"] - totals["kernel_ns"]) / steps / 1e6,
            "codec_calls_per_step": totals["codec"] / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--write", action="store_true",
                        help="also write bench/results/compress-host-torch<major>-cpu-<date>-<commit>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the encoder's nested-tensor notice
    rows = []
    for d in args.d_model:
        row = measure(d, 2, 4, 64, args.bits, args.steps, args.rounds)
        row.update(torch=torch.__version__, package=os.path.dirname(abp.__file__))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.write:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        major = "2" if not torch.__version__.startswith("1.") else torch.__version__[:4]
        write_results({"device": "cpu", "date": datetime.date.today().isoformat(),
                                      "commit": commit_id(root), "torch": torch.__version__,
                                      "steps": args.steps, "rounds": args.rounds, "rows": rows},
                                     root, f"compress-host-torch{major}-")


if __name__ == "__main__":
    main()
