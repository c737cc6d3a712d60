"""HashedPrefixCache: the prefix cache kvmem ships (the interface is ``_prefix_cache.py``).

An index from each cached page's chained key (``_prefix_keys.py``) to the page, every hit
confirmed against the page's key, tag, namespace and token ids (read from the manager's page
tokens), and an LRU of the pages only the cache holds, evicted least recently released first::

    index      key lane 0 -> page     (stale entries allowed: lookups confirm them)
    cached     [num_pages] bool, keys [num_pages, 2], namespace, tag when cached
    LRU        a FIFO of (page, stamp); an entry is current while stamp[page] matches
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvmem.allocator._page_allocator import PageAllocator, as_page_ids, equal_arrays
from kvmem.allocator._prefix_cache import Int32Array, Int64Array, PrefixCache, PrefixMatch
from kvmem.allocator._prefix_keys import KeyArray, Namespace, PrefixKeys, namespace_bytes
from kvmem.errors import ArgumentError

__all__ = ["HashedPrefixCache"]

_NO_PAGES = np.empty(0, dtype=np.int32)
_NO_PAGES.flags.writeable = False
_NO_KEYS = np.empty((0, 2), dtype=np.uint64)
_NO_KEYS.flags.writeable = False


class HashedPrefixCache(PrefixCache):
    """Chained 128-bit page keys (:class:`~kvmem.allocator._prefix_keys.PrefixKeys`) in a
    dict; LRU eviction of pages only the cache holds.

    Every hit is confirmed against the page's stored token ids and namespace, so a key
    collision can only cost a miss, never a wrong page. Pass ``seed`` to make keys
    reproducible across processes (a cache-aware router recomputes them); leave it None for a
    per-process secret.

    Parameters
    ----------
    seed: ``int`` or None (random per process).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = self._seed(seed)
        self.seed_given = seed is not None  # (False: a tier may give the seed before bind)
        self.page_size = 0
        # First 64-bit lane of a key -> page. An entry may be stale (its page was forgotten, or
        # cached again under another key): lookups confirm it (_live_page, _walk).
        self._index: dict[int, int] = {}

    # -- binding ------------------------------------------------------------------------------

    def bind(self, allocator: PageAllocator, page_size: int,
             page_tokens: npt.NDArray[np.int32] | None = None) -> None:
        self._bind_allocator(allocator, page_size)
        self._rc = allocator.refcounts  # read-only views, looked up once
        self._atags = allocator.tags
        n = allocator.num_pages
        self.keys = PrefixKeys(self.seed, self.page_size)
        if page_tokens is None:
            page_tokens = np.zeros((n, self.page_size), dtype=np.int32)
        self.page_tokens = page_tokens
        # Recent matches, by (namespace, namespace id, first page's token bytes): (tokens of the
        # prompt's full pages, matched pages, their tags, their keys). A prompt that shares
        # pages with a recent one reuses what that match found instead of hashing them again.
        self._memo: dict[tuple[bytes, int | None, bytes], tuple[Int64Array, Int32Array,
                                                                Int64Array, KeyArray]] = {}
        self._cached = np.zeros(n, dtype=bool)
        self._keys = np.zeros((n, 2), dtype=np.uint64)  # key of each cached page
        self._namespace = np.zeros(n, dtype=np.int64)  # manager's namespace id of each page
        self._tag = np.zeros(n, dtype=np.int64)  # the page's tag when it was cached
        # LRU of evictable pages: a FIFO of (page, stamp) entries in two flat buffers,
        # oldest at _fifo_head, newest before _fifo_tail; an entry is current while stamp[page]
        # equals its stamp (a page re-acquired and released later gets a new entry, and a page
        # listed twice in one release keeps its first entry current).
        self._stamp = np.zeros(n, dtype=np.int64)  # 0 = not evictable
        self._last_run = np.zeros(n, dtype=np.intp)  # scratch for released_many
        self._next_stamp = 1
        cap = 4 * n + 1024
        self._fifo_pages = np.zeros(cap, dtype=np.intp)
        self._fifo_stamps = np.zeros(cap, dtype=np.int64)
        self._fifo_head = 0
        self._fifo_tail = 0
        self._num_cached = 0
        # The index is rebuilt from the cached pages when it holds this many entries (live and
        # stale): each rebuild drops at least 2 * num_pages + 1024 stale entries.
        self._index_limit = 3 * n + 1024
        self._num_evictable = 0

    # -- keys (the key function is PrefixKeys') ----------------------------------------------

    def root_key(self, namespace: Namespace) -> KeyArray:
        return self.keys.root(namespace)

    def prompt_keys(self, token_ids: npt.NDArray[np.integer], namespace: Namespace,
                    max_pages: int | None = None) -> KeyArray:
        """Keys of a prompt's full pages (at most ``max_pages``): ``[k, 2]``, uint64.

        This is what a cache-aware router computes (with the same ``seed``) to follow events.
        """
        return self.keys.prompt_keys(token_ids, self.root_key(namespace), max_pages)

    def page_keys(self, parent_keys: KeyArray, counts: npt.NDArray[np.integer],
                  first_positions: npt.NDArray[np.integer],
                  token_ids: npt.NDArray[np.integer]) -> KeyArray:
        return self.keys.page_keys(parent_keys, counts, first_positions, token_ids)

    def run_keys(self, parent_key: KeyArray, first_position: int,
                 token_ids: npt.NDArray[np.integer]) -> KeyArray:
        return self.keys.run_keys(parent_key, first_position, token_ids)

    # -- match -------------------------------------------------------------------------------

    def _entry_live(self, key0: int, page: int) -> bool:
        """Whether the index entry ``key0 -> page`` is live: the page is cached, under a key
        whose first lane is ``key0``. Other entries are stale (left by a forgotten page)."""
        return bool(self._cached[page]) and int(self._keys[page, 0]) == key0

    def _live_page(self, key0: int, key1: int) -> int | None:
        """The page cached under a key (given as its two lanes), or None."""
        page = self._index.get(key0)
        if (page is None or not self._entry_live(key0, page)
                or int(self._keys[page, 1]) != key1):
            return None
        return page

    def match(self, token_ids: npt.NDArray[np.integer], namespace: Namespace,
              max_pages: int, namespace_id: int | None = None) -> PrefixMatch:
        root = self.root_key(namespace)
        p = self.page_size
        k = min(token_ids.size // p, max_pages)
        if k <= 0 or not self._num_cached:
            return PrefixMatch(_NO_PAGES, _NO_KEYS, root, 0)
        tokens = np.asarray(token_ids[: k * p], dtype=np.int64)
        memo_key = (namespace_bytes(namespace), namespace_id, tokens[:p].tobytes())
        memo = self._memo.get(memo_key)
        if memo is not None:
            m_tokens, m_pages, m_tags, m_keys = memo
            size = min(tokens.size, m_tokens.size)
            differ = (tokens[:size] != m_tokens[:size]).nonzero()[0]
            common = (int(differ[0]) if differ.size else size) // p  # pages with equal tokens
            found = min(common, m_pages.size)
            pages, keys, tags = m_pages[:found], m_keys[:found], m_tags[:found]
            idx = pages.astype(np.intp)
            # Still cached, in the lifetime they were matched in (a forgotten page's cache tag
            # is 0; a page freed behind the cache's back has another allocator tag), and the
            # next page not cached (it usually misses). Otherwise walk.
            if (equal_arrays(self._tag[idx], tags)
                    and equal_arrays(self.allocator.tags[idx], tags)
                    and (found == k or self._live_page(*self.keys.key_ints(
                        *((int(keys[-1, 0]), int(keys[-1, 1])) if found
                          else (int(root[0]), int(root[1]))),
                        tokens[found * p : (found + 1) * p], found)) is None)):
                return PrefixMatch(pages, keys, root, int(np.count_nonzero(self._stamp[idx])))
        new_pages, new_keys = self._walk(tokens, namespace, k, namespace_id)
        if new_pages.size:
            self._remember_match(memo_key, tokens, new_pages, new_keys)
            return PrefixMatch(new_pages, new_keys, root,
                               int(np.count_nonzero(self._stamp[new_pages.astype(np.intp)])))
        # Nothing cached: a memo would only say what the walk's first look says as cheaply.
        if memo is not None:
            del self._memo[memo_key]
        return PrefixMatch(new_pages, new_keys, root, 0)

    def _walk(self, tokens: Int64Array, namespace: Namespace, k: int,
              namespace_id: int | None) -> tuple[Int32Array, KeyArray]:
        """Hash the prompt's ``k`` full pages, follow the index, confirm every hit.

        Page 0 is hashed and looked up first, alone: a prompt that misses on it (most prompts
        without a shared prefix) costs no more hashing."""
        if self._live_page(*self.keys.first_key(self.root_key(namespace), tokens)) is None:
            return _NO_PAGES, _NO_KEYS
        keys = self.prompt_keys(tokens, namespace, k)
        get = self._index.get
        found: list[int] = []
        for key in keys[:, 0].tolist():
            page = get(key)
            if page is None:
                break
            found.append(page)
        idx = np.array(found, dtype=np.intp)
        # Confirm every hit: the entry is live (the page is cached under the whole key), the
        # page holds these tokens (and namespace, when known).
        p = self.page_size
        n = idx.size
        ok = self._cached[idx]
        ok &= (self._keys[idx] == keys[:n]).all(axis=1)
        ok &= (self.page_tokens[idx] == tokens[: n * p].reshape(n, p)).all(axis=1)
        # Still the lifetime that was cached: a page freed behind the cache's back (and maybe
        # reallocated) is never handed out, even before anyone notices.
        ok &= self.allocator.tags[idx] == self._tag[idx]
        if namespace_id is not None:
            ok &= self._namespace[idx] == namespace_id
        if np.count_nonzero(ok) != n:
            n = int(np.argmin(ok))
        return idx[:n].astype(np.int32), keys[:n]

    def _remember_match(self, memo_key: tuple[bytes, int | None, bytes], tokens: Int64Array,
                        pages: Int32Array, keys: KeyArray) -> None:
        if len(self._memo) >= 256:
            self._memo.clear()
        self._memo[memo_key] = (tokens.copy(), pages, self.allocator.tags[pages], keys)

    # -- insert / remove ---------------------------------------------------------------------

    def insert(self, keys: KeyArray, pages: Int32Array,
               namespace_ids: npt.NDArray[np.integer]) -> Int32Array:
        pages = as_page_ids(pages)
        if pages.size == 0:
            return pages
        keys = np.asarray(keys, dtype=np.uint64)
        idx = pages.astype(np.intp)
        index = self._index
        kl = keys[:, 0].tolist()
        plist = pages.tolist()
        cached = self._cached[idx]
        if not np.count_nonzero(cached) and len(set(plist)) == len(plist):
            # The usual case (pages that just filled): setdefault adds each new key (or finds a
            # stale entry that already names the page) ...
            got = list(map(index.setdefault, kl, plist))
            if got == plist:
                return self._remember(keys, pages, idx, namespace_ids)
        # ... else, key by key: a key cached under another page, or listed earlier in this call,
        # keeps its page; a stale entry is overwritten; a page is remembered under one key.
        was_cached = cached.tolist()
        taken: set[int] = set()  # pages remembered by this call ...
        taken_keys: set[int] = set()  # ... under these keys
        take = []
        for i, (key, page) in enumerate(zip(kl, plist)):
            if was_cached[i] or page in taken or key in taken_keys:
                continue
            cur = index.get(key)
            if cur is not None and cur != page and self._entry_live(key, cur):
                continue  # (a live entry under another key with this first lane: a miss later)
            index[key] = page
            taken.add(page)
            taken_keys.add(key)
            take.append(i)
        if not take:
            return np.empty(0, dtype=np.int32)
        if len(take) == len(plist):
            return self._remember(keys, pages, idx, namespace_ids)
        sel = np.array(take, dtype=np.intp)
        return self._remember(keys[sel], pages[sel], idx[sel], np.asarray(namespace_ids)[sel])

    def _rebuild_index(self) -> None:
        """Drop the stale entries: the index again maps exactly the cached pages' keys."""
        cached = self._cached.nonzero()[0]
        self._index = dict(zip(self._keys[cached, 0].tolist(), cached.tolist()))

    def _remember(self, keys: KeyArray, pages: Int32Array, idx: npt.NDArray[np.intp],
                  namespace_ids: npt.NDArray[np.integer]) -> Int32Array:
        """Record pages just added to the index (distinct, not cached before; ``idx``: the same
        as intp) and hold them."""
        self.allocator.share_distinct(idx)
        self._cached[idx] = True
        self._keys[idx] = keys
        self._namespace[idx] = namespace_ids
        self._tag[idx] = self._atags[idx]
        self._num_cached += idx.size
        if len(self._index) > self._index_limit:
            self._rebuild_index()
        return pages

    def _forget(self, idx: npt.NDArray[np.intp], evictable: bool = False) -> KeyArray:
        """Drop distinct cached pages (intp) from the cache and the LRU (not from the
        allocator; their index entries go stale); ``evictable``: all of them are (just taken
        from the LRU)."""
        keys = self._keys[idx]
        self._cached[idx] = False
        self._tag[idx] = 0
        if evictable:
            self._num_evictable -= idx.size
        else:
            self._num_evictable -= int(np.count_nonzero(self._stamp[idx]))
        self._stamp[idx] = 0
        self._num_cached -= idx.size
        return keys

    def _cached_of(self, pages: Int32Array) -> npt.NDArray[np.intp]:
        """The cached ones among ``pages``, distinct and ascending, as intp."""
        idx = np.unique(as_page_ids(pages)).astype(np.intp)
        return idx[self._cached[idx]]

    def forget(self, pages: Int32Array) -> KeyArray:
        return self._forget(self._cached_of(pages))

    def stale(self) -> Int32Array:
        cached = self.cached_pages()
        return cached[self.allocator.tags[cached] != self._tag[cached]]

    def remove(self, pages: Int32Array) -> tuple[Int32Array, KeyArray]:
        idx = self._cached_of(pages)
        keys = self._forget(idx)
        self.allocator.free_distinct(idx)
        return idx.astype(np.int32), keys

    def clear(self) -> Int32Array:
        idx = self._cached.nonzero()[0]
        self._forget(idx)
        self.allocator.free_distinct(idx)
        self._index.clear()
        self._fifo_head = self._fifo_tail = 0
        return idx.astype(np.int32)

    # -- evictability ------------------------------------------------------------------------

    def acquired(self, pages: Int32Array) -> None:
        idx = as_page_ids(pages).astype(np.intp)
        was = self._stamp[idx] != 0
        if np.count_nonzero(was):
            hit = np.unique(idx[was])
            self._stamp[hit] = 0
            self._num_evictable -= hit.size

    def released(self, pages: Int32Array) -> None:
        pages = as_page_ids(pages)
        if pages.size:
            # Deepest pages first, so a prefix outlives its extensions when both become
            # evictable.
            self._released(pages[::-1].astype(np.intp))

    def released_many(self, runs: Sequence[Int32Array]) -> None:
        if len(runs) <= 1:
            if runs:
                self.released(runs[0])
            return
        # Every run reversed (deepest first), in order; an entry counts only in the last run
        # that lists its page (stamped in run order, the last run wins).
        rev = [as_page_ids(run)[::-1] for run in runs]
        idx = np.concatenate(rev).astype(np.intp)
        run_of = np.repeat(np.arange(len(runs), dtype=np.intp), [r.size for r in rev])
        self._last_run[idx] = run_of
        self._released(idx[self._last_run[idx] == run_of])

    def _released(self, idx: npt.NDArray[np.intp]) -> None:
        """:meth:`released` of intp pages, deepest first."""
        now = self._cached[idx]
        now &= self._rc[idx] == 1
        now &= self._stamp[idx] == 0
        new = idx[now]
        m = new.size
        if m == 0:
            return
        stamps = np.arange(self._next_stamp, self._next_stamp + m, dtype=np.int64)
        self._next_stamp += m
        if m == 1:
            self._stamp[new] = stamps
            self._num_evictable += 1
        else:
            # Stamped in reverse, so a page listed twice keeps its first listing's stamp (its
            # later entry is stale from the start, as a re-released page's old entry is).
            self._stamp[new[::-1]] = stamps[::-1]
            self._num_evictable += int(np.count_nonzero(self._stamp[new] == stamps))
        tail = self._fifo_tail
        if tail + m > self._fifo_pages.size:
            self._compact(m)
            tail = self._fifo_tail
        self._fifo_pages[tail : tail + m] = new
        self._fifo_stamps[tail : tail + m] = stamps
        self._fifo_tail = tail + m

    def _compact(self, room: int = 0) -> None:
        """Drop stale FIFO entries (their page was re-acquired or evicted since), moving the
        current ones to the front; grow the buffers if ``room`` more entries still do not fit."""
        head, tail = self._fifo_head, self._fifo_tail
        pages = self._fifo_pages[head:tail]
        stamps = self._fifo_stamps[head:tail]
        live = self._stamp[pages] == stamps
        pages, stamps = pages[live], stamps[live]  # copies
        n = pages.size
        if n + room > self._fifo_pages.size:
            size = max(2 * self._fifo_pages.size, n + room)
            self._fifo_pages = np.zeros(size, dtype=np.intp)
            self._fifo_stamps = np.zeros(size, dtype=np.int64)
        self._fifo_pages[:n] = pages
        self._fifo_stamps[:n] = stamps
        self._fifo_head, self._fifo_tail = 0, n

    def evict(self, num_pages: int) -> tuple[Int32Array, KeyArray]:
        if num_pages > self._num_evictable:
            raise ArgumentError(
                f"asked to evict {num_pages} pages but only {self._num_evictable} cached pages "
                "are held by the cache alone; nothing was evicted"
            )
        if num_pages <= 0:
            return np.empty(0, dtype=np.int32), np.empty((0, 2), dtype=np.uint64)
        fifo_pages, fifo_stamps, stamp = self._fifo_pages, self._fifo_stamps, self._stamp
        head, tail = self._fifo_head, self._fifo_tail
        victims: list[npt.NDArray[np.intp]] = []
        need = num_pages
        while need > 0:
            # A window of the oldest entries; current ones are the LRU's next victims.
            end = min(head + max(2 * need, 64), tail)
            window = fifo_pages[head:end]
            current = (stamp[window] == fifo_stamps[head:end]).nonzero()[0]
            if current.size >= need:
                end = head + int(current[need - 1]) + 1
                current = current[:need]
            victims.append(window[current])
            need -= current.size
            head = end
        self._fifo_head = head
        out = np.concatenate(victims) if len(victims) > 1 else victims[0]
        # Current entries name distinct pages (one stamp each): forget them, then free.
        keys = self._forget(out, evictable=True)
        self.allocator.free_distinct(out)
        return out.astype(np.int32), keys

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
        # Live entries (the page is cached under the entry's key); the rest are stale. Live
        # entries name distinct cached pages (a page has one key), so equal counts mean the
        # index names exactly the cached pages.
        idx_keys = np.fromiter(self._index.keys(), dtype=np.uint64, count=len(self._index))
        idx_pages = np.fromiter(self._index.values(), dtype=np.int64, count=len(self._index))
        live = self._cached[idx_pages] & (self._keys[idx_pages, 0] == idx_keys)
        num_live = int(np.count_nonzero(live))
        if num_live != cached.size or cached.size != self._num_cached:
            problems.append(
                f"index holds {num_live} live keys, {cached.size} pages are marked cached, "
                f"counter says {self._num_cached}"
            )
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
