"""Converted models under DistributedDataParallel and FSDP (gloo, 2 CPU processes).

Recipe lowmembp is deterministic (memory-sharing norms, ReGELU2), so two ranks each training on
half of every batch, with DDP averaging their gradients (or FSDP2 sharding the parameters and
reduce-scattering them), must end at the parameters that one process reaches on the whole batches
(to float32 rounding). The random recipes draw a distinct, reproducible stream per rank
(abp.compress.rank_key), and compress_saved and the compression controller run per rank. The
ranks run in spawned processes that import abp themselves, as a user's launcher would.
"""
from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import abp
from abp_reference import MlpBlock as Block, library_or_skip

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD = 2


#: Seconds a spawned pair of ranks may take: each takes a few; one past it is hung.
DEADLINE_S = 240


def _spawn(rank_fn: Callable[..., None], tmp: str, *args: Any) -> None:
    """Runs rank_fn(rank, rendezvous, *args) on WORLD spawned processes. A rank that hangs (a
    collective one rank never joins, a teardown deadlock) fails the test at DEADLINE_S with every
    live rank's Python stacks, rather than hanging the lane."""
    context = mp.spawn(rank_fn, args=(os.path.join(tmp, "rendezvous"), *args), nprocs=WORLD, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() < deadline:
            continue
        alive = [p for p in context.processes if p.is_alive()]
        for process in alive:
            os.kill(process.pid, signal.SIGUSR1)
        time.sleep(2)  # the stacks reach stderr
        for process in alive:
            process.kill()
        pytest.fail(f"{rank_fn.__name__}: {len(alive)} of {WORLD} ranks still running after {DEADLINE_S} s "
                    "(their stacks are above)")


@contextlib.contextmanager
def _process_group(rank: int, rendezvous: str) -> Iterator[None]:
    """A rank's gloo group (one torch thread), destroyed when the rank's work ends. faulthandler
    prints every thread's Python stack if the rank dies of a signal, and the rank says when its
    group is gone: a spawned FSDP2 rank aborted twice in whole torch 2 lanes ("terminate called
    without an active exception"), never alone; the next one will say whether in the work, in the
    group's teardown or in the interpreter's exit."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)  # _spawn's stacks of a rank past its deadline
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()
        print(f"rank {rank}: process group destroyed", file=sys.stderr, flush=True)


def plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.LayerNorm(32), nn.Linear(32, 4))


def converted() -> nn.Module:
    model, changes = abp.convert(plain(), "lowmembp")
    assert sum(c.action == "replaced" for c in changes) == 5  # 3 norms, 2 GELUs
    return model


def batches() -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 16, 8, 32, generator=g), torch.randint(0, 4, (5, 16, 8), generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, 4), y.reshape(-1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = loss_of(model, x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard  # FSDP2 (torch >= 2.6), which runs on CPU with gloo

    for block in list(model)[:2]:
        fully_shard(block)
    return fully_shard(model)


def _rank(rank: int, rendezvous: str, out: str, wrapper: str) -> None:
    with _process_group(rank, rendezvous):
        model = nn.parallel.DistributedDataParallel(converted()) if wrapper == "ddp" else _fsdp(converted())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in zip(*batches()):
            half = x.shape[0] // WORLD
            part = slice(rank * half, (rank + 1) * half)
            train_step(model, opt, x[part], y[part])
        state = model.module.state_dict() if wrapper == "ddp" else model.state_dict()
        # FSDP's parameters are DTensor shards: gathered whole on every rank.
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
        if rank == 0:
            torch.save(full, out)


def _fsdp2_available() -> bool:
    try:
        import torch.distributed.fsdp as fsdp
    except Exception:  # ImportError; torch 1.13's fsdp does not even import on Python 3.11 (ValueError)
        return False
    return hasattr(fsdp, "fully_shard")


@pytest.mark.parametrize("wrapper", [
    "ddp", pytest.param("fsdp", marks=pytest.mark.skipif(not _fsdp2_available(), reason="FSDP2 (fully_shard) needs torch >= 2.6"))])
def test_data_parallel_training_matches_one_process(wrapper: str) -> None:
    library_or_skip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        _spawn(_rank, tmp, out, wrapper)
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


def _random_recipes(rank: int, rendezvous: str, out: str) -> None:
    """Each rank, seeded alike: its first keys, the rows its sampled layer keeps, and three DDP
    steps of the "all" recipe (sampled projections + compress_saved) and of the compression
    controller, with what they compressed."""
    with _process_group(rank, rendezvous):
        torch.manual_seed(0)
        keys = [abp.compress.draw_seed() for _ in range(3)]
        x = torch.randn(64, 32, requires_grad=True)
        w = torch.randn(8, 32, requires_grad=True)
        (dw,) = torch.autograd.grad(abp.sampling.sampled_linear(x, w, keep=0.3).sum(), (w,))
        result = {"keys": keys, "sampled_dw": dw}
        xs, ys = batches()
        torch.manual_seed(0)
        model, _ = abp.convert(nn.Sequential(Block(), Block(), nn.LayerNorm(32), nn.Linear(32, 4)), "all",
                               keep=0.3, bits=8, layers=["*fc1", "*fc2"])
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in zip(xs[:3], ys[:3]):
            train_step(ddp, opt, x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8])
        result["all"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.manual_seed(0)
        model = converted()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        controller = abp.CompressionController(model, avg_bits=4.0, interval=2)
        for x, y in zip(xs[:3], ys[:3]):
            with controller:
                train_step(ddp, opt, x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8])
        result["controller"] = {"stats": dict(controller.stats), "average_bits": controller.average_bits(),
                                "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        torch.save(result, f"{out}.{rank}")


def test_random_recipes_draw_distinct_reproducible_streams_per_rank() -> None:
    library_or_skip()
    runs = []
    for attempt in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank")
            _spawn(_random_recipes, tmp, out)
            runs.append([torch.load(f"{out}.{r}") for r in range(WORLD)])
    first, second = runs
    # Rank 0 draws what one process draws; rank 1, seeded alike, other keys and other rows.
    torch.manual_seed(0)
    assert first[0]["keys"] == [abp.compress.draw_seed() for _ in range(3)]
    assert not set(first[0]["keys"]) & set(first[1]["keys"])
    assert not torch.equal(first[0]["sampled_dw"], first[1]["sampled_dw"])
    # Reproducible: a second launch draws and trains exactly as the first.
    for a, b in zip(first, second):
        assert a["keys"] == b["keys"] and torch.equal(a["sampled_dw"], b["sampled_dw"])
        for name in a["all"]:
            assert torch.equal(a["all"][name], b["all"][name]), name
            assert torch.equal(a["controller"]["params"][name], b["controller"]["params"][name]), name
    # DDP keeps the replicas equal, whatever each rank drew.
    for name in first[0]["all"]:
        torch.testing.assert_close(first[0]["all"][name], first[1]["all"][name], rtol=0, atol=1e-6)
        torch.testing.assert_close(first[0]["controller"]["params"][name], first[1]["controller"]["params"][name], rtol=0, atol=1e-6)
    # The controller compressed on every rank, within its budget (its statistics are per rank).
    for rank in first:
        assert rank["controller"]["stats"]["compressed"] > 0
        assert rank["controller"]["average_bits"] <= 4.0 + 1e-9
        assert all(torch.isfinite(v).all() for v in rank["all"].values())


class _AttentionBlock(nn.Module):
    """Pre-norm attention with separate q, k, v projections feeding fused attention."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, n, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(b, n, d))


def _attention_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_AttentionBlock(), _AttentionBlock(), nn.LayerNorm(32), nn.Linear(32, 4))


#: How each recompute case shards its model: (model, the modules given their own unit, reshard
#: after forward?). "block": attention's projections share their block's unit; "linear": each is a
#: unit of its own, whose weight FSDP frees right after its forward.
_SHARDINGS = {
    "reshard": (plain, lambda m: (m[0], m[1], m[3]), True),
    "keep": (plain, lambda m: (m[0], m[1], m[3]), False),
    "block": (_attention_model, lambda m: (m[0], m[1]), True),
    "linear": (_attention_model, lambda m: (m[0].q, m[0].k, m[0].v, m[0], m[1].q, m[1].k, m[1].v, m[1]), True),
}


def _fsdp_recompute(rank: int, rendezvous: str, out: str, case: str) -> None:
    """One FSDP2 step under compress_saved(recompute=True) with raw widths (per-tensor widths:
    attention's projections are recomputed where their weights stay): backward recomputes with
    parameters that FSDP gathered for the forward and (resharding after it) gathers again."""
    from torch.distributed.fsdp import fully_shard

    with _process_group(rank, rendezvous):
        make, units, reshard = _SHARDINGS[case]
        model = make()
        for module in (*units(model), model):
            fully_shard(module, reshard_after_forward=reshard)
        x, y = (b[0] for b in batches())
        half = x.shape[0] // WORLD
        part = slice(rank * half, (rank + 1) * half)
        with abp.compress_saved(bits_for=lambda t: 32, min_numel=1) as saver:
            loss_of(model, x[part], y[part]).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save((grads, dict(saver.stats)), out)


def _recompute_under_fsdp(case: str) -> Dict[str, int]:
    """Runs `case` on 2 ranks, checks its gradients against one process's, returns its stats."""
    library_or_skip()
    from abp import _derived

    if not _derived.AVAILABLE:
        pytest.skip("recompute needs torch >= 2")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        _spawn(_fsdp_recompute, tmp, out, case)
        grads, stats = torch.load(out)
    model = _SHARDINGS[case][0]()
    x, y = (b[0] for b in batches())
    half = x.shape[0] // WORLD
    (sum(loss_of(model, x[r * half:(r + 1) * half], y[r * half:(r + 1) * half]) for r in range(WORLD)) / WORLD).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-6, msg=f"{case}: {name}")
    return stats


@pytest.mark.skipif(not _fsdp2_available(), reason="FSDP2 (fully_shard) needs torch >= 2.6")
@pytest.mark.parametrize("case", ["reshard", "keep"])
def test_compress_saved_recomputes_under_fsdp_as_in_one_process(case: str) -> None:
    assert _recompute_under_fsdp(case)["derived"] > 0


@pytest.mark.skipif(not _fsdp2_available(), reason="FSDP2 (fully_shard) needs torch >= 2.6")
def test_attention_projections_recompute_under_fsdp_only_where_their_weights_stay() -> None:
    stats = {unit: _recompute_under_fsdp(unit) for unit in ("block", "linear")}
    assert stats["block"]["derived"] - stats["linear"]["derived"] == 2 * 3  # q, k, v per block


def _tiny_llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _llama_batch() -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


def _compiled_recipe_under_fsdp(rank: int, rendezvous: str, out: str, backend: str) -> None:
    """Two steps of a LLaMA converted with recipe compress, sharded per layer and compiled."""
    from torch.distributed.fsdp import fully_shard

    with _process_group(rank, rendezvous):
        model, _ = abp.convert(_tiny_llama(), "compress", bits=8)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = _llama_batch()[rank * 2:(rank + 1) * 2]
        losses = []
        for _ in range(2):
            loss = compiled(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        coded = sum(1 for record in abp._compiled_saves.compiled_stats() if record["bits"] < 32)
        torch.save((losses, coded), f"{out}.{rank}")


@pytest.mark.skipif(not _fsdp2_available(), reason="FSDP2 (fully_shard) needs torch >= 2.6")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_model_converted_with_recipe_compress_trains_under_per_layer_fsdp(backend: str) -> None:
    """The recipe's block opened its recompute recorder (a torch function mode) around the compiled
    forward, which dynamo traced through for nothing and, with FSDP2's per-layer hooks, mis-traced
    (torch 2.15: LLaMA's ``inputs_embeds.device`` came back as a torch.Size). Opened from compiled
    code the block has no recorder; the compiled graphs still store their saves as codes. Under
    inductor a save dynamo traced itself reached the block's eager pack hook, whose Python then
    failed in the graph ("'NoneType' object has no attribute 'is_leaf'"): it is kept as it is."""
    pytest.importorskip("transformers")
    library_or_skip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        _spawn(_compiled_recipe_under_fsdp, tmp, out, backend)
        losses = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    # The forward is exact (LLaMA has no dropout): each rank's first loss is the plain model's.
    plain, ids = _tiny_llama(), _llama_batch()
    for rank, ((first, second), coded) in enumerate(losses):
        part = ids[rank * 2:(rank + 1) * 2]
        assert abs(first - plain(input_ids=part, labels=part).loss.item()) < 1e-5
        assert math.isfinite(second) and second != first
        assert coded > 0  # the compiled graphs' saves are codes


class _Checkpointed(nn.Module):
    """`block` under torch's reentrant checkpoint, as older transformers checkpoint their layers."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=True)


def _controller_reentrant(rank: int, rendezvous: str, out: str) -> None:
    """Three DDP steps of reentrant-checkpointed blocks under the controller, estimating at every
    step: its replays take a plain backward there (abp._replay), which fires DDP's gradient hooks
    outside DDP's own backward."""
    with _process_group(rank, rendezvous):
        torch.manual_seed(0)
        # A Linear first: a reentrant checkpoint gives its block's parameters gradients only when
        # its input requires grad.
        model = nn.Sequential(nn.Linear(32, 32), _Checkpointed(Block()), _Checkpointed(Block()), nn.LayerNorm(32),
                              nn.Linear(32, 4))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        xs, ys = batches()
        # Step 0 stores everything as it is: its gradients are those of an uncontrolled DDP step.
        loss_of(ddp, xs[0][rank * 8:(rank + 1) * 8], ys[0][rank * 8:(rank + 1) * 8]).backward()
        plain = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.zero_grad()
        controller = abp.CompressionController(model, avg_bits=4.0, interval=1)
        grads = []
        for x, y in zip(xs[:3], ys[:3]):
            with controller:
                loss = loss_of(ddp, x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8])
                opt.zero_grad()
                loss.backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
            opt.step()
        torch.save({"estimates": controller.estimates, "grads": grads, "plain": plain,
                    "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}, f"{out}.{rank}")


def test_the_controller_estimates_under_ddp_with_reentrant_checkpoints() -> None:
    library_or_skip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        _spawn(_controller_reentrant, tmp, out)
        ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    assert all(r["estimates"] == 3 for r in ranks)
    for r in ranks:  # step 0 under the controller is DDP's own step, the replays' hooks ignored
        for name, g in r["plain"].items():
            assert torch.equal(g, r["grads"][0][name]), name
    # After each estimate the gradients are DDP's averages, the same on both ranks (the replay's
    # backward put each parameter's .grad back), and so are the parameters.
    for step in range(3):
        for name, g in ranks[0]["grads"][step].items():
            torch.testing.assert_close(g, ranks[1]["grads"][step][name], rtol=0, atol=1e-7, msg=f"step {step} {name}")
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, ranks[1]["params"][name], rtol=0, atol=1e-6, msg=name)


def _automatic_schedule(rank: int, rendezvous: str, out: str) -> None:
    """One estimate per rank on batches of different sizes: rank 1's tensors are too small to
    compress (under min_numel), so its step probes fewer keys than rank 0's."""
    with _process_group(rank, rendezvous):
        model = converted()
        controller = abp.CompressionController(model, avg_bits=4.0)  # interval="auto"
        xs, ys = batches()
        rows = 16 if rank == 0 else 1
        with controller:
            loss_of(model, xs[0][:rows], ys[0][:rows]).backward()
        torch.save({"keys": len(controller.sensitivity), "next": controller.next_estimate}, f"{out}.{rank}")


def test_the_automatic_interval_is_the_same_on_every_rank() -> None:
    """interval="auto" spaces estimates by the replays an estimate ran, one per key the rank's own
    step saved: ranks with other keys would estimate at different steps (under FSDP2 an estimate
    gathers parameters, so ranks out of step would wait on each other). They take the largest."""
    library_or_skip()
    from abp.controller import AUTO_STEPS_PER_REPLAY

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        _spawn(_automatic_schedule, tmp, out)
        ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    assert ranks[0]["keys"] > ranks[1]["keys"], ranks
    assert ranks[0]["next"] == ranks[1]["next"] == AUTO_STEPS_PER_REPLAY * (ranks[0]["keys"] + 1), ranks


def _fixed_schedule(rank: int, rendezvous: str, out: str) -> None:
    """interval=3 over four steps; at step 0 rank 1's batch is one row, every tensor of it under min_numel:
    its estimate has nothing to allocate, while rank 0's estimates."""
    with _process_group(rank, rendezvous):
        model = converted()
        controller = abp.CompressionController(model, avg_bits=4.0, interval=3, min_numel=2048)
        xs, ys = batches()
        schedule = []
        for step in range(4):
            rows = 1 if rank == 1 and step == 0 else 16
            with controller:
                loss_of(model, xs[step][:rows], ys[step][:rows]).backward()
            schedule.append(controller.next_estimate)
        torch.save({"schedule": schedule, "estimates": controller.estimates}, f"{out}.{rank}")


def test_a_fixed_interval_is_the_same_on_every_rank() -> None:
    """An int interval: a rank whose probe step saved nothing to compress estimated again at its
    next step, alone, while the others waited `interval` steps (under FSDP2 its replay would
    gather parameters no other rank gathers). The ranks agree: if any estimated, all wait."""
    library_or_skip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        _spawn(_fixed_schedule, tmp, out)
        ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    assert ranks[0]["schedule"] == ranks[1]["schedule"] == [3, 3, 3, 6], ranks
    assert ranks[0]["estimates"] == 2 and ranks[1]["estimates"] == 1, ranks


def _controllers_under_fsdp(rank: int, rendezvous: str, out: str) -> None:
    """FSDP2: one estimating step of the compression controller on this rank's half of a batch
    (its replays call the root's forward directly, past FSDP's gathering pre-forward), then a
    VCAS calibration and two sampled steps (its gradients are the ranks' shards)."""
    from abp import vcas

    with _process_group(rank, rendezvous):
        xs, ys = batches()
        half = xs.shape[1] // WORLD
        part = slice(rank * half, (rank + 1) * half)
        model = _fsdp(converted())
        controller = abp.CompressionController(model, avg_bits=4.0, interval=1)
        torch.manual_seed(7)  # the second step's codes draw their keys
        for step in range(2):
            with controller:
                loss_of(model, xs[step][part], ys[step][part]).backward()
        result = {"sensitivity": {str(k): v for k, v in controller.sensitivity.items()},
                  "bits": {str(k): v for k, v in controller.bits.items()}, "estimates": controller.estimates}
        controller.remove()
        torch.manual_seed(0)
        model = plain()
        sampler = vcas.Controller(model, Block, cal_var_freq=1, param_sample_ratio=0.5)
        model = _fsdp(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler.calibrate(lambda b: loss_of(model, b[0][part], b[1][part]), list(zip(xs[2:4], ys[2:4])))
        for x, y in zip(xs[:2], ys[:2]):
            train_step(model, opt, x[part], y[part])
            sampler.step()
        result["vcas"] = {"last": sampler.last, "ratios": sampler.activation_ratios}
        result["params"] = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
        torch.save(result, f"{out}.{rank}")


@pytest.mark.skipif(not _fsdp2_available(), reason="FSDP2 (fully_shard) needs torch >= 2.6")
def test_the_controllers_estimate_under_fsdp_as_one_process_does_on_its_micro_batch() -> None:
    """Rank 0's sensitivities and widths are those one process estimates on its micro-batch (the
    replays differentiate the gathered parameters; rank 1's codes draw another stream, so only
    its keys are compared); VCAS calibrates on the ranks' gradient shards and the sharded model
    trains on."""
    library_or_skip()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        _spawn(_controllers_under_fsdp, tmp, out)
        ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    xs, ys = batches()
    half = xs.shape[1] // WORLD
    model = converted()
    controller = abp.CompressionController(model, avg_bits=4.0, interval=1)
    torch.manual_seed(7)
    for step in range(2):
        with controller:
            loss_of(model, xs[step][:half], ys[step][:half]).backward()
    expected = {str(k): v for k, v in controller.sensitivity.items()}
    assert controller.estimates == 2 and any(v > 0 for v in expected.values())
    for result in ranks:
        assert result["estimates"] == 2 and set(result["sensitivity"]) == set(expected)
        assert all(0 < v < float("inf") for v in result["sensitivity"].values())
        assert result["vcas"]["last"]["v_sgd"] > 0 and all(0 < r <= 1 for r in result["vcas"]["ratios"])
    for key, value in expected.items():
        assert ranks[0]["sensitivity"][key] == pytest.approx(value, rel=1e-4, abs=1e-12), key
    assert ranks[0]["bits"] == {str(k): v for k, v in controller.bits.items()}
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, ranks[1]["params"][name], rtol=0, atol=0, msg=name)
