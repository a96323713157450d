"""Saved tensors that cheap ops made from other saved tensors: recomputed in backward, not stored.

`compress_saved(recompute=True)` records, while its block's forward runs, what each *cheap* torch
function made (a pointwise op, a view, reshape, copy or cast, a normalisation, softmax, sum or
concatenation: memory-bound work of the order of a decode) and from what. When autograd then
saves a tensor that such a function made from tensors the block has already packed (or from
parameters and small constants), the pack hook stores a `Derived` instead: the function and the
packs of its arguments. Backward's unpack calls the function again on their decoded values.

Two reasons (docs/compressed-training.md has the measurements):

* **Consistency.** Backward formulas rely on relations between the tensors they read: a norm's
  output is its input times the 1/rms it saved; SwiGLU's product is the product of its saved
  factors; the input of an attention's output projection is the attention output it saved.
  Independent codes of both sides break the relations, and the gradient with them. Recomputed
  from the decoded inputs, the relations hold exactly: the gradient is the exact gradient at a
  perturbed point.
* **Memory.** A tensor derived so costs nothing, and a model's saved tensors are often such
  tensors (a transformer block saves its norm outputs, activation outputs and SwiGLU products
  beside their inputs): about half the elements of a LLaMA-style block.

What is recorded is decided per torch function (`kind_of`): pointwise functions by the
``pointwise`` tag of their ATen op (never one with the ``nondeterministic_seeded`` tag, so no
dropout or random op is ever replayed, and never an in-place one); views, copies and casts and a
few row functions by name. Matrix products are recomputed in one case only: a projection
(``linear``, ``addmm``, ``matmul``, ``mm``) whose output fused attention reads as its query, key
or value, under per-tensor widths (the controller), when the block recomputes that attention
(`Recorder(projections=True)`; the saver accepts such a Derived only for those saves, through
one product, and only while every parameter it reads holds its data: `parameters_present`). Fused
attention's backward reads query and key through exp(q kᵀ), which their codes bias; recomputed
from the projection's stored input they cost no bits, and the input they share gets the bits
(docs/compressed-training.md measures it). Anything else a matrix product makes stays stored:
recomputing it would be activation checkpointing, a different trade.
"""
from __future__ import annotations

import importlib
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _amp

__all__ = ["AVAILABLE", "Derived", "Recorder", "kind_of"]

#: Recording needs ATen's op tags (torch >= 2): on torch 1.13 nothing is recomputed.
AVAILABLE = hasattr(torch.Tag, "pointwise") and hasattr(torch.Tag, "nondeterministic_seeded")

#: Functions that view, reshape, copy or cast (their output is their input's data rearranged).
_LAYOUT = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims", "permute",
    "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "expand_as", "contiguous", "t",
    "narrow", "select", "movedim", "moveaxis", "getitem", "split", "chunk", "unbind", "clone",
    "to", "float", "half", "bfloat16", "double", "type_as", "repeat", "repeat_interleave",
})
#: Row functions as cheap as a decode: normalisations, softmax, reductions, concatenation.
_ROWS = frozenset({
    "layer_norm", "rms_norm", "group_norm", "softmax", "log_softmax", "mean", "sum", "cat", "concat",
    "concatenate", "stack", "logsumexp", "amax", "amin",
})
#: Matrix products: recorded only by a Recorder with `projections` (see the module's docstring).
_PROJECTIONS = frozenset({"linear", "addmm", "matmul", "mm"})
#: Python-level names whose ATen op has another name.
_ATEN_NAME = {"truediv": "div", "floordiv": "floor_divide", "matmul": "", "and": "", "or": "", "xor": ""}

_KINDS: Dict[Any, Optional[str]] = {}


def _aten_pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None) if name and AVAILABLE else None
    if packet is None:
        return False
    tags = set()
    for overload in packet.overloads():
        tags.update(getattr(packet, overload).tags)
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def kind_of(func: Any) -> Optional[str]:
    """"pointwise", "layout", "rows" or "projection" for a torch function whose outputs may be
    recomputed, else None (cached per function)."""
    try:
        return _KINDS[func]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable
        return None
    name = getattr(func, "__name__", "") or ""
    kind: Optional[str] = None
    dunder = name.startswith("__") and name.endswith("__") and len(name) > 4
    if dunder:
        name = name[2:-2]
        if name.startswith("i") and _aten_pointwise(_ATEN_NAME.get(name[1:], name[1:])):
            name = name + "_"  # __imul__ and the like work in place
        elif name.startswith("r") and (name[1:] in _PROJECTIONS or _aten_pointwise(_ATEN_NAME.get(name[1:], name[1:]))):
            name = name[1:]  # __rmul__: the same op, called with its operands as they were
    if name.endswith("_"):
        kind = None  # in place: it changes a tensor instead of making one
    elif name in _LAYOUT:
        kind = "layout"
    elif name in _ROWS:
        kind = "rows"
    elif name in _PROJECTIONS:
        kind = "projection"
    elif _aten_pointwise(_ATEN_NAME.get(name, name)):
        kind = "pointwise"
    _KINDS[func] = kind
    return kind


class Use:
    """One tensor argument of a Derived: `value` is what the block packed for it (a compressed
    tensor, a pending one, another Derived, or the tensor itself where it is kept as it is: a
    parameter, a constant, a tensor stored raw). `version`, for a tensor kept as it is, is its
    version when recorded: an in-place change after that fails as torch's own check does.
    `parameter`: the value is a parameter (or its view or cast), which the module keeps anyway;
    `numel` its element count when recorded (a sharding wrapper may swap in an empty shard)."""

    __slots__ = ("value", "version", "parameter", "numel")

    def __init__(self, value: Any, version: Optional[int], parameter: bool = False) -> None:
        self.value = value
        self.version = version
        self.parameter = parameter
        self.numel = value.numel() if parameter and isinstance(value, torch.Tensor) else None


class Shared:
    """The outputs of one call that several Derived read: computed by the first read, held until
    the `reads` expected have been made (the saver counts one for each save that will read it:
    `claim`); a read beyond them computes again."""

    __slots__ = ("reads", "value")

    def __init__(self, reads: int) -> None:
        self.reads, self.value = reads, None


def claim(*values: Any) -> None:
    """Counts one more read of every Shared call that materializing `values` together (what a pack
    hook returns, or what one recomputed call reads) will read: once each, as one materialization
    computes each Derived once."""
    todo, seen = list(values), set()
    while todo:
        value = todo.pop()
        value = getattr(value, "value", value) if not isinstance(value, (Derived, torch.Tensor)) else value
        if isinstance(value, Derived) and id(value) not in seen:
            seen.add(id(value))
            if value.shared is not None:
                value.shared.reads += 1
                if value.shared.reads > 1:
                    continue  # computed once for all its reads: what it reads was counted at its first
            todo.extend(use.value for use in value.uses())


def reachable(derived: "Derived") -> List["Derived"]:
    """`derived` and every Derived its Uses lead to, each once (the graph shares: `y * sigmoid(y)`
    reads y twice, and a chain of such ops has exponentially many paths)."""
    found, todo, seen = [], [derived], {id(derived)}
    while todo:
        d = todo.pop()
        found.append(d)
        for use in d.uses():
            if isinstance(use.value, Derived) and id(use.value) not in seen:
                seen.add(id(use.value))
                todo.append(use.value)
    return found


def uses_of(derived: "Derived") -> List[Use]:
    """Every Use of `derived` and of the Derived values it refers to."""
    return [use for d in reachable(derived) for use in d.uses()]


def accept_projections(derived: "Derived") -> None:
    """Marks the matrix products `derived` recomputes as accepted by a save: what is later derived
    from it recomputes nothing more than it does."""
    for d in reachable(derived):
        d.projection = False


def parameters_present(derived: "Derived") -> bool:
    """False if a parameter `derived` reads has no data now: a sharding wrapper (FSDP resharding a
    module after its forward, ZeRO-3) frees it until that module's own backward, which may come
    after the recomputation's. The parameter must then not be read in backward."""
    return all(_holds_data(use.value, use.numel) for use in uses_of(derived)
               if use.parameter and isinstance(use.value, torch.Tensor))


def _holds_data(t: torch.Tensor, numel: Optional[int]) -> bool:
    """Whether parameter `t` (of `numel` elements when recorded) has its data now."""
    if numel is not None and t.numel() != numel:  # FSDP1 swaps in an empty or flat shard
        return False
    if hasattr(t, "ds_id"):  # DeepSpeed ZeRO-3: gathered for its own module's passes, unless persistent
        return bool(getattr(t, "ds_persist", False)) or getattr(getattr(t, "ds_status", None), "name", "") == "AVAILABLE"
    if t.numel() == 0 or _wrapper_subclass(t):  # a DTensor's data is its local shard's business
        return True
    extent = t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= extent * t.element_size()


try:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _wrapper_subclass
except ImportError:  # torch 1.13, which records nothing
    def _wrapper_subclass(t: torch.Tensor) -> bool:
        return False


#: What a memo holds for a Derived being computed (a cycle would find it).
_COMPUTING: Any = object()


class Derived:
    """A saved tensor recomputed in backward: ``func(*args, **kwargs)`` (its `index`-th output)
    with every `Use` replaced by its decoded value, under the autocast state of the forward.
    Derived with the same `shared` call `func` once between them. `projection`: a matrix product
    is among what it recomputes that no save has accepted yet (`accept_projections`);
    `reads_projection`: a matrix product is among what it recomputes, accepted or not."""

    __slots__ = ("func", "spec", "leaves", "index", "autocast", "shape", "dtype", "shared", "projection",
                 "reads_projection")

    def __init__(self, func: Callable[..., Any], spec: Any, leaves: List[Any], index: Optional[int],
                 autocast: Optional[Tuple[str, bool, torch.dtype]], shape: Tuple[int, ...], dtype: torch.dtype,
                 shared: Optional[Shared] = None) -> None:
        self.func, self.spec, self.leaves, self.index = func, spec, leaves, index
        self.autocast = autocast
        self.shape, self.dtype = shape, dtype
        self.shared = shared
        made = [leaf.value for leaf in leaves if isinstance(leaf, Use) and isinstance(leaf.value, Derived)]
        own = kind_of(func) == "projection"
        self.projection = own or any(d.projection for d in made)
        self.reads_projection = own or any(d.reads_projection for d in made)

    def uses(self) -> List[Use]:
        return [leaf for leaf in self.leaves if isinstance(leaf, Use)]

    def materialize(self, decode: Callable[[Any, Dict[int, torch.Tensor]], torch.Tensor],
                    memo: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
        """The tensor, recomputed; `decode(value, memo)` gives the tensor a Use's value stands for.
        `memo` (by id: what one unpack has computed) makes each Derived and each stored value
        reached through several paths computed and decoded once."""
        if memo is None:
            memo = {}
        done = memo.get(id(self))
        if done is _COMPUTING:
            raise RuntimeError(f"compress_saved(recompute=True): recomputing {getattr(self.func, '__name__', self.func)} "
                               "needs its own result; pass recompute=False and report this")
        if done is not None:
            return done
        memo[id(self)] = _COMPUTING
        shared = self.shared
        if shared is None:
            out = self._call(decode, memo)
        else:
            if shared.value is None:
                shared.value = self._call(decode, memo)
            out = shared.value
            shared.reads -= 1
            if shared.reads <= 0:
                shared.value = None
        if self.index is not None:
            out = out[self.index]
        if tuple(out.shape) != self.shape or out.dtype != self.dtype:
            raise RuntimeError(f"compress_saved(recompute=True): recomputing {getattr(self.func, '__name__', self.func)} "
                               f"gave {tuple(out.shape)} {out.dtype}, not the saved {self.shape} {self.dtype}; "
                               "pass recompute=False and report this")
        memo[id(self)] = out
        return out

    def _call(self, decode: Callable[[Any, Dict[int, torch.Tensor]], torch.Tensor], memo: Dict[int, torch.Tensor]) -> Any:
        leaves = []
        for leaf in self.leaves:
            if isinstance(leaf, Use):
                value = leaf.value
                if isinstance(value, torch.Tensor):
                    if leaf.parameter and not _holds_data(value, leaf.numel):
                        raise RuntimeError(
                            f"compress_saved(recompute=True): a parameter of shape {tuple(value.shape)} that "
                            f"recomputing {getattr(self.func, '__name__', self.func)} reads has no data in backward: "
                            "something freed it after forward (a sharding wrapper such as FSDP or ZeRO-3 that "
                            "gathers it again only for its own module's backward). Wrap the module that reads it "
                            "and the module that made it in one sharded unit, or pass recompute=False")
                    if leaf.version is not None and value._version != leaf.version:
                        # A parameter: torch would compute with the forward's values where no op
                        # saved it (a bias added), so recomputing with the new ones would differ.
                        raise RuntimeError(
                            f"compress_saved(recompute=True): a parameter of shape {tuple(value.shape)} that "
                            f"recomputing {getattr(self.func, '__name__', self.func)} reads was modified in place "
                            f"between forward and backward (version {leaf.version}, now {value._version}; an "
                            "optimizer step before backward?), so the recomputed tensor would not be the one forward "
                            "made. Run backward before changing parameters, or pass recompute=False"
                            if leaf.parameter else
                            "compress_saved: one of the tensors needed for gradient computation was modified by an "
                            f"in-place operation after it was saved (version {leaf.version}, now {value._version}); "
                            "torch raises the same error without compress_saved. Use the out-of-place op, or clone "
                            "the tensor before changing it")
                    leaf = value
                elif isinstance(value, Derived):
                    leaf = value.materialize(decode, memo)  # memoized there (a cycle raises there)
                else:
                    leaf = memo.get(id(value))
                    if leaf is None:
                        leaf = memo[id(value)] = decode(value, memo)
            leaves.append(leaf)
        args, kwargs = _unflatten_call(leaves, self.spec)
        with torch.no_grad(), _autocast(self.autocast):
            return self.func(*args, **kwargs)


def flatten(args: Tuple[Any, ...]) -> Tuple[List[Any], Any]:
    """(leaves, spec) of positional `args` as Derived holds them."""
    return _flatten_call(args, {})


class _FlatCall:
    """The spec of a call whose arguments hold no container: how many are positional, and the
    keywords' names. Most recorded calls are so (tensors and scalars), and torch's pytree costs
    tens of microseconds a call on the forward's hot path."""

    __slots__ = ("positional", "names")

    def __init__(self, positional: int, names: Tuple[str, ...]) -> None:
        self.positional, self.names = positional, names


_SCALARS = (int, float, bool)


def _leaf(value: Any) -> bool:
    """True for an argument _FlatCall keeps whole: anything but a container, and a list or tuple
    of numbers (a shape, layer_norm's normalized_shape), which holds no tensor to replace."""
    if isinstance(value, dict):
        return False
    if isinstance(value, (list, tuple)):
        return all(type(v) in _SCALARS for v in value)
    return True


def _flatten_call(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[List[Any], Any]:
    """(leaves, spec) of a call's arguments: a _FlatCall where every argument is a leaf (`_leaf`),
    torch's pytree otherwise (which drops None: it is an empty node there, a leaf here)."""
    for value in args:
        if not _leaf(value):
            return tree_flatten((args, kwargs))
    for value in kwargs.values():
        if not _leaf(value):
            return tree_flatten((args, kwargs))
    return [*args, *kwargs.values()], _FlatCall(len(args), tuple(kwargs))


def _unflatten_call(leaves: List[Any], spec: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """(args, kwargs) back from `_flatten_call`'s leaves and spec."""
    if isinstance(spec, _FlatCall):
        n = spec.positional
        return tuple(leaves[:n]), dict(zip(spec.names, leaves[n:]))
    return tree_unflatten(leaves, spec)


def _autocast_state(device: torch.device) -> Optional[Tuple[str, bool, torch.dtype]]:
    kind = device.type
    if kind not in ("cpu", "cuda"):
        return None
    return (kind, *_amp.state(kind))


class _NoAutocast:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _autocast(state: Optional[Tuple[str, bool, torch.dtype]]) -> Any:
    if state is None:
        return _NoAutocast()
    kind, enabled, dtype = state
    return torch.autocast(kind, dtype=dtype, enabled=enabled)


def _is_compiling_function() -> Optional[Callable[[], bool]]:
    """torch's "is torch.compile tracing?" (True in traced code): torch.compiler's on torch >= 2.2;
    torch._dynamo's on 2.0 and 2.1, imported here for it (~0.2 s), because dynamo 2.1 folds it to
    True only when it reads the function from a module global (looked up at trace time through
    sys.modules, it ran the eager function: False); none on 1.13."""
    found = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if found is None and hasattr(torch, "compile"):
        try:
            found = getattr(importlib.import_module("torch._dynamo"), "is_compiling", None)
        except Exception:  # a torch whose dynamo does not import cannot compile either
            found = None
    return found


# Looked up once: the recorder asks on every torch function of a forward.
_IS_COMPILING: Optional[Callable[[], bool]] = _is_compiling_function()


def _compiling() -> bool:
    """True while torch.compile traces (torch >= 2.0; 1.13 cannot compile)."""
    return _IS_COMPILING is not None and bool(_IS_COMPILING())


class Recorder(TorchFunctionMode):
    """The torch function mode of a recomputing block: records what cheap functions make.

    `resolve(tensor)` is the block's: the Use a tensor argument becomes, or None if it is none of
    a parameter, a small constant, a packed tensor or a recorded output (then the function's
    outputs are not recorded). Records are dropped when their output is freed.
    """

    def __init__(self, resolve: Callable[[torch.Tensor, int], Optional[Use]], projections: bool = False) -> None:
        super().__init__()
        self._resolve = resolve
        #: Record matrix products too (kind "projection"; see the module's docstring).
        self.projections = projections
        self._records: Dict[int, Tuple[Any, Derived, int]] = {}
        #: False while the block packs or unpacks (its own torch calls are not the model's) and
        #: once backward has begun.
        self.recording = True
        #: Called with every result the model's calls return while recording (compress_saved
        #: learns the node of an op that saved only its inputs from it).
        self.watch: Optional[Callable[[Any], None]] = None

    def __torch_function__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # torch.compile traces this handler when a compiled model runs in the block: its graph
        # recomputes on its own (the partitioner), and sees a plain call.
        if self.recording and not _compiling() and torch.is_grad_enabled():
            if self.watch is not None:
                self.watch(out)
            kind = kind_of(func)
            if kind is not None and (kind != "projection" or self.projections):
                self._record(func, kind, args, kwargs, out)
        return out

    def _record(self, func: Any, kind: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        if isinstance(out, torch.Tensor):
            outputs: List[Tuple[Optional[int], torch.Tensor]] = [(None, out)]
        elif isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
            outputs = list(enumerate(out))
        else:
            return
        leaves, spec = _flatten_call(args, kwargs)
        # Only those autograd may save, and never an argument handed back as it is (`x.to(x.dtype)`,
        # a contiguous tensor's contiguous()): it would be recorded as made from itself.
        inputs = {id(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)}
        outputs = [(i, o) for i, o in outputs if o.requires_grad and id(o) not in inputs]
        if not outputs:
            return
        budget = max(o.numel() * o.element_size() for _, o in outputs)
        projection = kind == "projection"
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                use = self._resolve(leaf, budget)
                if use is None or (projection and isinstance(use.value, Derived) and use.value.reads_projection):
                    return  # unknown, or a product of a product: one product per recomputed tensor
                leaves[i] = use
        state = _autocast_state(outputs[0][1].device)
        # A matrix product is computed once for all the saves that read it (claim counts them).
        shared = Shared(0) if projection else None
        for index, o in outputs:
            derived = Derived(func, spec, leaves, index, state, tuple(o.shape), o.dtype, shared)
            key = id(o)
            self._records[key] = (weakref.ref(o, lambda _, key=key: self._records.pop(key, None)), derived, o._version)

    def derivation(self, t: torch.Tensor) -> Optional[Derived]:
        """The Derived recorded for `t` itself (not a view of it), if unchanged since."""
        entry = self._records.get(id(t))
        if entry is None or entry[0]() is not t or entry[2] != t._version:
            return None
        return entry[1]

    def clear(self) -> None:
        self._records.clear()


#: A leaf to fill in (pytree treats None as an empty node, not a leaf).
_SLOT = object()


def _strided(base: torch.Tensor, base_stride: Tuple[int, ...], size: Tuple[int, ...], stride: Tuple[int, ...],
             offset: int) -> torch.Tensor:
    """The view (size, stride, offset elements from base's first) of `base` laid out as base_stride."""
    if tuple(base.stride()) != base_stride:
        laid = torch.empty_strided(base.shape, base_stride, dtype=base.dtype, device=base.device)
        laid.copy_(base)
        base = laid
    return base.as_strided(size, stride, base.storage_offset() + offset)


def dense(t: torch.Tensor) -> bool:
    """True if `t`'s elements fill the stretch of memory from its first without gaps or overlap (a
    contiguous tensor or a permutation of one), so a view of it can be rebuilt from its values."""
    if t.is_contiguous():
        return True
    pairs = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for st, n in pairs:
        if st != expected:
            return False
        expected *= n
    return True


def view_of(base: Any, base_tensor: torch.Tensor, t: torch.Tensor) -> Derived:
    """`t`, a view of the dense tensor `base_tensor` that `base` (a Use's value) stands for, as a
    Derived."""
    offset = t.storage_offset() - base_tensor.storage_offset()
    leaves, spec = tree_flatten(((_SLOT, tuple(base_tensor.stride()), tuple(t.shape), tuple(t.stride()), offset), {}))
    leaves[0] = Use(base, None)
    return Derived(_strided, spec, leaves, None, None, tuple(t.shape), t.dtype)
