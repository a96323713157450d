"""Trains a small pre-LN transformer twice — as written, and after ``abp.convert(recipe="lowmembp")``.

    PYTHONPATH=bindings/python python3 examples/lowmembp_demo.py [--steps 60] [--device cpu|cuda]

The conversion replaces every LayerNorm by MS-LayerNorm keeping its affine parameters (backward
recovers the normalised value from the output, which the next Linear keeps anyway), and GELU by
ReGELU2. It prints what the converter changed, the bytes
saved for backward per step (``abp.memory.report``, each storage once, parameters left out) and the
final training loss of both runs (same seed, data and initial function).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import time
from typing import Any, Callable, ContextManager, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import abp


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.norm1, self.q, self.k, self.v, self.out = (
            nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d))
        self.norm2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, dh = x.shape[0], x.shape[1], self.d // self.heads
        h = self.norm1(x)
        split = lambda z: z.reshape(b, t, self.heads, dh).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
        x = x + self.out((a @ v).transpose(1, 2).reshape(b, t, self.d))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, d: int, depth: int, heads: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, heads, 4 * d) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens)))).mean(dim=1)


def make_data(n: int, t: int, vocab: int, classes: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, t), generator=g)
    # Which quarter of the vocabulary occurs most often in the sequence.
    counts = torch.stack([((tokens * classes) // vocab == c).sum(dim=1) for c in range(classes)], dim=1)
    labels = counts.argmax(dim=1)
    return tokens.to(device), labels.to(device)


def demo_args(doc: str, steps: int) -> argparse.Namespace:
    """The demos' shared options: steps, batch, seq, dim, depth and device."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def demo_setup(args: argparse.Namespace) -> Tuple[torch.device, nn.Module, Tuple[torch.Tensor, torch.Tensor],
                                                   Tuple[torch.Tensor, torch.Tensor]]:
    """The compression and sampling demos' start: (device, model, data, one probe batch), printed.

    The probe batch is a copy, not a view: a saved view would count the whole data set's storage.
    """
    device = torch.device(args.device)
    vocab, classes = 50, 4
    torch.manual_seed(0)
    model = Model(vocab, args.dim, args.depth, 4, classes).to(device)
    data = make_data(4096, args.seq, vocab, classes, device)
    print(f"pre-LN transformer: {args.depth} blocks, d={args.dim}, batch {args.batch} x {args.seq} tokens, "
          f"device {device} (torch {torch.__version__})")
    return device, model, data, (data[0][: args.batch].clone(), data[1][: args.batch].clone())


def train(model: nn.Module, data: Tuple[torch.Tensor, torch.Tensor], steps: int, batch: int,
          wrap: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
          before_step: Optional[Callable[[Callable[[torch.Tensor], torch.Tensor]], None]] = None,
          ) -> Tuple[List[float], float]:
    """AdamW steps with each step's forward and backward inside `wrap()` (e.g. abp.compress_saved);
    `before_step(loss_of)` runs first each step (loss_of(index) is the loss of those examples; VCAS
    calibrates there). Returns the losses and the time."""
    tokens, labels = data
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = torch.Generator().manual_seed(1)
    losses: List[float] = []
    start = time.perf_counter()
    for _ in range(steps):
        if before_step is not None:
            before_step(lambda index: F.cross_entropy(model(tokens[index]), labels[index]))
        index = torch.randint(0, tokens.shape[0], (batch,), generator=order).to(tokens.device)
        optimizer.zero_grad(set_to_none=True)
        with wrap():
            loss = F.cross_entropy(model(tokens[index]), labels[index])
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def main() -> None:
    args = demo_args(__doc__, steps=60)
    device = torch.device(args.device)
    vocab, classes = 50, 4
    torch.manual_seed(0)
    original = Model(vocab, args.dim, args.depth, 4, classes).to(device)
    with torch.no_grad():  # non-trivial affine parameters, as after training
        for m in original.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
    converted, changes = abp.convert(original, recipe="lowmembp")
    print(f"pre-LN transformer: {args.depth} blocks, d={args.dim}, batch {args.batch} x {args.seq} tokens, "
          f"device {device} (torch {torch.__version__})")
    print("abp.convert(model, recipe='lowmembp'):")
    for c in changes:
        print(f"  {c.action:<9} {c.module:<20} {c.detail}")

    data = make_data(4096, args.seq, vocab, classes, device)
    probe = data[0][: args.batch]
    with torch.no_grad():
        drift = (converted(probe) - original(probe)).abs().max().item()
    report = abp.memory.report(converted, probe, baseline=original, loss_fn=lambda out: out.sum())
    original.zero_grad(set_to_none=True)
    converted.zero_grad(set_to_none=True)
    print(f"same function after conversion: max |output difference| {drift:.2e} (fp32)")
    print(f"saved for backward per step: {report.baseline_total_bytes / 2**20:.2f} MiB as written, "
          f"{report.total_bytes / 2**20:.2f} MiB converted "
          f"({report.baseline_total_bytes / report.total_bytes:.2f}x less)")

    results = []
    for name, model in (("as written", copy.deepcopy(original)), ("lowmembp", converted)):
        losses, seconds = train(model, data, args.steps, args.batch)
        tail = losses[-10:]
        results.append((name, sum(tail) / len(tail), seconds))
    for name, loss, seconds in results:
        print(f"  {name:<11} final loss {loss:.4f}  ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
