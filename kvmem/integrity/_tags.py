"""Namespace-qualified tags: the one format every check compares, defined here only.

The allocator gives a page a fresh 64-bit tag for every lifetime (0 while free). The manager
records, for every page a request maps, and checks, before every step, the page's tag
*qualified* by the namespace of the content it holds::

    qualified = tag << NS_BITS | namespace_id      a live page (tag > 0, 0 <= namespace_id < 2**20)
    qualified = 0                                  a free page

so one comparison proves three things: the page is live, it is in the lifetime the request
mapped it in, and it holds the request's namespace's content (a tenant's, an adapter's).
Tags stay far below ``2**43``, so qualified tags never overflow int64.

:class:`TagMirror` keeps the qualified tag of every page, on the host and, when the pages live
in a pool, on its device (``pool.tags``), so a check of device metadata runs on the device. It
is the only writer of both; it follows the allocator through a change-log reader of its own.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvmem._validate import index_array, integer
from kvmem.errors import ArgumentError, ArgumentTypeError

__all__ = [
    "MAX_NAMESPACES",
    "NS_BITS",
    "TagMirror",
    "lifetime_of",
    "namespace_id_of",
    "qualify",
    "qualify_live",
]

NS_BITS = 20
MAX_NAMESPACES = 1 << NS_BITS
_NS_MASK = MAX_NAMESPACES - 1

Int64Array = npt.NDArray[np.int64]


def qualify(tags: npt.NDArray[np.int64], namespace_ids: npt.ArrayLike) -> Int64Array:
    """Qualified tags of pages: ``tag << NS_BITS | namespace_id``, 0 where ``tag`` is 0.

    ``tags``: ``[k]``, int64 (the allocator's); ``namespace_ids``: ``[k]`` or one int, each in
    ``-1 .. MAX_NAMESPACES - 1`` (a free page's -1 is ignored) -> ``[k]``, int64. Raises
    ArgumentTypeError / ArgumentError naming the argument for anything else (a namespace id of
    ``MAX_NAMESPACES`` or more would spill into the lifetime bits), changing nothing.
    """
    tags = index_array(tags, "tags", what="tag")
    if isinstance(namespace_ids, (int, np.integer)) and not isinstance(namespace_ids, bool):
        ns: Any = integer(namespace_ids, "namespace_ids", minimum=-1,
                          maximum=MAX_NAMESPACES - 1)
    else:
        ns = index_array(namespace_ids, "namespace_ids", bound=MAX_NAMESPACES, minimum=-1,
                         what="namespace id")
        if ns.shape != tags.shape:
            raise ArgumentError(f"namespace_ids has {ns.size} entries for {tags.size} tags: "
                                "give one per tag, or one int for all")
    return _qualify(tags, ns)


def _qualify(tags: Int64Array, namespace_ids: Int64Array | int) -> Int64Array:
    """:func:`qualify` of arguments known good (the tag mirror's own arrays)."""
    out = (tags << NS_BITS) | np.maximum(namespace_ids, 0)
    out[tags == 0] = 0
    return out


def qualify_live(tags: npt.NDArray[np.int64], namespace_ids: Int64Array | int) -> Int64Array:
    """:func:`qualify` of pages that should be live (two numpy calls): a free page (tag 0)
    gives its namespace id or -1, never a valid qualified tag, so it fails any comparison with
    a recorded one (recorded tags have a lifetime > 0)."""
    out = tags << NS_BITS
    out |= namespace_ids
    return out


def lifetime_of(qualified: Any) -> Any:
    """The allocator tag inside qualified tags (an int or an integer array or tensor)."""
    return _qualified(qualified) >> NS_BITS


def namespace_id_of(qualified: Any) -> Any:
    """The namespace id inside qualified tags (an int or an integer array or tensor)."""
    return _qualified(qualified) & _NS_MASK


def raw_lifetime_of(qualified: Any) -> Any:
    """:func:`lifetime_of` of tags the caller produced (unchecked)."""
    return qualified >> NS_BITS


def raw_namespace_id_of(qualified: Any) -> Any:
    """:func:`namespace_id_of` of tags the caller produced (unchecked)."""
    return qualified & _NS_MASK


def _qualified(value: Any) -> Any:
    """Qualified tags as given: an integer >= 0, or an integer array or tensor."""
    if isinstance(value, np.ndarray) or hasattr(value, "device"):
        kind = str(value.dtype).removeprefix("torch.")
        if not kind.startswith(("int", "uint")):
            raise ArgumentTypeError(f"qualified tags have dtype {value.dtype}: expected "
                                    "integers")
        return value
    return integer(value, "qualified", minimum=0)


class _Reader(Protocol):
    def read(self) -> list[npt.NDArray[np.int32]] | None: ...


class _Pool(Protocol):
    tags: Any

    def claim_tags(self) -> object: ...

    def update_tags(self, page_ids: Any, tags: Any, *, key: object = None) -> None: ...


class TagMirror:
    """The qualified tag of every page, kept current from the allocator's change log.

    Parameters
    ----------
    tags: ``[num_pages]``, int64 — the allocator's tags (a read-only view)
    namespace_ids: ``[num_pages]``, int64 — whose content each page holds (-1 when free)
    changes: a reader of the allocator's change log (its own: nobody else reads it); only
        with a pool (without one, :meth:`sync` recomputes the host copy, which only full
        checks ask for)
    pool: optional ``PagePool`` whose ``tags`` tensor becomes this mirror's device copy; the
        mirror claims it, so nothing else writes it
    """

    def __init__(self, tags: npt.NDArray[np.int64], namespace_ids: Int64Array,
                 changes: _Reader | None = None, pool: _Pool | None = None) -> None:
        self._tags = tags
        self._namespace_ids = namespace_ids
        self._changes = changes
        self.host = _qualify(tags, namespace_ids)
        self._pool = pool
        if pool is not None and changes is None:
            raise ValueError("a mirror with a pool follows the allocator: give it a reader")
        self._key = None if pool is None else pool.claim_tags()
        if pool is not None:
            self._write_pool(np.arange(tags.size))

    @property
    def device(self) -> Any:
        """The device copy (the pool's ``tags`` tensor), or None without a pool."""
        return None if self._pool is None else self._pool.tags

    def sync(self) -> Int64Array:
        """Bring both copies up to date; returns the host copy ``[num_pages]``, int64."""
        if self._changes is None:
            self.host = _qualify(self._tags, self._namespace_ids)
            return self.host
        log = self._changes.read()
        if log is None:  # fell behind: everything
            changed: npt.NDArray[np.integer] = np.arange(self._tags.size)
        elif not log:
            return self.host
        else:
            changed = np.unique(np.concatenate(log)) if len(log) > 1 else np.unique(log[0])
        self.host[changed] = _qualify(self._tags[changed], self._namespace_ids[changed])
        if self._pool is not None:
            self._write_pool(changed)
        return self.host

    def _write_pool(self, pages: npt.NDArray[np.integer]) -> None:
        assert self._pool is not None
        self._pool.update_tags(pages, self.host[pages], key=self._key)
