"""A KVCacheManager with a host tier (``offload=HostTier(...)``): evicted prefix pages stored, and
loaded back on admission. Real PagePool, real manager, real tier; the engine's K/V is a
deterministic function of (namespace, prefix) so recomputed and loaded pages can be compared."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import pytest
import torch

from kvmem import IncompatibleCacheError, PagePool, PoolSpec
from kvmem.allocator import keys_as_ints
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError, KVMemError
from kvmem.manager import AllPagesCleared, KVCacheManager, PagesRemoved, PagesStored
from kvmem.transfer import CacheIdentity, DiskTier, HostTier, OffloadConfig, tier_keys

P = 4
SHAPE = {"num_layers": 2, "page_size": P, "num_kv_heads": 2, "head_dim": 8, "device": "cpu"}
FORMATS = [("bf16", None), ("fp16", None), ("fp8_e4m3", "token_head"), ("fp8_e4m3", "tensor"),
           ("fp8_e5m2", "head")]


def make_pool(num_pages: int = 8, dtype: str = "bf16", scales: str | None = None) -> PagePool:
    return PagePool(PoolSpec(**SHAPE, num_pages=num_pages, dtype=dtype, scales=scales))


def identity(pool: PagePool, weights: str = "w1") -> CacheIdentity:
    return CacheIdentity.of(pool.spec, "smol", weights)


def make_manager(pool: PagePool, tier_pages: int | None = 64, **kw: Any) -> KVCacheManager:
    """A manager over ``pool`` (a host tier of ``tier_pages`` pages, or none; ``offload=``
    in ``kw`` replaces it)."""
    tier = None if tier_pages is None else HostTier(tier_pages * pool.spec.bytes_per_page,
                                                      identity(pool))
    tier = kw.pop("offload", tier)
    kw = {"max_seqs": 3, "tracker": "checking", "kv_events": True, **kw}
    return KVCacheManager(pool.spec.num_pages, P, pool=pool, offload=tier, **kw)


def kv(namespace: Any, prefix: list[int]) -> torch.Tensor:
    """The K and V of the last token of ``prefix`` in every layer: ``[L, 2, 2, 8]`` bf16, a
    function of (namespace, prefix) only, as a model's would be."""
    seed = int.from_bytes(hashlib.sha256(repr((namespace, prefix)).encode()).digest()[:6], "big")
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE["num_layers"], 2, 2, 8, generator=g).bfloat16()


def prefill(mgr: KVCacheManager, rid: Any, prompt: list[int], namespace: Any = None) -> Any:
    """Admit (landing a deferred load first), write the K/V of the tokens not cached,
    commit; check() after."""
    res = mgr.admit(rid, prompt, namespace)
    start = res.num_cached_tokens
    if res.loading:
        assert mgr.is_loading(rid)
        start = mgr.land_copies()[rid]
        assert not mgr.is_loading(rid)
    step = mgr.reserve([rid], len(prompt) - start)
    assert not mgr.verify([rid], step).aborted
    values = torch.stack([kv(namespace, prompt[: i + 1]) for i in range(start, len(prompt))])
    slots = torch.as_tensor(step.slot_mapping)
    for layer in range(SHAPE["num_layers"]):
        mgr.pool.write(layer, slots, values[:, layer, 0], values[:, layer, 1])
    mgr.commit(rid, prompt[start:])
    mgr.check()
    return res


def page_bytes(pool: PagePool, pages: Any) -> list[torch.Tensor]:
    """Every byte of ``pages`` (data, and token scales where the pool has them)."""
    ids = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    out = [pool.page_bytes.index_select(1, ids)]
    if pool.token_scales is not None:
        out.append(pool.token_scales.index_select(1, ids))
    return out


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


A = list(range(100, 113))  # 13 tokens: 3 full pages and one token
B = list(range(200, 229))  # 29 tokens: 8 pages, the whole pool


def evict_a(mgr: KVCacheManager, namespace: Any = None) -> list[torch.Tensor]:
    """Prefill A, release it, then B (which takes every page, evicting A's): A's full pages'
    bytes before they left the device."""
    prefill(mgr, "a", A, namespace)
    before = page_bytes(mgr.pool, mgr.pages_of("a")[:3])
    mgr.release("a")
    mgr.land_copies()  # (deferred write-through stores hold A's pages until they land)
    prefill(mgr, "b", B)
    mgr.release("b")
    mgr.check()
    assert mgr.match_prefix(A, namespace).num_pages == 0  # gone from the device
    return before


@pytest.mark.parametrize(("dtype", "scales"), FORMATS)
def test_an_evicted_prefix_comes_back_from_the_host_tier_bit_exact(dtype: str,
                                                                   scales: str | None) -> None:
    pool = make_pool(dtype=dtype, scales=scales)
    mgr = make_manager(pool)
    before = evict_a(mgr, "t")
    stats = mgr.stats().offload
    assert stats is not None and stats.stored_pages >= 3 and stats.tier.num_pages >= 3
    assert mgr.match_prefix(A, "t").num_offloaded == 3
    res = prefill(mgr, "a2", A, "t")
    assert (res.num_cached_tokens, res.num_hit_pages, res.num_host_pages) == (12, 0, 3)
    assert same_bytes(page_bytes(pool, mgr.pages_of("a2")[:3]), before)
    assert mgr.tokens_of("a2").tolist() == A
    # The loaded pages are committed device pages now: a third request hits them on the device.
    mgr.release("a2")
    res = mgr.admit("a3", A, "t")
    assert (res.num_hit_pages, res.num_host_pages) == (3, 0)
    after = mgr.stats().offload
    assert after is not None and (after.loaded_pages, after.load_misses) == (3, 0)
    mgr.check()


def test_eviction_and_load_report_kv_events_per_medium() -> None:
    pool = make_pool()
    mgr = make_manager(pool, tier_pages=3)
    mgr.take_events()
    evict_a(mgr)
    events = mgr.take_events()
    keys = mgr.cache.prompt_keys(np.asarray(A), None, 3)
    a_hashes = set(keys_as_ints(keys))
    cpu = [e for e in events if isinstance(e, PagesStored) and e.medium == "CPU"]
    assert a_hashes <= {h for e in cpu for h in e.page_hashes}
    assert all(e.parent_page_hash is None and len(e.token_ids) == P * len(e.page_hashes)
               for e in cpu)
    # Filling the 3-page tier with B's pages pushed A's out: removed from the CPU medium.
    prefill(mgr, "c", list(range(300, 329)))
    removed = [h for e in mgr.take_events() if isinstance(e, PagesRemoved) and e.medium == "CPU"
               for h in e.page_hashes]
    assert removed


def test_a_corrupted_host_page_is_recomputed_never_loaded() -> None:
    """Guards the digest check on load: a stored page whose bytes changed ends the hit at that
    page; the request recomputes it and ends with the right bytes."""
    pool = make_pool()
    mgr = make_manager(pool)
    before = evict_a(mgr)
    tier = mgr.offload.tiers[0]  # type: ignore[union-attr]
    key = tier_keys(mgr.cache.prompt_keys(np.asarray(A), None, 3), tier.identity)[1]
    tier._slabs["data"][0, tier._slot_of[key], 5] ^= 0x40  # page 1 of A's run
    res = prefill(mgr, "a2", A)
    assert (res.num_cached_tokens, res.num_host_pages) == (P, 1)
    assert same_bytes(page_bytes(pool, mgr.pages_of("a2")[:3]), before)
    stats = mgr.stats().offload
    assert stats is not None
    assert (stats.tier.num_digest_failures, stats.load_misses, stats.loaded_pages) == (1, 2, 1)


def test_another_namespace_never_hits_the_host_tier() -> None:
    pool = make_pool()
    mgr = make_manager(pool)
    evict_a(mgr, "t")
    assert mgr.match_prefix(A, "u").num_offloaded == 0
    res = prefill(mgr, "a2", A, "u")
    assert (res.num_cached_tokens, res.num_host_pages) == (0, 0)
    assert mgr.match_prefix(A, "t").num_offloaded == 3  # still there for its own namespace


def test_a_tier_of_another_identity_is_refused_naming_the_field() -> None:
    pool = make_pool()
    for other, field in ((make_pool(dtype="fp8_e4m3", scales="token_head"), "dtype"),
                         (PagePool(PoolSpec(**{**SHAPE, "page_size": 8}, num_pages=8)),
                          "page_size")):
        tier = HostTier(1 << 20, identity(other))
        with pytest.raises(IncompatibleCacheError) as e:
            KVCacheManager(8, P, pool=pool, offload=tier)
        assert e.value.field == field


def test_a_tier_needs_a_pool_a_prefix_cache_and_its_own_manager(tmp_path: Any) -> None:
    pool = make_pool()
    tier = HostTier(1 << 20, identity(pool))
    with pytest.raises(ConfigError, match="pool"):
        KVCacheManager(8, P, offload=tier)
    with pytest.raises(ConfigError, match="prefix cache"):
        KVCacheManager(8, P, pool=pool, prefix_cache=None, offload=tier)
    disk = DiskTier(tmp_path, 1 << 20, identity(pool))
    with pytest.raises(ArgumentTypeError, match="HostTier"):
        KVCacheManager(8, P, pool=pool, offload="host")
    with pytest.raises(ConfigError, match="in that order"):
        KVCacheManager(8, P, pool=pool, offload=(disk, tier))
    with pytest.raises(ArgumentError, match="write="):
        KVCacheManager(8, P, pool=pool, offload=OffloadConfig((tier,), write="later"))
    with pytest.raises(ArgumentError, match="copies="):
        KVCacheManager(8, P, pool=pool, offload=OffloadConfig((tier,), copies="async"))
    for rate, error in ((True, ArgumentTypeError), ("fast", ArgumentTypeError),
                        (0, ArgumentError), (-1.0, ArgumentError), (float("nan"), ArgumentError),
                        (float("inf"), ArgumentError)):
        with pytest.raises(error, match="prefill_tokens_per_s"):
            OffloadConfig((tier,), prefill_tokens_per_s=rate)
    assert tier.on_removed is None and disk.on_removed is None  # (refusals bound nothing)
    KVCacheManager(8, P, pool=pool, offload=tier)
    with pytest.raises(ConfigError, match="already serves"):
        KVCacheManager(8, P, pool=make_pool(), offload=tier)


def test_clear_prefix_cache_clears_the_host_tier() -> None:
    pool = make_pool()
    mgr = make_manager(pool)
    evict_a(mgr)
    mgr.take_events()
    mgr.clear_prefix_cache()
    stats = mgr.stats().offload
    assert stats is not None and stats.tier.num_pages == 0
    assert AllPagesCleared("CPU") in mgr.take_events()
    res = prefill(mgr, "a2", A)
    assert (res.num_cached_tokens, res.num_host_pages) == (0, 0)


def test_a_refused_admission_changes_neither_the_manager_nor_the_tier() -> None:
    pool = make_pool()
    mgr = make_manager(pool, max_seqs=2)
    evict_a(mgr)
    for rid in ("x", "y"):
        mgr.admit(rid, [7, 8])
    tier_before, stats_before = mgr.offload.tiers[0].stats(), mgr.stats()  # type: ignore[union-attr]
    with pytest.raises(KVMemError, match="rows"):
        mgr.admit("a2", A)
    assert mgr.offload.tiers[0].stats() == tier_before  # type: ignore[union-attr]
    assert mgr.stats() == stats_before
    mgr.check()


def tiers(pool: PagePool, config: str, directory: Any, host_pages: int = 16) -> Any:
    """The offload of a named configuration: host, disk, host+disk (a host tier too small
    for the workload: its evictions go to disk), write-through, deferred copies."""
    host = HostTier(host_pages * pool.spec.bytes_per_page, identity(pool))
    if config == "disk":
        return DiskTier(directory, 1 << 24, identity(pool))
    if config == "host+disk":
        return (HostTier(3 * pool.spec.bytes_per_page, identity(pool)),
                DiskTier(directory, 1 << 24, identity(pool)))
    if config == "through":
        return OffloadConfig((host,), write="through")
    if config == "deferred":
        return OffloadConfig((host,), write="through", copies="deferred")
    return host


CONFIGS = ["host", "disk", "host+disk", "through", "deferred"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_workload_fills_the_same_pages_with_and_without_a_tier(
        seed: int, config: str, tmp_path: Any) -> None:
    """Prompts that share prefixes, in two namespaces, through a 10-page pool: every admitted
    prompt's full pages hold the same bytes whether a tier (each configuration) served part
    of its prefix or the engine recomputed it; and the tiers did serve some."""
    rng = random.Random(seed)
    bases = [[rng.randrange(1000) for _ in range(5 * P)] for _ in range(3)]
    prompts = []
    for _ in range(40):
        base = rng.choice(bases)
        prompts.append((base[: rng.randrange(1, len(base))]
                        + [rng.randrange(1000) for _ in range(rng.randrange(4))],
                        rng.choice([None, "x"]), rng.random() < 0.3))
    contents = []
    for tiered in (True, False):
        pool = make_pool(num_pages=10)
        mgr = make_manager(pool, None, offload=tiers(pool, config, tmp_path) if tiered else None)
        running: list[str] = []
        seen = []
        for i, (prompt, namespace, keep) in enumerate(prompts):
            mgr.land_copies()  # (an engine's step; a no-op unless copies are deferred)
            while running and not mgr.can_admit(prompt, namespace):
                mgr.release(running.pop(0))
            prefill(mgr, i, prompt, namespace)
            seen.append(page_bytes(pool, mgr.pages_of(i)[: len(prompt) // P]))
            if keep:
                running.append(i)  # type: ignore[arg-type]
            else:
                mgr.release(i)
            mgr.check()
        contents.append((seen, mgr.stats().offload))
    (with_tier, stats), (without, _) = contents
    assert all(same_bytes(a, b) for a, b in zip(with_tier, without, strict=True))
    assert stats is not None and stats.loaded_pages > 0


def test_pages_stored_under_other_static_scales_are_recomputed() -> None:
    """Guards the static-scale confirmation on load: an fp8 pool whose tensor scales changed
    after a store must not read the stored bytes through the new scales."""
    pool = make_pool(dtype="fp8_e4m3", scales="tensor")
    mgr = make_manager(pool)
    evict_a(mgr)
    pool.static_scales.mul_(2)  # type: ignore[union-attr]
    res = prefill(mgr, "a2", A)
    assert (res.num_cached_tokens, res.num_host_pages) == (0, 0)
    stats = mgr.stats().offload
    assert stats is not None and (stats.load_misses, stats.loaded_pages) == (3, 0)


def test_the_host_tiers_evictions_go_to_disk_and_come_back_bit_exact(tmp_path: Any) -> None:
    pool = make_pool()
    mgr = make_manager(pool, None, offload=tiers(pool, "host+disk", tmp_path))
    before = evict_a(mgr)  # A's 3 pages fill the 3-page host tier
    mgr.take_events()
    prefill(mgr, "c", list(range(300, 329)))  # evicts B's pages: the host tier sends A's down
    mgr.release("c")
    events = mgr.take_events()
    a_hashes = set(keys_as_ints(mgr.cache.prompt_keys(np.asarray(A), None, 3)))
    stored_on_disk = {h for e in events if isinstance(e, PagesStored) and e.medium == "DISK"
                      for h in e.page_hashes}
    removed_from_host = {h for e in events if isinstance(e, PagesRemoved) and e.medium == "CPU"
                         for h in e.page_hashes}
    assert a_hashes <= stored_on_disk and a_hashes <= removed_from_host
    res = prefill(mgr, "a2", A)
    assert (res.num_cached_tokens, res.num_host_pages, res.num_disk_pages) == (12, 0, 3)
    assert same_bytes(page_bytes(pool, mgr.pages_of("a2")[:3]), before)
    stats = mgr.stats().offload
    assert stats is not None and stats.loaded_by_medium == {"CPU": 0, "DISK": 3}
    assert [t.medium for t in stats.tiers] == ["CPU", "DISK"]
    mgr.take_events()
    mgr.clear_prefix_cache()
    cleared = [e for e in mgr.take_events() if isinstance(e, AllPagesCleared)]
    assert {e.medium for e in cleared} == {"GPU", "CPU", "DISK"}
    assert all(t.num_pages == 0 for t in mgr.stats().offload.tiers)  # type: ignore[union-attr]


def test_a_disk_tier_serves_a_restarted_manager_of_its_identity_only(tmp_path: Any) -> None:
    pool = make_pool()
    disk = DiskTier(tmp_path, 1 << 24, identity(pool))
    before = evict_a(make_manager(pool, None, offload=disk))
    disk.close()  # the process ends
    for weights, hits in (("w2", 0), ("w1", 3)):
        pool2 = make_pool()
        disk2 = DiskTier(tmp_path, 1 << 24, identity(pool2, weights))
        mgr = make_manager(pool2, None, offload=disk2)
        res = prefill(mgr, "a", A)
        assert res.num_disk_pages == hits
        assert same_bytes(page_bytes(pool2, mgr.pages_of("a")[:3]), before)
        disk2.close()


def test_write_through_stores_at_commit_and_an_eviction_stores_nothing_twice() -> None:
    pool = make_pool()
    mgr = make_manager(pool, None, offload=tiers(pool, "through", None))
    prefill(mgr, "a", A)
    stats = mgr.stats().offload
    assert stats is not None and (stats.stored_pages, stats.tier.num_pages) == (3, 3)
    before = page_bytes(pool, mgr.pages_of("a")[:3])
    mgr.release("a")
    prefill(mgr, "b", B)  # evicts A's pages: stored already
    mgr.release("b")
    stats = mgr.stats().offload
    assert stats is not None and stats.tier.bytes_stored == (3 + 7) * pool.spec.bytes_per_page
    res = prefill(mgr, "a2", A)
    assert res.num_host_pages == 3
    assert same_bytes(page_bytes(pool, mgr.pages_of("a2")[:3]), before)


def deferred_manager(pool: PagePool, **kw: Any) -> KVCacheManager:
    return make_manager(pool, None, offload=tiers(pool, "deferred", None), **kw)


def test_a_deferred_load_lands_before_its_request_may_run() -> None:
    """Guards the landing marks: a request scheduled before its load landed is aborted by
    verify (the rest of the batch proceeds); after land_copies its tokens are committed and its
    pages hold the stored bytes."""
    pool = make_pool()
    mgr = deferred_manager(pool)
    before = evict_a(mgr)
    mgr.land_copies()
    mgr.admit("other", [1, 2, 3])
    res = mgr.admit("early", A)
    assert res.loading and res.num_host_pages == 3 and mgr.is_loading("early")
    mgr.reserve(["other", "early"], [1, 1])
    report = mgr.verify(["other", "early"])
    assert list(report.aborted) == ["early"] and "landed" in report.aborted["early"]
    res = mgr.admit("fork-me", A)
    with pytest.raises(ArgumentError, match="land_copies"):
        mgr.fork("fork-me", "child")  # (the child would share pages not landed yet)
    mgr.release("fork-me")
    assert not mgr.is_loading("early")
    mgr.check()
    assert mgr.land_copies() == {}  # the aborted request's load ended unwritten
    res = mgr.admit("a2", A)
    assert res.loading and mgr.num_committed("a2") == 0
    assert mgr.land_copies() == {"a2": 12}
    assert mgr.num_committed("a2") == 12
    assert same_bytes(page_bytes(pool, mgr.pages_of("a2")[:3]), before)
    assert mgr.verify(["a2"]).ok
    mgr.check()


def test_a_released_requests_pending_load_keeps_its_pages_until_it_lands() -> None:
    """Guards the load's lease: the destination pages are not reused while the copy may still
    write them, whoever releases the request; nothing leaks once it lands."""
    pool = make_pool()
    mgr = deferred_manager(pool)
    evict_a(mgr)
    mgr.land_copies()
    mgr.admit("a2", A)
    dest = mgr.pages_of("a2")[:3].tolist()
    mgr.release("a2")
    free_while_pending = mgr.stats().num_free
    mgr.admit("x", list(range(500, 500 + P * free_while_pending)))  # every free page
    assert not set(dest) & set(mgr.pages_of("x").tolist())
    mgr.release("x")
    assert mgr.land_copies() == {}
    mgr.check()
    assert mgr.stats().num_free > free_while_pending


def test_a_reset_during_a_pending_load_cancels_it_and_the_request_recomputes() -> None:
    pool = make_pool()
    mgr = deferred_manager(pool)
    evict_a(mgr)
    mgr.land_copies()
    res = mgr.admit("a2", A)
    assert res.loading
    mgr.clear_prefix_cache()  # new weights: the tier's bytes are stale
    assert mgr.land_copies() == {"a2": 0}
    assert mgr.num_tokens("a2") == 0 and mgr.stats().offload.cancelled_loads == 1  # type: ignore[union-attr]
    step = mgr.reserve(["a2"], len(A))
    assert mgr.verify(["a2"], step).ok
    mgr.commit("a2", A)
    mgr.check()


def test_a_deferred_store_holds_its_pages_until_it_lands_and_a_reset_drops_it() -> None:
    pool = make_pool()
    mgr = deferred_manager(pool)
    prefill(mgr, "a", A)
    mgr.release("a")
    stats = mgr.stats().offload
    assert stats is not None and (stats.pending_stores, stats.tier.num_pages) == (1, 0)
    assert not mgr.can_admit(B)  # A's pages are leased by the store: not evictable
    mgr.land_copies()
    stats = mgr.stats().offload
    assert stats is not None and (stats.pending_stores, stats.tier.num_pages) == (0, 3)
    assert mgr.can_admit(B)
    prefill(mgr, "b", B[:9])
    mgr.clear_prefix_cache()
    stats = mgr.stats().offload
    assert stats is not None and (stats.pending_stores, stats.tier.num_pages) == (0, 0)
    mgr.land_copies()
    assert mgr.stats().offload.tier.num_pages == 0  # type: ignore[union-attr]
    mgr.check()


def test_a_tier_hit_is_recomputed_when_that_is_estimated_faster() -> None:
    pool = make_pool()
    mgr = make_manager(pool, offload=OffloadConfig(
        (HostTier(64 * pool.spec.bytes_per_page, identity(pool)),), prefill_tokens_per_s=1e9))
    evict_a(mgr)
    offload = mgr.offload
    assert offload is not None
    assert prefill(mgr, "a1", A).num_host_pages == 3  # the tier's bandwidth unknown: loaded
    offload.bandwidth["CPU"].value = 1.0  # a byte a second: recomputing wins
    mgr.release("a1")
    mgr.clear_prefix_cache()
    evict_a(mgr)
    res = prefill(mgr, "a2", A)
    assert (res.num_cached_tokens, res.num_host_pages) == (0, 0)
    stats = mgr.stats().offload
    assert stats is not None and (stats.chose_load, stats.chose_recompute) == (3, 3)
    offload.prefill_rate.value = 1e-6  # now the engine prefills a token in 11 days
    mgr.release("a2")
    mgr.clear_prefix_cache()
    evict_a(mgr)
    assert prefill(mgr, "a3", A).num_host_pages == 3


def test_a_store_the_disk_cannot_take_is_dropped_with_an_event_and_loses_nothing(
        tmp_path: Any) -> None:
    """A disk tier too small for one page file (as a full disk): every store is dropped, an
    ``offload_drop`` event says so, the device pages and the manager are whole, and the prompt
    is recomputed."""
    pool = make_pool()
    mgr = make_manager(pool, None, offload=DiskTier(tmp_path, 100, identity(pool)))
    drops: list[Any] = []
    mgr.add_hook("offload_drop", lambda e: drops.append(e.detail))
    evict_a(mgr)
    assert ("DISK", 3) in drops
    stats = mgr.stats().offload
    assert stats is not None and stats.tier.num_dropped_stores >= 3 and stats.stored_pages == 0
    res = prefill(mgr, "a2", A)
    assert (res.num_cached_tokens, res.num_disk_pages) == (0, 0)
    mgr.check()


def expected_bytes(pool: PagePool, namespace: Any, tokens: list[int]) -> list[torch.Tensor]:
    """The bytes of ``tokens``' full pages as a fresh pool holds them after a prefill."""
    fresh = make_pool(num_pages=len(tokens) // P + 1)
    values = torch.stack([kv(namespace, tokens[: i + 1]) for i in range(len(tokens))])
    slots = torch.arange(len(tokens))
    for layer in range(SHAPE["num_layers"]):
        fresh.write(layer, slots, values[:, layer, 0], values[:, layer, 1])
    return page_bytes(fresh, list(range(len(tokens) // P)))


@pytest.mark.parametrize("seed", range(6))
def test_deferred_copies_under_random_releases_preemptions_and_resets(seed: int,
                                                                     tmp_path: Any) -> None:
    """Random admissions (shared prefixes, two namespaces), steps for the requests that are
    ready, releases and preemptions (also before a load landed), resumes, resets and landings,
    on an 8-page pool and a write-through host tier of 4 pages over disk, deferred copies:
    ``check()`` holds after every call, ``verify`` never aborts a request the engine only
    scheduled once ready, and every prefilled request's full pages hold the K/V of its own
    prefix."""
    rng = random.Random(seed)
    pool = make_pool(num_pages=8)
    host = HostTier(4 * pool.spec.bytes_per_page, identity(pool))
    disk = DiskTier(tmp_path, 1 << 24, identity(pool))
    mgr = make_manager(pool, None, max_seqs=3, offload=OffloadConfig(
        (host, disk), write="through", copies="deferred"))
    bases = [[rng.randrange(1000) for _ in range(4 * P)] for _ in range(4)]
    state: dict[Any, tuple[list[int], Any]] = {}  # running: (prompt, namespace)
    ready: set[Any] = set()
    preempted: list[Any] = []
    for i in range(300):
        if rng.random() < 0.6:  # an engine's step lands what is pending (not always first)
            for rid, done in mgr.land_copies().items():
                assert done == mgr.num_committed(rid)
                ready.add(rid)
        op = rng.random()
        if op < 0.3 and len(state) < 3:
            ns = rng.choice([None, "x"])
            prompt = [*rng.choice(bases)[: rng.randrange(P, 4 * P)], rng.randrange(1000)]
            if mgr.can_admit(prompt, ns):
                res = mgr.admit(i, prompt, ns)
                state[i] = (prompt, ns)
                if not res.loading:
                    ready.add(i)
        elif op < 0.6 and ready:
            rid = rng.choice(sorted(ready, key=str))
            prompt, ns = state[rid]
            start = mgr.num_tokens(rid)
            if start < len(prompt) and mgr.can_reserve([rid], len(prompt) - start):
                step = mgr.reserve([rid], len(prompt) - start)
                assert mgr.verify([rid], step).ok
                values = torch.stack([kv(ns, prompt[: j + 1]) for j in range(start, len(prompt))])
                slots = torch.as_tensor(step.slot_mapping)
                for layer in range(SHAPE["num_layers"]):
                    pool.write(layer, slots, values[:, layer, 0], values[:, layer, 1])
                mgr.commit(rid, prompt[start:])
                full = len(prompt) // P
                assert same_bytes(page_bytes(pool, mgr.pages_of(rid)[:full]),
                                  expected_bytes(pool, ns, prompt[: full * P]))
        elif op < 0.8 and state:
            rid = rng.choice(sorted(state, key=str))
            mgr.release(rid)
            del state[rid]
            ready.discard(rid)
        elif op < 0.86 and state:
            rid = rng.choice(sorted(state, key=str))
            mgr.preempt(rid)
            preempted.append((rid, state.pop(rid)))
            ready.discard(rid)
        elif op < 0.93 and preempted and len(state) < 3:
            rid, (prompt, ns) = preempted[0]
            if mgr.can_resume(rid):
                preempted.pop(0)
                res = mgr.resume(rid)
                state[rid] = (prompt, ns)
                if not res.loading:
                    ready.add(rid)
        elif op < 0.935:
            mgr.clear_prefix_cache()
        mgr.check()
    stats = mgr.stats().offload
    assert stats is not None and stats.loaded_pages > 0  # (the tiers did serve)
    mgr.land_copies()
    for rid in list(state):
        mgr.release(rid)
    mgr.check()
    assert mgr.stats().num_used == 0
