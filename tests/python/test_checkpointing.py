"""abp's ops inside activation checkpointing: torch.utils.checkpoint (use_reentrant True and
False) around plain-torch blocks, and transformers' activation checkpointing of converted models.

The deterministic recipes (lowmembp: memory-sharing norms and ReGELU2/ReSiLU2; lowmembp with the
FewBit gelu_b3/silu_b3 tables) recompute the same ops on the same inputs, so the gradients equal
those without checkpointing bit for bit. They differ from the original model's (the activations'
defined derivative is not GELU's), so the equality also shows that the recomputation ran abp's
ops and their backward. Saved bytes (abp.memory.SavedTensorsCounter, parameters left out): the
forward keeps only the checkpoints' inputs, and a reentrant recomputation saves exactly what the
converted block saves without checkpointing, less than the original block: the saving is kept
where checkpointing's peak is, one block's recomputation.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import abp
from abp import _save_rules
from abp.memory import SavedTensorsCounter, distinct_bytes, model_storages
from abp_reference import MlpBlock as Block, library_on_one_thread, train_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import model_zoo  # noqa: E402  (bench/model_zoo.py: small transformers configs, no downloads; imports them lazily)

RECIPES = {"lowmembp": {}, "fewbit": {"gelu": "gelu_b3", "silu": "silu_b3"}}


_library = pytest.fixture(autouse=True)(library_on_one_thread)


class Net(nn.Module):
    """Two blocks, each checkpointed when `reentrant` is set (True / False: torch's two kinds)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, 4)
        self.reentrant: Optional[bool] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _net() -> Tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    # The input requires grad: reentrant checkpointing gives the parameters no gradient otherwise.
    return Net(), torch.randn(4, 8, 32, requires_grad=True)


def _weighted(y: torch.Tensor) -> torch.Tensor:
    return (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum()


def _grads(model: nn.Module, step: Callable[[], torch.Tensor],
           leaf: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if leaf is not None:
        leaf.grad = None
    step().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if leaf is not None:
        grads["<input>"] = leaf.grad.clone()
    return grads


def _saved(model: nn.Module, layers: List[nn.Module], run: Callable[[], Any],
           loss: Callable[[Any], torch.Tensor]) -> Tuple[int, List[int], List[int]]:
    """Bytes saved by one step (parameters and buffers left out, each storage once): the total of
    the forward `run` (the loss is taken outside the count), and per layer what its submodules
    saved in forward and in backward (a reentrant recomputation). Submodules, not the layer: a
    transformers 5 layer checkpoints its forward, so the layer's own hooks stay outside the
    checkpoint (they see its input saved, and do not run again when it is recomputed)."""
    kept = model_storages(model)
    forward, backward = SavedTensorsCounter(), SavedTensorsCounter()

    def tag(value: Optional[int]) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            forward.tag = backward.tag = value  # only the counter entered now records

        return hook

    handles = []
    for i, layer in enumerate(layers):
        for child in layer.children():
            handles += [child.register_forward_pre_hook(tag(i)), child.register_forward_hook(tag(None))]
    try:
        with forward:
            out = run()
        with backward:
            loss(out).backward()
    finally:
        for h in handles:
            h.remove()

    def per_layer(counter: SavedTensorsCounter) -> List[int]:
        return [distinct_bytes([s for s in counter.tensors if s.tag == i and (s.device, s.storage_ptr) not in kept])
                for i in range(len(layers))]

    total = distinct_bytes([s for s in forward.tensors if (s.device, s.storage_ptr) not in kept])
    return total, per_layer(forward), per_layer(backward)


def _abp_calls(model: nn.Module) -> Tuple[Dict[str, int], List[Any]]:
    """A forward count per abp module (recomputations included), and the hooks' handles."""
    calls: Dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, (abp.nn.AbpActivation, abp.nn.MSLayerNorm, abp.nn.MSRMSNorm)):
            calls[name] = 0

            def count(m: nn.Module, args: Any, out: Any, key: str = name) -> None:
                calls[key] += 1

            handles.append(module.register_forward_hook(count))
    return calls, handles


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_checkpointed_blocks_give_the_gradients_of_the_converted_model(recipe: str, reentrant: bool) -> None:
    net, x = _net()
    converted, changes = abp.convert(net, "lowmembp", **RECIPES[recipe])
    assert sum(c.action == "replaced" for c in changes) == 4  # 2 norms, 2 GELUs
    want = _grads(converted, lambda: _weighted(converted(x)), x)
    calls, handles = _abp_calls(converted)
    converted.reentrant = reentrant
    got = _grads(converted, lambda: _weighted(converted(x)), x)
    for h in handles:
        h.remove()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), (key, float((got[key] - want[key]).abs().max()))
    # Each abp module ran twice: in the forward and in the recomputation.
    assert calls and set(calls.values()) == {2}, calls
    # The negative control: these are not the original model's gradients, so the equality above
    # needs the recomputation's backward to be abp's.
    original = _grads(net, lambda: _weighted(net(x)), x)
    assert max(float((want[k] - original[k]).abs().max()) for k in want) > 1e-3


def test_compress_saved_keeps_a_reentrant_recomputations_saves_as_a_non_reentrant_one_does() -> None:
    """Backward inside the block: a reentrant checkpoint's rerun saves through compress_saved's
    hooks, a non-reentrant one's through torch's own. Both keep them as they are, so the two
    kinds store, count and compute the same: the same codes of the head's input (its key and
    offsets drawn alike), the same gradients bit for bit."""
    from abp import compress

    results = {}
    for reentrant in (True, False):
        net, x = _net()
        net.reentrant = reentrant
        net.zero_grad()
        with compress.compress_saved(bits=4, min_numel=64, generator=torch.Generator().manual_seed(1)) as block:
            _weighted(net(x)).backward()
        results[reentrant] = ({n: p.grad.clone() for n, p in net.named_parameters()}, x.grad.clone(), block.stats)
    (grads_r, dx_r, stats_r), (grads_n, dx_n, stats_n) = results[True], results[False]
    if not torch.__version__.startswith("1."):  # 1.13's non-reentrant checkpoint saves its inputs unseen
        assert stats_r == stats_n  # the reruns' saves neither counted nor coded
    assert stats_r["compressed"] == stats_n["compressed"] > 0 and stats_r["bytes_compressed"] == stats_n["bytes_compressed"]
    assert torch.equal(dx_r, dx_n)
    for name in grads_n:
        assert torch.equal(grads_r[name], grads_n[name]), name


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_checkpointed_forward_keeps_only_the_boundaries_and_the_recomputation_keeps_the_saving(recipe: str) -> None:
    net, x = _net()
    converted, _ = abp.convert(net, "lowmembp", **RECIPES[recipe])
    boundary = x.numel() * x.element_size()  # every block input and the head's input have x's shape

    def saved(model: Net) -> Tuple[int, List[int], List[int]]:
        return _saved(model, list(model.blocks), lambda: model(x), _weighted)

    plain_total, plain, _ = saved(converted)
    _, original, _ = saved(net)
    converted.reentrant = True
    total, in_forward, in_backward = saved(converted)
    # Reentrant: the two checkpoints save their inputs, the head its input; nothing inside a block.
    assert total == 3 * boundary < plain_total, (total, plain_total)
    assert in_forward == [0, 0]
    # Each block's recomputation saves what it saves without checkpointing (same ops, same
    # tensors), well below the original block.
    assert in_backward == plain, (in_backward, plain)
    assert all(p <= 0.6 * o for p, o in zip(plain, original)), (plain, original)
    converted.reentrant = False
    total, in_forward, _ = saved(converted)
    # Non-reentrant: torch's own saved-tensor hooks take every save inside a checkpoint (the
    # innermost hooks win); what reaches outer hooks is at most the boundaries (torch 2.15 saves
    # the checkpoints' inputs through them, torch 1.13 keeps them itself), at least the head's input.
    assert in_forward == [0, 0]
    assert boundary <= total <= 3 * boundary, total


def _hf(name: str) -> Tuple[nn.Module, torch.Tensor]:
    pytest.importorskip("transformers")  # only these tests: the ones above run on torch 1.13 too
    torch.manual_seed(0)
    model, make_input = model_zoo.build(name)
    model.train()
    return model, make_input(0)


def _layers(model: nn.Module) -> List[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _enable_checkpointing(model: nn.Module, reentrant: bool) -> None:
    # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias) to
    # activation_checkpointing_enable; both take the kwargs of torch.utils.checkpoint.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert all(layer.gradient_checkpointing for layer in _layers(model))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_transformers_checkpointing_of_a_converted_model(name: str, recipe: str, reentrant: bool) -> None:
    model, ids = _hf(name)
    converted, _ = abp.convert(model, "lowmembp", **RECIPES[recipe])
    layers = _layers(converted)
    assert len(layers) == 2

    # No KV cache: checkpointing turns it off, and the cache's copies of the keys and values would
    # be saved instead of views of the projection's output (GPT-2), a difference not abp's.
    def step() -> torch.Tensor:
        return converted(input_ids=ids, labels=ids, use_cache=False).loss

    def saved(m: nn.Module, layers: List[nn.Module]) -> Tuple[int, List[int], List[int]]:
        return _saved(m, layers, lambda: m(input_ids=ids, labels=ids, use_cache=False), lambda out: out.loss)

    want = _grads(converted, step)
    plain_total, plain, _ = saved(converted, layers)
    _, original, _ = saved(model, _layers(model))
    _enable_checkpointing(converted, reentrant)
    calls, handles = _abp_calls(converted)
    got = _grads(converted, step)
    for h in handles:
        h.remove()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), (key, float((got[key] - want[key]).abs().max()))
    prefixes = tuple(f"{n}." for n, m in converted.named_modules() if any(m is layer for layer in layers))
    inside = [n for n in calls if n.startswith(prefixes)]
    assert inside and all(calls[n] == 2 for n in inside), calls  # forward and recomputation
    total, in_forward, in_backward = saved(converted, layers)
    assert in_forward == [0, 0] and total < plain_total
    if reentrant:  # the recomputation's saves are visible to outer hooks only when reentrant
        assert in_backward == plain, (in_backward, plain)
    assert all(p < 0.8 * o for p, o in zip(plain, original)), (plain, original)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compress_saved_keeps_the_inputs_of_transformers_checkpoints(name: str, reentrant: bool) -> None:
    """Under transformers' checkpointing, compress_saved keeps each checkpointed layer's hidden
    states as they are (backward reruns the layer from them); without op rules they are codes."""
    from abp import compress

    model, ids = _hf(name)
    _enable_checkpointing(model, reentrant)
    hidden: List[torch.Tensor] = []
    handles = [layer.register_forward_pre_hook(lambda m, args, kwargs: hidden.append(
        kwargs.get("hidden_states", args[0] if args else None)), with_kwargs=True) for layer in _layers(model)]
    stats = {}
    for rules in (True, False):
        hidden.clear()
        with compress.compress_saved(bits=4, op_rules=rules) as block:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        stats[rules] = dict(block.stats)
    for h in handles:
        h.remove()
    layer_inputs = hidden[:2]  # the forward's (not the recomputation's)
    assert layer_inputs and all(h is not None for h in layer_inputs)
    # Kept as they are, counted as checkpoint inputs; without the rules, codes like the rest.
    assert stats[True]["numel_checkpointed"] == sum(h.numel() for h in layer_inputs)
    assert stats[True]["bytes_stored"] >= sum(h.numel() * h.element_size() for h in layer_inputs)
    assert stats[False]["numel_checkpointed"] == 0 and stats[False]["compressed"] > stats[True]["compressed"], stats
    if not reentrant:  # the same saves reach the hooks: kept raw, about 7/8 of their bytes more than codes
        extra = stats[True]["bytes_stored"] - stats[False]["bytes_stored"]
        assert extra > 0.7 * sum(h.numel() * h.element_size() for h in layer_inputs), stats


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_controller_counts_checkpoint_inputs_in_its_budget(name: str, reentrant: bool) -> None:
    """The kept layer inputs count in the controller's elements at none of its bits: the few
    tensors left outside the checkpoints share the budget of the whole saved set."""
    model, ids = _hf(name)
    _enable_checkpointing(model, reentrant)
    hidden: List[torch.Tensor] = []
    handles = [layer.register_forward_pre_hook(lambda m, args, kwargs: hidden.append(
        kwargs.get("hidden_states", args[0] if args else None)), with_kwargs=True) for layer in _layers(model)]
    controller = abp.CompressionController(model, avg_bits=2, interval=1)
    with controller:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for h in handles:
        h.remove()
    stats = controller.stats
    assert stats["numel_checkpointed"] == sum(h.numel() for h in hidden[:2]) > 0  # the forward's, not the recomputation's
    numels, bits = controller._numels, controller.bits
    codes = sum(controller.stored_bits(k, b) for k, b in bits.items())  # b per coded element, padding included
    elements = sum(numels[k] for k in bits) + stats["numel_derived"] + stats["numel_checkpointed"]
    assert controller.average_bits() == pytest.approx(codes / elements) and codes <= 2 * elements
    if not reentrant:
        # Only the tensors outside the checkpoints are offered (a non-reentrant recomputation
        # saves through torch's own hooks): without the checkpointed elements the budget would be
        # below what they now hold. A reentrant recomputation in backward saves through the
        # controller's block, so the block's tensors are in the budget as without checkpointing.
        assert codes > 2 * (elements - stats["numel_checkpointed"]), (bits, stats)


def test_the_controller_at_two_bits_trains_under_checkpointing_as_without() -> None:
    """Deterministic (fixed seeds, CPU, one thread). Measured with torch 2.15: exact 1.996, the
    controller 2.004 without checkpointing and 2.003 with; 2.23 when the checkpoints' inputs were
    left out of the budget (the final norm's input went to 2 bits; step 0 then also stored codes)."""
    pytest.importorskip("transformers")
    exact, plain = train_tiny_llama(controller=False), train_tiny_llama(controller=True)
    checkpointed = train_tiny_llama(controller=True, checkpointed=True)
    assert plain < 1.04 * exact, (exact, plain)
    assert checkpointed < 1.04 * exact and checkpointed < 1.02 * plain, (exact, plain, checkpointed)


@pytest.mark.parametrize("hooks_named", [True, False], ids=["innermost-hooks-named", "told-by-the-stack"])
def test_a_block_opened_inside_a_non_reentrant_checkpoint_leaves_it_its_saves(monkeypatch: pytest.MonkeyPatch,
                                                                             hooks_named: bool) -> None:
    """A module converted with recipe compress, checkpointed (non-reentrant): its block would take
    every save from the checkpoint's hooks (the innermost win), which then neither kept only its
    inputs nor recomputed. The block compresses nothing there and says so; the checkpoint works.
    Where torch cannot name the innermost hooks (1.13 to 2.4), the stack tells the checkpoint's
    forward and its recomputation (torch 2.1 and 2.4 missed the latter: "a different number of
    tensors was saved")."""
    monkeypatch.setattr(abp.compress, "_WARNED", set())  # said once per process
    if not hooks_named:
        monkeypatch.setattr(_save_rules, "_TOP_HOOKS", None)
    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    converted, _ = abp.convert(block, "compress", bits=4)
    calls = [0]
    converted.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    x = torch.randn(8, 16, 64, requires_grad=True)

    def grads(model: nn.Module) -> List[torch.Tensor]:
        model.zero_grad()
        x.grad = None
        checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    with pytest.warns(RuntimeWarning, match="inside a non-reentrant activation checkpoint"):
        got = grads(converted)
    assert calls[0] == 2, "recomputed in backward"
    for mine, exact in zip(got, grads(block)):
        assert torch.equal(mine, exact)  # nothing compressed: the checkpoint's exact gradients
    with abp.compress_saved(bits=4) as outside:  # around the checkpointed call it compresses
        checkpoint(block, x, use_reentrant=False).pow(2).mean().backward()
    assert outside.stats["tensors"] > 0
    # As the warning advises, around the checkpointed converted module too: its own block, inert
    # inside the checkpoint, does not count as nested, and the outer one is open again after it.
    with abp.compress_saved(bits=4) as outside:
        checkpoint(converted, x, use_reentrant=False).pow(2).mean().backward()
        assert abp.compress.open_block() is outside
    assert abp.compress.open_block() is None
