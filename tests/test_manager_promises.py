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
    s = m.stats()
    return {
        "running": m.running, "preempted": m.preempted,
        "tokens": {r: m.num_tokens(r) for r in m.running},
        "committed": {r: m.num_committed(r) for r in m.running},
        "pages": {r: m.pages_of(r).tolist() for r in m.running},
        "refcounts": m.allocator.refcounts.tolist(), "tags": m.allocator.tags.tolist(),
        "table": m.table.pages.tolist(),
        "stats": (s.num_free, s.num_used, s.num_cached, s.num_fenced, s.num_prefix_queries,
                  s.prefix_query_tokens, s.num_integrity_failures, s.num_evictions),
    }


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
