"""Paged attention over the pool."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from adversarial import (  # the shared menagerie of bad arguments
    BAD,
    SETTINGS,
    contracted,
    is_not_integer,
)
from hypothesis import given
from model_fixtures import TINY_VOCAB  # noqa: F401 (fixtures)
from pool_fixtures import calibrated_pool, pool_state

from kvmem.attention import paged_attention
from kvmem.cuda import PagePool, PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Batch:
    """Requests laid out on shuffled pages of a pool, with their dense K/V kept for reference."""

    def __init__(
        self,
        pool: PagePool,
        kv_lens: list[int],
        qo_lens: list[int],
        seed: int = 0,
        scale: float = 1.0,
    ) -> None:
        spec = pool.spec
        ps = spec.page_size
        g = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        free = rng.permutation(spec.num_pages)
        self.pages: list[np.ndarray] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        used = 0
        for n in kv_lens:
            pages = free[used : used + -(-n // ps)]
            used += len(pages)
            slots = torch.from_numpy(pages[np.arange(n) // ps] * ps + np.arange(n) % ps)
            if spec.attention == "gqa":
                k = torch.randn(n, spec.num_heads, spec.width, generator=g) * scale
                v = torch.randn(n, spec.num_heads, spec.width, generator=g) * scale
                for layer in range(spec.num_layers):
                    pool.write(layer, slots.to(pool.device), k.to(pool.device), v.to(pool.device))
            else:
                assert spec.kv_lora_rank is not None
                k = torch.randn(n, 1, spec.width, generator=g) * scale
                v = k[..., : spec.kv_lora_rank]
                for layer in range(spec.num_layers):
                    pool.write(layer, slots.to(pool.device), k[:, 0].to(pool.device))
            self.pages.append(pages)
            self.k.append(k)
            self.v.append(v)
        self.kv_lens = kv_lens
        self.qo_lens = qo_lens
        self.qo_indptr = np.cumsum([0, *qo_lens]).astype(np.int32)
        self.kv_indptr = np.cumsum([0, *(len(p) for p in self.pages)]).astype(np.int32)
        self.kv_indices = np.concatenate(self.pages).astype(np.int32)
        self.kv_last_page_len = np.array([(n - 1) % ps + 1 for n in kv_lens], dtype=np.int32)

    def run(self, pool: PagePool, q: torch.Tensor, layer: int = 0, **kw: Any) -> torch.Tensor:
        return paged_attention(
            q,
            self.qo_indptr,
            pool,
            layer,
            self.kv_indptr,
            self.kv_indices,
            self.kv_last_page_len,
            **kw,
        )

    def dense(
        self, q: torch.Tensor, causal: bool = True, sm_scale: float | None = None
    ) -> torch.Tensor:
        """Plain scaled_dot_product_attention per request on the original fp32 K/V."""
        outs = []
        for b, (n, m) in enumerate(zip(self.kv_lens, self.qo_lens)):
            qb = q[self.qo_indptr[b] : self.qo_indptr[b + 1]].float().cpu().transpose(0, 1)
            group = qb.shape[0] // self.k[b].shape[1]
            k = self.k[b].repeat_interleave(group, 1).transpose(0, 1)
            v = self.v[b].repeat_interleave(group, 1).transpose(0, 1)
            mask = None
            if causal:
                mask = torch.from_numpy(np.arange(n)[None] <= (n - m + np.arange(m))[:, None])
            o = F.scaled_dot_product_attention(
                qb[None], k[None], v[None], attn_mask=mask, scale=sm_scale
            )
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def _gqa(device: str = "cpu", **kw: Any) -> PagePool:
    base = {
        "num_layers": 2,
        "num_pages": 64,
        "page_size": 8,
        "num_kv_heads": 2,
        "head_dim": 32,
        "device": device,
    }
    return PagePool(PoolSpec(**{**base, **kw}))


MIXED = ([37, 16, 5, 24, 9], [37, 3, 1, 24, 0])  # full prefill, prefix + chunk, decode, ..., idle


def _outlier_kv(
    seed: int = 0, tokens: int = 4096, heads: int = 2, dim: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Synthetic K/V shaped like real caches: 4 key channels x15, log-normal token magnitudes."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, dim, generator=g)
    v = torch.randn(tokens, heads, dim, generator=g)
    outliers = torch.randperm(dim, generator=g)[:4]
    k[:, :, outliers] *= 15
    k *= torch.exp(0.5 * torch.randn(tokens, 1, 1, generator=g))
    v *= torch.exp(0.5 * torch.randn(tokens, 1, 1, generator=g))
    q = torch.randn(16, 4 * heads, dim, generator=g)
    return q, k, v


@pytest.fixture(scope="module")
def outliers() -> dict[str, Any]:
    q, k, v = _outlier_kv()
    out = {}
    for dtype, scales in [
        ("fp32", None),
        ("fp8_e4m3", "token_head"),
        ("fp8_e4m3", "head"),
        ("fp8_e4m3", "tensor"),
        ("fp8_e5m2", "tensor"),
    ]:
        spec = PoolSpec(
            num_layers=1,
            num_pages=4096 // 16,
            num_kv_heads=2,
            head_dim=128,
            dtype=dtype,
            scales=scales,
            device="cpu",
            compute_dtype="fp32",
        )
        pool = PagePool(spec)
        pool.write(0, torch.arange(4096), k, v)
        out[f"{dtype}/{scales}"] = paged_attention(
            q, [0, 16], pool, 0, [0, 256], np.arange(256), [16]
        )
        assert pool.num_saturated == 0 and pool.num_nonfinite == 0
    return out






def _attention_call(pool: PagePool) -> dict[str, Any]:
    return {
        "q": torch.randn(3, 4, 8),
        "qo_indptr": [0, 2, 3],
        "pool": pool,
        "layer": 0,
        "kv_indptr": np.array([0, 1, 3], dtype=np.int32),
        "kv_indices": torch.tensor([0, 1, 2], dtype=torch.int32),
        "kv_last_page_len": [3, 2],
        "sm_scale": 0.3,
        "causal": True,
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("dtype", "bound"), [("fp32", 1e-5), ("bf16", 1e-2)])
def test_matches_dense_sdpa(device: str, layout: str, dtype: str, bound: float) -> None:
    pool = _gqa(device, dtype=dtype, layout=layout)
    batch = Batch(pool, *MIXED)
    q = torch.randn(sum(MIXED[1]), 6, 32, generator=torch.Generator().manual_seed(1))
    out = batch.run(pool, q.to(device), layer=1)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel(out, batch.dense(q)) <= bound


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_batch_matches_dense_and_bf16_queries(dtype: str) -> None:
    pool = _gqa(dtype=dtype)
    kv_lens = [1, 8, 9, 40, 63]
    batch = Batch(pool, kv_lens, [1] * 5, seed=3)
    q = torch.randn(5, 4, 32, generator=torch.Generator().manual_seed(4))
    ref = batch.dense(q)
    assert _rel(batch.run(pool, q), ref) <= (1e-5 if dtype == "fp32" else 1e-2)
    out16 = batch.run(pool, q.bfloat16())
    assert out16.dtype == torch.bfloat16 and _rel(out16, ref) <= 1e-2


def test_non_causal_and_custom_scale() -> None:
    pool = _gqa(dtype="fp32")
    batch = Batch(pool, [20, 11], [4, 11], seed=5)
    q = torch.randn(15, 2, 32, generator=torch.Generator().manual_seed(6))
    out = batch.run(pool, q, causal=False, sm_scale=0.3)
    assert _rel(out, batch.dense(q, causal=False, sm_scale=0.3)) <= 1e-5
    assert _rel(out, batch.dense(q, causal=True, sm_scale=0.3)) > 1e-2  # the mask matters


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "bound"), [("fp32", 1e-5), ("bf16", 1e-2)])
def test_mla_matches_dense(device: str, dtype: str, bound: float) -> None:
    spec = PoolSpec(
        num_layers=1,
        num_pages=32,
        page_size=8,
        attention="mla",
        kv_lora_rank=48,
        qk_rope_head_dim=16,
        dtype=dtype,
        device=device,
    )
    pool = PagePool(spec)
    batch = Batch(pool, [30, 7, 12], [30, 1, 4], seed=7)
    q = torch.randn(35, 4, 64, generator=torch.Generator().manual_seed(8))
    out = batch.run(pool, q.to(device), sm_scale=0.125)
    assert out.shape == (35, 4, 48)
    assert _rel(out, batch.dense(q, sm_scale=0.125)) <= bound


@pytest.mark.parametrize(
    ("config", "bound"),
    [
        ("fp8_e4m3/token_head", 0.09),
        ("fp8_e4m3/head", 0.18),
        ("fp8_e4m3/tensor", 0.18),
        ("fp8_e5m2/tensor", 0.40),
    ],
)
def test_fp8_attention_error_on_outlier_channels(
    outliers: dict[str, Any], config: str, bound: float
) -> None:
    err = _rel(outliers[config], outliers["fp32/None"])
    assert 0.0 < err <= bound


def test_token_head_beats_tensor_scales(outliers: dict[str, Any]) -> None:
    ref = outliers["fp32/None"]
    assert _rel(outliers["fp8_e4m3/token_head"], ref) < _rel(outliers["fp8_e4m3/tensor"], ref)
    assert _rel(outliers["fp8_e4m3/tensor"], ref) < _rel(outliers["fp8_e5m2/tensor"], ref)


def test_empty_batch_and_idle_requests() -> None:
    pool = _gqa(dtype="fp32")
    q = torch.zeros(0, 2, 32)
    out = paged_attention(q, [0], pool, 0, [0], np.zeros(0, np.int32), np.zeros(0, np.int32))
    assert out.shape == (0, 2, 32)


def test_bad_metadata_is_rejected() -> None:
    pool = _gqa(dtype="fp32")
    batch = Batch(pool, [20, 5], [2, 1])
    q = torch.randn(3, 4, 32)
    args = (batch.qo_indptr, pool, 0, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)

    def call(q: torch.Tensor = q, **over: Any) -> None:
        a = dict(
            zip(["qo_indptr", "pool", "layer", "kv_indptr", "kv_indices", "kv_last_page_len"], args)
        )
        paged_attention(q, **{**a, **over})

    with pytest.raises(ArgumentError, match="multiple"):
        call(torch.randn(3, 3, 32))
    with pytest.raises(ArgumentError, match="head size"):
        call(torch.randn(3, 4, 16))
    with pytest.raises(ArgumentError, match=r"\[T, num_q_heads, head_dim\]"):
        call(torch.randn(3, 128))
    with pytest.raises(ArgumentError, match="end at T"):
        call(qo_indptr=np.array([0, 2, 4]))
    with pytest.raises(ArgumentError, match="CSR sizes"):
        call(kv_last_page_len=np.array([4]))
    with pytest.raises(ArgumentError, match="kv_last_page_len"):
        call(kv_last_page_len=np.array([0, 5]))
    with pytest.raises(ArgumentError, match="kv_last_page_len"):
        call(kv_last_page_len=np.array([9, 5]))
    with pytest.raises(ArgumentError, match="pool has pages"):
        call(kv_indices=np.array([0, 1, 2, 64]))
    with pytest.raises(ArgumentError, match="qo_len <= kv_len"):
        call(qo_indptr=np.array([0, 1, 3]), kv_last_page_len=np.array([4, 1]))
    with pytest.raises(ArgumentError, match="layer"):
        call(layer=7)
    with pytest.raises(ArgumentError, match="kv_indptr"):
        call(kv_indptr=np.array([0, 3, 2]))
    with pytest.raises(ArgumentTypeError, match="integer"):
        call(qo_indptr=np.array([0.0, 2.0, 3.0]))


@pytest.mark.parametrize("param", list(_attention_call(calibrated_pool(dtype="bf16"))))
@SETTINGS
@given(bad=BAD)
def test_paged_attention(param: str, bad: Any) -> None:
    pool = calibrated_pool(dtype="fp8_e4m3", scales="tensor")
    kwargs = _attention_call(pool)
    paged_attention(**kwargs)  # valid as built
    exc = contracted(lambda: paged_attention(**{**kwargs, param: bad}), pool_state(pool))
    if param == "layer" and is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and "layer" in str(exc)


def test_attention_metadata_beyond_int64_says_so_in_words() -> None:
    # The message read "kv_indices holds 9223372036854775808: too large for an value."
    import numpy as np

    from kvmem.attention import paged_attention
    from kvmem.cuda import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=4, page_size=4, attention="gqa",
                             num_kv_heads=1, head_dim=8, dtype="fp32", device="cpu"))
    with pytest.raises(ArgumentError, match="kv_indices holds 9223372036854775808, beyond int64"):
        paged_attention(torch.randn(1, 1, 8), [0, 1], pool, 0, [0, 1],
                        np.array([2**63], dtype=np.uint64), [1])
