"""The machinery of :func:`kvmem.simulate.simulate`: the decode-step clock and the batching
loop (the module docstring of :mod:`kvmem.simulate` draws it), and what a run reports."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from kvmem.errors import ConfigError, OutOfPagesError
from kvmem.manager import KVCacheManager
from kvmem.planning import CapacityPlan, ThroughputModel
from kvmem.simulate._workload import Arrivals, Workload

__all__ = ["HostPlan", "Simulation", "SimulationReport", "StepClock", "TimelinePoint"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class TimelinePoint(BaseModel):
    """One sample of the simulation (taken every ``sample_every`` seconds of simulated time)."""

    model_config = _FROZEN

    t: float
    running: int
    waiting: int
    preempted: int
    used_pages: int


class SimulationReport(BaseModel):
    """What happened. Times in simulated seconds unless named ``wall``."""

    model_config = _FROZEN

    model: str
    kv_dtype: str
    num_pages: int
    page_size: int
    kv_tokens: int
    num_requests: int
    num_completed: int
    simulated_seconds: float
    wall_seconds: float
    output_tokens: int
    output_tokens_per_s: float
    mean_running: float
    max_running: int
    p50_running: float
    max_waiting: int
    num_queued: int = Field(description="requests that had to wait for pages or a free row")
    queue_delay_p50_s: float
    queue_delay_p95_s: float
    queue_delay_max_s: float
    num_preemptions: int
    num_resumes: int
    recomputed_tokens: int
    prefix_hit_rate: float
    peak_page_usage: float
    num_evictions: int
    timeline: list[TimelinePoint]
    # With a host tier (offload_gib): prefix_hit_rate is the device's, host_hit_rate the tier's
    # (loaded tokens over the same looked-up prompt tokens); bytes are the plan's, per GPU.
    offload_gib: float | None = None
    offload_pages_per_gpu: int | None = None
    host_hit_rate: float | None = None
    host_hit_tokens: int | None = None
    host_stored_pages: int | None = None
    host_loaded_pages: int | None = None
    host_bytes_stored_per_gpu: int | None = None
    host_bytes_loaded_per_gpu: int | None = None
    host_evictions: int | None = None
    host_load_seconds: float | None = None

    def summary(self) -> str:
        """A few readable lines."""
        lines = [
            f"{self.model}, KV {self.kv_dtype}: {self.num_pages:,} pages x {self.page_size} "
            f"= {self.kv_tokens:,} tokens",
            f"  {self.num_completed:,}/{self.num_requests:,} requests in "
            f"{self.simulated_seconds:,.1f} s simulated ({self.wall_seconds:.1f} s wall), "
            f"{self.output_tokens_per_s:,.0f} output tok/s",
            f"  running: mean {self.mean_running:.1f}, median {self.p50_running:.0f}, "
            f"max {self.max_running}; peak page usage {self.peak_page_usage:.1%}",
            f"  queued: {self.num_queued:,} requests (max {self.max_waiting} waiting), delay p50 "
            f"{self.queue_delay_p50_s:.2f} s, p95 {self.queue_delay_p95_s:.2f} s, max "
            f"{self.queue_delay_max_s:.2f} s",
            f"  preemptions: {self.num_preemptions:,} ({self.recomputed_tokens:,} tokens "
            f"recomputed); prefix hit rate {self.prefix_hit_rate:.1%}; "
            f"{self.num_evictions:,} cached pages evicted",
        ]
        if self.offload_gib is not None:
            stored_gib = (self.host_bytes_stored_per_gpu or 0) / GIB
            loaded_gib = (self.host_bytes_loaded_per_gpu or 0) / GIB
            lines.append(
                f"  host tier: {self.offload_pages_per_gpu:,} pages / GPU "
                f"({self.offload_gib:g} GiB / replica); hit rate device "
                f"{self.prefix_hit_rate:.1%}, host {self.host_hit_rate:.1%}; stored "
                f"{self.host_stored_pages:,} pages ({stored_gib:,.2f} GiB / GPU), loaded "
                f"{self.host_loaded_pages:,} ({loaded_gib:,.2f} GiB / GPU, "
                f"{self.host_load_seconds:,.2f} s); {self.host_evictions:,} evicted from the tier"
            )
        return "\n".join(lines)


GIB = 1 << 30
SIMULATED_WEIGHTS = "simulated"  # the stand-in pool's weights fingerprint


@dataclass(frozen=True, slots=True)
class HostPlan:
    """A simulated host tier: the pages a tier of ``gib`` GiB per replica holds on one GPU
    (``plan.offload_pages``), the slots it is built with, and how loads are charged.

    The tier is a real :class:`~kvmem.transfer.HostTier` beside a stand-in pool (one layer, one
    KV head of width 1, bf16: the bookkeeping of the plan's pages, not their bytes); bytes moved
    are counted as pages times the plan's ``kv_bytes_per_page_per_gpu``. It has ``slots =
    min(pages, pages the workload can ever commit)`` slots: a tier that holds every page the
    workload writes never evicts, whatever its size, so the run is the same.
    """

    gib: float
    pages: int
    slots: int
    page_bytes: int
    load_bytes_per_s: float | None

    @classmethod
    def of(cls, plan: CapacityPlan, arr: Arrivals, gib: float, gbs: float | None) -> HostPlan:
        pages = plan.offload_pages(gib)
        if pages == 0:
            raise ConfigError(
                f"a host tier of {gib:g} GiB over {plan.tp} rank(s) holds no page of "
                f"{plan.kv_bytes_per_page_per_gpu:,} bytes; give at least "
                f"{plan.kv_bytes_per_page_per_gpu * plan.tp / GIB:.3g} GiB."
            )
        written = int((-(-(arr.prompt + arr.output) // plan.page_size)).sum())
        return cls(gib, pages, min(pages, written), plan.kv_bytes_per_page_per_gpu,
                   None if gbs is None else gbs * 1e9)

    def pool_and_tier(self, plan: CapacityPlan) -> tuple[Any, Any]:
        """The stand-in pool of ``plan.kv_pages_per_gpu`` pages and its host tier."""
        from kvmem.cuda import PagePool, PoolSpec  # (torch: only with a tier)
        from kvmem.transfer import CacheIdentity, HostTier

        spec = PoolSpec(num_pages=plan.kv_pages_per_gpu, page_size=plan.page_size, num_layers=1,
                        num_kv_heads=1, head_dim=1, dtype="bf16", device="cpu")
        identity = CacheIdentity.of(spec, plan.model, SIMULATED_WEIGHTS)
        return PagePool(spec), HostTier(self.slots * spec.bytes_per_page, identity)

    def load_seconds(self, num_pages: int) -> float:
        """Time to load ``num_pages`` pages (0 when loads are not charged)."""
        if self.load_bytes_per_s is None:
            return 0.0
        return num_pages * self.page_bytes / self.load_bytes_per_s


class StepClock:
    """Vectorized decode-step times from a plan and a throughput model."""

    def __init__(self, plan: CapacityPlan, model: ThroughputModel) -> None:
        self.t0 = model.t0_s
        self.rate = plan.gpu_bandwidth_gbs * 1e9 * model.efficiency
        self.dense = plan.decode_dense_weight_bytes
        self.routed = plan.decode_routed_weight_bytes
        self.experts = plan.num_experts
        self.top_k = plan.experts_top_k
        self.kv = plan.kv_bytes_per_token_per_gpu
        self.sliding = plan.kv_sliding_bytes_per_token_per_gpu
        self.window = plan.sliding_window

    def chunk_seconds(self, ctx: npt.NDArray[np.int64], n: npt.NDArray[np.int64]) -> float:
        """Time for decode steps where request ``i`` (context ``ctx[i]``) runs ``n[i]`` steps."""
        k = int(n.max()) if n.size else 0
        if k == 0:
            return 0.0
        order = np.argsort(n)
        n_sorted, ctx_sorted = n[order], ctx[order]
        steps = np.arange(k)
        first_active = np.searchsorted(n_sorted, steps, side="right")  # n_i > j are active
        active = n.size - first_active
        suffix = np.concatenate([np.cumsum(ctx_sorted[::-1])[::-1], [0]])
        ctx_sum = suffix[first_active] + active * (steps + 1)
        nbytes = self.dense + self.kv * ctx_sum.astype(np.float64)
        if self.experts:
            frac = 1.0 - (1.0 - self.top_k / self.experts) ** active
            nbytes += self.routed * frac
        if self.sliding:
            nbytes += self.sliding * active * min(self.window, int(ctx.mean()) if ctx.size else 0)
        with np.errstate(over="ignore"):  # an absurd step model: Simulation._record refuses inf
            return float(np.sum(self.t0 + nbytes / self.rate))

    def tokens(self, num_tokens: int, rate: float | None) -> float:
        return 0.0 if rate is None else num_tokens / rate


class Simulation:
    """One run: the manager, who waits and who runs, the clock, and the report's figures.

    :meth:`run` is the loop of the module docstring; request ids are arrival indices.
    """

    def __init__(
        self,
        workload: Workload,
        plan: CapacityPlan,
        mgr: KVCacheManager,
        arr: Arrivals,
        clock: StepClock,
        max_running: int,
        chunk: int,
        prefill_tokens_per_s: float | None,
        sample_every: float,
        host: HostPlan | None = None,
    ) -> None:
        self.workload, self.plan, self.mgr, self.arr, self.clock = workload, plan, mgr, arr, clock
        self.host, self.host_load_s = host, 0.0
        self.max_running = max_running
        self.chunk = chunk
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.sample_every = sample_every
        total = self.total = workload.num_requests
        first = min(workload.concurrency or 0, total)  # closed loop: `concurrency` at t = 0
        self.next_arrival = first if workload.rate is None else 0
        self.waiting: deque[int] = deque(range(first))
        self.running: list[int] = []  # in admission order (the newest is preempted first)
        self.resumed_from: set[int] = set()
        self.remaining = arr.output.copy()
        self.namespaces = arr.namespace.tolist()
        self.loops = 0
        self.waited_since = np.ones(total, dtype=np.int64)  # the loop a request started waiting in
        self.arrived_at = np.full(total, np.nan)
        self.arrived_at[:first] = 0.0
        self.admitted_at = np.full(total, np.nan)
        self.queued = np.zeros(total, dtype=bool)
        self.now = 0.0
        self.completed = self.output_tokens = 0
        self.preemptions = self.resumes = self.recomputed = 0
        self.timeline: list[TimelinePoint] = []
        self.next_sample = 0.0
        self.run_sum = self.run_time = 0.0
        self.run_samples: list[int] = []
        self.max_run = self.max_wait = self.peak_used = 0

    def run(self, progress: Callable[[int, int], None] | None, wall0: float) -> None:
        """Admit, reserve, commit and release chunk by chunk until every request completed."""
        arr, total, open_loop = self.arr, self.total, self.workload.rate is not None
        last_progress = wall0
        while self.completed < total:
            self.loops += 1
            if open_loop:  # arrivals up to now
                while self.next_arrival < total and arr.times[self.next_arrival] <= self.now:
                    self._arrive(arr.times[self.next_arrival], self.loops)
            self.now += self._admit_waiting()
            if not self.running:
                if open_loop and self.next_arrival < total:
                    self.now = max(self.now, float(arr.times[self.next_arrival]))
                    continue
                if self.waiting:
                    i = self.waiting[0]
                    raise ConfigError(
                        f"request {i} ({int(arr.prompt[i])} prompt tokens) does not fit in an "
                        f"empty pool of {self.plan.kv_pages_per_gpu} pages x "
                        f"{self.plan.page_size}; use a bigger plan or shorter prompts."
                    )
                break  # pragma: no cover - every request arrived and completed
            ids, n, k = self._reserve_chunk()
            if not ids:
                continue
            self._run_chunk(ids, n, k)
            if progress is not None and time.perf_counter() - last_progress > 0.2:
                progress(self.completed, total)
                last_progress = time.perf_counter()
        if progress is not None:
            progress(self.completed, total)

    def _arrive(self, at: float, loop: int) -> None:
        """The next request arrives at ``at`` and waits from loop ``loop`` on."""
        i = self.next_arrival
        self.waiting.append(i)
        self.waited_since[i] = loop
        self.arrived_at[i] = at
        self.next_arrival += 1

    def _admit_waiting(self) -> float:
        """Admit (or resume) waiting requests in order; commit their prompts in one batch.
        Returns the prefill seconds it charges."""
        mgr, arr, page = self.mgr, self.arr, self.plan.page_size
        spent = 0.0
        new_ids: list[int] = []
        pending: list[int] = []
        tails: list[npt.NDArray[np.int64]] = []
        while self.waiting and len(self.running) < self.max_running:
            i = self.waiting[0]
            ns = self.namespaces[i]
            resuming = i in self.resumed_from
            try:
                if resuming:
                    if not mgr.can_resume(i):
                        break
                    res = mgr.resume(i)
                    self.resumes += 1
                    self.recomputed += res.num_prompt_tokens - res.num_cached_tokens
                else:
                    tokens = arr.tokens(i)
                    # can_admit() is certain when even a miss leaves the watermark free:
                    # skip its prefix lookup then (admit() does one anyway).
                    need = -(-tokens.size // page) + mgr.watermark_pages
                    if need > _available(mgr) and not mgr.can_admit(tokens, namespace=ns):
                        break
                    res = mgr.admit(i, tokens, namespace=ns)
            except OutOfPagesError:
                break
            self.waiting.popleft()
            self.resumed_from.discard(i)
            self.queued[i] |= self.loops > self.waited_since[i]
            work = res.num_prompt_tokens - res.num_cached_tokens
            if work:
                # The prompt's KV now exists in the pool (a disaggregated decode pool receives
                # it; a colocated one computes it at the prefill rate): commit it below.
                generated = int(arr.output[i] - self.remaining[i])
                new_ids.append(i)
                pending.append(work)
                prompt = arr.tokens(i) if resuming else tokens
                tails.append(_tail(prompt, generated, work))
            spent += self.clock.tokens(work, self.prefill_tokens_per_s)
            if res.num_host_pages and self.host is not None:
                loading = self.host.load_seconds(res.num_host_pages)
                self.host_load_s += loading
                spent += loading
            if np.isnan(self.admitted_at[i]):
                self.admitted_at[i] = self.now
            self.running.append(i)
        if new_ids:  # admission mapped every prompt page already: this allocates nothing
            mgr.reserve(new_ids, pending)
            mgr.commit_batch(new_ids, tails)
        return spent

    def _reserve_chunk(self) -> tuple[list[int], npt.NDArray[np.int64], int]:
        """Who runs this chunk, the steps each runs and the chunk's length ``k``: ``chunk``
        steps, else the most the pool can give, else the newest request is preempted."""
        mgr, ids = self.mgr, self.running  # ids is the running list itself
        rem = self.remaining[np.asarray(ids, dtype=np.int64)]
        k = self.chunk
        n = np.minimum(rem, k)
        while not mgr.can_reserve(ids, n):
            k = _largest_fitting(mgr, ids, rem, k)
            if k > 0:
                n = np.minimum(rem, k)
                break
            victim = ids.pop()  # the newest request gives its pages back
            mgr.preempt(victim)
            self.waited_since[victim] = self.loops
            self.preemptions += 1
            self.resumed_from.add(victim)
            self.waiting.appendleft(victim)
            rem = self.remaining[np.asarray(ids, dtype=np.int64)]
            n = np.minimum(rem, k)
            if not ids:
                break
        return ids, n, k

    def _run_chunk(self, ids: list[int], n: npt.NDArray[np.int64], k: int) -> None:
        """Request ``ids[j]`` decodes ``n[j]`` of the chunk's ``k`` steps; the finished leave."""
        mgr = self.mgr
        ids_arr = np.asarray(ids, dtype=np.int64)
        ctx = _ctx(self.arr, self.remaining, ids)
        mgr.reserve(ids, n)  # type: ignore[arg-type]  # it takes int arrays too
        whole = n == k
        if whole.all():
            mgr.commit_batch(ids, _zeros(len(ids), k))
        else:  # the requests that finish inside the chunk commit fewer tokens
            whole_ids = ids_arr[whole].tolist()
            if whole_ids:
                mgr.commit_batch(whole_ids, _zeros(len(whole_ids), k))
            part = np.flatnonzero(~whole & (n > 0))
            mgr.commit_batch(
                ids_arr[part].tolist(), [np.zeros(int(n[j]), dtype=np.int32) for j in part]
            )
        spent = self.clock.chunk_seconds(ctx, n)
        self._record(len(ids), spent)
        self.now += spent
        self.remaining[ids_arr] -= n
        self.output_tokens += int(n.sum())
        done = self.remaining[ids_arr] == 0
        if done.any():
            finished = ids_arr[done].tolist()
            mgr.release_batch(finished)
            self.completed += len(finished)
            gone = set(finished)
            self.running[:] = [i for i in self.running if i not in gone]
            if self.workload.concurrency is not None:  # each finished client sends its next one
                for _ in finished:
                    if self.next_arrival < self.total:
                        self._arrive(self.now, self.loops + 1)

    def _record(self, num_running: int, spent: float) -> None:
        """Statistics over a chunk of ``spent`` seconds (before its releases)."""
        if not math.isfinite(self.now + spent):  # the sampling loop below would never end
            raise ConfigError(
                f"simulated time passed a float's range ({self.now + spent}): the step model "
                f"(t0_s={self.clock.t0:g}, {self.clock.rate:g} bytes/s) or the arrival rate "
                f"(rate={self.workload.rate}) is out of scale; use a realistic t0, efficiency "
                "and rate."
            )
        # Pages requests map: neither free nor merely cached (evictable) by the prefix cache.
        used_pages = self.mgr.num_pages - _available(self.mgr)
        self.peak_used = max(self.peak_used, used_pages)
        self.run_sum += num_running * spent
        self.run_time += spent
        self.max_run = max(self.max_run, num_running)
        self.max_wait = max(self.max_wait, len(self.waiting))
        self.run_samples.append(num_running)
        while self.next_sample <= self.now + spent:
            self.timeline.append(
                TimelinePoint(
                    t=self.next_sample,
                    running=num_running,
                    waiting=len(self.waiting),
                    preempted=len(self.resumed_from),
                    used_pages=used_pages,
                )
            )
            self.next_sample += self.sample_every

    def report(self, wall0: float) -> SimulationReport:
        """What happened, for a run that started at ``wall0`` (``time.perf_counter()``)."""
        plan, stats = self.plan, self.mgr.stats()
        delays = self.admitted_at - self.arrived_at
        delays = delays[~np.isnan(delays)]
        now = self.now
        return SimulationReport(
            model=plan.model,
            kv_dtype=plan.kv_dtype,
            num_pages=plan.kv_pages_per_gpu,
            page_size=plan.page_size,
            kv_tokens=plan.kv_pages_per_gpu * plan.page_size,
            num_requests=self.total,
            num_completed=self.completed,
            simulated_seconds=now,
            wall_seconds=time.perf_counter() - wall0,
            output_tokens=self.output_tokens,
            output_tokens_per_s=self.output_tokens / now if now > 0 else 0.0,
            mean_running=self.run_sum / self.run_time if self.run_time > 0 else 0.0,
            max_running=self.max_run,
            p50_running=float(np.median(self.run_samples)) if self.run_samples else 0.0,
            max_waiting=self.max_wait,
            num_queued=int(self.queued.sum()),
            queue_delay_p50_s=float(np.percentile(delays, 50)) if delays.size else 0.0,
            queue_delay_p95_s=float(np.percentile(delays, 95)) if delays.size else 0.0,
            queue_delay_max_s=float(delays.max()) if delays.size else 0.0,
            num_preemptions=self.preemptions,
            num_resumes=self.resumes,
            recomputed_tokens=self.recomputed,
            prefix_hit_rate=stats.prefix_hit_rate,
            peak_page_usage=self.peak_used / self.mgr.num_pages,
            num_evictions=stats.num_evictions,
            timeline=self.timeline,
            **self._host_figures(stats),
        )

    def _host_figures(self, stats: Any) -> dict[str, Any]:
        """The report's host-tier fields (none without a tier)."""
        host, off = self.host, stats.offload
        if host is None or off is None:
            return {}
        stand_in = off.tier.capacity_bytes // host.slots  # the stand-in pool's page bytes
        stored = off.tier.bytes_stored // stand_in
        hit_tokens = off.loaded_pages * self.plan.page_size
        query = stats.prefix_query_tokens
        return {
            "offload_gib": host.gib, "offload_pages_per_gpu": host.pages,
            "host_hit_rate": hit_tokens / query if query else 0.0,
            "host_hit_tokens": hit_tokens, "host_stored_pages": stored,
            "host_loaded_pages": off.loaded_pages,
            "host_bytes_stored_per_gpu": stored * host.page_bytes,
            "host_bytes_loaded_per_gpu": off.loaded_pages * host.page_bytes,
            "host_evictions": off.tier.num_evictions, "host_load_seconds": self.host_load_s,
        }


def _available(mgr: KVCacheManager) -> int:
    """Pages an allocation can get now: free plus evictable cached pages."""
    return mgr.allocator.num_free + (mgr.cache.num_evictable if mgr.cache is not None else 0)


_ZEROS: dict[tuple[int, int], npt.NDArray[np.int32]] = {}


def _zeros(rows: int, cols: int) -> npt.NDArray[np.int32]:
    """Generated token ids (the simulation generates token 0), reused between chunks."""
    key = (rows, cols)
    if key not in _ZEROS:
        if len(_ZEROS) > 64:
            _ZEROS.clear()
        _ZEROS[key] = np.zeros(key, dtype=np.int32)
    return _ZEROS[key]


def _ctx(
    arr: Arrivals, remaining: npt.NDArray[np.int64], ids: Sequence[int]
) -> npt.NDArray[np.int64]:
    """Tokens each running request holds: its prompt plus what it generated so far."""
    idx = np.asarray(ids, dtype=np.int64)
    return arr.prompt[idx] + arr.output[idx] - remaining[idx]


def _tail(prompt: npt.NDArray[np.int64], generated: int, pending: int) -> npt.NDArray[np.int64]:
    """The last ``pending`` tokens of the request so far: its prompt, then ``generated`` tokens
    (the simulation generates token 0)."""
    if generated:
        prompt = np.concatenate([prompt, np.zeros(generated, dtype=np.int64)])
    return prompt[prompt.size - pending :]


def _largest_fitting(
    mgr: KVCacheManager, ids: Sequence[int], rem: npt.NDArray[np.int64], k: int
) -> int:
    """The largest ``k' < k`` steps whose pages the pool can give now (0 if not even one)."""
    lo, hi = 0, k - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mgr.can_reserve(ids, np.minimum(rem, mid).tolist()):
            lo = mid
        else:
            hi = mid - 1
    return lo
