"""Counts the bytes autograd saves for backward (saved_tensors_hooks), deduplicated by storage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["SavedTensor", "SavedTensorsCounter", "distinct_bytes", "saved_bytes", "storage_key"]


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
        try:
            device, ptr, nbytes = storage_key(t)
        except RuntimeError:
            # A tensor without data (torch.compile's fake tensors while it traces): nothing is stored.
            return t
        self.tensors.append(SavedTensor(tuple(t.shape), t.dtype, device, nbytes, ptr, self.tag))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "SavedTensorsCounter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def total_bytes(self) -> int:
        """Bytes of the distinct storages saved (a storage viewed by several saved tensors counts once)."""
        return distinct_bytes(self.tensors)

    def bytes_tagged(self, tag: Optional[str]) -> int:
        """Bytes of the distinct storages saved while ``self.tag`` was ``tag``."""
        return distinct_bytes([s for s in self.tensors if s.tag == tag])


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
