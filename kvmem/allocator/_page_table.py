"""PageTable: which pages each live request maps, and the kernel metadata for a batch of rows.

One row per live request::

    pages[row]       | p0 | p1 | p2 | -1 | -1 | ... |     (PAD = -1 past the mapped pages)
    num_pages[row]     3
    num_tokens[row]    37    (tokens with a slot; page_size 16 -> the last page holds 5)

Token ``t`` of a row lives in slot ``pages[row, t // page_size] * page_size + t % page_size``.
A row may map pages ahead of its tokens (reserved room); kernel metadata covers only the pages
that hold tokens. Every per-step method is vectorized over rows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvmem.allocator._page_allocator import PageAllocator, as_page_ids
from kvmem.errors import KVMemError

__all__ = ["PAD", "CSRMetadata", "GrowResult", "PageTable"]

PAD = -1

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]


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
    new_page_rows: ``[k]``, int32 — the row each new page was mapped into
    new_page_positions: ``[k]``, int32 — its position (column) in that row
    """

    slot_mapping: Int64Array
    new_pages: Int32Array
    new_page_rows: Int32Array
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
    num_pages: ``[max_seqs]``, int32 — pages mapped per row
    num_tokens: ``[max_seqs]``, int64 — tokens with a slot per row
    """

    def __init__(self, max_seqs: int, max_pages_per_seq: int, page_size: int) -> None:
        for name, value in (
            ("max_seqs", max_seqs),
            ("max_pages_per_seq", max_pages_per_seq),
            ("page_size", page_size),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_seqs = int(max_seqs)
        self.max_pages_per_seq = int(max_pages_per_seq)
        self.page_size = int(page_size)
        self.pages = np.full((self.max_seqs, self.max_pages_per_seq), PAD, dtype=np.int32)
        self.num_pages = np.zeros(self.max_seqs, dtype=np.int32)
        self.num_tokens = np.zeros(self.max_seqs, dtype=np.int64)
        self._free_rows = list(range(self.max_seqs - 1, -1, -1))
        self._live = np.zeros(self.max_seqs, dtype=bool)

    # -- rows -----------------------------------------------------------------------------------

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def is_live(self, row: int) -> bool:
        return bool(self._live[row])

    def add_row(self) -> int:
        """Open an empty row for a new request."""
        if not self._free_rows:
            raise KVMemError(
                f"all {self.max_seqs} page-table rows are in use; release a request first or "
                "build the table with a larger max_seqs"
            )
        row = self._free_rows.pop()
        self._live[row] = True
        return row

    def remove_row(self, row: int) -> Int32Array:
        """Close a row; returns the pages it mapped (the caller frees them)."""
        self._require_live_rows(np.array([row]))
        pages = self.pages[row, : self.num_pages[row]].copy()
        self.pages[row, : self.num_pages[row]] = PAD
        self.num_pages[row] = 0
        self.num_tokens[row] = 0
        self._live[row] = False
        self._free_rows.append(row)
        return pages

    def map_pages(self, row: int, pages: npt.ArrayLike) -> None:
        """Append already-held pages (a prefix hit, a fork) to a row; the caller holds them."""
        pages = as_page_ids(pages)
        self._require_live_rows(np.array([row]))
        start = int(self.num_pages[row])
        if start + pages.size > self.max_pages_per_seq:
            raise KVMemError(
                f"row {row} maps {start} pages and cannot take {pages.size} more "
                f"(max_pages_per_seq={self.max_pages_per_seq})"
            )
        self.pages[row, start : start + pages.size] = pages
        self.num_pages[row] = start + pages.size

    def set_num_tokens(self, row: int, num_tokens: int) -> None:
        """Declare that ``num_tokens`` of the row's slots hold tokens (e.g. after a prefix hit)."""
        num_slots = int(self.num_pages[row]) * self.page_size
        if not 0 <= num_tokens <= num_slots:
            raise KVMemError(
                f"row {row} maps {self.num_pages[row]} pages ({num_slots} slots) and cannot hold "
                f"{num_tokens} tokens; map more pages first"
            )
        self.num_tokens[row] = num_tokens

    def replace_page(self, row: int, position: int, page: int) -> int:
        """Put ``page`` at column ``position`` of ``row`` (copy-on-write); returns the old page."""
        if not 0 <= position < self.num_pages[row]:
            raise KVMemError(f"row {row} maps {self.num_pages[row]} pages; no position {position}")
        old = int(self.pages[row, position])
        self.pages[row, position] = page
        return old

    def row_pages(self, row: int) -> Int32Array:
        return self.pages[row, : self.num_pages[row]]

    # -- growth (the decode step) --------------------------------------------------------------

    def pages_needed(self, rows: Int32Array, num_new_tokens: npt.ArrayLike) -> Int32Array:
        """Pages each row must gain to hold ``num_new_tokens`` more tokens: ``[B]``, int32."""
        rows = np.asarray(rows)
        end = self.num_tokens[rows] + np.asarray(num_new_tokens, dtype=np.int64)
        needed = (end + self.page_size - 1) // self.page_size - self.num_pages[rows]
        return np.maximum(needed, 0).astype(np.int32)

    def grow(
        self, rows: npt.ArrayLike, num_new_tokens: npt.ArrayLike, allocator: PageAllocator
    ) -> GrowResult:
        """Give each row ``num_new_tokens`` more token slots, allocating pages only where a row
        crosses a page boundary. All or nothing: on any error nothing changes.

        Parameters
        ----------
        rows: ``[B]``, int — distinct live rows
        num_new_tokens: int or ``[B]``, int — tokens each row gains (>= 0)
        allocator: where new pages come from

        Returns
        -------
        GrowResult with the int64 slot mapping of the new tokens (row by row).
        """
        rows = np.asarray(rows, dtype=np.int32).reshape(-1)
        new = np.broadcast_to(np.asarray(num_new_tokens, dtype=np.int64), rows.shape)
        self._require_live_rows(rows)
        if (new < 0).any():
            raise ValueError(f"num_new_tokens must be >= 0, got {new[new < 0].tolist()[:8]}")
        needed = self.pages_needed(rows, new)
        too_long = self.num_pages[rows] + needed > self.max_pages_per_seq
        if too_long.any():
            raise KVMemError(
                f"rows {rows[too_long].tolist()[:8]} would need more than max_pages_per_seq="
                f"{self.max_pages_per_seq} pages; finish those requests or raise the limit"
            )
        total = int(needed.sum())
        new_pages = allocator.allocate(total)  # raises OutOfPagesError before any change
        # Row and column of every new page: repeat each row by its count, columns count up.
        page_rows = np.repeat(rows, needed)
        first = np.repeat(self.num_pages[rows], needed)
        offsets = np.arange(total, dtype=np.int32) - np.repeat(np.cumsum(needed) - needed, needed)
        page_cols = (first + offsets).astype(np.int32)
        self.pages[page_rows, page_cols] = new_pages
        self.num_pages[rows] += needed
        start = self.num_tokens[rows].copy()
        self.num_tokens[rows] += new
        slot_mapping = self.slot_mapping(*self._token_positions(rows, start, new))
        return GrowResult(slot_mapping, new_pages, page_rows, page_cols)

    # -- metadata ------------------------------------------------------------------------------

    def slot_mapping(self, token_rows: npt.ArrayLike, positions: npt.ArrayLike) -> Int64Array:
        """Slots of tokens given by (row, position): ``[T]``, int64."""
        token_rows = np.asarray(token_rows)
        positions = np.asarray(positions, dtype=np.int64)
        pages = self.pages[token_rows, positions // self.page_size].astype(np.int64)
        return pages * self.page_size + positions % self.page_size

    def token_slots(
        self, rows: npt.ArrayLike, start: npt.ArrayLike, count: npt.ArrayLike
    ) -> Int64Array:
        """Slots of tokens ``start .. start+count-1`` of each row, row by row.

        Returns ``[sum(count)]``, int64.
        """
        rows = np.asarray(rows, dtype=np.int32).reshape(-1)
        start = np.broadcast_to(np.asarray(start, dtype=np.int64), rows.shape)
        count = np.broadcast_to(np.asarray(count, dtype=np.int64), rows.shape)
        return self.slot_mapping(*self._token_positions(rows, start, count))

    @staticmethod
    def _token_positions(
        rows: Int32Array, start: Int64Array, count: Int64Array
    ) -> tuple[Int32Array, Int64Array]:
        token_rows = np.repeat(rows, count)
        within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(count) - count, count
        )
        return token_rows, np.repeat(start, count) + within

    def _used_pages(self, rows: Int32Array, seq_lens: npt.ArrayLike | None) -> Int64Array:
        lens = self.num_tokens[rows] if seq_lens is None else np.asarray(seq_lens, dtype=np.int64)
        return (lens + self.page_size - 1) // self.page_size

    def csr(self, rows: npt.ArrayLike, seq_lens: npt.ArrayLike | None = None) -> CSRMetadata:
        """FlashInfer CSR over the pages that hold each row's first ``seq_lens`` tokens
        (default: all its tokens). Every row must hold at least one token.
        """
        rows = np.asarray(rows, dtype=np.int32).reshape(-1)
        lens = self.num_tokens[rows] if seq_lens is None else np.asarray(seq_lens, dtype=np.int64)
        used = self._used_pages(rows, lens)
        indptr = np.zeros(rows.size + 1, dtype=np.int32)
        np.cumsum(used, out=indptr[1:])
        # Gather row b's first used[b] columns in one fancy-index.
        cols = np.arange(int(indptr[-1]), dtype=np.int64) - np.repeat(indptr[:-1], used)
        indices = self.pages[np.repeat(rows, used), cols]
        last_len = (lens - 1) % self.page_size + 1
        return CSRMetadata(indptr, indices, last_len.astype(np.int32))

    def block_table(
        self, rows: npt.ArrayLike, seq_lens: npt.ArrayLike | None = None, width: int | None = None
    ) -> Int32Array:
        """vLLM-style block table ``[B, width]``, int32: each row's pages holding its first
        ``seq_lens`` tokens, PAD after. ``width`` defaults to the widest row.
        """
        rows = np.asarray(rows, dtype=np.int32).reshape(-1)
        used = self._used_pages(rows, seq_lens)
        if width is None:
            width = int(used.max()) if used.size else 0
        table = self.pages[rows, :width].copy()
        table[np.arange(width) >= used[:, None]] = PAD
        return table

    def _require_live_rows(self, rows: npt.NDArray[np.integer]) -> None:
        bad = (rows < 0) | (rows >= self.max_seqs)
        if not bad.any():
            bad = ~self._live[rows]
        if bad.any():
            raise KVMemError(f"rows {rows[bad].tolist()[:8]} are not live rows of this page table")
        if np.unique(rows).size != rows.size:
            raise ValueError(f"rows must be distinct, got {rows.tolist()[:16]}")
