"""Trackers: the request side of the integrity check.

When a page is mapped into a request, a tracker may record the tag the page carries then. Before
decode, it checks a whole batch against the live tags in one vectorized operation.

* :class:`NoOpTracker` (the default) records nothing and checks nothing. Its ``enabled`` is
  False, and callers test that flag first so that they do not even build a tracker's inputs.
* :class:`CheckingTracker` keeps ``expected_tags[row, position]`` (int64, 0 = nothing recorded),
  one row per page-table row. ``record`` and ``forget`` (anyone may call them) may change what a
  row expects at positions a verifier already proved: they bump ``versions[row]`` and the
  counter ``num_changes``, so a verifier knows. ``record_row``, ``clear_row`` and ``append`` are
  the manager's row-lifecycle calls: a new row, a closed row (both get a new page-table
  generation anyway) and pages appended past the row's proven ones; they bump nothing. The
  tracker is the only writer of its arrays (``expected_tags`` is a read-only view).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvmem._validate import flag, id_tuple, index_array, integer, show
from kvmem.errors import ArgumentError, ArgumentTypeError, MetadataError
from kvmem.integrity._check import (
    BadEntries,
    Reason,
    check_block_table,
    check_block_table_torch,
    check_csr,
    check_csr_torch,
    require_int_array,
    validate_block_table,
    validate_csr,
)

__all__ = ["CheckingTracker", "IntegrityReport", "NoOpTracker", "Tracker"]


def _empty_entries() -> BadEntries:
    empty = np.empty(0, dtype=np.int64)
    return BadEntries(empty, empty, empty, empty, empty, empty)


@dataclass(frozen=True)
class IntegrityReport:
    """Result of verifying a batch.

    failed: the ids (request ids when given, else page-table rows) of requests with a bad
        entry, in batch order, each once.
    entries: every bad entry; ``entries.batch_index`` indexes the verified batch.
    """

    ids: tuple[Any, ...] = ()
    entries: BadEntries = field(default_factory=_empty_entries)

    @property
    def ok(self) -> bool:
        return self.entries.num_bad == 0

    @property
    def failed(self) -> tuple[Any, ...]:
        order = np.unique(self.entries.batch_index)
        return tuple(self.ids[i] for i in order.tolist())

    def reasons(self) -> dict[Any, str]:
        """One readable line per failed request: its first bad entry and how many there are."""
        out: dict[Any, str] = {}
        e = self.entries
        for i in np.unique(e.batch_index).tolist():
            k = int(np.flatnonzero(e.batch_index == i)[0])
            n = int(np.count_nonzero(e.batch_index == i))
            out[self.ids[i]] = (
                f"{Reason.NAMES[int(e.reason[k])]}: position {int(e.position[k])}, page "
                f"{int(e.page[k])}, expected tag {int(e.expected_tag[k])}, found tag "
                f"{int(e.found_tag[k])} ({n} bad entr{'y' if n == 1 else 'ies'})"
            )
        return out


@runtime_checkable
class Tracker(Protocol):
    """What a manager needs from a tracker. Callers skip all tracker work when not ``enabled``."""

    enabled: bool

    def record(self, rows: npt.ArrayLike, positions: npt.ArrayLike, tags: npt.ArrayLike) -> None:
        """Remember that ``rows[i]`` maps, at ``positions[i]``, a page whose tag is ``tags[i]``."""

    def forget(self, rows: npt.ArrayLike) -> None:
        """Drop everything recorded for these rows (the request was released)."""

    def verify(
        self,
        rows: npt.ArrayLike,
        num_pages: Any,
        tags: Any,
        *,
        block_table: Any = None,
        kv_indptr: Any = None,
        kv_indices: Any = None,
        ids: tuple[Any, ...] | None = None,
    ) -> IntegrityReport:
        """Check the metadata the kernel will read for ``rows``."""
        ...


class NoOpTracker:
    """Records nothing, checks nothing, costs nothing. The default."""

    enabled = False

    def record(self, rows: npt.ArrayLike, positions: npt.ArrayLike, tags: npt.ArrayLike) -> None:
        pass

    def forget(self, rows: npt.ArrayLike) -> None:
        pass

    def verify(
        self,
        rows: npt.ArrayLike,
        num_pages: Any,
        tags: Any,
        *,
        block_table: Any = None,
        kv_indptr: Any = None,
        kv_indices: Any = None,
        ids: tuple[Any, ...] | None = None,
    ) -> IntegrityReport:
        return IntegrityReport()


class CheckingTracker:
    """Records the expected tag of every (request row, page position) and verifies batches.

    Parameters
    ----------
    max_seqs, max_pages_per_seq: the shape of the page table it shadows.
    paranoid: a manager using this tracker runs the full check beside every fast verification
        and raises :class:`~kvmem.errors.IntegrityError` if they disagree (for tests and
        fuzzing: it costs a full check per step).

    Attributes
    ----------
    expected_tags: ``[max_seqs, max_pages_per_seq]``, int64, read-only — 0 where nothing is
        recorded
    versions: ``[max_seqs]``, int64, read-only — changes when ``record``/``forget`` touch a row
    num_changes: how many ``record``/``forget`` calls so far
    """

    enabled = True

    def __init__(self, max_seqs: int, max_pages_per_seq: int, paranoid: bool = False) -> None:
        max_seqs = integer(max_seqs, "max_seqs", minimum=1)
        max_pages_per_seq = integer(max_pages_per_seq, "max_pages_per_seq", minimum=1)
        self.paranoid = flag(paranoid, "paranoid")
        self._expected = np.zeros((int(max_seqs), int(max_pages_per_seq)), dtype=np.int64)
        self._flat = self._expected.reshape(-1)  # (row, position) at row * width + position
        self._versions = np.zeros(int(max_seqs), dtype=np.int64)
        self.num_changes = 0
        self.claimed = False  # set by the manager that records its rows here
        self.expected_tags = self._expected.view()
        self.expected_tags.flags.writeable = False
        self.versions = self._versions.view()
        self.versions.flags.writeable = False

    def _rows(self, rows: npt.ArrayLike) -> npt.NDArray[np.intp]:
        return index_array(rows, "rows", bound=self._expected.shape[0], what="row").astype(np.intp)

    def _bump(self, rows: npt.NDArray[np.intp]) -> None:
        self.num_changes += 1
        self._versions[rows] = self.num_changes

    def record(self, rows: npt.ArrayLike, positions: npt.ArrayLike, tags: npt.ArrayLike) -> None:
        rows_i = self._rows(rows)
        pos = index_array(positions, "positions", bound=self._expected.shape[1], what="position")
        tags_i = index_array(tags, "tags", what="tag")
        if not rows_i.size == pos.size == tags_i.size:
            raise ArgumentError(f"record() got {rows_i.size} rows, {pos.size} positions and "
                                f"{tags_i.size} tags: give one position and one tag per row "
                                "entry. Nothing was changed.")
        self._expected[rows_i, pos] = tags_i
        self._bump(np.unique(rows_i))

    def record_row(self, row: int, tags: npt.NDArray[np.int64]) -> None:
        """A new row's recorded tags, positions ``0 .. len(tags) - 1`` (the rest 0): the
        manager's call for a row it just opened."""
        self._expected[row, : tags.size] = tags  # (the rest is 0: cleared when it closed)

    def clear_row(self, row: int) -> None:
        """Drop a row's recorded tags: the manager's call for a row it closes."""
        self._expected[row] = 0

    def append(self, flat_positions: npt.NDArray[np.integer], tags: npt.NDArray[np.int64]) -> None:
        """Record pages a row gained past the ones it had (``flat_positions``: ``row * width +
        position``): a verifier checks entries it has not proved in full, so no version
        changes. The manager's per-step path; it never calls this for a position it had."""
        self._flat[flat_positions] = tags

    def forget(self, rows: npt.ArrayLike) -> None:
        rows_i = self._rows(rows)
        self._expected[rows_i] = 0
        self._bump(np.unique(rows_i))

    def verify(
        self,
        rows: npt.ArrayLike,
        num_pages: Any,
        tags: Any,
        *,
        block_table: Any = None,
        kv_indptr: Any = None,
        kv_indices: Any = None,
        ids: tuple[Any, ...] | None = None,
    ) -> IntegrityReport:
        """Check one batch's metadata against the recorded tags, in one vectorized pass.

        Give either ``block_table`` (``[B, W]`` int32, PAD past each row's pages) or CSR
        (``kv_indptr [B+1]``, ``kv_indices [nnz]``, int32): the very arrays the kernel reads.
        numpy arrays are checked with numpy; torch tensors on their own device.

        Parameters
        ----------
        rows: ``[B]`` — page-table rows of the batch
        num_pages: ``[B]`` — pages the kernel will read per row
        tags: ``[num_physical_pages]``, int64 — live tags (the allocator's, or a device mirror)
        ids: labels for the report (request ids); defaults to ``rows``
        """
        if (block_table is None) == (kv_indptr is None and kv_indices is None):
            raise MetadataError("verify() needs exactly one of block_table or kv_indptr + "
                                "kv_indices; nothing was checked")
        rows = self._rows(rows)
        if not isinstance(tags, np.ndarray) and not hasattr(tags, "device"):
            raise ArgumentTypeError(f"tags={show(tags)}: expected the live tags as an int64 "
                                    "numpy array or torch tensor (allocator.tags, pool.tags)")
        tensor_counts = not isinstance(num_pages, np.ndarray) and hasattr(num_pages, "device")
        if not tensor_counts:
            num_pages = np.asarray(num_pages)
            if num_pages.size == 0:  # (np.asarray([]) is float64)
                num_pages = num_pages.astype(np.int64)
        if tuple(num_pages.shape) != rows.shape:
            raise ArgumentError(f"num_pages has shape {tuple(num_pages.shape)}: expected "
                                f"{rows.shape}, one count per row. Nothing was checked.")
        require_int_array("num_pages", num_pages, rows.shape)
        if ids is not None:
            ids = id_tuple(ids, "ids")  # ("ab" is one label, not two: refused)
        if ids is not None and len(ids) != rows.size:
            raise ArgumentError(f"ids lists {len(ids)} labels for {rows.size} rows: give one "
                                "per row, in batch order. Nothing was checked.")
        if block_table is not None:
            validate_block_table(block_table, rows.size)
        else:
            validate_csr(kv_indptr, kv_indices, rows.size)
        # Gather only the columns the metadata can reach (CSR: the longest row it lists).
        if block_table is not None:
            width = block_table.shape[1]
        else:
            counts = kv_indptr[1:] - kv_indptr[:-1]
            width = int(counts.max()) if counts.shape[0] else 0
        expected = self.expected_tags[rows, : min(width, self.expected_tags.shape[1])]
        if isinstance(tags, np.ndarray):
            num_pages = num_pages.cpu().numpy() if tensor_counts else num_pages
            if block_table is not None:
                entries = check_block_table(block_table, num_pages, expected, tags)
            else:
                entries = check_csr(kv_indptr, kv_indices, num_pages, expected, tags)
        else:
            import torch

            device = tags.device
            expected_t = torch.as_tensor(expected, device=device)
            num_pages_t = torch.as_tensor(num_pages, device=device)
            if block_table is not None:
                entries = check_block_table_torch(block_table, num_pages_t, expected_t, tags)
            else:
                entries = check_csr_torch(kv_indptr, kv_indices, num_pages_t, expected_t, tags)
        return IntegrityReport(tuple(rows.tolist()) if ids is None else tuple(ids), entries)
