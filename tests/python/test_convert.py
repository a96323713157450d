"""abp.convert (LowMemoryBP recipe) and abp.memory.report on small models written in plain torch.

The converted model must compute the same function (float64: outputs and input gradients to
1e-10) and its gradients must be the original's through the fold's chain rule; what it saves must
drop by exactly the norm inputs and LayerNorm's mean (its 1/sigma becomes ours); refusals must leave
the model unchanged and say why.
"""
from __future__ import annotations

import copy
import math
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abp
from abp_reference import library_or_skip


@pytest.fixture(autouse=True)
def _library() -> None:
    library_or_skip()


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.q, self.k, self.v = nn.Linear(d, d, bias=bias), nn.Linear(d, d, bias=bias), nn.Linear(d, d, bias=bias)
        self.out = nn.Linear(d, d, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # Written so that torch.fx can trace it (no unpacking of h.shape), as abp.convert needs.
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


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm, as HF writes it (float32 inside)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


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


def randomize_norms(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, RMSNorm)):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.3)


def make(cls, dtype=torch.float64):
    torch.manual_seed(0)
    model = cls().to(dtype)
    randomize_norms(model)
    return model


def grads(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def by_action(changes: List[abp.Change], action: str) -> Dict[str, str]:
    return {c.module: c.detail for c in changes if c.action == action}


def test_vit_conversion_folds_every_pre_ln_norm_and_keeps_the_function():
    model = make(ViT)
    converted, changes = abp.convert(model, gelu=None)
    replaced, folded = by_action(changes, "replaced"), by_action(changes, "folded")
    norms = ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
    assert set(replaced) == set(norms) and not by_action(changes, "refused")
    assert set(folded) == {f"blocks.{i}.attn.{p}" for i in (0, 1) for p in "qkv"} | {
        "blocks.0.fc1", "blocks.1.fc1", "head"}
    assert all(isinstance(converted.get_submodule(n), abp.nn.MSLayerNorm) for n in norms)
    assert isinstance(model.blocks[0].norm1, nn.LayerNorm), "inplace=False must not touch the original"

    x = torch.randn(2, 6, 32, dtype=torch.float64)
    out0, dx0, g0 = grads(model, x)
    out1, dx1, g1 = grads(converted, x)
    torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=1e-10)
    # Parameters the fold did not touch get the same gradients.
    for name, g in g1.items():
        linear = name.rsplit(".", 1)[0]
        if linear not in folded:
            torch.testing.assert_close(g, g0[name], rtol=0, atol=1e-10, msg=name)
    # Folded Linears: with z = gamma * xhat + beta, dW = dW' diag(gamma) + db beta^T and db = db'.
    for block in ("blocks.0", "blocks.1"):
        for norm, consumers in (("norm1", ["attn.q", "attn.k", "attn.v"]), ("norm2", ["fc1"])):
            gamma = model.get_submodule(f"{block}.{norm}").weight.detach()
            beta = model.get_submodule(f"{block}.{norm}").bias.detach()
            dgamma = torch.zeros_like(gamma)
            dbeta = torch.zeros_like(beta)
            for c in consumers:
                name = f"{block}.{c}"
                w = model.get_submodule(name).weight.detach()
                dw1, db1 = g1[f"{name}.weight"], g1[f"{name}.bias"]
                torch.testing.assert_close(db1, g0[f"{name}.bias"], rtol=0, atol=1e-10)
                torch.testing.assert_close(dw1 * gamma + torch.outer(db1, beta), g0[f"{name}.weight"], rtol=0, atol=1e-10)
                dgamma += (dw1 * w).sum(0)
                dbeta += w.t() @ db1
            # The norm's own gradients follow from the converted model's (chain rule through the fold).
            torch.testing.assert_close(dgamma, g0[f"{block}.{norm}.weight"], rtol=0, atol=1e-10)
            torch.testing.assert_close(dbeta, g0[f"{block}.{norm}.bias"], rtol=0, atol=1e-10)


def test_llama_conversion_folds_rmsnorms_into_qkv_gate_up_and_lm_head():
    model = make(LlamaBlock)
    converted, changes = abp.convert(model, silu=None)
    assert set(by_action(changes, "folded")) == {"attn.q", "attn.k", "attn.v", "gate", "up", "lm_head"}
    assert all(isinstance(converted.get_submodule(n), abp.nn.MSRMSNorm)
               for n in ("input_layernorm", "post_attention_layernorm", "final_norm"))
    assert converted.input_layernorm.eps == 1e-6
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    out0, dx0, g0 = grads(model, x)
    out1, dx1, g1 = grads(converted, x)
    torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=1e-10)
    for name in ("attn.out.weight", "down.weight"):
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-10)
    gamma = model.post_attention_layernorm.weight.detach()
    for name in ("gate", "up"):
        torch.testing.assert_close(g1[f"{name}.weight"] * gamma, g0[f"{name}.weight"], rtol=0, atol=1e-10)


def test_float32_conversion_with_activations_stays_close():
    model = make(ViT, torch.float32)
    converted, changes = abp.convert(model)
    assert set(by_action(changes, "replaced")) >= {"blocks.0.act", "blocks.1.act"}
    assert isinstance(converted.blocks[0].act, abp.nn.ReGELU2)
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(converted(x), model(x), rtol=1e-4, atol=1e-4)
    llama, _ = abp.convert(make(LlamaBlock, torch.float32), gelu="gelu_b3", silu="silu_b2_uniform")
    assert isinstance(llama.act, abp.nn.SiLU)


def test_saved_bytes_drop_by_the_norm_inputs_and_means():
    model = make(ViT, torch.float32)
    converted, _ = abp.convert(model, gelu=None)
    # Inputs that require grad, as inside a network (else the first norm saves nothing at all).
    x = torch.randn(3, 7, 32, requires_grad=True)
    report = abp.memory.report(converted, x, baseline=model)
    rows = 3 * 7
    # Each of the 5 LayerNorms saved its input (rows x 32 fp32), mean and rstd (rows fp32 each);
    # each MS norm saves one fp32 per row, and its output is saved by the Linear either way.
    per_norm = rows * 32 * 4 + 2 * rows * 4 - rows * 4
    assert report.baseline_total_bytes - report.total_bytes == 5 * per_norm
    assert report.per_module["blocks.0.norm1"] == rows * 32 * 4 + rows * 4  # its output + 1/sigma
    assert sum(report.per_module.values()) == report.total_bytes
    assert "blocks.0.norm1" in str(report) and "baseline" in str(report)


def test_report_counts_shared_storage_once_and_skips_parameters():
    lin = nn.Linear(8, 8)
    seq = nn.Sequential(lin, nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(5, 8, requires_grad=True)
    r = abp.memory.report(seq, x)
    # Linear 0 saves x (its weight is a parameter); ReLU saves its output, which Linear 2 saves again.
    assert r.per_module == {"0": 5 * 8 * 4, "1": 5 * 8 * 4, "2": 0}
    assert r.total_bytes == 2 * 5 * 8 * 4 and r.baseline_total_bytes is None
    assert lin.weight.grad is not None, "the report ran backward"
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        abp.memory.report(lambda t: t, x)  # type: ignore[arg-type]


def post_ln_block() -> nn.Module:
    class PostLN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(16, 16)
            self.norm = nn.LayerNorm(16)
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x + self.q(x))
            return h + self.fc(h)  # the norm output feeds the residual add: not foldable

    return PostLN()


class NormIntoSlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)[:, 0])


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 16)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


class GemmaRMSNorm(nn.Module):
    """Looks like an RMSNorm but scales by (1 + w): replacing it would change the function."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


class Gemma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = GemmaRMSNorm(16), nn.Linear(16, 16)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.q(self.norm(x)))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if h.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
            return self.q(h)
        return self.q(h) * 2


@pytest.mark.parametrize(
    "make_model,name,reason",
    [
        (post_ln_block, "norm", "feeds `add` (call_function), not only Linear layers"),
        (NormIntoSlice, "norm", "feeds `getitem` (call_function), not only Linear layers"),
        (Tied, "norm", "Linear `head` shares its parameters with embed.weight"),
        (Gemma, "norm", "GemmaRMSNorm does not compute rmsnorm: probe mismatch"),
        (Untraceable, "norm", "could not be traced by torch.fx"),
    ],
)
def test_refusals_leave_the_model_unchanged_and_say_why(make_model, name, reason):
    torch.manual_seed(1)
    model = make_model().double()
    randomize_norms(model)
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    before = model(x)
    converted, changes = abp.convert(model)
    refused = by_action(changes, "refused")
    assert reason in refused[name], refused
    assert type(converted.get_submodule(name)) is type(model.get_submodule(name))
    assert name not in by_action(changes, "replaced")
    torch.testing.assert_close(converted(x), before, rtol=0, atol=1e-12)


def test_tanh_gelu_is_refused_and_norm_without_affine_is_always_replaced():
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=False), nn.GELU(approximate="tanh"), nn.SiLU())
    converted, changes = abp.convert(model)
    assert "approximate='tanh'" in by_action(changes, "refused")["1"]
    assert isinstance(converted[0], abp.nn.MSLayerNorm) and isinstance(converted[2], abp.nn.ReSiLU2)
    assert isinstance(converted[1], nn.GELU)
    x = torch.randn(3, 8)
    torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-5)


def test_norms_false_and_inplace():
    model = make(ViT)
    same, changes = abp.convert(model, norms=False, gelu="gelu_b2", inplace=True)
    assert same is model and isinstance(model.blocks[0].norm1, nn.LayerNorm)
    assert isinstance(model.blocks[0].act, abp.nn.GELU) and all(c.action == "replaced" for c in changes)


def test_bias_added_to_a_consumer_without_one():
    torch.manual_seed(2)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4, bias=False)).double()
    randomize_norms(model)
    converted, changes = abp.convert(model)
    assert converted[1].bias is not None and "bias added" in by_action(changes, "folded")["1"]
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"recipe": "fewbit"}, ValueError, "recipe: expected one of lowmembp, got 'fewbit'"),
        ({"nonsense": 1}, TypeError, "unknown override\\(s\\) nonsense; valid keywords are norms, gelu, silu"),
        ({"gelu": "gelu_b9"}, ValueError, "gelu: expected one of regelu2, gelu_b1"),
        ({"silu": "regelu2"}, ValueError, "silu: expected one of resilu2"),
        ({"norms": "yes"}, TypeError, "norms: expected True or False"),
    ],
)
def test_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        abp.convert(nn.Linear(2, 2), **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got function"):
        abp.convert(lambda x: x)  # type: ignore[arg-type]
