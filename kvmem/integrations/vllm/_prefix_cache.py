"""A :class:`~kvmem.allocator.PrefixCache` that reuses and evicts pages in vLLM's order.

vLLM's block pool differs from :class:`~kvmem.allocator.HashedPrefixCache` in two ways that
decide which prefix survives under memory pressure, so a scheduler driven by kvmem must follow
them to schedule exactly what vLLM's own manager would:

- **Duplicates are cached.** Two requests that compute the same block (same prefix, same
  namespace) before either was cached both keep their page in the cache; a lookup finds the
  one cached first, and the other still serves hits once the first is evicted.
- **Eviction follows the free queue.** A cached page becomes evictable when its last holder
  drops it, and evictable pages go in that order (a request's deepest page first). Pages
  nobody caches are used before any cached page is evicted (the manager's free stack).

::

    index      key (two uint64 lanes as a tuple) -> {page: None}, first cached first
    lru        evictable pages (only the cache holds them), least recently released first
    per page   cached flag, key, tokens, namespace id and lifetime tag when cached

Keys are kvmem's chained 128-bit keys (:meth:`HashedPrefixCache.page_keys`, the namespace in
the root), and every hit is confirmed against the page's stored tokens, namespace and tag.
numpy and the standard library only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

import numpy as np
import numpy.typing as npt

from kvmem.allocator import Namespace, PageAllocator, PrefixCache, PrefixKeys, PrefixMatch

__all__ = ["VllmOrderPrefixCache"]

Int32Array = npt.NDArray[np.int32]
KeyArray = npt.NDArray[np.uint64]

_NO_PAGES = np.empty(0, dtype=np.int32)
_NO_PAGES.flags.writeable = False
_NO_KEYS = np.empty((0, 2), dtype=np.uint64)
_NO_KEYS.flags.writeable = False


class VllmOrderPrefixCache(PrefixCache):
    """Prefix reuse with vLLM's duplicate handling and free-queue eviction order.

    Parameters
    ----------
    seed: seeds the key function (``PrefixKeys``, as ``HashedPrefixCache(seed)``'s); None
        draws a secret.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = self._seed(seed)
        self.page_size = 0
        self._index: dict[tuple[int, int], dict[int, None]] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._num_cached = 0

    # -- binding and keys ----------------------------------------------------------------------

    def bind(self, allocator: PageAllocator, page_size: int,
             page_tokens: npt.NDArray[np.int32] | None = None) -> None:
        self._bind_allocator(allocator, page_size)
        self._keyer = PrefixKeys(self.seed, self.page_size)
        n = allocator.num_pages
        self._cached = np.zeros(n, dtype=bool)
        self._keys = np.zeros((n, 2), dtype=np.uint64)
        # The token ids of each page: the manager's store (written on commit), read here.
        self.page_tokens = (np.zeros((n, self.page_size), dtype=np.int32) if page_tokens is None
                            else page_tokens)
        self._namespace = np.zeros(n, dtype=np.int64)
        self._tag = np.zeros(n, dtype=np.int64)

    def root_key(self, namespace: Namespace) -> KeyArray:
        return self._keyer.root(namespace)

    def page_keys(self, parent_keys: KeyArray, counts: npt.NDArray[np.integer],
                  first_positions: npt.NDArray[np.integer],
                  token_ids: npt.NDArray[np.integer]) -> KeyArray:
        return self._keyer.page_keys(parent_keys, counts, first_positions, token_ids)

    def run_keys(self, parent_key: KeyArray, first_position: int,
                 token_ids: npt.NDArray[np.integer]) -> KeyArray:
        return self._keyer.run_keys(parent_key, first_position, token_ids)

    # -- match ---------------------------------------------------------------------------------

    def _first_live(self, key: tuple[int, int], tokens: npt.NDArray[np.integer],
                    namespace_id: int | None) -> int | None:
        """The first page cached under ``key`` that holds ``tokens`` (and the namespace)."""
        pages = self._index.get(key)
        if not pages:
            return None
        tags = self.allocator.tags
        for page in pages:
            if (int(tags[page]) == int(self._tag[page])
                    and (namespace_id is None or int(self._namespace[page]) == namespace_id)
                    and np.array_equal(self.page_tokens[page], tokens)):
                return page
        return None

    def _confirmed(self, keys: KeyArray, tokens: npt.NDArray[np.integer],
                   namespace_id: int | None) -> list[int]:
        """The pages of the prompt's longest cached prefix: page ``i`` the first cached under
        ``keys[i]`` that holds ``tokens[i]`` (and the namespace), in its cached lifetime.

        The first page cached under each key is confirmed for all keys at once (a handful of
        numpy calls); only a key whose first page fails is walked page by page."""
        index = self._index
        firsts: list[int] = []
        for key in map(tuple, keys.tolist()):
            pages = index.get(key)
            if not pages:
                break
            firsts.append(next(iter(pages)))
        n = len(firsts)
        if not n:
            return firsts
        idx = np.array(firsts, dtype=np.intp)
        ok = self.allocator.tags[idx] == self._tag[idx]
        if namespace_id is not None:
            ok &= self._namespace[idx] == namespace_id
        ok &= (self.page_tokens[idx] == tokens[:n]).all(axis=1)
        if np.count_nonzero(ok) == n:
            return firsts
        bad = int(np.argmin(ok))  # a duplicate cached under the same key may still hold it
        page = self._first_live(tuple(keys[bad].tolist()), tokens[bad], namespace_id)
        if page is None:
            return firsts[:bad]
        found = [*firsts[:bad], page]
        for i in range(bad + 1, n):  # (rare: walk the rest one key at a time)
            page = self._first_live(tuple(keys[i].tolist()), tokens[i], namespace_id)
            if page is None:
                break
            found.append(page)
        return found

    def match(self, token_ids: npt.NDArray[np.integer], namespace: Namespace,
              max_pages: int, namespace_id: int | None = None) -> PrefixMatch:
        root = self.root_key(namespace)
        p = self.page_size
        k = min(int(token_ids.size) // p, max_pages)
        if k <= 0 or not self._num_cached:
            return PrefixMatch(_NO_PAGES, _NO_KEYS, root, 0)
        tokens = np.asarray(token_ids[: k * p], dtype=np.int64).reshape(k, p)
        # Page 0 alone first (in Python ints): a prompt that misses on it costs one key, not
        # the prompt's.
        if self._index.get(self._keyer.first_key(root, tokens[0])) is None:
            return PrefixMatch(_NO_PAGES, _NO_KEYS, root, 0)
        keys = self._keyer.prompt_keys(tokens.reshape(-1), root, k)
        found = self._confirmed(keys, tokens, namespace_id)
        if not found:
            return PrefixMatch(_NO_PAGES, _NO_KEYS, root, 0)
        pages = np.array(found, dtype=np.int32)
        lru = self._lru
        return PrefixMatch(pages, keys[: len(found)], root, sum(p in lru for p in found))

    # -- insert / remove -----------------------------------------------------------------------

    def insert(self, keys: KeyArray, pages: Int32Array,
               namespace_ids: npt.NDArray[np.integer]) -> Int32Array:
        idx = np.asarray(pages, dtype=np.intp).reshape(-1)
        if idx.size == 0:
            return _NO_PAGES
        keys = np.asarray(keys, dtype=np.uint64)
        plist = idx.tolist()
        cached = self._cached[idx]
        if not np.count_nonzero(cached) and len(set(plist)) == len(plist):
            # The usual case (pages that just filled, none cached, each listed once): each
            # page goes after those its key lists already (the block pool caches duplicate
            # blocks too).
            setdefault = self._index.setdefault
            for key, page in zip(map(tuple, keys.tolist()), plist):
                setdefault(key, {})[page] = None
        else:
            take = self._index_new(keys, plist, cached.tolist())
            if not take:
                return _NO_PAGES
            if len(take) < len(plist):
                sel = np.array(take, dtype=np.intp)
                idx, keys = idx[sel], keys[sel]
                namespace_ids = np.asarray(namespace_ids).reshape(-1)[sel]
        self.allocator.share_distinct(idx)
        self._cached[idx] = True
        self._keys[idx] = keys
        self._namespace[idx] = np.asarray(namespace_ids).reshape(-1)
        self._tag[idx] = self.allocator.tags[idx]
        self._num_cached += idx.size
        return idx.astype(np.int32)

    def _index_new(self, keys: KeyArray, plist: list[int], was_cached: list[bool]
                   ) -> list[int]:
        """Index the pages not cached yet (each once) under their keys; their positions."""
        index = self._index
        take: list[int] = []
        seen: set[int] = set()
        for i, ((k0, k1), page) in enumerate(zip(keys.tolist(), plist)):
            if was_cached[i] or page in seen:
                continue  # a page is cached under one key
            seen.add(page)
            # A key already cached under another page keeps both, the first found first: the
            # block pool caches duplicate blocks too.
            entry = index.get((k0, k1))
            if entry is None:
                index[(k0, k1)] = {page: None}
            else:
                entry[page] = None
            take.append(i)
        return take

    def _forget(self, plist: list[int], evicted: bool = False) -> KeyArray:
        """Drop cached pages (distinct) from the index and the LRU; not from the allocator.
        ``evicted``: they were just taken from the LRU."""
        if not plist:
            return _NO_KEYS
        idx = np.array(plist, dtype=np.intp)
        keys = self._keys[idx].copy()
        index = self._index
        for page, key in zip(plist, map(tuple, keys.tolist())):
            entry = index.get(key)
            if entry is not None:
                entry.pop(page, None)
                if not entry:
                    del index[key]
        if not evicted:
            lru = self._lru
            for page in plist:
                lru.pop(page, None)
        self._cached[idx] = False
        self._tag[idx] = 0
        self._num_cached -= idx.size
        return keys

    def _cached_list(self, pages: Int32Array) -> list[int]:
        uniq = np.unique(np.asarray(pages, dtype=np.intp).reshape(-1))
        return uniq[self._cached[uniq]].tolist()

    def remove(self, pages: Int32Array) -> tuple[Int32Array, KeyArray]:
        plist = self._cached_list(pages)
        keys = self._forget(plist)
        idx = np.array(plist, dtype=np.intp)
        if idx.size:
            self.allocator.free_distinct(idx)
        return idx.astype(np.int32), keys

    def forget(self, pages: Int32Array) -> KeyArray:
        return self._forget(self._cached_list(pages))

    def stale(self) -> Int32Array:
        cached = np.flatnonzero(self._cached)
        return cached[self.allocator.tags[cached] != self._tag[cached]].astype(np.int32)

    def clear(self) -> Int32Array:
        cached = np.flatnonzero(self._cached)
        self._forget(cached.tolist())
        if cached.size:
            self.allocator.free_distinct(cached)
        self._index.clear()
        self._lru.clear()
        return cached.astype(np.int32)

    # -- evictability --------------------------------------------------------------------------

    def acquired(self, pages: Int32Array) -> None:
        lru = self._lru
        if lru:
            for page in np.asarray(pages).reshape(-1).tolist():
                lru.pop(page, None)

    def released(self, pages: Int32Array) -> None:
        plist = np.asarray(pages, dtype=np.intp).reshape(-1)[::-1]  # deepest first
        if plist.size == 0:
            return
        now = plist[self._cached[plist] & (self.allocator.refcounts[plist] == 1)]
        # Appended in order; a page the LRU lists already keeps its place (update's rule).
        self._lru.update(dict.fromkeys(now.tolist()))

    def released_many(self, runs: Sequence[Int32Array]) -> None:
        for run in runs:  # a request's pages are distinct and rows never share a release
            self.released(run)

    def evict(self, num_pages: int) -> tuple[Int32Array, KeyArray]:
        if num_pages > len(self._lru):
            raise ValueError(
                f"asked to evict {num_pages} pages but only {len(self._lru)} cached pages are "
                "held by the cache alone; nothing was evicted"
            )
        if num_pages <= 0:
            return _NO_PAGES, _NO_KEYS
        lru = self._lru
        victims = [lru.popitem(last=False)[0] for _ in range(num_pages)]
        keys = self._forget(victims, evicted=True)
        idx = np.array(victims, dtype=np.intp)
        self.allocator.free_distinct(idx)
        return idx.astype(np.int32), keys

    # -- queries -------------------------------------------------------------------------------

    def next_evicted(self, num_pages: int) -> list[int]:
        """The pages ``evict(num_pages)`` would take now (at most the evictable ones), in
        order; changes nothing."""
        return list(islice(self._lru, max(num_pages, 0)))

    def is_evictable(self, page: int) -> bool:
        """Whether ``page`` is cached and held by the cache alone (in the eviction order)."""
        return page in self._lru

    def is_cached(self, pages: Int32Array) -> npt.NDArray[np.bool_]:
        return self._cached[np.asarray(pages, dtype=np.intp).reshape(-1)]

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def check(self) -> list[str]:
        """The cache's invariants; one line per problem (empty when sound)."""
        problems: list[str] = []
        cached = np.flatnonzero(self._cached)
        indexed = sorted(p for pages in self._index.values() for p in pages)
        if indexed != cached.tolist() or cached.size != self._num_cached:
            problems.append(f"index lists {len(indexed)} pages, {cached.size} are marked cached, "
                            f"counter says {self._num_cached}")
        rc = self.allocator.refcounts
        should = sorted(cached[rc[cached] == 1].tolist())
        if sorted(self._lru) != should:
            problems.append(f"evictable pages {sorted(self._lru)[:16]} differ from cached pages "
                            f"held by the cache alone {should[:16]}")
        stale = self.stale()
        if stale.size:
            problems.append(f"cached pages {stale.tolist()[:16]} were freed or reallocated behind "
                            "the cache's back")
        return problems
