"""``kvmem simulate``: continuous batching on a planned KV pool, from the command line.

::

    kvmem simulate MODEL [--compare bf16,fp8_e4m3] [--requests 1000] [--concurrency 64] ...

The options are checked (by :mod:`kvmem.cli.args`' types) before the simulator and the manager
are imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmem.cli.args import (
    FRACTION,
    KV_DTYPES,
    NONNEG,
    NONNEG_INT,
    POSITIVE,
    POSITIVE_INT,
    Parser,
    dtype_list,
    dtypes_asked,
    number,
    resolve_model,
)
from kvmem.errors import ConfigError

__all__ = ["add_simulate_parser", "run_simulate"]


def add_simulate_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``kvmem simulate`` on the CLI's subparsers."""
    p = sub.add_parser(
        "simulate",
        help="simulate continuous batching on a planned KV pool with the real manager",
        description=(
            "Drive kvmem's KVCacheManager with a simulated workload on the KV pool that "
            "`kvmem plan` computes, and report concurrency, queueing, preemptions and prefix "
            "hits. Defaults reproduce the report's shape: 64 clients of 11-20K-token requests "
            "on Kimi K2.6, 8 x H200, TP 8 (try --compare bf16,fp8_e4m3)."
        ),
    )
    p.add_argument("model", nargs="?", default="kimi-k2.6",
                   help="preset name or config.json (default kimi-k2.6)")
    p.add_argument("--gpu", default="h200", help="GPU preset name (default h200)")
    p.add_argument("--tp", type=POSITIVE_INT, default=8,
                   help="tensor-parallel GPUs per replica (default 8)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="KV dtype (default bf16)")
    p.add_argument("--compare", type=dtype_list,
                   help="comma-separated KV dtypes, simulated one after the other")
    p.add_argument("--weights", default="native",
                   help="native, bf16, fp8, int4-g<N> or mxfp4 (default native)")
    p.add_argument("--page-size", type=POSITIVE_INT, default=16,
                   help="tokens per KV page (default 16)")
    p.add_argument("--requests", type=POSITIVE_INT, default=1000,
                   help="requests to simulate (default 1000)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=POSITIVE_INT,
                   help="closed loop: clients, each sending its next request when one ends "
                        "(default 64)")
    g.add_argument("--rate", type=POSITIVE, help="open loop: Poisson arrivals per second (> 0)")
    p.add_argument("--prompt-len", default="10000-18000",
                   help="prompt tokens: N, LO-HI or lognormal:MEDIAN,SIGMA (default 10000-18000)")
    p.add_argument("--output-len", default="1000-2000",
                   help="output tokens: N, LO-HI or lognormal:MEDIAN,SIGMA (default 1000-2000)")
    p.add_argument("--prefixes", type=NONNEG_INT, default=0,
                   help="shared prefixes (default 0)")
    p.add_argument("--prefix-len", type=NONNEG_INT,
                   help="tokens per shared prefix (default 0; needs --prefixes)")
    p.add_argument("--prefix-fraction", type=number(float, 0, maximum=1),
                   help="fraction of requests that start with a shared prefix, in [0, 1] "
                        "(default 1; needs --prefixes)")
    p.add_argument("--max-running", type=POSITIVE_INT, default=256,
                   help="most requests decoding at once (default 256)")
    p.add_argument("--chunk", type=POSITIVE_INT, default=16,
                   help="decode steps per batched manager call (default 16)")
    p.add_argument("--prefill-tps", type=POSITIVE,
                   help="prefill tokens/s, > 0 (default: a disaggregated decode pool)")
    p.add_argument("--t0-ms", type=NONNEG,
                   help="fixed cost of a decode step in ms (default 5.4, the Kimi K2.6 fit)")
    p.add_argument("--efficiency", type=FRACTION,
                   help="fraction of peak bandwidth a decode step reaches, in (0, 1] "
                        "(default 0.70, the Kimi K2.6 fit)")
    p.add_argument("--no-prefix-cache", action="store_true", help="run without prefix reuse")
    p.add_argument("--offload-gib", type=POSITIVE,
                   help="a host KV tier of this many GiB per replica (> 0): evicted prefix pages "
                        "stored there and loaded back; reports hit rates per tier and bytes moved")
    p.add_argument("--offload-gbs", type=POSITIVE,
                   help="host-to-device GB/s per GPU charged for each load (> 0; default: loads "
                        "cost no time; needs --offload-gib)")
    p.add_argument("--seed", type=number(int, 0, maximum=2**32 - 1), default=0,
                   help="random seed of the workload (default 0)")
    p.add_argument("--groups", action="store_true",
                   help="run the workload on the model's KV cache groups (full attention, "
                        "sliding window, state, indexer; each its own page size) on the "
                        "group allocator, one decode step at a time; reports pages per group")
    p.add_argument("--padded-compare", action="store_true",
                   help="with the groups, run the same workload with the layers grouped and "
                        "padded to one page size as vLLM does (implies --groups)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    """``kvmem simulate``: one simulation per KV dtype, then a summary or JSON."""
    # Checked before the manager is imported: every name is known and every length parses.
    from kvmem.planning import ThroughputModel, get_gpu, plan_capacity

    dtypes = dtypes_asked(args)
    if not args.prefixes and (args.prefix_len is not None or args.prefix_fraction is not None):
        raise ConfigError("--prefix-len and --prefix-fraction describe shared prefixes: give "
                          "--prefixes N as well, or drop them.")
    spec = resolve_model(args.model)
    gpu = get_gpu(args.gpu)
    from kvmem.simulate import DEFAULT_STEP_MODEL, LengthDist, SimulationReport, Workload, simulate

    workload = Workload(
        num_requests=args.requests,
        concurrency=None if args.rate is not None else (args.concurrency or 64),
        rate=args.rate,
        prompt_len=LengthDist.parse(args.prompt_len),
        output_len=LengthDist.parse(args.output_len),
        num_prefixes=args.prefixes,
        prefix_len=args.prefix_len or 0,
        prefix_fraction=1.0 if args.prefix_fraction is None else args.prefix_fraction,
        seed=args.seed,
    )
    step_model = ThroughputModel(
        t0_s=DEFAULT_STEP_MODEL.t0_s if args.t0_ms is None else args.t0_ms / 1e3,
        efficiency=DEFAULT_STEP_MODEL.efficiency if args.efficiency is None else args.efficiency,
        context_len=DEFAULT_STEP_MODEL.context_len,
    )
    plans = [
        plan_capacity(
            spec, gpu, args.tp, kv_dtype=dtype, weights=args.weights, page_size=args.page_size
        )
        for dtype in dtypes
    ]
    if args.groups or args.padded_compare:
        return _simulate_groups(args, spec, plans, workload)
    reports: list[SimulationReport] = []
    for dtype, plan in zip(dtypes, plans):
        bar = None if args.no_progress or args.json else _progress_bar(f"{dtype:>9}")
        reports.append(
            simulate(
                workload,
                plan,
                step_model=step_model,
                max_running=args.max_running,
                chunk=args.chunk,
                prefill_tokens_per_s=args.prefill_tps,
                prefix_cache=not args.no_prefix_cache,
                progress=bar,
                offload_gib=args.offload_gib,
                offload_gbs=args.offload_gbs,
            )
        )
    if args.json:
        dumped = [r.model_dump(mode="json") for r in reports]
        print(json.dumps(dumped[0] if len(dumped) == 1 else {"compare": dumped}, indent=2))
        return 0
    for r in reports:
        print(r.summary())
        print(_sparkline(r))
    return 0


def _simulate_groups(args: argparse.Namespace, spec: Any, plans: list[Any],
                     workload: Any) -> int:
    """``--groups`` / ``--padded-compare``: each plan's KV budget per GPU, kvmem's groups and
    (if asked) vLLM's padded groups."""
    from kvmem.planning import kv_groups, vllm_groups
    from kvmem.simulate import simulate_groups

    unused = [flag for flag, given in (("--rate", args.rate is not None),
                                       ("--prefixes", bool(args.prefixes)),
                                       ("--offload-gib", args.offload_gib is not None),
                                       ("--prefill-tps", args.prefill_tps is not None))
              if given]
    if unused:
        raise ConfigError(f"{', '.join(unused)} do not apply to --groups (a closed-loop decode "
                          "pool without a prefix cache); drop them.")
    results = []
    for plan in plans:
        budget = int(plan.kv_budget_gib_per_gpu * 2**30)
        runs = {"kvmem": simulate_groups(workload, kv_groups(spec, plan), budget,
                                         max_running=args.max_running)}
        if args.padded_compare:
            runs["padded"] = simulate_groups(workload, vllm_groups(spec, plan), budget,
                                             layout="padded", max_running=args.max_running)
        results.append((plan, runs))
    if args.json:
        dumped = [{"model": plan.model, "kv_dtype": plan.kv_dtype, "tp": plan.tp,
                   **{name: r.model_dump(mode="json") for name, r in runs.items()}}
                  for plan, runs in results]
        print(json.dumps(dumped[0] if len(dumped) == 1 else {"compare": dumped}, indent=2))
        return 0
    for plan, runs in results:
        print(f"{plan.model}, KV {plan.kv_dtype}, TP {plan.tp}: KV cache groups, per GPU")
        for r in runs.values():
            print(r.summary())
        if "padded" in runs:
            mine, theirs = runs["kvmem"], runs["padded"]
            print(f"kvmem / padded: {mine.tokens_per_step / theirs.tokens_per_step:.3f}x output "
                  f"tokens per step, {mine.peak_tokens / max(theirs.peak_tokens, 1):.3f}x peak "
                  "tokens resident")
    return 0


def _progress_bar(label: str) -> Callable[[int, int], None]:
    start = time.perf_counter()

    def show(done: int, total: int) -> None:
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        rate = done / max(time.perf_counter() - start, 1e-9)
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{label} [{bar:<30}] {done:,}/{total:,} requests ({rate:,.0f}/s){end}")
        sys.stderr.flush()

    return show


def _sparkline(r: Any, width: int = 60) -> str:
    """Running and waiting requests over time, as two text rows."""
    if not r.timeline:
        return ""
    idx = np.linspace(0, len(r.timeline) - 1, min(width, len(r.timeline))).astype(int)
    pts = [r.timeline[i] for i in idx]
    top = max(max(p.running for p in pts), max(p.waiting for p in pts), 1)
    ramp = " .:-=+*#%@"

    def row(values: list[int]) -> str:
        return "".join(ramp[min(9, int(9 * v / top + 0.999))] if v else " " for v in values)

    return (
        f"  running  |{row([p.running for p in pts])}| max {r.max_running}\n"
        f"  waiting  |{row([p.waiting for p in pts])}| max {r.max_waiting}\n"
        f"            0 s{' ' * (width - 12)}{r.simulated_seconds:,.0f} s"
    )
