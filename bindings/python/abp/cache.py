"""The runtime's compile cache, from Python: counters and purge (abp_cache_stats / abp_cache_clear)."""
from __future__ import annotations

from typing import Dict

from . import _lib

__all__ = ["stats", "clear"]


def stats() -> Dict[str, float]:
    """Compile-cache counters of this process: memory_hits, disk_hits, misses, compile_ms."""
    return _lib.cache_stats()


def clear() -> None:
    """Removes every compiled-kernel entry under $ABP_CACHE_DIR and empties the in-memory cache.
    The C++ per-call lane's build (plan-lane/, keyed by its source and torch) stays."""
    _lib.cache_clear()
