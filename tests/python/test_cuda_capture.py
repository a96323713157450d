"""CUDA-graph capture of abp's ops (issue #16 item 3); skipped without a CUDA build of torch and a GPU.

Every case of bench/capture_probe.py but those it lists as NOT_YET (a controller's estimation
step): every activation, both memory-sharing norms with and without affine, the sampled layer,
blocks converted by the lowmembp, sampled and all recipes, and a compress_saved block run a
forward and backward step with no host synchronisation torch can see
(set_sync_debug_mode("error")) and capture in a CUDA graph whose replay gives the eager step's
bytes where the step is deterministic.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from abp_reference import library_or_skip

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import capture_probe  # noqa: E402  (bench/capture_probe.py: the cases and the probe)

CASES = [pytest.param(name, make, deterministic, id=name)
         for name, make, deterministic in capture_probe.cases() if name not in capture_probe.NOT_YET]


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def test_the_not_yet_list_names_cases_the_probe_has():
    assert capture_probe.NOT_YET <= {name for name, _, _ in capture_probe.cases()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA and a GPU")
@pytest.mark.parametrize("name, make, deterministic", CASES)
def test_step_is_sync_free_and_captures(name, make, deterministic):
    row = capture_probe.probe(name, make, deterministic)
    assert "error" not in row, row
    assert row["sync_free"] is True and row["captured"] is True, row
    if deterministic:
        assert row["replay_equals_eager"] is True, row
