"""The compiled launcher (bindings/launcher) and the eager launch path that uses it.

The launcher's contract is abp_kernel_launch's: the same kernel, the same words, the same bytes
out, whether the words come from the compiled module or from ctypes (the fallback where it was
not built). Its own mistakes (a bad argument, too many) are errors, never a launch."""
from __future__ import annotations

import math
import struct

import pytest
import torch

import abp
from abp import _launch, _lib
from abp._errors import AbpError


def _silu_codes(launch, x: torch.Tensor):
    """silu_b3's forward through `launch`: (output, 3-bit codes)."""
    op = _lib.kernel_library().operator("silu_b3")
    bound = _launch.binding(op, False, x.dtype)
    n = x.numel()
    y, codes = torch.empty_like(x), torch.empty((3 * n + 7) // 8, dtype=torch.uint8)
    status = launch(bound.address, -1, n, None, x, y, codes, n)
    assert status == 0
    return y, codes


def test_the_build_tree_has_the_compiled_launcher():
    # scripts/test builds it (CMake finds Python's headers, which scripts/ installs): the fast
    # path is what the rest of the suite runs.
    path = _lib.launcher_path()
    assert path is not None and path.name == _lib.LAUNCHER_FILE, (
        "no _abp_launch beside libabp.so: was the build configured without Python's headers "
        "(python3-dev)? abp then launches through ctypes")
    assert _lib.launcher() is not _lib.launch_ctypes


@pytest.mark.parametrize("n", [1, 7, 128, 4099])
def test_compiled_and_ctypes_launchers_write_the_same_bytes(n):
    torch.manual_seed(n)
    x = torch.randn(n)
    y1, c1 = _silu_codes(_lib.launcher(), x)
    y2, c2 = _silu_codes(_lib.launch_ctypes, x)
    assert torch.equal(y1, y2) and torch.equal(c1, c2)
    torch.testing.assert_close(y1, torch.nn.functional.silu(x))  # the kernel's expf, to rounding


def test_addresses_and_tensors_are_the_same_argument():
    x = torch.randn(64)
    op = _lib.kernel_library().operator("silu_b3")
    bound = _launch.binding(op, False, x.dtype)
    y, codes = torch.empty_like(x), torch.empty(24, dtype=torch.uint8)
    y2, codes2 = torch.empty_like(x), torch.empty(24, dtype=torch.uint8)
    launch = _lib.launcher()
    assert launch(bound.address, -1, 64, None, x, y, codes, 64) == 0
    assert launch(bound.address, -1, 64, None, x.data_ptr(), y2.data_ptr(), codes2.data_ptr(), 64) == 0
    assert torch.equal(y, y2) and torch.equal(codes, codes2)


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, 2**64 - 1])
def test_i64_words_are_taken_modulo_2_to_the_64(seed):
    # A seed is an i64 kernel scalar: a negative Python int must reach the kernel as its
    # two's complement, through either launcher (ctypes masks it; the compiled one takes it mod 2^64).
    op = _lib.kernel_library().operator("gact_b2")
    bound = _launch.binding(op, False, torch.float32)
    x = torch.randn(4, 256)
    outs = []
    for launch in (_lib.launcher(), _lib.launch_ctypes):
        codes = torch.empty(4 * 256 * 2 // 8, dtype=torch.uint8)
        rows = [torch.empty(4), torch.empty(4)]  # the minima and the scales, in output order
        outputs = [codes if spec.layout == "packed" else rows.pop(0) for spec in bound.outputs]
        args = bound.arguments({"input0": x, "param0": seed, "param1": 0})
        assert launch(bound.address, -1, x.numel(), None, *args, *outputs, 4, 256) == 0
        outs.append(outputs)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_negative_seed_is_its_twos_complement():
    op = _lib.kernel_library().operator("gact_b2")
    bound = _launch.binding(op, False, torch.float32)
    x = torch.randn(2, 256)

    def codes(seed):
        out = torch.empty(2 * 256 * 2 // 8, dtype=torch.uint8)
        rows = [torch.empty(2), torch.empty(2)]
        outputs = [out if spec.layout == "packed" else rows.pop(0) for spec in bound.outputs]
        _lib.launch(bound.address, -1, x.numel(), None,
                    bound.arguments({"input0": x, "param0": seed, "param1": 0}) + outputs + [2, 256])
        return out

    assert torch.equal(codes(-1), codes(2**64 - 1))
    assert not torch.equal(codes(-1), codes(1))


def test_f32_scalars_are_passed_as_their_bits():
    assert _launch._f32_bits(1.0) == struct.unpack("<I", struct.pack("<f", 1.0))[0]
    assert _launch._f32_bits(1e39) == struct.unpack("<I", struct.pack("<f", math.inf))[0]
    assert _launch._f32_bits(-1e39) == struct.unpack("<I", struct.pack("<f", -math.inf))[0]


LAUNCHERS = {"compiled": lambda: _lib.launcher(), "ctypes": lambda: _lib.launch_ctypes}


@pytest.mark.parametrize("which", sorted(LAUNCHERS))
def test_a_bad_argument_is_a_type_error_naming_its_position(which):
    op = _lib.kernel_library().operator("silu_b3")
    bound = _launch.binding(op, False, torch.float32)
    x = torch.randn(8)
    with pytest.raises(TypeError, match="argument 1 must be an int or a tensor"):
        LAUNCHERS[which]()(bound.address, -1, 8, None, x, "not a tensor", x, 8)


@pytest.mark.parametrize("which", sorted(LAUNCHERS))
def test_too_many_arguments_and_null_handles_are_refused_before_any_launch(which):
    launch = LAUNCHERS[which]()
    with pytest.raises(ValueError, match="at most 64"):
        launch(1, -1, 1, None, *([0] * 65))
    with pytest.raises(ValueError, match="non-null"):
        launch(0, -1, 1, None, 0)
    with pytest.raises(TypeError):
        launch(1, -1)


def test_an_unloadable_launcher_falls_back_to_ctypes_with_a_warning(tmp_path, monkeypatch):
    # A damaged or foreign _abp_launch (not this platform's .so) must not break launching.
    bogus = tmp_path / _lib.LAUNCHER_FILE
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setattr(_lib, "launcher_path", lambda: bogus)
    monkeypatch.setattr(_lib, "_launcher", None)
    with pytest.warns(RuntimeWarning, match="launching through ctypes"):
        assert _lib.launcher() is _lib.launch_ctypes
    # And an eager call works through it.
    x = torch.randn(4, 8, requires_grad=True)
    y = abp.functional.silu(x, bits=4)
    y.sum().backward()
    torch.testing.assert_close(y, torch.nn.functional.silu(x.detach()))


def test_a_failed_launch_raises_the_runtimes_error():
    # A CUDA device the runtime cannot use (none here, or an index out of range): an AbpError
    # from abp_kernel_launch, raised by _lib.launch, not a status silently dropped.
    op = _lib.kernel_library().operator("silu_b3")
    bound = _launch.binding(op, False, torch.float32)
    with pytest.raises(AbpError):
        _lib.launch(bound.address, 1 << 20, 8, None, [0, 0, 0, 8])


def test_eager_calls_match_the_exact_op_through_the_fast_path():
    # Shapes, dtypes and strides the per-call path special-cases: a 0-d tensor, an empty one, a
    # transposed (non-contiguous) one, and row operators whose rows have 0 columns.
    for shape in [(), (0,), (3, 0), (5, 7)]:
        x = torch.randn(shape, requires_grad=True)
        y = abp.functional.silu(x, bits=4)
        torch.testing.assert_close(y, torch.nn.functional.silu(x.detach()))
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    xt = torch.randn(7, 5).t().requires_grad_()
    y = abp.functional.silu(xt, bits=4)
    torch.testing.assert_close(y, torch.nn.functional.silu(xt.detach()))
    # A row kernel over rows of 0 columns still runs (each row's norm is 0); over 0 rows it does not.
    for shape, want in [((3, 0), torch.zeros(3)), ((0, 5), torch.zeros(0))]:
        z = torch.randn(shape, requires_grad=True)
        norms = abp.functional.apply("row_norms", z)
        assert torch.equal(norms.detach(), want)
        norms.sum().backward()
        assert z.grad is not None and z.grad.shape == shape


def test_double_backward_through_an_activation_fails_loudly_at_once():
    # The backward is not differentiable, and an activation saves only codes: nothing of its graph
    # could carry an error for a second backward towards its input (a Hessian of sum(W·act(x))
    # was silently zero), so backward(create_graph=True) raises at once.
    x = torch.randn(4, 8, requires_grad=True)
    v = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="differentiate twice.*through the codes it saved"):
        torch.autograd.grad(abp.functional.silu(x, bits=4), x, grad_outputs=v, create_graph=True)
    (g_plain,) = torch.autograd.grad(abp.functional.silu(x, bits=4), x, grad_outputs=v.detach())
    assert g_plain.shape == x.shape


@pytest.mark.parametrize("params", [(0.25,), [0.25], torch.tensor([0.25]), torch.tensor([0.0])])
def test_params_in_any_sequence_reach_the_kernel(params):
    # The per-call path skips the parameter checks only for (): a list or a tensor of
    # parameters is still read element by element.
    x = torch.randn(3, 5)
    y = abp.functional.apply("leaky_relu", x, params)
    torch.testing.assert_close(y, torch.nn.functional.leaky_relu(x, float(params[0])))
    with pytest.raises(TypeError, match="expected 1 parameters"):
        abp.functional.apply("leaky_relu", x, torch.tensor([0.25, 0.5]))
