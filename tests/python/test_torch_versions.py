"""What abp reads of torch features that differ between the versions it installs on (1.13 to 2.x).

The lanes run torch 1.13 and a current torch; these tests hold the mechanisms a version between
them needs, each written so that it fails where the mechanism is gone: torch 2.4 refused abp's
custom ops at `import abp` (string annotations), torch 2.1's dynamo failed on autocast's device
argument, and torch 2.1 to 2.4 passed tracing's fake tensors through compress_saved's eager hook.
"""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import abp
from abp import _amp, _custom_ops
from abp.compress import _without_data


@pytest.mark.skipif(not _custom_ops.enabled(), reason="torch.library.custom_op needs torch >= 2.4")
def test_custom_ops_get_their_annotations_evaluated():
    """abp's modules postpone annotations (strings); the helper hands torch the types themselves,
    which torch 2.4's schema inference needs."""
    def scale_rows(x: torch.Tensor, factor: float, times: int) -> torch.Tensor:
        return x * factor * times

    assert inspect.signature(scale_rows).parameters["x"].annotation == "torch.Tensor"  # postponed here too
    op = _custom_ops.custom_op("abp_test::scale_rows", mutates_args=())(scale_rows)
    signature = inspect.signature(scale_rows)
    assert signature.parameters["x"].annotation is torch.Tensor
    assert signature.parameters["factor"].annotation is float and signature.return_annotation is torch.Tensor
    torch.testing.assert_close(op(torch.ones(2), 0.5, 3), torch.full((2,), 1.5))


@pytest.mark.parametrize("per_device", [True, False], ids=["device-argument", "per-device-getters"])
def test_autocast_state_is_read_by_feature_in_either_spelling(monkeypatch, per_device):
    """torch >= 2.4 takes the device type; older torch is read through its per-device getters,
    chosen by feature (not by catching the TypeError, which dynamo does not raise as one)."""
    if per_device and not hasattr(torch, "get_autocast_dtype"):
        pytest.skip("torch < 2.4 has no device argument")
    if not per_device and not hasattr(torch, "is_autocast_cpu_enabled"):
        pytest.skip("this torch has dropped the per-device getters")
    monkeypatch.setattr(_amp, "_PER_DEVICE", per_device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer torch deprecates the per-device getters
        assert _amp.state("cpu")[0] is False and _amp.dtype("cpu") is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert _amp.state("cpu") == (True, torch.bfloat16)
            assert _amp.dtype("cpu") == torch.bfloat16
        assert _amp.state("cuda")[0] is False
        if not per_device:
            assert _amp.dtype("xpu") is None  # no autocast state to read for it there
    with pytest.raises(ValueError, match="kind: expected 'cpu' or 'cuda', got 'meta'"):
        _amp.state("meta")


fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")


@pytest.mark.skipif(not hasattr(fake_tensor, "is_fake"), reason="torch 1.13 has no is_fake")
def test_tracing_tensors_pass_through_compress_saved_unpacked():
    """torch.compile on torch 2.1 to 2.4 ran compress_saved's eager pack hook on fake and
    functional tensors (data_ptr failed: "Cannot access data pointer"): they are given back as
    they are, and nothing of them is counted."""
    with fake_tensor.FakeTensorMode():
        fake = torch.empty(64, 64, requires_grad=True) * 2
    assert _without_data(fake)
    plain = torch.randn(64, 64, requires_grad=True) * 2
    assert not _without_data(plain) and not _without_data(torch.nn.Parameter(torch.ones(3)))
    with abp.compress_saved(bits=4) as block:
        assert block.pack(fake) is fake
        assert block.unpack(fake) is fake
        assert block.stats["tensors"] == 0
        assert block.pack(plain) is not plain  # a real activation is taken (deferred, then coded)
    functional = pytest.importorskip("torch._subclasses.functional_tensor")
    with fake_tensor.FakeTensorMode(), functional.FunctionalTensorMode():
        wrapped = torch.empty(8, 8) + 1
    assert isinstance(wrapped, functional.FunctionalTensor) and _without_data(wrapped)


def test_compile_tracing_is_recognised_on_every_torch_that_compiles(monkeypatch):
    """torch.compiler.is_compiling came in 2.2; on 2.0 and 2.1 torch._dynamo says it. Without it
    abp never knew it was traced there: the compress recipe opened its block inside the trace
    (a false "modified by an in-place operation" at backward, dynamo failing on the recorder)."""
    from abp import _derived

    if not hasattr(torch, "compile"):  # 1.13
        assert _derived._is_compiling_function() is None and not _derived._compiling()
        return
    import importlib
    import types

    dynamo = importlib.import_module("torch._dynamo")  # (an `import torch._dynamo` here would make torch local)
    with monkeypatch.context() as patched:
        patched.setattr(torch, "compiler", types.SimpleNamespace())  # as on torch 2.1
        found = _derived._is_compiling_function()
    assert found is dynamo.is_compiling
    monkeypatch.setattr(_derived, "_IS_COMPILING", found)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x + (1.0 if _derived._compiling() else 0.0)

    dynamo.reset()
    assert shifted(torch.zeros(1)).item() == 0.0
    assert torch.compile(shifted, backend="eager")(torch.zeros(1)).item() == 1.0


def test_the_cpp_lane_is_not_built_or_cached_inside_a_trace(monkeypatch):
    """On torch < 2.4 dynamo traces abp's Python (no custom ops): a first call inside the trace
    built the C++ lane there, which failed and kept the process on the Python lane. Inside a
    trace no lane is looked up or remembered; the first eager call finds it."""
    from abp import _derived, autograd

    monkeypatch.setattr(autograd, "_lanes", {})
    monkeypatch.setattr(_derived, "_compiling", lambda: True)
    assert autograd.lane_plan("regelu2", torch.float32) is None
    assert autograd._lanes == {}
    monkeypatch.setattr(_derived, "_compiling", lambda: False)
    found = autograd.lane_plan("regelu2", torch.float32)
    assert found is autograd._lanes[("regelu2", torch.float32)]
    assert found is not None or abp._plan_lane.module() is None
