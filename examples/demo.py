"""Trains one small MLP three times — exact GELU, abp ReGELU2, abp 3-bit GELU — and compares memory and loss.

    PYTHONPATH=bindings/python python3 examples/demo.py [--steps 150] [--device cpu|cuda]

Same seed, data and initial weights for every variant. For each it prints the bytes the activations
keep for backward per training step (counted with saved_tensors_hooks, deduplicated by storage), the
bytes of all the step's residuals (everything saved for backward except the parameters, which are
kept anyway), and the final training loss (mean of the last 10 steps) and accuracy.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable, List

import torch
import torch.nn.functional as F

import abp


@dataclass
class Result:
    variant: str
    activation_bytes: int
    total_bytes: int
    final_loss: float
    accuracy: float
    seconds: float


def make_data(n: int, dim: int, classes: int, seed: int, device: torch.device):
    """A synthetic classification task: labels from a random two-layer teacher network."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w1 = torch.randn(dim, 128, generator=g) / dim**0.5
    w2 = torch.randn(128, classes, generator=g) / 128**0.5
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x.to(device), y.to(device)


def make_model(dim: int, hidden: int, classes: int, act: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(dim, hidden),
        act(),
        torch.nn.Linear(hidden, hidden),
        act(),
        torch.nn.Linear(hidden, classes),
    )


def tag_activations(model: torch.nn.Module, kind: type, counter: Callable[[], abp.memory.SavedTensorsCounter]) -> None:
    """Tags what the `kind` modules save as "activation" in the step's counter (module hooks)."""

    def enter(module: torch.nn.Module, inputs) -> None:
        counter().tag = "activation"

    def leave(module: torch.nn.Module, inputs, output) -> None:
        counter().tag = None

    for module in model.modules():
        if isinstance(module, kind):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)


def train(variant: str, act: Callable[[], torch.nn.Module], args: argparse.Namespace, device: torch.device) -> Result:
    x, y = make_data(args.samples, args.dim, args.classes, seed=0, device=device)
    model = make_model(args.dim, args.hidden, args.classes, act, seed=1).to(device)
    step_counter = abp.memory.SavedTensorsCounter()
    tag_activations(model, type(act()), lambda: step_counter)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = torch.Generator().manual_seed(2)
    losses: List[float] = []
    activation_bytes = total_bytes = 0
    start = time.perf_counter()
    for step in range(args.steps):
        index = torch.randint(0, args.samples, (args.batch,), generator=batches).to(device)
        step_counter = abp.memory.SavedTensorsCounter()
        with step_counter:
            loss = F.cross_entropy(model(x[index]), y[index])
        activation_bytes = step_counter.bytes_tagged("activation")
        # Everything the step keeps for backward except the parameters (kept anyway).
        parameters = {abp.memory.storage_key(p)[:2] for p in model.parameters()}
        total_bytes = abp.memory.distinct_bytes(
            [s for s in step_counter.tensors if (s.device, s.storage_ptr) not in parameters]
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    tail = losses[-10:]
    return Result(variant, activation_bytes, total_bytes, sum(tail) / len(tail), accuracy, seconds)


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    variants = [
        ("torch GELU (exact)", torch.nn.GELU),
        ("abp ReGELU2 (2-bit)", abp.nn.ReGELU2),
        ("abp GELU bits=3", lambda: abp.nn.GELU(bits=3)),
    ]
    print(
        f"MLP {args.dim}-{args.hidden}-{args.hidden}-{args.classes}, batch {args.batch}, {args.steps} steps, "
        f"AdamW lr {args.lr:g}, device {device} (torch {torch.__version__})"
    )
    results = [train(name, act, args, device) for name, act in variants]
    exact = results[0].activation_bytes
    header = f"{'variant':<22} {'activation bytes/step':>22} {'vs exact':>11} {'all residuals/step':>19} {'final loss':>11} {'accuracy':>9} {'time':>7}"
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = f"{exact / r.activation_bytes:.1f}x less" if r.activation_bytes and r is not results[0] else "1.0x"
        print(
            f"{r.variant:<22} {human(r.activation_bytes):>22} {ratio:>11} {human(r.total_bytes):>19} "
            f"{r.final_loss:>11.4f} {r.accuracy:>9.3f} {r.seconds:>6.1f}s"
        )
    elements = 2 * args.batch * args.hidden
    print(f"({elements} activation inputs per step; exact GELU keeps 4 bytes each, ReGELU2 2 bits, 3-bit GELU 3 bits)")


if __name__ == "__main__":
    main()
