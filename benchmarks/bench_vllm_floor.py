"""The numpy floor inside vLLM's scheduler loop: the most KV-time speedup over vLLM's manager
that a numpy-only manager could reach on issue #13's workload (prints one JSON object).

``bench_vllm_scheduler.py``'s decode workload (``--requests`` 256 of ~1,000-token prompts, a quarter
sharing a 512-token prefix, decode at batch 256), vLLM's ``Scheduler`` on its own manager and
on kvmem's in lockstep, every call into the KV cache manager timed (as that benchmark's second
pass). After each pair of steps, the numpy floor's decode step (``bench_floor.FloorDecode``:
the least numpy work a step of 256 requests needs, with no argument checks, hooks, events,
fences, namespaces, LRU or generations) runs and is timed in the same loop, whose cache the
schedulers have just used; then the floor alone, back to back (warm).

Keys (medians, microseconds per step): ``vllm_kv_us`` / ``kvmem_kv_us`` (time inside each KV
cache manager), ``kvmem_flush_us`` (kvmem's batched reserve, verify and commit, inside that)
and ``kvmem_per_request_us`` (the rest: the adapter's per-request calls, ``allocate_slots``
for each of the 256 requests above all), ``floor_step_us`` (the floor in the loop),
``floor_step_warm_us``, and ``kv_speedup_bound = vllm_kv_us / (floor_step_us +
kvmem_per_request_us)``: the KV-time speedup of an adapter whose flush cost no more than the
floor and whose per-request calls cost what kvmem's do now. ``kv_speedup`` is kvmem's own.

    PYTHONPATH=/tmp/vllm_env/site:/tmp/vllm_env/deps taskset -c 1 \\
        python benchmarks/bench_vllm_floor.py [--decode-steps 300] [--requests 256]
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import numpy as np
from bench_floor import FloorDecode

from kvmem.cli.args import Parser, number


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="bench_vllm_floor.py", description=__doc__.split("\n")[0])
    p.add_argument("--decode-steps", type=number(int, 1, maximum=100_000), default=300)
    p.add_argument("--requests", type=number(int, 1, maximum=4096), default=256)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option (one line on stderr)
        return int(exc.code or 0)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout
    from kvmem.integrations.vllm import vllm_import_error

    error = vllm_import_error()
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    from kvmem.integrations.vllm import bench
    from kvmem.integrations.vllm.conformance import SchedulerSpec, make_scheduler

    n, prompt_len, block, steps = args.requests, 1000, 16, args.decode_steps
    max_tokens = steps + 2
    spec = SchedulerSpec(
        num_blocks=n * -(-(prompt_len * 11 // 10 + max_tokens) // block) + 64, block_size=block,
        max_num_seqs=n, max_num_batched_tokens=8192, max_model_len=prompt_len * 2 + max_tokens,
        enable_prefix_caching=True, kv_events=False)
    scheds = {name: make_scheduler(spec, kvmem=name == "kvmem", log_stats=True)
              for name in ("vllm", "kvmem")}
    for sched in scheds.values():
        for rid, prompt in bench._requests(n, prompt_len, 512, max_tokens, block, 0):
            sched.add_request(bench._make(rid, prompt, max_tokens, block))
    bench._prefill(scheds, n)
    timer_ns = bench.timer_ns_per_call()
    timers = {name: bench._KVTimer() for name in scheds}
    for name, sched in scheds.items():
        bench._instrument(sched, timers[name], name == "kvmem")
    adapter = scheds["kvmem"].kv_cache_manager
    flush_ns = [0]
    timed_flush = adapter.flush

    def flush() -> None:  # (timed whether or not another adapter method called it)
        t0 = time.perf_counter_ns()
        try:
            timed_flush()
        finally:
            flush_ns[0] += time.perf_counter_ns() - t0

    adapter.flush = flush
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 30000, size=int(rng.integers(900, 1100))) for _ in range(n)]
    pages = n * (-(-(1100 + 2 * steps) // block) + 2) + 1024
    cold, warm = FloorDecode(prompts, steps, pages), FloorDecode(prompts, steps, pages)
    kv: dict[str, list[float]] = {name: [] for name in (*scheds, "flush")}
    mismatched = 0
    gc.collect()
    for i in range(steps):
        outs = {}
        for name in (("vllm", "kvmem") if i % 2 == 0 else ("kvmem", "vllm")):
            timer = timers[name]
            kv0, calls0, f0 = timer.total_ns, timer.calls, flush_ns[0]
            outs[name] = bench._step(scheds[name])
            kv[name].append((timer.total_ns - kv0 - (timer.calls - calls0) * timer_ns) / 1e3)
            if name == "kvmem":
                kv["flush"].append((flush_ns[0] - f0) / 1e3)
        mismatched += outs["vllm"].num_scheduled_tokens != outs["kvmem"].num_scheduled_tokens
        cold.step(i)
    for i in range(steps):
        warm.step(i)
    med = statistics.median
    per_request = med(a - b for a, b in zip(kv["kvmem"], kv["flush"]))
    floor = med(cold.times["decode"])
    result = {
        "batch": n, "decode_steps": steps, "mismatched_steps": mismatched,
        "vllm_kv_us": round(med(kv["vllm"]), 1), "kvmem_kv_us": round(med(kv["kvmem"]), 1),
        "kvmem_flush_us": round(med(kv["flush"]), 1),
        "kvmem_per_request_us": round(per_request, 1),
        "floor_step_us": round(floor, 1),
        "floor_step_warm_us": round(med(warm.times["decode"]), 1),
        "kv_speedup": round(med(kv["vllm"]) / med(kv["kvmem"]), 3),
        "kv_speedup_bound": round(med(kv["vllm"]) / (floor + per_request), 3),
        "load_average_1m": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
