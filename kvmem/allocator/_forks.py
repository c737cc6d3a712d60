"""Forks: a request started as a copy of another, and the copy-on-write room it was promised.

A fork shares every page of its parent that holds tokens and gets pages of its own for the
parent's reserved room. When the parent's last page is partly filled, both will write into it:
the first write of each but the last writer gets a copy (copy-on-write, in ``Reserver``), and
the page for that copy is promised at the fork, so that a later step never runs short::

    parent   | p0 | p1 (9/16) | r0 |          r0: reserved room (no tokens yet)
    child    | p0 | p1 (9/16) | r0' |         p0, p1 shared; r0' its own; one copy promised

:class:`Forks` is the one owner of that promise: :meth:`Forks.promised` counts it from the page
table's forked rows (``Pages.available`` subtracts it), and :meth:`Forks.candidates` finds the
writes that redeem it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvmem.allocator._page_table import PageTable
from kvmem.allocator._pages import Pages

__all__ = ["Forks"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]


class Forks:
    """Forks of a page table's rows and the copy-on-write copies they promised.

    Parameters
    ----------
    table: the page table (its ``forked`` rows mark a partly filled tail a fork may share).
    """

    def __init__(self, table: PageTable) -> None:
        self.table = table

    def pages_needed(self, row: int) -> int:
        """Pages a fork of ``row`` takes now: its own for the row's unfilled room, and the
        copy-on-write copy a shared, partly filled tail will need."""
        t = self.table
        ntok = int(t.num_tokens[row])
        used = -(-ntok // t.page_size)
        return int(t.num_pages[row]) - used + (1 if ntok % t.page_size else 0)

    def fork(self, row: int, pages: Pages) -> tuple[int, Int32Array, Int32Array]:
        """Open a row that copies ``row``: (the new row, the pages it maps, those of them
        allocated for it). Raises OutOfPagesError or KVMemError (no free row), changing
        nothing. A fork happens between steps: the parent's writes are done."""
        t = self.table
        pages.require(self.pages_needed(row))
        ntok = int(t.num_tokens[row])
        used = -(-ntok // t.page_size)
        ns = int(t.namespace_ids[row])
        shared = t.pages[row, :used].copy()
        pages.allocator.share(shared)
        own = pages.allocate(int(t.num_pages[row]) - used, ns)
        mapped = np.concatenate([shared, own])
        child = t.open_row(mapped, ntok, int(t.num_committed[row]), ns, t.prefix_keys[row])
        t.writes_done(row)
        if ntok % t.page_size:  # both now write into one partly filled page: copy-on-write
            t.set_forked(np.array([row, child]), True)
        return child, mapped, own

    def promised(self, pages: Pages) -> int:
        """Copy-on-write copies still to come: per partly filled tail page that forked rows
        share, one copy per writer but the last (the pages the forks promised)."""
        t = self.table
        if not t.num_forked:
            return 0
        rows = t.forked.nonzero()[0]
        tails = np.unique(t.pages[rows, t.num_tokens[rows] // t.page_size])
        tails = tails[(tails >= 0) & (tails < pages.num_pages)]
        return int(np.maximum(pages.writers(tails).astype(np.int64) - 1, 0).sum())

    def candidates(self, rows: IntpArray, n: Int64Array | int, pages: Pages
                   ) -> tuple[IntpArray, Int64Array, Int32Array] | None:
        """Rows whose next write lands in a shared, partly filled page: (rows, columns, pages).

        Only a fork shares a partly filled page (cached prefix pages are full, and a prompt's
        last token always lands in a page of its own), so only rows marked at a fork are looked
        at; a batch without forks pays one check.
        """
        t = self.table
        if not t.num_forked:
            return None
        forked = t.forked[rows] & (np.asarray(n) > 0)
        if not forked.any():
            return None
        r = rows[forked]
        tok = t.num_tokens[r]
        partial = tok % t.page_size != 0
        r, cols = r[partial], tok[partial] // t.page_size
        tails = t.pages[r, cols]
        holders = pages.writers(tails)
        shared = holders > 1
        if not shared.any():
            return None
        r, cols, tails, holders = r[shared], cols[shared], tails[shared], holders[shared]
        # When every holder of a page writes into it this step, the first keeps it.
        _, first, count = np.unique(tails, return_index=True, return_counts=True)
        whole = first[count == holders[first]]
        if whole.size:
            keep = np.ones(tails.size, dtype=bool)
            keep[whole] = False
            r, cols, tails = r[keep], cols[keep], tails[keep]
        return (r, cols, tails) if tails.size else None
