"""Which module calls of a recorded example call a residual add bypasses (abp.convert).

The 2-bit activations' defined derivative has an error that compounds along a chain of layers
the gradient must all pass through (bench/activation_chains.py: 12 Conv-BatchNorm-SiLU layers,
first-layer gradient error 3.4; 12 pre-norm residual blocks, 0.54). A transformer's activations
sit in residual branches (``x + mlp(x)``): the gradient reaches earlier layers along the skip
too, so their error does not compound. A CNN's do not, or sit after the residual add (ResNet's
``act(bn(conv(x)) + x)``), on the path every gradient takes.

``Dataflow`` rebuilds the call's dataflow from abp._structure's events as values (a tensor id is
a new value each time an op writes it, so ``h += x`` is told apart from ``h``), and
``bypassed(module)`` says whether, for every call of the module, the nearest add that combines a
value computed from its output with one computed, without it, from a value its input was
computed from (the skip around it) closes a branch holding no other activation; ``producers(module)`` names the ops that made its inputs.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from ._structure import Structure

__all__ = ["Dataflow"]

#: Torch functions that hand their first input on, as far as where it came from goes.
_PASS_ON = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                      "contiguous", "clone", "detach", "to", "type_as"})
#: Torch functions that add two tensors (what a residual connection is).
_ADDS = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})
#: Torch functions that normalise what they read (a norm module's own ops aside: its output is named).
_NORMS = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"})


class Dataflow:
    """The values of one recorded call, their producers, and each module call's input and output."""

    def __init__(self, structure: Structure, constants: Set[int] = frozenset()) -> None:
        """`constants`: ids of tensors besides the parameters that no skip is made of (the model's
        buffers: one added in every layer would otherwise look like a skip around each)."""
        self._parents: List[Tuple[int, ...]] = []  # value -> the values its op read
        self._function: List[Optional[str]] = []  # value -> the op that wrote it (None: given)
        self._children: List[List[int]] = []
        self._constants: Set[int] = set()  # values of the model's parameters and `constants`
        # module name -> (input value, output value) of each call, in order
        self.calls: Dict[str, List[Tuple[int, int]]] = {}
        current: Dict[int, int] = {}  # tensor id -> its value now
        started: Dict[str, int] = {}  # module running now -> the value of its input when it began

        def value_of(tid: int) -> int:
            if tid not in current:
                current[tid] = self._new((), None)
                if tid in structure.parameters or tid in constants:
                    self._constants.add(current[tid])
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

    def _closure(self, start: int, edges: Sequence[Sequence[int]],
                 keep: Optional[Callable[[int], bool]] = None) -> Set[int]:
        """`start` and every value reachable from it along `edges` (through values `keep` accepts)."""
        seen = {start}
        stack = [start]
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt not in seen and (keep is None or keep(nxt)):
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    def producers(self, module: str) -> List[Optional[str]]:
        """For each call of `module`, the torch function that made its input, looking through those
        that pass a tensor on (dropout, copies); None where no recorded op made it."""
        found = []
        for value, _ in self.calls.get(module, []):
            while self._function[value] in _PASS_ON and self._parents[value]:
                value = self._parents[value][0]
            found.append(self._function[value])
        return found

    def outputs(self, modules: Sequence[str]) -> Set[int]:
        """The values every call of `modules` made (what `bypassed` counts in a branch)."""
        return {out for name in modules for _, out in self.calls.get(name, [])}

    def bypassed(self, module: str, activations: Set[int], normalized: Set[int] = frozenset()) -> Optional[bool]:
        """True if a residual add bypasses every call of `module`; False if one call is on a path
        no add bypasses; None if the module did not run. The add must close a branch that holds
        no other of the `activations` values (`outputs` of the activation modules): a skip over
        several (a long skip across a chain, a CNN branch of Conv-BatchNorm-activation layers)
        leaves each on a path whose error compounds through the others. Activations in parallel
        paths of the branch (a mixture of experts' experts and shared expert) are not a chain.
        Nor may a norm stand between the call and the add (`normalized`: what norm modules made;
        or a norm function): a branch normalised before it is added back (Gemma 2's and GLM-4's
        post-MLP norms) is rescaled to the skip's size whatever its own, so its gradient, and the
        error of the activation's, is not the small share of the block's that the skip leaves."""
        calls = self.calls.get(module)
        if not calls:
            return None
        return all(self._bypassed(a, b, activations, normalized) for a, b in calls)

    def _bypassed(self, given: int, made: int, activations: Set[int], normalized: Set[int]) -> bool:
        before = self._closure(given, self._parents) - self._constants
        after = self._closure(made, self._children)

        def source(operand: int) -> Optional[int]:
            """The latest value the call's input was made from that `operand` was made from too,
            without this call's output nor another activation: where a skip around the call
            starts. None if none is (a parallel branch through its own activation is no skip:
            the gradient through either branch meets an activation)."""
            if operand in after:
                return None
            if operand in before:
                return operand
            if operand in activations:
                return None
            reach = self._closure(operand, self._parents, lambda v: v in before or v not in activations)
            return max(reach & before, default=None)

        # The nearest add of a value made from this output and one made, without it, from a value
        # its input was made from: the residual add closing the branch this call is in, if any.
        # The skip may reach the add through other ops (Cohere's ``residual + attn + mlp`` adds
        # the MLP's output to ``residual + attn``, which its input was not made from).
        for add in sorted(v for v in after if self._function[v] in _ADDS):
            parents = self._parents[add]
            if not any(p in after for p in parents):
                continue
            skips = {s for s in map(source, parents) if s is not None}
            if skips:
                break
        else:
            return False
        plain = self._closure(made, self._children,
                              lambda v: v not in normalized and self._function[v] not in _NORMS)
        if not any(p in plain for p in parents):
            return False  # every path from this call to the add passes a norm
        for skip in sorted(skips):
            # The branch: every value on a path from the skip's source to the add.
            branch = self._closure(add, self._parents, lambda v, lo=skip: v >= lo) & \
                self._closure(skip, self._children, lambda v: v <= add)
            # Only activations on a path through this call count: one before it or after it in the
            # branch compounds with it; one beside it (a parallel expert, a shared expert) does not,
            # as the gradient through this call passes none of those.
            chained = (branch - {skip}) & activations & (before | after)
            if len(chained) <= 1:  # this call's own output; the skip's source may be an activation's output
                return True
        return False
