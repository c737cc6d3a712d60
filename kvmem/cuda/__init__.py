"""Page pools: KV pages on the device (CUDA when present, CPU otherwise), by page id; a
hybrid model's groups in one buffer (``GroupPool``)."""

from __future__ import annotations

from kvmem.cuda._group_pool import GroupPool
from kvmem.cuda._pool import PagePool, PoolStats
from kvmem.cuda._spec import PoolSpec

__all__ = ["GroupPool", "PagePool", "PoolSpec", "PoolStats"]
