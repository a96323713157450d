"""Adaptive per-tensor bit widths for compressed saved activations (GACT, docs/algorithms.md §6.3).

`allocate_bits` is the greedy solver of §6.3: given each saved tensor's sensitivity C_l and element
count D_l, it picks b_l ∈ {32, 8, 4, 2, 1} (32 = stored raw, zero variance) to reduce the
linearised gradient variance Σ_l C_l/(2^{b_l} − 1)² under the memory budget Σ_l b_l·D_l ≤
B_avg·Σ_l D_l.

`CompressionController` drives `abp.compress.compress_saved` with such an allocation during
training. Wrap each training step's forward and backward in ``with controller:``::

    controller = abp.CompressionController(model, avg_bits=4.0)
    for x, y in loader:
        optimizer.zero_grad()
        with controller:
            loss = loss_fn(model(x), y)
            loss.backward()
        optimizer.step()

Each saved tensor is identified by a `TensorKey`: the innermost submodule of `model` running when
it was saved, its shape and dtype, and how many earlier tensors of the step had that same
(module, shape, dtype). Unlike GACT's save-order ids, a tensor skipped or added in one branch does
not shift the keys of the others. At step 0 and then every `interval` steps the controller
re-estimates every key's sensitivity by replaying the step's model calls (see the class docstring)
and re-allocates the bits.

In a stock ``transformers.Trainer``, ``trainer.add_callback(abp.controller.trainer_callback(controller))``
makes each micro-batch's forward and backward one such step (see `trainer_callback`).
"""
from __future__ import annotations

import contextlib
import heapq
import math
import numbers
import operator
import sys
import warnings
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from . import _replay
from .convert import recipe_block_in
from .compress import (MIN_UNIFORM_BITS, _compiling, check_generator, code_layout, coded_numel, compress_saved,
                       inside_outside_blocks, keeps_support)

__all__ = ["CompressionController", "TensorKey", "allocate_bits", "RUNGS", "trainer_callback"]

def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run as Python even inside code torch.compile traces (a graph break there): what the
    controller must see of a compiled model's call, at its edge."""
    compiler = getattr(torch, "compiler", None)
    disable = getattr(compiler, "disable", None)
    return _Hook(disable(fn)) if disable is not None else _Hook(fn)


#: What abp.convert reads off a hook to name who put it there (it refuses to replace hooked modules).
_OWNER = "abp.CompressionController"


class _Inert:
    """What a controller's hook is in a copy of the model: nothing, still owned (abp.convert
    names the controller where its hooks keep a module from being replaced)."""

    abp_owner = _OWNER

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Hook(partial):
    """A hook the controller puts on the model. It acts for the model object it was made for
    only: copied with the model (copy.deepcopy, torch.save of the whole model) it becomes
    `_Inert`, as the controller does not train the copy; a new controller on the copy would."""

    abp_owner = _OWNER

    def __reduce__(self) -> Any:
        return (_Inert, ())


#: The ladder of widths, widest first; 32 means "store the tensor raw" (no quantisation variance).
RUNGS: Tuple[int, ...] = (32, 8, 4, 2, 1)
#: Sensitivities that are not finite count as this many times the largest finite one
#: (docs/algorithms.md §6.3).
MAX_SENSITIVITY = 1e10
#: The module path of tensors saved while no submodule of the model runs (the loss, for example).
OUTSIDE = "<outside>"
#: interval="auto": steps between estimates per replay the last one ran. An estimate replays the
#: step's model calls once per probed key and once exact, each a forward and backward no dearer
#: than a compressed step's (the replays keep most tensors raw), so spacing them this far apart
#: keeps the estimates under 1 / 20 = 5 % of the training time however many keys a model has (a
#: fixed 1000 steps gave a 6-layer encoder's 67 keys 5.1 %, and a model with 300 keys 25 %).
AUTO_STEPS_PER_REPLAY = 20
#: interval="auto": steps until the next estimate after a probe step that could measure nothing (a
#: compiled model: its graph runs without the controller's hooks), instead of trying every step.
UNMEASURED_STEPS = 1000


# ---------------------------------------------------------------------------------------------------
# The allocation problem.


def _variance(c: float, bits: int) -> float:
    """The linearised variance C/(2^b − 1)² of one tensor at `bits` (zero when stored raw)."""
    return 0.0 if bits == 32 else c / float((1 << bits) - 1) ** 2


def _lowering_cost(c: float, costs: Sequence[int], rung: int, to: int) -> float:
    """Variance added per bit saved by lowering a tensor from RUNGS[rung] to RUNGS[to]
    (`costs`: its bits stored at each rung; `to` saves some)."""
    return (_variance(c, RUNGS[to]) - _variance(c, RUNGS[rung])) / (costs[rung] - costs[to])


def _plain_costs(numel: int) -> List[int]:
    """b·D at each rung: a tensor whose codes hold its elements and nothing more."""
    return [b * numel for b in RUNGS]


def _greedy(sensitivities: Sequence[float], costs: Sequence[Sequence[int]], budget: int,
            minimum: Optional[Sequence[int]] = None, strict: bool = True) -> List[int]:
    """The §6.3 greedy for an integer budget of Σ bits stored; inputs already validated.
    `costs[i][r]`: the bits tensor i takes stored at RUNGS[r] (b·D for plain codes; more where
    its planes are padded, 32·D where it would be kept as it is). No tensor goes below its
    `minimum` width; a rung that saves no bits is passed over (a 2 x 2 plane's codes take its
    bytes at 8 bits, not at 4). When the budget is out of reach, `strict` raises, otherwise the
    allocation is every tensor at the fewest bits it may have."""
    # Relative to the largest finite sensitivity: the allocation is the same whatever scales the
    # loss (a GradScaler's factor S multiplies every sensitivity by S², 2^32 at its default; an
    # absolute cap flattened the larger ones into ties). Clamped as GACT does: a NaN or an infinity
    # means "very sensitive", and the heap's costs stay finite and comparable.
    top = max((v for v in sensitivities if math.isfinite(v) and v > 0), default=1.0)
    c = [v / top if math.isfinite(v) else MAX_SENSITIVITY for v in sensitivities]
    rung = [0] * len(c)
    total = sum(cost[0] for cost in costs)
    low = [1] * len(c) if minimum is None else list(minimum)
    # (cost, index, rung to): equal costs are broken by the smaller index, so the result is deterministic.
    heap: List[Tuple[float, int, int]] = []

    def offer(i: int) -> None:
        """Puts tensor i's next rung down that saves bits in the heap, if it may go there."""
        here = rung[i]
        to = next((r for r in range(here + 1, len(RUNGS)) if costs[i][r] < costs[i][here]), None)
        if to is not None and RUNGS[to] >= low[i]:
            heapq.heappush(heap, (_lowering_cost(c[i], costs[i], here, to), i, to))

    for i in range(len(c)):
        offer(i)
    while total > budget:
        if not heap:
            if not strict:
                break
            raise ValueError(f"avg_bits: the budget of {budget} bits is below what the tensors' minimum "
                             "widths need (1 bit per element, or an op's minimum)")
        _, i, to = heapq.heappop(heap)
        total -= costs[i][rung[i]] - costs[i][to]
        rung[i] = to
        # The per-bit cost of the next rung down is never smaller than this one's (the ladder is
        # convex; padding adds the same share of bits to every coded rung), so a tensor's rungs
        # leave the heap in order and one entry per tensor suffices.
        offer(i)
    return [RUNGS[r] for r in rung]


def _check_avg_bits(avg_bits: Any, low: float, low_inclusive: bool) -> float:
    if isinstance(avg_bits, bool) or not isinstance(avg_bits, numbers.Real):
        raise TypeError(f"avg_bits: expected a number, got {type(avg_bits).__name__}")
    value = float(avg_bits)
    too_low = value < low if low_inclusive else value <= low
    if math.isnan(value) or too_low:
        bound = f">= {low:g}" if low_inclusive else f"> {low:g}"
        raise ValueError(f"avg_bits: expected a number {bound}, got {avg_bits!r}")
    return value


def _budget(avg_bits: float, total_numel: int) -> int:
    """floor(avg_bits · Σ D), exactly: Σ b·D is an integer, so this is the same constraint, and
    no rounding of the product can let an allocation exceed avg_bits."""
    if avg_bits >= 32:
        return 32 * total_numel
    return math.floor(Fraction(avg_bits) * total_numel)


def allocate_bits(sensitivities: Sequence[float], numels: Sequence[int], avg_bits: float,
                  minimum_bits: Optional[Sequence[int]] = None) -> List[int]:
    """Bits per tensor, each in (32, 8, 4, 2, 1), by the greedy of docs/algorithms.md §6.3.

    Starts with every tensor at 32 (raw); while Σ b_l·D_l > avg_bits·Σ D_l, lowers by one rung the
    tensor with the smallest [C/(2^{b'}−1)² − C/(2^b−1)²] / (D·(b − b')), ties going to the
    smaller index. The result never exceeds the budget; it may undershoot it, since the rungs are
    coarse. Sensitivities count relative to the largest finite one (the result does not depend on
    their common scale); NaN and infinities count as 1e10 times it. `minimum_bits`
    (one of RUNGS per tensor) keeps a tensor at or above that width: the op rules of
    ``compress_saved`` (fused attention's query and key need 8 bits).

    Raises TypeError or ValueError naming the argument for a sensitivity that is not a number or
    is negative, a numel that is not an int > 0, lengths that differ, or an avg_bits that is not a
    positive number; ValueError if avg_bits < 1 or below what the minimum widths need (no
    allocation can meet it).
    """
    c: List[float] = []
    for i, v in enumerate(_as_list(sensitivities, "sensitivities")):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"sensitivities[{i}]: expected a number, got {type(v).__name__}")
        v = float(v)
        if v < 0:  # NaN and -inf fall through to the clamp, as GACT treats them
            if math.isfinite(v):
                raise ValueError(f"sensitivities[{i}]: expected a number >= 0, got {v!r}")
        c.append(v)
    d: List[int] = []
    for i, n in enumerate(_as_list(numels, "numels")):
        if isinstance(n, bool):
            raise TypeError(f"numels[{i}]: expected an int, got bool")
        try:
            n = operator.index(n)
        except TypeError:
            raise TypeError(f"numels[{i}]: expected an int, got {type(n).__name__}") from None
        if n <= 0:
            raise ValueError(f"numels[{i}]: expected an int > 0, got {n}")
        d.append(n)
    if len(c) != len(d):
        raise ValueError(f"numels: expected one per sensitivity ({len(c)}), got {len(d)}")
    low: Optional[List[int]] = None
    if minimum_bits is not None:
        low = _as_list(minimum_bits, "minimum_bits")
        if len(low) != len(c):
            raise ValueError(f"minimum_bits: expected one per sensitivity ({len(c)}), got {len(low)}")
        for i, b in enumerate(low):
            if isinstance(b, bool) or not isinstance(b, int) or b not in RUNGS:
                raise ValueError(f"minimum_bits[{i}]: expected one of {', '.join(map(str, RUNGS))}, got {b!r}")
    avg = _check_avg_bits(avg_bits, 0.0, low_inclusive=False)
    if not d:
        return []
    if avg < 1:
        raise ValueError(f"avg_bits: {avg_bits!r} is below 1 bit per element, which no allocation meets")
    return _greedy(c, [_plain_costs(n) for n in d], _budget(avg, sum(d)), low)


def _as_list(values: Any, name: str) -> List[Any]:
    """A sequence, a 1-D tensor or any other iterable (a numpy array) as a list; not a string."""
    if isinstance(values, torch.Tensor):
        return list(values.reshape(-1).tolist())
    if not isinstance(values, (str, bytes)):
        try:
            return list(values)
        except TypeError:
            pass
    raise TypeError(f"{name}: expected a sequence, got {type(values).__name__}")


# ---------------------------------------------------------------------------------------------------
# The controller.


#: The smallest budget the controller accepts unless told otherwise: with recompute (the default)
#: 2 bits trained digits to exact training's accuracy and the language model to within about
#: 0.7 % of its loss (docs/compressed-training.md); without it, 4 bits are needed to stay stable.
MIN_AVERAGE_BITS = 2.0


def check_average_bits(avg_bits: float, allow_low_bits: bool, recompute: bool = True) -> None:
    """Refuses a budget below 2 bits per element (4 without recompute), unless `allow_low_bits`."""
    floor = MIN_AVERAGE_BITS if recompute else float(MIN_UNIFORM_BITS)
    if avg_bits < floor and not allow_low_bits:
        how = ("" if recompute else
               " without recompute (fused attention's query and key then need 8 bits and the rest gets 1-2); "
               "recompute=True came within about 0.7 % of exact training's loss at avg_bits=2")
        raise ValueError(
            f"avg_bits={avg_bits:g}: budgets below {floor:g} bits did not train a language model as exact training "
            f"does{how} (docs/compressed-training.md). Use avg_bits={floor:g}, or pass allow_low_bits=True to accept "
            "the risk (the divergence guard still watches)")


class _Position(NamedTuple):
    """Where a save comes in a step, shapes aside: (module path, dtype, rank) and how many saves
    of that place came before it."""

    place: Tuple[str, torch.dtype, int]
    ordinal: int


@dataclass(frozen=True)
class TensorKey:
    """The identity of a saved tensor within a training step.

    `module` is the innermost submodule of the model running when the tensor was saved (its
    `named_modules()` path: "" for the model itself, "<outside>" outside every submodule), and
    `index` counts the earlier tensors of the step with the same (module, shape, dtype).
    ``str(key)`` reads like ``encoder.0.fc1:(64, 128):torch.float32#0``.
    """

    module: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    index: int

    def __str__(self) -> str:
        return f"{self.module}:{self.shape}:{self.dtype}#{self.index}"


def _key_tuple(key: TensorKey) -> Tuple[Any, ...]:
    return (key.module, tuple(key.shape), str(key.dtype), key.index)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.rpartition(".")[2], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"state: {name!r} names no torch dtype")
    return dtype


def _tensor_key(entry: Tuple[Any, ...]) -> TensorKey:
    module, shape, dtype, index = entry
    return TensorKey(str(module), tuple(int(n) for n in shape), _dtype(dtype), int(index))


def _squared_distance(a: Sequence[Optional[torch.Tensor]], b: Sequence[Optional[torch.Tensor]]) -> float:
    """Σ ‖a_i − b_i‖² in fp64; None (an unused parameter) counts as zero."""
    total = 0.0
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        diff = y if x is None else x if y is None else x - y
        total += float(diff.detach().double().pow(2).sum())
    return total


_MISSING = object()


def _refuse_recipe_blocks(model: torch.nn.Module) -> None:
    """Raises where abp.convert's recipe compress or all opens a compress_saved block in a forward
    of `model`: that block would open inside the controller's at the first step (blocks do not
    nest), so say it now, where the controller is made, with what to do instead."""
    found = recipe_block_in(model)
    if found is not None:
        name, hooks = found
        where = f"its module {name!r}" if name else "its forward"
        raise ValueError(
            f"model: {where} runs inside the compress_saved(bits={hooks.bits}) block that abp.convert's recipe "
            "compress or all put there, and the controller opens its own block around each step (blocks do not "
            "nest). For per-tensor widths, convert with recipe lowmembp and/or sampled and let the controller "
            "compress; for a uniform width, keep the recipe and drop the controller")


class CompressionController:
    """Compresses a model's saved activations at per-tensor widths chosen by sensitivity (GACT).

    ``with controller:`` around each training step's forward *and* backward (``loss.backward()``
    inside the block; ``optimizer.step()`` may be inside or outside) enters
    ``abp.compress.compress_saved`` with `group_size`, `min_numel`, `filter` and `generator`,
    storing each eligible saved tensor at the width allocated to its `TensorKey` (32 = raw). Each
    block's exit counts one step.

    **Start.** Until the first estimate, tensors are stored as they are: its replays hold every
    tensor as it is anyway, and a first gradient from blind codes can set Adam's second moment
    for hundreds of steps (GACT started at 4 bits for a 2-bit target, docs/algorithms.md §6.6).
    A key absent from the last estimate takes the width of the save at the same position (same
    module, dtype and rank, same ordinal among those saves: a batch of another length makes other
    keys, not other saves), else the largest of (8, 4, 2, 1) that is ≤ `avg_bits`, over the
    budget only by what the op rules' minimum widths add.

    **Sensitivity estimate** (at step 0, then every `interval` steps (below), after the user's
    backward, in the exit of that step's block). During such a step the controller records each call of
    `model` (its inputs, copied; the RNG states, buffers, train/eval modes and autocast state at
    the call) and hooks the outputs to capture dL/d(output) from the user's backward. At the exit
    it replays the calls: once with every saved tensor raw, giving the exact gradient g, then once
    per key l with only tensor l at its fewest allowed bits b (min_bits, or its op rule's minimum),
    giving g_l; C_l = ‖g_l − g‖²·(2^b − 1)² summed over every parameter that requires grad (and
    every model input that requires grad). That is the coefficient of the linearised variance model
    Var ≈ Σ C_l/(2^{b_l} − 1)², measured at the narrowest width the allocation may give l (a
    tensor read through exp() in backward, kept at 8 bits by its rule, would look far worse at 1
    bit than it ever is). The replays use
    ``torch.autograd.grad`` (``.grad`` is never touched; where backward passes a reentrant
    ``torch.utils.checkpoint``, which refuses it, a plain backward with each parameter's
    ``.grad`` set aside and put back, so its post-accumulate-grad hooks run), restore the recorded RNG states (same
    dropout masks), buffers (BatchNorm statistics) and modes before each replay, draw their
    quantisation seeds from a private generator, and afterwards put the RNG states, buffers and
    modes back as the user's step left them. Then `allocate_bits` runs over the keys with D_l =
    numel, and the new widths apply from the next step on.

    **Cost.** An estimate costs (number of keys + 1) forward and backward passes of the model's
    calls, plus one copy of the inputs and of dL/d(output) held until the estimate ends. With
    `interval="auto"` (the default) the next estimate comes AUTO_STEPS_PER_REPLAY (20) steps per
    pass later, so estimates take at most about 5 % of the training time whatever the number of
    keys (`next_estimate` says when; in a process group, the most passes of any rank); an int
    fixes the steps between estimates instead. Between estimates the overhead is one forward
    pre-hook and one forward hook per submodule call and a dict look-up per saved tensor.

    **Keys that cannot be probed** (saved outside every model call, e.g. by the loss, or not saved
    again by the replay) keep the initial width and count against the budget; the probed keys
    share what remains. Submodules added after construction are attributed to their parent.
    Outputs are found in nested tuples, lists and dicts. The model's forward is wrapped (an
    instance attribute, removed again) only during estimation steps, so keyword arguments work on
    every torch version.

    Inspection: `bits` (key → width), `sensitivity` (key → C_l of the last estimate), `step`
    (steps completed), `estimates` (estimates done), `average_bits()` (≤ `avg_bits` unless the
    minimum widths exceed it), `stats` (the last step's ``compress_saved`` byte counts),
    `last_step_keys` (key → numel of the keys saved by the last step). `remove()` removes every
    hook.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        avg_bits: float = 4.0,
        *,
        group_size: int = 256,
        interval: Union[int, str] = "auto",
        min_numel: int = 1024,
        filter: Optional[Callable[[torch.Tensor], bool]] = None,
        generator: Optional[torch.Generator] = None,
        guard: Union[bool, str] = "warn",
        min_bits: int = 2,
        allow_low_bits: bool = False,
        recompute: bool = True,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        _refuse_recipe_blocks(model)
        if isinstance(min_bits, bool) or not isinstance(min_bits, int) or min_bits not in RUNGS[1:]:
            raise ValueError(f"min_bits: expected one of {', '.join(map(str, RUNGS[1:]))}, got {min_bits!r}")
        if not isinstance(allow_low_bits, bool):
            raise TypeError(f"allow_low_bits: expected True or False, got {allow_low_bits!r}")
        avg = _check_avg_bits(avg_bits, 1.0, low_inclusive=True)
        if avg > 32:
            raise ValueError(f"avg_bits: expected a number in [1, 32], got {avg_bits!r}")
        if avg < min_bits:
            fits = max(b for b in RUNGS[1:] if b <= avg)  # avg >= 1, the narrowest rung
            raise ValueError(f"avg_bits: {avg_bits!r} is below min_bits={min_bits}, which no allocation meets; "
                             f"pass min_bits={fits} (or fewer) to allow narrower widths")
        check_average_bits(avg, allow_low_bits, recompute)
        if isinstance(interval, str):
            if interval != "auto":
                raise ValueError(f"interval: expected 'auto' or an int >= 1, got {interval!r}")
        elif isinstance(interval, bool) or not isinstance(interval, int):
            raise TypeError(f"interval: expected 'auto' or an int >= 1, got {type(interval).__name__}")
        elif interval < 1:
            raise ValueError(f"interval: expected 'auto' or an int >= 1, got {interval}")
        check_generator(generator)
        self._model = model
        self._avg_bits = avg
        self._interval = interval
        # Replays the last estimate ran (the exact pass and one per probed key): what "auto" spaces by.
        self._last_replays = 1
        self._min_bits = min_bits
        # At avg_bits=32 (a control run) nothing is compressed, tensors the estimate cannot probe
        # included (a loss's log-probabilities outside the model).
        self._initial = 32 if avg >= 32 else max(b for b in (8, 4, 2, 1) if b <= avg)
        # compress_saved validates group_size, min_numel and filter, naming them. A ReLU's output
        # keeps its exact support (x > 0) beside its codes, a bit per element the budget counts
        # (stored_bits): as plain codes its backward's sign was biased (ResNet-18, 48 px: a first
        # gradient 0.13 off at avg_bits=4, 0.10 over six draws; 0.011 and 0.005 with the support).
        self._saver = compress_saved(min(self._initial, 8), group_size, min_numel=min_numel, filter=filter,
                                     bits_for=self._bits_for, generator=generator, exact_relu=True, guard=guard,
                                     recompute=recompute)
        self._saver.label = f"abp.CompressionController(avg_bits={avg:g})"
        # Replays draw their quantisation seeds here, never from torch's default generator: a draw
        # there would shift the dropout masks of the layers after the probed tensor.
        self._replay_generator = torch.Generator()
        # With the op rules training has: a probe stores its key at _probe_bits (its op's floor
        # at least, where the rules would raise it anyway) and scales what it measures by
        # (2^b − 1)²; fused attention recomputes its output and logsumexp from the probed query
        # and key as in training, so the probe sees the damage training would.
        self._replay_saver = compress_saved(min(self._initial, 8), group_size, min_numel=min_numel, filter=filter,
                                            bits_for=self._bits_for, generator=self._replay_generator,
                                            exact_relu=True, guard=False, recompute=recompute)
        # A replay stores what it does not probe as it is: "compressed none" says nothing to the user.
        self._replay_saver.explains_constants = False
        self._replay_saver.checks_versions = False  # replays copy the recorded buffers back between calls

        self._bits: Dict[TensorKey, int] = {}
        # The widths of the last estimate by position, for keys of other shapes (_bits_for).
        self._bits_by_position: Dict[_Position, int] = {}
        self._numels: Dict[TensorKey, int] = {}
        # The keys saved as a ReLU's output, whose support costs a bit per element (stored_bits),
        # and those a kinked activation's backward tests, whose side of its breakpoints does.
        self._supported: Set[TensorKey] = set()
        self._sensitivity: Dict[TensorKey, float] = {}
        self._step = 0
        self._estimates = 0
        self._next_probe = 0
        self._stats: Dict[str, int] = {}
        self._last_seen: Dict[TensorKey, int] = {}
        # Keys an op rule of compress_saved stores at more bits than asked: key → fewest bits.
        self._floors: Dict[TensorKey, int] = {}
        # Elements the budget counts at 0 bits: tensors recomputed in backward, checkpoints' inputs.
        self._numel_at_zero_bits = 0
        self._order: List[TensorKey] = []
        self._warned_over = False
        self._warned_idle = False
        self._warned_unrecorded = False
        self._ran = False

        # Per-step state.
        self._active = False
        self._probing = False
        self._replaying = False
        self._target: Optional[TensorKey] = None
        self._stack: List[str] = []
        self._counts: Dict[Tuple[str, Tuple[int, ...], torch.dtype], int] = {}
        self._places: Dict[Tuple[str, torch.dtype, int], int] = {}  # the next ordinal per place
        self._positions: Dict[TensorKey, _Position] = {}
        self._seen: Dict[TensorKey, int] = {}
        self._calls: List[_replay.Call] = []
        self._original_forward: Optional[Callable[..., Any]] = None
        self._saved_forward_attr: Any = _MISSING
        self._recorder_installed = False
        self._step_stats: Dict[str, int] = {}
        self._order_base = 0
        # Hooked steps (trainer_callback): the forward hooks are installed, the open step is one,
        # how many model calls are running, and each running call's record (None: not probing).
        self._step_hooks = False
        self._hooked = False
        self._depth = 0
        self._pending: List[Optional[_replay.Call]] = []

        self._handles: List[Any] = []
        # name -> module: the hooks act for these modules only (a copy of the model gets inert
        # ones: _Hook).
        self._modules: Dict[str, torch.nn.Module] = dict(model.named_modules())
        for name, module in self._modules.items():
            enter, leave = _Hook(self._enter_module, name), _Hook(self._leave_module, name)
            if module is model:  # seen even around a compiled call: the model ran (_never_ran)
                enter, leave = _eager(enter), _eager(leave)
            self._handles.append(module.register_forward_pre_hook(enter))
            self._handles.append(module.register_forward_hook(leave))
        self._removed = False

    # -- inspection --------------------------------------------------------------------------------

    @property
    def avg_bits(self) -> float:
        """The budget: average bits per element over the tensors the controller sees (those it
        allocates, those recomputed in backward and activation checkpoints' inputs)."""
        return self._avg_bits

    @property
    def interval(self) -> Union[int, str]:
        """Steps between sensitivity estimates, or "auto": AUTO_STEPS_PER_REPLAY steps per replay the
        last estimate ran (see `next_estimate`)."""
        return self._interval

    @property
    def next_estimate(self) -> int:
        """The step at which the next sensitivity estimate runs."""
        return self._next_probe

    def _schedule_after_probe(self, estimated: bool, unmeasured: bool = False) -> None:
        """Sets the step of the next estimate after a probe step. With interval="auto" the ranks of
        a process group agree on it: each rank probes the keys its own step saved, and ranks that
        counted their own replays would estimate at different steps (under FSDP2 an estimate
        gathers the parameters: ranks out of step would wait on each other's collectives). Every
        rank's probe step makes one all-reduce of its count for that. A step the controller could
        not measure (`unmeasured`: a compiled model's) waits UNMEASURED_STEPS before the next try.
        An int interval agrees the same way: the next estimate is `interval` steps on if any rank
        estimated (or could measure nothing), else at the next step on every rank; a rank whose
        step saved nothing to compress (a short last batch) no longer estimates alone after it."""
        if self._interval != "auto":
            if _largest_on_any_rank(int(estimated or unmeasured), self._model):
                self._next_probe = self._step + int(self._interval)
            return
        own = self._last_replays if estimated else UNMEASURED_STEPS // AUTO_STEPS_PER_REPLAY if unmeasured else 0
        replays = _largest_on_any_rank(own, self._model)
        if replays:
            self._next_probe = self._step + AUTO_STEPS_PER_REPLAY * replays

    @property
    def initial_bits(self) -> int:
        """The width of keys without an allocation: the largest of (8, 4, 2, 1) ≤ avg_bits; 32 (kept as
        they are) at avg_bits=32."""
        return self._initial

    @property
    def bits(self) -> Dict[TensorKey, int]:
        """The current allocation, key → bits (1, 2, 4, 8 or 32 = raw); a copy."""
        return dict(self._bits)

    @property
    def sensitivity(self) -> Dict[TensorKey, float]:
        """C_l of every key probed by the last estimate; a copy."""
        return dict(self._sensitivity)

    @property
    def step(self) -> int:
        """The number of steps (``with`` blocks) completed."""
        return self._step

    @property
    def estimates(self) -> int:
        """The number of sensitivity estimates done."""
        return self._estimates

    @property
    def stats(self) -> Dict[str, int]:
        """The last step's ``compress_saved`` counts (tensors, compressed, bytes_in, bytes_stored)."""
        return dict(self._stats)

    @property
    def last_step_keys(self) -> Dict[TensorKey, int]:
        """The keys of the tensors the last step compressed or kept raw by allocation, → numel."""
        return dict(self._last_seen)

    def average_bits(self) -> float:
        """Σ bits stored / Σ D over the current allocation (b per coded element, planes padded to
        whole groups counting their padding, 32 per element of a tensor kept as it is because
        its codes would not pay: `stored_bits`), the tensors recomputed in backward and the
        activation checkpoints' inputs (0 bits each); 32 before any estimate (tensors are stored
        as they are until the first). Group headers are not counted (GACT's budget)."""
        total = sum(self._numels[k] for k in self._bits) + self._numel_at_zero_bits
        if total == 0:
            return 32.0 if not self._estimates else float(self._initial)
        return sum(self.stored_bits(k, b) for k, b in self._bits.items()) / total

    def stored_bits(self, key: TensorKey, bits: int) -> int:
        """The bits the tensor of `key` takes stored at `bits` (group headers not counted): 32 per
        element as it is (`bits` 32, or codes that would take as many bytes as the tensor,
        ``abp.compress.codes_pay``), otherwise `bits` per coded element, its planes padded to
        whole groups (``abp.compress.plane_groups``: 7 x 7 pixels code 56 elements each), and a
        ReLU output's support or a kinked activation's side of its breakpoints, a bit per element."""
        numel = math.prod(key.shape)
        layout = self._layout(key, bits)
        if layout is None:
            return 32 * numel
        return bits * coded_numel(key.shape, layout[1]) + (numel if key in self._supported else 0)

    def _layout(self, key: TensorKey, bits: int) -> Optional[Tuple[int, int]]:
        """compress.code_layout of `key`'s tensor at `bits`; None at 32 or where it is kept as it is."""
        return None if bits == 32 else code_layout(key.shape, key.dtype, bits, self._saver.group_size)

    # -- resuming ----------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs to continue as the uninterrupted one: the step count, the
        schedule, the allocation and what it was made of, and the replays' generator. Plain values
        (keys as (module, shape, dtype name, index) tuples), so ``torch.save`` and
        ``torch.load(weights_only=True)`` take it; save it with the model's and optimizer's."""
        def keyed(table: Dict[TensorKey, Any]) -> List[Tuple[Tuple[Any, ...], Any]]:
            return [(_key_tuple(k), v) for k, v in table.items()]

        return {
            "version": 1,
            "avg_bits": self._avg_bits,
            "settings": self._settings(),
            "step": self._step,
            "estimates": self._estimates,
            "next_probe": self._next_probe,
            "bits": keyed(self._bits),
            "bits_by_position": [((p.place[0], str(p.place[1]), p.place[2], p.ordinal), b)
                                 for p, b in self._bits_by_position.items()],
            "numels": keyed(self._numels),
            "sensitivity": keyed(self._sensitivity),
            "floors": keyed(self._floors),
            "supported": sorted(_key_tuple(k) for k in self._supported if k in self._numels),
            "numel_at_zero_bits": self._numel_at_zero_bits,
            "replay_generator": self._replay_generator.get_state(),
            "modules": sorted(self._modules),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores what `state_dict` returned, into a controller built on the resumed model (with
        the same settings; a state saved at another avg_bits is refused). Call it before the first
        step."""
        if self._removed:
            raise RuntimeError("CompressionController: used after remove()")
        if self._active:
            raise RuntimeError("CompressionController.load_state_dict: called inside a `with controller:` block")
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("state: expected what CompressionController.state_dict() returned (a dict with version 1), "
                             f"got {type(state).__name__}")
        try:
            saved = {"avg_bits": float(state["avg_bits"]), **state["settings"]}

            def table(entries: List[Tuple[Tuple[Any, ...], Any]]) -> Dict[TensorKey, Any]:
                return {_tensor_key(k): v for k, v in entries}

            step, estimates, next_probe = int(state["step"]), int(state["estimates"]), int(state["next_probe"])
            bits, numels = table(state["bits"]), table(state["numels"])
            sensitivity, floors = table(state["sensitivity"]), table(state["floors"])
            by_position = {_Position((m, _dtype(d), int(rank)), int(ordinal)): int(b)
                           for (m, d, rank, ordinal), b in state["bits_by_position"]}
            numel_at_zero_bits = int(state["numel_at_zero_bits"])
            # Absent from states saved before ReLU outputs kept their support: the next step
            # finds them again.
            supported = {_tensor_key(k) for k in state.get("supported", [])}
            generator_state = state["replay_generator"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"state: expected what CompressionController.state_dict() returned; this one does not "
                             f"read as such ({type(e).__name__}: {e})") from None
        mine = {"avg_bits": self._avg_bits, **self._settings()}
        differ = [f"{k}={saved.get(k)!r} (this one {v!r})" for k, v in mine.items() if saved.get(k) != v]
        if differ:
            raise ValueError(f"state: saved by a controller with other settings: {', '.join(differ)}; build it with "
                             "the saved settings to resume")
        # The model's module names (absent from states saved before they were kept): a state of a
        # model with more or fewer layers would load its keys into the layers both have.
        if "modules" in state and set(state["modules"]) != set(self._modules):
            extra = sorted(set(state["modules"]) - set(self._modules))
            missing = sorted(set(self._modules) - set(state["modules"]))
            raise ValueError(f"state: saved on another model: {len(state['modules'])} modules, this controller's model "
                             f"has {len(self._modules)} (only in the saved one: {extra[:3]}; only in this one: "
                             f"{missing[:3]})")
        # Keys name the model's modules: a state saved on another model names others.
        names = set(self._modules) | {OUTSIDE}
        foreign = sorted({k.module for k in bits} - names)
        if foreign:
            raise ValueError(f"state: saved on another model: its tensors were saved in {foreign[:3]}"
                             f"{' ...' if len(foreign) > 3 else ''}, which this controller's model does not have")
        self._step, self._estimates, self._next_probe = step, estimates, next_probe
        self._bits, self._numels, self._sensitivity, self._floors = bits, numels, sensitivity, floors
        self._bits_by_position, self._numel_at_zero_bits = by_position, numel_at_zero_bits
        self._supported = supported
        self._replay_generator.set_state(generator_state)

    def _settings(self) -> Dict[str, Any]:
        """The settings a state belongs to (the schedule and the keys depend on them)."""
        saver = self._saver
        return {"interval": self._interval, "min_bits": self._min_bits, "group_size": saver.group_size,
                "min_numel": saver.min_numel}

    def __reduce__(self) -> Any:
        raise TypeError("CompressionController cannot be pickled: its hooks belong to the model object it was built "
                        "on, and an unpickled copy would measure nothing. Save controller.state_dict() with the "
                        "model's and optimizer's, and after loading build a controller on the model and call "
                        "load_state_dict (docs/training.md, resuming)")

    def __deepcopy__(self, memo: Dict[int, Any]) -> "CompressionController":
        """The controller itself: it belongs to the model it was built on (a copy of that model
        gets inert hooks, _Hook; a controller holds a generator, which torch 1.13 cannot copy)."""
        return self

    def __repr__(self) -> str:
        return (f"CompressionController(avg_bits={self._avg_bits:g}, step={self._step}, "
                f"tensors={len(self._bits)}, average_bits={self.average_bits():.3f})")

    # -- hooks -------------------------------------------------------------------------------------

    # Under torch.compile, dynamo traces these hooks with the model: their list edits would be
    # replayed out of order, and what they attribute (eager saves) does not happen in a compiled
    # graph, whose saves no per-tensor width reaches (docs/python.md). They do nothing there.

    def _enter_module(self, name: str, module: torch.nn.Module, args: Any) -> None:
        if _compiling() or self._modules.get(name) is not module:
            return
        self._ran = True
        self._stack.append(name)

    def _leave_module(self, name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        if _compiling() or self._modules.get(name) is not module:
            return
        # Normally the top; if a forward raised earlier, its entry was never popped: drop it too.
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i] == name:
                del self._stack[i:]
                return

    def _bits_for(self, t: torch.Tensor) -> int:
        """compress_saved's per-tensor width: the allocation of the tensor's key."""
        path = self._stack[-1] if self._stack else OUTSIDE
        shape = tuple(t.shape)
        ident = (path, shape, t.dtype)
        index = self._counts.get(ident, 0)
        self._counts[ident] = index + 1
        key = TensorKey(path, shape, t.dtype, index)
        self._seen[key] = t.numel()
        if keeps_support(t):
            self._supported.add(key)
        if self._replaying:
            return self._probe_bits(key) if key == self._target else 32
        self._order.append(key)  # the step's own calls, whose indices compress_saved's floors use
        # Where in its module the save comes, shapes aside: another batch's sequence length or
        # image size makes other keys, not other saves.
        place = (path, t.dtype, t.dim())
        ordinal = self._places.get(place, 0)
        self._places[place] = ordinal + 1
        if self._probing:  # the estimate maps its widths to positions (_estimate)
            self._positions[key] = _Position(place, ordinal)
        if not self._estimates:
            # Before the first estimate a tensor is stored as it is: that step's estimate replays
            # the model with every tensor as it is, which holds as much anyway, and a first
            # gradient from codes chosen blind can set an optimizer's statistics for hundreds of
            # steps (Adam's second moment; a T5 trained at 2 bits for its first step only ended
            # 12 % worse).
            return 32
        bits = self._bits.get(key)
        if bits is None:
            bits = self._bits_by_position.get(_Position(place, ordinal), self._initial)
        return bits

    # -- the step ----------------------------------------------------------------------------------
    #
    # A step is begun, the saver compresses what its model calls save, and the step is ended (the
    # estimate, at a probe step). `with controller:` does this around the user's forward and
    # backward. trainer_callback cannot put the Trainer's code in a `with` block: it begins and
    # ends "hooked" steps at Trainer events and opens the saver only while the model's forward
    # runs (hooks on the model, the closing one `always_call`). No callback runs when a Trainer
    # step raises, so a saver held open from one event to the next would stay open after a
    # failed step and compress every later save of the thread; a forward's hooks always close.

    def __enter__(self) -> "CompressionController":
        self._begin_step(hooked=False)
        try:
            self._open_saver()
        except BaseException:
            self._abort_step()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._close_saver(exc_type, exc, tb)
        except BaseException:
            self._end_step(failed=True)
            raise
        self._end_step(failed=exc_type is not None)

    def _begin_step(self, hooked: bool) -> None:
        if self._removed:
            raise RuntimeError("CompressionController: used after remove()")
        if self._active and self._hooked and not self._depth:
            # A hooked step whose Trainer step raised (no event ended it): it is not counted.
            self._abort_step()
        if self._active:
            raise RuntimeError("CompressionController: `with controller:` blocks cannot nest")
        self._stack, self._counts, self._seen, self._calls, self._order = [], {}, {}, [], []
        self._places, self._positions = {}, {}
        self._step_stats = {}
        self._ran = False  # a module of the model ran (its pre-hook) in this step
        self._probing = self._step >= self._next_probe
        self._hooked, self._depth, self._pending = hooked, 0, []
        if self._probing and not hooked:  # a hooked step records its calls from the forward hooks
            self._install_recorder()
        self._active = True

    def _open_saver(self) -> None:
        # Where this saver block's bits_for calls start in the step's order (its floors' indices).
        self._order_base = len(self._order)
        self._saver.__enter__()

    def _close_saver(self, *exc: Any) -> None:
        try:
            self._saver.__exit__(*exc)
        finally:
            # A step may open several saver blocks (a hooked step: one per model call): their
            # counts add up, and their floors index the step's order from where each began.
            for name, count in self._saver.stats.items():
                self._step_stats[name] = self._step_stats.get(name, 0) + count
            # Widths the op rules raised (compress_saved's floors), kept for the allocations.
            for index, floor in self._saver.rule_floors.items():
                key = self._order[self._order_base + index]
                self._floors[key] = max(self._floors.get(key, 1), floor)
            # A kinked activation's saves keep their side of its breakpoints beside the codes, a
            # bit per element, as a ReLU output keeps its support (compress_saved found which).
            for index in self._saver.region_choices:
                self._supported.add(self._order[self._order_base + index])
            # Tensors recomputed instead of stored have no width: their elements count as
            # compress_saved's numel_derived.
            for index in self._saver.derived_choices:
                self._seen.pop(self._order[self._order_base + index], None)

    def _end_step(self, failed: bool) -> None:
        """Ends the step: publishes its counts and, unless it failed, estimates (at a probe step)
        and counts it."""
        calls, probing = self._calls, self._probing
        self._active, self._hooked = False, False
        self._stats = dict(self._step_stats)
        self._last_seen = dict(self._seen)
        self._uninstall_recorder()
        estimated = unmeasured = False
        if failed:
            try:
                self._finish_probe()
            finally:
                if probing:  # every rank's probe step reaches its all-reduce, a failed one too
                    self._schedule_after_probe(False)
            return
        try:
            if probing and calls:
                if not any(g is not None for call in calls for g in call.grads):
                    raise RuntimeError(
                        "CompressionController: the model's outputs got no gradient inside the `with` block "
                        f"of step {self._step}, a sensitivity-estimation step: call loss.backward() inside it")
                estimated = self._estimate(calls, self._last_seen)
            elif probing and self._stats.get("tensors", 0) and self._never_ran() and not self._warned_idle:
                self._warned_idle = True  # once per controller
                warnings.warn(
                    f"CompressionController: the block of step {self._step} saved {self._stats['tensors']} tensors "
                    "for backward, but the model this controller was built on never ran (no call of it or of "
                    "a submodule, none of its parameters has a gradient): it measures nothing and stores every "
                    "tensor as it is (no estimate, no allocation). Was it built on another model object? abp.convert returns "
                    "a converted copy; build the controller on the model you train", RuntimeWarning, stacklevel=3)
            elif probing and self._ran and self._stats.get("tensors", 0) and \
                    any(p.grad is not None for p in self._model.parameters()):
                self._warn_unmeasured()
                unmeasured = True
            # A probe step without a differentiable model call (an evaluation block): estimate at
            # the next step instead.
        finally:
            try:
                self._finish_probe()
            finally:
                if probing:  # also where the estimate raised: the other ranks wait in this all-reduce
                    self._schedule_after_probe(estimated, unmeasured)
                self._step += 1

    def _warn_unmeasured(self) -> None:
        """Once per controller: the step ran the model and its backward, but not so that the
        controller could measure it."""
        if self._warned_unrecorded:
            return
        self._warned_unrecorded = True
        warnings.warn(
            f"CompressionController: step {self._step} ran the model and its backward, but no call of it "
            "could be recorded for the sensitivity estimate, or none of its saved tensors reached the controller: "
            "a torch.compile'd model runs its graph without the controller's hooks (so does a model trained "
            "through another method than its forward). Nothing is estimated, every tensor is stored as it is (a "
            "controller's widths never reach a compiled graph's saves) and average_bits() stays 32. For a "
            "compiled model use compress_saved(bits=4) or abp.convert(model, 'compress'), whose uniform width "
            "compiled graphs take (docs/python.md, torch.compile)", RuntimeWarning, stacklevel=4)

    def _never_ran(self) -> bool:
        """True if nothing of the model ran in the step: no module's pre-hook (the model's own
        runs even around a compiled call; saves inside a module follow one) and no parameter with
        a gradient (torch.compile(model.forward) runs no hook at all)."""
        return not self._ran and all(p.grad is None for p in self._model.parameters() if p.requires_grad)

    def _abort_step(self) -> None:
        """Drops a begun step: nothing is estimated, published or counted."""
        self._active, self._hooked, self._depth, self._pending = False, False, 0, []
        self._finish_probe()

    def _finish_probe(self) -> None:
        """Frees everything recorded for the estimate (inputs, output gradients, hooks)."""
        self._uninstall_recorder()
        for call in self._calls:
            call.close()
        self._calls = []
        self._probing = False
        self._original_forward = None
        self._target = None
        self._replaying = False

    def _watch(self, call: _replay.Call, out: Any) -> None:
        if _replay.watch_outputs(call, out):
            self._calls.append(call)

    def _install_recorder(self) -> None:
        model = self._model
        self._recorder_installed = True
        self._saved_forward_attr = model.__dict__.get("forward", _MISSING)
        original = model.forward
        self._original_forward = original
        # Wrapping forward, not a forward pre-hook: hooks see keyword arguments only on torch >= 2.0
        # (with_kwargs), and torch 1.13 must work too.
        def recording_forward(*args: Any, **kwargs: Any) -> Any:
            if _compiling() or inside_outside_blocks():  # a compiled call is not replayed (the hooks
                return original(*args, **kwargs)         # above), nor one of a VCAS calibration
            call = _replay.record(model, args, kwargs)
            out = original(*args, **kwargs)
            self._watch(call, out)
            return out

        model.forward = recording_forward

    def _uninstall_recorder(self) -> None:
        if not self._recorder_installed:
            return
        self._recorder_installed = False
        saved = self._saved_forward_attr
        if saved is _MISSING:
            self._model.__dict__.pop("forward", None)
        else:
            self._model.__dict__["forward"] = saved
        self._saved_forward_attr = _MISSING

    # -- hooked steps (trainer_callback) -----------------------------------------------------------

    def _install_step_hooks(self) -> None:
        """The model's forward pre-hook and hook that run its calls during a hooked step inside
        the saver (and record them at a probe step); once per controller, removed by remove()."""
        if self._removed:
            raise RuntimeError("CompressionController: used after remove()")
        if self._step_hooks:
            return
        try:
            # with_kwargs: the recorder needs the call's keyword arguments; always_call: the saver
            # closes even when forward raises. Both need torch >= 2.0.
            # Eager: around a compiled model's call too (a graph break at its edge), so that the
            # block opens and says what it compressed.
            pre = self._model.register_forward_pre_hook(  # type: ignore[call-arg]
                _eager(self._forward_begins), with_kwargs=True)
        except TypeError:
            raise RuntimeError("CompressionController: trainer_callback needs torch >= 2.0 (forward hooks with "
                               "with_kwargs and always_call); use `with controller:` instead") from None
        post = self._model.register_forward_hook(_eager(self._forward_ends), always_call=True)  # type: ignore[call-arg]
        self._handles += [pre, post]
        self._step_hooks = True

    def _forward_begins(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if not (self._active and self._hooked) or self._replaying or inside_outside_blocks():
            return None  # not a step's call (a VCAS calibration's passes run outside_blocks)
        call = None
        if self._probing:
            # What a hooked step's replays call: forward as __call__ runs it (an instance
            # forward, such as accelerate's autocast wrapper, included), without the hooks.
            self._original_forward = module.forward
            call = _replay.record(self._model, args, kwargs)
        if not self._depth:
            try:
                self._open_saver()
            except BaseException:
                if call is not None:
                    call.close()
                raise
        self._depth += 1
        self._pending.append(call)
        return None

    def _forward_ends(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._depth:  # not a hooked step's call, or its pre-hook raised
            return None
        self._depth -= 1
        call = self._pending.pop()
        try:
            if call is not None:
                self._watch(call, output)  # output is None when forward raised: closed
        finally:
            if not self._depth:
                self._close_saver(None, None, None)
        return None

    def _end_hooked_step(self) -> None:
        if self._active and self._hooked:
            self._end_step(failed=False)

    def _abort_hooked_step(self) -> None:
        if self._active and self._hooked:
            self._abort_step()

    # -- the estimate ------------------------------------------------------------------------------

    def _probe_bits(self, key: TensorKey) -> int:
        """The width a probe stores `key` at: the fewest bits it may have (min_bits, its op's rule),
        where the allocation can put it. The variance model scales the result to C_l."""
        return max(self._floors.get(key, 1), self._min_bits)

    def _estimate(self, calls: List[_replay.Call], step_keys: Dict[TensorKey, int]) -> bool:
        """Estimates and allocates; False if the step had nothing to allocate (the next estimates)."""
        with _unsharded(self._model):
            return self._estimate_unsharded(calls, step_keys)

    def _estimate_unsharded(self, calls: List[_replay.Call], step_keys: Dict[TensorKey, int]) -> bool:
        model = self._model
        params = [p for p in model.parameters() if p.requires_grad]
        modules = list(model.modules())
        after_rng, after_buffers = _replay.rng_state(), _replay.snapshot_buffers(model)
        after_modes = [m.training for m in modules]
        try:
            exact, replayed = self._replay(calls, params, modules, None)
            self._last_replays = 1
            if replayed and not step_keys:
                # The calls were recorded at the model's edge (a hooked step's pre-hook runs
                # eagerly around a compiled call), and their eager replay saves tensors the
                # step's own saves never offered: those were a compiled graph's, which widths
                # estimated here would never reach. Nothing is measured, so "auto" waits as long
                # as the fixed default once did (1000 steps) before it tries again.
                self._warn_unmeasured()
                self._last_replays = UNMEASURED_STEPS // AUTO_STEPS_PER_REPLAY
                return True
            if not step_keys:
                # It saved nothing it could compress (a short last batch, every tensor under
                # min_numel): an allocation made of it would be empty. The last one stays.
                return False
            probed = [k for k in step_keys if k in replayed]
            self._last_replays = 1 + len(probed)
            sensitivity: Dict[TensorKey, float] = {}
            for key in probed:
                grads, _ = self._replay(calls, params, modules, key)
                # Measured at b bits, the variance is C/(2^b − 1)²: C is the 1-bit coefficient.
                sensitivity[key] = _squared_distance(grads, exact) * float((1 << self._probe_bits(key)) - 1) ** 2
            del exact
        finally:
            self._replaying = False
            self._target = None
            _replay.set_rng_state(after_rng)
            _replay.restore_buffers(after_buffers)
            for m, mode in zip(modules, after_modes):
                m.training = mode

        fixed = [k for k in step_keys if k not in replayed]
        # Tensors recomputed in backward (compress_saved's recompute) are saved elements stored
        # at 0 bits: they count in the budget's elements. So do activation checkpoints' inputs,
        # kept as they are outside the budget: each stands for the block backward recomputes
        # from it (at least its own elements), and without them the few tensors left outside the
        # checkpoints would share a budget sized for themselves alone (a tiny LLaMA at 2 bits:
        # the final norm's input went to 2 bits, the loss 12 % above exact training's).
        self._numel_at_zero_bits = self._stats.get("numel_derived", 0) + self._stats.get("numel_checkpointed", 0)
        total = sum(step_keys.values()) + self._numel_at_zero_bits

        def least(k: TensorKey) -> int:  # the fewest bits min_bits and an op rule allow for k
            return max(self._floors.get(k, 1), self._min_bits)

        # Unprobed keys keep the initial width (≤ avg_bits, or their op's minimum); the probed
        # ones share what is left, none below its op's minimum.
        budget = _budget(self._avg_bits, total) - sum(self.stored_bits(k, max(self._initial, least(k))) for k in fixed)
        costs = [[self.stored_bits(k, b) for b in RUNGS] for k in probed]
        widths = _greedy([sensitivity[k] for k in probed], costs, budget, [least(k) for k in probed],
                         strict=False) if probed else []
        allocated = dict(zip(probed, widths))
        self._bits = {k: allocated.get(k, max(self._initial, least(k))) for k in step_keys}
        self._bits_by_position = {self._positions[k]: b for k, b in self._bits.items() if k in self._positions}
        self._numels = dict(step_keys)
        # Only the allocation's keys are asked about (other shapes of a later batch add theirs again).
        self._supported = {k for k in self._supported if k in step_keys}
        over = sum(self.stored_bits(k, b) for k, b in self._bits.items()) - _budget(self._avg_bits, total)
        if over > 0 and not self._warned_over:
            self._warned_over = True  # once per controller: every estimate would say it again
            warnings.warn(
                f"CompressionController(avg_bits={self._avg_bits:g}): the fewest bits the tensors may take exceed "
                f"the budget ({'; '.join(self._why_over(least))}); the allocation averages "
                f"{self.average_bits():.2f} bits per element", RuntimeWarning, stacklevel=3)
        self._sensitivity = sensitivity
        self._estimates += 1
        return True

    def _why_over(self, least: Callable[[TensorKey], int]) -> List[str]:
        """What takes the current allocation's tensors above their codes' bits, each with the
        share of the elements it concerns: what an over-budget warning names."""
        keys = list(self._bits)
        total = sum(self._numels[k] for k in keys) + self._numel_at_zero_bits
        parts = [(f"min_bits={self._min_bits}", keys)]

        def share(found: List[TensorKey]) -> str:
            return f"{sum(self._numels[k] for k in found) / total:.0%} of the elements"

        layouts = {k: self._layout(k, self._bits[k]) for k in keys}  # None: kept as it is
        floors = [k for k in keys if least(k) > self._min_bits]
        if floors:
            parts.append(("op rules' floors (fused attention's query and key, log_softmax's output, what amax-like reductions compare)", floors))
        support = [k for k in keys if k in self._supported and layouts[k] is not None]
        if support:
            parts.append(("ReLU outputs' support and kinked activations' sides of their breakpoints, a bit per element",
                          support))
        padded = [k for k in keys if layouts[k] is not None and layouts[k][1]]
        if padded:
            parts.append(("planes padded to whole code groups", padded))
        raw = [k for k in keys if self._layout(k, least(k)) is None]
        if raw:
            parts.append(("tensors kept as they are, whose codes would take as many bytes", raw))
        return [f"{what}: {share(found)}" for what, found in parts]

    def _replay(
        self,
        calls: List[_replay.Call],
        params: List[torch.Tensor],
        modules: List[torch.nn.Module],
        target: Optional[TensorKey],
    ) -> Tuple[List[Optional[torch.Tensor]], Dict[TensorKey, int]]:
        """Replays the recorded calls with only `target` at its probe width (none: all raw); returns the
        gradients of params and of the inputs that require grad, and the keys saved."""
        assert self._original_forward is not None
        self._replaying, self._target = True, target
        self._counts, self._seen, self._stack = {}, {}, []
        self._replay_generator.manual_seed(0)
        with self._replay_saver, _unsharded(self._model):
            # The model's own path: the root's pre-hook does not run when forward is called
            # directly (and calling it through __call__ would rerun the user's pre-hooks).
            grads = _replay.replay(calls, self._original_forward, params, modules, self._at_root)
        return grads, dict(self._seen)

    @contextlib.contextmanager
    def _at_root(self) -> Iterator[None]:
        """Saves during a replayed forward belong to the model itself ("") unless a submodule runs."""
        self._stack = [""]
        try:
            yield
        finally:
            self._stack = []

    # -- removal -----------------------------------------------------------------------------------

    def remove(self) -> None:
        """Removes every hook the controller registered; the controller cannot be used after."""
        if self._active and not self._hooked:
            raise RuntimeError("CompressionController: remove() inside a `with controller:` block")
        self._abort_hooked_step()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._finish_probe()
        self._removed = True
        # A controller kept after remove() (a user's variable, a Trainer's callback) must not keep
        # the model alive.
        self._model = None  # type: ignore[assignment]
        self._modules = {}


def _largest_on_any_rank(value: int, model: torch.nn.Module) -> int:
    """The largest `value` of the ranks of torch.distributed's default group (`value` itself outside
    one), by an all-reduce on the group's backend: for NCCL on the CUDA device of `model`'s
    parameters (a rank that never called torch.cuda.set_device is on device 0 otherwise)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return value
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = next((p.device for p in model.parameters() if p.is_cuda),
                      torch.device("cuda", torch.cuda.current_device()))
    found = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    # gloo's worker thread drops its reference to `found` just after the all-reduce completes. Were
    # that the last one, it would free the tensor's Python object and so wait for the GIL; if the
    # main thread is by then tearing down the process group (joining that worker, GIL held: DDP's
    # reducer freed at the end of training), neither goes on (torch 1.13). Python keeps the tensor
    # until the next agreement, long after the worker let it go.
    _LAST_AGREEMENT[:] = [found]
    return int(found.item())


#: The tensor of the last all-reduce of _largest_on_any_rank (see there).
_LAST_AGREEMENT: List[torch.Tensor] = []


@contextlib.contextmanager
def _unsharded(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2 (fully_shard): the replays call the model's forward directly, so the root's
    pre-forward, which gathers its parameters, does not run. Every sharded module is gathered
    around the estimate, so that model.parameters() are the whole parameters the replays read
    and differentiate (FSDP2 keeps one such object per parameter), and around each replay, whose
    backward frees them again; resharded after, as after a training step. Each rank gathers as
    many times as the others where their steps saved the same tensors (the same keys)."""
    # A model sharded so was sharded by code that imported FSDP2: nothing to import here (torch
    # 1.13's fsdp does not even import on Python 3.11).
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    sharded = [m for m in model.modules() if isinstance(m, kind)] if kind is not None else []
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()


def trainer_callback(controller: CompressionController) -> Any:
    """A transformers.TrainerCallback that runs `controller` in a stock ``transformers.Trainer``:
    each micro-batch's forward and backward is one controller step, as ``with controller:``
    around them would make it in a loop of your own (with gradient_accumulation_steps=k, k steps
    per optimizer step).

    The Trainer gives callbacks no way to wrap its training_step, so the step is begun at
    on_step_begin (and after each on_substep_end) and ended after the backward, at
    on_substep_end or on_pre_optimizer_step (on_step_end where transformers has no such event),
    where the estimate of a probe step runs; the saved-tensor hooks are entered only while the
    model's forward runs, by a forward pre-hook and an ``always_call`` forward hook on the
    controller's model. A step that raises leaves no hook behind; its bookkeeping is dropped when
    the next step begins, when training ends, or by ``controller.remove()`` (which also removes
    the forward hooks). Saves outside the model's forward (a loss computed by the Trainer from
    the logits) are not compressed, and neither is what a reentrant activation checkpoint
    recomputes during backward.

    Raises ImportError when transformers is not installed; at on_train_begin, ValueError if the
    Trainer's model is not, and does not contain, the controller's model.
    """
    import transformers  # noqa: F401  (an ImportError here says what is missing)

    controller._install_step_hooks()

    class CompressionCallback(transformers.TrainerCallback):  # type: ignore[misc, name-defined]
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Optional[torch.nn.Module] = None,
                           **kwargs: Any) -> Any:
            if controller._removed:
                raise RuntimeError("CompressionController: used after remove()")
            # Hooks on a model the Trainer never calls would leave every step empty, silently.
            if model is not None and not any(m is controller._model for m in model.modules()):
                raise ValueError("abp.controller.trainer_callback: the Trainer's model is not the controller's "
                                 "model and does not contain it (build the controller on the model you train, "
                                 "e.g. after abp.convert)")
            return control

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            controller._begin_step(hooked=True)
            return control

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            # A micro-batch that did not end the optimizer step: the next one is a step of its own.
            controller._end_hooked_step()
            controller._begin_step(hooked=True)
            return control

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            # After the last micro-batch's backward, before the parameters change: a probe
            # step's replays see the parameters its backward saw.
            controller._end_hooked_step()
            return control

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            controller._end_hooked_step()  # transformers without on_pre_optimizer_step
            return control

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            # Training stopped after on_substep_end began a step no micro-batch ran in.
            controller._abort_hooked_step()
            return control

    return CompressionCallback()
