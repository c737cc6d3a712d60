"""PageAllocator: which physical pages are free, who holds the rest, and which lifetime each is in.

::

    free_stack[:num_free]      page ids ready to hand out (top of the stack at the end)
    refcounts[page]            holders of a live page (0 when free)
    tags[page]                 lifetime tag of a live page (0 when free); from one 64-bit counter,
                               so no two lifetimes of any pages ever share a tag

All state is numpy; allocating or freeing k pages costs a constant number of numpy calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import INT32_MAX as _INT32_MAX
from kvmem._validate import integer, show
from kvmem.allocator._change_log import ChangeLog
from kvmem.errors import (
    ArgumentError,
    ArgumentTypeError,
    IntegrityError,
    InvalidFreeError,
    OutOfPagesError,
)

__all__ = ["AllocatorStats", "FreePlan", "PageAllocator"]

PageIds = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """A snapshot of allocator counters; it does not change when the allocator does."""

    num_pages: int
    num_free: int
    num_used: int
    num_shared: int  # live pages with more than one holder
    num_allocations: int  # page lifetimes started so far (== last tag handed out)
    num_frees: int  # page lifetimes ended so far

    @property
    def usage(self) -> float:
        return self.num_used / self.num_pages


_min = np.minimum.reduce  # the ufunc reductions: a few microseconds less than ndarray.min()
_max = np.maximum.reduce
_ONE = np.int32(1)  # np.add.at with a same-dtype one: numpy 2's fast path


def equal_arrays(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    """``np.array_equal`` of two numpy arrays without its conversions: a fraction of its cost
    on the batch-sized arrays of a step (``count_nonzero`` is likewise cheaper than ``any``)."""
    return a.shape == b.shape and not np.count_nonzero(a != b)


def as_page_ids(pages: npt.ArrayLike, name: str = "pages") -> PageIds:
    """``pages`` (a 1-D sequence or array of page ids) as a flat int32 array, without copying
    when it already is one. Ids are never wrapped: a value that int32 cannot hold, a float, a
    bool, a string, or one id where a sequence is expected raises ArgumentError (or its
    TypeError twin). Negative ids pass through for the caller's range check."""
    if type(pages) is np.ndarray and pages.dtype == np.int32 and pages.ndim == 1:
        return pages
    if isinstance(pages, (str, bytes)) or np.ndim(pages) != 1:
        raise ArgumentTypeError(f"{name} must be a 1-D sequence of page ids, got "
                                f"{type(pages).__name__} {pages!r:.60}")
    arr = np.asarray(pages)
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name} must hold int page ids, got {arr.dtype} "
                                f"({pages!r:.60}); nothing changed")
    if int(arr.max()) > _INT32_MAX or int(arr.min()) < -_INT32_MAX:
        raise ArgumentError(f"{name} holds ids outside int32 ({int(arr.min())} .. "
                            f"{int(arr.max())}); page ids are in 0 .. num_pages - 1")
    return arr.astype(np.int32)


@dataclass(frozen=True, slots=True)
class FreePlan:
    """:meth:`PageAllocator.plan_free`'s answer: the distinct pages to free (``[k]`` intp,
    ascending) and the holders each keeps (``[k]`` int32), for ``allocator`` at ``version``."""

    allocator: PageAllocator
    version: int
    pages: npt.NDArray[np.intp]
    remaining: npt.NDArray[np.int32]


class PageAllocator:
    """Reference-counted pages ``0 .. num_pages-1`` with a fresh tag for every lifetime.

    Parameters
    ----------
    num_pages:
        Number of physical pages managed.

    Attributes
    ----------
    refcounts: ``[num_pages]``, int32, read-only view
        Holders of each page; 0 for a free page.
    tags: ``[num_pages]``, int64, read-only view
        Lifetime tag of each live page (> 0); 0 for a free page.
    changes: :class:`ChangeLog`
        Every array of pages whose tag changed (allocate, free), for readers that follow the
        tags (``changes.reader()``: each reader has its own cursor).
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = integer(num_pages, "num_pages", minimum=1, maximum=_INT32_MAX)
        # Reversed so that the first allocation hands out 0, 1, 2, ...
        self._free_stack = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = self.num_pages
        self._refcounts = np.zeros(self.num_pages, dtype=np.int32)
        self._tags = np.zeros(self.num_pages, dtype=np.int64)
        self._last_tag = 0
        self._version = 0  # moves with every change (a FreePlan holds for one version)
        self._num_frees = 0
        self.changes = ChangeLog()
        self._popped = self.changes.reader()  # pop_changed_pages()'s own cursor
        self.refcounts = self._refcounts.view()
        self.refcounts.flags.writeable = False
        self.tags = self._tags.view()
        self.tags.flags.writeable = False

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def can_allocate(self, num: int) -> bool:
        return integer(num, "num", minimum=0, maximum=None) <= self._num_free

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            num_pages=self.num_pages,
            num_free=self._num_free,
            num_used=self.num_used,
            num_shared=int(np.count_nonzero(self._refcounts > 1)),
            num_allocations=self._last_tag,
            num_frees=self._num_frees,
        )

    # -- mutations ---------------------------------------------------------------------------

    def allocate(self, num: int) -> PageIds:
        """Take ``num`` free pages, each with one holder and a fresh tag; all or nothing.

        Returns
        -------
        pages: ``[num]``, int32

        Raises
        ------
        OutOfPagesError
            Fewer than ``num`` pages are free; nothing changed.
        """
        num = integer(num, "num", minimum=0, maximum=_INT32_MAX)
        if num > self._num_free:
            raise OutOfPagesError(num, self._num_free)
        start = self._num_free - num
        pages = self._free_stack[start : self._num_free][::-1].copy()
        self._num_free = start
        idx = pages.astype(np.intp)  # numpy indexes with intp arrays several times faster
        self._version += 1
        self._refcounts[idx] = 1
        self._tags[idx] = np.arange(self._last_tag + 1, self._last_tag + 1 + num, dtype=np.int64)
        self._last_tag += num
        self.changes.append(pages)
        return pages

    def take(self, pages: npt.ArrayLike) -> None:
        """Take exactly the listed free pages, each with one holder and a fresh tag; all or
        nothing. Costs one pass over the free stack (a chunk of pages going back to a byte
        arena, not a per-step call).

        ``pages``: ``[k]``, distinct free page ids. Raises ArgumentError (nothing changed) if
        one is out of range, listed twice or held.
        """
        pages = as_page_ids(pages)
        if pages.size == 0:
            return
        idx = pages.astype(np.intp)
        if _min(idx) < 0 or _max(idx) >= self.num_pages:
            raise ArgumentError(f"take() got page ids {pages.tolist()[:16]}: pages are in "
                                f"0..{self.num_pages - 1}; nothing changed.")
        if np.unique(idx).size != idx.size:
            raise ArgumentError(f"take() lists a page twice in {pages.tolist()[:16]}; nothing "
                                "changed.")
        held = np.flatnonzero(self._refcounts[idx])
        if held.size:
            raise ArgumentError(f"take() got pages {pages[held].tolist()[:16]} that are held, "
                                "not free; nothing changed.")
        stack = self._free_stack[: self._num_free]
        kept = stack[~np.isin(stack, pages)]
        self._free_stack[: kept.size] = kept
        self._num_free = kept.size
        self._version += 1
        self._refcounts[idx] = 1
        self._tags[idx] = np.arange(self._last_tag + 1, self._last_tag + 1 + idx.size,
                                    dtype=np.int64)
        self._last_tag += idx.size
        self.changes.append(pages.copy())

    def share(self, pages: npt.ArrayLike) -> None:
        """Add one holder to each listed live page (a page listed twice gains two)."""
        pages = as_page_ids(pages)
        self._require_live(pages, "share")
        self._version += 1
        np.add.at(self._refcounts, pages, _ONE)

    def share_distinct(self, pages: npt.NDArray[np.integer]) -> None:
        """:meth:`share` for pages (int32 or intp) listed at most once each (one scatter, no
        add.at)."""
        if pages.size == 0:
            return
        idx = pages if pages.dtype == np.intp else pages.astype(np.intp)
        if _min(idx) < 0 or _max(idx) >= self.num_pages:
            self._require_live(idx, "share")  # raises, naming the bad ids
        held = self._refcounts[idx]
        if np.count_nonzero(held) != held.size:
            self._require_live(idx, "share")
        held += 1
        self._version += 1
        self._refcounts[idx] = held

    def free(self, pages: npt.ArrayLike) -> PageIds:
        """Remove one holder from each listed page; pages left with none become free.

        The whole call is validated before anything changes.

        Returns
        -------
        released: ``[k]``, int32
            The pages that lost their last holder (now free, tag 0), ascending.

        Raises
        ------
        InvalidFreeError
            A page is out of range, already free, or listed more times than it has holders.
        """
        pages = as_page_ids(pages)
        if pages.size == 0:
            return pages.copy()
        return self.apply_free(self.plan_free(pages))

    def plan_free(self, pages: npt.ArrayLike) -> FreePlan:
        """What :meth:`free` of ``pages`` would do, validated, changing nothing; apply it with
        :meth:`apply_free` before anything else changes this allocator (a caller freeing in
        several allocators at once validates all of them first). Raises InvalidFreeError as
        :meth:`free`."""
        pages = as_page_ids(pages)
        if pages.size == 0:
            return FreePlan(self, self._version, np.empty(0, dtype=np.intp),
                            np.empty(0, dtype=np.int32))
        uniq, held = self._sorted_live(pages)
        if uniq.size > 1 and np.count_nonzero(uniq[1:] == uniq[:-1]):
            # A page listed k times loses k holders: group the repeats first.
            uniq, counts = np.unique(uniq, return_counts=True)
            remaining = self._refcounts[uniq] - counts
            if np.count_nonzero(remaining < 0):
                bad = uniq[remaining < 0]
                raise InvalidFreeError(
                    f"free() lists pages {bad.tolist()[:16]} more times than they have holders "
                    f"(holders {self._refcounts[bad].tolist()[:16]}); nothing was freed. Two "
                    "release paths are probably freeing the same page: free each holder's "
                    "reference once."
                )
            return FreePlan(self, self._version, uniq, remaining.astype(np.int32))
        held -= 1  # live pages have >= 1 holder: never negative
        return FreePlan(self, self._version, uniq, held)

    def apply_free(self, plan: FreePlan) -> PageIds:
        """Carry out a :meth:`plan_free` of this allocator, made since its last change;
        returns the pages left with no holder (free now, tag 0), ascending, int32. Raises
        ArgumentError (nothing changed) for another allocator's plan or a stale one."""
        if not isinstance(plan, FreePlan) or plan.allocator is not self:
            raise ArgumentError(f"apply_free() got {show(plan)}: pass a plan_free() of this "
                                "allocator; nothing changed.")
        if plan.version != self._version:
            raise ArgumentError("apply_free() got a plan made before this allocator last "
                                "changed; plan the free again; nothing changed.")
        return self._drop_holders(plan.pages, plan.remaining)

    def free_distinct(self, pages: npt.NDArray[np.integer]) -> PageIds:
        """:meth:`free` for pages (int32 or intp) listed at most once each (no duplicate check).

        Validated before anything changes, like :meth:`free`, and returns the same pages in
        the same (ascending) order.
        """
        if pages.size == 0:
            return np.empty(0, dtype=np.int32)
        uniq, held = self._sorted_live(pages)
        held -= 1
        return self._drop_holders(uniq, held)

    def _sorted_live(self, pages: npt.NDArray[np.integer]
                     ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int32]]:
        """``pages`` (non-empty) sorted as intp, and their holders; raises InvalidFreeError,
        changing nothing, if one is out of range or free."""
        uniq = pages.astype(np.intp)
        uniq.sort()
        if uniq[0] < 0 or uniq[-1] >= self.num_pages:
            self._require_live(uniq, "free")  # raises: out of range
        held = self._refcounts[uniq]
        if np.count_nonzero(held) != held.size:
            self._require_live(uniq, "free")  # raises: a free page
        return uniq, held

    def _drop_holders(self, uniq: npt.NDArray[np.intp], remaining: npt.NDArray[np.int32]
                      ) -> PageIds:
        """Set distinct, ascending pages' holders to ``remaining``; free those left with
        none (returned, int32, ascending)."""
        self._version += 1
        self._refcounts[uniq] = remaining
        released = uniq[remaining == 0] if np.count_nonzero(remaining) else uniq
        self._tags[released] = 0
        out = released.astype(np.int32)
        self._free_stack[self._num_free : self._num_free + out.size] = out
        self._num_free += out.size
        self._num_frees += out.size
        self.changes.append(out)
        return out

    def pop_changed_pages(self) -> PageIds:
        """Pages whose tag changed since the previous call (or since the allocator was made):
        ``[k]``, int32, ascending. Every page when too many changes went unread.

        This call has a cursor of its own in :attr:`changes`: it hides nothing from any other
        reader (a device mirror, the manager's verifier), and they hide nothing from it.
        """
        got = self._popped.read_pages()
        return np.arange(self.num_pages, dtype=np.int32) if got is None else got

    # -- validation ---------------------------------------------------------------------------

    def _require_live(self, pages: npt.NDArray[np.integer], action: str) -> None:
        out_of_range = (pages < 0) | (pages >= self.num_pages)
        if np.count_nonzero(out_of_range):
            raise InvalidFreeError(
                f"{action}() got page ids {pages[out_of_range].tolist()[:16]} outside "
                f"0..{self.num_pages - 1}; nothing changed. Pass ids returned by allocate()."
            )
        free = self._refcounts[pages] == 0
        if np.count_nonzero(free):
            raise InvalidFreeError(
                f"{action}() got pages {np.unique(pages[free]).tolist()[:16]} that are free "
                "(no holder); nothing changed. A page may only be shared or freed while it is "
                "allocated: this is a double free or a use after free."
            )

    def check(self) -> None:
        """Verify the allocator's own invariants; raise IntegrityError listing every offender.

        Conservation (free + used == total), no page twice in the free stack, free pages have
        refcount 0 and tag 0, live pages have refcount > 0 and tag > 0.
        """
        problems: list[str] = []
        free_ids = self._free_stack[: self._num_free]
        bad_ids = free_ids[(free_ids < 0) | (free_ids >= self.num_pages)]
        if bad_ids.size:
            problems.append(f"free stack holds out-of-range ids {bad_ids.tolist()[:16]}")
            free_ids = free_ids[(free_ids >= 0) & (free_ids < self.num_pages)]
        in_free = np.bincount(free_ids, minlength=self.num_pages)
        dup = np.flatnonzero(in_free > 1)
        if dup.size:
            problems.append(f"pages {dup.tolist()[:16]} appear more than once in the free stack")
        is_free = in_free > 0
        num_live = int(np.count_nonzero(self._refcounts > 0))
        if int(np.count_nonzero(is_free)) + num_live != self.num_pages:
            lost = np.flatnonzero(~is_free & (self._refcounts == 0))
            problems.append(
                f"conservation broken: {int(is_free.sum())} free + {num_live} live != "
                f"{self.num_pages} total; pages neither free nor held: {lost.tolist()[:16]}"
            )
        free_held = np.flatnonzero(is_free & (self._refcounts != 0))
        if free_held.size:
            problems.append(f"free pages {free_held.tolist()[:16]} have refcount != 0")
        free_tagged = np.flatnonzero(is_free & (self._tags != 0))
        if free_tagged.size:
            problems.append(f"free pages {free_tagged.tolist()[:16]} have tag != 0")
        live_untagged = np.flatnonzero(~is_free & (self._tags <= 0))
        if live_untagged.size:
            problems.append(f"live pages {live_untagged.tolist()[:16]} have tag <= 0")
        negative = np.flatnonzero(self._refcounts < 0)
        if negative.size:
            problems.append(f"pages {negative.tolist()[:16]} have negative refcounts")
        if problems:
            raise IntegrityError("PageAllocator.check() failed: " + "; ".join(problems))
