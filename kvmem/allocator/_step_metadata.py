"""Kernel metadata of a reserved step: what the attention and KV-store kernels read.

:class:`StepMetadata` is what ``reserve`` returns: the slot mapping, FlashInfer CSR, lengths,
and (built on first use) vLLM's block table. :class:`StepBuilder` makes it from the page table,
and remembers each batch it built (:class:`StepRecord`, private copies) so that:

* the next step keeps the CSR entries of the rows that did not change and splices in only the
  new ones (a decode step changes a few rows: a copy, not a gather; :meth:`StepBuilder.csr`)::

      previous kv_indices   | r0 r0 r0 | r1 r1 | r2 r2 r2 r2 |
      r1 grew a page        | r0 r0 r0 | r1 r1 +new | r2 r2 r2 r2 |     one concatenation
      r0 finished, r3 came  | r1 r1 +new | r2 r2 r2 r2 | +r3 +r3 |

  Rows are matched by page-table row, so requests that finish or join (the batch shrinks,
  grows, its rows move) keep the spliced path as long as the others keep their order.

* ``verify`` of the very step just reserved compares the arrays it is given with the record's
  private copies and checks in full only what was spliced in (``kvmem.integrity``).

A record names its splice's base by serial number (:attr:`Splice.base_serial`), never by
object identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import show
from kvmem.allocator._page_table import PageTable
from kvmem.errors import ArgumentError
from kvmem.integrity import PAD, DecodeSlots, Splice, checked_beside, max_spliced_rows, splice

__all__ = ["Splice", "StepBuilder", "StepMetadata", "StepRecord"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]
_EMPTY_TAGS = np.empty(0, dtype=np.int64)
_EMPTY_PAGES = np.empty(0, dtype=np.int32)
# Records kept for commit_batch's decode path: an engine with steps in flight, each reserved in
# a few calls (prefill chunks, decodes), commits a step several reserves later.
RECENT = 8


@dataclass(frozen=True)
class StepMetadata:
    """Kernel metadata for one reserved step of a batch of ``B`` requests.

    request_ids: the batch, in order
    rows: ``[B]``, int32 — page-table rows
    num_new_tokens: ``[B]``, int32 — tokens reserved per request this step
    slot_mapping: ``[T]``, int64 — where to write each new token's K/V
        (``page * page_size + offset``), request by request, ``T = sum(num_new_tokens)``
    qo_indptr: ``[B + 1]``, int32 — request ``b``'s new tokens are ``qo_indptr[b]:qo_indptr[b+1]``
    kv_indptr: ``[B + 1]``, int32; kv_indices: ``[nnz]``, int32; kv_last_page_len: ``[B]``,
        int32 — FlashInfer CSR over each request's pages, covering every token up to and
        including the reserved ones
    seq_lens: ``[B]``, int32 — tokens per request including the reserved ones
    copy_src, copy_dst: ``[C]``, int32 — copy-on-write page copies to do before writing, when
        no pool is attached (the manager keeps ``copy_src`` alive until the next ``reserve``);
        empty when a pool is attached (the manager already called ``pool.copy_pages``)
    """

    request_ids: tuple[Any, ...]
    rows: Int32Array
    num_new_tokens: Int32Array
    slot_mapping: Int64Array
    qo_indptr: Int32Array
    kv_indptr: Int32Array
    kv_indices: Int32Array
    kv_last_page_len: Int32Array
    seq_lens: Int32Array
    copy_src: Int32Array
    copy_dst: Int32Array
    page_size: int

    @property
    def batch_size(self) -> int:
        return int(self.rows.size)

    @property
    def num_pages(self) -> Int32Array:
        """Pages each request reads: ``[B]``, int32."""
        return np.diff(self.kv_indptr)

    def fields(self) -> dict[str, Any]:
        """The arrays the kernels read, by the names :meth:`tensors` uses (no block table)."""
        return {"slot_mapping": self.slot_mapping, "qo_indptr": self.qo_indptr,
                "kv_indptr": self.kv_indptr, "kv_indices": self.kv_indices,
                "kv_last_page_len": self.kv_last_page_len, "seq_lens": self.seq_lens,
                "num_new_tokens": self.num_new_tokens}

    def tensors(self, device: Any = "cpu") -> dict[str, Any]:
        """The kernel metadata as torch tensors on ``device`` (one copy each), keyed by field:
        ``slot_mapping`` (int64), ``qo_indptr``, ``kv_indptr``, ``kv_indices``,
        ``kv_last_page_len``, ``seq_lens``, ``num_new_tokens``, ``block_table`` (int32). Pass
        the dict to ``KVCacheManager.verify(ids, metadata=...)`` to check the very tensors the
        kernels read, on their device."""
        import torch

        try:
            where = torch.device("cpu" if device is None else device)
            torch.empty(0, device=where)  # a device this process can reach
        except (RuntimeError, TypeError, AssertionError) as e:
            raise ArgumentError(f"device={show(device)} is not a device torch can use here "
                                f"({e}); pass 'cpu', 'cuda' or 'cuda:N'") from None
        arrays = {**self.fields(), "block_table": self.block_table}
        return {name: torch.from_numpy(np.ascontiguousarray(a)).to(where)
                for name, a in arrays.items()}

    @cached_property
    def block_table(self) -> Int32Array:
        """vLLM / flash-attn block table ``[B, W]``, int32, PAD (-1) past each request's pages;
        ``W`` is the widest request of the batch. Built from the CSR on first use."""
        counts = np.diff(self.kv_indptr)
        width = int(counts.max()) if counts.size else 0
        table = np.full((counts.size, width), PAD, dtype=np.int32)
        cols = np.arange(self.kv_indices.size) - np.repeat(self.kv_indptr[:-1], counts)
        table[np.repeat(np.arange(counts.size), counts), cols] = self.kv_indices
        return table


@dataclass(slots=True, eq=False)
class StepRecord:
    """A reserved batch, as built (private copies; ``indptr``/``indices`` are what the step's
    arrays were copied from, and what the next step of a batch this size splices from). The
    verifier reads it as a :class:`kvmem.integrity.SplicedStep`."""

    serial: int
    ids: tuple[Any, ...]
    rows: IntpArray  # read-only
    rows32: Int32Array
    rows_w: Int64Array  # rows * max_pages_per_seq: flat index of each row's column 0
    epoch: int  # the page table's epoch when built
    gens: Int64Array  # the rows' generations when built
    tracker_changes: int  # the tracker's num_changes when built (-1 without a CheckingTracker)
    counts: Int64Array  # pages listed per row
    indptr: Int32Array
    indices: Int32Array
    qo_indptr: Int32Array
    start: Int64Array  # tokens each row held before the reserve ...
    end: Int64Array  # ... and after it
    k: int  # tokens per row when the batch got one count (-1: per-row counts)
    slots: Int64Array  # the slot each new token lands in
    decode: DecodeSlots | None = None  # the decode step's: each token's page, offset, column
    splice: Splice | None = None
    step: StepMetadata | None = field(default=None, repr=False)


class StepBuilder:
    """Builds steps' kernel metadata from a page table and remembers recent batches.

    Parameters
    ----------
    table: the page table.
    expected_flat: the tracker's expected tags as a flat ``[max_seqs * max_pages_per_seq]``
        view (a CheckingTracker's), so a splice snapshots what was recorded for its new
        entries; None without one.
    """

    def __init__(self, table: PageTable, expected_flat: Int64Array | None = None) -> None:
        self.table = table
        self.expected_flat = expected_flat
        self.latest: StepRecord | None = None
        # What the next batch splices from: the latest record that a verifier's proof would
        # cover: a spliced one (proved spliced), or one not checked beside the base (a
        # prefill chunk between decode steps is; kvmem.integrity.checked_beside).
        self._base: StepRecord | None = None
        self._recent: list[StepRecord] = []  # the latest RECENT records, newest last
        self._position = np.full(table.max_seqs, -1, dtype=np.intp)  # scratch: row -> base index
        self._serial = 0
        self._counts: dict[tuple[int, int], tuple[Int32Array, Int32Array]] = {}
        self._arange = np.arange(max(table.max_pages_per_seq, table.max_seqs) + 1, dtype=np.int64)

    def current(self, ids: tuple[Any, ...]) -> StepRecord | None:
        """The latest record if it is ``ids``' batch and no row changed since (the page
        table's epoch is the same)."""
        b = self.latest
        if b is not None and b.epoch == self.table.epoch and ids == b.ids:
            return b
        return None

    def leading_rows(self, ids: tuple[Any, ...]) -> IntpArray | None:
        """The rows of ``ids`` when they are the leading requests of the latest record's batch
        and no row changed since (a churning step's decodes, committed before its
        admissions): a read-only slice of its rows; else None."""
        b = self.latest
        n = len(ids)
        if (b is None or not 1 < n < len(b.ids) or b.epoch != self.table.epoch
                or b.ids[:n] != ids):
            return None
        return b.rows[:n]

    def uncommitted(self, ids: tuple[Any, ...], committed: Int64Array) -> StepRecord | None:
        """A recent one-token record of ``ids``' batch that nothing was committed into yet:
        the rows have the same generations (nothing but appends since) and commit exactly its
        tokens next (``committed``: the rows' committed counts, in batch order). An engine
        that reserves step n + 1 before it commits step n finds step n's record here."""
        for b in reversed(self._recent):  # (committed == start: none of its rows committed)
            if (b.decode is not None and b.ids == ids
                    and b.start.shape == committed.shape
                    and not np.count_nonzero(committed != b.start)
                    and not np.count_nonzero(self.table.generation[b.rows] != b.gens)):
                return b
        return None

    def uncommitted_head(self, ids: tuple[Any, ...], committed: Int64Array
                         ) -> StepRecord | None:
        """The latest record when ``ids`` are the leading requests of its batch (a decode step
        that requests joined), each reserved one token there, nothing committed into them
        since (``committed``: their committed counts, in batch order) and no row changed
        (the page table's epoch is the same); else None."""
        b = self.latest
        n = len(ids)
        if (b is None or not 0 < n < len(b.ids) or b.epoch != self.table.epoch
                or b.ids[:n] != ids):
            return None
        start = b.start[:n]
        if np.count_nonzero(committed != start) or np.count_nonzero(b.end[:n] - start != 1):
            return None
        return b

    def row_arrays(self, rows: IntpArray) -> tuple[Int64Array, Int32Array]:
        """``rows * max_pages_per_seq`` and the rows as read-only int32 (``StepMetadata.rows``):
        the latest record's own when ``rows`` is its array (read-only, so the same values)."""
        b = self.latest
        if b is not None and rows is b.rows:
            return b.rows_w, b.rows32
        rows32 = rows.astype(np.int32)
        rows32.flags.writeable = False
        return rows * self.table.max_pages_per_seq, rows32

    def step_counts(self, size: int, k: int) -> tuple[Int32Array, Int32Array, Int32Array]:
        """``num_new_tokens`` ``[size]`` (all ``k``) and ``qo_indptr`` ``[size + 1]``
        (``0, k, 2k, ...``), int32, fresh copies of cached arrays; and the cached
        ``qo_indptr`` itself (read-only: a record's private copy)."""
        if size == 1:  # one request's chunk: three tiny arrays cost less than the lookup
            qo = np.array([0, k], dtype=np.int32)
            qo.flags.writeable = False
            return np.array([k], dtype=np.int32), qo.copy(), qo
        got = self._counts.get((size, k))
        if got is None:
            got = (np.full(size, k, dtype=np.int32),
                   np.multiply(self._arange[: size + 1], k, dtype=np.int32))
            got[1].flags.writeable = False
            if k > self.table.page_size:  # a prefill chunk's length: rarely seen twice
                return got[0], got[1].copy(), got[1]
            if len(self._counts) > 64:
                self._counts.clear()
            self._counts[(size, k)] = got
        return got[0].copy(), got[1].copy(), got[1]

    def csr(self, rows: IntpArray, rows_w: Int64Array, gens: Int64Array, counts: Int64Array
            ) -> tuple[Int32Array, Int32Array, Splice | None]:
        """FlashInfer ``kv_indptr``, ``kv_indices`` over each row's first ``counts`` pages.

        A row that the base batch (the latest one a proof would cover) listed, with nothing
        but appends since (same generation), keeps its entries: the new ``kv_indices`` is the
        base's, cut where rows changed, left or joined, the new pages spliced in, in one
        concatenation (and a :class:`Splice`). Otherwise one masked gather.
        """
        size = rows.size
        indptr = np.zeros(size + 1, dtype=np.int32)
        np.add.accumulate(counts, out=indptr[1:], dtype=np.int32)
        if size == 1:  # one request (a prefill chunk): a slice of its row
            at = int(rows_w[0])
            return indptr, self.table.pages.reshape(-1)[at : at + int(counts[0])].copy(), None
        c = self._base
        if c is not None and size:
            spliced = self._splice(c, rows_w, gens, counts) if c.rows.size == size else None
            if spliced is None:  # rows left, joined or moved
                spliced = self._splice_rows(c, rows, rows_w, gens, counts)
            if spliced is not None:
                return indptr, *spliced
        width = int(counts.max()) if size else 0
        mask = self._arange[:width] < counts[:, None]
        return indptr, self.table.pages[rows, :width][mask], None

    def _splice(self, c: StepRecord, rows_w: Int64Array, gens: Int64Array, counts: Int64Array
                ) -> tuple[Int32Array, Splice] | None:
        """``kv_indices`` spliced from ``c``'s, or None when too much changed."""
        kept = gens == c.gens
        if kept.size - np.count_nonzero(kept) > self._max_spliced(c):
            return None  # (rows left or joined mid-batch: every row after moved; by row next)
        first = c.counts * kept  # entries each row keeps
        changed = ((counts != first) | ~kept).nonzero()[0]
        first = first[changed]
        fresh = counts[changed] - first
        if changed.size > self._max_spliced(c) or np.count_nonzero(fresh < 0):
            return None
        c.splice = None  # (a record keeps only its own splice, not a chain of them)
        if not changed.size:
            return c.indices, Splice(c.serial, changed, _EMPTY_PAGES, _EMPTY_TAGS, [])
        # Kept: the base's entries up to each changed row's cut and from its end on.
        indices, pages, wants, gone = splice(
            c.indices, [0, *c.indptr[changed + 1].tolist()],
            [*(c.indptr[changed] + first).tolist(), c.indices.size],
            self.table.pages.reshape(-1), (rows_w[changed] + first).tolist(), fresh.tolist(),
            self.expected_flat)
        return indices, Splice(c.serial, changed, pages, wants, gone)

    def _max_spliced(self, c: StepRecord) -> int:
        """Changed rows up to which a splice from ``c`` beats a gather (with a checking tracker,
        the gather also costs verify its proof)."""
        return max_spliced_rows(c.indices.size, proved=self.expected_flat is not None)

    def _splice_rows(self, c: StepRecord, rows: IntpArray, rows_w: Int64Array, gens: Int64Array,
                     counts: Int64Array) -> tuple[Int32Array, Splice] | None:
        """``kv_indices`` spliced from ``c``'s with rows matched by page-table row (they may
        sit at other batch positions), or None when too much changed or the kept rows are not
        in ``c``'s order."""
        if abs(rows.size - c.rows.size) > self._max_spliced(c):  # (each row more or less: a piece)
            return None
        position = self._position
        position[c.rows] = self._arange[: c.rows.size]
        j = position[rows]  # each row's index in c, -1: not in c
        position[c.rows] = -1
        kept = j >= 0
        kept[kept] = c.gens[j[kept]] == gens[kept]  # (generations are unique to a row's lifetime)
        jk = j[kept]
        first = np.zeros(rows.size, dtype=np.int64)
        first[kept] = c.counts[jk]  # entries each row keeps
        fresh = counts - first
        if np.count_nonzero(fresh < 0) or np.count_nonzero(jk[1:] <= jk[:-1]):
            return None
        # A run of kept rows that sit next to each other in c, with no new entries but after
        # the last, is one slice of c's entries.
        joined = kept[1:] & kept[:-1] & (fresh[:-1] == 0)
        joined[joined] = j[1:][joined] == j[:-1][joined] + 1
        ends = [*(~joined).nonzero()[0].tolist(), rows.size - 1]
        if len(ends) + c.rows.size - jk.size > self._max_spliced(c):  # (runs + rows cut out)
            return None
        c.splice = None  # (a record keeps only its own splice, not a chain of them)
        # Run g keeps c's entries of its rows (none when its rows are new), then its new ones.
        e = np.asarray(ends, dtype=np.intp)
        k = kept[e]
        hi = np.maximum.accumulate(np.where(k, c.indptr[j[e] + 1], 0))
        lo = np.where(k, c.indptr[j[np.concatenate(([0], e[:-1] + 1))]], hi)
        end_all = [c.indices.size]
        indices, pages, wants, gone = splice(
            c.indices, [*lo.tolist(), *end_all], [*hi.tolist(), *end_all],
            self.table.pages.reshape(-1), (rows_w[e] + first[e]).tolist(), fresh[e].tolist(),
            self.expected_flat)
        changed = (~kept | (fresh > 0)).nonzero()[0]
        return indices, Splice(c.serial, changed, pages, wants, gone)

    def record(self, b: StepRecord) -> StepRecord:
        """Remember a built batch (the latest; the base of the next one unless it is a small
        batch checked beside the base, kvmem.integrity.checked_beside)."""
        self._serial += 1
        b.serial = self._serial
        self.latest = b
        self._recent.append(b)
        if len(self._recent) > RECENT:
            del self._recent[0]
        base = self._base
        if base is None or b.splice is not None or not checked_beside(b.rows.size,
                                                                      base.rows.size):
            self._base = b
        return b

    def forget(self) -> None:
        """Forget every record (the next steps build their CSR by a gather)."""
        self.latest = None
        self._base = None
        self._recent.clear()
