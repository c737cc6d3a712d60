"""The prefix cache: hashing, keys, lookup, insertion, eviction order, its fast path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem import ArgumentError, ArgumentTypeError, PageAllocator
from kvmem.allocator import HashedPrefixCache, PrefixCache, namespace_bytes

P = 4


def bound(num_pages: int = 32, seed: int = 1) -> tuple[HashedPrefixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    cache = HashedPrefixCache(seed=seed)
    cache.bind(alloc, P)
    return cache, alloc


def insert(cache: HashedPrefixCache, keys: np.ndarray, pages: np.ndarray, tokens: np.ndarray,
           ns_ids: np.ndarray) -> np.ndarray:
    """What the manager does on commit: the pages' tokens go into the page-token store (not
    into a page that is cached already: its content never changes), then the pages are
    offered."""
    tokens = np.asarray(tokens).reshape(-1, P)
    fresh = ~cache.is_cached(pages)
    cache.page_tokens[pages[fresh]] = tokens[fresh]
    return cache.insert(keys, pages, ns_ids)


def key_of(cache: HashedPrefixCache, parent: np.ndarray, tokens: object, position: int
           ) -> np.ndarray:
    """One page's key, from the key function's one-at-a-time path."""
    return np.array(cache.keys.key_ints(int(parent[0]), int(parent[1]), tokens, position),
                    dtype=np.uint64)


def store(cache: HashedPrefixCache, alloc: PageAllocator, tokens: np.ndarray, ns_name: object,
          ns_id: int) -> np.ndarray:
    """A request computes ``tokens`` (full pages), offers them, and finishes."""
    k = tokens.size // P
    pages = alloc.allocate(k)
    root = cache.root_key(ns_name)
    keys = cache.page_keys(root[None], np.array([k]), np.array([0]), tokens.reshape(k, P))
    insert(cache, keys, pages, tokens.reshape(k, P), np.full(k, ns_id))
    alloc.free(pages)
    cache.released(pages)
    return pages


class ModelCache:
    """The cache's contract in plain Python: an index of 16-byte keys that holds exactly the
    cached pages, and an LRU (insertion-ordered dict) of the pages only the cache holds."""

    def __init__(self, cache: HashedPrefixCache, alloc: PageAllocator) -> None:
        self.hasher, self.alloc = cache, alloc
        self.index: dict[bytes, int] = {}
        self.entry: dict[int, tuple[bytes, tuple[int, ...], int, int]] = {}
        self.lru: dict[int, None] = {}

    def match(self, tokens: np.ndarray, ns: object, max_pages: int, ns_id: int) -> list[int]:
        found: list[int] = []
        keys = self.hasher.prompt_keys(tokens, ns, max_pages)
        for i, key in enumerate(keys):
            page = self.index.get(key.tobytes())
            if page is None:
                break
            _, toks, page_ns, tag = self.entry[page]
            if (toks != tuple(tokens[i * P : (i + 1) * P].tolist()) or page_ns != ns_id
                    or tag != self.alloc.tags[page]):
                break
            found.append(page)
        return found

    def insert(self, keys: np.ndarray, pages: np.ndarray, tokens: np.ndarray,
               ns_ids: np.ndarray) -> list[int]:
        taken: list[int] = []
        seen_keys: set[bytes] = set()
        for key, page, toks, ns in zip(keys, pages.tolist(), tokens.reshape(-1, P), ns_ids):
            kb = key.tobytes()
            if page in self.entry or kb in self.index or kb in seen_keys or page in taken:
                continue
            seen_keys.add(kb)
            taken.append(page)
            self.index[kb] = page
            self.entry[page] = (kb, tuple(toks.tolist()), int(ns), int(self.alloc.tags[page]))
        self.alloc.share(taken)
        return taken

    def acquired(self, pages: np.ndarray) -> None:
        for page in pages.tolist():
            self.lru.pop(page, None)

    def released(self, pages: np.ndarray) -> None:
        for page in pages.tolist()[::-1]:  # deepest first; a page listed twice: its first
            if page in self.entry and self.alloc.refcounts[page] == 1 and page not in self.lru:
                self.lru[page] = None

    def _forget(self, pages: list[int]) -> list[bytes]:
        keys = []
        for page in pages:
            kb = self.entry.pop(page)[0]
            del self.index[kb]
            self.lru.pop(page, None)
            keys.append(kb)
        return keys

    def evict(self, n: int) -> tuple[list[int], list[bytes]]:
        victims = list(self.lru)[:n]
        keys = self._forget(victims)
        self.alloc.free(victims)
        return victims, keys

    def remove(self, pages: np.ndarray) -> list[int]:
        gone = sorted({p for p in pages.tolist() if p in self.entry})
        self._forget(gone)
        self.alloc.free(gone)
        return gone


def drive(seed: int, num_pages: int, small_buffers: bool, rebuild_often: bool) -> None:
    """Random admissions, releases, holds, evictions and removals on the cache and on the
    model (each with its own allocator): every answer and every count must agree."""
    rng = np.random.default_rng(seed)
    cache, alloc = bound(num_pages=num_pages, seed=seed)
    model = ModelCache(cache, PageAllocator(num_pages))
    if small_buffers:  # the LRU's buffers compact and grow while the cache runs
        cache._fifo_pages = np.zeros(4, dtype=np.intp)
        cache._fifo_stamps = np.zeros(4, dtype=np.int64)
    if rebuild_often:  # the index drops its stale entries after every insert
        cache._index_limit = 0
    stems = [rng.integers(0, 3, 6 * P) for _ in range(4)]
    names = [None, "t"]
    held: list[np.ndarray] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.5:  # admit a prompt: reuse its cached prefix, store the rest, maybe finish
            stem = stems[int(rng.integers(0, len(stems)))]
            cut = int(rng.integers(0, stem.size + 1))
            tokens = np.concatenate([stem[:cut], rng.integers(0, 3, int(rng.integers(1, 4)) * P)])
            tokens = tokens[: tokens.size // P * P]
            if tokens.size == 0:
                continue
            ns_id = int(rng.integers(0, 2))
            m = cache.match(tokens, names[ns_id], 99, ns_id)
            assert m.pages.tolist() == model.match(tokens, names[ns_id], 99, ns_id)
            assert m.num_evictable == sum(p in model.lru for p in m.pages.tolist())
            # Sometimes two requests with this prompt, admitted together, commit in one call.
            copies = 2 if rng.random() < 0.2 else 1
            need = tokens.size // P - m.num_pages
            if copies * need > alloc.num_free + cache.num_evictable - m.num_evictable:
                continue
            for a, c in ((alloc, cache), (model.alloc, model)):
                for _ in range(copies):
                    a.share(m.pages)
                c.acquired(m.pages)
            short = copies * need - alloc.num_free
            if short > 0:
                got, keys = cache.evict(short)
                want, want_keys = model.evict(short)
                assert got.tolist() == want and [k.tobytes() for k in keys] == want_keys
            own = alloc.allocate(copies * need)
            assert own.tolist() == model.alloc.allocate(copies * need).tolist()
            rest = np.vstack([tokens[m.num_pages * P :].reshape(-1, P)] * copies)
            keys = cache.page_keys(np.vstack([m.last_key] * copies), np.full(copies, need),
                                   np.full(copies, m.num_pages), rest)
            ns_ids = np.full(copies * need, ns_id)
            offered = own
            if rng.random() < 0.2:  # the same pages offered twice in one call
                keys, rest = np.vstack([keys, keys]), np.vstack([rest, rest])
                offered, ns_ids = np.concatenate([own, own]), np.concatenate([ns_ids, ns_ids])
            got = insert(cache, keys, offered, rest, ns_ids)
            assert got.tolist() == model.insert(keys, offered, rest, ns_ids)
            for copy in range(copies):
                pages = np.concatenate([m.pages, own[copy * need : (copy + 1) * need]])
                if rng.random() < 0.5:
                    held.append(pages)
                else:
                    for a, cc in ((alloc, cache), (model.alloc, model)):
                        a.free(pages)
                        cc.released(pages)
        elif op < 0.65 and held:  # requests finish, in one release (a page may be listed twice)
            pages = np.concatenate([held.pop(int(rng.integers(0, len(held)))) for _ in
                                    range(min(len(held), int(rng.integers(1, 3))))])
            for a, c in ((alloc, cache), (model.alloc, model)):
                a.free(pages)
                c.released(pages)
        elif op < 0.8 and cache.num_evictable:
            n = int(rng.integers(1, cache.num_evictable + 1))
            got, keys = cache.evict(n)
            want, want_keys = model.evict(n)
            assert got.tolist() == want and [k.tobytes() for k in keys] == want_keys
        elif op < 0.9 and cache.num_cached:
            pick = rng.choice(cache.cached_pages(), size=int(rng.integers(1, 4)))
            if all(model.alloc.refcounts[p] == 1 for p in pick.tolist()):
                removed, _ = cache.remove(pick)
                assert removed.tolist() == model.remove(pick)
        elif cache.num_cached:  # a request holds cached pages a while (no longer evictable)
            pick = np.unique(rng.choice(cache.cached_pages(), size=int(rng.integers(1, 4))))
            for a, c in ((alloc, cache), (model.alloc, model)):
                a.share(pick)
                c.acquired(pick)
            held.append(pick.astype(np.int32))
        assert cache.num_cached == len(model.entry)
        assert cache.num_evictable == len(model.lru)
        assert np.array_equal(alloc.refcounts, model.alloc.refcounts)
        assert not cache.check()


MASK = (1 << 64) - 1


def bound_cache(page_size: int = 16, seed: int = 20240611) -> HashedPrefixCache:
    cache = HashedPrefixCache(seed=seed)
    cache.bind(PageAllocator(8), page_size)
    return cache


def reference_keys(seed: int, page_size: int, root: list[int], tokens: list[int],
                   first_position: int) -> list[tuple[int, int]]:
    """The chained keys of consecutive pages, as the class docstring defines them, in Python
    ints (K and Q drawn from ``seed`` as ``bind`` draws them)."""
    rng = np.random.default_rng(seed)
    rng.bytes(32)  # the namespace secret
    K = (rng.integers(1, 2**63, size=(2, page_size), dtype=np.uint64) | 1).tolist()
    Q = (rng.integers(1, 2**63, size=2, dtype=np.uint64) | 1).tolist()

    def fmix(x: int) -> int:
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & MASK
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & MASK
        return x ^ (x >> 33)

    keys, key = [], list(root)
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        position = first_position + i
        for lane in range(2):
            s = 0
            for c, token in enumerate(page):
                v = ((token + 1) * K[lane][c]) & MASK
                s += v ^ (v >> 31)
            key[lane] = (key[lane] + fmix((s + (position + 1) * Q[lane]) & MASK)) & MASK
        keys.append((key[0], key[1]))
    return keys


def test_qualified_tags_decode_and_refuse_what_is_no_tag() -> None:
    from kvmem.integrity import lifetime_of, namespace_id_of

    q = 41 << 20 | 3
    assert (lifetime_of(q), namespace_id_of(q)) == (41, 3)
    assert (lifetime_of(np.int64(q)), namespace_id_of(np.int64(q))) == (41, 3)
    assert lifetime_of(np.array([q, 0])).tolist() == [41, 0]
    for bad, kind in ((1.5, ArgumentTypeError), (True, ArgumentTypeError), ("3", ArgumentTypeError),
                      (-1, ArgumentError), (np.array([1.5]), ArgumentTypeError)):
        with pytest.raises(kind):
            lifetime_of(bad)
        with pytest.raises(kind):
            namespace_id_of(bad)


@pytest.mark.parametrize("seed, page_size, kind", [
    ("x", 16, ArgumentTypeError), (1.5, 16, ArgumentTypeError), (True, 16, ArgumentTypeError),
    (-1, 16, ArgumentError), (0, 0, ArgumentError), (0, True, ArgumentTypeError),
])
def test_prefix_keys_check_their_arguments(seed: Any, page_size: Any, kind: type) -> None:
    from kvmem.allocator import PrefixKeys

    with pytest.raises(kind):
        PrefixKeys(seed, page_size)


def test_prefix_keys_of_a_list_equal_those_of_an_array_and_floats_are_refused() -> None:
    from kvmem import HashedPrefixCache
    from kvmem.allocator import PrefixKeys

    keys = PrefixKeys(7, 4)
    root = keys.root("tenant")
    tokens = list(range(9))
    assert np.array_equal(keys.prompt_keys(tokens, root), keys.prompt_keys(np.arange(9), root))
    assert keys.prompt_keys(tokens, root).shape == (2, 2)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        keys.prompt_keys(np.array([1.5] * 4), root)
    for bad in ("x", 1.5):
        with pytest.raises(ArgumentTypeError, match="seed"):
            HashedPrefixCache(seed=bad)


def test_prompt_keys_equal_incremental_page_keys() -> None:
    cache, _ = bound()
    tokens = np.arange(24) % 7
    whole = cache.prompt_keys(tokens, "ns")
    # The same keys computed as two runs (pages 0-1, then 2-5), as commits produce them.
    first = cache.page_keys(cache.root_key("ns")[None], np.array([2]), np.array([0]),
                            tokens[:8].reshape(2, P))
    rest = cache.page_keys(first[-1:], np.array([4]), np.array([2]), tokens[8:].reshape(4, P))
    assert np.array_equal(whole, np.vstack([first, rest]))
    # Batched runs of different requests give the same keys as one at a time.
    both = cache.page_keys(np.vstack([cache.root_key("ns"), first[-1]]), np.array([2, 4]),
                           np.array([0, 2]), tokens.reshape(6, P))
    assert np.array_equal(both, whole)


def test_keys_depend_on_namespace_position_order_and_every_token() -> None:
    cache, _ = bound()
    t = np.arange(8)
    base = cache.prompt_keys(t, None)
    assert not np.array_equal(cache.prompt_keys(t, "tenant"), base)
    swapped = np.concatenate([t[4:], t[:4]])
    assert not (cache.prompt_keys(swapped, None)[1] == base[1]).all()
    for i in range(8):
        u = t.copy()
        u[i] += 1
        assert not (cache.prompt_keys(u, None)[1] == base[1]).all()
    # The same seed gives the same keys in another cache (a router can recompute them).
    other, _ = bound(seed=1)
    assert np.array_equal(other.prompt_keys(t, None), base)
    assert not np.array_equal(bound(seed=2)[0].prompt_keys(t, None), base)


def test_namespace_encoding_is_injective() -> None:
    names = [None, "", "a", "ab", ("a", "b"), ("ab",), 1, "1", b"1", (1,), ((1,),), True, 0]
    encoded = [namespace_bytes(n) for n in names]
    assert len(set(encoded)) == len(encoded)
    with pytest.raises(TypeError, match="namespace"):
        namespace_bytes(1.5)  # type: ignore[arg-type]


def test_match_returns_longest_confirmed_prefix_in_the_namespace() -> None:
    cache, alloc = bound()
    tokens = np.arange(16)
    pages = store(cache, alloc, tokens, "a", 1)
    m = cache.match(np.concatenate([tokens[:12], [99, 98, 97, 96, 1]]), "a", 10, 1)
    assert m.pages.tolist() == pages[:3].tolist()
    assert m.num_evictable == 3
    assert cache.match(tokens, "b", 10, 2).num_pages == 0  # another namespace: nothing
    assert cache.match(tokens, "a", 2, 1).num_pages == 2  # capped
    assert cache.match(np.concatenate([[5], tokens[1:]]), "a", 10, 1).num_pages == 0


def test_a_colliding_key_is_confirmed_against_tokens_and_namespace() -> None:
    """BUGS 10, 11: even if two prefixes collide on the key, a hit is confirmed."""
    cache, alloc = bound()
    pages = store(cache, alloc, np.arange(8), "a", 1)
    # A namespace confusion (stored ids disagree) is refused.
    assert cache.match(np.arange(8), "a", 10, namespace_id=2).num_pages == 0
    assert cache.match(np.arange(8), "a", 10, namespace_id=1).num_pages == 2
    # Forge a collision: another prompt's keys name the stored pages, which are cached under
    # exactly those keys (all 128 bits collide); the stored tokens still refuse the hit.
    forged = np.arange(8) + 100
    for key, page in zip(cache.prompt_keys(forged, "a"), pages.tolist()):
        cache._index[int(key[0])] = page
        cache._keys[page] = key
    assert cache.match(forged, "a", 10, 1).num_pages == 0


def test_a_first_lane_collision_costs_a_miss_never_a_wrong_page() -> None:
    """The index is keyed by a key's first 64-bit lane; the second lane is confirmed too."""
    cache, alloc = bound()
    tokens = np.arange(12)
    pages = store(cache, alloc, tokens, None, 0)
    # Page 1 cached under a key that shares only its first lane with the prompt's page 1: the
    # match stops before it (the walk), and again when the recent match is reused (the memo).
    key = cache._keys[pages[1]].copy()
    cache._keys[pages[1], 1] ^= np.uint64(1)
    assert cache.match(tokens, None, 10, 0).pages.tolist() == pages[:1].tolist()
    assert cache.match(tokens, None, 10, 0).pages.tolist() == pages[:1].tolist()
    cache._keys[pages[1]] = key
    assert cache.match(tokens, None, 10, 0).num_pages == 3
    # Inserting another key with a cached key's first lane leaves the cached page in place.
    other = key.copy()
    other[1] ^= np.uint64(1)
    extra = alloc.allocate(1)
    assert insert(cache, other[None], extra, np.full((1, P), 7), np.zeros(1)).size == 0
    assert cache.match(tokens, None, 10, 0).num_pages == 3 and not cache.check()


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_the_first_page_key_equals_the_prompt_keys(page_size: int) -> None:
    alloc = PageAllocator(8)
    cache = HashedPrefixCache(seed=5)
    cache.bind(alloc, page_size)
    rng = np.random.default_rng(page_size)
    for ns in (None, "tenant", ("lora", 3)):
        tokens = rng.integers(0, 2**31 - 1, 3 * page_size)
        want = cache.prompt_keys(tokens, ns)[0]
        assert cache.keys.first_key(cache.root_key(ns), tokens) == tuple(want.tolist())


def test_evict_is_lru_by_release_deepest_first_and_frees_pages() -> None:
    cache, alloc = bound(num_pages=16)
    old = store(cache, alloc, np.arange(8), None, 0)
    new = store(cache, alloc, np.arange(8) + 50, None, 0)
    assert cache.num_cached == cache.num_evictable == 4
    freed, keys = cache.evict(1)
    assert freed.tolist() == [old[1]]  # the oldest release, its deepest page first
    assert alloc.refcounts[freed[0]] == 0 and alloc.tags[freed[0]] == 0
    assert keys.shape == (1, 2)
    freed, _ = cache.evict(2)
    assert freed.tolist() == [old[0], new[1]]
    assert cache.num_cached == 1 and not cache.check()
    with pytest.raises(ValueError, match="only 1"):
        cache.evict(2)
    assert cache.num_cached == 1  # a refused eviction changes nothing


def test_acquired_pages_are_not_evictable_until_released() -> None:
    cache, alloc = bound(num_pages=16)
    pages = store(cache, alloc, np.arange(8), None, 0)
    alloc.share(pages)
    cache.acquired(pages)
    assert cache.num_evictable == 0 and not cache.check()
    with pytest.raises(ValueError):
        cache.evict(1)
    alloc.free(pages)
    cache.released(pages)
    assert cache.num_evictable == 2 and not cache.check()


def test_insert_keeps_the_first_page_for_a_key_and_dedupes_within_a_call() -> None:
    cache, alloc = bound()
    tokens = np.arange(4)
    pages = alloc.allocate(2)
    keys = np.vstack([cache.prompt_keys(tokens, None)] * 2)
    inserted = insert(cache, keys, pages, np.vstack([tokens, tokens]), np.zeros(2))
    assert inserted.tolist() == [pages[0]]
    assert alloc.refcounts.tolist()[: 2] == [2, 1]
    assert cache.num_cached == 1 and not cache.check()


def test_remove_and_clear_drop_the_cache_references() -> None:
    cache, alloc = bound()
    pages = store(cache, alloc, np.arange(12), None, 0)
    removed, keys = cache.remove(pages[1:2])
    assert removed.tolist() == [pages[1]] and keys.shape == (1, 2)
    assert alloc.refcounts[pages[1]] == 0
    assert cache.clear().size == 2
    assert alloc.num_free == alloc.num_pages and cache.num_cached == 0 and not cache.check()


def test_check_reports_accounting_drift() -> None:
    """BUG 15: an evictable page that a request also holds must be reported."""
    cache, alloc = bound()
    pages = store(cache, alloc, np.arange(4), None, 0)
    alloc.share(pages)  # a holder the cache was not told about
    assert any("evictable" in p for p in cache.check())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=4, max_size=16),
                          st.sampled_from([None, "x"])), min_size=1, max_size=8))
def test_match_finds_exactly_the_stored_prefixes(stored: list[tuple[list[int], object]]) -> None:
    cache, alloc = bound(num_pages=64)
    model: set[tuple[object, tuple[int, ...]]] = set()
    ns_ids = {None: 0, "x": 1}
    for tokens, ns in stored:
        full = np.array(tokens[: len(tokens) // P * P])
        if full.size:
            m = cache.match(full, ns, 99, ns_ids[ns])
            # Reuse the hit pages and store only the rest, as the manager does.
            k = full.size // P
            alloc.share(m.pages)
            cache.acquired(m.pages)
            own = alloc.allocate(k - m.num_pages)
            keys = cache.page_keys(m.last_key[None], np.array([k - m.num_pages]),
                                   np.array([m.num_pages]), full[m.num_pages * P :].reshape(-1, P))
            insert(cache, keys, own, full[m.num_pages * P :].reshape(-1, P),
                         np.full(own.size, ns_ids[ns]))
            held = np.concatenate([m.pages, own])
            alloc.free(held)
            cache.released(held)
            for end in range(P, full.size + 1, P):
                model.add((ns, tuple(full[:end].tolist())))
        assert not cache.check()
    for tokens, _ in stored:
        for other in (None, "x"):
            t = np.array(tokens)
            want = 0
            while (want + 1) * P <= t.size and (
                (other, tuple(t[: (want + 1) * P].tolist())) in model
            ):
                want += 1
            assert cache.match(t, other, 99, ns_ids[other]).num_pages == want


def test_one_key_at_a_time_equals_the_vectorized_keys() -> None:
    cache, _ = bound(seed=7)
    rng = np.random.default_rng(3)
    for _ in range(50):
        tokens = rng.integers(0, 2**31 - 1, P)
        parent = rng.integers(0, 2**63, 2).astype(np.uint64)
        position = int(rng.integers(0, 5000))
        want = cache.page_keys(parent[None], np.array([1]), np.array([position]), tokens[None])
        for form in (tokens.tolist(), tokens, tokens.astype(np.int32)):
            assert np.array_equal(key_of(cache, parent, form, position), want[0])
    edge = np.array([0, 2**31 - 1] * (P // 2))  # (Python ints wrap modulo 2**64 as numpy's)
    want = cache.page_keys(np.zeros((1, 2), np.uint64), np.array([1]), np.array([0]), edge[None])
    assert np.array_equal(key_of(cache, np.zeros(2, np.uint64), edge.tolist(), 0), want[0])


@pytest.mark.parametrize("num", [P - 1, P + 1])
def test_one_key_at_a_time_refuses_anything_but_one_page(num: int) -> None:
    """Guards key_ints' Python loop, which would key a longer list's first page silently."""
    cache, _ = bound(seed=7)
    with pytest.raises(ArgumentError, match="one page"):
        cache.keys.key_ints(0, 0, list(range(num)), 0)


def test_a_recent_match_is_reused_only_while_its_pages_are_cached() -> None:
    cache, alloc = bound(num_pages=64)
    system = np.arange(12)
    store(cache, alloc, np.concatenate([system, [50] * 4]), "a", 1)
    first = cache.match(np.concatenate([system, [60] * 5]), "a", 4, 1)  # hashes and walks
    assert first.num_pages == 3
    again = cache.match(np.concatenate([system, [70] * 5]), "a", 4, 1)  # reuses the walk
    assert np.array_equal(again.pages, first.pages) and np.array_equal(again.keys, first.keys)
    # A page stored since the recent match extends the next one.
    store(cache, alloc, np.concatenate([system, [70] * 4]), "a", 1)
    assert cache.match(np.concatenate([system, [70] * 5]), "a", 4, 1).num_pages == 4
    # Other namespaces never see the namespace's pages, with or without a recent match.
    store(cache, alloc, np.concatenate([system, [1] * 4]), "b", 2)
    assert cache.match(np.concatenate([system, [1] * 5]), "a", 4, 1).num_pages == 3
    assert cache.match(np.concatenate([system, [1] * 5]), "b", 4, 2).num_pages == 4
    assert cache.match(np.concatenate([system, [2] * 5]), "b", 4, 2).num_pages == 3
    # A page forgotten (removed, evicted) or freed behind the cache's back is never reused.
    cache.remove(first.pages[1:2])
    assert cache.match(np.concatenate([system, [80] * 5]), "a", 4, 1).num_pages == 1
    alloc.free(first.pages[:1])  # behind the cache's back: page 0 is stale
    assert cache.match(np.concatenate([system, [90] * 5]), "a", 4, 1).num_pages == 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("small_buffers", "rebuild_often"), [(False, False), (True, True)])
def test_the_cache_agrees_with_a_plain_model(seed: int, small_buffers: bool,
                                             rebuild_often: bool) -> None:
    drive(seed, num_pages=24 + 8 * seed, small_buffers=small_buffers,
          rebuild_often=rebuild_often)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("how", ["vectorized", "generic"])
def test_released_many_equals_one_release_per_holder(seed: int, how: str) -> None:
    """Holders sharing prefix pages (one may list a page twice), released in one call after
    all their frees: the LRU ends up as if each had been released right after its own free."""
    tokens = np.random.default_rng(seed).integers(0, 4, 10 * P)
    order = []
    for batched in (False, True):
        cache, alloc = bound(num_pages=64, seed=seed)
        pages = store(cache, alloc, tokens, None, 0)  # 10 cached pages, all evictable
        rng = np.random.default_rng(seed + 100)
        runs = []
        for _ in range(int(rng.integers(2, 6))):
            shared = pages[: int(rng.integers(0, pages.size + 1))]
            alloc.share(shared)
            cache.acquired(shared)
            run = np.concatenate([shared, alloc.allocate(int(rng.integers(0, 3)))])
            if run.size and rng.random() < 0.3:  # a page listed twice: two references
                dup = run[int(rng.integers(0, run.size))]
                alloc.share([dup])
                run = np.concatenate([run, [dup]])
            runs.append(run.astype(np.int32))
        for run in runs:
            alloc.free(run)
            if not batched:
                cache.released(run)
        if batched and how == "vectorized":
            cache.released_many(runs)
        elif batched:
            PrefixCache.released_many(cache, runs)  # the interface's own, via released()
        assert not cache.check()
        order.append(cache.evict(cache.num_evictable)[0].tolist())
    assert order[0] == order[1] and len(order[0]) == 10


def test_batched_keys_equal_one_at_a_time_for_any_batch_size_and_int_width() -> None:
    """page_keys hashes into reused scratch buffers that grow with the batch: batches of every
    size, int32 or int64 token ids (up to the int32 maximum) give the one-page keys."""
    cache, _ = bound(seed=11)
    rng = np.random.default_rng(4)
    for k in (1, 7, 500, 3, 64):
        tokens = rng.integers(0, 2**31, (k, P))
        tokens[0, 0] = 2**31 - 1
        parents = rng.integers(0, 2**63, (k, 2)).astype(np.uint64)
        positions = rng.integers(0, 3000, k)
        want = np.array([key_of(cache, parents[i], tokens[i], int(positions[i]))
                         for i in range(k)])
        for dtype in (np.int32, np.int64):
            got = cache.page_keys(parents, np.ones(k, dtype=np.int64), positions,
                                  tokens.astype(dtype))
            assert np.array_equal(got, want)


def test_keys_are_those_of_the_documented_hash() -> None:
    """Bit for bit what this seed gave before (routers recompute keys), and the docstring's
    formula: prompt_keys, and the one-page path at positions inside and past the position
    table (1024 entries at first)."""
    cache = bound_cache()
    tokens = (np.arange(64, dtype=np.int64) * 7919) % 50021
    keys = cache.prompt_keys(tokens, ("tenant", 7))
    assert [tuple(map(hex, k)) for k in keys.tolist()] == [
        ("0x12f92fb33058bba", "0x3d7ae09152f6f304"),
        ("0xeb28c8944d050a9a", "0x3724f2fb8a4432ea"),
        ("0xad6725ea65105ffd", "0x96521102ffc494c1"),
        ("0x6d97453e8f61609c", "0xf366cb2259e0ff05"),
    ]
    root = cache.root_key(("tenant", 7)).tolist()
    assert keys.tolist() == [list(k) for k in
                             reference_keys(cache.seed, 16, root, tokens.tolist(), 0)]
    parents = np.array([[1, 2], [2**64 - 1, 0], [12345, 2**63]], dtype=np.uint64)
    positions = np.array([0, 5, 4000])
    got = cache.page_keys(parents, np.ones(3, np.int64), positions,
                          tokens[:48].reshape(3, 16).astype(np.int32))
    assert [tuple(map(hex, k)) for k in got.tolist()] == [
        ("0x12620ead76c2d5e6", "0x8439ca96db9cfbdc"),
        ("0xcca081ef588e03da", "0x955d52c5bd096db9"),
        ("0xfe4e2e7a4a22627f", "0x45797f45fa913f6f"),
    ]
    for i in range(3):
        want = reference_keys(cache.seed, 16, parents[i].tolist(),
                              tokens[16 * i : 16 * (i + 1)].tolist(), int(positions[i]))
        assert got[i].tolist() == list(want[0])


def test_one_page_runs_equal_the_segmented_path_and_prompt_keys() -> None:
    """Every page of several prompts (namespaces, lengths, int widths), hashed three ways:
    prompt_keys; page_keys with runs of several pages (the segmented sum); page_keys with one
    page per run, all prompts' pages mixed in one batch as a decode step offers them."""
    cache = bound_cache(page_size=4)
    rng = np.random.default_rng(7)
    prompts = [(rng.integers(0, 2**31, 4 * n).astype(dtype), ns)
               for n, dtype, ns in ((9, np.int32, None), (1, np.int64, "a"), (30, np.int32, "a"),
                                    (5, np.int64, ("t", 2)))]
    whole = [cache.prompt_keys(tokens, ns) for tokens, ns in prompts]
    parent_rows, token_rows, position_rows = [], [], []
    for (tokens, ns), keys in zip(prompts, whole):
        k = keys.shape[0]
        parents = np.concatenate([cache.root_key(ns)[None], keys[:-1]])
        pages = tokens.reshape(k, 4)
        # Runs of 1..4 pages.
        cuts = np.unique(np.concatenate([[0], rng.integers(0, k, 3), [k]]))
        counts = np.diff(cuts)
        segmented = cache.page_keys(parents[cuts[:-1]], counts, cuts[:-1], pages)
        assert np.array_equal(segmented, keys)
        parent_rows.append(parents)
        token_rows.append(pages.astype(np.int64))
        position_rows.append(np.arange(k))
    order = rng.permutation(sum(keys.shape[0] for keys in whole))
    one_page = cache.page_keys(np.concatenate(parent_rows)[order],
                               np.ones(order.size, np.int64),
                               np.concatenate(position_rows)[order],
                               np.concatenate(token_rows)[order])
    assert np.array_equal(one_page, np.concatenate(whole)[order])
    assert one_page.dtype == np.uint64 and one_page.flags.c_contiguous


def test_returned_keys_do_not_share_the_scratch() -> None:
    """The hashing scratch is reused call after call: keys returned earlier must not change."""
    cache = bound_cache(page_size=4)
    rng = np.random.default_rng(3)
    parents = rng.integers(0, 2**63, (6, 2)).astype(np.uint64)
    tokens = rng.integers(0, 1000, (6, 4))
    first = [cache.page_keys(parents, np.ones(6, np.int64), np.arange(6), tokens),
             cache.page_keys(parents[:2], np.array([2, 4]), np.array([0, 9]), tokens),
             cache.prompt_keys(tokens.reshape(-1), None)]
    saved = [keys.copy() for keys in first]
    for k in (6, 3, 40):  # same size, smaller, and larger (the scratch grows)
        cache.page_keys(rng.integers(0, 2**63, (k, 2)).astype(np.uint64), np.ones(k, np.int64),
                        np.arange(k), rng.integers(0, 1000, (k, 4)))
        cache.prompt_keys(rng.integers(0, 1000, 4 * k), "b")
    for keys, want in zip(first, saved):
        assert np.array_equal(keys, want)


def test_a_huge_batch_hashes_into_temporaries_with_the_same_keys() -> None:
    """Past 2**20 tokens, page_values hashes into temporaries instead of kept scratch: the
    keys equal those of smaller batches (kept scratch) of the same pages."""
    cache = bound_cache(page_size=1)
    tokens = np.random.default_rng(5).integers(0, 50000, (1 << 20) + 3).astype(np.int32)
    keys = cache.prompt_keys(tokens, "n")
    head = cache.page_keys(cache.root_key("n")[None], np.array([1000]), np.array([0]),
                           tokens[:1000, None])
    assert np.array_equal(keys[:1000], head)
    k = tokens.size
    tail = cache.page_keys(keys[k - 1001 : k - 1], np.ones(1000, np.int64),
                           np.arange(k - 1000, k), tokens[k - 1000 :, None])
    assert np.array_equal(keys[k - 1000 :], tail)


def test_evict_of_no_page_returns_empty_arrays_and_too_many_is_refused_by_name() -> None:
    """evict(0) frees nothing and returns ``[0]`` int32 pages and ``[0, 2]`` uint64 keys; an
    eviction of more pages than only the cache holds says how many it could."""
    cache, alloc = bound(num_pages=16)
    store(cache, alloc, np.arange(8), None, 0)
    freed, keys = cache.evict(0)
    assert freed.dtype == np.int32 and freed.shape == (0,)
    assert keys.dtype == np.uint64 and keys.shape == (0, 2)
    assert cache.num_evictable == 2 and alloc.num_free == 14
    with pytest.raises(ArgumentError, match=r"^asked to evict 3 pages but only 2 cached pages "
                       r"are held by the cache alone; nothing was evicted$"):
        cache.evict(3)
    assert cache.num_evictable == 2 and not cache.check()


@pytest.mark.parametrize("runs", [1, 0])
def test_released_many_of_one_run_or_none_equals_released(runs: int) -> None:
    """released_many of a single run is released of that run (deepest page first into the
    LRU); of no run, nothing."""
    cache, alloc = bound(num_pages=16)
    pages = store(cache, alloc, np.arange(12), None, 0)
    alloc.share(pages)
    cache.acquired(pages)
    alloc.free(pages)
    cache.released_many([pages] if runs else [])
    assert cache.num_evictable == (3 if runs else 0)
    if runs:  # (with none, the cache alone holds pages it was not told of)
        assert not cache.check()
        assert cache.evict(3)[0].tolist() == pages[::-1].tolist()


def test_keys_of_and_namespaces_of_read_what_insert_stored() -> None:
    cache, alloc = bound()
    tokens = np.arange(8)
    pages = store(cache, alloc, tokens, "t", 3)
    keys = cache.prompt_keys(tokens, "t")
    assert cache.keys_of(pages).tolist() == keys.tolist()
    assert cache.keys_of(pages).dtype == np.uint64
    assert cache.namespaces_of(pages).tolist() == [3, 3]


def test_the_lru_buffer_stays_bounded_when_the_same_pages_cycle() -> None:
    """A page acquired and released again and again leaves one stale LRU entry per cycle;
    compaction drops them, so the buffer never grows past its first size (and the LRU order
    survives: the page released last is evicted last)."""
    cache, alloc = bound(num_pages=8)
    pages = store(cache, alloc, np.arange(8), None, 0)
    size = cache._fifo_pages.size
    for _ in range(3 * size):
        alloc.share(pages[:1])
        cache.acquired(pages[:1])
        alloc.free(pages[:1])
        cache.released(pages[:1])
    assert cache._fifo_pages.size == size
    assert cache.evict(2)[0].tolist() == [pages[1], pages[0]]
    assert not cache.check()


@pytest.mark.parametrize(("namespace", "encoding"), [
    (None, b"n"), (True, b"o1"), (False, b"o0"), (np.True_, b"o1"), (5, b"i5"),
    (np.int64(-3), b"i-3"), ("ab", b"s2:ab"), ("\u00e9", b"s2:\xc3\xa9"), (b"xy", b"b2:xy"),
    ((1, "a"), b"t2(2:i14:s1:a)"), (((),), b"t1(4:t0())"), ((None, (b"",)), b"t2(1:n9:t1(3:b0:))"),
])
def test_namespace_encodings_are_the_documented_bytes(namespace: Any, encoding: bytes) -> None:
    """Root keys are a keyed hash of these bytes, so a router or another process with the
    same seed computes the same keys only while every kind of namespace encodes exactly so:
    a tag letter, lengths, ``:`` and a tuple's parts in parentheses."""
    assert namespace_bytes(namespace) == encoding


def test_a_namespace_of_another_type_is_refused_saying_what_to_do() -> None:
    with pytest.raises(ArgumentTypeError, match=r"^namespace must be None, str, int, bytes or a "
                       r"tuple of those, got float 1\.5; encode other values \(a LoRA config, an "
                       r"image hash\) as one of those$"):
        namespace_bytes(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("seed", "page_size", "kind", "message"), [
    (-1, 4, ArgumentError, r"^seed=-1: expected an integer >= 0"),
    ("x", 4, ArgumentTypeError, r"^seed='x' \(str\): expected an integer >= 0"),
    (0, 0, ArgumentError, r"^page_size=0: expected an integer in 1\.\.65536"),
    (0, 65537, ArgumentError, r"^page_size=65537: expected an integer in 1\.\.65536"),
])
def test_prefix_keys_argument_errors_name_the_argument(seed: Any, page_size: Any, kind: type,
                                                       message: str) -> None:
    """The key function's bounds (a seed >= 0, pages of 1 .. 65536 tokens) and the argument
    each refusal names; the largest page size is accepted."""
    from kvmem.allocator import PrefixKeys

    with pytest.raises(kind, match=message):
        PrefixKeys(seed, page_size)
    assert PrefixKeys(0, 65536).page_size == 65536


@pytest.mark.parametrize(("max_pages", "kind"), [(-1, ArgumentError), (1.5, ArgumentTypeError)])
def test_prompt_keys_refuse_a_bad_max_pages_by_name(max_pages: Any, kind: type) -> None:
    from kvmem.allocator import PrefixKeys

    keys = PrefixKeys(0, P)
    with pytest.raises(kind, match=r"^max_pages=.*expected an integer >= 0"):
        keys.prompt_keys(np.arange(8), keys.root(None), max_pages)
    assert keys.prompt_keys(np.arange(8), keys.root(None), 0).shape == (0, 2)
    assert keys.prompt_keys(np.arange(8), keys.root(None), 1).shape == (1, 2)


def test_a_cache_serves_one_manager_and_says_so() -> None:
    """An unbound cache has no allocator, a bound one refuses a second manager: each error
    names the cache's class and what to do."""
    from kvmem import ConfigError, KVCacheManager

    cache = HashedPrefixCache(seed=3)
    with pytest.raises(ConfigError, match=r"^this HashedPrefixCache is not bound; give it to a "
                       r"KVCacheManager first$"):
        cache.allocator  # noqa: B018
    KVCacheManager(8, page_size=P, prefix_cache=cache)
    with pytest.raises(ConfigError, match=r"^this HashedPrefixCache is already bound to an "
                       r"allocator \(a manager\); give each KVCacheManager a new one$"):
        KVCacheManager(8, page_size=P, prefix_cache=cache)
    assert cache.allocator.num_pages == 8 and cache.page_size == P


@pytest.mark.parametrize(("seed", "kind", "message"), [
    (-1, ArgumentError, r"^seed=-1: expected an integer >= 0"),
    (1.5, ArgumentTypeError, r"^seed=1\.5 \(float\): expected an integer >= 0"),
])
def test_a_cache_seed_is_checked_by_name(seed: Any, kind: type, message: str) -> None:
    with pytest.raises(kind, match=message):
        HashedPrefixCache(seed=seed)
    assert HashedPrefixCache(seed=0).seed == 0
    assert HashedPrefixCache(seed=2**70).seed == 2**70


def test_evict_across_stale_lru_entries_takes_every_page_asked_for() -> None:
    """Pages acquired and released again leave stale LRU entries at the head: an eviction
    whose first window holds too few current entries reads on, and frees exactly the pages
    asked for, least recently released first."""
    cache, alloc = bound(num_pages=128)
    pages = np.concatenate([store(cache, alloc, np.arange(8) + 100 * i, None, 0)
                            for i in range(20)])  # 40 pages, 40 LRU entries
    alloc.share(pages)
    cache.acquired(pages)
    alloc.free(pages)
    cache.released(pages)  # 40 stale entries, then 40 current ones (deepest first)
    freed, keys = cache.evict(30)
    assert freed.tolist() == pages[::-1][:30].tolist()
    assert keys.shape == (30, 2) and cache.num_evictable == 10 and cache.num_cached == 10
    assert alloc.num_free == 128 - 10 and not cache.check()


def test_check_names_a_page_freed_behind_the_caches_back_and_a_stamp_count_drift() -> None:
    """The cache's own check says, in its words, what is wrong."""
    cache, alloc = bound()
    pages = store(cache, alloc, np.arange(8), None, 0)
    alloc.free(pages[1:])  # the cache's own reference, dropped behind its back
    assert f"cached pages [{pages[1]}] were freed or reallocated behind the cache's back" in (
        cache.check())
    cache2, alloc2 = bound()
    store(cache2, alloc2, np.arange(8), None, 0)
    cache2._num_evictable += 1
    assert "2 pages carry an LRU stamp, counter says 3" in cache2.check()


def test_a_cache_without_a_seed_draws_a_128_bit_secret_of_its_own() -> None:
    """seed=None: a random 128-bit seed per cache (keys no other process can recompute)."""
    a, b = HashedPrefixCache(), HashedPrefixCache()
    assert type(a.seed) is int and a.seed >= 0 and a.seed.bit_length() <= 128
    assert a.seed != b.seed
    a.bind(PageAllocator(4), P)
    b.bind(PageAllocator(4), P)
    assert not np.array_equal(a.root_key(None), b.root_key(None))


def test_check_names_a_cached_count_drift_and_evictable_pages_a_request_holds() -> None:
    """The check's other two lines, word for word: the counter of cached pages against the
    index and the marks, and the LRU against the pages only the cache holds (BUG 15)."""
    cache, alloc = bound()
    store(cache, alloc, np.arange(8), None, 0)
    cache._num_cached += 1
    assert cache.check() == ["index holds 2 live keys, 2 pages are marked cached, counter says 3"]
    cache, alloc = bound()
    pages = store(cache, alloc, np.arange(8), None, 0)
    alloc.share(pages)  # a holder the cache was not told about
    assert cache.check() == [f"evictable pages {pages.tolist()} differ from cached pages held by "
                             "the cache alone []"]


def test_check_sees_pages_marked_cached_outside_the_index_and_lists_16_stale_pages() -> None:
    """A page marked cached that no index entry names is a count problem, said once; the
    stale-page line lists at most 16 pages."""
    cache, alloc = bound()
    pages = store(cache, alloc, np.arange(8), None, 0)
    free_page = int(np.flatnonzero(alloc.refcounts == 0)[0])
    cache._cached[free_page] = True
    assert cache.check() == ["index holds 2 live keys, 3 pages are marked cached, counter says 2"]
    cache, alloc = bound(num_pages=32)
    pages = store(cache, alloc, np.arange(17 * P), None, 0)
    alloc.free(pages)  # every reference the cache holds, dropped behind its back
    assert f"cached pages {pages[:16].tolist()} were freed or reallocated behind the cache's " \
           "back" in cache.check()


def test_a_stale_index_entry_of_a_page_cached_again_is_sound() -> None:
    """An evicted page's index entry goes stale; the page, reallocated and cached under
    another key, is named by two entries, one live: the check finds nothing wrong."""
    cache, alloc = bound(num_pages=1)
    (page,) = store(cache, alloc, np.arange(4), None, 0)
    assert cache.evict(1)[0].tolist() == [page]
    (again,) = store(cache, alloc, np.arange(4) + 10, None, 0)
    assert again == page and len(cache._index) == 2
    assert cache.check() == []
