"""torch >= 2.4 only (the pytest-torch2 lane): abp under torch.compile with the eager, aot_eager and
inductor backends, static and dynamic shapes, autocast; torch.library.opcheck over every abp
custom op; torch.export; and compiled training steps that save exactly the bytes of eager ones,
counted with abp.memory's saved-tensor counter."""
from __future__ import annotations

import json
import shutil
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import math

import pytest
import torch
import torch.nn.functional as F

import abp
from abp import _custom_ops
from abp_reference import library_or_skip, packed, sample_inputs

pytestmark = pytest.mark.skipif(
    not _custom_ops.supported_torch(),
    reason=f"torch.compile / torch.library custom-op paths need torch >= 2.4 (this is torch {torch.__version__})",
)

# inductor on the CPU compiles C++ with the host compiler (g++ comes with scripts/test's packages).
_INDUCTOR = pytest.param(
    "inductor",
    marks=pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler"),
)
BACKENDS = ["eager", "aot_eager", _INDUCTOR]


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()
    torch._dynamo.reset()


def _recording(backend: str, graphs: List[str]) -> Callable[..., Any]:
    """A dynamo backend that records each graph it gets (the code, with the abp ops it calls) and
    hands it on to `backend`."""
    inner = torch._dynamo.lookup_backend(backend)

    def compiler(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Any:
        graphs.append(gm.code)
        return inner(gm, example_inputs)

    return compiler


def _chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Every kind of abp operator: 2-bit tables, FewBit codes (both weights), piecewise ops with one
    and two parameters and a scalar residual, and both row norms (shared output + one value per row).
    The inputs of the abp ops are exact in fp32 (x, 2x, -x), so any backend feeds them the same bits."""
    a = abp.functional.regelu2(x * 2.0) + abp.functional.resilu2(x)
    b = abp.functional.gelu(x, bits=3) + abp.functional.silu(-x, bits=2, weight="uniform")
    c = abp.functional.leaky_relu(x, 0.2) + abp.functional.hardtanh(x, -1.0, 2.0) + abp.functional.threshold(x, 0.5, -2.0)
    d = abp.functional.ms_layer_norm(x, x.shape[-1]) + abp.functional.ms_rms_norm(x * 2.0, x.shape[-1])
    return (a * w + b * w + c + d * w).sum()


_CHAIN_OPS = (
    "regelu2_fwd", "resilu2_fwd", "gelu_b3_fwd", "silu_b2_uniform_fwd", "leaky_relu_fwd",
    "hardtanh_fwd", "threshold_fwd", "ms_layernorm_fwd", "ms_rmsnorm_fwd",
)


def _assert_same(backend: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if backend == "inductor":  # inductor's own kernels for the torch ops around abp's may round differently
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:  # the very same kernels run
        assert torch.equal(actual, expected), (actual - expected).abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_functional_ops_equal_eager_forward_and_backward(backend):
    graphs: List[str] = []
    compiled = torch.compile(_chain, backend=_recording(backend, graphs), fullgraph=True)
    x = sample_inputs(16 * 48, torch.float32, seed=21).reshape(16, 48).requires_grad_()
    w = torch.randn(16, 48, generator=torch.Generator().manual_seed(22))
    loss = compiled(x, w)
    (dx,) = torch.autograd.grad(loss, x)
    code = "\n".join(graphs)
    for name in _CHAIN_OPS:  # the custom ops are in the graph, not graph breaks or decompositions
        assert f"abp.{name}" in code, code
    x2 = x.detach().requires_grad_()
    loss2 = _chain(x2, w)
    (dx2,) = torch.autograd.grad(loss2, x2)
    _assert_same(backend, loss, loss2)
    _assert_same(backend, dx, dx2)


def test_dynamic_shapes_compile_once_and_equal_eager():
    graphs: List[str] = []
    compiled = torch.compile(_chain, backend=_recording("aot_eager", graphs), dynamic=True, fullgraph=True)
    first_call: Optional[int] = None
    for rows, seed in ((5, 31), (9, 32), (17, 33)):  # symbolic rows: fake codes of ceil(2 * numel / 8) bytes etc.
        x = sample_inputs(rows * 40, torch.float32, seed=seed).reshape(rows, 40).requires_grad_()
        w = torch.randn(rows, 40, generator=torch.Generator().manual_seed(seed))
        loss = compiled(x, w)
        (dx,) = torch.autograd.grad(loss, x)
        # The first call may hand the backend two graphs (dynamo restarts once to specialise the
        # norms' float eps); later row counts must reuse the result.
        first_call = len(graphs) if first_call is None else first_call
        x2 = x.detach().requires_grad_()
        loss2 = _chain(x2, w)
        (dx2,) = torch.autograd.grad(loss2, x2)
        assert torch.equal(loss, loss2) and torch.equal(dx, dx2)
    assert first_call and len(graphs) == first_call, f"recompiled for new row counts: {len(graphs)} graphs"
    assert "SymInt" in graphs[-1], graphs[-1]  # the row count is symbolic


def test_dynamic_eps_and_slope_of_modules_compile():
    # With dynamic=True, dynamo makes module float attributes symbolic: eps's fp32 check must
    # guard on them, not call struct or math on them.
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 24), abp.nn.MSLayerNorm(24, eps=1e-3), abp.nn.LeakyReLU(0.3), torch.nn.Linear(24, 4)
    )
    compiled = torch.compile(model, backend="aot_eager", dynamic=True, fullgraph=True)
    x = torch.randn(7, 24)
    y = compiled(x)
    y.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y2 = model(x)
    y2.sum().backward()
    assert torch.equal(y, y2)
    for g, p in zip(grads, model.parameters()):
        assert torch.equal(g, p.grad)


_PARAMS = {"negative_slope": 0.1, "min_val": -1.0, "max_val": 2.0, "threshold": 0.5, "value": -2.0, "lambd": 0.5, "eps": 1e-5,
           "offset": 0.5}


def _inputs(plan: Any, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """x, and a vector of x's last dimension for each per-column input (a norm's gain and bias)."""
    gen = torch.Generator().manual_seed(7)
    return (x, *[torch.randn(x.shape[-1], generator=gen) for _ in plan.op.input_args[1:]])


def _bwd_args(plan: Any, x: torch.Tensor, params: Tuple[float, ...]) -> Tuple[Any, ...]:
    """Arguments of abp::<op>_bwd from a real forward: its saved residuals, output grads, scalars."""
    inputs = _inputs(plan, x)
    produced = plan.fwd(*inputs, *params)
    produced = produced if isinstance(produced, tuple) else (produced,)
    n_out = plan.op.outputs
    returned = iter(produced[n_out:])
    saved = [produced[k] if kind == "output" else inputs[k] if kind == "input" else next(returned)
             for kind, k in plan.residual_sources if kind != "param"]
    # A per-row output's gradient is per row (row_norms); the launch shape is then given.
    grads = [torch.randn(x.shape[:-1] if layout == "rows" else x.shape, dtype=x.dtype) for layout in plan.op.output_layouts]
    scalars = [params[plan.residual_sources[i][1]] for i in plan.scalar_residuals]
    return (*saved, *grads, *scalars, x.dtype, list(x.shape))


def test_opcheck_every_registered_custom_op():
    """torch.library.opcheck (schema, fake tensor, autograd registration, AOT dispatch with dynamic
    shapes) on abp::<op>_fwd and abp::<op>_bwd of every operator abp registers, on an odd element
    count (the codes' last byte is partial)."""
    library = abp._lib.kernel_library()
    # The op library's operators (the build's manifests), not ones other tests compiled from IR.
    built = {o["name"] for path in abp.kernel_dir().glob("*.json") for o in json.loads(path.read_text()).get("operators", [])}
    names = sorted(n for n in built if _custom_ops.registrable(library.operator(n)))
    assert len(names) >= 100 and {"regelu2", "ms_layernorm", "ms_layernorm_affine", "ms_rmsnorm_gain"} <= set(names)
    failures: Dict[str, str] = {}
    for name in names:
        plan = _custom_ops.register(library.operator(name))
        params = tuple(_PARAMS[p] for p in plan.op.params)
        x = torch.randn(5, 33, generator=torch.Generator().manual_seed(len(name)), requires_grad=True)
        try:
            torch.library.opcheck(plan.fwd, (*_inputs(plan, x), *params))
            torch.library.opcheck(plan.bwd, _bwd_args(plan, x.detach(), params))
        except Exception as e:  # collect them all: one report names every failing op
            failures[name] = f"{type(e).__name__}: {e}"[:400]
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())


@pytest.mark.parametrize("op", ["ms_layernorm", "ms_rmsnorm"])
def test_opcheck_norm_with_out_dtype_and_bwd_dtype(op):
    plan = _custom_ops.register(abp._lib.kernel_library().operator(op))
    x = torch.randn(6, 20, requires_grad=True)
    torch.library.opcheck(plan.fwd, (x, 1e-5, torch.bfloat16))
    y, r = plan.fwd(x.detach(), 1e-5, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and r.dtype == torch.float32
    dy = torch.randn(6, 20, dtype=torch.bfloat16)
    torch.library.opcheck(plan.bwd, (y, r, dy, torch.float32))
    assert plan.bwd(y, r, dy, torch.float32).dtype == torch.float32
    assert plan.bwd(y, r, dy).dtype == torch.bfloat16


def test_gact_codecs_are_not_custom_ops():
    # gact_b<k> (input to codes, no output) has nothing to differentiate; abp.compress launches it.
    op = abp._lib.kernel_library().operator("gact_b2")
    assert op.outputs == 0 and not _custom_ops.registrable(op) and not _custom_ops.registered("gact_b2")
    with pytest.raises(ValueError, match="gact_b2: only operators with an output whose shapes follow from a dense input"):
        _custom_ops.register(op)


class _Block(torch.nn.Module):
    """Linear -> norm -> Linear -> activation -> Linear, abp's or torch's parts."""

    def __init__(self, abp_parts: bool, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp = torch.nn.Linear(32, width)
        self.norm = abp.nn.MSLayerNorm(width) if abp_parts else torch.nn.LayerNorm(width, elementwise_affine=False)
        self.up = torch.nn.Linear(width, 2 * width)
        self.act = abp.nn.ReGELU2() if abp_parts else torch.nn.GELU()
        self.out = torch.nn.Linear(2 * width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.up(self.norm(self.inp(x)))))


def _distinct(counter: abp.memory.SavedTensorsCounter) -> List[Tuple[str, int]]:
    """(dtype, bytes) of each distinct storage saved, sorted: what backward keeps, whatever views."""
    seen: Dict[Tuple[str, int], Tuple[str, int]] = {}
    for s in counter.tensors:
        seen[(s.device, s.storage_ptr)] = (str(s.dtype), s.storage_bytes)
    return sorted(seen.values())


def _train_step(
    model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, autocast: Optional[torch.dtype] = None
) -> Tuple[abp.memory.SavedTensorsCounter, torch.Tensor, List[torch.Tensor]]:
    """One step's forward under the counter and its backward: (counter, loss, parameter grads)."""
    for p in model.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        with abp.memory.SavedTensorsCounter() as counter:
            loss = F.mse_loss(model(x).float(), target)
    loss.backward()
    return counter, loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_training_step_saves_the_bytes_of_eager(backend):
    model = _Block(abp_parts=True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    target = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    eager, eager_loss, eager_grads = _train_step(model, x, target)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _train_step(compiled, x, target)  # compiles (fake tensors, nothing stored)
    counter, loss, grads = _train_step(compiled, x, target)
    assert counter.total_bytes == eager.total_bytes
    assert _distinct(counter) == _distinct(eager)
    # What abp saves is there: ReGELU2's 2-bit codes and MS-LayerNorm's one fp32 value per row.
    assert ("torch.uint8", packed(2, 16 * 128)) in _distinct(counter)
    assert ("torch.float32", 16 * 4) in _distinct(counter)
    _assert_same(backend, loss, eager_loss)
    for g, e in zip(grads, eager_grads):
        _assert_same(backend, g, e)
    # The saving survives compilation: the same block with torch's LayerNorm and GELU saves more.
    torch._dynamo.reset()
    baseline = _Block(abp_parts=False)
    compiled_baseline = torch.compile(baseline, backend=backend, fullgraph=True)
    _train_step(compiled_baseline, x, target)
    base_counter, _, _ = _train_step(compiled_baseline, x, target)
    assert counter.total_bytes < base_counter.total_bytes


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_autocast_norm_shares_its_low_precision_output(backend):
    # An MS norm over an fp32 input under autocast emits autocast's dtype, so the Linear after it
    # saves that very tensor; the compiled graph must do the same as eager (out_dtype of the op).
    torch.manual_seed(8)
    model = torch.nn.Sequential(abp.nn.MSLayerNorm(32), torch.nn.Linear(32, 64), abp.nn.ReGELU2(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32, requires_grad=True)
    target = torch.randn(16, 8)
    eager, eager_loss, eager_grads = _train_step(model, x, target, autocast=torch.bfloat16)
    eager_dx = x.grad.clone()
    x.grad = None
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _train_step(compiled, x, target, autocast=torch.bfloat16)
    x.grad = None
    counter, loss, grads = _train_step(compiled, x, target, autocast=torch.bfloat16)
    assert ("torch.bfloat16", 16 * 32 * 2) in _distinct(eager)  # the norm's output, shared
    assert ("torch.float32", 16 * 32 * 4) not in _distinct(counter)  # no fp32 copy of it
    assert _distinct(counter) == _distinct(eager) and counter.total_bytes == eager.total_bytes
    assert torch.equal(loss, eager_loss) and torch.equal(x.grad, eager_dx)
    assert x.grad.dtype == torch.float32
    for g, e in zip(grads, eager_grads):
        assert torch.equal(g, e)


def test_export_keeps_the_abp_ops():
    model = _Block(abp_parts=True)
    x = torch.randn(4, 32)
    program = torch.export.export(model, (x,))
    code = program.graph_module.code
    assert "abp.ms_layernorm_fwd" in code and "abp.regelu2_fwd" in code, code
    assert torch.equal(program.module()(x), model(x))


@pytest.mark.parametrize("method", ["wtacrs", "crs", "gaussian"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_sampled_linear_has_no_graph_break_and_draws_what_eager_draws(method, backend):
    # One Philox key per call from torch's generator in both paths: the same seed gives the same
    # rows (or sketch), hence the same dW; the eager path's host planning and kernel launches sit
    # inside abp::sampled_linear_save / _dw, so dynamo keeps the whole step in one graph.
    x = torch.randn(4, 50, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)

    def step(x, w, b):
        return (abp.sampling.sampled_linear(x, w, b, method=method, keep=0.3) ** 2).sum()

    explained = torch._dynamo.explain(step)(x, w, b)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    grads = []
    for run in (step, torch.compile(step, backend=backend)):
        torch.manual_seed(3)
        grads.append(torch.autograd.grad(run(x, w, b), (x, w, b)))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [12, 20, 40])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_sampled_layers_sharing_an_input_draw_their_keys_in_forward(tokens, backend):
    """A gate and an up projection of one input (SwiGLU's pair) at token counts where saving the
    input once costs the partitioner less than two layers' kept rows (12 and 20 tokens keep 10
    rows each): the plans and their keys' torch.randint must still run in the forward graph. They
    ran in backward, drawing from the generator as backward ran and in the other layer's order,
    so dW was not eager's (0.7 to 1.1 relative error), and a draw between forward and backward
    changed it. The outputs are eager's bit for bit (the layer adds the save op's -0.0)."""
    torch._dynamo.reset()
    gate = torch.randn(64, 32, requires_grad=True)
    up = torch.randn(64, 32, requires_grad=True)

    def step(x):
        y = abp.sampling.sampled_linear(x, gate, keep=0.3) * abp.sampling.sampled_linear(x, up, keep=0.3)
        return y, y.pow(2).sum()

    x = torch.randn(tokens, 32)
    results = []
    for run in (step, torch.compile(step, backend=backend)):
        torch.manual_seed(9)
        y, loss = run(x)
        torch.rand(3)  # a draw between forward and backward (the user's, or another model's)
        results.append((y, torch.autograd.grad(loss, (gate, up))))
    (y_eager, eager), (y_compiled, compiled) = results
    assert torch.equal(y_compiled, y_eager)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["wtacrs", "gaussian"])
def test_compiled_sampled_linear_serves_every_token_count_with_one_graph(method):
    """The fake implementation gives the kept rows as an expression of the token count (a SymInt
    under dynamic shapes), not int(n): otherwise every new sequence length compiled a graph of its
    own, and past dynamo's recompile limit the model silently ran eager. The graph for many lengths
    computes what eager does (the real kernels' row counts agree with the traced ones)."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    w = torch.randn(8, 16, requires_grad=True)

    def step(x):
        return (abp.sampling.sampled_linear(x, w, method=method, keep=0.3) ** 2).sum()

    compiled = torch.compile(step, backend=backend)
    for tokens in range(40, 40 + 9 * 7, 7):  # 9 lengths: more than dynamo's default recompile limit of 8
        x = torch.randn(2, tokens, 16)
        torch.manual_seed(tokens)
        (got,) = torch.autograd.grad(compiled(x), (w,))
        torch.manual_seed(tokens)
        (want,) = torch.autograd.grad(step(x), (w,))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(graphs) <= 2, f"{len(graphs)} graphs for 9 token counts"


def test_compiled_sampled_linear_keeps_exact_and_degenerate_gradients():
    # k >= n: the input whole, so dW is exact; all-zero rows: dW = 0 as exactly; a non-finite input:
    # a non-finite dW as exactly (AMP's scaler then skips the step).
    w = torch.randn(8, 16, requires_grad=True)
    step = torch.compile(lambda x: abp.sampling.sampled_linear(x, w, method="wtacrs", keep=0.3).sum(), backend="aot_eager")
    few = torch.randn(6, 16)  # n = 6 < the 10-row minimum: nothing to sample
    (dw,) = torch.autograd.grad(step(few), (w,))
    torch.testing.assert_close(dw, torch.ones(8, 6) @ few)
    (dw,) = torch.autograd.grad(step(torch.zeros(64, 16)), (w,))
    assert torch.equal(dw, torch.zeros_like(dw))
    bad = torch.randn(64, 16)
    bad[5, 3] = float("inf")
    (dw,) = torch.autograd.grad(step(bad), (w,))
    assert not torch.isfinite(dw).all()


def test_sampled_custom_ops_pass_opcheck():
    from abp import _sampled_ops

    x2 = torch.randn(64, 16)
    key = torch.randint(0, 2**63 - 1, (1,))
    for method in ("wtacrs", "gaussian"):
        torch.library.opcheck(_sampled_ops._save, (x2, key, method, 0.3), test_utils=("test_schema", "test_faketensor"))
        rows, index, used, negative_zero = _sampled_ops._save(x2, key, method, 0.3)
        assert torch.equal(used, key)
        # What the layer adds to its output: -0.0, which leaves every value's bits as they are.
        assert negative_zero.dim() == 0 and negative_zero.dtype == x2.dtype
        assert negative_zero.item() == 0.0 and math.copysign(1.0, negative_zero.item()) == -1.0
        torch.library.opcheck(_sampled_ops._dw, (torch.randn(64, 8), rows, index, used, method),
                              test_utils=("test_schema", "test_faketensor"))


def test_abp_ops_under_fake_tensor_mode_take_their_fake_implementations():
    # Eager abp ops used to hand a FakeTensor's NULL data pointer to the native kernel (SIGSEGV in
    # the user's process). Under a FakeTensorMode they now call the torch.library ops, whose fake
    # implementations give the shapes; a fake tensor outside its mode is a clear error.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from abp._errors import AbpError

    mode = FakeTensorMode()
    with mode:
        x = torch.randn(3, 10, requires_grad=True)
        y = abp.functional.apply("gelu_b3", x)
        y.sum().backward()
        z = abp.nn.MSLayerNorm(10)(x)
    assert y.shape == x.shape and x.grad.shape == x.shape and z.shape == x.shape
    stray = mode.from_tensor(torch.randn(10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that a FakeTensor's data_ptr is deprecated
        with pytest.raises(AbpError, match=r"args\[0\]: a NULL data pointer for 10 elements"):
            abp.functional.apply("gelu_b3", stray)


@pytest.mark.parametrize("make, what", [
    (lambda: abp.nn.MSLayerNorm(8, elementwise_affine=True), "abp's memory-sharing norm"),
    (lambda: abp.nn.ReGELU2(), "abp operator regelu2"),
    (lambda: abp.nn.SampledLinear(8, 8, keep=0.5), "abp's sampled linear layer"),
], ids=["affine-norm", "activation", "sampled"])
def test_torch_func_transforms_get_an_error_naming_abp(make, what):
    # torch's own error asks for a setup_context the Functions do not have; abp's names itself and
    # says what to use instead (per-sample gradients: the unconverted model).
    library_or_skip()
    from torch.func import grad, vmap
    module, x = make(), torch.randn(4, 8)
    transforms = [grad(lambda t: module(t).sum())]
    if "sampled" not in what:  # vmap refuses the sampled layer's random draw first, in its own words
        transforms.append(vmap(grad(lambda t: module(t).sum())))
    for transform in transforms:
        with pytest.raises(RuntimeError, match=f"{what}: torch.func transforms .* are not supported.*loss.backward"):
            transform(x)
    module(x.requires_grad_()).sum().backward()  # outside a transform nothing changed
    assert x.grad is not None
