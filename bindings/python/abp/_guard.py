"""The divergence guard of compressed training: watches the gradient norm, warns when it runs away.

Compression that damages the backward pass does not fail loudly: the loss stalls while the norm
of the gradient grows step after step (from about 2 to 10^6 in 250 steps on a real task,
docs/compressed-training.md), and the user gets a silently worse model. Exact training keeps its
gradient norm within a small factor of where it settled after the first steps. The guard compares
the two: after backward, the norm of the gradients of the parameters the compressed block saw;
its reference is the median over steps `skip`..`skip + window`; it alarms when a norm is not
finite or when the median of the last `window` steps exceeds `factor` times the reference.

**When the norm is read.** Under a loss scaler (torch.amp.GradScaler) the gradients a backward
leaves are scaled: an overflow step's norm is inf (the scaler skips that step and halves its
scale), and the scale doubles after every run of clean steps. Neither is divergence. So where
torch runs global optimizer step hooks (torch >= 2), a step's norm is read when the torch.optim
optimizer holding the parameters steps, after the scaler has unscaled them; a step the scaler
skips never reaches it, and accumulated micro-batches count as the one step they are. A model
that no torch.optim optimizer steps within `_WITHOUT_STEPS` backward passes is read at the end of
each backward instead (its readings so far are kept), as on torch 1.13. Read there, a watch that
has seen float16 saves (`scaled`: a scaler is likely) leaves non-finite steps out, alarms only
when `window` steps in a row are not finite (a run no scaler rescues: diverged training
overflows every step), and drops the growth rule.

The norms stay on the device and are read every `window` steps (one host sync then). A watch
belongs to a model (found by the first parameter a block sees), so a new ``compress_saved`` per
step shares it.
"""
from __future__ import annotations

import importlib
import math
import statistics
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["DivergenceError", "DivergenceWarning", "GradientWatch", "check_after_backward"]


class DivergenceWarning(RuntimeWarning):
    """Compressed training's gradient norm is running away (see abp.compress_saved's `guard`)."""


class DivergenceError(RuntimeError):
    """Raised instead of a DivergenceWarning with ``guard="raise"``."""


class GradientWatch:
    """The gradient-norm history of one model under compressed training, and the alarm rule."""

    def __init__(self, *, skip: int = 5, window: int = 20, factor: float = 8.0) -> None:
        self.skip, self.window, self.factor = skip, window, factor
        #: The readings the rule still needs (read from the device every `window` steps): every
        #: one until the reference is set, then the last `window` (a long run keeps no history).
        self.norms: List[float] = []
        self.steps = 0  # readings so far (the step a reading is, in messages)
        self._pending: List[torch.Tensor] = []
        self.reference: Optional[float] = None
        #: requires_grad of every parameter read so far, by id: when one of them flips (layers
        #: unfrozen or frozen) the norm is over other parameters, another quantity, and the history
        #: restarts. A parameter first seen late (an expert routed to for the first time, a layer
        #: LayerDrop skipped) is no flip: which parameters a step saves varies by itself.
        self._trains: Dict[int, bool] = {}
        self.alarmed = False
        #: Float16 training, its gradients scaled by a GradScaler (module docstring).
        self.scaled = False
        self._not_finite = 0  # steps in a row whose norm was not finite (scaled)
        self._finite_seen = False  # a finite norm was read (kept across restarts: training had run)
        #: Where its norms are read: "step" (at the optimizer's step), "backward" (at the end of
        #: backward), or "undecided" until an optimizer steps the parameters or none has for long.
        self.mode = "undecided" if _STEP_HOOKS else "backward"
        # The parameters (weak references) and alarm of a backward whose step has not come yet.
        self._due: Optional[Tuple[List["weakref.ref[torch.Tensor]"], Callable[[str], None]]] = None
        self._undecided: List[Tuple[torch.Tensor, bool]] = []  # backward-end norms while undecided

    def record(self, norm: torch.Tensor, scaled: bool = False, trains: Optional[Dict[int, bool]] = None) -> Optional[str]:
        """Adds one step's gradient norm (a 0-d tensor); `scaled`: the step saved float16 tensors;
        `trains`: requires_grad of the parameters it is the norm of, by id (trainable_flags).
        Returns the alarm's reason, once."""
        if trains is not None:
            known = self._trains
            if any(known.get(key, flag) != flag for key, flag in trains.items()):
                self._restart()
            known.update(trains)
        self.scaled = self.scaled or scaled
        self._pending.append(norm.detach())
        if len(self._pending) < self.window:
            return None
        return self.add([float(v) for v in torch.stack(self._pending).cpu().tolist()])

    def _restart(self) -> None:
        """Forgets the readings and the reference (the alarm, once raised, stays raised)."""
        self.norms, self._pending, self.steps, self.reference, self._not_finite = [], [], 0, None, 0

    def add(self, norms: Iterable[float]) -> Optional[str]:
        """Adds gradient norms read on the host; returns the alarm's reason, once."""
        self._pending = []
        found = None
        for value in norms:
            self.norms.append(value)
            self.steps += 1
            reason = self._check()
            if (self.reference is not None or self.scaled) and len(self.norms) > self.window:
                del self.norms[:-self.window]
            if reason is not None and not self.alarmed:
                self.alarmed = True
                found = found or reason
        return found

    def _check(self) -> Optional[str]:
        step, value = self.steps - 1, self.norms[-1]
        self._finite_seen = self._finite_seen or math.isfinite(value)
        if self.scaled:
            if math.isfinite(value):
                self._not_finite = 0
                return None  # a scaler's scale moves the norm by powers of 2: no growth rule
            self.norms.pop()  # a skipped step: not part of the history
            self.steps -= 1
            self._not_finite += 1
            if self._not_finite >= self.window:
                return (f"the gradient norm was not finite for {self._not_finite} steps in a row (a loss scaler "
                        "skips such steps and lowers its scale; these kept overflowing)")
            return None
        if not math.isfinite(value):
            if not self._finite_seen:
                return f"the gradient norm is {value} at step {step}, {FROM_THE_START}"
            return f"the gradient norm is {value} at step {step}"
        start = self.skip
        if self.reference is None and self.steps >= start + self.window:
            self.reference = statistics.median(self.norms[start:start + self.window])
        if self.reference is None or self.steps < start + 2 * self.window:
            return None
        recent = statistics.median(self.norms[-self.window:])
        if recent > self.factor * self.reference:
            return (f"the gradient norm grew from {self.reference:.3g} (median of steps {start}-"
                    f"{start + self.window - 1}) to {recent:.3g} (median of steps {step - self.window + 1}-{step})")
        return None


#: torch >= 2 runs global optimizer step pre-hooks, where the guard reads a step's gradients.
_optimizers = importlib.import_module("torch.optim.optimizer")  # torch.optim hides its submodule's name
_STEP_HOOKS = hasattr(_optimizers, "register_optimizer_step_pre_hook")
#: Backward passes without an optimizer step after which a watch reads at backward end.
_WITHOUT_STEPS = 60
_step_hook: Optional[Any] = None


def check_after_backward(parameters: List[torch.Tensor], half: bool, on_alarm: Callable[[str], None]) -> None:
    """Called at the end of a backward through a compressed block that saw `parameters` (`half`:
    in float16): records this step's gradient norm where the module docstring says, and calls
    `on_alarm(reason)` if the watch alarms."""
    watch = watch_for(parameters[0])
    if watch.mode == "backward":
        _read(watch, parameters, half, on_alarm)
        return
    global _step_hook
    if _step_hook is None:
        _step_hook = _optimizers.register_optimizer_step_pre_hook(_before_step)
    # Weak references: a step that never comes (the run's last backward, gradients for analysis)
    # must not keep the model alive through this global table.
    watch._due = ([weakref.ref(p) for p in parameters], on_alarm)
    if watch.mode == "undecided":
        norm = gradient_norm(parameters)
        if norm is not None:
            watch._undecided.append((norm.detach(), half, trainable_flags(parameters)))
        if len(watch._undecided) >= _WITHOUT_STEPS:  # no torch.optim optimizer steps this model
            watch.mode, undecided, watch._undecided, watch._due = "backward", watch._undecided, [], None
            for norm, was_half, trains in undecided:
                reason = watch.record(norm, scaled=was_half, trains=trains)
                if reason is not None:
                    on_alarm(reason)


def trainable_flags(parameters: List[torch.Tensor]) -> Dict[int, bool]:
    """requires_grad of each of `parameters`, by id (GradientWatch.record)."""
    return {id(p): p.requires_grad for p in parameters}


def _read(watch: "GradientWatch", parameters: List[torch.Tensor], half: bool, on_alarm: Callable[[str], None]) -> None:
    norm = gradient_norm(parameters)
    if norm is None:
        return
    reason = watch.record(norm, scaled=half and watch.mode == "backward", trains=trainable_flags(parameters))
    if reason is not None:
        on_alarm(reason)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook: reads the due watches whose parameters `optimizer`
    steps (a GradScaler has unscaled their gradients by now)."""
    held: Optional[set] = None
    for _, watch in list(_watches.values()):
        if watch._due is None or watch.mode == "backward":
            continue
        if held is None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        references, on_alarm = watch._due
        parameters = [p for p in (r() for r in references) if p is not None]
        # Held by this optimizer: any trainable one (the first may be a frozen base weight, LoRA's).
        if not any(p.requires_grad and id(p) in held for p in parameters):
            continue
        watch._due, watch.mode, watch._undecided = None, "step", []
        _read(watch, parameters, False, on_alarm)


# One watch per model: keyed by the first parameter a compressed block sees (by identity: a
# tensor's == is elementwise), dropped with it.
_watches: Dict[int, Tuple["weakref.ref[torch.Tensor]", GradientWatch]] = {}


def watch_for(parameter: torch.Tensor) -> GradientWatch:
    key = id(parameter)
    entry = _watches.get(key)
    if entry is None or entry[0]() is not parameter:
        # The table itself in the callback: at interpreter exit the module's globals may be gone.
        entry = _watches[key] = (weakref.ref(parameter, lambda _, key=key, table=_watches: table.pop(key, None)),
                                 GradientWatch())
    return entry[1]


def gradient_norm(parameters: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
    """The 2-norm of the gradients of `parameters` (those that have one), on their device."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return None
    devices = {g.device for g in grads}
    if len(devices) == 1:
        # One foreach op for every gradient (a model has hundreds: per-tensor norms cost a
        # dispatch each on every step), accumulating in fp32 as the loop below does.
        try:
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        except (AttributeError, TypeError, RuntimeError, NotImplementedError):
            pass  # torch 1.13 takes no dtype; a tensor subclass may have no foreach kernel
    device = grads[0].device if len(devices) == 1 else torch.device("cpu")
    return torch.linalg.vector_norm(torch.stack([_norm32(g).to(device) for g in grads]))


def _norm32(g: torch.Tensor) -> torch.Tensor:
    """The 2-norm of `g` in float32: accumulated in float32 (a float16 gradient's squares would
    overflow in float16), or in float64 for a float64 gradient (which vector_norm will not narrow)."""
    if g.dtype == torch.float64:
        return torch.linalg.vector_norm(g).float()
    return torch.linalg.vector_norm(g, dtype=torch.float32)


def after_backward(callback: Callable[[], Any]) -> bool:
    """Runs `callback` when the backward pass running now ends; False outside backward."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
    except RuntimeError:
        return False
    return True


#: What a reason says when no step had a finite gradient norm yet: nothing has diverged.
FROM_THE_START = "the first step the guard read"


def alarm(mode: str, who: str, reason: str, widest: bool = False) -> None:
    """Warns (or raises, `mode` "raise") that training under `who` diverges; `widest`: it stores
    every compressed tensor at 8 bits already, so more bits is no advice. A gradient that was never
    finite has not diverged: the message says what to look for instead."""
    if FROM_THE_START in reason:
        message = (f"{who}: {reason}: not a divergence (nothing grew), but a backward that is not finite from the "
                   "start. Run one step without the block: if its gradient is finite, an op's backward does not "
                   "work on what the block stored for it (please report the op); if not, the model's own gradient "
                   "is not finite. guard=False silences this check")
    else:
        advice = ("It stores 8 bits already, the widest: train exactly on the same schedule to compare; if that "
                  "diverges too, the cause is not compression (the learning rate, for one)" if widest else
                  "Store the saved activations at more bits than this setting does (compress_saved(bits=8) is the "
                  "widest); if exact training diverges too, the cause is not compression (the learning rate, for one)")
        message = f"{who}: {reason}, as compressed training that diverges does. {advice}. guard=False silences this check"
    if mode == "raise":
        raise DivergenceError(message)
    warnings.warn(message, DivergenceWarning, stacklevel=2)
