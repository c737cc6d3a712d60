""":func:`simulate`: its arguments checked, the manager, arrivals and clock built, the run."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from kvmem._validate import INT32_MAX, flag, integer, real, show
from kvmem.errors import ArgumentTypeError, ConfigError
from kvmem.manager import KVCacheManager
from kvmem.planning import CapacityPlan, ThroughputModel, plan_capacity
from kvmem.simulate._simulation import HostPlan, Simulation, SimulationReport, StepClock
from kvmem.simulate._workload import Arrivals, Workload

__all__ = ["DEFAULT_STEP_MODEL", "simulate"]

logger = logging.getLogger(__name__)

# The report's Kimi K2.6 BF16 points fitted with kvmem.planning.fit_throughput.
DEFAULT_STEP_MODEL = ThroughputModel(t0_s=0.0054, efficiency=0.70, context_len=4096)


def simulate(
    workload: Workload,
    plan: CapacityPlan | None = None,
    *,
    model: str = "kimi-k2.6",
    gpu: str = "h200",
    tp: int = 8,
    kv_dtype: str = "bf16",
    step_model: ThroughputModel | None = None,
    max_running: int = 256,
    chunk: int = 16,
    prefill_tokens_per_s: float | None = None,
    prefix_cache: bool = True,
    sample_every: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    offload_gib: float | None = None,
    offload_gbs: float | None = None,
) -> SimulationReport:
    """Simulate continuous batching of ``workload`` on the KV pool of ``plan``.

    Parameters
    ----------
    workload : Workload
        Arrivals and lengths.
    plan : CapacityPlan, optional
        Pool size (``kv_pages_per_gpu`` pages of ``page_size``) and the bytes a decode step
        reads; ``plan_capacity(model, gpu, tp, kv_dtype=kv_dtype)`` when omitted.
    step_model : ThroughputModel, optional
        ``t0`` and bandwidth efficiency of a decode step (defaults: the Kimi K2.6 fit, 5.4 ms and
        0.70).
    max_running : int
        Most requests decoding at once (the engine's max running requests).
    chunk : int
        Decode steps per batched manager call, 1 to 2**31 - 1.
    prefill_tokens_per_s : float, optional
        Prefill rate charged for uncached prompt tokens at admission and for recomputation at
        resume; ``None`` treats the pool as a disaggregated decode pool (prompt KV arrives
        computed) and recomputation as free.
    prefix_cache : bool
        Use the manager's hashed prefix cache.
    sample_every : float, optional
        Simulated seconds between timeline samples (about 200 samples by default).
    progress : callable, optional
        ``progress(completed, total)``, called about every 0.2 s of wall time.
    offload_gib : float, optional
        A host tier of this many GiB per replica (``plan.offload_pages``: split over the TP
        ranks, whole pages of the plan's bytes): evicted prefix pages are stored in it and
        loaded back on admission, through the real manager, :class:`~kvmem.transfer.HostTier`
        and a stand-in page pool (see :mod:`kvmem.simulate`). Needs the prefix cache.
    offload_gbs : float, optional
        Host-to-device bandwidth per GPU in GB/s, to charge loads
        (``pages * kv_bytes_per_page_per_gpu / bandwidth``); ``None`` charges nothing, as a
        disaggregated pool charges no prefill.

    Returns
    -------
    SimulationReport
    """
    wall0 = time.perf_counter()
    max_running, chunk, prefill_tokens_per_s, sample_every, prefix_cache = _checked_arguments(
        workload, plan, step_model, max_running, chunk, prefill_tokens_per_s, sample_every,
        prefix_cache, progress)
    offload = _checked_offload(offload_gib, offload_gbs, prefix_cache)
    plan = plan or plan_capacity(model, gpu, tp, kv_dtype=kv_dtype)
    sim = _simulation(workload, plan, step_model, max_running, chunk, prefill_tokens_per_s,
                      sample_every, prefix_cache, offload)
    sim.run(progress, wall0)
    return sim.report(wall0)


def _checked_arguments(
    workload: Workload,
    plan: CapacityPlan | None,
    step_model: ThroughputModel | None,
    max_running: int,
    chunk: int,
    prefill_tokens_per_s: float | None,
    sample_every: float | None,
    prefix_cache: bool,
    progress: Callable[[int, int], None] | None,
) -> tuple[int, int, float | None, float | None, bool]:
    """:func:`simulate`'s arguments checked: ``(max_running, chunk, prefill_tokens_per_s,
    sample_every, prefix_cache)``."""
    if not isinstance(workload, Workload):
        raise ArgumentTypeError(f"workload={show(workload)}: expected a Workload.")
    if plan is not None and not isinstance(plan, CapacityPlan):
        raise ArgumentTypeError(f"plan={show(plan)}: expected a CapacityPlan (plan_capacity).")
    if step_model is not None and not isinstance(step_model, ThroughputModel):
        raise ArgumentTypeError(f"step_model={show(step_model)}: expected a ThroughputModel.")
    max_running = integer(max_running, "max_running", minimum=1)
    chunk = integer(chunk, "chunk", minimum=1, maximum=INT32_MAX)
    if prefill_tokens_per_s is not None:
        prefill_tokens_per_s = real(
            prefill_tokens_per_s, "prefill_tokens_per_s", minimum=0, exclusive_minimum=True
        )
    if sample_every is not None:
        sample_every = real(sample_every, "sample_every", minimum=0, exclusive_minimum=True)
    prefix_cache = flag(prefix_cache, "prefix_cache")
    if progress is not None and not callable(progress):
        raise ArgumentTypeError(f"progress={show(progress)}: expected None or a callable.")
    return max_running, chunk, prefill_tokens_per_s, sample_every, prefix_cache


def _checked_offload(offload_gib: float | None, offload_gbs: float | None,
                     prefix_cache: bool) -> tuple[float, float | None] | None:
    """``(offload_gib, offload_gbs)`` checked, or None without a host tier."""
    if offload_gib is None:
        if offload_gbs is not None:
            raise ConfigError("offload_gbs charges host-tier loads: give offload_gib as well.")
        return None
    offload_gib = real(offload_gib, "offload_gib", minimum=0, exclusive_minimum=True)
    if offload_gbs is not None:
        offload_gbs = real(offload_gbs, "offload_gbs", minimum=0, exclusive_minimum=True)
    if not prefix_cache:
        raise ConfigError("a host tier stores the pages the prefix cache evicts: keep the "
                          "prefix cache (prefix_cache=True) or drop offload_gib.")
    return offload_gib, offload_gbs


def _simulation(
    workload: Workload,
    plan: CapacityPlan,
    step_model: ThroughputModel | None,
    max_running: int,
    chunk: int,
    prefill_tokens_per_s: float | None,
    sample_every: float | None,
    prefix_cache: bool,
    offload: tuple[float, float | None] | None = None,
) -> Simulation:
    """The simulation of ``workload`` on a manager over ``plan``'s pool, ready to run."""
    arr = Arrivals(workload)
    host = None if offload is None else HostPlan.of(plan, arr, *offload)
    mgr = _manager(plan, workload, max_running, prefix_cache, host)
    _check_fits(arr, plan)
    clock = StepClock(plan, step_model or DEFAULT_STEP_MODEL)
    if sample_every is None:
        sample_every = _default_sample_every(arr, workload, clock, max_running,
                                             prefill_tokens_per_s)
    return Simulation(
        workload, plan, mgr, arr, clock, max_running, chunk, prefill_tokens_per_s, sample_every,
        host,
    )


def _manager(
    plan: CapacityPlan, workload: Workload, max_running: int, prefix_cache: bool,
    host: HostPlan | None = None,
) -> KVCacheManager:
    """A manager on the plan's pool, with rows long enough for the longest request (and a
    stand-in page pool with a host tier when ``host`` is given)."""
    longest = workload.prompt_len.high() + workload.output_len.high()
    max_pages_per_seq = max(1, min(plan.kv_pages_per_gpu, math.ceil(longest / plan.page_size) + 1))
    pool = tier = None
    if host is not None:
        pool, tier = host.pool_and_tier(plan)
    return KVCacheManager(
        num_pages=plan.kv_pages_per_gpu,
        page_size=plan.page_size,
        max_seqs=max_running,
        max_pages_per_seq=max_pages_per_seq,
        prefix_cache="hashed" if prefix_cache else None,
        pool=pool,
        offload=tier,
    )


def _check_fits(arr: Arrivals, plan: CapacityPlan) -> None:
    """Refuse a workload whose longest request does not fit in the whole pool."""
    lengths = arr.prompt + arr.output
    if -(-int(lengths.max()) // plan.page_size) > plan.kv_pages_per_gpu:
        i = int(np.argmax(lengths))
        raise ConfigError(
            f"request {i} ({int(arr.prompt[i])} prompt + {int(arr.output[i])} output tokens) "
            f"does not fit in an empty pool of {plan.kv_pages_per_gpu} pages x {plan.page_size}; "
            "use a bigger plan or shorter requests."
        )


def _default_sample_every(arr: Arrivals, w: Workload, clock: StepClock, max_running: int,
                          prefill_tokens_per_s: float | None = None) -> float:
    """About 200 samples over the expected run (decode steps, and every prompt's prefill at
    ``prefill_tokens_per_s``, which the clock charges one admission after another)."""
    per_step = clock.t0 + clock.dense / clock.rate
    batch = min(w.concurrency or 64, max_running, w.num_requests)
    steps = float(arr.output.sum()) / batch
    prefill = float(arr.prompt.sum()) / prefill_tokens_per_s if prefill_tokens_per_s else 0.0
    horizon = max(steps * per_step + prefill, float(arr.times[-1]) if w.rate else 0.0)
    return max(horizon / 200, 1e-3)
