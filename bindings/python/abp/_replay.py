"""Record and replay of a model's calls: the engine of abp.controller's sensitivity estimate.

`record` takes, before a call of the model runs, what running it again needs: copies of its
inputs, the RNG states, the buffers, the modules' training modes, autocast, and the tensors
torch.func.functional_call put in parameters' places (a stateless step's weights). `watch_outputs`
hooks the call's outputs so that the user's backward leaves dL/d(output) on the record.
`replay` runs recorded calls again, as the user's step ran them, and returns the gradients of
the parameters and of the inputs that required grad.

Nested arguments and outputs are walked with torch.utils._pytree: tuples, lists, dicts,
namedtuples and the containers libraries register (transformers registers its ModelOutput on
torch 2). A dict, list or tuple subclass that no one registered (a model's own output dict, or
ModelOutput on torch 1.13) is walked through its contents; anything else is a leaf.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from . import _amp, _save_rules

__all__ = [
    "Call",
    "tensors",
    "map_tensors",
    "rng_state",
    "set_rng_state",
    "snapshot_buffers",
    "restore_buffers",
    "substitutes",
    "record",
    "watch_outputs",
    "replay",
]

RngState = Tuple[torch.Tensor, Optional[List[torch.Tensor]]]
AutocastState = Tuple[Tuple[str, bool, torch.dtype], ...]
BufferSnapshot = List[Tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]]
#: (module, parameter name, the tensor in its place during the call).
Substitutes = List[Tuple[torch.nn.Module, str, torch.Tensor]]


def _subtree(leaf: Any) -> Optional[Any]:
    """A container pytree left as a leaf (a dict, list or tuple subclass no one registered, such
    as a model's own output dict): its contents as a plain container to walk, else None."""
    if isinstance(leaf, dict):
        return dict(leaf)
    if isinstance(leaf, (list, tuple)):
        return list(leaf)
    return None


def tensors(tree: Any) -> List[torch.Tensor]:
    """The tensors in `tree`, in order, each object once."""
    found: List[torch.Tensor] = []
    seen: set = set()

    def walk(tree: Any) -> None:
        for leaf in pytree.tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in seen:
                    seen.add(id(leaf))
                    found.append(leaf)
            elif (inner := _subtree(leaf)) is not None:
                walk(inner)

    walk(tree)
    return found


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`tree` with every tensor replaced by fn(tensor) (the same object gives the same result)."""
    memo: Dict[int, Any] = {}

    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in memo:
                memo[id(leaf)] = fn(leaf)
            return memo[id(leaf)]
        inner = _subtree(leaf)
        if inner is None:
            return leaf
        mapped = walk(inner)
        try:  # the container's own type, where it can be built from its contents
            return type(leaf)(mapped.items() if isinstance(leaf, dict) else mapped)
        except TypeError:
            return mapped

    def walk(tree: Any) -> Any:
        leaves, spec = pytree.tree_flatten(tree)
        return pytree.tree_unflatten([one(leaf) for leaf in leaves], spec)

    return walk(tree)


def rng_state() -> RngState:
    # CUDA's generators only if CUDA is already in use: never initialise it for a CPU model.
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _autocast_state() -> AutocastState:
    return tuple((d, *_amp.state(d)) for d in ("cpu", "cuda"))


@contextlib.contextmanager
def _autocast(state: AutocastState) -> Iterator[None]:
    """Autocast as it was when the call was recorded (the replay runs outside the user's block)."""
    now = {d: enabled for d, enabled, _ in _autocast_state()}
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            elif now[device]:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def snapshot_buffers(model: torch.nn.Module) -> BufferSnapshot:
    return [(m, name, b, b.detach().clone())
            for m in model.modules() for name, b in m._buffers.items() if b is not None]


def restore_buffers(snapshot: BufferSnapshot) -> None:
    with torch.no_grad():
        for module, name, buffer, saved in snapshot:
            module._buffers[name] = buffer  # the original object, in case forward replaced it
            buffer.copy_(saved)


@dataclass
class Call:
    """One recorded call of the model: what its replays need, freed by close()."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    requires_grad: List[bool]  # per input tensor, in `tensors` order
    was_leaf: List[bool]  # per input tensor: a leaf (a tensor compress_saved treats as a parameter)
    rng: RngState
    buffers: BufferSnapshot
    modes: List[bool]
    autocast: AutocastState
    substitutes: Substitutes  # functional_call's tensors in parameters' places
    grads: List[Optional[torch.Tensor]] = field(default_factory=list)  # dL/d(output), per output
    handles: List[Any] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.args, self.kwargs, self.buffers, self.grads, self.handles = (), {}, [], [], []
        self.substitutes = []
        self.closed = True


def substitutes(model: torch.nn.Module) -> Substitutes:
    """The parameters of `model` that torch.func.functional_call (torch.nn.utils.stateless) has
    replaced for the call it runs, with the tensors in their places. torch >= 2.0 puts each in
    the parameter's slot: a plain tensor where an nn.Parameter was (nothing else puts one there;
    a wrapper's own parameter objects, FSDP's shards and gathered parameters, are Parameters).
    torch 1.13 leaves the slots alone and gives the module a class whose attribute lookup answers
    the replaced names (`_attr_to_path`) with the caller's tensors."""
    found: Substitutes = []
    for m in model.modules():
        replaced = m.__dict__.get("_attr_to_path", {})
        for name, p in m._parameters.items():
            if p is None:
                continue
            if name in replaced:
                found.append((m, name, getattr(m, name)))
            elif not isinstance(p, torch.nn.Parameter):
                found.append((m, name, p))
    return found


@contextlib.contextmanager
def _substituted(slots: Substitutes) -> Iterator[None]:
    """Puts the recorded tensors back in their parameters' places for a replayed call, as
    functional_call did for the user's."""
    kept = [(m, name, m._parameters[name]) for m, name, _ in slots]
    try:
        for m, name, t in slots:
            m._parameters[name] = t
        yield
    finally:
        for m, name, p in kept:
            m._parameters[name] = p


def record(model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Call:
    """What a replay of the call model(*args, **kwargs) needs, taken before forward runs."""
    inputs = tensors((args, kwargs))
    # Copied before forward runs (it may modify its inputs in place); the RNG states, buffers
    # and modes as forward will see them.
    args_copy, kwargs_copy = map_tensors((args, kwargs), lambda t: t.detach().clone())
    return Call(
        args=args_copy, kwargs=kwargs_copy,
        requires_grad=[t.requires_grad for t in inputs],
        was_leaf=[t.is_leaf for t in inputs],
        rng=rng_state(), buffers=snapshot_buffers(model),
        modes=[m.training for m in model.modules()], autocast=_autocast_state(),
        substitutes=substitutes(model))


def watch_outputs(call: Call, out: Any) -> bool:
    """Hooks the call's outputs to collect dL/d(output) from the user's backward. False (and the
    call closed) when no output requires grad: a call under no_grad cannot be replayed."""
    outputs = tensors(out)
    call.grads = [None] * len(outputs)
    for i, t in enumerate(outputs):
        if t.requires_grad:
            call.handles.append(t.register_hook(partial(_capture, call, i)))
    if len(call.handles) > 1:
        _subtract_inner_paths(call, outputs)
    if not call.handles:
        call.close()
    return bool(call.handles)


def _capture(call: Call, i: int, grad: Optional[torch.Tensor]) -> None:
    # None: no gradient reached this output (a compiled graph's hook may be called so); zero.
    if call.closed or grad is None:
        return
    prev = call.grads[i]
    call.grads[i] = grad.detach() if prev is None else prev + grad.detach()


def _subtract_inner_paths(call: Call, outputs: List[torch.Tensor]) -> None:
    """An output's hook sees all of its gradient, also what reaches it through another output the
    call computed from it (a causal LM's logits, through the loss it returns). The replays feed
    every output its gradient and run that path themselves, so it would count twice: hooks on
    the call's nodes that consume an output subtract what they send it, leaving the gradient of
    the caller's own use. (Handing the caller identity views to hook instead fails: a view
    changed in place, as the Trainer scales its loss, loses its hooks.)"""
    held = [t.grad_fn for t in outputs]  # node objects keep their identity while referenced
    target = {(id(node), t.output_nr): i for i, (node, t) in enumerate(zip(held, outputs))
              if node is not None and t.requires_grad}
    stack = [node for node in held if node is not None]
    seen = {id(node) for node in stack}
    while stack:
        node = stack.pop()
        for k, (following, nr) in enumerate(node.next_functions):
            if following is None:
                continue
            i = target.get((id(following), nr))
            if i is not None:
                call.handles.append(node.register_hook(partial(_subtract, call, i, k)))
            if id(following) not in seen:
                seen.add(id(following))
                held.append(following)
                stack.append(following)


def _subtract(call: Call, i: int, k: int, grad_inputs: Tuple[Optional[torch.Tensor], ...], _: Any) -> None:
    grad = grad_inputs[k]
    if call.closed or grad is None:
        return
    prev = call.grads[i]
    call.grads[i] = -grad.detach() if prev is None else prev - grad.detach()


def _replay_inputs(call: Call, leaves: List[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Fresh copies of the call's inputs (the model may modify its inputs in place)."""
    replacement: Dict[int, torch.Tensor] = {}
    # Outside any torch function mode: compress_saved's recorder must not take these copies for
    # the model's own work (the user's step made its inputs before the block).
    with torch._C.DisableTorchFunction():
        for t, req, leaf in zip(tensors((call.args, call.kwargs)), call.requires_grad, call.was_leaf):
            replacement[id(t)] = _input_copy(t, req, leaf, leaves)
    args, kwargs = map_tensors((call.args, call.kwargs), lambda t: replacement[id(t)])
    return args, kwargs


def _input_copy(t: torch.Tensor, req: bool, leaf: bool, leaves: List[torch.Tensor]) -> torch.Tensor:
    copy = t.clone()
    # Inputs that required grad are replayed requiring grad: some ops save different
    # tensors depending on it, and the keys must match the user's step.
    if req:
        copy.requires_grad_(True)
        leaves.append(copy)
        # An input that was not a leaf must not look like a parameter to compress_saved,
        # or it would be skipped and the keys after it would shift.
        if not leaf:
            copy = copy.clone()
    return copy


def replay(
    calls: List[Call],
    forward: Callable[..., Any],
    params: List[torch.Tensor],
    modules: List[torch.nn.Module],
    around_forward: Callable[[], ContextManager[Any]],
) -> List[Optional[torch.Tensor]]:
    """Runs `forward` again on every recorded call, each in its recorded RNG state, buffers,
    training modes and autocast, inside `around_forward()`; feeds each output its recorded
    gradient and returns the gradients of `params`, of the tensors functional_call put in
    parameters' places that require grad (the weights a stateless step trained) and of the
    inputs that required grad (none when nothing requires grad). The caller restores the
    model's state afterwards."""
    outputs: List[torch.Tensor] = []
    grad_outputs: List[torch.Tensor] = []
    leaves: List[torch.Tensor] = []
    stateless: Dict[int, torch.Tensor] = {}
    with torch.enable_grad():
        for call in calls:
            set_rng_state(call.rng)
            restore_buffers(call.buffers)
            for m, mode in zip(modules, call.modes):
                m.training = mode
            args, kwargs = _replay_inputs(call, leaves)
            for _, _, t in call.substitutes:
                if t.requires_grad:
                    stateless.setdefault(id(t), t)
            with _autocast(call.autocast), _substituted(call.substitutes), around_forward():
                out = forward(*args, **kwargs)
            produced = tensors(out)
            if len(produced) != len(call.grads):
                raise RuntimeError(
                    f"CompressionController: the model returned {len(produced)} tensors when replayed, "
                    f"{len(call.grads)} in the user's step; the replay must be deterministic")
            for t, g in zip(produced, call.grads):
                if g is not None and t.requires_grad:
                    outputs.append(t)
                    grad_outputs.append(g)
        inputs = params + list(stateless.values()) + leaves
        if not inputs or not outputs:
            return []
        if not _reentrant_checkpoint_in(outputs):
            return list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
        return _accumulated_gradients(outputs, inputs, grad_outputs)


def _reentrant_checkpoint_in(outputs: List[torch.Tensor]) -> bool:
    """Whether backward from `outputs` passes a reentrant torch.utils.checkpoint (its node runs
    a backward of its own inside, which torch allows only under a plain .backward())."""
    seen, stack = set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _save_rules.is_reentrant_checkpoint(node):
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


def _accumulated_gradients(outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                           grad_outputs: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """The gradients of `inputs` by a plain backward, which accumulates into .grad: each input's
    own .grad is set aside for it and put back after. Parameters' post-accumulate-grad hooks run
    (autograd.grad runs none); DDP's ignore a backward outside its own."""
    kept = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    try:
        torch.autograd.backward(outputs, grad_outputs)
        return [t.grad for t in inputs]
    finally:
        for t, grad in zip(inputs, kept):
            t.grad = grad
