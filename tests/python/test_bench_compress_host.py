"""Smoke test of bench/compress_host.py (#16 item 2): one tiny run splits a compressed step's
extra time into the codec's kernels and compress_saved's host time, and counts the launches the
step makes through abp._lib.launch. The numbers themselves live in the benchmark, not here."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import abp
from abp_reference import library_or_skip

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import compress_host  # noqa: E402  (bench/compress_host.py)


def test_a_compressed_step_is_split_into_kernels_and_host_time() -> None:
    library_or_skip()
    row = compress_host.measure(d=16, layers=1, batch=2, seq=32, bits=4, steps=1, rounds=1)
    # 2 x 32 tokens of 16 features: the block's activations reach min_numel (1024), so some are
    # coded, and each coded tensor is quantized in forward and dequantized in backward.
    assert row["launches_per_step"] >= 2 and row["launches_per_step"] % 1 == 0
    assert row["kernels_ms"] > 0
    for key in ("exact_step_ms", "compressed_step_ms", "extra_ms", "host_ms"):
        assert math.isfinite(row[key])
    assert math.isclose(row["host_ms"], row["extra_ms"] - row["kernels_ms"])
    # The codec's calls hold every launch the step makes: one or more per call.
    assert row["codec_calls_per_step"] >= 2 and row["launches_per_step"] >= row["codec_calls_per_step"]
    assert row["codec_host_ms"] > 0 and math.isfinite(row["recorder_ms"])


def test_the_launch_counter_puts_the_launcher_back() -> None:
    totals = {"kernel_ns": 0.0, "kernel": 0}
    original = abp._lib.launch
    with compress_host.counting_launches(totals):
        assert abp._lib.launch is not original
    assert abp._lib.launch is original
