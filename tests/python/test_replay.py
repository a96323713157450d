"""abp._replay's tree walk: torch.utils._pytree's containers, plus dict/list/tuple subclasses no
one registered (walked through their contents), each tensor object once."""
from __future__ import annotations

import collections

import pytest
import torch

from abp._replay import map_tensors, tensors

Pair = collections.namedtuple("Pair", "a b")


class OwnDict(dict):
    """A model's own output dict: a subclass torch's pytree does not know."""


class OwnList(list):
    pass


def test_tensors_are_found_in_order_once_each_in_every_container() -> None:
    t, u, v, w = torch.ones(1), torch.ones(2), torch.ones(3), torch.ones(4)
    tree = (OwnDict(a=t, b=[t, u]), {"k": Pair(v, 4)}, OwnList([w]), "text", None)
    assert [x.shape[0] for x in tensors(tree)] == [1, 2, 3, 4]


def test_map_tensors_keeps_the_structure_and_maps_each_object_once() -> None:
    t = torch.ones(2)
    calls = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return x * 2

    tree = (OwnDict(a=t, b=[t, 3]), {"k": Pair(torch.ones(1), "s")}, OwnList([torch.ones(3)]))
    out = map_tensors(tree, double)
    assert len(calls) == 3  # t is mapped once although it appears twice
    assert type(out[0]) is OwnDict and out[0]["a"] is out[0]["b"][0] and out[0]["b"][1] == 3
    assert torch.equal(out[0]["a"], torch.full((2,), 2.0))
    assert type(out[1]["k"]) is Pair and out[1]["k"].b == "s"
    assert type(out[2]) is OwnList and torch.equal(out[2][0], torch.full((3,), 2.0))


def test_a_container_that_cannot_be_rebuilt_from_its_contents_becomes_a_plain_one() -> None:
    class Strict(dict):
        def __init__(self, *, required: int) -> None:
            super().__init__(x=torch.ones(1))

    out = map_tensors([Strict(required=1)], lambda x: x + 1)
    assert type(out[0]) is dict and torch.equal(out[0]["x"], torch.full((1,), 2.0))


def test_transformers_model_outputs_are_walked() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    out = outputs.CausalLMOutput(loss=torch.ones(()), logits=torch.zeros(2, 3))
    assert [tuple(x.shape) for x in tensors(out)] == [(), (2, 3)]
    mapped = map_tensors(out, lambda x: x + 1)
    assert type(mapped) is type(out) and torch.equal(mapped.logits, torch.ones(2, 3))


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["plain", "reentrant", "non-reentrant"])
def test_replay_gives_the_gradients_under_checkpointing_and_leaves_grad_alone(reentrant) -> None:
    """A reentrant checkpoint refuses autograd.grad: the replay takes a plain backward there, which
    must give the same gradients and leave each parameter's own .grad as it was."""
    import contextlib

    from torch.utils.checkpoint import checkpoint

    from abp import _replay

    torch.manual_seed(0)
    block, head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)), torch.nn.Linear(8, 3)
    model = torch.nn.Sequential(block, head)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = block(x) if reentrant is None else checkpoint(block, x, use_reentrant=reentrant)
        return head(h)

    x = torch.randn(5, 8, requires_grad=True)
    call = _replay.record(model, (x,), {})
    out = forward(x)
    assert _replay.watch_outputs(call, out)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    user_grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    params = list(model.parameters())
    got = _replay.replay([call], forward, params, list(model.modules()), contextlib.nullcontext)
    assert len(got) == len(params) + 1
    for g, want in zip(got, user_grads):  # the replay of the same step: the same gradients
        assert torch.allclose(g, want, rtol=1e-6, atol=1e-7)
    for p, want in zip(params, user_grads):
        assert torch.equal(p.grad, want)  # untouched by the replay's backward
    call.close()
