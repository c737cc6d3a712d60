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
  ``kvmem_flush_join_us_median`` / ``kvmem_flush_decode_us_median``: per flush with work, those
  that admitted a request (its step's decodes and its prefill) and those that did not;
* ``kvmem_flushes_per_step``: the adapter's flushes that had work (``num_flushes``) per step:
  1 when the decodes and the requests joining go out together;
* ``verify_paths``: which path of kvmem's verifier answered (``VerifierStats``): a decode step
  proved spliced checks only its new pages, one restarted checks every entry;
* ``paired_step_speedup`` / ``paired_kv_speedup``: the median over steps of the same step's
  ratio (vLLM's over kvmem's): a shared machine's slow spell slows both steps of a pair;
* ``joined_per_step``: requests added per measured step.

``--by-call`` adds ``kv_us_by_call``: per manager, the mean microseconds a measured step spends
in each method (outermost calls: kvmem's ``get_block_ids`` includes the flush it starts), and
``kv_calls_by_call``, the calls a step. Its bookkeeping (a dict update per timed call, on both
sides) runs in the same pass, so the other figures of that run include it.

``--sweep`` runs instead a grid of churn rates (0, 1, 2, 8 requests joining per step) and
prompt lengths (128, 512, 1024, 4096 tokens, each prompt within 10% of it, a quarter sharing a
prefix of half that length) and prints, under ``sweep``, one cell per pair with the keys above
plus ``churn_per_step`` and ``prompt_len``. ``--requests`` applies to each cell, and so do
``--steps`` (default 100 with ``--sweep``) and ``--warmup`` (default 20, after the fill).

A rate ``r`` is exact, with vLLM's own finishing (``max_tokens`` reached): every request gets
``max_tokens = requests // r``, at most ``r`` join before each step, and the scheduler's token
budget (``requests + r *`` the longest prompt, at least 8192) prefills each one whole in the
step it joins, so a request stays exactly ``requests // r`` steps. The fill takes that many
steps (``r`` join a step and none finish yet); from then on ``r`` finish and ``r`` join every
step (``joined_per_step`` shows it). Rate 0 is a steady batch: every request joins before the
first step and none finishes; the fill lasts until every prompt is prefilled in the
scheduler's chunks. No request is preempted: the pool holds every request's longest
context.

    PYTHONPATH=/tmp/vllm_env/site:/tmp/vllm_env/deps taskset -c 1 \\
        python benchmarks/bench_vllm_churn.py [--steps 400] [--requests 256] [--sweep]
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import time
from typing import Any

CHURN_RATES = (0, 1, 2, 8)
PROMPT_LENS = (128, 512, 1024, 4096)
BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    from kvmem.cli.args import Parser, number

    # kvmem's parser: a bad option is one line on stderr and exit status 2, before any work.
    p = Parser(prog="bench_vllm_churn.py", description=__doc__.split("\n")[0])
    # The scheduler batches 8192 tokens a step, and vLLM needs max_num_seqs at most that.
    p.add_argument("--requests", type=number(int, 1, maximum=8192), default=256,
                   help="running requests (1 to 8192)")
    p.add_argument("--steps", type=number(int, 1), default=None,
                   help="steps measured (at least 1; default 400, 100 a cell with --sweep)")
    p.add_argument("--warmup", type=number(int, 0), default=None,
                   help="steps run before measuring (at least 0; default 200, with --sweep 20 "
                        "a cell once its churn is steady)")
    p.add_argument("--sweep", action="store_true",
                   help="the grid of churn rates and prompt lengths (module docstring)")
    p.add_argument("--seed", type=number(int), default=0)
    p.add_argument("--by-call", action="store_true",
                   help="also the KV time per method (kv_us_by_call; module docstring)")
    try:
        args = p.parse_args(argv)
        sweep = args.sweep
        n = args.requests
        steps = args.steps or (100 if sweep else 400)
        warmup = args.warmup if args.warmup is not None else (20 if sweep else 200)
        if sweep and n < max(CHURN_RATES):
            p.error(f"argument --requests: expected at least {max(CHURN_RATES)} with --sweep "
                    f"(the highest churn rate), got {n}")
    except SystemExit as exc:  # --help, or a bad option (its one line already printed)
        return int(exc.code or 0)
    try:
        from kvmem.integrations.vllm import bench
        from kvmem.integrations.vllm.conformance import SchedulerSpec
    except ImportError as e:
        print(f"vLLM is not importable ({e}); run benchmarks/setup_vllm_cpu.sh", file=sys.stderr)
        return 1
    if sweep:
        result: dict[str, Any] = {"requests": n, "steps": steps, "warmup": warmup, "sweep": [
            _cell(n, rate, prompt_len, steps, warmup, args.seed)
            for rate in CHURN_RATES for prompt_len in PROMPT_LENS]}
    else:
        spec = SchedulerSpec(num_blocks=n * 80 + 64, block_size=BLOCK, max_num_seqs=n,
                             max_num_batched_tokens=8192, max_model_len=2048,
                             enable_prefix_caching=True, kv_events=False)
        total = warmup + steps
        # Enough prompts for every replacement: a request lives at least 50 steps
        # (max_tokens), so at most n per 50 steps finish (2 a step ran out past ~450
        # requests). The first prompts are the same whatever the count.
        prompts = bench._requests(n + total * max(2, -(-n // 50)), 600, 256, 0, BLOCK,
                                  args.seed)
        rng = random.Random(args.seed)
        arrivals = [(rid, prompt, rng.randint(50, 400)) for rid, prompt in prompts]
        result = _lockstep(spec, arrivals, n, None, warmup, steps, args.by_call)
    result["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))
    return 0


def _cell(n: int, rate: int, prompt_len: int, steps: int, warmup: int,
          seed: int) -> dict[str, Any]:
    """One cell of the sweep: ``rate`` requests join (and finish) every step, prompts of about
    ``prompt_len`` tokens (module docstring)."""
    from kvmem.integrations.vllm import bench
    from kvmem.integrations.vllm.conformance import SchedulerSpec

    longest = prompt_len + prompt_len // 10  # bench._requests: lengths within 10%
    budget = max(8192, n + max(rate, 1) * longest)
    if rate:
        lifetime = n // rate  # steps in flight: prefilled in the first, max_tokens in all
        fill = lifetime  # the first requests finish after their lifetime
    else:
        fill = -(-n * longest // (budget - n)) + 1  # every prompt prefilled in chunks
        lifetime = fill + warmup + steps + 1  # never finishes
    spec = SchedulerSpec(num_blocks=n * -(-(longest + lifetime) // BLOCK) + 64,
                         block_size=BLOCK, max_num_seqs=n, max_num_batched_tokens=budget,
                         max_model_len=longest + lifetime, enable_prefix_caching=True,
                         kv_events=False)
    prompts = bench._requests(n + rate * (fill + warmup + steps), prompt_len, prompt_len // 2,
                              0, BLOCK, seed)
    arrivals = [(rid, prompt, lifetime) for rid, prompt in prompts]
    figures = _lockstep(spec, arrivals, n, rate or None, fill + warmup, steps)
    return {"churn_per_step": rate, "prompt_len": prompt_len, **figures}


def _lockstep(spec: Any, arrivals: list[tuple[str, list[int], int]], n: int,
              max_joins: int | None, warmup: int, steps: int, by_call: bool = False
              ) -> dict[str, Any]:
    """vLLM's ``Scheduler`` on its own manager and on kvmem's, stepped in lockstep.

    Before each step, each scheduler takes the next ``arrivals`` (request id, prompt,
    max_tokens) until ``n`` requests are in flight, at most ``max_joins`` a step (None: no
    limit). After ``warmup`` steps, ``steps`` are measured; returns the figures (module
    docstring)."""
    from kvmem.integrations.vllm import bench
    from kvmem.integrations.vllm.conformance import make_scheduler

    scheds = {w: make_scheduler(spec, kvmem=w == "kvmem", log_stats=True)
              for w in ("vllm", "kvmem")}
    added = {w: 0 for w in scheds}

    def top_up(name: str, s: Any) -> None:
        joins = n - len(s.running) - len(s.waiting)
        for _ in range(joins if max_joins is None else min(joins, max_joins)):
            rid, prompt, max_tokens = arrivals[added[name]]
            s.add_request(bench._make(rid, prompt, max_tokens, spec.block_size))
            added[name] += 1

    timers = {w: bench._KVTimer(by_call) for w in scheds}
    undo = [bench._instrument(s, timers[w], w == "kvmem") for w, s in scheds.items()]
    kv: dict[str, list[int]] = {w: [] for w in scheds}
    adapter = scheds["kvmem"].kv_cache_manager
    flushes: list[float] = []
    by_join: dict[bool, list[float]] = {True: [], False: []}  # flushes with work, by admission
    flush = adapter.flush

    def timed_flush() -> None:
        queue = adapter._queue
        work = bool(queue.entries)
        joined = queue.first_admit >= 0
        t = time.perf_counter()
        flush()
        flushes.append(time.perf_counter() - t)
        if work:
            by_join[joined].append(flushes[-1])

    adapter.flush = timed_flush
    step_times: dict[str, list[float]] = {w: [] for w in scheds}
    mismatched = 0
    before = adapter.manager.verifier.stats
    flushes_before = adapter.num_flushes
    added_before = 0
    gc.collect()
    for i in range(warmup + steps):
        if i == warmup:
            before = adapter.manager.verifier.stats
            flushes_before = adapter.num_flushes
            added_before = added["kvmem"]
            flushes.clear()
            by_join[True].clear()
            by_join[False].clear()
            for v in (*step_times.values(), *kv.values()):
                v.clear()
            for timer in timers.values():
                if timer.by_call is not None:
                    timer.by_call.clear()
                    timer.calls_by.clear()
        outs = {}
        for name, s in scheds.items():
            top_up(name, s)
            timers[name].total_ns = 0
            t = time.perf_counter()
            outs[name] = bench._step(s)
            step_times[name].append(time.perf_counter() - t)
            kv[name].append(timers[name].total_ns)
        mismatched += outs["vllm"].num_scheduled_tokens != outs["kvmem"].num_scheduled_tokens
    after = adapter.manager.verifier.stats
    for u in undo:
        u()
    med = statistics.median
    vllm_kv, kvmem_kv = (med(kv[w]) / 1e3 for w in ("vllm", "kvmem"))
    vllm_us, kvmem_us = (med(step_times[w]) * 1e6 for w in ("vllm", "kvmem"))
    extra: dict[str, Any] = {}
    if by_call:
        extra["kv_us_by_call"] = {w: {name: round(ns / steps / 1e3, 1) for name, ns in sorted(
            (t.by_call or {}).items(), key=lambda kv: -kv[1])} for w, t in timers.items()}
        extra["kv_calls_by_call"] = {w: {name: round(c / steps, 2) for name, c in sorted(
            t.calls_by.items())} for w, t in timers.items()}
    return {
        "requests": n, "steps": steps, "requests_added": added["kvmem"],
        "joined_per_step": round((added["kvmem"] - added_before) / steps, 3),
        "mismatched_steps": mismatched,
        "vllm_step_us_median": round(vllm_us, 1), "kvmem_step_us_median": round(kvmem_us, 1),
        "step_speedup": round(vllm_us / kvmem_us, 3),
        "paired_step_speedup": round(med(
            v / k for v, k in zip(step_times["vllm"], step_times["kvmem"])), 3),
        "vllm_kv_us_median": round(vllm_kv, 1), "kvmem_kv_us_median": round(kvmem_kv, 1),
        "kv_speedup": round(vllm_kv / kvmem_kv, 3),
        "paired_kv_speedup": round(med(v / k for v, k in zip(kv["vllm"], kv["kvmem"])), 3),
        "kvmem_flush_us_median": round(med(flushes) * 1e6, 1),
        **{f"kvmem_flush_{name}_us_median": round(med(by_join[joined]) * 1e6, 1)
           for name, joined in (("join", True), ("decode", False)) if by_join[joined]},
        "kvmem_flushes_per_step": round((adapter.num_flushes - flushes_before) / steps, 3),
        "verify_paths": {k: getattr(after, k) - getattr(before, k) for k in after._fields},
        **extra,
    }


if __name__ == "__main__":
    sys.exit(main())
