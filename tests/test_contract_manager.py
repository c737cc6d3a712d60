"""Issue 12's findings in the manager, allocator, page table and trackers, one test each,
reproduced against the public API (each failed before the fix). The contract they hold the
code to is docs/errors.md: a kvmem error (argument errors also ``ValueError`` or
``TypeError``), a message naming the argument and value, and nothing changed."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from kvmem import CheckingTracker, KVCacheManager, KVMemError, PageAllocator, PagePool, PageTable
from kvmem.cuda import PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError


def _state(m: KVCacheManager) -> dict[str, Any]:
    """What must not change when a call is refused."""
    return {
        "running": m.running,
        "preempted": m.preempted,
        "tokens": {r: m.num_tokens(r) for r in m.running},
        "committed": {r: m.num_committed(r) for r in m.running},
        "pages": {r: m.pages_of(r).tolist() for r in m.running},
        "refcounts": m.allocator.refcounts.tolist(),
        "tags": m.allocator.tags.tolist(),
        "free": m.stats().num_free,
    }


# -- promises that break ------------------------------------------------------------------------


def test_reserve_between_the_table_bounds_and_a_page_is_atomic() -> None:
    m = KVCacheManager(64, page_size=16, max_seqs=2, max_pages_per_seq=2)
    m.admit("a", [1, 2, 3])
    before = _state(m)
    try:
        m.reserve(["a"], 5)
    except KVMemError:
        assert _state(m) == before
    else:
        assert m.num_tokens("a") == 5


@pytest.mark.parametrize("k", [2**63 - 16, 2**63 - 1])
@pytest.mark.parametrize("form", ["int", "list"])
def test_a_huge_reserve_is_refused_and_changes_nothing(k: int, form: str) -> None:
    m = KVCacheManager(64, page_size=16, max_seqs=2)
    m.admit("a", [1, 2, 3])
    m.reserve(["a"], 3)
    m.commit("a", [1, 2, 3])
    before = _state(m)
    with pytest.raises(KVMemError):
        m.reserve(["a"], k if form == "int" else [k])
    assert _state(m) == before


def test_prefill_never_runs_out_of_pages_after_a_fork() -> None:
    m = KVCacheManager(4, page_size=16, max_seqs=4, prefix_cache=None)
    prompt = list(range(1, 41))
    m.admit("a", prompt)  # 3 pages: the whole prompt's room
    m.reserve(["a"], 20)
    m.commit("a", prompt[:20])
    try:
        m.fork("a", "b")  # a fork may be refused for lack of pages...
    except KVMemError:
        return
    m.reserve(["a"], 20)  # ...but once it succeeded, the prompt's prefill must fit
    m.reserve(["b"], 20)


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


@pytest.mark.parametrize(("num_pages", "page_size"), [(4, 8), (8, 16)])
def test_a_pool_must_match_the_manager(num_pages: int, page_size: int) -> None:
    from kvmem import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=4, page_size=16, num_kv_heads=1,
                             head_dim=8, device="cpu"))
    with pytest.raises(ArgumentError, match="page"):
        KVCacheManager(num_pages, page_size=page_size, pool=pool)


def test_a_failed_resume_keeps_the_preempted_order() -> None:
    m = KVCacheManager(8, page_size=4, max_seqs=4, prefix_cache=None)
    for r in "ab":
        m.admit(r, list(range(1, 9)))
        m.reserve([r], 8)
        m.commit(r, list(range(1, 9)))
    m.preempt("a")
    m.preempt("b")
    m.admit("c", list(range(1, 29)))  # takes the pages a resume would need
    before = _state(m)
    with pytest.raises(KVMemError):
        m.resume("a")
    assert _state(m) == before


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


# -- input that escapes or is silently changed --------------------------------------------------


@pytest.mark.parametrize("count", [1.5, "2", True, 2.0])
def test_counts_must_be_integers(count: Any) -> None:
    m = KVCacheManager(64, page_size=4, max_seqs=4)
    m.admit("a", [1, 2])
    before = _state(m)
    with pytest.raises(ArgumentTypeError, match="num_tokens"):
        m.reserve(["a"], count)
    assert _state(m) == before


@pytest.mark.parametrize("pages", [np.int64(2**32 + 1), [1.7], [True], 1, np.array([2**32 + 1])])
def test_free_never_wraps_truncates_or_takes_one_id(pages: Any) -> None:
    a = PageAllocator(8)
    a.allocate(3)
    before = (a.refcounts.tolist(), a.tags.tolist(), a.num_free)
    with pytest.raises((ArgumentError, ArgumentTypeError)):
        a.free(pages)
    assert (a.refcounts.tolist(), a.tags.tolist(), a.num_free) == before


@pytest.mark.parametrize("n", [True, 1.0, "1"])
def test_allocate_takes_an_integer_count(n: Any) -> None:
    a = PageAllocator(8)
    with pytest.raises(ArgumentTypeError):
        a.allocate(n)
    assert a.num_free == 8


def test_release_batch_refuses_a_string() -> None:
    m = KVCacheManager(64, page_size=4, max_seqs=4)
    m.admit("A", [1])
    m.admit("B", [2])
    with pytest.raises(ArgumentTypeError):
        m.release_batch("AB")
    assert set(m.running) == {"A", "B"}


def test_namespace_of_page_refuses_a_negative_page() -> None:
    m = KVCacheManager(2, page_size=4, max_seqs=2, prefix_cache=None)
    m.admit("A", list(range(1, 8)), namespace="t")  # both pages
    with pytest.raises(ArgumentError):
        m.namespace_of_page(-1)


def test_tracker_forget_refuses_a_negative_row() -> None:
    tracker = CheckingTracker(4, 4)
    tracker.record([3], [0], [7])
    with pytest.raises(ArgumentError):
        tracker.forget([-1])
    assert tracker.expected_tags[3].tolist() == [7, 0, 0, 0]


def test_map_pages_refuses_a_negative_page() -> None:
    table = PageTable(4, 4, 16)
    row = table.add_row()
    with pytest.raises(ArgumentError):
        table.map_pages(row, [-1])


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


@pytest.mark.parametrize("form", ["list", "tensor"])
def test_commit_batch_takes_one_token_per_request(form: str) -> None:
    m = KVCacheManager(64, page_size=4, max_seqs=4)
    m.admit("a", [1, 2])
    m.admit("b", [3, 4])
    m.reserve(["a", "b"], 2)
    m.commit_batch(["a", "b"], [[1, 2], [3, 4]])
    m.reserve(["a", "b"], 1)
    if form == "list":
        tokens: Any = [5, 7]
    else:
        import torch

        tokens = torch.tensor([5, 7])
    m.commit_batch(["a", "b"], tokens)
    assert m.num_committed("a") == m.num_committed("b") == 3
