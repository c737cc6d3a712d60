"""VllmOrderPrefixCache: vLLM's duplicate handling and eviction order (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from kvmem import (
    ArgumentError,
    ArgumentTypeError,
    ConfigError,
    HashedPrefixCache,
    KVMemError,
)
from kvmem.integrations.vllm import VllmOrderPrefixCache, vllm_import_error
from kvmem.manager import KVCacheManager
from kvmem.testing import ManagerMachine


def _mgr(num_pages: int = 16, page_size: int = 4) -> KVCacheManager:
    return KVCacheManager(num_pages, page_size=page_size, max_seqs=8,
                          prefix_cache=VllmOrderPrefixCache(seed=1), tracker="checking",
                          watermark=0.0, kv_events=True)


def _run(mgr: KVCacheManager, rid: str, tokens: list[int], ns: object = None) -> int:
    """Admit, prefill and commit a whole prompt; returns the cached tokens it reused."""
    res = mgr.admit(rid, np.array(tokens), namespace=ns)
    mgr.reserve([rid], len(tokens) - res.num_cached_tokens)
    mgr.commit(rid, tokens[res.num_cached_tokens:])
    return res.num_cached_tokens


def test_duplicates_are_cached_and_the_first_is_found_first() -> None:
    mgr = _mgr()
    prompt = list(range(10, 19))  # two full pages and one token
    # Both compute the same two pages before either is cached: vLLM caches both copies.
    for rid in ("a", "b"):
        mgr.admit(rid, np.array(prompt))
    for rid in ("a", "b"):
        mgr.reserve([rid], len(prompt))
        mgr.commit(rid, prompt)
    cache = mgr.cache
    assert cache is not None
    assert cache.num_cached == 4
    a_pages, b_pages = mgr.pages_of("a")[:2], mgr.pages_of("b")[:2]
    match = cache.match(np.array(prompt), None, 2)
    assert match.pages.tolist() == a_pages.tolist()
    # Once a's copies are gone, b's still serve the prefix.
    mgr.release("a")
    mgr.release("b")
    evicted, _ = cache.evict(2)
    assert sorted(evicted.tolist()) == sorted(a_pages.tolist())
    assert cache.match(np.array(prompt), None, 2).pages.tolist() == b_pages.tolist()
    mgr.check()


def test_eviction_follows_release_order_deepest_page_first() -> None:
    mgr = _mgr()
    _run(mgr, "a", list(range(100, 109)))
    _run(mgr, "b", list(range(200, 209)))
    a, b = mgr.pages_of("a")[:2].tolist(), mgr.pages_of("b")[:2].tolist()
    mgr.release("b")  # b first: its pages are older in the free queue
    mgr.release("a")
    cache = mgr.cache
    assert cache is not None
    order = [int(cache.evict(1)[0][0]) for _ in range(4)]
    assert order == [b[1], b[0], a[1], a[0]]


def test_a_hit_takes_pages_out_of_the_queue_and_a_release_puts_them_last() -> None:
    mgr = _mgr()
    _run(mgr, "a", list(range(100, 109)))
    _run(mgr, "b", list(range(200, 209)))
    mgr.release("a")
    mgr.release("b")
    cache = mgr.cache
    assert cache is not None
    assert cache.num_evictable == 4
    assert _run(mgr, "a2", list(range(100, 109))) == 8  # hits a's pages
    assert cache.num_evictable == 2
    hit = mgr.pages_of("a2")[:2].tolist()
    mgr.release("a2")
    order = [int(cache.evict(1)[0][0]) for _ in range(4)]
    assert order[2:] == [hit[1], hit[0]]


def test_namespaces_never_share() -> None:
    mgr = _mgr()
    prompt = list(range(10, 19))
    _run(mgr, "a", prompt, ns="tenant-a")
    assert _run(mgr, "b", prompt, ns="tenant-b") == 0
    assert _run(mgr, "c", prompt, ns="tenant-a") == 8


def test_a_bound_cache_cannot_be_bound_again() -> None:
    cache = VllmOrderPrefixCache()
    KVCacheManager(8, page_size=4, max_seqs=2, prefix_cache=cache)
    with pytest.raises(KVMemError):
        KVCacheManager(8, page_size=4, max_seqs=2, prefix_cache=cache)


def test_the_package_imports_without_vllm_and_says_how_to_get_it() -> None:
    error = vllm_import_error()
    assert error is None or "setup_vllm_cpu.sh" in error


class VllmOrderMachine(ManagerMachine):
    """kvmem's whole state machine (forks, copy-on-write, fences, preemption, faults' absence)
    against the vLLM-order cache."""

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_pages=self.num_pages, page_size=self.page_size,
                              max_seqs=self.max_seqs, max_pages_per_seq=self.max_pages_per_seq,
                              prefix_cache=VllmOrderPrefixCache(seed=3), tracker="checking",
                              watermark=0.0)


TestVllmOrderMachine = VllmOrderMachine.TestCase
TestVllmOrderMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_the_package_names_are_exactly_the_intended_ones() -> None:
    import kvmem.integrations.vllm as pkg

    assert set(pkg.__all__) == {
        "VLLM_VERSION", "KVMemAsyncScheduler", "KVMemBlocks", "KVMemScheduler",
        "VllmKVCacheAdapter", "VllmOrderPrefixCache", "check_supported", "vllm_import_error"}
    assert pkg.VLLM_VERSION == "0.33.0"
    if vllm_import_error() is None:  # the lazy names load on first use
        for name in pkg.__all__:
            assert getattr(pkg, name) is not None
    with pytest.raises(AttributeError):
        pkg.NoSuchName  # noqa: B018


@pytest.mark.parametrize("cls", [VllmOrderPrefixCache, HashedPrefixCache])
def test_a_cache_refuses_a_bad_seed_and_a_second_manager(cls: type) -> None:
    for seed, error in (("x", ArgumentTypeError), (1.5, ArgumentTypeError), (True,
                        ArgumentTypeError), (-1, ArgumentError)):
        with pytest.raises(error, match="seed"):
            cls(seed=seed)
    cache = cls(seed=7)
    with pytest.raises(ConfigError, match="not bound"):
        _ = cache.allocator
    KVCacheManager(16, page_size=4, prefix_cache=cache)
    with pytest.raises(ConfigError, match="already bound"):
        KVCacheManager(16, page_size=4, prefix_cache=cache)
    assert cache.allocator.num_pages == 16
