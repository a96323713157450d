"""The per-call lane of the eager path (abp._eager) against the general path (abp._launch).

A Plan is a second way to run the same manifest, kept for speed; these tests hold it to the
general path's bytes, operator by operator, and check that whatever it does not expect goes to
the general path (which converts or names the mistake) instead of reaching a kernel."""
from __future__ import annotations

import pytest
import torch

import abp
from abp import _eager, _launch, _lib
from abp_reference import PLAN_DTYPES as DTYPES
from abp_reference import library_or_skip, plan_served as _served, same_bytes as _same_bytes


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def _operators():
    library_or_skip()
    return sorted(_lib.kernel_library().operators.items())


def _params(op):
    # A value per parameter that every served operator accepts (slopes, thresholds, eps).
    return tuple(0.25 + 0.125 * i for i in range(len(op.params)))


def test_the_plan_serves_the_activations_and_norms_and_declines_the_rest():
    served = set(_served(torch.float32))
    for name in ("silu_b3", "gelu_b2", "regelu2", "resilu2", "relu", "leaky_relu", "threshold",
                 "ms_layernorm", "ms_rmsnorm"):
        assert name in served, name
    # No output (a codec), draws without an input, rows read by index, a per-row output: the
    # general path's.
    for name in ("gact_b2", "philox_uniform", "sample_rows", "row_norms"):
        assert name not in served, name
    assert "ms_layernorm" in _served(torch.float64)  # row kernels have fp64 symbols


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_served_operator_gives_the_general_paths_bytes(dtype):
    torch.manual_seed(0)
    for name in _served(dtype):
        op = _lib.kernel_library().operator(name)
        plan = _eager.plan(op, dtype)
        params = _params(op)
        for shape in [(5, 33), (2, 3, 64), (7,), (0, 4), (3, 0)] + ([()] if not op.row_wise else []):
            x = torch.randn(shape, dtype=dtype)
            fast = plan.forward(x, params)
            assert fast is not None, (name, shape)
            slow = _launch.forward(op, (x,), params)
            assert len(fast[0]) == len(slow[0]) and len(fast[1]) == len(slow[1]), name
            for a, b in zip(fast[0] + fast[1], slow[0] + slow[1]):
                if isinstance(a, torch.Tensor):
                    assert _same_bytes(a, b), (name, shape)
                else:
                    assert a == b, (name, shape)
            if op.backward is None:
                continue
            g = torch.randn(shape, dtype=dtype)
            residuals = list(fast[1])
            for i, r in enumerate(op.residuals):
                if r.kind == "shared":
                    residuals[i] = fast[0][r.output]
            if op.outputs != 1:  # several gradients (an operator another test authored): the plan declines
                assert plan.backward(residuals, (g,) * op.outputs, x.shape, x.device) is None, name
                continue
            dx = plan.backward(residuals, (g,), x.shape, x.device)
            assert dx is not None, (name, shape)
            want = _launch.backward(op, residuals, (g,), x.shape, dtype, x.device)
            assert _same_bytes(dx[0], want[0]), (name, shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plans_with_per_column_inputs_give_the_general_paths_bytes(dtype):
    # The affine norms: a dense input and a gain (and bias) read per column, whose gradients are
    # the backward's column sums.
    names = _served(dtype, inputs=2) + _served(dtype, inputs=3)
    assert {"ms_layernorm_gain", "ms_layernorm_affine", "ms_rmsnorm_gain", "ms_rmsnorm_affine"} <= set(names)
    gen = torch.Generator().manual_seed(3)
    for name in names:
        op = _lib.kernel_library().operator(name)
        plan = _eager.plan(op, dtype)
        params = _params(op)
        for shape in [(5, 33), (2, 3, 64), (7,), (0, 4), (3, 0)]:
            x = torch.randn(shape, dtype=dtype, generator=gen)
            cols = [torch.randn(shape[-1], dtype=dtype, generator=gen) for _ in range(op.inputs - 1)]
            assert plan.forward(x, params) is None, name  # without its per-column inputs: declined
            fast = plan.forward(x, params, cols)
            assert fast is not None, (name, shape)
            slow = _launch.forward(op, (x, *cols), params)
            for a, b in zip(fast[0] + fast[1], slow[0] + slow[1]):
                assert _same_bytes(a, b) if isinstance(a, torch.Tensor) else a == b, (name, shape)
            residuals = list(fast[1])
            g = torch.randn(shape, dtype=dtype, generator=gen)
            dxs = plan.backward(residuals, (g,), x.shape, x.device)
            want = _launch.backward(op, residuals, (g,), x.shape, dtype, x.device)
            assert dxs is not None and len(dxs) == op.inputs == len(want), (name, shape)
            assert all(_same_bytes(a, b) for a, b in zip(dxs, want)), (name, shape)
        # A per-column input of the wrong length, dtype or layout, or a saved one changed: the general path's.
        x = torch.randn(4, 8, dtype=dtype)
        good = [torch.randn(8, dtype=dtype) for _ in range(op.inputs - 1)]
        other = torch.float64 if dtype != torch.float64 else torch.float32
        for bad in (torch.randn(7, dtype=dtype), torch.randn(8, dtype=other), torch.randn(16, dtype=dtype)[::2]):
            assert plan.forward(x, params, [bad, *good[1:]]) is None, name
        outputs, residuals = plan.forward(x, params, good)
        changed = [r[:7] if isinstance(r, torch.Tensor) and r.dim() == 1 and r.numel() == 8 else r for r in residuals]
        assert plan.backward(changed, (torch.randn(4, 8, dtype=dtype),), x.shape, x.device) is None, name


def test_a_non_contiguous_input_and_gradient_take_the_lane_as_copies():
    op = _lib.kernel_library().operator("ms_layernorm")
    x = torch.randn(16, 8).t()  # (8, 16), transposed
    plan = _eager.plan(op, torch.float32)
    outputs, residuals = plan.forward(x, (1e-5,))
    torch.testing.assert_close(outputs[0], torch.nn.functional.layer_norm(x, (16,), eps=1e-5))
    g = torch.randn(16, 8).t()
    residuals[0] = outputs[0]
    dx = plan.backward(residuals, (g,), x.shape, x.device)
    want = _launch.backward(op, residuals, (g.contiguous(),), x.shape, torch.float32, x.device)
    assert torch.equal(dx[0], want[0])


def test_what_the_plan_does_not_expect_goes_to_the_general_path():
    op = _lib.kernel_library().operator("silu_b3")
    plan = _eager.plan(op, torch.float32)
    x = torch.randn(4, 8)
    outputs, residuals = plan.forward(x, ())
    # Another dtype, no gradient, another shape, codes too short: None, never a launch.
    assert plan.forward(x.double(), ()) is None
    assert plan.backward(residuals, (None,), x.shape, x.device) is None
    assert plan.backward(residuals, (torch.randn(4, 8, dtype=torch.float64),), x.shape, x.device) is None
    assert plan.backward(residuals, (torch.randn(32),), x.shape, x.device) is None
    assert plan.backward([residuals[0][:1]], (torch.randn(4, 8),), x.shape, x.device) is None
    sparse = torch.ones(4, 8).to_sparse()
    assert plan.backward(residuals, (sparse,), x.shape, x.device) is None
    # Through autograd: an expanded (stride 0) gradient is copied, the same gradient results.
    xr = x.clone().requires_grad_()
    abp.functional.silu(xr).backward(torch.ones(()).expand(4, 8))
    xs = x.clone().requires_grad_()
    abp.functional.silu(xs).backward(torch.ones(4, 8))
    assert torch.equal(xr.grad, xs.grad)


def test_saved_tensors_not_as_the_kernel_reads_them_go_to_the_general_path():
    # ms_layernorm's backward reads its output (shared, dense) and 1/std per row: a residual of
    # another size, dtype or layout must never reach the kernel.
    op = _lib.kernel_library().operator("ms_layernorm")
    plan = _eager.plan(op, torch.float32)
    x = torch.randn(6, 32)
    (y,), residuals = plan.forward(x, (1e-5,))
    residuals[0] = y
    g = torch.randn(6, 32)
    assert plan.backward(residuals, (g,), x.shape, x.device) is not None
    for bad in ([y[:3], residuals[1]], [y.double(), residuals[1]], [y.t().contiguous().t(), residuals[1]],
                [y, residuals[1][:5]], [y, residuals[1].double()], [y, 1.0]):
        assert plan.backward(bad, (g,), x.shape, x.device) is None


def test_saved_tensor_hooks_see_the_plans_residuals_and_their_copies_work():
    # compress_saved and user hooks get what a plan saves; what they give back goes through
    # the plan's checks (a contiguous copy is fine, a dtype change goes to the general path).
    x = torch.randn(6, 32, requires_grad=True)
    seen = []

    def pack(t):
        seen.append((t.dtype, t.dim()))
        return t.clone()

    def unpack(t):  # the shared output comes back in fp64: the general path casts it back
        return t.double() if t.dim() == 2 else t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = abp.nn.MSLayerNorm(32)(x)
    y.backward(torch.ones_like(y))
    x2 = x.detach().clone().requires_grad_()
    abp.nn.MSLayerNorm(32)(x2).backward(torch.ones_like(y))
    assert torch.equal(x.grad, x2.grad)
    assert (torch.float32, 2) in seen and (torch.float32, 1) in seen  # the output and 1/std per row


def test_a_wrong_parameter_count_is_the_general_paths_error():
    op = _lib.kernel_library().operator("leaky_relu")
    plan = _eager.plan(op, torch.float32)
    x = torch.randn(3, 5)
    assert plan.forward(x, (0.1, 0.2)) is None and plan.forward(x, ()) is None
    with pytest.raises(TypeError, match="expected 1 parameters"):
        abp.functional.apply("leaky_relu", x, (0.1, 0.2))
