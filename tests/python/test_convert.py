"""abp.convert and abp.memory.report on small models written in plain torch.

Default mode (``fold=False``): every norm the probe recognises becomes a memory-sharing norm that
keeps the SAME Parameter objects (``elementwise_affine=True``); the converted model computes the
same function and the same input and parameter gradients (float64: 1e-10, float32: 1e-5), its
state_dict has the original's keys and loads into the original, and what it saves drops by the
norm inputs (and LayerNorm's mean). ``fold=True`` runs one example call, folds gamma and beta into
the linear maps that alone read a norm's output (gradients follow the fold's chain rule), and says
"not folded: <reason>" where it cannot, keeping the affine instead. Activations are checked
against abp's modules applied directly (their derivative is the defined approximation, not
torch's exact one). Refusals leave the model unchanged and say why.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import abp
from abp_reference import library_or_skip
from norm_lookalikes import BertLayerNorm, GemmaRMSNorm


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.q, self.k, self.v = nn.Linear(d, d, bias=bias), nn.Linear(d, d, bias=bias), nn.Linear(d, d, bias=bias)
        self.out = nn.Linear(d, d, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d, dh = h.shape[0], h.shape[1], self.d, self.d // self.heads
        split = lambda z: z.reshape(b, t, self.heads, dh).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
        return self.out((a @ v).transpose(1, 2).reshape(b, t, d))


class PreLNBlock(nn.Module):
    """ViT / BERT-pre-LN: x + attn(norm1(x)); x + fc2(gelu(fc1(norm2(x))))."""

    def __init__(self, d: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.norm2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self, d: int = 32, depth: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[PreLNBlock(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class InlineAttentionBlock(nn.Module):
    """A pre-LN block whose q, k, v are its own children: norm1's output goes to three Linears."""

    def __init__(self, d: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # unpacking a shape: fine for abp, not for torch.fx
        h = self.norm1(x)
        split = lambda z: z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.out((a @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class PostLNBlock(nn.Module):
    """BERT (post-LN): norm1(x + attn(x)); norm2(h + fc2(gelu(fc1(h)))). Norm outputs feed residual adds."""

    def __init__(self, d: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.attn, self.norm1 = Attention(d, heads), nn.LayerNorm(d)
        self.fc1, self.act, self.fc2, self.norm2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x + self.attn(x))
        return self.norm2(h + self.fc2(self.act(self.fc1(h))))


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm, as HF writes it (float32 inside)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32) if dtype != torch.float64 else x
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


class LlamaBlock(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 48, vocab: int = 11) -> None:
        super().__init__()
        self.input_layernorm, self.attn = RMSNorm(d), Attention(d, 4, bias=False)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down, self.act = nn.Linear(hidden, d, bias=False), nn.SiLU()
        self.final_norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        x = x + self.down(self.act(self.gate(h)) * self.up(h))
        return self.lm_head(self.final_norm(x))


class Gemma(nn.Module):
    def __init__(self, act: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.norm, self.q = GemmaRMSNorm(16), nn.Linear(16, 16)
        self.act = act if act is not None else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.q(self.norm(x)))


class EpsRMSNorm(nn.Module):
    """An RMSNorm look-alike that names its epsilon `eps` and computes in the input dtype."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Conv1D(nn.Module):
    """transformers' Conv1D: y = x @ W + b with W stored (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class GPT2MLP(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 32, act: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(hidden, d), Conv1D(d, hidden)
        self.act = act if act is not None else nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, act: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.ln_2, self.mlp = nn.LayerNorm(16), GPT2MLP(act=act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln_2(x))


NORM_TYPES = (nn.LayerNorm, RMSNorm, EpsRMSNorm)


def randomize_norms(model: nn.Module, seed: int = 0) -> None:
    """Affine parameters away from their initial ones and zeros (which would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GemmaRMSNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) - 0.5)  # gamma = 1 + w in [0.5, 1.5]
            elif isinstance(m, BertLayerNorm):
                m.gamma.copy_(torch.rand(m.gamma.shape, generator=g) + 0.5)
                m.beta.copy_(torch.randn(m.beta.shape, generator=g) * 0.3)
            elif isinstance(m, NORM_TYPES) and getattr(m, "weight", None) is not None:
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.3)


def make(cls: Callable[[], nn.Module], dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    model = cls().to(dtype)
    randomize_norms(model)
    return model


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def grads(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """(output, input gradient, parameter gradients by name) for a fixed, non-uniform loss."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_training_step(reference: nn.Module, converted: nn.Module, x: torch.Tensor, atol: float) -> None:
    """Same output, input gradient and parameter gradients (by name)."""
    out0, dx0, g0 = grads(reference, x)
    out1, dx1, g1 = grads(converted, x)
    torch.testing.assert_close(out1, out0, rtol=0, atol=atol)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=atol)
    assert set(g1) == set(g0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=atol, msg=name)


def by_action(changes: List[abp.Change], action: str) -> Dict[str, str]:
    return {c.module: c.detail for c in changes if c.action == action}


def folds_of(changes: List[abp.Change]) -> Dict[str, List[str]]:
    """norm -> the linear layers its affine parameters were folded into, from the change list."""
    folds: Dict[str, List[str]] = {}
    for c in changes:
        if c.action == "folded":
            folds.setdefault(c.detail.rsplit("`", 2)[1], []).append(c.module)
    return folds


def assert_gradients_follow_the_fold(original: nn.Module, g0: Dict[str, torch.Tensor], g1: Dict[str, torch.Tensor],
                                     folds: Dict[str, List[str]], atol: float = 1e-10) -> None:
    """Every gradient of the original model, recovered exactly from the converted model's.

    A consumer of z = gamma * xhat + beta computes W z + b = W' xhat + b' (W' = W diag(gamma),
    b' = b + W beta), so with G its output gradient: dW = G z^T = dW' diag(gamma) + db' beta^T,
    db = db', dgamma = sum over consumers of column sums of dW' * W, dbeta = sum of W^T db'.
    Parameters the fold did not touch (norms whose affine was kept included) get identical gradients.
    """
    close = lambda a, b, what: torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=what)  # noqa: E731
    checked = set()
    for norm_name, consumers in folds.items():
        norm = original.get_submodule(norm_name)
        gamma = norm.weight.detach()
        beta = norm.bias.detach() if getattr(norm, "bias", None) is not None else None
        dgamma, dbeta = torch.zeros_like(gamma), torch.zeros_like(gamma)
        for c in consumers:
            w = original.get_submodule(c).weight.detach()
            dw1, db1 = g1[f"{c}.weight"], g1.get(f"{c}.bias")
            assert beta is None or db1 is not None, f"{c}: beta was folded but the consumer has no bias"
            close(dw1 * gamma + (torch.outer(db1, beta) if beta is not None else 0), g0[f"{c}.weight"], f"{c}.weight")
            if f"{c}.bias" in g0:
                close(db1, g0[f"{c}.bias"], f"{c}.bias")
            dgamma += (dw1 * w).sum(0)
            if beta is not None:
                dbeta += w.t() @ db1
            checked |= {f"{c}.weight", f"{c}.bias"}
        close(dgamma, g0[f"{norm_name}.weight"], f"{norm_name}.weight")
        checked.add(f"{norm_name}.weight")
        if beta is not None:
            close(dbeta, g0[f"{norm_name}.bias"], f"{norm_name}.bias")
            checked.add(f"{norm_name}.bias")
        assert not any(n.startswith(f"{norm_name}.") for n in g1), "a folded norm has no parameters"
    for name, g in g0.items():
        if name not in checked:
            close(g1[name], g, name)


def with_abp_activations(model: nn.Module, make_replacement: Callable[[nn.Module], Optional[nn.Module]]) -> nn.Module:
    """A copy of `model` whose activations are abp modules put there by hand (no abp.convert)."""
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        new = make_replacement(module)
        if new is not None:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


def require_tanh_gelu() -> None:
    """Skips unless abp has the tanh-form GELU operators (added by a separate change)."""
    try:
        abp.nn.ReGELU2(approximate="tanh")  # type: ignore[call-arg]
        abp.nn.GELU(approximate="tanh", bits=3)
    except (TypeError, ValueError, abp.AbpError) as e:
        pytest.skip(f"abp.nn.ReGELU2(approximate='tanh') / abp.nn.GELU(approximate='tanh') not available: {e}")


# ---------------------------------------------------------------------------------------------
# Default mode: norms keep their affine (same Parameters), same function and gradients
# ---------------------------------------------------------------------------------------------


def test_vit_default_mode_keeps_the_affine_and_the_parameters():
    model = make(ViT)
    reference = copy.deepcopy(model)
    norms = ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
    weights = {n: model.get_submodule(n).weight for n in norms}
    biases = {n: model.get_submodule(n).bias for n in norms}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    converted, changes = abp.convert(model, gelu=None, inplace=True)
    assert converted is model
    replaced = by_action(changes, "replaced")
    assert set(replaced) == set(norms) and not by_action(changes, "refused") and not by_action(changes, "folded")
    for n in norms:
        ms = converted.get_submodule(n)
        assert type(ms) is abp.nn.MSLayerNorm and ms.elementwise_affine and ms.eps == 1e-5
        assert ms.weight is weights[n] and ms.bias is biases[n], "the same Parameter objects"
        assert replaced[n].startswith("LayerNorm -> MSLayerNorm (LayerNorm, eps=1e-05, affine kept: backward recovers the "
                                      "normalised value from the output); keeps its dtype under autocast")
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in converted.parameters()}
    assert list(converted.state_dict()) == list(reference.state_dict())
    reference_copy = copy.deepcopy(reference)
    reference_copy.load_state_dict(converted.state_dict())  # strict: same keys and shapes
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    assert_same_training_step(reference, converted, x, atol=1e-10)

    # A training step through the converted model moves the shared parameters like the original's.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for m, opt in ((reference, ref_opt), (converted, optimizer)):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    for (n0, p0), (n1, p1) in zip(reference.named_parameters(), converted.named_parameters()):
        assert n0 == n1
        torch.testing.assert_close(p1, p0, rtol=0, atol=1e-12, msg=n0)


def test_vit_default_mode_float32_gradients_match_torch():
    model = make(ViT, torch.float32)
    converted, _ = abp.convert(model, gelu=None)
    assert isinstance(model.blocks[0].norm1, nn.LayerNorm), "inplace=False must not touch the original"
    assert_same_training_step(model, converted, torch.randn(3, 7, 32), atol=1e-5)


def test_llama_default_mode_keeps_rms_weights():
    model = make(LlamaBlock)
    converted, changes = abp.convert(model, silu=None)
    for n in ("input_layernorm", "post_attention_layernorm", "final_norm"):
        ms = converted.get_submodule(n)
        assert type(ms) is abp.nn.MSRMSNorm and ms.eps == 1e-6 and ms.normalized_shape == (32,)
        assert ms.elementwise_affine and ms.bias is None and ms.weight_offset == 0.0
        assert "RMSNorm -> MSRMSNorm (RMSNorm, eps=1e-06, affine kept" in by_action(changes, "replaced")[n]
    assert list(converted.state_dict()) == list(model.state_dict())
    assert converted.lm_head.bias is None
    assert_same_training_step(model, converted, torch.randn(2, 5, 32, dtype=torch.float64), atol=1e-10)
    model32 = make(LlamaBlock, torch.float32)
    assert_same_training_step(model32, abp.convert(model32, silu=None)[0], torch.randn(2, 5, 32), atol=1e-5)


def test_post_ln_model_converts_with_the_affine_kept():
    """BERT's norms feed residual adds: no fold is possible, and none is needed."""
    model = make(PostLNBlock)
    converted, changes = abp.convert(model, gelu=None)
    assert set(by_action(changes, "replaced")) == {"norm1", "norm2"} and not by_action(changes, "refused")
    assert all("affine kept" in d for d in by_action(changes, "replaced").values())
    assert_same_training_step(model, converted, torch.randn(2, 6, 32, dtype=torch.float64), atol=1e-10)
    model32 = make(PostLNBlock, torch.float32)
    converted32, _ = abp.convert(model32, gelu=None)
    assert_same_training_step(model32, converted32, torch.randn(2, 6, 32), atol=1e-5)
    x = torch.randn(3, 7, 32, requires_grad=True)
    report = abp.memory.report(converted32, x, baseline=model32)
    rows = 3 * 7
    # norm1's input is gone (fc1 saves its output, which the norm saves as its own); mean is gone.
    assert report.baseline_per_module["norm1"] == rows * 32 * 4 + 2 * rows * 4
    assert report.per_module["norm1"] == rows * 32 * 4 + rows * 4
    assert report.per_module["fc1"] == 0 and report.baseline_per_module["fc1"] == rows * 32 * 4
    assert report.baseline_total_bytes - report.total_bytes == (rows * 32 * 4 + rows * 4) + rows * 4


def test_gemma_norm_default_mode_keeps_one_plus_weight():
    model = make(Gemma, torch.float32)
    converted, changes = abp.convert(model, silu=None)
    ms = converted.norm
    assert type(ms) is abp.nn.MSRMSNorm and ms.weight_offset == 1.0 and ms.eps == 1e-6 and ms.bias is None
    assert "GemmaRMSNorm -> MSRMSNorm (RMSNorm (1 + weight), eps=1e-06, affine kept" in by_action(changes, "replaced")["norm"]
    torch.testing.assert_close(ms.weight, model.norm.weight, rtol=0, atol=0)
    assert list(converted.state_dict()) == list(model.state_dict())
    assert_same_training_step(model, converted, torch.randn(3, 5, 16), atol=1e-5)


def test_renamed_norm_parameters_are_reported():
    """gamma / beta become the MS norm's weight / bias; the change says so (state_dict keys follow)."""
    model = nn.Sequential(BertLayerNorm(16), nn.Linear(16, 4)).double()
    randomize_norms(model)
    converted, changes = abp.convert(model)
    detail = by_action(changes, "replaced")["0"]
    assert "BertLayerNorm -> MSLayerNorm (LayerNorm, eps=1e-12" in detail
    assert "parameters renamed gamma -> weight, beta -> bias" in detail
    assert converted[0].eps == pytest.approx(1e-12, rel=1e-6), "estimated from the output: no eps attribute"
    assert sorted(converted.state_dict()) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    x = torch.randn(5, 16, dtype=torch.float64)
    out0, dx0, g0 = grads(model, x)
    out1, dx1, g1 = grads(converted, x)
    torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=1e-10)
    torch.testing.assert_close(g1["0.weight"], g0["0.gamma"], rtol=0, atol=1e-10)
    torch.testing.assert_close(g1["0.bias"], g0["0.beta"], rtol=0, atol=1e-10)


def test_rms_norm_look_alike_with_eps_attribute():
    model = nn.Sequential(EpsRMSNorm(16, eps=1e-4), nn.Linear(16, 8)).double()
    randomize_norms(model)
    converted, changes = abp.convert(model)
    assert isinstance(converted[0], abp.nn.MSRMSNorm) and converted[0].eps == 1e-4
    assert_same_training_step(model, converted, torch.randn(3, 16, dtype=torch.float64), atol=1e-10)


class StandInTorchRMSNorm(nn.Module):
    """torch.nn.RMSNorm's documented interface and function, for torch < 2.4 (eps=None: the epsilon of
    the dtype it computes in, float32's for half-precision rows)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True) -> None:
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        eps = self.eps if self.eps is not None else torch.finfo(compute).eps
        dims = tuple(range(-len(self.normalized_shape), 0))
        y = (x.to(compute) * torch.rsqrt(x.to(compute).pow(2).mean(dims, keepdim=True) + eps)).to(x.dtype)
        return y * self.weight if self.weight is not None else y


@pytest.fixture
def torch_rms_norm(monkeypatch):
    """torch.nn.RMSNorm where torch has it (>= 2.4), else the stand-in installed as nn.RMSNorm."""
    if not hasattr(nn, "RMSNorm"):
        monkeypatch.setattr(nn, "RMSNorm", StandInTorchRMSNorm, raising=False)
    return nn.RMSNorm


@pytest.mark.parametrize("eps", [
    None,
    1e-6,
])
def test_torch_rms_norm(torch_rms_norm, eps):
    model = nn.Sequential(torch_rms_norm(16, eps=eps), nn.Linear(16, 8))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 16)
    converted, changes = abp.convert(model)
    assert isinstance(converted[0], abp.nn.MSRMSNorm) and converted[0].elementwise_affine
    assert converted[0].eps == (torch.finfo(torch.float32).eps if eps is None else eps)
    assert not by_action(changes, "refused")
    assert_same_training_step(model, converted, x, atol=1e-5)
    folded, changes = abp.convert(model, fold=True, example_inputs=x)
    assert by_action(changes, "folded") == {"1": "folded gamma in float64 from `0`"}
    assert isinstance(folded[0], abp.nn.MSRMSNorm) and folded[0].weight is None
    torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_rms_norm_without_eps_in_half_precision_takes_float32s_epsilon(torch_rms_norm, dtype):
    # Half-precision rows are normalised in float32, with float32's epsilon, not their own (bf16's
    # 0.0078 would change every output of rows of small values).
    model = nn.Sequential(torch_rms_norm(16, eps=None), nn.Linear(16, 8)).to(dtype)
    converted, _ = abp.convert(model)
    assert converted[0].eps == torch.finfo(torch.float32).eps
    x = (0.05 * torch.randn(3, 16)).to(dtype)
    torch.testing.assert_close(converted[0](x), model[0](x), rtol=0, atol=torch.finfo(dtype).eps * 4)


def test_norm_without_affine_is_replaced(torch_rms_norm):
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 8), torch_rms_norm(8, elementwise_affine=False))
    converted, changes = abp.convert(model)
    assert isinstance(converted[0], abp.nn.MSLayerNorm) and isinstance(converted[2], abp.nn.MSRMSNorm)
    x = torch.randn(3, 8)
    torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Saved bytes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fold", [False, True])
def test_saved_bytes_drop_by_the_norm_inputs_and_means(fold):
    model = make(ViT, torch.float32)
    # Inputs that require grad, as inside a network (else the first norm saves nothing at all).
    x = torch.randn(3, 7, 32, requires_grad=True)
    converted, _ = abp.convert(model, gelu=None, fold=fold, example_inputs=x if fold else None)
    report = abp.memory.report(converted, x, baseline=model)
    rows = 3 * 7
    # Each of the 5 LayerNorms saved its input (rows x 32 fp32), mean and rstd (rows fp32 each);
    # each MS norm saves its output (which the next Linear saves anyway) and one fp32 per row.
    per_norm = rows * 32 * 4 + 2 * rows * 4 - rows * 4
    assert report.baseline_total_bytes - report.total_bytes == 5 * per_norm
    for norm, consumer in (("blocks.0.norm1", "blocks.0.attn.q"), ("blocks.0.norm2", "blocks.0.fc1"), ("norm", "head")):
        assert report.baseline_per_module[norm] == rows * 32 * 4 + 2 * rows * 4  # input, mean, rstd
        assert report.per_module[norm] == rows * 32 * 4 + rows * 4  # its output + 1/sigma
        assert report.per_module[consumer] == 0, "the consumer saves the norm's own output"
    assert sum(report.per_module.values()) == report.total_bytes
    assert "blocks.0.norm1" in str(report) and "baseline" in str(report)


def test_saved_bytes_of_rms_norms_are_their_output_and_one_value_per_row():
    model = make(LlamaBlock, torch.float32)
    converted, _ = abp.convert(model, silu=None)
    x = torch.randn(2, 5, 32, requires_grad=True)
    report = abp.memory.report(converted, x, baseline=model)
    rows = 2 * 5
    for norm, consumers in (("input_layernorm", ["attn.q", "attn.k", "attn.v"]),
                            ("post_attention_layernorm", ["gate", "up"]), ("final_norm", ["lm_head"])):
        assert report.per_module[norm] == rows * 32 * 4 + rows * 4  # the output (shared) + r per row
        # What the baseline kept for this norm: its own saves plus its output, first saved by a consumer.
        baseline = report.baseline_per_module[norm] + sum(report.baseline_per_module[c] for c in consumers)
        assert baseline > report.per_module[norm]
        assert all(report.per_module[c] == 0 for c in consumers), "the consumers save the norm's own output"
    changed = {"input_layernorm", "post_attention_layernorm", "final_norm", "attn.q", "gate", "lm_head"}
    for name, size in report.baseline_per_module.items():
        if name not in changed:
            assert report.per_module[name] == size, name


# ---------------------------------------------------------------------------------------------
# fold=True
# ---------------------------------------------------------------------------------------------


def test_fold_needs_example_inputs():
    model = make(ViT)
    with pytest.raises(ValueError, match="fold=True: pass example_inputs=.*example_kwargs="):
        abp.convert(model, fold=True)
    # Nothing to fold: no example call needed.
    abp.convert(model, fold=True, norms=False, gelu=None)
    abp.convert(nn.Sequential(nn.Linear(4, 4), nn.GELU()), fold=True)


def assert_fold_keeps_the_function(model: nn.Module, converted: nn.Module, changes: List[abp.Change], x: torch.Tensor) -> None:
    """Same output and input gradient (fp64, 1e-10); parameter gradients as the fold's chain rule says."""
    out0, dx0, g0 = grads(model, x)
    out1, dx1, g1 = grads(converted, x)
    torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=1e-10)
    assert_gradients_follow_the_fold(model, g0, g1, folds_of(changes))


def test_vit_fold_folds_every_pre_ln_norm_and_keeps_the_function():
    model = make(ViT)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    converted, changes = abp.convert(model, gelu=None, fold=True, example_inputs=x)
    norms = ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
    assert set(by_action(changes, "replaced")) == set(norms) and not by_action(changes, "refused")
    # The Attention module given norm1's output is looked through: its q, k, v read it.
    assert folds_of(changes) == {**{f"blocks.{i}.norm1": [f"blocks.{i}.attn.{p}" for p in "qkv"] for i in (0, 1)},
                                 **{f"blocks.{i}.norm2": [f"blocks.{i}.fc1"] for i in (0, 1)}, "norm": ["head"]}
    assert all(d == f"folded gamma and beta in float64 from `{d.rsplit('`', 2)[1]}`" for d in by_action(changes, "folded").values())
    replaced = by_action(changes, "replaced")
    assert replaced["norm"] == "LayerNorm -> MSLayerNorm (LayerNorm, eps=1e-05, affine folded into head)"
    assert replaced["blocks.0.norm1"] == ("LayerNorm -> MSLayerNorm (LayerNorm, eps=1e-05, affine folded into blocks.0.attn.q, "
                                          "blocks.0.attn.k, blocks.0.attn.v)")
    for n in norms:
        ms = converted.get_submodule(n)
        assert type(ms) is abp.nn.MSLayerNorm and not ms.elementwise_affine and ms.weight is None and ms.bias is None
    assert isinstance(model.blocks[0].norm2, nn.LayerNorm), "inplace=False must not touch the original"
    for probe in (x, torch.randn(3, 4, 32, dtype=torch.float64)):  # not only the example call
        assert_fold_keeps_the_function(model, converted, changes, probe)


class NormIntoProjections(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.norm, self.q, self.head = nn.LayerNorm(16), nn.Linear(16, 16, bias=bias), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.q(self.norm(x))))


@pytest.mark.parametrize("bias", [True, False])
def test_a_folded_checkpoint_loads_into_the_original_class_as_documented(bias):
    """docs/training.md, "Deploy without abp": with strict=False the original class loads a folded
    checkpoint, its norms at γ = 1 and β = 0: the same function, unless the fold gave a bias-less
    layer a bias, which the original class has no place for (a trial found GPT-J's and Swin's
    projections 24 to 51 % off; the docs claimed the same function)."""
    torch.manual_seed(2)
    model = NormIntoProjections(bias).double()
    randomize_norms(model)
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    converted, changes = abp.convert(model, fold=True, example_inputs=x)
    assert folds_of(changes) == {"norm": ["q"]}
    assert ("bias added for beta: a new Parameter" in by_action(changes, "folded")["q"]) == (not bias)
    plain = NormIntoProjections(bias).double()
    missing, unexpected = plain.load_state_dict(converted.state_dict(), strict=False)
    assert sorted(missing) == ["norm.bias", "norm.weight"]
    assert unexpected == ([] if bias else ["q.bias"])
    same = torch.allclose(plain(x), converted(x), rtol=0, atol=1e-10)
    assert same == bias


def test_fold_into_several_linears():
    model = make(InlineAttentionBlock)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    converted, changes = abp.convert(model, gelu=None, fold=True, example_inputs=x)
    assert folds_of(changes) == {"norm1": ["q", "k", "v"], "norm2": ["fc1"]}
    assert by_action(changes, "replaced")["norm1"] == "LayerNorm -> MSLayerNorm (LayerNorm, eps=1e-05, affine folded into q, k, v)"
    assert_fold_keeps_the_function(model, converted, changes, x)


def test_llama_fold():
    model = make(LlamaBlock)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    converted, changes = abp.convert(model, silu=None, fold=True, example_inputs=(x,))
    assert folds_of(changes) == {"input_layernorm": ["attn.q", "attn.k", "attn.v"],
                                 "post_attention_layernorm": ["gate", "up"], "final_norm": ["lm_head"]}
    assert all(isinstance(converted.get_submodule(n), abp.nn.MSRMSNorm)
               for n in ("input_layernorm", "post_attention_layernorm", "final_norm"))
    assert converted.input_layernorm.eps == 1e-6 and converted.input_layernorm.normalized_shape == (32,)
    assert all(d == f"folded gamma in float64 from `{d.rsplit('`', 2)[1]}`" for d in by_action(changes, "folded").values())
    assert converted.lm_head.bias is None and converted.gate.bias is None, "RMSNorm has no beta: no bias is added"
    assert_fold_keeps_the_function(model, converted, changes, x)


def test_gemma_fold_uses_one_plus_weight():
    model = make(Gemma)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    converted, changes = abp.convert(model, silu=None, fold=True, example_inputs=x)
    assert folds_of(changes) == {"norm": ["q"]}
    assert by_action(changes, "replaced")["norm"] == "GemmaRMSNorm -> MSRMSNorm (RMSNorm (1 + weight), eps=1e-06, affine folded into q)"
    expected = model.q.weight.detach() * (1 + model.norm.weight.detach())
    torch.testing.assert_close(converted.q.weight.detach(), expected, rtol=0, atol=1e-12)
    # GemmaRMSNorm computes in float32 even for float64 input; the MS norm in float64.
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-6)


def test_fold_into_transformers_conv1d():
    model = make(lambda: GPT2Block(act=nn.SiLU()))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    converted, changes = abp.convert(model, silu=None, fold=True, example_inputs=x)
    assert folds_of(changes) == {"ln_2": ["mlp.c_fc"]}
    assert type(converted.mlp.c_fc) is Conv1D
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)
    # x W + b layout: W' = diag(gamma) W, b' = b + beta W.
    gamma, beta = model.ln_2.weight.detach(), model.ln_2.bias.detach()
    w, b = model.mlp.c_fc.weight.detach(), model.mlp.c_fc.bias.detach()
    torch.testing.assert_close(converted.mlp.c_fc.weight.detach(), gamma[:, None] * w, rtol=0, atol=1e-12)
    torch.testing.assert_close(converted.mlp.c_fc.bias.detach(), b + beta @ w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("breakage", ["beta forgotten", "gamma times 0.9"])
def test_a_broken_fold_fails_the_checks(breakage):
    """Negative controls: a fold with b' = b, or with 0.9 gamma, must fail the output and gradient checks."""
    model = make(InlineAttentionBlock)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    converted, changes = abp.convert(model, gelu=None, fold=True, example_inputs=x)
    with torch.no_grad():
        q = converted.q
        if breakage == "beta forgotten":
            q.bias.copy_(model.q.bias)
        else:
            q.weight.mul_(0.9)
    out0, _, g0 = grads(model, x)
    out1, _, g1 = grads(converted, x)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    with pytest.raises(AssertionError):
        assert_gradients_follow_the_fold(model, g0, g1, folds_of(changes))


class DataDependent(nn.Module):
    """Python control flow on values and iteration over tensors: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        y = self.q(self.norm(x))
        if x.sum() > 0:  # data-dependent branch
            y = y * 2
        rows = [r * (i + 1) for i, r in enumerate(y)]  # iterating over a tensor
        if scale is not None and scale.item() != 1.0:
            rows = [r * scale for r in rows]
        return {"out": torch.stack(rows), "count": torch.tensor(len(x.tolist()))}


def test_untraceable_model_folds_with_example_inputs_and_kwargs():
    torch.manual_seed(4)
    model = DataDependent().double()
    randomize_norms(model)
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)
    for call in ({"example_inputs": x}, {"example_inputs": (x,), "example_kwargs": {"scale": torch.tensor(3.0)}},
                 {"example_kwargs": {"x": x}}):
        converted, changes = abp.convert(model, fold=True, **call)
        assert folds_of(changes) == {"norm": ["q"]}, call
        for probe in (x, -x):  # both branches
            for scale in (None, torch.tensor(0.5, dtype=torch.float64)):
                torch.testing.assert_close(converted(probe, scale)["out"], model(probe, scale)["out"], rtol=0, atol=1e-10)


class NormIntoSlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)[:, 0])


class PostLNResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.norm, self.fc = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.q(x))
        return h + self.fc(h)  # the norm output feeds the residual add: not foldable


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 16)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


class BranchOnNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if h.sum() > 0:  # data-dependent control flow on the norm's output: `sum` reads it
            return self.q(h)
        return self.q(h) * 2


class NormCalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q, self.k = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(self.norm(x)) + self.k(self.norm(2 * x))


class LinearCalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(self.q(self.norm(x)))  # folding into q would also change its second call


class TwoDimNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm((3, 16)), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(self.norm(x))


class LoRALinear(nn.Linear):
    """A Linear subclass with a low-rank branch: its weight alone is not what it applies."""

    def __init__(self, d: int) -> None:
        super().__init__(d, d)
        self.a, self.b = nn.Parameter(torch.randn(2, d) * 0.1), nn.Parameter(torch.randn(d, 2) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.a.t() @ self.b.t()


class IntoLoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), LoRALinear(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(self.norm(x))


class OwnForwardLinear(nn.Linear):
    """Computes x W^T + b like nn.Linear (the probe says linear map), but through its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def into_own_forward_linear() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(16), OwnForwardLinear(16, 16))


def into_pre_hooked_linear() -> nn.Module:
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    model[1].register_forward_pre_hook(_no_op_pre_hook)
    return model


def _no_op_pre_hook(module: nn.Module, args: Tuple[torch.Tensor, ...]) -> None:
    return None


class Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def into_parametrized_linear() -> nn.Module:
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    parametrize.register_parametrization(model[1], "weight", Doubled())
    return model


class ReadsNormWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(self.norm(x)) * self.norm.weight


class ReadsNormWeightDtype(nn.Module):
    """Mamba's block: `self.norm(x.to(self.norm.weight.dtype))`. A folded norm has no weight, so the
    folded model failed at that read."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(self.norm(x.to(dtype=self.norm.weight.dtype)))


class UnusedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.norm(x)
        return self.q(x)


class NormNotRun(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, normalise: bool = False) -> torch.Tensor:
        return self.q(self.norm(x) if normalise else x)


class GatedWrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.q(h) * torch.sigmoid(h)  # its own torch code reads h too


class IntoGatedWrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.block = nn.LayerNorm(16), GatedWrapper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.norm(x))


def encoder_layer() -> nn.Module:
    return nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True))


NOT_FOLDED = [
    (PostLNResidual, "norm", "its output also feeds `add` at the top level, not only linear layers"),
    (NormIntoSlice, "norm", "its output also feeds `__getitem__` at the top level, not only linear layers"),
    (Tied, "norm", "`head` shares its parameters with embed.weight"),
    (BranchOnNorm, "norm", "its output also feeds `sum` at the top level, not only linear layers"),
    (NormCalledTwice, "norm", "it ran 2 times in the example call; folding needs exactly one call"),
    (LinearCalledTwice, "norm", "`q` ran 2 times; folding would change its other calls"),
    (TwoDimNorm, "norm", "`q` has in_features 16; the norm's shape is (3, 16)"),
    (IntoLoRA, "norm", "its output feeds module `q` (LoRALinear), which is not a linear map"),
    (into_own_forward_linear, "0", "Linear `1` (OwnForwardLinear) has its own forward; its weight alone may not be what it applies"),
    (into_pre_hooked_linear, "0", "Linear `1` has forward pre-hooks (e.g. weight_norm)"),
    # A parametrized Linear is a container (of its parametrizations): looked through, F.linear reads the output.
    (into_parametrized_linear, "0", "its output also feeds `linear` in `1`, not only linear layers"),
    (ReadsNormWeight, "norm", "its parameters are also used outside it (`norm.weight` by `mul`"),
    (ReadsNormWeightDtype, "norm", "its parameters are also read outside it (`norm.weight.dtype` read at the top "
                                   "level); folding removes them"),
    (UnusedNorm, "norm", "its output is unused"),
    (NormNotRun, "norm", "it did not run in the example call"),
    (IntoGatedWrapper, "norm", "its output also feeds `sigmoid` in `block`, not only linear layers"),
    (encoder_layer, "0.norm1", "its output also feeds `transpose` in `0.self_attn`, not only linear layers"),
]


@pytest.mark.parametrize("make_model,name,reason", NOT_FOLDED, ids=[f.__name__ for f, _, _ in NOT_FOLDED])
def test_not_folded_norms_keep_their_affine_and_say_why(make_model, name, reason):
    torch.manual_seed(1)
    model = make_model().double()
    randomize_norms(model)
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    converted, changes = abp.convert(model, fold=True, example_inputs=x)
    detail = by_action(changes, "replaced")[name]
    assert f"affine kept: backward recovers the normalised value from the output); not folded: {reason}" in detail, detail
    assert name not in by_action(changes, "refused") and name not in folds_of(changes)
    ms = converted.get_submodule(name)
    assert isinstance(ms, abp.nn.MSLayerNorm) and ms.elementwise_affine
    torch.testing.assert_close(ms.weight, model.get_submodule(name).weight, rtol=0, atol=0)
    assert_fold_keeps_the_function(model, converted, changes, x)
    # Default mode: the same model converts with the affine kept and says nothing about folding.
    default, changes = abp.convert(model)
    assert "not folded" not in by_action(changes, "replaced")[name] and not folds_of(changes)
    assert_same_training_step(model, default, x, atol=1e-10)


class ReturnsNormOutput(nn.Module):
    """The norm's output leaves the model (as HF models return last_hidden_state next to the logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x)
        return self.head(h), h


def test_fold_keeps_a_norm_output_that_the_model_returns():
    torch.manual_seed(13)
    model = ReturnsNormOutput().double()
    randomize_norms(model)
    x = torch.randn(3, 16, dtype=torch.float64)
    converted, changes = abp.convert(model, fold=True, example_inputs=x)
    for got, want in zip(converted(x), model(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_fold_does_not_freeze_a_trainable_norm():
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4, bias=False)).double()
    randomize_norms(model)
    model[1].requires_grad_(False)
    x = torch.randn(3, 8, dtype=torch.float64)
    converted, changes = abp.convert(model, fold=True, example_inputs=x)
    trainable = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
    assert trainable(converted) == trainable(model), changes


def test_bias_added_to_a_consumer_without_one():
    torch.manual_seed(2)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4, bias=False)).double()
    randomize_norms(model)
    x = torch.randn(5, 8, dtype=torch.float64)
    converted, changes = abp.convert(model, fold=True, example_inputs=x)
    assert converted[1].bias is not None and "bias added" in by_action(changes, "folded")["1"]
    assert converted[1].bias.requires_grad and "bias" in dict(converted[1].named_parameters())
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)


def test_fold_keeps_the_linear_and_its_parameter_objects():
    """In place, an optimizer built before the conversion still holds the Linear's parameters."""
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4, bias=False)).double()
    randomize_norms(model)
    linear, weight = model[1], model[1].weight
    converted, _ = abp.convert(model, inplace=True, fold=True, example_inputs=torch.randn(2, 8, dtype=torch.float64))
    assert converted[1] is linear and converted[1].weight is weight


@pytest.mark.parametrize("trainable", [True, False])
def test_a_zero_beta_adds_a_bias_if_beta_could_learn(trainable):
    """A trainable beta that is 0 now (LayerNorm's initial value) still adds a bias (zeros): the
    folded model must be able to learn the shift the original's beta could. A frozen zero beta
    (a frozen model: convert folds only where the norm and the layer train alike) adds none."""
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4, bias=False)).double()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    model.requires_grad_(trainable)
    x = torch.randn(5, 8, dtype=torch.float64)
    converted, changes = abp.convert(model, fold=True, example_inputs=x)
    if trainable:
        assert converted[1].bias is not None and converted[1].bias.requires_grad and not converted[1].bias.any()
        assert "bias added" in by_action(changes, "folded")["1"]
    else:
        assert converted[1].bias is None and "bias added" not in by_action(changes, "folded")["1"]
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)


def test_fold_example_call_is_run_without_side_effects():
    """The example call runs once without gradients; RNG state, modes and parameters stay as they were."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.LayerNorm(8), nn.Dropout(0.5), nn.Linear(8, 4)).double()
    randomize_norms(model)
    model.eval()
    x = torch.randn(5, 8, dtype=torch.float64)
    state = torch.get_rng_state()
    converted, changes = abp.convert(model, fold=True, example_inputs=x)
    assert torch.equal(torch.get_rng_state(), state)
    assert not converted.training and all(not m.training for m in converted.modules())
    assert "its output feeds module `1` (Dropout), which is not a linear map" in by_action(changes, "replaced")["0"]
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)


def test_example_call_errors():
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    with pytest.raises(TypeError, match="example_inputs: expected a tensor or a tuple of positional arguments, got int"):
        abp.convert(model, fold=True, example_inputs=3)
    with pytest.raises(TypeError, match="example_kwargs: expected a dict \\(a mapping\\) of keyword arguments, got list"):
        abp.convert(model, fold=True, example_kwargs=[torch.randn(2, 8)])
    with pytest.raises(RuntimeError, match=r"example_inputs/example_kwargs: the example call failed \(RuntimeError: "):
        abp.convert(model, fold=True, example_inputs=torch.randn(2, 5))


def test_weight_norm_linear_is_not_folded_in_place_and_cannot_be_deep_copied():
    torch.manual_seed(3)
    model = nn.Sequential(nn.LayerNorm(16), nn.utils.weight_norm(nn.Linear(16, 16))).double()
    randomize_norms(model)
    x = torch.randn(4, 16, dtype=torch.float64)
    before = model(x).detach()
    try:
        copyable = True
        copy.deepcopy(model)
    except RuntimeError:
        copyable = False
    if not copyable:  # torch's old-style weight_norm keeps a non-leaf tensor
        with pytest.raises(RuntimeError, match="model: could not be deep-copied .*pass inplace=True"):
            abp.convert(model, fold=True, example_inputs=x)
    weight_v = model[1].weight_v.detach().clone()
    converted, changes = abp.convert(model, inplace=True, fold=True, example_inputs=x)
    detail = by_action(changes, "replaced")["0"]
    # weight_norm recomputes the weight from weight_v / weight_g: a pre-hook, and a use of its parameters outside it.
    assert "not folded: Linear `1` has forward pre-hooks" in detail or "not folded: `1`'s parameters are also used outside it" in detail
    assert isinstance(converted[0], abp.nn.MSLayerNorm) and converted[0].elementwise_affine
    assert torch.equal(converted[1].weight_v, weight_v)
    torch.testing.assert_close(converted(x), before, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Refusals: zero gamma, hooks, parametrizations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_model", [lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)), Gemma])
def test_norm_with_zero_gamma_is_refused(make_model):
    torch.manual_seed(6)
    model = make_model().double()
    randomize_norms(model)
    norm_name = "0" if isinstance(model, nn.Sequential) else "norm"
    norm = model.get_submodule(norm_name)
    with torch.no_grad():
        norm.weight[3] = -1.0 if isinstance(norm, GemmaRMSNorm) else 0.0  # gamma = 0 at feature 3
    x = torch.randn(4, 8 if norm_name == "0" else 16, dtype=torch.float64)
    converted, changes = abp.convert(model, silu=None)
    refused = by_action(changes, "refused")[norm_name]
    assert "not replaced: gamma is 0 at 1 feature(s); backward recovers the normalised value as (y - beta) / gamma" in refused
    assert type(converted.get_submodule(norm_name)) is type(norm)
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=0)


def test_zero_gamma_folds_but_is_refused_where_it_cannot_fold():
    """A fold multiplies by gamma (no division): a zero is fine there, and only there."""
    torch.manual_seed(7)
    foldable = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8)).double()
    not_foldable = PostLNResidual().double()
    for model, name in ((foldable, "0"), (not_foldable, "norm")):
        randomize_norms(model)
        with torch.no_grad():
            model.get_submodule(name).weight[0] = 0.0
    x = torch.randn(3, 16, dtype=torch.float64)
    converted, changes = abp.convert(foldable, fold=True, example_inputs=x)
    assert folds_of(changes) == {"0": ["1"]}
    torch.testing.assert_close(converted(x), foldable(x), rtol=0, atol=1e-10)
    converted, changes = abp.convert(not_foldable, fold=True, example_inputs=x)
    assert "gamma is 0 at 1 feature(s)" in by_action(changes, "refused")["norm"]
    assert isinstance(converted.norm, nn.LayerNorm)


def _forward_hook(module: nn.Module, args: Tuple[torch.Tensor], output: torch.Tensor) -> None:
    module.last_mean = float(output.detach().mean())


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("hook,label", [
    (lambda m: m.register_forward_hook(_forward_hook), "forward hooks"),
    (lambda m: m.register_forward_pre_hook(_no_op_pre_hook), "forward pre-hooks"),
    (lambda m: m.register_full_backward_hook(lambda mod, gi, go: None), "backward hooks"),
])
def test_hooked_norm_is_refused(hook, label, fold):
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)).double()
    randomize_norms(model)
    hook(model[0])
    x = torch.randn(4, 16, dtype=torch.float64)
    converted, changes = abp.convert(model, inplace=True, fold=fold, example_inputs=x if fold else None)
    assert by_action(changes, "refused") == {"0": f"LayerNorm (LayerNorm) not replaced: it has {label}, which the replacement would not carry"}
    assert type(converted[0]) is nn.LayerNorm and not folds_of(changes)
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=0)


def test_hooked_activation_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU())
    model[1].register_forward_hook(lambda m, args, out: None)
    converted, changes = abp.convert(model, inplace=True)
    assert "SiLU not replaced: it has forward hooks" in by_action(changes, "refused")["1"]
    assert type(converted[1]) is nn.SiLU


class Positive(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.abs() + 0.5


def test_parametrized_norm_is_left_unchanged():
    torch.manual_seed(8)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8)).double()
    parametrize.register_parametrization(model[0], "weight", Positive())
    x = torch.randn(3, 16, dtype=torch.float64)
    converted, changes = abp.convert(model)
    assert parametrize.is_parametrized(converted[0]) and isinstance(converted[0], nn.LayerNorm)
    assert "0" not in by_action(changes, "replaced")
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=0)


def test_parametrized_norm_is_reported_as_refused():
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8))
    parametrize.register_parametrization(model[0], "weight", Positive())
    _, changes = abp.convert(model)
    assert not [c for c in changes if ".parametrizations." in c.module], changes
    assert "parametrized" in by_action(changes, "refused")["0"]


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def _abp_for(module: nn.Module) -> Optional[nn.Module]:
    if type(module) is nn.GELU and module.approximate == "none":
        return abp.nn.ReGELU2()
    if type(module) is nn.SiLU:
        return abp.nn.ReSiLU2()
    return None


@pytest.mark.parametrize("cls", [ViT, LlamaBlock])
def test_activation_gradients_are_the_abp_modules_derivative(cls):
    """The converted model's gradients are those of the model with abp's modules put in by hand."""
    model = make(cls, torch.float32)
    converted, changes = abp.convert(model)
    acts = {"blocks.0.act", "blocks.1.act"} if cls is ViT else {"act"}
    replaced = by_action(changes, "replaced")
    assert acts <= set(replaced)
    for a in acts:
        assert type(converted.get_submodule(a)) is (abp.nn.ReGELU2 if cls is ViT else abp.nn.ReSiLU2)
        assert replaced[a] == ("GELU (gelu) -> ReGELU2 (regelu2)" if cls is ViT else "SiLU (silu) -> ReSiLU2 (resilu2)")
    reference = with_abp_activations(model, _abp_for)
    x = torch.randn(2, 6, 32)
    assert_same_training_step(reference, converted, x, atol=1e-5)
    # Negative control: the derivative is the 2-bit one, not torch's exact one.
    _, dx_exact, _ = grads(model, x)
    _, dx_abp, _ = grads(converted, x)
    assert not torch.allclose(dx_abp, dx_exact, rtol=0, atol=1e-4)


def test_fewbit_choices():
    model = make(ViT, torch.float32)
    converted, changes = abp.convert(model, gelu="gelu_b3")
    act = converted.blocks[0].act
    assert type(act) is abp.nn.GELU and act.bits == 3 and act.weight == "normal"
    assert by_action(changes, "replaced")["blocks.0.act"] == "GELU (gelu) -> GELU (gelu_b3)"
    reference = with_abp_activations(model, lambda m: abp.nn.GELU(bits=3) if type(m) is nn.GELU else None)
    assert_same_training_step(reference, converted, torch.randn(2, 6, 32), atol=1e-5)
    llama = make(LlamaBlock, torch.float32)
    converted, _ = abp.convert(llama, silu="silu_b2_uniform")
    assert type(converted.act) is abp.nn.SiLU and converted.act.bits == 2 and converted.act.weight == "uniform"
    reference = with_abp_activations(llama, lambda m: abp.nn.SiLU(bits=2, weight="uniform") if type(m) is nn.SiLU else None)
    assert_same_training_step(reference, converted, torch.randn(2, 6, 32), atol=1e-5)


class ConvNormActChain(nn.Module):
    """`depth` Conv-norm-activation layers with no residual path (a CNN stem), then a pooled
    Linear-SiLU head whose activation reads a Linear's output."""

    def __init__(self, norm: Optional[Callable[[int], nn.Module]], act: Callable[[], nn.Module], depth: int = 12,
                 width: int = 8) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Conv2d(width, width, 3, padding=1)] + ([norm(width)] if norm is not None else []) + [act()]
        self.body = nn.Sequential(*layers)
        self.head, self.head_act = nn.Linear(width, width), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head_act(self.head(self.body(x).mean((2, 3))))


class NormWithActivation(nn.BatchNorm2d):
    """A BatchNorm that applies its activation itself, as timm's BatchNormAct2d does."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


def first_weight_gradient(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d)).weight.grad.clone()


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, lambda c: nn.GroupNorm(2, c), nn.InstanceNorm2d, None],
                         ids=["batchnorm", "groupnorm", "instancenorm", "no-norm"])
@pytest.mark.parametrize("act", [nn.SiLU, nn.GELU])
@pytest.mark.parametrize("example", [True, False], ids=["example-call", "module-tree"])
def test_activations_fed_by_a_cnn_layer_take_the_3_bit_form(norm: Optional[Callable[[int], nn.Module]],
                                                            act: Callable[[], nn.Module], example: bool) -> None:
    """A CNN's chain of conv(-norm)-activation layers compounds the 2-bit activations' derivative
    error with depth (bench/activation_chains.py); convert gives its activations the 3-bit FewBit
    form, found from the example call (no residual add bypasses them) or, without one, from the
    module tree (their block holds convolutions), the head's SiLU included. Through 12 layers the
    first conv's gradient is then within 0.9 of exact (relative error), and at least 3 times closer
    than under the 2-bit form, which the caller can still force (measured at this seed: 0.18-0.82
    against 2.0-16 with norms; without, the 2-bit form is off by orders of magnitude)."""
    torch.manual_seed(0)
    model = ConvNormActChain(norm, act)
    x = torch.randn(4, 8, 12, 12)
    kwargs = {"example_inputs": (x,)} if example else {}
    converted, changes = abp.convert(model, **kwargs)
    family = "silu" if act is nn.SiLU else "gelu"
    per_layer = 2 if norm is None else 3
    fed = [f"body.{per_layer * i + per_layer - 1}" for i in range(12)]
    replaced = by_action(changes, "replaced")
    why = "on a path no residual add bypasses in the example call" if example else "in `body`, a block with a Conv2d"
    for name in fed:
        assert replaced[name].startswith(f"{act.__name__} ({family}) -> {act.__name__} ({family}_b3: {why}"), replaced[name]
        assert f"{family}='{'resilu2' if family == 'silu' else 'regelu2'}' forces it" in replaced[name]
        module = converted.get_submodule(name)
        assert type(module) is getattr(abp.nn, act.__name__) and module.bits == 3
    assert type(converted.head_act) is abp.nn.SiLU and converted.head_act.bits == 3
    exact = first_weight_gradient(model, x)
    error = lambda m: float((first_weight_gradient(m, x) - exact).norm() / exact.norm())  # noqa: E731
    forced, changes = abp.convert(model, **kwargs, **{family: "resilu2" if family == "silu" else "regelu2"})
    assert all("ReSiLU2" in by_action(changes, "replaced")[n] or "ReGELU2" in by_action(changes, "replaced")[n] for n in fed)
    assert error(converted) < 0.9 and error(forced) > 3 * error(converted)


def test_activation_inside_its_norm_takes_the_3_bit_form_and_an_explicit_choice_is_kept() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), NormWithActivation(8), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.SiLU())
    x = torch.randn(2, 3, 10, 10)
    for kwargs in ({}, {"example_inputs": (x,)}):
        converted, changes = abp.convert(model, **kwargs)
        assert type(converted[1].act) is abp.nn.SiLU and converted[1].act.bits == 3
        assert type(converted[4]) is abp.nn.SiLU and converted[4].bits == 3
        converted, changes = abp.convert(model, silu="silu_b2", **kwargs)
        assert by_action(changes, "replaced")["1.act"] == "SiLU (silu) -> SiLU (silu_b2)"
        converted, changes = abp.convert(model, silu="resilu2", **kwargs)
        assert type(converted[4]) is abp.nn.ReSiLU2


class ResidualBlock(nn.Module):
    """`x + fc2(act(fc1(norm(x))))` with a BatchNorm1d as the norm: the activation sits in a residual
    branch, fed by a Linear, though its block holds a channel norm."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = nn.BatchNorm1d(d), nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class PostAddBlock(nn.Module):
    """ResNet's layout: `act(bn(conv(x)) + x)`, the sum written out or in place; the activation is
    on the path every gradient takes."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.conv, self.bn, self.act = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        if self.in_place:
            h += x
        else:
            h = h + x
        return self.act(h)


def test_the_example_calls_dataflow_decides_over_the_module_tree() -> None:
    """With an example call an activation in a residual branch fed by a Linear keeps the 2-bit
    form, whatever its block holds; without one the block's BatchNorm makes it 3-bit."""
    model = nn.Sequential(ResidualBlock(), ResidualBlock())
    x = torch.randn(4, 8)
    converted, changes = abp.convert(model, example_inputs=(x,))
    assert [type(b.act) for b in converted] == [abp.nn.ReSiLU2, abp.nn.ReSiLU2]
    converted, changes = abp.convert(model)
    assert all(type(b.act) is abp.nn.SiLU and b.act.bits == 3 for b in converted)
    assert by_action(changes, "replaced")["0.act"].startswith("SiLU (silu) -> SiLU (silu_b3: in `0`, a block with a BatchNorm1d")


@pytest.mark.parametrize("in_place", [False, True], ids=["h = h + x", "h += x"])
def test_an_activation_after_the_residual_add_takes_the_3_bit_form(in_place: bool) -> None:
    model = nn.Sequential(PostAddBlock(in_place), PostAddBlock(in_place))
    converted, changes = abp.convert(model, example_inputs=(torch.randn(2, 4, 6, 6),))
    for name in ("0.act", "1.act"):
        assert "silu_b3: on a path no residual add bypasses in the example call" in by_action(changes, "replaced")[name]


class LinearChain(nn.Module):
    """`depth` Linear-LayerNorm-SiLU layers without per-layer residuals; `long_skip` adds the input
    to the output (one skip over the whole chain), `shift` adds a buffer in every layer."""

    def __init__(self, long_skip: bool = False, shift: bool = False, depth: int = 6, d: int = 8) -> None:
        super().__init__()
        self.long_skip, self.use_shift = long_skip, shift
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.SiLU()) for _ in range(depth))
        self.register_buffer("shift", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = layer(h)
            if self.use_shift:
                h = h + self.shift
        return h + x if self.long_skip else h


@pytest.mark.parametrize("variant", [{}, {"long_skip": True}, {"shift": True}], ids=["chain", "long-skip", "buffer-added"])
def test_a_skip_over_several_activations_or_an_added_buffer_is_no_bypass(variant: Dict[str, bool]) -> None:
    """A residual add bypasses an activation only if its branch holds no other: one skip over a
    whole chain leaves every layer's gradient passing through the rest; a buffer added in every
    layer is no skip at all."""
    converted, _ = abp.convert(LinearChain(**variant), example_inputs=(torch.randn(4, 8),))
    assert all(type(layer[2]) is abp.nn.SiLU and layer[2].bits == 3 for layer in converted.layers)


class Experts(nn.Module):
    """`x + Σ_e fc2_e(act_e(fc1_e(norm(x))))`: a mixture of experts' layer, each expert a branch of its
    own beside the others (a routed expert and a shared one, Qwen2-MoE's and DeepSeek's layout);
    `series` stacks a second activation after each expert's, a chain within the branch."""

    def __init__(self, experts: int = 2, series: bool = False, d: int = 8) -> None:
        super().__init__()
        self.norm, self.series = nn.LayerNorm(d), series
        self.fc1 = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(experts))
        self.act = nn.ModuleList(nn.SiLU() for _ in range(experts))
        self.mid = nn.ModuleList(nn.Sequential(nn.Linear(2 * d, 2 * d), nn.SiLU()) for _ in range(experts))
        self.fc2 = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = None
        for e in range(len(self.fc1)):
            y = self.act[e](self.fc1[e](h))
            y = self.fc2[e](self.mid[e](y) if self.series else y)
            out = y if out is None else out + y
        return x + out


def test_parallel_experts_in_one_residual_branch_keep_the_2_bit_form() -> None:
    """The experts of a mixture sit side by side in one residual branch: the gradient through one
    expert's activation passes no other activation, so none compounds (Qwen2-MoE's and DeepSeek-V3's
    experts and shared expert took the 3-bit form). Two activations in series within each expert
    still do."""
    model = nn.Sequential(Experts(3), Experts(3))
    converted, changes = abp.convert(model, example_inputs=(torch.randn(4, 8),))
    assert all(type(a) is abp.nn.ReSiLU2 for block in converted for a in block.act)
    chained, _ = abp.convert(nn.Sequential(Experts(2, series=True)), example_inputs=(torch.randn(4, 8),))
    assert all(type(a) is abp.nn.SiLU and a.bits == 3 for a in chained[0].act)
    assert all(type(m[1]) is abp.nn.SiLU and m[1].bits == 3 for m in chained[0].mid)


class ParallelBlock(nn.Module):
    """GPT-J's, Phi's and Cohere's block: attention and MLP read one norm of x, and x, the
    attention's output and the MLP's are summed in the order `order` names; `series` puts a
    second activation after the MLP's, a chain within its branch."""

    def __init__(self, order: str, series: bool = False, d: int = 8) -> None:
        super().__init__()
        self.order, self.series = order, series
        self.norm, self.attn = nn.LayerNorm(d), nn.Linear(d, d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d)
        self.mid = nn.Sequential(nn.Linear(2 * d, 2 * d), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a = self.attn(h)
        y = self.act(self.fc1(h))
        m = self.fc2(self.mid(y) if self.series else y)
        if self.order == "x + attn + mlp":  # Cohere: (x + attn) + mlp, the skip through an add
            return x + a + m
        if self.order == "attn + mlp + x":  # Phi
            return a + m + x
        return x + (a + m)


@pytest.mark.parametrize("order", ["x + attn + mlp", "attn + mlp + x", "x + (attn + mlp)"])
def test_a_parallel_blocks_mlp_activation_keeps_the_2_bit_form_whatever_the_order_of_its_adds(order: str) -> None:
    """The skip around the MLP may reach its add through another add (Cohere's `residual + attn +
    mlp` took the 3-bit form, "no residual add bypasses"); two activations in series in the MLP
    still compound."""
    converted, changes = abp.convert(nn.Sequential(ParallelBlock(order), ParallelBlock(order)),
                                     example_inputs=(torch.randn(4, 8),))
    assert all(type(b.act) is abp.nn.ReSiLU2 for b in converted), changes
    chained, _ = abp.convert(nn.Sequential(ParallelBlock(order, series=True)), example_inputs=(torch.randn(4, 8),))
    assert type(chained[0].act) is abp.nn.SiLU and chained[0].act.bits == 3
    assert type(chained[0].mid[1]) is abp.nn.SiLU and chained[0].mid[1].bits == 3


class TwoActivatedBranches(nn.Module):
    """`act_a(a(x)) + act_b(b(x))`: two branches, each through its own activation, and no identity
    skip: every gradient path through a stack of these meets one activation per block."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.act_a, self.act_b = nn.Linear(d, d), nn.Linear(d, d), nn.SiLU(), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_a(self.a(x)) + self.act_b(self.b(x))


def test_two_activated_branches_without_an_identity_skip_are_no_bypass() -> None:
    converted, _ = abp.convert(nn.Sequential(*[TwoActivatedBranches() for _ in range(4)]),
                               example_inputs=(torch.randn(4, 8),))
    assert all(type(m) is abp.nn.SiLU and m.bits == 3 for block in converted for m in (block.act_a, block.act_b))


class SandwichBlock(nn.Module):
    """Gemma 2's, OLMo 2's and GLM-4's MLP: `x + post_norm(mlp(pre_norm(x)))` (or, `functional`,
    the post norm as F.layer_norm); without `post`, a plain pre-norm block."""

    def __init__(self, post: str, d: int = 8) -> None:
        super().__init__()
        self.post = post
        self.pre, self.post_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.fc2(self.act(self.fc1(self.pre(x))))
        if self.post == "module":
            m = self.post_norm(m)
        elif self.post == "functional":
            m = torch.nn.functional.layer_norm(m, m.shape[-1:])
        return x + m


@pytest.mark.parametrize("post", ["module", "functional", "none"])
def test_a_branch_normalised_before_its_residual_add_is_no_bypass(post: str) -> None:
    """A norm between the activation and the add rescales the branch to the skip's size: the 2-bit
    error no longer has the small share of the gradient the skip leaves it (GLM-4: whole-gradient
    error 0.65 with ReSiLU2, 0.054 with the 3-bit form; Gemma 2 0.67 / 0.058; LLaMA's plain pre-norm
    block 0.13 with ReSiLU2)."""
    converted, changes = abp.convert(nn.Sequential(SandwichBlock(post), SandwichBlock(post)),
                                     example_inputs=(torch.randn(4, 8),))
    if post == "none":
        assert all(type(b.act) is abp.nn.ReSiLU2 for b in converted), changes
    else:
        assert all(type(b.act) is abp.nn.SiLU and b.act.bits == 3 for b in converted), changes
        assert "a branch normalised before its add" in by_action(changes, "replaced")["0.act"]


def test_a_shared_activation_takes_the_3_bit_form_if_any_of_its_calls_compounds() -> None:
    """One SiLU module called in a residual branch and after a BatchNorm: the 3-bit form whichever
    call comes first (the BatchNorm call is in a residual branch too)."""
    class Shared(nn.Module):
        def __init__(self, branch_first: bool) -> None:
            super().__init__()
            self.branch_first = branch_first
            self.fc, self.conv, self.bn, self.act = nn.Linear(4, 4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def branch(y: torch.Tensor) -> torch.Tensor:
                return y + self.act(self.fc(y.transpose(1, 3))).transpose(1, 3)

            def chain(y: torch.Tensor) -> torch.Tensor:
                return y + self.act(self.bn(self.conv(y)))
            return chain(branch(x)) if self.branch_first else branch(chain(x))

    for branch_first in (True, False):
        converted, _ = abp.convert(Shared(branch_first), example_inputs=(torch.randn(2, 4, 3, 3),))
        assert type(converted.act) is abp.nn.SiLU and converted.act.bits == 3


@pytest.mark.parametrize("gelu", ["regelu2", "gelu_b2"])
def test_tanh_gelu_becomes_the_tanh_form(gelu):
    require_tanh_gelu()
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 16))
    converted, changes = abp.convert(model, gelu=gelu)
    act = converted[1]
    assert act.approximate == "tanh"
    assert by_action(changes, "replaced")["1"].startswith("GELU (gelu_tanh) -> ")
    assert "tanh form" in by_action(changes, "replaced")["1"]
    manual = abp.nn.ReGELU2(approximate="tanh") if gelu == "regelu2" else abp.nn.GELU(approximate="tanh", bits=2)
    assert type(act) is type(manual) and act.operator == manual.operator
    reference = with_abp_activations(model, lambda m: manual if type(m) is nn.GELU else None)
    assert_same_training_step(reference, converted, torch.randn(4, 5, 16), atol=1e-5)


def test_gemma_with_tanh_gelu():
    require_tanh_gelu()
    model = make(lambda: Gemma(nn.GELU(approximate="tanh")), torch.float32)
    converted, changes = abp.convert(model)
    assert type(converted.norm) is abp.nn.MSRMSNorm and converted.norm.weight_offset == 1.0
    assert type(converted.act) is abp.nn.ReGELU2 and converted.act.approximate == "tanh"
    reference = with_abp_activations(model, lambda m: abp.nn.ReGELU2(approximate="tanh") if type(m) is nn.GELU else None)
    assert_same_training_step(reference, converted, torch.randn(3, 5, 16), atol=1e-5)


class QuickGELU(nn.Module):
    """CLIP's x * sigmoid(1.702 x): close to GELU, but not GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


@pytest.mark.parametrize("act", [nn.LeakyReLU(0.2, inplace=True), nn.ELU(inplace=True), nn.CELU(inplace=True),
                                 nn.SELU(inplace=True)], ids=str)
def test_an_in_place_activation_whose_backward_reads_its_result_is_kept(act):
    """torch's in-place LeakyReLU, ELU, CELU and SELU save their result, which the next layer saves
    anyway: a replacement could only add its codes (a timm ResNet-18 with in-place ELUs stored
    3 % more converted). Their out-of-place forms are replaced."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), act, nn.Conv2d(8, 4, 3)), torch.randn(2, 3, 12, 12)
    converted, changes = abp.convert(model, "lowmembp", example_inputs=(x,))
    assert type(converted[2]) is type(act) and "kept: in place, torch's backward reads its result" in by_action(
        changes, "refused")["2"]
    report = abp.memory.report(converted, x, baseline=model)
    assert report.total_bytes == report.baseline_total_bytes
    act.inplace = False
    replaced, _ = abp.convert(model, "lowmembp", example_inputs=(x,))
    assert type(replaced[2]).__module__ == "abp.nn"


def test_relu_unknown_and_identity_like_activations():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Tanh(), QuickGELU(), nn.Dropout(0.1), nn.Identity(), nn.Softmax(-1))
    converted, changes = abp.convert(model)
    refused = by_action(changes, "refused")
    assert refused == {
        "1": "ReLU (ReLU) kept: its backward reads only its output, which the next layer saves anyway",
        "2": "Tanh (Tanh) kept: torch's backward reads only its output, which the ops after it usually keep too (a gate's "
        "product does); abp.nn.Tanh(bits=...) stores k-bit codes of its input instead, for where nothing else keeps the output",
        "3": "QuickGELU not replaced: an elementwise activation that is none of GELU (erf or tanh form), SiLU, the ReLU family "
        "(ReLU, LeakyReLU, ReLU6), Hardsigmoid, Sigmoid, Tanh, or Hardswish, Mish, ELU/CELU (alpha 1), SELU, Softplus "
        "(beta 1, threshold 20), LogSigmoid, Softsign, Tanhshrink",
    }
    assert not by_action(changes, "replaced")
    assert [type(m) for m in converted] == [type(m) for m in model]
    x = torch.randn(3, 8)
    torch.testing.assert_close(converted.eval()(x), model.eval()(x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_random_and_learned_activations_are_kept_with_the_reason(mode):
    """RReLU draws its slope in training, and is a LeakyReLU in eval mode (a model fresh from
    from_pretrained): replacing it there with a fixed LeakyReLU would train another function.
    PReLU's slope is learned. Both stay, each named in the changes; Dropout is not mentioned."""
    model = nn.Sequential(nn.Linear(8, 8), nn.RReLU(), nn.Linear(8, 8), nn.PReLU(), nn.Dropout(0.1))
    model.train(mode == "train")
    converted, changes = abp.convert(model, example_inputs=(torch.randn(4, 8),))
    assert not by_action(changes, "replaced")
    assert [type(m) for m in converted] == [type(m) for m in model]
    assert converted.training == (mode == "train")
    assert by_action(changes, "refused") == {
        "1": "RReLU not replaced: it draws at random in training mode (as RReLU's slope does), which no replacement with "
        "a fixed derivative reproduces",
        "3": "PReLU not replaced: its output depends on its learned parameters (weight) besides its input; abp replaces "
        "activations that are fixed functions of their input",
    }


def test_converting_a_converted_model_again_says_why_nothing_changed():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8))
    once, changes = abp.convert(model, example_inputs=(torch.randn(4, 8),))
    assert len(by_action(changes, "replaced")) == 2
    twice, again = abp.convert(once, example_inputs=(torch.randn(4, 8),))
    assert again == [abp.Change("", "refused", "recipe lowmembp: nothing left to replace; 2 module(s) are abp's already "
                                "(GELU, MSLayerNorm: an earlier convert's), which convert leaves as they are")]
    assert [type(m) for m in twice] == [type(m) for m in once]
    assert abp.convert(nn.Sequential(nn.Linear(8, 8)))[1] == []  # nothing abp's: nothing to say


def test_leaky_relu_becomes_the_exact_one_bit_leaky_relu():
    model = nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 8), nn.LeakyReLU())
    converted, changes = abp.convert(model)
    assert type(converted[1]) is abp.nn.LeakyReLU and converted[1].negative_slope == pytest.approx(0.2)
    assert converted[3].negative_slope == pytest.approx(0.01)
    assert by_action(changes, "replaced")["1"] == "LeakyReLU (leaky_relu) -> LeakyReLU (LeakyReLU(negative_slope=0.2), exact 1-bit)"
    # Its derivative is exact: torch's own gradients.
    assert_same_training_step(model, converted, torch.randn(4, 8), atol=1e-6)
    kept, changes = abp.convert(model, leaky_relu=False)
    assert type(kept[1]) is nn.LeakyReLU and not changes


def test_relu6_and_hardsigmoid_become_the_exact_one_bit_modules():
    """MobileNet's ReLU6 and a squeeze-excitation gate's Hardsigmoid: torch saves their input,
    one bit per element gives their derivative exactly (they were refused as unknown)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(), nn.Conv2d(8, 8, 1),
                          nn.Hardsigmoid(), nn.Conv2d(8, 4, 1))
    x = torch.randn(2, 3, 16, 16)
    converted, changes = abp.convert(model, example_inputs=(x,))
    assert type(converted[2]) is abp.nn.ReLU6 and type(converted[4]) is abp.nn.Hardsigmoid
    assert by_action(changes, "replaced")["2"] == "ReLU6 (relu6) -> ReLU6 (exact 1-bit)"
    assert by_action(changes, "replaced")["4"] == "Hardsigmoid (hardsigmoid) -> Hardsigmoid (exact 1-bit)"
    assert_same_training_step(model, converted, x, atol=1e-6)
    report = abp.memory.report(converted, x, baseline=model)
    assert report.baseline_total_bytes is not None and report.total_bytes < report.baseline_total_bytes


_FEWBIT_KINDS = [(nn.Hardswish, abp.nn.Hardswish), (nn.Mish, abp.nn.Mish), (nn.ELU, abp.nn.ELU), (nn.CELU, abp.nn.ELU),
                 (nn.SELU, abp.nn.SELU), (nn.Softplus, abp.nn.Softplus), (nn.LogSigmoid, abp.nn.LogSigmoid),
                 (nn.Softsign, abp.nn.Softsign), (nn.Tanhshrink, abp.nn.Tanhshrink)]


@pytest.mark.parametrize("original,replacement", _FEWBIT_KINDS, ids=lambda c: c.__name__)
def test_activations_with_a_fewbit_table_get_its_k_bit_derivative(original, replacement):
    """MobileNetV3's Hardswish, CSPNet's Mish, ...: torch saves their input; the FewBit module
    stores `other_activations` bits of it (3 by default), and its gradient is that table's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), original(), nn.Linear(16, 4))
    x = torch.randn(64, 8) * 2
    converted, changes = abp.convert(model, example_inputs=(x,))
    assert type(converted[1]) is replacement and converted[1].bits == 3
    kind = abp._recognise.recognise(original())
    assert by_action(changes, "replaced")["1"] == f"{original.__name__} ({kind.kind}) -> {replacement.__name__} (FewBit 3-bit)"
    reference = with_abp_activations(model, lambda m: replacement(bits=3) if type(m) is original else None)
    assert_same_training_step(reference, converted, x, atol=1e-6)
    torch.testing.assert_close(converted.eval()(x), model.eval()(x), rtol=1e-5, atol=1e-6)
    two, _ = abp.convert(model, other_activations=2)
    assert type(two[1]) is replacement and two[1].bits == 2
    report = abp.memory.report(converted, x, baseline=model)
    assert report.baseline_total_bytes is not None and report.total_bytes < report.baseline_total_bytes


def test_other_activations_switched_off_and_checked():
    model = nn.Sequential(nn.Linear(8, 8), nn.Hardswish(), nn.Linear(8, 8), nn.GELU())
    kept, changes = abp.convert(model, other_activations=None)
    assert type(kept[1]) is nn.Hardswish and set(by_action(changes, "replaced")) == {"3"}
    kept, _ = abp.convert(model, other_activations=False)  # False is None: off
    assert type(kept[1]) is nn.Hardswish
    import numpy as np
    assert abp.convert(model, other_activations=np.int64(2))[0][1].bits == 2
    for bad in (0, 5, 2.5, "3", True):
        with pytest.raises(ValueError, match=r"other_activations: expected the bits of the FewBit derivative \(1, 2, 3 or 4\)"):
            abp.convert(model, other_activations=bad)


def test_an_explicit_other_activations_is_kept_under_compress():
    """Under recipe compress a replacement that stores more than the compressed original is put
    back, unless the caller chose it: other_activations= is such a choice, as gelu= is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.Hardswish(), nn.Linear(512, 16))
    x = torch.randn(64, 16)
    chosen, changes = abp.convert(model, ["lowmembp", "compress"], example_inputs=(x,), other_activations=4)
    assert type(chosen[1]) is abp.nn.Hardswish and chosen[1].bits == 4


def test_activations_switched_off():
    converted, changes = abp.convert(make(ViT, torch.float32), gelu=None)
    assert all(type(m) is nn.GELU for n, m in converted.named_modules() if n.endswith(".act"))
    assert not any(c.module.endswith(".act") for c in changes)
    converted, changes = abp.convert(make(LlamaBlock, torch.float32), silu=False)  # False is None: off
    assert type(converted.act) is nn.SiLU and "act" not in by_action(changes, "replaced")


def test_norms_false_and_inplace():
    model = make(ViT, torch.float32)
    same, changes = abp.convert(model, norms=False, gelu="gelu_b2", inplace=True)
    assert same is model and isinstance(model.blocks[0].norm1, nn.LayerNorm)
    assert isinstance(model.blocks[0].act, abp.nn.GELU) and all(c.action == "replaced" for c in changes)
    assert {c.module for c in changes} == {"blocks.0.act", "blocks.1.act"}


def test_a_module_registered_twice_is_replaced_at_both_paths():
    act = nn.GELU()
    model = nn.Sequential(nn.Linear(8, 8), act, nn.Linear(8, 8), act, nn.LayerNorm(8))
    model.extra = model[4]
    randomize_norms(model)
    keys = list(model.state_dict())
    converted, changes = abp.convert(model)
    assert isinstance(converted[1], abp.nn.ReGELU2) and converted[3] is converted[1]
    assert isinstance(converted[4], abp.nn.MSLayerNorm) and converted.extra is converted[4]
    replaced = by_action(changes, "replaced")
    assert "also registered as `3`" in replaced["1"] and "also registered as `extra`" in replaced["4"]
    assert list(converted.state_dict()) == keys
    assert converted.state_dict()["extra.weight"].data_ptr() == converted.state_dict()["4.weight"].data_ptr()
    x = torch.randn(3, 8)
    reference = with_abp_activations(model, lambda m: abp.nn.ReGELU2() if type(m) is nn.GELU else None)
    torch.testing.assert_close(converted(x), reference(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Recipes "sampled" and "compress", and lists of recipes
# ---------------------------------------------------------------------------------------------


def test_sampled_recipe_handles_conv1d():
    torch.manual_seed(9)
    model = GPT2Block(act=nn.SiLU()).double()
    weight = model.mlp.c_fc.weight
    converted, changes = abp.convert(model, "sampled", inplace=True, keep=1.0)
    assert by_action(changes, "replaced") == {
        "mlp.c_fc": "Conv1D -> SampledConv1D (method='wtacrs', keep=1.0)",
        "mlp.c_proj": "Conv1D -> SampledConv1D (method='wtacrs', keep=1.0)",
    }
    c_fc = converted.mlp.c_fc
    # Not a Linear: its weight is (in, out), which code reading a Linear's (out, in) would misread.
    assert type(c_fc) is abp.nn.SampledConv1D and not isinstance(c_fc, nn.Linear) and c_fc.weight is weight
    assert (c_fc.in_features, c_fc.out_features) == (16, 32)
    assert sorted(converted.state_dict()) == sorted(GPT2Block().state_dict())
    assert type(converted.ln_2) is nn.LayerNorm and type(converted.mlp.act) is nn.SiLU, "sampled alone touches nothing else"


def test_sampled_conv1d_is_exact_where_it_should_be():
    torch.manual_seed(10)
    model = GPT2Block(act=nn.SiLU()).double()
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    full, _ = abp.convert(model, "sampled", keep=1.0)
    assert_same_training_step(model, full, x, atol=1e-10)  # keep=1: every row, so dW is exact too
    sampled, _ = abp.convert(model, "sampled", keep=0.3)
    out0, dx0, g0 = grads(model, x)
    out1, dx1, g1 = grads(sampled, x)
    torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=1e-10)  # dX and db are exact
    torch.testing.assert_close(g1["mlp.c_proj.bias"], g0["mlp.c_proj.bias"], rtol=0, atol=1e-10)
    assert not torch.allclose(g1["mlp.c_proj.weight"], g0["mlp.c_proj.weight"]), "dW is estimated from sampled rows"
    xs = x.clone().requires_grad_()
    report = abp.memory.report(sampled, xs, baseline=model)
    assert report.per_module["mlp.c_fc"] < report.baseline_per_module["mlp.c_fc"]
    assert report.total_bytes < report.baseline_total_bytes
    sampled.eval()
    torch.testing.assert_close(sampled(x), model(x), rtol=0, atol=1e-10)


class LoraLayer(nn.Module):
    """A peft-style LoRA wrapper: a frozen base layer and trainable low-rank A, B."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.base_layer = nn.Linear(d, d).requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, d, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class LoraModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.o_proj = LoraLayer(16)
        self.mlp = nn.Module()
        self.mlp.down_proj = nn.Linear(16, 16).requires_grad_(False)
        self.mlp.up_proj = LoraLayer(16)
        self.mlp.up_proj.lora_A.requires_grad_(False)
        self.mlp.up_proj.lora_B.requires_grad_(False)
        self.mlp.gate_proj = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(self.mlp.gate_proj(self.mlp.up_proj(self.self_attn.o_proj(x))))


def test_sampled_recipe_descends_into_lora_wrappers():
    torch.manual_seed(11)
    model = LoraModel()
    converted, changes = abp.convert(model, "sampled")
    assert by_action(changes, "replaced") == {
        "self_attn.o_proj.lora_A.default": "Linear -> SampledLinear (method='wtacrs', keep=0.3)",
        "self_attn.o_proj.lora_B.default": "Linear -> SampledLinear (method='wtacrs', keep=0.3)",
    }
    assert by_action(changes, "refused") == {
        "mlp.down_proj": "`mlp.down_proj` is frozen (its weight needs no gradient): nothing to sample",
        "mlp.up_proj": "LoraLayer matches layers= but holds no trainable linear map",
        "mlp.gate_proj": "GELU matches layers= but does not compute a linear map",
    }
    assert type(converted.self_attn.o_proj.base_layer) is nn.Linear, "the frozen base layer is not sampled"
    assert sorted(converted.state_dict()) == sorted(model.state_dict())
    x = torch.randn(3, 5, 16)
    converted.eval(), model.eval()
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-6)


def test_sampled_layers_and_method_overrides():
    model = LoraModel()
    converted, changes = abp.convert(model, "sampled", layers=["*lora_A*"], method="crs", keep=0.5)
    assert by_action(changes, "replaced") == {
        "self_attn.o_proj.lora_A.default": "Linear -> SampledLinear (method='crs', keep=0.5)"}
    assert by_action(changes, "refused") == {
        "mlp.up_proj.lora_A": "ModuleDict matches layers= but holds no trainable linear map",
        "mlp.up_proj.lora_A.default": "`mlp.up_proj.lora_A.default` is frozen (its weight needs no gradient): nothing to sample"}
    assert converted.self_attn.o_proj.lora_A.default.method == "crs"
    assert abp.convert(model, "sampled", layers=[])[1] == []


def test_compress_recipe_wraps_the_forward():
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    converted, changes = abp.convert(model, "compress", bits=4)
    how = "forward hooks" if abp._custom_ops.enabled() else "forward wrapped"  # torch 1.13: no always_call
    assert changes == [abp.Change("", "wrapped", f"forward runs inside compress_saved(bits=4, group_size=256) ({how})")]
    assert list(converted.state_dict()) == list(model.state_dict())
    x = torch.randn(8, 16, 16, requires_grad=True)
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=0)
    report = abp.memory.report(converted, x, baseline=model)
    assert report.total_bytes < report.baseline_total_bytes / 2
    low, _ = abp.convert(model, "compress", bits=2, allow_low_bits=True)
    assert abp.memory.report(low, x).total_bytes < report.total_bytes
    again = copy.deepcopy(converted)
    assert abp.memory.report(again, x).total_bytes == report.total_bytes, "a deep copy compresses as well"
    assert type(model).forward is nn.Sequential.forward and "forward" not in vars(model)


def test_a_second_compress_recipe_is_refused_and_the_first_still_runs():
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    once, _ = abp.convert(model, "compress", bits=4)
    twice, changes = abp.convert(once, "compress")
    assert [(c.module, c.action) for c in changes] == [("", "refused")]
    assert "already runs inside compress_saved(bits=4, group_size=256) from an earlier convert" in changes[0].detail
    x = torch.randn(8, 16, 16)
    assert abp.memory.report(twice, x).total_bytes == abp.memory.report(once, x).total_bytes


def test_a_compress_recipe_over_a_submodule_that_has_one_is_refused():
    """A model holding a submodule converted with the compress recipe: the outer block would
    open around the inner one's and fail at the first forward; convert refuses it, naming the
    submodule, and the model keeps training under the inner block."""
    inner, _ = abp.convert(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)), "compress", bits=4)
    outer = nn.Sequential(inner, nn.Linear(16, 4))
    converted, changes = abp.convert(outer, "compress")
    assert [(c.module, c.action) for c in changes] == [("", "refused")]
    assert "its submodule '0' already runs inside compress_saved(bits=4, group_size=256)" in changes[0].detail
    x = torch.randn(8, 16, 16)
    converted(x).sum().backward()
    assert abp.memory.report(converted, x).total_bytes == abp.memory.report(outer, x).total_bytes


def test_a_compress_recipe_model_run_without_grad_opens_no_block():
    """With grad off nothing is saved, so the recipe opens no block: a converted teacher runs
    under no_grad inside the student's compress_saved block (distillation); with grad on,
    nesting is still refused."""
    torch.manual_seed(3)
    teacher, _ = abp.convert(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)), "compress", bits=8)
    student = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    with abp.compress_saved(bits=4) as block:
        out = student(x)
        with torch.no_grad():
            target = teacher(x)
        assert abp.compress.open_block() is block
        torch.nn.functional.mse_loss(out, target).backward()
    with torch.inference_mode():
        torch.testing.assert_close(teacher(x), target, rtol=0, atol=0)
    with abp.compress_saved(bits=4), pytest.raises(RuntimeError, match="opened inside abp.compress_saved"):
        teacher(x)
    assert abp.compress.open_block() is None


def test_a_forward_interrupted_by_a_base_exception_has_its_block_closed_by_the_next_call():
    """A KeyboardInterrupt inside forward skips the hook that closes the recipe's block (torch
    runs always_call hooks for Exceptions only); the model's next call closes it, says so, and runs."""
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    converted, _ = abp.convert(model, "compress", bits=4)
    x = torch.randn(8, 16, 16)
    expected = abp.memory.report(converted, x).total_bytes

    def interrupt(module, args):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    handle = converted[2].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        converted(x)
    handle.remove()
    if "forward" in vars(converted):  # torch < 2.0: the wrapped forward's finally closed it at once
        assert abp.compress.open_block() is None
        converted(x).sum().backward()
    else:
        assert abp.compress.open_block() is not None  # left open by the interrupted forward
        with pytest.warns(RuntimeWarning, match="last forward did not finish .* closed it"):
            converted(x).sum().backward()
    assert abp.compress.open_block() is None
    assert abp.memory.report(converted, x).total_bytes == expected


def test_torch_export_of_a_compress_recipe_model_exports_its_function_and_leaves_no_block_open():
    """torch.export traces with tensors that hold no data: the recipe opens no block there (it
    failed reading a data pointer, and its hooks stayed on the stack for everything after)."""
    export = getattr(torch, "export", None)
    if export is None or not hasattr(export, "export"):
        pytest.skip("this torch has no torch.export")
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    converted, _ = abp.convert(model, "compress", bits=4)
    x = torch.randn(8, 16, 16)
    program = export.export(converted, (x,))
    assert abp.compress.open_block() is None
    torch.testing.assert_close(program.module()(x), model(x))
    converted(x).sum().backward()  # and the model still trains under its block
    assert abp.compress.open_block() is None


def test_recipe_lists_and_all():
    model = make(lambda: GPT2Block(act=nn.SiLU()), torch.float32)
    converted, changes = abp.convert(model, ["compress", "lowmembp", "lowmembp"])
    # No call to count on: the replacements stay, and a last line says so (abp._composition).
    assert [c.action for c in changes] == ["replaced", "replaced", "wrapped", "refused"], "recipes run in RECIPES order"
    assert "no call to count" in changes[-1].detail
    converted, changes = abp.convert(model, "all")
    actions = [(c.module, c.action) for c in changes]
    assert actions == [("ln_2", "replaced"), ("mlp.act", "replaced"), ("mlp.c_fc", "replaced"),
                       ("mlp.c_proj", "replaced"), ("", "wrapped"), ("", "refused")]
    assert type(converted.ln_2) is abp.nn.MSLayerNorm and type(converted.mlp.act) is abp.nn.ReSiLU2
    assert type(converted.mlp.c_fc) is abp.nn.SampledConv1D
    assert list(converted.state_dict()) == list(model.state_dict())
    x = torch.randn(3, 5, 16)
    converted.eval(), model.eval()
    torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Arguments and exports
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"recipe": "fewbit"}, ValueError, "recipe: expected one of lowmembp, sampled, compress or 'all', got 'fewbit'"),
        ({"recipe": ["lowmembp", "nope"]}, ValueError, "recipe: expected one of .* got 'nope'$"),
        ({"recipe": "lowmemBP"}, ValueError, "got 'lowmemBP'; did you mean 'lowmembp'\\?"),
        # The methods' own names say which recipe (or tool) is each.
        ({"recipe": "fewbit"}, ValueError, "got 'fewbit'; FewBit's k-bit .* recipe='lowmembp' with gelu='gelu_b3', silu='silu_b3'"),
        ({"recipe": "WTA-CRS"}, ValueError, "WTA-CRS is recipe='sampled'"),
        ({"recipe": ["lowmembp", "GACT"]}, ValueError, "GACT's compressed saved tensors are recipe='compress'"),
        ({"recipe": "vcas"}, ValueError, "VCAS is not a convert recipe: build abp.vcas.Controller"),
        ({"recipe": "sampeld"}, ValueError, "got 'sampeld'; did you mean 'sampled'\\?"),
        ({"recipe": []}, TypeError, "recipe: expected a recipe name or a non-empty list of them, got \\[\\]"),
        ({"recipe": 3}, TypeError, "recipe: expected a recipe name or a list of them, got 3"),
        ({"recipe": ["lowmembp", 3]}, TypeError, "recipe: expected a recipe name or a list of them"),
        ({"nonsense": 1}, TypeError,
         "unknown override\\(s\\) nonsense for recipe\\(s\\) lowmembp; valid keywords are norms, fold, gelu, silu, leaky_relu"),
        ({"keep": 0.5}, TypeError, "unknown override\\(s\\) keep for recipe\\(s\\) lowmembp"),
        ({"recipe": "compress", "gelu": None}, TypeError, "unknown override\\(s\\) gelu for recipe\\(s\\) compress"),
        ({"recipe": "all", "nonsense": 2}, TypeError, "valid keywords are norms, fold, gelu, silu, leaky_relu, other_activations, method, keep, layers, bits, group_size, allow_low_bits"),
        ({"gelu": "gelu_b9"}, ValueError, "gelu: expected one of regelu2, gelu_b1"),
        ({"gelu": True}, TypeError, "gelu: expected one of regelu2, .* \\(a str\\) or None \\(off\\), got bool True"),
        ({"silu": 3}, TypeError, "silu: expected one of resilu2, .*got int 3"),
        ({"silu": "regelu2"}, ValueError, "silu: expected one of resilu2"),
        ({"norms": "yes"}, TypeError, "norms: expected True or False"),
        ({"fold": 1}, TypeError, "fold: expected True or False, got 1"),
        ({"leaky_relu": None}, TypeError, "leaky_relu: expected True or False, got None"),
        ({"recipe": "sampled", "method": "bogus"}, ValueError, "method: expected one of wtacrs"),
        ({"recipe": "sampled", "keep": 0}, ValueError, "keep: expected a float in \\(0, 1\\], got 0"),
        ({"recipe": "sampled", "keep": "0.3"}, TypeError, "keep: expected a float in \\(0, 1\\], got str '0.3'"),
        ({"recipe": "sampled", "layers": "*.fc1"}, TypeError, "layers: expected a sequence of fnmatch patterns"),
        ({"recipe": "sampled", "layers": [1]}, TypeError, "layers: expected a sequence of fnmatch patterns"),
        ({"recipe": "compress", "bits": 5}, ValueError, "bits"),
        ({"recipe": "compress", "bits": 2}, ValueError, "bits=2: one width of 2 bits or fewer for every saved tensor .*allow_low_bits=True"),
        ({"recipe": "compress", "allow_low_bits": 1}, TypeError, "allow_low_bits: expected True or False, got 1"),
        ({"recipe": "compress", "group_size": 0}, ValueError, "group_size"),
    ],
)
def test_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        abp.convert(nn.Linear(2, 2), **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got function"):
        abp.convert(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="inplace: expected True or False, got 'yes'"):
        abp.convert(nn.Linear(2, 2), inplace="yes")  # type: ignore[arg-type]


def test_exports():
    assert abp.convert is abp.convert_.convert and abp.Change is abp.convert_.Change
    assert abp.convert_.RECIPES == ("lowmembp", "sampled", "compress")
    assert set(abp.convert_.__all__) == {"Change", "CompressSavedHooks", "convert", "RECIPES", "SAMPLED_LAYERS"}
    assert all(hasattr(abp.convert_, n) for n in abp.convert_.__all__)
    assert {"*mlp.c_fc", "*mlp.c_proj", "*self_attn.o_proj", "*mlp.fc1"} <= set(abp.convert_.SAMPLED_LAYERS)
    assert {"convert", "Change", "convert_"} <= set(abp.__all__)
    with pytest.raises(dataclasses.FrozenInstanceError):
        abp.Change("a", "replaced", "x").module = "b"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# What a user's model may do that convert must see (review findings)
# ---------------------------------------------------------------------------------------------


class LinearWeightReadElsewhere(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.head = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.norm(x))) + nn.functional.linear(x, self.fc.weight)


class NormOutputReadThroughProperty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.fc(h) + h.T.T


@pytest.mark.parametrize("cls, reason", [
    (LinearWeightReadElsewhere, "`fc`'s parameters are also used outside it"),
    (NormOutputReadThroughProperty, "its output also feeds `__get__`"),
])
def test_fold_sees_every_read_that_a_fold_would_change(cls, reason):
    torch.manual_seed(3)
    model = cls().double()
    randomize_norms(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    converted, changes = abp.convert(model, fold=True, example_inputs=x)
    assert not by_action(changes, "folded")
    assert reason in by_action(changes, "replaced")["norm"]
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)


class InPlaceAfterNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.relu(self.norm(self.fc1(x)), inplace=True))


class NoisyRouter(nn.Module):
    """A norm read by a router that multiplies its input by noise in place in training only, as
    SwitchTransformers' router does (router_jitter_noise)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.router, self.fc = nn.LayerNorm(8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.training:
            h *= torch.empty_like(h).uniform_(0.9, 1.1)
        return self.router(h) + self.fc(h)


def test_a_norm_whose_output_is_modified_in_place_in_training_only_is_refused():
    """The example call runs in eval mode (dropout aside); where the model is in training mode,
    a second call in its own modes finds the in-place writes training makes."""
    x = torch.randn(4, 8)
    converted, changes = abp.convert(NoisyRouter(), example_inputs=x)
    assert "its output is modified in place (`mul_`)" in by_action(changes, "refused")["norm"]
    converted(x).sum().backward()  # failed: the norm's saved output was modified
    evaluated, changes = abp.convert(NoisyRouter().eval(), example_inputs=x)
    assert "norm" in by_action(changes, "replaced")  # never written in place in eval mode


class GatedNorm(nn.Module):
    """RMSNorm with an optional gate, as Mamba2's MambaRMSNormGated: with gate=None it is RMSNorm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        if gate is not None:
            x = x * nn.functional.silu(gate)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_a_module_whose_forward_takes_more_than_its_input_is_not_replaced():
    """Probed with its input alone a gated norm computes RMSNorm; the model passes the gate too,
    which a one-input replacement would refuse (Mamba2's first forward failed)."""
    model = nn.Sequential(nn.Linear(8, 8), GatedNorm(8), nn.Linear(8, 2))
    converted, changes = abp.convert(model)
    assert by_action(changes, "refused")["1"].endswith("its forward takes `gate` besides its input, which abp's "
                                                       "replacement would not take")
    assert type(converted[1]) is GatedNorm


def test_a_norm_whose_output_is_modified_in_place_is_refused():
    """The memory-sharing backward reads the output: an in-place op on it would fail backward."""
    x = torch.randn(4, 8)
    sequential = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    converted, changes = abp.convert(sequential)
    assert "the next module `2` (ReLU) works in place" in by_action(changes, "refused")["1"]
    converted(x).sum().backward()
    functional = InPlaceAfterNorm()
    converted, changes = abp.convert(functional, example_inputs=x)
    assert "its output is modified in place (`relu(inplace=True)`" in by_action(changes, "refused")["norm"]
    converted(x).sum().backward()
    sequential[2].inplace = False  # what the reason suggests
    converted, changes = abp.convert(sequential)
    assert "1" in by_action(changes, "replaced")
    converted(x).sum().backward()


def test_under_autocast_norms_keep_their_dtype_unless_linear_layers_alone_read_them():
    torch.manual_seed(4)
    post_ln = nn.Sequential(nn.LayerNorm(8))  # the output is the model's (a residual stream)
    x = torch.randn(4, 8)
    plain, _ = abp.convert(post_ln)
    seen, _ = abp.convert(post_ln, example_inputs=x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain(x).dtype == seen(x).dtype == torch.float32  # an fp32 residual stream stays fp32
    pre_ln = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    plain, changes = abp.convert(pre_ln)
    assert "keeps its dtype under autocast (pass example_inputs=" in by_action(changes, "replaced")["0"]
    seen, changes = abp.convert(pre_ln, example_inputs=x)
    assert not seen[0].autocast_output is False and "keeps its dtype" not in by_action(changes, "replaced")["0"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert seen[0](x).dtype == torch.bfloat16 and plain[0](x).dtype == torch.float32
        # The Linear saves the norm's bf16 output itself, not a cast copy: less saved than without the example.
        assert abp.memory.saved_bytes(lambda: seen(x)) < abp.memory.saved_bytes(lambda: plain(x))


def test_convert_has_no_side_effects_on_hooks_rng_and_buffers():
    calls = []
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.LayerNorm(8), nn.Dropout(0.5), nn.GELU(), nn.Linear(8, 4))
    model[4].register_forward_hook(lambda *a: calls.append("gelu"))
    example = torch.randn(16, 8) * 5 + 3
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    converted, changes = abp.convert(model, fold=True, example_inputs=example)
    assert torch.equal(torch.rand(3), expected), "probes and the example call restore the RNG state"
    # The probes never reach the hook; the example calls do (in eval mode, and for a model in
    # training mode once more in its own modes).
    assert calls == ["gelu", "gelu"]
    assert torch.equal(converted[1].running_mean, model[1].running_mean)
    assert int(converted[1].num_batches_tracked) == int(model[1].num_batches_tracked) == 0
    assert "refused" in {c.action for c in changes if c.module == "4"}  # hooked: not replaced


def test_example_kwargs_may_be_any_mapping():
    from collections import UserDict

    class KwargsOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 4)

        def forward(self, *, hidden: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(hidden))

    model = KwargsOnly()
    converted, changes = abp.convert(model, fold=True, example_kwargs=UserDict(hidden=torch.randn(3, 8)))
    assert by_action(changes, "folded") and by_action(changes, "replaced")


def test_fold_needs_an_example_only_where_there_is_an_affine_to_fold():
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 4))
    converted, changes = abp.convert(model, fold=True)
    assert isinstance(converted[0], abp.nn.MSLayerNorm) and not converted[0].elementwise_affine


def test_a_norm_keeping_fp32_under_autocast_saves_its_output_in_the_autocast_dtype():
    torch.manual_seed(5)
    norm = nn.LayerNorm(64)
    randomize_norms(nn.Sequential(norm))
    ms = abp.nn.MSLayerNorm(64, elementwise_affine=True, autocast_output=False)
    ms.weight, ms.bias = norm.weight, norm.bias
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ms(x).dtype == torch.float32
        # a bf16 copy of the output, 1/sigma per row, and gamma and beta (parameters, kept anyway)
        assert abp.memory.saved_bytes(lambda: ms(x)) == 8 * 64 * 2 + 8 * 4 + 2 * 64 * 4
        g = torch.randn(8, 64)
        got = torch.autograd.grad(ms(x), [x, norm.weight, norm.bias], g)
    want = torch.autograd.grad(norm(x), [x, norm.weight, norm.bias], g)
    for a, b in zip(got, want):  # bf16-accurate: n recovered from the bf16 copy
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def test_new_user_mistakes_get_a_pointer():
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    with pytest.raises(TypeError, match="inplace, example_inputs, example_kwargs; did you mean example_inputs\\?"):
        abp.convert(model, example_input=(x,))
    with pytest.raises(TypeError, match="got dict; pass keyword arguments as example_kwargs="):
        abp.convert(model, example_inputs={"input": x})


def test_sampled_recipe_says_when_no_layer_matched():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    _, changes = abp.convert(model, "sampled")
    assert by_action(changes, "refused")[""].startswith("recipe sampled: no module name matched layers=")
    _, changes = abp.convert(model, "sampled", layers=["0"])
    assert "0" in by_action(changes, "replaced") and "" not in by_action(changes, "refused")


class ChannelsFirstLayerNorm(nn.Module):
    """timm's LayerNorm2d: normalises over the channels of (N, C, H, W)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.permute(0, 2, 3, 1), x.shape[1:2], self.weight, self.bias).permute(0, 3, 1, 2)


def test_a_norm_abp_has_no_replacement_for_is_listed_not_skipped():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), ChannelsFirstLayerNorm(8), nn.BatchNorm2d(8))
    _, changes = abp.convert(model)
    refused = by_action(changes, "refused")
    assert "neither LayerNorm nor RMSNorm over the last dimension" in refused["1"]
    assert "neither LayerNorm nor RMSNorm over the last dimension" in refused["2"]


def test_with_an_example_a_norm_says_why_it_keeps_its_dtype():
    model = nn.Sequential(nn.LayerNorm(8))
    _, changes = abp.convert(model, example_inputs=torch.randn(3, 8))
    assert "keeps its dtype under autocast (its output also feeds the model's return value)" in by_action(changes, "replaced")["0"]


def test_a_float64_model_keeps_its_activations_and_trains():
    """The activation kernels are float32, float16 and bfloat16: in a float64 model convert keeps
    the GELUs, naming why, and replaces the norms, which run float64; the converted model trains.
    An abp activation given a float64 tensor names itself in the TypeError."""
    model = make(ViT).double()
    converted, changes = abp.convert(model)
    refused = by_action(changes, "refused")
    assert set(refused) == {"blocks.0.act", "blocks.1.act"}
    assert all("float64" in why and "activation kernels" in why for why in refused.values())
    assert len(by_action(changes, "replaced")) == 5  # the norms
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    converted(x).square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in converted.parameters())
    float_model, float_changes = abp.convert(make(ViT, torch.float32))
    assert "blocks.0.act" in by_action(float_changes, "replaced")
    with pytest.raises(TypeError, match=r"^ReGELU2 \(regelu2\): input: expected dtype .* got torch.float64"):
        float_model.blocks[0].act(x)
    # A converted model cast with .double() afterwards (for gradcheck, say): the error says what to do.
    with pytest.raises(TypeError, match=r"got torch.float64; abp's generated elementwise kernels have no float64 "
                                        r"form: .* use the unconverted model"):
        float_model.double()(x)


class NormThroughFunctionalDropout(nn.Module):
    """A norm read by a Linear through F.dropout(training=self.training), as attention code does."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(nn.functional.dropout(self.norm(x), 0.1, self.training))


def test_a_norm_read_through_functional_dropout_is_not_folded():
    """The example call runs in eval mode, where F.dropout hands its input back, so the Linear
    seems to read the norm's output itself; in training it reads dropout's output, through which
    beta cannot be folded. The dropout call is a use of the norm's output all the same, so the
    fold is refused."""
    model = make(NormThroughFunctionalDropout).train()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    converted, changes = abp.convert(model, gelu=None, fold=True, example_inputs=x)
    assert not by_action(changes, "folded"), changes
    assert "norm" in by_action(changes, "replaced") and "affine kept" in by_action(changes, "replaced")["norm"]


def test_an_activation_the_example_call_never_ran_is_said_to_be_idle() -> None:
    """A registered activation the forward does not call (transformers' Mamba keeps `act` and calls
    F.silu on its slow path): the change says so when an example call shows it, and its tree
    reading says why it used the tree."""
    class Idle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.act = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(self.bn(self.conv(x)))

    _, changes = abp.convert(Idle(), example_inputs=(torch.randn(2, 4, 3, 3),))
    detail = by_action(changes, "replaced")["act"]
    assert "it did not run in the example call, so convert reads the module tree" in detail
    assert detail.startswith("did not run in the example call, so the replacement may change nothing: ")
    _, changes = abp.convert(Idle())
    detail = by_action(changes, "replaced")["act"]
    assert "without an example call convert reads the module tree" in detail and "did not run" not in detail


def test_a_model_on_the_meta_device_converts_and_says_gamma_went_unchecked():
    """A model built on the meta device (to be loaded later): convert cannot read gamma's values
    (it refuses zero gammas elsewhere), says so, and the model materialised afterwards trains."""
    model = nn.Sequential(nn.Linear(16, 32, device="meta"), nn.LayerNorm(32, device="meta"), nn.GELU(),
                          nn.Linear(32, 4, device="meta"))
    converted, changes = abp.convert(model)
    assert type(converted[1]) is abp.nn.MSLayerNorm and "gamma is on the meta device" in by_action(changes, "replaced")["1"]
    converted = converted.to_empty(device="cpu")
    for p in converted.parameters():
        torch.nn.init.normal_(p)
    converted(torch.randn(3, 16)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in converted.parameters())


def test_an_optimizer_built_before_a_copying_convert_is_warned_about_once():
    """convert deep-copies: an optimizer of the original steps parameters that get no gradient.
    Its step warns once; an exact baseline trained beside the converted copy (its parameters get
    gradients) and an optimizer of the converted model do not."""
    from torch.optim import optimizer as torch_optimizer
    if not hasattr(torch_optimizer, "register_optimizer_step_pre_hook"):
        pytest.skip("this torch has no global optimizer hooks")
    import warnings
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    before = torch.optim.SGD(model.parameters(), lr=0.1)
    converted, _ = abp.convert(model)
    x = torch.randn(5, 8)
    converted(x).sum().backward()
    with pytest.warns(RuntimeWarning, match="steps the parameters of the model as it was before abp.convert copied it"):
        before.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before.step()  # once per optimizer
        model(x).sum().backward()  # the original trained as a baseline: it has gradients
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        after = torch.optim.SGD(converted.parameters(), lr=0.1)
        after.step()


def test_torchscript_refusals_name_what_to_use_and_a_compress_model_traces_as_its_function():
    """torch.jit.script of any abp module or compress-recipe model, and torch.jit.trace of a sampled
    layer in training, say what to use instead, on this torch (they failed on an annotation deep
    inside, or on a traced count; torch 1.13 has no torch.compile to advise); a compress-recipe
    model traces as the model's function (its block is no part of it), with a warning that the
    traced module trains without compression."""
    import warnings
    modules = [abp.nn.GELU(), abp.nn.ReGELU2(), abp.nn.ReLU(), abp.nn.MSLayerNorm(8),
               abp.nn.SampledLinear(8, 8), abp.convert(nn.Sequential(nn.Linear(8, 8), nn.GELU()))[0]]
    alternative = "torch.compile or torch.export" if hasattr(torch, "compile") else "on this torch, script or trace the unconverted"
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    converted, _ = abp.convert(model, "compress", bits=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch >= 2.9 calls TorchScript deprecated
        for module in modules:
            with pytest.raises(RuntimeError, match=f"torch.jit.script cannot compile abp modules.*{alternative}"):
                torch.jit.script(module)
        with pytest.raises(RuntimeError, match=f"runs inside compress_saved.*TorchScript cannot compile.*{alternative}"):
            torch.jit.script(converted)
        with pytest.raises(RuntimeError, match="sampled_linear: torch.jit.trace cannot record abp operators"):
            torch.jit.trace(abp.nn.SampledLinear(8, 8).train(), torch.randn(4, 3, 8))
        x = torch.randn(4, 8)
        abp.compress._WARNED.discard("jit-trace")  # said once per process
        warnings.simplefilter("always", RuntimeWarning)
        with pytest.warns(RuntimeWarning, match="trains without compression"):
            traced = torch.jit.trace(converted, x)
    assert abp.compress.open_block() is None
    torch.testing.assert_close(traced(x), model(x))


class ReadsTheInputAgain(nn.Module):
    """An in-place activation whose input the model reads after it (`y = act(h); y + h`)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = self.act(h)
        return y + h


@pytest.mark.parametrize("act", [nn.SiLU(inplace=True), nn.Hardswish(inplace=True)], ids=["SiLU", "Hardswish"])
def test_an_in_place_activation_stays_in_place(act):
    torch.manual_seed(0)
    model, x = ReadsTheInputAgain(act), torch.randn(4, 8)
    converted, changes = abp.convert(model, "lowmembp", example_inputs=(x,), leaky_relu=True)
    assert by_action(changes, "replaced").keys() == {"act"} and converted.act.inplace is True
    torch.testing.assert_close(converted(x), model(x), rtol=1e-6, atol=1e-6)
    converted(x).sum().backward()  # the write is recorded: backward runs
    assert torch.isfinite(converted.fc.weight.grad).all()


@pytest.mark.parametrize("recipe", ["lowmembp", ["lowmembp", "sampled"], "all"])
@pytest.mark.parametrize("leaf", [lambda: nn.GELU(), lambda: nn.LayerNorm(8), lambda: nn.Linear(8, 8)])
def test_a_model_without_submodules_says_convert_replaced_nothing_in_it(recipe, leaf) -> None:
    """A replacement takes a module's place in its parent: a model that is itself a GELU came
    back unchanged with an empty change list, which said nothing."""
    model = leaf()
    converted, changes = abp.convert(model, recipe)
    assert type(converted) is type(model)
    refused = [c for c in changes if c.action == "refused" and "without submodules" in c.detail]
    assert len(refused) == 1 and refused[0].module == "", changes
    assert f"itself a {type(model).__name__} without submodules" in refused[0].detail
    assert "nn.Sequential(module)" in refused[0].detail
    wrapped, changes = abp.convert(nn.Sequential(leaf()), recipe)
    assert not any("without submodules" in c.detail for c in changes)
