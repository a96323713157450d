"""Recipe "sampled" finds the attention-output and feed-forward projections by what one call of the
model computes (abp._roles), whatever the modules are called: hand-built blocks with unusual
names, a fused QKV projection, a router, LoRA wrappers, a block whose FFN runs before its
attention, a model without a layer stack, and a model that carries its own dummy inputs.
The architectures people train are checked in test_models.py."""
from __future__ import annotations

import dataclasses

import math
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abp
from abp import _recognise, _roles, _structure
from abp_reference import library_or_skip


@pytest.fixture(autouse=True)
def library() -> None:
    library_or_skip()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Multi-head attention in plain torch (torch 1.13 has no scaled_dot_product_attention)."""
    b, t, d = q.shape
    split = [x.view(b, t, heads, d // heads).transpose(1, 2) for x in (q, k, v)]
    scores = split[0] @ split[1].transpose(-1, -2) / math.sqrt(d // heads)
    return (scores.softmax(-1) @ split[2]).transpose(1, 2).reshape(b, t, d)


class FusedAttention(nn.Module):
    """One projection for Q, K and V (GPT-2/GPT-NeoX style), names no list knows."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mix_in = nn.Linear(d, 3 * d)
        self.mix_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.mix_in(x).chunk(3, dim=-1)
        return self.mix_out(_attend(q, k, v, heads=2))


class Router(nn.Module):
    """A mixture of two experts: a linear router through softmax and top-1, experts as Linears."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.chooser = nn.Linear(d, 2)
        self.experts = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.chooser(x).softmax(-1)
        top = weights.topk(1, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            out = out + expert(x) * (top.indices == i).to(x.dtype) * top.values
        return out


class Layer(nn.Module):
    def __init__(self, d: int, ffn_first: bool = False, router: bool = False) -> None:
        super().__init__()
        self.ffn_first = ffn_first
        self.pre_a = nn.LayerNorm(d)
        self.pre_b = nn.LayerNorm(d)
        self.mixer = FusedAttention(d)
        self.widen = nn.Linear(d, 2 * d)
        self.narrow = nn.Linear(2 * d, d)
        self.router = Router(d) if router else None

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.narrow(F.gelu(self.widen(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ffn_first:  # Macaron-style: the FFN's output is attended to afterwards
            x = x + self.ffn(self.pre_a(x))
            x = x + self.mixer(self.pre_b(x))
        else:
            x = x + self.mixer(self.pre_a(x))
            x = x + self.ffn(self.pre_b(x))
        if self.router is not None:
            x = x + self.router(x)
        return x


class Net(nn.Module):
    def __init__(self, d: int = 8, layers: int = 2, **kw: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.stack = nn.ModuleList([Layer(d, **kw) for _ in range(layers)])
        self.readout = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.stack:
            h = layer(h)
        return self.readout(h)


def _sampled(model: nn.Module, **kw) -> List[str]:
    _, changes = abp.convert(model, "sampled", **kw)
    return sorted(c.module for c in changes if c.action in ("replaced", "kept"))


def _example() -> torch.Tensor:
    return torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))


def test_blocks_are_the_children_of_a_layer_stack() -> None:
    assert _roles.blocks(Net()) == ["stack.0", "stack.1"]
    timm_like = nn.Sequential(Layer(8), Layer(8))
    assert _roles.blocks(timm_like) == ["0", "1"]
    mixed = nn.Sequential(FusedAttention(8), Layer(8), nn.Linear(8, 8))  # a network, not a stack
    assert _roles.blocks(mixed) == []
    assert _roles.blocks(nn.Sequential(nn.Linear(8, 8), nn.GELU())) == []
    # A CNN's stem and last stage around its repeated blocks (rexnet, torchvision's MobileNet):
    # the repeated class's children are the blocks; with no stack found the whole model was one
    # block, and recipe sampled sampled the classifier head.
    cnn_like = nn.Sequential(FusedAttention(8), Layer(8), Layer(8), Layer(8), nn.Sequential(nn.Linear(8, 8)))
    assert _roles.blocks(cnn_like) == ["1", "2", "3"]
    tie = nn.Sequential(FusedAttention(8), FusedAttention(8), Layer(8), Layer(8))
    assert _roles.blocks(tie) == []
    # Two plain containers are a stem and a head as often as two stages: not blocks; the stack
    # inside the middle part is found on its own.
    stem_body_head = nn.Sequential(nn.Sequential(nn.Linear(4, 8)), Net(), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 3)))
    assert _roles.blocks(stem_body_head) == ["1.stack.0", "1.stack.1"]


class _Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class _Classifier(nn.Module):
    """A stem, repeated blocks and a different last module in one Sequential, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(_Stem(), Layer(8), Layer(8), nn.Sequential(nn.LayerNorm(8)))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(1))


def test_the_head_after_a_cnn_like_stack_stays_exact() -> None:
    torch.manual_seed(0)
    got = _sampled(_Classifier(), example_inputs=_example())
    assert got == [f"features.{i}.{n}" for i in (1, 2) for n in ("mixer.mix_out", "narrow", "widen")]


def test_projections_are_found_by_what_they_compute() -> None:
    torch.manual_seed(0)
    got = _sampled(Net(), example_inputs=_example())
    # mix_in feeds the attention products (exact); embed and readout are outside the blocks.
    assert got == [f"stack.{i}.{n}" for i in range(2) for n in ("mixer.mix_out", "narrow", "widen")]


def test_a_router_stays_exact_and_its_experts_are_sampled() -> None:
    torch.manual_seed(0)
    got = _sampled(Net(router=True), example_inputs=_example())
    per_layer = {n.split(".", 2)[2] for n in got}
    assert per_layer == {"mixer.mix_out", "narrow", "widen", "router.experts.0", "router.experts.1"}


def test_an_ffn_before_the_attention_is_sampled() -> None:
    torch.manual_seed(0)
    got = _sampled(Net(ffn_first=True), example_inputs=_example())
    assert {n.split(".", 2)[2] for n in got} == {"mixer.mix_out", "narrow", "widen"}


class NormedQueryKey(nn.Module):
    """Qwen3 / OLMo2 attention: a norm on the query's and key's projections (per head) before the
    scores, and an output projection; the FFN output is normed before its residual add (Gemma)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.q_norm, self.k_norm = nn.LayerNorm(d // 2), nn.LayerNorm(d // 2)
        self.pre_a, self.pre_b, self.post_ffn = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre_a(x)
        b, t, d = h.shape
        q = self.q_norm(self.q(h).view(b, t, 2, d // 2)).reshape(b, t, d)
        k = self.k_norm(self.k(h).view(b, t, 2, d // 2)).reshape(b, t, d)
        x = x + self.o(_attend(q, k, self.v(h), heads=2))
        return x + self.post_ffn(self.down(F.gelu(self.up(self.pre_b(x)))))


class Stacked(nn.Module):
    """An embedding and two blocks of `block(d)` in a ModuleList, the blocks' layer stack."""

    def __init__(self, block: type, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.blocks = nn.ModuleList([block(d) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def test_a_query_or_key_normed_before_its_scores_stays_exact() -> None:
    """A norm of the projection alone (before any sum with another activation) is followed to the
    scores, so the normed query and key projections stay exact (they were taken for sampled ones
    and put back only because they stored more); a norm after a residual add still ends the path,
    and one on the FFN's output before its add does not make the FFN score."""
    torch.manual_seed(0)
    got = _sampled(Stacked(NormedQueryKey), example_inputs=_example())
    assert {n.split(".", 2)[2] for n in got} == {"o", "up", "down"}


def test_a_model_without_a_layer_stack_is_one_block() -> None:
    torch.manual_seed(0)
    layer = Layer(8)
    got = _sampled(layer, example_inputs=torch.randn(2, 5, 8))
    assert got == ["mixer.mix_out", "narrow", "widen"]


def test_a_parametrized_linear_is_refused_alone_and_is_no_block() -> None:
    """torch.nn.utils.parametrize gives a Linear a `parametrizations` child: it is still one layer
    (no layer stack of one), refused for its parametrization while the others are sampled."""
    from torch.nn.utils import parametrize

    class Identity(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    parametrize.register_parametrization(model[0], "weight", Identity())
    assert _roles.blocks(model) == []
    _, changes = abp.convert(model, "sampled", example_inputs=(torch.randn(4, 8, 16),))
    # The last map's output is the model's result: the head, exact (test_a_head_stays_exact_...).
    assert [(c.module, c.action) for c in changes] == [("0", "refused"), ("2", "replaced")]
    assert "parametrized weights" in changes[0].detail


class Stages(nn.Module):
    """timm's RegNet shape: stages that are attributes of the model (no layer stack), then pooling
    and a classifier, whose logits are returned (soft-capped, and with the features if asked)."""

    def __init__(self, with_features: bool = False) -> None:
        super().__init__()
        self.with_features = with_features
        self.s1, self.s2 = Layer(8), Layer(8)
        self.head = nn.Sequential(nn.Dropout(0.0), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> Any:
        h = self.s2(self.s1(x))
        logits = torch.tanh(self.head(h.mean(1)) / 30.0) * 30.0
        return (logits, h) if self.with_features else logits


@pytest.mark.parametrize("with_features", [False, True])
def test_a_head_stays_exact_where_the_model_has_no_layer_stack(with_features: bool) -> None:
    """Without a layer stack the model is one block, so its classifier was sampled like a
    feed-forward projection (timm's regnetx_002: a 10-class head's weight gradient 1.7 off exact at
    a batch of 48). A map whose output is the model's result, with no residual sum between, is a
    head and stays exact; the blocks' last projections, summed into the stream, are still sampled."""
    torch.manual_seed(0)
    got = _sampled(Stages(with_features), example_inputs=(torch.randn(2, 5, 8),))
    assert got == sorted(f"s{i}.{m}" for i in (1, 2) for m in ("mixer.mix_out", "narrow", "widen"))


class Lora(nn.Module):
    """peft's shape: a frozen base layer plus a trainable low-rank path, added."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, base.out_features, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def test_lora_paths_take_the_role_of_the_layer_they_wrap() -> None:
    torch.manual_seed(0)
    model = Net()
    for layer in model.stack:
        layer.mixer.mix_in = Lora(layer.mixer.mix_in)
        layer.mixer.mix_out = Lora(layer.mixer.mix_out)
    for p in model.parameters():
        p.requires_grad_(False)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)
    _, changes = abp.convert(model, "sampled", example_inputs=_example())
    replaced = sorted(c.module for c in changes if c.action in ("replaced", "kept"))
    # lora_A of mix_in feeds only lora_B, but the wrapper's output is attended to: exact.
    assert replaced == [f"stack.{i}.mixer.mix_out.lora_{ab}.default" for i in range(2) for ab in "AB"]
    frozen = [c.detail for c in changes if c.action == "refused"]
    assert len(frozen) == 1 and frozen[0].startswith("recipe sampled: 6 frozen linear map(s)"), frozen


class WithDummy(Net):
    """A model that carries its own example call, as transformers' models do (``dummy_inputs``)."""

    def __init__(self, works: bool = True) -> None:
        super().__init__()
        self.works = works

    @property
    def dummy_inputs(self) -> Dict[str, torch.Tensor]:
        return {"x": _example() if self.works else torch.randn(2, 5, 7)}


def test_the_models_dummy_inputs_are_the_call_and_names_the_fallback() -> None:
    torch.manual_seed(0)
    assert _sampled(WithDummy()) == _sampled(Net(), example_inputs=_example())
    _, changes = abp.convert(WithDummy(works=False), "sampled")  # its dummy call fails: names, none match
    assert [c.detail for c in changes][0].startswith("recipe sampled: no module name matched layers=")
    assert "pass example_inputs=" in changes[0].detail
    _, changes = abp.convert(Net(), "sampled")  # no call at all
    assert not [c for c in changes if c.action in ("replaced", "kept")]


class Residual(nn.Module):
    """A stackless residual MLP: out = d(gelu(c(h))), summed in place (`out += h`) or not."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.c, self.d = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.d(F.gelu(self.c(h)))
        if self.in_place:
            out += h
            return out
        return h + out


@pytest.mark.parametrize("in_place", [False, True])
def test_a_projection_summed_into_the_result_is_no_head(in_place: bool) -> None:
    """`out += h` kept the returned tensor's identity, so the head test (review) took `d`, summed
    into the stream in place, for the model's result."""
    torch.manual_seed(0)
    assert _sampled(Residual(in_place), example_inputs=(torch.randn(2, 5, 8),)) == ["c", "d"]


@dataclasses.dataclass
class Out:
    logits: torch.Tensor


class Trunk(nn.Module):
    """No residual: a -> gelu -> b -> head. Returns the logits alone, with the trunk's features
    (which the head also reads), or in a dataclass of its own; optionally a LoRA-wrapped head."""

    def __init__(self, returns: str, lora_head: bool = False) -> None:
        super().__init__()
        self.returns = returns
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 16)
        self.head: nn.Module = Lora(nn.Linear(16, 3)) if lora_head else nn.Linear(16, 3)
        if lora_head:
            self.head.base_layer.requires_grad_(True)
        self.register_buffer("prior", torch.randn(3))

    def forward(self, x: torch.Tensor) -> Any:
        features = self.b(F.gelu(self.a(x)))
        logits = self.head(features)
        if self.returns == "logits_plus_prior":  # a registered buffer added: still the result
            return logits + self.prior.to(logits.dtype)
        if self.returns == "logits_and_features":
            return logits, features
        return Out(logits) if self.returns == "dataclass" else logits


@pytest.mark.parametrize("returns,lora_head,want", [
    ("logits", False, ["a", "b"]),
    ("dataclass", False, ["a", "b"]),  # its tensors were not found: the head was sampled
    ("logits", True, ["a", "b"]),  # the adapters of a LoRA-wrapped head were sampled
    # b's output is returned, but the head reads it: b is part of the network, not its result
    ("features", False, ["a", "b"]),
    ("logits_plus_prior", False, ["a", "b"]),  # the buffer counted as an activation: head sampled
])
def test_heads_are_found_through_wrappers_and_containers_and_features_are_no_heads(returns, lora_head, want) -> None:
    torch.manual_seed(0)
    got = _sampled(Trunk(returns if returns != "features" else "logits_and_features", lora_head),
                   example_inputs=(torch.randn(2, 5, 8),))
    assert got == want


def test_converting_a_sampled_model_again_says_it_is_sampled_already() -> None:
    """A second convert found no linear map to choose (abp's layers are not among them) and said the
    call ran none in attention-output or feed-forward position, sending the user to `layers=`."""
    torch.manual_seed(0)
    once, _ = abp.convert(Net(), "sampled", example_inputs=_example())
    _, changes = abp.convert(once, "sampled", example_inputs=_example())
    assert [(c.module, c.action) for c in changes] == [("", "refused")]
    assert changes[0].detail.startswith("recipe sampled: nothing left to sample; 6 linear map(s) are sampled already")


def test_explicit_layers_choose_by_name() -> None:
    torch.manual_seed(0)
    assert _sampled(Net(), example_inputs=_example(), layers=["*.widen"]) == ["stack.0.widen", "stack.1.widen"]


def test_a_sampled_model_computes_the_same_function() -> None:
    torch.manual_seed(0)
    model = Net()
    converted, changes = abp.convert(model, ["lowmembp", "sampled"], example_inputs=_example())
    # `widen` reads the memory-sharing norm's output, which that norm's backward keeps whole: sampling
    # it would save nothing, so it stays exact (abp._composition).
    assert sum(isinstance(m, abp.nn.SampledLinear) for m in converted.modules()) == 4
    assert sorted(c.module for c in changes if c.action == "kept") == ["stack.0.widen", "stack.1.widen"]
    x = _example()
    torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-5)
    converted(x).square().sum().backward()
    assert all(p.grad is not None for p in converted.parameters())


def test_the_recorded_events_carry_the_dataflow() -> None:
    torch.manual_seed(0)
    model = Layer(8)
    structure = _structure.record(model, (torch.randn(1, 3, 8),), {}, [])
    calls = [e.module for e in structure.events if e.module is not None]
    assert calls[-1] == "" and calls.index("mixer.mix_in") < calls.index("mixer.mix_out")
    mix_in = next(e for e in structure.events if e.module == "mixer.mix_in")
    chunk = next(e for e in structure.events if e.function == "chunk")
    assert chunk.inputs == mix_in.outputs and len(chunk.outputs) == 3 and chunk.within == ("", "mixer")
    assert {id(p) for p in model.parameters()} == structure.parameters
    recognised = {id(m): s for m in model.modules() if (s := _recognise.recognise(m)) is not None}
    assert sorted(_roles.sampled_linear_maps(model, structure, recognised)) == ["mixer.mix_out", "narrow", "widen"]


class LayerDropNet(Net):
    """Net whose layers are skipped at random while training (wav2vec2's and BART's LayerDrop)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.stack:
            if not (self.training and float(torch.rand(())) < 0.5):
                h = layer(h)
        return self.readout(h)


def test_the_example_call_runs_every_layer_whatever_the_random_state() -> None:
    """The example call runs in eval mode (modes put back after): LayerDrop leaves no layer out,
    so which layers are sampled does not depend on torch's random state at convert time."""
    torch.manual_seed(0)
    model = LayerDropNet(layers=4).train()
    want = _sampled(Net(layers=4), example_inputs=_example())
    assert len(want) == 12  # each layer's attention output and both FFN projections
    for seed in range(6):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        converted, changes = abp.convert(model, "sampled", example_inputs=_example())
        assert sorted(c.module for c in changes if c.action in ("replaced", "kept")) == want, seed
        assert torch.equal(torch.get_rng_state(), state)  # the call drew from a fork
        assert all(m.training for m in model.modules()) and all(m.training for m in converted.modules())


class SparseRouter(nn.Module):
    """Top-1 routing that runs each expert on its tokens only: an expert no token is routed to
    does not run (here the third, whose router bias is -100)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.chooser = nn.Linear(d, 3)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])
        with torch.no_grad():
            self.chooser.bias.copy_(torch.tensor([0.0, 0.0, -100.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.chooser(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            routed = choice == i
            if bool(routed.any()):
                out[routed] = expert(x[routed])
        return out


class SparseLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = SparseRouter(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


def test_an_expert_the_example_routes_nothing_to_is_sampled_like_the_others() -> None:
    """Which experts run depends on the example batch; one that did not run stands where the
    others stand and is sampled too (it was left exact, unmentioned)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(SparseLayer(8), SparseLayer(8)), nn.Linear(8, 3))
    got = _sampled(model, example_inputs=_example())
    # The chooser feeds argmax (it scores) and stays exact.
    assert got == [f"1.{i}.moe.experts.{e}" for i in range(2) for e in range(3)]


class NormAttentionNorm(nn.Module):
    """DBRX's shape: one module holds the first norm, the attention and the second norm, and
    returns the second norm's output (which the experts read) beside the residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm_1, self.attn, self.norm_2 = nn.LayerNorm(d), FusedAttention(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor):
        h = x + self.attn(self.norm_1(x))
        return h, self.norm_2(h)


class IndexedExperts(nn.Module):
    """Experts as one parameter, the chosen expert's weight picked by the router's index and
    multiplied with the tokens (DBRX's, Mixtral's fused form): a product whose one operand is a
    parameter picked by an activation."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, 2)
        self.weight = nn.Parameter(torch.randn(2, d, d) / d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).softmax(-1).argmax(-1)
        return torch.matmul(x.unsqueeze(-2), self.weight[chosen]).squeeze(-2)


class NormAttentionNormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm_attn_norm, self.ffn = NormAttentionNorm(d), IndexedExperts(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, normed = self.norm_attn_norm(x)
        return h + self.ffn(normed)


def test_a_module_holding_the_attention_and_a_norm_does_not_speak_for_its_output_projection() -> None:
    # Its output is past its second norm, and reaches the experts' product: taken for the output
    # projection's, it refused the projection ("ran no linear map in attention-output position").
    torch.manual_seed(0)
    got = _sampled(Stacked(NormAttentionNormBlock), example_inputs=_example())
    assert got == ["blocks.0.norm_attn_norm.attn.mix_out", "blocks.1.norm_attn_norm.attn.mix_out"]


class _TwoTowers(nn.Module):
    """A text stack and an image stack; the image stack runs only when images are passed."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.ModuleList([Layer(4), Layer(4)])
        self.vision = nn.ModuleList([Layer(4), Layer(4)])

    def forward(self, x: torch.Tensor, images: Optional[torch.Tensor] = None) -> torch.Tensor:
        for layer in self.text:
            x = layer(x)
        if images is not None:
            for layer in self.vision:
                images = layer(images)
            x = x + images.mean(1, keepdim=True)
        return x


def test_blocks_the_example_never_ran_are_named_and_stay_exact() -> None:
    # LLaVA converted with an example without pixel_values: no line said that the vision tower's
    # linear maps were left exact.
    torch.manual_seed(0)
    _, changes = abp.convert(_TwoTowers(), "sampled", example_inputs=(_example(),))
    sampled = sorted(c.module for c in changes if c.action == "replaced")
    assert sampled and all(name.startswith("text.") for name in sampled)
    notes = [c.detail for c in changes if c.action == "refused"]
    assert notes == ["recipe sampled: the example call did not run 2 block(s) holding linear maps (`vision.0`, "
                     "`vision.1`), whose roles it therefore cannot tell: they stay exact; give an example that runs "
                     "them (every input the model takes, e.g. its images as well) or layers=[...]"]
    _, changes = abp.convert(_TwoTowers(), "sampled", example_inputs=(_example(), _example()))
    assert not [c for c in changes if c.action == "refused"]
    assert {c.module.split(".")[0] for c in changes if c.action == "replaced"} == {"text", "vision"}


class _SkipsItsLastLayer(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.stack[:-1]:
            h = layer(h)
        return self.readout(h)


def test_a_block_sampled_like_the_ones_that_ran_is_not_called_idle() -> None:
    # Its maps are sampled by analogy (as `stack.0...`): a note saying they stay exact would
    # contradict the replaced lines.
    torch.manual_seed(0)
    _, changes = abp.convert(_SkipsItsLastLayer(layers=3), "sampled", example_inputs=(_example(),))
    assert {c.module for c in changes if c.action == "replaced" and c.module.startswith("stack.2.")}
    assert not [c for c in changes if c.action == "refused"]
