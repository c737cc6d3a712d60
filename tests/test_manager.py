"""The manager's construction, argument checking, errors, hooks, stats and thread safety."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import busy_manager, prefill, run_prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem import (
    ArgumentError,
    ArgumentTypeError,
    CheckingTracker,
    ConcurrentUseError,
    IntegrityError,
    KVMemError,
    OutOfPagesError,
    PageAllocator,
    PagePool,
    PageTable,
)
from kvmem.cuda import PoolSpec
from kvmem.manager import (
    HookError,
    KVCacheManager,
    ManagerEvent,
)
from kvmem.testing import ToyEngine, faults

P = 4


def busy(make_manager: Any) -> tuple[KVCacheManager, ToyEngine]:
    """Three running requests (two share a prefix), one preempted, one step in flight."""
    mgr = make_manager(max_seqs=6, max_pages_per_seq=8)
    eng = ToyEngine(mgr)
    for rid, prompt in (("a", list(range(9))), ("b", list(range(9))), ("c", [7] * 5),
                        ("p", [3] * 6)):
        res = eng.admit(rid, prompt)
        eng.step([rid], len(prompt) - res.num_cached_tokens)
        eng.commit([rid])
    eng.preempt("p")
    mgr.begin_step()
    return mgr, eng


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


class _BlockingPool(PagePool):
    """A pool whose copy_pages blocks until released: a call from another thread then
    overlaps the first thread's reserve, deterministically."""

    def __init__(self) -> None:
        super().__init__(PoolSpec(num_layers=1, num_pages=16, num_kv_heads=1, head_dim=4,
                                  page_size=4, dtype="fp32", device="cpu"))
        self.entered = threading.Event()
        self.proceed = threading.Event()

    def copy_pages(self, src: Any, dst: Any) -> None:
        self.entered.set()
        self.proceed.wait(10)
        super().copy_pages(src, dst)


def manager() -> KVCacheManager:
    mgr = KVCacheManager(64, page_size=4, max_seqs=8, tracker="checking")
    mgr.admit("a", list(range(10)))
    return mgr


BAD_IDS = [1.5, float("nan"), None, True, np.True_, b"x", (1, 2), torch.tensor(3), object()]


@pytest.mark.long  # 300 hypothesis examples
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=st.sampled_from(sorted(ENTRIES)), data=st.data())
def test_bad_input_raises_a_kvmem_error_and_changes_nothing(
        make_manager: Any, snapshot: Any, entry: str, data: Any) -> None:
    call, values = ENTRIES[entry]
    value = data.draw(st.sampled_from(values))
    mgr, _ = busy(make_manager)
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


def test_a_second_thread_inside_the_manager_is_refused(make_manager: Any, snapshot: Any) -> None:
    """A manager is used by one thread at a time: a thread that enters while another is inside
    (here held in a hook) is refused before it changes anything; the same thread may re-enter
    (a hook that calls the manager)."""
    mgr = make_manager(max_seqs=6, max_pages_per_seq=8)
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


def test_a_hook_may_call_the_manager(make_manager: Any) -> None:
    mgr = make_manager(max_seqs=6, max_pages_per_seq=8)
    mgr.add_hook("admit", lambda e: mgr.release(e.request_id) if e.request_id == "tmp" else None)
    mgr.admit("tmp", [1, 2])
    assert mgr.running == ()


def test_concurrent_use_from_two_threads_is_refused() -> None:
    pool = _BlockingPool()
    m = KVCacheManager(16, page_size=4, max_seqs=4, pool=pool)
    p = list(range(1, 7))
    m.admit("a", p)
    m.reserve(["a"], 6)
    m.commit("a", p)
    m.fork("a", "b")
    worker = threading.Thread(target=m.reserve, args=(["a"], 1))  # copy-on-write: blocks
    worker.start()
    try:
        assert pool.entered.wait(10)
        with pytest.raises(KVMemError, match="thread"):
            m.admit("c", [7, 8, 9])
    finally:
        pool.proceed.set()
        worker.join(10)
    m.check()


@pytest.mark.parametrize("count", [1.5, "2", True, 2.0])
def test_counts_must_be_integers(snapshot: Any, count: Any) -> None:
    m = KVCacheManager(64, page_size=4, max_seqs=4)
    m.admit("a", [1, 2])
    before = snapshot(m)
    with pytest.raises(ArgumentTypeError, match="num_tokens"):
        m.reserve(["a"], count)
    assert snapshot(m) == before


@pytest.mark.parametrize("args", [(0,), (64, 0), (64, 16, 0)])
def test_constructor_errors_are_kvmem_errors_naming_the_argument(args: tuple[int, ...]) -> None:
    names = ("num_pages", "page_size", "max_seqs")
    with pytest.raises(ArgumentError) as info:
        KVCacheManager(*args)
    assert names[len(args) - 1] in str(info.value)
    assert "max_pages_per_seq" not in str(info.value)  # not passed, not blamed


def test_constructor_takes_numpy_integers_and_refuses_bools() -> None:
    assert KVCacheManager(np.int64(64)).num_pages == 64
    with pytest.raises(ArgumentTypeError, match="num_pages"):
        KVCacheManager(True)


@pytest.mark.parametrize("call", [
    lambda m: m.reserve(["zz"], 1), lambda m: m.commit("zz", [1]), lambda m: m.verify(["zz"]),
    lambda m: m.preempt("zz"), lambda m: m.release("zz"), lambda m: m.release_batch(["zz"]),
    lambda m: m.resume("a"), lambda m: m.can_resume("a"), lambda m: m.fork("zz", "c"),
    lambda m: m.admit("a", [1, 2]), lambda m: m.fork("a", "a"), lambda m: m.pages_of("zz"),
    lambda m: m.commit("a", list(range(50))), lambda m: m.admit("b", list(range(1000))),
    lambda m: m.namespace_of_page(63),
])
def test_an_unknown_or_unfit_request_argument_is_an_argument_error(
        snapshot: Any, call: Any) -> None:
    """An id the manager does not know (or knows already), a prompt or chunk too long for a
    row: argument mistakes, so ArgumentError (a ValueError), changing nothing."""
    mgr = manager()
    before = snapshot(mgr)
    with pytest.raises(ArgumentError):
        call(mgr)
    assert snapshot(mgr) == before


def test_a_repeated_request_id_is_named() -> None:
    mgr = manager()
    mgr.admit("b", [5, 6])
    for call in (lambda: mgr.reserve(["a", "b", "a"], 1), lambda: mgr.verify(["b", "a", "b"]),
                 lambda: mgr.release_batch(["a", "b", "b"])):
        with pytest.raises(ArgumentError, match=r"lists '[ab]' twice"):
            call()
    assert set(mgr.running) == {"a", "b"}


def test_every_manager_error_is_a_kvmem_error() -> None:
    mgr = manager()
    with pytest.raises(KVMemError):
        mgr.reserve([["zz"]], 1)  # unhashable id


def test_hook_arguments_of_the_wrong_type_or_kind_are_refused_by_name() -> None:
    mgr = manager()
    for kind in (3, ["admit"], None):
        with pytest.raises(ArgumentTypeError, match="kind"):
            mgr.add_hook(kind, print)
    with pytest.raises(ArgumentTypeError, match="callable"):
        mgr.add_hook("admit", 3)
    with pytest.raises(ArgumentError, match="kind='nope'"):
        mgr.remove_hook("nope", print)
    with pytest.raises(ArgumentError, match="not registered"):
        mgr.remove_hook("admit", print)
    mgr.admit("b", [1])  # no hook was added by the refused calls


def test_the_error_tree_is_the_one_errors_md_draws() -> None:
    import kvmem

    parents = {
        "OutOfPagesError": kvmem.KVMemError, "InvalidFreeError": kvmem.KVMemError,
        "IntegrityError": kvmem.KVMemError, "ConcurrentUseError": kvmem.KVMemError,
        "HookError": kvmem.KVMemError, "ArgumentError": kvmem.KVMemError,
        "ConfigError": kvmem.ArgumentError, "MetadataError": kvmem.ArgumentError,
        "ArgumentTypeError": kvmem.KVMemError,
    }
    for name, parent in parents.items():
        assert getattr(kvmem, name).__bases__[0] is parent, name
    assert issubclass(kvmem.ArgumentError, ValueError)
    assert issubclass(kvmem.ArgumentTypeError, TypeError)
    assert not issubclass(kvmem.HookError, kvmem.ConcurrentUseError)


def test_errors_change_nothing(make_manager: Any, snapshot: Any) -> None:
    mgr = make_manager(num_pages=5, max_pages_per_seq=4)
    mgr.admit("a", np.arange(8))
    mgr.reserve(["a"], 8)
    before = snapshot(mgr)
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
        assert snapshot(mgr) == before, call
    mgr.check()


def test_tracker_configuration_is_checked(make_manager: Any) -> None:
    with pytest.raises(KVMemError, match="tracker records"):
        make_manager(tracker=CheckingTracker(2, 2))
    with pytest.raises(KVMemError):
        make_manager(tracker="bogus")
    with pytest.raises(KVMemError):
        make_manager(prefix_cache="radix")
    with pytest.raises(ValueError):
        KVCacheManager(num_pages=0, max_pages_per_seq=4)
    assert make_manager(tracker=CheckingTracker(8, 16)).tracker.enabled


def test_a_request_listed_twice_in_a_batch_is_rejected_and_changes_nothing(
        make_manager: Any, snapshot: Any) -> None:
    mgr = make_manager(num_pages=64)
    for rid in ("a", "b"):
        mgr.admit(rid, np.arange(5))
    before = snapshot(mgr)
    for num in (1, P + 1, [1, 2, 3]):  # the one-page path, the general path, per-row counts
        with pytest.raises(ValueError, match="distinct"):
            mgr.reserve(["a", "b", "a"], num)
        assert snapshot(mgr) == before
    mgr.reserve(["a", "b"], 1)
    before = snapshot(mgr)
    with pytest.raises(KVMemError, match="distinct"):
        mgr.commit_batch(["b", "b"], np.array([1, 2]))
    assert snapshot(mgr) == before
    mgr.commit_batch(["a", "b"], np.array([1, 2]))
    mgr.check()


def test_hooks_see_every_kind_of_event(make_manager: Any) -> None:
    mgr = make_manager(num_pages=10)
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


def test_a_raising_hook_never_leaves_the_manager_half_changed(make_manager: Any) -> None:
    mgr = make_manager()
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


def test_stats_are_a_frozen_snapshot_that_conserves_pages(make_manager: Any) -> None:
    mgr = make_manager()
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


def test_hooks_and_kv_events_are_changed_by_one_thread_at_a_time(make_manager: Any) -> None:
    import threading

    m = make_manager(kv_events=True, max_pages_per_seq=8)
    inside, leave = threading.Event(), threading.Event()

    def blocking_hook(event: Any) -> None:
        inside.set()
        assert leave.wait(10)

    prefill(m, "warm", list(range(5)))  # one PagesStored waiting in take_events
    m.add_hook("admit", blocking_hook)
    worker = threading.Thread(target=m.admit, args=("b", [7, 8, 9]))
    worker.start()
    try:
        assert inside.wait(10)
        for call in (m.take_events, lambda: m.add_hook("free", print),
                     lambda: m.remove_hook("admit", blocking_hook)):
            with pytest.raises(KVMemError, match="thread"):
                call()
    finally:
        leave.set()
        worker.join(10)
    assert len(m.take_events()) == 1  # the refused take_events took nothing
    m.remove_hook("admit", blocking_hook)
    m.check()


def test_each_hook_kind_carries_what_the_table_says(make_manager: Any) -> None:
    from kvmem.manager import HOOK_KINDS
    from kvmem.testing import faults

    m = make_manager(num_pages=10, max_seqs=4, kv_events=True, max_pages_per_seq=8)
    seen: list[Any] = []
    for kind in HOOK_KINDS:
        m.add_hook(kind, seen.append)

    def take() -> list[tuple[str, Any, Any, Any]]:
        out = [(e.kind, e.request_id, None if e.pages is None else e.pages.tolist(),
                e.detail if e.kind != "kv_event" else type(e.detail).__name__) for e in seen]
        assert all(e.pages is None or (e.pages.dtype == np.int32 and not e.pages.flags.writeable)
                   for e in seen)
        seen.clear()
        return out

    m.admit("a", list(range(9)))
    assert take() == [("allocate", "a", [0, 1, 2], None), ("admit", "a", [0, 1, 2], 0)]
    m.reserve(["a"], 9)
    m.commit("a", list(range(9)))
    m.reserve(["a"], 4)
    assert take() == [("kv_event", None, None, "PagesStored"), ("allocate", None, [3], None)]
    m.commit("a", [1, 2, 3, 4])
    take()
    m.fork("a", "b")
    assert take() == [("fork", "b", [0, 1, 2, 3], "a")]
    h = m.begin_step()
    m.preempt("b")
    m.retire(h)  # the fence's references dropped; "a" still holds the pages: nothing freed
    assert take() == [("step_begin", None, None, h.step_id), ("preempt", "b", [0, 1, 2, 3], None),
                      ("step_end", None, [0, 1, 2, 3], h.step_id)]
    m.release("b")
    assert take() == [("release", "b", None, None)]
    m.admit("c", [3] * 24)
    m.reserve(["c"], 24)
    m.commit("c", [3] * 24)
    take()
    faults.free_behind_back(m, "c", 1)
    report = m.verify(["c"])
    got = take()
    assert report.aborted.keys() == {"c"}
    assert [k for k, *_ in got if k != "kv_event"] == ["integrity_failure", "free"]  # no release
    assert ("free", None, [6, 7, 8, 9], None) in got and got[-2][1:3] == ("c", None)
    m.release("a")
    assert take() == [("free", None, [3], None), ("release", "a", [0, 1, 2, 3], None)]
    m.clear_prefix_cache()
    assert take() == [("free", None, [0, 1, 2, 4], None), ("kv_event", None, None,
                                                          "AllPagesCleared")]
    m.check()


@pytest.mark.parametrize("bad", BAD_IDS, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("call", ["admit", "fork"])
def test_a_request_id_is_a_str_or_an_int(
        make_manager: Any, snapshot: Any, call: str, bad: Any) -> None:
    """errors.md, manager.md: request ids are the engine's, str or int. A float, None, a
    bool (True is not request 1 here), bytes, a tuple, a tensor or an object were admitted."""
    mgr = busy_manager(make_manager)
    before = snapshot(mgr)
    with pytest.raises(ArgumentTypeError, match="request_id"):
        if call == "admit":
            mgr.admit(bad, [1, 2, 3])
        else:
            mgr.fork("c", bad)
    assert snapshot(mgr) == before


def test_a_numpy_integer_request_id_is_its_int(make_manager: Any) -> None:
    mgr = make_manager(num_pages=64, max_seqs=10, tracker="paranoid")
    mgr.admit(np.int64(7), [1, 2, 3])
    assert mgr.running == (7,) and mgr.num_tokens(7) == 0
    mgr.reserve([7], 3)
    mgr.commit(np.int32(7), [1, 2, 3])
    mgr.fork(7, np.int16(8))
    assert mgr.running == (7, 8)
    with pytest.raises(KVMemError, match="already known"):
        mgr.admit(8, [4])


def test_the_documented_defaults_dtypes_stats_and_hook_kinds(make_manager: Any) -> None:
    import dataclasses

    from kvmem.manager import HOOK_KINDS, ManagerStats

    assert KVCacheManager(100, page_size=4, watermark=0.29).watermark_pages == 28
    assert KVCacheManager(1024, page_size=4).config.evict_ahead == 2
    assert KVCacheManager(1024, page_size=4).pages._evict_ahead == 2  # num_pages // 512
    assert KVCacheManager(511, page_size=4).pages._evict_ahead == 0  # exactly what it needs
    assert KVCacheManager(1024, page_size=4, evict_ahead=0).pages._evict_ahead == 0
    assert set(HOOK_KINDS) == {"admit", "allocate", "free", "evict", "preempt", "release",
                               "fork", "step_begin", "step_end", "integrity_failure",
                               "kv_event", "offload_drop"}
    stats = {f.name for f in dataclasses.fields(ManagerStats)} | {"usage", "prefix_hit_rate"}
    assert {"num_free", "num_used", "num_cached", "num_fenced", "usage", "num_running",
            "num_preempted", "num_prefix_queries", "prefix_query_tokens", "prefix_hit_tokens",
            "prefix_hit_rate", "num_evictions", "num_preemptions", "num_integrity_failures",
            "num_cow_copies", "num_forks", "steps_in_flight"} <= stats
    mgr = make_manager(num_pages=64, max_seqs=10, tracker="paranoid")
    res = mgr.admit("a", np.arange(9))
    assert res.num_cached_tokens == 0
    step = mgr.reserve(["a"], 9)
    assert step.slot_mapping.dtype == np.int64
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "seq_lens",
                 "num_new_tokens"):
        assert getattr(step, name).dtype == np.int32, name
    assert step.block_table.dtype == np.int32 and step.kv_last_page_len.tolist() == [1]
    mgr.commit("a", np.arange(9))
    again = mgr.admit("b", np.arange(9))  # two full pages cached, the last token computed
    assert again.num_cached_tokens == 8 and again.num_cached_tokens % P == 0


def _first8(pages: Any) -> str:
    return str([int(p) for p in pages][:8])


def _check_message(mgr: KVCacheManager) -> str:
    with pytest.raises(IntegrityError) as e:
        mgr.check()
    return str(e.value)


@pytest.mark.parametrize("num_bad", [1, 9])
def test_check_names_the_request_and_pages_a_corrupt_row_maps(make_manager: Any,
                                                               num_bad: int) -> None:
    """check() reports a row that maps ids outside the pool (below 0 or at num_pages and
    beyond: of no namespace) by request and page (the first 8), together with the refcounts
    that no longer match their holders and the pages no holder keeps (leaked); and a row
    committed past what it reserved."""
    mgr = make_manager(num_pages=32, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(40)))  # pages 0..9
    mgr.check()
    row = mgr._requests.row_of("a")
    ids = [-5, 32, -6, 33, 34, 35, -7, 36, 37][:num_bad]
    for col, page in enumerate(ids):
        mgr.table.overwrite(row, col, page)
    lost = list(range(num_bad))
    message = _check_message(mgr)
    assert message.startswith("KVCacheManager.check() failed: ")
    assert f"request 'a' maps pages {_first8(ids)} of another namespace (or none)" in message
    assert (f"refcounts {_first8([1] * num_bad)} of pages {_first8(lost)} differ from their "
            f"holders {_first8([0] * num_bad)}") in message
    assert f"pages {_first8(lost)} are held by no row, cache or fence (leaked)" in message
    for col, page in enumerate(lost):
        mgr.table.overwrite(row, col, page)
    mgr.check()
    mgr.table.num_committed[row] = mgr.table.num_tokens[row] + 1
    assert _check_message(mgr) == ("KVCacheManager.check() failed: request 'a': committed 41 > "
                                   "reserved 40 or beyond its pages")


@pytest.mark.parametrize("num_bad", [1, 9])
def test_check_names_pages_that_are_free_and_held(make_manager: Any, num_bad: int) -> None:
    """A page freed behind its holders' backs, whether only the prefix cache keeps it or a
    row maps it, is reported as free and held (the first 8 pages)."""
    mgr = make_manager(num_pages=32)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(40)))
    eng.release("a")  # the cache alone keeps a's pages
    run_prompt(eng, "b", [7] * 40)
    assert mgr.cache is not None
    cached = mgr.cache.cached_pages()[:num_bad]
    mgr.allocator.free(cached)  # behind the cache's back
    assert f"pages {_first8(cached)} are free and held at once" in _check_message(mgr)
    mapped = np.sort(mgr.table.row_pages(mgr._requests.row_of("b"))[:num_bad])
    mgr.allocator.free(np.concatenate([mapped, mapped]))  # behind b's and the cache's backs
    both = np.sort(np.concatenate([cached, mapped]))
    assert f"pages {_first8(both)} are free and held at once" in _check_message(mgr)


@pytest.mark.parametrize("num_bad", [1, 9])
def test_check_names_cached_pages_whose_namespace_drifted(make_manager: Any,
                                                          num_bad: int) -> None:
    """A cached page whose namespace (the pages' record) disagrees with the prefix cache's
    is reported (the first 8 pages)."""
    mgr = make_manager(num_pages=32)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(40)))
    eng.release("a")
    assert mgr.cache is not None
    drifted = mgr.cache.cached_pages()[:num_bad]
    mgr.pages.namespace_ids[drifted] = 99
    assert _check_message(mgr) == (f"KVCacheManager.check() failed: cached pages "
                                   f"{_first8(drifted)} disagree on namespace")


def test_check_passes_on_the_allocators_own_findings(make_manager: Any) -> None:
    """check() includes the allocator's own check, word for word."""
    mgr = make_manager(num_pages=32, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(6)))
    free_page = int(mgr.allocator._free_stack[0])
    mgr.allocator._tags[free_page] = 7
    assert _check_message(mgr) == ("KVCacheManager.check() failed: PageAllocator.check() "
                                   f"failed: free pages [{free_page}] have tag != 0")


def test_tokens_of_is_a_copy_of_the_committed_ids_as_int64(make_manager: Any) -> None:
    """tokens_of() returns ``[k]`` int64 token ids (not floats that compare equal), a copy
    that the caller may change."""
    mgr = make_manager()
    prefill(mgr, "a", [3, 1, 4, 1, 5, 9])
    got = mgr.tokens_of("a")
    assert got.dtype == np.int64 and got.tolist() == [3, 1, 4, 1, 5, 9]
    got[0] = 7
    assert mgr.tokens_of("a")[0] == 3


def test_evicting_ahead_stops_at_the_evictable_pages_and_frees_their_namespaces(
        make_manager: Any) -> None:
    """An allocation short of free pages evicts what it needs plus up to ``evict_ahead``
    more least-recently-used pages, never more than the cache holds alone; evicted pages
    that stay free hold no namespace (-1), like every free page."""
    mgr = make_manager(num_pages=16, evict_ahead=8)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(16)))  # 4 full pages, cached
    eng.release("a")
    run_prompt(eng, "c", [7] * 40)  # 10 pages held
    assert mgr.stats().num_free == 2 and mgr.stats().num_cached == 4
    run_prompt(eng, "b", list(range(100, 112)))  # 3 pages: 1 short, the other 3 evicted ahead
    stats = mgr.stats()
    assert stats.num_evictions == 4 and stats.num_free == 3 and stats.page_size == 4
    free = mgr.allocator.refcounts == 0
    assert (mgr.pages.namespace_ids[free] == -1).all()
    mgr.check()
