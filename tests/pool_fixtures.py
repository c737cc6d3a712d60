"""Pool specs and pools the pool, pool-spec and attention tests share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvmem import PagePool
from kvmem.cuda import PoolSpec

GQA: dict[str, Any] = {
    "num_layers": 2,
    "num_pages": 12,
    "page_size": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
}


MLA: dict[str, Any] = {
    "num_layers": 2,
    "num_pages": 12,
    "page_size": 4,
    "attention": "mla",
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 8,
}


DTYPES = [
    ("fp32", None),
    ("bf16", None),
    ("fp16", None),
    ("fp8_e4m3", "tensor"),
    ("fp8_e4m3", "head"),
    ("fp8_e4m3", "token_head"),
    ("fp8_e5m2", "tensor"),
    ("fp8_e5m2", "token_head"),
]


def calibrated_pool(**kw: Any) -> PagePool:
    spec = PoolSpec(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8,
                    device="cpu", **kw)
    pool = PagePool(spec)
    k = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(0))
    pool.write(0, [0, 1, 2, 5, 9, 30], k, -k)  # calibrates layer 0's tensor scales
    pool.load_tags(np.arange(8) * 3)
    return pool


def pool_state(pool: PagePool) -> Callable[[], dict[str, Any]]:
    def snap() -> dict[str, Any]:
        state: dict[str, Any] = {n: t.clone() for n, t in pool.storage_tensors().items()}
        state["tags"] = pool.tags.clone()
        state["stats"] = pool.stats()
        state["calibrated"] = list(pool._calibrated)
        return state

    return snap


SMALL_GQA: dict[str, Any] = {
    "num_layers": 1,
    "num_pages": 4,
    "page_size": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
}


def small_pool(**kw: Any) -> PagePool:
    return PagePool(PoolSpec(**{**SMALL_GQA, "device": "cpu", **kw}))


def page_bytes(pool: PagePool, pages: Any) -> list[torch.Tensor]:
    """Copies of ``pages``' bytes in every layer: ``[L, n, B]`` uint8 data, and the token scales
    when the pool has them."""
    ids = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    out = [pool.page_bytes.index_select(1, ids)]
    if pool.token_scales is not None:
        out.append(pool.token_scales.index_select(1, ids))
    return out
