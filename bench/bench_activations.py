#!/usr/bin/env python3
"""Activation benchmark: abp kernels vs PyTorch eager and torch.compile (issue #2, item 10).

For each size (bf16 by default, 2^24..2^28 elements on a GPU) it times forward and forward+backward
of abp's ReGELU2, ReSiLU2, 3-bit GELU and ReLU against torch's exact GELU/SiLU/ReLU (eager and
torch.compile), and reports effective bandwidth as a fraction of the device's measured copy
bandwidth (a clone of the same tensor: the roofline of a pass that reads and writes each element
once). It also measures the NVRTC cold compile, the warm disk-cache load (in a fresh process) and
the per-call host overhead of a Python launch. Results go to bench/results/<device>-<date>.json
with the commit, torch version and device name.

Not run by the tests: numbers live here, not in timed tests.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
import abp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import commit_id, median_time, write_results  # noqa: E402


def timer(device: torch.device) -> Callable[[Callable[[], None], int], float]:
    """Returns a function timing `fn` (seconds per call, median of `reps` after warm-up)."""
    return lambda fn, reps: median_time(fn, device, reps)


def bits_of(name: str) -> int:
    return {"regelu2": 2, "resilu2": 2, "gelu3": 3, "relu": 1}[name]


def abp_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return {
        "regelu2": abp.functional.regelu2,
        "resilu2": abp.functional.resilu2,
        "gelu3": lambda x: abp.functional.gelu(x, bits=3),
        "relu": abp.functional.relu,
    }[name]


def torch_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return {"regelu2": F.gelu, "resilu2": F.silu, "gelu3": F.gelu, "relu": F.relu}[name]


def bench_size(n: int, dtype: torch.dtype, device: torch.device, reps: int,
               use_compile: bool) -> Dict[str, object]:
    run = timer(device)
    esize = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(n, device=device, dtype=dtype)
    dy = torch.randn(n, device=device, dtype=dtype)
    copy_s = run(lambda: x.clone(), reps)
    copy_bw = 2 * n * esize / copy_s
    out: Dict[str, object] = {"n": n, "copy_bandwidth_GBps": copy_bw / 1e9, "ops": {}}
    for name in ["regelu2", "resilu2", "gelu3", "relu"]:
        code_bytes = math.ceil(bits_of(name) * n / 8)
        f = abp_fn(name)
        fwd_s = run(lambda: f(x), reps)
        xr = x.detach().requires_grad_(True)

        def fwd_bwd(fn=f) -> None:
            y = fn(xr)
            y.backward(dy)
            xr.grad = None

        fb_s = run(fwd_bwd, reps)
        bwd_s = fb_s - fwd_s  # the backward kernel alone, estimated
        fwd_bytes = 2 * n * esize + code_bytes  # read x, write y, write codes
        bwd_bytes = 2 * n * esize + code_bytes  # read codes and dy, write dx
        entry = {
            "abp_fwd_s": fwd_s, "abp_fwd_bwd_s": fb_s, "abp_bwd_s_est": bwd_s,
            "abp_fwd_GBps": fwd_bytes / fwd_s / 1e9,
            "abp_fwd_roofline": fwd_bytes / fwd_s / copy_bw,
            "abp_bwd_roofline_est": bwd_bytes / max(bwd_s, 1e-12) / copy_bw,
        }
        t = torch_fn(name)
        entry["eager_fwd_s"] = run(lambda: t(x), reps)

        def eager_fb(fn=t) -> None:
            y = fn(xr)
            y.backward(dy)
            xr.grad = None

        entry["eager_fwd_bwd_s"] = run(eager_fb, reps)
        if use_compile:
            ct = torch.compile(t)
            entry["compile_fwd_s"] = run(lambda: ct(x), reps)

            def compile_fb(fn=ct) -> None:
                y = fn(xr)
                y.backward(dy)
                xr.grad = None

            entry["compile_fwd_bwd_s"] = run(compile_fb, reps)
        out["ops"][name] = entry  # type: ignore[index]
    return out


def host_overhead(device: torch.device, reps: int = 2000) -> float:
    """Seconds of host time per abp forward call on a tiny tensor (Python + C API + launch)."""
    x = torch.randn(1024, device=device)
    for _ in range(50):
        abp.functional.regelu2(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        abp.functional.regelu2(x)
    elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return elapsed / reps


def compile_times(device: torch.device) -> Dict[str, float]:
    """NVRTC cold compile (empty cache) and warm disk-cache load (fresh process)."""
    code = (
        "import sys, time, torch; sys.path.insert(0, %r); import abp; "
        "x = torch.randn(1024, device='cuda'); t0 = time.perf_counter(); "
        "abp.functional.regelu2(x); torch.cuda.synchronize(); print(time.perf_counter() - t0)"
        % os.path.join(ROOT, "bindings", "python"))
    abp.cache.clear()
    cold = float(subprocess.check_output([sys.executable, "-c", code]).decode().split()[-1])
    warm = float(subprocess.check_output([sys.executable, "-c", code]).decode().split()[-1])
    return {"first_call_cold_cache_s": cold, "first_call_warm_disk_cache_s": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--log2-sizes", default="24,26,28",
                        help="comma-separated log2 element counts (GPU default 24,26,28)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    parser.add_argument("--out", default=None, help="result file (default bench/results/...)")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    use_compile = not args.no_compile and hasattr(torch, "compile") and device.type == "cuda"
    sizes = [1 << int(s) for s in args.log2_sizes.split(",")]
    commit = commit_id(ROOT)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: Dict[str, object] = {
        "device": name, "date": datetime.date.today().isoformat(), "commit": commit,
        "torch": torch.__version__, "dtype": args.dtype, "sizes": [],
        "host_overhead_per_call_s": host_overhead(device),
    }
    if device.type == "cuda":
        results["compile"] = compile_times(device)
    rows: List[Dict[str, object]] = results["sizes"]  # type: ignore[assignment]
    for n in sizes:
        rows.append(bench_size(n, dtype, device, args.reps, use_compile))
        print(json.dumps(rows[-1], indent=1))
    write_results(results, ROOT, "", args.out or "")


if __name__ == "__main__":
    main()
