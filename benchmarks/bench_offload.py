"""Host tier round trip: store plus load of a page bundle against a plain torch copy of its bytes.

A bf16 pool shaped like a small model's (24 layers, 8 KV heads, head_dim 64, 16-token pages:
0.75 MiB per page over all layers) holds runs of 1 and 16 written pages. In lockstep, each step:

- ``tier``: ``HostTier.clear()``, ``put(bundle)`` (a copy into the tier's slab), ``get(keys)``
  (a gather out of it and the BLAKE2b digest check of every page);
- ``copy``: the same bytes, ``[layers, pages, bytes]`` uint8, ``copy_`` into a preallocated
  host buffer and ``clone`` back (the plain copy there and back, allocating like ``get``);
- ``digest``: ``page_digests`` of the loaded bundle alone (the check's share of ``tier``).

Medians over ``--repeat`` steps. ``roundtrip_over_copy`` = copy / tier (goal >= 0.5).

    taskset -c 1 python benchmarks/bench_offload.py [--json] [--repeat 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvmem import PagePool, PoolSpec
from kvmem.allocator._prefix_keys import PrefixKeys
from kvmem.transfer import CacheIdentity, HostTier, PageBundle, page_digests

SIZES = (1, 16)


def setup(num_layers: int, pages: int) -> tuple[PageBundle, np.ndarray, HostTier, torch.Tensor]:
    spec = PoolSpec(num_pages=pages + 4, page_size=16, num_layers=num_layers, num_kv_heads=8,
                    head_dim=64, dtype="bf16", device="cpu")
    pool = PagePool(spec)
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(16 * pages, dtype=torch.int64)
    for layer in range(num_layers):
        k, v = (torch.randn(len(slots), 8, 64, generator=g).bfloat16() for _ in range(2))
        pool.write(layer, slots, k, v)
    tokens = np.arange(16 * pages, dtype=np.int64) + 1000
    pk = PrefixKeys(seed=1, page_size=16)
    keys = pk.prompt_keys(tokens, pk.root(None))
    identity = CacheIdentity.of(spec, "bench", "w")
    bundle = PageBundle.of(pool, np.arange(pages), tokens, identity, None, keys)
    tier = HostTier(pages * spec.bytes_per_page, identity)
    return bundle, keys, tier, torch.from_numpy(bundle.pages["data"].copy())


def measure(num_layers: int, pages: int, repeat: int) -> dict[str, Any]:
    bundle, keys, tier, src = setup(num_layers, pages)
    buffer = torch.empty_like(src)
    times: dict[str, list[float]] = {"tier": [], "copy": [], "digest": []}
    for _ in range(repeat):
        tier.clear()
        t0 = time.perf_counter()
        tier.put(bundle)
        got = tier.get(keys)
        t1 = time.perf_counter()
        buffer.copy_(src)
        back = buffer.clone()
        t2 = time.perf_counter()
        assert got is not None and got.num_pages == pages and torch.equal(back, src)
        page_digests(got.pages, got.token_ids, got.static_scales)
        t3 = time.perf_counter()
        times["tier"].append(t1 - t0)
        times["copy"].append(t2 - t1)
        times["digest"].append(t3 - t2)
    us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    nbytes = src.numel()
    return {"pages": pages, "bytes": nbytes, "tier_us": round(us["tier"], 1),
            "copy_us": round(us["copy"], 1), "digest_us": round(us["digest"], 1),
            "roundtrip_over_copy": round(us["copy"] / us["tier"], 3),
            "digest_share": round(us["digest"] / us["tier"], 3),
            "tier_gb_s": round(2 * nbytes / us["tier"] / 1e3, 2),
            "copy_gb_s": round(2 * nbytes / us["copy"] / 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(args.layers, n, args.repeat) for n in SIZES]
    out = {"machine": platform.machine(), "torch": torch.__version__, "repeat": args.repeat,
           "rows": rows,
           "roundtrip_over_copy": {r["pages"]: r["roundtrip_over_copy"] for r in rows}}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print("pages  MiB    tier us  copy us  digest us  copy/tier  digest share")
    for r in rows:
        print(f"{r['pages']:5d}  {r['bytes'] / 2**20:5.2f}  {r['tier_us']:8.0f}  "
              f"{r['copy_us']:7.0f}  {r['digest_us']:9.0f}  {r['roundtrip_over_copy']:9.3f}  "
              f"{r['digest_share']:12.2f}")


if __name__ == "__main__":
    main()
