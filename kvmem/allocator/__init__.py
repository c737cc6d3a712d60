"""Page bookkeeping in numpy (no torch): the allocator, the page table, prefix caches, fences."""

from __future__ import annotations

from kvmem.allocator._page_allocator import AllocatorStats, PageAllocator
from kvmem.allocator._page_table import PAD, CSRMetadata, GrowResult, PageTable

__all__ = ["PAD", "AllocatorStats", "CSRMetadata", "GrowResult", "PageAllocator", "PageTable"]
