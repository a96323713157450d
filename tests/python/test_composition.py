"""abp.convert keeps a replacement only where it saves memory, counted on the example call
(abp._composition), with the size thresholds off while it counts (abp._scale)."""
from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import abp
from abp import _composition, _scale, compress, sampling
from abp_reference import library_or_skip


@pytest.fixture(autouse=True)
def library() -> None:
    library_or_skip()


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class GatedBlock(nn.Module):
    """A LLaMA-style feed-forward block (names no list knows): norm, SwiGLU, residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = RMSNorm(d)
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.act = nn.SiLU()
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(self.act(self.gate(h)) * self.up(h))


class PlainBlock(nn.Module):
    """A pre-LN feed-forward block whose first linear map reads the norm's output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.widen = nn.Linear(d, 2 * d)
        self.narrow = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.narrow(F.gelu(self.widen(self.norm(x))))


def _net(block: type, d: int = 16, layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, d), *[block(d) for _ in range(layers)], nn.Linear(d, 3))


def _example(rows: int = 6) -> torch.Tensor:
    return torch.randn(2, rows, 4, generator=torch.Generator().manual_seed(1))


def _count(model: nn.Module, x: torch.Tensor) -> int:
    return _composition.saved_bytes_of_call(model, ((x,), {}))


def _actions(changes: List[abp.convert_.Change], action: str) -> List[str]:
    return sorted(c.module for c in changes if c.action == action)


def test_the_combined_recipe_stores_no_more_than_compress_alone_and_each_kept_back_group_would_store_more() -> None:
    model, x = _net(GatedBlock), _example()
    combined, changes = abp.convert(model, ["lowmembp", "compress"], example_inputs=x)
    alone, _ = abp.convert(model, "compress")
    assert _count(combined, x) <= _count(alone, x)
    kept = [c for c in changes if c.action == "kept"]
    if torch.__version__ >= "2":  # compress_saved recomputes the exact SiLU's output from its input
        assert {"1.act", "2.act"} <= set(_actions(changes, "kept")), changes
        assert all("ReSiLU2" in c.detail and "under compress_saved(bits=8)" in c.detail for c in kept if "act" in c.module)
    # The activations put back would store more if they were replaced again (the count that decided).
    if any("act" in c.module for c in kept):
        again, _ = abp.convert(combined, "lowmembp", norms=False)
        assert isinstance(again.get_submodule("1.act"), abp.nn.ReSiLU2)
        assert _count(again, x) > _count(combined, x)
    torch.testing.assert_close(combined(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_layer_whose_input_another_op_keeps_is_not_sampled_unless_named() -> None:
    # `widen` reads the memory-sharing norm's output, which that norm's backward keeps whole.
    model, x = _net(PlainBlock), _example()
    converted, changes = abp.convert(model, ["lowmembp", "sampled"], example_inputs=x)
    assert _actions(changes, "kept") == ["1.widen", "2.widen"]
    # One decision for the group, which each member's change says.
    assert all("at *.widen (one decision for these 2 modules)" in c.detail for c in changes if c.action == "kept")
    assert isinstance(converted.get_submodule("1.narrow"), abp.nn.SampledLinear)
    sampled_too, named = abp.convert(model, ["lowmembp", "sampled"], example_inputs=x, layers=["*.widen", "*.narrow"])
    assert not _actions(named, "kept") and isinstance(sampled_too.get_submodule("1.widen"), abp.nn.SampledLinear)
    assert _count(sampled_too, x) > _count(converted, x)


def test_an_activation_named_by_the_caller_stays_replaced() -> None:
    model, x = _net(GatedBlock), _example()
    _, changes = abp.convert(model, ["lowmembp", "compress"], example_inputs=x, silu="resilu2")
    assert "1.act" in _actions(changes, "replaced")


def test_without_a_call_to_count_every_replacement_stays_and_convert_says_so() -> None:
    model = _net(GatedBlock)
    _, changes = abp.convert(model, ["lowmembp", "compress"])
    assert not _actions(changes, "kept") and "1.act" in _actions(changes, "replaced")
    assert any(c.action == "refused" and "no call to count what each replacement saves" in c.detail for c in changes)


def test_a_model_in_eval_mode_is_counted_as_it_will_train() -> None:
    # from_pretrained returns a model in eval mode, where a sampled layer is a plain Linear.
    model, x = _net(PlainBlock), _example()
    trained = abp.convert(model, ["lowmembp", "sampled"], example_inputs=x)[1]
    evaluated, changes = abp.convert(model.eval(), ["lowmembp", "sampled"], example_inputs=x)
    assert [(c.module, c.action) for c in changes] == [(c.module, c.action) for c in trained]
    assert not any(m.training for m in evaluated.modules())


def test_an_example_that_cannot_train_leaves_the_replacements_and_says_why() -> None:
    # One image: BatchNorm in training mode needs more than one value per channel after pooling.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(8), nn.SiLU(), nn.Flatten(),
                          nn.Linear(8, 3))
    converted, changes = abp.convert(model, "all", example_inputs=torch.randn(1, 3, 8, 8))
    notes = [c.detail for c in changes if c.action == "refused" and "in training mode, failed" in c.detail]
    assert len(notes) == 1 and "Expected more than 1 value per channel" in notes[0], changes
    assert isinstance(converted.get_submodule("3"), abp.nn.SiLU)  # replaced, not counted
    converted(torch.randn(4, 3, 8, 8)).sum().backward()


def test_an_example_made_under_inference_mode_is_counted() -> None:
    model = _net(PlainBlock)
    with torch.inference_mode():
        x = _example()
    want = abp.convert(model, ["lowmembp", "sampled"], example_inputs=_example())[1]
    got = abp.convert(model, ["lowmembp", "sampled"], example_inputs=x)[1]
    assert [(c.module, c.action) for c in got] == [(c.module, c.action) for c in want]
    # Converted under inference_mode, too: the copy's parameters are ordinary tensors, and it trains.
    with torch.inference_mode():
        converted, inside = abp.convert(model, ["lowmembp", "sampled"], example_inputs=x)
    assert [(c.module, c.action) for c in inside] == [(c.module, c.action) for c in want]
    assert not any(p.is_inference() for p in converted.parameters())
    converted(_example()).sum().backward()


def test_the_decision_does_not_depend_on_the_example_being_small() -> None:
    # 2 x 3 = 6 token rows: fewer than WTA-CRS's floor of 10, which would keep every row (and save
    # nothing) outside the count; 2 x 64 rows are past it. Both decide the same.
    model = _net(PlainBlock)
    small = abp.convert(model, ["lowmembp", "sampled", "compress"], example_inputs=_example(3))[1]
    large = abp.convert(model, ["lowmembp", "sampled", "compress"], example_inputs=_example(64))[1]
    assert [(c.module, c.action) for c in small] == [(c.module, c.action) for c in large]


def test_size_thresholds_are_off_inside_ignored_only() -> None:
    x = torch.randn(8, 8)
    assert sampling.minimum_kept("wtacrs") == 10
    kind, kept = sampling.sampled_residuals(x, "wtacrs", 0.3, 1, None)
    assert kind == "exact"  # 8 rows: the floor of 10 keeps them all
    with _scale.ignored():
        assert sampling.minimum_kept("wtacrs") == 1
        kind, kept = sampling.sampled_residuals(x, "wtacrs", 0.3, 1, None)
        assert kind == "rows" and kept[0].shape[0] == 2  # floor(8 x 0.3)
        small = x.requires_grad_() * 1.0  # an activation of 64 elements
        assert compress.eligible(small, 1024)
    assert not compress.eligible(small, 1024)


def test_counting_leaves_no_trace_on_the_model_or_the_random_streams() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), GatedBlock(16), nn.Linear(16, 3))
    x = torch.randn(8, 4)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    converted, changes = abp.convert(model, "all", example_inputs=x)
    assert torch.equal(torch.get_rng_state(), before)
    bn = converted.get_submodule("1")
    assert torch.equal(bn.running_mean, torch.zeros(16)) and int(bn.num_batches_tracked) == 0
    assert any(c.action == "kept" for c in changes) or torch.__version__ < "2"


def test_the_count_runs_with_gradients_even_when_convert_does_not() -> None:
    model, x = _net(PlainBlock), _example()
    want = abp.convert(model, ["lowmembp", "sampled"], example_inputs=x)[1]
    with torch.no_grad():
        got = abp.convert(model, ["lowmembp", "sampled"], example_inputs=x)[1]
    assert [(c.module, c.action) for c in got] == [(c.module, c.action) for c in want]


def test_a_folded_norm_is_never_put_back() -> None:
    norm = nn.LayerNorm(8)
    folded = abp.nn.MSLayerNorm(8)  # no affine: gamma and beta went into the next linear maps
    assert not _composition.Candidate("n", ("n",), norm, folded, "lowmembp").revertible()
    kept = abp.nn.MSLayerNorm(8, elementwise_affine=True)
    kept.weight, kept.bias = norm.weight, norm.bias
    assert _composition.Candidate("n", ("n",), norm, kept, "lowmembp").revertible()
    assert _composition.Candidate("a.3.b", ("a.3.b",), nn.GELU(), abp.nn.ReGELU2(), "lowmembp").pattern == "a.*.b"


class Checkpointed(nn.Module):
    """Each block under torch.utils.checkpoint: forward saves only the blocks' inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net(GatedBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[0](x)
        for block in list(self.net)[1:-1]:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.net[-1](h)


def test_a_tie_keeps_the_replacement_as_inside_checkpointed_blocks() -> None:
    import torch.utils.checkpoint  # noqa: F401

    model, x = Checkpointed(), _example()
    converted, changes = abp.convert(model, ["lowmembp", "compress"], example_inputs=x)
    assert not _actions(changes, "kept"), changes
    assert isinstance(converted.get_submodule("net.1.act"), abp.nn.ReSiLU2)
    assert _count(converted, x) == _count(abp.convert(model, "compress")[0], x)


class BySize(nn.Module):
    """Other blocks for batches of more than 4 (the example's batch of 2 never runs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.small = _net(GatedBlock)
        self.big = _net(GatedBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.big if x.shape[0] > 4 else self.small)(x)


def test_a_group_the_example_never_runs_follows_the_groups_of_its_classes_that_ran() -> None:
    model = BySize()
    converted, changes = abp.convert(model, ["lowmembp", "compress"], example_inputs=_example())
    kept = {c.module: c.detail for c in changes if c.action == "kept"}
    if torch.__version__ >= "2":  # the ReSiLU2 that ran are put back (see the first test)
        assert {"small.1.act", "small.2.act", "big.1.act", "big.2.act"} <= set(kept), changes
        assert "did not run big.*.act" in kept["big.1.act"] and "at small.*.act" in kept["big.1.act"]
    ran = {n for n in kept if n.startswith("small")}
    idle = {n for n in kept if n.startswith("big")}
    assert idle == {n.replace("small", "big") for n in ran}
    large = torch.randn(8, 6, 4)
    assert _count(converted, large) <= _count(abp.convert(model, "compress")[0], large)


def test_a_model_already_under_compress_counts_a_later_recipe_there() -> None:
    model, x = _net(GatedBlock), _example()
    compressed, _ = abp.convert(model, "compress")
    _, changes = abp.convert(compressed, "lowmembp", example_inputs=x)
    _, together = abp.convert(model, ["lowmembp", "compress"], example_inputs=x)
    assert [(c.module, c.action) for c in changes] == [(c.module, c.action) for c in together if c.module]
    assert all("under compress_saved(bits=8)" in c.detail for c in changes if c.action == "kept")


def test_a_narrow_layers_kept_rows_are_coded_when_its_input_would_be() -> None:
    # A rank-4 layer (a LoRA B) on 512 rows: its input has 2048 elements, over min_numel = 1024,
    # and is coded; 30 % of its rows (153 x 4 = 612 elements) are under it. The kept rows are
    # tested on the input's size, as the count (thresholds off) assumed: coded too.
    torch.manual_seed(0)
    layer = abp.nn.SampledLinear(4, 8, bias=False, keep=0.3)
    x = torch.randn(512, 4, requires_grad=True) * 1.0
    with compress.compress_saved(bits=4) as block:
        layer(x).sum().backward()
    kept_rows = int(0.3 * 512) * 4
    assert block.stats["compressed"] == 1
    assert block.stats["bytes_compressed"] < kept_rows * 4 / 4  # 4-bit codes and group headers, not fp32
    # Rows sampled from an input under min_numel stay raw, as that input would.
    small = torch.randn(200, 4, requires_grad=True) * 1.0
    with compress.compress_saved(bits=4) as block:
        layer(small).sum().backward()
    assert block.stats["compressed"] == 0


@pytest.mark.parametrize("kinds", ["one", "two"])
def test_groups_that_each_tie_alone_are_put_back_together_where_that_stores_less(kinds: str) -> None:
    """The norms of a tiny Mixtral under recipe "all" stored the same bytes with any one of their
    three groups put back and 5 % fewer with all of them, so each stayed and "all" stored more
    than "compress" alone. Two groups (of one kind of replacement, or of two) that tie alone but
    not together are put back together; a third whose putting back changes nothing stays."""
    model = nn.Sequential(nn.LayerNorm(4), nn.LayerNorm(4), nn.GELU())
    firsts = [model[0], model[1], model[2]]
    news: List[nn.Module] = [abp.nn.MSLayerNorm(4, elementwise_affine=True) for _ in range(2)] + [abp.nn.ReGELU2()]
    second = "compress" if kinds == "two" else "lowmembp"
    candidates = [_composition.Candidate("0.a", ("0",), firsts[0], news[0], "lowmembp"),
                  _composition.Candidate("1.b", ("1",), firsts[1], news[1], second),
                  _composition.Candidate("2", ("2",), firsts[2], news[2], "lowmembp")]
    for norm, new in zip(firsts[:2], news[:2]):
        new.weight, new.bias = norm.weight, norm.bias  # revertible: the original's parameters stay
    for i, new in enumerate(news):
        model[i] = new

    def count() -> int:
        model(torch.zeros(1, 4))  # every group runs
        both_back = model[0] is firsts[0] and model[1] is firsts[1]
        return 90 if both_back else 100

    put_back, error = _composition.keep_what_saves(model, candidates, count)
    assert error is None
    assert sorted(p.candidate.name for p in put_back) == ["0.a", "1.b"]
    assert all((p.with_bytes, p.without_bytes) == (100, 90) for p in put_back)
    assert model[0] is firsts[0] and model[1] is firsts[1] and model[2] is news[2]


def test_a_mixture_of_experts_model_converted_with_all_stores_no_more_than_with_compress() -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MixtralConfig"):
        pytest.skip("this transformers has no Mixtral")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                        num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 100, (8, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}

    def stored(recipe: str) -> int:
        converted, _ = abp.convert(model, recipe, example_kwargs=batch)
        return abp.memory.report(converted, kwargs=batch, loss_fn=lambda out: out.loss).total_bytes

    assert stored("all") <= stored("compress")
