"""abp.convert (LowMemoryBP recipe) and abp.memory.report on small models written in plain torch.

The converted model must compute the same function (float64: outputs and input gradients to
1e-10) and its gradients must be the original's through the fold's chain rule; what it saves must
drop by exactly the norm inputs and LayerNorm's mean (its 1/sigma becomes ours); refusals must leave
the model unchanged and say why.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Dict, List, Tuple

import pytest
import torch
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


def folds_of(changes: List[abp.Change]) -> Dict[str, List[str]]:
    """norm -> the Linear layers its affine parameters were folded into, from the change list."""
    folds: Dict[str, List[str]] = {}
    for c in changes:
        if c.action == "folded":
            folds.setdefault(c.detail.rsplit("`", 2)[1], []).append(c.module)
    return folds


def assert_gradients_follow_the_fold(original: nn.Module, g0: Dict[str, torch.Tensor], g1: Dict[str, torch.Tensor],
                                     folds: Dict[str, List[str]]) -> None:
    """Every gradient of the original model, recovered exactly from the converted model's.

    A consumer of z = gamma * xhat + beta computes W z + b = W' xhat + b' (W' = W diag(gamma),
    b' = b + W beta), so with G its output gradient: dW = G z^T = dW' diag(gamma) + db' beta^T,
    db = db', dgamma = sum over consumers of column sums of dW' * W, dbeta = sum of W^T db'.
    Parameters the fold did not touch must get identical gradients.
    """
    close = lambda a, b, what: torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=what)  # noqa: E731
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
        assert not any(n.startswith(f"{norm_name}.") for n in g1), "the replaced norm has no parameters"
    for name, g in g0.items():
        if name not in checked:
            close(g1[name], g, name)


def test_vit_conversion_folds_every_pre_ln_norm_and_keeps_the_function():
    model = make(ViT)
    converted, changes = abp.convert(model, gelu=None)
    replaced, folded = by_action(changes, "replaced"), by_action(changes, "folded")
    norms = ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
    assert set(replaced) == set(norms) and not by_action(changes, "refused")
    assert folds_of(changes) == {**{f"blocks.{i}.norm1": [f"blocks.{i}.attn.{p}" for p in "qkv"] for i in (0, 1)},
                                 **{f"blocks.{i}.norm2": [f"blocks.{i}.fc1"] for i in (0, 1)}, "norm": ["head"]}
    assert all(isinstance(converted.get_submodule(n), abp.nn.MSLayerNorm) for n in norms)
    assert isinstance(model.blocks[0].norm1, nn.LayerNorm), "inplace=False must not touch the original"
    assert all("float64" in d for d in folded.values())

    x = torch.randn(2, 6, 32, dtype=torch.float64)
    out0, dx0, g0 = grads(model, x)
    out1, dx1, g1 = grads(converted, x)
    torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=1e-10)
    assert_gradients_follow_the_fold(model, g0, g1, folds_of(changes))


def test_llama_conversion_folds_rmsnorms_into_qkv_gate_up_and_lm_head():
    model = make(LlamaBlock)
    converted, changes = abp.convert(model, silu=None)
    assert folds_of(changes) == {"input_layernorm": ["attn.q", "attn.k", "attn.v"],
                                 "post_attention_layernorm": ["gate", "up"], "final_norm": ["lm_head"]}
    assert all(isinstance(converted.get_submodule(n), abp.nn.MSRMSNorm)
               for n in ("input_layernorm", "post_attention_layernorm", "final_norm"))
    assert converted.input_layernorm.eps == 1e-6 and converted.input_layernorm.normalized_shape == (32,)
    assert converted.lm_head.bias is None, "RMSNorm has no beta: no bias is added"
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    out0, dx0, g0 = grads(model, x)
    out1, dx1, g1 = grads(converted, x)
    torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=1e-10)
    assert_gradients_follow_the_fold(model, g0, g1, folds_of(changes))


@pytest.mark.parametrize("breakage", ["beta forgotten", "gamma times 0.9"])
def test_a_broken_fold_fails_the_checks(breakage):
    """Negative controls: a fold with b' = b, or with 0.9 gamma, must fail the output and gradient checks."""
    model = make(ViT)
    converted, changes = abp.convert(model, gelu=None)
    with torch.no_grad():
        q = converted.blocks[0].attn.q
        if breakage == "beta forgotten":
            q.bias.copy_(model.blocks[0].attn.q.bias)
        else:
            q.weight.mul_(0.9)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    out0, _, g0 = grads(model, x)
    out1, _, g1 = grads(converted, x)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out1, out0, rtol=0, atol=1e-10)
    with pytest.raises(AssertionError):
        assert_gradients_follow_the_fold(model, g0, g1, folds_of(changes))


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


class Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def into_parametrized_linear() -> nn.Module:
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    torch.nn.utils.parametrize.register_parametrization(model[1], "weight", Doubled())
    return model


def hooked_norm() -> nn.Module:
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    model[0].register_forward_hook(_record_norm_output)
    return model


def _record_norm_output(module: nn.Module, args: Tuple[torch.Tensor], output: torch.Tensor) -> None:
    module.last_mean = float(output.detach().mean())


class ReadsNormWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(self.norm(x)) * self.norm.weight


def encoder_layer() -> nn.Module:
    # torch.fx keeps torch.nn's own layers as single calls: their norms' consumers are invisible.
    return nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True))


@pytest.mark.parametrize(
    "make_model,name,reason",
    [
        (post_ln_block, "norm", "feeds `add` (call_function), not only Linear layers"),
        (NormIntoSlice, "norm", "feeds `getitem` (call_function), not only Linear layers"),
        (Tied, "norm", "Linear `head` shares its parameters with embed.weight"),
        (Gemma, "norm", "GemmaRMSNorm does not compute rmsnorm: probe mismatch"),
        (Untraceable, "norm", "could not be traced by torch.fx"),
        (NormCalledTwice, "norm", "it is called 2 times in the traced graph"),
        (LinearCalledTwice, "norm", "Linear `q` is called 2 times"),
        (TwoDimNorm, "norm", "normalized_shape (3, 16) spans several dimensions"),
        (IntoLoRA, "norm", "Linear `q` (LoRALinear) has its own forward"),
        (into_parametrized_linear, "0", "Linear `1` has parametrized weights"),
        (hooked_norm, "0", "LayerNorm not replaced: it has forward hooks"),
        (ReadsNormWeight, "norm", "forward also reads `norm.weight` directly"),
        (encoder_layer, "0.norm1", "it runs inside `0` (TransformerEncoderLayer), which torch.fx keeps as one opaque call"),
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
    assert converted[1].bias.requires_grad and "bias" in dict(converted[1].named_parameters())
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)


def test_fold_keeps_the_linear_and_its_parameter_objects():
    """In place, an optimizer built before the conversion still holds the Linear's parameters."""
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4, bias=False)).double()
    randomize_norms(model)
    linear, weight = model[1], model[1].weight
    converted, _ = abp.convert(model, inplace=True)
    assert converted[1] is linear and converted[1].weight is weight


def test_norm_with_zero_beta_adds_no_bias():
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4, bias=False)).double()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    converted, changes = abp.convert(model)
    assert converted[1].bias is None and "bias added" not in by_action(changes, "folded")["1"]
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)


def test_weight_norm_linear_is_refused_in_place_and_cannot_be_deep_copied():
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
            abp.convert(model)
    converted, changes = abp.convert(model, inplace=True)
    assert "Linear `1` has forward pre-hooks" in by_action(changes, "refused")["0"]
    assert isinstance(converted[0], nn.LayerNorm)
    torch.testing.assert_close(converted(x), before, rtol=0, atol=0)


def test_a_module_registered_twice_is_replaced_at_both_paths():
    act = nn.GELU()
    model = nn.Sequential(nn.Linear(8, 8), act, nn.Linear(8, 8), act, nn.LayerNorm(8, elementwise_affine=False))
    model.extra = model[4]
    converted, changes = abp.convert(model)
    assert isinstance(converted[1], abp.nn.ReGELU2) and converted[3] is converted[1]
    assert isinstance(converted[4], abp.nn.MSLayerNorm) and converted.extra is converted[4]
    assert "also registered as `3`" in by_action(changes, "replaced")["1"]


def test_hooked_activation_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU())
    model[1].register_forward_hook(lambda m, args, out: None)
    converted, changes = abp.convert(model)
    assert "SiLU not replaced: it has forward hooks" in by_action(changes, "refused")["1"]
    assert type(converted[1]) is nn.SiLU


class EpsRMSNorm(nn.Module):
    """An RMSNorm look-alike that names its epsilon `eps` and computes in the input dtype."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_rms_norm_look_alike_with_eps_attribute():
    model = nn.Sequential(EpsRMSNorm(16, eps=1e-4), nn.Linear(16, 8)).double()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    converted, changes = abp.convert(model)
    assert isinstance(converted[0], abp.nn.MSRMSNorm) and converted[0].eps == 1e-4
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-10)


class StandInTorchRMSNorm(nn.Module):
    """torch.nn.RMSNorm's documented interface and function, for torch < 2.4 (eps=None: finfo(x.dtype).eps)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True) -> None:
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        dims = tuple(range(-len(self.normalized_shape), 0))
        y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
        return y * self.weight if self.weight is not None else y


@pytest.fixture
def torch_rms_norm(monkeypatch):
    """torch.nn.RMSNorm where torch has it (>= 2.4), else the stand-in installed as nn.RMSNorm."""
    if not hasattr(nn, "RMSNorm"):
        monkeypatch.setattr(nn, "RMSNorm", StandInTorchRMSNorm, raising=False)
    return nn.RMSNorm


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_torch_rms_norm(torch_rms_norm, eps):
    model = nn.Sequential(torch_rms_norm(16, eps=eps), nn.Linear(16, 8), torch_rms_norm(8, elementwise_affine=False))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    converted, changes = abp.convert(model)
    assert isinstance(converted[0], abp.nn.MSRMSNorm) and isinstance(converted[2], abp.nn.MSRMSNorm)
    assert converted[0].eps == (torch.finfo(torch.float32).eps if eps is None else eps)
    assert by_action(changes, "folded") == {"1": "folded gamma in float64 from `0`"}
    assert not by_action(changes, "refused")
    x = torch.randn(3, 16)
    torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"recipe": "fewbit"}, ValueError, "recipe: expected one of lowmembp, sampled, got 'fewbit'"),
        ({"nonsense": 1}, TypeError, "unknown override\\(s\\) nonsense for recipe 'lowmembp'; valid keywords are norms, gelu, silu"),
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
    with pytest.raises(TypeError, match="inplace: expected True or False, got 'yes'"):
        abp.convert(nn.Linear(2, 2), inplace="yes")  # type: ignore[arg-type]


def test_exports():
    assert abp.convert is abp.convert_.convert and abp.Change is abp.convert_.Change
    assert abp.convert_.RECIPES == ("lowmembp", "sampled")
    with pytest.raises(dataclasses.FrozenInstanceError):
        abp.Change("a", "replaced", "x").module = "b"  # type: ignore[misc]
