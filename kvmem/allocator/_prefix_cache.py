"""Prefix reuse: the pluggable :class:`PrefixCache` interface and the hashed-prefix cache.

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

Keys are chained: the key of page ``i`` of a prompt is computed from the key of page ``i - 1``,
the page's position and its token ids, starting from a root key derived from the namespace. So
a key names a whole prefix in one namespace, and two namespaces never share a key. Keys are
128 bits, stored as ``[k, 2]`` uint64 arrays (one row per page) and as 16-byte ``bytes`` in the
index. Every hit is confirmed against the token ids and the namespace stored with the page, so
a hash collision can cost a miss but never a wrong page.

numpy and hashlib only: no torch.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvmem.allocator._page_allocator import PageAllocator, as_page_ids

__all__ = ["HashedPrefixCache", "PrefixCache", "PrefixMatch", "namespace_bytes"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
KeyArray = npt.NDArray[np.uint64]  # [k, 2]: one 128-bit key per row

Namespace = Hashable  # None, str, int, bytes, or a tuple of those (tenant, LoRA id, salt, ...)


class PrefixMatch(NamedTuple):
    """The cached pages that hold a prompt's leading full pages.

    pages: ``[k]``, int32 — cached pages for prompt pages ``0 .. k-1``, in order
    keys: ``[k, 2]``, uint64 — their chained keys
    root_key: ``[2]``, uint64 — the namespace's root key (the parent of page 0)
    num_evictable: how many of ``pages`` only the cache holds (a hit makes them unevictable)
    """

    pages: Int32Array
    keys: KeyArray
    root_key: KeyArray
    num_evictable: int

    @property
    def num_pages(self) -> int:
        return int(self.pages.size)

    @property
    def last_key(self) -> KeyArray:
        """Key of the last matched page (the root key when nothing matched): ``[2]``, uint64."""
        return self.keys[-1] if self.pages.size else self.root_key


def namespace_bytes(namespace: Namespace) -> bytes:
    """A stable, injective byte encoding of a namespace (None, str, int, bytes or a tuple)."""
    if namespace is None:
        return b"n"
    if isinstance(namespace, bool):
        return b"o1" if namespace else b"o0"
    if isinstance(namespace, int):
        return b"i" + str(namespace).encode()
    if isinstance(namespace, str):
        data = namespace.encode()
        return b"s" + str(len(data)).encode() + b":" + data
    if isinstance(namespace, bytes):
        return b"b" + str(len(namespace)).encode() + b":" + namespace
    if isinstance(namespace, tuple):
        parts = [namespace_bytes(x) for x in namespace]
        return b"t" + str(len(parts)).encode() + b"(" + b"".join(
            str(len(p)).encode() + b":" + p for p in parts
        ) + b")"
    raise TypeError(
        f"a namespace must be None, str, int, bytes or a tuple of those, got "
        f"{type(namespace).__name__}; encode other values (a LoRA config, an image hash) as one"
    )


class PrefixCache(ABC):
    """What the manager needs from a prefix-reuse policy.

    The manager calls :meth:`bind` once, then: :meth:`match` (pure) before admitting;
    :meth:`acquired` after it took a reference on matched pages; :meth:`page_keys` and
    :meth:`insert` when pages fill with committed tokens; :meth:`released` after requests
    dropped references; :meth:`evict` when the allocator runs dry. A cache takes and drops its own
    allocator references (``allocator.share`` on insert, ``allocator.free`` on evict/remove).
    """

    page_size: int

    @abstractmethod
    def bind(self, allocator: PageAllocator, page_size: int) -> None:
        """Attach to the allocator whose pages the cache will hold."""

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

    @abstractmethod
    def insert(self, keys: KeyArray, pages: Int32Array, token_ids: npt.NDArray[np.integer],
               namespace_ids: npt.NDArray[np.integer]) -> Int32Array:
        """Remember full pages under their keys; a key already cached keeps its page.

        Parameters
        ----------
        keys: ``[k, 2]``, uint64; pages: ``[k]``, int32 (held by requests);
        token_ids: ``[k, page_size]``; namespace_ids: ``[k]`` (the manager's ids)

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


# -- the hashed-prefix cache ------------------------------------------------------------------

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S31 = np.uint64(31)
_MASK = (1 << 64) - 1
_M1_INT = int(_M1)
_M2_INT = int(_M2)


def _fmix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """64-bit finalizer (avalanche): every output bit depends on every input bit. In place."""
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


class HashedPrefixCache(PrefixCache):
    """Chained 128-bit page keys in a dict; LRU eviction of pages only the cache holds.

    Key of page ``i`` (per 64-bit lane ``l`` of two, all arithmetic modulo 2**64)::

        s_i   = sum_c  xorshift((token[c] + 1) * K[l, c])      (c = 0 .. page_size-1)
        g_i   = fmix(s_i + (i + 1) * Q[l])
        key_i = key_{i-1} + g_i,      key_{-1} = root(namespace) = blake2b(secret, namespace)

    ``K`` and ``Q`` are random odd constants drawn from ``seed``, so the keys of a whole prompt
    come from a dozen vectorized numpy calls instead of a hash call per page. The keys are keyed,
    not cryptographic: every hit is confirmed against the page's stored token ids and namespace,
    so a collision can only cost a miss, never a wrong page. Pass ``seed`` to make keys
    reproducible across processes (a cache-aware router recomputes them); leave it None for a
    per-process secret.

    Parameters
    ----------
    seed: ``int`` or None (random per process).
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is None:
            seed = int.from_bytes(os.urandom(16), "little")
        self.seed = int(seed)
        rng = np.random.default_rng(self.seed)
        self._secret = rng.bytes(32)
        self._rng = rng
        self.page_size = 0
        self._allocator: PageAllocator | None = None
        self._index: dict[bytes, int] = {}
        self._roots: dict[Namespace, KeyArray] = {}

    # -- binding ------------------------------------------------------------------------------

    def bind(self, allocator: PageAllocator, page_size: int) -> None:
        if self._allocator is not None:
            raise ValueError("this prefix cache is already bound to an allocator; make a new one")
        self._allocator = allocator
        self.page_size = int(page_size)
        n = allocator.num_pages
        self._K = self._rng.integers(1, 2**63, size=(2, 1, self.page_size), dtype=np.uint64)
        self._K |= np.uint64(1)
        self._Q = self._rng.integers(1, 2**63, size=(2, 1), dtype=np.uint64) | np.uint64(1)
        self._pq = np.arange(1, 1025, dtype=np.uint64)[None] * self._Q  # see _position_values
        # The same constants as Python ints, for one key computed without numpy (_key_of).
        self._K_int = [[int(v) for v in lane] for lane in self._K[:, 0, :]]
        self._Q_int = [int(v) for v in self._Q[:, 0]]
        # Recent matches, by (namespace, namespace id, first page's token bytes): (tokens of the
        # prompt's full pages, matched pages, their tags, their keys). A prompt that shares
        # pages with a recent one reuses what that match found instead of hashing them again.
        self._memo: dict[tuple[Any, int | None, bytes], tuple[Int64Array, Int32Array,
                                                              Int64Array, KeyArray]] = {}
        self._cached = np.zeros(n, dtype=bool)
        self._keys = np.zeros((n, 2), dtype=np.uint64)  # key of each cached page
        self._tokens = np.zeros((n, self.page_size), dtype=np.int64)  # for confirming hits
        self._namespace = np.zeros(n, dtype=np.int64)  # manager's namespace id of each page
        self._tag = np.zeros(n, dtype=np.int64)  # the page's tag when it was cached
        # LRU of evictable pages: a FIFO of (page, stamp) chunks; an entry is current while
        # stamp[page] equals its stamp (a page re-acquired and released later gets a new entry).
        self._stamp = np.zeros(n, dtype=np.int64)  # 0 = not evictable
        self._scratch = np.zeros(n, dtype=np.int64)
        self._next_stamp = 1
        self._fifo: list[tuple[Int32Array, Int64Array]] = []
        self._fifo_head = 0  # offset into self._fifo[0]
        self._fifo_len = 0
        self._num_cached = 0
        self._num_evictable = 0

    @property
    def allocator(self) -> PageAllocator:
        if self._allocator is None:
            raise ValueError("the prefix cache is not bound; give it to a KVCacheManager first")
        return self._allocator

    # -- keys --------------------------------------------------------------------------------

    def root_key(self, namespace: Namespace) -> KeyArray:
        root = self._roots.get(namespace)
        if root is None:
            digest = hashlib.blake2b(
                namespace_bytes(namespace), digest_size=16, key=self._secret
            ).digest()
            root = np.frombuffer(digest, dtype=np.uint64).copy()
            self._roots[namespace] = root
        return root

    def _page_values(self, token_ids: npt.NDArray[np.integer],
                     positions: npt.NDArray[np.integer]) -> KeyArray:
        """``g`` of each page: ``token_ids [k, page_size]``, ``positions [k]`` -> ``[2, k]``."""
        x = np.multiply(token_ids, self._K, dtype=np.uint64, casting="unsafe")
        x += self._K  # (token + 1) * K: token 0 still moves the sum
        x ^= x >> _S31
        s = x.sum(axis=2, dtype=np.uint64)
        s += self._position_values(positions)
        return _fmix(s)

    def _position_values(self, positions: npt.NDArray[np.integer]) -> KeyArray:
        """``(position + 1) * Q`` per lane: ``[2, k]``, uint64 (from a table grown on demand)."""
        try:
            return self._pq[:, positions]
        except IndexError:  # a position past the table (positions are never negative)
            size = max(2 * self._pq.shape[1], int(np.max(positions)) + 1)
            self._pq = np.arange(1, size + 1, dtype=np.uint64)[None] * self._Q
            return self._pq[:, positions]

    def prompt_keys(self, token_ids: npt.NDArray[np.integer], namespace: Namespace,
                    max_pages: int | None = None) -> KeyArray:
        """Keys of a prompt's full pages (at most ``max_pages``): ``[k, 2]``, uint64.

        This is what a cache-aware router computes (with the same ``seed``) to follow events.
        """
        p = self.page_size
        k = token_ids.size // p if max_pages is None else min(token_ids.size // p, max_pages)
        if k <= 0:
            return np.empty((0, 2), dtype=np.uint64)
        g = self._page_values(token_ids[: k * p].reshape(k, p), np.arange(k))
        keys = np.cumsum(g, axis=1, dtype=np.uint64)
        keys += self.root_key(namespace)[:, None]
        return np.ascontiguousarray(keys.T)

    def page_keys(self, parent_keys: KeyArray, counts: npt.NDArray[np.integer],
                  first_positions: npt.NDArray[np.integer],
                  token_ids: npt.NDArray[np.integer]) -> KeyArray:
        token_ids = np.asarray(token_ids)
        if token_ids.size == np.size(counts) * self.page_size:
            # One page per run (the decode step): no segmented sum.
            g = self._page_values(token_ids.reshape(-1, self.page_size),
                                  np.asarray(first_positions))
            return g.T + np.asarray(parent_keys, dtype=np.uint64)
        counts = np.asarray(counts, dtype=np.int64)
        total = int(counts.sum())
        if total == 0:
            return np.empty((0, 2), dtype=np.uint64)
        starts = np.cumsum(counts) - counts
        within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        positions = np.repeat(np.asarray(first_positions, dtype=np.int64), counts) + within
        g = self._page_values(np.asarray(token_ids).reshape(total, self.page_size), positions)
        # Segmented cumulative sum (mod 2**64): global cumsum minus the sum before each run.
        c = np.cumsum(g, axis=1, dtype=np.uint64)
        before = np.where(starts > 0, c[:, np.maximum(starts - 1, 0)], np.uint64(0))
        keys = c - np.repeat(before, counts, axis=1)
        keys += np.repeat(np.asarray(parent_keys, dtype=np.uint64).T, counts, axis=1)
        return np.ascontiguousarray(keys.T)

    @staticmethod
    def _as_bytes(keys: KeyArray) -> list[bytes]:
        return np.ascontiguousarray(keys).view(np.dtype((np.void, 16))).ravel().tolist()

    # -- match -------------------------------------------------------------------------------

    def _key_of(self, parent: KeyArray, tokens: list[int], position: int) -> KeyArray:
        """The key of one page, in Python ints (no numpy call): equal to :meth:`page_keys`."""
        out = []
        for lane in (0, 1):
            s = 0
            for t, k in zip(tokens, self._K_int[lane]):
                x = ((t + 1) * k) & _MASK
                s += x ^ (x >> 31)
            s = (s + (position + 1) * self._Q_int[lane]) & _MASK
            s ^= s >> 33
            s = (s * _M1_INT) & _MASK
            s ^= s >> 33
            s = (s * _M2_INT) & _MASK
            s ^= s >> 33
            out.append((int(parent[lane]) + s) & _MASK)
        return np.array(out, dtype=np.uint64)

    def match(self, token_ids: npt.NDArray[np.integer], namespace: Namespace,
              max_pages: int, namespace_id: int | None = None) -> PrefixMatch:
        root = self.root_key(namespace)
        p = self.page_size
        k = min(token_ids.size // p, max_pages)
        if k <= 0 or not self._index:
            return PrefixMatch(np.empty(0, np.int32), np.empty((0, 2), np.uint64), root, 0)
        tokens = np.asarray(token_ids[: k * p], dtype=np.int64)
        memo_key = (namespace, namespace_id, tokens[:p].tobytes())
        memo = self._memo.get(memo_key)
        if memo is not None:
            m_tokens, m_pages, m_tags, m_keys = memo
            size = min(tokens.size, m_tokens.size)
            differ = np.flatnonzero(tokens[:size] != m_tokens[:size])
            common = (int(differ[0]) if differ.size else size) // p  # pages with equal tokens
            found = min(common, m_pages.size)
            pages, keys, tags = m_pages[:found], m_keys[:found], m_tags[:found]
            # Still cached, in the lifetime they were matched in (a forgotten page's cache tag
            # is 0; a page freed behind the cache's back has another allocator tag), and the
            # next page not cached (hashed in Python: it usually misses). Otherwise walk.
            if (np.array_equal(self._tag[pages], tags)
                    and np.array_equal(self.allocator.tags[pages], tags)
                    and (found == k or self._key_of(
                        keys[-1] if found else root, tokens[found * p : (found + 1) * p].tolist(),
                        found).tobytes() not in self._index)):
                num_evictable = int(np.count_nonzero(self._stamp[pages])) if found else 0
                return PrefixMatch(pages, keys, root, num_evictable)
        new_pages, new_keys = self._walk(tokens, namespace, k, namespace_id)
        self._remember_match(memo_key, tokens, new_pages, new_keys)
        num_evictable = int(np.count_nonzero(self._stamp[new_pages])) if new_pages.size else 0
        return PrefixMatch(new_pages, new_keys, root, num_evictable)

    def _walk(self, tokens: Int64Array, namespace: Namespace, k: int,
              namespace_id: int | None) -> tuple[Int32Array, KeyArray]:
        """Hash the prompt's ``k`` full pages, follow the index, confirm every hit."""
        keys = self.prompt_keys(tokens, namespace, k)
        get = self._index.get
        found: list[int] = []
        for key in self._as_bytes(keys):
            page = get(key)
            if page is None:
                break
            found.append(page)
        pages = np.array(found, dtype=np.int32)
        if pages.size:
            # Confirm every hit against the stored tokens (and namespace, when known).
            p = self.page_size
            n = pages.size
            ok = (self._tokens[pages] == tokens[: n * p].reshape(n, p)).all(axis=1)
            # Still the lifetime that was cached: a page freed behind the cache's back (and maybe
            # reallocated) is never handed out, even before anyone notices.
            ok &= self.allocator.tags[pages] == self._tag[pages]
            if namespace_id is not None:
                ok &= self._namespace[pages] == namespace_id
            if not ok.all():
                pages = pages[: int(np.argmin(ok))]
        return pages, keys[: pages.size]

    def _remember_match(self, memo_key: tuple[Any, int | None, bytes], tokens: Int64Array,
                        pages: Int32Array, keys: KeyArray) -> None:
        if len(self._memo) >= 256:
            self._memo.clear()
        self._memo[memo_key] = (tokens.copy(), pages, self.allocator.tags[pages], keys)

    # -- insert / remove ---------------------------------------------------------------------

    def insert(self, keys: KeyArray, pages: Int32Array, token_ids: npt.NDArray[np.integer],
               namespace_ids: npt.NDArray[np.integer]) -> Int32Array:
        pages = as_page_ids(pages)
        if pages.size == 0:
            return pages
        index = self._index
        kb = self._as_bytes(keys)
        plist = pages.tolist()
        if len(set(plist)) == len(plist) and not self._cached[pages].any():
            # The usual case (pages that just filled): setdefault adds each new key and leaves a
            # key already cached (or listed earlier in this call) with its page.
            got = list(map(index.setdefault, kb, plist))
            if got == plist:
                return self._remember(keys, pages, token_ids, namespace_ids)
            take = [i for i, (g, p) in enumerate(zip(got, plist)) if g == p]
        else:
            # A page is remembered under one key; a key listed twice keeps its first page.
            seen_k: set[bytes] = set()
            seen_p: set[int] = set()
            take = []
            cached = self._cached[pages].tolist()
            for i, (k, page) in enumerate(zip(kb, plist)):
                if not cached[i] and k not in index and k not in seen_k and page not in seen_p:
                    seen_k.add(k)
                    seen_p.add(page)
                    take.append(i)
            index.update((kb[i], plist[i]) for i in take)
        if not take:
            return np.empty(0, dtype=np.int32)
        sel = np.array(take, dtype=np.int64)
        return self._remember(keys[sel], pages[sel],
                              np.asarray(token_ids).reshape(-1, self.page_size)[sel],
                              np.asarray(namespace_ids)[sel])

    def _remember(self, keys: KeyArray, pages: Int32Array, token_ids: npt.NDArray[np.integer],
                  namespace_ids: npt.NDArray[np.integer]) -> Int32Array:
        """Record pages just added to the index (distinct, not cached before) and hold them."""
        self.allocator.share_distinct(pages)
        self._cached[pages] = True
        self._keys[pages] = keys
        self._tokens[pages] = np.asarray(token_ids).reshape(-1, self.page_size)
        self._namespace[pages] = namespace_ids
        self._tag[pages] = self.allocator.tags[pages]
        self._num_cached += pages.size
        return pages

    def _forget(self, pages: Int32Array, evictable: bool = False) -> KeyArray:
        """Drop pages from the index and the LRU (not from the allocator); ``evictable``: all
        of them are (they were just taken from the LRU)."""
        keys = self._keys[pages]
        deque(map(self._index.__delitem__, self._as_bytes(keys)), maxlen=0)
        self._cached[pages] = False
        self._tag[pages] = 0
        if evictable:
            self._num_evictable -= pages.size
        else:
            self._num_evictable -= int(np.count_nonzero(self._stamp[pages]))
        self._stamp[pages] = 0
        self._num_cached -= pages.size
        return keys

    def forget(self, pages: Int32Array) -> KeyArray:
        pages = np.unique(as_page_ids(pages))
        return self._forget(pages[self._cached[pages]])

    def stale(self) -> Int32Array:
        cached = self.cached_pages()
        return cached[self.allocator.tags[cached] != self._tag[cached]]

    def remove(self, pages: Int32Array) -> tuple[Int32Array, KeyArray]:
        pages = np.unique(as_page_ids(pages))
        pages = pages[self._cached[pages]]
        keys = self._forget(pages)
        self.allocator.free(pages)
        return pages, keys

    def clear(self) -> Int32Array:
        pages = np.flatnonzero(self._cached).astype(np.int32)
        self._forget(pages)
        self.allocator.free(pages)
        self._fifo.clear()
        self._fifo_head = 0
        self._fifo_len = 0
        return pages

    # -- evictability ------------------------------------------------------------------------

    def acquired(self, pages: Int32Array) -> None:
        pages = as_page_ids(pages)
        was = self._stamp[pages] != 0
        if was.any():
            hit = np.unique(pages[was])
            self._stamp[hit] = 0
            self._num_evictable -= hit.size

    def released(self, pages: Int32Array) -> None:
        pages = as_page_ids(pages)
        if pages.size == 0:
            return
        # Deepest pages first, so a prefix outlives its extensions when both become evictable.
        pages = pages[::-1]
        now = self._cached[pages] & (self.allocator.refcounts[pages] == 1) & (
            self._stamp[pages] == 0
        )
        if not now.any():
            return
        new = pages[now]
        if new.size > 1:  # keep each page's first listing (stamping in reverse: first wins)
            index = np.arange(new.size)
            self._scratch[new[::-1]] = index[::-1]
            first = self._scratch[new] == index
            if not first.all():
                new = new[first]
        stamps = np.arange(self._next_stamp, self._next_stamp + new.size, dtype=np.int64)
        self._next_stamp += new.size
        self._stamp[new] = stamps
        self._num_evictable += new.size
        self._fifo.append((new.copy(), stamps))
        self._fifo_len += new.size
        if self._fifo_len > 4 * self.allocator.num_pages + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drop stale FIFO entries (their page was re-acquired or evicted since)."""
        if not self._fifo:
            return
        pages = np.concatenate([p for p, _ in self._fifo])[self._fifo_head :]
        stamps = np.concatenate([s for _, s in self._fifo])[self._fifo_head :]
        live = self._stamp[pages] == stamps
        self._fifo = [(pages[live], stamps[live])]
        self._fifo_head = 0
        self._fifo_len = int(live.sum())

    def evict(self, num_pages: int) -> tuple[Int32Array, KeyArray]:
        if num_pages > self._num_evictable:
            raise ValueError(
                f"asked to evict {num_pages} pages but only {self._num_evictable} cached pages "
                "are held by the cache alone; nothing was evicted"
            )
        if num_pages <= 0:
            return np.empty(0, dtype=np.int32), np.empty((0, 2), dtype=np.uint64)
        victims: list[Int32Array] = []
        need = num_pages
        while need > 0:
            # Look at a window of the oldest chunk only (after _compact() it holds them all).
            pages, stamps = self._fifo[0]
            head = self._fifo_head
            end = min(head + max(2 * need, 64), pages.size)
            window = pages[head:end]
            current = np.flatnonzero(self._stamp[window] == stamps[head:end])
            if current.size >= need:
                end = head + int(current[need - 1]) + 1
                current = current[:need]
            victims.append(window[current])
            need -= current.size
            self._fifo_len -= end - head
            if end == pages.size:
                self._fifo.pop(0)
                self._fifo_head = 0
            else:
                self._fifo_head = end
        out = np.concatenate(victims) if len(victims) > 1 else victims[0]
        keys = self._forget(out, evictable=True)
        self.allocator.free(out)
        return out, keys

    # -- queries -----------------------------------------------------------------------------

    def is_cached(self, pages: Int32Array) -> npt.NDArray[np.bool_]:
        return self._cached[as_page_ids(pages)]

    def keys_of(self, pages: Int32Array) -> KeyArray:
        """Keys of cached pages: ``[k, 2]``, uint64."""
        return self._keys[as_page_ids(pages)]

    def namespaces_of(self, pages: Int32Array) -> Int64Array:
        """Namespace id stored with each cached page: ``[k]``, int64."""
        return self._namespace[as_page_ids(pages)]

    def cached_pages(self) -> Int32Array:
        return np.flatnonzero(self._cached).astype(np.int32)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    def check(self) -> list[str]:
        """The cache's own invariants; returns one line per problem (empty when sound)."""
        problems: list[str] = []
        cached = self.cached_pages()
        if len(self._index) != cached.size or cached.size != self._num_cached:
            problems.append(
                f"index holds {len(self._index)} keys, {cached.size} pages are marked cached, "
                f"counter says {self._num_cached}"
            )
        idx_pages = np.array(sorted(self._index.values()), dtype=np.int32)
        if idx_pages.size == cached.size and not np.array_equal(idx_pages, cached):
            problems.append("the index's pages differ from the pages marked cached")
        rc = self.allocator.refcounts
        stale = self.stale()
        if stale.size:
            problems.append(f"cached pages {stale.tolist()[:16]} were freed or reallocated "
                            "behind the cache's back")
        evictable = np.flatnonzero(self._stamp)
        if evictable.size != self._num_evictable:
            problems.append(
                f"{evictable.size} pages carry an LRU stamp, counter says {self._num_evictable}"
            )
        should = cached[rc[cached] == 1]
        if not np.array_equal(np.sort(should), evictable):
            problems.append(
                f"evictable pages {evictable.tolist()[:16]} differ from cached pages held by the "
                f"cache alone {should.tolist()[:16]}"
            )
        return problems
