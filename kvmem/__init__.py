"""kvmem: a paged KV-cache memory manager for LLM inference engines.

Layers (data flows downward; nothing imports upward)::

    kvmem.allocator   PageAllocator, PageTable (numpy only)
    kvmem.integrity   trackers and the batched mapping check (numpy; torch form lazily)
"""

from __future__ import annotations

from kvmem.allocator import PAD, AllocatorStats, CSRMetadata, GrowResult, PageAllocator, PageTable
from kvmem.errors import ConfigError, IntegrityError, InvalidFreeError, KVMemError, OutOfPagesError
from kvmem.integrity import CheckingTracker, IntegrityReport, NoOpTracker, Tracker

__version__ = "0.1.0"

__all__ = [
    "PAD",
    "AllocatorStats",
    "CSRMetadata",
    "CheckingTracker",
    "ConfigError",
    "GrowResult",
    "IntegrityError",
    "IntegrityReport",
    "InvalidFreeError",
    "KVMemError",
    "NoOpTracker",
    "OutOfPagesError",
    "PageAllocator",
    "PageTable",
    "Tracker",
    "__version__",
]
