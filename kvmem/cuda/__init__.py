"""Page pools: KV pages on the device (CUDA when present, CPU otherwise), by page id."""

from __future__ import annotations

from kvmem.cuda._pool import PagePool, PoolStats
from kvmem.cuda._spec import PoolSpec

__all__ = ["PagePool", "PoolSpec", "PoolStats"]
