"""A model's structure found by running it once (abp.convert), not by symbolic tracing.

torch.fx cannot trace most models people train (transformers' and timm's use data-dependent
Python, iterate over tensors, build masks in Python). ``record`` instead runs one example call
eagerly, without gradients and with the RNG state restored afterwards, and records:

- every module call (forward pre-hooks and hooks): how often each module ran, the tensors it was
  given and the tensors it returned;
- every torch function applied to a tensor (a TorchFunctionMode), with the stack of modules
  running at that moment.

Tensors are told apart by identity (all of them are kept alive until the run ends, so no id is
reused). A *use* of a module's output is then either a later leaf module call given that tensor
(what happens inside that module belongs to it; containers given it are looked through), or a
torch function applied to it outside any such call (a residual add, a slice, a view). Reading
only metadata (``.shape``, ``.size()``) is no use.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["Event", "Structure", "Use", "own_rng", "record", "tensors_in", "untouched"]

# Tensor methods and properties that read metadata only.
_METADATA = {"size", "dim", "numel", "stride", "is_floating_point", "is_contiguous", "data_ptr",
             "element_size", "get_device", "__get__", "__len__", "nelement", "ndimension", "is_complex"}


@dataclass(frozen=True)
class Use:
    """One use of a tensor: a module call (``module`` is its name) or a torch function (``function``)."""

    module: Optional[str]
    function: Optional[str]
    within: str  # the innermost module running ("" = the top level)

    def describe(self, modules: Dict[str, nn.Module]) -> str:
        if self.module is not None:
            return f"module `{self.module}` ({type(modules[self.module]).__name__})"
        if self.function == "the model's return value":
            return "the model's return value"
        where = f" in `{self.within}`" if self.within else " at the top level"
        return f"`{self.function}`{where}"


@dataclass(frozen=True)
class Event:
    """One step of the example call, in the order it ran: a torch function (``module`` None) or a
    module call that returned (recorded when it returned, after what ran inside it). ``inputs`` and
    ``outputs`` are tensor ids; ``within`` names the modules running around it, outermost first."""

    function: Optional[str]
    module: Optional[str]
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]
    within: Tuple[str, ...]


@dataclass
class Structure:
    """What one example call showed (``record``)."""

    calls: Dict[str, int] = field(default_factory=dict)  # module name -> times called
    uses: Dict[str, List[Use]] = field(default_factory=dict)  # module name -> uses of its output(s), first call
    foreign_parameter_uses: Dict[str, List[str]] = field(default_factory=dict)  # module -> its parameters used outside it
    # module -> its parameters whose metadata (dtype, device, shape) was read outside it: a fold that
    # removes them (a folded norm's γ and β) breaks such a read (Mamba: `x.to(self.norm.weight.dtype)`)
    foreign_parameter_reads: Dict[str, List[str]] = field(default_factory=dict)
    inputs: Dict[str, List[int]] = field(default_factory=dict)  # module name -> ids of its first call's tensor inputs
    modified: Dict[str, List[str]] = field(default_factory=dict)  # module name -> in-place ops on its output
    events: List[Event] = field(default_factory=list)  # the call's dataflow, in order (abp._roles reads it)
    parameters: Set[int] = field(default_factory=set)  # ids of the model's parameters


def tensors_in(value: Any) -> List[Tensor]:
    """The tensors in `value`, however nested in lists, tuples, dicts and dataclasses (a model
    may return its logits in a dataclass of its own, as transformers' ModelOutput is one)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        return [t for f in value.__dataclass_fields__ for t in tensors_in(getattr(value, f, None))]
    return []


def _plain(value: Any) -> Any:
    """A model output as plain containers (transformers' ModelOutput is a dict; dataclasses too)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, dict):
        return list(value.values())
    if hasattr(value, "__dataclass_fields__"):
        return [getattr(value, f) for f in value.__dataclass_fields__]
    return value


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.stack: List[Tuple[str, int]] = []  # (module name, call number)
        self.functions: List[Tuple[str, Tuple[int, ...], Tuple[Tuple[str, int], ...]]] = []
        self.keep: List[Tensor] = []
        self.module_calls: List[Tuple[str, int, Tuple[int, ...]]] = []  # (name, call number, input ids)
        self.events: List[Event] = []
        self.parameter_ids: Set[int] = set()  # set by `record`: whose metadata reads are kept
        self.parameter_reads: List[Tuple[str, int, Tuple[Tuple[str, int], ...]]] = []  # (what, id, stack)

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        result = func(*args, **kwargs)
        if kwargs.get("inplace") is True:  # F.relu(x, inplace=True) reaches the mode as `relu`
            name = f"{name}(inplace=True)"
        # A property read that returns a tensor (.T, .mT, .data, .real) is a use, not metadata.
        if name not in _METADATA or tensors_in(result):
            tensors = tensors_in(list(args)) + tensors_in(kwargs)
            if tensors:
                self.keep.extend(tensors)
                self.functions.append((name, tuple(id(t) for t in tensors), tuple(self.stack)))
                outputs = tuple(id(t) for t in tensors_in(result))
                self.events.append(Event(name, None, self.functions[-1][1], outputs, tuple(n for n, _ in self.stack)))
        elif args and id(args[0]) in self.parameter_ids:
            # A property's getter reaches the mode as `__get__` of the property's descriptor.
            what = getattr(getattr(func, "__self__", None), "__name__", None) if name == "__get__" else name
            self.parameter_reads.append((f".{what}" if what else name, id(args[0]), tuple(self.stack)))
        self.keep.extend(tensors_in(result))
        return result


def own_rng(model: nn.Module) -> "contextlib.AbstractContextManager[None]":
    """torch.random.fork_rng over the CPU and the CUDA devices `model`'s parameters are on: what
    its body draws leaves the caller's random streams as they were."""
    devices = [d.index for d in {p.device for p in model.parameters()} if d.type == "cuda" and d.index is not None]
    return torch.random.fork_rng(devices=devices)


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Runs its body with the RNG state forked (own_rng) and puts back every buffer of `model`
    afterwards (a call may update BatchNorm's running statistics): a call of the model inside it
    leaves no trace on the model or on the caller's random streams."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with own_rng(model):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def record(model: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any], watch: Sequence[str],
           as_trained: bool = False) -> Structure:
    """Runs ``model(*args, **kwargs)`` once and returns its Structure; ``watch`` names the modules
    whose output uses are wanted. Gradients are off and every module but the dropout modules is
    in eval mode for the call (LayerDrop and stochastic depth would leave out a random set of
    layers, and a checkpointed layer would take its checkpointing branch), or with `as_trained`
    in its own mode (what training runs: a router's noise multiplied in place in training only);
    the RNG state, the buffers and the modes are restored. Every tensor of the call stays alive
    until it returns: pass a small example (one short sequence) for a large model."""
    recorder = _Recorder()
    recorder.parameter_ids = {id(p) for p in model.parameters()}
    structure = Structure()
    names = {id(m): n for n, m in model.named_modules()}
    outputs: Dict[str, Set[int]] = {}
    created_at: Dict[str, int] = {}  # watched module -> the function count when its first call returned
    counter = [0]
    watched = set(watch)

    def pre(module: nn.Module, inputs: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        counter[0] += 1
        ids = tuple(id(t) for t in tensors_in(inputs))
        recorder.keep.extend(tensors_in(inputs))
        recorder.module_calls.append((name, counter[0], ids))
        structure.calls[name] = structure.calls.get(name, 0) + 1
        structure.inputs.setdefault(name, list(ids))
        recorder.stack.append((name, counter[0]))

    def post(module: nn.Module, inputs: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        recorder.stack.pop()
        recorder.keep.extend(tensors_in(output))
        recorder.events.append(Event(None, name, tuple(id(t) for t in tensors_in(inputs)), tuple(id(t) for t in tensors_in(output)),
                                     tuple(n for n, _ in recorder.stack)))
        if name in watched and name not in outputs:
            recorder.keep.extend(tensors_in(output))
            outputs[name] = {id(t) for t in tensors_in(output)}
            created_at[name] = len(recorder.functions)

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    modes = [(m, m.training) for m in model.modules()]
    try:
        # Dropout modules keep their mode: in training they make a new tensor, which eval's
        # identity would turn into a direct read of their input (their draws come from the fork).
        for m, training in modes:
            m.training = training and (as_trained or isinstance(m, nn.modules.dropout._DropoutNd))
        with untouched(model), torch.no_grad(), recorder:
            returned = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes:
            m.training = training
    _attribute_uses(model, recorder, structure, outputs, created_at)
    # A tensor the model returns is read by the caller: a use no fold may change.
    returned_ids = {id(t) for t in tensors_in(_plain(returned))}
    for name, ids in outputs.items():
        if ids & returned_ids:
            structure.uses[name].append(Use(None, "the model's return value", ""))
    _foreign_parameter_uses(model, recorder, structure)
    structure.events = recorder.events
    structure.parameters = {id(p) for p in model.parameters()}
    recorder.keep.clear()
    return structure


def _attribute_uses(
    model: nn.Module, recorder: _Recorder, structure: Structure, outputs: Dict[str, Set[int]], created_at: Dict[str, int]
) -> None:
    """A use is a leaf module call given the output, or a torch function applied to it outside any
    such call. A container given the output (an attention block) is looked through: what reads the
    output inside it (its projections, or its own torch code) are the uses."""
    leaves = {n for n, m in model.named_modules() if next(iter(m.children()), None) is None}
    for name, ids in outputs.items():
        uses: List[Use] = []
        leaf_calls = set()
        for callee, number, inputs in recorder.module_calls:
            if callee != name and callee in leaves and ids & set(inputs):
                leaf_calls.add(number)
                use = Use(callee, None, "")
                if use not in uses:
                    uses.append(use)
        for function, tensor_ids, stack in recorder.functions[created_at[name]:]:
            if not ids & set(tensor_ids):
                continue
            if any(n in leaf_calls for _, n in stack):
                continue  # inside a leaf module given the output: that module is the use
            use = Use(None, function, stack[-1][0] if stack and stack[-1][0] else "")
            if use not in uses:
                uses.append(use)
        structure.uses[name] = uses
        # In-place ops on the output itself, wherever they run (nn.ReLU(inplace=True) included).
        modified = []
        for function, tensor_ids, stack in recorder.functions[created_at[name]:]:
            in_place = (function.endswith("_") and not function.endswith("__")) or function.endswith("(inplace=True)")
            if tensor_ids and tensor_ids[0] in ids and in_place:
                where = f"`{function}` in `{stack[-1][0]}`" if stack and stack[-1][0] else f"`{function}`"
                if where not in modified:
                    modified.append(where)
        structure.modified[name] = modified


def _foreign_parameter_uses(model: nn.Module, recorder: _Recorder, structure: Structure) -> None:
    """For each module, its own parameters that a torch function used while it was not running
    (`foreign_parameter_uses`), and those whose metadata was read so (`foreign_parameter_reads`)."""
    owners: Dict[int, List[Tuple[str, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((prefix, pname))

    def note(found: Dict[str, List[str]], tid: int, stack: Tuple[Tuple[str, int], ...], suffix: str) -> None:
        """Records in `found` a use of parameter `tid` outside its module, as "`owner.name<suffix> in ..."."""
        running = {n for n, _ in stack}
        where = f" in `{stack[-1][0]}`" if stack and stack[-1][0] else " at the top level"
        for owner, pname in owners.get(tid, []):
            if owner and owner not in running and not any(o in running for o, _ in owners[tid]):
                text = f"`{owner}.{pname}{suffix}{where}"
                if text not in found.setdefault(owner, []):
                    found[owner].append(text)

    for function, tensor_ids, stack in recorder.functions:
        for tid in tensor_ids:
            note(structure.foreign_parameter_uses, tid, tuple(stack), f"` by `{function}`")
    for what, tid, stack in recorder.parameter_reads:
        note(structure.foreign_parameter_reads, tid, stack, f"{what}` read")
