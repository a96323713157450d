"""A warning for the optimizer built before ``abp.convert`` copied the model.

``convert(model)`` deep-copies the model (``inplace=False``, the default), so an optimizer made
from ``model.parameters()`` beforehand steps the original's parameters, which the converted model
never uses: training changes nothing, silently. convert notes the parameters it copied from; a
global optimizer step pre-hook (torch >= 2.0; none on 1.13) warns, once per optimizer, when a step
finds none of its parameters with a gradient and some of them copied from. An optimizer of the
original that does get gradients (an exact baseline trained beside the converted copy) is never
warned about: the hook returns at the first gradient it sees.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, Optional

import torch
from torch import nn

__all__ = ["note_copied"]

# Parameters of models convert copied, by id (a tensor's == is elementwise, so no WeakSet).
_COPIED: Dict[int, "weakref.ref[torch.Tensor]"] = {}
_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers already warned about
_HOOK: Optional[Any] = None


def note_copied(original: nn.Module) -> None:
    """Remembers the parameters of `original`, which convert has just deep-copied."""
    global _HOOK
    try:
        from torch.optim import optimizer
    except ImportError:  # pragma: no cover - every torch abp supports has it
        return
    register = getattr(optimizer, "register_optimizer_step_pre_hook", None)
    if register is None:  # torch 1.13: no global optimizer hooks
        return
    for parameter in original.parameters():
        key = id(parameter)
        _COPIED[key] = weakref.ref(parameter, lambda _, key=key: _COPIED.pop(key, None))
    if _HOOK is None:
        _HOOK = register(_check_step)


def _check_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if optimizer in _WARNED:
        return
    copied = False
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is not None:
                return  # something trains: the usual case costs one look
            if not copied:
                entry = _COPIED.get(id(parameter))
                copied = entry is not None and entry() is parameter
    if copied:
        _WARNED.add(optimizer)
        warnings.warn(f"abp.convert: this {type(optimizer).__name__} steps the parameters of the model as it was "
                      "before abp.convert copied it (inplace=False, the default), and none of them has a gradient: "
                      "nothing trains. Build the optimizer from the converted model's parameters, or convert with "
                      "inplace=True", RuntimeWarning, stacklevel=3)
