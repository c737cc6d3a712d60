"""Admission and prefix reuse: admit, can_admit, the watermark, namespaces, KV events, eviction."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from engine_helpers import run_prompt

from kvmem import (
    ArgumentError,
    ArgumentTypeError,
    KVMemError,
    OutOfPagesError,
)
from kvmem.allocator import HashedPrefixCache
from kvmem.manager import (
    AllPagesCleared,
    KVCacheManager,
    PagesRemoved,
    PagesStored,
)
from kvmem.testing import ToyEngine

P = 4


def prefill(m: KVCacheManager, rid: Any, prompt: list[int], ns: Any = None) -> int:
    res = m.admit(rid, prompt, namespace=ns)
    m.reserve([rid], len(prompt) - res.num_cached_tokens)
    m.commit(rid, prompt[res.num_cached_tokens:])
    return res.num_cached_tokens


def _cached_hashes(m: KVCacheManager) -> Counter[int]:
    c: Any = m.cache
    return Counter(int.from_bytes(k.tobytes(), "big") for k in c._keys[c._cached])


@pytest.mark.parametrize("between", [None, "evicted", "evicted and reallocated"])
def test_a_lookup_then_acquire_never_acquires_a_page_evicted_in_between(make_manager: Any,
        between: str | None) -> None:
    """BUGS.md 7: ``can_admit`` looks the prefix up, ``admit`` right after acquires what it
    found. A cached page evicted (and reallocated) in between, behind the manager's back,
    must not be acquired: the acquire validates each hit's tag and liveness in one step and
    matches again."""
    mgr = make_manager(num_pages=8)
    eng = ToyEngine(mgr)
    prompt: Any = np.arange(9)  # one array: the admit right after can_admit recalls its plan
    run_prompt(eng, "a", prompt)
    eng.release("a")
    assert mgr.can_admit(prompt)  # the lookup: pages 0 and 1 of "a" hit
    cache = mgr.cache
    assert cache is not None
    if between is not None:
        evicted, _ = cache.evict(2)
        assert evicted.size == 2
        if between == "evicted and reallocated":
            taken = mgr.allocator.allocate(mgr.allocator.num_free)  # someone else's now
            mgr.allocator.free(taken[~np.isin(taken, evicted)])
    res = eng.admit("b", prompt)  # the acquire
    assert res.num_cached_tokens == (8 if between is None else 0)
    if between == "evicted and reallocated":
        assert not np.isin(mgr.pages_of("b"), evicted).any()
        mgr.allocator.free(evicted)  # the other lifetime ends
    eng.step(["b"], 9 - res.num_cached_tokens)
    eng.commit(["b"])
    assert mgr.verify(["b"]).ok
    eng.check_kv()
    mgr.check()


@pytest.mark.parametrize("one, other", [(1, True), (0, False), ((1, "a"), (True, "a")),
                                        ("1", 1), (b"a", "a"), ((1,), 1)])
def test_namespaces_that_encode_apart_never_share_a_page(
        make_manager: Any, one: Any, other: Any) -> None:
    mgr = make_manager(max_seqs=6, max_pages_per_seq=8)
    eng = ToyEngine(mgr)
    prompt = list(range(13))
    res = eng.admit("x", prompt, one)
    eng.step(["x"], len(prompt) - res.num_cached_tokens)
    eng.commit(["x"])
    assert eng.admit("y", prompt, other).num_cached_tokens == 0
    assert eng.admit("z", prompt, one).num_cached_tokens == 12
    assert mgr.namespace_of_page(int(mgr.pages_of("y")[0])) is other


def test_a_float_namespace_is_refused_whatever_was_seen_before(make_manager: Any) -> None:
    mgr = make_manager(max_seqs=6, max_pages_per_seq=8)
    mgr.admit("x", [1, 2], 1)
    for bad in (1.0, float("nan"), [1]):
        with pytest.raises(ArgumentTypeError):
            mgr.admit("y", [1, 2], bad)
        with pytest.raises(ArgumentTypeError):
            mgr.can_admit([1, 2], bad)
    assert np.int64(1) is not None and mgr.admit("y", [1, 2], np.int64(1)).num_pages == 1


def test_match_prefix_finds_what_admit_reuses_and_changes_nothing(
        make_manager: Any, snapshot: Any) -> None:
    mgr = make_manager(max_seqs=6, max_pages_per_seq=8)
    eng = ToyEngine(mgr)
    prompt = list(range(13))
    res = eng.admit("a", prompt, "t")
    eng.step(["a"], len(prompt) - res.num_cached_tokens)
    eng.commit(["a"])
    before = snapshot(mgr)
    match = mgr.match_prefix(prompt, "t")
    assert match.num_pages == 3 and match.pages.tolist() == mgr.pages_of("a")[:3].tolist()
    assert mgr.match_prefix(prompt, "t", max_pages=1).num_pages == 1
    assert mgr.match_prefix(prompt, "other").num_pages == 0  # unseen namespace: nothing
    assert mgr.match_prefix(prompt, True).num_pages == 0
    assert snapshot(mgr) == before
    assert eng.admit("b", prompt, "t").num_cached_tokens == 12
    with pytest.raises(ArgumentTypeError):
        mgr.match_prefix(prompt, "t", max_pages=1.5)


@pytest.mark.parametrize(("first", "second"), [(1, True), (0, False), ((1, "a"), (True, "a"))])
def test_namespaces_that_differ_never_share_a_page(first: Any, second: Any) -> None:
    m = KVCacheManager(64, page_size=4, max_seqs=4)
    tokens = list(range(1, 10))
    m.admit("a", tokens, namespace=first)
    m.reserve(["a"], 9)
    m.commit("a", tokens)
    m.release("a")
    try:
        res = m.admit("b", tokens, namespace=second)
    except KVMemError:  # refusing the namespace outright also keeps tenants apart
        return
    assert res.num_cached_tokens == 0


def test_a_namespace_is_refused_or_accepted_whatever_was_seen_before() -> None:
    fresh = KVCacheManager(64, page_size=4, max_seqs=4)
    with pytest.raises(KVMemError):
        fresh.admit("x", [1, 2], namespace=1.0)
    seen = KVCacheManager(64, page_size=4, max_seqs=4)
    seen.admit("a", [1, 2], namespace=1)
    with pytest.raises(KVMemError):
        seen.admit("b", [1, 2], namespace=1.0)


def test_an_idle_manager_admits_what_fits() -> None:
    m = KVCacheManager(4, page_size=4, max_seqs=4, prefix_cache=None)
    p = list(range(1, 7))
    m.admit("a", p)
    m.reserve(["a"], 6)
    m.commit("a", p)
    m.fork("a", "b")
    step = m.reserve(["a"], 1)  # a writes into the shared tail: the engine copies page 1
    assert step.copy_src.size == 1
    m.commit("a", [9])
    m.release("a")
    m.release("b")
    assert not m.running
    assert m.can_admit(list(range(1, 17)))
    m.admit("c", list(range(1, 17)))  # all 4 pages


def test_namespace_of_page_refuses_a_negative_page() -> None:
    m = KVCacheManager(2, page_size=4, max_seqs=2, prefix_cache=None)
    m.admit("A", list(range(1, 8)), namespace="t")  # both pages
    with pytest.raises(ArgumentError):
        m.namespace_of_page(-1)


def test_admit_maps_the_whole_prompt_and_prefill_allocates_nothing_more(make_manager: Any) -> None:
    mgr = make_manager()
    res = mgr.admit("a", np.arange(10))
    assert (res.num_cached_tokens, res.num_prompt_tokens, res.num_pages) == (0, 10, 3)
    assert mgr.allocator.num_used == 3 and mgr.num_tokens("a") == 0
    step = mgr.reserve(["a"], 6)  # a prefill chunk
    assert mgr.allocator.num_used == 3
    pages = mgr.pages_of("a")
    assert step.slot_mapping.dtype == np.int64
    assert step.slot_mapping.tolist() == [pages[t // P] * P + t % P for t in range(6)]
    assert step.qo_indptr.tolist() == [0, 6] and step.seq_lens.tolist() == [6]
    assert step.kv_indptr.tolist() == [0, 2] and step.kv_indices.tolist() == pages[:2].tolist()
    assert step.kv_last_page_len.tolist() == [2]
    step = mgr.reserve(["a"], 4)  # the rest of the prompt
    assert step.slot_mapping.tolist() == [pages[t // P] * P + t % P for t in range(6, 10)]
    assert step.kv_indices.tolist() == pages.tolist() and step.kv_last_page_len.tolist() == [2]
    mgr.commit("a", np.arange(10))
    assert mgr.num_committed("a") == 10


def test_can_admit_counts_prefix_savings_and_the_watermark(make_manager: Any) -> None:
    mgr = make_manager(num_pages=8)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(17)))  # 5 pages, 4 full ones committed and cached
    assert mgr.allocator.num_free == 3
    prompt = np.array(list(range(16)) + [99] * 8)  # 6 pages, 4 of them cached
    assert mgr.can_admit(prompt)
    assert not mgr.can_admit(np.arange(100, 124))  # same size, nothing to reuse
    with pytest.raises(OutOfPagesError):
        mgr.admit("x", np.arange(100, 124))
    strict = make_manager(num_pages=8, watermark=0.25)  # keeps 2 pages free
    assert strict.can_admit(np.arange(24)) and not strict.can_admit(np.arange(28))
    assert mgr.admit("b", prompt).num_cached_tokens == 16


def test_same_namespace_shares_other_namespaces_never_do(make_manager: Any) -> None:
    mgr = make_manager()
    eng = ToyEngine(mgr)
    system = list(range(12))
    assert run_prompt(eng, "a", [*system, 50, 51]) == 0
    assert run_prompt(eng, "b", [*system, 60]) == 12  # same namespace: the whole system prompt
    assert run_prompt(eng, "t1", [*system, 70], ns="tenant-1") == 0  # and the other way round:
    assert run_prompt(eng, "t2", [*system, 80], ns="tenant-1") == 12
    assert run_prompt(eng, "n", [*system, 90], ns=None) == 12
    shared_a = set(mgr.pages_of("a")[:3].tolist())
    assert shared_a == set(mgr.pages_of("b")[:3].tolist())
    assert not shared_a & set(mgr.pages_of("t1").tolist())
    assert not shared_a & set(mgr.pages_of("t2").tolist())
    eng.check_kv()
    mgr.check()
    s = mgr.stats()
    assert s.num_prefix_queries == 5 and s.prefix_hit_tokens == 36


def test_pages_are_reusable_only_once_committed(make_manager: Any) -> None:
    """BUG 6: a same-step hit on a page whose KV is not written yet."""
    mgr = make_manager()
    eng = ToyEngine(mgr)
    eng.admit("a", list(range(9)))
    eng.step(["a"], 9)  # reserved and written, not committed
    assert eng.admit("b", list(range(9))).num_cached_tokens == 0
    eng.commit(["a"])
    assert eng.admit("c", list(range(9))).num_cached_tokens == 8
    eng.check_kv()


def test_the_last_prompt_token_is_always_computed(make_manager: Any) -> None:
    mgr = make_manager()
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(8)))
    res = eng.admit("b", list(range(8)))  # fully cached, page aligned
    assert res.num_cached_tokens == 4 and res.num_hit_pages == 1
    eng.step(["b"], 4)
    eng.commit(["b"])
    assert mgr.verify(["a", "b"]).ok
    eng.check_kv()


def test_eviction_is_lru_and_never_touches_pages_of_running_requests(make_manager: Any) -> None:
    """BUG 5: prefix pages freed while a running request still maps them."""
    mgr = make_manager(num_pages=12)
    eng = ToyEngine(mgr)
    run_prompt(eng, "keep", list(range(9)))  # 3 pages, 2 cached and in use
    run_prompt(eng, "old", [7] * 9)
    eng.release("old")
    run_prompt(eng, "new", [8] * 9)
    eng.release("new")
    assert mgr.stats().num_cached == 4  # 2 of "old", 2 of "new"; free: 12 - 3 - 4
    keep = mgr.pages_of("keep").tolist()
    cache = mgr.cache
    assert cache is not None and cache.match(np.array([7] * 9), None, 2).num_pages == 2
    assert run_prompt(eng, "big", [5] * 22) == 0  # 6 pages: 5 free + 1 evicted
    s = mgr.stats()
    assert s.num_evictions == 1 and s.num_cached == 3
    assert mgr.pages_of("keep").tolist() == keep
    # The least recently released prefix lost its deeper page first; the newer one is whole.
    assert cache.match(np.array([7] * 9), None, 2).num_pages == 1
    assert cache.match(np.array([8] * 9), None, 2).num_pages == 2
    assert mgr.verify(list(mgr.running)).ok
    eng.check_kv()
    mgr.check()


def test_a_cached_prefix_survives_its_writer(make_manager: Any) -> None:
    mgr = make_manager()
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(13)))
    eng.release("a")
    assert mgr.stats().num_cached == 3 and mgr.stats().num_used == 0
    assert run_prompt(eng, "b", list(range(13))) == 12
    eng.check_kv()


def test_kv_events_follow_what_the_cache_holds(make_manager: Any) -> None:
    mgr = make_manager(num_pages=8, kv_events=True)
    eng = ToyEngine(mgr)
    hooked: list[Any] = []
    mgr.add_hook("kv_event", lambda e: hooked.append(e.detail))
    run_prompt(eng, "a", list(range(9)), ns="t")
    stored = mgr.take_events()
    assert hooked == stored
    assert len(stored) == 1 and isinstance(stored[0], PagesStored)
    ev = stored[0]
    assert ev.parent_page_hash is None and len(ev.page_hashes) == 2
    assert ev.token_ids == tuple(range(8)) and ev.namespace == "t" and ev.page_size == P
    keys = mgr.cache.prompt_keys(np.arange(8), "t")  # type: ignore[union-attr]
    assert ev.page_hashes[0] == int.from_bytes(keys[0].tobytes(), "big")
    eng.step(["a"], 3)
    eng.commit(["a"])  # fills the third page
    (more,) = mgr.take_events()
    assert isinstance(more, PagesStored) and more.parent_page_hash == ev.page_hashes[1]
    eng.release("a")
    run_prompt(eng, "b", [5] * 26)  # evicts
    removed = [e for e in mgr.take_events() if isinstance(e, PagesRemoved)]
    assert removed and set(removed[0].page_hashes) <= {*ev.page_hashes, *more.page_hashes}
    mgr.clear_prefix_cache()
    assert isinstance(mgr.take_events()[-1], AllPagesCleared)
    assert mgr.take_events() == []


def test_many_namespaces_and_int_ids(make_manager: Any) -> None:
    mgr = make_manager(num_pages=64, max_seqs=16)
    eng = ToyEngine(mgr)
    for i in range(12):
        run_prompt(eng, i, list(range(9)), ns=("lora", i % 3))
    assert sum(mgr.stats().prefix_hit_tokens for _ in [0]) == 9 * 8
    assert mgr.verify(list(range(12))).ok
    eng.check_kv()
    mgr.check()


@pytest.mark.parametrize("prompt", [[], list(range(40))], ids=["empty", "too-long"])
def test_a_prompt_that_can_never_fit_is_refused_naming_the_request(
        make_manager: Any, snapshot: Any, prompt: list[int]) -> None:
    m = make_manager(max_pages_per_seq=8)
    prefill(m, "a", list(range(9)))
    m.preempt("a")
    before = snapshot(m)
    with pytest.raises(ArgumentError, match="'req-77'"):
        m.admit("req-77", prompt)
    with pytest.raises(ArgumentError, match="'a'"):
        m.resume("a", prompt)
    assert snapshot(m) == before and m.preempted == ("a",)


@pytest.mark.parametrize("bad", [np.array([1.0, 2.0, 3.0]), np.array([True, False, True])],
                         ids=["float", "bool"])
def test_admit_refuses_a_non_integer_prompt_even_right_after_can_admit(
        make_manager: Any, snapshot: Any, bad: Any) -> None:
    # errors.md: "a list holding a float or a bool" is refused; can_admit remembers its plan
    # for the admit right after, which must not let such a prompt through.
    m = make_manager(max_pages_per_seq=8)
    assert m.can_admit(bad.astype(np.int64))
    before = snapshot(m)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        m.admit("x", bad)
    assert snapshot(m) == before


def test_kv_events_replay_to_exactly_what_the_cache_holds(make_manager: Any) -> None:
    rng = np.random.default_rng(5)
    m = make_manager(num_pages=24, kv_events=True, max_pages_per_seq=8)
    held: Counter[int] = Counter()
    n = 0
    for _ in range(150):
        op = rng.integers(6)
        running = list(m.running)
        try:
            if op == 0:
                m.admit(n, [1, 2, 3, 4, 5, 6, 7, 8, *rng.integers(0, 3, 4).tolist()],
                        namespace=str(rng.integers(2)))
                n += 1
            elif op == 1 and running:
                m.reserve(running, 2)
            elif op == 2 and running:
                todo = [r for r in running if m.num_tokens(r) > m.num_committed(r)]
                if todo:
                    m.commit_batch(todo, [rng.integers(0, 3, m.num_tokens(r)
                                                       - m.num_committed(r)).tolist()
                                          for r in todo])
            elif op == 3 and running:
                m.fork(running[int(rng.integers(len(running)))], n)
                n += 1
            elif op == 4 and running:
                m.release(running[int(rng.integers(len(running)))])
            elif op == 5 and rng.random() < 0.2:
                m.clear_prefix_cache()
        except KVMemError:
            pass  # out of pages or rows: refused, nothing changed
        for e in m.take_events():
            if isinstance(e, PagesStored):
                held.update(e.page_hashes)
            elif isinstance(e, PagesRemoved):
                held.subtract(e.page_hashes)
            else:
                assert isinstance(e, AllPagesCleared)
                held.clear()
        assert min(held.values(), default=0) >= 0
        assert +held == _cached_hashes(m)
    m.check()


def test_allocate_and_free_events_alone_follow_which_pages_are_in_use(make_manager: Any) -> None:
    rng = np.random.default_rng(11)
    m = make_manager(num_pages=20, max_seqs=5, max_pages_per_seq=6)
    live: Counter[int] = Counter()
    m.add_hook("allocate", lambda e: live.update(np.asarray(e.pages).tolist()))
    m.add_hook("free", lambda e: live.subtract(np.asarray(e.pages).tolist()))
    handles: list[Any] = []
    n = 0
    for _ in range(300):
        op, running = int(rng.integers(8)), list(m.running)
        pick = running[int(rng.integers(len(running)))] if running else None
        try:
            if op == 0:
                m.admit(n, [1, 2, 3, 4, 5, *rng.integers(0, 3, int(rng.integers(6))).tolist()])
                n += 1
            elif op == 1 and running:
                m.reserve(running, int(rng.integers(1, 4)))
            elif op == 2 and pick is not None:
                m.commit(pick, [1] * (m.num_tokens(pick) - m.num_committed(pick)))
            elif op == 3 and pick is not None:
                m.fork(pick, n)
                n += 1
            elif op == 4 and pick is not None:
                m.release(pick) if rng.random() < 0.7 else m.preempt(pick)
            elif op == 5 and m.preempted:
                m.resume(m.preempted[0])
            elif op == 6:
                handles.append(m.begin_step())
            elif op == 7 and handles:
                m.retire(handles.pop(int(rng.integers(len(handles)))))
        except KVMemError:
            pass  # out of pages, rows or row length: refused, nothing changed
        assert set(+live) == set(np.flatnonzero(m.allocator.refcounts).tolist())
        assert max(live.values(), default=0) <= 1
    m.check()


@pytest.mark.parametrize("ns", [None, "tenant", ("lora", 3)])
def test_a_router_with_the_seed_recomputes_every_stored_hash(make_manager: Any, ns: Any) -> None:
    from kvmem.allocator import PrefixKeys, keys_as_ints

    m = make_manager(prefix_cache=HashedPrefixCache(seed=7), kv_events=True, max_pages_per_seq=8)
    prompt = list(range(20, 33))
    m.admit("r", prompt, namespace=ns)
    m.reserve(["r"], 13)
    m.commit("r", prompt)
    m.reserve(["r"], 3)
    m.commit("r", [1, 2, 3])  # fills a fourth page, chained from the third
    first, second = m.take_events()
    assert isinstance(first, PagesStored) and isinstance(second, PagesStored)
    router = PrefixKeys(7, P)
    keys = keys_as_ints(router.prompt_keys(np.array([*prompt, 1, 2, 3]), router.root(ns)))
    assert [*first.page_hashes, *second.page_hashes] == keys
    assert first.parent_page_hash is None and second.parent_page_hash == keys[2]
    assert second.token_ids == (32, 1, 2, 3) and second.namespace == ns


def test_can_admit_keeps_exactly_the_watermark_pages_free() -> None:
    m = KVCacheManager(num_pages=100, page_size=P, max_seqs=4, max_pages_per_seq=100,
                       watermark=0.29)
    assert m.watermark_pages == int(0.29 * 100) == 28
    assert m.can_admit(list(range(72 * P)))  # leaves 28
    assert not m.can_admit(list(range(72 * P + 1)))  # would leave 27
    m.admit("a", list(range(72 * P)))
    assert m.stats().num_free == 28


def test_clear_prefix_cache_counts_what_it_forgot_and_frees_only_unheld_pages(
        make_manager: Any) -> None:
    m = make_manager(num_pages=16, kv_events=True, max_pages_per_seq=8)
    prefill(m, "a", list(range(9)))  # pages 0, 1 cached
    m.admit("b", list(range(9)))  # shares them
    h = m.begin_step()
    m.release("a")
    free = m.stats().num_free
    assert m.clear_prefix_cache() == 2
    s = m.stats()
    assert (s.num_free, s.num_cached) == (free, 0) and m.take_events()[-1] == AllPagesCleared()
    assert m.match_prefix(list(range(9))).pages.size == 0
    m.retire(h)
    m.release("b")
    assert m.stats().num_free == 16
    m.check()


class NamespaceBlindKeys(HashedPrefixCache):
    """A weak key function: every namespace chains from the same root (BUGS 11's cache key
    that misses an input), so only the namespace stored with each page tells tenants apart."""

    def root_key(self, namespace: Any) -> Any:
        return super().root_key(None)


def test_match_prefix_confirms_the_namespace_even_when_the_keys_collide() -> None:
    """With keys equal across namespaces, match_prefix in another (seen) namespace still finds
    nothing: the manager hands the cache its namespace id to confirm every hit with."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, prefix_cache=NamespaceBlindKeys(seed=1),
                       watermark=0.0)
    prompt = list(range(9))
    prefill(m, "a", prompt, ns="x")
    prefill(m, "b", [7, 7, 7], ns="y")  # "y" is a namespace the manager has seen
    assert m.match_prefix(prompt, "x").num_pages == 2
    assert m.match_prefix(prompt, "y").num_pages == 0
    assert m.admit("c", prompt, namespace="y").num_cached_tokens == 0


def test_match_prefix_in_the_default_namespace_finds_cached_pages() -> None:
    """Namespace None has id 0, a seen namespace like any other: its pages are found."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, watermark=0.0)
    prompt = list(range(9))
    prefill(m, "a", prompt)
    match = m.match_prefix(prompt)
    assert match.num_pages == 2 and match.pages.tolist() == m.pages_of("a")[:2].tolist()


@pytest.mark.parametrize("case", ["no cache", "unseen namespace", "max_pages 0"])
def test_an_empty_prefix_match_has_the_documented_shapes(case: str) -> None:
    """Where nothing can match (no prefix cache, a namespace the manager never saw, no page
    asked for), match_prefix returns an empty match of the documented dtypes and shapes:
    pages [0] int32, keys [0, 2] uint64, root_key [2] uint64, num_evictable 0."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, watermark=0.0,
                       prefix_cache=None if case == "no cache" else "hashed")
    prompt = list(range(9))
    prefill(m, "a", prompt)
    match = m.match_prefix(prompt, "never seen" if case == "unseen namespace" else None,
                           0 if case == "max_pages 0" else None)
    assert match.pages.dtype == np.int32 and match.pages.shape == (0,)
    assert match.keys.dtype == np.uint64 and match.keys.shape == (0, 2)
    assert match.root_key.dtype == np.uint64 and match.root_key.shape == (2,)
    assert match.last_key.shape == (2,)
    assert type(match.num_evictable) is int and match.num_evictable == 0
    assert match.num_pages == 0
    # The root key is the namespace's (what PrefixMatch promises), zeros without a cache.
    ns = "never seen" if case == "unseen namespace" else None
    want = [0, 0] if m.cache is None else m.cache.root_key(ns).tolist()
    assert match.root_key.tolist() == match.last_key.tolist() == want


@pytest.mark.parametrize(("call", "prompt", "message"), [
    ("can_admit", [], r"^a request needs at least one prompt token; got none \(nothing "
                      r"changed\)$"),
    ("admit", [], r"^request 'x' needs at least one prompt token; got none \(nothing changed\)$"),
    ("can_admit", list(range(40)), r"^a request: a prompt of 40 tokens needs 10 pages but a "
                                   r"request may map at most max_pages_per_seq=8; shorten it or "
                                   r"raise the limit \(nothing changed\)$"),
    ("admit", list(range(40)), r"^request 'x': a prompt of 40 tokens needs 10 pages but a "
                               r"request may map at most max_pages_per_seq=8; shorten it or "
                               r"raise the limit \(nothing changed\)$"),
])
def test_a_prompt_that_can_never_fit_is_refused_with_the_whole_story(
        snapshot: Any, call: str, prompt: list[int], message: str) -> None:
    """admit names the request, can_admit (which has no id) says "a request"; both say what
    was found and what to do, and change nothing."""
    m = KVCacheManager(32, page_size=P, max_seqs=2, max_pages_per_seq=8, watermark=0.0)
    before = snapshot(m)
    with pytest.raises(ArgumentError, match=message):
        m.admit("x", prompt) if call == "admit" else m.can_admit(prompt)
    assert snapshot(m) == before
    assert m.can_admit(list(range(32)))  # 8 pages: the longest prompt a row maps


def test_admit_with_every_row_mapped_says_what_to_do(snapshot: Any) -> None:
    m = KVCacheManager(32, page_size=P, max_seqs=2, watermark=0.0)
    m.admit("a", [1])
    m.admit("b", [2])
    before = snapshot(m)
    with pytest.raises(KVMemError, match=r"^all max_seqs=2 rows are mapped; release or preempt a "
                       r"request before admitting another$"):
        m.admit("c", [3])
    assert snapshot(m) == before


def test_a_manager_tells_apart_at_most_max_namespaces() -> None:
    """Namespace ids are 0 (None) .. MAX_NAMESPACES - 1: the last one is given, the next
    namespace is refused with what to do, and None keeps id 0 throughout."""
    from kvmem.allocator import Namespaces
    from kvmem.integrity import MAX_NAMESPACES

    names = Namespaces()
    assert names.id_of(None, False) == 0 and names.name(0) is None
    assert names.id_of("t", False) == -1
    for i in range(1, MAX_NAMESPACES):
        assert names.id_of(i, True, b"i%d" % i) == i
    assert names.id_of(MAX_NAMESPACES - 1, False) == MAX_NAMESPACES - 1
    with pytest.raises(KVMemError, match=rf"^this manager has seen {MAX_NAMESPACES} namespaces, "
                       r"the most it can tell apart; use fewer \(a namespace is a tenant, adapter "
                       r"or salt, not a request\)$"):
        names.id_of("one more", True)
    assert names.id_of("one more", False) == -1 and names.id_of(None, True) == 0


def test_can_admit_of_an_unseen_namespace_registers_nothing(snapshot: Any) -> None:
    """can_admit changes nothing, not even the namespaces the manager has seen: the
    namespace gets its id at admit."""
    m = KVCacheManager(32, page_size=P, max_seqs=2, watermark=0.0)
    before = snapshot(m)
    assert m.can_admit([1, 2, 3], namespace="new tenant")
    assert snapshot(m) == before
    m.admit("a", [1, 2, 3], namespace="new tenant")
    assert snapshot(m) != before


def test_without_a_prefix_cache_can_admit_counts_every_page_and_a_free_row() -> None:
    """No cache, no hit: a 3-page prompt does not fit 2 free pages; and no prompt fits
    while every row is mapped."""
    m = KVCacheManager(3, page_size=P, max_seqs=2, prefix_cache=None, watermark=0.0)
    m.admit("a", [1])
    assert not m.can_admit(list(range(9))) and m.can_admit(list(range(8)))
    with pytest.raises(OutOfPagesError):
        m.admit("b", list(range(9)))
    m.admit("b", [2])
    assert m.stats().num_free == 1 and not m.can_admit([3])


@pytest.mark.parametrize("other", ["tokens differ", "every token differs", "longer",
                                   "namespace", "namespace None"])
def test_admit_right_after_can_admit_reuses_its_plan_only_for_the_same_prompt(other: str) -> None:
    """admit() reuses the plan of the can_admit() right before it only for the same tokens
    and namespace: another prompt or namespace is matched afresh, so it never maps the
    pages the first prompt would have hit (BUGS 10, 11)."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, watermark=0.0)
    prompt = np.arange(9)
    asked_ns = None if other == "namespace None" else "x"
    prefill(m, "a", prompt.tolist(), ns=asked_ns)
    prefill(m, "y", [7, 7, 7], ns="y")
    admit_ns = {"namespace": "y", "namespace None": "y"}.get(other, asked_ns)
    tokens = {"tokens differ": np.array([50, *range(1, 9)]), "every token differs": prompt + 100,
              "longer": np.array([50, *range(1, 10)])}.get(other, prompt)
    assert m.can_admit(prompt, namespace=asked_ns)
    res = m.admit("b", tokens, namespace=admit_ns)
    assert res.num_cached_tokens == 0
    assert not set(m.pages_of("b").tolist()) & set(m.pages_of("a").tolist())


def test_admit_after_another_call_matches_the_prompt_again() -> None:
    """A can_admit, then a commit that caches the prompt's pages, then admit: admit sees
    the pages cached since (the plan of the earlier can_admit is not reused)."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, watermark=0.0)
    prompt = list(range(9))
    m.admit("a", prompt)
    m.reserve(["a"], 9)
    assert m.can_admit(prompt)
    m.commit("a", prompt)
    assert m.admit("b", prompt).num_cached_tokens == 8


def test_admit_after_can_admit_of_a_new_namespace_labels_its_pages_with_it() -> None:
    """can_admit plans before an unseen namespace has an id; the admit right after it gives
    the namespace its own id, and the request's pages carry it (not None's, not a bool's)."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, watermark=0.0)
    prompt = np.arange(9)  # (an array: admit may reuse can_admit's plan)
    assert m.can_admit(prompt, namespace="new")
    m.admit("b", prompt, namespace="new")
    assert {m.namespace_of_page(int(p)) for p in m.pages_of("b")} == {"new"}
    m.reserve(["b"], 9)
    m.commit("b", prompt)
    assert m.match_prefix(prompt, "new").num_pages == 2
    assert m.match_prefix(prompt, None).num_pages == 0


def test_admit_out_of_pages_says_how_many_it_needs_and_has(snapshot: Any) -> None:
    """The error of an admit that does not fit counts the pages the prompt needs beyond its
    cached prefix and the pages to be had (free, less evictable hits)."""
    m = KVCacheManager(4, page_size=P, max_seqs=4, max_pages_per_seq=8, watermark=0.0)
    prefill(m, "a", list(range(9)))  # pages 0-1 cached and held by "a", page 2 its own
    before = snapshot(m)
    with pytest.raises(OutOfPagesError) as info:
        m.admit("b", [*range(8), *range(100, 112)])  # 5 pages, 2 of them hits: needs 3
    assert (info.value.num_requested, info.value.num_free) == (3, 1)
    assert str(info.value) == ("asked for 3 pages but only 1 are free; nothing was allocated. "
                               "Preempt or release a request (or retire a step in flight) and "
                               "retry; can_admit(), can_reserve() and can_fork() ask first.")
    assert snapshot(m) == before


def test_admit_out_of_pages_does_not_count_its_own_evictable_hits_as_free(snapshot: Any) -> None:
    """Hits held by the cache alone stop being evictable once admitted: the error's free
    count leaves them out."""
    m = KVCacheManager(4, page_size=P, max_seqs=4, max_pages_per_seq=8, watermark=0.0)
    prefill(m, "a", list(range(9)))
    m.release("a")  # pages 0-1 cached, held by the cache alone: 2 free + 2 evictable
    before = snapshot(m)
    assert not m.can_admit([*range(8), *range(100, 112)])
    assert m.can_admit([*range(8), *range(100, 108)])  # 2 hits + 2 new pages: fits
    with pytest.raises(OutOfPagesError) as info:
        m.admit("b", [*range(8), *range(100, 112)])
    assert (info.value.num_requested, info.value.num_free) == (3, 2)
    assert snapshot(m) == before
