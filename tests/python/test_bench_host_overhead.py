"""Smoke test of bench/host_overhead.py (#16): every abp module is paired with the torch module
it replaces, the pairs compute the same forward, and one tiny side-by-side run gives a finite
time for each. The numbers themselves live in the benchmark, not here."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

import abp
from abp_reference import library_or_skip

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import host_overhead  # noqa: E402  (bench/host_overhead.py)


def test_every_abp_module_is_paired_with_the_torch_module_it_replaces() -> None:
    library_or_skip()
    names = [name for name, _, _, _ in host_overhead.pairs()]
    activations = [n for n in abp.nn.__all__
                   if isinstance(getattr(abp.nn, n), type) and issubclass(getattr(abp.nn, n), abp.nn.AbpActivation)]
    assert names[: len(activations)] == activations and "MSLayerNorm" in names
    torch.manual_seed(0)
    for name, mine, theirs, rows in host_overhead.pairs():
        x = torch.randn(rows, host_overhead.COLS)
        # Forward is the exact op for every abp module: the pairing is the right one.
        torch.testing.assert_close(mine()(x), theirs()(x), rtol=1e-5, atol=1e-5, msg=name)


def test_one_tiny_run_times_every_pair_and_recipe() -> None:
    library_or_skip()
    rows = host_overhead.measure(rounds=1, calls=2)
    assert [r["op"] for r in rows] == ([n for n, _, _, _ in host_overhead.pairs()] + ["launch floor (SiLU)"]
                                       + [n for n, _, _ in host_overhead.recipes()])
    for r in rows:
        assert all(math.isfinite(float(r[k])) and float(r[k]) > 0 for k in ("abp_us", "torch_us", "ratio")), r


def test_the_launch_floor_computes_silu_and_its_3_bit_derivative() -> None:
    # The reference row is only meaningful if it does abp.nn.SiLU's work: same output, same gradient.
    library_or_skip()
    torch.manual_seed(1)
    x = torch.randn(host_overhead.ROWS, host_overhead.COLS, requires_grad=True)
    g = torch.randn_like(x)
    floor = host_overhead.floor()()
    y = floor(x)
    y.backward(g)
    x_abp = x.detach().clone().requires_grad_()
    y_abp = abp.nn.SiLU()(x_abp)
    y_abp.backward(g)
    assert torch.equal(y, y_abp) and torch.equal(x.grad, x_abp.grad)


def test_the_timed_sampled_layer_plans_and_the_timed_block_compresses() -> None:
    # A row is only the cost it names if that work happens at the bench's sizes: the sampled layer
    # keeps fewer rows than its input has (of a few rows it keeps all: an exact product, no plan),
    # and compress_saved codes some of the block's activations (under min_numel it keeps all).
    library_or_skip()
    (name, mine, _, rows), = [p for p in host_overhead.pairs() if p[0].startswith("SampledLinear")]
    x = torch.randn(rows, host_overhead.COLS, requires_grad=True)
    with abp.memory.SavedTensorsCounter() as counter:
        mine()(x).sum().backward()
    kept_rows = abp.sampling.selection.keep_count(rows, mine().keep)
    assert kept_rows < rows
    assert any(t.shape[0] == kept_rows for t in counter.tensors), name  # the sampled rows, not x
    block = host_overhead._recipe_block()
    batch = torch.randn(host_overhead.ROWS_SAMPLED, host_overhead.COLS)
    with abp.compress_saved(bits=4) as compressing:
        loss = block(batch).sum()
    loss.backward()
    assert compressing.stats["compressed"] > 0


def test_profile_names_where_a_rows_host_time_goes(capsys) -> None:
    library_or_skip()
    host_overhead.profile("ReGELU2", calls=3, top=5)
    out = capsys.readouterr().out
    assert "== ReGELU2: Python functions by own time, 3 calls" in out
    assert "== ReGELU2: torch ops by self CPU time, 3 calls" in out
    try:
        host_overhead.abp_step("no such row")
    except SystemExit as e:
        assert "no row named 'no such row'" in str(e) and "ReGELU2" in str(e)
    else:
        raise AssertionError("an unknown row was accepted")
