"""One-shot faults: functions that put a manager into the state a bug produces (BUGS.md rows),
through its public components, so that a test can prove the matching detector fires."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvmem._validate import integer
from kvmem.errors import ArgumentError

if TYPE_CHECKING:
    from kvmem.manager import KVCacheManager

__all__ = [
    "free_behind_back",
    "lose_fence_completion",
    "overwrite_page_entry",
    "reallocate_behind_back",
    "row_of",
    "share_write_page",
]


def row_of(mgr: KVCacheManager, request_id: Any) -> int:
    """The page-table row of a running request (``mgr.row_of``)."""
    return mgr.row_of(request_id)


def _mapped_page(mgr: KVCacheManager, request_id: Any, position: int) -> int:
    """The page at ``position`` of a running request's pages (ArgumentError if it maps none
    there)."""
    pages = mgr.pages_of(request_id)
    integer(position, "position", minimum=0, maximum=max(pages.size - 1, 0))
    if not pages.size:
        raise ArgumentError(f"request {request_id!r} maps no page yet")
    return int(pages[position])


def free_behind_back(mgr: KVCacheManager, request_id: Any, position: int) -> int:
    """Free the page at ``position`` of a running request while it still maps it (BUGS 5, 9:
    a second release path, or a prefix page freed under a running request). Returns the page."""
    page = _mapped_page(mgr, request_id, position)
    holders = int(mgr.allocator.refcounts[page])
    mgr.allocator.free(np.full(holders, page, dtype=np.int32))
    return page


def reallocate_behind_back(mgr: KVCacheManager, request_id: Any, position: int) -> int:
    """Free a mapped page behind the request's back and hand it out again (BUGS 1, 5, 7, 9:
    the page now holds someone else's KV). Returns the page; the new lifetime is left
    allocated and owned by nobody the manager knows (a leak ``check`` reports)."""
    page = free_behind_back(mgr, request_id, position)
    # Take free pages until the victim comes back (the allocator hands out LIFO).
    taken = []
    while True:
        got = int(mgr.allocator.allocate(1)[0])
        if got == page:
            break
        taken.append(got)
    if taken:
        mgr.allocator.free(np.array(taken, dtype=np.int32))
    return page


def overwrite_page_entry(mgr: KVCacheManager, request_id: Any, position: int, page: int) -> int:
    """Write another page id into a request's row (BUGS 12, 13: the kernel is handed the wrong
    slice of the page table, or stale columns). Returns the page that was there."""
    row = row_of(mgr, request_id)
    old = _mapped_page(mgr, request_id, position)
    integer(page, "page", minimum=0, maximum=mgr.num_pages - 1)
    mgr.table.overwrite(row, position, page)
    return old


def share_write_page(mgr: KVCacheManager, request_id: Any) -> int:
    """Give the page a request is about to write a second, phantom holder (BUG 14: a partly
    filled page written by two requests without copy-on-write). Returns the page."""
    pos = mgr.num_committed(request_id) // mgr.page_size
    page = int(mgr.pages_of(request_id)[pos])
    mgr.allocator.share([page])
    return page


def lose_fence_completion(mgr: KVCacheManager) -> int:
    """The fence gets every open step's completion but the references it returns are dropped
    on the floor (BUG 2: the deferred free never happens). The steps are closed in the fence;
    nothing is freed. Returns the references lost."""
    from kvmem.manager import StepHandle

    lost = 0
    for step_id in mgr.fences.open_steps:
        lost += int(mgr.fences.retire(StepHandle(step_id)).size)
    return lost
