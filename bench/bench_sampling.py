#!/usr/bin/env python3
"""Sampled linear layers benchmark (issue #5, item 4).

1. Kernels: row norms and gather-and-scale (abp.sample) of a bf16 token matrix, as effective
   bandwidth against the device's copy bandwidth (a clone).
2. A small T5-style encoder (pre-LN, T5's layer names, bf16 autocast on a GPU): saved activation
   bytes (saved-tensor hooks, parameters left out, each storage once), peak memory (GPU) and step
   time, exact vs WTA-CRS at keep 0.3 and 0.1 (abp.convert(recipe="sampled"): attention output
   and FFN sampled, Q/K/V exact), plus CRS and the Gaussian sketch at 0.3.
3. VCAS on the same model: the controller's GEMM-FLOPs ratio and the step time at fixed ratios
   (ρ = ν = 0.5 and 0.25 planted in every sampler, as a converged schedule might be), and the
   time of one calibration (M = 2).

Results go to bench/results/sampling-<device>-<date>-<commit>.json. Not run by the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
import abp  # noqa: E402
from abp import _sample_kernels as kernels  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import commit_id, median_time, write_results  # noqa: E402


class Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x))) \
            if hasattr(F, "scaled_dot_product_attention") else \
            torch.softmax(split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / (d // self.heads) ** 0.5, -1) @ split(self.v(x))
        return self.o(a.transpose(1, 2).reshape(b, t, d))


class FeedForward(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.wi = torch.nn.Linear(d, 4 * d, bias=False)
        self.act = torch.nn.GELU()
        self.wo = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi(x)))


class T5Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.SelfAttention = Attention(d, heads)
        self.DenseReluDense = FeedForward(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.SelfAttention(self.norm1(x))
        return x + self.DenseReluDense(self.norm2(x))


def encoder(device: torch.device, d: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [T5Block(d, max(1, d // 64)) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.LayerNorm(d), torch.nn.Linear(d, d)).to(device)


def autocast_for(device: torch.device) -> Any:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def step_fn(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast_for(x.device):
            loss = model(x).float().square().mean()
        loss.backward()
    return step


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes saved for backward by one step (abp.memory.report: each storage once, parameters out)."""
    with autocast_for(x.device):
        return abp.memory.report(model, x, loss_fn=lambda y: y.float().square().mean()).total_bytes


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device)


def measure(name: str, model: torch.nn.Module, x: torch.Tensor, reps: int, base: Dict[str, Any]) -> Dict[str, Any]:
    step = step_fn(model, x)
    s = median_time(step, x.device, reps)
    out = {"step_s": s, "saved_bytes": saved_bytes(model, x), "peak_bytes": peak_bytes(step, x.device)}
    if base:
        out["saved_reduction"] = base["saved_bytes"] / max(1, out["saved_bytes"])
        out["step_time_ratio"] = s / base["step_s"]
        if base["peak_bytes"]:
            out["peak_reduction"] = base["peak_bytes"] / max(1, out["peak_bytes"])
    print(f"  {name}: {s * 1e3:.2f} ms/step, {out['saved_bytes'] / 2**20:.1f} MiB saved"
          + (f" ({out['saved_reduction']:.2f}x less), peak {out['peak_bytes'] / 2**20:.0f} MiB" if base else ""), flush=True)
    return out


def kernel_throughput(rows: int, cols: int, device: torch.device, reps: int) -> Dict[str, Any]:
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    copy_s = median_time(lambda: x.clone(), device, reps)
    copy_bw = 2 * x.numel() * x.element_size() / copy_s
    k = rows * 3 // 10
    index = torch.randperm(rows, device=device)[:k].sort().values.to(torch.int32)
    weight = torch.rand(k, device=device) + 0.5
    norms_s = median_time(lambda: kernels.row_norms(x), device, reps)
    gather_s = median_time(lambda: kernels.sample_rows(x, index, weight), device, reps)
    torch_gather_s = median_time(lambda: x.index_select(0, index.long()) * weight[:, None].to(x.dtype), device, reps)
    moved_norms = x.numel() * x.element_size() + rows * 4
    moved_gather = 2 * k * cols * x.element_size() + k * 8
    return {"rows": rows, "cols": cols, "dtype": "bfloat16", "copy_bandwidth_GBps": copy_bw / 1e9,
            "row_norms_s": norms_s, "row_norms_fraction_of_copy_bw": moved_norms / norms_s / copy_bw,
            "sample_rows_s": gather_s, "sample_rows_fraction_of_copy_bw": moved_gather / gather_s / copy_bw,
            "torch_index_select_scale_s": torch_gather_s}


def sampled_linear_models(device: torch.device, batch: int, seq: int, d: int, layers: int, reps: int) -> Dict[str, Any]:
    x = torch.randn(batch, seq, d, device=device)
    exact = encoder(device, d, layers)
    results: Dict[str, Any] = {"batch": batch, "seq": seq, "d": d, "layers": layers}
    results["exact"] = measure("exact", exact, x, reps, {})
    for method, keep in (("wtacrs", 0.3), ("wtacrs", 0.1), ("crs", 0.3), ("gaussian", 0.3)):
        model, _ = abp.convert(exact, recipe="sampled", method=method, keep=keep)
        results[f"{method}@{keep}"] = measure(f"{method}@{keep}", model, x, reps, results["exact"])
    # The FFN's hidden activation is saved by GELU too, so sampling wo alone frees nothing there;
    # with ReGELU2 (2-bit codes) in its place the sampled rows are all wo keeps of it.
    regelu, _ = abp.convert(exact, norms=False)
    for keep in (0.3, 0.1):
        model, _ = abp.convert(regelu, recipe="sampled", keep=keep)
        results[f"regelu2+wtacrs@{keep}"] = measure(f"regelu2+wtacrs@{keep}", model, x, reps, results["exact"])
    return results


def vcas_model(device: torch.device, batch: int, seq: int, d: int, layers: int, reps: int) -> Dict[str, Any]:
    x = torch.randn(batch, seq, d, device=device)
    model = encoder(device, d, layers)
    results: Dict[str, Any] = {"batch": batch, "seq": seq, "d": d, "layers": layers}
    results["exact"] = measure("exact", model, x, reps, {})
    controller = abp.vcas.Controller(model, T5Block)
    for ratio in (0.5, 0.25):
        for sampler in controller.samplers:
            sampler.ratio = ratio
        for layer in controller.linears:
            layer.state.ratio = ratio
        out = measure(f"vcas rho=nu={ratio}", model, x, reps, results["exact"])
        out["gemm_flops_ratio"] = controller.flops_ratio()
        results[f"rho=nu={ratio}"] = out
    batches: List[torch.Tensor] = [torch.randn_like(x) for _ in range(controller.cal_var_m)]

    def loss_fn(b: torch.Tensor) -> torch.Tensor:
        with autocast_for(device):
            return model(b).float().square().mean()

    results["calibration_s"] = median_time(lambda: controller.calibrate(loss_fn, batches), device, max(1, reps // 5))
    print(f"  calibration (M={controller.cal_var_m}): {results['calibration_s'] * 1e3:.1f} ms", flush=True)
    controller.remove()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    results: Dict[str, Any] = {"device": name, "date": datetime.date.today().isoformat(),
                               "commit": commit_id(ROOT), "torch": torch.__version__}
    reps = args.reps if gpu else 3
    print("kernels", flush=True)
    results["kernels"] = kernel_throughput(1 << 16 if gpu else 1 << 12, 1024 if gpu else 256, device, args.reps)
    shape = (32, 128, 768, 6) if gpu else (8, 64, 128, 2)
    print("sampled linear (T5-style encoder)", flush=True)
    results["sampled_linear"] = sampled_linear_models(device, *shape, reps)
    print("VCAS", flush=True)
    results["vcas"] = vcas_model(device, *shape, reps)
    write_results(results, ROOT, "sampling-", args.out or "")


if __name__ == "__main__":
    main()
