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


def run_example(script: str, args: list) -> str:
    """Runs examples/<script> with this package on PYTHONPATH; returns its stdout (it must succeed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(abp.__file__).parent.parent), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(REPO / "examples" / script), *args], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_demo_trains_three_variants_and_prints_their_bytes():
    out = run_example("demo.py", ["--steps", "3", "--hidden", "32", "--batch", "64", "--samples", "512", "--device", "cpu"])
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if line.startswith(("torch", "abp"))}
    assert set(rows) == {"torch GELU (exact)", "abp ReGELU2 (2-bit)", "abp GELU bits=3"}, out
    # Two activations of 64 x 32 elements per step: fp32 input (exact), 2-bit and 3-bit codes.
    assert "16.0 KiB" in rows["torch GELU (exact)"]
    assert "1.0 KiB" in rows["abp ReGELU2 (2-bit)"] and "16.0x less" in rows["abp ReGELU2 (2-bit)"]
    assert "1.5 KiB" in rows["abp GELU bits=3"] and "10.7x less" in rows["abp GELU bits=3"]


def test_lowmembp_demo_converts_trains_and_saves_less():
    out = run_example("lowmembp_demo.py", ["--steps", "2", "--batch", "8", "--seq", "8", "--dim", "16", "--depth", "1",
                                           "--device", "cpu"])
    assert "replaced  blocks.0.norm1       LayerNorm -> MSLayerNorm" in out, out
    assert "affine kept" in out and "refused" not in out, out
    saved = [line for line in out.splitlines() if line.startswith("saved for backward per step")]
    assert saved and "x less" in saved[0], out
    assert "as written  final loss" in out and "lowmembp    final loss" in out, out


def test_gact_demo_trains_compressed_runs_and_saves_less():
    out = run_example("gact_demo.py", ["--steps", "2", "--batch", "8", "--seq", "16", "--dim", "32", "--depth", "1",
                                       "--device", "cpu"])
    rows = {line.split()[0] + (" " + line.split()[1] if line.split()[0] == "controller" else ""): line
            for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) == {"exact", "4-bit", "2-bit", "controller 4"}, out
    less = {name: float(row.split("(")[1].split("x less")[0]) for name, row in rows.items()}
    assert less["exact"] == 1.0 and less["2-bit"] > less["4-bit"] > 1.5, out
    average = float(rows["controller 4"].split("average ")[1].split(" bits")[0])
    assert 2.0 <= average <= 4.0, out  # the budget is never exceeded, and min_bits is 2


def test_real_data_demo_prints_accuracy_and_saved_bytes_per_setting():
    out = run_example("real_data_demo.py", ["--steps", "3"])
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) == {"exact", "compress-8", "compress-4", "compress-2", "controller-4"}, out
    accuracy = {name: float(row.split("accuracy")[1].split("%")[0]) for name, row in rows.items()}
    assert all(0 <= a <= 100 for a in accuracy.values()), out
    less = {name: float(row.split("(")[1].split("x less")[0]) for name, row in rows.items()}
    assert less["exact"] == 1.0 and less["compress-2"] > less["compress-4"] > less["compress-8"] > 1.5, out


def test_sampled_demo_trains_wtacrs_and_vcas_runs():
    out = run_example("sampled_demo.py", ["--steps", "12", "--batch", "8", "--seq", "16", "--dim", "32", "--depth", "1",
                                          "--device", "cpu"])
    rows = {" ".join(line.split()[:2]) if line.split()[0] == "wtacrs" else line.split()[0]: line
            for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) == {"exact", "wtacrs 0.3", "wtacrs 0.1", "vcas"}, out
    less = {name: float(row.split("(")[1].split("x less")[0]) for name, row in rows.items()}
    assert less["exact"] == 1.0 and less["vcas"] == 1.0 and less["wtacrs 0.1"] > less["wtacrs 0.3"] > 1.0, out
    assert "GEMM FLOPs x" in rows["vcas"], out  # calibrated at steps 0 and 10
