"""fork and copy-on-write."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import run_prompt

from kvmem import (
    KVMemError,
    OutOfPagesError,
)
from kvmem.cuda import PagePool, PoolSpec
from kvmem.manager import (
    KVCacheManager,
    PagesStored,
)
from kvmem.testing import ToyEngine

P = 4


def pooled(make_manager: Any, num_pages: int = 16) -> tuple[KVCacheManager, Any]:
    from kvmem.cuda import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=2, num_pages=num_pages, num_kv_heads=1, head_dim=8,
                             page_size=P, dtype="fp32", device="cpu"))
    return make_manager(num_pages=num_pages, pool=pool), pool


def _cached_hashes(m: KVCacheManager) -> Counter[int]:
    c: Any = m.cache
    return Counter(int.from_bytes(k.tobytes(), "big") for k in c._keys[c._cached])


def test_a_copy_on_write_of_an_fp8_page_moves_its_scales(make_manager: Any) -> None:
    """BUGS.md 16: the copy-on-write of a partly filled FP8 tail (per-token scales) moves data
    and scales together, so the child reads exactly the parent's K/V; a copy of the data alone
    (the shipped bug) reads back different values, which the same comparison catches."""
    pool = PagePool(PoolSpec(num_layers=2, num_pages=16, num_kv_heads=1, head_dim=8,
                             page_size=P, dtype="fp8_e4m3", scales="token_head", device="cpu"))
    mgr = make_manager(pool=pool, num_pages=16)
    mgr.admit("p", np.arange(6))
    step = mgr.reserve(["p"], 6)
    mag = torch.tensor([1.0, 30.0, 0.01, 500.0, 7.0, 2000.0]).reshape(6, 1, 1)
    kv = torch.linspace(-1, 1, 6 * 8).reshape(6, 1, 8) * mag
    for layer in range(2):
        pool.write(layer, torch.as_tensor(step.slot_mapping), kv, -kv)
    mgr.commit("p", np.arange(6))
    mgr.fork("p", "c")
    step = mgr.reserve(["p", "c"], 1)  # the manager copies the shared tail through the pool
    tail_p, tail_c = int(mgr.pages_of("p")[1]), int(mgr.pages_of("c")[1])
    assert tail_p != tail_c and mgr.stats().num_cow_copies == 1
    # The bug, beside it: the data bytes of the parent's tail copied to a free page alone.
    spare = int(np.flatnonzero(mgr.allocator.refcounts == 0)[0])
    data = pool.storage_tensors()["data"]
    data[:, spare] = data[:, tail_p]
    for layer in range(2):
        kp, vp = pool.read(layer, [tail_p])
        kc, vc = pool.read(layer, [tail_c])
        ks, _ = pool.read(layer, [spare])
        assert torch.equal(kp[:, :2], kc[:, :2]) and torch.equal(vp[:, :2], vc[:, :2])
        assert not torch.equal(kp[:, :2], ks[:, :2])
    assert mgr.verify(["p", "c"], step).ok


@pytest.mark.parametrize("num_pages", range(4, 12))
def test_prefill_after_a_fork_never_runs_out_of_pages(
        make_manager: Any, snapshot: Any, num_pages: int) -> None:
    """A fork between two prefill chunks: the parent's next chunk writes into the shared tail,
    which needs a copy-on-write page admission never reserved. The fork promises it: either the
    fork refuses (nothing changed) or both requests finish their prompts."""
    mgr = make_manager(num_pages=num_pages, prefix_cache=None, max_seqs=6, max_pages_per_seq=8)
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


def test_fork_shares_pages_and_copies_a_partly_filled_tail_on_write(make_manager: Any) -> None:
    """BUG 14 (no copy-on-write) and BUG 4 (fork refcounts)."""
    mgr = make_manager()
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


def test_a_fork_of_a_full_tail_needs_no_copy_and_reserved_room_is_private(
        make_manager: Any) -> None:
    mgr = make_manager()
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


def test_copy_on_write_copies_the_pool_pages(make_manager: Any) -> None:
    import torch

    mgr, pool = pooled(make_manager)
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


def test_a_forks_shared_page_committed_by_both_in_one_batch_is_stored_once(
        make_manager: Any) -> None:
    # The parent forks after writing (before committing) a full page; both commit it in one
    # commit_batch. One physical page is cached under one hash: one PagesStored.
    m = make_manager(kv_events=True, max_pages_per_seq=8)
    m.admit("p", [1, 2, 3, 4, 5, 6])
    m.reserve(["p"], 6)
    m.fork("p", "c")
    m.commit_batch(["p", "c"], [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    events = m.take_events()
    stored = [h for e in events if isinstance(e, PagesStored) for h in e.page_hashes]
    assert len(stored) == 1 == len(set(stored))
    assert Counter(stored) == _cached_hashes(m)
    m.check()


def test_a_fork_of_a_full_tail_takes_exactly_its_reserved_room() -> None:
    """A parent with two full pages and a third reserved: the fork needs one page (its own
    room) and no copy, so it succeeds with exactly one free page (a copy counted for a full
    tail refused it)."""
    m = KVCacheManager(4, page_size=P, max_seqs=4, prefix_cache=None, watermark=0.0)
    m.admit("p", list(range(12)))
    m.reserve(["p"], 8)
    m.commit("p", list(range(8)))
    assert m.stats().num_free == 1
    assert m.can_fork("p")
    m.fork("p", "c")
    assert m.stats().num_free == 0


def test_a_forks_pages_chain_their_prefix_keys_from_the_parents() -> None:
    """The child inherits the parent's last prefix key: the page it fills after the fork is
    cached under the key of the whole prefix, so a later prompt with that prefix hits both
    pages (one chained from nothing would hit only the first)."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, watermark=0.0)
    m.admit("p", list(range(6)))
    m.reserve(["p"], 6)
    m.commit("p", list(range(6)))  # page 0 cached; page 1 holds 2 tokens
    m.fork("p", "c")
    m.reserve(["c"], 2)
    m.commit("c", [6, 7])  # the child's copy of page 1 fills and is cached
    match = m.match_prefix([*range(8), 99])
    assert match.num_pages == 2
    assert match.pages[1] == m.pages_of("c")[1] != m.pages_of("p")[1]


def test_a_fork_leaves_the_pending_step_of_another_request_alone() -> None:
    """A fork marks only its parent's writes done: another request's reserved, not yet
    verified step still lists its new tokens, and verify accepts it afterwards."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, tracker="checking", watermark=0.0)
    for rid in ("a", "p"):
        m.admit(rid, [1, 2, 3])
        m.reserve([rid], 3)
        m.commit(rid, [1, 2, 3])
    step = m.reserve(["a"], 2)
    m.reserve(["p"], 1)
    m.commit("p", [4])
    m.fork("p", "c")
    report = m.verify(["a"], step)
    assert report.ok and not report.aborted
    m.commit("a", [5, 6])
    assert m.tokens_of("a").tolist() == [1, 2, 3, 5, 6]


def test_a_fork_at_a_partial_page_marks_exactly_the_parent_and_the_child() -> None:
    """Only the two rows that share the partly filled tail are marked forked (others keep the
    decode step's fast path), and the marks go once both have written past it."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, watermark=0.0)
    m.admit("other", [9])
    m.admit("p", list(range(6)))
    m.reserve(["p"], 6)
    m.commit("p", list(range(6)))
    m.fork("p", "c")
    rows = {m.row_of("p"), m.row_of("c")}
    assert set(np.flatnonzero(m.table.forked).tolist()) == rows and m.table.num_forked == 2
    m.reserve(["p", "c"], 1)
    assert m.table.num_forked == 0 and not m.table.forked.any()


@pytest.mark.parametrize("batch", [["p"], ["p", "c1"]])
def test_a_forked_request_that_writes_nothing_this_step_gets_no_copy(batch: list[str]) -> None:
    """A row reserving 0 tokens writes nothing, so it takes no copy of the tail it shares:
    alone, no copy at all; beside a sibling that writes, only the sibling copies (the tail
    has a third holder that may write later)."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, prefix_cache=None, watermark=0.0)
    m.admit("p", list(range(6)))
    m.reserve(["p"], 6)
    m.commit("p", list(range(6)))
    m.fork("p", "c1")
    m.fork("p", "c2")
    tail = m.pages_of("p")[1]
    step = m.reserve(batch, [0] * (len(batch) - 1) + [0 if len(batch) == 1 else 1])
    assert step.copy_src.tolist() == ([] if len(batch) == 1 else [tail])
    assert m.pages_of("p")[1] == tail


@pytest.mark.parametrize("first", [True, False], ids=["tail is page 0", "tail is page 1"])
def test_the_page_a_fork_promised_for_its_copy_is_not_available(first: bool) -> None:
    """After a fork at a partly filled tail, the copy's page is promised: admission cannot
    take it (whatever the tail's page id, page 0 included), the copy-on-write can."""
    m = KVCacheManager(2 if first else 3, page_size=P, max_seqs=4, prefix_cache=None,
                       watermark=0.0)
    if not first:
        m.admit("x", [9])
    m.admit("p", [1, 2])
    m.reserve(["p"], 2)
    m.commit("p", [1, 2])
    m.fork("p", "c")
    assert m.pages_of("p")[0] == (0 if first else 1)
    assert m.stats().num_free == 1 and not m.can_admit([5])
    with pytest.raises(OutOfPagesError):
        m.admit("y", [5])
    assert m.reserve(["c"], 1).copy_src.tolist() == [m.pages_of("p")[0]]


@pytest.mark.parametrize("ntok", [5, 6, 7])
def test_a_shared_tail_holding_any_number_of_tokens_is_copied_on_write(ntok: int) -> None:
    """A tail holding 1, 2 or 3 of its 4 tokens: the child's first write gets a copy of it,
    and the parent keeps the page."""
    m = KVCacheManager(32, page_size=P, max_seqs=4, prefix_cache=None, watermark=0.0)
    m.admit("p", list(range(ntok)))
    m.reserve(["p"], ntok)
    m.commit("p", list(range(ntok)))
    m.fork("p", "c")
    tail = m.pages_of("p")[1]
    step = m.reserve(["c"], 1)
    assert step.copy_src.tolist() == [tail] and m.pages_of("c")[1] != tail
    assert m.pages_of("p")[1] == tail
