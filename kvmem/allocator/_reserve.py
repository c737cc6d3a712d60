"""Reserve: a batch's next token slots, the pages they need, and the step's kernel metadata.

Every request of a batch gains ``n`` token slots (a prefill chunk, one decode token, ``k``
speculative tokens). A row allocates a page only where it grows past the pages it maps; a row
about to write into a partly filled page it shares with a fork first gets a copy of it
(copy-on-write)::

    before   | p0 | p1 (9/16, shared with a fork) |
    after    | p0 | p1' (copy, 9/16) | p2 |      reserve(ids, 20): p1 copied, p2 allocated

All or nothing: everything that can fail (a request too long, too few pages) is checked
before the first change. Four paths, one result: :meth:`Reserver.reserve_small` is the decode
step's (every row gains ``k <= page_size`` tokens, no fork to copy: a constant number of numpy
calls), :meth:`Reserver.reserve_one` one request's prefill chunk (Python ints and slices of its
row: numpy's fixed cost per call is what one request pays), :meth:`Reserver.reserve_mixed` a
decode step that a few requests join (the decode rows vectorized, each joining row as one
slice), :meth:`Reserver.reserve_any` the general one. ``Reserver.per_request = False`` sends
the second and third to the general path (a differential test compares them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import integer, integers
from kvmem.allocator._forks import Forks
from kvmem.allocator._page_table import PageTable
from kvmem.allocator._pages import Pages
from kvmem.allocator._step_metadata import StepBuilder, StepMetadata, StepRecord
from kvmem.errors import ArgumentError
from kvmem.integrity import DecodeSlots, Recorder, qualify_live

__all__ = ["Reserver"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]
_EMPTY_PAGES = np.empty(0, dtype=np.int32)
_EMPTY_PAGES.flags.writeable = False
# The most rows of a batch, past a leading run of decode rows, that reserve_mixed takes one by
# one (a step that a few requests join); more take reserve_any.
MIXED_TAIL = 8


class Reserver:
    """Reserves token slots for batches of page-table rows.

    Parameters
    ----------
    table, pages, steps, forks: the manager's page table, page references, step builder and
        forks (the copy-on-write copies they promised).
    recorder: records the qualified tag of every page a row gains in the tracker.
    copy_pages: ``fn(src, dst)`` that copies pages now (a pool's ``copy_pages``), or None:
        the step lists the copies (``copy_src``/``copy_dst``) for the engine to make.
    on_allocate: ``fn(pages)`` after pages were allocated.
    """

    def __init__(self, table: PageTable, pages: Pages, steps: StepBuilder, forks: Forks,
                 recorder: Recorder, copy_pages: Callable[[Int32Array, Int32Array], None] | None,
                 on_allocate: Callable[[Int32Array], None]) -> None:
        self.table = table
        self.pages = pages
        self.steps = steps
        self.forks = forks
        self.recorder = recorder
        self.copy_pages = copy_pages
        self.on_allocate = on_allocate
        self.num_cow_copies = 0
        self.per_request = True  # reserve_one / reserve_mixed where they fit (False: reserve_any)
        self._arange = np.arange(max(table.max_pages_per_seq, table.max_seqs, table.page_size) + 1,
                                 dtype=np.int64)

    # -- checks -------------------------------------------------------------------------------

    def pages_needed(self, rows: IntpArray, n: Int64Array | int) -> int:
        """Pages ``reserve(rows, n)`` would allocate (new pages and copies), or -1 if a row
        would exceed ``max_pages_per_seq``."""
        t = self.table
        mapped = t.num_pages[rows]
        need = np.maximum((t.num_tokens[rows] + n + t.page_size - 1) // t.page_size - mapped, 0)
        if np.count_nonzero(mapped + need > t.max_pages_per_seq):
            return -1
        cow = self.forks.candidates(rows, n, self.pages)
        return int(need.sum()) + (0 if cow is None else cow[0].size)

    def can_reserve(self, rows: IntpArray, n: Int64Array | int) -> bool:
        """Whether ``reserve(rows, n)`` would find its pages (copies use promised ones)."""
        need = self.pages_needed(rows, n)
        cow = self.forks.candidates(rows, n, self.pages)
        return 0 <= need <= self.pages.available() + (0 if cow is None else cow[0].size)

    def _too_long(self, ids: tuple[Any, ...], where: npt.NDArray[np.integer]) -> None:
        raise ArgumentError(
            f"requests {[ids[i] for i in where[:8].tolist()]} would need more than "
            f"max_pages_per_seq={self.table.max_pages_per_seq} pages; finish them or raise the "
            "limit (nothing was reserved)"
        )

    # -- recording ----------------------------------------------------------------------------

    def expected(self, pages: npt.NDArray[np.integer], namespace_ids: Int64Array | int
                 ) -> Int64Array:
        """The qualified tags a request records for live pages it maps: ``[k]``, int64."""
        return qualify_live(self.pages.allocator.tags[pages], namespace_ids)

    def _record_new(self, rows: IntpArray, cols: Int64Array, flat_at: Int64Array,
                    pages: npt.NDArray[np.integer], ns: Int64Array | int) -> None:
        """Record pages rows gained past the ones they had."""
        if self.recorder.enabled:
            self.recorder.append(rows, cols, flat_at, self.expected(pages, ns))

    # -- the step -----------------------------------------------------------------------------

    def reserve(self, ids: tuple[Any, ...], rows: IntpArray, n: Int64Array | int
                ) -> StepMetadata:
        """Give every row ``n`` more token slots (checked counts) and return the step's
        metadata: the decode step's path when it can (one count of at most a page, no fork
        to copy, no copy pending), else the general one. All or nothing."""
        if not self.table.num_forked and not self.pages.fences.copies_pending:
            if isinstance(n, int) and n <= self.table.page_size:
                return self.reserve_small(ids, rows, n)
            if rows.size == 1 and self.per_request:
                return self.reserve_one(ids, rows, n)
            if self.per_request and not isinstance(n, int) and rows.size > 1:
                head = self._decode_head(n)
                if head:
                    return self.reserve_mixed(ids, rows, n, head)
        return self.reserve_any(ids, rows, n)

    def _decode_head(self, n: Int64Array) -> int:
        """The rows of a decode step that a few requests join: how many leading rows gain one
        count of at most a page when at most ``MIXED_TAIL`` rows follow them, else 0."""
        k = int(n[0])
        if k > self.table.page_size:
            return 0
        other = (n != k).nonzero()[0]
        if other.size > MIXED_TAIL or (other.size and other.size != n.size - int(other[0])):
            return 0  # (more rows join, or rows of the head's count follow them)
        return n.size - other.size

    # -- the decode step ----------------------------------------------------------------------

    def reserve_small(self, ids: tuple[Any, ...], rows: IntpArray, k: int) -> StepMetadata:
        """Every row gains ``k <= page_size`` tokens (decode, short speculation), so at most one
        page, and no row writes into a page a fork shares: a constant number of numpy calls."""
        t = self.table
        P = t.page_size
        rows_w, rows32 = self.steps.row_arrays(rows)
        start = t.num_tokens[rows]
        end = start + k
        cap = t.num_pages[rows]
        grow = (end > cap * P).nonzero()[0]
        if grow.size:
            cols = cap[grow]
            if np.maximum.reduce(cols) >= t.max_pages_per_seq:
                self._too_long(ids, grow[cols >= t.max_pages_per_seq])
            self.pages.require(grow.size)
            new = self.pages.allocate(grow.size, t.namespace_ids[rows[grow]])
            at = rows_w[grow] + cols  # (row, column) of each new page, flat
            grow_rows = rows[grow]
            t.append_pages(grow_rows, at, cols, new)
            self._record_new(grow_rows, cols, at, new.astype(np.intp), t.namespace_ids[grow_rows])
            self.on_allocate(new)
        t.advance(rows, start, end)
        if k != 1:
            positions = (start[:, None] + self._arange[:k]).reshape(-1)
            slots = t._slots(np.repeat(rows, k), positions)
            return self._finish(ids, rows, rows_w, rows32, start, end, k, slots, None)
        col = start // P
        offset = start - col * P
        token_pages = t.pages.reshape(-1)[rows_w + col]
        slots = np.multiply(token_pages, P, dtype=np.int64)
        slots += offset
        return self._finish(ids, rows, rows_w, rows32, start, end, 1, slots, None,
                            DecodeSlots(token_pages, offset, col), col + 1,
                            np.add(offset, 1, dtype=np.int32))

    # -- one request's chunk ------------------------------------------------------------------

    def reserve_one(self, ids: tuple[Any, ...], rows: IntpArray, n: Int64Array | int
                    ) -> StepMetadata:
        """:meth:`reserve_any` of one row (``rows`` ``[1]``) and no fork to copy: the same
        checks, state and metadata, in Python ints and slices of the row."""
        t = self.table
        P = t.page_size
        row = int(rows[0])
        count = n if isinstance(n, int) else int(n[0])
        mapped = int(t.num_pages[row])
        start = int(t.num_tokens[row])
        end = start + count
        used = -(-end // P)  # pages holding the row's tokens after this step
        need = max(used - mapped, 0)
        if mapped + need > t.max_pages_per_seq:
            self._too_long(ids, np.zeros(1, dtype=np.intp))
        self.pages.require(need)
        # Nothing can fail from here on.
        if need:
            ns = int(t.namespace_ids[row])
            new = self.pages.allocate(need, ns)
            t.append_run(row, new)
            if self.recorder.enabled:
                cols = np.arange(mapped, mapped + need, dtype=np.int64)
                self._record_new(np.full(need, row, dtype=np.intp), cols,
                                 cols + row * t.max_pages_per_seq, new, ns)
            self.on_allocate(new)
        slots = t.row_slots(row, start, count)
        t.advance(row, start, end)
        rows_w, rows32 = self.steps.row_arrays(rows)
        return self._finish(ids, rows, rows_w, rows32, np.array([start], dtype=np.int64),
                            np.array([end], dtype=np.int64), n if isinstance(n, int) else -1,
                            slots, None, counts=np.array([used], dtype=np.int64),
                            last_len=np.array([(end - 1) % P + 1], dtype=np.int32))

    # -- a decode step that requests join ---------------------------------------------------

    def reserve_mixed(self, ids: tuple[Any, ...], rows: IntpArray, n: Int64Array, head: int
                      ) -> StepMetadata:
        """:meth:`reserve_any` of a decode step that a few requests join (``n`` ``[B]``: the
        leading ``head`` rows gain one count of at most a page, the rest, at most
        ``MIXED_TAIL``, any count; no fork to copy): the head's slots in a few vectorized
        calls, each joining row's as one slice of its row (as :meth:`reserve_one`), the pages
        allocated in one call in row order. The same checks, state and metadata."""
        t = self.table
        P = t.page_size
        rows_w, rows32 = self.steps.row_arrays(rows)
        mapped = t.num_pages[rows]
        start = t.num_tokens[rows]
        end = start + n
        need = np.maximum((end + (P - 1)) // P - mapped, 0)
        too_long = mapped + need > t.max_pages_per_seq
        if np.count_nonzero(too_long):
            self._too_long(ids, np.flatnonzero(too_long))
        total = int(need.sum())
        self.pages.require(total)
        # Nothing can fail from here on.
        if total:
            grow = need.nonzero()[0]
            grow_rows = rows[grow]
            ns = t.namespace_ids[grow_rows]
            if grow.size == total:  # one page each (the decode rows' growth)
                new = self.pages.allocate(total, ns)
                cols = mapped[grow]
                at = rows_w[grow] + cols
                t.append_pages(grow_rows, at, cols, new)
            else:  # a joining row's run: rows and columns of every new page, in row order
                counts = need[grow]
                new = self.pages.allocate(total, np.repeat(ns, counts))
                grow_rows = np.repeat(grow_rows, counts)
                firsts = np.cumsum(counts) - counts
                cols = np.repeat(mapped[grow] - firsts, counts) + np.arange(total)
                at = grow_rows * t.max_pages_per_seq + cols
                t.append_runs(rows[grow], counts, at, new)
            self._record_new(grow_rows, cols, at, new, t.namespace_ids[grow_rows])
            self.on_allocate(new)
        k = int(n[0])
        if k == 1:
            hs = start[:head]
            col = hs // P
            head_slots = np.multiply(t.pages.reshape(-1)[rows_w[:head] + col], P,
                                     dtype=np.int64)
            head_slots += hs - col * P
        else:
            positions = (start[:head, None] + self._arange[:k]).reshape(-1)
            head_slots = t._slots(np.repeat(rows[:head], k), positions)
        tail = [t.row_slots(r, s, c) for r, s, c in zip(
            rows[head:].tolist(), start[head:].tolist(), n[head:].tolist())]
        slots = np.concatenate([head_slots, *tail]) if tail else head_slots
        t.advance(rows, start, end)
        return self._finish(ids, rows, rows_w, rows32, start, end, -1, slots,
                            (_EMPTY_PAGES, _EMPTY_PAGES))

    # -- the general step ---------------------------------------------------------------------

    def reserve_any(self, ids: tuple[Any, ...], rows: IntpArray, n: Int64Array | int
                    ) -> StepMetadata:
        """Per-row counts, long chunks, copy-on-write of forked tails."""
        t = self.table
        P = t.page_size
        mapped = t.num_pages[rows]
        start = t.num_tokens[rows]
        need = np.maximum((start + (n + P - 1)) // P - mapped, 0)
        too_long = mapped + need > t.max_pages_per_seq
        if np.count_nonzero(too_long):
            self._too_long(ids, np.flatnonzero(too_long))
        cow = self.forks.candidates(rows, n, self.pages)
        copies = 0 if cow is None else cow[0].size  # (pages a fork promised them)
        self.pages.require(int(need.sum()) + copies, keeping=copies)
        # Nothing can fail from here on.
        if self.pages.fences.copies_pending:  # the engine made last step's copies by now
            self.pages.copies_done()
        pairs = (_EMPTY_PAGES, _EMPTY_PAGES) if cow is None else self._copy_on_write(*cow)
        if t.num_forked:  # every write into a shared tail was just handled
            t.set_forked(rows if isinstance(n, int) else rows[n > 0], False)
        if need.any():
            grown = t.grow(rows, n, _Labelled(self.pages, np.repeat(t.namespace_ids[rows], need)))
            new_rows, cols = grown.new_page_rows, grown.new_page_positions.astype(np.int64)
            self._record_new(new_rows, cols, new_rows * t.max_pages_per_seq + cols,
                             grown.new_pages, t.namespace_ids[new_rows])
            self.on_allocate(grown.new_pages)
            slots = grown.slot_mapping
        else:  # the rows map the pages already (an admitted prompt's prefill chunks)
            slots = t._token_slots(rows, start, n)
        t.advance(rows, start, start + n)
        rows_w, rows32 = self.steps.row_arrays(rows)
        k = n if isinstance(n, int) else -1
        return self._finish(ids, rows, rows_w, rows32, start, start + n, k, slots, pairs)

    def _copy_on_write(self, rows: IntpArray, cols: Int64Array, old: Int32Array
                       ) -> tuple[Int32Array, Int32Array]:
        """Give each row a copy of its shared tail; (copy_src, copy_dst) for the engine, empty
        when a pool copied them now."""
        t = self.table
        new = self.pages.copy_for_write(old)
        t.replace_pages(rows, cols, new)
        if self.recorder.enabled:
            self.recorder.replace(rows, cols, self.expected(new, self.pages.namespace_ids[new]))
        self.num_cow_copies += old.size
        self.on_allocate(new)
        if self.copy_pages is not None:
            self.copy_pages(old, new)
            self.pages.copies_done()
            return _EMPTY_PAGES, _EMPTY_PAGES
        return old.copy(), new

    # -- the metadata -------------------------------------------------------------------------

    def _finish(self, ids: tuple[Any, ...], rows: IntpArray, rows_w: Int64Array,
                rows32: Int32Array, start: Int64Array, end: Int64Array, k: int,
                slots: Int64Array, copies: tuple[Int32Array, Int32Array] | None,
                decode: DecodeSlots | None = None,
                counts: Int64Array | None = None, last_len: Int32Array | None = None
                ) -> StepMetadata:
        """The step's metadata, and its record (private copies) for verify and the next step.
        ``counts`` (pages per row) and ``last_len`` when the caller has them at hand."""
        t = self.table
        P = t.page_size
        if counts is None:
            counts = (end + (P - 1)) // P
        if last_len is None:
            last_len = ((end - 1) % P + 1).astype(np.int32)
        gens = t.generation[rows]
        indptr, indices, splice = self.steps.csr(rows, rows_w, gens, counts)
        if k >= 0:
            num_new, qo_indptr, own_qo = self.steps.step_counts(rows.size, k)
        else:
            num_new = (end - start).astype(np.int32)
            qo_indptr = np.zeros(rows.size + 1, dtype=np.int32)
            np.cumsum(num_new, out=qo_indptr[1:])
            own_qo = qo_indptr.copy()
        src, dst = copies if copies is not None else (_EMPTY_PAGES, _EMPTY_PAGES)
        step = StepMetadata(ids, rows32, num_new, slots.copy(), qo_indptr, indptr.copy(),
                            indices.copy(), last_len, end.astype(np.int32), src, dst, P)
        changes = self.recorder.num_changes
        self.steps.record(StepRecord(
            0, ids, rows, rows32, rows_w, t.epoch, gens, changes, counts, indptr, indices,
            own_qo, start, end, k, slots, decode, splice=splice,
            step=step))
        return step


def token_counts(num_tokens: Any, size: int, most: int) -> Int64Array | int:
    """``num_tokens`` as an int (one count for the whole batch) or ``[size]`` int64, each in
    ``0 .. most`` (a request's most tokens); raises ArgumentError / ArgumentTypeError naming
    what was wrong."""
    if isinstance(num_tokens, (int, np.integer)):
        return integer(num_tokens, "num_tokens", minimum=0, maximum=most)
    try:
        scalar = np.ndim(num_tokens) == 0
    except ValueError:  # a ragged nesting: integers() names it
        scalar = False
    if scalar:
        return integer(num_tokens, "num_tokens", minimum=0, maximum=most)
    return integers(num_tokens, "num_tokens", minimum=0, maximum=most, size=size)


class _Labelled:
    """What ``PageTable.grow`` allocates from: pages labelled with their rows' namespaces."""

    def __init__(self, pages: Pages, namespace_ids: Int64Array) -> None:
        self.pages = pages
        self.namespace_ids = namespace_ids

    def allocate(self, num: int) -> Int32Array:
        return self.pages.allocate(num, self.namespace_ids)
