"""The public surface: errors that name the bad argument, modules, training, inspect, cache, loading."""
from __future__ import annotations

import ctypes.util
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F

import abp
from abp._errors import CompileError
from abp_reference import (
    BUCKET_DOC_TABLES,
    bucket_backward,
    f32,
    fewbit_ops,
    library_or_skip,
    manifest_table,
)

PACKAGE_DIR = Path(abp.__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter with the package importable and `env` added."""
    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_DIR), full.get("PYTHONPATH", "")]))
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------------
# Errors name the bad argument and say what was expected.


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool, torch.uint8])
@pytest.mark.parametrize(
    "call",
    [abp.functional.regelu2, lambda x: abp.functional.gelu(x, bits=2), abp.functional.relu, lambda x: abp.nn.SiLU(bits=1)(x)],
    ids=["regelu2", "gelu", "relu", "SiLU"],
)
def test_unsupported_dtype_is_a_type_error_naming_input(call, dtype):
    x = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError) as info:
        call(x)
    message = str(info.value)
    # A module says which it is first: "SiLU (silu_b1): input: ...".
    assert re.match(r"^(\w+ \(\w+\): )?input:", message), message
    assert "torch.float32, torch.float16 or torch.bfloat16" in message and str(dtype) in message


def test_non_tensor_and_non_cpu_cuda_inputs_are_rejected():
    with pytest.raises(TypeError, match=r"^input: expected a torch.Tensor, got list"):
        abp.functional.regelu2([1.0, 2.0])
    with pytest.raises(ValueError, match=r"^input: expected a CPU or CUDA tensor, got a tensor on meta"):
        abp.functional.regelu2(torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match=r"^input: expected a dense"):
        abp.functional.relu(torch.zeros(3, 3).to_sparse())


def test_sampled_layers_and_vcas_on_meta_tensors_name_the_device():
    """A model moved to "meta": the sampled layer and VCAS's samplers said "Found no NVIDIA driver"
    (every device that is not the CPU was taken for CUDA); a GPU machine would have launched on a
    meta pointer. Without gradients the sampled layer is a plain linear map, which meta runs."""
    layer = abp.nn.SampledLinear(8, 4).to("meta")
    x = torch.empty(64, 8, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match=r"^x: expected a CPU or CUDA tensor, got a tensor on meta"):
        layer(x)
    with torch.no_grad():
        assert layer(x).shape == (64, 4)
    with pytest.raises(ValueError, match=r"^grad: expected a CPU or CUDA tensor, got a tensor on meta"):
        abp.vcas.sample_activation_grad(torch.empty(8, 100, device="meta"), 0.5, 0)
    with pytest.raises(ValueError, match=r"^x: expected a CPU or CUDA tensor, got a tensor on meta"):
        abp.vcas.sampled_linear_grads(torch.empty(8, 3, device="meta"), torch.empty(8, 2, device="meta"),
                                      torch.empty(2, 3, device="meta"), 0.5, 0)
    with pytest.raises(ValueError, match=r"^abp's kernels run on CPU and CUDA tensors, got a tensor on meta"):
        abp.sampling.kernels.row_norms(torch.empty(4, 3, device="meta"))


@pytest.mark.parametrize("bits", [0, 5, 8, 2.0, True, "3", None])
def test_bits_outside_1_to_4_is_a_value_error_naming_bits(bits):
    x = torch.randn(4)
    with pytest.raises(ValueError, match=r"^bits: expected 1, 2, 3 or 4"):
        abp.functional.gelu(x, bits=bits)
    with pytest.raises(ValueError, match=r"^bits: expected 1, 2, 3 or 4"):
        abp.nn.Tanh(bits=bits)


def test_weight_must_be_normal_or_uniform():
    with pytest.raises(ValueError, match=r"^weight: expected 'normal' or 'uniform'"):
        abp.functional.silu(torch.randn(3), weight="gaussian")
    with pytest.raises(ValueError, match=r"^weight: "):
        abp.nn.GELU(weight="histogram")


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda x: abp.functional.elu(x, alpha=0.5), "alpha"),
        (lambda x: abp.functional.celu(x, 2.0), "alpha"),
        (lambda x: abp.functional.softplus(x, beta=2.0), "beta"),
        (lambda x: abp.functional.softplus(x, threshold=10.0), "threshold"),
        (lambda x: abp.nn.ELU(alpha=0.1), "alpha"),
        (lambda x: abp.nn.CELU(alpha=3.0), "alpha"),
        (lambda x: abp.nn.Softplus(beta=0.5), "beta"),
    ],
)
def test_non_default_parameters_of_fitted_tables_are_refused(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: .*fitted for torch's default {name}"):
        call(torch.randn(3))


def test_default_parameters_given_explicitly_are_fine():
    x = torch.randn(50)
    torch.testing.assert_close(abp.functional.elu(x, alpha=1.0), F.elu(x))
    torch.testing.assert_close(abp.functional.softplus(x, beta=1, threshold=20), F.softplus(x))
    torch.testing.assert_close(abp.nn.CELU(alpha=1)(x), F.celu(x))


def test_other_bad_parameters():
    x = torch.randn(3)
    for bad in ("exact", "Tanh", None):
        with pytest.raises(ValueError, match=r"^approximate: expected 'none' \(erf form\) or 'tanh'"):
            abp.functional.gelu(x, approximate=bad)
        with pytest.raises(ValueError, match=r"^approximate: "):
            abp.nn.GELU(bad)
        with pytest.raises(ValueError, match=r"^approximate: "):
            abp.functional.regelu2(x, approximate=bad)
        with pytest.raises(ValueError, match=r"^approximate: "):
            abp.nn.ReGELU2(approximate=bad)
    with pytest.raises(ValueError, match=r"^bits: "):
        abp.nn.GELU("tanh", bits=5)
    with pytest.raises(ValueError, match=r"^min_val: expected min_val <= max_val"):
        abp.functional.hardtanh(x, 2.0, 1.0)
    with pytest.raises(ValueError, match=r"^min_val: "):
        abp.nn.Hardtanh(1.0, -1.0)
    with pytest.raises(TypeError, match=r"^negative_slope: expected a number, got str"):
        abp.functional.leaky_relu(x, "0.1")
    with pytest.raises(TypeError, match=r"^lambd: expected a number, got a tensor of shape \(2,\)"):
        abp.nn.Hardshrink(torch.tensor([0.1, 0.2]))
    # A 0-d tensor parameter is a number.
    torch.testing.assert_close(abp.functional.leaky_relu(x, torch.tensor(0.3)), F.leaky_relu(x, 0.3))


def test_unknown_operator_is_an_abp_error_listing_the_known_ones():
    with pytest.raises(abp.AbpError) as info:
        abp.functional.apply("no_such_op", torch.randn(3))
    assert info.value.status == abp.Status.NOT_FOUND
    assert "no_such_op" in str(info.value) and "regelu2" in str(info.value)
    with pytest.raises(abp.AbpError):
        abp.inspect("no_such_op")


def test_wrong_gradient_shape_or_device_is_reported():
    op = abp._lib.kernel_library().operator("relu")
    codes = torch.zeros(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^grad_output: expected shape \(4,\)"):
        abp._launch.backward(op, [codes], [torch.ones(5)], torch.Size([4]), torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"^grad_output: expected dtype"):
        abp._launch.backward(op, [codes], [torch.ones(4, dtype=torch.float64)], torch.Size([4]), torch.float32, torch.device("cpu"))


def test_mismatched_inputs_name_the_second_one():
    with pytest.raises(ValueError, match=r"^input1: expected shape \(3,\)"):
        abp._launch.check_inputs([torch.zeros(3), torch.zeros(4)], ["input0", "input1"])
    with pytest.raises(TypeError, match=r"^input1: expected dtype torch.float32"):
        abp._launch.check_inputs([torch.zeros(3), torch.zeros(3, dtype=torch.float16)], ["input0", "input1"])


# ---------------------------------------------------------------------------------------------------
# Modules: drop-in, tables, repr.

FEWBIT_MODULES = {
    "gelu": "GELU",
    "silu": "SiLU",
    "celu": "CELU",
    "elu": "ELU",
    "hardswish": "Hardswish",
    "logsigmoid": "LogSigmoid",
    "mish": "Mish",
    "selu": "SELU",
    "sigmoid": "Sigmoid",
    "softplus": "Softplus",
    "softsign": "Softsign",
    "tanh": "Tanh",
    "tanhshrink": "Tanhshrink",
}


@pytest.mark.parametrize("op,act,bits,weight", fewbit_ops(), ids=[o for o, *_ in fewbit_ops()])
def test_fewbit_modules_expose_their_manifest_table(op, act, bits, weight):
    module = getattr(abp.nn, FEWBIT_MODULES[act])(bits=bits, weight=weight)
    assert module.operator == op and module.saved_bits_per_element == bits
    borders, levels = manifest_table(op)
    assert module.borders.dtype == torch.float32 and module.levels.dtype == torch.float32
    assert torch.equal(module.borders, f32(borders)) and torch.equal(module.levels, f32(levels))
    assert module.levels.numel() == 2**bits and module.borders.numel() == 2**bits - 1
    assert torch.all(module.borders[1:] > module.borders[:-1])
    assert f"bits={bits}" in repr(module) and f"weight='{weight}'" in repr(module)
    x = torch.randn(100)
    assert torch.equal(module(x), getattr(abp.functional, act)(x, bits=bits, weight=weight))


@pytest.mark.parametrize("cls,op", [(abp.nn.ReGELU2, "regelu2"), (abp.nn.ReSiLU2, "resilu2")])
def test_lowmembp_modules_expose_the_published_constants_in_fp32(cls, op):
    module = cls()
    borders, levels = BUCKET_DOC_TABLES[op]
    assert torch.equal(module.borders, f32(borders)) and torch.equal(module.levels, f32(levels))
    assert torch.equal(module.borders, f32(manifest_table(op)[0]))
    assert module.saved_bits_per_element == 2 and op in repr(module)


def _committed_regelu2_tanh_table():
    """(borders, levels) of the #regelu2_tanh table as written in ops/lowmembp/regelu2_tanh.mlir."""
    text = (Path(__file__).resolve().parents[2] / "ops" / "lowmembp" / "regelu2_tanh.mlir").read_text()
    m = re.search(r"^#regelu2_tanh = #abp\.buckets<borders = \[(.*)\], levels = \[(.*)\]>$", text, re.M)
    assert m, "no #regelu2_tanh table in ops/lowmembp/regelu2_tanh.mlir"
    return [float(v) for v in m.group(1).split(", ")], [float(v) for v in m.group(2).split(", ")]


def test_regelu2_tanh_module_exposes_the_committed_fitted_table_in_fp32():
    module = abp.nn.ReGELU2(approximate="tanh")
    borders, levels = _committed_regelu2_tanh_table()
    assert module.operator == "regelu2_tanh" and module.saved_bits_per_element == 2
    assert torch.equal(module.borders, f32(borders)) and torch.equal(module.levels, f32(levels))
    assert module.levels[0] == 0 and module.levels[3] == 1  # the surrogate is 0 left of c1, x right of c3
    assert "approximate='tanh'" in repr(module) and "regelu2_tanh" in repr(module)
    assert "approximate='none'" in repr(abp.nn.ReGELU2()) and abp.nn.ReGELU2("none").operator == "regelu2"
    x = torch.randn(100)
    assert torch.equal(module(x), abp.functional.regelu2(x, approximate="tanh"))
    assert torch.equal(module(x), abp.functional.regelu2(x, "tanh"))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("weight", ["normal", "uniform"])
def test_gelu_tanh_modules_and_functions_pick_the_tanh_tables(bits, weight):
    op = f"gelu_tanh_b{bits}" + ("_uniform" if weight == "uniform" else "")
    module = abp.nn.GELU(approximate="tanh", bits=bits, weight=weight)
    assert abp.functional.fewbit_operator("gelu_tanh", bits, weight) == op
    assert module.operator == op and module.saved_bits_per_element == bits and module.activation == "gelu_tanh"
    borders, levels = manifest_table(op)
    assert torch.equal(module.borders, f32(borders)) and torch.equal(module.levels, f32(levels))
    # The erf form's table is a different one (its own fit; the 1-bit uniform ones share the border 0).
    erf = abp.nn.GELU(bits=bits, weight=weight)
    assert erf.operator == op.replace("gelu_tanh", "gelu")
    assert not (torch.equal(erf.borders, module.borders) and torch.equal(erf.levels, module.levels))
    assert f"approximate='tanh', bits={bits}, weight='{weight}'" in repr(module)
    x = torch.randn(100)
    assert torch.equal(module(x), abp.functional.gelu(x, approximate="tanh", bits=bits, weight=weight))
    assert torch.equal(abp.nn.GELU("tanh", bits=bits, weight=weight)(x), module(x))


@pytest.mark.parametrize(
    "make,borders,levels,torch_module",
    [
        (lambda: abp.nn.ReLU(), [0.0], [0.0, 1.0], torch.nn.ReLU()),
        (lambda: abp.nn.ReLU6(), [0.0, 6.0], [0.0, 1.0], torch.nn.ReLU6()),
        (lambda: abp.nn.Hardsigmoid(), [-3.0, 3.0], [0.0, 1.0 / 6.0], torch.nn.Hardsigmoid()),
        (lambda: abp.nn.LeakyReLU(0.2), [0.0], [0.2, 1.0], torch.nn.LeakyReLU(0.2)),
        (lambda: abp.nn.Threshold(0.5, -1.0), [0.5], [0.0, 1.0], torch.nn.Threshold(0.5, -1.0)),
        (lambda: abp.nn.Hardtanh(-2.0, 0.5), [-2.0, 0.5], [0.0, 1.0], torch.nn.Hardtanh(-2.0, 0.5)),
        (lambda: abp.nn.Hardshrink(0.3), [-0.3, 0.3], [0.0, 1.0], torch.nn.Hardshrink(0.3)),
        (lambda: abp.nn.Softshrink(), [-0.5, 0.5], [0.0, 1.0], torch.nn.Softshrink()),
    ],
    ids=["ReLU", "ReLU6", "Hardsigmoid", "LeakyReLU", "Threshold", "Hardtanh", "Hardshrink", "Softshrink"],
)
def test_piecewise_modules_match_torch_and_document_their_bit(make, borders, levels, torch_module):
    module = make()
    assert torch.equal(module.borders, f32(borders)) and torch.equal(module.levels, f32(levels))
    assert module.saved_bits_per_element == 1
    x = (torch.randn(300) * 4).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = module(x), torch_module(x_ref)
    assert torch.equal(y, y_ref)
    dy = torch.randn(300)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
    assert repr(module).startswith(type(module).__name__ + "(")


def test_inplace_writes_the_input_and_the_default_does_not():
    x = torch.randn(100)
    before = x.clone()
    for module in (abp.nn.ReLU(), abp.nn.SiLU(), abp.nn.ELU(1.0), abp.nn.Hardswish()):
        y = module(x)
        assert torch.equal(x, before) and y.data_ptr() != x.data_ptr()
    for module, ref in ((abp.nn.ReLU(inplace=True), F.relu), (abp.nn.ELU(1.0, True), F.elu),
                        (abp.nn.Hardswish(inplace=True), F.hardswish)):
        x = before.clone()
        assert module(x) is x and torch.allclose(x, ref(before), rtol=1e-6, atol=1e-7)
    x = before.clone()
    y = abp.functional.leaky_relu(x, 0.1, inplace=True)
    assert y is x and torch.equal(y, F.leaky_relu(before, 0.1))


def test_modules_have_no_state_and_load_a_torch_state_dict():
    torch_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    abp_model = torch.nn.Sequential(torch.nn.Linear(4, 8), abp.nn.GELU(bits=4), torch.nn.Linear(8, 2))
    abp_model.load_state_dict(torch_model.state_dict())
    assert list(abp_model[1].state_dict()) == [] and list(abp_model[1].parameters()) == []
    x = torch.randn(3, 4)
    assert_close_f32 = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(abp_model(x), torch_model(x), **assert_close_f32)


class _TableActivation(torch.autograd.Function):
    """A pure-torch reference of a bucket activation: exact forward, levels[code(x)] * dy backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Any, borders: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.table = (borders, levels)
        return fn(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return bucket_backward(x, dy, *ctx.table), None, None, None


def test_training_step_in_a_sequential_matches_a_pure_torch_reference():
    torch.manual_seed(0)
    data, target = torch.randn(64, 16), torch.randn(64, 1)
    abp_model = torch.nn.Sequential(torch.nn.Linear(16, 32), abp.nn.GELU(bits=3), torch.nn.Linear(32, 1))
    ref_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Identity(), torch.nn.Linear(32, 1))
    ref_model.load_state_dict(abp_model.state_dict())
    borders, levels = abp_model[1].borders, abp_model[1].levels

    def ref_forward(x: torch.Tensor) -> torch.Tensor:
        h = ref_model[0](x)
        return ref_model[2](_TableActivation.apply(h, F.gelu, borders, levels))

    loss = F.mse_loss(abp_model(data), target)
    ref_loss = F.mse_loss(ref_forward(data), target)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    loss.backward()
    ref_loss.backward()
    for p, q in zip(abp_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)

    optimizer = torch.optim.SGD(abp_model.parameters(), lr=0.05)
    first = None
    for _ in range(30):
        optimizer.zero_grad()
        loss = F.mse_loss(abp_model(data), target)
        loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
    assert math.isfinite(loss.item()) and loss.item() < first


# ---------------------------------------------------------------------------------------------------
# Package functions: operators, inspect, cuda_available, cache, version, loading.


def test_operators_lists_the_whole_library():
    names = set(abp.operators())
    expected = {"regelu2", "resilu2", "relu", "relu6", "hardsigmoid", "leaky_relu", "threshold", "hardtanh"}
    expected |= {"hardshrink", "softshrink"} | {op for op, *_ in fewbit_ops()}
    assert expected <= names
    assert abp.operators() == sorted(names)


def test_inspect_returns_manifest_generated_source_and_ir():
    info = abp.inspect("leaky_relu")
    assert info["name"] == "leaky_relu" and info["operator"]["params"] == ["negative_slope"]
    assert Path(info["manifest_path"]).parent == abp.kernel_dir()
    kernels = {k["name"]: k for k in info["operator"]["kernels"]}
    assert set(kernels) == {"leaky_relu_fwd", "leaky_relu_bwd"}
    for k in kernels.values():
        for symbol in k["symbols"].values():
            assert symbol in info["source"]  # the generated CUDA C++ defines every symbol
    assert info["source"] == Path(info["source_path"]).read_text()
    assert info["host_library"].endswith("leaky_relu.host.so") and Path(info["host_library"]).is_file()
    if info["ir"] is not None:
        assert "abp.operator @leaky_relu" in info["ir"]
    info = abp.inspect("gelu_b2")
    assert info["operator"]["tables"] and "gelu_b2" in info["source"]


def test_cuda_available_is_a_bool_that_agrees_with_the_driver():
    available = abp.cuda_available()
    assert isinstance(available, bool)
    if torch.cuda.is_available():
        assert available


def test_version_and_kernel_dir():
    assert abp.version() and abp.version()[0].isdigit()
    assert abp.kernel_dir().is_dir() and list(abp.kernel_dir().glob("*.json"))


def test_cache_stats_and_clear_in_a_private_cache(tmp_path):
    code = """
import json, abp
stats = abp.cache.stats()
assert set(stats) == {"memory_hits", "disk_hits", "misses", "compile_ms"}, stats
abp.cache.clear()
print(json.dumps(abp.cache.stats()))
"""
    result = run_python(code, ABP_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["misses"] == 0


def _nvrtc_works() -> bool:
    try:
        abp._lib.kernel_library().compile_for_arch("relu_fwd", "sm_80", "ptx")
        return True
    except abp.AbpError:
        return False


def test_compile_error_carries_log_source_options_and_arch(tmp_path):
    if not _nvrtc_works():
        pytest.skip("NVRTC is not available on this machine")
    source = Path(abp.inspect("relu")["source_path"]).read_bytes()
    broken = source + b"\nthis line is not C++;\n"
    override = tmp_path / "override"
    override.mkdir()
    (override / (hashlib.sha256(source).hexdigest() + ".cu")).write_bytes(broken)
    code = """
import json, abp
from abp import _lib
try:
    _lib.kernel_library().compile_for_arch("relu_fwd", "sm_90", "cubin")
except abp.CompileError as e:
    print(json.dumps({"status": int(e.status), "arch": e.arch, "options": e.options, "log": e.log,
                      "source": e.source, "detail": e.detail, "isabp": isinstance(e, abp.AbpError)}))
"""
    result = run_python(code, ABP_OVERRIDE_DIR=str(override), ABP_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    info: Dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["status"] == abp.Status.COMPILE and info["isabp"]
    assert info["arch"] == "sm_90"
    assert "-arch=sm_90" in info["options"]
    assert "error" in info["log"] and "this line is not C++" in info["log"]
    assert info["source"] == broken.decode()
    assert "ABP_OVERRIDE_DIR" in result.stderr  # the override is announced


def test_compile_error_parses_the_runtime_format():
    message = "NVRTC 13.0 failed to compile x.cu (x) for sm_80 (ptx): ERR\noptions: --std=c++17 -arch=sm_80\n"
    detail = (
        "compiler log (NVRTC_ERROR_COMPILATION):\nx.cu(2): error: bad\n"
        "source x.cu ('>' marks the lines the log mentions):\n     1 | int a;\n>    2 | bad\n"
    )
    e = abp._errors.error_from_status(5, message + detail, detail)
    assert isinstance(e, CompileError) and e.status == abp.Status.COMPILE
    assert e.arch == "sm_80" and e.options == ["--std=c++17", "-arch=sm_80"]
    assert e.log == "x.cu(2): error: bad" and e.source == "int a;\nbad\n"
    assert "options:" in e.dump() and str(e).startswith("[compile] NVRTC")
    plain = abp._errors.error_from_status(2, "no kernel named 'x'")
    assert type(plain) is abp.AbpError and plain.status == abp.Status.NOT_FOUND and plain.detail == ""


def test_a_missing_library_is_reported_at_first_use_not_at_import():
    code = """
import abp
try:
    abp.operators()
except abp.AbpError as e:
    print("ERR", e.status, e)
"""
    result = run_python(code, ABP_LIBRARY="/nonexistent/libabp.so")
    assert result.returncode == 0, result.stderr
    assert "ERR None" in result.stdout and "ABP_LIBRARY='/nonexistent/libabp.so' is not a file" in result.stdout


def test_another_shared_library_named_by_abp_library_is_reported_at_first_use():
    # A real library that is not libabp.so (zlib, a kernel's host library) made `import abp`
    # itself raise ctypes' AttributeError ("undefined symbol: abp_last_error").
    other = ctypes.util.find_library("z") or ctypes.util.find_library("m")
    if other is None:
        pytest.skip("no libz or libm to point ABP_LIBRARY at")
    path = next((os.path.join(d, other) for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib")
                 if os.path.isfile(os.path.join(d, other))), None)
    if path is None:
        pytest.skip(f"{other} not found on disk")
    code = """
import abp
try:
    abp.operators()
except abp.AbpError as e:
    print("ERR", e.status, e)
"""
    result = run_python(code, ABP_LIBRARY=path)
    assert result.returncode == 0, result.stderr
    assert f"{path}: not abp's runtime library (it has no abp_last_error)" in result.stdout, result.stdout


def test_library_search_order(monkeypatch):
    monkeypatch.delenv("ABP_LIBRARY", raising=False)
    candidates = abp._lib.library_path_candidates()
    # An installed package's own lib/ first, then a checkout's build tree, then the loader's path.
    assert candidates[0] == str(abp._lib.PACKAGE_DIR / "lib" / "libabp.so")
    assert candidates[1].endswith(os.path.join("build", "lib", "libabp.so")) and candidates[-1] == "libabp.so"
    monkeypatch.setenv("ABP_LIBRARY", "/x/libabp.so")
    assert abp._lib.library_path_candidates() == ["/x/libabp.so"]


def test_env_values_come_from_the_runtime_registry():
    assert abp._lib.env_get("ABP_CACHE_MAX_MB").isdigit()
    with pytest.raises(abp.AbpError):
        abp._lib.env_get("ABP_NO_SUCH_VARIABLE")


def test_every_name_mirrors_torch():
    for name in abp.functional.CONTINUOUS + abp.functional.PIECEWISE:
        assert callable(getattr(abp.functional, name)) and hasattr(F, name), name
    for name in abp.nn.__all__:
        assert issubclass(getattr(abp.nn, name), torch.nn.Module)
        # abp's own methods; every other name is torch's.
        assert name in ("ReGELU2", "ReSiLU2", "MSLayerNorm", "MSRMSNorm", "SampledLinear", "SampledConv1D", "Apply") or hasattr(torch.nn, name), name


def test_manifest_saved_bits_per_element_agrees_with_the_residuals():
    # The manifest's summaries must equal what its residuals really store: codes and tensors per
    # element, per-row statistics per row; scalars and shared outputs (the consumer's own tensor)
    # cost nothing.
    wrong = {}
    for name in abp.operators():
        record = abp.inspect(name)["operator"]
        residuals = record["residuals"]
        per_element = sum(r["bits"] for r in residuals if r["kind"] in ("codes", "tensor"))
        per_row = sum(r["bits"] for r in residuals if r["kind"] == "rows")
        if (record["saved_bits_per_element"], record.get("saved_bits_per_row", 0)) != (per_element, per_row):
            wrong[name] = (record["saved_bits_per_element"], record.get("saved_bits_per_row"), per_element, per_row)
    assert not wrong, f"saved bits (manifest per element, per row; residuals per element, per row): {wrong}"


def test_pip_nvrtc_candidates_find_nvidia_wheels_newest_first(tmp_path, monkeypatch):
    # Where torch's CUDA wheels put NVRTC: nvidia/cu13/lib (CUDA 13) and nvidia/cuda_nvrtc/lib (12).
    for rel in ("a/nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "b/nvidia/cu13/lib/libnvrtc.so.13",
                "b/nvidia/cu13/lib/libnvrtc-builtins.so.13.2", "b/nvidia/cu13/lib/libnvrtc.so.13.2",
                "c/nvidia/cudnn/lib/libcudnn.so.9"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / d) for d in ("a", "b", "c", "missing")])
    assert abp._lib.pip_nvrtc_candidates() == [tmp_path / "b/nvidia/cu13/lib/libnvrtc.so.13",
                                               tmp_path / "a/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"]


def test_f32_parameters_travel_as_their_bits_and_overflow_to_infinity():
    # Launch words carry an f32 parameter's bits in their low half; beyond f32's range the
    # value becomes ±inf, as C's float conversion gives it (not an OverflowError).
    from abp._launch import _f32_bits

    assert _f32_bits(1.0) == 0x3F800000 and _f32_bits(-2.5) == 0xC0200000
    assert _f32_bits(1e39) == 0x7F800000 and _f32_bits(-1e39) == 0xFF800000
    y = abp.functional.apply("leaky_relu", torch.tensor([-1.0, 2.0]), (0.25,))
    assert torch.equal(y, torch.tensor([-0.25, 2.0]))


def test_inspect_and_compile_operators_name_a_wrong_type():
    with pytest.raises(TypeError, match="op_name: expected an operator's name as a str .*got NoneType"):
        abp.inspect(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="origin: expected a str naming where the IR comes from .*got int"):
        abp.compile_operators("module {}", origin=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [
    lambda: abp.nn.ReGELU2(), lambda: abp.nn.MSLayerNorm(8), lambda: abp.nn.MSLayerNorm(8, elementwise_affine=True),
], ids=["activation", "norm", "affine-norm"])
def test_a_vectorized_jacobian_gets_an_error_naming_abp(make):
    """jacobian(vectorize=True) vmaps backward: a batched gradient reached a kernel launch
    ("Cannot access data pointer of Tensor that doesn't have storage"). Both lanes say what it is.
    (The sampled layer's dX is torch's product: its vectorized jacobian works.)"""
    library_or_skip()
    module, x = make(), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r": its backward got a gradient that holds no memory.*vectorize=False"):
        torch.autograd.functional.jacobian(module, x, vectorize=True)
    assert torch.autograd.functional.jacobian(module, x).shape == (4, 8, 4, 8)  # not vectorized: works


def test_a_transform_over_an_abp_op_gets_an_error_naming_abp_on_every_torch():
    """torch.func's vmap and grad (functorch's on torch 1.13, whose message only says it does not
    support autograd.Function) over an abp op: the error names abp and says what to use."""
    library_or_skip()
    func = pytest.importorskip("torch.func") if hasattr(torch, "func") else pytest.importorskip("functorch")
    for transform in (func.vmap(abp.functional.regelu2), func.grad(lambda t: abp.nn.MSLayerNorm(8)(t).pow(2).sum())):
        with pytest.raises(RuntimeError, match=r"abp operator \w+: torch.func transforms .* are not supported.*loss.backward"):
            transform(torch.randn(3, 8))
