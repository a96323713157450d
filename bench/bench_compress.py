#!/usr/bin/env python3
"""GACT compression benchmark (issue #4, item 5).

1. Codec throughput: quantize+pack and unpack+dequantize of one large bf16 tensor at 1/2/4/8 bits,
   as effective bandwidth (bytes read + written) against the device's copy bandwidth (a clone).
2. Training step of a small pre-LN transformer encoder (BERT/ViT-style, bf16 autocast on a GPU):
   step time and saved activation bytes, exact vs `abp.compress_saved` at 8/4/2 bits, and with
   `abp.CompressionController` (average 4 bits) when it is available: its ordinary and probe steps.
3. Bias of backward formulas that are nonlinear in the compressed tensor (GELU input; ReLU output
   as plain codes, and with its exact 1-bit support, the default): the relative error of the mean
   weight gradient over several seeds.

Results go to bench/results/compress-<device>-<date>-<commit>.json. Not run by the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
import abp  # noqa: E402
import abp.compress as C  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import commit_id, median_time, write_results  # noqa: E402


def codec_throughput(n: int, device: torch.device, reps: int) -> Dict[str, Any]:
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    copy_s = median_time(lambda: x.clone(), device, reps)
    copy_bw = 2 * x.numel() * x.element_size() / copy_s
    out: Dict[str, Any] = {"n": n, "dtype": "bfloat16", "copy_bandwidth_GBps": copy_bw / 1e9}
    for bits in C.BITS:
        c = C.quantize(x, bits, seed=1)
        moved = x.numel() * x.element_size() + c.nbytes  # read x once, write codes and headers
        q_s = median_time(lambda: C.quantize(x, bits, seed=1), device, reps)
        d_s = median_time(lambda: C.dequantize(c), device, reps)
        out[f"b{bits}"] = {
            "quantize_s": q_s, "dequantize_s": d_s,
            "quantize_fraction_of_copy_bw": moved / q_s / copy_bw,
            "dequantize_fraction_of_copy_bw": moved / d_s / copy_bw,
        }
        print(f"  {bits}-bit: quantize {q_s * 1e6:.0f} us ({moved / q_s / copy_bw:.0%} of copy), "
              f"dequantize {d_s * 1e6:.0f} us ({moved / d_s / copy_bw:.0%})", flush=True)
    return out


def encoder(device: torch.device, d: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d, nhead=max(1, d // 64), dim_feedforward=4 * d, dropout=0.1,
                                             activation="gelu", batch_first=True, norm_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, layers), torch.nn.Linear(d, d)).to(device)


def autocast_for(device: torch.device) -> Any:
    """bf16 autocast on a GPU; plain fp32 on the CPU path."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def step_fn(model: torch.nn.Module, x: torch.Tensor, wrap: Callable[[], Any]) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with wrap():  # forward and backward in one block, as the controller requires
            with autocast_for(x.device):
                loss = model(x).float().square().mean()
            loss.backward()
    return step


def training_step(device: torch.device, batch: int, seq: int, d: int, layers: int, reps: int) -> Dict[str, Any]:
    model = encoder(device, d, layers)
    x = torch.randn(batch, seq, d, device=device)
    results: Dict[str, Any] = {"batch": batch, "seq": seq, "d_model": d, "layers": layers}
    exact_s = median_time(step_fn(model, x, contextlib.nullcontext), device, reps)
    counter = abp.memory.SavedTensorsCounter()
    with counter, autocast_for(device):
        model(x).float().square().mean()
    exact_bytes = counter.total_bytes
    results["exact"] = {"step_s": exact_s, "saved_bytes": exact_bytes}
    print(f"  exact: {exact_s * 1e3:.2f} ms/step, {exact_bytes / 2**20:.1f} MiB saved", flush=True)
    for bits in (8, 4, 2):
        ctx = C.compress_saved(bits=bits, allow_low_bits=True)
        s = median_time(step_fn(model, x, lambda: ctx), device, reps)
        with ctx, autocast_for(device):
            model(x).float().square().mean()
        stats = dict(ctx.stats)
        results[f"b{bits}"] = {"step_s": s, "overhead": s / exact_s - 1, "saved_bytes": stats["bytes_stored"],
                               "memory_ratio": exact_bytes / max(1, stats["bytes_stored"]), "stats": stats}
        print(f"  {bits}-bit: {s * 1e3:.2f} ms/step ({s / exact_s - 1:+.0%}), "
              f"{stats['bytes_stored'] / 2**20:.1f} MiB saved ({exact_bytes / max(1, stats['bytes_stored']):.1f}x less)",
              flush=True)
    controller_cls = getattr(abp, "CompressionController", None)
    if controller_cls is not None:
        interval = 10**9  # estimate once (step 0), then time ordinary steps
        ctl = controller_cls(model, avg_bits=4.0, interval=interval)
        first = step_fn(model, x, lambda: ctl)
        import time
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        first()  # step 0: runs the sensitivity probes
        if device.type == "cuda":
            torch.cuda.synchronize()
        probe_s = time.perf_counter() - t0
        s = median_time(first, device, reps)
        results["controller_avg4"] = {"step_s": s, "overhead": s / exact_s - 1, "probe_step_s": probe_s,
                                      "average_bits": ctl.average_bits(), "tensors": len(ctl.bits)}
        print(f"  controller (avg 4 bits): {s * 1e3:.2f} ms/step ({s / exact_s - 1:+.0%}); probe step "
              f"{probe_s:.2f} s over {len(ctl.bits)} tensors; average {ctl.average_bits():.2f} bits", flush=True)
        ctl.remove()
    return results


def profile_step(device: torch.device, batch: int, seq: int, d: int, layers: int) -> None:
    """Where a 4-bit compressed step spends its time: Python (cProfile) and the device (torch.profiler)."""
    import cProfile
    import pstats

    model = encoder(device, d, layers)
    x = torch.randn(batch, seq, d, device=device)
    step = step_fn(model, x, lambda: C.compress_saved(bits=4))
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15))


def nonlinear_bias(device: torch.device, runs: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256).to(device)
    x = torch.randn(128, 256, device=device)
    dy = torch.randn(128, 256, device=device)
    out: Dict[str, Any] = {}
    cases = (("gelu_input", F.gelu, True), ("relu_output_plain_codes", torch.relu, False),
             ("relu_output_exact_support", torch.relu, True))
    for name, act, exact_relu in cases:
        lin.zero_grad()
        act(lin(x)).backward(dy)
        exact = lin.weight.grad.double().clone()
        row: Dict[str, float] = {}
        for bits in C.BITS:
            acc = torch.zeros_like(exact)
            for r in range(runs):
                torch.manual_seed(r)
                lin.zero_grad()
                # Only the activation's saved tensor: the Linear's saved input stays exact, so
                # the error is the activation backward's alone.
                with C.compress_saved(bits=bits, allow_low_bits=True, min_numel=1, filter=lambda t: t.data_ptr() != x.data_ptr(),
                                      exact_relu=exact_relu):
                    act(lin(x)).backward(dy)
                acc += lin.weight.grad.double()
            row[f"b{bits}"] = float((acc / runs - exact).norm() / exact.norm())
        out[name] = row
        print(f"  {name}: relative bias of dW over {runs} seeds: " +
              ", ".join(f"{k} {v:.2e}" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--log2-n", type=int, default=None, help="codec tensor size (GPU 28, CPU 22)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="also profile a 4-bit compressed step")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    n = 1 << (args.log2_n or (28 if gpu else 22))
    batch = args.batch or (32 if gpu else 4)
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    results: Dict[str, Any] = {"device": name, "date": datetime.date.today().isoformat(),
                               "commit": commit_id(ROOT), "torch": torch.__version__}
    print("codec throughput", flush=True)
    results["codec"] = codec_throughput(n, device, args.reps)
    print("training step", flush=True)
    results["step"] = training_step(device, batch, 256 if gpu else 64, 768 if gpu else 128, 6 if gpu else 2,
                                    args.reps if gpu else 3)
    if args.profile:
        profile_step(device, batch, 256 if gpu else 64, 768 if gpu else 128, 6 if gpu else 2)
    print("nonlinear bias", flush=True)
    results["bias"] = nonlinear_bias(device, 64 if gpu else 16)
    write_results(results, ROOT, "compress-", args.out or "")


if __name__ == "__main__":
    main()
