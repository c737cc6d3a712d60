"""The manager's request registry: every request it knows, and the page-table row of each
running one (a preempted request holds no row; it keeps the tokens it will recompute)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import is_hashable, is_integer_like, show
from kvmem.errors import ArgumentError, ArgumentTypeError

__all__ = ["Request", "Requests", "repeated"]

Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]


@dataclass(slots=True)
class Request:
    namespace: Any
    namespace_id: int
    prompt: Int64Array  # the prompt token ids (a private copy)
    saved: Int64Array | None = None  # tokens to recompute on resume (set while preempted)


def repeated(ids: tuple[Any, ...]) -> Any:
    """The first id that appears twice in ``ids`` (which has one)."""
    return next(rid for i, rid in enumerate(ids) if rid in ids[:i])


def _not_hashable(request_id: Any) -> ArgumentError:
    return ArgumentError(f"a request id must be hashable (a str or an int), got "
                         f"{type(request_id).__name__}")


class Requests:
    """Known requests (running or preempted) and the rows of the running ones.

    Attributes
    ----------
    known: request id -> :class:`Request`, in the order they were admitted
    rows: running request id -> page-table row
    """

    def __init__(self, max_seqs: int) -> None:
        self.known: dict[Any, Request] = {}
        self.rows: dict[Any, int] = {}
        self._ids: list[Any] = [None] * max_seqs  # row -> running request id

    def is_known(self, request_id: Any) -> bool:
        """Whether the request is known; ArgumentError if the id is not a str or an int."""
        if not isinstance(request_id, str) and not is_integer_like(request_id):
            if not is_hashable(request_id):
                raise _not_hashable(request_id)
            raise ArgumentTypeError(f"request_id={show(request_id)}: expected a str or an int "
                                    "(or numpy integer; not bool, float, bytes or None)")
        try:
            return request_id in self.known
        except TypeError:
            raise _not_hashable(request_id) from None

    def row_of(self, request_id: Any) -> int:
        """The row of a running request; ArgumentError naming its state otherwise."""
        hashable = is_hashable(request_id)
        row = self.rows.get(request_id) if hashable else None
        if row is None:
            state = ("preempted" if hashable and request_id in self.known
                     else "unknown or released")
            raise ArgumentError(
                f"request {request_id!r} is not running ({state}); admit or resume it first"
            )
        return row

    def rows_of(self, ids: tuple[Any, ...], what: str) -> IntpArray:
        """The rows of distinct running requests: ``[B]``, intp, read-only (ArgumentError
        naming the first that is not running or is listed twice: nothing was ``what``)."""
        try:
            rows = np.fromiter(map(self.rows.__getitem__, ids), dtype=np.intp, count=len(ids))
        except (KeyError, TypeError):
            for rid in ids:
                self.row_of(rid)  # raises, naming the first that is not running
            raise
        if rows.size > 1 and np.maximum.reduce(np.bincount(rows)) > 1:
            raise ArgumentError(f"request_ids lists {repeated(ids)!r} twice; request ids "
                                f"must be distinct (nothing was {what})")
        rows.flags.writeable = False
        return rows

    def preempted(self, request_id: Any, advice: str = "") -> tuple[Request, Int64Array]:
        """A preempted request and the tokens it saved (ArgumentError otherwise, with
        ``advice``)."""
        req = self.known.get(request_id) if is_hashable(request_id) else None
        if req is None or req.saved is None:
            raise ArgumentError(f"request {request_id!r} is not preempted{advice}")
        return req, req.saved

    def releasable(self, ids: tuple[Any, ...]) -> None:
        """ArgumentError unless every id is known and listed once (nothing was released)."""
        unknown = [rid for rid in ids if not is_hashable(rid) or rid not in self.known]
        if unknown:
            raise ArgumentError(f"requests {unknown[:8]!r} are unknown or already released "
                                "(nothing was released)")
        if len(set(ids)) != len(ids):
            raise ArgumentError(f"request_ids lists {repeated(ids)!r} twice; request ids "
                                "must be distinct (nothing was released)")

    def open(self, request_id: Any, row: int, req: Request) -> None:
        """A request now runs in ``row`` (a new one, or a resumed one in its place)."""
        self.rows[request_id] = row
        self._ids[row] = request_id
        self.known[request_id] = req

    def close(self, request_id: Any) -> int:
        """A running request gives up its row (it stays known); returns the row."""
        row = self.rows.pop(request_id)
        self._ids[row] = None
        return row

    def at_row(self, row: int) -> Request:
        """The running request of a row."""
        return self.known[self._ids[row]]
