"""The C++ per-call lane (abp/_plan_lane.cpp) against the Python lane (abp.autograd.OperatorFunction).

The C++ lane runs the same plans as abp._eager without entering Python; these tests hold its
outputs, gradients and saved residuals to the Python lane's bytes for every operator a plan
serves, check that what it declines (and what its backward declines) takes the general path with
its errors, and that the directory the lane is built in is one only this user can write."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

import abp
from abp import _eager, _launch, _lib, _plan_lane, autograd
from abp_reference import PLAN_DTYPES as DTYPES
from abp_reference import built_lane as _lane, library_or_skip, plan_served, same_bytes as _same_bytes


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def _python_lane(name, params, x):
    return autograd.OperatorFunction.apply(name, params, None, x)


class _Saved:
    """The tensors autograd saves, through saved_tensors_hooks."""

    def __init__(self):
        self.tensors = []

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def _pack(self, t):
        self.tensors.append(t.detach().clone())
        return t

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def test_the_lane_is_built_and_takes_the_calls_of_abp_nn():
    _lane()
    assert _plan_lane.status() == "C++ lane"
    y = abp.nn.SiLU()(torch.randn(3, 8, requires_grad=True))
    assert "CppNode" in type(y.grad_fn).__name__ or "CppFunction" in type(y.grad_fn).__name__, type(y.grad_fn)
    # Cast outputs (autocast into an MS-norm) and several inputs stay on the Python lane.
    assert type(_python_lane("silu_b3", (), torch.randn(2, requires_grad=True)).grad_fn).__name__ == \
        "OperatorFunctionBackward"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_served_operator_gives_the_python_lanes_bytes(dtype):
    lane = _lane()
    torch.manual_seed(0)
    for name in plan_served(dtype):
        op = _lib.kernel_library().operator(name)
        native = _eager.native_plan(op, dtype)
        assert native is not None, name
        params = tuple(0.25 + 0.125 * i for i in range(len(op.params)))
        shapes = [(5, 33), (2, 3, 64), (7,), (0, 4), (3, 0)] + ([()] if not op.row_wise else [])
        for shape in shapes:
            x = torch.randn(shape, dtype=dtype)
            results = []
            for run in (lambda t: lane.run(native, t, params), lambda t: _python_lane(name, params, t)):
                leaf = x.clone().requires_grad_(op.backward is not None)
                with _Saved() as saved:
                    y = run(leaf)
                ys = y if isinstance(y, tuple) else (y,)
                grad = None
                if op.backward is not None:
                    g = torch.randn(ys[0].shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
                    ys[0].backward(g)
                    grad = leaf.grad
                results.append((ys, saved.tensors, grad))
            (ya, sa, ga), (yb, sb, gb) = results
            assert len(ya) == len(yb) and all(_same_bytes(a, b) for a, b in zip(ya, yb)), (name, shape)
            assert len(sa) == len(sb) and all(_same_bytes(a, b) for a, b in zip(sa, sb)), (name, shape)
            assert (ga is None) == (gb is None) and (ga is None or _same_bytes(ga, gb)), (name, shape)


def test_a_non_contiguous_input_and_gradient_give_the_python_lanes_bytes():
    lane = _lane()
    op = _lib.kernel_library().operator("ms_layernorm")
    native = _eager.native_plan(op, torch.float32)
    base = torch.randn(16, 24)
    x = base[:, ::2]
    g = torch.randn(24, 16).t()[:, ::2]
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    lane.run(native, a.t().t(), (1e-5,)).backward(g)
    _python_lane("ms_layernorm", (1e-5,), b.t().t()).backward(g)
    assert _same_bytes(a.grad, b.grad)


def test_what_the_lane_declines_takes_the_general_path_and_its_errors():
    lane = _lane()
    op = _lib.kernel_library().operator("silu_b3")
    native = _eager.native_plan(op, torch.float32)
    assert lane.run(native, torch.randn(3, dtype=torch.float64), ()) is None  # another dtype's plan
    assert lane.run(native, torch.randn(3), (1.0,)) is None  # a parameter count it was not made for
    assert lane.run(native, torch.randn(3).to_sparse(), ()) is None
    # Through the public functions the general path then names the mistake.
    with pytest.raises(TypeError, match="input: expected dtype"):
        abp.functional.silu(torch.arange(3))
    with pytest.raises(TypeError, match="params"):
        abp.functional.apply("leaky_relu", torch.randn(3), ("a",))
    # Integer parameters are converted by the general path's check and then run by the lane.
    y = abp.functional.apply("leaky_relu", torch.randn(3, requires_grad=True), (1,))
    assert "OperatorFunction" not in type(y.grad_fn).__name__


def test_a_gradient_the_backward_declines_goes_to_the_general_path():
    lane = _lane()
    native = _eager.native_plan(_lib.kernel_library().operator("silu_b3"), torch.float32)
    x = torch.randn(4, 6)
    # A gradient of another dtype: the general path converts it, as the Python lane does.
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(4, 6, dtype=torch.float64)
    torch.autograd.backward(lane.run(native, a, ()), g)
    torch.autograd.backward(_python_lane("silu_b3", (), b), g)
    assert _same_bytes(a.grad, b.grad)
    # A saved residual a hook handed back changed: the general path names it, and the error keeps
    # its type through torch's engine.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t[:1]):
        y = lane.run(native, x.clone().requires_grad_(), ())
        with pytest.raises(Exception, match="residual|saved|expected") as caught:
            y.sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t[:1]):
        y = _python_lane("silu_b3", (), x.clone().requires_grad_())
        with pytest.raises(type(caught.value)):
            y.sum().backward()


def test_a_second_backward_through_the_lane_fails_as_the_python_lanes_does():
    lane = _lane()
    native = _eager.native_plan(_lib.kernel_library().operator("silu_b3"), torch.float32)
    x = torch.randn(5, requires_grad=True)
    # A second backward would have to differentiate the kernel's result: both lanes refuse
    # backward(create_graph=True) through an activation at once, in the same words.
    for y in (lane.run(native, x, ()), _python_lane("silu_b3", (), x)):
        with pytest.raises(RuntimeError, match="differentiate twice.*through the codes it saved"):
            torch.autograd.grad((y * y).sum(), x, create_graph=True)
    a = lane.run(native, x, ())
    b = _python_lane("silu_b3", (), x)
    ga = torch.autograd.grad((a * a).sum(), x)[0]
    gb = torch.autograd.grad((b * b).sum(), x)[0]
    assert _same_bytes(ga, gb)


def test_compress_saved_and_checkpointing_see_the_lanes_residuals():
    _lane()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), abp.nn.ReGELU2(), torch.nn.Linear(32, 4),
                                abp.nn.MSLayerNorm(4))
    x = torch.randn(8, 16)
    ref = _train_step_grads(model, x)
    with abp.compress_saved(bits=4, min_numel=0) as ctx:
        compressed = _train_step_grads(model, x)
    assert ctx.stats["compressed"] > 0
    checkpointed = _train_step_grads(model, x, checkpoint=True)
    for a, b in zip(ref, checkpointed):
        assert _same_bytes(a, b)
    assert all(torch.isfinite(g).all() for g in compressed)


def _affine_norm(requires_grad=True):
    norm = abp.nn.MSLayerNorm(8, elementwise_affine=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    norm.requires_grad_(requires_grad)
    return norm


def test_the_lanes_nodes_keep_autograds_contracts():
    """The lane's nodes are torch::autograd::Node subclasses: they must behave as a Function's."""
    _lane()
    x = torch.randn(4, 8, requires_grad=True)
    for module, saves_output in ((abp.nn.SiLU(bits=3), False), (abp.nn.MSLayerNorm(8), True), (_affine_norm(), True)):
        y = module(x)
        assert y.grad_fn.name().startswith("abp::") and y.grad_fn.name().endswith("Backward"), y.grad_fn.name()
        # A saved output changed in place is caught at backward, as for torch's own ops (the
        # activation saves codes of x, not y, and keeps working).
        y.add_(1.0)
        if saves_output:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()
        else:
            y.sum().backward()
        # The graph is freed after a backward: a second one says so.
        y = module(x)
        y.sum().backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.sum().backward()
        # Without grad mode, or with nothing that wants a gradient: no node, as torch's ops.
        with torch.no_grad():
            assert module(x).grad_fn is None
        module.requires_grad_(False)
        assert module(x.detach()).grad_fn is None
        module.requires_grad_(True)


def test_a_frozen_affine_norm_gives_only_the_inputs_gradient():
    """needs_input_grad of the old Function: a frozen γ and β get none, x still gets its own."""
    _lane()
    norm = _affine_norm(requires_grad=False)
    x = torch.randn(4, 8, requires_grad=True)
    norm(x).square().sum().backward()
    assert x.grad is not None and norm.weight.grad is None and norm.bias.grad is None
    # And the other way round: only the parameters train (the input is data).
    norm = _affine_norm()
    y = norm(torch.randn(4, 8))
    assert y.grad_fn is not None
    y.square().sum().backward()
    assert norm.weight.grad is not None and norm.bias.grad is not None


def test_forward_mode_ad_is_refused_not_dropped():
    """A dual input (torch.autograd.forward_ad) takes the Python lane, which says that abp defines no
    forward derivative (abp.autograd.apply_function); a node of the C++ lane would have dropped the
    tangent silently."""
    _lane()
    import torch.autograd.forward_ad as fwAD
    x = torch.randn(4, 8)
    for module in (abp.nn.SiLU(bits=3), abp.nn.MSLayerNorm(8), _affine_norm()):
        with fwAD.dual_level():
            dual = fwAD.make_dual(x, torch.ones_like(x))
            with pytest.raises(NotImplementedError, match=r"forward-mode AD .*jvp.* is not supported.*reverse mode"):
                module(dual)


def _train_step_grads(model, x, checkpoint=False):
    model.zero_grad(set_to_none=True)
    if checkpoint:
        y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    else:
        y = model(x)
    y.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


_SCRIPT = """
import sys, torch, abp
from abp import _plan_lane
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), abp.nn.ReGELU2(), torch.nn.Linear(32, 4), abp.nn.MSLayerNorm(4))
x = torch.randn(8, 16)
model(x).square().mean().backward()
print(_plan_lane.status())
torch.save([p.grad for p in model.parameters()], sys.argv[1])
"""


def test_turned_off_the_python_lane_trains_to_the_same_bytes(tmp_path):
    _lane()
    out = {}
    for lane in ("1", "0"):
        env = dict(os.environ, ABP_PLAN_LANE=lane)
        path = tmp_path / f"grads-{lane}.pt"
        done = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        out[lane] = (done.stdout.strip().splitlines()[-1], torch.load(path))
    assert out["1"][0] == "C++ lane"
    assert out["0"][0] == "Python lane: the C++ lane is turned off (ABP_PLAN_LANE=0)"
    assert all(_same_bytes(a, b) for a, b in zip(out["1"][1], out["0"][1]))


def test_the_build_directory_must_be_this_users_alone(tmp_path):
    good = tmp_path / "cache" / "plan-lane" / "k"
    old_mask = os.umask(0o002)  # a group-writable default (Debian and Ubuntu users' umask)
    try:
        _plan_lane._private_directory(good)
    finally:
        os.umask(old_mask)
    for made in (good, good.parent, good.parent.parent):
        assert (made.stat().st_mode & 0o777) == 0o700, made
    # A directory above that others can write (and is not sticky) could have the lane's moved.
    open_above = tmp_path / "open"
    open_above.mkdir()
    open_above.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by everyone .* and not sticky"):
        _plan_lane._private_directory(open_above / "cache" / "plan-lane" / "k")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    _plan_lane._private_directory(sticky / "cache" / "plan-lane" / "k")
    shared = tmp_path / "shared" / "k"
    shared.parent.mkdir()
    shared.parent.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        _plan_lane._private_directory(shared)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.mkdir(mode=0o700)
    (link / "k").symlink_to(target)
    with pytest.raises(PermissionError, match="link"):
        _plan_lane._private_directory(link / "k")
    if os.getuid() == 0:  # only root can give a directory away
        foreign = tmp_path / "foreign" / "k"
        foreign.mkdir(parents=True, mode=0o700)
        os.chown(foreign, 12345, -1)
        with pytest.raises(PermissionError, match="owned by uid 12345"):
            _plan_lane._private_directory(foreign)


def test_the_build_directory_follows_abp_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ABP_CACHE_DIR", str(tmp_path))
    assert _plan_lane.build_directory("abc") == Path(tmp_path, "plan-lane", "abc")


def _affine_python(op_name, x, eps, weight, bias, offset, out_dtype, save_dtype):
    from abp._affine_norm import _AffineMSNorm, affine_operator
    return _AffineMSNorm.apply(affine_operator(op_name, bias is not None), eps, offset, out_dtype, save_dtype,
                               x, weight, bias)


@pytest.mark.parametrize("op_name", ["ms_layernorm", "ms_rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_affine_norm_gives_the_python_lanes_bytes(op_name, dtype):
    from abp import _affine_norm
    _lane()
    for bias in (False, True):
        assert autograd.lane_plan(_affine_norm.affine_operator(op_name, bias), _launch.compute_dtype(dtype)) is not None
    gen = torch.Generator().manual_seed(2)
    cases = [  # (shape, weight, bias, offset, out_dtype, save_dtype)
        ((6, 16), True, True, 0.0, None, None),
        ((2, 3, 16), True, False, 1.0, None, None),
        ((5, 16), False, True, 0.0, None, None),
        ((4, 16), True, True, 0.0, torch.bfloat16, None),
        ((4, 16), True, True, 0.0, None, torch.float16),
        ((16,), True, True, 0.0, None, None),
    ]
    for shape, has_w, has_b, offset, out_dtype, save_dtype in cases:
        x = torch.randn(shape, dtype=dtype, generator=gen)
        w = torch.randn(16, generator=gen).to(dtype) if has_w else None
        if w is not None:
            w[3] = 0  # a zero gamma: n is taken as 0 there, in both lanes
        b = torch.randn(16, generator=gen).to(dtype) if has_b else None
        results = []
        for run in (_affine_norm.affine_ms_norm, lambda *a: _affine_python(*a)):
            leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
            with _Saved() as saved:
                y = run(op_name, leaves[0], 1e-5, leaves[1], leaves[2], offset, out_dtype, save_dtype)
            g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.dtype)
            y.backward(g.t().contiguous().t() if g.dim() == 2 else g)  # non-contiguous where it can be
            results.append((y, saved.tensors, [t.grad if t is not None else None for t in leaves], y.grad_fn))
        (ya, sa, ga, fa), (yb, sb, gb, fb) = results
        case = (shape, has_w, has_b, offset, out_dtype, save_dtype)
        assert "AffineMSNorm" not in type(fa).__name__ and "AffineMSNorm" in type(fb).__name__, case
        assert _same_bytes(ya, yb), case
        assert len(sa) == len(sb) and all(_same_bytes(a, b) for a, b in zip(sa, sb)), case
        for a, b in zip(ga, gb):
            assert (a is None) == (b is None) and (a is None or _same_bytes(a, b)), case


def test_the_affine_norm_declines_a_changed_statistic_to_the_python_lanes_error():
    # A saved-tensor hook that hands the per-row statistic back in another dtype: the C++ plan
    # declines it, and the Python lane's general path names it, its type kept through the engine.
    from abp import _affine_norm
    _lane()
    errors = []
    for run in (_affine_norm.affine_ms_norm, _affine_python):
        x = torch.randn(4, 8, requires_grad=True)
        w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
        unpack = lambda t: t.double() if t.dim() == 1 and t.numel() == 4 else t  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = run("ms_layernorm", x, 1e-5, w, b, 0.0, None, None)
        with pytest.raises(ValueError) as info:
            y.sum().backward()
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "one value per row" in errors[0], errors


def test_a_saved_tensor_an_unpack_changed_is_named_with_what_differs():
    """An unpack that gives the norm's saved output back with other strides (same values, dtype and
    size): the error says it is not contiguous and where a saved tensor comes from, instead of
    "must be ... of 32 elements, got ... with 32 elements"."""
    _lane()
    x = torch.randn(4, 8, requires_grad=True)
    unpack = lambda t: t.t().contiguous().t() if t.dim() == 2 else t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = abp.nn.MSLayerNorm(8)(x)
    with pytest.raises(ValueError, match=r"residual0 must be a contiguous torch.float32 tensor of 32 elements, got "
                                         r"torch.float32 with 32 elements, not contiguous \(shape \(4, 8\), strides "
                                         r"\(1, 4\)\); it is a tensor saved for backward: a saved_tensors_hooks unpack"):
        y.sum().backward()


def test_a_plan_of_per_column_inputs_is_not_a_one_input_lane():
    # The affine norms' plans take per-column inputs: the one-input entry declines them.
    lane = _lane()
    native = _eager.native_plan(_lib.kernel_library().operator("ms_rmsnorm_gain"), torch.float32)
    assert native is not None and lane.run(native, torch.randn(3, 8), (1e-6, 0.0)) is None


def test_integer_parameters_are_exact_and_several_outputs_are_a_tuple():
    # A 63-bit seed reaches the kernel as the Python lane passes it (a double would round it),
    # and an operator with two outputs returns a tuple in both lanes.
    import numpy as np

    import gact_reference as ref
    from abp.author import operator, uniform, where
    from abp_reference import compiler_or_skip
    compiler_or_skip()
    _lane()

    @operator(name="test_plan_lane_dropout2", params={"seed": int, "offset": int})
    def dropout2(x, seed, offset):
        keep = uniform(seed, offset) < 0.5
        def backward(dy, dz):
            return where(keep, dy + dz, 0.0)
        return (where(keep, x, 0.0), where(keep, 0.0, x)), backward

    seed, offset = (1 << 60) + 1, 3
    x = torch.randn(5, 40)
    lanes = []
    for run in (lambda t: dropout2(t, seed, offset),
                lambda t: autograd.OperatorFunction.apply(dropout2.name, (seed, offset), None, t)):
        leaf = x.clone().requires_grad_()
        y, z = out = run(leaf)
        torch.autograd.backward([y, z], [torch.ones_like(y), torch.ones_like(z)])
        lanes.append((out, leaf.grad))
    (out_a, grad_a), (out_b, grad_b) = lanes
    assert type(out_a) is tuple and type(out_b) is tuple
    assert "OperatorFunction" not in type(out_a[0].grad_fn).__name__  # the C++ lane ran
    assert all(_same_bytes(a, b) for a, b in zip(out_a, out_b)) and _same_bytes(grad_a, grad_b)
    keep = torch.from_numpy(ref.uniform_at(seed, np.arange(x.numel(), dtype=np.uint64) + np.uint64(offset)) < 0.5)
    assert torch.equal(out_a[0], torch.where(keep.reshape(x.shape), x, torch.zeros(())))


def test_the_lane_declines_while_torch_jit_traces():
    # A trace records Python autograd.Functions (as opaque ops) but not this lane's launches: its
    # graph would hold the allocations and not the kernels, and return uninitialised memory.
    lane = _lane()
    native = _eager.native_plan(_lib.kernel_library().operator("silu_b3"), torch.float32)
    x = torch.randn(4, 8)
    seen = []

    def f(t):
        seen.append(lane.run(native, t, ()))
        return t * 2
    with warnings.catch_warnings():  # torch >= 2.9 calls jit.trace deprecated
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.trace(f, x, check_trace=False)  # (a check would run f again, untraced)
    assert seen == [None]
    assert lane.run(native, x, ()) is not None  # and takes the call again once the trace is done


def _neg_view(values):
    """A negative-bit view: memory holds -values, the tensor reads values (torch's lazy negation)."""
    t = torch.complex(torch.zeros(len(values)), -torch.tensor(values, dtype=torch.float32)).conj().imag
    assert t.is_neg() and torch.equal(t, torch.tensor(values, dtype=torch.float32))
    return t


@pytest.mark.parametrize("lane", ["1", "0"])
def test_negative_bit_views_are_read_as_their_values(lane, monkeypatch):
    # A kernel reads memory: a negative-bit input or gradient must be resolved first (it read the
    # un-negated values: relu(-2) gave 2).
    _lane()
    x = _neg_view([-2.0, 0.5, -0.25, 3.0])
    g = _neg_view([1.0, -1.0, 2.0, -2.0])
    if lane == "0":
        run = lambda t: autograd.OperatorFunction.apply("leaky_relu", (0.1,), None, t)  # noqa: E731
    else:
        run = lambda t: abp.functional.leaky_relu(t, 0.1)  # noqa: E731
    leaf = x.clone().requires_grad_()
    y = run(x)
    assert torch.equal(y, torch.nn.functional.leaky_relu(x.clone(), 0.1))
    run(leaf).backward(g)
    assert torch.equal(leaf.grad, torch.where(leaf > 0, g.clone(), 0.1 * g.clone()))
    ln = abp.nn.MSLayerNorm(4, elementwise_affine=True)
    torch.testing.assert_close(ln(x.reshape(1, 4)), torch.nn.functional.layer_norm(x.clone().reshape(1, 4), (4,)))


def test_every_gradient_of_an_abp_backward_refuses_a_second_differentiation():
    # backward(create_graph=True) through abp: the gradients it gives are marked, so a gradient
    # penalty built on them raises instead of being silently constant, through .backward() and
    # through autograd.grad towards what the incoming gradient depends on (`c`); with a constant
    # incoming gradient (a Hessian of f) it raises at once instead of giving a zero Hessian.
    _lane()
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    c = torch.randn(8, requires_grad=True)
    activations = {
        "activation, C++ lane": lambda t: abp.nn.SiLU()(t),
        "activation, Python lane": lambda t: autograd.OperatorFunction.apply("silu_b3", (), None, t),
    }
    for name, f in activations.items():  # codes carry no graph: refused at once (see test_launcher)
        with pytest.raises(RuntimeError, match="differentiate twice.*through the codes it saved"):
            torch.autograd.grad((f(x) * c).sum(), x, create_graph=True)
    cases = {
        "norm, C++ lane": lambda t: abp.nn.MSLayerNorm(8)(t),
        "affine norm, C++ lane": lambda t: abp.functional.ms_layer_norm(t, (8,), weight=w),
        "affine norm, Python lane": lambda t: _affine_python("ms_layernorm", t, 1e-5, w, None, 0.0, None, None),
    }
    head = torch.randn(8, 4, requires_grad=True)
    for name, f in cases.items():
        # A Hessian of sum(f(x) @ head): the incoming gradient depends on head, not on x; the
        # mark joins the norm's saved output, so the path towards x passes it (it was zero).
        with pytest.raises(RuntimeError, match="differentiate twice"):
            torch.autograd.functional.hessian(lambda t: (f(t) @ head).sum(), x.detach())
        (gx,) = torch.autograd.grad((f(x) * c).sum(), x, create_graph=True)  # an incoming gradient c
        assert gx.requires_grad, name
        with pytest.raises(RuntimeError, match="differentiate twice"):
            gx.pow(2).sum().backward()
        (gx,) = torch.autograd.grad((f(x) * c).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            torch.autograd.grad(gx.pow(2).sum(), c, allow_unused=True)
        with pytest.raises(RuntimeError, match="differentiate twice.*constant incoming gradient"):
            torch.autograd.grad(f(x).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            torch.autograd.functional.hessian(lambda t: (f(t) * c.detach()).sum(), x.detach())
        # Without create_graph nothing changes: plain gradients, equal to the marked ones.
        (plain,) = torch.autograd.grad((f(x) * c).sum(), x)
        assert not plain.requires_grad and torch.equal(plain, gx.detach()), name


def test_torch_jit_trace_of_an_abp_module_says_what_to_use_instead():
    _lane()
    for module in (abp.nn.GELU(), abp.nn.MSLayerNorm(8), abp.nn.MSLayerNorm(8, elementwise_affine=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="torch.jit.trace cannot record abp operators.*unconverted model"):
                torch.jit.trace(module, torch.randn(4, 8))


_STALE_LOCK = """
import time, torch
from abp import _plan_lane
t0 = time.time()
_plan_lane._build()
print("built in", round(time.time() - t0, 1))
"""


def test_a_lock_file_left_by_a_killed_build_does_not_hang_the_next(tmp_path):
    # torch 1.13 waits while its lock file exists; a build killed midway leaves one behind.
    _lane()
    directory = _plan_lane.build_directory(_plan_lane._key(_plan_lane._cuda_stream_support()))
    (directory / "lock").write_text("")
    # Without the fix torch 1.13 waits forever (the timeout fails the test); torch 2 locks with the
    # system's file locks, and keeps the file.
    done = subprocess.run([sys.executable, "-c", _STALE_LOCK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


_CALL_GELU = """
import torch, abp
from abp import _plan_lane
abp.nn.GELU()(torch.randn(8, requires_grad=True)).sum().backward()
print(_plan_lane.status())
"""


def test_a_damaged_lane_library_is_built_again_not_loaded(tmp_path):
    """A truncated library (a full disk, a build killed while linking) passed ninja's check (newer
    than its objects) and killed every later process with SIGBUS at load. Its SHA-256, recorded
    when it was built, no longer matches: the directory is emptied and the lane built again."""
    _lane()
    built = _plan_lane.build_directory(_plan_lane._key(_plan_lane._cuda_stream_support()))
    name = next(built.glob("abp_plan_lane_*.so")).name
    assert (built / f"{name}.sha256").read_text().strip() == _plan_lane._digest(built / name)
    root = tmp_path / "cache"
    (root / "plan-lane").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    copy = root / "plan-lane" / built.name
    copy.mkdir(mode=0o700)
    for entry in built.iterdir():  # a copy of the built lane: ninja has nothing to do there
        if entry.is_file() and entry.name != "lock":
            (copy / entry.name).write_bytes(entry.read_bytes())
    library = copy / name
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    env = dict(os.environ, ABP_CACHE_DIR=str(root))
    done = subprocess.run([sys.executable, "-c", _CALL_GELU], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.returncode, done.stderr)  # -7 (SIGBUS) before
    assert "it does not match the checksum recorded when it was built; building it again" in done.stderr
    assert done.stdout.strip() == "C++ lane"
    assert (copy / f"{name}.sha256").read_text().strip() == _plan_lane._digest(library)  # recorded once loaded


def test_a_lane_that_builds_but_will_not_load_is_not_built_again_by_every_process(tmp_path, monkeypatch):
    """A library that links but that the loader refuses (a symbol this torch lacks) raised before
    its checksum was recorded, so every later process found none, emptied the directory and built
    it again (a minute each) to fail the same way. Its checksum is now recorded: the next process
    fails at the load at once and takes the Python lane, with a warning that says so. The build
    is faked (a linked "library" and a refused import), as ninja and torch's loader would act."""
    builds = []

    class FakeCppExtension:
        CUDA_HOME = None

        @staticmethod
        def load(name, sources, build_directory, **kwargs):
            library = Path(build_directory, f"{name}.so")
            if not library.exists():  # ninja: nothing to do when the library is there
                builds.append(name)
                library.write_bytes(b"\x7fELF linked, but with a symbol torch lacks")
            raise ImportError(f"{library}: undefined symbol: _ZN3c105ErrorC2Ev")

    monkeypatch.setenv("ABP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_plan_lane, "_cpp_extension", lambda: FakeCppExtension)
    monkeypatch.setattr(_plan_lane, "_cuda_stream_support", lambda: False)
    for process in range(2):  # each run of module() in a fresh process
        monkeypatch.setattr(_plan_lane, "_state", {})
        with pytest.warns(RuntimeWarning) as caught:
            assert _plan_lane.module() is None
        messages = [str(w.message) for w in caught]
        assert not any("building it again" in m for m in messages), messages
        assert any("was built but could not be loaded (ImportError: " in m and "Python lane" in m for m in messages)
        assert _plan_lane.status().startswith("Python lane: the C++ lane was built but could not be loaded")
    assert len(builds) == 1, builds  # two before: one per process
    directory = _plan_lane.build_directory(_plan_lane._key(False))
    library = directory / f"{builds[0]}.so"
    assert (directory / f"{builds[0]}.so.sha256").read_text().strip() == _plan_lane._digest(library)


def test_an_unrecognised_abp_plan_lane_value_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv("ABP_PLAN_LANE", "enable")
    with pytest.warns(RuntimeWarning, match="ABP_PLAN_LANE='enable' is not one of"):
        assert _plan_lane._flag("ABP_PLAN_LANE", True) is True
    monkeypatch.setenv("ABP_PLAN_LANE", "off")
    assert _plan_lane._flag("ABP_PLAN_LANE", True) is False


def test_status_answers_after_a_bare_import():
    """docs/install.md's `abp._plan_lane.status()` works right after `import abp` (it raised
    AttributeError until some abp call had loaded the module)."""
    done = subprocess.run([sys.executable, "-c", "import abp; print(abp._plan_lane.status())"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
