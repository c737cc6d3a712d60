"""KVCacheManager: lifecycle, metadata, prefix reuse, fences, hooks, events, and detectors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmem import CheckingTracker, IntegrityError, KVMemError, OutOfPagesError
from kvmem.allocator import HashedPrefixCache, Namespace
from kvmem.manager import (
    AllPagesCleared,
    HookError,
    KVCacheManager,
    ManagerEvent,
    PagesRemoved,
    PagesStored,
)
from kvmem.testing import ToyEngine, faults

P = 4


def make(num_pages: int = 32, **kw: Any) -> KVCacheManager:
    kw.setdefault("tracker", "checking")
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(num_pages=num_pages, page_size=P, max_seqs=kw.pop("max_seqs", 8),
                          max_pages_per_seq=kw.pop("max_pages_per_seq", 16), **kw)


def state(mgr: KVCacheManager) -> tuple[Any, ...]:
    """Everything a failed operation must leave untouched."""
    return (mgr.allocator.refcounts.tobytes(), mgr.allocator.tags.tobytes(),
            mgr.table.pages.tobytes(), mgr.table.num_tokens.tobytes(), mgr.stats(),
            tuple(mgr.running), tuple(mgr.preempted), mgr.table.num_committed.tobytes())


def run_prompt(eng: ToyEngine, rid: Any, prompt: list[int], ns: Any = None) -> int:
    """Admit, prefill in one chunk, commit; returns the cached token count."""
    res = eng.admit(rid, prompt, ns)
    eng.step([rid], len(prompt) - res.num_cached_tokens)
    eng.commit([rid])
    return res.num_cached_tokens


# -- lifecycle and metadata -----------------------------------------------------------------------


def test_admit_maps_the_whole_prompt_and_prefill_allocates_nothing_more() -> None:
    mgr = make()
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


def test_decode_step_metadata_for_a_batch() -> None:
    mgr = make()
    for rid, n in (("a", 4), (7, 5), ("c", 1)):
        assert mgr.admit(rid, np.arange(n) + 10 * n).num_cached_tokens == 0
        mgr.reserve([rid], n)
        mgr.commit(rid, np.arange(n) + 10 * n)
    step = mgr.reserve(["a", 7, "c"], 1)
    assert step.request_ids == ("a", 7, "c")
    assert step.seq_lens.tolist() == [5, 6, 2] and step.qo_indptr.tolist() == [0, 1, 2, 3]
    assert step.kv_indptr.tolist() == [0, 2, 4, 5]
    assert step.kv_last_page_len.tolist() == [1, 2, 2]
    # "a" crossed a page boundary: its new token opens its second page.
    assert step.slot_mapping[0] == mgr.pages_of("a")[1] * P
    table = step.block_table
    assert table.dtype == np.int32 and table.shape == (3, 2)
    assert table.tolist() == [mgr.pages_of("a").tolist(), mgr.pages_of(7).tolist(),
                              [mgr.pages_of("c")[0], -1]]
    assert step.num_pages.tolist() == [2, 2, 1]


def test_speculative_and_per_request_token_counts() -> None:
    mgr = make()
    for rid in ("a", "b"):
        mgr.admit(rid, np.arange(3))
        mgr.reserve([rid], 3)
    step = mgr.reserve(["a", "b"], [4, 0])
    assert step.qo_indptr.tolist() == [0, 4, 4] and step.seq_lens.tolist() == [7, 3]
    assert step.slot_mapping.size == 4


def test_can_admit_counts_prefix_savings_and_the_watermark() -> None:
    mgr = make(num_pages=8)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(17)))  # 5 pages, 4 full ones committed and cached
    assert mgr.allocator.num_free == 3
    prompt = np.array(list(range(16)) + [99] * 8)  # 6 pages, 4 of them cached
    assert mgr.can_admit(prompt)
    assert not mgr.can_admit(np.arange(100, 124))  # same size, nothing to reuse
    with pytest.raises(OutOfPagesError):
        mgr.admit("x", np.arange(100, 124))
    strict = make(num_pages=8, watermark=0.25)  # keeps 2 pages free
    assert strict.can_admit(np.arange(24)) and not strict.can_admit(np.arange(28))
    assert mgr.admit("b", prompt).num_cached_tokens == 16


def test_errors_change_nothing() -> None:
    mgr = make(num_pages=5, max_pages_per_seq=4)
    mgr.admit("a", np.arange(8))
    mgr.reserve(["a"], 8)
    before = state(mgr)
    cases = [
        (KVMemError, lambda: mgr.admit("a", np.arange(3))),  # duplicate id
        (KVMemError, lambda: mgr.admit("b", np.arange(17))),  # longer than max_pages_per_seq
        (KVMemError, lambda: mgr.admit("b", [])),
        (KVMemError, lambda: mgr.admit("b", np.array([1, -1]))),
        (KVMemError, lambda: mgr.admit("b", np.array([[1, 2]]))),
        (KVMemError, lambda: mgr.admit("b", np.array([1.5]))),
        (OutOfPagesError, lambda: mgr.admit("b", np.arange(16))),
        (KVMemError, lambda: mgr.reserve(["zzz"], 1)),
        (KVMemError, lambda: mgr.reserve(["a"], 9)),  # beyond max_pages_per_seq
        (KVMemError, lambda: mgr.reserve(["a"], -1)),
        (ValueError, lambda: mgr.reserve(["a", "a"], 1)),
        (KVMemError, lambda: mgr.commit("a", np.arange(9))),  # more than reserved
        (KVMemError, lambda: mgr.commit_batch(["a", "a"], np.array([1, 2]))),
        (KVMemError, lambda: mgr.release("zzz")),
        (KVMemError, lambda: mgr.preempt("zzz")),
        (KVMemError, lambda: mgr.resume("a")),  # running, not preempted
        (KVMemError, lambda: mgr.fork("a", "a")),
        (KVMemError, lambda: mgr.add_hook("nope", print)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
        assert state(mgr) == before, call
    mgr.check()


def test_out_of_pages_on_reserve_then_preempt_and_retry() -> None:
    mgr = make(num_pages=4, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    run_prompt(eng, "b", [2] * 8)
    assert not mgr.can_reserve(["a", "b"], 1)
    before = state(mgr)
    with pytest.raises(OutOfPagesError):
        mgr.reserve(["a", "b"], 1)
    assert state(mgr) == before
    eng.preempt("b")
    eng.step(["a"], 1)
    eng.commit(["a"])
    eng.check_kv()
    assert mgr.preempted == ("b",) and not mgr.can_resume("b")
    eng.release("a")
    res = eng.resume("b")
    assert res.num_prompt_tokens == 8 and mgr.stats().num_preemptions == 1
    eng.step(["b"], 8)
    eng.check_kv()


def test_the_manager_keeps_its_own_copy_of_token_ids() -> None:
    mgr = make()
    prompt = np.arange(6)
    mgr.admit("a", prompt)
    prompt[:] = 77  # the engine reuses its buffer
    mgr.preempt("a")
    assert mgr.resume("a").num_prompt_tokens == 6
    mgr.reserve(["a"], 6)
    mgr.commit("a", np.arange(6))
    assert mgr.tokens_of("a").tolist() == list(range(6))


def test_tracker_configuration_is_checked() -> None:
    with pytest.raises(KVMemError, match="tracker records"):
        make(tracker=CheckingTracker(2, 2))
    with pytest.raises(KVMemError):
        make(tracker="bogus")
    with pytest.raises(KVMemError):
        make(prefix_cache="radix")
    with pytest.raises(ValueError):
        KVCacheManager(num_pages=0, max_pages_per_seq=4)
    assert make(tracker=CheckingTracker(8, 16)).tracker.enabled


# -- prefix reuse ---------------------------------------------------------------------------------


def test_same_namespace_shares_other_namespaces_never_do() -> None:
    mgr = make()
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


def test_pages_are_reusable_only_once_committed() -> None:
    """BUG 6: a same-step hit on a page whose KV is not written yet."""
    mgr = make()
    eng = ToyEngine(mgr)
    eng.admit("a", list(range(9)))
    eng.step(["a"], 9)  # reserved and written, not committed
    assert eng.admit("b", list(range(9))).num_cached_tokens == 0
    eng.commit(["a"])
    assert eng.admit("c", list(range(9))).num_cached_tokens == 8
    eng.check_kv()


def test_the_last_prompt_token_is_always_computed() -> None:
    mgr = make()
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(8)))
    res = eng.admit("b", list(range(8)))  # fully cached, page aligned
    assert res.num_cached_tokens == 4 and res.num_hit_pages == 1
    eng.step(["b"], 4)
    eng.commit(["b"])
    assert mgr.verify(["a", "b"]).ok
    eng.check_kv()


def test_eviction_is_lru_and_never_touches_pages_of_running_requests() -> None:
    """BUG 5: prefix pages freed while a running request still maps them."""
    mgr = make(num_pages=12)
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


def test_a_cached_prefix_survives_its_writer() -> None:
    mgr = make()
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(13)))
    eng.release("a")
    assert mgr.stats().num_cached == 3 and mgr.stats().num_used == 0
    assert run_prompt(eng, "b", list(range(13))) == 12
    eng.check_kv()


# -- fork and copy-on-write -----------------------------------------------------------------------


def test_fork_shares_pages_and_copies_a_partly_filled_tail_on_write() -> None:
    """BUG 14 (no copy-on-write) and BUG 4 (fork refcounts)."""
    mgr = make()
    eng = ToyEngine(mgr)
    run_prompt(eng, "p", list(range(6)))  # page 0 full, page 1 holds 2 tokens
    eng.fork("p", "c1")
    eng.fork("p", "c2")
    pages = mgr.pages_of("p")
    assert mgr.allocator.refcounts[pages].tolist() == [4, 3]  # + the cache on the full page
    step = eng.step(["p", "c1", "c2"], 1)
    assert step.copy_src.tolist() == [pages[1], pages[1]]  # two copies; the parent keeps its
    assert len(set(step.copy_dst.tolist())) == 2
    assert mgr.pages_of("p")[1] == pages[1]
    assert mgr.verify(["p", "c1", "c2"], step).ok
    eng.commit(["p", "c1", "c2"])
    eng.check_kv()
    for _ in range(4):
        eng.step(["p", "c1", "c2"], 1)
        eng.commit(["p", "c1", "c2"])
    eng.check_kv()
    assert mgr.stats().num_cow_copies == 2 and mgr.stats().num_forks == 2
    for rid in ("p", "c1", "c2"):
        eng.release(rid)
    mgr.check()
    assert mgr.stats().num_used == 0


def test_a_fork_of_a_full_tail_needs_no_copy_and_reserved_room_is_private() -> None:
    mgr = make()
    eng = ToyEngine(mgr)
    eng.admit("p", list(range(12)))
    eng.step(["p"], 8)  # two full pages written, the third reserved for the prompt's rest
    eng.fork("p", "c")
    assert mgr.pages_of("p")[:2].tolist() == mgr.pages_of("c")[:2].tolist()
    assert mgr.pages_of("p")[2] != mgr.pages_of("c")[2]
    step = eng.step(["p", "c"], 4)
    assert step.copy_src.size == 0
    eng.commit(["p", "c"])
    eng.check_kv()


# -- fences ---------------------------------------------------------------------------------------


def test_pages_released_during_a_step_are_freed_when_it_retires() -> None:
    """BUGS 1, 9: pages freed and reused while a launched step still reads them."""
    mgr = make(num_pages=6, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 12)  # 3 pages
    pages = mgr.pages_of("a")
    tags = mgr.allocator.tags[pages].copy()
    h1 = mgr.begin_step()
    h2 = mgr.begin_step()
    eng.release("a")
    s = mgr.stats()
    assert (s.num_free, s.num_fenced, s.steps_in_flight) == (3, 3, 2)
    assert not mgr.can_admit(np.arange(16))
    with pytest.raises(OutOfPagesError):
        mgr.admit("b", np.arange(16))
    assert (mgr.allocator.tags[pages] == tags).all()
    mgr.check()
    mgr.retire(h2)  # out of order: h1 still reads them
    assert mgr.stats().num_fenced == 3
    mgr.retire(h1)
    assert mgr.stats().num_fenced == 0 and mgr.allocator.num_free == 6
    with pytest.raises(KVMemError, match="not an open step"):
        mgr.retire(h1)
    mgr.check()


def _finished_batch(mgr: KVCacheManager) -> list[Any]:
    """Requests sharing prefixes (two namespaces), a fork, a preempted one: the ids to release."""
    eng = ToyEngine(mgr)
    system = list(range(9))
    for i in range(5):
        run_prompt(eng, i, system + [100 + i] * (3 + i), ns="t" if i % 2 else None)
    eng.fork(1, "1b")
    for _ in range(3):
        eng.step([0, 1, "1b", 2, 3, 4], 1)
        eng.commit([0, 1, "1b", 2, 3, 4])
    eng.preempt(3)
    return [2, "1b", 0, 3, 1]


def test_release_batch_equals_releasing_one_by_one() -> None:
    one, many = make(num_pages=64), make(num_pages=64)
    ids = _finished_batch(one)
    assert _finished_batch(many) == ids
    freed: dict[KVCacheManager, list[ManagerEvent]] = {one: [], many: []}
    for mgr in (one, many):
        mgr.add_hook("free", freed[mgr].append)
    for rid in ids:
        one.release(rid)
    many.release_batch(ids)
    for mgr in (one, many):
        mgr.check()
        assert mgr.running == (4,) and mgr.preempted == ()
    assert one.stats() == many.stats()
    assert (one.allocator.refcounts == many.allocator.refcounts).all()
    assert len(freed[many]) == 1  # one free for the batch
    assert sorted(np.concatenate([e.pages for e in freed[one]]).tolist()) == sorted(
        freed[many][0].pages.tolist())
    assert one.cache is not None and many.cache is not None
    n = one.cache.num_evictable
    assert n > 0  # the least recently used first, in the same order
    assert one.cache.evict(n)[0].tolist() == many.cache.evict(n)[0].tolist()


def test_a_request_listed_twice_in_a_batch_is_rejected_and_changes_nothing() -> None:
    mgr = make(num_pages=64)
    for rid in ("a", "b"):
        mgr.admit(rid, np.arange(5))
    before = state(mgr)
    for num in (1, P + 1, [1, 2, 3]):  # the one-page path, the general path, per-row counts
        with pytest.raises(ValueError, match="distinct"):
            mgr.reserve(["a", "b", "a"], num)
        assert state(mgr) == before
    mgr.reserve(["a", "b"], 1)
    before = state(mgr)
    with pytest.raises(KVMemError, match="distinct"):
        mgr.commit_batch(["b", "b"], np.array([1, 2]))
    assert state(mgr) == before
    mgr.commit_batch(["a", "b"], np.array([1, 2]))
    mgr.check()


def test_release_batch_is_all_or_nothing_and_fenced() -> None:
    mgr = make(num_pages=64)
    ids = _finished_batch(mgr)
    before = state(mgr)
    with pytest.raises(KVMemError, match="unknown"):
        mgr.release_batch([2, "nope", 0])
    with pytest.raises(ValueError, match="distinct"):
        mgr.release_batch([2, 0, 2])
    assert state(mgr) == before
    handle = mgr.begin_step()
    mgr.release_batch(ids)
    assert mgr.stats().num_fenced > 0
    mgr.check()
    mgr.retire(handle)
    assert mgr.stats().num_fenced == 0
    mgr.check()


def test_a_step_opened_after_a_release_does_not_hold_its_pages() -> None:
    mgr = make(num_pages=6, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    h1 = mgr.begin_step()
    eng.release("a")
    h2 = mgr.begin_step()
    mgr.retire(h1)
    assert mgr.stats().num_fenced == 0  # h2 began after the release
    mgr.retire(h2)


def test_preemption_and_abort_during_a_step_are_fenced() -> None:
    mgr = make(num_pages=8)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(9)))
    run_prompt(eng, "b", list(range(50, 59)))
    h = mgr.begin_step()
    eng.preempt("a")
    faults.free_behind_back(mgr, "b", 2)
    assert list(mgr.verify(["b"]).aborted) == ["b"]
    assert mgr.stats().num_fenced == 1  # a's private tail; the full pages stay cached
    mgr.check()
    mgr.retire(h)
    mgr.check()
    assert mgr.stats().num_fenced == 0


def test_a_lost_fence_completion_is_reported_as_a_leak() -> None:
    """BUG 2: the deferred free never gets its completion signal."""
    mgr = make(prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    mgr.begin_step()
    eng.release("a")
    mgr.check()  # fenced pages are accounted for
    assert faults.lose_fence_completion(mgr) == 2
    with pytest.raises(IntegrityError, match="differ from their holders"):
        mgr.check()


# -- verify: each detector fires on its fault, only on the victim, and never on correct runs ----


def three_running(**kw: Any) -> tuple[KVCacheManager, ToyEngine]:
    mgr = make(**kw)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(10)))
    run_prompt(eng, "b", list(range(10)))  # shares two pages with "a"
    run_prompt(eng, "c", [9] * 6)
    eng.step(["a", "b", "c"], 1)
    return mgr, eng


def test_verify_is_silent_on_a_correct_run() -> None:
    mgr, eng = three_running()
    for _ in range(10):
        step = eng.step(["a", "b", "c"], 1)
        report = mgr.verify(["a", "b", "c"], step)
        assert report.ok and report.keep.tolist() == [True] * 3 and report.integrity is None
        eng.commit(["a", "b", "c"])
    assert mgr.verify(["a", "b", "c"]).ok
    assert mgr.stats().num_integrity_failures == 0


@pytest.mark.parametrize("fault, victims, what, leaks", [
    (lambda m: faults.free_behind_back(m, "c", 0), ["c"], "freed", False),
    (lambda m: faults.reallocate_behind_back(m, "c", 1), ["c"], "reallocated", True),
    (lambda m: faults.free_behind_back(m, "a", 0), ["a", "b"], "freed", False),  # shared page
    (lambda m: faults.free_behind_back(m, "a", 2), ["a"], "freed", False),
    (lambda m: faults.overwrite_page_entry(m, "a", 2, int(m.pages_of("c")[0])), ["a"],
     "reallocated", False),
    (lambda m: faults.share_write_page(m, "c"), ["c"], "holders", True),
])
def test_verify_aborts_only_the_victims(fault: Any, victims: list[str], what: str,
                                        leaks: bool) -> None:
    mgr, eng = three_running()
    failures: list[ManagerEvent] = []
    mgr.add_hook("integrity_failure", failures.append)
    fault(mgr)
    report = mgr.verify(["a", "b", "c"])
    assert list(report.aborted) == victims
    assert all(what in report.aborted[v] for v in victims)
    assert report.keep.tolist() == [r not in victims for r in "abc"]
    assert report.ok_ids == tuple(r for r in "abc" if r not in victims)
    assert not set(victims) & {*mgr.running, *mgr.preempted}
    assert [e.request_id for e in failures] == victims
    assert mgr.stats().num_integrity_failures == len(victims)
    for v in victims:
        eng.abort(v)
    others = [r for r in "abc" if r not in victims]
    assert mgr.verify(others).ok  # the rest proceed
    eng.check_kv(others)
    if leaks:  # the fault left a holder the manager does not know: check() reports it
        with pytest.raises(IntegrityError, match="differ from their holders"):
            mgr.check()
    else:  # the victims' own references were released, nobody else's
        mgr.check()


def test_verify_checks_the_arrays_the_kernel_reads() -> None:
    """BUGS 12, 13: the kernel is handed a wrong slice or stale columns."""
    mgr, eng = three_running()
    step = eng.step(["a", "b", "c"], 1)
    bad = step.kv_indices.copy()
    bad[-1] = mgr.pages_of("a")[0]  # "c"'s last entry points into "a"
    tampered = type(step)(**{**step.__dict__, "kv_indices": bad})
    assert list(mgr.verify(["a", "b", "c"], tampered).aborted) == ["c"]
    mgr2, eng2 = three_running()
    step = eng2.step(["a", "b", "c"], 1)
    indptr = step.kv_indptr.copy()
    indptr[1] -= 1  # "a" loses a page, "b" gains one: both are wrong
    tampered = type(step)(**{**step.__dict__, "kv_indptr": indptr})
    assert sorted(mgr2.verify(["a", "b", "c"], tampered).aborted) == ["a", "b"]


def test_a_reused_row_has_no_stale_columns() -> None:
    """BUG 13: a reused block-table row keeps columns past the new request's pages."""
    mgr = make()
    eng = ToyEngine(mgr)
    run_prompt(eng, "long", [1] * 30)
    eng.release("long")
    run_prompt(eng, "short", [2] * 3)
    step = eng.step(["short"], 1)
    assert step.block_table.tolist() == [[mgr.pages_of("short")[0]]]
    assert (mgr.table.pages[step.rows[0], 1:] == -1).all()
    assert mgr.verify(["short"], step).ok


class NamespaceBlindCache(HashedPrefixCache):
    """A cache whose key forgets the namespace and which confirms only tokens (BUG 11)."""

    def root_key(self, namespace: Namespace) -> Any:
        return super().root_key(None)

    def match(self, token_ids: Any, namespace: Namespace, max_pages: int,
              namespace_id: int | None = None) -> Any:
        return super().match(token_ids, namespace, max_pages, None)


def test_a_cross_namespace_hit_is_caught_before_decode() -> None:
    """BUG 11: the cache key misses an input, and a tenant maps another tenant's pages."""
    mgr = make(prefix_cache=NamespaceBlindCache(seed=3))
    eng = ToyEngine(mgr)
    run_prompt(eng, "t1", list(range(9)), ns="tenant-1")
    run_prompt(eng, "own", [5] * 5, ns="tenant-2")
    res = eng.admit("t2", list(range(9)), "tenant-2")
    assert res.num_cached_tokens == 8  # the faulty cache handed over tenant-1's pages
    eng.step(["t2"], 1)
    report = mgr.verify(["t1", "own", "t2"])
    assert list(report.aborted) == ["t2"]
    assert "namespace" in report.aborted["t2"]
    eng.abort("t2")
    mgr.check()
    assert mgr.verify(["t1", "own"]).ok


def test_pages_written_after_a_failure_are_not_offered_again() -> None:
    """BUG 8: pages of an aborted request inserted into the prefix index with bad KV."""
    mgr = make()
    eng = ToyEngine(mgr)
    run_prompt(eng, "v", list(range(13)))  # pages 0..2 cached
    faults.free_behind_back(mgr, "v", 0)
    assert list(mgr.verify(["v"]).aborted) == ["v"]
    eng.abort("v")
    # Page 0 was lost; pages 1 and 2 were computed from it and must not be reused.
    assert mgr.stats().num_cached == 0
    mgr.check()
    assert eng.admit("w", list(range(13))).num_cached_tokens == 0


def test_noop_tracker_verification_costs_nothing() -> None:
    mgr = make(tracker=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    faults.free_behind_back(mgr, "a", 0)
    report = mgr.verify(["a", "not-even-a-request"])  # does not look at anything
    assert report.ok and report.request_ids == ("a", "not-even-a-request")


# -- hooks, events, stats -------------------------------------------------------------------------


def test_hooks_see_every_kind_of_event() -> None:
    mgr = make(num_pages=10)
    eng = ToyEngine(mgr)
    seen: list[tuple[str, Any]] = []
    for kind in ("admit", "allocate", "free", "evict", "preempt", "release", "fork",
                 "step_begin", "step_end", "integrity_failure"):
        mgr.add_hook(kind, lambda e: seen.append((e.kind, e.request_id)))
    run_prompt(eng, "a", list(range(9)))
    eng.fork("a", "b")
    h = mgr.begin_step()
    eng.preempt("b")
    mgr.retire(h)
    eng.release("a")
    run_prompt(eng, "c", [3] * 36)  # needs evictions
    faults.free_behind_back(mgr, "c", 0)
    mgr.verify(["c"])
    kinds = {k for k, _ in seen}
    assert kinds == {"admit", "allocate", "free", "evict", "preempt", "release", "fork",
                     "step_begin", "step_end", "integrity_failure"}
    assert ("admit", "a") in seen and ("fork", "b") in seen and ("preempt", "b") in seen


def test_a_raising_hook_never_leaves_the_manager_half_changed() -> None:
    mgr = make()
    calls: list[str] = []

    def bad(event: ManagerEvent) -> None:
        raise RuntimeError("hook bug")

    mgr.add_hook("allocate", bad)
    mgr.add_hook("admit", lambda e: calls.append(e.request_id))
    with pytest.raises(HookError, match="hook bug") as info:
        mgr.admit("a", np.arange(6))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert calls == ["a"]  # the other hooks still ran
    assert mgr.running == ("a",) and mgr.allocator.num_used == 2  # the admission stands
    mgr.check()
    mgr.remove_hook("allocate", bad)
    mgr.reserve(["a"], 6)
    mgr.commit("a", np.arange(6))
    assert mgr.verify(["a"]).ok


def test_kv_events_follow_what_the_cache_holds() -> None:
    mgr = make(num_pages=8, kv_events=True)
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


def test_stats_are_a_frozen_snapshot_that_conserves_pages() -> None:
    mgr = make()
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(9)))
    s = mgr.stats()
    with pytest.raises(AttributeError):
        s.num_free = 0  # type: ignore[misc]
    eng.release("a")
    assert s.num_used == 3 and mgr.stats().num_used == 0
    t = mgr.stats()
    assert t.num_free + t.num_used + t.num_cached + t.num_fenced == t.num_pages
    assert t.num_cached == 2 and 0 < s.usage < 1 and t.usage == 0
    assert s.prefix_hit_rate == 0.0


def test_many_namespaces_and_int_ids() -> None:
    mgr = make(num_pages=64, max_seqs=16)
    eng = ToyEngine(mgr)
    for i in range(12):
        run_prompt(eng, i, list(range(9)), ns=("lora", i % 3))
    assert sum(mgr.stats().prefix_hit_tokens for _ in [0]) == 9 * 8
    assert mgr.verify(list(range(12))).ok
    eng.check_kv()
    mgr.check()


# -- an attached PagePool -------------------------------------------------------------------------


def pooled(num_pages: int = 16) -> tuple[KVCacheManager, Any]:
    from kvmem.cuda import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=2, num_pages=num_pages, num_kv_heads=1, head_dim=8,
                             page_size=P, dtype="fp32", device="cpu"))
    return make(num_pages=num_pages, pool=pool), pool


def test_copy_on_write_copies_the_pool_pages() -> None:
    import torch

    mgr, pool = pooled()
    mgr.admit("p", np.arange(6))
    step = mgr.reserve(["p"], 6)
    for layer in range(2):
        kv = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 1, 8) + 100 * layer
        pool.write(layer, torch.as_tensor(step.slot_mapping), kv, -kv)
    mgr.commit("p", np.arange(6))
    mgr.fork("p", "c")
    step = mgr.reserve(["p", "c"], 1)
    assert step.copy_src.size == 0  # the manager copied through the pool itself
    tail_p, tail_c = int(mgr.pages_of("p")[1]), int(mgr.pages_of("c")[1])
    assert tail_p != tail_c and mgr.stats().num_cow_copies == 1
    for layer in range(2):
        kp, vp = pool.read(layer, torch.tensor([tail_p]))
        kc, vc = pool.read(layer, torch.tensor([tail_c]))
        assert torch.equal(kp[:, :2], kc[:, :2]) and torch.equal(vp[:, :2], vc[:, :2])
        assert float(kc[0, 1, 0, 0]) == 5 * 8 + 100 * layer
    assert mgr.verify(["p", "c"], step).ok


def test_verify_on_the_pool_device_against_its_tag_mirror() -> None:
    import torch

    mgr, pool = pooled()
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(9)))
    run_prompt(eng, "b", [7] * 5)
    step = eng.step(["a", "b"], 1)
    qtags = mgr.mirror.sync()
    assert torch.equal(pool.tags, torch.as_tensor(qtags))  # the mirror holds qualified tags
    t = step.tensors("cpu")
    assert t["slot_mapping"].dtype == torch.int64 and t["kv_indices"].dtype == torch.int32
    assert t["block_table"].tolist() == step.block_table.tolist()
    indptr, indices = t["kv_indptr"], t["kv_indices"]
    assert mgr.verify(["a", "b"], kv_indptr=indptr, kv_indices=indices).ok
    lost = faults.free_behind_back(mgr, "b", 0)
    report = mgr.verify(["a", "b"], kv_indptr=indptr, kv_indices=indices)
    assert list(report.aborted) == ["b"] and "freed" in report.aborted["b"]
    assert int(pool.tags[lost]) == 0  # the mirror saw the page go before the check ran


def test_commit_batch_takes_one_token_each_k_each_or_ragged_lists() -> None:
    mgr = make()
    for rid in ("a", "b"):
        mgr.admit(rid, np.arange(2) + (10 if rid == "b" else 0))
    mgr.reserve(["a", "b"], 2)
    mgr.commit_batch(["a", "b"], np.array([[0, 1], [10, 11]]))
    mgr.reserve(["a", "b"], [3, 1])
    mgr.commit_batch(["a", "b"], [np.array([2, 3, 4]), [12]])
    mgr.reserve(["a", "b"], 1)
    mgr.commit_batch(["a", "b"], np.array([5, 13], dtype=np.int32))
    assert mgr.tokens_of("a").tolist() == [0, 1, 2, 3, 4, 5]
    assert mgr.tokens_of("b").tolist() == [10, 11, 12, 13]
    with pytest.raises(KVMemError, match="token lists"):
        mgr.commit_batch(["a", "b"], [[1]])
    with pytest.raises(KVMemError):
        mgr.commit_batch(["a", "b"], np.array([-1, 2]))


# -- the incremental decode step: detectors still fire after a verified step ----------------------


def decoding(num_steps: int = 3, **kw: Any) -> tuple[KVCacheManager, ToyEngine, list[str]]:
    """Five requests (two share a prefix) that decoded and verified a few steps: verify holds
    a proven snapshot and reserve a CSR base."""
    mgr = make(num_pages=64, **kw)
    eng = ToyEngine(mgr)
    ids = ["a", "b", "c", "d", "e"]
    for i, rid in enumerate(ids):
        run_prompt(eng, rid, list(range(10)) if rid in "ab" else [i] * (5 + 3 * i))
    for _ in range(num_steps):
        step = eng.step(ids, 1)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    stats = mgr.verifier.stats
    assert stats.spliced_proved + stats.incremental_proved == num_steps  # a proof is held
    return mgr, eng, ids


def the_rest_proceed(mgr: KVCacheManager, eng: ToyEngine, ids: list[str],
                     victims: list[str], faulted_pages: bool = False) -> None:
    """After verify aborted ``victims``: the others commit, take another step that verifies,
    and read exactly their own KV; nothing leaked (unless the fault itself took or gave page
    references behind the manager's back: ``faulted_pages``)."""
    for v in victims:
        eng.abort(v)
    rest = [r for r in ids if r not in victims]
    eng.commit(rest)
    step = eng.step(rest, 1)
    assert mgr.verify(rest, step).ok
    eng.check_kv(rest)
    if not faulted_pages:
        mgr.check()


class Spliced:
    """What the verifier's quick check of a decode step's spliced entries answered since
    this was made (from the verifier's counters)."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.verifier = mgr.verifier
        self.before = mgr.verifier.stats

    def answers(self) -> tuple[int, int]:
        """(proved, declined) since."""
        now = self.verifier.stats
        return (now.spliced_proved - self.before.spliced_proved,
                now.spliced_declined - self.before.spliced_declined)


def spy_spliced(mgr: KVCacheManager) -> Spliced:
    return Spliced(mgr)


def test_a_decode_loop_checks_only_the_entries_reserve_spliced_in() -> None:
    """Once a step is verified, the next step's verify proves the unchanged entries by
    comparison and checks the fresh ones (grown pages, replaced requests) in full."""
    mgr, eng, ids = decoding()
    spliced = spy_spliced(mgr)
    for i in range(16):
        if i in (3, 9):  # a request finishes and another takes its batch slot
            slot = i % len(ids)
            eng.release(ids[slot])
            ids[slot] = f"new{i}"
            run_prompt(eng, ids[slot], [i] * (3 + i))  # (not verified yet: fresh entries)
        step = eng.step(ids, 1)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    assert spliced.answers() == (16, 0)
    eng.check_kv()
    mgr.check()


# (A page freed behind a request's back may be handed out again by the step's own allocation;
# the page a step writes exists once the step is reserved.)
@pytest.mark.parametrize("fault, victims, what, after_reserve", [
    (lambda m: faults.free_behind_back(m, "c", 0), ["c"], ("freed", "reallocated"), False),
    (lambda m: faults.reallocate_behind_back(m, "d", 1), ["d"], ("reallocated",), False),
    (lambda m: faults.free_behind_back(m, "a", 0), ["a", "b"], ("freed", "reallocated"), False),
    (lambda m: faults.free_behind_back(m, "e", 1), ["e"], ("freed",), True),
    (lambda m: faults.share_write_page(m, "e"), ["e"], ("holders",), True),
])
def test_verify_of_the_next_step_catches_faults_on_entries_it_proved_before(
        fault: Any, victims: list[str], what: tuple[str, ...], after_reserve: bool) -> None:
    mgr, eng, ids = decoding()
    spliced = spy_spliced(mgr)
    if not after_reserve:
        fault(mgr)
    step = eng.step(ids, 1)
    if after_reserve:
        fault(mgr)
    report = mgr.verify(ids, step)
    assert spliced.answers() == (0, 1)  # the quick check of the spliced entries saw it too
    assert list(report.aborted) == victims
    assert all(any(w in report.aborted[v] for w in what) for v in victims)
    the_rest_proceed(mgr, eng, ids, victims, faulted_pages=True)


@pytest.mark.parametrize("num_tokens", [1, 2, 5])
@pytest.mark.parametrize("where", ["another request's page", "an earlier slot of its own"])
def test_a_slot_mapping_that_sends_a_token_astray_aborts_only_that_request(
        num_tokens: int, where: str) -> None:
    """BUGS 12 for the kernel that stores K/V: verify checks the step's slot mapping against
    the pages its CSR lists, not only that the page written has one holder."""
    mgr, eng, ids = decoding()
    spliced = spy_spliced(mgr)
    step = eng.step(ids, num_tokens)
    first = step.qo_indptr.tolist()  # each request's first token in the slot mapping
    c, d = first[ids.index("c")], first[ids.index("d")]
    if where == "another request's page":  # one "d" holds alone and writes now: one holder
        step.slot_mapping[c] = step.slot_mapping[d] // P * P + step.slot_mapping[c] % P
    else:  # overwrites a token "c" committed before (its own page or the one before)
        step.slot_mapping[c] -= 1
    report = mgr.verify(ids, step)
    assert spliced.answers() == (0, 1) if num_tokens == 1 else spliced.answers()[0] == 0
    assert list(report.aborted) == ["c"] and "slot mapping" in report.aborted["c"]
    the_rest_proceed(mgr, eng, ids, ["c"])


def test_the_decode_quick_check_catches_a_reserve_that_sent_a_slot_astray() -> None:
    """A bug in reserve itself (its own slots and the step's agree, but not with the CSR it
    built): the quick check of a decode step sees that the token's page is not the last one
    its row lists, and the full check aborts exactly that request."""
    mgr, eng, ids = decoding()
    spliced = spy_spliced(mgr)
    step = eng.step(ids, 1)
    b = mgr.steps.latest
    assert b is not None and b.decode is not None
    c, d = ids.index("c"), ids.index("d")
    stray = int(b.decode.token_pages[d])  # "d" holds it alone: one writer
    for slots in (b.slots, step.slot_mapping):
        slots[c] = stray * P + slots[c] % P
    b.decode.token_pages[c] = stray
    report = mgr.verify(ids, step)
    assert spliced.answers() == (0, 1)
    assert list(report.aborted) == ["c"] and "slot mapping" in report.aborted["c"]
    the_rest_proceed(mgr, eng, ids, ["c"])


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("field", ["kv_last_page_len", "seq_lens", "num_new_tokens"])
def test_step_lengths_that_are_not_the_requests_own_abort_only_that_request(
        num_tokens: int, field: str) -> None:
    """A last page said longer than it is makes the kernel read slots no token of the request
    wrote (a previous holder's KV); wrong sequence or query lengths read the wrong tokens."""
    mgr, eng, ids = decoding()
    step = eng.step(ids, num_tokens)
    c = ids.index("c")
    getattr(step, field)[c] += 1
    if field == "num_new_tokens":  # the query ranges move with it
        step.qo_indptr[c + 1 :] += 1
    report = mgr.verify(ids, step)
    assert list(report.aborted) == ["c"] and "lengths" in report.aborted["c"]
    the_rest_proceed(mgr, eng, ids, ["c"])


@pytest.mark.parametrize("fault", ["slot", "last_page_len", "padding"])
def test_verify_of_tensor_metadata_checks_slots_and_lengths_on_their_device(fault: str) -> None:
    """verify(ids, metadata=step.tensors(device)): what an engine with a device pool checks
    (here CPU tensors); padding slots (-1) after the step's tokens are allowed."""
    import torch

    mgr, eng, ids = decoding()
    step = eng.step(ids, 2)
    t = step.tensors("cpu")
    t["slot_mapping"] = torch.cat([t["slot_mapping"], torch.full((3,), -1)])  # padded
    assert mgr.verify(ids, metadata=t).ok
    c, d = step.qo_indptr[ids.index("c")], step.qo_indptr[ids.index("d")]
    if fault == "slot":
        t["slot_mapping"][c] = t["slot_mapping"][d] // P * P + t["slot_mapping"][c] % P
    elif fault == "last_page_len":
        t["kv_last_page_len"][ids.index("c")] += 1
    else:  # a padding slot that writes somewhere: no token of the step can be trusted
        t["slot_mapping"][-1] = t["slot_mapping"][0]
    report = mgr.verify(ids, metadata=t)
    assert list(report.aborted) == (ids if fault == "padding" else ["c"])
    if fault != "padding":
        the_rest_proceed(mgr, eng, ids, ["c"])
    with pytest.raises(KVMemError, match="slot_mapping"):
        mgr.verify(mgr.running, metadata={"kv_indptr": t["kv_indptr"],
                                          "kv_indices": t["kv_indices"]})


@pytest.mark.parametrize("fault", [None, "slot", "stale column", "page"])
@pytest.mark.parametrize("as_tensors", [False, True])
def test_verify_of_a_block_table_with_its_slot_mapping(fault: str | None,
                                                       as_tensors: bool) -> None:
    """The vLLM form: block table, slot mapping and sequence lengths, as numpy or tensors."""
    mgr, eng, ids = decoding()
    step = eng.step(ids, 1)
    meta: dict[str, Any] = {"block_table": step.block_table.copy(),
                            "slot_mapping": step.slot_mapping.copy(),
                            "seq_lens": step.seq_lens.copy()}
    c = ids.index("c")
    n = int(step.seq_lens[c] - 1) // P  # c's last page
    if fault == "slot":  # its token into "d"'s page, same offset
        d = ids.index("d")
        meta["slot_mapping"][c] = (meta["slot_mapping"][d] // P * P
                                   + meta["slot_mapping"][c] % P)
    elif fault == "stale column":  # BUGS 13: a reused buffer keeps a column past c's pages
        meta["block_table"][c, n + 1] = mgr.pages_of("d")[0]
    elif fault == "page":  # c's last page listed as another request's
        meta["block_table"][c, n] = mgr.pages_of("d")[0]
    if as_tensors:
        import torch

        meta = {k: torch.from_numpy(v) for k, v in meta.items()}
    report = mgr.verify(ids, metadata=meta)
    assert list(report.aborted) == ([] if fault is None else ["c"])
    if fault is not None:
        the_rest_proceed(mgr, eng, ids, ["c"])


def test_slot_mappings_of_correct_steps_pass_on_every_path() -> None:
    """The slot check stays silent: decode steps (quick path), speculative and ragged steps
    (the general path), and the detailed check of a batch that changed."""
    mgr, eng, ids = decoding()
    for num in (1, 3, [2, 1, 4, 1, 16], 1, 1):
        step = eng.step(ids, num)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    mgr.verifier.forget()  # nothing proven: the next verify checks everything
    step = eng.step(ids[::-1], 2)
    assert mgr.verify(ids[::-1], step).ok
    assert mgr.verify(ids[::-1], metadata=step.tensors("cpu")).ok  # as tensors, detailed
    eng.commit(ids)
    eng.check_kv()
    assert mgr.stats().num_integrity_failures == 0


def test_verify_of_the_next_step_checks_the_arrays_it_is_given() -> None:
    mgr, eng, ids = decoding()
    step = eng.step(ids, 1)
    bad = step.kv_indices.copy()
    bad[0] = mgr.pages_of("c")[0]  # an entry verify proved last step now points elsewhere
    tampered = type(step)(**{**step.__dict__, "kv_indices": bad})
    assert list(mgr.verify(ids, tampered).aborted) == ["a"]
    mgr2, eng2, ids2 = decoding()
    step = eng2.step(ids2, 1)
    step.kv_indices[-1] = step.kv_indices[0]  # in place: the engine's own array
    assert list(mgr2.verify(ids2, step).aborted) == ["e"]


def test_a_page_table_entry_overwritten_after_a_verified_step_is_caught() -> None:
    """BUGS 12, 13 after the snapshot: verify() of fresh metadata sees the table's entry."""
    mgr, _eng, ids = decoding()
    faults.overwrite_page_entry(mgr, "d", 0, int(mgr.pages_of("c")[0]))
    report = mgr.verify(ids)
    assert list(report.aborted) == ["d"] and "namespace" not in report.aborted["d"]


def test_replaced_requests_in_a_decode_batch_are_checked_in_full() -> None:
    mgr, eng, ids = decoding()
    for slot, rid in ((1, "b2"), (3, "d2")):  # finished requests replaced in place
        eng.release(ids[slot])
        run_prompt(eng, rid, list(range(10)) if rid == "b2" else [7] * 21)
        ids[slot] = rid
    for _ in range(20):  # rows grow pages; the CSR is spliced from the previous step's
        step = eng.step(ids, 1)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    eng.check_kv()
    eng.release("c")
    run_prompt(eng, "c2", [3] * 9)
    ids[2] = "c2"
    faults.free_behind_back(mgr, "c2", 0)
    step = eng.step(ids, 1)
    assert list(mgr.verify(ids, step).aborted) == ["c2"]
    mgr.check()


def test_speculative_and_chunked_steps_of_a_decoding_batch() -> None:
    mgr, eng, ids = decoding()
    for n in (3, 1, [2, 0, 5, 1, 4], 16, 1):
        step = eng.step(ids, n)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    eng.check_kv()
    assert mgr.verify(ids).ok


def test_a_big_pool_evicts_a_little_ahead_and_never_a_mapped_page() -> None:
    mgr = KVCacheManager(num_pages=1024, page_size=P, max_seqs=8, max_pages_per_seq=256,
                         tracker="checking", watermark=0.0)
    eng = ToyEngine(mgr)
    for i in range(200):  # 4 full pages each, cached when released
        run_prompt(eng, f"old{i}", [i, i + 1] * 8 + [0])
        eng.release(f"old{i}")
    run_prompt(eng, "keep", list(range(40)))
    keep = mgr.pages_of("keep").tolist()
    free = mgr.allocator.num_free
    run_prompt(eng, "big", [999] * (4 * (free + 1)))  # needs one page more than is free
    s = mgr.stats()
    assert 1 <= s.num_evictions <= 1 + 1024 // 512
    assert mgr.pages_of("keep").tolist() == keep
    assert mgr.verify(list(mgr.running)).ok
    mgr.check()
    eng.check_kv()


def test_alternating_batches_of_one_size_are_each_checked_in_full() -> None:
    mgr = make(num_pages=64, max_seqs=8)
    eng = ToyEngine(mgr)
    for i in range(6):
        run_prompt(eng, i, [i] * (6 + i))
    one, two = [0, 1, 2], [3, 4, 5]
    for _ in range(6):
        for batch in (one, two):
            step = eng.step(batch, 1)
            assert mgr.verify(batch, step).ok
            eng.commit(batch)
    faults.free_behind_back(mgr, 4, 0)
    step = eng.step(two, 1)
    assert list(mgr.verify(two, step).aborted) == [4]
    eng.abort(4)
    step = eng.step(one, 1)
    assert mgr.verify(one, step).ok
    eng.check_kv()
