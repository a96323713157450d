"""Trains the small pre-LN transformer of lowmembp_demo.py with compressed saved activations.

    PYTHONPATH=bindings/python python3 examples/gact_demo.py [--steps 40] [--device cpu|cuda]

Four runs from the same seed, data and initial weights: exact; ``abp.compress_saved(bits=4)``;
``abp.compress_saved(bits=2)``; and ``abp.CompressionController(model, avg_bits=4)``, which
estimates each saved tensor's sensitivity at step 0 and spends a 4-bit budget where it matters
(budgets below 4 bits need ``allow_low_bits=True``: docs/compressed-training.md).
It prints the bytes saved for backward per step and the final training loss of each run.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F

import abp
from lowmembp_demo import demo_args, demo_setup, train


def main() -> None:
    args = demo_args(__doc__, steps=40)
    _, original, data, probe = demo_setup(args)
    with abp.memory.SavedTensorsCounter() as counter:
        F.cross_entropy(original(probe[0]), probe[1])
    params = sum(p.numel() * p.element_size() for p in original.parameters())
    exact_bytes = counter.total_bytes

    runs = []
    for name in ("exact", "4-bit", "2-bit", "controller 4"):
        torch.manual_seed(0)
        model = copy.deepcopy(original)
        if name == "exact":
            wrap: Callable[[], ContextManager[Any]] = contextlib.nullcontext
            saver = None
        elif name == "controller 4":
            saver = abp.CompressionController(model, avg_bits=4.0, min_numel=256, interval=10**9)
            wrap = lambda s=saver: s  # noqa: E731
        else:
            bits = int(name[0])
            wrap = lambda b=bits: abp.compress_saved(bits=b, allow_low_bits=True, min_numel=256)  # noqa: E731
            saver = None
        # What one step saves, each storage once (compress_saved's stats; the controller's stats
        # are those of its compress_saved).
        if name == "exact":
            stored = exact_bytes
        else:
            ctx = saver if saver is not None else wrap()
            with ctx:
                F.cross_entropy(model(probe[0]), probe[1]).backward()
            stored = ctx.stats["bytes_stored"]
            model.zero_grad(set_to_none=True)
        losses, seconds = train(model, data, args.steps, args.batch, wrap)
        tail = losses[-10:]
        extra = ""
        if isinstance(saver, abp.CompressionController):
            widths = sorted(set(saver.bits.values()))
            extra = f"; widths {widths}, average {saver.average_bits():.2f} bits"
            saver.remove()
        runs.append((name, stored, sum(tail) / len(tail), seconds, extra))
    print(f"saved for backward per step (parameters saved by Linears included: {params / 2**20:.2f} MiB of "
          f"weights are never compressed):")
    for name, stored, loss, seconds, extra in runs:
        print(f"  {name:<13} {stored / 2**20:6.2f} MiB ({exact_bytes / stored:4.1f}x less)  "
              f"final loss {loss:.4f}  ({seconds:.1f} s){extra}")


if __name__ == "__main__":
    main()
