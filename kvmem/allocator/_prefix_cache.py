"""Prefix reuse: the pluggable :class:`PrefixCache` interface (kvmem's own cache is
``_hashed_prefix_cache.py``).

A prefix cache remembers full pages of committed tokens so that a later request with the same
prefix, in the same namespace, maps those pages instead of recomputing them. It holds one
allocator reference on every page it remembers; a remembered page nobody else holds is
*evictable* and is given back, least recently released first, when the allocator runs dry::

    page state            refcount   holders
    ---------------------------------------------------------------
    free                  0          -
    used, not cached      >= 1       requests (and step fences)
    used and cached       >= 2       requests + the cache
    cached, evictable     1          the cache alone        <- LRU victims

Keys are chained (``kvmem.allocator._prefix_keys``, the key function): the key of page ``i`` of
a prompt is computed from the key of page ``i - 1``, the page's position and its token ids,
starting from a root key derived from the namespace. So a key names a whole prefix in one
namespace, and two namespaces never share a key. Keys are 128 bits, stored as ``[k, 2]`` uint64
arrays (one row per page); the index maps a key's first 64-bit lane to a page, and every entry
found is confirmed against the whole key, the lifetime tag, the page's token ids (read from the
manager's store of page tokens: stored once) and its namespace, so a hash collision can cost a
miss but never a wrong page. Forgetting a page does not touch the index: its entry goes stale (the
page is no longer cached, or is cached under another key) and is overwritten by the next insert
of that key or dropped when the index is rebuilt, so eviction costs no per-page Python work.

numpy and hashlib only: no torch.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvmem._validate import integer
from kvmem.allocator._page_allocator import PageAllocator, as_page_ids
from kvmem.allocator._prefix_keys import KeyArray, Namespace, namespace_bytes
from kvmem.errors import ConfigError

__all__ = ["Namespace", "PrefixCache", "PrefixMatch", "namespace_bytes"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]


class PrefixMatch(NamedTuple):
    """The cached pages that hold a prompt's leading full pages.

    pages: ``[k]``, int32 — cached pages for prompt pages ``0 .. k-1``, in order
    keys: ``[k, 2]``, uint64 — their chained keys
    root_key: ``[2]``, uint64 — the namespace's root key (the parent of page 0)
    num_evictable: how many of ``pages`` only the cache holds (a hit makes them unevictable)
    num_offloaded: how many prompt pages after ``pages`` a tier below the device holds
        (``KVCacheManager.match_prefix`` with an offload tier; admission loads them)
    """

    pages: Int32Array
    keys: KeyArray
    root_key: KeyArray
    num_evictable: int
    num_offloaded: int = 0

    @property
    def num_pages(self) -> int:
        return int(self.pages.size)

    @property
    def last_key(self) -> KeyArray:
        """Key of the last matched page (the root key when nothing matched): ``[2]``, uint64."""
        return self.keys[-1] if self.pages.size else self.root_key


class PrefixCache(ABC):
    """What the manager needs from a prefix-reuse policy.

    The manager calls :meth:`bind` once, then: :meth:`match` (pure) before admitting;
    :meth:`acquired` after it took a reference on matched pages; :meth:`page_keys` and
    :meth:`insert` when pages fill with committed tokens; :meth:`released` after requests
    dropped references; :meth:`evict` when the allocator runs dry. A cache takes and drops its own
    allocator references (``allocator.share`` on insert, ``allocator.free`` on evict/remove).
    """

    page_size: int
    _allocator: PageAllocator | None = None

    @staticmethod
    def _seed(seed: int | None) -> int:
        """A key seed: ``seed`` checked, or a random one per process where it is None."""
        if seed is None:
            return int.from_bytes(os.urandom(16), "little")
        return int(integer(seed, "seed", minimum=0))

    def _bind_allocator(self, allocator: PageAllocator, page_size: int) -> None:
        if self._allocator is not None:
            raise ConfigError(f"this {type(self).__name__} is already bound to an allocator (a "
                              "manager); give each KVCacheManager a new one")
        self._allocator = allocator
        self.page_size = int(page_size)

    @property
    def allocator(self) -> PageAllocator:
        """The allocator whose pages the cache holds (set by :meth:`bind`)."""
        if self._allocator is None:
            raise ConfigError(f"this {type(self).__name__} is not bound; give it to a "
                              "KVCacheManager first")
        return self._allocator

    @abstractmethod
    def bind(self, allocator: PageAllocator, page_size: int,
             page_tokens: npt.NDArray[np.int32] | None = None) -> None:
        """Attach to the allocator whose pages the cache will hold. ``page_tokens``
        (``[num_pages, page_size]``, read-only) holds the token ids committed into each
        page, written by the manager; without it the cache keeps a store of its own
        (``page_tokens`` attribute) that its caller writes before :meth:`insert`."""

    @abstractmethod
    def root_key(self, namespace: Namespace) -> KeyArray:
        """The key a namespace's page 0 chains from: ``[2]``, uint64."""

    @abstractmethod
    def match(self, token_ids: npt.NDArray[np.integer], namespace: Namespace,
              max_pages: int, namespace_id: int | None = None) -> PrefixMatch:
        """Longest run of cached pages holding ``token_ids``' first full pages (at most
        ``max_pages``), confirmed against stored token ids and, when ``namespace_id`` (the
        manager's id of ``namespace``, -1 if it has none yet) is given, the page's namespace.
        Changes nothing."""

    @abstractmethod
    def page_keys(self, parent_keys: KeyArray, counts: npt.NDArray[np.integer],
                  first_positions: npt.NDArray[np.integer],
                  token_ids: npt.NDArray[np.integer]) -> KeyArray:
        """Chained keys of ``R`` runs of consecutive full pages.

        Parameters
        ----------
        parent_keys: ``[R, 2]``, uint64 — key of the page before each run (a root key at 0)
        counts: ``[R]`` — pages in each run (>= 1)
        first_positions: ``[R]`` — page position of each run's first page within its request
        token_ids: ``[sum(counts), page_size]`` — the runs' tokens, run by run

        Returns
        -------
        keys: ``[sum(counts), 2]``, uint64
        """

    def run_keys(self, parent_key: KeyArray, first_position: int,
                 token_ids: npt.NDArray[np.integer]) -> KeyArray:
        """:meth:`page_keys` of one run (one request's newly full pages): ``parent_key``
        ``[2]``, its first page's position, ``token_ids`` ``[k, page_size]`` -> ``[k, 2]``,
        uint64. A cache may answer it faster; the keys must be the same."""
        k = int(token_ids.shape[0])
        return self.page_keys(np.asarray(parent_key, dtype=np.uint64).reshape(1, 2),
                              np.array([k]), np.array([first_position]), token_ids)

    @abstractmethod
    def insert(self, keys: KeyArray, pages: Int32Array,
               namespace_ids: npt.NDArray[np.integer]) -> Int32Array:
        """Remember full pages under their keys; a key already cached keeps its page. The
        pages' token ids are in the page-token store (:meth:`bind`).

        Parameters
        ----------
        keys: ``[k, 2]``, uint64; pages: ``[k]``, int32 (held by requests);
        namespace_ids: ``[k]`` (the manager's ids)

        Returns
        -------
        inserted: ``[j]``, int32 — the pages newly remembered (the cache took one reference each)
        """

    @abstractmethod
    def acquired(self, pages: Int32Array) -> None:
        """Requests just took references on these pages (they are no longer evictable)."""

    @abstractmethod
    def released(self, pages: Int32Array) -> None:
        """Requests or fences just dropped references on these pages (some may be evictable)."""

    def released_many(self, runs: Sequence[Int32Array]) -> None:
        """Several holders dropped references, ``runs[0]``'s first, then ``runs[1]``'s, ...,
        all before this call: the same as calling :meth:`released` on each run right after its
        own references were dropped. (A page listed in a later run still had that holder when
        an earlier run was released: only its last run counts.)"""
        later: set[int] = set()
        mine: list[Int32Array] = []
        for run in reversed(runs):
            pages = as_page_ids(run)
            plist = pages.tolist()
            mine.append(pages[[p not in later for p in plist]] if later else pages)
            later.update(plist)
        for pages in reversed(mine):
            self.released(pages)

    @abstractmethod
    def evict(self, num_pages: int) -> tuple[Int32Array, KeyArray]:
        """Forget ``num_pages`` evictable pages, least recently released first, and free them.

        Returns the freed pages ``[num_pages]`` (int32) and their keys ``[num_pages, 2]``.
        Raises ValueError (changing nothing) if fewer are evictable.
        """

    @abstractmethod
    def remove(self, pages: Int32Array) -> tuple[Int32Array, KeyArray]:
        """Forget these pages if cached (e.g. written by a request that failed verification).

        Returns the pages that were cached (int32) and their keys; drops the cache's reference.
        """

    @abstractmethod
    def forget(self, pages: Int32Array) -> KeyArray:
        """Drop entries whose reference was already lost (the page was freed behind the cache's
        back): no allocator call. Returns their keys."""

    @abstractmethod
    def stale(self) -> Int32Array:
        """Cached pages no longer in the lifetime they were cached in (int32; empty if sound)."""

    @abstractmethod
    def clear(self) -> Int32Array:
        """Forget every page; returns the pages that were cached."""

    @abstractmethod
    def is_cached(self, pages: Int32Array) -> npt.NDArray[np.bool_]:
        """Whether each page is remembered: ``[k]``, bool."""

    @property
    @abstractmethod
    def num_cached(self) -> int:
        """Pages remembered (some may also be held by requests)."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Remembered pages that only the cache holds."""
