"""The bookkeeping invariants of a manager's pages and rows, checked in full (``check()``).

::

    allocator        its own invariants (free stack, refcounts, tags)
    holders          each page's refcount == rows mapping it + the cache + fence holds
    conservation     free + used + cached + fenced == num_pages, no page in two classes
    rows             every page a row maps holds the row's namespace's content;
                     committed <= reserved <= mapped slots
    cache            the prefix cache's own invariants; cached pages agree on namespace

Every page is in exactly one class: free, used (a row maps it), cached (the prefix cache
remembers it and no row maps it), fenced (held only by a fence).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.allocator._page_table import PageTable
from kvmem.allocator._pages import Pages
from kvmem.errors import IntegrityError

__all__ = ["page_classes", "problems"]

Mask = npt.NDArray[np.bool_]


def _cached_mask(pages: Pages) -> Mask:
    if pages.cache is None:
        return np.zeros(pages.num_pages, dtype=bool)
    return pages.cache.is_cached(np.arange(pages.num_pages, dtype=np.int32))


def page_classes(pages: Pages) -> tuple[Mask, Mask, Mask]:
    """(used, cached, fenced) masks ``[num_pages]``; the pages in none are free."""
    rc = pages.allocator.refcounts
    cached = _cached_mask(pages)
    held = pages.fences.held
    used = rc - held - cached > 0
    return used, ~used & cached, ~used & ~cached & (held > 0)


def problems(pages: Pages, table: PageTable, rows: Iterable[tuple[Any, int]]) -> list[str]:
    """One line per broken invariant (empty when sound); ``rows``: (request id, row) of every
    running request."""
    out: list[str] = []
    try:
        pages.allocator.check()
    except IntegrityError as e:
        out.append(str(e))
    rows = list(rows)
    n = pages.num_pages
    mapped = (np.concatenate([table.row_pages(r) for _, r in rows]) if rows
              else np.empty(0, dtype=np.int32))
    row_holders = np.bincount(mapped[(mapped >= 0) & (mapped < n)], minlength=n)[:n]
    cached = _cached_mask(pages)
    holders = row_holders + cached + pages.fences.held
    bad = np.flatnonzero(holders != pages.allocator.refcounts)
    if bad.size:
        out.append(f"refcounts {pages.allocator.refcounts[bad].tolist()[:8]} of pages "
                   f"{bad.tolist()[:8]} differ from their holders {holders[bad].tolist()[:8]}")
    out.extend(_conservation(pages, row_holders > 0, cached))
    out.extend(_row_problems(pages, table, rows))
    cache = pages.cache
    if cache is not None:
        cpages = np.flatnonzero(cached)
        if hasattr(cache, "namespaces_of"):
            wrong = cpages[cache.namespaces_of(cpages) != pages.namespace_ids[cpages]]
            if wrong.size:
                out.append(f"cached pages {wrong.tolist()[:8]} disagree on namespace")
        if hasattr(cache, "check"):
            out.extend(cache.check())
    return out


def _conservation(pages: Pages, mapped: Mask, cached: Mask) -> list[str]:
    """free + used + cached + fenced == num_pages, each class from its holders (a row maps
    it; the cache; a fence), not from the refcount: a page whose references outlive every
    holder is in no class (a leak, BUGS.md 2), and a free page with a holder is in two
    (BUGS.md 15)."""
    n = pages.num_pages
    free = pages.allocator.refcounts == 0
    held = pages.fences.held > 0
    used = mapped
    in_cache = ~used & cached
    fenced = ~used & ~cached & held
    out = []
    total = pages.allocator.num_free + int(used.sum() + in_cache.sum() + fenced.sum())
    if total != n:
        lost = np.flatnonzero(~free & ~used & ~cached & ~held)
        out.append(f"conservation: free + used + cached + fenced = {total} != {n} pages; "
                   f"pages {lost.tolist()[:8]} are held by no row, cache or fence (leaked)")
    twice = np.flatnonzero(free & (used | cached | held))
    if twice.size:
        out.append(f"pages {twice.tolist()[:8]} are free and held at once")
    return out


def _row_problems(pages: Pages, table: PageTable, rows: list[tuple[Any, int]]) -> list[str]:
    out = []
    for rid, row in rows:
        mapped = table.row_pages(row)
        ok = (mapped >= 0) & (mapped < pages.num_pages)
        foreign = np.concatenate([mapped[~ok], mapped[ok][
            pages.namespace_ids[mapped[ok]] != table.namespace_ids[row]]])
        if foreign.size:
            out.append(f"request {rid!r} maps pages {foreign.tolist()[:8]} of another "
                       "namespace (or none)")
        if not (table.num_committed[row] <= table.num_tokens[row]
                <= table.num_pages[row] * table.page_size):
            out.append(f"request {rid!r}: committed {table.num_committed[row]} > reserved "
                       f"{table.num_tokens[row]} or beyond its pages")
    return out
