"""The transfer oracles: what must hold when pages move from another manager (a prefill pool)
into the fuzzed one (a decode pool), whatever the interleaving.

=====================  ======================================================================
``transfer_lifetime``  no step reads bytes that a transfer read from a source page whose
                       lifetime ended (its tag changed in the source manager) before the read
                       completed: no token is generated from them, and no prefix hit serves
                       them (a step that rewrites the slots first clears them)
``leases``             when nothing is in flight, the source manager holds no lease, no
                       request, and passes ``check()``
=====================  ======================================================================

Each is checked against ground truth the fuzzer reads itself: the source allocator's tags when
the read was posted and when it landed, the fuzzed manager's tags, the launched steps' CSR.
Destination pages reused while a read into them is pending are ``happens_before``'s (the
timeline guards a transfer's pages until it lands).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import IntegrityError
from kvmem.testing._launch import Launch
from kvmem.testing._oracles import FuzzFailure, OracleSet

__all__ = ["TransferOracles"]

Int64Array = npt.NDArray[np.int64]


class TransferOracles:
    """The transfer oracles over a source manager (``source``) and the fuzzed manager (``dest``).

    The fuzzer calls :meth:`posted` when a transfer op is launched, :meth:`after_move` after
    every move, :meth:`landed` when the op lands, :meth:`check_launch` for every step launched
    on ``dest``, and :meth:`full_check` with the timeline's. :meth:`new_source` follows a
    replacement source (the old one was killed: its reads fail, its state is gone).
    """

    def __init__(self, source: Any, dest: Any) -> None:
        self.dest = dest
        self.P = int(dest.page_size)
        self.taint = np.zeros(int(dest.num_pages) * self.P, dtype=bool)  # per dest slot
        self.taint_tag = np.zeros(int(dest.num_pages), dtype=np.int64)  # dest tag when tainted
        self.why: dict[int, str] = {}  # dest page -> what ended under the read
        self.counts = {"transfers": 0, "tainted": 0, "launch_checks": 0}
        self.new_source(source)

    def new_source(self, source: Any) -> None:
        self.source = source
        self.source_pages = OracleSet(source)  # no request maps a page between moves
        self._pending: dict[int, tuple[Launch, Any, Int64Array, Int64Array, str]] = {}

    def posted(self, op: Launch) -> None:
        """``op`` (a transfer) reads ``op.source_pages`` of the source: note their lifetimes
        (``op.source_tags``, the lifetimes the offer named, where given)."""
        pages = op.source_pages
        tags = (self.source.allocator.tags[pages].copy() if op.source_tags is None
                else op.source_tags)
        self._pending[id(op)] = (op, self.source, pages, tags, "")
        self.counts["transfers"] += 1

    def after_move(self) -> None:
        """Note the pending reads whose source pages changed lifetime; check the source's
        pages (tags, refcounts against leases and cache, conservation)."""
        for key, (op, src, pages, tags, why) in self._pending.items():
            if why:
                continue
            now = src.allocator.tags[pages]
            changed = (now != tags).nonzero()[0]
            if changed.size:
                i = int(changed[0])
                self._pending[key] = (op, src, pages, tags,
                                      f"source page {int(pages[i])} went from tag {int(tags[i])} "
                                      f"to {int(now[i])} before the read completed")
        self.source_pages.check_pages()

    def landed(self, op: Launch, ok: bool) -> None:
        """``op`` landed (``ok``: its bytes moved; a failed read moved none)."""
        self.after_move()
        entry = self._pending.pop(id(op), None)
        if entry is None or not ok or not entry[4]:
            return
        slots = op.slot_mapping
        self.taint[slots] = True
        pages = np.unique(slots // self.P)
        self.taint_tag[pages] = self.dest.allocator.tags[pages]
        for p in pages.tolist():
            self.why[p] = entry[4]
        self.counts["tainted"] += 1

    def failed(self, op: Launch) -> None:
        """``op`` will never land (its source died): nothing it names is read."""
        self._pending.pop(id(op), None)

    def check_launch(self, op: Launch) -> None:
        """The step ``op`` reads its old positions (``< starts``) through its CSR: none may hold
        tainted bytes. Then its own writes clear the slots they write."""
        self.counts["launch_checks"] += 1
        P = self.P
        pages, indptr = op.kv_indices, op.kv_indptr
        if pages.size and self.taint.any():
            counts = indptr[1:] - indptr[:-1]
            b = np.repeat(np.arange(counts.size), counts)
            col = np.arange(pages.size) - indptr[:-1][b]
            pos = col[:, None] * P + np.arange(P)
            slots = pages[:, None] * P + np.arange(P)
            live = self.dest.allocator.tags[pages] == self.taint_tag[pages]
            bad = (pos < op.starts[b][:, None]) & self.taint[slots] & live[:, None]
            if bad.any():
                i, j = (int(x[0]) for x in np.nonzero(bad))
                page = int(pages[i])
                raise FuzzFailure(
                    "transfer_lifetime", f"{op!r}: request {op.request_ids[int(b[i])]!r} reads "
                    f"position {int(pos[i, j])} from page {page}, which a transfer filled "
                    f"although its {self.why.get(page, 'source ended')}: a token is generated "
                    "from bytes of a lifetime that had ended")
        self.taint[op.slot_mapping] = False

    def full_check(self, idle: bool) -> None:
        """The source's bookkeeping; with ``idle`` (nothing in flight, nothing to process), no
        lease and no request left there."""
        self.after_move()  # (a full check may come within a move, before its page check)
        src = self.source
        try:
            src.check()
        except IntegrityError as e:
            raise FuzzFailure("check", f"source manager: {e}") from None
        self.source_pages.full_check()
        if idle:
            leases = src.fences.leases
            left = list(src.running) + list(src.preempted)
            if leases or left:
                raise FuzzFailure(
                    "leases", f"nothing is in flight, but the source manager holds leases "
                    f"{list(leases)[:8]} and requests {left[:8]}: their pages are stranded")
