"""Which linear maps recipe "sampled" samples, found from what one example call computed.

WTA-CRS estimates a linear layer's weight gradient from a sample of its input rows. It is meant
for the layers of a network's repeated blocks whose output is added back into the hidden state:
the attention output projection and the feed-forward projections. Query, key and value
projections stay exact: their outputs are multiplied with each other (attention scores, the
probability-weighted sum), so an error in them is squared by the softmax instead of being added.
Routers of mixture-of-experts layers are left exact for the same reason (their output goes
through a softmax or a top-k). Heads, poolers and embeddings outside the blocks stay exact.

This module finds those roles from a recorded call (``abp._structure``), not from names:

- *blocks* are the non-leaf children of an ``nn.ModuleList``, or of an ``nn.Sequential`` whose
  non-leaf children share one class (transformers' and timm's layer stacks), or, where they do
  not, those of the one class that repeats most (a CNN's bottlenecks between its stem and its
  last convolution); a linear map belongs to the outermost block around it. A model without such
  a stack is one block.
- a linear map (or a module around it inside its block, such as a LoRA wrapper, but not one that
  holds a norm that ran: its output is past that norm) *scores* when its output reaches, inside the block, a product of two activations (``matmul``, ``bmm``, ``einsum``,
  ``scaled_dot_product_attention``...) or a ``softmax`` / ``topk`` before it reaches a norm of a
  sum (the next sublayer's) or another linear map. Views, splits, rotary embeddings, dropout,
  activations and a norm of the projection alone (Qwen3's and OLMo2's query and key norms) are
  followed.
- a linear map whose output is the model's result (through views, activations and dropout, with
  no sum or product with another activation and no other layer between) is a *head*: a
  classifier, which a model without a layer stack has inside its one block. It stays exact.
- every other linear map inside a block that ran in the call is sampled.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Optional, Set, Tuple

from torch import nn
from torch.nn.utils import parametrize

from ._recognise import LinearMap, Norm, is_leaf
from ._structure import Structure

__all__ = ["blocks", "idle_blocks", "sampled_linear_maps"]

#: Functions whose result mixes two activations multiplicatively (attention scores, the weighted sum).
_PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum", "scaled_dot_product_attention",
             "_scaled_dot_product_attention", "flex_attention"}
#: Functions that sum two activations (a residual add): past one, a norm is the next sublayer's.
_SUMS = {"add", "__add__", "__radd__", "add_", "__iadd__", "sub", "__sub__", "__rsub__", "sub_", "__isub__"}
#: Functions that turn a projection into scores or a routing decision.
_SCORES = {"softmax", "_softmax", "log_softmax", "topk", "sort", "argmax", "argsort"}


def _leaf(module: nn.Module) -> bool:
    """A leaf of the model's computation: no children, or only the `parametrizations` that
    torch.nn.utils.parametrize adds (a parametrized Linear is a layer, not a block of layers)."""
    return is_leaf(module) or (parametrize.is_parametrized(module)
                               and all(n == "parametrizations" for n, _ in module.named_children()))


def _parametrized_linear(module: nn.Module) -> bool:
    """A torch Linear whose weight or bias is parametrized (recognise does not probe it: what it
    computes is not its own); convert refuses to sample it, naming why."""
    return isinstance(module, nn.Linear) and parametrize.is_parametrized(module)


def blocks(model: nn.Module) -> List[str]:
    """Names of the model's repeated blocks, outermost only (see the module docstring)."""
    found: List[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(n, c) for n, c in module.named_children() if not _leaf(c)]
        if isinstance(module, nn.Sequential):
            children = _repeated(children)
        if not children:
            continue
        for child_name, _ in children:
            full = f"{name}.{child_name}" if name else child_name
            if not any(full == b or full.startswith(b + ".") for b in found):
                found.append(full)
    return found


#: Containers that say nothing about what their children compute: in a Sequential of mixed
#: classes, two of them are a stem and a head as often as two stages.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _repeated(children: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """The children of a Sequential that are its repeated blocks: all of them where they share one
    class; else those of the one class that occurs most often, at least twice, that is no plain
    container (a CNN's stem and final convolution around its repeated bottlenecks: rexnet's
    `features`, torchvision's MobileNetV2); none where no such class repeats (a network of
    distinct parts, not a stack: stacks inside its parts are found on their own)."""
    counts = Counter(type(c) for _, c in children)
    if len(counts) <= 1:
        return children
    ranked = counts.most_common()
    top, n = ranked[0]
    second = ranked[1][1]
    if n < 2 or n == second or issubclass(top, _CONTAINERS):
        return []
    return [(name, c) for name, c in children if type(c) is top]


def _inside(name: str, block: str) -> bool:
    return block == "" or name == block or name.startswith(block + ".")


def _block_of(name: str, found: List[str]) -> Optional[str]:
    for b in found:
        if _inside(name, b):
            return b
    return None


def _parameter_derived(structure: Structure, constants: Set[int] = frozenset()) -> Set[int]:
    """Ids of the parameters (and of `constants`) and of what was computed from them alone (``W.T``,
    a cast)."""
    derived = set(structure.parameters) | set(constants)
    for event in structure.events:
        if event.function is not None and event.inputs and all(i in derived for i in event.inputs):
            derived.update(event.outputs)
    return derived


def _scores(start: int, end: int, block: str, structure: Structure, leaves: Set[str], stops: Set[str],
            norms: Set[str], derived: Set[int]) -> Optional[str]:
    """What the output of event `start` reaches inside `block` (whose call returned at event `end`)
    that makes it scores, or None: the first product of two activations or softmax-like function.
    `stops` (linear maps and norms) end the path, but a norm the path reaches before any sum with
    another activation is the projection's own (a query's or key's norm) and is followed."""
    reached = set(structure.events[start].outputs)
    mixed = False  # the path has met another activation in a sum (a residual add)
    for event in structure.events[start + 1:end]:
        if not reached.intersection(event.inputs):
            continue
        if event.module is not None:
            if event.module not in leaves or not _inside(event.module, block):
                continue  # what runs inside a container is followed event by event
            if event.module in stops and (mixed or event.module not in norms):
                continue  # linear maps end the path, and so do norms of a sum (the next sublayer's)
            reached.update(event.outputs)  # a norm of the projection alone (Qwen3's q_norm): followed
            continue
        if event.within and event.within[-1] in leaves:
            continue  # inside a leaf module: its module event stands for it
        if block and not any(_inside(m, block) for m in event.within):
            continue
        name = event.function or ""
        activations = [i for i in event.inputs if i not in derived]
        if name in _SCORES or (name in _PRODUCTS and len(activations) >= 2):
            return name
        mixed = mixed or (name in _SUMS and len(activations) >= 2)
        reached.update(event.outputs)
    return None


def _is_head(start: int, structure: Structure, leaves: Set[str], stops: Set[str], derived: Set[int],
             returned: Set[int]) -> bool:
    """Whether the output of event `start` (a call of a linear map, or of a module around one) is
    the model's result and nothing more: it reaches the tensors the model returned through views,
    activations, dropout and the like, with no sum or product with another activation between (a
    residual branch's last projection is summed into the stream, in place or not; a classifier's
    output is returned as it is), and no later layer (a linear map or a norm) reads it (a trunk
    whose features are returned beside the logits, a stage output kept as a hidden state). Such
    a map is a head, wherever it sits: a model without a layer stack is one block, and a CNN
    whose stages are attributes of the model (timm's RegNet) has its classifier in that block."""
    reached = set(structure.events[start].outputs)
    for event in structure.events[start + 1:]:
        if not reached.intersection(event.inputs):
            continue
        if event.module is not None:
            if event.module in stops and event.module in leaves:
                return False  # a later layer reads it: part of the network, not its result
            if event.module in leaves:
                reached.update(event.outputs)  # an activation, dropout or pooling module
            continue  # a container is followed event by event
        if event.within and event.within[-1] in leaves:
            continue  # inside a leaf module: its module event stands for it
        name = event.function or ""
        activations = [i for i in event.inputs if i not in derived]
        if (name in _SUMS or name in _PRODUCTS) and len(activations) >= 2:
            if event.inputs and (name.endswith("_") or name.startswith("__i")):
                reached.discard(event.inputs[0])  # `out += shortcut`: the tensor is a sum now
            continue  # mixed with another activation: a branch of something larger, not the result
        reached.update(event.outputs)
    return bool(reached & returned)


def sampled_linear_maps(model: nn.Module, structure: Structure, recognised: Dict[int, object]) -> Dict[str, str]:
    """Name of each linear map the recipe may sample -> why (its role), for the linear maps that ran
    inside a block and do not score; see the module docstring."""
    modules = dict(model.named_modules())
    found = blocks(model) or [""]
    leaves = {n for n, m in modules.items() if n and _leaf(m)}
    linear = {n for n, m in modules.items() if n and (isinstance(recognised.get(id(m)), LinearMap) or _parametrized_linear(m))}
    norms = {n for n, m in modules.items() if n and isinstance(recognised.get(id(m)), Norm)}
    stops = linear | norms
    derived = _parameter_derived(structure)
    # For the head rule the model's buffers are constants too: logits plus a registered prior or
    # bias are still the result (elsewhere a buffer stays an activation: a rotary table's product
    # with a query leads to the scores either way).
    constants = _parameter_derived(structure, {id(b) for b in model.buffers()})
    # What the model's own call returned (its event is the last with the empty name).
    returned = next((set(e.outputs) for e in reversed(structure.events) if e.module == ""), set())
    first: Dict[str, int] = {}  # module -> index of its first call's event (recorded when the call returned)
    for index, event in enumerate(structure.events):
        if event.module is not None and event.module not in first:
            first[event.module] = index
    verdict: Dict[str, Optional[str]] = {}  # module -> what its output reaches that scores (None: nothing)

    def scores(name: str, block: str) -> Optional[str]:
        if name not in verdict:
            end = _end_of(name, block)
            verdict[name] = _scores(first[name], end, block, structure, leaves, stops, norms, derived)
        return verdict[name]

    def _end_of(name: str, block: str) -> int:
        """The event at which the call of `block` around `name`'s first call returned."""
        if not block:
            return len(structure.events)
        for index in range(first[name] + 1, len(structure.events)):
            if structure.events[index].module == block:
                return index
        return len(structure.events)

    chosen: Dict[str, str] = {}
    for name in sorted(linear, key=lambda n: first.get(n, len(structure.events))):
        block = _block_of(name, found)
        if block is None or name not in first:
            continue
        parts = name.split(".")
        around = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
        # The map and the modules around it whose output is its output (a LoRA wrapper, an
        # attention module around its output projection): not a container whose output a norm
        # inside it made (DBRX's norm-attention-norm module feeds the experts, past its own norm).
        owners = [a for a in around if a in first and a != block and _inside(a, block)
                  and (a == name or not any(n in norms and _inside(n, a) for n in first))]
        if any(scores(a, block) is not None for a in owners):
            continue
        if any(_is_head(first[a], structure, leaves, stops - {a}, constants, returned) for a in owners):
            continue  # heads stay exact, and so do the paths of a wrapper around one (LoRA's)
        chosen[name] = f"in block `{block}`" if block else "in the model (no layer stack found)"
    return {**chosen, **_like_chosen(modules, linear - set(first), chosen)}


def idle_blocks(model: nn.Module, structure: Structure, recognised: Dict[int, object], chosen: Dict[str, str]) -> List[str]:
    """The blocks the call never entered that hold a linear map, none of which `chosen` (what
    sampled_linear_maps chose) samples by analogy with a block that ran: what their maps do is
    unknown, so they stay exact (a vision tower that an example without pixel values never runs)."""
    modules = dict(model.named_modules())
    ran = {event.module for event in structure.events if event.module is not None}
    idle = []
    for block in blocks(model):
        if any(_inside(n, block) for n in ran) or any(_inside(n, block) for n in chosen):
            continue
        if any(_inside(n, block) and isinstance(recognised.get(id(m)), LinearMap) for n, m in modules.items()):
            idle.append(block)
    return idle


def _pattern(name: str) -> str:
    """`name` with its numbers blanked: the same layer in another block or another expert."""
    return re.sub(r"\d+", "#", name)


def _like_chosen(modules: Dict[str, nn.Module], idle: Set[str], chosen: Dict[str, str]) -> Dict[str, str]:
    """The linear maps the call never ran (a mixture of experts' experts that the example batch
    routed no token to) that stand where a chosen one stands in another block or expert, and
    are of its class: chosen too, saying after which."""
    like: Dict[str, str] = {}
    for name in chosen:
        like.setdefault((_pattern(name), type(modules[name])), name)
    found: Dict[str, str] = {}
    for name in sorted(idle):
        model = like.get((_pattern(name), type(modules[name])))
        if model is not None:
            found[name] = f"as `{model}` ({chosen[model]}): the example call did not run this one"
    return found
