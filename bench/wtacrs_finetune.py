"""Does WTA-CRS at keep 0.3 reach exact training's loss when it fine-tunes instead of training
from scratch? (measurement, CPU; issue #13 item 2: the method's reported parity is for fine-tuning)

For each seed: trains real_tasks' TinyLlama exactly on the charlm task (the standard library's
Python source, 600 steps, AdamW lr 3e-3: real_tasks.train's schedule), then fine-tunes copies of it
on English text, the documentation topics that ship with Python (``pydoc_data/topics.py``: a domain
shift from code to prose), for `--steps` steps at AdamW lr `--lr`, once per recipe of real_tasks
(exact first). Prints and writes the fine-tuned validation loss (nats per byte, 64 fixed windows of
held-out topic text) per recipe and seed, and the gap of each recipe's mean to exact's.

Usage (either torch lane): PYTHONPATH=bindings/python python bench/wtacrs_finetune.py
[--seeds 3] [--recipes exact,sampled-0.3] [--steps 300] [--lr 1e-3] [--json FILE].
The committed output: results/wtacrs-finetune-*.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_tasks  # noqa: E402

CONTEXT, BATCH = 64, 32


def topics_text(train_bytes: int = 600_000, val_bytes: int = 60_000) -> Tuple[torch.Tensor, torch.Tensor]:
    """The running Python's documentation topics as bytes: (train, validation)."""
    path = Path(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")
    data = path.read_bytes()
    if len(data) < train_bytes + val_bytes:
        raise RuntimeError(f"{path}: fewer than {train_bytes + val_bytes} bytes")
    text = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    return text[:train_bytes], text[train_bytes:train_bytes + val_bytes]


def windows(text: torch.Tensor, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(text) - CONTEXT - 1, (BATCH,), generator=gen)
    window = torch.stack([text[s:s + CONTEXT + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def pretrained(seed: int) -> nn.Module:
    """real_tasks' charlm model after its exact 600 steps from `seed` (the same initialisation,
    batches and optimiser as real_tasks.train)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    text, _ = real_tasks.python_source()
    model = real_tasks.TinyLlama(context=CONTEXT)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for _ in range(600):
        loss = loss_of(model, *windows(text, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def fine_tune(base: nn.Module, setting: str, seed: int, steps: int, lr: float) -> Dict[str, Any]:
    train, val_text = topics_text()
    starts = torch.linspace(0, len(val_text) - CONTEXT - 2, 64).long().tolist()
    val = torch.stack([val_text[s:s + CONTEXT + 1] for s in starts])
    model = copy.deepcopy(base)
    torch.manual_seed(3000 + seed)  # the sampled layers' seeds draw from here
    extra = torch.Generator().manual_seed(2000 + seed)
    spec = real_tasks.Task("charlm", model.Block, lambda b: loss_of(model, *b), lambda: windows(train, extra),
                           val[:4, :-1])
    _, context_of = real_tasks._prepare(setting, model, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(4000 + seed)
    model.train()
    start = time.perf_counter()
    for _ in range(steps):
        batch = windows(train, gen)
        with context_of():
            loss = loss_of(model, *batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        val_loss = float(loss_of(model, val[:, :-1], val[:, 1:]))
    return {"setting": setting, "seed": seed, "val_loss": val_loss, "step_ms": 1000 * seconds / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--recipes", default="exact,sampled-0.3", help="exact first (the reference)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = args.recipes.split(",")
    results: List[Dict[str, Any]] = []
    for seed in range(args.seeds):
        base = pretrained(seed)
        for setting in settings:
            row = fine_tune(base, setting, seed, args.steps, args.lr)
            results.append(row)
            print(f"  seed {seed} {setting:14s} val_loss {row['val_loss']:.4f}", file=sys.stderr, flush=True)
    reference = statistics.mean(r["val_loss"] for r in results if r["setting"] == settings[0])
    print(f"fine-tuning on pydoc topics, {args.steps} steps at lr {args.lr:g}, {args.seeds} seed(s); "
          f"validation loss (nats/byte), gap to {settings[0]}'s mean")
    for setting in settings:
        losses = [r["val_loss"] for r in results if r["setting"] == setting]
        mean = statistics.mean(losses)
        print(f"  {setting:14s} {mean:.4f}  {' / '.join(f'{v:.4f}' for v in losses)}  "
              f"{100 * (mean - reference) / reference:+.1f} %")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "steps": args.steps, "lr": args.lr, "seeds": args.seeds, "torch": torch.__version__,
            "python": platform.python_version(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
