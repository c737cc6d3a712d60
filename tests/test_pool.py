"""PagePool and PoolSpec: writes, reads, dtypes, sizes, eviction ahead and argument checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from adversarial import (  # the shared menagerie of bad arguments
    BAD,
    SETTINGS,
    assert_same,
    contracted,
    is_not_integer,
)
from engine_helpers import run_prompt
from hypothesis import given
from pool_fixtures import DTYPES, GQA, MLA, SMALL_GQA, calibrated_pool, pool_state

from kvmem import (
    ArgumentError,
    ArgumentTypeError,
    KVMemError,
    PagePool,
)
from kvmem.cuda import PoolSpec, PoolStats
from kvmem.manager import (
    KVCacheManager,
)
from kvmem.testing import ToyEngine

P = 4




POOL_KINDS = [  # per-layer scales set by a first write, and per-token scales
    {"dtype": "fp8_e4m3", "scales": "tensor"},
    {"dtype": "fp8_e5m2", "scales": "token_head"},
]




def _pool_calls(pool: PagePool) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Each public pool method with valid arguments: name -> (method, kwargs)."""
    k = torch.randn(2, 2, 8)
    return {
        "write": (pool.write, {"layer": 1, "slot_mapping": [3, 7], "k": k, "v": k.clone(),
                               "check": True}),
        "check_slots": (pool.check_slots, {"slot_mapping": [3, -1]}),
        "gather": (pool.gather, {"layer": 0, "page_ids": [0, 2], "dtype": None}),
        "read": (pool.read, {"layer": 0, "page_ids": np.array([1]), "dtype": torch.float32}),
        "copy_pages": (pool.copy_pages, {"src_page_ids": [0], "dst_page_ids": [3]}),
        "update_tags": (pool.update_tags, {"page_ids": [1, 2], "tags": [7, 8]}),
        "load_tags": (pool.load_tags, {"tags": list(range(8))}),
        "kv_cache": (pool.kv_cache, {"layer": 1}),
        "sync_tags": (pool.sync_tags, {"allocator": _Alloc(8)}),
    }


class _Alloc:
    """What sync_tags needs from an allocator."""

    def __init__(self, n: int) -> None:
        self.tags = np.arange(n, dtype=np.int64) + 100
        self.changed = np.array([1, 3])

    def pop_changed_pages(self) -> np.ndarray:
        out, self.changed = self.changed, np.zeros(0, dtype=np.int64)
        return out


POOL_PARAMS = [
    (method, param)
    for method, (_, kwargs) in _pool_calls(calibrated_pool(dtype="bf16")).items()
    for param in kwargs
]


INTEGER_PARAMS = {"layer"}


ID_LIST_PARAMS = {"slot_mapping", "page_ids", "src_page_ids", "dst_page_ids", "tags"}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]




def _pool(device: str = "cpu", **kw: Any) -> PagePool:
    return PagePool(PoolSpec(**{**GQA, "device": device, **kw}))


def _kv(
    t: int, device: str = "cpu", seed: int = 0, heads: int = 2, dim: int = 16, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, heads, dim, generator=g) * scale
    v = torch.randn(t, heads, dim, generator=g) * scale
    return k.to(device), v.to(device)


def _snapshot(pool: PagePool) -> dict[str, torch.Tensor]:
    state = {name: t.clone() for name, t in pool.storage_tensors().items()}
    state["tags"] = pool.tags.clone()
    state["counters"] = pool._counters.clone()
    return state


def _unchanged(pool: PagePool, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(_snapshot(pool)[name], t) for name, t in before.items())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _bad_writes(device: str) -> list[tuple[Any, str]]:
    k, v = _kv(3, device)
    ok = torch.tensor([0, 1, 2], device=device)
    return [
        (lambda p: p.write(2, ok, k, v), "layer=2: expected an integer in 0..1"),
        (lambda p: p.write(-1, ok, k, v), "layer=-1: expected an integer in 0..1"),
        (lambda p: p.write(True, ok, k, v), r"layer=True \(bool\)"),
        (lambda p: p.write(0, torch.tensor([0, 1, 48], device=device), k, v), "slots from"),
        (lambda p: p.write(0, torch.tensor([0, -2, 1], device=device), k, v), "slots from"),
        (lambda p: p.write(0, torch.tensor([3, 1, 3], device=device), k, v), "more than once"),
        (lambda p: p.write(0, ok[:2], k, v), "2 entries for 3 tokens"),
        (lambda p: p.write(0, ok.float(), k, v), "integer tensor"),
        (lambda p: p.write(0, ok[None], k, v), "1-D"),
        (lambda p: p.write(0, ok, k[:, :1], v), "shape"),
        (lambda p: p.write(0, ok, k, v[:2]), "match in tokens"),
        (lambda p: p.write(0, ok, k, v.half()), "match in tokens and dtype"),
        (lambda p: p.write(0, ok, k.double(), v.double()), "dtype"),
        (lambda p: p.write(0, ok, k.int(), v.int()), "dtype"),
        (lambda p: p.write(0, ok, k), "both k and v"),
        (
            lambda p: p.write(0, ok, k.numpy() if device == "cpu" else k.cpu().numpy(), v),
            "torch.Tensor",
        ),
    ]


def test_a_pool_must_match_the_manager() -> None:
    from kvmem.cuda import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=8, num_kv_heads=1, head_dim=8,
                             page_size=16, dtype="fp32", device="cpu"))
    with pytest.raises(ArgumentError, match="page_size"):
        KVCacheManager(8, page_size=8, pool=pool)
    with pytest.raises(ArgumentError, match="pages"):
        KVCacheManager(16, page_size=16, pool=pool)
    with pytest.raises(ArgumentError, match="pages"):
        KVCacheManager(4, page_size=16, pool=pool)
    assert KVCacheManager(8, page_size=16, pool=pool).pool is pool


@pytest.mark.parametrize("evict_ahead, evicted", [(None, 1 + 1024 // 512), (0, 1), (5, 6)])
def test_evict_ahead_takes_that_many_more_pages(evict_ahead: int | None, evicted: int) -> None:
    mgr = KVCacheManager(1024, page_size=P, max_seqs=4, max_pages_per_seq=1024,
                         evict_ahead=evict_ahead, watermark=0.0)
    for i in range(7):  # 7 cached prompts of 128 pages, held by the cache alone
        mgr.admit(f"r{i}", np.arange(128 * P) + i * 10**6)
        mgr.reserve([f"r{i}"], 128 * P)
        mgr.commit(f"r{i}", np.arange(128 * P) + i * 10**6)
        mgr.release(f"r{i}")
    free = mgr.allocator.num_free
    assert mgr.stats().num_evictions == 0 and free == 1024 - 7 * 128
    mgr.admit("x", np.arange((free + 1) * P) + 7 * 10**7)  # one page short
    assert mgr.stats().num_evictions == evicted


def test_evict_ahead_is_checked() -> None:
    for bad in (-1, 1.5, True, 10**9):
        with pytest.raises(KVMemError, match="evict_ahead"):
            KVCacheManager(64, evict_ahead=bad)


@pytest.mark.parametrize(("num_pages", "page_size"), [(4, 8), (8, 16)])
def test_a_pool_of_other_pages_or_page_size_is_refused(num_pages: int, page_size: int) -> None:
    from kvmem import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=4, page_size=16, num_kv_heads=1,
                             head_dim=8, device="cpu"))
    with pytest.raises(ArgumentError, match="page"):
        KVCacheManager(num_pages, page_size=page_size, pool=pool)


@pytest.mark.parametrize("kind", POOL_KINDS, ids=lambda k: k["dtype"])
@pytest.mark.parametrize(("method", "param"), POOL_PARAMS)
@SETTINGS
@given(bad=BAD)
def test_pool_methods_refuse_bad_arguments_and_change_nothing(
    kind: dict[str, Any], method: str, param: str, bad: Any
) -> None:
    pool = calibrated_pool(**kind)
    fn, kwargs = _pool_calls(pool)[method]
    exc = contracted(lambda: fn(**{**kwargs, param: bad}), pool_state(pool))
    if param in INTEGER_PARAMS and is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and param in str(exc), (bad, exc)
    if param in ID_LIST_PARAMS and not isinstance(bad, (list, tuple, np.ndarray, torch.Tensor)):
        assert exc is not None, f"one value {bad!r} passed as {param} was accepted"


@pytest.mark.parametrize("kind", [{"dtype": "bf16"}, *POOL_KINDS], ids=lambda k: k["dtype"])
def test_pool_valid_calls_succeed(kind: dict[str, Any]) -> None:
    """The calls the property test corrupts are valid as built."""
    pool = calibrated_pool(**kind)
    for fn, kwargs in _pool_calls(pool).values():
        fn(**kwargs)


def test_page_ids_never_wrap_or_index_from_the_end() -> None:
    pool = calibrated_pool(dtype="bf16")
    snap = pool_state(pool)
    before = snap()
    for ids in ([-1], np.array([-8]), torch.tensor([-1]), [8], [2**32 + 1],
                np.array([2**32 + 1], dtype=np.int64), [np.int64(2**63 - 1)]):
        with pytest.raises(ArgumentError, match=r"pages? from"):
            pool.copy_pages([0], ids)
        with pytest.raises(ArgumentError, match=r"pages? from"):
            pool.gather(0, ids)
    for ids in ([1.7], [True], [1, True], np.array([1.0]), 1, np.int64(1), "1"):
        with pytest.raises(ArgumentTypeError):
            pool.copy_pages([0], ids)
    assert_same(before, snap())


def test_a_write_that_fails_late_changes_nothing() -> None:
    """NaN input with nonfinite='raise' is refused after every shape check passed."""
    pool = PagePool(PoolSpec(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1,
                             head_dim=4, dtype="fp8_e4m3", device="cpu", nonfinite="raise"))
    snap = pool_state(pool)
    before = snap()
    k = torch.ones(2, 1, 4)
    k[1, 0, 0] = float("nan")
    with pytest.raises(ArgumentError, match="NaN"):
        pool.write(0, [0, 1], k, k)
    assert_same(before, snap())
    assert pool._calibrated == [False]  # the refused write did not set the layer's scales


def test_a_nonfinite_write_under_raise_is_a_config_error_and_writes_nothing() -> None:
    import torch

    from kvmem import ConfigError, PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1,
                             head_dim=4, dtype="fp8_e4m3", nonfinite="raise", device="cpu"))
    before = pool.page_bytes.clone()
    k = torch.tensor([[[float("nan"), 1.0, 2.0, 3.0]]])
    with pytest.raises(ConfigError, match="nonfinite"):
        pool.write(0, torch.tensor([0]), k, torch.zeros(1, 1, 4))
    assert torch.equal(pool.page_bytes, before) and pool.stats().num_nonfinite == 0


def test_a_pool_serves_one_manager() -> None:
    from kvmem import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1,
                             head_dim=4, device="cpu"))
    KVCacheManager(8, page_size=4, pool=pool)
    with pytest.raises(ArgumentError, match="already claimed"):
        KVCacheManager(8, page_size=4, pool=pool)


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1"])
def test_a_pool_on_an_indexed_cpu_device_takes_tensors_from_that_device(device: str) -> None:
    """``PoolSpec(device="cpu:0")`` is accepted; its pool must then take CPU tensors (it used to
    refuse every one: "k is on cpu but the pool is on cpu:0; move it first"). The same mismatch
    made a ``device="cuda"`` pool refuse tensors on cuda:0."""
    pool = PagePool(PoolSpec(**SMALL_GQA, device=device))
    assert pool.device == pool.data.device == torch.device("cpu")
    k = torch.randn(3, 2, 8)
    pool.write(0, torch.tensor([0, 1, 5]), k, -k)
    keys, values = pool.read(0, torch.tensor([0]), torch.float32)
    assert torch.allclose(keys[0, :2], k[:2], rtol=1e-2, atol=1e-2)
    assert torch.allclose(values[0, :2], -k[:2], rtol=1e-2, atol=1e-2)
    pool.copy_pages(torch.tensor([0]), torch.tensor([3]))
    pool.update_tags(torch.tensor([2]), torch.tensor([7]))
    assert int(pool.tags[2]) == 7


def test_a_big_pool_evicts_a_little_ahead_and_never_a_mapped_page() -> None:
    mgr = KVCacheManager(num_pages=1024, page_size=P, max_seqs=8, max_pages_per_seq=256,
                         tracker="checking", watermark=0.0)
    eng = ToyEngine(mgr)
    for i in range(200):  # 4 full pages each, cached when released
        run_prompt(eng, f"old{i}", [i, i + 1] * 8 + [0])
        eng.release(f"old{i}")
    run_prompt(eng, "keep", list(range(40)))
    keep = mgr.pages_of("keep").tolist()
    free = mgr.allocator.num_free
    run_prompt(eng, "big", [999] * (4 * (free + 1)))  # needs one page more than is free
    s = mgr.stats()
    assert 1 <= s.num_evictions <= 1 + 1024 // 512
    assert mgr.pages_of("keep").tolist() == keep
    assert mgr.verify(list(mgr.running)).ok
    mgr.check()
    eng.check_kv()


def test_static_scales_are_normalized_per_layer_component_head() -> None:
    t = PoolSpec(**GQA, dtype="fp8_e4m3", static_scales=[[1.0, 2.0], [3.0, 4.0]])
    assert t.static_scales == [[[1.0], [2.0]], [[3.0], [4.0]]]
    h = PoolSpec(**GQA, dtype="fp8_e4m3", scales="head", static_scales=0.25)
    assert np.asarray(h.static_scales).shape == (2, 2, 2)
    pool = PagePool(h.model_copy(update={"device": "cpu"}))
    assert pool.static_scales is not None and bool((pool.static_scales == 0.25).all())


def test_fp8_doubles_tokens_in_a_budget_and_token_head_overhead_is_reported() -> None:
    base = {"num_layers": 32, "num_pages": 1, "num_kv_heads": 8, "head_dim": 128}
    bf16 = PoolSpec(**base, dtype="bf16")
    assert bf16.bytes_per_token == 32 * 2 * 8 * 128 * 2  # 131072: Llama-3.1-8B
    for budget in (8 << 30, 70 << 30, bf16.bytes_per_page * 1000):
        bf16_tokens = bf16.num_pages_for_budget(budget) * bf16.page_size
        for scales in ("tensor", "head"):
            fp8 = PoolSpec(**base, dtype="fp8_e4m3", scales=scales)
            assert fp8.bytes_per_token * 2 == bf16.bytes_per_token
            assert fp8.num_pages_for_budget(budget) * fp8.page_size == 2 * bf16_tokens
    token = PoolSpec(**base, dtype="fp8_e4m3", scales="token_head")
    assert token.scale_overhead == 4 / 128  # 3.1%: one fp32 per 128 one-byte elements
    assert token.bytes_per_token == bf16.bytes_per_token // 2 * (1 + 4 / 128)
    ratio = token.num_pages_for_budget(8 << 30) / bf16.num_pages_for_budget(8 << 30)
    assert 1.93 < ratio < 1.94  # 2 / 1.03125
    mla = PoolSpec(
        num_layers=61,
        num_pages=1,
        attention="mla",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        dtype="bf16",
    )
    assert mla.bytes_per_token == 61 * 576 * 2  # 70,272: Kimi K2 / DeepSeek-V3
    fp8_mla = mla.model_copy(update={"dtype": "fp8_e4m3", "scales": "tensor"})
    assert PoolSpec(**fp8_mla.model_dump()).bytes_per_token == 35_136
    with pytest.raises(ArgumentError, match="page_budget_bytes=-1"):
        bf16.num_pages_for_budget(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("dtype", "scales"), DTYPES)
def test_write_read_round_trip(device: str, layout: str, dtype: str, scales: str | None) -> None:
    pool = _pool(device, dtype=dtype, scales=scales, layout=layout)
    k, v = _kv(10, device)
    slots = torch.tensor([4, 5, 6, 7, 8, 33, 34, 2, 0, 47], device=device)
    pool.write(1, slots, k, v)
    pages = torch.tensor([0, 1, 2, 8, 11], device=device)
    kk, vv = pool.read(1, pages)
    assert kk.shape == vv.shape == (5, 4, 2, 16)
    assert kk.dtype == pool.compute_dtype
    assert pool.compute_dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16)
    lookup = {int(p): i for i, p in enumerate(pages)}
    got_k = torch.stack([kk[lookup[int(s) // 4], int(s) % 4] for s in slots])
    got_v = torch.stack([vv[lookup[int(s) // 4], int(s) % 4] for s in slots])
    bound = {"fp32": 0.0, "bf16": 0.004, "fp16": 0.004}.get(
        dtype, 0.07 if "e5m2" in dtype else 0.04
    )
    assert _rel(got_k, k) <= bound and _rel(got_v, v) <= bound
    assert float(kk[lookup[2], 1].abs().sum()) == 0.0  # slot 9 was never written
    assert pool.stats() == PoolStats(0, 0, (0, 0), (0, 0))


def test_layouts_store_the_same_values() -> None:
    k, v = _kv(16, scale=3.0)
    slots = torch.randperm(48)[:16]
    reads = []
    for layout in ("NHD", "HND"):
        pool = _pool(dtype="fp8_e4m3", scales="token_head", layout=layout)
        pool.write(0, slots, k, v)
        reads.append(pool.read(0, torch.arange(12)))
    assert torch.equal(reads[0][0], reads[1][0]) and torch.equal(reads[0][1], reads[1][1])
    pool = _pool(dtype="bf16", layout="HND")
    assert pool.kv_cache(0).shape == (12, 2, 2, 4, 16)
    assert _pool(dtype="fp8_e4m3").kv_cache(1).dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "scales"), [("bf16", None), ("fp8_e4m3", "tensor"), ("fp8_e4m3", "token_head")]
)
def test_mla_latent_round_trip(device: str, dtype: str, scales: str | None) -> None:
    pool = PagePool(PoolSpec(**MLA, dtype=dtype, scales=scales, device=device))
    latent = torch.randn(6, 32, device=device)
    pool.write(0, [8, 9, 10, 11, 12, 20], latent)
    got = pool.read(0, [2, 3, 5])
    assert isinstance(got, torch.Tensor) and got.shape == (3, 4, 32)
    assert pool.kv_cache(0).shape == (12, 4, 32)
    stored = torch.cat([got[0], got[1, :1], got[2, :1]])
    assert _rel(stored, latent) < 0.04


def test_token_is_never_requantized_as_its_page_fills() -> None:
    pool = _pool(dtype="fp8_e4m3", scales="token_head")
    small, small_v = _kv(1, scale=0.01)
    pool.write(0, [0], small, small_v)
    assert pool.token_scales is not None
    data_before = pool.data[0, 0, :, 0].clone()
    scale_before = pool.token_scales[0, 0, :, 0].clone()
    big, big_v = _kv(3, seed=1, scale=1000.0)
    pool.write(0, [1, 2, 3], big, big_v)  # same page, much larger values
    assert torch.equal(pool.data[0, 0, :, 0], data_before)
    assert torch.equal(pool.token_scales[0, 0, :, 0], scale_before)
    k, _ = pool.read(0, [0])
    assert _rel(k[0, 0], small[0]) < 0.04


def test_per_layer_scales_are_calibrated_once_then_fixed() -> None:
    pool = _pool(dtype="fp8_e4m3", scales="tensor")
    assert pool.static_scales is not None and bool((pool.static_scales == 0).all())
    k, v = _kv(4, scale=2.0)
    pool.write(0, [0, 1, 2, 3], k, v)
    first = pool.static_scales[0].clone()
    assert torch.allclose(first[:, 0], torch.stack([k.abs().amax(), v.abs().amax()]) / 448)
    assert bool((pool.static_scales[1] == 0).all())  # layer 1 untouched
    k2, v2 = _kv(4, seed=3, scale=100.0)
    pool.write(0, [4, 5, 6, 7], k2, v2)
    assert torch.equal(pool.static_scales[0], first)  # fixed after the first write
    assert pool.num_saturated > 0  # and the larger values are reported, not hidden
    assert pool.stats().saturated_per_layer[1] == 0


@pytest.mark.parametrize(("dtype", "scales"), DTYPES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_chunked_cpu_writes_store_the_same_bytes(
    dtype: str, scales: str | None, layout: str
) -> None:
    whole = _pool(dtype=dtype, scales=scales, layout=layout)
    chunked = _pool(dtype=dtype, scales=scales, layout=layout)
    chunked._chunk_tokens = 3  # 17 tokens: chunks of 3, the last one short
    k, v = _kv(17, scale=300.0)
    k[5, 1, 2] = float("nan")
    slots = torch.randperm(48)[:17]
    slots[[2, 9]] = -1
    for pool in (whole, chunked):
        pool.write(0, slots, k, v)
        pool.write(1, slots.flip(0), v, k)
    for name, t in whole.storage_tensors().items():
        assert torch.equal(chunked.storage_tensors()[name], t), name
    assert chunked.stats() == whole.stats()


@pytest.mark.parametrize("device", DEVICES)
def test_slot_minus_one_touches_nothing(device: str) -> None:
    pool = _pool(device, dtype="fp8_e4m3", scales="token_head")
    k, v = _kv(5, device)
    pool.write(0, torch.tensor([0, 1, 2, 3, 4], device=device), k, v)
    before = _snapshot(pool)
    k2, v2 = _kv(3, device, seed=9, scale=7.0)
    pool.write(0, torch.tensor([-1, -1, -1], device=device), k2, v2)
    assert _unchanged(pool, before)
    pool.write(0, torch.tensor([-1, 40, -1], device=device), k2, v2)
    changed = _snapshot(pool)["data"] != before["data"]
    assert bool(changed.any()) and bool(changed.nonzero()[:, 1].eq(10).all())  # page 10 only


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "scales"), DTYPES)
def test_copy_pages_moves_data_and_scales_bit_identically(
    device: str, dtype: str, scales: str | None
) -> None:
    pool = _pool(device, dtype=dtype, scales=scales)
    for layer in (0, 1):
        k, v = _kv(12, device, seed=layer, scale=3.0)
        pool.write(layer, torch.arange(12, device=device), k, v)
    before = _snapshot(pool)
    pool.copy_pages([0, 1, 2], [5, 6, 7])
    after = _snapshot(pool)
    for name in pool.storage_tensors():
        if name == "static_scales":
            assert torch.equal(after[name], before[name])
            continue
        assert torch.equal(after[name][:, [5, 6, 7]], before[name][:, [0, 1, 2]])
        assert torch.equal(after[name][:, :5], before[name][:, :5])
        assert torch.equal(after[name][:, 8:], before[name][:, 8:])
    for layer in (0, 1):
        src = pool.read(layer, [0, 1, 2])
        dst = pool.read(layer, [5, 6, 7])
        assert torch.equal(src[0], dst[0]) and torch.equal(src[1], dst[1])


def test_copy_pages_reads_all_sources_before_writing() -> None:
    pool = _pool(dtype="fp8_e4m3", scales="token_head")
    k, v = _kv(12, scale=2.0)
    pool.write(0, torch.arange(12), k, v)
    before = _snapshot(pool)
    pool.copy_pages([0, 1], [1, 2])  # a chain: page 1 is read before it is overwritten
    assert torch.equal(pool.data[:, 1], before["data"][:, 0])
    assert torch.equal(pool.data[:, 2], before["data"][:, 1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "scales"), [("bf16", None), ("fp8_e4m3", "tensor"), ("fp8_e4m3", "token_head")]
)
def test_bad_writes_raise_and_change_nothing(device: str, dtype: str, scales: str | None) -> None:
    pool = _pool(device, dtype=dtype, scales=scales)
    k, v = _kv(4, device, seed=5)
    pool.write(0, torch.tensor([8, 9, 10, 11], device=device), k, v)
    before = _snapshot(pool)
    for call, match in _bad_writes(device):
        with pytest.raises(KVMemError, match=match):
            call(pool)
        assert _unchanged(pool, before), match


@pytest.mark.cuda
def test_wrong_device_is_rejected() -> None:
    pool = _pool("cuda")
    k, v = _kv(2)
    with pytest.raises(ArgumentError, match="move it"):
        pool.write(0, torch.tensor([0, 1], device="cuda"), k, v)
    with pytest.raises(ArgumentError, match="move it"):
        pool.read(0, torch.tensor([0]))


def test_mla_write_needs_one_latent() -> None:
    pool = PagePool(PoolSpec(**MLA, device="cpu"))
    latent = torch.randn(2, 32)
    with pytest.raises(ArgumentError, match="without v"):
        pool.write(0, [0, 1], latent, latent)
    with pytest.raises(ArgumentError, match="shape"):
        pool.write(0, [0, 1], latent[:, :31])


def test_bad_reads_and_copies_raise_and_change_nothing() -> None:
    pool = _pool(dtype="fp8_e4m3", scales="token_head")
    k, v = _kv(8)
    pool.write(0, torch.arange(8), k, v)
    before = _snapshot(pool)
    with pytest.raises(ArgumentError, match="pages from"):
        pool.read(0, [0, 12])
    with pytest.raises(ArgumentError, match="layer"):
        pool.read(5, [0])
    with pytest.raises(ArgumentError, match="one destination per source"):
        pool.copy_pages([0, 1], [3])
    with pytest.raises(ArgumentError, match="destination page twice"):
        pool.copy_pages([0, 1], [3, 3])
    with pytest.raises(ArgumentError, match="pages from"):
        pool.copy_pages([0, 1], [3, 12])
    with pytest.raises(ArgumentError, match="pages from"):
        pool.copy_pages([-1], [3])
    assert _unchanged(pool, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "scales"), [("bf16", None), ("fp8_e4m3", "token_head"), ("fp8_e5m2", "tensor")]
)
def test_nonfinite_input_is_counted_and_stored_as_zero(
    device: str, dtype: str, scales: str | None
) -> None:
    pool = _pool(device, dtype=dtype, scales=scales)
    k, v = _kv(4, device)
    pool.write(0, torch.arange(4, device=device), k, v)
    assert pool.num_nonfinite == 0  # silent on clean input
    k[1, 0, 3] = float("nan")
    v[2, 1, 0] = float("inf")
    pool.write(1, torch.arange(4, device=device), k, v)
    assert pool.num_nonfinite == 2
    assert pool.stats().nonfinite_per_layer == (0, 2)
    kk, vv = pool.read(1, [0])
    assert kk[0, 1, 0, 3] == 0 and vv[0, 2, 1, 0] == 0
    assert bool(torch.isfinite(kk).all()) and bool(torch.isfinite(vv).all())
    pool.reset_stats()
    assert pool.stats() == PoolStats(0, 0, (0, 0), (0, 0))


def test_nonfinite_raise_policy_rejects_before_writing() -> None:
    pool = _pool(dtype="fp8_e4m3", nonfinite="raise")
    k, v = _kv(4)
    pool.write(0, torch.arange(4), k, v)  # clean input passes
    before = _snapshot(pool)
    k[0, 0, 0] = float("nan")
    with pytest.raises(ArgumentError, match="NaN or inf"):
        pool.write(0, torch.arange(4, 8), k, v)
    assert _unchanged(pool, before)
    assert pool.num_nonfinite == 0


def test_static_scale_one_beyond_448_is_flagged() -> None:
    pool = _pool(dtype="fp8_e4m3", static_scales=1.0)
    k, v = _kv(4, scale=10.0)
    pool.write(0, torch.arange(4), k, v)
    assert pool.num_saturated == 0  # silent while the data fits
    k[0, 0, :4] = torch.tensor([600.0, -900.0, 2000.0, 449.0])  # 449: ordinary rounding
    pool.write(1, torch.arange(4), k, v)
    assert pool.num_saturated == 3
    assert pool.stats().saturated_per_layer == (0, 3)
    kk, _ = pool.read(1, [0])
    assert kk[0, 0, 0, :4].tolist() == [448.0, -448.0, 448.0, 448.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "scales"),
    [
        ("fp8_e4m3", "tensor"),
        ("fp8_e4m3", "head"),
        ("fp8_e4m3", "token_head"),
        ("fp8_e5m2", "tensor"),
    ],
)
def test_inputs_up_to_1e6_with_dynamic_scales_stay_finite(
    device: str, dtype: str, scales: str
) -> None:
    pool = _pool(device, dtype=dtype, scales=scales)
    k, v = _kv(16, device, scale=1.0)
    k[::3] *= 1e6
    v[1::4] *= 2e5
    pool.write(0, torch.arange(16, device=device), k, v)
    kk, vv = pool.read(0, torch.arange(4, device=device))
    assert bool(torch.isfinite(kk).all()) and bool(torch.isfinite(vv).all())
    assert pool.num_saturated == 0 and pool.num_nonfinite == 0
    assert _rel(kk.reshape(16, 2, 16), k) < 0.07


@pytest.mark.parametrize("device", DEVICES)
def test_tag_mirror_updates_only_changed_entries(device: str) -> None:
    pool = _pool(device)
    assert pool.tags.dtype == torch.int64 and pool.tags.shape == (12,)
    assert pool.tags.device.type == device
    pool.load_tags(np.arange(12, dtype=np.int64) * 10)
    pool.update_tags(np.array([3, 7], dtype=np.int32), np.array([1001, 1002], dtype=np.int64))
    want = np.arange(12) * 10
    want[[3, 7]] = [1001, 1002]
    assert pool.tags.cpu().tolist() == want.tolist()
    pool.update_tags(torch.tensor([0], device=device), torch.tensor([0], device=device))
    assert int(pool.tags[0]) == 0
    before = pool.tags.clone()
    with pytest.raises(ArgumentError, match="one tag per page"):
        pool.update_tags([1, 2], [5])
    with pytest.raises(ArgumentError, match="pages from"):
        pool.update_tags([12], [5])
    with pytest.raises(ArgumentError, match="twice"):
        pool.update_tags([4, 4], [5, 6])
    with pytest.raises(ArgumentError, match="12 tags"):
        pool.load_tags([1, 2, 3])
    assert torch.equal(pool.tags, before)


@pytest.mark.parametrize("device", DEVICES)
def test_tag_mirror_follows_the_allocator_and_feeds_the_integrity_check(device: str) -> None:
    from kvmem.allocator import PageAllocator
    from kvmem.integrity import check_csr_torch

    pool = _pool(device)
    alloc = PageAllocator(pool.spec.num_pages)
    pages = alloc.allocate(3)
    expected = torch.from_numpy(alloc.tags[pages][None]).to(device)  # the request's record
    assert pool.sync_tags(alloc) == 3
    assert pool.sync_tags(alloc) == 0  # nothing changed since
    assert np.array_equal(pool.tags.cpu().numpy(), alloc.tags)

    def check() -> int:
        indptr = torch.tensor([0, 3], device=device)
        indices = torch.from_numpy(pages.astype(np.int64)).to(device)
        num = torch.tensor([3], device=device)
        return check_csr_torch(indptr, indices, num, expected, pool.tags).num_bad

    assert check() == 0  # silent while the mapping holds
    alloc.free(pages[1:2])
    alloc.allocate(1)  # the same page, handed to a new lifetime
    assert pool.sync_tags(alloc) == 1
    assert np.array_equal(pool.tags.cpu().numpy(), alloc.tags)
    assert check() == 1  # fires on the pool's device, from the mirror


def test_tags_are_not_part_of_kv_bytes() -> None:
    pool = _pool(dtype="fp8_e4m3")
    assert "tags" not in pool.storage_tensors()
    assert pool.spec.tag_nbytes == 12 * 8


def test_stats_is_a_frozen_snapshot() -> None:
    pool = _pool(dtype="fp8_e4m3", static_scales=1.0)
    snap = pool.stats()
    k, v = _kv(2, scale=1000.0)
    pool.write(0, [0, 1], k, v)
    assert snap.num_saturated == 0 and pool.stats().num_saturated > 0
    with pytest.raises(AttributeError):
        snap.num_saturated = 5  # type: ignore[misc]


def test_cuda_request_without_cuda_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ArgumentError, match="CUDA is not available"):
        PagePool(PoolSpec(**GQA, device="cuda"))
    assert PoolSpec(**GQA).resolved_device() == "cpu"
