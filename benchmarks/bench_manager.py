"""Manager benchmark: the decode-step trace and a shared-prompt admission trace. Prints JSON.

Decode-step trace (issue 2's): batch 256, page size 16, 2000 steps; every running request gains
one token per step; 1% of requests finish each step and are replaced by one with a
500..2000-token prompt (seeded, random tokens). Per step, as an engine does: ``release`` the
finished requests and ``admit`` + ``reserve`` + ``commit`` their replacements' prompts (one
prefill chunk each), then for the whole batch ``reserve(ids, 1)`` (with the CSR metadata),
``verify(ids, step)`` and ``commit_batch(ids, tokens)``. ``decode_step_us_median`` is that
decode part for the batch (the work vLLM's ``allocate_slots`` loop does per decode step), with
prefix reuse and CheckingTracker on (``..._noop``: NoOpTracker); ``step_total_us_median`` adds
the replacements; ``decode_{reserve,verify,commit}_us_median`` split the decode part.

Shared-prompt trace: 1000 requests sharing a 1024-token system prompt plus 256 own tokens each
(seeded), ~200 running. Per request: ``can_admit`` + ``admit`` (timed together:
``admit_us_median``), then prefill ``reserve`` + ``commit`` (``admit_prefill_us_median`` times
all four) and, later, ``release`` (not timed). Reports the prefix hit rate (cached prompt
tokens / prompt tokens).

Timings are wall-clock medians in microseconds on one core; ``load_average_1min`` says how busy
the machine was (other processes inflate every figure).

If ``import vllm`` works (vLLM 0.33; on a CPU machine see ``setup_vllm_cpu.sh``), the same
traces run through vLLM's KVCacheManager in the same process: ``vllm_decode_step_us_median``
(append the sampled token + ``allocate_slots(req, 1)`` for the 256 requests),
``vllm_admit_us_median`` (``get_computed_blocks`` + ``allocate_slots`` for the prompt; vLLM hashes
the prompt's blocks earlier, in ``Request()``: ``vllm_admit_hash_us_median``, and
``vllm_admit_with_hash_us_median`` is the sum) and the ratios ``*_speedup_vs_vllm`` (vLLM's time
over kvmem's: above 1, kvmem is faster). Without vLLM that part is skipped.

    python benchmarks/bench_manager.py [--steps 2000] [--batch 256] [--requests 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import numpy as np

from kvmem.manager import KVCacheManager

PAGE_SIZE = 16


def decode_trace(seed: int, steps: int, batch: int
                 ) -> tuple[list[np.ndarray], list[tuple[np.ndarray, list[np.ndarray]]]]:
    """Initial prompts, then per step: finishing batch slots and their replacements' prompts."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 32000, size=n).astype(np.int32)
               for n in rng.integers(500, 2001, size=batch)]
    out = []
    for _ in range(steps):
        done = rng.choice(batch, size=rng.binomial(batch, 0.01), replace=False)
        out.append((done, [rng.integers(0, 32000, size=n).astype(np.int32)
                           for n in rng.integers(500, 2001, size=done.size)]))
    return prompts, out


def run_decode(prompts: list[np.ndarray], steps: list, tracker: str | None,
               num_pages: int) -> dict[str, list[float]]:
    batch = len(prompts)
    mgr = KVCacheManager(num_pages=num_pages, page_size=PAGE_SIZE, max_seqs=batch,
                         max_pages_per_seq=512, prefix_cache="hashed", tracker=tracker)
    ids: list[int] = list(range(batch))
    next_id = batch

    def start(rid: int, prompt: np.ndarray) -> None:
        res = mgr.admit(rid, prompt)
        mgr.reserve([rid], prompt.size - res.num_cached_tokens)
        mgr.commit(rid, prompt[res.num_cached_tokens:])

    for rid, prompt in zip(ids, prompts):
        start(rid, prompt)
    tokens = np.ones(batch, dtype=np.int32)
    times: dict[str, list[float]] = {k: [] for k in
                                     ("step", "decode", "replace", "reserve", "verify", "commit")}
    clock = time.perf_counter
    for done, new_prompts in steps:
        t0 = clock()
        for slot, prompt in zip(done.tolist(), new_prompts):
            mgr.release(ids[slot])
            ids[slot] = next_id
            start(next_id, prompt)
            next_id += 1
        t1 = clock()
        step = mgr.reserve(ids, 1)
        t2 = clock()
        report = mgr.verify(ids, step)
        t3 = clock()
        mgr.commit_batch(ids, tokens)
        t4 = clock()
        assert report.ok
        for key, us in (("replace", t1 - t0), ("decode", t4 - t1), ("step", t4 - t0),
                        ("reserve", t2 - t1), ("verify", t3 - t2), ("commit", t4 - t3)):
            times[key].append(us * 1e6)
    mgr.check()
    return times


def shared_prompt_trace(seed: int, num_requests: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32000, size=1024).astype(np.int32)
    return system, [np.concatenate([system, rng.integers(0, 32000, size=256).astype(np.int32)])
                    for _ in range(num_requests)]


def run_shared(prompts: list[np.ndarray], tracker: str | None) -> dict[str, Any]:
    mgr = KVCacheManager(num_pages=256 * 96, page_size=PAGE_SIZE, max_seqs=256,
                         max_pages_per_seq=128, tracker=tracker)
    admit_us: list[float] = []
    prefill_us: list[float] = []  # can_admit + admit + the prompt's reserve + commit
    live: list[int] = []
    for rid, prompt in enumerate(prompts):
        if len(live) == 200:  # keep ~200 running; the oldest finish
            mgr.release(live.pop(0))
        t0 = time.perf_counter()
        ok = mgr.can_admit(prompt)  # an engine asks first, then admits
        res = mgr.admit(rid, prompt)
        t1 = time.perf_counter()
        assert ok
        admit_us.append((t1 - t0) * 1e6)
        mgr.reserve([rid], prompt.size - res.num_cached_tokens)
        mgr.commit(rid, prompt[res.num_cached_tokens:])
        prefill_us.append((time.perf_counter() - t0) * 1e6)
        live.append(rid)
    mgr.check()
    s = mgr.stats()
    return {"admit_us": admit_us, "prefill_us": prefill_us, "hit_rate": s.prefix_hit_rate}


def median(values: list[float]) -> float:
    return round(float(np.median(values)), 2)


def run_vllm(prompts: list[np.ndarray], steps: list, shared: list[np.ndarray]
             ) -> dict[str, Any] | None:
    """The same traces through vLLM's v1 KVCacheManager, when vLLM imports (best effort: its
    internal API moves between releases; a mismatch is reported, not raised)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # vLLM absent (or broken): no comparison
        return None
    try:
        return _vllm_traces(prompts, steps, shared)
    except Exception as e:  # an internal API this harness does not know
        return {"vllm_error": f"{type(e).__name__}: {e}"}


def _vllm_traces(prompts: list[np.ndarray], steps: list, shared: list[np.ndarray]
                 ) -> dict[str, Any]:
    """vLLM 0.33's API, used as its scheduler does: prefix caching on, its default
    ``sha256`` block hash, ``get_computed_blocks`` + ``allocate_slots`` per admission and
    ``allocate_slots(req, 1)`` per running request and decode step."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(PAGE_SIZE, sha256)
    clock = time.perf_counter

    def make(num_blocks: int) -> Any:
        spec = FullAttentionSpec(block_size=PAGE_SIZE, num_kv_heads=1, head_size=64,
                                 dtype=torch.float16)
        page = spec.page_size_bytes
        tensor = KVCacheTensor(size=num_blocks * page, layers=["l0"],
                               layer_stride=num_blocks * page, block_stride=page)
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        return VllmManager(cfg, max_model_len=512 * PAGE_SIZE, enable_caching=True,
                           scheduler_block_size=PAGE_SIZE, hash_block_size=PAGE_SIZE)

    def request(rid: int, prompt: np.ndarray, hashed: bool = True) -> Any:
        return Request(str(rid), prompt.tolist(), SamplingParams(max_tokens=10**6), None,
                       block_hasher=hasher if hashed else None)

    hits = [0, 0]  # cached prompt tokens, prompt tokens (shared-prompt trace)

    def start(mgr: Any, req: Any) -> float:
        t0 = clock()
        blocks, cached, _ = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - cached, cached, blocks) is not None
        t1 = clock()
        req.num_computed_tokens = req.num_tokens
        hits[0] += cached
        hits[1] += req.num_tokens
        return (t1 - t0) * 1e6

    batch = len(prompts)
    mgr = make(batch * 200)
    reqs = [request(i, p) for i, p in enumerate(prompts)]
    for req in reqs:
        start(mgr, req)
    next_id = batch
    decode: list[float] = []
    for done, new_prompts in steps:
        for slot, prompt in zip(done.tolist(), new_prompts):
            mgr.free(reqs[slot])
            reqs[slot] = request(next_id, prompt)
            next_id += 1
            start(mgr, reqs[slot])
        t0 = clock()
        for req in reqs:  # the sampled token (hashed when it fills a block), then its slot
            req.append_output_token_ids(1)
            assert mgr.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        decode.append((clock() - t0) * 1e6)
    mgr2 = make(256 * 96)
    hits[:] = [0, 0]
    admit: list[float] = []
    hashing: list[float] = []
    live: list[Any] = []
    for rid, prompt in enumerate(shared):
        if len(live) == 200:
            mgr2.free(live.pop(0))
        req = request(rid, prompt, hashed=False)
        t0 = clock()  # the prompt's block hashes (vLLM computes them in Request())
        req.block_hashes.extend(hasher(req))
        hashing.append((clock() - t0) * 1e6)
        admit.append(start(mgr2, req))
        live.append(req)
    return {"vllm_decode_step_us_median": median(decode),
            "vllm_admit_us_median": median(admit[1:]),
            "vllm_admit_hash_us_median": median(hashing[1:]),
            "vllm_admit_with_hash_us_median":
                median([a + h for a, h in zip(admit[1:], hashing[1:])]),
            "vllm_prefix_hit_rate": round(hits[0] / hits[1], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts, steps = decode_trace(args.seed, args.steps, args.batch)
    # Enough pages for the running batch and a prefix cache that fills up and evicts.
    num_pages = args.batch * 200
    on = run_decode(prompts, steps, "checking", num_pages)
    off = run_decode(prompts, steps, None, num_pages)
    _system, shared = shared_prompt_trace(args.seed, args.requests)
    sp = run_shared(shared, "checking")
    sp_off = run_shared(shared, None)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, numpy {np.__version__}",
        "load_average_1min": load,
        "batch": args.batch,
        "steps": args.steps,
        "page_size": PAGE_SIZE,
        "decode_step_us_median": median(on["decode"]),
        "decode_step_us_median_noop": median(off["decode"]),
        "step_total_us_median": median(on["step"]),
        "step_total_us_median_noop": median(off["step"]),
        "decode_reserve_us_median": median(on["reserve"]),
        "decode_verify_us_median": median(on["verify"]),
        "decode_commit_us_median": median(on["commit"]),
        "replace_us_median": median(on["replace"]),
        "admit_us_median": median(sp["admit_us"][1:]),
        "admit_us_median_noop": median(sp_off["admit_us"][1:]),
        "admit_prefill_us_median": median(sp["prefill_us"][1:]),
        "admit_prefill_us_median_noop": median(sp_off["prefill_us"][1:]),
        "prefix_hit_rate": round(sp["hit_rate"], 4),
        "issue_reference_vllm_decode_step_us": 2700,
        "issue_reference_vllm_admit_us": 145,
    }
    vllm = run_vllm(prompts, steps, shared)
    if vllm is not None:
        result.update(vllm)
    if vllm is not None and "vllm_error" not in vllm:  # > 1: kvmem is faster
        for key, ours, theirs in (
                ("decode_speedup_vs_vllm", "decode_step_us_median", "vllm_decode_step_us_median"),
                ("admit_speedup_vs_vllm", "admit_us_median", "vllm_admit_us_median"),
                ("admit_prefill_speedup_vs_vllm", "admit_prefill_us_median",
                 "vllm_admit_with_hash_us_median")):
            result[key] = round(result[theirs] / result[ours], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
