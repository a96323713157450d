"""A converted model under DistributedDataParallel (gloo, 2 CPU processes) trains as one process does.

Recipe lowmembp is deterministic (memory-sharing norms, ReGELU2), so two ranks each training on
half of every batch, with DDP averaging their gradients, must end at the parameters that one
process reaches on the whole batches (to float32 rounding). The ranks run in spawned processes
that import abp themselves, as a user's launcher would.
"""
from __future__ import annotations

import os
import tempfile
from typing import Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import abp
from abp_reference import library_or_skip

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD = 2


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def converted() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.LayerNorm(32), nn.Linear(32, 4))
    model, changes = abp.convert(model, "lowmembp")
    assert sum(c.action == "replaced" for c in changes) == 5  # 3 norms, 2 GELUs
    return model


def batches() -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 16, 8, 32, generator=g), torch.randint(0, 4, (5, 16, 8), generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def _rank(rank: int, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        model = nn.parallel.DistributedDataParallel(converted())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in zip(*batches()):
            half = x.shape[0] // WORLD
            part = slice(rank * half, (rank + 1) * half)
            train_step(model, opt, x[part], y[part])
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, out)
    finally:
        dist.destroy_process_group()


def test_ddp_training_matches_one_process() -> None:
    library_or_skip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_rank, args=(os.path.join(tmp, "rendezvous"), out), nprocs=WORLD)
        distributed = torch.load(out)
    single = converted()
    opt = torch.optim.SGD(single.parameters(), lr=0.1)
    for x, y in zip(*batches()):
        train_step(single, opt, x, y)
    reference = single.state_dict()
    assert set(distributed) == set(reference)
    for name, value in distributed.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-6, msg=name)
    # The training moved the parameters: equal results are not both "unchanged".
    assert float((reference["3.weight"] - converted().state_dict()["3.weight"]).abs().max()) > 1e-3
