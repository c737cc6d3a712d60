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
