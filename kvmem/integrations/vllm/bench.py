"""vLLM's scheduler on its own KV cache manager and on kvmem's, timed in lockstep (imports vLLM).

The workload (``--requests 256`` by default): requests of about ``prompt_len`` tokens, a quarter
of them sharing a ``shared_len``-token prefix, prefilled in the schedulers' own chunks, then
``decode_steps`` decode steps at full batch, prefix caching on. Both schedulers run in one
process on the same request stream, step ``i`` of each before step ``i + 1`` of either (the
order alternates), and every step's ``num_scheduled_tokens`` is compared (``mismatched_steps``).
A step is ``schedule()`` + ``update_from_output()`` with the synthetic model's output.

A step's time is the thread's CPU time (``time.thread_time_ns``), so the time the OS gives
other work on a shared core does not count (wall-clock medians are reported too:
``*_step_wall_us_median``). The time inside the KV cache manager is wall-clock
(``perf_counter_ns`` around each call: a CPU-time clock costs a microsecond a read here),
scaled by the step's CPU / wall time ratio (the time the OS gave other work during the step,
spread over it evenly).

Two passes: the first times whole steps; the second also times every call into the KV cache
manager (vLLM's ``KVCacheManager`` methods and ``KVCacheBlocks.get_block_ids``; kvmem's adapter
methods, its queue flush, and ``KVMemBlocks.get_block_ids``), the outermost call only, so the
timers' own cost does not touch the first pass's figures. A timer costs time inside its own
span too (two clock reads and the call's forwarding: ``timer_us_per_call``, measured on a
no-op of ``allocate_slots``' shape, less a direct call of it); that much per timed call is
taken out of each step's KV time (both managers see the same calls per running request:
``*_kv_calls_per_step``). vLLM's block hashing of every output token (``Request``'s block
hasher, for its prefix cache; kvmem's adapter turns it off and keys pages itself) runs outside
the manager's methods and is counted in neither.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvmem.integrations.vllm.conformance import SchedulerSpec, make_scheduler

__all__ = ["lockstep"]


class _KVTimer:
    """Accumulates the time spent inside wrapped methods (outermost calls only) and counts
    those calls; with ``by_call``, also per method name (``by_call``: ns, ``calls_by``:
    calls)."""

    def __init__(self, by_call: bool = False) -> None:
        self.total_ns = 0
        self.calls = 0
        self.depth = 0
        self.by_call: dict[str, int] | None = {} if by_call else None
        self.calls_by: dict[str, int] = {}

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter_ns
        name = fn.__name__
        by_call, calls_by = self.by_call, self.calls_by

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth = 1
            self.calls += 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - t0
                self.total_ns += spent
                if by_call is not None:
                    by_call[name] = by_call.get(name, 0) + spent
                    calls_by[name] = calls_by.get(name, 0) + 1
                self.depth = 0

        return timed


def _noop(request: Any, num_new_tokens: int, num_lookahead_tokens: int = 0) -> None:
    """What the timer's calibration times (allocate_slots' shape of call)."""


def timer_ns_per_call(calls: int = 200_000) -> float:
    """What a timer adds inside its span per call: the clock reads and the forwarding, less a
    direct call of the same shape (which the untimed step makes too); the median of 5."""
    clock = time.perf_counter_ns
    timer = _KVTimer()
    timed = timer.wrap(_noop)
    costs = []
    for _ in range(5):
        timer.total_ns = 0
        for _ in range(calls):
            timed(None, 1, num_lookahead_tokens=0)
        t0 = clock()
        for _ in range(calls):
            _noop(None, 1, num_lookahead_tokens=0)
        t1 = clock()
        for _ in range(calls):
            pass
        direct = (t1 - t0) - (clock() - t1)
        costs.append((timer.total_ns - direct) / calls)
    return max(0.0, statistics.median(costs))


_VLLM_METHODS = (
    "get_computed_blocks", "allocate_slots", "free", "get_blocks", "get_block_ids",
    "cache_blocks", "take_events", "make_prefix_cache_stats", "reset_prefix_cache",
    "new_step_starts", "record_prefix_cache_stats", "estimate_cached_tokens",
    "take_new_block_ids", "take_kv_cache_block_copies", "take_boundary_state_offloads",
    "remove_skipped_blocks", "get_block_ids_for_computed_tokens", "finalize_partial_tail_offloads",
)


def _instrument(sched: Any, timer: _KVTimer, kvmem: bool) -> Callable[[], None]:
    """Time the manager's methods (instance attributes shadow the class's) and the block
    objects' ``get_block_ids`` (class attribute); returns the undo."""
    mgr = sched.kv_cache_manager
    names = [*_VLLM_METHODS, "flush"] if kvmem else list(_VLLM_METHODS)
    for name in names:
        fn = getattr(mgr, name, None)
        if fn is not None:
            setattr(mgr, name, timer.wrap(fn))
    cls_usage = type(mgr).usage
    blocks_cls: Any
    if kvmem:
        from kvmem.integrations.vllm._blocks import KVMemBlocks

        blocks_cls = KVMemBlocks
    else:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        blocks_cls = KVCacheBlocks
    original = blocks_cls.get_block_ids
    blocks_cls.get_block_ids = timer.wrap(original)
    # usage is a property (read by make_stats): time it on the class for this scheduler only.
    prop_holder = type("Timed" + type(mgr).__name__, (type(mgr),), {
        "usage": property(timer.wrap(cls_usage.fget))})
    mgr.__class__ = prop_holder

    def undo() -> None:
        blocks_cls.get_block_ids = original

    return undo


def _requests(num: int, prompt_len: int, shared_len: int, max_tokens: int, block_size: int,
              seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 30000) for _ in range(shared_len)]
    out = []
    for i in range(num):
        n = prompt_len + rng.randint(-prompt_len // 10, prompt_len // 10)
        if i % 4 == 0:
            prompt = shared + [rng.randrange(10, 30000) for _ in range(n - shared_len)]
        else:
            prompt = [rng.randrange(10, 30000) for _ in range(n)]
        out.append((f"req-{i}", prompt))
    return out


def _make(rid: str, prompt: list[int], max_tokens: int, block_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvmem.integrations.vllm._vllm_objects import make_block_hasher

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, arrival_time=0.0,
                   block_hasher=make_block_hasher(block_size))


def _step(sched: Any) -> Any:
    from kvmem.integrations.vllm.conformance import model_output

    out = sched.schedule()
    sched.update_from_output(out, model_output(sched, out))
    return out


def _prefill(scheds: dict[str, Any], num_requests: int) -> tuple[int, int]:
    """Step both schedulers until every request decodes (not timed); returns the steps whose
    schedules differ and the steps taken."""
    mismatched = 0
    prefill_steps = 0
    while True:
        outs = {name: _step(s) for name, s in scheds.items()}
        prefill_steps += 1
        if outs["vllm"].num_scheduled_tokens != outs["kvmem"].num_scheduled_tokens:
            mismatched += 1
        if all(v == 1 for v in outs["vllm"].num_scheduled_tokens.values()) and len(
                outs["vllm"].num_scheduled_tokens) == num_requests:
            break
        if prefill_steps > 10_000:
            raise RuntimeError("the prefill phase did not end")
    return mismatched, prefill_steps


def _pass(num_requests: int, prompt_len: int, shared_len: int, decode_steps: int,
          block_size: int, async_scheduling: bool, seed: int, instrument: bool,
          timer_ns: float = 0.0) -> dict[str, Any]:
    max_tokens = decode_steps + 2
    spec = SchedulerSpec(
        num_blocks=num_requests * (-(-(prompt_len + prompt_len // 10 + max_tokens)
                                     // block_size)) + 64,
        block_size=block_size, max_num_seqs=num_requests, max_num_batched_tokens=8192,
        max_model_len=prompt_len * 2 + max_tokens, enable_prefix_caching=True,
        async_scheduling=async_scheduling, kv_events=False)
    scheds = {"vllm": make_scheduler(spec, kvmem=False, log_stats=True),
              "kvmem": make_scheduler(spec, kvmem=True, log_stats=True)}
    for sched in scheds.values():
        for rid, prompt in _requests(num_requests, prompt_len, shared_len, max_tokens,
                                     block_size, seed):
            sched.add_request(_make(rid, prompt, max_tokens, block_size))
    mismatched, prefill_steps = _prefill(scheds, num_requests)
    timers = {name: _KVTimer() for name in scheds}
    undo = []
    if instrument:
        undo = [_instrument(s, timers[n], n == "kvmem") for n, s in scheds.items()]
    step_us: dict[str, list[float]] = {n: [] for n in scheds}  # thread CPU time
    wall_us: dict[str, list[float]] = {n: [] for n in scheds}
    kv_us: dict[str, list[float]] = {n: [] for n in scheds}
    kv_calls: dict[str, list[int]] = {n: [] for n in scheds}
    gc.collect()
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    order = list(scheds)
    try:
        for i in range(decode_steps):
            outs = {}
            for name in order if i % 2 == 0 else order[::-1]:
                sched, timer = scheds[name], timers[name]
                kv0, calls0 = timer.total_ns, timer.calls
                c0, t0 = cpu(), clock()
                outs[name] = _step(sched)
                wall, used = clock() - t0, cpu() - c0
                wall_us[name].append(wall / 1e3)
                step_us[name].append(used / 1e3)
                # The KV timers read the wall clock (a CPU-time read costs a microsecond here);
                # time the OS gave other work during the step is spread over it evenly. Each
                # timed call's own cost inside its span (timer_ns) is taken out.
                calls = timer.calls - calls0
                kv_calls[name].append(calls)
                inside = timer.total_ns - kv0 - calls * timer_ns
                kv_us[name].append(max(0.0, inside) * min(1.0, used / wall) / 1e3)
            if outs["vllm"].num_scheduled_tokens != outs["kvmem"].num_scheduled_tokens:
                mismatched += 1
    finally:
        for u in undo:
            u()
    return {"step_us": step_us, "wall_us": wall_us, "kv_us": kv_us, "kv_calls": kv_calls,
            "mismatched_steps": mismatched, "prefill_steps": prefill_steps,
            "verify_steps": scheds["kvmem"].kv_cache_manager.num_verified_steps}


def lockstep(num_requests: int = 256, prompt_len: int = 1000, shared_len: int = 512,
             decode_steps: int = 300, block_size: int = 16, async_scheduling: bool = False,
             seed: int = 0) -> dict[str, Any]:
    """Medians (microseconds) of a decode step and of its time inside the KV cache manager,
    vLLM's manager against kvmem's, in lockstep (see the module doc)."""
    timing = _pass(num_requests, prompt_len, shared_len, decode_steps, block_size,
                   async_scheduling, seed, instrument=False)
    timer_ns = timer_ns_per_call()
    kv = _pass(num_requests, prompt_len, shared_len, decode_steps, block_size,
               async_scheduling, seed, instrument=True, timer_ns=timer_ns)
    med = statistics.median
    v_step, k_step = med(timing["step_us"]["vllm"]), med(timing["step_us"]["kvmem"])
    v_kv, k_kv = med(kv["kv_us"]["vllm"]), med(kv["kv_us"]["kvmem"])
    paired = med(a / b for a, b in zip(timing["step_us"]["vllm"], timing["step_us"]["kvmem"]))
    return {
        "scheduler": "AsyncScheduler" if async_scheduling else "Scheduler",
        "batch": num_requests, "decode_steps": decode_steps,
        "prefill_steps": timing["prefill_steps"],
        "vllm_step_us_median": round(v_step, 1), "kvmem_step_us_median": round(k_step, 1),
        "step_speedup": round(v_step / k_step, 3), "paired_step_speedup": round(paired, 3),
        "vllm_kv_us_median": round(v_kv, 1), "kvmem_kv_us_median": round(k_kv, 1),
        "kv_speedup": round(v_kv / k_kv, 3),
        "timer_us_per_call": round(timer_ns / 1e3, 3),
        "vllm_kv_calls_per_step": med(kv["kv_calls"]["vllm"]),
        "kvmem_kv_calls_per_step": med(kv["kv_calls"]["kvmem"]),
        "vllm_kv_share": round(v_kv / med(kv["step_us"]["vllm"]), 3),
        "kvmem_kv_share": round(k_kv / med(kv["step_us"]["kvmem"]), 3),
        "mismatched_steps": timing["mismatched_steps"] + kv["mismatched_steps"],
        "vllm_step_wall_us_median": round(med(timing["wall_us"]["vllm"]), 1),
        "kvmem_step_wall_us_median": round(med(timing["wall_us"]["kvmem"]), 1),
        "kvmem_verified_steps": timing["verify_steps"],
    }
