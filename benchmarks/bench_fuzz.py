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
  ``load_average`` / ``load_average_end`` say how busy the machine was.
* ``manager_us_per_move`` / ``fuzzer_us_per_move`` (``--split``, the default): CPU time inside
  the manager's public calls and everything else (engine adapter, device model, every oracle),
  per move, from a second run of the same moves with the manager's methods timed. The timers
  cost CPU too; their cost per call (``timer_us_per_call``: inside the timed span / around it)
  is measured on a no-op and removed, so the two shares add up to an untimed move.
* ``fuzz_reserve_us`` / ``fuzz_verify_us`` / ``fuzz_commit_batch_us`` (``--split``): those
  calls' CPU time per call in the fuzz, beside the yardstick's ``raw_*_us``: the fuzz's batches
  change from step to step (requests finish and join, prefill chunks, partial and mixed steps,
  two steps in flight), the yardstick's never, so the manager's fast paths for a batch it has
  seen serve the fuzz less; ``verify_paths``: which path of the verifier answered
  (``kvmem.integrity.VerifierStats``, counts over the timed moves).
* ``raw_manager_ops_per_s``: the issue's yardstick: a lockstep decode loop (reserve, verify,
  commit_batch) over 64 requests, 300 steps, in manager calls per CPU second. It runs right
  before and right after the shares' run (with ``--no-split``: after the first run), twice from
  scratch, and the two are pooled: the same minute of the machine's swings as the shares, and
  each loop in one piece, warm, as the issue ran it (in slices between the moves, each slice
  starts cold and the yardstick reads up to 1.3x slower).
* ``moves_per_s_at_12k``: the rate scaled to a machine where the yardstick does 12,000 calls
  per second (derived below). A conservative cross-check: the warm yardstick speeds up more
  than the fuzz when the machine is fast, so this figure falls as the machine gets faster.
* ``call_costs_vs_issue``: the fuzz's own ``reserve`` + ``verify`` + ``commit_batch`` per call
  (``fuzz_*_us``) over the issue's measurement of the same calls, 100 + 60 + 100 us, 64
  requests running on 4,096 pages (1.0: the manager's calls cost, in this setting, what the
  issue measured); ``moves_per_s_at_issue_costs``: the untimed rate of a move (the shares) scaled
  by it, the rate where those calls cost what the issue measured.

How ``moves_per_s_at_12k`` is derived. A move is ``m`` seconds of manager calls and ``f`` of
fuzzer (the two shares); one yardstick call takes ``r = 1 / raw_manager_ops_per_s``, measured
beside them. In yardstick calls a move costs ``(m + f) / r``: ``m / r`` is manager work, the
same code as the yardstick's, so it carries over to any machine exactly; ``f / r`` carries over
if the fuzzer's Python and numpy slow down on the issue's machine as much as the manager's do
(the yardstick is the only measurement of that machine we have). On that machine a move then
takes ``(m + f) / r`` calls of ``1 / 12,000`` s::

    moves_per_s_at_12k = 12,000 * r / (m + f)

``moves_per_s * 12,000 / raw_manager_ops_per_s`` is the same formula with ``1 / moves_per_s`` in
place of ``m + f``, but ``moves_per_s`` comes from another run than the yardstick, a minute apart
on a machine whose speed swings by 2x, so their ratio carries that swing; the shares are
measured between the yardstick's two loops. Under load the yardstick (a small working set, warm)
slows down less than the fuzz does (the other jobs evict its caches), so a figure taken at a
high load average is pessimistic: compare runs at similar load averages.

Run: ``taskset -c 1 python benchmarks/bench_fuzz.py [--moves 15000] [--no-split]``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmem.cli.args import Parser, number
from kvmem.manager import KVCacheManager
from kvmem.testing import FuzzConfig, Run

ISSUE_RAW_OPS_PER_S = 12_000.0
"""The yardstick (``raw_manager_ops_per_s``) on the machine the goal was set for (issue #14)."""
ISSUE_CALL_US = {"reserve": 100.0, "verify": 60.0, "commit_batch": 100.0}
"""What the issue measured the manager's calls at, 64 requests running on 4,096 pages."""

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


def _timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """``fn``, with its CPU time added to ``spent[0]`` and its calls counted in ``spent[1]``."""
    clock = time.process_time

    def timed(*a: Any, **k: Any) -> Any:
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            spent[0] += clock() - t
            spent[1] += 1

    return timed


def timer_cost(calls: int = 50_000) -> tuple[float, float]:
    """CPU seconds a :func:`_timed` wrapper adds per call: (inside the span it times, around
    it), measured on a function that does nothing."""
    def noop() -> None:
        return None

    spent = [0.0, 0.0]
    timed = _timed(noop, spent)
    clock = time.process_time
    t0 = clock()
    for _ in range(calls):
        noop()
    plain = clock() - t0
    t0 = clock()
    for _ in range(calls):
        timed()
    total = clock() - t0
    inside = spent[0] / calls
    return inside, max(0.0, (total - plain) / calls - inside)


class Yardstick:
    """The issue's yardstick: lockstep decode of 64 requests on 4,096 pages, CheckingTracker
    (reserve, verify, commit_batch each step). :meth:`loop` runs the issue's 300 steps on a
    fresh manager; the times of every loop run add up."""

    def __init__(self) -> None:
        self.steps = 0
        self.parts = {"reserve": 0.0, "verify": 0.0, "commit_batch": 0.0}

    def loop(self, steps: int = 300) -> None:
        mgr = KVCacheManager(4096, page_size=16, max_seqs=128, tracker="checking")
        rng = np.random.default_rng(0)
        for i in range(64):
            p = rng.integers(0, 100, size=int(rng.integers(100, 400)))
            mgr.admit(i, p)
            mgr.reserve([i], len(p))
            mgr.commit(i, p)
        ids = tuple(range(64))
        tok = np.zeros(64, dtype=np.int64)
        parts = self.parts
        clock = time.process_time
        for _ in range(steps):
            t0 = clock()
            step = mgr.reserve(ids, 1)
            t1 = clock()
            mgr.verify(ids, step)
            t2 = clock()
            mgr.commit_batch(ids, tok)
            t3 = clock()
            parts["reserve"] += t1 - t0
            parts["verify"] += t2 - t1
            parts["commit_batch"] += t3 - t2
        self.steps += steps

    def result(self) -> dict[str, float]:
        out = {f"raw_{k}_us": v / self.steps * 1e6 for k, v in self.parts.items()}
        out["raw_manager_ops_per_s"] = 3 * self.steps / sum(self.parts.values())
        return out


def fuzz_rate(num_moves: int, seed: int, split: bool) -> dict[str, Any]:
    """Time ``num_moves`` moves (``split``: with the manager's calls timed apart)."""
    run = Run("manager", FuzzConfig.preset("bench"), None, seed)
    mgr = run.engine.manager
    spent = {name: [0.0, 0.0] for name in _TIMED}  # CPU seconds inside each call, calls
    if split:
        for name in _TIMED:
            setattr(mgr, name, _timed(getattr(mgr, name), spent[name]))
    moves = _driver(run, seed)
    while len(mgr.running) < 64:  # fill the system
        moves(200)
    for s in spent.values():
        s[:] = [0.0, 0.0]
    before = mgr.verifier.stats
    w0, c0 = time.perf_counter(), time.process_time()
    moves(num_moves)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    paths = {k: n - getattr(before, k) for k, n in mgr.verifier.stats._asdict().items()}
    run.final_check()
    out: dict[str, Any] = {
        "moves": num_moves, "cpu_s": cpu, "wall_s": wall, "moves_per_s": num_moves / cpu,
        "moves_per_wall_s": num_moves / wall, "running": len(mgr.running),
        "device_reads_checked": run.timeline.num_reads}
    if split:
        inside, around = timer_cost()
        inside_s, calls = (sum(v) for v in zip(*spent.values()))
        out["manager_us_per_move"] = (inside_s - calls * inside) / num_moves * 1e6
        out["fuzzer_us_per_move"] = (cpu - inside_s - calls * around) / num_moves * 1e6
        out["manager_calls_per_move"] = calls / num_moves
        out["timer_us_per_call"] = (inside + around) * 1e6
        for name in ("reserve", "verify", "commit_batch"):
            t, n = spent[name]
            out[f"fuzz_{name}_us"] = (t / n - inside) * 1e6 if n else 0.0
        out["verify_paths"] = paths
    return out


def main() -> None:
    ap = Parser(prog="bench_fuzz.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--moves", type=number(int, 1), default=15000)
    ap.add_argument("--seed", type=number(int, 0), default=1)
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True,
                    help="a second run with the manager's calls timed apart (the shares, "
                         "moves_per_s_at_12k and the issue's call costs); on by default")
    args = ap.parse_args()
    result: dict[str, Any] = {"setting": "manager engine, 4096 pages x 16 tokens, 64 running, "
                              "CheckingTracker, every oracle, 2 steps in flight",
                              "load_average": round(os.getloadavg()[0], 2)}
    yardstick = Yardstick()
    result.update(fuzz_rate(args.moves, args.seed, split=False))
    yardstick.loop()
    if args.split:
        shares = fuzz_rate(args.moves, args.seed, split=True)
        yardstick.loop()
        for key in ("manager_us_per_move", "fuzzer_us_per_move", "manager_calls_per_move",
                    "timer_us_per_call", "fuzz_reserve_us", "fuzz_verify_us",
                    "fuzz_commit_batch_us", "verify_paths"):
            result[key] = shares[key]
    result.update(yardstick.result())
    if args.split:
        per_move = (result["manager_us_per_move"] + result["fuzzer_us_per_move"]) * 1e-6
        r = 1.0 / result["raw_manager_ops_per_s"]
        result["moves_per_s_at_12k"] = ISSUE_RAW_OPS_PER_S * r / per_move
        ratio = sum(result[f"fuzz_{k}_us"] for k in ISSUE_CALL_US) / sum(ISSUE_CALL_US.values())
        result["call_costs_vs_issue"] = ratio
        result["moves_per_s_at_issue_costs"] = ratio / per_move
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                      for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
