"""WindowRow: one request's pages in a sliding-window group, and which of them it still reads.

::

    row index     0     1     2     3     4
    tokens       0..3  4..7  8..11 12..15 16..19      page_size 4, window 6
    pages        PAD   PAD   [ 17    40    22 ]       num_computed 14: the next query (14)
                 released    inside the window         reads keys 9..14, from row index 2

A query at position q reads keys ``q - window + 1 .. q``. Once ``num_computed`` tokens are
computed, every later query sits at ``num_computed`` or after, so a page whose last token is
before ``num_computed - window + 1`` is read by no one again: :meth:`WindowRow.advance`
hands it back once, for the caller to free (or to give to a prefix cache), and the kernel
metadata of later steps lists only the pages from the first one still read.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvmem._validate import integer
from kvmem.allocator._groups import SlidingWindowSpec, first_window_page
from kvmem.allocator._page_allocator import as_page_ids
from kvmem.errors import ArgumentError, ArgumentTypeError

__all__ = ["WindowRow"]

PageIds = npt.NDArray[np.int32]


class WindowRow:
    """The pages of one request in the sliding-window group ``spec``, in token order.

    Row index ``i`` holds tokens ``i * page_size .. (i + 1) * page_size - 1``. Pages before
    ``num_released`` have been handed back by :meth:`advance`; the rest are the row's.
    """

    def __init__(self, spec: SlidingWindowSpec) -> None:
        if not isinstance(spec, SlidingWindowSpec):
            raise ArgumentTypeError(f"spec={spec!r:.60}: expected a SlidingWindowSpec.")
        self.spec = spec
        self._pages: list[int] = []
        self.num_released = 0
        self.num_computed = 0

    @property
    def num_pages(self) -> int:
        """Row length in pages, released ones included."""
        return len(self._pages)

    def append(self, pages: npt.ArrayLike) -> None:
        """Add pages for the next token positions (the caller allocated them)."""
        self._pages.extend(as_page_ids(pages).tolist())

    def advance(self, num_computed: int) -> PageIds:
        """Record that ``num_computed`` tokens are computed; returns the row's pages that now
        lie wholly before the next query's window, each once (``[k]``, int32, in token order).

        ``num_computed`` never goes back and never passes the tokens the row's pages hold
        (ArgumentError, nothing changed).
        """
        capacity = len(self._pages) * self.spec.page_size
        num_computed = integer(num_computed, "num_computed", minimum=self.num_computed,
                               maximum=capacity)
        first = min(first_window_page(num_computed, self.spec.window, self.spec.page_size),
                    len(self._pages))
        self.num_computed = num_computed
        if first <= self.num_released:
            return np.empty(0, dtype=np.int32)
        out = np.array(self._pages[self.num_released : first], dtype=np.int32)
        self.num_released = first
        return out

    def kernel_pages(self, num_tokens: int | None = None) -> tuple[PageIds, int]:
        """The pages a step's kernel reads, and the row index of the first of them.

        The step's first query is at ``num_computed``; its tokens run to ``num_tokens``
        (default: every page of the row). Returns ``(pages [k] int32, first)``: the row's
        pages ``first .. ceil(num_tokens / page_size) - 1``, where ``first`` is the first
        page of the window; page ``pages[j]`` holds tokens from ``(first + j) * page_size``.
        """
        size = self.spec.page_size
        end = len(self._pages) if num_tokens is None else -(-integer(
            num_tokens, "num_tokens", minimum=self.num_computed) // size)
        if end > len(self._pages):
            raise ArgumentError(f"num_tokens={num_tokens}: the row's {len(self._pages)} pages "
                                f"hold {len(self._pages) * size} tokens; append pages first.")
        first = max(self.num_released,
                    first_window_page(self.num_computed, self.spec.window, size))
        first = min(first, end)
        return np.array(self._pages[first:end], dtype=np.int32), first

    def held_pages(self) -> PageIds:
        """``[k]``, int32: the pages the row still holds (not released), in token order."""
        return np.array(self._pages[self.num_released :], dtype=np.int32)
