"""The full check of a batch (the verdict every form of ``verify`` returns), for each request:

* every page its metadata lists (CSR or block table) is in range, live, and carries the
  qualified tag the tracker recorded for ``(row, position)`` (``kvmem.integrity._tags``): the
  same lifetime and namespace as when the request mapped it; block-table padding is PAD;
* it lists as many pages as its tokens fill;
* the pages the step writes (its slot mapping's, else the slots the latest reserve handed
  out) each have one writer, and, given the step's fields, its slots and lengths are its own
  (``kvmem.integrity._step_checks``); without a slot mapping the step writes where the page
  table says, and each such write lands in the page the metadata lists for it.

Every failing request gets one readable reason and the position of its first bad page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from kvmem.integrity._check import Reason
from kvmem.integrity._metadata import Metadata
from kvmem.integrity._step_checks import (
    length_mismatches,
    ranges,
    slot_mismatches,
    table_slots,
    write_set,
)
from kvmem.integrity._tags import TagMirror
from kvmem.integrity._tags import raw_lifetime_of as lifetime_of
from kvmem.integrity._tags import raw_namespace_id_of as namespace_id_of
from kvmem.integrity._tracker import IntegrityReport, Tracker

__all__ = ["FullCheck", "Verdict", "Writers", "describe"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]
Writers = Callable[[npt.NDArray[np.integer]], npt.NDArray[np.integer]]


class Verdict(NamedTuple):
    """Per failing batch index: (first bad page position, one readable reason)."""

    failed: dict[int, tuple[int, str]]
    report: IntegrityReport | None = None

    @property
    def ok(self) -> bool:
        return not self.failed


class _Table(Protocol):
    """What the verifier reads of the page table (kvmem.PageTable)."""

    pages: Int32Array
    num_tokens: Int64Array
    num_committed: Int64Array
    write_from: Int64Array
    generation: Int64Array
    page_size: int


class FullCheck:
    """The full check of a manager's batches (see the module docstring).

    Parameters
    ----------
    tracker: the manager's tracker; table: the page table (rows, tokens, generations)
    mirror: the qualified tags (host and device copies)
    writers: ``pages -> [k]`` holders that may read or write each page's future slots
    """

    def __init__(self, tracker: Tracker, table: _Table, mirror: TagMirror,
                 writers: Writers) -> None:
        self.tracker = tracker
        self.table = table
        self.page_size = table.page_size
        self.mirror = mirror
        self.writers = writers
        self.num_pages = int(mirror.host.size)

    def full_check(self, ids: tuple[Any, ...], rows: IntpArray, md: Metadata) -> Verdict:
        """Every entry, the write set and (given) the step's slots and lengths; one reason per
        failing request. Changes nothing but the tag mirror."""
        t = self.table
        P = self.page_size
        qtags = self.mirror.sync()
        total = t.num_tokens[rows]
        num_pages = (total + P - 1) // P
        read = md.indices if md.indices is not None else md.block_table
        tags: Any = qtags
        if not isinstance(read, np.ndarray):  # tensors: on their device, against the mirror
            import torch

            tags = self.mirror.device
            if tags is None or tags.device != read.device:
                tags = torch.as_tensor(qtags, device=read.device)
        if md.indices is None:
            report = self.tracker.verify(rows, num_pages, tags, block_table=md.block_table,
                                         ids=ids)
        else:
            report = self.tracker.verify(rows, num_pages, tags, kv_indptr=md.indptr,
                                         kv_indices=md.indices, ids=ids)
        failed: dict[int, tuple[int, str]] = {}
        e = report.entries
        for k in np.argsort(e.position, kind="stable").tolist():
            i = int(e.batch_index[k])
            if i not in failed:
                failed[i] = (max(int(e.position[k]), 0),
                             describe(e, k, int(np.count_nonzero(e.batch_index == i))))
        for i, pos, reason in self._write_failures(rows, md):
            first, why = failed.get(i, (pos, reason))
            failed[i] = (min(first, pos), why)
        return Verdict(dict(sorted(failed.items())), None if report.ok else report)

    def _write_failures(self, rows: IntpArray, md: Metadata) -> list[tuple[int, int, str]]:
        """(batch index, page position, reason) of each failing write: a written page with
        another holder, a stray slot, lengths that are not the request's."""
        t = self.table
        P = self.page_size
        start = t.write_from[rows]
        total = t.num_tokens[rows]
        out: list[tuple[int, int, str]] = []
        wb, wpos, wpages = self.write_set(rows, md.fields)
        holders = self.writers(wpages)
        for k in np.flatnonzero(holders != 1).tolist():
            out.append((int(wb[k]), int(wpos[k]),
                        f"page {int(wpages[k])} at position {int(wpos[k])} is about to be "
                        f"written but has {int(holders[k])} holders (a shared page is written "
                        "only after copy-on-write)"))
        out.extend(self._table_write_failures(rows, md))
        if md.fields is None:
            return out
        first_new = start // P
        for i in length_mismatches(md.fields, total, total - start, P).tolist():
            out.append((i, int(first_new[i]),
                        "its step's lengths (seq_lens, kv_last_page_len, num_new_tokens or "
                        "qo_indptr) are not its own: a kernel would read past its tokens or "
                        "another request's queries"))
        if md.fields.get("slot_mapping") is not None:
            csr = {"kv_indptr": md.indptr, "kv_indices": md.indices} if md.indices is not None \
                else {"block_table": md.block_table}
            bad_b, bad_pos = slot_mismatches({**csr, "slot_mapping": md.fields["slot_mapping"]},
                                             start, total - start, P)
            for i, pos in zip(bad_b.tolist(), bad_pos.tolist()):
                out.append((i, pos, f"its slot mapping sends a token of page position {pos} "
                                    "outside the page its metadata lists there (another "
                                    "request's page, or the wrong slot)"))
        return out

    def _table_write_failures(self, rows: IntpArray, md: Metadata) -> list[tuple[int, int, str]]:
        """Without a slot mapping a step writes where the page table says: each such write
        must land in the page the metadata lists for it (a row entry changed after the
        metadata was built would send it into a page the request does not read, perhaps
        another request's, whose one holder is that request)."""
        if md.fields is not None and md.fields.get("slot_mapping") is not None:
            return []  # (a block table always comes with its slot mapping: this is a CSR)
        bad_b, bad_pos = self.table_write_mismatches(
            rows, {"kv_indptr": md.indptr, "kv_indices": md.indices})
        return [(i, pos, f"its page table sends a token of page position {pos} into a page its "
                         "metadata does not list there (a row entry changed after the metadata "
                         "was built)") for i, pos in zip(bad_b.tolist(), bad_pos.tolist())]

    def table_write_mismatches(self, rows: IntpArray, read: Mapping[str, Any]
                               ) -> tuple[Int64Array, Int64Array]:
        """(batch index, page position) of each write the page table sends (the step's new
        slots nobody committed yet) outside the page ``read`` lists there: ``read`` the CSR
        (``kv_indptr``, ``kv_indices``), numpy or tensors."""
        t = self.table
        done = np.maximum(t.num_committed[rows], t.write_from[rows])
        total = t.num_tokens[rows]
        slots: Any = table_slots(t.pages, rows, done, total, self.page_size)
        listed = read["kv_indices"]
        if not isinstance(listed, np.ndarray):  # tensors: compared on their device
            import torch

            slots = torch.as_tensor(slots, device=listed.device)
        return slot_mismatches({**read, "slot_mapping": slots}, done, total - done,
                               self.page_size)

    def write_set(self, rows: IntpArray, fields: Mapping[str, Any] | None
                  ) -> tuple[IntpArray, Int64Array, Int64Array]:
        """(batch index, page position, page) of each token the step is about to write: the
        slots its latest reserve handed out that nobody committed yet, in the pages the step's
        slot mapping names when given (slots out of range are left to the slot check), else in
        the page table's."""
        t = self.table
        P = self.page_size
        start = t.write_from[rows]
        done = np.maximum(t.num_committed[rows], start)
        total = t.num_tokens[rows]
        wb, wpos, wpages = write_set(t.pages, rows, done, total, P)
        slots = None if fields is None else fields.get("slot_mapping")
        if slots is None:
            return wb, wpos, wpages
        first = np.cumsum(total - start) - (total - start)  # each row's first slot index
        at = ranges(first + done - start, total - done)
        picked = slots[at] if isinstance(slots, np.ndarray) else slots[at].cpu().numpy()
        spages = np.asarray(picked, dtype=np.int64) // P
        ok = (spages >= 0) & (spages < self.num_pages)
        return wb[ok], wpos[ok], spages[ok]

def describe(e: Any, k: int, num_bad: int) -> str:
    """One readable line for bad entry ``k`` of :class:`BadEntries` (qualified tags decoded)."""
    reason, pos, page = int(e.reason[k]), int(e.position[k]), int(e.page[k])
    expected, found = int(e.expected_tag[k]), int(e.found_tag[k])
    more = f" ({num_bad} bad entries)" if num_bad > 1 else ""
    if reason == Reason.REALLOCATED and lifetime_of(expected) == lifetime_of(found):
        what = (f"page holds namespace {namespace_id_of(found)}'s content, the request is in "
                f"namespace {namespace_id_of(expected)}")
    elif reason == Reason.LENGTH:
        return f"{Reason.NAMES[reason]}{more}"
    else:
        what = Reason.NAMES.get(reason, f"reason {reason}")
        if expected > 0 and found > 0:
            what += f" (expected tag {lifetime_of(expected)}, found {lifetime_of(found)})"
    return f"{what}: position {pos}, page {page}{more}"
