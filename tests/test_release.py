"""release, release_batch, preemption and resume."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from engine_helpers import finished_batch, run_prompt

from kvmem import (
    ArgumentTypeError,
    KVMemError,
    OutOfPagesError,
)
from kvmem.manager import (
    KVCacheManager,
    ManagerEvent,
)
from kvmem.testing import ToyEngine


def test_a_failed_resume_keeps_the_preempted_order(make_manager: Any, snapshot: Any) -> None:
    mgr = make_manager(num_pages=8, prefix_cache=None, max_seqs=6, max_pages_per_seq=8)
    for rid in ("a", "b", "c"):
        mgr.admit(rid, [1] * 8)
    for rid in ("a", "b", "c"):
        mgr.preempt(rid)
    mgr.admit("hog", [2] * 28)  # 7 of 8 pages: nobody resumes
    before = snapshot(mgr)
    with pytest.raises(OutOfPagesError):
        mgr.resume("b")
    assert mgr.preempted == ("a", "b", "c") and snapshot(mgr) == before


def test_a_failed_resume_of_committed_requests_keeps_the_preempted_order(snapshot: Any) -> None:
    m = KVCacheManager(8, page_size=4, max_seqs=4, prefix_cache=None)
    for r in "ab":
        m.admit(r, list(range(1, 9)))
        m.reserve([r], 8)
        m.commit(r, list(range(1, 9)))
    m.preempt("a")
    m.preempt("b")
    m.admit("c", list(range(1, 29)))  # takes the pages a resume would need
    before = snapshot(m)
    with pytest.raises(KVMemError):
        m.resume("a")
    assert snapshot(m) == before


def test_release_batch_refuses_a_string() -> None:
    m = KVCacheManager(64, page_size=4, max_seqs=4)
    m.admit("A", [1])
    m.admit("B", [2])
    with pytest.raises(ArgumentTypeError):
        m.release_batch("AB")
    assert set(m.running) == {"A", "B"}


def test_out_of_pages_on_reserve_then_preempt_and_retry(make_manager: Any, snapshot: Any) -> None:
    mgr = make_manager(num_pages=4, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    run_prompt(eng, "b", [2] * 8)
    assert not mgr.can_reserve(["a", "b"], 1)
    before = snapshot(mgr)
    with pytest.raises(OutOfPagesError):
        mgr.reserve(["a", "b"], 1)
    assert snapshot(mgr) == before
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


def test_release_batch_equals_releasing_one_by_one(make_manager: Any) -> None:
    one, many = make_manager(num_pages=64), make_manager(num_pages=64)
    ids = finished_batch(one)
    assert finished_batch(many) == ids
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


def test_the_free_at_once_fault_hook_frees_only_the_drops_it_names(make_manager: Any) -> None:
    """Fault injection's ``free_at_once(pages)``: with a step in flight, a release whose pages
    it answers True for is freed at once (the bug it re-creates); the others wait for the
    step, as without the hook. The hook sees the very pages dropped."""
    mgr = make_manager(num_pages=32, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(8)))
    run_prompt(eng, "b", list(range(20, 28)))
    a_pages = mgr.table.row_pages(mgr.row_of("a")).tolist()
    b_pages = mgr.table.row_pages(mgr.row_of("b")).tolist()
    seen: list[list[int]] = []

    def free_at_once(pages: np.ndarray) -> bool:
        seen.append(sorted(pages.tolist()))
        return seen[-1] == sorted(a_pages)

    mgr.fault_hooks.free_at_once = free_at_once
    handle = mgr.begin_step()
    free = mgr.allocator.num_free
    mgr.release("a")
    assert mgr.allocator.num_free == free + 2 and not mgr.allocator.refcounts[a_pages].any()
    mgr.release("b")
    assert mgr.allocator.num_free == free + 2 and mgr.allocator.refcounts[b_pages].all()
    assert seen == [sorted(a_pages), sorted(b_pages)]
    mgr.retire(handle)
    assert mgr.allocator.num_free == free + 4
    mgr.check()
