"""The error contract of the core (allocator, page table, trackers, manager): invalid input
raises a KVMemError subclass (argument errors also ValueError / TypeError) naming the argument,
nothing else escapes, and the state is unchanged; and the promises of issue 12 hold."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem import (
    ArgumentError,
    ArgumentTypeError,
    CheckingTracker,
    ConcurrentUseError,
    KVMemError,
    OutOfPagesError,
    PageAllocator,
    PageTable,
)
from kvmem.manager import KVCacheManager
from kvmem.testing import ToyEngine

P = 4


def make(**kw: Any) -> KVCacheManager:
    kw.setdefault("tracker", "checking")
    return KVCacheManager(kw.pop("num_pages", 32), page_size=P, max_seqs=kw.pop("max_seqs", 6),
                          max_pages_per_seq=kw.pop("max_pages_per_seq", 8), watermark=0.0, **kw)


def snapshot(mgr: KVCacheManager) -> tuple[Any, ...]:
    """Tags, refcounts, free count, page table, per-row state, stats, registry."""
    t = mgr.table
    return (mgr.allocator.tags.tobytes(), mgr.allocator.refcounts.tobytes(),
            mgr.allocator.num_free, t.pages.tobytes(), t.num_tokens.tobytes(),
            t.num_committed.tobytes(), t.write_from.tobytes(), mgr.stats(), mgr.running,
            mgr.preempted, mgr.fences.held.tobytes())


def busy() -> tuple[KVCacheManager, ToyEngine]:
    """Three running requests (two share a prefix), one preempted, one step in flight."""
    mgr = make()
    eng = ToyEngine(mgr)
    for rid, prompt in (("a", list(range(9))), ("b", list(range(9))), ("c", [7] * 5),
                        ("p", [3] * 6)):
        res = eng.admit(rid, prompt)
        eng.step([rid], len(prompt) - res.num_cached_tokens)
        eng.commit([rid])
    eng.preempt("p")
    mgr.begin_step()
    return mgr, eng


# -- the property test: bad values at every argument of every entry point --------------------------

BAD_INTS = [True, False, 1.5, "2", None, -1, 2**63, 2**40, [1], np.float64(1.0), np.bool_(True)]
BAD_ID_LISTS = ["AB", b"ab", 7, None, {"a": 1}, ["zz"], ["a", "a"], [["a"]]]
BAD_TOKENS = ["abc", 5, None, [1.5, 2.0], [-1], [2**40], [[1, 2]], np.array([True, False]),
              np.zeros((2, 2), dtype=np.int64), [None]]
BAD_PAGES = [np.int64(2**32 + 1), [1.7], 3, "1", [2**40], [-1], [None], np.array([[1]])]

# entry point -> (call(manager, bad value), the bad values to try)
ENTRIES: dict[str, tuple[Callable[[KVCacheManager, Any], Any], list[Any]]] = {
    "reserve num_tokens": (lambda m, v: m.reserve(["a", "c"], v), [*BAD_INTS, [1], [1, -1]]),
    "reserve ids": (lambda m, v: m.reserve(v, 1), BAD_ID_LISTS),
    "can_reserve num_tokens": (lambda m, v: m.can_reserve(["a", "c"], v), BAD_INTS),
    "commit tokens": (lambda m, v: m.commit("a", v), BAD_TOKENS),
    "commit id": (lambda m, v: m.commit(v, [1]), [["a"], "zz", None, {"x": 1}]),
    "commit_batch tokens": (lambda m, v: m.commit_batch(["a", "c"], v),
                            [*BAD_TOKENS, [5], [5, 7, 9], [[1], [2], [3]]]),
    "commit_batch ids": (lambda m, v: m.commit_batch(v, [1]), BAD_ID_LISTS),
    "admit prompt": (lambda m, v: m.admit("new", v), [*BAD_TOKENS, []]),
    "admit id": (lambda m, v: m.admit(v, [1, 2]), [["x"], "a", {"x": 1}]),
    "admit namespace": (lambda m, v: m.admit("new", [1, 2], v), [1.5, [1], {"t": 1}, object()]),
    "can_admit prompt": (lambda m, v: m.can_admit(v), [*BAD_TOKENS, []]),
    "verify ids": (lambda m, v: m.verify(v), BAD_ID_LISTS),
    "verify metadata": (lambda m, v: m.verify(["a"], metadata=v),
                        [{"slot_mapping": [1]}, {"kv_indptr": [0, 1]}, [1, 2], "x",
                         {"slot_mapping": np.zeros(1, np.int64), "block_table": [[1]]}]),
    "fork": (lambda m, v: m.fork(v, "child"), [["a"], "zz", None, "p"]),
    "fork child": (lambda m, v: m.fork("a", v), ["b", ["x"], {"x": 1}]),
    "preempt": (lambda m, v: m.preempt(v), [["a"], "zz", "p", None]),
    "resume": (lambda m, v: m.resume(v), [["p"], "a", "zz"]),
    "resume tokens": (lambda m, v: m.resume("p", v), [t for t in BAD_TOKENS if t is not None]),
    "release": (lambda m, v: m.release(v), [["a"], "zz", None, {"x": 1}]),
    "release_batch": (lambda m, v: m.release_batch(v), [*BAD_ID_LISTS, ["a", "zz"]]),
    "retire": (lambda m, v: m.retire(v), [1, None, "h"]),
    "namespace_of_page": (lambda m, v: m.namespace_of_page(v), [*BAD_INTS, 31, 32]),
    "pages_of": (lambda m, v: m.pages_of(v), ["zz", ["a"], "p"]),
    "add_hook": (lambda m, v: m.add_hook(v, print), ["nope", None, 1]),
    "add_hook fn": (lambda m, v: m.add_hook("admit", v), [None, 1, "print"]),
    "allocator.free": (lambda m, v: m.allocator.free(v), BAD_PAGES),
    "allocator.share": (lambda m, v: m.allocator.share(v), BAD_PAGES),
    "allocator.allocate": (lambda m, v: m.allocator.allocate(v), BAD_INTS),
    "allocator.can_allocate": (lambda m, v: m.allocator.can_allocate(v),
                               [v for v in BAD_INTS if not isinstance(v, int) or v < 0
                                or isinstance(v, bool)]),
    "table.map_pages": (lambda m, v: m.table.map_pages(m.row_of("a"), v), BAD_PAGES),
    "tracker.forget": (lambda m, v: m.tracker.forget(v), [[-1], [99], [1.5], ["a"]]),
    "tracker.record": (lambda m, v: m.tracker.record([0], v, [1]), [[-1], [99], [1.5]]),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=st.sampled_from(sorted(ENTRIES)), data=st.data())
def test_bad_input_raises_a_kvmem_error_and_changes_nothing(entry: str, data: Any) -> None:
    call, values = ENTRIES[entry]
    value = data.draw(st.sampled_from(values))
    mgr, _ = busy()
    before = snapshot(mgr)
    with pytest.raises(KVMemError) as info:
        call(mgr, value)
    error = info.value
    argument_error = isinstance(error, (ArgumentError, ArgumentTypeError))
    assert argument_error == isinstance(error, (ValueError, TypeError)) or not argument_error
    assert str(error), "an error says what was asked and found"
    assert snapshot(mgr) == before, f"{entry}({value!r}) changed the manager"
    mgr.check()


@pytest.mark.parametrize("kwargs, name", [
    ({"num_pages": True}, "num_pages"), ({"num_pages": 0}, "num_pages"),
    ({"num_pages": 1.5}, "num_pages"), ({"num_pages": "64"}, "num_pages"),
    ({"num_pages": 8, "page_size": 0}, "page_size"),
    ({"num_pages": 8, "max_seqs": -1}, "max_seqs"),
    ({"num_pages": 8, "max_pages_per_seq": np.float32(2)}, "max_pages_per_seq"),
    ({"num_pages": 8, "watermark": 1.0}, "watermark"),
    ({"num_pages": 8, "watermark": "0.1"}, "watermark"),
    ({"num_pages": 8, "kv_events": 1}, "kv_events"),
    ({"num_pages": 8, "tracker": "bogus"}, "tracker"),
    ({"num_pages": 8, "tracker": 3}, "tracker"),
    ({"num_pages": 8, "prefix_cache": "radix"}, "prefix_cache"),
    ({"num_pages": 8, "pool": object()}, "pool"),
])
def test_constructor_errors_name_the_argument(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(KVMemError, match=name) as info:
        KVCacheManager(**kwargs)
    assert isinstance(info.value, (ValueError, TypeError))


def test_numpy_integers_are_integers_and_bools_are_not() -> None:
    assert KVCacheManager(np.int64(64)).num_pages == 64
    assert KVCacheManager(np.int32(8), page_size=np.int64(4)).page_size == 4
    with pytest.raises(ArgumentTypeError):
        KVCacheManager(True)
    alloc = PageAllocator(np.int64(4))
    assert alloc.allocate(np.int32(2)).tolist() == [0, 1]
    with pytest.raises(ArgumentTypeError):
        alloc.allocate(True)


def test_page_ids_never_wrap_and_one_id_is_not_a_list() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(3)
    before = (alloc.refcounts.tobytes(), alloc.num_free)
    for bad in (np.int64(2**32 + 1), [2**32 + 1], [1.7], 1, "1"):
        with pytest.raises(KVMemError):
            alloc.free(bad)
    assert (alloc.refcounts.tobytes(), alloc.num_free) == before
    table = PageTable(2, 4, P)
    row = table.add_row()
    with pytest.raises(ArgumentError):
        table.map_pages(row, [-1])  # PAD is not a page
    tracker = CheckingTracker(2, 4)
    tracker.record([1], [0], [5])
    with pytest.raises(ArgumentError):
        tracker.forget([-1])  # never the last row
    assert tracker.expected_tags[1, 0] == 5


# -- promises --------------------------------------------------------------------------------------


def test_commit_batch_takes_a_plain_list_and_a_tensor_of_one_token_each() -> None:
    import torch

    mgr = make()
    for rid in ("a", "b"):
        mgr.admit(rid, [1, 2, 3])
        mgr.reserve([rid], 3)
        mgr.commit(rid, [1, 2, 3])
    mgr.reserve(["a", "b"], 1)
    mgr.commit_batch(["a", "b"], [5, 7])
    mgr.reserve(["a", "b"], 1)
    mgr.commit_batch(["a", "b"], torch.tensor([6, 8]))
    assert mgr.tokens_of("a").tolist() == [1, 2, 3, 5, 6]
    assert mgr.tokens_of("b").tolist() == [1, 2, 3, 7, 8]


@pytest.mark.parametrize("chunk", [1, 18, 100, 256])
def test_reserve_takes_any_chunk_up_to_the_rows_room(chunk: int) -> None:
    """A chunk longer than max(max_pages_per_seq, max_seqs) + 1 but at most page_size raised a
    raw numpy error after it had advanced num_tokens."""
    mgr = KVCacheManager(64, page_size=256, max_pages_per_seq=16, max_seqs=8)
    mgr.admit("a", np.arange(300))
    step = mgr.reserve(["a"], chunk)
    assert step.slot_mapping.size == chunk and mgr.num_tokens("a") == chunk
    mgr.commit("a", np.arange(chunk))
    before = mgr.num_tokens("a")
    with pytest.raises(ArgumentError):
        mgr.reserve(["a"], 2**63 - 256)
    assert mgr.num_tokens("a") == before


def test_speculative_reserve_longer_than_the_rows() -> None:
    mgr = KVCacheManager(16, page_size=16, max_pages_per_seq=4, max_seqs=2)
    mgr.admit("a", [1, 2])
    mgr.reserve(["a"], 2)
    assert mgr.reserve(["a"], 8).slot_mapping.size == 8


@pytest.mark.parametrize("num_pages", range(4, 12))
def test_prefill_after_a_fork_never_runs_out_of_pages(num_pages: int) -> None:
    """A fork between two prefill chunks: the parent's next chunk writes into the shared tail,
    which needs a copy-on-write page admission never reserved. The fork promises it: either the
    fork refuses (nothing changed) or both requests finish their prompts."""
    mgr = make(num_pages=num_pages, prefix_cache=None)
    eng = ToyEngine(mgr)
    prompt = list(range(10))  # 3 pages of 4
    eng.admit("parent", prompt)
    eng.step(["parent"], 5)  # the first chunk ends inside page 1
    eng.commit(["parent"])
    can = mgr.can_fork("parent")
    before = snapshot(mgr)
    try:
        eng.fork("parent", "child")
    except OutOfPagesError:
        assert not can and snapshot(mgr) == before
        return
    assert can
    eng.step(["parent"], 5)  # the rest of the prompt: copies the shared tail
    eng.step(["child"], 5)
    eng.commit(["parent", "child"])
    eng.check_kv()
    mgr.check()


@pytest.mark.parametrize("one, other", [(1, True), (0, False), ((1, "a"), (True, "a")),
                                        ("1", 1), (b"a", "a"), ((1,), 1)])
def test_namespaces_that_encode_apart_never_share_a_page(one: Any, other: Any) -> None:
    mgr = make()
    eng = ToyEngine(mgr)
    prompt = list(range(13))
    res = eng.admit("x", prompt, one)
    eng.step(["x"], len(prompt) - res.num_cached_tokens)
    eng.commit(["x"])
    assert eng.admit("y", prompt, other).num_cached_tokens == 0
    assert eng.admit("z", prompt, one).num_cached_tokens == 12
    assert mgr.namespace_of_page(int(mgr.pages_of("y")[0])) is other


def test_a_float_namespace_is_refused_whatever_was_seen_before() -> None:
    mgr = make()
    mgr.admit("x", [1, 2], 1)
    for bad in (1.0, float("nan"), [1]):
        with pytest.raises(ArgumentTypeError):
            mgr.admit("y", [1, 2], bad)
        with pytest.raises(ArgumentTypeError):
            mgr.can_admit([1, 2], bad)
    assert np.int64(1) is not None and mgr.admit("y", [1, 2], np.int64(1)).num_pages == 1


def test_a_pool_must_match_the_manager() -> None:
    from kvmem.cuda import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=8, num_kv_heads=1, head_dim=8,
                             page_size=16, dtype="fp32", device="cpu"))
    with pytest.raises(ArgumentError, match="page_size"):
        KVCacheManager(8, page_size=8, pool=pool)
    with pytest.raises(ArgumentError, match="pages"):
        KVCacheManager(16, page_size=16, pool=pool)
    with pytest.raises(ArgumentError, match="pages"):
        KVCacheManager(4, page_size=16, pool=pool)
    assert KVCacheManager(8, page_size=16, pool=pool).pool is pool


def test_a_failed_resume_keeps_the_preempted_order() -> None:
    mgr = make(num_pages=8, prefix_cache=None)
    for rid in ("a", "b", "c"):
        mgr.admit(rid, [1] * 8)
    for rid in ("a", "b", "c"):
        mgr.preempt(rid)
    mgr.admit("hog", [2] * 28)  # 7 of 8 pages: nobody resumes
    before = snapshot(mgr)
    with pytest.raises(OutOfPagesError):
        mgr.resume("b")
    assert mgr.preempted == ("a", "b", "c") and snapshot(mgr) == before


def test_an_idle_manager_holds_no_fenced_page() -> None:
    """No pool: a copy-on-write source is held until the engine copied it (the next reserve);
    once no request is left to copy for, it is released and an admission that fits fits."""
    mgr = make(num_pages=6, prefix_cache=None)
    mgr.admit("a", [1] * 6)
    mgr.reserve(["a"], 6)
    mgr.commit("a", [1] * 6)
    mgr.fork("a", "b")
    step = mgr.reserve(["a"], 1)  # copies the shared tail: the source is held
    assert step.copy_src.size == 1 and mgr.stats().num_fenced == 0
    mgr.release("a")
    mgr.release("b")
    assert mgr.stats().num_fenced == 0 and mgr.allocator.num_free == 6
    assert mgr.can_admit([1] * 24)
    mgr.admit("c", [1] * 24)


# -- threads ---------------------------------------------------------------------------------------


def test_a_second_thread_inside_the_manager_is_refused() -> None:
    """A manager is used by one thread at a time: a thread that enters while another is inside
    (here held in a hook) is refused before it changes anything; the same thread may re-enter
    (a hook that calls the manager)."""
    mgr = make()
    inside, release = threading.Event(), threading.Event()
    seen: list[Any] = []

    def hook(event: Any) -> None:
        seen.append(mgr.stats().num_running)  # re-entry from the same thread is fine
        inside.set()
        release.wait(10)

    mgr.add_hook("admit", hook)
    worker = threading.Thread(target=lambda: mgr.admit("a", [1, 2, 3]))
    worker.start()
    assert inside.wait(10)
    before = snapshot(mgr)
    with pytest.raises(ConcurrentUseError):
        mgr.admit("b", [4, 5])
    with pytest.raises(ConcurrentUseError):
        mgr.reserve(["a"], 1)
    assert snapshot(mgr) == before
    release.set()
    worker.join(10)
    assert seen == [1] and mgr.running == ("a",)
    mgr.admit("b", [4, 5])  # the first thread is done: the second may go


def test_a_hook_may_call_the_manager() -> None:
    mgr = make()
    mgr.add_hook("admit", lambda e: mgr.release(e.request_id) if e.request_id == "tmp" else None)
    mgr.admit("tmp", [1, 2])
    assert mgr.running == ()


@pytest.mark.parametrize("evict_ahead, evicted", [(None, 1 + 1024 // 512), (0, 1), (5, 6)])
def test_evict_ahead_takes_that_many_more_pages(evict_ahead: int | None, evicted: int) -> None:
    mgr = KVCacheManager(1024, page_size=P, max_seqs=4, max_pages_per_seq=1024,
                         evict_ahead=evict_ahead, watermark=0.0)
    for i in range(7):  # 7 cached prompts of 128 pages, held by the cache alone
        mgr.admit(f"r{i}", np.arange(128 * P) + i * 10**6)
        mgr.reserve([f"r{i}"], 128 * P)
        mgr.commit(f"r{i}", np.arange(128 * P) + i * 10**6)
        mgr.release(f"r{i}")
    free = mgr.allocator.num_free
    assert mgr.stats().num_evictions == 0 and free == 1024 - 7 * 128
    mgr.admit("x", np.arange((free + 1) * P) + 7 * 10**7)  # one page short
    assert mgr.stats().num_evictions == evicted


def test_evict_ahead_is_checked() -> None:
    for bad in (-1, 1.5, True, 10**9):
        with pytest.raises(KVMemError, match="evict_ahead"):
            KVCacheManager(64, evict_ahead=bad)


def test_match_prefix_finds_what_admit_reuses_and_changes_nothing() -> None:
    mgr = make()
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
