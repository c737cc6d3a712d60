"""Recorder: a manager's side of its tracker, the one place outside a tracker that knows which
kind of tracker it is.

A manager records, for every page a row maps, the qualified tag the page carries then; the
verifier reads what was recorded. The :class:`~kvmem.integrity.Tracker` protocol
(``record``/``forget``/``verify``) is what any tracker offers; a :class:`CheckingTracker` also
offers the row-lifecycle calls (``record_row``, ``clear_row``, ``append``) that bump no version,
and read-only views of its arrays. :class:`Recorder` calls whichever the tracker has, so that
nothing else asks what a tracker is; it writes nothing itself (the tracker is the one writer of
its arrays).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError, ArgumentTypeError
from kvmem.integrity._ownership import owned_pages, row_is_own
from kvmem.integrity._tracker import CheckingTracker, NoOpTracker, Tracker

__all__ = ["Recorder", "tracker_for"]

Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]


def tracker_for(spec: Tracker | str | None, max_seqs: int, max_pages_per_seq: int) -> Tracker:
    """The tracker a manager of this shape uses for ``spec``: None (a :class:`NoOpTracker`),
    ``"checking"``, ``"paranoid"`` or a :class:`Tracker` no other manager claimed (a checking
    one shaped ``[>= max_seqs, >= max_pages_per_seq]``). Raises ArgumentError /
    ArgumentTypeError otherwise."""
    if spec is None:
        return NoOpTracker()
    if isinstance(spec, str):
        if spec not in ("checking", "paranoid"):
            raise ArgumentError(f"tracker={spec!r} is not known; use 'checking', 'paranoid' or "
                                "a Tracker")
        return CheckingTracker(max_seqs, max_pages_per_seq, paranoid=spec == "paranoid")
    if not isinstance(spec, Tracker):
        raise ArgumentTypeError(f"tracker must be 'checking', 'paranoid', None or a Tracker, got "
                                f"{type(spec).__name__}")
    if getattr(spec, "claimed", False):
        raise ArgumentError("this tracker already records another manager's rows (the two "
                            "would overwrite each other's expected tags); make one per manager")
    expected = getattr(spec, "expected_tags", None)
    if expected is not None and (
        expected.shape[0] < max_seqs or expected.shape[1] < max_pages_per_seq
    ):
        raise ArgumentError(
            f"the tracker records {expected.shape} (rows, pages) but the manager needs "
            f"({max_seqs}, {max_pages_per_seq}); build it with "
            "CheckingTracker(max_seqs, max_pages_per_seq) or pass tracker='checking'"
        )
    return spec


class Recorder:
    """What a manager's rows record in its tracker, and what the verifier reads back.

    Parameters
    ----------
    tracker: the manager's tracker.
    max_pages_per_seq: the page table's width (flat positions are ``row * width + column``).

    Attributes
    ----------
    enabled: the tracker records (callers skip building tags when False)
    paranoid: a checking tracker in paranoid mode
    expected_tags: ``[rows, width]``, int64, read-only — a checking tracker's records (else None)
    versions: ``[rows]``, int64, read-only — its per-row versions (else None)
    expected_flat: ``expected_tags`` as ``[max_seqs * max_pages_per_seq]`` when the tracker has
        the table's width (else None): what a CSR splice snapshots for its new entries
    """

    def __init__(self, tracker: Tracker, max_pages_per_seq: int) -> None:
        self.tracker = tracker
        self.enabled = bool(tracker.enabled)
        checking = tracker if isinstance(tracker, CheckingTracker) else None
        self._checking = checking
        self.paranoid = checking is not None and checking.paranoid
        self.expected_tags: Int64Array | None = None
        self.versions: Int64Array | None = None
        self.expected_flat: Int64Array | None = None
        self._width = max_pages_per_seq
        self._same_width = True
        if checking is not None:
            self.expected_tags = checking.expected_tags
            self.versions = checking.versions
            self._width = checking.expected_tags.shape[1]
            self._same_width = self._width == max_pages_per_seq
            if self._same_width:
                self.expected_flat = checking.expected_tags.reshape(-1)

    @property
    def num_changes(self) -> int:
        """The checking tracker's count of ``record``/``forget`` calls (-1 without one)."""
        return -1 if self._checking is None else self._checking.num_changes

    def claim(self) -> None:
        """Mark a checking tracker as this manager's (``tracker_for`` refuses it to another)."""
        if self._checking is not None:
            self._checking.claimed = True

    def record_row(self, row: int, tags: Int64Array) -> None:
        """A row just opened maps pages whose qualified tags are ``tags`` (positions 0..)."""
        if self._checking is not None:
            self._checking.record_row(row, tags)
        elif self.enabled:
            self.tracker.record(np.full(tags.size, row), np.arange(tags.size), tags)

    def clear_row(self, row: int) -> None:
        """A row closes: drop what it recorded."""
        if self._checking is not None:
            self._checking.clear_row(row)
        elif self.enabled:
            self.tracker.forget([row])

    def truncate(self, row: int, num_pages: int, tags: Int64Array) -> None:
        """A row keeps only its first ``num_pages`` pages, whose qualified tags it recorded as
        ``tags`` (``[num_pages]``): what it recorded past them is dropped."""
        if self.enabled:
            self.clear_row(row)
            self.record_row(row, tags)

    def append(self, rows: IntpArray, cols: npt.NDArray[np.integer],
               flat_at: npt.NDArray[np.integer], tags: Int64Array) -> None:
        """Rows gained pages past the ones they had, at columns ``cols`` (``flat_at``: ``row *
        max_pages_per_seq + col``, which the caller has at hand)."""
        if self._checking is not None:
            if not self._same_width:
                flat_at = rows * self._width + cols
            self._checking.append(flat_at, tags)
        elif self.enabled:
            self.tracker.record(rows, cols, tags)

    def replace(self, rows: IntpArray, cols: npt.NDArray[np.integer], tags: Int64Array) -> None:
        """Rows map other pages at columns they had (copy-on-write): a change a verifier's
        proof must see (the tracker bumps the rows' versions)."""
        if self.enabled:
            self.tracker.record(rows, cols, tags)

    def recorded(self, row: int, num: int) -> Int64Array | None:
        """The qualified tags recorded at a row's first ``num`` positions (None: the tracker
        keeps none the manager can read)."""
        if self.expected_tags is None:
            return None
        return self.expected_tags[row, :num]

    def holds(self, row: int, pages: npt.NDArray[np.integer], tags: Int64Array) -> bool:
        """Whether a row's ``pages`` are the ones it recorded (``row_is_own``; True when
        nothing readable was recorded)."""
        recorded = self.recorded(row, pages.size)
        return recorded is None or row_is_own(pages, recorded, tags)

    def owned_pages(self, row: int, pages: npt.NDArray[np.integer], allocator: Any
                    ) -> npt.NDArray[np.int64]:
        """(position, page) of each reference a row mapping ``pages`` really holds, given the
        allocator's ``tags`` and ``refcounts`` (``owned_pages``)."""
        return owned_pages(pages, self.recorded(row, pages.size), allocator.tags,
                           allocator.refcounts)

    def __repr__(self) -> str:
        return f"Recorder({self.tracker!r})"
