"""Whether abp's size thresholds apply; abp.convert turns them off while it counts saved bytes.

Two thresholds exist for small tensors only: a sampled linear map keeps at least a few rows
(sampling.MINIMUM_KEPT: the estimator needs them), and compress_saved leaves tensors under
``min_numel`` elements raw (codes would not pay for their groups' scales). On the small example
call convert runs (a short sequence, transformers' dummy_inputs) they would decide everything,
while at training sizes neither applies: a sampled layer of 10 tokens keeps all 10 rows and
saves nothing, one of 4096 tokens keeps 30 %. ``ignored()`` counts the example as a large batch
would behave, in proportion.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

__all__ = ["apply", "ignored"]

_IGNORED = contextvars.ContextVar("abp_size_thresholds_ignored", default=False)


def apply() -> bool:
    """False inside ``ignored()``."""
    return not _IGNORED.get()


@contextlib.contextmanager
def ignored() -> Iterator[None]:
    token = _IGNORED.set(True)
    try:
        yield
    finally:
        _IGNORED.reset(token)
