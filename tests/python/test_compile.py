"""torch >= 2.4: the torch.library custom ops, and torch.compile keeping them (and their saving)."""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F

import abp
from abp import _custom_ops
from abp_reference import library_or_skip, packed, retains_input, sample_inputs

pytestmark = pytest.mark.skipif(not _custom_ops.supported_torch(), reason="torch.library custom ops need torch >= 2.4")


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


def test_every_operator_is_registered_when_the_library_opens():
    library = abp._lib.kernel_library()
    # Registered: whatever a dense input shapes (per-row outputs too: row_norms). Not: codecs
    # without an output (gact: input to codes; sample_rows), rows read by index, draws without an
    # input: abp.compress's and abp.sampling's, or eager.
    for name in ("regelu2", "gelu_b3", "ms_layernorm", "row_norms"):
        assert _custom_ops.registrable(library.operator(name)), name
    for name in ("gact_b2", "sample_rows", "philox_uniform", "sketch_gaussian"):
        assert not _custom_ops.registrable(library.operator(name)), name
    for name in abp.operators():
        op = library.operator(name)
        if not _custom_ops.registrable(op):
            assert not _custom_ops.registered(name) and not hasattr(torch.ops.abp, f"{name}_fwd")
            continue
        assert _custom_ops.registered(name)
        assert hasattr(torch.ops.abp, f"{name}_fwd") and hasattr(torch.ops.abp, f"{name}_bwd")
    schema = str(torch.ops.abp.leaky_relu_fwd.default._schema)
    assert "Tensor input0, float param0" in schema


@pytest.mark.parametrize("op,params", [("regelu2", ()), ("gelu_b3", ()), ("leaky_relu", (0.1,)), ("hardtanh", (-1.0, 2.0))])
def test_opcheck_validates_schema_fake_and_autograd(op, params):
    x = torch.randn(37, 5, requires_grad=True)
    fwd = getattr(torch.ops.abp, f"{op}_fwd").default
    torch.library.opcheck(fwd, (x, *params))
    produced = fwd(x.detach(), *params)
    codes = produced[1]
    bwd = getattr(torch.ops.abp, f"{op}_bwd").default
    bwd_args = (codes, torch.randn(37, 5)) + ((params[0],) if op == "leaky_relu" else ())
    torch.library.opcheck(bwd, bwd_args)


@pytest.mark.parametrize("op", ["ms_layernorm_affine", "ms_layernorm_gain", "ms_rmsnorm_affine", "ms_rmsnorm_gain"])
def test_opcheck_validates_per_column_inputs_and_their_gradients(op):
    # The affine norms' gain and bias: per-column inputs, saved from the inputs (not returned),
    # whose gradients hold one value per column.
    columns = _custom_ops.plan(op).op.inputs - 1
    x = torch.randn(6, 5, 16, requires_grad=True)
    cols = [torch.randn(16, requires_grad=True) for _ in range(columns)]
    fwd = getattr(torch.ops.abp, f"{op}_fwd").default
    torch.library.opcheck(fwd, (x, *cols, 1e-5, 0.5))
    y, statistic = fwd(x.detach(), *[c.detach() for c in cols], 1e-5, 0.5)
    assert y.shape == x.shape and statistic.shape == (6, 5)
    bwd = getattr(torch.ops.abp, f"{op}_bwd").default
    torch.library.opcheck(bwd, (y, statistic, *[c.detach() for c in cols], torch.randn(6, 5, 16), 0.5))
    grads = bwd(y, statistic, *[c.detach() for c in cols], torch.randn(6, 5, 16), 0.5)
    assert [tuple(g.shape) for g in grads] == [(6, 5, 16)] + [(16,)] * columns
    # Through autograd: the eager operator's gradients, bit for bit.
    dy = torch.randn(6, 5, 16)
    got = torch.autograd.grad(fwd(x, *cols, 1e-5, 0.5)[0], [x, *cols], dy)
    eager = abp.functional.apply(op, (x, *cols), (1e-5, 0.5))
    want = torch.autograd.grad(eager, [x, *cols], dy)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("op,params", [("resilu2", ()), ("silu_b2_uniform", ()), ("leaky_relu", (0.25,))])
def test_custom_op_autograd_equals_the_eager_function(op, params):
    x = sample_inputs(1000, torch.float32, seed=11).reshape(10, 100).t().requires_grad_()
    dy = sample_inputs(1000, torch.float32, seed=12).reshape(100, 10)
    fwd = getattr(torch.ops.abp, f"{op}_fwd").default
    with abp.memory.SavedTensorsCounter() as counter:
        y = fwd(x, *params)[0]
    bits = abp._lib.kernel_library().operator(op).residuals[0].bits
    assert counter.total_bytes == packed(bits, 1000)
    (dx,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().requires_grad_()
    y2 = abp.functional.apply(op, x2, params)
    (dx2,) = torch.autograd.grad(y2, x2, dy)
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and dx.shape == x.shape


def test_custom_op_does_not_keep_its_input():
    assert not retains_input(lambda x: torch.ops.abp.gelu_b3_fwd.default(x)[0])
    assert not retains_input(lambda x: torch.ops.abp.leaky_relu_fwd.default(x, 0.3)[0])


def _recording_backend(graphs: List[str]):
    """AOTAutograd with compilers that record the forward and backward graphs and run them as they are."""
    from torch._dynamo.backends.common import aot_autograd

    try:
        from torch._functorch.aot_autograd import make_boxed_func
    except ImportError:  # older layouts
        from functorch.compile import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def test_compile_keeps_the_operators_in_one_graph_and_saves_only_codes():
    torch._dynamo.reset()
    graphs: List[str] = []

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = abp.functional.gelu(x * 2.0, bits=3) + abp.functional.leaky_relu(x, 0.2)
        return abp.functional.regelu2(h) * w

    compiled = torch.compile(block, backend=_recording_backend(graphs), fullgraph=True)
    x = sample_inputs(4096, torch.float32, seed=13).requires_grad_()
    w = torch.randn(4096)
    with abp.memory.SavedTensorsCounter() as counter:
        y = compiled(x, w)
    joined = "\n".join(graphs)
    for name in ("gelu_b3_fwd", "leaky_relu_fwd", "regelu2_fwd"):
        assert f"abp.{name}" in joined, joined
    n = x.numel()
    # The codes (3 + 1 + 2 bits per element) and w (4 bytes per element, needed for dh = dy * w).
    assert counter.total_bytes == packed(3, n) + packed(1, n) + packed(2, n) + 4 * n

    y.sum().backward()
    assert any("abp.regelu2_bwd" in g for g in graphs)
    x2 = x.detach().requires_grad_()
    block(x2, w).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_compile_a_model_with_abp_modules():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), abp.nn.GELU(bits=2), torch.nn.Linear(64, 1))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 32)
    loss = F.mse_loss(compiled(x), torch.zeros(16, 1))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.mse_loss(model(x), torch.zeros(16, 1)).backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_channels_last_activation_keeps_its_layout_as_eager_does(backend):
    torch._dynamo.reset()
    block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), abp.nn.SiLU(bits=3)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0)).contiguous(memory_format=torch.channels_last)
    eager = block(x)
    explained = torch._dynamo.explain(block)(x)
    compiled = torch.compile(block, backend=backend)(x)
    assert eager.is_contiguous(memory_format=torch.channels_last)
    assert compiled.stride() == eager.stride() and torch.allclose(compiled, eager, atol=1e-6)
    assert explained.graph_break_count == 0


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def _convert_counting_graphs(model: torch.nn.Module, inplace: bool, x: torch.Tensor) -> Tuple[torch.nn.Module, List[abp.Change]]:
    """abp.convert(model, "lowmembp") with dynamo's caches and counters reset first."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return abp.convert(model, "lowmembp", inplace=inplace, example_inputs=(x,))


@pytest.mark.parametrize("inplace", [False, True])
def test_convert_of_a_compiled_model_converts_its_module_and_compiles_the_result(inplace):
    # convert(torch.compile(model)) ran its example and probes through dynamo (a transformers
    # LLaMA: 39 graphs, recompile-limit warnings, then a crash in the first training call).
    import torch._dynamo

    x = torch.randn(8, 32)
    plain, plain_changes = abp.convert(_block(), "lowmembp", example_inputs=(x,))
    compiled = torch.compile(_block(), backend="eager")
    converted, changes = _convert_counting_graphs(compiled, inplace, x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing traced while converting
    assert type(converted) is type(compiled) and (converted is compiled) == inplace
    assert changes == plain_changes
    assert isinstance(converted._orig_mod[2], abp.nn.GELU)
    y = converted(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # and it runs compiled
    assert torch.equal(y, plain(x))
    y.sum().backward()
    assert converted._orig_mod[1].weight.grad is not None


@pytest.mark.parametrize("where", ["model", "layers"])
@pytest.mark.parametrize("inplace", [False, True])
def test_convert_of_modules_compiled_in_place_runs_eagerly_and_returns_them_compiled(inplace, where):
    # model.compile() (nn.Module.compile) stores the compiled call on the module itself: convert ran
    # its example and probes through dynamo, and its copy (deepcopy drops the compiled call) came
    # back uncompiled without a word; so did each layer compiled on its own (torch's advice for
    # large models).
    import torch._dynamo
    from abp.convert import _dynamo_context

    x = torch.randn(8, 32)
    plain, plain_changes = abp.convert(_block(), "lowmembp", example_inputs=(x,))
    model = _block()
    compiled = [model] if where == "model" else list(model)
    for module in compiled:
        module.compile(backend="eager", dynamic=False)
    contexts = [_dynamo_context(m._compiled_call_impl) for m in compiled]
    assert None not in contexts
    converted, changes = _convert_counting_graphs(model, inplace, x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing traced while converting
    assert (converted is model) == inplace and changes == plain_changes
    assert isinstance(converted[2], abp.nn.GELU)
    # Every compiled module convert kept is compiled by its context (the replaced GELU is abp's).
    kept = [converted] if where == "model" else [converted[i] for i in (1, 3)]
    want = contexts if where == "model" else [contexts[i] for i in (1, 3)]
    assert [_dynamo_context(m._compiled_call_impl) for m in kept] == want
    if not inplace:  # the original is untouched and still compiled
        assert isinstance(model[2], torch.nn.GELU) and all(m._compiled_call_impl is not None for m in compiled)
    y = converted(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # and it runs compiled
    assert torch.equal(y, plain(x))
    y.sum().backward()
    assert converted[1].weight.grad is not None


def test_a_module_compiled_with_compile_disabled_stays_uncompiled_without_a_warning():
    import warnings

    model = _block()
    model.compile(disable=True)
    x = torch.randn(8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted, _ = abp.convert(model, "lowmembp", example_inputs=(x,))
    assert converted is not model and getattr(converted, "_compiled_call_impl", None) is None
    plain, _ = abp.convert(_block(), "lowmembp", example_inputs=(x,))
    assert torch.equal(converted(x), plain(x))


@pytest.mark.parametrize("affine", [True, False])
def test_a_norm_is_not_checked_while_traced(affine):
    """MSLayerNorm's one-time gamma check sets a flag on the module; torch 2.4's dynamo could not
    trace that setattr under fullgraph=True (a norm without affine failed). The traced call leaves
    the module untouched; the first eager call checks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), abp.nn.MSLayerNorm(32, elementwise_affine=affine),
                                torch.nn.Linear(32, 4))
    x = torch.randn(8, 32)
    torch._dynamo.reset()
    y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    y.sum().backward()
    assert "_gamma_checked" not in model[1].__dict__
    torch.testing.assert_close(y, model(x))
    assert model[1].__dict__.get("_gamma_checked") is True


def test_the_compress_recipe_steps_aside_where_compiled_graphs_cannot_be_compressed(monkeypatch):
    """On a torch whose AOTAutograd takes no saved-tensor hooks (2.4 and before), the recipe's block
    cannot be kept out of the trace; traced, its own Python failed under inductor (torch 2.4.1:
    "'NoneType' object has no attribute 'is_leaf'"). There it opens no block while compiled, says
    so once, and the model trains as without the recipe."""
    from abp import _compiled_saves

    monkeypatch.setattr(_compiled_saves, "available", lambda: False)
    monkeypatch.setattr(abp.convert_, "_BLOCK_FUNCTIONS", None)
    monkeypatch.setattr(abp.compress, "_WARNED", set())
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    x = torch.randn(8, 16, 64)
    converted, _ = abp.convert(block, "compress", bits=4)
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="compresses nothing in compiled graphs"):
        y = torch.compile(converted, backend="aot_eager")(x)
    y.pow(2).mean().backward()
    assert abp.compress.open_block() is None
    block.zero_grad()
    block(x).pow(2).mean().backward()
    for mine, exact in zip(converted.parameters(), block.parameters()):
        torch.testing.assert_close(mine.grad, exact.grad)
