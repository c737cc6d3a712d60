"""GroupAllocator: the pages of every KV cache group, paid from one byte budget, unpadded.

::

    ByteArena    |chunk 0      |chunk 1      |chunk 2      |chunk 3      |
    owners        full          state         full          (arena)
    carved        [p0 p1 p2 p3] [s0 ...... ]  [p4 p5 p6 p7]
                  group 'full': pages of page_size * bytes_per_token bytes, 4 to a chunk
                  group 'state': one state per page, 1 to a chunk (the rest of the chunk unused)

Each group has its own :class:`~kvmem.allocator.PageAllocator` whose page ids cover the
whole budget in that group's page size: page ``p`` of group ``g`` lies in chunk
``p // pages_per_chunk[g]``, at byte ``chunk * chunk_bytes + (p % pages_per_chunk[g]) *
page_bytes[g]`` of the budget. Pages of chunks the group does not hold are held by the arena
(one holder each), so the group's allocator hands out only pages of its own chunks, and a page
that comes back from the arena starts a new lifetime: its tag changes whenever it is reused,
in the same group or after its chunk served another group. Tags are unique within a group;
``(group, page, tag)`` names one lifetime across groups.

What the unpadded layout costs (all of it visible in :meth:`GroupAllocator.stats`):

- carving: a chunk holds ``chunk_bytes // page_bytes`` pages; the rest, less than one page's
  bytes, is unused while the chunk serves that group (``carve_bytes``);
- the budget past the last whole chunk, less than one chunk (``unused_bytes``);
- free pages in a group's chunks serve only that group until the chunk empties
  (``stranded_bytes``); a group asks the arena for a chunk only when its own free pages are
  used up, and a chunk returns to the arena once all its pages are free (at the next
  allocate: one that refills it for the same group skips the round trip; every query counts
  it as the arena's from the free on).

Chunks a few times the largest page keep the first two small; the third is what makes a
chunk larger than it must be a cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvmem._validate import INT32_MAX, integer, show
from kvmem.allocator._arena import ByteArena
from kvmem.allocator._groups import GroupSpec, check_groups
from kvmem.allocator._page_allocator import PageAllocator, as_page_ids
from kvmem.errors import (
    ArgumentError,
    ArgumentTypeError,
    ConfigError,
    IntegrityError,
    InvalidFreeError,
    OutOfPagesError,
)

__all__ = ["GroupAllocator", "GroupFit", "GroupStats", "GroupUsage"]

PageIds = npt.NDArray[np.int32]
DEFAULT_PAGES_PER_CHUNK = 4  # default chunk: this many of the largest group's pages


@dataclass(frozen=True, slots=True)
class GroupFit:
    """Whether pages asked of several groups fit, in pages, chunks and bytes (a snapshot).

    Per group, in the allocator's group order: ``num_pages`` asked, ``num_free_pages`` free in
    the chunks it holds, ``num_chunks`` it must borrow for the rest.
    """

    fits: bool
    num_pages: tuple[int, ...]
    num_free_pages: tuple[int, ...]
    num_chunks: tuple[int, ...]
    num_free_chunks: int  # in the arena
    page_bytes: int  # true bytes of the pages asked, every group together
    chunk_bytes: int  # bytes of the chunks to borrow

    @property
    def num_chunks_short(self) -> int:
        """Chunks missing for the request to fit (0 when it fits)."""
        return max(0, sum(self.num_chunks) - self.num_free_chunks)


@dataclass(frozen=True, slots=True)
class GroupUsage:
    """One group's share of the budget (a snapshot)."""

    name: str
    page_bytes: int
    pages_per_chunk: int
    num_chunks: int  # chunks it holds
    num_used_pages: int  # pages requests hold
    num_free_pages: int  # free pages in its chunks (stranded: no other group can use them)

    @property
    def used_bytes(self) -> int:
        return self.num_used_pages * self.page_bytes

    @property
    def stranded_bytes(self) -> int:
        return self.num_free_pages * self.page_bytes


@dataclass(frozen=True, slots=True)
class GroupStats:
    """The byte budget and every group's share of it (a snapshot)."""

    budget_bytes: int
    chunk_bytes: int
    num_chunks: int
    num_free_chunks: int
    unused_bytes: int  # past the last whole chunk
    groups: tuple[GroupUsage, ...]

    @property
    def used_bytes(self) -> int:
        """Bytes of pages requests hold, every group together (true bytes, no padding)."""
        return sum(g.used_bytes for g in self.groups)

    @property
    def carve_bytes(self) -> int:
        """Bytes lost carving held chunks into pages (< one page's bytes per chunk)."""
        return sum(g.num_chunks * (self.chunk_bytes % g.page_bytes) for g in self.groups)

    @property
    def stranded_bytes(self) -> int:
        return sum(g.stranded_bytes for g in self.groups)

    @property
    def free_bytes(self) -> int:
        """Bytes of the chunks in the arena."""
        return self.num_free_chunks * self.chunk_bytes


class GroupAllocator:
    """Pages of each KV cache group in ``groups``, carved from chunks of one byte budget.

    Parameters
    ----------
    groups:
        The group specs (:func:`~kvmem.allocator.check_groups`); a group is named by its spec's
        ``name`` in every call.
    budget_bytes:
        Bytes every group together may use.
    chunk_bytes:
        The arena's unit; at least the largest group's page. Default: four of the largest
        group's pages.

    Every call that takes pages takes ``{group name: page ids}`` (a group left out: none),
    validates all of it first, and changes nothing when it raises.
    """

    def __init__(self, groups: Sequence[GroupSpec], budget_bytes: int,
                 chunk_bytes: int | None = None) -> None:
        self.groups = check_groups(groups)
        self.names = tuple(spec.name for spec in self.groups)
        self._index = {name: i for i, name in enumerate(self.names)}
        self.page_bytes = tuple(spec.page_bytes for spec in self.groups)
        largest = max(self.page_bytes)
        if chunk_bytes is None:
            chunk_bytes = DEFAULT_PAGES_PER_CHUNK * largest
        chunk_bytes = integer(chunk_bytes, "chunk_bytes", minimum=1)
        if chunk_bytes < largest:
            name = self.names[self.page_bytes.index(largest)]
            raise ConfigError(f"chunk_bytes={chunk_bytes} is smaller than group {name!r}'s "
                              f"page of {largest} bytes: a chunk must hold at least one page "
                              "of every group.")
        self.arena = ByteArena(budget_bytes, chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.pages_per_chunk = tuple(chunk_bytes // b for b in self.page_bytes)
        for name, ppc in zip(self.names, self.pages_per_chunk):
            if self.arena.num_chunks * ppc > INT32_MAX:
                raise ConfigError(f"group {name!r} would number {self.arena.num_chunks * ppc} "
                                  f"pages over the budget, more than int32 page ids hold: "
                                  "give it larger pages or a smaller budget.")
        self._allocators = tuple(PageAllocator(self.arena.num_chunks * ppc)
                                 for ppc in self.pages_per_chunk)
        for alloc in self._allocators:
            alloc.allocate(alloc.num_pages)  # the arena holds every page of every chunk
        # Pages requests hold in each chunk, per group (0 for chunks the group does not hold).
        self._used = tuple(np.zeros(self.arena.num_chunks, dtype=np.int64) for _ in self.groups)
        # Chunks emptied by a free that each group still holds until its next allocate (which
        # refills them or returns them): counted as the arena's everywhere (fit, stats), so a
        # window's pages freed at one step and taken at the next cost no chunk round trip.
        self._emptied = [np.empty(0, dtype=np.int32) for _ in self.groups]

    # -- queries ---------------------------------------------------------------------------

    def allocator(self, group: str) -> PageAllocator:
        """The group's PageAllocator: its ``tags`` and ``refcounts`` (read-only views) and
        change log. Change its pages only through this object."""
        return self._allocators[self._group(group)]

    def tags(self, group: str) -> npt.NDArray[np.int64]:
        """``[num_pages]``, int64: the lifetime tag of each of the group's pages."""
        return self.allocator(group).tags

    def fit(self, needs: Mapping[str, int],
            freeing: Mapping[str, npt.NDArray[np.integer]] | None = None) -> GroupFit:
        """Whether ``{group: num_pages}`` fits at once, and what it costs, in pages, chunks
        and bytes. A group uses the free pages of its own chunks first, then borrows chunks.

        ``freeing``: ``{group: page ids}`` whose holders would be dropped first (a page listed
        ``k`` times loses ``k``; e.g. a prefix cache's references): the answer is then the one
        :meth:`free` of them followed by this fit would give. Changes nothing."""
        wanted = self._counts(needs)
        free = [a.num_free - e.size * ppc
                for a, e, ppc in zip(self._allocators, self._emptied, self.pages_per_chunk)]
        arena_free = self.arena.num_free + sum(e.size for e in self._emptied)
        for name, listed in (freeing or {}).items():
            g = self._group(name)
            ids = as_page_ids(listed)
            if ids.size == 0:
                continue
            uniq, counts = np.unique(ids, return_counts=True)
            gone = uniq[self._allocators[g].refcounts[uniq] <= counts]
            free[g] += gone.size
            used = self._used[g]
            per_chunk = np.bincount(gone // self.pages_per_chunk[g], minlength=used.size)
            emptied = int(np.count_nonzero((used > 0) & (used == per_chunk)))
            free[g] -= emptied * self.pages_per_chunk[g]  # (an emptied chunk goes back whole)
            arena_free += emptied
        chunks = tuple(-(-max(0, n - f) // ppc)
                       for n, f, ppc in zip(wanted, free, self.pages_per_chunk))
        return GroupFit(
            fits=sum(chunks) <= arena_free,
            num_pages=wanted,
            num_free_pages=tuple(free),
            num_chunks=chunks,
            num_free_chunks=arena_free,
            page_bytes=sum(n * b for n, b in zip(wanted, self.page_bytes)),
            chunk_bytes=sum(chunks) * self.chunk_bytes,
        )

    def can_allocate(self, needs: Mapping[str, int]) -> bool:
        """Whether :meth:`allocate` of ``{group: num_pages}`` would succeed."""
        return self.fit(needs).fits

    def byte_offsets(self, group: str, pages: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """``[k]``, int64: where each of the group's pages starts in the budget, in bytes."""
        g = self._group(group)
        ids = self._ids(g, pages, "byte_offsets").astype(np.int64)
        ppc = self.pages_per_chunk[g]
        out: npt.NDArray[np.int64] = (ids // ppc) * self.chunk_bytes + (ids % ppc) * \
            self.page_bytes[g]
        return out

    def stats(self) -> GroupStats:
        owners = self.arena.owners
        return GroupStats(
            budget_bytes=self.arena.budget_bytes,
            chunk_bytes=self.chunk_bytes,
            num_chunks=self.arena.num_chunks,
            num_free_chunks=self.arena.num_free + sum(e.size for e in self._emptied),
            unused_bytes=self.arena.unused_bytes,
            groups=tuple(
                GroupUsage(name=name, page_bytes=self.page_bytes[g],
                           pages_per_chunk=self.pages_per_chunk[g],
                           num_chunks=int(np.count_nonzero(owners == g)) - self._emptied[g].size,
                           num_used_pages=int(self._used[g].sum()),
                           num_free_pages=self._allocators[g].num_free
                           - self._emptied[g].size * self.pages_per_chunk[g])
                for g, name in enumerate(self.names)),
        )

    # -- mutations ---------------------------------------------------------------------------

    def allocate(self, needs: Mapping[str, int]) -> dict[str, PageIds]:
        """Take ``{group: num_pages}`` pages, each with one holder and a fresh tag, in every
        group at once or in none.

        Returns ``{group: [num_pages] int32}`` for every group named. Raises OutOfPagesError
        (in chunks of the arena; nothing changed) when the groups together do not fit.
        """
        plan = self.fit(needs)
        if not plan.fits:
            short = ", ".join(f"{name!r} {c}" for name, c in zip(self.names, plan.num_chunks) if c)
            raise OutOfPagesError(sum(plan.num_chunks), plan.num_free_chunks,
                                  f"Chunks per group: {short}. Free pages in any group first, "
                                  "or check can_allocate() before allocating.", unit="chunks")
        # A group refills the chunks it emptied (as many as it would borrow); the rest go back.
        kept = [min(e.size, plan.num_chunks[g]) if self.names[g] in needs else 0
                for g, e in enumerate(self._emptied)]
        for g, e in enumerate(self._emptied):
            if e.size > kept[g]:
                self._return(g, e[kept[g] :])
            self._emptied[g] = e[: kept[g]]
        out = {}
        for g, name in enumerate(self.names):
            if name not in needs:
                continue
            alloc, num = self._allocators[g], plan.num_pages[g]
            mine = alloc.allocate(min(num, plan.num_free_pages[g]
                                      + kept[g] * self.pages_per_chunk[g]))  # its own first
            if plan.num_chunks[g] > kept[g]:
                chunks = self.arena.lend(g, plan.num_chunks[g] - kept[g])
                alloc.free(self._pages_of(g, chunks))  # the arena lets go of them
                mine = np.concatenate([mine, alloc.allocate(num - mine.size)])
            np.add.at(self._used[g], mine // self.pages_per_chunk[g], 1)
            self._emptied[g] = self._emptied[g][:0]  # (refilled: fewer than a chunk is free)
            out[name] = mine
        return out

    def share(self, pages: Mapping[str, npt.ArrayLike]) -> None:
        """Add one holder to each listed page (a page listed twice gains two)."""
        checked = self._checked(pages, "share")
        for g, ids in checked.items():
            self._allocators[g].share(ids)

    def free(self, pages: Mapping[str, npt.ArrayLike]) -> dict[str, PageIds]:
        """Remove one holder from each listed page, in every group or, if any group's list is
        bad, in none (InvalidFreeError names it). Chunks left with no held page return to
        the arena.

        Returns ``{group: released}``: the pages that lost their last holder, ascending.
        """
        if not isinstance(pages, Mapping):
            raise ArgumentTypeError(f"pages={show(pages)}: expected a dict of group name -> "
                                    "page ids.")
        plans = {}
        for name, listed in pages.items():
            g = self._group(name)
            try:  # (in range, held, listed no more times than held)
                plan = self._allocators[g].plan_free(as_page_ids(listed, f"pages[{name!r}]"))
            except InvalidFreeError as e:
                raise InvalidFreeError(f"group {name!r}: {e}") from None
            if plan.pages.size:
                self._require_own(g, plan.pages, "free")
                plans[g] = plan
        out = {}
        for g, plan in plans.items():
            released = self._allocators[g].apply_free(plan)
            if released.size:
                touched = released // self.pages_per_chunk[g]
                used = self._used[g]
                np.subtract.at(used, touched, 1)
                empty = touched[used[touched] == 0]  # (ascending, a chunk once per page)
                if empty.size:  # (back to the arena at the group's next allocate)
                    first = np.ones(empty.size, dtype=bool)
                    np.not_equal(empty[1:], empty[:-1], out=first[1:])
                    self._emptied[g] = np.concatenate([self._emptied[g], empty[first]])
            out[self.names[g]] = released
        return out

    # -- validation ---------------------------------------------------------------------------

    def _group(self, name: object) -> int:
        if not isinstance(name, str):
            raise ArgumentTypeError(f"group={show(name)}: expected a group name, one of "
                                    f"{list(self.names)}.")
        g = self._index.get(name)
        if g is None:
            raise ArgumentError(f"group={name!r}: no such group; the groups are "
                                f"{list(self.names)}.")
        return g

    def _counts(self, needs: Mapping[str, int]) -> tuple[int, ...]:
        if not isinstance(needs, Mapping):
            raise ArgumentTypeError(f"needs={show(needs)}: expected a dict of group name -> "
                                    "number of pages.")
        wanted = [0] * len(self.names)
        for name, num in needs.items():
            wanted[self._group(name)] = integer(num, f"needs[{name!r}]", minimum=0,
                                                maximum=INT32_MAX)
        return tuple(wanted)

    def _pages_of(self, g: int, chunks: npt.NDArray[np.integer]) -> PageIds:
        """Every page id of group ``g`` in ``chunks``, chunk by chunk, ascending within each."""
        ppc = self.pages_per_chunk[g]
        pages = (chunks.astype(np.int64)[:, None] * ppc + np.arange(ppc)).ravel()
        return pages.astype(np.int32)

    def _ids(self, g: int, pages: npt.ArrayLike, action: str) -> PageIds:
        ids = as_page_ids(pages, f"pages[{self.names[g]!r}]")
        num = self._allocators[g].num_pages
        bad = ids[(ids < 0) | (ids >= num)]
        if bad.size:
            raise InvalidFreeError(f"{action}() got pages {bad.tolist()[:16]} of group "
                                   f"{self.names[g]!r} outside 0..{num - 1}; nothing changed.")
        return ids

    def _return(self, g: int, chunks: npt.NDArray[np.int32]) -> None:
        """Give group ``g``'s empty ``chunks`` back to the arena (it holds their pages again)."""
        self._allocators[g].take(self._pages_of(g, chunks))
        self.arena.give_back(g, chunks)

    def _require_own(self, g: int, ids: npt.NDArray[np.integer], action: str) -> None:
        """Raise InvalidFreeError unless every page (in range) is in a chunk group ``g``
        holds (elsewhere the arena is the one holder)."""
        outside = ids[self.arena.owners[ids // self.pages_per_chunk[g]] != g]
        if outside.size:
            raise InvalidFreeError(
                f"{action}() got pages {outside.tolist()[:16]} of group {self.names[g]!r} in "
                "chunks the group does not hold (no request holds them); nothing changed. "
                "This is a use after free.")

    def _checked(self, pages: Mapping[str, npt.ArrayLike], action: str
                 ) -> dict[int, PageIds]:
        """``{group index: ids}``, every listed page in range, in a chunk its group holds
        and held; raises InvalidFreeError, changing nothing."""
        if not isinstance(pages, Mapping):
            raise ArgumentTypeError(f"pages={show(pages)}: expected a dict of group name -> "
                                    "page ids.")
        checked = {}
        for name, listed in pages.items():
            g = self._group(name)
            ids = self._ids(g, listed, action)
            if ids.size == 0:
                continue
            self._require_own(g, ids, action)
            free = ids[self._allocators[g].refcounts[ids] == 0]
            if free.size:
                raise InvalidFreeError(
                    f"{action}() got pages {free.tolist()[:16]} of group {name!r} that are free "
                    "(no holder); nothing changed. This is a use after free.")
            checked[g] = ids
        return checked

    def check(self) -> None:
        """Verify the bookkeeping; raise IntegrityError naming every problem.

        The arena's free list holds exactly the unowned chunks; every group's allocator is
        sound; in a chunk a group does not hold, each of its pages has exactly the arena as
        holder; in a chunk it holds, the pages requests hold are the ones counted, and at
        least one unless the chunk is one it emptied and returns at its next allocate; the
        chunks held fit the budget.
        """
        problems = self.arena.check()
        for g, (name, alloc) in enumerate(zip(self.names, self._allocators)):
            try:
                alloc.check()
            except IntegrityError as e:
                problems.append(f"group {name!r}: {e}")
            held = self.arena.owners == g
            rc = alloc.refcounts.reshape(self.arena.num_chunks, self.pages_per_chunk[g])
            live = np.count_nonzero(rc > 0, axis=1)
            bad = np.flatnonzero(~held & np.any(rc != 1, axis=1))
            if bad.size:
                problems.append(f"group {name!r}: chunks {bad.tolist()[:16]} are not its own "
                                "but hold pages with other than the arena as their one holder")
            emptied = np.zeros(self.arena.num_chunks, dtype=bool)
            emptied[self._emptied[g]] = True
            bad = np.flatnonzero(held & ((live != self._used[g])
                                         | ((self._used[g] == 0) != emptied)))
            bad = np.union1d(bad, np.flatnonzero(~held & ((self._used[g] != 0) | emptied)))
            if bad.size:
                problems.append(f"group {name!r}: chunks {bad.tolist()[:16]} have held-page "
                                f"counts {self._used[g][bad].tolist()[:16]}, pages live "
                                f"{live[bad].tolist()[:16]}")
        lent = int(np.count_nonzero(self.arena.owners >= 0))
        if lent * self.chunk_bytes > self.arena.budget_bytes:
            problems.append(f"{lent} chunks lent exceed the budget")
        if problems:
            raise IntegrityError("GroupAllocator.check() failed: " + "; ".join(problems))
