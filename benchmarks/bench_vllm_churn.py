"""vLLM 0.33's ``Scheduler`` on kvmem under churn: requests finish and join every step (JSON).

The decode benchmark (``bench_vllm_scheduler.py``) keeps its 256 requests for 300 steps; a
serving batch does not. Here 256 requests run, each with ``max_tokens`` drawn from 50..400, and
each one that finishes is replaced at once by a new ~600-token prompt (a quarter share a
256-token prefix), so every step or two a request leaves the middle of vLLM's running list and
one joins at its end (prefilled in the scheduler's chunks beside the decodes). vLLM's own
manager and kvmem's run the same stream in lockstep; ``mismatched_steps`` counts steps whose
``num_scheduled_tokens`` differ. After ``--warmup`` steps, ``--steps`` are measured:

* ``vllm_step_us_median`` / ``kvmem_step_us_median`` / ``step_speedup``: ``schedule()`` +
  ``update_from_output()``;
* ``vllm_kv_us_median`` / ``kvmem_kv_us_median`` / ``kv_speedup``: the time inside the KV cache
  manager per step (its methods and the block objects' ``get_block_ids``, outermost calls, as
  ``bench_vllm_scheduler.py`` times them; the timers run in this same pass, so the step
  figures include their cost, a fraction of a microsecond a call, on both sides);
* ``kvmem_flush_us_median``: the adapter's flush (reserve, verify, commit), per call;
* ``verify_paths``: which path of kvmem's verifier answered (``VerifierStats``): a decode step
  proved spliced checks only its new pages, one restarted checks every entry.

    PYTHONPATH=/tmp/vllm_env/site:/tmp/vllm_env/deps taskset -c 1 \\
        python benchmarks/bench_vllm_churn.py [--steps 400] [--requests 256]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    from kvmem.cli.args import Parser, number

    # kvmem's parser: a bad option is one line on stderr and exit status 2, before any work.
    p = Parser(prog="bench_vllm_churn.py", description=__doc__.split("\n")[0])
    # The scheduler batches 8192 tokens a step, and vLLM needs max_num_seqs at most that.
    p.add_argument("--requests", type=number(int, 1, maximum=8192), default=256,
                   help="running requests (1 to 8192)")
    p.add_argument("--steps", type=number(int, 1), default=400,
                   help="steps measured (at least 1)")
    p.add_argument("--warmup", type=number(int, 0), default=200,
                   help="steps run before measuring (at least 0)")
    p.add_argument("--seed", type=number(int), default=0)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option (its one line already printed)
        return int(exc.code or 0)
    try:
        from kvmem.integrations.vllm import bench
        from kvmem.integrations.vllm.conformance import SchedulerSpec, make_scheduler
    except ImportError as e:
        print(f"vLLM is not importable ({e}); run benchmarks/setup_vllm_cpu.sh", file=sys.stderr)
        return 1
    n, block = args.requests, 16
    spec = SchedulerSpec(num_blocks=n * 80 + 64, block_size=block, max_num_seqs=n,
                         max_num_batched_tokens=8192, max_model_len=2048,
                         enable_prefix_caching=True, kv_events=False)
    scheds = {w: make_scheduler(spec, kvmem=w == "kvmem", log_stats=True)
              for w in ("vllm", "kvmem")}
    total = args.warmup + args.steps
    # Enough prompts for every replacement: a request lives at least 50 steps (max_tokens), so
    # at most n per 50 steps finish (2 a step ran out past ~450 requests). The first prompts
    # are the same whatever the count.
    prompts = bench._requests(n + total * max(2, -(-n // 50)), 600, 256, 0, block, args.seed)
    rng = random.Random(args.seed)
    arrivals = [(rid, prompt, rng.randint(50, 400)) for rid, prompt in prompts]
    added = {w: 0 for w in scheds}

    def top_up(name: str, s: Any) -> None:
        while len(s.running) + len(s.waiting) < n:
            rid, prompt, max_tokens = arrivals[added[name]]
            s.add_request(bench._make(rid, prompt, max_tokens, block))
            added[name] += 1

    timers = {w: bench._KVTimer() for w in scheds}
    undo = [bench._instrument(s, timers[w], w == "kvmem") for w, s in scheds.items()]
    kv: dict[str, list[int]] = {w: [] for w in scheds}
    adapter = scheds["kvmem"].kv_cache_manager
    flushes: list[float] = []
    flush = adapter.flush

    def timed_flush() -> None:
        t = time.perf_counter()
        flush()
        flushes.append(time.perf_counter() - t)

    adapter.flush = timed_flush
    steps: dict[str, list[float]] = {w: [] for w in scheds}
    mismatched = 0
    before = adapter.manager.verifier.stats
    for i in range(total):
        if i == args.warmup:
            before = adapter.manager.verifier.stats
            flushes.clear()
            for v in (*steps.values(), *kv.values()):
                v.clear()
        outs = {}
        for name, s in scheds.items():
            top_up(name, s)
            timers[name].total_ns = 0
            t = time.perf_counter()
            outs[name] = bench._step(s)
            steps[name].append(time.perf_counter() - t)
            kv[name].append(timers[name].total_ns)
        mismatched += outs["vllm"].num_scheduled_tokens != outs["kvmem"].num_scheduled_tokens
    after = adapter.manager.verifier.stats
    for u in undo:
        u()
    vllm_kv, kvmem_kv = (statistics.median(kv[w]) / 1e3 for w in ("vllm", "kvmem"))
    vllm_us = statistics.median(steps["vllm"]) * 1e6
    kvmem_us = statistics.median(steps["kvmem"]) * 1e6
    print(json.dumps({
        "requests": n, "steps": args.steps, "requests_added": added["kvmem"],
        "mismatched_steps": mismatched,
        "vllm_step_us_median": round(vllm_us, 1), "kvmem_step_us_median": round(kvmem_us, 1),
        "step_speedup": round(vllm_us / kvmem_us, 3),
        "vllm_kv_us_median": round(vllm_kv, 1), "kvmem_kv_us_median": round(kvmem_kv, 1),
        "kv_speedup": round(vllm_kv / kvmem_kv, 3),
        "kvmem_flush_us_median": round(statistics.median(flushes) * 1e6, 1),
        "verify_paths": {k: getattr(after, k) - getattr(before, k) for k in after._fields},
        "load_average": round(os.getloadavg()[0], 2),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
