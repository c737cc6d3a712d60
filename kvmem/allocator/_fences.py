"""Step fences: a page reference dropped while something may still read the page is held
until that reader is done.

An engine that overlaps host scheduling with device work launches step ``n`` and, while the
device still runs it, frees the pages of finished requests and schedules step ``n + 1``. Without
a fence, a freed page can be handed to a new request and overwritten while step ``n`` still
reads it. With one::

    h = begin()            step n launched           open = {h}
    defer(pages)           request finished          pending: (pages, waits for {h})
    retire(h)              step n done on device     -> pages returned, the caller frees them

A deferred batch waits for every step that was open when it was deferred, so steps may retire
in any order. The fence *holds* the references it defers (it does not free them), so the pages
stay live, keep their tags, and cannot be evicted or reallocated meanwhile.

A copy-on-write source is the same kind of wait: the engine copies it to its new page before
the step writes there, so it is held (``hold_for_copy``) until the copies are done
(``copies_done``, which the manager calls at the next ``reserve`` or when no request is left to
copy for); by then a step in flight may still read it, so the caller defers what comes back.
A *lease* is the third kind of wait: pages that leave the pool (a transfer to another
process reads them) are held (``hold_for_lease``) until the reader is done or the lease ends
(``end_lease``), whatever happens to the request meanwhile. One list of pending references,
one ``held`` count per page, for all three::

    waits for   step ids 1, 2, ...   copies: 0   lease n: -n

Given the allocator's tags, a fence holds a *lifetime*: a reference whose page was freed behind
everyone's back meanwhile (its tag changed; a fault, see ``kvmem.testing.faults``) is not
handed back, so it is never freed again, perhaps under the page's next holder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvmem._validate import INT32_MAX, integer, show
from kvmem.allocator._page_allocator import _ONE, as_page_ids
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError

__all__ = ["Lease", "StepFences", "StepHandle"]

Int32Array = npt.NDArray[np.int32]
_COPIES = 0  # what copy-on-write sources wait for (steps are numbered from 1)
_NO_PAGES = np.empty(0, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class StepHandle:
    """Names one launched step; give it back to ``retire`` when the device is done with it."""

    step_id: int


@dataclass(frozen=True, slots=True)
class Lease:
    """Pages held until :meth:`StepFences.end_lease`: ``pages`` ``[n]`` int32 and their
    lifetime ``tags`` ``[n]`` int64 when the lease began (read-only arrays)."""

    lease_id: int
    pages: Int32Array
    tags: npt.NDArray[np.int64]


class StepFences:
    """Open steps and the page references waiting for them.

    Parameters
    ----------
    num_pages: the pool's page count.
    tags: the allocator's lifetime tags (``[num_pages]``, int64, read-only), or None: with
        them, a reference whose page's lifetime ended behind the fence's back is not returned.

    Attributes
    ----------
    held: ``[num_pages]``, int32 — references each page has in pending batches (read-only)
    """

    def __init__(self, num_pages: int, tags: npt.NDArray[np.int64] | None = None) -> None:
        num_pages = integer(num_pages, "num_pages", minimum=1, maximum=INT32_MAX)
        self._open: set[int] = set()
        self._next_id = 1
        self._tags = tags  # the allocator's (read-only): what each held reference's lifetime is
        # (steps waited for, pages, their tags when held or None)
        self._pending: list[tuple[set[int], Int32Array, npt.NDArray[np.int64] | None]] = []
        self._num_copy_holds = 0  # pending batches that wait for copies_done
        self._next_lease = 1
        self._leases: set[int] = set()  # leases not ended
        self._held = np.zeros(num_pages, dtype=np.int32)
        self.held = self._held.view()
        self.held.flags.writeable = False

    @property
    def in_flight(self) -> bool:
        """Whether a step is open (begun and not retired)."""
        return bool(self._open)

    @property
    def open_steps(self) -> tuple[int, ...]:
        return tuple(sorted(self._open))

    @property
    def holds_any(self) -> bool:
        """Whether any reference is waiting (``held`` is all zero when not)."""
        return bool(self._pending)

    @property
    def num_held(self) -> int:
        """References held, summed over pages."""
        return sum(int(p.size) for _, p, _ in self._pending)

    def begin(self) -> StepHandle:
        handle = StepHandle(self._next_id)
        self._next_id += 1
        self._open.add(handle.step_id)
        return handle

    def defer(self, pages: npt.ArrayLike) -> None:
        """Hold these references until every step open now has retired (requires one open)."""
        if not self._open:
            raise KVMemError("defer() needs a step in flight; free the pages directly instead")
        self._hold(set(self._open), self._pages(pages))

    def hold_for_copy(self, pages: npt.ArrayLike) -> None:
        """Hold copy-on-write sources until :meth:`copies_done`."""
        pages = self._pages(pages)
        if pages.size:
            self._num_copy_holds += 1
        self._hold({_COPIES}, pages)

    def hold_for_lease(self, pages: npt.ArrayLike) -> Lease:
        """Hold these references (the caller took them) until :meth:`end_lease`."""
        ids = self._pages(pages)
        lease_id = self._next_lease
        self._next_lease += 1
        self._leases.add(lease_id)
        self._hold({-lease_id}, ids)
        tags = (np.zeros(ids.size, dtype=np.int64) if self._tags is None
                else self._tags[ids].copy())
        ids = ids.copy()
        ids.flags.writeable = tags.flags.writeable = False
        return Lease(lease_id, ids, tags)

    @property
    def leases(self) -> tuple[int, ...]:
        """Ids of the leases not ended."""
        return tuple(sorted(self._leases))

    def end_lease(self, lease: Lease) -> tuple[Int32Array, bool]:
        """End a lease: (the references to drop now, whether every page was still in the
        lifetime the lease named). A page freed behind the lease's back (a bug, a fault) is
        not handed back, and makes the answer False: its bytes may be another lifetime's."""
        if not isinstance(lease, Lease):
            raise ArgumentTypeError(f"lease={show(lease)}: expected a Lease from "
                                    "hold_for_lease(); nothing changed")
        if lease.lease_id not in self._leases:
            raise ArgumentError(f"lease {lease.lease_id} has ended already (open leases: "
                                f"{self.leases}); end each lease once")
        self._leases.discard(lease.lease_id)
        alive = self._release(-lease.lease_id)
        return alive, alive.size == lease.pages.size

    def _pages(self, pages: npt.ArrayLike) -> Int32Array:
        """Page ids in ``0 .. num_pages - 1`` (never wrapped), checked before any change."""
        ids = as_page_ids(pages)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self._held.size):
            raise ArgumentError(f"pages holds ids from {int(ids.min())} to {int(ids.max())}: "
                                f"expected page ids in 0..{self._held.size - 1}; nothing changed")
        return ids

    def _hold(self, waits: set[int], pages: Int32Array) -> None:
        if pages.size:
            tags = None if self._tags is None else self._tags[pages]
            self._pending.append((waits, pages.copy(), tags))
            np.add.at(self._held, pages, _ONE)

    def check_retire(self, handle: StepHandle) -> None:
        if not isinstance(handle, StepHandle):
            raise ArgumentTypeError(f"handle={show(handle)}: expected a StepHandle returned by "
                                    "begin_step(); nothing changed")
        if handle.step_id not in self._open:
            raise ArgumentError(
                f"retire() got {handle!r}, which is not an open step (open: "
                f"{self.open_steps}); each handle from begin_step() is retired exactly once"
            )

    def retire(self, handle: StepHandle) -> Int32Array:
        """Close a step; returns the references no open step waits for any more (to free)."""
        self.check_retire(handle)
        self._open.discard(handle.step_id)
        return self._release(handle.step_id)

    def copies_done(self) -> Int32Array:
        """The engine has made every copy-on-write copy handed out so far: returns the sources
        held for them (references to drop: defer them if a step is in flight)."""
        self._num_copy_holds = 0
        return self._release(_COPIES)

    @property
    def copies_pending(self) -> bool:
        """Whether copy-on-write sources are held for copies not made yet."""
        return self._num_copy_holds > 0

    def _release(self, step_id: int) -> Int32Array:
        """The references no open step waits for any more, less those whose lifetime ended
        behind the fence's back."""
        done: list[Int32Array] = []
        alive: list[Int32Array] = []
        keep: list[tuple[set[int], Int32Array, npt.NDArray[np.int64] | None]] = []
        for waits, pages, tags in self._pending:
            waits.discard(step_id)
            if waits:
                keep.append((waits, pages, tags))
            else:
                done.append(pages)
                if self._tags is None or tags is None:
                    alive.append(pages)
                else:
                    alive.append(pages[self._tags[pages] == tags])
        self._pending = keep
        if not done:
            return _NO_PAGES
        out = np.concatenate(done)
        np.subtract.at(self._held, out, _ONE)
        return np.concatenate(alive) if len(alive) > 1 else alive[0]
