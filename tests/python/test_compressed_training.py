"""Compressed training on real data (CI-sized; bench/bench_compressed_training.py is the full run).

Scikit-learn's digits with a small transformer (bench/real_tasks.py), 12 epochs, three seeds:
`compress_saved(bits=4)` reaches exact training's test accuracy: its mean is within the exact
seeds' spread, or within 0.3 points of the exact mean, whichever is larger, and it stores at most
a fifth of the bytes. (Uniform 2 bits is refused by default: it fails on the language model of
bench/real_tasks.py; so are controller budgets below 4 bits, which do not reach exact training
either: docs/compressed-training.md has both.)
Without the op rules (``op_rules=False``), 2-bit codes of fused attention's query and key make
the same training diverge on torch >= 2, and the divergence guard says so.

Runs in the current-torch lane only (a few minutes on 2 cores): fused attention, whose saved
tensors the rules protect, does not exist on torch 1.13.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch.nn.functional as F

from abp import _save_rules
from abp_reference import library_or_skip

if _save_rules.sequence_number() is None or not hasattr(F, "scaled_dot_product_attention"):
    pytest.skip("the torch 2.x lane runs the compressed-training checks", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import real_tasks  # noqa: E402

SEEDS = (0, 1, 2)
_runs: Dict[str, List[Dict[str, Any]]] = {}


def runs(setting: str) -> List[Dict[str, Any]]:
    library_or_skip()
    if setting not in _runs:
        _runs[setting] = [real_tasks.train("digits", setting, seed) for seed in SEEDS]
    return _runs[setting]


def accuracy(setting: str) -> float:
    return statistics.mean(r["test_accuracy"] for r in runs(setting))


@pytest.mark.parametrize("setting", ["compress-4"])
def test_compressed_training_reaches_exact_accuracy(setting: str) -> None:
    exact = [r["test_accuracy"] for r in runs("exact")]
    floor = min(min(exact), statistics.mean(exact) - 0.003)
    assert accuracy(setting) >= floor, (setting, accuracy(setting), exact)
    assert all(r["divergence_warning"] is None for r in runs(setting))


@pytest.mark.parametrize("setting,most", [("compress-4", 0.2)])
def test_saved_bytes_shrink_as_the_widths_promise(setting: str, most: float) -> None:
    """Stored bytes of the last step against exact's: at most 4/32 or 2/32 of the compressed
    tensors plus what stays (row statistics, 8-bit attention inputs, headers), measured."""
    exact = runs("exact")[0]["saved_bytes"]
    stored = runs(setting)[0]["saved_bytes"]
    assert 0 < stored <= most * exact, (setting, stored, exact)


def test_without_op_rules_two_bit_training_diverges_and_the_guard_says_so() -> None:
    exact = [r["test_accuracy"] for r in runs("exact")]
    broken = [real_tasks.train("digits", "compress-2-no-rules", seed) for seed in SEEDS[:2]]
    # Below the worst exact seed by more than exact training's own seed spread.
    assert statistics.mean(r["test_accuracy"] for r in broken) < min(exact) - (max(exact) - min(exact))
    assert max(r["grad_norm_max"] for r in broken) > 5 * max(r["grad_norm_max"] for r in runs("exact"))
    assert any(r["divergence_warning"] is not None for r in broken)
