"""Which module calls of a recorded example call a residual add bypasses (abp.convert).

The 2-bit activations' defined derivative has an error that compounds along a chain of layers
the gradient must all pass through (bench/activation_chains.py: 12 Conv-BatchNorm-SiLU layers,
first-layer gradient error 3.4; 12 pre-norm residual blocks, 0.54). A transformer's activations
sit in residual branches (``x + mlp(x)``): the gradient reaches earlier layers along the skip
too, so their error does not compound. A CNN's do not, or sit after the residual add (ResNet's
``act(bn(conv(x)) + x)``), on the path every gradient takes.

``Dataflow`` rebuilds the call's dataflow from abp._structure's events as values (a tensor id is
a new value each time an op writes it, so ``h += x`` is told apart from ``h``), and
``bypassed(module)`` says whether, for every call of the module, some add combines a value
computed from its output with one its input was computed from: the skip around it;
``producer(module)`` names the op that made its input.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

from ._structure import Structure

__all__ = ["Dataflow"]

#: Torch functions that hand their first input on, as far as where it came from goes.
_PASS_ON = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                      "contiguous", "clone", "detach", "to", "type_as"})
#: Torch functions that add two tensors (what a residual connection is).
_ADDS = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})


class Dataflow:
    """The values of one recorded call, their producers, and each module call's input and output."""

    def __init__(self, structure: Structure) -> None:
        self._parents: List[Tuple[int, ...]] = []  # value -> the values its op read
        self._function: List[Optional[str]] = []  # value -> the op that wrote it (None: given)
        self._children: List[List[int]] = []
        self._parameters: Set[int] = set()  # values that are the model's parameters
        # module name -> (input value, output value) of each call, in order
        self.calls: Dict[str, List[Tuple[int, int]]] = {}
        current: Dict[int, int] = {}  # tensor id -> its value now
        started: Dict[str, int] = {}  # module running now -> the value of its input when it began

        def value_of(tid: int) -> int:
            if tid not in current:
                current[tid] = self._new((), None)
                if tid in structure.parameters:
                    self._parameters.add(current[tid])
            return current[tid]

        # Each call's tensor inputs, from its event (recorded when the call returns).
        given: Dict[str, List[Tuple[int, ...]]] = {}
        for event in structure.events:
            if event.module is not None:
                given.setdefault(event.module, []).append(event.inputs)
        done: Dict[str, int] = {}  # module -> calls returned so far
        for event in structure.events:
            # A call's input is read when the first op inside it runs (an op outside it may have
            # written the tensor in place since it was made).
            for name in event.within:
                if name not in started:
                    ids = given.get(name, [])[done.get(name, 0):][:1]
                    if ids and ids[0]:
                        started[name] = value_of(ids[0][0])
            if event.function is not None:
                read = tuple(value_of(t) for t in event.inputs)
                for tid in event.outputs:
                    current[tid] = self._new(read, event.function)
                continue
            name = event.module
            assert name is not None
            read = tuple(value_of(t) for t in event.inputs)
            for tid in event.outputs:
                if tid not in current:  # made without a recorded op (an extension's kernel)
                    current[tid] = self._new(read, None)
            begun = started.pop(name, None)
            done[name] = done.get(name, 0) + 1
            if event.inputs and event.outputs:
                self.calls.setdefault(name, []).append((read[0] if begun is None else begun, current[event.outputs[0]]))

    def _new(self, parents: Tuple[int, ...], function: Optional[str]) -> int:
        value = len(self._parents)
        self._parents.append(parents)
        self._function.append(function)
        self._children.append([])
        for p in parents:
            self._children[p].append(value)
        return value

    def _closure(self, start: int, edges: Sequence[Sequence[int]]) -> Set[int]:
        seen = {start}
        stack = [start]
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    def producer(self, module: str) -> Optional[str]:
        """The torch function that made the input of `module`'s first call, looking through those
        that pass a tensor on (dropout, copies); None if it did not run or no recorded op made it."""
        calls = self.calls.get(module)
        if not calls:
            return None
        value = calls[0][0]
        while self._function[value] in _PASS_ON and self._parents[value]:
            value = self._parents[value][0]
        return self._function[value]

    def bypassed(self, module: str) -> Optional[bool]:
        """True if a residual add bypasses every call of `module`; False if one call is on a path
        no add bypasses; None if the module did not run."""
        calls = self.calls.get(module)
        if not calls:
            return None
        return all(self._bypassed(a, b) for a, b in calls)

    def _bypassed(self, given: int, made: int) -> bool:
        before = self._closure(given, self._parents) - self._parameters
        after = self._closure(made, self._children)
        for value in after:
            if self._function[value] not in _ADDS:
                continue
            parents = self._parents[value]
            if any(p in after for p in parents) and any(p in before and p not in after for p in parents):
                return True
        return False
