"""Tiers below the device (kvmem.transfer HostTier, DiskTier): real pools, real bundles of pages
written with known K/V, real files and real second processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pool_fixtures import page_bytes

from kvmem import IncompatibleCacheError, PagePool, PoolSpec
from kvmem.allocator._prefix_keys import PrefixKeys
from kvmem.errors import ArgumentError, ConfigError
from kvmem.transfer import CacheIdentity, DiskTier, HostTier, PageBundle, TierStats, tier_keys
from kvmem.transfer._tier import identity_digest, page_of

P = 4  # page size
SHAPE = {"num_layers": 2, "num_pages": 16, "page_size": P, "num_kv_heads": 2, "head_dim": 8,
         "device": "cpu"}
KEYS = PrefixKeys(seed=7, page_size=P)
TOKENS = list(range(100, 100 + 6 * P))  # six full pages
REPO = str(Path(__file__).resolve().parents[1])
FORMATS = [("bf16", None), ("fp8_e4m3", "token_head"), ("fp8_e4m3", "tensor")]


def make_pool(dtype: str = "bf16", scales: str | None = None, **kw: Any) -> PagePool:
    return PagePool(PoolSpec(**{**SHAPE, **kw}, dtype=dtype, scales=scales))


def identity(pool: PagePool, weights: str = "w1") -> CacheIdentity:
    return CacheIdentity.of(pool.spec, "smol", weights)


def fill(pool: PagePool, pages: list[int], seed: int = 0) -> None:
    """Write known K/V (bf16 values, [T, 2, 8] per layer) into every slot of ``pages``."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([p * P + o for p in pages for o in range(P)], dtype=torch.int64)
    for layer in range(pool.spec.num_layers):
        k, v = (torch.randn(len(slots), 2, 8, generator=g).bfloat16() for _ in range(2))
        pool.write(layer, slots, k, v)


def keys_of(tokens: list[int], namespace: Any = None) -> np.ndarray:
    return KEYS.prompt_keys(np.asarray(tokens, dtype=np.int64), KEYS.root(namespace))


def bundle(pool: PagePool, pages: list[int], tokens: list[int], namespace: Any = None,
           weights: str = "w1") -> PageBundle:
    return PageBundle.of(pool, pages, tokens, identity(pool, weights), namespace,
                         keys_of(tokens, namespace))


def loads_bit_exact(src: PagePool, src_pages: list[int], got: PageBundle) -> bool:
    """Write ``got`` into a fresh pool of ``src``'s spec: are the pages ``src``'s, bit for bit?"""
    dst = PagePool(src.spec)
    if dst.static_scales is not None:
        dst.static_scales.copy_(src.static_scales)  # type: ignore[arg-type]
    dst_pages = list(range(3, 3 + got.num_pages))
    got.write_into(dst, dst_pages)
    return all(torch.equal(a, b) for a, b in zip(page_bytes(src, src_pages),
                                                 page_bytes(dst, dst_pages), strict=True))


@pytest.fixture
def written() -> tuple[PagePool, PageBundle]:
    pool = make_pool()
    fill(pool, [2, 5, 7])
    return pool, bundle(pool, [2, 5, 7], TOKENS[: 3 * P])


# -- the tier key ----------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("model", "other"), ("weights", "w2"), ("dtype", "fp8_e4m3"), ("scales", "token_head"),
    ("page_size", 8), ("layout", "HND"), ("format_version", 99)])
def test_the_tier_key_folds_every_identity_field(field: str, value: Any) -> None:
    ident = identity(make_pool())
    keys = keys_of(TOKENS)
    assert set(tier_keys(keys, ident)).isdisjoint(tier_keys(keys, ident.replace(**{field: value})))
    assert tier_keys(keys, ident) == tier_keys(keys.copy(), identity(make_pool()))


def test_the_tier_key_of_another_namespace_differs() -> None:
    ident = identity(make_pool())
    assert set(tier_keys(keys_of(TOKENS, "a"), ident)).isdisjoint(
        tier_keys(keys_of(TOKENS, "b"), ident))


# -- the host tier ---------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "scales"), FORMATS)
def test_the_host_tier_returns_pages_bit_exact(dtype: str, scales: str | None) -> None:
    pool = make_pool(dtype, scales)
    fill(pool, [2, 5, 7], seed=3)
    tier = HostTier(8 * pool.spec.bytes_per_page, identity(pool))
    assert tier.put(bundle(pool, [2, 5, 7], TOKENS[: 3 * P], "t")) == 3
    assert tier.longest_prefix(keys_of(TOKENS, "t")) == 3
    got = tier.get(keys_of(TOKENS, "t"))  # six pages asked, three stored
    assert got is not None and got.num_pages == 3 and got.namespace == "t"
    assert loads_bit_exact(pool, [2, 5, 7], got)
    assert np.array_equal(got.token_ids.reshape(-1), TOKENS[: 3 * P])
    two = tier.get(keys_of(TOKENS[: 2 * P], "t"))
    assert two is not None and loads_bit_exact(pool, [2, 5], two)
    s = tier.stats()
    assert (s.hit_pages, s.miss_pages, s.num_pages) == (5, 3, 3)
    assert s.bytes_stored == 3 * pool.spec.bytes_per_page == s.bytes_used
    assert s.bytes_loaded == 5 * pool.spec.bytes_per_page


def test_the_host_tier_never_hits_another_namespace(written: tuple[PagePool, PageBundle]) -> None:
    pool, b = written
    tier = HostTier(8 * pool.spec.bytes_per_page, identity(pool))
    tier.put(b)
    assert tier.longest_prefix(keys_of(TOKENS, "other")) == 0
    assert tier.get(keys_of(TOKENS, "other")) is None
    assert tier.stats().miss_pages == 6 and tier.stats().hit_pages == 0


@pytest.mark.parametrize("tier_kind", ["host", "disk"])
@pytest.mark.parametrize(("field", "kw"), [("weights", {"weights": "w2"}),
                                           ("layout", {"layout": "HND"}),
                                           ("dtype", {"dtype": "fp8_e4m3",
                                                      "scales": "token_head"})])
def test_a_bundle_of_another_identity_is_refused_naming_the_field(
        tmp_path: Path, tier_kind: str, field: str, kw: dict[str, Any]) -> None:
    mine = make_pool()
    shape = {"dtype": "bf16", "scales": None, **kw}
    weights = shape.pop("weights", "w1")
    theirs = make_pool(**shape)
    fill(theirs, [0, 1])
    tier: HostTier | DiskTier = (HostTier(8 * mine.spec.bytes_per_page, identity(mine))
                                 if tier_kind == "host" else
                                 DiskTier(tmp_path, 1 << 20, identity(mine)))
    with pytest.raises(IncompatibleCacheError) as e:
        tier.put(bundle(theirs, [0, 1], TOKENS[: 2 * P], weights=weights))
    assert e.value.field == field
    assert tier.stats().num_pages == 0 and tier.stats().bytes_stored == 0


def test_a_bundle_without_prefix_keys_is_refused(written: tuple[PagePool, PageBundle]) -> None:
    pool, _ = written
    tier = HostTier(8 * pool.spec.bytes_per_page, identity(pool))
    with pytest.raises(ArgumentError, match="prefix keys"):
        tier.put(PageBundle.of(pool, [2, 5], TOKENS[: 2 * P], identity(pool)))
    with pytest.raises(ArgumentError, match="uint64"):
        tier.get([1, 2])
    assert tier.stats().num_pages == 0


def test_longest_prefix_counts_the_leading_stored_keys_and_checks_them_first(
        tmp_path: Path) -> None:
    """longest_prefix (which hashes only up to the first miss, and nothing in an empty tier)
    equals the count of leading keys whose tier_keys are stored, for every run of asked keys;
    an empty tier still refuses keys that are not [n, 2] uint64."""
    pool = make_pool()
    fill(pool, list(range(6)))
    host = HostTier(16 * pool.spec.bytes_per_page, identity(pool))
    disk = DiskTier(tmp_path, 1 << 24, identity(pool))
    try:
        for tier in (host, disk):
            with pytest.raises(ArgumentError):
                tier.longest_prefix(np.zeros((2, 3), dtype=np.uint64))
            assert tier.longest_prefix(keys_of(TOKENS)) == 0
            # pages 0, 1 and 3 of the six stored (a gap at 2)
            full = bundle(pool, list(range(6)), TOKENS)
            tier.put(page_of(full, 0))
            tier.put(page_of(full, 1))
            tier.put(page_of(full, 3))
            stored = set(tier_keys(keys_of(TOKENS)[[0, 1, 3]], identity(pool)))
            for first in range(6):
                for stop in range(first, 7):
                    asked = keys_of(TOKENS)[first:stop]
                    expected = 0
                    for key in tier_keys(asked, identity(pool)):
                        if key not in stored:
                            break
                        expected += 1
                    assert tier.longest_prefix(asked) == expected, (tier.medium, first, stop)
    finally:
        disk.close()


def test_a_capacity_below_one_page_is_refused() -> None:
    pool = make_pool()
    with pytest.raises(ConfigError, match="holds no page"):
        HostTier(pool.spec.bytes_per_page - 1, identity(pool))


def test_the_host_tier_evicts_lru_by_bytes_keeping_leading_pages() -> None:
    """A run is touched last page first: eviction takes an older run's deepest pages first, so
    what remains of it is still a prefix that can be served."""
    pool = make_pool()
    fill(pool, list(range(6)))
    tier = HostTier(4 * pool.spec.bytes_per_page + 7, identity(pool))
    a, b = TOKENS[: 3 * P], [t + 1000 for t in TOKENS[: 3 * P]]
    tier.put(bundle(pool, [0, 1, 2], a))
    assert tier.put(bundle(pool, [3, 4, 5], b)) == 3
    assert tier.longest_prefix(keys_of(a)) == 1 and tier.longest_prefix(keys_of(b)) == 3
    assert tier.stats().num_evictions == 2 and tier.stats().num_pages == 4
    got = tier.get(keys_of(a))  # a's page 0 is now the most recent: b's page 2 goes next
    assert got is not None and loads_bit_exact(pool, [0], got)
    tier.put(bundle(pool, [0, 1], a[: 2 * P]))
    assert tier.longest_prefix(keys_of(a)) == 2 and tier.longest_prefix(keys_of(b)) == 2


def test_a_bundle_larger_than_the_host_tier_stores_its_leading_pages(
        written: tuple[PagePool, PageBundle]) -> None:
    pool, b = written
    tier = HostTier(2 * pool.spec.bytes_per_page, identity(pool))
    assert tier.put(b) == 2
    assert tier.longest_prefix(keys_of(TOKENS)) == 2
    assert tier.stats().num_dropped_stores == 1 and tier.stats().num_evictions == 0


def test_a_host_page_whose_bytes_changed_is_a_miss_and_ends_the_hit(
        written: tuple[PagePool, PageBundle]) -> None:
    """Guards the digest check on load: a changed byte in the tier's memory never reaches a
    pool; the pages before it are served, the page and those after it are not."""
    pool, b = written
    tier = HostTier(8 * pool.spec.bytes_per_page, identity(pool))
    tier.put(b)
    slot = tier._slot_of[tier_keys(keys_of(TOKENS[: 2 * P]),
                                   identity(pool))[1]]
    tier._slabs["data"][1, slot, 5] ^= 0x40
    got = tier.get(keys_of(TOKENS[: 3 * P]))
    assert got is not None and got.num_pages == 1 and loads_bit_exact(pool, [2], got)
    s = tier.stats()
    assert s.num_digest_failures == 1 and (s.hit_pages, s.miss_pages) == (1, 2)
    assert tier.longest_prefix(keys_of(TOKENS)) == 1  # the bad page is gone


def test_clear_empties_the_host_tier(written: tuple[PagePool, PageBundle]) -> None:
    pool, b = written
    tier = HostTier(8 * pool.spec.bytes_per_page, identity(pool))
    tier.put(b)
    before = tier.stats()
    assert tier.clear() == 3 and tier.get(keys_of(TOKENS)) is None
    assert tier.stats().num_pages == 0 and before.num_pages == 3  # a snapshot, not live
    assert isinstance(before, TierStats)
    assert tier.put(b) == 3  # every slot is free again


# -- the disk tier ---------------------------------------------------------------------------


def files(directory: Path, suffix: str = ".kvb") -> list[Path]:
    return sorted(directory.rglob(f"*{suffix}"))


@pytest.mark.parametrize(("dtype", "scales"), FORMATS)
def test_the_disk_tier_survives_a_restart_bit_exact(tmp_path: Path, dtype: str,
                                                    scales: str | None) -> None:
    pool = make_pool(dtype, scales)
    fill(pool, [2, 5, 7], seed=4)
    tier = DiskTier(tmp_path, 1 << 20, identity(pool))
    assert tier.put(bundle(pool, [2, 5, 7], TOKENS[: 3 * P], ("tenant", 1))) == 3
    assert len(files(tmp_path)) == 3 and not files(tmp_path, ".tmp")
    tier.close()
    again = DiskTier(tmp_path, 1 << 20, identity(pool))
    assert again.longest_prefix(keys_of(TOKENS, ("tenant", 1))) == 3
    assert again.longest_prefix(keys_of(TOKENS, ("tenant", 2))) == 0
    got = again.get(keys_of(TOKENS, ("tenant", 1)))
    assert got is not None and got.num_pages == 3 and got.namespace == ("tenant", 1)
    assert loads_bit_exact(pool, [2, 5, 7], got)
    assert again.stats().bytes_loaded == again.stats().bytes_used


def test_another_identity_ignores_the_disk_pages_and_keeps_them(
        tmp_path: Path, written: tuple[PagePool, PageBundle]) -> None:
    pool, b = written
    tier = DiskTier(tmp_path, 1 << 20, identity(pool))
    tier.put(b)
    tier.close()
    other = DiskTier(tmp_path, 1 << 20, identity(pool, weights="w2"))
    assert other.longest_prefix(keys_of(TOKENS)) == 0 and other.get(keys_of(TOKENS)) is None
    assert other.stats().num_pages == 0 and len(files(tmp_path)) == 3
    other.close()
    back = DiskTier(tmp_path, 1 << 20, identity(pool))
    assert back.longest_prefix(keys_of(TOKENS)) == 3
    assert back.remove_other_identities() == 0
    back.close()
    other = DiskTier(tmp_path, 1 << 20, identity(pool, weights="w2"))
    assert other.remove_other_identities() == 3 and not files(tmp_path)


def test_a_disk_file_of_another_identity_under_this_key_is_an_identity_miss(
        tmp_path: Path, written: tuple[PagePool, PageBundle]) -> None:
    """Guards the check of what a file holds: the name alone never makes a hit."""
    pool, _ = written
    theirs = DiskTier(tmp_path, 1 << 20, identity(pool, weights="w2"))
    theirs.put(bundle(pool, [2, 5, 7], TOKENS[: 3 * P], weights="w2"))
    theirs.close()
    mine_dir = tmp_path / identity_digest(identity(pool)).hex()
    mine_dir.mkdir()
    name = tier_keys(keys_of(TOKENS[:P]), identity(pool))[0].hex()
    shutil.copy(files(theirs.path)[0], mine_dir / f"{name}.kvb")
    mine = DiskTier(tmp_path, 1 << 20, identity(pool))
    assert mine.longest_prefix(keys_of(TOKENS)) == 1  # a file is there; get reads it
    assert mine.get(keys_of(TOKENS)) is None
    assert mine.stats().num_identity_misses == 1 and mine.stats().num_pages == 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "array_name"])
def test_a_truncated_or_corrupted_disk_file_is_a_miss_and_removed(
        tmp_path: Path, written: tuple[PagePool, PageBundle], damage: str) -> None:
    """``array_name`` guards a bug the offload fuzz engine found: a byte flipped in a page
    array's name ("pages.data") passed the digests (they cover the bytes, not the names), the
    page was served as a hit, and joining it to the host tier's pages raised KeyError out of
    ``admit``."""
    pool, b = written
    tier = DiskTier(tmp_path, 1 << 20, identity(pool))
    tier.put(b)
    name = tier_keys(keys_of(TOKENS[: 2 * P]), identity(pool))[1].hex()
    path = tier.path / f"{name}.kvb"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "array_name":
        data[data.index(b"pages.data") + 7] ^= 0x10  # "pages.dqta"
    else:
        data[-40] ^= 1  # a byte of page data
    path.write_bytes(bytes(data))
    got = tier.get(keys_of(TOKENS))
    assert got is not None and got.num_pages == 1 and loads_bit_exact(pool, [2], got)
    assert not path.exists() and tier.stats().num_digest_failures == 1
    assert tier.longest_prefix(keys_of(TOKENS)) == 1 and tier.stats().num_pages == 2


def test_the_disk_tier_evicts_lru_by_bytes_and_keeps_the_order_across_a_restart(
        tmp_path: Path) -> None:
    pool = make_pool()
    fill(pool, list(range(6)))
    a, b = TOKENS[: 3 * P], [t + 1000 for t in TOKENS[: 3 * P]]
    size = len(page_of(bundle(pool, [0, 1, 2], a), 0).to_bytes())
    tier = DiskTier(tmp_path, 4 * size + 7, identity(pool))
    tier.put(bundle(pool, [0, 1, 2], a))
    tier.put(bundle(pool, [3, 4, 5], b))
    assert tier.longest_prefix(keys_of(a)) == 1 and tier.longest_prefix(keys_of(b)) == 3
    assert tier.stats().num_evictions == 2 and len(files(tmp_path)) == 4
    assert tier.get(keys_of(a)) is not None  # a's page 0 is now the most recently used
    tier.close()
    again = DiskTier(tmp_path, 3 * size, identity(pool))  # smaller: evicts the oldest at once
    assert again.longest_prefix(keys_of(a)) == 1 and again.longest_prefix(keys_of(b)) == 2
    assert len(files(tmp_path)) == 3


def test_a_directory_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    ident = identity(make_pool())
    with pytest.raises(ConfigError, match="cannot use"):
        DiskTier(blocker / "tier", 1 << 20, ident)
    assert blocker.read_text() == "not a directory"


CHILD_PRELUDE = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    from test_tier import TOKENS, P, bundle, fill, identity, keys_of, make_pool
    from kvmem.transfer import DiskTier
    pool = make_pool(); fill(pool, [2, 5, 7])
""")


def run_child(body: str, tmp_path: Path, **popen: Any) -> subprocess.Popen[str]:
    code = CHILD_PRELUDE.format(repo=REPO, tests=str(Path(__file__).parent)) + textwrap.dedent(
        body).replace("DIR", repr(str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=env, **popen)


@pytest.mark.parametrize("limit", [0, 900])  # nothing written / a page file cut mid-write
def test_a_failing_write_drops_the_store_and_raises_nothing(tmp_path: Path, limit: int) -> None:
    """A process whose files may not grow past ``limit`` bytes (RLIMIT_FSIZE: the write fails
    with EFBIG, as on a full disk): the store is dropped and counted, no temporary file is left,
    the bundle and the pool are untouched."""
    child = run_child("""
        tier = DiskTier(DIR, 1 << 20, identity(pool))
        b = bundle(pool, [2, 5, 7], TOKENS[: 3 * P])
        before = pool.page_bytes.clone()
        resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_BYTES, MAX_BYTES))
        stored = tier.put(b)
        s = tier.stats()
        print(json.dumps({"stored": stored, "dropped": s.num_dropped_stores,
                          "pages": s.num_pages, "intact": bool((pool.page_bytes == before).all()),
                          "found": tier.longest_prefix(keys_of(TOKENS))}))
    """.replace("MAX_BYTES", str(limit)), tmp_path)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    assert json.loads(out) == {"stored": 0, "dropped": 3, "pages": 0, "intact": True,
                               "found": 0}
    assert not files(tmp_path) and not files(tmp_path, ".tmp")
    tier = DiskTier(tmp_path, 1 << 20, identity(make_pool()))
    assert tier.stats().num_pages == 0


def test_a_second_process_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    child = run_child("""
        tier = DiskTier(DIR, 1 << 20, identity(pool))
        tier.put(bundle(pool, [2, 5, 7], TOKENS[: 3 * P]))
        print("ready", flush=True)
        sys.stdin.readline()
    """, tmp_path, stdin=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError, match=f"in use by another DiskTier \\(process "
                                              f"{child.pid}\\)"):
            DiskTier(tmp_path, 1 << 20, identity(make_pool()))
    finally:
        child.communicate("\n", timeout=60)
    assert child.returncode == 0
    tier = DiskTier(tmp_path, 1 << 20, identity(make_pool()))  # free once the first has gone
    assert tier.longest_prefix(keys_of(TOKENS)) == 3
    with pytest.raises(ConfigError, match="in use"):  # in one process too
        DiskTier(tmp_path, 1 << 20, identity(make_pool()))


def test_clear_removes_this_identitys_files_only(tmp_path: Path,
                                                 written: tuple[PagePool, PageBundle]) -> None:
    pool, b = written
    other = DiskTier(tmp_path, 1 << 20, identity(pool, weights="w2"))
    other.put(bundle(pool, [2], TOKENS[:P], weights="w2"))
    other.close()
    tier = DiskTier(tmp_path, 1 << 20, identity(pool))
    tier.put(b)
    assert tier.clear() == 3 and tier.get(keys_of(TOKENS)) is None
    assert len(files(tmp_path)) == 1 and tier.stats().bytes_used == 0
