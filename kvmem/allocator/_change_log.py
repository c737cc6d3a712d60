"""ChangeLog: the pages whose tag changed, in order, for several readers at once.

Whoever follows the allocator's tags (a device mirror of them, an incremental verifier) asks
for a :class:`ChangeReader` of its own. Each reader has its own cursor, so no reader can hide
a change from another by reading it first::

    entries   [p0 p1] [p2] [p3 p4 p5] [p6]        arrays of pages, as the allocator logged them
                        ^ reader A     ^ reader B  (each reads from its cursor to the end)

Entries are dropped when more than ``limit`` are kept: those every reader has read, and at
least the older half. A reader that falls that far behind loses its place: its next
:meth:`ChangeReader.read` returns None, meaning "anything may have changed" (start over from
the full state). With no reader, logging costs nothing.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["ChangeLog", "ChangeReader"]

PageIds = npt.NDArray[np.int32]


class ChangeReader:
    """One reader's cursor into a :class:`ChangeLog` (get one from :meth:`ChangeLog.reader`)."""

    __slots__ = ("_log", "position")

    def __init__(self, log: ChangeLog, position: int) -> None:
        self._log = log
        self.position = position  # absolute index of the next entry to read; -1: lost

    def read(self) -> list[PageIds] | None:
        """The arrays of pages logged since this reader's last read (in order, possibly
        overlapping), or None if the reader fell behind and lost some (assume every page
        changed). Moves the cursor to the end."""
        return self._log._read(self)

    def read_pages(self) -> PageIds | None:
        """:meth:`read` as one array of distinct pages (int32, ascending), or None."""
        got = self.read()
        if got is None:
            return None
        return np.unique(np.concatenate(got)) if got else np.empty(0, dtype=np.int32)


class ChangeLog:
    """An append-only log of page arrays with a cursor per reader.

    Parameters
    ----------
    limit: entries kept for the slowest reader before it loses its place.
    """

    def __init__(self, limit: int = 4096) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._entries: list[PageIds] = []
        self._start = 0  # absolute index of _entries[0]
        self._end = 0  # absolute index past the last entry
        self._readers: list[ChangeReader] = []  # (few, and as long-lived as the log)
        self._num_logged = 0  # every append, read or not

    def reader(self) -> ChangeReader:
        """A new reader whose first read returns what is logged from now on."""
        reader = ChangeReader(self, self._end)
        self._readers.append(reader)
        return reader

    @property
    def num_logged(self) -> int:
        """How many arrays were ever appended: an epoch of the pages' lifetimes (unchanged
        means no page was allocated or freed since it was read)."""
        return self._num_logged

    def append(self, pages: PageIds) -> None:
        """Log an array of pages whose tag changed (kept as given: do not modify it later)."""
        self._num_logged += 1
        if not self._readers:
            return
        self._entries.append(pages)
        self._end += 1
        if len(self._entries) > self.limit:  # the slowest readers lose their place
            self._trim(max(self._start + len(self._entries) // 2, min(
                (r.position for r in self._readers if r.position >= 0), default=self._end)))

    def _read(self, reader: ChangeReader) -> list[PageIds] | None:
        at = reader.position
        reader.position = self._end
        if at < 0:
            return None
        return self._entries[at - self._start :]

    def _trim(self, upto: int) -> None:
        """Drop entries before absolute index ``upto``; readers still behind it lose place."""
        if upto <= self._start:
            return
        del self._entries[: upto - self._start]
        self._start = upto
        for r in self._readers:
            if 0 <= r.position < upto:
                r.position = -1
