"""Host tier: round trip against a copy, time to first token against recomputing, idle cost.

Three parts (``--parts``, all by default), one JSON object (``--json``) or tables.

**roundtrip** (``roundtrip_over_copy``): store plus load of a page bundle against a plain torch
copy of its bytes.

A bf16 pool shaped like a small model's (24 layers, 8 KV heads, head_dim 64, 16-token pages:
0.75 MiB per page over all layers) holds runs of 1 and 16 written pages. In lockstep, each step:

- ``tier``: ``HostTier.clear()``, ``put(bundle)`` (a copy into the tier's slab), ``get(keys)``
  (a gather out of it and the BLAKE2b digest check of every page);
- ``copy``: the same bytes, ``[layers, pages, bytes]`` uint8, ``copy_`` into a preallocated
  host buffer and ``clone`` back (the plain copy there and back, allocating like ``get``);
- ``digest``: ``page_digests`` of the loaded bundle alone (the check's share of ``tier``).

Medians over ``--repeat`` steps. ``roundtrip_over_copy`` = copy / tier (goal >= 0.5).

**ttft** (``ttft_recompute_over_tier``): SmolLM2-135M-Instruct on the CPU, kvmem's
transformers engine (``kvmem.integrations.engine``), one request at a time, greedy, one new
token. Two engines on pools of ``--prompt-len`` + 1 tokens, one with a host tier, one without:
a returning prompt of ``--prompt-len`` random tokens is served once (its pages committed to the
device's prefix cache), then, each repeat, another request's admission takes every page of the
pool (admitted and released, never run: it only evicts; with the tier the evicted pages are
stored) and the prompt returns: with the tier its full pages but the last are loaded (the last
prompt token is always computed), without it the whole prompt is prefilled. The engines run in
lockstep, the first rotating. ``ttft_recompute_over_tier`` = median recompute TTFT / median
tier TTFT (goal > 1); ``paired_ttft_recompute_over_tier`` the median of per-repeat ratios.
Shorter prompts (``--lengths``) are measured the same way.

Where the load-or-recompute choice switches: loading ``n`` pages is timed alone
(``HostTier.get`` with its digest checks + ``PageBundle.write_into`` the pool, n = 1, 4, 16,
64) and modelled as ``a + b n`` (``b`` the slope between 16 and 64 pages; ``a`` at most the
time of one page, an upper bound); recomputing a prefix of ``L`` tokens costs ``L / rate`` on
top of the forward that computes the last page anyway, with ``rate`` = prefix tokens /
(recompute TTFT - (tier TTFT - load time)) at ``--prompt-len``. Load time equals recompute
time at ``L* = a / (1 / rate - b / P)`` tokens of prefix, P = 16 tokens a page
(``switch_prefix_tokens_at_most``, from the upper bound of ``a``; below one page: the tier
wins for every page it can serve; null: recomputing is always faster).

**idle** (``idle_tier_step_ratio``): bench_manager.py's decode trace (batch 256, 1% of requests
replaced per step by a 500..2,000-token prompt) on two managers with a page pool, tracker
``checking``, one with a host tier configured, one without, in lockstep; the pool is large
enough that the prefix cache never evicts, so the tier stores and loads nothing (checked).
``idle_tier_step_ratio`` = median decode step (reserve + verify + commit_batch of the batch)
with the tier / without (goal <= 1.03); ``idle_tier_step_total_ratio`` adds the replacements'
admissions (which look the prompt up in the tier too).

    taskset -c 1 python benchmarks/bench_offload.py [--json] [--parts roundtrip,ttft,idle]
        [--repeat 30] [--ttft-repeat 7] [--prompt-len 1024] [--lengths 64,256] [--steps 1000]
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from kvmem import PagePool, PoolSpec
from kvmem.allocator._prefix_keys import PrefixKeys
from kvmem.cli.args import Parser, number
from kvmem.manager import KVCacheManager
from kvmem.transfer import CacheIdentity, HostTier, PageBundle, page_digests

PAGE = 16

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


# -- ttft: a returning prompt served from the host tier against the same prompt recomputed ------


def returning_prompt(model: Any, tokenizer: Any, length: int, repeats: int, chunk: int,
                     kv_dtype: str, seed: int) -> dict[str, Any]:
    """TTFT of a returning ``length``-token prompt, from the host tier and recomputed."""
    from kvmem.integrations.engine import Engine, Request
    from kvmem.integrations.hf import PagedCausalLM

    rng = np.random.default_rng(seed)
    vocab = int(tokenizer.vocab_size)
    prompt = rng.integers(100, vocab, length).tolist()
    num_pages = -(-(length + 1) // PAGE)
    engines = {}
    for name in ("tier", "recompute"):
        lm = PagedCausalLM.build(model, num_pages, kv_dtype)
        tier = (HostTier(num_pages * lm.pool.spec.bytes_per_page,
                         CacheIdentity.of(lm.pool.spec, "SmolLM2-135M-Instruct", "bench"))
                if name == "tier" else None)
        mgr = KVCacheManager(num_pages, page_size=PAGE, max_seqs=1, pool=lm.pool, offload=tier)
        engines[name] = Engine(lm, mgr, max_num_batched_tokens=chunk, chunk_size=chunk)

    def serve(engine: Any, rid: str) -> Any:
        r = Request(rid, prompt, max_new_tokens=1)
        engine.run({0: [r]})
        return r

    def evict(engine: Any, rid: str) -> None:  # another admission takes every page
        mgr = engine.manager
        other = rng.integers(100, vocab, num_pages * PAGE - 1)
        mgr.admit(rid, other)
        mgr.release(rid)

    for name, engine in engines.items():
        serve(engine, f"{name}-first")
    ttft: dict[str, list[float]] = {"tier": [], "recompute": []}
    host_tokens, cached, first = set(), set(), set()
    names = list(engines)
    for i in range(repeats + 1):  # the first repeat warms up, untimed
        for name in names[i % 2:] + names[: i % 2]:
            engine = engines[name]
            evict(engine, f"{name}-other-{i}")
            r = serve(engine, f"{name}-{i}")
            if i:
                ttft[name].append(r.ttft_s)
            cached.add((name, r.num_cached_tokens))
            host_tokens.add((name, r.num_host_tokens))
            first.add(r.output_ids[0])
    served = (length - 1) // PAGE * PAGE
    assert cached == {("tier", served), ("recompute", 0)}, cached
    assert host_tokens == {("tier", served), ("recompute", 0)}, host_tokens
    for engine in engines.values():
        engine.manager.check()
    tier_s, rec_s = statistics.median(ttft["tier"]), statistics.median(ttft["recompute"])
    return {"prompt_len": length, "host_tokens": served, "repeats": repeats,
            "ttft_tier_ms": round(tier_s * 1e3, 2), "ttft_recompute_ms": round(rec_s * 1e3, 2),
            "ttft_recompute_over_tier": round(rec_s / tier_s, 2),
            "paired_ttft_recompute_over_tier": round(statistics.median(
                r / t for r, t in zip(ttft["recompute"], ttft["tier"], strict=True)), 2),
            "same_first_token": len(first) == 1}


def load_times(model: Any, kv_dtype: str, repeat: int) -> tuple[dict[int, float], int]:
    """Seconds (median) to load ``n`` pages from a HostTier into the pool, by ``n``; and the
    bytes of a page."""
    from kvmem.integrations.hf import PagedCausalLM

    sizes = (1, 4, 16, 64)
    lm = PagedCausalLM.build(model, 2 * max(sizes), kv_dtype)
    pool, spec = lm.pool, lm.pool.spec
    g = torch.Generator().manual_seed(0)
    pool.page_bytes.copy_(torch.randint(0, 256, pool.page_bytes.shape, dtype=torch.uint8,
                                        generator=g))
    identity = CacheIdentity.of(spec, "SmolLM2-135M-Instruct", "bench")
    tier = HostTier(max(sizes) * spec.bytes_per_page, identity)
    tokens = np.arange(PAGE * max(sizes), dtype=np.int64) + 1000
    pk = PrefixKeys(seed=1, page_size=PAGE)
    keys = pk.prompt_keys(tokens, pk.root(None))
    tier.put(PageBundle.of(pool, np.arange(max(sizes)), tokens, identity, None, keys))
    dest = np.arange(max(sizes), 2 * max(sizes), dtype=np.int32)
    out = {}
    for n in sizes:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            bundle = tier.get(keys[:n])
            assert bundle is not None and bundle.num_pages == n
            bundle.write_into(pool, dest[:n])
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
    return out, spec.bytes_per_page


def switch_point(loads: dict[int, float], page_bytes: int, row: dict[str, Any]
                 ) -> dict[str, Any]:
    """Load time ``a + b n`` against recomputing at the measured rate; where they cross."""
    # The slope between the two largest loads; the fixed part, at most what one page costs
    # (a line fitted through noisy small loads can give a negative fixed cost).
    (n1, t1), (n2, t2) = sorted(loads.items())[-2:]
    b = (t2 - t1) / (n2 - n1)
    a = loads[min(loads)]  # an upper bound of the fixed cost: the switch is at most where
    served = row["host_tokens"]  # this line crosses the recompute line
    load_s = a + b * served / PAGE
    suffix_s = row["ttft_tier_ms"] / 1e3 - load_s  # the last page's forward, and the rest
    rate = served / (row["ttft_recompute_ms"] / 1e3 - suffix_s)
    per_token = 1 / rate - b / PAGE  # recompute minus load, per prefix token
    switch = a / per_token if per_token > 0 else None
    return {"load_us_one_page": round(a * 1e6, 1), "load_us_per_page": round(b * 1e6, 2),
            "load_us_by_pages": {k: round(v * 1e6, 1) for k, v in loads.items()},
            "tier_load_gb_s": round(page_bytes / b / 1e9, 2) if b > 0 else None,
            "prefill_tokens_per_s": round(rate, 1),
            "recompute_over_load_per_page": round(PAGE / rate / b, 1) if b > 0 else None,
            "switch_prefix_tokens_at_most": None if switch is None else round(switch, 2)}


def ttft_part(args: Any) -> dict[str, Any]:
    from kvmem.integrations.hf import load_smollm2

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, tokenizer = load_smollm2()
    rows = [returning_prompt(model, tokenizer, n, args.ttft_repeat, args.chunk, args.kv_dtype,
                             seed=n) for n in sorted({*args.lengths, args.prompt_len})]
    main_row = next(r for r in rows if r["prompt_len"] == args.prompt_len)
    loads, page_bytes = load_times(model, args.kv_dtype, args.repeat)
    switch = switch_point(loads, page_bytes, main_row)
    return {"kv_dtype": args.kv_dtype, "chunk": args.chunk, "page_bytes": page_bytes,
            "ttft_rows": rows, "ttft_recompute_over_tier": main_row["ttft_recompute_over_tier"],
            "paired_ttft_recompute_over_tier": main_row["paired_ttft_recompute_over_tier"],
            **switch}


# -- idle: the decode step with a tier configured but idle ---------------------------------------


def idle_part(args: Any) -> dict[str, Any]:
    from bench_manager import KvmemDecode, decode_trace, lockstep  # (benchmarks/ is sys.path[0])

    prompts, steps = decode_trace(args.seed, args.steps, args.batch)
    written = sum(-(-p.size // PAGE) for p in prompts) + sum(
        -(-p.size // PAGE) for _, new in steps for p in new)
    num_pages = written + args.batch * (-(-args.steps // PAGE) + 1)  # the prefix cache never evicts
    spec = PoolSpec(num_pages=num_pages, page_size=PAGE, num_layers=1, num_kv_heads=1,
                    head_dim=1, dtype="bf16", device="cpu")
    tier = HostTier(1024 * spec.bytes_per_page, CacheIdentity.of(spec, "bench", "w"))
    with_tier = KvmemDecode(prompts, steps, "checking", num_pages,
                            partial(KVCacheManager, pool=PagePool(spec), offload=tier))
    without = KvmemDecode(prompts, steps, "checking", num_pages,
                          partial(KVCacheManager, pool=PagePool(spec)))
    lockstep([with_tier, without], len(steps))
    stats = with_tier.mgr.stats()
    assert stats.num_evictions == 0 and stats.offload is not None
    idle = stats.offload.tier
    assert idle.bytes_stored == idle.bytes_loaded == idle.hit_pages == 0, idle

    def med(runner: Any, key: str) -> float:
        return statistics.median(runner.times[key])

    return {"batch": args.batch, "steps": args.steps, "num_pages": num_pages,
            "decode_step_us_tier": round(med(with_tier, "decode"), 1),
            "decode_step_us_no_tier": round(med(without, "decode"), 1),
            "idle_tier_step_ratio": round(med(with_tier, "decode") / med(without, "decode"), 3),
            "paired_idle_tier_step_ratio": round(statistics.median(
                a / b for a, b in zip(with_tier.times["decode"], without.times["decode"],
                                      strict=True)), 3),
            "step_total_us_tier": round(med(with_tier, "step"), 1),
            "step_total_us_no_tier": round(med(without, "step"), 1),
            "idle_tier_step_total_ratio": round(med(with_tier, "step") / med(without, "step"),
                                                3)}


def _list(kind: type, choices: tuple[str, ...] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items or (choices and any(x not in choices for x in items)):
            raise ValueError(text)
        values = [kind(x) for x in items]
        if kind is int and any(v < 2 for v in values):
            raise ValueError(text)
        return values

    parse.__name__ = "comma-separated list"
    return parse


def main() -> None:
    parser = Parser(prog="bench_offload.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--parts", type=_list(str, ("roundtrip", "ttft", "idle")),
                        default=["roundtrip", "ttft", "idle"])
    parser.add_argument("--repeat", type=number(int, 1), default=30)
    parser.add_argument("--layers", type=number(int, 1), default=24)
    parser.add_argument("--ttft-repeat", type=number(int, 1), default=7)
    parser.add_argument("--prompt-len", type=number(int, 2), default=1024)
    parser.add_argument("--lengths", type=_list(int), default=[64, 256])
    parser.add_argument("--chunk", type=number(int, 1), default=512,
                        help="prefill chunk and token budget of the engine (default 512)")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8_e4m3"), default="bf16")
    parser.add_argument("--steps", type=number(int, 1), default=1000)
    parser.add_argument("--batch", type=number(int, 1), default=256)
    parser.add_argument("--seed", type=number(int, 0), default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                   f"{platform.python_version()}, torch {torch.__version__}"}
    if "roundtrip" in args.parts:
        rows = [measure(args.layers, n, args.repeat) for n in SIZES]
        out.update({"repeat": args.repeat, "rows": rows, "roundtrip_over_copy":
                    {r["pages"]: r["roundtrip_over_copy"] for r in rows}})
    if "ttft" in args.parts:
        out["ttft"] = ttft_part(args)
        out["ttft_recompute_over_tier"] = out["ttft"]["ttft_recompute_over_tier"]
    if "idle" in args.parts:
        out["idle"] = idle_part(args)
        out["idle_tier_step_ratio"] = out["idle"]["idle_tier_step_ratio"]
    if args.json:
        print(json.dumps(out, indent=1))
        return
    if "roundtrip" in args.parts:
        print("pages  MiB    tier us  copy us  digest us  copy/tier  digest share")
        for r in out["rows"]:
            print(f"{r['pages']:5d}  {r['bytes'] / 2**20:5.2f}  {r['tier_us']:8.0f}  "
                  f"{r['copy_us']:7.0f}  {r['digest_us']:9.0f}  {r['roundtrip_over_copy']:9.3f}  "
                  f"{r['digest_share']:12.2f}")
    if "ttft" in args.parts:
        t = out["ttft"]
        print("prompt  host tokens  tier TTFT ms  recompute TTFT ms  recompute/tier  paired")
        for r in t["ttft_rows"]:
            print(f"{r['prompt_len']:6d}  {r['host_tokens']:11d}  {r['ttft_tier_ms']:12.1f}  "
                  f"{r['ttft_recompute_ms']:17.1f}  {r['ttft_recompute_over_tier']:14.2f}  "
                  f"{r['paired_ttft_recompute_over_tier']:6.2f}")
        print(f"load: at most {t['load_us_one_page']} us + {t['load_us_per_page']} us/page "
              f"({t['tier_load_gb_s']} GB/s); prefill {t['prefill_tokens_per_s']} tok/s; "
              f"load = recompute at <= {t['switch_prefix_tokens_at_most']} prefix tokens")
    if "idle" in args.parts:
        i = out["idle"]
        print(f"decode step, batch {i['batch']}: {i['decode_step_us_tier']} us with an idle "
              f"tier, {i['decode_step_us_no_tier']} us without: {i['idle_tier_step_ratio']} "
              f"(paired {i['paired_idle_tier_step_ratio']}); with admissions "
              f"{i['idle_tier_step_total_ratio']}")


if __name__ == "__main__":
    main()
