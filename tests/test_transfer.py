"""Pages that move (kvmem.transfer): identity, bundles, descriptors, the message, leases, and a
sender and a receiver (real managers and pools) over the in-process transport."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from pool_fixtures import page_bytes

from kvmem import IncompatibleCacheError, IntegrityError, KVCacheManager, PagePool, PoolSpec
from kvmem.errors import ArgumentError
from kvmem.transfer import (
    CacheIdentity,
    InProcessHub,
    InProcessTransport,
    PageBundle,
    Receiver,
    Region,
    Sender,
    TransferMessage,
    gather_pages,
    page_descs,
    page_digests,
    paired_descs,
)
from kvmem.transfer._bundle import pool_page_digests, static_scales_of
from kvmem.transfer._message import answer_bytes, confirm_bytes

P = 4  # page size
SHAPE = {"num_layers": 2, "num_pages": 24, "page_size": P, "num_kv_heads": 2, "head_dim": 8,
         "device": "cpu"}


@dataclass
class Side:
    manager: KVCacheManager
    pool: PagePool
    transport: InProcessTransport
    identity: CacheIdentity


def side(hub: InProcessHub, name: str, dtype: str = "bf16", scales: str | None = None,
         **kw: Any) -> Side:
    spec = PoolSpec(**{**SHAPE, **kw}, dtype=dtype, scales=scales)
    pool = PagePool(spec)
    m = KVCacheManager(spec.num_pages, page_size=P, max_seqs=8, max_pages_per_seq=8, pool=pool,
                       tracker="checking")
    return Side(m, pool, InProcessTransport(name, hub), CacheIdentity.of(spec, "smol", "w1"))


def pair(sender_dtype: str = "bf16", receiver_dtype: str = "bf16", sender_scales: str | None = None,
         receiver_scales: str | None = None, policy: str = "recompute", lease: float = 10.0,
         staging_pages: int | None = None) -> tuple[Side, Side, Sender, Receiver]:
    hub = InProcessHub()
    s = side(hub, "prefill", sender_dtype, sender_scales)
    r = side(hub, "decode", receiver_dtype, receiver_scales)
    s.transport.add_peer(r.transport.metadata())
    r.transport.add_peer(s.transport.metadata())
    return (s, r, Sender(s.manager, s.pool, s.transport, s.identity, lease_seconds=lease),
            Receiver(r.manager, r.pool, r.transport, r.identity, policy=policy,  # type: ignore[arg-type]
                     staging_pages=staging_pages))  # type: ignore[arg-type]


def kv(num_tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v), each [T, 2, 8] bfloat16 values (exact in every pool dtype's input);
    token t's values depend on the seed and t only."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, 2, 8, generator=g).bfloat16()[:num_tokens],
             torch.randn(64, 2, 8, generator=g).bfloat16()[:num_tokens]) for _ in range(2)]


def prefill(s: Side, rid: Any, prompt: list[int], seed: int = 0) -> None:
    """Admit, write every prompt token's K/V through the pool, commit."""
    res = s.manager.admit(rid, prompt)
    n = len(prompt) - res.num_cached_tokens
    step = s.manager.reserve([rid], n)
    for layer, (k, v) in enumerate(kv(len(prompt), seed)):
        s.pool.write(layer, step.slot_mapping, k[-n:], v[-n:])
    s.manager.commit(rid, prompt[-n:])


def same_pages(a: PagePool, pa: Any, b: PagePool, pb: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(page_bytes(a, pa), page_bytes(b, pb),
                                                 strict=True))


def send(s: Side, sender: Sender, rid: Any, now: float = 0.0) -> str:
    offer = sender.export(rid, now)
    s.transport.notify("decode", offer)
    return TransferMessage.from_bytes(offer).transfer_id


PROMPT = list(range(100, 111))  # 11 tokens: 2 full pages and a tail of 3


def check_both(s: Side, r: Side) -> None:
    s.manager.check()
    r.manager.check()


# -- identity --------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("model", "other"), ("weights", "w2"),
                                              ("page_size", 8), ("num_layers", 3),
                                              ("num_kv_heads", 4), ("format_version", 99)])
def test_an_identity_mismatch_is_refused_naming_the_field(field: str, value: Any) -> None:
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    msg = TransferMessage.from_bytes(sender.export("a", 0.0))
    bad = TransferMessage(**{**msg.__dict__, "identity": msg.identity.replace(**{field: value})})
    before = r.manager.stats()
    with pytest.raises(IncompatibleCacheError) as e:
        receiver.receive(bad, 0.0)
    assert e.value.field == field and field in str(e.value)
    assert r.manager.stats() == before and r.manager.running == ()


@pytest.mark.parametrize("change", [{"dtype": "fp8_e4m3", "scales": "tensor"},
                                    {"layout": "HND"}])
def test_a_different_dtype_scale_mode_or_layout_is_no_mismatch(change: dict[str, Any]) -> None:
    spec = PoolSpec(**SHAPE)
    mine = CacheIdentity.of(spec, "smol", "w1")
    other = mine.replace(**change)
    mine.check(other)  # silent
    assert not mine.same_storage(other) and mine.same_storage(mine)


def test_identity_refuses_bad_names() -> None:
    with pytest.raises(ArgumentError):
        CacheIdentity.of(PoolSpec(**SHAPE), "", "w")


# -- descriptors -----------------------------------------------------------------------------


def test_adjacent_pages_of_a_layer_merge_into_one_descriptor() -> None:
    region = Region(1000, num_layers=2, num_pages=8, page_nbytes=64, device=0)
    pages = [0, 1, 2, 5]
    unmerged = page_descs(region, pages, merge=False)
    merged = page_descs(region, pages)
    assert unmerged.shape == (8, 3) and merged.shape == (4, 3)
    assert merged[:, 1].tolist() == [192, 64, 192, 64]
    assert merged[2, 0] == 1000 + 8 * 64  # layer 1 page 0
    assert merged[:, 1].sum() == unmerged[:, 1].sum()
    every = page_descs(region, range(8))  # the whole tensor is one byte range
    assert every.tolist() == [[1000, 2 * 8 * 64, 0]]


def test_paired_descriptors_merge_only_where_both_sides_are_contiguous() -> None:
    src = Region(0, 2, 8, 64, 0)
    dst = Region(10_000, 2, 8, 64, 0)
    s, d = paired_descs(src, [0, 1, 2], dst, [3, 4, 7])
    assert s.shape == d.shape == (4, 3)  # per layer: [0-1 -> 3-4], [2 -> 7]
    assert (s[:, 1] == d[:, 1]).all() and s[:, 1].tolist() == [128, 64, 128, 64]
    s1, _d1 = paired_descs(src, [0, 1, 2], dst, [3, 4, 7], merge=False)
    assert s1.shape == (6, 3)
    with pytest.raises(ArgumentError):
        paired_descs(src, [0, 1], dst, [3])


def _bytes_at(descs: np.ndarray) -> bytes:
    return b"".join(ctypes.string_at(int(a), int(n)) for a, n, _ in descs)


@pytest.mark.parametrize("merge", [True, False])
def test_descriptors_name_the_pages_bytes_layer_major(merge: bool) -> None:
    """Against a real pool-shaped tensor (bf16 ``[L, P, page_size, 2, heads, dim]``): the
    descriptors' bytes, read in order, are the pages' bytes in every layer, layer-major."""
    t = torch.randn(3, 16, 4, 2, 2, 8, generator=torch.Generator().manual_seed(0)
                    ).to(torch.bfloat16)
    region = Region.of(t)
    assert region.page_nbytes == 4 * 2 * 2 * 8 * 2
    ids = np.array([3, 4, 5, 9, 0])
    descs = page_descs(region, ids, merge=merge)
    assert descs.dtype == np.int64 and descs.shape == (3 * (3 if merge else 5), 3)
    assert _bytes_at(descs) == t[:, ids].contiguous().view(torch.uint8).numpy().tobytes()
    assert (descs[:, 2] == 0).all()


def test_paired_descriptors_copy_the_source_pages_onto_the_destination_pages() -> None:
    """A byte-level read with paired rows (memmove row by row) lands every source page on its
    destination page and touches no other page."""
    gen = torch.Generator().manual_seed(1)
    src_t = torch.randint(0, 256, (2, 16, 64), dtype=torch.uint8, generator=gen)
    dst_t = torch.zeros_like(src_t)
    src_ids, dst_ids = np.array([0, 1, 2, 3, 15]), np.array([5, 6, 9, 10, 0])
    s, d = paired_descs(Region.of(src_t), src_ids, Region.of(dst_t), dst_ids)
    assert len(s) == 2 * 3  # per layer: [0-1 -> 5-6], [2-3 -> 9-10], [15 -> 0]
    for (sa, n, _), (da, dn, _) in zip(s.tolist(), d.tolist(), strict=True):
        assert n == dn
        ctypes.memmove(da, sa, n)
    assert torch.equal(dst_t[:, dst_ids], src_t[:, src_ids])
    others = np.setdiff1d(np.arange(16), dst_ids)
    assert not dst_t[:, others].any()


def test_pages_outside_the_region_and_strided_tensors_are_refused() -> None:
    t = torch.zeros(2, 16, 64, dtype=torch.uint8)
    region = Region.of(t)
    for bad in ([16], [-1], [0, 16]):
        with pytest.raises(ArgumentError, match=r"out of the region's 0\.\.15"):
            page_descs(region, bad)
        with pytest.raises(ArgumentError, match="out of the region"):
            paired_descs(region, [0] * len(bad), region, bad)
    with pytest.raises(ArgumentError, match="contiguous"):
        Region.of(t[:, ::2])  # pages of a layer not back to back
    with pytest.raises(ArgumentError, match="contiguous"):
        Region.of(torch.zeros(16))


# -- bundles and the message -----------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "scales"), [("bf16", None), ("fp8_e4m3", "token_head"),
                                               ("fp8_e4m3", "tensor")])
def test_a_bundle_round_trips_through_bytes_and_loads_bit_for_bit(dtype: str,
                                                                  scales: str | None) -> None:
    hub = InProcessHub()
    s = side(hub, "a", dtype, scales)
    prefill(s, "a", PROMPT)
    pages = s.manager.pages_of("a")[:2]
    bundle = PageBundle.of(s.pool, pages, PROMPT[:8], s.identity, ("tenant", 1))
    back = PageBundle.from_bytes(bundle.to_bytes())
    assert back.digest == bundle.digest and back.namespace == ("tenant", 1)
    assert back.identity == s.identity and np.array_equal(back.token_ids, bundle.token_ids)
    other = PagePool(s.pool.spec)
    if other.static_scales is not None:
        other.static_scales.copy_(s.pool.static_scales)  # type: ignore[arg-type]
    back.write_into(other, [5, 9])
    assert same_pages(s.pool, pages, other, [5, 9])


def _random_pool(dtype: str, scales: str | None, device: str = "cpu") -> PagePool:
    pool = PagePool(PoolSpec(**{**SHAPE, "device": device}, dtype=dtype, scales=scales))
    g = torch.Generator().manual_seed(3)
    for t in (pool.data, pool.token_scales):
        if t is not None:
            u8 = t.view(torch.uint8)
            u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g))
    return pool


@pytest.mark.parametrize(("dtype", "scales"), [("bf16", None), ("fp8_e4m3", "token_head"),
                                               ("fp8_e4m3", "tensor")])
def test_pool_page_digests_equal_the_digests_of_the_gathered_pages(dtype: str,
                                                                   scales: str | None) -> None:
    """pool_page_digests (hashed in place, the sender's and receiver's fast path) agrees with
    page_digests over gather_pages (a bundle's), and each digest covers every layer of its
    page only: a byte changed in the last layer of one page changes that page's digest."""
    pool = _random_pool(dtype, scales)
    pages = np.array([5, 0, 6, 7])
    tokens = np.arange(16, dtype=np.int64).reshape(4, P)
    static = static_scales_of(pool)
    plain = page_digests(gather_pages(pool, pages), tokens, static)
    fast = pool_page_digests(pool, pages, tokens, static)
    assert np.array_equal(fast, plain) and len({bytes(d) for d in fast}) == 4
    pool.data.view(torch.uint8)[-1, 6].view(-1)[-1] ^= 1
    changed = pool_page_digests(pool, pages, tokens, static)
    assert (changed != fast).any(axis=1).tolist() == [False, False, True, False]
    assert np.array_equal(changed, page_digests(gather_pages(pool, pages), tokens, static))


def test_page_digests_keep_their_format() -> None:
    """The digest is part of the wire and bundle format (FORMAT_VERSION 2): the first 16 bytes
    of SHA-256 over a domain prefix, a page's data in every layer, then its token scales in
    every layer, the static scales and its token ids (little-endian int64). Built here from
    hashlib directly, and pinned."""
    import hashlib

    pool = _random_pool("fp8_e4m3", "token_head")
    pages, tokens = [5, 0, 6], np.arange(12, dtype=np.int64).reshape(3, P)
    got = gather_pages(pool, pages)
    want = []
    for i in range(3):
        h = hashlib.sha256(b"kvmem page digest v2\0")
        for name in ("data", "token_scales"):
            for layer in got[name]:
                h.update(layer[i].tobytes())
        h.update(tokens[i].astype("<i8").tobytes())
        want.append(h.hexdigest()[:32])
    assert want == PINNED_DIGESTS
    for digests in (page_digests(got, tokens, None), pool_page_digests(pool, pages, tokens, None)):
        assert [d.tobytes().hex() for d in digests] == want


PINNED_DIGESTS = ["05495e6ac75c077de198ecbd456eab49", "4a3ec76163c966d42583f40d5f735ffa",
                  "a3958fb66c1163aa8261038934b7f775"]


def test_a_corrupted_bundle_is_refused() -> None:
    s = side(InProcessHub(), "a")
    prefill(s, "a", PROMPT)
    data = bytearray(PageBundle.of(s.pool, s.manager.pages_of("a")[:2], PROMPT[:8],
                                   s.identity).to_bytes())
    data[-200] ^= 1  # a byte of page data
    with pytest.raises(IntegrityError, match="digest"):
        PageBundle.from_bytes(bytes(data))
    with pytest.raises(ArgumentError):
        PageBundle.from_bytes(b"not a bundle")


def test_the_message_round_trips_and_refuses_malformed_bytes() -> None:
    s, _r, sender, _receiver = pair()
    prefill(s, 7, PROMPT)
    offer = sender.export(7, 5.0)
    msg = TransferMessage.from_bytes(offer)
    assert msg.request_id == 7 and msg.lease_expiry == 15.0
    assert msg.num_pages == 2 and msg.token_ids.tolist() == PROMPT
    assert np.array_equal(msg.tags, s.manager.allocator.tags[s.manager.pages_of(7)[:2]])
    assert TransferMessage.from_bytes(msg.to_bytes()).transfer_id == msg.transfer_id
    for bad in (offer[:-3], b"KVMW" + offer[4:30], answer_bytes("x", True)):
        with pytest.raises(ArgumentError):
            TransferMessage.from_bytes(bad)


# -- a whole transfer ------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "scales"), [("bf16", None), ("fp32", None),
                                               ("fp8_e4m3", "token_head")])
def test_a_transfer_of_the_same_dtype_copies_pages_and_scales(dtype: str,
                                                               scales: str | None) -> None:
    s, r, sender, receiver = pair(dtype, dtype, scales, scales)
    prefill(s, "a", PROMPT)
    tid = send(s, sender, "a")
    assert receiver.poll(0.0) == [] and receiver.loading == ("a",)
    assert sender.poll(0.1) == [(tid, True)]
    (res,) = receiver.poll(0.2)
    assert (res.status, res.num_computed_tokens) == ("loaded", 8) and receiver.loading == ()
    assert r.manager.num_committed("a") == 8 and r.manager.tokens_of("a").tolist() == PROMPT[:8]
    assert same_pages(s.pool, s.manager.pages_of("a")[:2], r.pool, r.manager.pages_of("a")[:2])
    # the receiver's prefix cache holds the loaded pages now
    assert r.manager.match_prefix(PROMPT).num_pages == 2
    assert sender.open_transfers == () and receiver.counts["ignored"] == 0
    # what moved: both pages of every layer (one descriptor per layer and tensor, the pages
    # being adjacent on both sides), scales with them
    per_page = sum(t[:, 0].nbytes for t in (s.pool.data, s.pool.token_scales) if t is not None)
    assert receiver.counts["bytes_read"] == 2 * per_page
    assert receiver.counts["descriptors"] == s.pool.spec.num_layers * (
        1 if s.pool.token_scales is None else 2)
    check_both(s, r)


@pytest.mark.parametrize("scales", ["token_head", "tensor"])
def test_bf16_to_fp8_pages_equal_a_direct_fp8_write(scales: str) -> None:
    """The receiver's fp8 pages are bit-identical to writing the same K/V straight into an fp8
    pool (the same tokens in one write per layer: tensor scales calibrate on it alike)."""
    s, r, sender, receiver = pair("bf16", "fp8_e4m3", None, scales)
    prefill(s, "a", PROMPT, seed=3)
    send(s, sender, "a")
    receiver.poll(0.0)
    sender.poll(0.0)
    (res,) = receiver.poll(0.0)
    assert res.status == "loaded"
    dst = r.manager.pages_of("a")[:2]
    direct = PagePool(r.pool.spec)
    slots = torch.as_tensor((dst.astype(np.int64)[:, None] * P + np.arange(P)).reshape(-1))
    for layer, (k, v) in enumerate(kv(len(PROMPT), 3)):
        direct.write(layer, slots, k[:8], v[:8])
    assert same_pages(direct, dst, r.pool, dst)
    if scales == "tensor":
        assert torch.equal(direct.static_scales, r.pool.static_scales)  # type: ignore[arg-type]
    check_both(s, r)


def test_fp8_to_bf16_pages_hold_the_dequantized_values() -> None:
    s, r, sender, receiver = pair("fp8_e4m3", "bf16", "token_head", None)
    prefill(s, "a", PROMPT)
    send(s, sender, "a")
    receiver.poll(0.0)
    sender.poll(0.0)
    assert receiver.poll(0.0)[0].status == "loaded"
    for layer in range(2):
        a = s.pool.read(layer, s.manager.pages_of("a")[:2], torch.float32)
        b = r.pool.read(layer, r.manager.pages_of("a")[:2], torch.float32)
        assert torch.equal(a[0].bfloat16().float(), b[0])


def test_a_converting_load_waits_for_staging_pages() -> None:
    s, r, sender, receiver = pair("bf16", "fp8_e4m3", None, "token_head", staging_pages=2)
    prefill(s, "a", PROMPT, seed=1)
    prefill(s, "b", list(range(200, 211)), seed=2)
    r.transport.hold_reads = True
    send(s, sender, "a")
    send(s, sender, "b")
    receiver.poll(0.0)
    assert len(r.transport.pending) == 1 and receiver.loading == ("a", "b")  # "b" waits
    r.transport.complete(r.transport.pending[0])
    receiver.poll(0.0)
    sender.poll(0.0)
    assert [x.status for x in receiver.poll(0.0)] == ["loaded"]
    assert len(r.transport.pending) == 1  # "b" took the staging pages "a" gave back
    r.transport.complete(r.transport.pending[0])
    receiver.poll(0.0)
    sender.poll(0.0)
    assert [x.request_id for x in receiver.poll(0.0)] == ["b"]
    check_both(s, r)


def test_a_load_larger_than_the_staging_pool_is_refused_changing_nothing() -> None:
    s, r, sender, receiver = pair("bf16", "fp8_e4m3", None, "token_head", staging_pages=1)
    prefill(s, "a", PROMPT)
    before = r.manager.stats()
    with pytest.raises(ArgumentError, match="staging"):
        receiver.receive(sender.export("a", 0.0), 0.0)
    assert r.manager.stats() == before and receiver.loading == ()
    r.manager.check()


# -- leases, aborts, stale and late notices --------------------------------------------------


@pytest.mark.parametrize("reuse", [False, True])
def test_an_expired_lease_makes_the_request_recompute(reuse: bool) -> None:
    """After expiry the confirm is stale even if the bytes were intact (reuse=False: the
    sender cannot tell); if the pages were reused meanwhile (True), the digest fails first."""
    s, r, sender, receiver = pair(lease=5.0)
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    send(s, sender, "a")
    s.manager.release("a")  # the request is gone on the sender: its pages are leased only
    s.manager.clear_prefix_cache()
    free_before = s.manager.allocator.num_free
    receiver.poll(0.0)
    assert sender.poll(6.0) == [] and sender.counts["expired"] == 1
    assert s.manager.allocator.num_free == free_before + 2  # the lease let go of its pages
    if reuse:
        prefill(s, "b", list(range(500, 511)), seed=9)
    r.transport.complete(r.transport.pending[0])
    results = receiver.poll(6.0)
    answered = sender.poll(6.0)
    results += receiver.poll(6.0)
    (res,) = results
    assert (res.status, res.num_computed_tokens) == ("recompute", 0)
    assert ("digest" if reuse else "stale") in res.reason
    assert answered[0][1] is False and sender.counts["stale"] == 1
    assert r.manager.num_committed("a") == 0 and r.manager.match_prefix(PROMPT).num_pages == 0
    check_both(s, r)


def test_a_confirm_within_the_lease_is_not_stale() -> None:
    s, _r, sender, receiver = pair(lease=5.0)
    prefill(s, "a", PROMPT)
    send(s, sender, "a")
    receiver.poll(0.0)
    assert sender.poll(4.9) == [("prefill:1", True)]
    assert sender.counts["stale"] == sender.counts["expired"] == 0


def test_a_page_freed_behind_the_lease_makes_the_transfer_stale() -> None:
    """A bug that frees a leased page (here: straight through the allocator) is caught by the
    tags at confirm: the receiver never commits those bytes."""
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    send(s, sender, "a")
    receiver.poll(0.0)
    page = int(s.manager.pages_of("a")[1])
    s.manager.release("a")
    s.manager.clear_prefix_cache()
    s.manager.allocator.free([page])  # the fault: the lease's reference dropped behind its back
    r.transport.complete(r.transport.pending[0])
    receiver.poll(0.0)
    assert sender.poll(0.0)[0][1] is False and sender.counts["stale"] == 1
    assert receiver.poll(0.0)[0].status == "recompute"


def test_the_sender_may_release_the_request_mid_transfer() -> None:
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    leased = s.manager.pages_of("a")[:2].copy()
    want = page_bytes(s.pool, leased)
    r.transport.hold_reads = True
    send(s, sender, "a")
    receiver.poll(0.0)
    s.manager.release("a")
    s.manager.clear_prefix_cache()
    fill = s.manager.allocator.num_free * P - 1
    prefill(s, "big", list(range(1000, 1000 + min(fill, 8 * P - 1))), seed=5)
    assert not np.isin(leased, s.manager.pages_of("big")).any()  # never reused while leased
    r.transport.complete(r.transport.pending[0])
    receiver.poll(0.0)
    sender.poll(0.0)
    assert receiver.poll(0.0)[0].status == "loaded"
    assert all(torch.equal(a, b) for a, b in zip(want, page_bytes(r.pool,
                                                                  r.manager.pages_of("a")[:2])))
    assert s.manager.allocator.refcounts[leased].tolist() == [0, 0]  # the lease ended
    check_both(s, r)


def test_a_receiver_abort_keeps_destination_pages_until_the_read_is_final() -> None:
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    send(s, sender, "a")
    receiver.poll(0.0)
    dst = r.manager.pages_of("a")[:2].copy()
    receiver.abort("a")
    assert "a" not in r.manager.running and receiver.loading == ()
    assert (r.manager.allocator.refcounts[dst] == 1).all()  # the lease alone holds them
    others = []
    while r.manager.allocator.num_free:
        others.append(f"o{len(others)}")
        r.manager.admit(others[-1], list(range(min(r.manager.allocator.num_free, 8) * P)))
        assert not np.isin(dst, r.manager.pages_of(others[-1])).any()
    r.manager.release_batch(others)
    r.transport.complete(r.transport.pending[0])  # the late write lands in fenced pages
    assert receiver.poll(0.0) == [] and (r.manager.allocator.refcounts[dst] == 0).all()
    assert sender.poll(0.0)[0][1] is True  # the read did complete: the sender's lease ends
    assert receiver.poll(0.0) == [] and receiver.counts["ignored"] == 1  # its late answer
    check_both(s, r)


def test_duplicate_and_late_notices_are_ignored() -> None:
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    tid = send(s, sender, "a")
    receiver.poll(0.0)
    sender.poll(0.0)
    receiver.poll(0.0)
    pages, committed = r.manager.pages_of("a"), r.manager.num_committed("a")
    s.transport.notify("decode", answer_bytes(tid, False, "late"))
    s.transport.notify("decode", answer_bytes(tid, True))
    s.transport.notify("decode", b"garbage")
    assert receiver.poll(1.0) == [] and receiver.counts["ignored"] == 3
    assert np.array_equal(r.manager.pages_of("a"), pages) and r.manager.num_committed("a") == (
        committed)
    r.transport.notify("prefill", confirm_bytes(tid, np.array([1, 2])))  # a duplicate confirm
    assert sender.poll(1.0) == [(tid, False)] and sender.counts["confirmed"] == 1
    check_both(s, r)


@pytest.mark.parametrize("when", ["reading", "loaded", "released"])
def test_a_duplicated_offer_is_ignored(when: str) -> None:
    """Guards a bug: a duplicated offer notice was refused as "already being received" (or, once
    loaded, "request id known here"), which declined the transfer to the sender and reported
    the running request "failed"; while the read was pending the decline ended the sender's
    lease, so the live load's own confirm was answered stale and it fell back. And one: a copy
    arriving after its request was released here admitted the finished request again."""
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = r.transport.hold_notices = True
    offer = sender.export("a", 0.0)
    s.transport.notify("decode", offer)
    r.transport.duplicate(0)  # the offer arrives, and again later
    assert receiver.poll(0.0) == [] and receiver.loading == ("a",)
    if when in ("loaded", "released"):
        r.transport.complete(r.transport.pending[0])
        receiver.poll(0.0)
        sender.poll(0.0)
        r.transport.deliver(1)  # the sender's answer
        assert [x.status for x in receiver.poll(0.0)] == ["loaded"]
    if when == "released":  # the request finished here before the copy arrived
        r.manager.release("a")
    r.transport.deliver(0)  # the duplicate
    assert receiver.poll(0.0) == [] and receiver.counts["ignored"] == 1
    if when == "released":
        assert "a" not in r.manager.running and receiver.loading == ()
        with pytest.raises(ArgumentError, match="already been received"):
            receiver.receive(offer, 0.0)  # nor is it received when handed over directly
        check_both(s, r)
        return
    assert sender.poll(0.0) == [] and sender.counts["declined"] == 0
    if when == "reading":
        r.transport.hold_notices = False
        r.transport.complete(r.transport.pending[0])
        receiver.poll(0.0)
        assert sender.poll(0.0)[0][1] is True
        assert [x.status for x in receiver.poll(0.0)] == ["loaded"]
    assert r.manager.num_committed("a") == 8 and receiver.counts["failed"] == 0
    check_both(s, r)


def test_a_failed_read_recomputes_correctly_beside_shared_prefix_pages() -> None:
    """A failed load never touches pages another request shares (vllm#49250): the receiver
    already holds the first page under request "c"; "a" hits it, its read of the second page
    fails, it recomputes from the hit, and ends with the sender's bytes; "c"'s page unchanged."""
    s, r, sender, receiver = pair()
    prompt = PROMPT + [7] * 5  # 16 tokens: 3 full pages offered (len - 1 limits hits to 3)
    prefill(s, "a", prompt, seed=4)
    prefill(r, "c", [*prompt[:4], 1], seed=4)  # same first page's tokens and K/V
    shared = int(r.manager.pages_of("c")[0])
    before = page_bytes(r.pool, [shared])
    r.transport.hold_reads = True
    send(s, sender, "a")
    receiver.poll(0.0)
    assert r.manager.pages_of("a")[0] == shared
    r.transport.complete(r.transport.pending[0], ok=False)
    (res,) = receiver.poll(0.0)
    assert (res.status, res.num_computed_tokens) == ("recompute", 4)
    assert all(torch.equal(a, b) for a, b in zip(before, page_bytes(r.pool, [shared])))
    step = r.manager.reserve(["a"], len(prompt) - 4)  # the engine recomputes the rest
    for layer, (k, v) in enumerate(kv(len(prompt), 4)):
        r.pool.write(layer, step.slot_mapping, k[4:], v[4:])
    r.manager.commit("a", prompt[4:])
    assert same_pages(s.pool, s.manager.pages_of("a")[:3], r.pool, r.manager.pages_of("a")[:3])
    assert r.manager.verify(["a", "c"]).aborted == {}
    sender.poll(100.0)  # no confirm came: the lease expires
    check_both(s, r)


def test_the_fail_policy_releases_the_request() -> None:
    s, r, sender, receiver = pair(policy="fail")
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    send(s, sender, "a")
    receiver.poll(0.0)
    r.transport.complete(r.transport.pending[0], ok=False)
    assert receiver.poll(0.0)[0].status == "failed" and "a" not in r.manager.running
    assert r.manager.allocator.num_free == r.manager.num_pages
    check_both(s, r)


def test_a_killed_sender_makes_its_request_fall_back() -> None:
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    send(s, sender, "a")
    receiver.poll(0.0)
    s.transport.close()
    r.transport.complete(r.transport.pending[0])
    assert receiver.poll(0.0)[0].status == "recompute"
    r.manager.check()


def test_bytes_that_differ_from_the_digest_fall_back() -> None:
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    send(s, sender, "a")
    receiver.poll(0.0)
    s.pool.data[1, int(s.manager.pages_of("a")[1])] += 1  # a write into a leased page (a bug)
    r.transport.complete(r.transport.pending[0])
    (res,) = receiver.poll(0.0)
    assert res.status == "recompute" and "digest" in res.reason
    assert r.manager.num_committed("a") == 0


def test_no_answer_within_the_timeout_falls_back() -> None:
    s, _r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    send(s, sender, "a")
    receiver.poll(0.0)
    assert receiver.poll(29.0) == []  # the sender has not polled: no answer yet
    assert receiver.poll(31.0)[0].reason == "the sender did not answer"


def test_an_offer_of_pages_the_receiver_holds_needs_no_read() -> None:
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT[:9])
    prefill(r, "c", [*PROMPT, 2])
    send(s, sender, "a")
    (res,) = receiver.poll(0.0)
    assert (res.status, res.num_computed_tokens) == ("loaded", 8)
    sender.poll(0.0)
    assert sender.counts["declined"] == 1 and sender.open_transfers == ()
    check_both(s, r)


# -- the lease mechanism ---------------------------------------------------------------------


def test_a_lease_ends_once_and_waits_for_a_step_in_flight() -> None:
    m = KVCacheManager(8, page_size=P, max_seqs=2, max_pages_per_seq=4)
    m.admit("a", list(range(9)))
    lease = m.lease("a", 0, 2)
    m.release("a")
    h = m.begin_step()
    assert m.end_lease(lease) is True
    assert m.allocator.num_free == 6  # held by the step in flight
    m.retire(h)
    assert m.allocator.num_free == 8
    with pytest.raises(ArgumentError, match="ended already"):
        m.end_lease(lease)
    m.check()


# -- a seeded campaign -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_check_holds_on_both_sides_after_a_random_campaign(seed: int) -> None:
    """Random prefills, exports, sender releases, reads completing or failing late, receiver
    aborts and releases, lease expiries: after every move check() holds on both managers;
    every load that ends "loaded" holds the bytes the sender's pages had at export (same dtype
    seeds); at the end nothing is leaked."""
    rng = np.random.default_rng(seed)
    fp8 = seed % 2 == 1
    s, r, sender, receiver = pair(receiver_dtype="fp8_e4m3" if fp8 else "bf16",
                                  receiver_scales="token_head" if fp8 else None, lease=6.0)
    r.transport.hold_reads = True
    now, statuses = 0.0, []
    exported: dict[Any, list[torch.Tensor]] = {}
    for i in range(80):
        now += float(rng.uniform(0, 1.0))
        move = int(rng.integers(8))
        running = list(s.manager.running)
        if move < 2 and len(running) < 4:
            prompt = [int(rng.integers(3))] * 4 + [int(t) for t in
                                                   rng.integers(0, 50, int(rng.integers(2, 14)))]
            if s.manager.can_admit(prompt):
                prefill(s, f"q{i}", prompt, seed=i)
        elif move == 2 and running:
            rid = running[int(rng.integers(len(running)))]
            if rid not in r.manager.running and r.manager.can_admit(s.manager.tokens_of(rid)):
                n = s.manager.num_committed(rid) // P
                exported[rid] = page_bytes(s.pool, s.manager.pages_of(rid)[:n])
                s.transport.notify("decode", sender.export(rid, now))
            s.manager.release(rid)
        elif move in (3, 4) and r.transport.pending:
            h = r.transport.pending[int(rng.integers(len(r.transport.pending)))]
            r.transport.complete(h, ok=bool(rng.integers(5)))
        elif move == 5 and receiver.loading and rng.integers(2):
            receiver.abort(receiver.loading[int(rng.integers(len(receiver.loading)))])
        elif move == 6:
            done = [x for x in r.manager.running if x not in receiver.loading]
            if done:
                r.manager.release(done[0])
        for res in receiver.poll(now):
            statuses.append(res.status)
            if res.status == "loaded" and not fp8:
                n = res.num_computed_tokens // P
                assert all(torch.equal(a, b) for a, b in zip(
                    exported[res.request_id], page_bytes(r.pool, r.manager.pages_of(
                        res.request_id)[:n]), strict=True))
        sender.poll(now)
        check_both(s, r)
    for _ in range(4):  # drain: every read final (a waiting load starts its own), every lease over
        for h in r.transport.pending:
            r.transport.complete(h)
        statuses += [x.status for x in receiver.poll(now + 100)]
        sender.poll(now + 100)
    assert receiver.loading == () and sender.open_transfers == ()
    for m in (s.manager, r.manager):
        m.release_batch(m.running)
        m.clear_prefix_cache()
        m.check()
        assert m.allocator.num_free == m.num_pages  # nothing leaked
    assert "loaded" in statuses and "recompute" in statuses  # the campaign took both ways


def test_receive_returns_what_it_admitted_and_the_read_it_started() -> None:
    s, r, sender, receiver = pair()
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    got = receiver.receive(sender.export("a", 0.0), 0.0)
    assert got.admitted.num_cached_tokens == 0 and got.admitted.num_pages == 3
    assert np.array_equal(got.pages, r.manager.pages_of("a")[:2])
    assert r.transport.pending == [got.handle]
    prefill(s, "b", PROMPT)
    prefill(r, "c", PROMPT)  # every offered page hits: nothing to read
    got = receiver.receive(sender.export("b", 0.0), 0.0)
    assert got.admitted.num_cached_tokens == 8 and got.pages.size == 0 and got.handle is None


def test_held_notices_are_delivered_lost_or_duplicated_on_demand() -> None:
    hub = InProcessHub()
    a, b = InProcessTransport("a", hub), InProcessTransport("b", hub)
    a.add_peer(b.metadata())
    b.hold_notices = True
    for m in (b"one", b"two", b"three"):
        a.notify("b", m)
    assert b.notices() == [] and [m for _, m in b.in_flight] == [b"one", b"two", b"three"]
    b.drop(1)
    b.duplicate(1)
    b.deliver(0)
    assert b.notices() == [("a", b"three"), ("a", b"one")]
    assert b.in_flight == [("a", b"three")]
    with pytest.raises(ArgumentError, match="no notice 1"):
        b.deliver(1)
    assert b.in_flight == [("a", b"three")]


def _held_load(lease: float = 10.0) -> tuple[Side, Side, Sender, Receiver]:
    """"a" prefilled and offered, its read held; the sender released it (the lease alone holds
    its pages)."""
    s, r, sender, receiver = pair(lease=lease)
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    receiver.receive(sender.export("a", 0.0), 0.0)
    s.manager.release("a")
    s.manager.clear_prefix_cache()
    return s, r, sender, receiver


def test_fault_switch_lease_pages_off_sends_page_ids_with_no_lifetime() -> None:
    """The stale-reference fault: no lease holds the offered pages, and a confirm of pages
    freed under the read is answered "ok"."""
    s, r, sender, receiver = pair()
    sender.faults.lease_pages = False
    prefill(s, "a", PROMPT)
    r.transport.hold_reads = True
    receiver.receive(sender.export("a", 0.0), 0.0)
    assert s.manager.fences.leases == ()
    s.manager.release("a")
    s.manager.clear_prefix_cache()
    assert s.manager.allocator.num_free == s.manager.num_pages  # freed under the read
    r.transport.complete(r.transport.pending[0])
    receiver.poll(0.0)
    assert sender.poll(0.0)[0][1] is True
    assert receiver.poll(0.0)[0].status == "loaded"


def test_fault_switch_end_lease_once_off_ends_a_lease_on_every_confirm() -> None:
    """The duplicated-completion fault: the second confirm of one transfer ends its lease
    again, which kvmem refuses."""
    s, _r, sender, receiver = pair()
    sender.faults.end_lease_once = False
    prefill(s, "a", PROMPT)
    s.transport.hold_notices = True
    receiver.receive(sender.export("a", 0.0), 0.0)
    s.transport.duplicate(0)
    assert sender.poll(0.0)[0][1] is True
    s.transport.deliver(0)
    with pytest.raises(ArgumentError, match="ended already"):
        sender.poll(0.0)


def test_fault_switch_expire_leases_off_strands_a_lease_whose_confirm_was_lost() -> None:
    s, _r, sender, receiver = pair(lease=5.0)
    prefill(s, "a", PROMPT)
    s.transport.hold_notices = True
    receiver.receive(sender.export("a", 0.0), 0.0)
    s.transport.drop(0)  # the confirm is lost
    sender.faults.expire_leases = False
    sender.poll(100.0)
    assert len(s.manager.fences.leases) == 1 and sender.counts["expired"] == 0
    sender.faults.expire_leases = True
    sender.poll(100.0)
    assert s.manager.fences.leases == () and sender.counts["expired"] == 1


def test_fault_switch_hold_until_final_off_frees_destinations_at_the_abort() -> None:
    """The late-write fault: an abort gives the destination pages back while the read that
    fills them is pending."""
    _s, r, _sender, receiver = _held_load()
    dst = r.manager.pages_of("a")[:2].copy()
    receiver.faults.hold_until_final = False
    receiver.abort("a")
    assert (r.manager.allocator.refcounts[dst] == 0).all() and r.transport.pending


def test_fault_switch_wait_for_answer_off_loads_bytes_of_an_expired_lease() -> None:
    """The lease-expiry fault: the lease ended before the read completed (its pages were free
    to reuse), the bytes still match their digests, and the load commits without the sender's
    "stale"."""
    s, r, sender, receiver = _held_load(lease=5.0)
    receiver.faults.wait_for_answer = False
    sender.poll(6.0)
    assert s.manager.fences.leases == ()
    r.transport.complete(r.transport.pending[0])
    assert receiver.poll(6.0)[0].status == "loaded" and r.manager.num_committed("a") == 8


def test_fault_switch_fail_failed_reads_off_commits_a_failed_read() -> None:
    """The killed-sender fault: the read failed (no byte moved) and the load commits."""
    s, r, _sender, receiver = _held_load()
    receiver.faults.fail_failed_reads = False
    s.transport.close()
    (handle,) = r.transport.pending
    r.transport.complete(handle)
    assert r.transport.state(handle) == "failed"
    assert receiver.poll(0.0)[0].status == "loaded" and r.manager.num_committed("a") == 8


def test_fault_switch_commit_checked_only_off_caches_a_failed_load() -> None:
    """The recompute-with-shared-pages fault: the failed load's pages enter the prefix cache
    and the request is released; admitting it again hits them."""
    _s, r, _sender, receiver = _held_load()
    receiver.faults.commit_checked_only = False
    r.transport.complete(r.transport.pending[0], ok=False)
    (res,) = receiver.poll(0.0)
    assert (res.status, res.num_computed_tokens) == ("recompute", 0)
    assert "a" not in r.manager.running and r.manager.match_prefix(PROMPT).num_pages == 2


def test_the_transfer_room_does_not_import_the_manager() -> None:
    code = ("import sys\nimport kvmem.transfer\n"
            "assert 'kvmem.manager' not in sys.modules, 'kvmem.transfer imported the manager'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_transfer_room_exports_exactly_its_public_names() -> None:
    import kvmem.transfer

    assert set(kvmem.transfer.__all__) == {
        "FORMAT_VERSION", "CacheIdentity", "DiskTier", "HostTier",
        "InProcessHub", "InProcessTransport", "LoadResult", "NixlTransport", "Offload",
        "OffloadConfig", "OffloadFaults", "OffloadStats",
        "PageBundle", "Peer", "PeerError", "ReadState", "Receiver", "Receiving", "Region",
        "Sender", "TierStats", "TransferFaults", "TransferMessage", "Transport", "gather_pages",
        "merge_descs", "page_descs", "page_digests", "paired_descs", "tensor_descs",
        "tier_keys"}
    assert all(hasattr(kvmem.transfer, n) for n in kvmem.transfer.__all__)
