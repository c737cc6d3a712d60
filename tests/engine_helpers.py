"""Requests driven through a ToyEngine, the way many manager tests begin."""

from __future__ import annotations

from typing import Any

from kvmem import KVCacheManager
from kvmem.testing import ToyEngine


def run_prompt(eng: ToyEngine, rid: Any, prompt: list[int], ns: Any = None) -> int:
    """Admit, prefill in one chunk, commit; returns the cached token count."""
    res = eng.admit(rid, prompt, ns)
    eng.step([rid], len(prompt) - res.num_cached_tokens)
    eng.commit([rid])
    return res.num_cached_tokens


def decoding(
        make_manager: Any, num_steps: int = 3, **kw: Any) -> tuple[KVCacheManager, ToyEngine,
                                                                   list[str]]:
    """Five requests (two share a prefix) that decoded and verified a few steps: verify holds
    a proven snapshot and reserve a CSR base."""
    mgr = make_manager(num_pages=64, **kw)
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


def finished_batch(mgr: KVCacheManager) -> list[Any]:
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


def prefill(m: KVCacheManager, rid: Any, prompt: list[int], ns: Any = None) -> int:
    res = m.admit(rid, prompt, namespace=ns)
    m.reserve([rid], len(prompt) - res.num_cached_tokens)
    m.commit(rid, prompt[res.num_cached_tokens:])
    return res.num_cached_tokens


def busy_manager(make_manager: Any) -> KVCacheManager:
    mgr = make_manager(num_pages=64, max_seqs=10, tracker="paranoid")
    for rid, prompt in (("a", list(range(9))), ("b", list(range(9))), ("c", [7] * 5),
                        ("p", [3] * 6)):
        res = mgr.admit(rid, prompt)
        mgr.reserve([rid], len(prompt) - res.num_cached_tokens)
        mgr.commit(rid, prompt[res.num_cached_tokens:])
    mgr.preempt("p")
    mgr.reserve(["a", "c"], 1)  # a decode step reserved: the fast paths' records exist
    return mgr
