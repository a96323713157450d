#!/usr/bin/env python3
"""Norm benchmark: abp's MS-LayerNorm / MS-RMSNorm row kernels vs PyTorch (issue #3, item 8).

For rows x cols in {4096..65536} x {768, 1024, 4096, 8192} (bf16 by default) it times forward and
forward+backward of abp.functional.ms_layer_norm / ms_rms_norm against torch's fused LayerNorm
(F.layer_norm without affine), an eager RMSNorm written in torch ops (torch.nn.functional.rms_norm
where it exists) and, on a GPU, torch.compile of both. Effective bandwidth counts the bytes a
fused implementation must move (forward: read x, write y; backward: read y and dy, write dx, plus
the per-row statistics) and is reported as a fraction of the device's measured copy bandwidth.
Results go to bench/results/norms-<device>-<date>-<commit>.json.

Not run by the tests: numbers live here, not in timed tests.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
import abp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import commit_id, median_time, write_results  # noqa: E402


def torch_rms_norm(x: torch.Tensor, cols: int, eps: float) -> torch.Tensor:
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (cols,), eps=eps)
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def implementations(cols: int, use_compile: bool) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    impls: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "abp_ms_layernorm": lambda x: abp.functional.ms_layer_norm(x, cols, 1e-5),
        "torch_layernorm": lambda x: F.layer_norm(x, (cols,), eps=1e-5),
        "abp_ms_rmsnorm": lambda x: abp.functional.ms_rms_norm(x, cols, 1e-6),
        "torch_rmsnorm": lambda x: torch_rms_norm(x, cols, 1e-6),
    }
    if use_compile:
        impls["compiled_layernorm"] = torch.compile(impls["torch_layernorm"])
        impls["compiled_rmsnorm"] = torch.compile(impls["torch_rmsnorm"])
    return impls


def bench_shape(rows: int, cols: int, dtype: torch.dtype, device: torch.device, reps: int,
                use_compile: bool, copy_bw: float) -> Dict[str, object]:
    x = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(rows, cols, device=device, dtype=dtype)
    size = x.element_size()
    fwd_bytes = 2 * rows * cols * size + 4 * rows
    bwd_bytes = 3 * rows * cols * size + 4 * rows
    row: Dict[str, object] = {"rows": rows, "cols": cols}
    for name, fn in implementations(cols, use_compile).items():
        with torch.no_grad():
            fwd = median_time(lambda: fn(x), device, reps)

        def step() -> None:
            y = fn(x)
            torch.autograd.grad(y, x, g)

        both = median_time(step, device, reps)
        row[name] = {
            "fwd_s": fwd,
            "fwd_bwd_s": both,
            "fwd_fraction_of_copy_bw": fwd_bytes / fwd / copy_bw,
            "fwd_bwd_fraction_of_copy_bw": (fwd_bytes + bwd_bytes) / both / copy_bw,
        }
    return row


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Bytes/s of a clone of 2^26 bf16 elements (read + write): the roofline of one pass."""
    x = torch.empty(1 << 26, device=device, dtype=torch.bfloat16)
    t = median_time(lambda: x.clone(), device, reps)
    return 2 * x.numel() * x.element_size() / t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rows", default="4096,16384,65536")
    parser.add_argument("--cols", default="768,1024,4096,8192")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    parser.add_argument("--out", default=None, help="result file (default bench/results/...)")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    use_compile = not args.no_compile and hasattr(torch, "compile") and device.type == "cuda"
    commit = commit_id(ROOT)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = copy_bandwidth(device, args.reps)
    results: Dict[str, object] = {
        "device": name, "date": datetime.date.today().isoformat(), "commit": commit,
        "torch": torch.__version__, "dtype": args.dtype, "copy_bandwidth_bytes_per_s": bw, "shapes": [],
    }
    shapes: List[Dict[str, object]] = results["shapes"]  # type: ignore[assignment]
    for rows in (int(r) for r in args.rows.split(",")):
        for cols in (int(c) for c in args.cols.split(",")):
            shapes.append(bench_shape(rows, cols, dtype, device, args.reps, use_compile, bw))
            print(json.dumps(shapes[-1]), flush=True)
    write_results(results, ROOT, "norms-", args.out or "")


if __name__ == "__main__":
    main()
