"""Compressed training on real data (CI-sized; bench/bench_compressed_training.py is the full run).

The tasks of bench/real_tasks.py, from the same seeds as exact training:

* digits (12 epochs, the benchmark's length, three seeds): `compress_saved(bits=4)` and
  `CompressionController(avg_bits=2)` reach exact training's test accuracy: their mean is within
  the exact seeds' spread, or within 0.3 points of the exact mean, whichever is larger;
* digits with timm's ViT (five seeds: its exact runs spread more), whose class token is a row of
  another scale than the patches' in every saved activation: the same;
* the byte-level language model (300 steps, half the benchmark's, three seeds): the same two reach
  exact training's validation loss: within the exact seeds' spread, or within 1 % of the exact mean.

Each stores what its widths promise, measured against exact training's bytes, and the guard stays
quiet. Without the op rules and without recompute, 2-bit codes of fused attention's query and key
make the same digits training diverge on torch >= 2, and the divergence guard says so.

Runs in the current-torch lane only (about nine minutes on 2 cores): fused attention, whose saved
tensors the rules and recompute protect, and recompute itself need torch >= 2; digits-vit needs timm.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch.nn.functional as F

from abp import _derived, _save_rules
from abp_reference import library_or_skip

if _save_rules.sequence_number() is None or not hasattr(F, "scaled_dot_product_attention") or not _derived.AVAILABLE:
    pytest.skip("the torch 2.x lane runs the compressed-training checks", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import real_tasks  # noqa: E402

#: task -> (metric, +1 if higher is better, steps, the fixed tolerance, relative to the exact mean?, seeds)
TASKS: Dict[str, Tuple[str, int, int, float, bool, int]] = {
    "digits": ("test_accuracy", +1, 276, 0.003, False, 3),
    "digits-vit": ("test_accuracy", +1, 276, 0.003, False, 5),
    "charlm": ("val_loss", -1, 300, 0.01, True, 3),
}
_runs: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}


def runs(task: str, setting: str) -> List[Dict[str, Any]]:
    library_or_skip()
    if task == "digits-vit":
        pytest.importorskip("timm")
    if (task, setting) not in _runs:
        steps, seeds = TASKS[task][2], TASKS[task][5]
        _runs[(task, setting)] = [real_tasks.train(task, setting, seed, steps=steps) for seed in range(seeds)]
    return _runs[(task, setting)]


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("setting", ["compress-4", "controller-2"])
def test_compressed_training_reaches_exact_training(task: str, setting: str) -> None:
    metric, sign, _, fixed, relative, _ = TASKS[task]
    exact = [r[metric] for r in runs(task, "exact")]
    got = [r[metric] for r in runs(task, setting)]
    mean = statistics.mean(exact)
    worst = min(exact, key=lambda v: sign * v)
    tolerance = max(sign * (mean - worst), fixed * abs(mean) if relative else fixed)
    assert sign * (mean - statistics.mean(got)) <= tolerance, (task, setting, got, exact)
    assert all(r["divergence_warning"] is None for r in runs(task, setting))


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("setting,most", [("compress-4", 0.12), ("controller-2", 0.1)])
def test_saved_bytes_shrink_as_the_widths_promise(task: str, setting: str, most: float) -> None:
    """Stored bytes of the last step against exact's fp32: 4/32 of what is stored (less what is
    recomputed), plus the 8-bit query, key and log-probabilities of one width, headers and what
    stays as it is; the controller's 2-bit average over every saved element, plus the same."""
    exact = runs(task, "exact")[0]["saved_bytes"]
    stored = runs(task, setting)[0]["saved_bytes"]
    assert 0 < stored <= most * exact, (task, setting, stored, exact)


def test_without_op_rules_and_recompute_two_bit_training_diverges_and_the_guard_says_so() -> None:
    exact = [r["test_accuracy"] for r in runs("digits", "exact")]
    broken = [real_tasks.train("digits", "compress-2-no-rules-no-recompute", seed) for seed in (0, 1)]
    # Below the worst exact seed by more than exact training's own seed spread.
    assert statistics.mean(r["test_accuracy"] for r in broken) < min(exact) - (max(exact) - min(exact))
    assert max(r["grad_norm_max"] for r in broken) > 5 * max(r["grad_norm_max"] for r in runs("digits", "exact"))
    assert any(r["divergence_warning"] is not None for r in broken)
