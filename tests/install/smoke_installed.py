"""Run by python_wheel.sh with an interpreter that has abp installed from the wheel, from outside
the source tree, with no ABP_* variable and no path to the build: every file abp uses must come
from the installed package. Exits non-zero (an AssertionError or AbpError) on the first failure.

Usage: smoke_installed.py SOURCE_TREE [--without-llvm]. `--without-llvm` is for a machine without
LLVM 19's shared libraries (scripts/device-check's GPU machine): there, compiling IR at run time
must fail with the message that says how to get them, and everything else must work. Where a GPU
is present, the op, NVRTC from the environment and a compressed training step also run on it."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

import abp
import abp.functional

package = Path(abp.__file__).resolve().parent
source_tree = Path(sys.argv[1]).resolve()
without_llvm = sys.argv[2:] == ["--without-llvm"]
assert sys.argv[2:] in ([], ["--without-llvm"]), f"usage: {sys.argv[0]} SOURCE_TREE [--without-llvm]"
assert not any(k.startswith("ABP_") for k in os.environ), sorted(k for k in os.environ if k.startswith("ABP_"))
assert package != source_tree / "bindings" / "python" / "abp", f"abp imported from the source tree: {package}"

# The runtime and the op library are the package's own.
assert abp.kernel_dir() == package / "kernels", abp.kernel_dir()
# An op of the library, forward exact and backward the defined 3-bit derivative.
x = torch.linspace(-3, 3, 1001, requires_grad=True)
y = abp.functional.apply("gelu_b3", x)
exact = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
assert torch.allclose(y, exact, atol=1e-6), (y - exact).abs().max()
# The compiled launcher (one stable-ABI module for every CPython 3) came with the wheel and is what
# the general path launches through (the op above ran in the C++ lane, which does not need it).
from abp import _lib  # noqa: E402
assert _lib.launcher_path() == package / "lib" / "_abp_launch.abi3.so", _lib.launcher_path()
assert _lib.launcher() is not _lib.launch_ctypes, "abp launches through ctypes, not its compiled launcher"
maps = Path("/proc/self/maps").read_text()
assert str(package / "lib" / "libabp.so") in maps
assert str(package / "lib" / "_abp_launch.abi3.so") in maps, "the compiled launcher is not loaded"
assert "abp_compiler" not in maps, "the IR compiler was loaded before anything compiled IR"
# The C++ per-call lane is built from the package's own source against this torch and ran the op.
from abp import _plan_lane  # noqa: E402
assert _plan_lane.status() == "C++ lane", _plan_lane.status()
assert _plan_lane.SOURCES == (package / "_plan_lane.cpp", package / "_row_plan.cpp"), _plan_lane.SOURCES
assert "OperatorFunction" not in type(y.grad_fn).__name__, type(y.grad_fn)
y.sum().backward()
table = abp.inspect("gelu_b3")["operator"]["tables"][0]
codes = torch.bucketize(x.detach(), torch.tensor(table["borders"]), right=True)
assert torch.equal(x.grad, torch.tensor(table["levels"])[codes]), "backward is not levels[code(x)]"

# abp.inspect finds the installed IR the kernels were compiled from.
info = abp.inspect("gelu_b3")
assert info["ir_path"] == str(package / "ops" / "fewbit" / "gelu.mlir"), info["ir_path"]
assert "abp.operator" in info["ir"]

# A converted model trains with compressed saved activations.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
model, changes = abp.convert(model, recipe="lowmembp")
assert any(type(m).__module__.startswith("abp") for m in model.modules()), "convert replaced nothing"
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data, target = torch.randn(64, 16), torch.randint(0, 4, (64,))
losses = []
for _ in range(20):
    opt.zero_grad()
    with abp.compress_saved(bits=4, generator=torch.Generator().manual_seed(1)):
        loss = torch.nn.functional.cross_entropy(model(data), target)
        loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
assert losses[-1] < losses[0], losses

# Run-time IR compilation through the installed compiler library and device header.
IR = """
#t = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [3.0, 0.5, 0.25, 3.0]>
func.func private @cube(%x: f32) -> f32 {
  %a = arith.mulf %x, %x : f32
  %b = arith.mulf %a, %x : f32
  return %b : f32
}
func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}
abp.operator @installed_cube forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @cube(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #t} : tensor<?xf32> -> !abp.codes<2>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<2>
} backward {
^bb0(%c: !abp.codes<2>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #t} : !abp.codes<2> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
"""
if without_llvm:
    try:
        abp.compile_operators(IR, origin="smoke.mlir")
    except abp.AbpError as e:
        message = str(e)
        for needed in ("libabp_compiler.so", "LLVM 19", "apt install", "ABP_COMPILER_LIBRARY"):
            assert needed in message, f"the missing compiler's message does not say {needed!r}: {message}"
    else:
        raise AssertionError("--without-llvm, but the IR compiled: this machine has LLVM 19")
else:
    (name,) = abp.compile_operators(IR, origin="smoke.mlir")
    x = torch.randn(257, requires_grad=True)
    y = abp.functional.apply(name, x)
    assert torch.equal(y, x.detach() ** 3) or torch.equal(y, x.detach() * x.detach() * x.detach())
    y.sum().backward()
    levels = torch.tensor([3.0, 0.5, 0.25, 3.0])
    assert torch.equal(x.grad, levels[torch.bucketize(x.detach(), torch.tensor([-1.0, 0.0, 1.0]), right=True)])
    assert str(package / "lib" / "libabp_compiler.so") in Path("/proc/self/maps").read_text()

# NVRTC from NVIDIA's wheel, where the environment has one (torch's CUDA wheels install it).
from abp import _lib  # noqa: E402

pip_nvrtc = _lib.pip_nvrtc_candidates()
if pip_nvrtc:
    size = _lib.kernel_library().compile_for_arch("gelu_b3_fwd", "sm_80", "ptx")
    assert size > 0
    maps = Path("/proc/self/maps").read_text()
    assert str(pip_nvrtc[0].resolve()) in maps or str(pip_nvrtc[0]) in maps, "NVRTC was not the wheel's"
# On a GPU: the op's kernels compiled at first use by the NVRTC found above (the wheel's where the
# environment has one), forward within float rounding of the exact GELU and backward the same
# levels as on the CPU; a converted model takes compressed training steps there.
on_gpu = torch.cuda.is_available()
if on_gpu:
    xh = torch.linspace(-3, 3, 1001, requires_grad=True)
    abp.functional.apply("gelu_b3", xh).sum().backward()
    xc = xh.detach().cuda().requires_grad_()
    yc = abp.functional.apply("gelu_b3", xc)
    exact_h = 0.5 * xh.detach() * (1 + torch.erf(xh.detach() / math.sqrt(2)))
    assert torch.allclose(yc.cpu(), exact_h, atol=1e-5), (yc.cpu() - exact_h).abs().max()
    yc.sum().backward()
    assert torch.equal(xc.grad.cpu(), xh.grad), "the GPU's backward is not the CPU's levels[code(x)]"
    maps = Path("/proc/self/maps").read_text()
    if pip_nvrtc:
        assert str(pip_nvrtc[0].resolve()) in maps or str(pip_nvrtc[0]) in maps, "NVRTC was not the wheel's"
    assert "libnvrtc" in maps, "a CUDA op ran with no NVRTC loaded"
    torch.manual_seed(0)  # a fresh model: the CPU steps above have already fitted `model`
    model_gpu, _ = abp.convert(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                                   torch.nn.Linear(32, 4)), recipe="lowmembp")
    model_gpu = model_gpu.cuda()
    opt = torch.optim.SGD(model_gpu.parameters(), lr=0.1)
    data_gpu, target_gpu = data.cuda(), target.cuda()
    gpu_losses = []
    for _ in range(20):
        opt.zero_grad()
        with abp.compress_saved(bits=4, generator=torch.Generator("cuda").manual_seed(1)):
            loss = torch.nn.functional.cross_entropy(model_gpu(data_gpu), target_gpu)
            loss.backward()
        opt.step()
        gpu_losses.append(float(loss.detach()))
    assert gpu_losses[-1] < gpu_losses[0], gpu_losses
print(f"installed abp {abp.version()} from {package}: ok"
      f" (torch {torch.__version__}; NVRTC from a wheel: {bool(pip_nvrtc)}; GPU: {on_gpu};"
      f" IR compiler: {'absent, as expected' if without_llvm else 'ran'})")
