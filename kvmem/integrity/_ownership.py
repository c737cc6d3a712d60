"""What a request provably holds: its row's pages, checked against the tags it recorded.

A page-table row is the manager's claim of which pages a request maps; the tracker's record is
the request's own (the lifetime tag each page had when the request mapped it). When they
disagree (an entry overwritten, a page freed or reallocated behind the request's back), only
the record can be trusted to release the request's references::

    row        | p3 | p9 | p4 |          p9 overwritten behind the manager's back
    recorded   | t3 | t7 | t4 |          t7 is the tag of p1 now: the request holds p1
    -> owned   (0, p3) (1, p1) (2, p4)   p9 (another request's) is never dropped

A page freed behind the request's back (its tag 0, or another lifetime) is not held at all.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError
from kvmem.integrity._tags import raw_lifetime_of as lifetime_of

__all__ = ["owned_pages", "row_is_own"]

Int64Array = npt.NDArray[np.int64]
_min = np.minimum.reduce  # (the ufunc reductions: cheaper than ndarray.min())
_max = np.maximum.reduce


def row_is_own(pages: npt.NDArray[np.integer], recorded: Int64Array,
               tags: Int64Array) -> bool:
    """Whether every page of a row (``[k]``) carries the lifetime of its recorded qualified
    tag (``[k]``); ``tags``: the allocator's ``[num_pages]``."""
    if pages.size and (int(_min(pages)) < 0 or int(_max(pages)) >= tags.size):
        return False
    # (np.array_equal's conversions cost more than the comparison of a row's pages)
    want = lifetime_of(recorded)
    return pages.shape == want.shape and not np.count_nonzero(tags[pages] != want)


def owned_pages(pages: npt.NDArray[np.integer], recorded: Int64Array | None,
                tags: Int64Array, refcounts: npt.NDArray[np.integer]) -> Int64Array:
    """(position, page) of each reference a row really holds: ``[k, 2]``, int64.

    With ``recorded`` (the row's qualified tags, ``[len(pages)]``): an entry whose page does
    not carry its recorded lifetime is not the request's reference; the page that does carry
    it (lifetimes are unique) is, when it is live and not listed already (each page once: a
    recorded tag naming the lifetime of a page at another position of the row must not make
    the request free it twice). Without (no checking tracker): the row's live pages are
    trusted.
    """
    if recorded is not None and recorded.shape != pages.shape:
        raise ArgumentError(f"owned_pages got {pages.size} pages and recorded tags shaped "
                            f"{recorded.shape}: give one recorded tag per page of the row")
    pages = pages.astype(np.int64)
    positions = np.arange(pages.size)
    ok = (pages >= 0) & (pages < tags.size)
    if recorded is None:
        ok[ok] = refcounts[pages[ok]] > 0
        return np.stack([positions[ok], pages[ok]], axis=1)
    want = lifetime_of(recorded)
    ok[ok] = tags[pages[ok]] == want[ok]
    ok &= want > 0
    out = [np.stack([positions[ok], pages[ok]], axis=1)]
    owned = set(pages[ok].tolist())  # (a row holds a page once: never list one twice)
    for j in np.flatnonzero(~ok & (want > 0)).tolist():
        found = np.flatnonzero(tags == int(want[j]))
        if found.size == 1 and int(found[0]) not in owned:
            owned.add(int(found[0]))
            out.append(np.array([[j, int(found[0])]], dtype=np.int64))
    return np.concatenate(out)
