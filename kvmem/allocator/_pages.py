"""Pages: every reference a manager's pages have, and what each page holds.

::

    allocator       refcounts and lifetime tags (requests, the cache and fences hold references)
    fences          references held until a launched step retires or a copy is made
    cache           the prefix cache's references (evictable when it holds a page alone)
    namespace_ids   [num_pages]               whose content each page holds (-1 when free)
    tokens          [num_pages, page_size]    the token id committed into each slot

A page enters a lifetime in :meth:`Pages.allocate` (evicting cached pages first when the free
list is short) and leaves it when its last reference is dropped (:meth:`Pages.drop`: now, or
when the steps in flight retire). This object is the one writer of ``namespace_ids`` and
``tokens``; the prefix cache reads ``tokens`` to confirm its hits (the tokens are stored once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvmem.allocator._fences import Lease, StepFences
from kvmem.allocator._page_allocator import PageAllocator
from kvmem.allocator._prefix_cache import PrefixCache
from kvmem.errors import OutOfPagesError

__all__ = ["MANAGER_OUT_OF_PAGES", "FaultHooks", "Pages"]

# What an engine does when the manager is out of pages (OutOfPagesError's advice).
MANAGER_OUT_OF_PAGES = ("Preempt or release a request (or retire a step in flight) and retry; "
                        "can_admit(), can_reserve() and can_fork() ask first.")

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
KeyArray = npt.NDArray[np.uint64]


def _ignore(*_: object) -> None:
    return None


@dataclass
class FaultHooks:
    """Switches that make kvmem skip one of its own protections, for fault injection only
    (``kvmem.testing.faults``, ``kvmem fuzz``): a fuzzer proves its oracles catch the bug
    each one re-creates. All True in production; never switch them off elsewhere.

    hold_dropped_pages: a reference dropped while a step is in flight waits for the step (False:
        freed at once, BUGS 1 and 5)
    free_at_once: ``fn(pages) -> bool``, or None: a drop of references for which it answers True
        is freed at once, never held by a step in flight (a fuzzer passes "the batch holds the
        source of a copy-on-write copy not landed yet", BUGS 9 and 14)
    retire_frees: ``retire`` frees the references that waited for the step (False: they are
        lost, BUGS 2)
    """

    hold_dropped_pages: bool = True
    free_at_once: Callable[[Int32Array], bool] | None = None
    retire_frees: bool = True


class Pages:
    """The page references of one manager.

    Parameters
    ----------
    num_pages, page_size: the pool's shape.
    cache: a prefix cache to bind (or None: no reuse).
    on_evict: ``fn(pages, keys, namespace_ids)`` after cached pages were evicted (and freed,
        before anything else can allocate them: their bytes are still the cached content).
    on_free: ``fn(pages)`` after pages lost their last reference.
    evict_ahead: extra least-recently-used pages an eviction takes beyond the shortfall (None:
        ``num_pages // 512``; 0: exactly the shortfall).
    promised: ``fn(pages) -> int``, the pages promised to copy-on-write copies still to come
        (``Forks.promised``), which allocation leaves alone; None: none are.
    """

    def __init__(self, num_pages: int, page_size: int, cache: PrefixCache | None = None,
                 on_evict: Callable[[Int32Array, KeyArray, Int64Array], None] = _ignore,
                 on_free: Callable[[Int32Array], None] = _ignore,
                 evict_ahead: int | None = None,
                 promised: Callable[[Pages], int] | None = None) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.fences = StepFences(num_pages, self.allocator.tags)
        self.namespace_ids = np.full(num_pages, -1, dtype=np.int64)
        self.tokens = np.zeros((num_pages, page_size), dtype=np.int32)
        self._tokens_flat = self.tokens.reshape(-1)  # slot s at [s]
        self.cache = cache
        if cache is not None:
            view = self.tokens.view()
            view.flags.writeable = False
            cache.bind(self.allocator, page_size, view)
        # An eviction has a fixed cost (a few dozen numpy calls), so a big pool evicts up to
        # num_pages / 512 more of the least recently used pages than it must (see make_room).
        self._evict_ahead = num_pages >> 9 if evict_ahead is None else evict_ahead
        self.num_evictions = 0
        self.on_evict = on_evict
        self.on_free = on_free
        # Pages promised to copy-on-write copies still to come (a fork's shared, partly filled
        # tail needs a copy per extra writer): counted by their owner (Forks.promised).
        self._promised = promised
        self.faults = FaultHooks()

    # -- counts -------------------------------------------------------------------------------

    def available(self) -> int:
        """Pages allocation can obtain now: free ones plus evictable cached ones, less those
        promised to copy-on-write copies still to come (``promised(self)``)."""
        free = self.allocator.num_free + (self.cache.num_evictable if self.cache else 0)
        return free if self._promised is None else free - self._promised(self)

    def require(self, num: int, keeping: int = 0) -> None:
        """Raise OutOfPagesError (nothing changed) unless ``num`` pages can be obtained, of
        which ``keeping`` are promised ones the caller is about to use."""
        if num > self.available() + keeping:
            raise OutOfPagesError(num, self.available() + keeping, MANAGER_OUT_OF_PAGES)

    def writers(self, pages: npt.NDArray[np.integer]) -> npt.NDArray[np.integer]:
        """Holders that may read or write these pages' future slots: requests and the cache.
        A fence holds a reference only so a launched step can still read the existing slots,
        or a copy be made; it never reads a slot a request is about to write."""
        holders = self.allocator.refcounts[pages]
        if self.fences.holds_any:
            return holders - self.fences.held[pages]
        return holders

    # -- references ---------------------------------------------------------------------------

    def make_room(self, num: int) -> None:
        """Evict cached pages until ``num`` are free (the caller checked that they can be).
        In a pool of 512 pages or more, up to ``num_pages / 512`` more of the least recently
        used pages go too: the next allocations find them free."""
        short = num - self.allocator.num_free
        if short <= 0:
            return
        assert self.cache is not None
        ahead = min(self._evict_ahead, self.cache.num_evictable - short)
        pages, keys = self.cache.evict(short + max(ahead, 0))
        namespace_ids = self.namespace_ids[pages]
        self.namespace_ids[pages] = -1
        self.num_evictions += pages.size
        self.on_evict(pages, keys, namespace_ids)

    def allocate(self, num: int, namespace_ids: Int64Array | int) -> Int32Array:
        """``num`` fresh pages holding ``namespace_ids``' content (one reference each)."""
        self.make_room(num)
        pages = self.allocator.allocate(num)
        self.namespace_ids[pages] = namespace_ids
        return pages

    def share_hits(self, pages: Int32Array) -> None:
        """A request takes a reference on prefix-cache hits (distinct pages)."""
        if pages.size:
            self.allocator.share_distinct(pages)
            assert self.cache is not None
            self.cache.acquired(pages)

    def drop(self, pages: Int32Array) -> None:
        """Drop one reference per listed page: now, or when the steps in flight retire."""
        if pages.size == 0:
            return
        if self.fences.in_flight and self._held(pages):
            self.fences.defer(pages)
        else:
            self.free(pages)

    def _held(self, pages: Int32Array) -> bool:
        """Whether dropped references wait for the steps in flight (always, but for faults)."""
        f = self.faults
        return f.hold_dropped_pages and (f.free_at_once is None or not f.free_at_once(pages))

    def drop_runs(self, runs: Sequence[Int32Array]) -> None:
        """:meth:`drop` of several holders' runs at once, released in order (the cache's LRU
        order follows)."""
        if len(runs) <= 1:
            if runs:
                self.drop(runs[0])
            return
        if self.fences.in_flight and all(self._held(pages) for pages in runs):
            for pages in runs:
                self.fences.defer(pages)
        else:
            self.free(np.concatenate(runs), runs)

    def free(self, pages: Int32Array, runs: Sequence[Int32Array] | None = None) -> None:
        """Drop one reference per listed page now; ``runs``: ``pages`` is their concatenation,
        one run per holder, released in that order."""
        freed = self.allocator.free(pages)
        self.namespace_ids[freed] = -1
        if self.cache is not None:
            if runs is None:
                self.cache.released(pages)
            else:
                self.cache.released_many(runs)
        if freed.size:
            self.on_free(freed)

    def forget_freed(self, pages: Int32Array) -> None:
        """After the cache dropped its references: pages now free lose their namespace."""
        freed = pages[self.allocator.refcounts[pages] == 0]
        self.namespace_ids[freed] = -1
        if freed.size:
            self.on_free(freed)

    def clear_cache(self) -> int:
        """Forget every cached prefix; how many pages the cache forgot (those nobody else
        holds are free now)."""
        assert self.cache is not None
        pages = self.cache.clear()
        self.forget_freed(pages)
        return int(pages.size)

    def uncache(self, pages: Int32Array) -> list[KeyArray]:
        """Take ``pages`` out of the prefix cache (requests that hold them keep them), and
        first every entry whose page was freed behind everyone's back (``cache.stale()``): a
        request's pages after a bad one may hold KV computed from a corrupted context. The
        keys removed, one array per removal (none without a cache)."""
        if self.cache is None:
            return []
        out = []
        stale = self.cache.stale()
        if stale.size:
            out.append(self.cache.forget(stale))
        removed, keys = self.cache.remove(pages)
        self.forget_freed(removed)
        out.append(keys)
        return out

    def copy_for_write(self, sources: Int32Array) -> Int32Array:
        """New pages for copy-on-write of ``sources`` (same namespaces and tokens); each source
        is held (:meth:`StepFences.hold_for_copy`) until :meth:`copies_done`."""
        new = self.allocate(sources.size, self.namespace_ids[sources])
        self.tokens[new] = self.tokens[sources]
        self.fences.hold_for_copy(sources)
        return new

    def copies_done(self) -> None:
        """Every copy handed out so far was made or is being made by a step in flight: drop
        the sources' references (that step holds them further)."""
        self.drop(self.fences.copies_done())

    def lease(self, pages: Int32Array) -> Lease:
        """Take one more reference on each live page and hold it until :meth:`end_lease`."""
        self.allocator.share(pages)
        return self.fences.hold_for_lease(pages)

    def end_lease(self, lease: Lease) -> bool:
        """Drop a lease's references (now, or when the steps in flight retire); whether every
        page was still in the lifetime the lease named."""
        pages, intact = self.fences.end_lease(lease)
        self.drop(pages)
        return intact

    def retired(self, pages: Int32Array) -> None:
        """A step retired: free the references that waited only for it."""
        if pages.size and self.faults.retire_frees:
            self.free(pages)

    # -- contents -----------------------------------------------------------------------------

    def write_tokens(self, slots: npt.NDArray[np.integer], token_ids: npt.ArrayLike) -> None:
        """Record the token ids committed into ``slots`` (``page * page_size + offset``)."""
        self._tokens_flat[slots] = token_ids

    def tokens_at(self, slots: npt.NDArray[np.integer]) -> Int64Array:
        """Token ids committed into ``slots``: ``[k]``, int64."""
        return self._tokens_flat[slots].astype(np.int64)
