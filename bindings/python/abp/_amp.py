"""autocast's state for a device type on every torch abp runs on (1.13 to 2.x): one reading for the
operators' dtype choice (abp.functional), the recompute recorder (abp._derived) and the
controller's replays (abp._replay)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["dtype", "state"]

#: torch >= 2.4 takes the device type (and deprecates the per-device getters). Older torch takes no
#: argument, and is asked by feature, not by trying: under torch.compile's tracing a call with one
#: fails as dynamo's internal error, not as the TypeError eager code would catch (torch 2.1).
_PER_DEVICE = hasattr(torch, "get_autocast_dtype")


def state(kind: str) -> Tuple[bool, torch.dtype]:
    """(enabled, dtype) of autocast on device type `kind`, "cpu" or "cuda"."""
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"kind: expected 'cpu' or 'cuda', got {kind!r}")
    if _PER_DEVICE:
        return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)  # type: ignore[call-arg,attr-defined]
    if kind == "cpu":
        return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()


def dtype(kind: str) -> Optional[torch.dtype]:
    """The dtype autocast runs device type `kind`'s ops in where it is on there, else None (so for a
    device type an older torch has no autocast state for)."""
    if kind in ("cpu", "cuda"):
        enabled, chosen = state(kind)
    elif _PER_DEVICE:
        enabled, chosen = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)  # type: ignore[call-arg,attr-defined]
    else:
        return None
    return chosen if enabled else None
