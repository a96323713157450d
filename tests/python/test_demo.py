"""examples/demo.py runs and reports the activation bytes each variant keeps."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import abp
from abp_reference import library_or_skip

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def test_demo_trains_three_variants_and_prints_their_bytes():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(abp.__file__).parent.parent), env.get("PYTHONPATH", "")]))
    args = ["--steps", "3", "--hidden", "32", "--batch", "64", "--samples", "512", "--device", "cpu"]
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split("  ")[0].strip(): line for line in result.stdout.splitlines() if line.startswith(("torch", "abp"))}
    assert set(rows) == {"torch GELU (exact)", "abp ReGELU2 (2-bit)", "abp GELU bits=3"}, result.stdout
    # Two activations of 64 x 32 elements per step: fp32 input (exact), 2-bit and 3-bit codes.
    assert "16.0 KiB" in rows["torch GELU (exact)"]
    assert "1.0 KiB" in rows["abp ReGELU2 (2-bit)"] and "16.0x less" in rows["abp ReGELU2 (2-bit)"]
    assert "1.5 KiB" in rows["abp GELU bits=3"] and "10.7x less" in rows["abp GELU bits=3"]
