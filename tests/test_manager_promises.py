"""docs/manager.md, docs/integrity.md and docs/errors.md against ``KVCacheManager``: promises an
adversarial audit found broken (each test failed before its fix) and promises found holding
that no other test pinned. Each test names the doc sentence it holds the code to."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from kvmem import KVCacheManager
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError
from kvmem.manager import AllPagesCleared, PagesRemoved, PagesStored

P = 4


def make(num_pages: int = 32, **kw: Any) -> KVCacheManager:
    kw.setdefault("tracker", "checking")
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(num_pages=num_pages, page_size=P, max_seqs=kw.pop("max_seqs", 8),
                          max_pages_per_seq=kw.pop("max_pages_per_seq", 8), **kw)


def state(m: KVCacheManager) -> dict[str, Any]:
    """What a refused call must leave as it was (errors.md, "Nothing changed")."""
    rows = {r: (m.num_tokens(r), m.num_committed(r), m.pages_of(r).tolist()) for r in m.running}
    return {"running": m.running, "preempted": m.preempted, "rows": rows, "stats": m.stats(),
            "refcounts": m.allocator.refcounts.tolist(), "tags": m.allocator.tags.tolist(),
            "table": m.table.pages.tolist()}


def prefill(m: KVCacheManager, rid: Any, prompt: list[int], ns: Any = None) -> int:
    res = m.admit(rid, prompt, namespace=ns)
    m.reserve([rid], len(prompt) - res.num_cached_tokens)
    m.commit(rid, prompt[res.num_cached_tokens:])
    return res.num_cached_tokens


# -- errors.md: "a prompt or chunk longer than a row can map ... an ArgumentError naming the id" ---


@pytest.mark.parametrize("prompt", [[], list(range(40))], ids=["empty", "too-long"])
def test_a_prompt_that_can_never_fit_is_refused_naming_the_request(prompt: list[int]) -> None:
    m = make()
    prefill(m, "a", list(range(9)))
    m.preempt("a")
    before = state(m)
    with pytest.raises(ArgumentError, match="'req-77'"):
        m.admit("req-77", prompt)
    with pytest.raises(ArgumentError, match="'a'"):
        m.resume("a", prompt)
    assert state(m) == before and m.preempted == ("a",)


@pytest.mark.parametrize("bad", [np.array([1.0, 2.0, 3.0]), np.array([True, False, True])],
                         ids=["float", "bool"])
def test_admit_refuses_a_non_integer_prompt_even_right_after_can_admit(bad: Any) -> None:
    # errors.md: "a list holding a float or a bool" is refused; can_admit remembers its plan
    # for the admit right after, which must not let such a prompt through.
    m = make()
    assert m.can_admit(bad.astype(np.int64))
    before = state(m)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        m.admit("x", bad)
    assert state(m) == before


# -- KV events: "PagesStored ... PagesRemoved ... AllPagesCleared", following the cache ---------


def _cached_hashes(m: KVCacheManager) -> Counter[int]:
    c: Any = m.cache
    return Counter(int.from_bytes(k.tobytes(), "big") for k in c._keys[c._cached])


def test_a_forks_shared_page_committed_by_both_in_one_batch_is_stored_once() -> None:
    # The parent forks after writing (before committing) a full page; both commit it in one
    # commit_batch. One physical page is cached under one hash: one PagesStored.
    m = make(kv_events=True)
    m.admit("p", [1, 2, 3, 4, 5, 6])
    m.reserve(["p"], 6)
    m.fork("p", "c")
    m.commit_batch(["p", "c"], [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    events = m.take_events()
    stored = [h for e in events if isinstance(e, PagesStored) for h in e.page_hashes]
    assert len(stored) == 1 == len(set(stored))
    assert Counter(stored) == _cached_hashes(m)
    m.check()


def test_kv_events_replay_to_exactly_what_the_cache_holds() -> None:
    rng = np.random.default_rng(5)
    m = make(num_pages=24, kv_events=True)
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


# -- errors.md, Threads: "every operation that changes the manager ... takes the guard" ---------


def test_hooks_and_kv_events_are_changed_by_one_thread_at_a_time() -> None:
    import threading

    m = make(kv_events=True)
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


# -- manager.md, Hooks and KV events: what each kind carries ------------------------------------


def test_each_hook_kind_carries_what_the_table_says() -> None:
    from kvmem.manager import HOOK_KINDS
    from kvmem.testing import faults

    m = make(num_pages=10, max_seqs=4, kv_events=True)
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


def test_allocate_and_free_events_alone_follow_which_pages_are_in_use() -> None:
    rng = np.random.default_rng(11)
    m = make(num_pages=20, max_seqs=5, max_pages_per_seq=6)
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


# -- manager.md, Step fences: held pages "cannot be evicted or reallocated" --------------------


def test_a_cached_page_a_fence_holds_counts_as_cached_and_is_not_evictable() -> None:
    m = make(num_pages=8)
    prefill(m, "a", list(range(9)))  # pages 0, 1 full and cached, page 2 holds one token
    h = m.begin_step()
    m.release("a")
    s = m.stats()
    assert (s.num_free, s.num_cached, s.num_fenced, s.num_used) == (5, 2, 1, 0)
    seven_pages = list(range(100, 128))
    assert not m.can_admit(seven_pages)
    before = state(m)
    with pytest.raises(KVMemError):
        m.admit("b", seven_pages)
    assert state(m) == before
    m.retire(h)
    s = m.stats()
    assert (s.num_free, s.num_cached, s.num_fenced) == (6, 2, 0)
    assert m.can_admit(seven_pages)
    m.admit("b", seven_pages)  # evicts one cached page now
    assert m.stats().num_evictions == 1
    m.check()


# -- errors.md: "No numpy, torch, pydantic or Python error escapes from bad input" --------------


@pytest.mark.parametrize("call", ["reserve", "can_reserve"])
def test_ragged_token_counts_are_an_argument_error(call: str) -> None:
    m = make()
    m.admit("a", [1, 2, 3])
    before = state(m)
    with pytest.raises(KVMemError, match="num_tokens") as info:
        getattr(m, call)(["a"], [[1, 2], [3]])
    assert isinstance(info.value, (ArgumentError, ArgumentTypeError))
    assert state(m) == before


# -- manager.md, Prefix reuse: "seed= makes them reproducible for a router" ---------------------


@pytest.mark.parametrize("ns", [None, "tenant", ("lora", 3)])
def test_a_router_with_the_seed_recomputes_every_stored_hash(ns: Any) -> None:
    from kvmem.allocator import HashedPrefixCache, PrefixKeys, keys_as_ints

    m = make(prefix_cache=HashedPrefixCache(seed=7), kv_events=True)
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


# -- manager.md, One verdict: "Malformed metadata ... is refused before anything changes" -------


def _malformed_metadata(step: Any) -> list[dict[str, Any]]:
    import torch

    t = step.tensors("cpu")
    return [
        {"kv_indptr": t["kv_indptr"], "kv_indices": step.kv_indices},
        {"kv_indptr": step.kv_indptr, "kv_indices": t["kv_indices"]},
        {"kv_indptr": step.kv_indptr.astype(np.uint64), "kv_indices": step.kv_indices},
        {"metadata": {**step.fields(), "seq_lens": torch.as_tensor(step.seq_lens)}},
        {"metadata": {"slot_mapping": t["slot_mapping"], "block_table": step.block_table}},
    ]


@pytest.mark.parametrize("case", range(5))
def test_metadata_of_mixed_kinds_or_uint64_is_a_metadata_error(case: int) -> None:
    from kvmem.errors import MetadataError

    m = make()
    for rid in ("a", "b"):
        prefill(m, rid, [int(rid == "a"), 2, 3, 4, 5, 6])
    step = m.reserve(["a", "b"], 1)
    before = state(m)
    kwargs = _malformed_metadata(step)[case]
    with pytest.raises(MetadataError, match=r"kv_indptr|kv_indices|seq_lens|slot_mapping"):
        m.verify(["a", "b"], **kwargs)
    assert state(m) == before
    assert m.verify(["a", "b"], step).ok


@pytest.mark.parametrize("form", ["host-tags", "device-tags"])
def test_tracker_verify_of_metadata_not_of_the_tags_kind_is_a_metadata_error(form: str) -> None:
    import torch

    from kvmem import CheckingTracker, PageAllocator
    from kvmem.errors import MetadataError

    tracker, alloc = CheckingTracker(4, 6), PageAllocator(8)
    pages = alloc.allocate(3)
    tracker.record(np.zeros(3, dtype=np.int64), np.arange(3), alloc.tags[pages])
    tags = alloc.tags if form == "host-tags" else torch.as_tensor(alloc.tags.copy())
    indptr, indices = np.array([0, 3], dtype=np.int32), pages.astype(np.int32)
    other = torch.as_tensor if form == "host-tags" else np.asarray
    same = (lambda a: a) if form == "host-tags" else torch.as_tensor
    assert tracker.verify([0], [3], tags, kv_indptr=same(indptr), kv_indices=same(indices)).ok
    for kw in ({"kv_indptr": other(indptr), "kv_indices": same(indices)},
               {"kv_indptr": same(indptr), "kv_indices": other(indices)},
               {"block_table": other(indices[None, :])}):
        with pytest.raises(MetadataError, match="tags"):
            tracker.verify([0], [3], tags, **kw)


# -- manager.md: can_admit "leave mgr.watermark_pages pages free" (int(watermark * num_pages)) --


def test_can_admit_keeps_exactly_the_watermark_pages_free() -> None:
    m = KVCacheManager(num_pages=100, page_size=P, max_seqs=4, max_pages_per_seq=100,
                       watermark=0.29)
    assert m.watermark_pages == int(0.29 * 100) == 28
    assert m.can_admit(list(range(72 * P)))  # leaves 28
    assert not m.can_admit(list(range(72 * P + 1)))  # would leave 27
    m.admit("a", list(range(72 * P)))
    assert m.stats().num_free == 28


# -- manager.md, Integrity in the loop: the slot mapping's padding ------------------------------


@pytest.mark.parametrize("pad", [-1, 5])
def test_slot_mapping_padding_must_be_minus_one_or_every_request_aborts(pad: int) -> None:
    m = make()
    prefill(m, "a", [1, 2, 3, 4, 5, 6])
    prefill(m, "b", [9, 8, 7, 6, 5])
    step = m.reserve(["a", "b"], 1)
    md = {"slot_mapping": np.concatenate([step.slot_mapping, [-1, pad]]),
          "kv_indptr": step.kv_indptr, "kv_indices": step.kv_indices}
    report = m.verify(["a", "b"], metadata=md)
    assert report.ok_ids == (("a", "b") if pad == -1 else ())
    assert report.keep.tolist() == [pad == -1] * 2
    m.check()


# -- errors.md: the message says "what to do"; the manager's is can_admit/can_reserve, not the
# allocator's can_allocate -----------------------------------------------------------------------


def test_the_managers_out_of_pages_error_says_what_an_engine_does() -> None:
    from kvmem.errors import OutOfPagesError

    m = make(num_pages=6, prefix_cache=None)
    prefill(m, "a", list(range(10)))  # 3 pages
    m.admit("b", [1, 2, 3, 4, 5])  # 2 pages: 1 free
    m.reserve(["b"], 5)
    m.commit("b", [1, 2, 3, 4, 5])
    m.fork("b", "f")  # promises the shared tail's copy: nothing left
    before = state(m)
    for call in (lambda: m.admit("c", list(range(9))), lambda: m.reserve(["a", "b"], 4),
                 lambda: m.fork("a", "g")):
        with pytest.raises(OutOfPagesError, match=r"can_admit\(\), can_reserve\(\)") as info:
            call()
        assert "can_allocate" not in str(info.value)
        assert state(m) == before


def test_clear_prefix_cache_counts_what_it_forgot_and_frees_only_unheld_pages() -> None:
    m = make(num_pages=16, kv_events=True)
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


# -- integrity.md, "What the allocator checks about itself": free() ----------------------------


@pytest.mark.parametrize(("pages", "error"), [
    ([8], "InvalidFreeError"), ([-1], "InvalidFreeError"), ([5], "InvalidFreeError"),
    ([0, 0], "InvalidFreeError"), ([2**32 + 1], "ArgumentError"), ([1.0], "ArgumentTypeError")])
def test_free_refuses_the_whole_call_naming_why(pages: list[Any], error: str) -> None:
    from kvmem import PageAllocator

    a = PageAllocator(8)
    a.allocate(3)
    before = (a.refcounts.tolist(), a.tags.tolist(), a.num_free)
    with pytest.raises(KVMemError) as info:
        a.free([0, *pages])  # page 0 is fine: the call is refused whole
    assert type(info.value).__name__ == error
    assert (a.refcounts.tolist(), a.tags.tolist(), a.num_free) == before
    a.check()


@pytest.mark.parametrize("tracker", [None, "checking"])
def test_verify_refuses_unknown_or_repeated_ids_unless_its_tracker_checks_nothing(
        tracker: Any) -> None:
    m = make(tracker=tracker)
    prefill(m, "a", [1, 2, 3, 4, 5])
    for ids in (["a", "ghost"], ["a", "a"]):
        before = state(m)
        if tracker is None:
            assert m.verify(ids).ok_ids == tuple(ids)
        else:
            with pytest.raises(ArgumentError, match=r"ghost|'a' twice"):
                m.verify(ids)
        assert state(m) == before


def test_a_checking_tracker_wider_than_the_table_serves_the_decode_loop() -> None:
    # manager.py: tracker "a CheckingTracker shaped [>= max_seqs, >= max_pages_per_seq]".
    from kvmem import CheckingTracker
    from kvmem.testing import faults

    m = make(num_pages=64, tracker=CheckingTracker(16, 32, paranoid=True))
    ids = ["a", "b", "c"]
    for i, rid in enumerate(ids):
        prefill(m, rid, [i, 2, 3, 4, 5])
    for k in range(6):
        assert m.verify(ids, m.reserve(ids, 1 + k % 3)).ok
        m.commit_batch(ids, [[k] * (1 + k % 3)] * 3)
    faults.free_behind_back(m, "b", 1)
    assert m.verify(ids, m.reserve(ids, 1)).aborted.keys() == {"b"}
    m.check()
