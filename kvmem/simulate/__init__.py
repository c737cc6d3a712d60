"""Continuous batching driven through the real :class:`KVCacheManager` (``kvmem simulate``).

This package sits above the manager (it drives one); :mod:`kvmem.planning` stays pure, and this
simulator takes its pool size and step clock from a :class:`~kvmem.planning.CapacityPlan`.

No page pools and no model: the manager does the real page bookkeeping (admission, prefix
reuse, page growth, copy-on-write, eviction, preemption), on a pool sized by a
:class:`~kvmem.planning.CapacityPlan` at the plan's real page size, and the clock comes from the
decode throughput model (``t_step = t0 + bytes_read / (bandwidth * efficiency)``).

The loop is event-driven and batched, so a million requests take minutes, not hours::

    while requests remain:
        admit waiting requests, FCFS (preempted first) while can_admit() and a row is free
        k = chunk                                         # one "chunk" of k decode steps
        n_i = min(k, tokens request i still has to generate)
        reserve(running, n)          one vectorized call; if the pages are not there, the
                                     largest k that fits, else preempt the newest request
        commit_batch(running, ...)   one call for the requests that ran all k steps
        clock += sum over the k steps of t_step(batch size, sum of contexts)   (numpy)
        release the requests that finished

A request admitted or finishing inside a chunk is admitted or released at the chunk's end, so
times are quantized to ``chunk`` decode steps (16 by default: a few hundred milliseconds).

:func:`simulate_groups` runs a workload on a hybrid model's KV cache groups instead
(``kvmem simulate --groups``): kvmem's groups against vLLM's padded ones, on the real
:class:`~kvmem.allocator.GroupAllocator` (the manager holds one group).

With ``offload_gib`` the manager also runs a host tier (:class:`~kvmem.transfer.HostTier` of
``plan.offload_pages(offload_gib)`` pages), which needs a page pool: a stand-in one (the plan's
page count and page size, one layer, one KV head of width 1, bf16), so evicted pages are stored
and loaded for real while the bytes reported are pages times the plan's bytes per page.
"""

from __future__ import annotations

from kvmem.simulate._groups import (
    GroupSimulationReport,
    GroupUse,
    padded_specs,
    simulate_groups,
)
from kvmem.simulate._run import DEFAULT_STEP_MODEL, simulate
from kvmem.simulate._simulation import SimulationReport, TimelinePoint
from kvmem.simulate._workload import Arrivals, LengthDist, Workload

__all__ = [
    "DEFAULT_STEP_MODEL",
    "Arrivals",
    "GroupSimulationReport",
    "GroupUse",
    "LengthDist",
    "SimulationReport",
    "TimelinePoint",
    "Workload",
    "padded_specs",
    "simulate",
    "simulate_groups",
]
