"""Interleavings per second of ``kvmem fuzz``, every oracle on (prints one JSON object).

Setting (issue #14's): the manager engine (kvmem's KVCacheManager driven directly, two steps in
flight) on 4,096 pages of 16 tokens with 64 requests running, CheckingTracker, prefix cache,
every oracle of :class:`kvmem.testing.Timeline` after every move (``FuzzConfig.preset("bench")``:
prompts of 32-384 tokens, 64-240 generated, some forks, preemptions, transfers, failing hooks).
A random campaign first fills the system (until 64 requests run), then ``--moves`` moves are
timed.

Keys:

* ``moves_per_s``: moves per CPU second of this process (``time.process_time``): what one core
  of its own does. The development VM is shared (2 cores, other jobs), so wall time swings by 2x
  within a minute; ``moves_per_wall_s`` is the wall-clock rate of the same run, and
  ``load_average`` says how busy the machine was.
* ``manager_us_per_move`` / ``fuzzer_us_per_move``: CPU time inside the manager's public calls
  and everything else (engine adapter, device model, oracles), per move (``--split``: a second
  run with the manager's methods timed).
* ``raw_manager_ops_per_s``: the issue's yardstick, measured in the same process: a lockstep
  decode loop (reserve, verify, commit_batch) over 64 requests, in manager calls per CPU second.

Run: ``taskset -c 1 python benchmarks/bench_fuzz.py [--moves 15000] [--split]``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import time
from typing import Any

import numpy as np

from kvmem.manager import KVCacheManager
from kvmem.testing import FuzzConfig, Run

_TIMED = ("reserve", "verify", "commit_batch", "commit", "admit", "can_admit", "begin_step",
          "retire", "release", "release_batch", "preempt", "resume", "can_resume", "fork",
          "clear_prefix_cache", "pages_of", "num_tokens", "can_reserve")


def _driver(run: Run, seed: int) -> Any:
    """A campaign's move loop (the one ``kvmem.testing.campaign`` runs), resumable."""
    weights = run.config.weights
    names = [m for m in run.moves_enabled if weights.get(m, 0) > 0]
    cum, total = [], 0.0
    for m in names:
        total += weights[m]
        cum.append(total)
    rnd = random.Random(seed)
    step, rand, bits, pick = run.step, rnd.random, rnd.getrandbits, bisect.bisect

    def moves(n: int) -> None:
        target = run.num_moves + n
        while run.num_moves < target:
            step(names[pick(cum, rand() * total)], bits(20), bits(20))

    return moves


def fuzz_rate(num_moves: int, seed: int, split: bool) -> dict[str, float]:
    run = Run("manager", FuzzConfig.preset("bench"), None, seed)
    mgr = run.engine.manager
    spent = [0.0]
    if split:
        for name in _TIMED:
            fn = getattr(mgr, name)

            def timed(*a: Any, _fn: Any = fn, **k: Any) -> Any:
                t = time.process_time()
                try:
                    return _fn(*a, **k)
                finally:
                    spent[0] += time.process_time() - t

            setattr(mgr, name, timed)
    moves = _driver(run, seed)
    while len(mgr.running) < 64:  # fill the system
        moves(200)
    spent[0] = 0.0
    w0, c0 = time.perf_counter(), time.process_time()
    moves(num_moves)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    run.final_check()
    out = {"moves": num_moves, "cpu_s": cpu, "wall_s": wall, "moves_per_s": num_moves / cpu,
           "moves_per_wall_s": num_moves / wall, "running": len(mgr.running),
           "device_reads_checked": run.timeline.num_reads}
    if split:
        out["manager_us_per_move"] = spent[0] / num_moves * 1e6
        out["fuzzer_us_per_move"] = (cpu - spent[0]) / num_moves * 1e6
    return out


def raw_manager_rate(steps: int = 300) -> dict[str, float]:
    """The issue's yardstick: lockstep decode of 64 requests on 4,096 pages, CheckingTracker."""
    mgr = KVCacheManager(4096, page_size=16, max_seqs=128, tracker="checking")
    rng = np.random.default_rng(0)
    for i in range(64):
        p = rng.integers(0, 100, size=int(rng.integers(100, 400)))
        mgr.admit(i, p)
        mgr.reserve([i], len(p))
        mgr.commit(i, p)
    ids = tuple(range(64))
    tok = np.zeros(64, dtype=np.int64)
    parts = {"reserve": 0.0, "verify": 0.0, "commit_batch": 0.0}
    for _ in range(steps):
        t0 = time.process_time()
        step = mgr.reserve(ids, 1)
        t1 = time.process_time()
        mgr.verify(ids, step)
        t2 = time.process_time()
        mgr.commit_batch(ids, tok)
        t3 = time.process_time()
        parts["reserve"] += t1 - t0
        parts["verify"] += t2 - t1
        parts["commit_batch"] += t3 - t2
    total = sum(parts.values())
    out = {f"raw_{k}_us": v / steps * 1e6 for k, v in parts.items()}
    out["raw_manager_ops_per_s"] = 3 * steps / total
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moves", type=int, default=15000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--split", action="store_true", help="also time the manager's calls apart")
    args = ap.parse_args()
    result: dict[str, Any] = {"setting": "manager engine, 4096 pages x 16 tokens, 64 running, "
                              "CheckingTracker, every oracle, 2 steps in flight",
                              "load_average": round(os.getloadavg()[0], 2)}
    result.update(fuzz_rate(args.moves, args.seed, split=False))
    if args.split:
        split = fuzz_rate(args.moves, args.seed, split=True)
        result["manager_us_per_move"] = split["manager_us_per_move"]
        result["fuzzer_us_per_move"] = split["fuzzer_us_per_move"]
    result.update(raw_manager_rate())
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                      for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
