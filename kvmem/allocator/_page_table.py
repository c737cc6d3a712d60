"""PageTable: which pages each live request maps, the request's per-row state, and the page
positions behind a batch's kernel metadata.

One row per live request::

    pages[row]          | p0 | p1 | p2 | -1 | -1 | ... |     (PAD = -1 past the mapped pages)
    num_pages[row]        3
    num_tokens[row]       37    tokens with a slot (page_size 16 -> the last page holds 5)
    num_committed[row]    36    tokens whose K/V the engine said it wrote (<= num_tokens)
    write_from[row]       36    first slot the latest reserve handed out
    namespace_ids[row]    the manager's id of the request's namespace
    prefix_keys[row]      prefix-cache key of the row's last committed full page (chain parent)
    forked[row]           a fork may share the row's partly filled tail (copy it on write)
    generation[row]       changes whenever the row's mapped columns change other than by
                          appending (opened, closed, a page replaced): equal generations mean
                          the same request with nothing but appends since

Token ``t`` of a row lives in slot ``pages[row, t // page_size] * page_size + t % page_size``.
A row may map pages ahead of its tokens (reserved room); kernel metadata covers only the pages
that hold tokens. Every per-step method is vectorized over rows.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from kvmem._validate import index_array, integer, is_integer_like, show
from kvmem.allocator._page_allocator import as_page_ids
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError
from kvmem.integrity import PAD

__all__ = ["PAD", "CSRMetadata", "GrowResult", "PageTable"]


Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]  # rows as indices (numpy indexes with intp fastest)


class Allocates(Protocol):
    """Where :meth:`PageTable.grow` takes pages from (a :class:`PageAllocator`, say)."""

    def allocate(self, num: int) -> Int32Array: ...


class CSRMetadata(NamedTuple):
    """FlashInfer paged-KV metadata for a batch of ``B`` rows.

    kv_indptr: ``[B + 1]``, int32 — row ``b``'s pages are
        ``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]``
    kv_indices: ``[nnz]``, int32 — page ids
    kv_last_page_len: ``[B]``, int32 — tokens in each row's last page, in ``1..page_size``
    """

    kv_indptr: Int32Array
    kv_indices: Int32Array
    kv_last_page_len: Int32Array


class GrowResult(NamedTuple):
    """What :meth:`PageTable.grow` did.

    slot_mapping: ``[T]``, int64 — slots of the new tokens, row by row, in order
    new_pages: ``[k]``, int32 — pages allocated by this call
    new_page_rows: ``[k]``, intp — the row each new page was mapped into
    new_page_positions: ``[k]``, int32 — its position (column) in that row
    """

    slot_mapping: Int64Array
    new_pages: Int32Array
    new_page_rows: IntpArray
    new_page_positions: Int32Array


class PageTable:
    """Rows of page ids for up to ``max_seqs`` live requests.

    Parameters
    ----------
    max_seqs: rows available.
    max_pages_per_seq: columns: the most pages one request may map.
    page_size: token slots per page.

    Attributes
    ----------
    pages: ``[max_seqs, max_pages_per_seq]``, int32 — page ids, PAD past ``num_pages[row]``
    num_pages: ``[max_seqs]``, int64 — pages mapped per row
    num_tokens: ``[max_seqs]``, int64 — tokens with a slot per row
    """

    def __init__(self, max_seqs: int, max_pages_per_seq: int, page_size: int) -> None:
        for name, value in (
            ("max_seqs", max_seqs),
            ("max_pages_per_seq", max_pages_per_seq),
            ("page_size", page_size),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ArgumentError(f"{name} must be a positive int, got {value!r}")
        self.max_seqs = int(max_seqs)
        self.max_pages_per_seq = int(max_pages_per_seq)
        self.page_size = int(page_size)
        self.pages = np.full((self.max_seqs, self.max_pages_per_seq), PAD, dtype=np.int32)
        self._flat_pages = self.pages.reshape(-1)  # a view: page (row, col) is [row * width + col]
        self._slot_offsets = np.arange(self.page_size, dtype=np.int64)  # slot within a page
        self.num_pages = np.zeros(self.max_seqs, dtype=np.int64)
        self.num_tokens = np.zeros(self.max_seqs, dtype=np.int64)
        self.num_committed = np.zeros(self.max_seqs, dtype=np.int64)
        self.write_from = np.zeros(self.max_seqs, dtype=np.int64)
        self.namespace_ids = np.zeros(self.max_seqs, dtype=np.int64)
        self.prefix_keys = np.zeros((self.max_seqs, 2), dtype=np.uint64)
        self.forked = np.zeros(self.max_seqs, dtype=bool)
        self.num_forked = 0  # rows with forked set
        self.generation = np.zeros(self.max_seqs, dtype=np.int64)
        self.epoch = 0  # generation changes so far, over all rows
        self._free_rows = list(range(self.max_seqs - 1, -1, -1))
        self._live = np.zeros(self.max_seqs, dtype=bool)
        self._row_marks = np.zeros(self.max_seqs, dtype=np.int64)  # scratch: the distinct check
        self._arange = np.arange(max(self.max_seqs, self.max_pages_per_seq, self.page_size) + 1,
                                 dtype=np.int64)

    # -- rows -----------------------------------------------------------------------------------

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def live_rows(self) -> IntpArray:
        """Rows that are open: ``[k]``, intp, ascending."""
        return self._live.nonzero()[0]

    def touch(self, rows: int | npt.NDArray[np.integer]) -> None:
        """Give rows a new generation: their mapped columns changed other than by appending."""
        if isinstance(rows, (int, np.integer)):
            self.epoch += 1
            self.generation[rows] = self.epoch
        else:
            n = len(rows)
            self.generation[rows] = self.epoch + 1 + self._arange[:n]
            self.epoch += n

    def add_row(self) -> int:
        """Open an empty row for a new request."""
        return int(self.add_rows(1)[0])

    def add_rows(self, num: int) -> Int32Array:
        """Open ``num`` empty rows: ``[num]``, int32."""
        num = integer(num, "num", minimum=0)
        if num > len(self._free_rows):
            raise KVMemError(
                f"asked for {num} page-table rows but {len(self._free_rows)} of {self.max_seqs} "
                "are free; release requests first or build the table with a larger max_seqs"
            )
        rows = np.array(self._free_rows[len(self._free_rows) - num :][::-1], dtype=np.int32)
        del self._free_rows[len(self._free_rows) - num :]
        self._live[rows] = True
        self.touch(rows)
        return rows

    def open_row(self, pages: Int32Array, num_tokens: int, num_committed: int | None = None,
                 namespace_id: int = 0, prefix_key: npt.NDArray[np.uint64] | None = None) -> int:
        """A new row mapping ``pages`` (``[k]``, int32, held by the caller) of which
        ``num_tokens`` slots hold tokens, ``num_committed`` of them (default all) committed:
        an admission or a fork. Raises KVMemError, changing nothing, if it cannot."""
        num = int(pages.size)
        if num > self.max_pages_per_seq or not 0 <= num_tokens <= num * self.page_size:
            raise KVMemError(
                f"a row of at most {self.max_pages_per_seq} pages cannot map {num} pages holding "
                f"{num_tokens} tokens (page_size={self.page_size})"
            )
        if not self._free_rows:
            raise KVMemError(
                f"asked for 1 page-table row but 0 of {self.max_seqs} are free; release requests "
                "first or build the table with a larger max_seqs"
            )
        row = self._free_rows.pop()
        self._live[row] = True
        self.touch(row)
        self.pages[row, :num] = pages
        self.num_pages[row] = num
        self.num_tokens[row] = self.write_from[row] = num_tokens
        self.num_committed[row] = num_tokens if num_committed is None else num_committed
        self.namespace_ids[row] = namespace_id
        self.prefix_keys[row] = 0 if prefix_key is None else prefix_key
        return row

    def remove_row(self, row: int) -> Int32Array:
        """Close a row; returns the pages it mapped (the caller frees them)."""
        if not is_integer_like(row):
            raise ArgumentTypeError(f"row={show(row)}: expected a live row (int or numpy integer)")
        if not 0 <= row < self.max_seqs or not self._live[row]:
            raise ArgumentError(f"row={row} is not a live row; nothing was removed")
        num = int(self.num_pages[row])
        pages = self.pages[row, :num].copy()
        self.pages[row, :num] = PAD
        self._reset(row)
        self._free_rows.append(row)
        return pages

    def _reset(self, rows: int | IntpArray) -> None:
        self.num_forked -= int(np.count_nonzero(self.forked[rows]))
        for arr in (self.num_pages, self.num_tokens, self.num_committed, self.write_from,
                    self.namespace_ids, self.prefix_keys, self.forked):
            arr[rows] = 0
        self._live[rows] = False
        self.touch(rows)

    def map_pages(self, row: int, pages: npt.ArrayLike) -> None:
        """Append already-held pages (a prefix hit, a fork) to a row; the caller holds them."""
        pages = as_page_ids(pages)
        self._require_live_rows(np.array([row]))
        if pages.size and int(pages.min()) < 0:
            raise ArgumentError(f"map_pages() got page ids {pages[pages < 0].tolist()[:8]}; "
                                "page ids are >= 0 (PAD marks the end of a row)")
        start = int(self.num_pages[row])
        if start + pages.size > self.max_pages_per_seq:
            raise KVMemError(
                f"row {row} maps {start} pages and cannot take {pages.size} more "
                f"(max_pages_per_seq={self.max_pages_per_seq})"
            )
        self.pages[row, start : start + pages.size] = pages
        self.num_pages[row] = start + pages.size

    def truncate(self, row: int, num_tokens: int, min_pages: int = 0) -> Int32Array:
        """Give back a row's slots past its first ``num_tokens`` (at least its committed ones):
        the pages past those that hold them (and past its first ``min_pages``) are unmapped
        (PAD) and returned (the caller drops their references); the row gets a new generation
        (no step record of it is reused)."""
        keep = max(-(-num_tokens // self.page_size), min_pages)
        num = int(self.num_pages[row])
        dropped = self.pages[row, keep:num].copy()
        self.pages[row, keep:num] = PAD
        self.num_pages[row] = min(num, keep)
        self.num_tokens[row] = num_tokens
        self.write_from[row] = min(int(self.write_from[row]), num_tokens)
        self.touch(row)
        return dropped

    def set_num_tokens(self, row: int, num_tokens: int) -> None:
        """Declare that ``num_tokens`` of the row's slots hold tokens (e.g. after a prefix hit)."""
        self._require_live_rows(np.array([integer(row, "row")]))
        num_tokens = integer(num_tokens, "num_tokens", minimum=0)
        num_slots = int(self.num_pages[row]) * self.page_size
        if not 0 <= num_tokens <= num_slots:
            raise ArgumentError(
                f"row {row} maps {self.num_pages[row]} pages ({num_slots} slots) and cannot hold "
                f"{num_tokens} tokens; map more pages first"
            )
        self.num_tokens[row] = num_tokens

    def append_pages(self, rows: IntpArray, flat_at: Int64Array, cols: Int64Array,
                     pages: Int32Array) -> None:
        """Map ``pages`` (held by the caller) at each row's next column ``cols`` (``flat_at``:
        ``row * max_pages_per_seq + col``, which the caller has at hand): the decode step's
        growth. Rows distinct, their columns the first unmapped ones."""
        self._flat_pages[flat_at] = pages
        self.num_pages[rows] = cols + 1

    def append_runs(self, rows: IntpArray, counts: Int64Array, flat_at: Int64Array,
                    pages: Int32Array) -> None:
        """Map ``pages`` (held by the caller), ``counts[i]`` of them at row ``rows[i]``'s next
        columns (``flat_at``: each page's ``row * max_pages_per_seq + col``, which the caller
        has at hand): a step's growth where rows gain several pages. Rows distinct."""
        self._flat_pages[flat_at] = pages
        self.num_pages[rows] += counts

    def append_run(self, row: int, pages: Int32Array) -> None:
        """Map ``pages`` (held by the caller) at one row's next columns: a prefill chunk's
        growth."""
        mapped = int(self.num_pages[row])
        self.pages[row, mapped : mapped + pages.size] = pages
        self.num_pages[row] = mapped + pages.size

    def advance(self, rows: IntpArray | int, start: Int64Array | int,
                end: npt.ArrayLike) -> None:
        """Rows that held ``start`` tokens hold ``end``, the slots from ``start`` on handed out
        by this step (the caller checked that their pages hold them)."""
        self.num_tokens[rows] = end
        self.write_from[rows] = start

    def writes_done(self, row: int) -> None:
        """The row's reserved slots were all written (a fork, between steps)."""
        self.write_from[row] = self.num_tokens[row]

    def set_committed(self, rows: IntpArray | int, num_committed: npt.ArrayLike) -> None:
        """Tokens of each row whose K/V the engine wrote (at most its ``num_tokens``)."""
        self.num_committed[rows] = num_committed

    def set_prefix_keys(self, rows: IntpArray | int, keys: npt.NDArray[np.uint64]) -> None:
        """Each row's prefix-cache key of its last committed full page (``[B, 2]``, uint64)."""
        self.prefix_keys[rows] = keys

    def overwrite(self, row: int, position: int, page: int) -> None:
        """Write ``page`` into a row's mapped ``position`` with no bookkeeping at all (no
        generation change, no reference moved): for fault injection only
        (``kvmem.testing``), which corrupts a row as a buggy engine would."""
        self.pages[row, position] = page

    def replace_pages(self, rows: IntpArray, cols: npt.NDArray[np.integer],
                      pages: Int32Array) -> None:
        """Put ``pages`` at ``(rows, cols)`` (copy-on-write: the columns are mapped already);
        the rows get new generations."""
        self.pages[rows, cols] = pages
        self.touch(rows)

    def set_forked(self, rows: npt.NDArray[np.integer], forked: bool) -> None:
        """Mark (or unmark) rows whose partly filled tail a fork may share."""
        before = int(np.count_nonzero(self.forked[rows]))
        self.forked[rows] = forked
        self.num_forked += int(np.count_nonzero(self.forked[rows])) - before

    def row_pages(self, row: int) -> Int32Array:
        """The pages a row maps: ``[k]``, int32 (a view; empty for a free row)."""
        if not is_integer_like(row) or not 0 <= row < self.max_seqs:
            integer(row, "row", minimum=0, maximum=self.max_seqs - 1)  # raises
        return self.pages[row, : self.num_pages[row]]

    # -- growth (the decode step) --------------------------------------------------------------

    def pages_needed(self, rows: npt.ArrayLike, num_new_tokens: npt.ArrayLike) -> Int64Array:
        """Pages each row must gain to hold ``num_new_tokens`` more tokens: ``[B]``, int64."""
        rows = self._rows_arg(rows)
        self._require_live_rows(rows)
        new = self._counts_arg(num_new_tokens, rows.size, "num_new_tokens")
        return self._pages_needed(rows, new)

    def _pages_needed(self, rows: IntpArray, num_new_tokens: npt.ArrayLike) -> Int64Array:
        end = self.num_tokens[rows] + np.asarray(num_new_tokens, dtype=np.int64)
        needed = (end + self.page_size - 1) // self.page_size - self.num_pages[rows]
        return np.maximum(needed, 0)

    def grow(
        self, rows: npt.ArrayLike, num_new_tokens: int | npt.ArrayLike, allocator: Allocates
    ) -> GrowResult:
        """Give each row ``num_new_tokens`` more token slots, allocating pages only where a row
        crosses a page boundary. All or nothing: on any error nothing changes.

        Parameters
        ----------
        rows: ``[B]``, int — distinct live rows
        num_new_tokens: int or ``[B]``, int — tokens each row gains (>= 0)
        allocator: where new pages come from (a PageAllocator, or anything whose
            ``allocate(num)`` returns ``num`` pages or raises changing nothing)

        Returns
        -------
        GrowResult with the int64 slot mapping of the new tokens (row by row).
        """
        rows = self._rows_arg(rows)
        self._require_live_rows(rows)
        if is_integer_like(num_new_tokens) and 0 <= num_new_tokens <= self.page_size:  # type: ignore[operator]
            return self._grow_by_at_most_one_page(rows, int(num_new_tokens), allocator)  # type: ignore[arg-type]
        new = self._counts_arg(num_new_tokens, rows.size, "num_new_tokens")
        needed = self._pages_needed(rows, new)
        self._require_room(rows, needed)
        total = int(needed.sum())
        new_pages = allocator.allocate(total)  # raises OutOfPagesError before any change
        # Row and column of every new page: repeat each row by its count, columns count up.
        page_rows = np.repeat(rows, needed)
        offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(needed) - needed, needed)
        page_cols = np.repeat(self.num_pages[rows], needed) + offsets
        self._flat_pages[page_rows * self.max_pages_per_seq + page_cols] = new_pages
        self.num_pages[rows] += needed
        start = self.num_tokens[rows]
        self.num_tokens[rows] = start + new
        slot_mapping = self._slots(*self._token_positions(rows, start, new))
        return GrowResult(slot_mapping, new_pages, page_rows, page_cols.astype(np.int32))

    def _grow_by_at_most_one_page(
        self, rows: IntpArray, num_new: int, allocator: Allocates
    ) -> GrowResult:
        """The decode step: every row gains ``num_new <= page_size`` tokens, so at most one page."""
        start = self.num_tokens[rows]
        num_pages = self.num_pages[rows]
        grow_idx = (start + num_new > num_pages * self.page_size).nonzero()[0]
        page_rows = rows[grow_idx]
        page_cols = num_pages[grow_idx]
        if page_cols.size and int(page_cols.max()) >= self.max_pages_per_seq:
            self._require_room(page_rows, np.ones(page_rows.size, dtype=np.int64))
        new_pages = allocator.allocate(grow_idx.size)
        self._flat_pages[page_rows * self.max_pages_per_seq + page_cols] = new_pages
        self.num_pages[page_rows] = page_cols + 1
        self.num_tokens[rows] = start + num_new
        if num_new != 1:
            start = (start[:, None] + self._arange[:num_new]).reshape(-1)
            rows = np.repeat(rows, num_new)
        slot_mapping = self._slots(rows, start)
        return GrowResult(slot_mapping, new_pages, page_rows, page_cols.astype(np.int32))

    def _require_room(self, rows: IntpArray, needed: Int64Array) -> None:
        too_long = self.num_pages[rows] + needed > self.max_pages_per_seq
        if np.count_nonzero(too_long):
            raise ArgumentError(
                f"rows {rows[too_long].tolist()[:8]} would need more than max_pages_per_seq="
                f"{self.max_pages_per_seq} pages; finish those requests or raise the limit"
            )

    # -- metadata ------------------------------------------------------------------------------

    def slot_mapping(self, token_rows: npt.ArrayLike, positions: npt.ArrayLike) -> Int64Array:
        """Slots of tokens given by (live row, position within its mapped pages): ``[T]``,
        int64."""
        rows = self._rows_arg(token_rows, "token_rows")
        pos = index_array(positions, "positions", what="position")
        if pos.size != rows.size:
            raise ArgumentError(f"slot_mapping() got {rows.size} token_rows and {pos.size} "
                                "positions: give one position per token")
        self._require_slots(rows, pos, pos + 1)
        return self._slots(rows, pos)

    def _require_slots(self, rows: IntpArray, start: Int64Array, end: Int64Array) -> None:
        """Rows live and tokens ``start .. end - 1`` of each inside the pages it maps."""
        if rows.size and not (int(rows.min()) >= 0 and int(rows.max()) < self.max_seqs
                              and self._live[rows].all()):
            raise ArgumentError(f"rows {rows.tolist()[:16]} include rows that are not live")
        bad = (start < 0) | (end > self.num_pages[rows] * self.page_size)
        if np.count_nonzero(bad):
            i = int(np.argmax(bad))
            raise ArgumentError(
                f"row {int(rows[i])} maps {int(self.num_pages[rows[i]])} pages of "
                f"{self.page_size}: tokens {int(start[i])}..{int(end[i]) - 1} are not in them")

    def _slots(self, token_rows: npt.ArrayLike, positions: npt.ArrayLike) -> Int64Array:
        """:meth:`slot_mapping` of rows and positions the caller knows are mapped."""
        token_rows = np.asarray(token_rows, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        page_index = token_rows * self.max_pages_per_seq + positions // self.page_size
        slots = self._flat_pages[page_index].astype(np.int64)
        slots *= self.page_size
        slots += positions % self.page_size
        return slots

    def token_slots(
        self, rows: npt.ArrayLike, start: npt.ArrayLike, count: npt.ArrayLike
    ) -> Int64Array:
        """Slots of tokens ``start .. start+count-1`` of each live row, row by row (start and
        count: an int or one per row, inside the pages the row maps).

        Returns ``[sum(count)]``, int64.
        """
        rows = self._rows_arg(rows)
        first = self._counts_arg(start, rows.size, "start")
        count = self._counts_arg(count, rows.size, "count")
        self._require_slots(rows, first, first + count)
        return self._token_slots(rows, first, count)

    def _token_slots(
        self, rows: npt.ArrayLike, start: npt.ArrayLike, count: npt.ArrayLike
    ) -> Int64Array:
        """:meth:`token_slots` of tokens the caller knows are mapped."""
        rows = np.asarray(rows, dtype=np.intp).reshape(-1)
        if rows.size == 1 and np.size(start) == 1 and np.size(count) == 1:
            return self.row_slots(int(rows[0]), int(np.asarray(start).reshape(-1)[0]),
                                  int(np.asarray(count).reshape(-1)[0]))
        start = np.broadcast_to(np.asarray(start, dtype=np.int64), rows.shape)
        count = np.broadcast_to(np.asarray(count, dtype=np.int64), rows.shape)
        return self._slots(*self._token_positions(rows, start, count))

    def row_slots(self, row: int, start: int, count: int) -> Int64Array:
        """:meth:`_token_slots` of one row (a prefill chunk): its pages are one slice of the
        row. ``[count]``, int64."""
        P = self.page_size
        first, skip = divmod(start, P)
        num_pages = (skip + count + P - 1) // P
        if first + num_pages > self.max_pages_per_seq:  # (past the row: the general path)
            one = np.array([row], dtype=np.intp)
            return self._slots(*self._token_positions(one, np.array([start], dtype=np.int64),
                                                      np.array([count], dtype=np.int64)))
        at = row * self.max_pages_per_seq + first
        pages = self._flat_pages[at : at + num_pages]
        slots = np.empty((num_pages, P), dtype=np.int64)  # (into one buffer: no temporary)
        np.add(np.multiply(pages, P, dtype=np.int64)[:, None], self._slot_offsets, out=slots)
        return slots.reshape(-1)[skip : skip + count]

    @staticmethod
    def _token_positions(
        rows: IntpArray, start: Int64Array, count: Int64Array
    ) -> tuple[IntpArray, Int64Array]:
        token_rows = np.repeat(rows, count)
        within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(count) - count, count
        )
        return token_rows, np.repeat(start, count) + within

    def csr(self, rows: npt.ArrayLike, seq_lens: npt.ArrayLike | None = None) -> CSRMetadata:
        """FlashInfer CSR over the pages that hold each row's first ``seq_lens`` tokens
        (default: all its tokens). Every row must hold at least one token.
        """
        rows, lens = self._lens_arg(rows, seq_lens)
        used = (lens + self.page_size - 1) // self.page_size
        indptr = np.zeros(rows.size + 1, dtype=np.int32)
        np.cumsum(used, out=indptr[1:])
        width = int(used.max()) if used.size else 0
        # One masked gather of the rows' first `width` columns (C order keeps rows contiguous).
        indices = self.pages[rows, :width][self._arange[:width] < used[:, None]]
        last_len = (lens - 1) % self.page_size + 1
        return CSRMetadata(indptr, indices, last_len.astype(np.int32))

    def block_table(
        self, rows: npt.ArrayLike, seq_lens: npt.ArrayLike | None = None, width: int | None = None
    ) -> Int32Array:
        """vLLM-style block table ``[B, width]``, int32: each row's pages holding its first
        ``seq_lens`` tokens, PAD after. ``width`` defaults to the widest row.
        """
        rows, lens = self._lens_arg(rows, seq_lens)
        used = (lens + self.page_size - 1) // self.page_size
        widest = int(used.max()) if used.size else 0
        width = widest if width is None else integer(width, "width", minimum=widest,
                                                         maximum=self.max_pages_per_seq)
        table = self.pages[rows, :width]
        table[np.arange(width) >= used[:, None]] = PAD
        return table

    def _rows_arg(self, rows: npt.ArrayLike, name: str = "rows") -> IntpArray:
        """Rows given by a caller: an integer array as is, else a checked 1-D sequence."""
        if type(rows) is np.ndarray and rows.dtype.kind in "iu" and rows.ndim == 1:
            return rows.astype(np.intp, copy=False)
        return index_array(rows, name, what="row").astype(np.intp)

    def _counts_arg(self, value: npt.ArrayLike, size: int, name: str) -> Int64Array:
        """An integer >= 0, or one per row, as ``[size]`` int64."""
        if not isinstance(value, (list, tuple, range, np.ndarray)):
            return np.full(size, integer(value, name, minimum=0), dtype=np.int64)
        out = index_array(value, name, what="count")
        if out.size != size or (out.size and int(out.min()) < 0):
            raise ArgumentError(f"{name}={show(value)}: expected an integer >= 0 or one per row "
                                f"({size}). Nothing was changed.")
        return out

    def _lens_arg(self, rows: npt.ArrayLike, seq_lens: npt.ArrayLike | None
                  ) -> tuple[IntpArray, Int64Array]:
        """Live rows and their lengths (default: their tokens), each in 1..the row's slots."""
        rows = self._rows_arg(rows)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.max_seqs
                          or not self._live[rows].all()):
            raise ArgumentError(f"rows {rows.tolist()[:16]} include rows that are not live")
        if seq_lens is None:
            return rows, self.num_tokens[rows]
        lens = self._counts_arg(seq_lens, rows.size, "seq_lens")
        if np.count_nonzero((lens < 1) | (lens > self.num_pages[rows] * self.page_size)):
            raise ArgumentError(f"seq_lens={show(seq_lens)}: each must be in 1..the row's "
                                "mapped slots (num_pages * page_size)")
        return rows, lens

    def _require_live_rows(self, rows: IntpArray) -> None:
        try:
            live = self._live[rows]
        except IndexError:
            live = np.zeros(rows.size, dtype=bool)
        if rows.size and (int(rows.min()) < 0 or not live.all()):
            raise ArgumentError(f"rows {rows.tolist()[:16]} include rows that are not live")
        # Distinct rows: stamping each row with its batch index reads every index back only
        # when no row appears twice (cheaper than np.unique on the per-step path).
        index = self._arange[: rows.size]
        self._row_marks[rows] = index
        if np.count_nonzero(self._row_marks[rows] != index):
            raise ArgumentError(f"rows must be distinct, got {rows.tolist()[:16]}")
