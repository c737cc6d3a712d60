"""``kvmem simulate``: continuous batching driven through the real :class:`KVCacheManager`.

This module sits above the manager (it drives one); :mod:`kvmem.planning` stays pure, and this
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
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmem._models import NonNegativeInt, NonNegativeReal, PositiveInt, PositiveReal, SpecModel
from kvmem._validate import flag, integer, real, show
from kvmem.errors import ArgumentTypeError, ConfigError, OutOfPagesError
from kvmem.manager import KVCacheManager
from kvmem.planning import CapacityPlan, ThroughputModel, plan_capacity

__all__ = [
    "LengthDist",
    "SimulationReport",
    "TimelinePoint",
    "Workload",
    "simulate",
]

logger = logging.getLogger(__name__)

_FROZEN = ConfigDict(frozen=True, extra="forbid")
# The report's Kimi K2.6 BF16 points fitted with kvmem.planning.fit_throughput.
DEFAULT_STEP_MODEL = ThroughputModel(t0_s=0.0054, efficiency=0.70, context_len=4096)


class LengthDist(SpecModel):
    """A token-length distribution: ``fixed`` (``a``), ``uniform`` on ``[a, b]``, or
    ``lognormal`` with median ``a`` and log-sigma ``b`` (clipped to ``[1, max_len]``)."""

    kind: Literal["fixed", "uniform", "lognormal"] = "uniform"
    a: PositiveReal
    b: NonNegativeReal = 0.0
    max_len: PositiveInt = 1 << 20

    @model_validator(mode="after")
    def _check(self) -> LengthDist:
        if self.kind == "uniform" and self.b < self.a:
            raise ConfigError(f"a uniform length needs b >= a; got [{self.a}, {self.b}].")
        return self

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``"512"``, ``"10000-18000"`` or ``"lognormal:1000,0.6"``."""
        if not isinstance(text, str):
            raise ArgumentTypeError(f"text={show(text)}: expected a str such as '10000-18000'.")
        t = text.strip().lower()
        try:
            if t.startswith("lognormal:"):
                median, sigma = t.split(":", 1)[1].split(",")
                return cls(kind="lognormal", a=float(median), b=float(sigma))
            if "-" in t:
                lo, hi = t.split("-", 1)
                return cls(kind="uniform", a=float(lo), b=float(hi))
            return cls(kind="fixed", a=float(t))
        except ValueError as exc:
            raise ConfigError(
                f"cannot read the length {text!r}; use N, LO-HI or lognormal:MEDIAN,SIGMA."
            ) from exc

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b + 1, n)
        else:
            x = rng.lognormal(math.log(self.a), self.b, n)
        return np.clip(np.floor(x), 1, self.max_len).astype(np.int64)

    def high(self) -> float:
        """A length no sample exceeds (lognormal: the clip, or median * e^(5 sigma))."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return self.b
        return min(self.max_len, self.a * math.exp(5 * self.b))


class Workload(SpecModel):
    """Who asks for what.

    Arrivals are either closed-loop (``concurrency`` clients, each sending its next request when
    the previous one finishes) or open-loop Poisson at ``rate`` requests/s. ``prompt_len``
    includes the shared prefix: a fraction ``prefix_fraction`` of requests starts with one of
    ``num_prefixes`` shared prefixes of ``prefix_len`` tokens (chosen uniformly).
    """

    num_requests: PositiveInt
    concurrency: PositiveInt | None = None
    rate: PositiveReal | None = None
    prompt_len: LengthDist
    output_len: LengthDist
    num_prefixes: NonNegativeInt = 0
    prefix_len: NonNegativeInt = 0
    prefix_fraction: NonNegativeReal = Field(default=1.0, le=1)
    namespaces: PositiveInt = 1
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if (self.concurrency is None) == (self.rate is None):
            raise ConfigError(
                "a workload needs exactly one of concurrency (closed loop) or rate (Poisson)."
            )
        if self.num_prefixes and not self.prefix_len:
            raise ConfigError("num_prefixes > 0 needs prefix_len > 0.")
        return self


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
        return "\n".join(lines)


_M = 100_000  # token ids of the simulated prompts are below 2 * _M (+ the request count)


class _Arrivals:
    """Request lengths and token ids, generated lazily in blocks (a million prompts of
    thousands of tokens would not fit in memory)."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.rng = np.random.default_rng(w.seed)
        self.prompt = w.prompt_len.sample(self.rng, w.num_requests)
        self.output = w.output_len.sample(self.rng, w.num_requests)
        self.prefix_id = np.full(w.num_requests, -1, dtype=np.int64)
        if w.num_prefixes:
            use = self.rng.random(w.num_requests) < w.prefix_fraction
            self.prefix_id[use] = self.rng.integers(0, w.num_prefixes, int(use.sum()))
            self.prompt[use] = np.maximum(self.prompt[use], w.prefix_len + 1)
        self.namespace = self.rng.integers(0, w.namespaces, w.num_requests)
        if w.rate is not None:
            self.times = np.cumsum(self.rng.exponential(1.0 / w.rate, w.num_requests))
        else:
            self.times = np.zeros(w.num_requests)
        prefix_rng = np.random.default_rng(w.seed + 1)
        self.prefixes = [
            prefix_rng.integers(0, 100_000, w.prefix_len).astype(np.int64)
            for _ in range(w.num_prefixes)
        ]
        # Request i's own tokens are (7919 j + i) mod M, j = 0, 1, ...: since 7919 is invertible
        # mod M, that is the sequence (7919 j) mod M read from j = i / 7919 mod M, so every
        # request's tokens are one slice of this table (see tokens()).
        longest = int(self.prompt.max()) if w.num_requests else 0
        self._own = (np.arange(_M + longest, dtype=np.int64) * 7919) % _M
        self._start = (np.arange(w.num_requests, dtype=np.int64) * pow(7919, -1, _M)) % _M
        self._prompt_list = self.prompt.tolist()
        self._prefix_list = self.prefix_id.tolist()

    def tokens(self, i: int) -> npt.NDArray[np.int64]:
        """Request ``i``'s prompt: its prefix, then tokens no other request shares (the first
        one encodes ``i``), so the only prefix hits are the intended ones: the own tokens are
        ``(7919 j + i) % 100_000`` for ``j = 0, 1, ...``, the first one ``100_000 + i``."""
        n = self._prompt_list[i]
        p = self._prefix_list[i]
        out = np.empty(n, dtype=np.int64)
        h = self.prefixes[p].size if p >= 0 else 0
        if h:
            out[:h] = self.prefixes[p]
        start = int(self._start[i])
        out[h:] = self._own[start : start + n - h]
        out[h] = 100_000 + i  # unique per request
        return out


class _StepClock:
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
        return float(np.sum(self.t0 + nbytes / self.rate))

    def tokens(self, num_tokens: int, rate: float | None) -> float:
        return 0.0 if rate is None else num_tokens / rate


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
        Decode steps per batched manager call.
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

    Returns
    -------
    SimulationReport
    """
    wall0 = time.perf_counter()
    if not isinstance(workload, Workload):
        raise ArgumentTypeError(f"workload={show(workload)}: expected a Workload.")
    if plan is not None and not isinstance(plan, CapacityPlan):
        raise ArgumentTypeError(f"plan={show(plan)}: expected a CapacityPlan (plan_capacity).")
    if step_model is not None and not isinstance(step_model, ThroughputModel):
        raise ArgumentTypeError(f"step_model={show(step_model)}: expected a ThroughputModel.")
    max_running = integer(max_running, "max_running", minimum=1)
    chunk = integer(chunk, "chunk", minimum=1)
    if prefill_tokens_per_s is not None:
        prefill_tokens_per_s = real(
            prefill_tokens_per_s, "prefill_tokens_per_s", minimum=0, exclusive_minimum=True
        )
    if sample_every is not None:
        sample_every = real(sample_every, "sample_every", minimum=0, exclusive_minimum=True)
    prefix_cache = flag(prefix_cache, "prefix_cache")
    if progress is not None and not callable(progress):
        raise ArgumentTypeError(f"progress={show(progress)}: expected None or a callable.")
    plan = plan or plan_capacity(model, gpu, tp, kv_dtype=kv_dtype)
    step_model = step_model or DEFAULT_STEP_MODEL
    page = plan.page_size
    longest = workload.prompt_len.high() + workload.output_len.high()
    max_pages_per_seq = max(1, min(plan.kv_pages_per_gpu, math.ceil(longest / page) + 1))
    mgr = KVCacheManager(
        num_pages=plan.kv_pages_per_gpu,
        page_size=page,
        max_seqs=max_running,
        max_pages_per_seq=max_pages_per_seq,
        prefix_cache="hashed" if prefix_cache else None,
    )
    arr = _Arrivals(workload)
    longest_sample = int((arr.prompt + arr.output).max())
    if -(-longest_sample // page) > plan.kv_pages_per_gpu:
        i = int(np.argmax(arr.prompt + arr.output))
        raise ConfigError(
            f"request {i} ({int(arr.prompt[i])} prompt + {int(arr.output[i])} output tokens) "
            f"does not fit in an empty pool of {plan.kv_pages_per_gpu} pages x {page}; use a "
            "bigger plan or shorter requests."
        )
    clock = _StepClock(plan, step_model)
    total = workload.num_requests
    if sample_every is None:
        sample_every = _default_sample_every(arr, workload, clock)

    now = 0.0
    next_arrival = workload.concurrency or 0  # closed loop: the first `concurrency` at t = 0
    waiting: deque[int] = deque(range(min(next_arrival, total)))
    arrived_at = np.full(total, np.nan)
    arrived_at[: min(next_arrival, total)] = 0.0
    admitted_at = np.full(total, np.nan)
    queued = np.zeros(total, dtype=bool)
    if workload.rate is not None:
        next_arrival = 0
    running: list[int] = []  # in admission order (the newest is preempted first)
    remaining = arr.output.copy()
    resumed_from: set[int] = set()
    completed = 0
    output_tokens = 0
    preemptions = resumes = recomputed = 0
    timeline: list[TimelinePoint] = []
    next_sample = 0.0
    run_sum = 0.0
    run_time = 0.0
    run_samples: list[int] = []
    max_run = max_wait = 0
    peak_used = 0
    last_progress = wall0
    loops = 0
    waited_since = np.ones(total, dtype=np.int64)  # the loop a request started waiting in
    namespaces = arr.namespace.tolist()

    def admit_waiting() -> float:
        """Admit (or resume) waiting requests in order; commit their prompts in one batch."""
        nonlocal resumes, recomputed
        spent = 0.0
        new_ids: list[int] = []
        pending: list[int] = []
        tails: list[npt.NDArray[np.int64]] = []
        while waiting and len(running) < max_running:
            i = waiting[0]
            ns = namespaces[i]
            resuming = i in resumed_from
            try:
                if resuming:
                    if not mgr.can_resume(i):
                        break
                    res = mgr.resume(i)
                    resumes += 1
                    recomputed += res.num_prompt_tokens - res.num_cached_tokens
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
            waiting.popleft()
            resumed_from.discard(i)
            queued[i] |= loops > waited_since[i]
            work = res.num_prompt_tokens - res.num_cached_tokens
            if work:
                # The prompt's KV now exists in the pool (a disaggregated decode pool receives
                # it; a colocated one computes it at the prefill rate): commit it below.
                generated = int(arr.output[i] - remaining[i])
                new_ids.append(i)
                pending.append(work)
                prompt = arr.tokens(i) if resuming else tokens
                tails.append(_tail(prompt, generated, work))
            spent += clock.tokens(work, prefill_tokens_per_s)
            if np.isnan(admitted_at[i]):
                admitted_at[i] = now
            running.append(i)
        if new_ids:  # admission mapped every prompt page already: this allocates nothing
            mgr.reserve(new_ids, pending)
            mgr.commit_batch(new_ids, tails)
        return spent

    while completed < total:
        loops += 1
        # Arrivals up to now (open loop).
        if workload.rate is not None:
            while next_arrival < total and arr.times[next_arrival] <= now:
                waiting.append(next_arrival)
                waited_since[next_arrival] = loops
                arrived_at[next_arrival] = arr.times[next_arrival]
                next_arrival += 1
        now += admit_waiting()
        if not running:
            if workload.rate is not None and next_arrival < total:
                now = max(now, float(arr.times[next_arrival]))
                continue
            if waiting:
                raise ConfigError(
                    f"request {waiting[0]} ({int(arr.prompt[waiting[0]])} prompt tokens) does not "
                    f"fit in an empty pool of {plan.kv_pages_per_gpu} pages x {page}; use a "
                    "bigger plan or shorter prompts."
                )
            break  # pragma: no cover - every request arrived and completed
        ids = running
        ids_arr = np.asarray(ids, dtype=np.int64)
        rem = remaining[ids_arr]
        k = chunk
        n = np.minimum(rem, k)
        while not mgr.can_reserve(ids, n):
            k = _largest_fitting(mgr, ids, rem, k)
            if k > 0:
                n = np.minimum(rem, k)
                break
            victim = running.pop()  # the newest request gives its pages back
            mgr.preempt(victim)
            waited_since[victim] = loops
            preemptions += 1
            resumed_from.add(victim)
            waiting.appendleft(victim)
            ids = running
            ids_arr = np.asarray(ids, dtype=np.int64)
            rem = remaining[ids_arr]
            n = np.minimum(rem, k)
            if not ids:
                break
        if not ids:
            continue
        ctx = _ctx(arr, remaining, ids)
        mgr.reserve(ids, n)
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
        spent = clock.chunk_seconds(ctx, n)
        # Statistics over the chunk (before releases).
        # Pages requests map: neither free nor merely cached (evictable) by the prefix cache.
        used_pages = mgr.num_pages - _available(mgr)
        peak_used = max(peak_used, used_pages)
        run_sum += len(ids) * spent
        run_time += spent
        max_run = max(max_run, len(ids))
        max_wait = max(max_wait, len(waiting))
        run_samples.append(len(ids))
        while next_sample <= now + spent:
            timeline.append(
                TimelinePoint(
                    t=next_sample,
                    running=len(ids),
                    waiting=len(waiting),
                    preempted=len(resumed_from),
                    used_pages=used_pages,
                )
            )
            next_sample += sample_every
        now += spent
        remaining[ids_arr] -= n
        output_tokens += int(n.sum())
        done = remaining[ids_arr] == 0
        if done.any():
            finished = ids_arr[done].tolist()
            mgr.release_batch(finished)
            completed += len(finished)
            gone = set(finished)
            running[:] = [i for i in running if i not in gone]
            if workload.concurrency is not None:  # each finished client sends its next one
                for _ in finished:
                    if next_arrival < total:
                        waiting.append(next_arrival)
                        waited_since[next_arrival] = loops + 1
                        arrived_at[next_arrival] = now
                        next_arrival += 1
        if progress is not None and time.perf_counter() - last_progress > 0.2:
            progress(completed, total)
            last_progress = time.perf_counter()
    if progress is not None:
        progress(completed, total)

    stats = mgr.stats()
    delays = admitted_at - arrived_at
    delays = delays[~np.isnan(delays)]
    return SimulationReport(
        model=plan.model,
        kv_dtype=plan.kv_dtype,
        num_pages=plan.kv_pages_per_gpu,
        page_size=page,
        kv_tokens=plan.kv_pages_per_gpu * page,
        num_requests=total,
        num_completed=completed,
        simulated_seconds=now,
        wall_seconds=time.perf_counter() - wall0,
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / now if now > 0 else 0.0,
        mean_running=run_sum / run_time if run_time > 0 else 0.0,
        max_running=max_run,
        p50_running=float(np.median(run_samples)) if run_samples else 0.0,
        max_waiting=max_wait,
        num_queued=int(queued.sum()),
        queue_delay_p50_s=float(np.percentile(delays, 50)) if delays.size else 0.0,
        queue_delay_p95_s=float(np.percentile(delays, 95)) if delays.size else 0.0,
        queue_delay_max_s=float(delays.max()) if delays.size else 0.0,
        num_preemptions=preemptions,
        num_resumes=resumes,
        recomputed_tokens=recomputed,
        prefix_hit_rate=stats.prefix_hit_rate,
        peak_page_usage=peak_used / mgr.num_pages,
        num_evictions=stats.num_evictions,
        timeline=timeline,
    )


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
    arr: _Arrivals, remaining: npt.NDArray[np.int64], ids: Sequence[int]
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


def _default_sample_every(arr: _Arrivals, w: Workload, clock: _StepClock) -> float:
    """About 200 samples over the expected run."""
    per_step = clock.t0 + clock.dense / clock.rate
    batch = w.concurrency or 64
    steps = float(arr.output.sum()) / batch
    horizon = max(steps * per_step, float(arr.times[-1]) if w.rate else 0.0)
    return max(horizon / 200, 1e-3)
