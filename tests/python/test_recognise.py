"""abp._recognise (what a leaf module computes, by probing it), abp._structure (who reads a module's
output, by running the model once) and the memory-sharing norms with their affine kept
(abp.nn.MSLayerNorm / MSRMSNorm with ``elementwise_affine=True``, abp._affine_norm)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abp
from abp._recognise import Activation, LinearMap, Norm, Unknown, is_leaf, recognise
from abp._structure import Use, record
from abp_reference import library_or_skip
from norm_lookalikes import BertLayerNorm, GemmaRMSNorm

# ---------------------------------------------------------------------------------------------
# Modules written as other libraries write them
# ---------------------------------------------------------------------------------------------


class ErfGELU(nn.Module):
    """transformers' GELUActivation (python form)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class NewGELU(nn.Module):
    """transformers' NewGELUActivation: the tanh form written out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Swish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class LlamaRMSNorm(nn.Module):
    """LLaMA's RMSNorm: float32 inside, cast back before the weight."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


class WeightOnlyLayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, 1e-5)


class Conv1D(nn.Module):
    """transformers' Conv1D: y = x @ W + b, W stored (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class ScaleShift(nn.Module):
    """x * w + b: a 1-D weight and bias like a norm's, but no normalisation."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w + self.b


class LayerScale(nn.Module):
    def __init__(self, d: int, init: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DoubledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class PlainLinearSubclass(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


# ---------------------------------------------------------------------------------------------
# recognise: activations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module,kind", [
    (nn.GELU(), "gelu"),
    (ErfGELU(), "gelu"),
    (nn.GELU(approximate="tanh"), "gelu_tanh"),
    (NewGELU(), "gelu_tanh"),
    (nn.SiLU(), "silu"),
    (Swish(), "silu"),
    (nn.ReLU(), "relu"),
    (nn.ReLU(inplace=True), "relu"),
], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else v)
def test_known_activations(module, kind):
    assert recognise(module) == Activation(kind)


@pytest.mark.parametrize("slope", [0.01, 0.2, 0.5])
def test_leaky_relu_slope(slope):
    found = recognise(nn.LeakyReLU(slope))
    assert isinstance(found, Activation) and found.kind == "leaky_relu"
    assert found.slope == pytest.approx(slope, rel=1e-12)


@pytest.mark.parametrize("module, shown", [
    (QuickGELU(), []), (nn.ELU(alpha=0.5), ["alpha=0.5"]), (nn.CELU(alpha=2.0, inplace=True), ["alpha=2"]),
    (nn.Hardtanh(-2, 2), ["min_val=-2", "max_val=2"]), (nn.Softplus(beta=2.0), ["beta=2", "threshold=20"]),
    (nn.Softplus(threshold=10.0), ["beta=1", "threshold=10"])], ids=lambda m: str(m))
def test_other_elementwise_functions_are_unknown(module, shown):
    """Functions abp has no table for, and FewBit's own functions at other parameters than the
    tables': Softplus's threshold 10 differs from 20 by 5e-5 at 11, which the far probes see. The
    reason shows the module's parameters (as torch's extra_repr prints them, which differs between
    versions: 2 or 2.0), not its in-place flag, before the tables' own."""
    found = recognise(module)
    assert isinstance(found, Unknown)
    tables = ("an elementwise activation that is none of GELU (erf or tanh form), SiLU, the ReLU family "
              "(ReLU, LeakyReLU, ReLU6), Hardsigmoid, Sigmoid, Tanh, or Hardswish, Mish, ELU/CELU (alpha 1), "
              "SELU, Softplus (beta 1, threshold 20), LogSigmoid, Softsign, Tanhshrink")
    assert found.reason.endswith(tables)
    parameters = found.reason[:-len(tables)]
    if not shown:
        assert parameters == ""
    else:
        assert parameters.startswith("with ") and parameters.endswith(" it is ") and "inplace" not in parameters
        assert all(p in parameters for p in shown), parameters


@pytest.mark.parametrize("training", [True, False])
def test_an_activation_that_draws_in_training_is_unknown_in_either_mode(training):
    """Probed in training mode, which its replacement trains in; the module's mode is left as it was.
    Dropout draws too but is the identity in eval mode: nothing to replace."""
    rrelu, dropout = nn.RReLU().train(training), nn.Dropout(0.2).train(training)
    found = recognise(rrelu)
    assert isinstance(found, Unknown) and "draws at random in training mode" in found.reason
    assert recognise(dropout) is None
    assert rrelu.training == training and dropout.training == training


@pytest.mark.parametrize("module", [nn.PReLU(), nn.PReLU(5)], ids=str)
def test_a_learned_activation_is_unknown(module):
    found = recognise(module)
    assert isinstance(found, Unknown) and found.reason.startswith("its output depends on its learned parameters (weight)")


def test_unknown_activation_whose_extra_repr_fails_still_gets_a_reason():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.sin(x)

        def extra_repr(self):
            raise RuntimeError("broken repr")

    found = recognise(Odd())
    assert isinstance(found, Unknown) and found.reason.startswith("an elementwise activation that is none of")


class _WrittenHardswish(nn.Module):
    """Hardswish as models write it out (x * relu6(x + 3) / 6), not torch's module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * F.relu6(x + 3.0) / 6.0


@pytest.mark.parametrize("module,kind", [
    (nn.Hardswish(), "hardswish"), (_WrittenHardswish(), "hardswish"), (nn.Mish(), "mish"), (nn.ELU(), "elu"),
    (nn.CELU(), "elu"), (nn.SELU(), "selu"), (nn.Softplus(), "softplus"), (nn.LogSigmoid(), "logsigmoid"),
    (nn.Softsign(), "softsign"), (nn.Tanhshrink(), "tanhshrink"),
], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else v)
def test_activations_with_a_fewbit_table_are_recognised_by_what_they_compute(module, kind):
    """CELU with alpha 1 is ELU with alpha 1, one function, one kind."""
    assert recognise(module) == Activation(kind)


@pytest.mark.parametrize("module,kind", [(nn.ReLU6(), "relu6"), (nn.Hardtanh(0.0, 6.0), "relu6"),
                                         (nn.Hardsigmoid(), "hardsigmoid"), (nn.Sigmoid(), "sigmoid"), (nn.Tanh(), "tanh")],
                         ids=lambda m: str(m))
def test_relu6_hardsigmoid_sigmoid_and_tanh_are_recognised_by_what_they_compute(module, kind):
    assert recognise(module) == Activation(kind)


class _ScaledGate(nn.Module):
    """Sigmoid when called with its input alone; its forward takes a scale as well."""

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.sigmoid(x) * scale


def test_a_known_function_with_other_arguments_is_named_by_what_it_computes():
    found = recognise(_ScaledGate())
    assert isinstance(found, Unknown)
    assert found.reason.startswith("with its input alone it computes Sigmoid, but its forward takes `scale`"), found.reason


@pytest.mark.parametrize("module", [nn.Dropout(0.1), nn.Dropout(0.1).eval(), nn.Identity(), nn.Softmax(-1),
                                    nn.Sequential(nn.GELU()), nn.BatchNorm1d(16).eval(), nn.Embedding(10, 16), nn.Flatten()],
                         ids=lambda m: f"{type(m).__name__}{'' if m.training else '-eval'}")
def test_not_recognised(module):
    training = module.training
    assert recognise(module) is None
    assert module.training == training, "the module's mode is restored"


def test_is_leaf():
    assert is_leaf(nn.GELU()) and is_leaf(nn.Linear(2, 2)) and not is_leaf(nn.Sequential(nn.GELU()))


# ---------------------------------------------------------------------------------------------
# recognise: norms
# ---------------------------------------------------------------------------------------------


def test_torch_layer_norm():
    assert recognise(nn.LayerNorm(16)) == Norm("layer", (16,), 1e-5, "weight", "bias", 0.0)
    assert recognise(nn.LayerNorm((3, 8), eps=1e-6)) == Norm("layer", (3, 8), 1e-6, "weight", "bias", 0.0)
    assert recognise(nn.LayerNorm(16, eps=1e-12)) == Norm("layer", (16,), 1e-12, "weight", "bias", 0.0)
    assert recognise(nn.LayerNorm(16).half()) == Norm("layer", (16,), 1e-5, "weight", "bias", 0.0)


def test_recognise_leaves_the_module_as_it_was():
    norm = nn.LayerNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    weight, values = norm.weight, norm.weight.detach().clone()
    norm.eval()
    recognise(norm)
    assert norm.weight is weight and torch.equal(norm.weight, values) and norm.weight.dtype == torch.float32
    assert not norm.training


def test_llama_rms_norm_with_float32_upcast():
    assert recognise(LlamaRMSNorm(16)) == Norm("rms", (16,), 1e-6, "weight", None, 0.0)
    assert recognise(LlamaRMSNorm(16, eps=1e-5).to(torch.bfloat16)) == Norm("rms", (16,), 1e-5, "weight", None, 0.0)


def test_gemma_norm_is_one_plus_weight():
    assert recognise(GemmaRMSNorm(16)) == Norm("rms", (16,), 1e-6, "weight", None, 1.0)


def test_eps_is_estimated_when_no_attribute_holds_it():
    found = recognise(BertLayerNorm(16))
    assert isinstance(found, Norm) and (found.kind, found.shape, found.weight, found.bias) == ("layer", (16,), "gamma", "beta")
    assert found.eps == pytest.approx(1e-12, rel=1e-3) and found.weight_offset == 0.0
    found = recognise(WeightOnlyLayerNorm(16))
    assert isinstance(found, Norm) and found.bias is None and found.eps == pytest.approx(1e-5, rel=1e-3)


@pytest.mark.parametrize("module", [ScaleShift(16), LayerScale(16), LayerScale(16, 1e-6)],
                         ids=["ScaleShift", "LayerScale", "LayerScale-1e-6"])
def test_a_one_dimensional_parameter_is_not_enough_for_a_norm(module):
    # A LayerScale at DeiT-III's 1e-6 scales x and 10x to outputs within any absolute tolerance
    # of each other: it is not a normalisation (and no line in convert's report says it is).
    assert not isinstance(recognise(module), Norm)
    assert recognise(module) is None


class Rotary(nn.Module):
    """A rotary embedding's shape: forward needs the positions besides its input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return (position_ids[..., None].float() * self.inv_freq).cos().to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm with an optional gate (Mamba2's MambaRMSNormGated): with gate=None it is RMSNorm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, gate: torch.Tensor = None) -> torch.Tensor:  # type: ignore[assignment]
        if gate is not None:
            x = x * F.silu(gate)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_module_that_needs_more_than_its_input_computes_nothing_abp_knows():
    assert recognise(Rotary(8)) is None  # no "refused" line for every rotary embedding


def test_a_module_that_computes_a_known_function_alone_but_takes_more_says_what_it_computes():
    found = recognise(GatedRMSNorm(8))
    assert isinstance(found, Unknown)
    assert found.reason == ("with its input alone it computes RMSNorm, but its forward takes `gate` besides its input, "
                            "which abp's replacement would not take")


def test_a_normalisation_abp_cannot_replace_is_unknown_with_the_reason():
    found = recognise(nn.BatchNorm1d(16))  # training mode: batch statistics make it scale-invariant
    assert isinstance(found, Unknown) and "neither LayerNorm nor RMSNorm over the last dimension" in found.reason


# ---------------------------------------------------------------------------------------------
# recognise: linear maps
# ---------------------------------------------------------------------------------------------


def test_torch_linear():
    assert recognise(nn.Linear(16, 8)) == LinearMap("weight", "bias", False, 16, 8)
    assert recognise(nn.Linear(16, 8, bias=False)) == LinearMap("weight", None, False, 16, 8)
    assert recognise(nn.Linear(16, 8).to(torch.bfloat16)) == LinearMap("weight", "bias", False, 16, 8)


def test_conv1d_is_a_transposed_linear_map():
    torch.manual_seed(0)
    assert recognise(Conv1D(8, 16)) == LinearMap("weight", "bias", True, 16, 8)


def test_linear_subclasses_are_probed():
    assert recognise(PlainLinearSubclass(16, 8)) == LinearMap("weight", "bias", False, 16, 8)
    assert recognise(DoubledLinear(16, 8)) is None


def test_meta_modules_are_recognised_without_running_them_on_the_meta_device():
    # torch's Linear is known by its class; a norm is probed on an empty CPU copy (values are random anyway).
    assert recognise(nn.Linear(16, 8, device="meta")) == LinearMap("weight", "bias", False, 16, 8)
    assert recognise(nn.LayerNorm(16, device="meta")) == Norm("layer", (16,), 1e-5, "weight", "bias", 0.0)
    assert recognise(PlainLinearSubclass(16, 8, device="meta")) is None  # a linear map must run to be known


# ---------------------------------------------------------------------------------------------
# _structure.record
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.q(h) * torch.sigmoid(self.k(h))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.q(h) * torch.sigmoid(h)  # its own torch code reads h too


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.post, self.attn = nn.LayerNorm(8), Attention()
        self.pre, self.gated = nn.LayerNorm(8), Gated()
        self.twice = nn.LayerNorm(8)
        self.scale = nn.LayerNorm(8)
        self.last = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        h = self.norm(x)
        assert h.shape[-1] == h.size(-1) == 8 and h.dim() == 3  # metadata reads: no use
        y = self.a(h) + self.b(h)
        p = self.post(y)
        z = p + self.attn(p)  # a residual add, and a container given p
        z = self.gated(self.pre(z))
        z = self.twice(z) + self.twice(2 * z)
        z = z * self.scale.weight  # a parameter used outside its module
        if flag:
            z = self.last(z)
            z = torch.stack([row for row in z])  # iterating over the output
        return z


WATCH = ["norm", "post", "pre", "twice", "scale", "last"]


def test_uses_are_leaf_modules_and_torch_functions():
    torch.manual_seed(0)
    model = Model()
    s = record(model, (torch.randn(2, 3, 8),), {}, WATCH)
    assert s.uses["norm"] == [Use("a", None, ""), Use("b", None, "")], "two Linears; .shape / .size() are no use"
    # A container given the output is looked through: its leaves and its own torch code are the uses.
    assert s.uses["post"] == [Use("attn.q", None, ""), Use("attn.k", None, ""), Use(None, "add", "")]
    assert s.uses["pre"] == [Use("gated.q", None, ""), Use(None, "sigmoid", "gated")]
    modules = dict(model.named_modules())
    assert Use(None, "add", "").describe(modules) == "`add` at the top level"
    assert Use(None, "sigmoid", "gated").describe(modules) == "`sigmoid` in `gated`"
    assert Use("a", None, "").describe(modules) == "module `a` (Linear)"
    assert s.inputs["a"] == s.inputs["b"] and len(s.inputs["a"]) == 1


def test_call_counts_and_first_call_uses():
    model = Model()
    s = record(model, (torch.randn(2, 3, 8),), {}, WATCH)
    assert s.calls["twice"] == 2 and s.calls["norm"] == 1 and s.calls["attn"] == 1 and s.calls[""] == 1
    assert s.uses["twice"] == [Use(None, "add", "")], "uses of the first call's output (`2 * z` reads z, not it)"
    assert "last" not in s.calls and "last" not in s.uses, "not run in this call"


def test_kwargs_and_iteration_over_the_output():
    model = Model()
    s = record(model, (torch.randn(2, 3, 8),), {"flag": True}, WATCH)
    assert s.calls["last"] == 1
    assert s.uses["last"] == [Use(None, "unbind", "")]


def test_parameters_used_outside_their_module():
    model = Model()
    s = record(model, (torch.randn(2, 3, 8),), {}, WATCH)
    assert list(s.foreign_parameter_uses) == ["scale"]
    assert s.foreign_parameter_uses["scale"][0].startswith("`scale.weight` by `mul`")

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(8, 8), nn.Linear(8, 8)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(x))

    assert record(Tied(), (torch.randn(2, 8),), {}, []).foreign_parameter_uses == {}, "tied weights are used by their owners"


def test_record_has_no_side_effects():
    torch.manual_seed(1)
    model = nn.Sequential(nn.LayerNorm(8), nn.Dropout(0.5), nn.Linear(8, 8))
    model[2].eval()
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    s = record(model, (x,), {}, ["0"])
    assert torch.equal(torch.get_rng_state(), rng), "the RNG state is restored"
    assert s.uses["0"] == [Use("1", None, "")]
    assert model.training and model[1].training and not model[2].training, "modes are put back"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()), "hooks are removed"
    assert all(p.grad is None for p in model.parameters())


def test_record_runs_without_gradients():
    seen = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_grad_enabled())
            return x

    record(nn.Sequential(Probe()), (torch.randn(2, requires_grad=True),), {}, [])
    assert seen == [False]


# ---------------------------------------------------------------------------------------------
# Memory-sharing norms with their affine kept
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def library() -> None:
    library_or_skip()


def layer_norm_reference(x, weight, bias, eps, shape=None):
    return F.layer_norm(x, shape or (x.shape[-1],), weight, bias, eps)


def rms_norm_reference(x, weight, bias, eps, offset=0.0):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight + offset)
    return y + bias if bias is not None else y


def storage_ptr(t: torch.Tensor) -> int:
    return abp.memory.storage_key(t)[1]


def check_against(module: nn.Module, reference, x: torch.Tensor, atol: float) -> None:
    """Output and the gradients wrt x and every parameter, against `reference(x)` (plain torch)."""
    x = x.clone().requires_grad_()
    params = [p for p in (module.weight, module.bias) if p is not None]
    y = module(x)
    want = reference(x)
    assert y.dtype == want.dtype and y.shape == want.shape
    torch.testing.assert_close(y, want, rtol=0, atol=atol)
    g = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(y, [x] + params, g)
    expected = torch.autograd.grad(want, [x] + params, g)
    for a, b, what in zip(got, expected, ["x", "weight", "bias"]):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=what)


def randomized(module: nn.Module, seed: int = 0, offset: float = 0.0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if module.weight is not None:
            module.weight.copy_(torch.rand(module.weight.shape, generator=g) + 0.5 - offset)
        if module.bias is not None:
            module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.5)
    return module


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_ms_layer_norm_with_affine_matches_torch(library, dtype, atol):
    ms = randomized(abp.nn.MSLayerNorm(16, elementwise_affine=True)).to(dtype)
    assert set(dict(ms.named_parameters())) == {"weight", "bias"}
    x = torch.randn(3, 5, 16, dtype=dtype) * 2 + 0.5
    check_against(ms, lambda x: layer_norm_reference(x, ms.weight, ms.bias, 1e-5), x, atol)
    nobias = randomized(abp.nn.MSLayerNorm(16, eps=1e-6, elementwise_affine=True, bias=False), seed=1).to(dtype)
    assert nobias.bias is None and list(nobias.state_dict()) == ["weight"]
    check_against(nobias, lambda x: layer_norm_reference(x, nobias.weight, None, 1e-6), x, atol)
    multi = randomized(abp.nn.MSLayerNorm((3, 8), elementwise_affine=True), seed=2).to(dtype)
    x3 = torch.randn(4, 3, 8, dtype=dtype)
    check_against(multi, lambda x: layer_norm_reference(x, multi.weight, multi.bias, 1e-5, (3, 8)), x3, atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_ms_rms_norm_with_weight_offset_matches_gemma(library, dtype, atol):
    ms = abp.nn.MSRMSNorm(16, elementwise_affine=True, weight_offset=1.0).to(dtype)
    assert torch.equal(ms.weight, torch.zeros(16, dtype=dtype)), "gamma = 1 + weight starts at ones"
    assert ms.bias is None and ms.weight_offset == 1.0 and "weight_offset=1.0" in repr(ms)
    randomized(ms, offset=1.0)  # weight in [-0.5, 0.5]: gamma in [0.5, 1.5]
    x = torch.randn(3, 5, 16, dtype=dtype)
    check_against(ms, lambda x: rms_norm_reference(x, ms.weight, None, 1e-6, offset=1.0), x, atol)
    if dtype == torch.float32:  # Gemma's own module (it computes in float32)
        gemma = GemmaRMSNorm(16)
        with torch.no_grad():
            gemma.weight.copy_(ms.weight)
        xg = x.clone().requires_grad_()
        y, want = ms(xg), gemma(xg)
        torch.testing.assert_close(y, want, rtol=0, atol=atol)
        g = torch.randn_like(y)
        torch.testing.assert_close(torch.autograd.grad(y, (xg, ms.weight), g),
                                   torch.autograd.grad(want, (xg, gemma.weight), g), rtol=0, atol=atol)
    with_bias = randomized(abp.nn.MSRMSNorm(16, elementwise_affine=True, bias=True), seed=4).to(dtype)
    check_against(with_bias, lambda x: rms_norm_reference(x, with_bias.weight, with_bias.bias, 1e-6), x, atol)


def test_functional_affine_norms(library):
    x = torch.randn(4, 16, dtype=torch.float64)
    w, b = torch.rand(16, dtype=torch.float64) + 0.5, torch.randn(16, dtype=torch.float64)
    torch.testing.assert_close(abp.functional.ms_layer_norm(x, 16, weight=w, bias=b), F.layer_norm(x, (16,), w, b), rtol=0, atol=1e-10)
    torch.testing.assert_close(abp.functional.ms_rms_norm(x, 16, 1e-6, weight=w - 1, weight_offset=1.0),
                               rms_norm_reference(x, w, None, 1e-6), rtol=0, atol=1e-10)
    torch.testing.assert_close(abp.functional.ms_layer_norm(x, 16, bias=b), F.layer_norm(x, (16,), None, b), rtol=0, atol=1e-10)


def test_affine_norm_saves_its_output_and_one_value_per_row(library):
    ms = randomized(abp.nn.MSLayerNorm(32, elementwise_affine=True))
    x = torch.randn(6, 32, requires_grad=True)
    with abp.memory.SavedTensorsCounter() as counter:
        y = ms(x)
    saved = {(s.shape, s.dtype) for s in counter.tensors}
    assert ((6, 32), torch.float32) in saved and ((6,), torch.float32) in saved
    assert all(s.storage_ptr != storage_ptr(x) for s in counter.tensors), "the input is not saved"
    assert any(s.storage_ptr == storage_ptr(y) for s in counter.tensors), "the output is"


class Autocast(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


def test_autocast_bf16_output_is_what_the_next_linear_saves(library):
    torch.manual_seed(5)
    ms = randomized(abp.nn.MSLayerNorm(32, elementwise_affine=True))
    torch_ln = nn.LayerNorm(32)
    torch_ln.load_state_dict(ms.state_dict())
    linear = nn.Linear(32, 16)
    x = torch.randn(4, 8, 32, requires_grad=True)
    with abp.memory.SavedTensorsCounter() as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ms(x)
            z = linear(y)
    assert y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16
    y_storage = storage_ptr(y)
    assert sum(s.storage_ptr == y_storage for s in counter.tensors) >= 2, "saved by the norm and by the Linear: one storage"
    assert not any(s.dtype == torch.float32 and math.prod(s.shape) == 4 * 8 * 32 for s in counter.tensors), \
        "no float32 rows (the input, or a float32 output) are saved"
    z.float().sum().backward()
    assert x.grad.dtype == torch.float32 and ms.weight.grad.dtype == torch.float32 and ms.bias.grad.dtype == torch.float32
    # Against torch's LayerNorm under the same autocast (bf16 output rounding: loose).
    x2 = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z2 = linear(torch_ln(x2))
    z2.float().sum().backward()
    torch.testing.assert_close(z.float(), z2.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0.05, atol=0.05)
    report = abp.memory.report(Autocast(nn.Sequential(ms, linear)), x, baseline=Autocast(nn.Sequential(torch_ln, linear)))
    assert report.total_bytes < report.baseline_total_bytes
    rows = 4 * 8
    assert report.per_module["inner.0"] == rows * 32 * 2 + rows * 4  # its bf16 output + 1/sigma per row


def test_zero_gamma_gradient_of_gamma_reads_zero(library):
    """Documented (abp._affine_norm): where gamma is 0, n is not recoverable and dgamma reads 0 there."""
    ms = randomized(abp.nn.MSLayerNorm(8, elementwise_affine=True)).double()
    with torch.no_grad():
        ms.weight[2] = 0.0
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 8, dtype=torch.float64)
    with torch.no_grad():
        ms(x)  # no training call: nothing read, nothing said
    with pytest.warns(RuntimeWarning, match=r"MSLayerNorm: gamma \(weight \+ weight_offset\) is 0 at 1 of 8 features "
                                            r"\(flat indices \[2\]\).*a weight initialised at 0 never leaves it"):
        y = ms(x)  # the first training call says so, once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ms(x)
    torch.testing.assert_close(y, F.layer_norm(x, (8,), ms.weight, ms.bias), rtol=0, atol=1e-10)
    dx, dw, db = torch.autograd.grad(y, (x, ms.weight, ms.bias), g)
    rx, rw, rb = torch.autograd.grad(F.layer_norm(x, (8,), ms.weight, ms.bias), (x, ms.weight, ms.bias), g)
    assert dw[2] == 0 and rw[2] != 0
    others = [i for i in range(8) if i != 2]
    torch.testing.assert_close(dw[others], rw[others], rtol=0, atol=1e-10)
    torch.testing.assert_close(db, rb, rtol=0, atol=1e-10)
    torch.testing.assert_close(dx[:, others], rx[:, others], rtol=0, atol=1e-10)




def test_affine_norm_modules_are_drop_ins(library):
    ms = abp.nn.MSLayerNorm(16, elementwise_affine=True)
    assert torch.equal(ms.weight, torch.ones(16)) and torch.equal(ms.bias, torch.zeros(16))
    assert list(ms.state_dict()) == list(nn.LayerNorm(16).state_dict())
    nn.LayerNorm(16).load_state_dict(ms.state_dict())
    plain = abp.nn.MSLayerNorm(16)
    assert plain.weight is None and plain.bias is None and list(plain.parameters()) == []
    rms = abp.nn.MSRMSNorm(16, elementwise_affine=True)
    assert rms.bias is None and list(rms.state_dict()) == ["weight"] and rms.eps == 1e-6
    assert abp.nn.MSLayerNorm(16, elementwise_affine=True, dtype=torch.float64).weight.dtype == torch.float64


@pytest.mark.parametrize("cls", ["MSLayerNorm", "MSRMSNorm"])
@pytest.mark.parametrize("kwargs,error,match", [
    ({"weight_offset": 1.0}, ValueError, "weight_offset: needs elementwise_affine=True"),
    ({"elementwise_affine": "yes"}, TypeError, "elementwise_affine: expected True or False, got 'yes'"),
    ({"elementwise_affine": 1}, TypeError, "elementwise_affine: expected True or False, got 1"),
    ({"elementwise_affine": True, "bias": 1}, TypeError, "bias: expected True or False, got 1"),
    ({"elementwise_affine": True, "weight_offset": "1"}, TypeError, "weight_offset: expected a number, got str"),
    ({"eps": 0}, ValueError, "eps: expected a positive"),
])
def test_affine_norm_argument_errors(library, cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(abp.nn, cls)(8, **kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"weight": torch.ones(7)}, ValueError, "weight: expected shape \\(8,\\) \\(normalized_shape\\), got \\(7,\\)"),
    ({"bias": torch.ones(8, 1)}, ValueError, "bias: expected shape \\(8,\\)"),
    ({"weight_offset": 1.0}, ValueError, "weight_offset: needs a weight"),
    ({"weight": torch.ones(8, dtype=torch.int32)}, TypeError, "weight: expected dtype"),
    ({"weight": [1.0] * 8}, TypeError, "weight: expected a torch.Tensor, got list"),
])
def test_functional_affine_argument_errors(library, kwargs, error, match):
    with pytest.raises(error, match=match):
        abp.functional.ms_layer_norm(torch.randn(3, 8), 8, **kwargs)


def test_embeddings_and_wide_parameters_are_not_probed_as_norms():
    from abp._recognise import _may_be_norm

    embedding = nn.Embedding(1000, 64)
    assert not _may_be_norm(embedding, dict(embedding.named_parameters()))
    assert recognise(embedding) is None
    two_d = nn.LayerNorm((4, 16))
    assert _may_be_norm(two_d, dict(two_d.named_parameters()))  # its declared normalized_shape


def test_a_bias_free_linear_subclass_is_recognised_from_a_few_output_features():
    class NoBias(nn.Linear):
        pass

    assert recognise(NoBias(64, 300, bias=False)) == LinearMap("weight", None, False, 64, 300)
