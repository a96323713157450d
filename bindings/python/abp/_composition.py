"""Which of convert's replacements really save memory, counted on the example call (abp.convert).

A replacement lowers what one layer stores on its own, but what a model keeps depends on its
neighbours and on the other recipes:

- under ``compress_saved`` an exact SiLU's output is recomputed from its stored input, while
  ReSiLU2's output must be stored (its backward keeps only 2-bit codes of the input), so a
  SwiGLU block stores more with ReSiLU2 than without it;
- a sampled linear map stores a fraction of its input's rows, which saves nothing where another
  operation keeps the whole input anyway (an expert beside a router, a projection whose input a
  norm's backward reads), and under ``compress_saved`` its output can no longer be recomputed.

So each group of like replacements (one class replaced by one class at one path up to layer
numbers) is tried without: the example call's saved bytes (abp.memory's accounting, compressed
codes as stored) are counted with the group and without it, and the group is put back where the
model stores fewer bytes without it: an approximate backward that stores more costs accuracy and
time for nothing. A tie keeps the group: inside a checkpointed block (torch.utils.checkpoint,
transformers' gradient_checkpointing_enable) forward saves nothing the count could see, and the
replacements there lower the peak of the block's recompute. Groups are tried one after another
against the model as it then stands, so neighbours' interactions are counted; the groups that
stayed are then tried together (those of one kind, then all), since groups that each tie alone
may store fewer bytes without all of them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _scale, _structure, memory

__all__ = ["Candidate", "PutBack", "keep_what_saves", "put", "saved_bytes_of_call"]


@dataclass(frozen=True)
class Candidate:
    """One replacement convert made: the module `new` stands at `paths` where `original` stood."""

    name: str
    paths: Tuple[str, ...]
    original: nn.Module
    new: nn.Module
    recipe: str

    def revertible(self) -> bool:
        """Whether putting the original back restores the model's function: it must hold nothing the
        replacement took away (a folded norm's affine now lives in the linear layers after it)."""
        kept = {id(p) for p in self.new.parameters()}
        return all(id(p) in kept for p in self.original.parameters())

    @property
    def pattern(self) -> str:
        """The path with its layer numbers as ``*``: ``blocks.*.mlp.act``."""
        return ".".join("*" if part.isdigit() else part for part in self.name.split("."))

    def group(self) -> Tuple[str, type, type, str]:
        return self.recipe, type(self.original), type(self.new), self.pattern


def put(model: nn.Module, paths: Sequence[str], module: nn.Module) -> None:
    """Puts `module` at every path of one module (convert's replacements and their undoing), so a
    module registered twice is not left half-converted."""
    for path in paths:
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, module)


def _trainable(value: Any) -> Any:
    """`value` with every inference tensor in it cloned (a convert under torch.inference_mode gets
    its example made there; autograd cannot save such a tensor)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if type(value) in (list, tuple):
        return type(value)(_trainable(v) for v in value)
    if isinstance(value, dict):
        return {k: _trainable(v) for k, v in value.items()}
    return value


def saved_bytes_of_call(model: nn.Module, call: Tuple[Tuple[Any, ...], Dict[str, Any]]) -> int:
    """The bytes ``model(*args, **kwargs)`` saves for backward (parameters and buffers left out),
    as training would save them: gradients on, every module in training mode (a model fresh from
    ``from_pretrained`` is in eval mode, where a sampled layer is a plain Linear), and as a large
    batch would save them in proportion (abp._scale: no floor on sampled rows, no small tensor
    left raw). The RNG state, the buffers and the modes are put back; the autocast state is the
    caller's; warnings are not shown."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in modes:
            m.training = True
        # Its warnings are the count's own (compress_saved's about a call that failed half-way).
        with _structure.untouched(model), _scale.ignored(), torch.inference_mode(False), torch.enable_grad(), \
                warnings.catch_warnings(), memory.SavedTensorsCounter() as counter:
            warnings.simplefilter("ignore")
            output = model(*_trainable(call[0]), **_trainable(call[1]))
            del output  # the graph and what it saved go now
    finally:
        for m, training in modes:
            m.training = training
    return counter.activation_bytes(model)


@dataclass(frozen=True)
class PutBack:
    """A candidate put back: the bytes counted with its group and without, or, for a group the
    example call never ran, the pattern of the group of the same classes whose decision it took."""

    candidate: Candidate
    with_bytes: int
    without_bytes: int
    like: Optional[str] = None


def _ran(candidates: Sequence[Candidate], count: Callable[[], int]) -> Tuple[int, set]:
    """count(), and the ids of the candidates' new modules that ran in it."""
    ran: set = set()
    handles = [c.new.register_forward_pre_hook(lambda module, args: ran.add(id(module))) for c in candidates]
    try:
        return count(), ran
    finally:
        for h in handles:
            h.remove()


def keep_what_saves(model: nn.Module, candidates: Sequence[Candidate], count: Callable[[], int]
                    ) -> Tuple[List[PutBack], Optional[Exception]]:
    """Puts back the originals of every group of `candidates` without which `count()` (the model's
    saved bytes on the example call) is lower. A group the call never ran (a branch another batch
    size takes) counts the same either way; it follows the groups of its classes that ran, put
    back if they all were, else it stays. Returns what was put back, and the error of a count
    that failed: the groups not yet decided then stay replaced."""
    groups: Dict[Tuple[str, type, type, str], List[Candidate]] = {}
    for c in candidates:
        if c.revertible():
            groups.setdefault(c.group(), []).append(c)
    put_back: List[PutBack] = []
    if not groups:
        return put_back, None
    try:
        current, ran = _ran([c for members in groups.values() for c in members], count)
    except Exception as e:
        return put_back, e
    if current == 0:  # the call saves nothing (no gradients anywhere): nothing to decide by
        return put_back, None
    decided: Dict[Tuple[str, type, type], Dict[str, bool]] = {}  # classes -> pattern -> put back
    idle: List[Tuple[Tuple[str, type, type, str], List[Candidate]]] = []
    kept: List[Tuple[Tuple[str, type, type, str], List[Candidate]]] = []  # ran, and stayed

    def place(members: Sequence[Candidate], originals: bool) -> None:
        for c in members:
            put(model, c.paths, c.original if originals else c.new)

    def counted_with(members: Sequence[Candidate], originals: bool) -> int:
        """count() with `members` as their originals (or their replacements); where it raises,
        they are placed back as they were and the error goes on."""
        place(members, originals)
        try:
            return count()
        except Exception:
            place(members, not originals)
            raise

    def without(chosen: Sequence[Tuple[Tuple[str, type, type, str], List[Candidate]]]) -> bool:
        """Puts back the groups `chosen` if the model then stores fewer bytes; raises what the count
        raised, with the groups replaced again."""
        nonlocal current
        members = [c for _, group in chosen for c in group]
        counted = counted_with(members, originals=True)
        if counted >= current:
            place(members, originals=False)
            return False
        before, current = current, counted
        if len(chosen) > 1:
            # A group put back with the others only because they were tried together (its own
            # part ties) is replaced again: a tie keeps the replacement.
            needed = []
            for key, group in chosen:
                again = counted_with(group, originals=False)
                if again <= current:
                    current = again
                else:
                    place(group, originals=True)
                    needed.append((key, group))
            chosen = needed
        put_back.extend(PutBack(c, before, current) for _, group in chosen for c in group)
        for key, _ in chosen:
            decided[key[:3]][key[3]] = True
        return bool(chosen)

    try:
        for key, members in groups.items():
            if not any(id(c.new) in ran for c in members):
                idle.append((key, members))
                continue
            decided.setdefault(key[:3], {})[key[3]] = False
            if not without([(key, members)]):
                kept.append((key, members))
        # Groups that each tie alone may not tie together: the norms of a mixture-of-experts
        # model under compress_saved stored the same bytes with any one of their three groups
        # put back and 5 % fewer with all of them. The groups that stayed are tried together,
        # those of one kind of replacement, then all of them.
        kinds: Dict[Tuple[str, type, type], List[Tuple[Tuple[str, type, type, str], List[Candidate]]]] = {}
        for key, members in kept:
            kinds.setdefault(key[:3], []).append((key, members))
        together = [chosen for chosen in kinds.values() if len(chosen) > 1]
        if len(kinds) > 1:
            together.append(kept)
        for chosen in together:
            left = [(key, members) for key, members in chosen if not decided[key[:3]][key[3]]]
            if len(left) > 1:
                without(left)
    except Exception as e:
        return put_back, e
    for key, members in idle:
        like = decided.get(key[:3], {})
        if like and all(like.values()):
            for c in members:
                put(model, c.paths, c.original)
            put_back += [PutBack(c, current, current, next(iter(like))) for c in members]
    return put_back, None
