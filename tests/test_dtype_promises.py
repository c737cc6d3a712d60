"""Promises of docs/data_types.md and the codec/pool docstrings, held against adversarial input.

Each test here failed before the fix it names: the pool, the codecs, int4 and the tag mirror
either broke a documented promise (no silent NaN, inputs accepted on the pool's device, scales
within range) or answered bad input with something other than a clear kvmem error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvmem.cuda import PagePool, PoolSpec
from kvmem.errors import ArgumentError

GQA: dict[str, Any] = {
    "num_layers": 1,
    "num_pages": 4,
    "page_size": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
}


def _pool(**kw: Any) -> PagePool:
    return PagePool(PoolSpec(**{**GQA, "device": "cpu", **kw}))


def _snapshot(pool: PagePool) -> dict[str, torch.Tensor]:
    state = {name: t.clone() for name, t in pool.storage_tensors().items()}
    state["tags"] = pool.tags.clone()
    state["counters"] = pool._counters.clone()
    return state


# -- the pool's device ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1"])
def test_a_pool_on_an_indexed_cpu_device_takes_tensors_from_that_device(device: str) -> None:
    """``PoolSpec(device="cpu:0")`` is accepted; its pool must then take CPU tensors (it used to
    refuse every one: "k is on cpu but the pool is on cpu:0; move it first"). The same mismatch
    made a ``device="cuda"`` pool refuse tensors on cuda:0."""
    pool = PagePool(PoolSpec(**GQA, device=device))
    assert pool.device == pool.data.device == torch.device("cpu")
    k = torch.randn(3, 2, 8)
    pool.write(0, torch.tensor([0, 1, 5]), k, -k)
    keys, values = pool.read(0, torch.tensor([0]), torch.float32)
    assert torch.allclose(keys[0, :2], k[:2], rtol=1e-2, atol=1e-2)
    assert torch.allclose(values[0, :2], -k[:2], rtol=1e-2, atol=1e-2)
    pool.copy_pages(torch.tensor([0]), torch.tensor([3]))
    pool.update_tags(torch.tensor([2]), torch.tensor([7]))
    assert int(pool.tags[2]) == 7
