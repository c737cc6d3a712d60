"""Differential conformance: vLLM's ``Scheduler`` on its own manager and on kvmem's, step by step.

A *stream* (:class:`StreamSpec`) is a scheduler configuration and a list of requests
(:class:`RequestSpec`: arrival step, prompt, ``cache_salt``, ``max_tokens``, optional abort
step). :func:`run_stream` drives one scheduler over it with a synthetic model: each step's
sampled token is a deterministic function of the request and the position (:func:`token_at`),
a request stops on ``max_tokens`` or on the stop token. It records, per step, what the step
scheduled (:class:`StepRecord`): new requests with their prefix-hit ``num_computed_tokens``,
running ones, ``num_scheduled_tokens``, preempted and finished ids, the *sharing structure* of
the block tables the workers would build (which requests share a block at which position;
block ids themselves may differ), and the KV events' cache contents (which prefix was stored or
removed; hashes differ). :func:`compare` runs both schedulers and returns every difference.

The synthetic model and the stream generator need no GPU and no model weights: a scheduler is
built with :func:`make_vllm_config` from a tiny model ``config.json`` written to a temp folder.
Every function here imports vLLM; :func:`kvmem.integrations.vllm.vllm_import_error` says how to
get it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import tempfile
import time
import zlib
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STOP_TOKEN",
    "Driver",
    "RequestSpec",
    "SchedulerSpec",
    "StepRecord",
    "StreamResult",
    "StreamSpec",
    "compare",
    "make_scheduler",
    "make_vllm_config",
    "random_stream",
    "run_stream",
    "token_at",
]

STOP_TOKEN = 7
VOCAB = 997


@dataclass(frozen=True)
class SchedulerSpec:
    """The scheduler's configuration (what a stream varies)."""

    num_blocks: int = 64
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 256
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    watermark: float = 0.0
    async_scheduling: bool = False
    kv_events: bool = True
    policy: str = "fcfs"
    paranoid: bool = False  # kvmem: verify the workers' block tables (every entry) each step


@dataclass(frozen=True)
class RequestSpec:
    """One request: arrives before step ``arrival`` is scheduled, aborted before step
    ``abort_at`` (if given and it is still unfinished)."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int = 0
    salt: str | None = None
    abort_at: int | None = None
    priority: int = 0


@dataclass(frozen=True)
class StreamSpec:
    """A stream: ``run_stream(StreamSpec(...))`` replays it exactly."""

    sched: SchedulerSpec
    requests: tuple[RequestSpec, ...]
    max_steps: int = 400
    seed: int = 0
    pipeline: int = 1  # steps scheduled before the oldest one's output is handed back


@dataclass
class StepRecord:
    """What one step scheduled, in a form both managers must agree on."""

    new: list[tuple[str, int]]  # (request id, prefix-hit num_computed_tokens), in order
    cached: list[str]  # running or resumed requests, in order
    resumed: list[str]
    num_scheduled: dict[str, int]
    preempted: list[str]
    finished: list[str]
    sharing: list[tuple[str, int, int]]  # (request, position, first (req, pos) with its block)
    usage: float  # the scheduler's KV cache usage after the step was scheduled
    events: Counter[tuple[Any, ...]] = field(default_factory=Counter)

    def key(self) -> tuple[Any, ...]:
        return (self.new, self.cached, self.resumed, sorted(self.num_scheduled.items()),
                self.preempted, self.finished, self.sharing, self.usage,
                sorted(self.events.items()))


@dataclass
class StreamResult:
    steps: list[StepRecord]
    outputs: dict[str, tuple[int, ...]]  # every request's final output tokens
    finish: dict[str, str]  # finish reason per request
    step_us: list[float]  # schedule() + update_from_output() per step
    verify_failures: int = 0  # requests kvmem's integrity check aborted (kvmem only)
    table_mismatches: int = 0  # handed-out block ids that differ from kvmem's pages


def token_at(rid: str, position: int, seed: int = 0) -> int:
    """The synthetic model's sampled token for request ``rid`` at ``position`` (deterministic;
    the stop token about one time in 24)."""
    h = zlib.crc32(f"{seed}:{rid}:{position}".encode())
    return STOP_TOKEN if h % 24 == 0 else 10 + h % (VOCAB - 10)


# -- building vLLM objects ---------------------------------------------------------------------


@functools.cache
def _model_dir() -> str:
    """A folder with a tiny model config.json: what ModelConfig needs, without weights."""
    path = os.path.join(tempfile.gettempdir(), "kvmem_vllm_tiny_model")
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 1 << 20,
           "torch_dtype": "float16", "rms_norm_eps": 1e-5}
    target = os.path.join(path, "config.json")
    tmp = f"{target}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cfg, f)
    os.replace(tmp, target)
    return path


@functools.cache
def _model_config(max_model_len: int) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0,
                       max_model_len=max_model_len)


def make_vllm_config(spec: SchedulerSpec) -> tuple[Any, Any]:
    """``(VllmConfig, KVCacheConfig)`` for a CPU-only scheduler with one full-attention group."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVEventsConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    sc = SchedulerConfig(
        max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len, enable_chunked_prefill=True,
        long_prefill_token_threshold=spec.long_prefill_token_threshold,
        watermark=spec.watermark, async_scheduling=spec.async_scheduling,
        is_encoder_decoder=False, policy=spec.policy)
    cc = CacheConfig(block_size=spec.block_size, enable_prefix_caching=spec.enable_prefix_caching)
    cc.num_gpu_blocks = spec.num_blocks
    events = (KVEventsConfig(enable_kv_cache_events=True, publisher="null")
              if spec.kv_events else None)
    vc = VllmConfig(scheduler_config=sc, model_config=_model_config(spec.max_model_len),
                    cache_config=cc, device_config=DeviceConfig(device="cpu"),
                    kv_events_config=events)
    kc = KVCacheConfig(num_blocks=spec.num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=spec.block_size, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    return vc, kc


class _Recorder:
    """Stands in for the KV event publisher: keeps the batches it is given."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def make_scheduler(spec: SchedulerSpec, kvmem: bool, log_stats: bool = False) -> Any:
    """vLLM's ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling``), on vLLM's own manager
    or (``kvmem=True``) kvmem's."""
    from vllm.v1.structured_output import StructuredOutputManager

    if kvmem:
        from kvmem.integrations.vllm._scheduler import KVMemAsyncScheduler, KVMemScheduler

        cls: Any = KVMemAsyncScheduler if spec.async_scheduling else KVMemScheduler
        if spec.paranoid:
            cls = type(f"Paranoid{cls.__name__}", (cls,), {"verify_block_tables": True})
    else:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        cls = AsyncScheduler if spec.async_scheduling else Scheduler
    vc, kc = make_vllm_config(spec)
    sched = cls(vllm_config=vc, kv_cache_config=kc,
                structured_output_manager=StructuredOutputManager(vc),
                block_size=spec.block_size, log_stats=log_stats)
    sched.kv_event_publisher = _Recorder()
    return sched


@functools.cache
def _block_hasher(block_size: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def make_request(r: RequestSpec, block_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=r.max_tokens, stop_token_ids=[STOP_TOKEN],
                            ignore_eos=True)
    return Request(request_id=r.rid, prompt_token_ids=list(r.prompt), sampling_params=params,
                   pooling_params=None, arrival_time=float(r.arrival), cache_salt=r.salt,
                   priority=r.priority, block_hasher=_block_hasher(block_size))


def model_output(sched: Any, out: Any, seed: int = 0) -> Any:
    """The synthetic model's ``ModelRunnerOutput`` for a step, built right after ``schedule()``
    returned it: one sampled token per request whose prompt (or resumed sequence) is complete
    after this step (``token_at`` its position), none otherwise."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in ids:
        req = sched.requests.get(rid)
        if req is None or req.is_prefill_chunk:
            sampled.append([])
        else:
            sampled.append([token_at(rid, req.num_computed_tokens, seed)])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


# -- recording ------------------------------------------------------------------------------


class _Worker:
    """The block tables a worker builds from the scheduler's outputs."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, out: Any) -> None:
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.tables.pop(rid, None)
        for nr in out.scheduled_new_reqs:
            self.tables[nr.req_id] = list(nr.block_ids[0])
        c = out.scheduled_cached_reqs
        for rid, nb in zip(c.req_ids, c.new_block_ids):
            if rid in c.resumed_req_ids:
                self.tables[rid] = list(nb[0]) if nb is not None else []
            elif nb is not None:
                self.tables.setdefault(rid, []).extend(nb[0])

    def sharing(self) -> list[tuple[str, int, int]]:
        """Each (request, position) with the index of the first (request, position), in
        sorted order, that holds the same block: equal exactly when the sharing is."""
        first: dict[int, int] = {}
        out: list[tuple[str, int, int]] = []
        i = 0
        for rid in sorted(self.tables):
            for pos, block in enumerate(self.tables[rid]):
                out.append((rid, pos, first.setdefault(block, i)))
                i += 1
        return out


class _EventContents:
    """KV events as cache contents: a stored or removed block is named by its whole prefix
    (root extra keys, then every token from the start), not by its hash."""

    def __init__(self) -> None:
        self.content: dict[Any, tuple[Any, ...]] = {}

    def convert(self, events: Sequence[Any]) -> Counter[tuple[Any, ...]]:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        out: Counter[tuple[Any, ...]] = Counter()
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.parent_block_hash is None:
                    root = ev.extra_keys[0] if ev.extra_keys else None
                    prefix: tuple[Any, ...] = (tuple(root) if root else (),)
                else:
                    prefix = self.content[ev.parent_block_hash]
                p = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    prefix = prefix + tuple(ev.token_ids[i * p : (i + 1) * p])
                    self.content[h] = prefix
                    out[("stored", prefix)] += 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    out[("removed", self.content[h])] += 1
            elif isinstance(ev, AllBlocksCleared):
                out[("cleared",)] += 1
        return out


class Driver:
    """One scheduler, driven the way an engine would, recording what every step scheduled.

    ``step()`` is ``schedule()``, the synthetic model, ``update_from_output()``; ``schedule()``
    and ``update(out)`` apart let a scenario pipeline steps as an engine with several batches in
    flight does. ``records`` holds one :class:`StepRecord` per ``schedule()`` (the events of an
    ``update`` go to the record of the step it updates).
    """

    def __init__(self, spec: SchedulerSpec, kvmem: bool, seed: int = 0,
                 check_tables: bool = True) -> None:
        self.spec = spec
        self.kvmem = kvmem
        self.seed = seed
        self.check_tables = check_tables
        self.sched = make_scheduler(spec, kvmem)
        self.worker = _Worker()
        self.contents = _EventContents()
        self.requests: dict[str, Any] = {}
        self.records: list[StepRecord] = []
        self.step_us: list[float] = []
        self.verify_failures = 0
        self.table_mismatches = 0
        self._record_of: dict[int, StepRecord] = {}
        self._output_of: dict[int, Any] = {}

    def add(self, r: RequestSpec) -> None:
        req = make_request(r, self.spec.block_size)
        self.requests[r.rid] = req
        self.sched.add_request(req)

    def abort(self, rids: Sequence[str]) -> None:
        from vllm.v1.request import RequestStatus

        live = [rid for rid in rids if rid in self.sched.requests]
        if live:
            self.sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)

    def schedule(self) -> Any:
        out = self.sched.schedule()
        self.worker.apply(out)
        c = out.scheduled_cached_reqs
        rec = StepRecord(
            new=[(nr.req_id, nr.num_computed_tokens) for nr in out.scheduled_new_reqs],
            cached=list(c.req_ids), resumed=sorted(c.resumed_req_ids),
            num_scheduled=dict(out.num_scheduled_tokens),
            preempted=sorted(out.preempted_req_ids), finished=sorted(out.finished_req_ids),
            sharing=self.worker.sharing(), usage=self.sched.get_kv_cache_usage())
        self.records.append(rec)
        self._record_of[id(out)] = rec
        # The model runs the step as scheduled, whenever its output is handed back.
        self._output_of[id(out)] = model_output(self.sched, out, self.seed)
        if self.kvmem and self.check_tables:
            self.table_mismatches += _table_mismatches(self.sched, self.worker)
        return out

    def update(self, out: Any) -> None:
        self.sched.update_from_output(out, self._output_of.pop(id(out)))
        recorder: _Recorder = self.sched.kv_event_publisher
        rec = self._record_of.pop(id(out))
        rec.events.update(self.contents.convert(recorder.events))
        recorder.events = []

    def run(self, max_steps: int = 1000) -> None:
        """Step until no request is left (or ``max_steps``)."""
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return
            self.step()

    def step(self) -> Any:
        t0 = time.perf_counter()
        out = self.schedule()
        self.update(out)
        self.step_us.append((time.perf_counter() - t0) * 1e6)
        return out

    def result(self) -> StreamResult:
        outputs = {rid: tuple(req.output_token_ids) for rid, req in self.requests.items()}
        finish = {}
        for rid, req in self.requests.items():
            reason = req.get_finished_reason()
            finish[rid] = "unfinished" if reason is None else str(reason)
        if self.kvmem:
            self.sched.kv_cache_manager.check()
            self.verify_failures = self.sched.kv_cache_manager.num_integrity_aborts
        return StreamResult(self.records, outputs, finish, self.step_us,
                            self.verify_failures, self.table_mismatches)


def run_stream(stream: StreamSpec, kvmem: bool, check_tables: bool = True) -> StreamResult:
    """Drive one scheduler over the stream (schedule, synthetic model, update_from_output per
    step) until every request finished or ``max_steps``."""
    d = Driver(stream.sched, kvmem, stream.seed, check_tables)
    arrivals: dict[int, list[RequestSpec]] = {}
    aborts: dict[int, list[str]] = {}
    for r in stream.requests:
        arrivals.setdefault(r.arrival, []).append(r)
        if r.abort_at is not None:
            aborts.setdefault(r.abort_at, []).append(r.rid)
    last_arrival = max((r.arrival for r in stream.requests), default=0)
    in_flight: deque[Any] = deque()  # scheduled steps whose output has not been handed back
    for step in range(stream.max_steps):
        for r in arrivals.get(step, ()):
            d.add(r)
        d.abort(aborts.get(step, ()))
        if step > last_arrival and not d.sched.has_requests():
            break
        in_flight.append(d.schedule())
        if len(in_flight) >= stream.pipeline:
            d.update(in_flight.popleft())
    while in_flight:
        d.update(in_flight.popleft())
    return d.result()


def _table_mismatches(sched: Any, worker: _Worker) -> int:
    """Requests whose block table (as the worker built it) is not kvmem's pages + 1."""
    mgr = sched.kv_cache_manager.manager
    bad = 0
    for rid in mgr.running:
        table = worker.tables.get(rid)
        if table is not None and table != (mgr.pages_of(rid) + 1).tolist():
            bad += 1
    return bad


@dataclass
class Comparison:
    """How the two runs of a stream differ (empty lists: they agree)."""

    stream: StreamSpec
    steps: int
    mismatched_steps: list[int]
    first_difference: str | None
    outputs_differ: list[str]
    verify_failures: int
    table_mismatches: int
    vllm: StreamResult
    kvmem: StreamResult

    @property
    def ok(self) -> bool:
        return (not self.mismatched_steps and not self.outputs_differ
                and not self.verify_failures and not self.table_mismatches)

    def replay(self) -> str:
        """A test that replays this stream."""
        return ("from kvmem.integrations.vllm.conformance import *\n\n"
                "def test_replay():\n"
                f"    stream = {self.stream!r}\n"
                "    assert compare(stream).ok\n")


def _describe(a: StepRecord, b: StepRecord) -> str:
    for name in ("new", "cached", "resumed", "num_scheduled", "preempted", "finished",
                 "sharing", "usage", "events"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            return f"{name}: vLLM {x!r} / kvmem {y!r}"
    return "equal"


def compare(stream: StreamSpec) -> Comparison:
    """Run the stream on vLLM's manager and on kvmem's; list every difference."""
    v = run_stream(stream, kvmem=False)
    k = run_stream(stream, kvmem=True)
    n = max(len(v.steps), len(k.steps))
    bad: list[int] = []
    first: str | None = None
    for i in range(n):
        if i >= len(v.steps) or i >= len(k.steps):
            bad.append(i)
            first = first or f"step {i}: one run ended ({len(v.steps)} vs {len(k.steps)} steps)"
            continue
        if v.steps[i].key() != k.steps[i].key():
            bad.append(i)
            if first is None:
                first = f"step {i}: {_describe(v.steps[i], k.steps[i])}"
    outs = sorted(rid for rid in v.outputs
                  if v.outputs[rid] != k.outputs.get(rid) or v.finish[rid] != k.finish.get(rid))
    if outs and first is None:
        first = f"final tokens of {outs[:4]} differ"
    return Comparison(stream, n, bad, first, outs, k.verify_failures, k.table_mismatches, v, k)


# -- random streams -------------------------------------------------------------------------


def random_stream(rng: random.Random, *, max_requests: int = 10) -> StreamSpec:
    """A stream that exercises prefix sharing at several depths, several salts, chunked
    prefill, aborts, and (often) a pool small enough to preempt. Same rng state, same stream."""
    block_size = rng.choice((2, 4, 8, 16))
    num_requests = rng.randint(1, max_requests)
    salts = [None, "tenant-a", "tenant-b"]
    roots = [tuple(rng.randrange(10, VOCAB) for _ in range(block_size * rng.randint(1, 5) + 3))
             for _ in range(rng.randint(1, 3))]
    priority = rng.random() < 0.2  # the priority policy preempts requests already scheduled
    requests = []
    arrival = 0
    longest = 1
    for i in range(num_requests):
        root = rng.choice(roots)
        depth = min(len(root), rng.choice((0, block_size - 1, block_size, block_size + 1,
                                           2 * block_size, len(root))))
        suffix = tuple(rng.randrange(10, VOCAB) for _ in range(rng.randint(0, 3 * block_size)))
        prompt = root[:depth] + suffix
        if not prompt:
            prompt = (rng.randrange(10, VOCAB),)
        max_tokens = rng.randint(1, 3 * block_size)
        arrival += rng.choice((0, 0, 1, 2, 5))
        abort_at = arrival + rng.randint(0, 30) if rng.random() < 0.15 else None
        salt = rng.choice(salts) if rng.random() < 0.5 else None
        requests.append(RequestSpec(f"r{i}", prompt, max_tokens, arrival, salt, abort_at,
                                    rng.randint(0, 3) if priority else 0))
        longest = max(longest, len(prompt) + max_tokens)
    # Every request must fit alone (vLLM reserves the whole sequence on admission); a tight
    # pool preempts.
    need = -(-longest // block_size) + 1
    num_blocks = need + rng.choice((0, 1, 2, 4, need, 4 * need))
    max_num_seqs = rng.choice((2, 4, 8, 16))
    sched = SchedulerSpec(
        num_blocks=min(num_blocks, 500), block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(rng.choice((8, 16, 32, 64, 256)), max_num_seqs),
        max_model_len=max(256, longest + block_size),
        enable_prefix_caching=rng.random() < 0.8,
        long_prefill_token_threshold=rng.choice((0, 0, 0, 5)),
        watermark=rng.choice((0.0, 0.0, 0.05)),
        async_scheduling=rng.random() < 0.25, policy="priority" if priority else "fcfs",
        paranoid=rng.random() < 0.3)
    # Steps in flight: an async engine schedules step t + 1 before step t's output is back
    # (placeholders, caching after the output); a sync one with pipeline parallelism too.
    pipeline = 2 if rng.random() < (0.6 if sched.async_scheduling else 0.1) else 1
    return StreamSpec(sched, tuple(requests), max_steps=400, seed=rng.randrange(1 << 16),
                      pipeline=pipeline)


def as_dict(c: Comparison) -> dict[str, Any]:
    return {"steps": c.steps, "mismatched_steps": len(c.mismatched_steps),
            "first_difference": c.first_difference, "outputs_differ": c.outputs_differ,
            "verify_failures": c.verify_failures, "table_mismatches": c.table_mismatches,
            "stream": dataclasses.asdict(c.stream)}
