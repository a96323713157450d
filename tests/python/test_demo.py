"""examples/demo.py runs and reports the activation bytes each variant keeps."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import abp
from abp import _derived
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
    assert set(rows) == {"exact", "compress-8", "compress-4", "compress-4-no-recompute", "compress-2", "controller-4",
                         "controller-2"}, out
    accuracy = {name: float(row.split("accuracy")[1].split("%")[0]) for name, row in rows.items()}
    assert all(0 <= a <= 100 for a in accuracy.values()), out
    less = {name: float(row.split("(")[1].split("x less")[0]) for name, row in rows.items()}
    assert less["exact"] == 1.0 and less["compress-2"] > less["compress-4"] > less["compress-8"] > 1.5, out
    assert "CompressionController(avg_bits=2)" in rows["controller-2"], out
    if _derived.AVAILABLE:  # torch >= 2: what cheap ops derive is recomputed, not stored
        assert less["compress-4"] > less["compress-4-no-recompute"], out


def test_sampled_demo_trains_wtacrs_and_vcas_runs():
    out = run_example("sampled_demo.py", ["--steps", "12", "--batch", "8", "--seq", "16", "--dim", "32", "--depth", "1",
                                          "--device", "cpu"])
    rows = {" ".join(line.split()[:2]) if line.split()[0] == "wtacrs" else line.split()[0]: line
            for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) == {"exact", "wtacrs 0.3", "wtacrs 0.1", "vcas"}, out
    less = {name: float(row.split("(")[1].split("x less")[0]) for name, row in rows.items()}
    assert less["exact"] == 1.0 and less["vcas"] == 1.0 and less["wtacrs 0.1"] > less["wtacrs 0.3"] > 1.0, out
    assert "GEMM FLOPs x" in rows["vcas"], out  # calibrated at steps 0 and 10


PARITY_RECIPES = {"exact", "lowmembp", "fewbit-3", "compress-4", "compress-2", "controller-4", "controller-2",
                  "sampled-0.3", "vcas", "all"}


def parity_rows(out: str, task: str) -> dict:
    """The table rows of `task` in parity_demo.py's output: recipe -> its columns."""
    lines = out.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith(f"{task}: ")) + 2:]
    rows = {}
    for line in lines:
        if not line.startswith("  ") or line.split()[0] not in PARITY_RECIPES:
            break
        rows[line.split()[0]] = line
    return rows


def test_parity_demo_prints_every_recipe_and_writes_a_png(tmp_path):
    png = tmp_path / "parity.png"
    out = run_example("parity_demo.py", ["--tasks", "digits", "--digits-steps", "2", "--evals", "1", "--threads", "1",
                                         "--out", str(png)])
    rows = parity_rows(out, "digits")
    assert set(rows) == PARITY_RECIPES, out
    for name, row in rows.items():
        assert 0 <= float(row.split()[1]) <= 100 and (" yes " in row or " NO " in row), row  # mean %, target
    saved = {name: float(row.split("MiB")[0].split()[-1]) for name, row in rows.items()}
    assert saved["compress-2"] < saved["compress-4"] < saved["all"] < saved["lowmembp"] < saved["exact"], out
    assert saved["vcas"] == saved["exact"] and "GEMM FLOPs x" in rows["vcas"], out
    assert all(row.rstrip().split("ms")[0].split()[-1].replace(".", "").isdigit() for row in rows.values()), out
    if importlib.util.find_spec("matplotlib") is None:
        assert "note: matplotlib is not installed" in out and not png.exists(), out
    else:
        assert f"plot: {png}" in out, out
        data = png.read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n", len(data)


def test_parity_demo_language_model_rows_and_redraw_from_json(tmp_path):
    saved = tmp_path / "parity.json"
    args = ["--tasks", "charlm", "--charlm-steps", "1", "--recipes", "exact,compress-2,all", "--evals", "1",
            "--threads", "1", "--json", str(saved), "--out", str(tmp_path / "a.png")]
    out = run_example("parity_demo.py", args)
    rows = parity_rows(out, "charlm")
    assert set(rows) == {"exact", "compress-2", "all"}, out
    assert all(1 < float(row.split()[1]) < 6 for row in rows.values()), out  # nats per byte after a step
    assert "[allow_low_bits]" in out and "lowmembp + sampled 0.3 + compress 8 bits" in out, out
    again = run_example("parity_demo.py", ["--from-json", str(saved), "--out", str(tmp_path / "b.png")])
    assert parity_rows(again, "charlm") == rows, again
