"""Counts the bytes autograd saves for backward (saved_tensors_hooks), deduplicated by storage."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from . import _structure

__all__ = [
    "MemoryReport",
    "SavedTensor",
    "SavedTensorsCounter",
    "distinct_bytes",
    "note_saved",
    "report",
    "saved_bytes",
    "storage_key",
]


def storage_key(t: torch.Tensor) -> Tuple[str, int, int]:
    """(device, data pointer, bytes) of the storage under `t` (torch 2: untyped_storage; 1.13: storage)."""
    if hasattr(t, "untyped_storage"):
        storage = t.untyped_storage()
    else:  # torch 1.13
        storage = t.storage()
    return (str(t.device), int(storage.data_ptr()), int(storage.nbytes()))


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved: its shape, dtype, device and the bytes of its storage."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: str
    storage_bytes: int
    storage_ptr: int
    tag: Optional[str] = None


def without_node(t: torch.Tensor) -> torch.Tensor:
    """`t` as a pack hook may keep it: an alias without its autograd node (the same storage and
    version counter). An op that saves its own output (softmax, rsqrt, a memory-sharing norm) would
    otherwise hold itself through what it saved, a cycle Python's collector cannot see into, so a
    forward dropped before its backward (an evaluation without no_grad) would keep its whole graph
    alive. Unpacking gives autograd the node back: it re-attaches what it recorded at the save."""
    return t if t.grad_fn is None else t.detach()


class SavedTensorsCounter:
    """A context manager that records every tensor saved for backward inside it (no references kept).

    ``total_bytes`` counts each storage once, however many saved tensors view it (e.g. a Linear's
    input also saved by the activation before it). Saving works as usual: the hooks are identities.
    Set ``tag`` (e.g. from module hooks) to attribute saves to a part of a model: each record keeps
    the tag current when it was saved, and ``bytes_tagged(tag)`` sums one part.
    """

    def __init__(self) -> None:
        self.tensors: List[SavedTensor] = []
        self.tag: Optional[str] = None
        self._hooks: Optional[Any] = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._note(t, self.tag)
        return without_node(t)

    def _note(self, t: torch.Tensor, tag: Optional[str]) -> None:
        try:
            device, ptr, nbytes = storage_key(t)
        except RuntimeError:
            # A tensor without data (torch.compile's fake tensors while it traces): nothing is stored.
            return
        self.tensors.append(SavedTensor(tuple(t.shape), t.dtype, device, nbytes, ptr, tag))

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "SavedTensorsCounter":
        if self._hooks is not None:
            raise RuntimeError("SavedTensorsCounter: already counting (a `with` block of the same counter cannot be "
                               "entered again before it exits)")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hooks is None:
            raise RuntimeError("SavedTensorsCounter: exited, but it is not counting (exited twice, or never entered)")
        _active.remove(self)
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def total_bytes(self) -> int:
        """Bytes of the distinct storages saved (a storage viewed by several saved tensors counts once)."""
        return distinct_bytes(self.tensors)

    def activation_bytes(self, model: torch.nn.Module) -> int:
        """`total_bytes` without the storages of `model`'s parameters and buffers, which the model
        keeps whether or not autograd also saves them."""
        kept = model_storages(model)
        return distinct_bytes([s for s in self.tensors if (s.device, s.storage_ptr) not in kept])

    def bytes_tagged(self, tag: Optional[str]) -> int:
        """Bytes of the distinct storages saved while ``self.tag`` was ``tag``."""
        return distinct_bytes([s for s in self.tensors if s.tag == tag])


# The counters entered and not yet left. saved_tensors_hooks do not nest (the innermost pair alone
# runs), so a hook that stores something else in place of a saved tensor (compress_saved's codes)
# tells these counters what it really keeps: one accounting of saved bytes, compressed or not.
_active: List[SavedTensorsCounter] = []


Tags = Tuple[Tuple[SavedTensorsCounter, Optional[str]], ...]


def current_tags() -> Tags:
    """The counters active now with their tags: what a pack hook that decides later how to store
    a tensor passes to `note_saved` then, so the save is counted where it happened."""
    return tuple((counter, counter.tag) for counter in _active)


def note_saved(kept: Sequence[torch.Tensor], tags: Optional[Tags] = None) -> None:
    """Called by a saved-tensors pack hook that runs inside a SavedTensorsCounter (and so hides
    the saves from it): records `kept`, the tensors it stores for one saved tensor, in the
    counters of `tags` (from `current_tags` at the save), by default those active now."""
    for counter, tag in current_tags() if tags is None else tags:
        for t in kept:
            counter._note(t, tag)


def model_storages(model: torch.nn.Module) -> Set[Tuple[str, int]]:
    """(device, data pointer) of the storages of `model`'s parameters and buffers."""
    return {storage_key(t)[:2] for t in list(model.parameters()) + list(model.buffers())}


def distinct_bytes(saved: List[SavedTensor]) -> int:
    """Bytes of the distinct storages among `saved` records (each storage counted once)."""
    seen: Dict[Tuple[str, int], int] = {}
    for s in saved:
        key = (s.device, s.storage_ptr)
        # A zero-byte storage has no unique pointer; it adds nothing anyway.
        seen[key] = max(seen.get(key, 0), s.storage_bytes)
    return sum(seen.values())


def saved_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Runs ``fn(*args, **kwargs)`` and returns the bytes its autograd graph saved for backward,
    counted with saved_tensors_hooks and deduplicated by storage.

    The result of ``fn`` is dropped; use SavedTensorsCounter directly to keep it (e.g. to run backward).
    """
    with SavedTensorsCounter() as counter:
        fn(*args, **kwargs)
    return counter.total_bytes


@dataclass(frozen=True)
class MemoryReport:
    """What one training step's forward saves for backward, per module (``report``).

    ``per_module`` maps a module's qualified name ("" = outside any submodule) to the bytes of the
    storages first saved while it was the innermost running module; a storage saved again later
    (a Linear saving the norm output the norm already saved) is not counted again, so the values
    add up to ``total_bytes``. Parameters and buffers are left out: the modules keep them anyway.
    With a baseline, the same numbers for it.
    """

    total_bytes: int
    per_module: Dict[str, int]
    baseline_total_bytes: Optional[int] = None
    baseline_per_module: Optional[Dict[str, int]] = None

    def __str__(self) -> str:
        names = list(self.per_module)
        if self.baseline_per_module is not None:
            names += [n for n in self.baseline_per_module if n not in self.per_module]
        lines = [f"{'module':<40} {'saved bytes':>14}" + (f" {'baseline':>14}" if self.baseline_per_module is not None else "")]
        for name in names:
            line = f"{name or '(top level)':<40} {self.per_module.get(name, 0):>14,}"
            if self.baseline_per_module is not None:
                line += f" {self.baseline_per_module.get(name, 0):>14,}"
            lines.append(line)
        total = f"{'total':<40} {self.total_bytes:>14,}"
        if self.baseline_total_bytes is not None:
            total += f" {self.baseline_total_bytes:>14,}"
        return "\n".join(lines + [total])


def _innermost_module_tags(model: torch.nn.Module, counter: SavedTensorsCounter) -> List[Any]:
    """Hooks keeping ``counter.tag`` = the qualified name of the innermost module running ("" = none).

    A stack, not the last module entered: after a child returns, saves belong to its parent again.
    """
    stack: List[str] = []

    def enter(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            stack.append(name)
            counter.tag = name

        return hook

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        stack.pop()
        counter.tag = stack[-1] if stack else ""

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
    return handles


def _grad_leaves(model: torch.nn.Module, inputs: Sequence[Any]) -> List[torch.Tensor]:
    """Tensors whose ``.grad`` backward may write: the model's parameters and the leaf inputs."""
    leaves = list(model.parameters())
    leaves += [t for t in inputs if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad]
    return leaves


def _measure(model: torch.nn.Module, inputs: Tuple[Any, ...], kwargs: Dict[str, Any],
             loss_fn: Optional[Callable[[Any], torch.Tensor]]) -> Tuple[int, Dict[str, int]]:
    """(total, per module) bytes saved by one forward of ``model(*inputs, **kwargs)``; runs backward to free them.

    A report must not disturb training: ``.grad`` of the parameters and inputs, every buffer (a
    BatchNorm's running statistics) and torch's random streams (the next dropout masks) are as
    they were afterwards.
    """
    counter = SavedTensorsCounter()
    handles = _innermost_module_tags(model, counter)
    # Kept by the module anyway, whether or not autograd also saves them.
    kept = model_storages(model)
    leaves = _grad_leaves(model, [*inputs, *kwargs.values()])
    grads = [t.grad for t in leaves]
    for t in leaves:  # backward would otherwise accumulate into the existing .grad tensors in place
        t.grad = None
    try:
        with _structure.untouched(model):
            counter.tag = ""
            with counter:
                output = model(*inputs, **kwargs)
            loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
    finally:
        for h in handles:
            h.remove()
        for t, g in zip(leaves, grads):
            t.grad = g
    seen: Dict[Tuple[str, int], int] = {}
    per_module: Dict[str, int] = {}
    for s in counter.tensors:
        key = (s.device, s.storage_ptr)
        if key in kept:
            continue
        tag = s.tag or ""
        per_module.setdefault(tag, 0)
        if key not in seen:
            seen[key] = s.storage_bytes
            per_module[tag] += s.storage_bytes
    return sum(seen.values()), per_module


def _default_loss(output: Any) -> torch.Tensor:
    tensors = [t for t in _structure.tensors_in(output) if t.is_floating_point()]
    if not tensors:
        raise TypeError(f"report: the model's output ({type(output).__name__}) holds no floating-point tensor; pass "
                        "loss_fn= to turn it into a loss")
    return sum(t.float().sum() for t in tensors)  # type: ignore[return-value]


def report(
    model: torch.nn.Module,
    inputs: Union[torch.Tensor, Sequence[Any]] = (),
    *,
    kwargs: Optional[Mapping[str, Any]] = None,
    baseline: Optional[torch.nn.Module] = None,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> MemoryReport:
    """Runs one forward and backward of ``model(*inputs, **kwargs)`` and reports the bytes saved for
    backward per module, each storage counted once (``MemoryReport``). ``kwargs``: keyword
    arguments of the call (a transformers model's ``input_ids``, ``pixel_values``, ...), as
    ``abp.convert``'s ``example_kwargs``. ``baseline`` (e.g. the model before ``abp.convert``) is
    measured the same way on the same inputs. The loss is ``loss_fn(output)``, by default the sum
    of the output(s) in float32; backward only frees what forward saved. The models are left as
    they were: the ``.grad`` of parameters and inputs, their buffers (BatchNorm's running
    statistics) and torch's random number state (the next dropout masks).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if baseline is not None and not isinstance(baseline, torch.nn.Module):
        raise TypeError(f"baseline: expected a torch.nn.Module or None, got {type(baseline).__name__}")
    if isinstance(inputs, torch.Tensor):
        args: Tuple[Any, ...] = (inputs,)
    elif isinstance(inputs, (tuple, list)):
        args = tuple(inputs)
    else:
        hint = " (keyword arguments go in kwargs=)" if isinstance(inputs, Mapping) else ""
        raise TypeError(f"inputs: expected a tensor or a tuple of positional arguments, got {type(inputs).__name__}{hint}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs: expected a mapping of argument names to values, got {type(kwargs).__name__}")
    named = dict(kwargs)
    from . import compress  # here: compress imports this module

    if compress.open_block() is not None and not compress.inside_outside_blocks():
        warnings.warn("abp.memory.report: called inside an open compress_saved block, whose hooks never see the "
                      "report's step (the report's own are innermost): it counts every tensor as saved uncompressed. "
                      "To measure compression, report a model converted with recipe 'compress' (or 'all'), or read "
                      "the block's `stats` after a step of your own", RuntimeWarning, stacklevel=2)
    total, per_module = _measure(model, args, named, loss_fn)
    if baseline is None:
        return MemoryReport(total, per_module)
    base_total, base_per_module = _measure(baseline, args, named, loss_fn)
    return MemoryReport(total, per_module, base_total, base_per_module)
