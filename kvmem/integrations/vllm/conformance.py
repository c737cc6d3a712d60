"""Differential conformance: vLLM's ``Scheduler`` on its own manager and on kvmem's, step by step.

A *stream* (:class:`StreamSpec`) is a scheduler configuration and a list of requests
(:class:`StreamRequest`: arrival step, prompt, ``cache_salt``, ``max_tokens``, optional abort
step). :func:`run_stream` drives one scheduler over it with a synthetic model: each step's
sampled token is a deterministic function of the request and the position (:func:`token_at`),
a request stops on ``max_tokens`` or on the stop token. With speculative decoding
(``SchedulerSpec.spec_method``) a synthetic drafter guesses the model's tokens right about
``draft_acceptance`` of the time (:func:`accepts_draft`), and the model samples the accepted
drafts' tokens plus one, so the scheduler rolls the rejected ones back. It records, per step,
what the step scheduled (:class:`StreamStep`): new requests with their prefix-hit
``num_computed_tokens``, running ones with their ``num_computed_tokens`` and scheduled drafts,
``num_scheduled_tokens``, preempted and finished ids, the *sharing structure* of
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
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmem._validate import flag, integer, show
from kvmem.errors import ArgumentTypeError
from kvmem.integrations.vllm._streams import (
    SPEC_METHODS,
    STOP_TOKEN,
    SchedulerSpec,
    SpecMethod,
    StreamRequest,
    StreamResult,
    StreamSpec,
    StreamStep,
    accepts_draft,
    random_stream,
    token_at,
)
from kvmem.integrations.vllm._vllm_objects import (
    EventRecorder,
    draft_token_ids,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_output,
)

__all__ = [
    "SPEC_METHODS",
    "STOP_TOKEN",
    "Driver",
    "SchedulerSpec",
    "SpecMethod",
    "StreamRequest",
    "StreamResult",
    "StreamSpec",
    "StreamStep",
    "accepts_draft",
    "compare",
    "make_scheduler",
    "make_vllm_config",
    "random_stream",
    "run_stream",
    "token_at",
]


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
    flight does. ``records`` holds one :class:`StreamStep` per ``schedule()`` (the events of an
    ``update`` go to the record of the step it updates).
    """

    def __init__(self, spec: SchedulerSpec, kvmem: bool, seed: int = 0,
                 check_tables: bool = True) -> None:
        if not isinstance(spec, SchedulerSpec):
            raise ArgumentTypeError(f"spec={show(spec)}: expected a SchedulerSpec.")
        flag(kvmem, "kvmem")
        flag(check_tables, "check_tables")
        integer(seed, "seed")
        self.spec = spec
        self.kvmem = kvmem
        self.seed = seed
        self.check_tables = check_tables
        self.sched = make_scheduler(spec, kvmem)
        self.worker = _Worker()
        self.contents = _EventContents()
        self.requests: dict[str, Any] = {}
        self.records: list[StreamStep] = []
        self.step_us: list[float] = []
        self.verify_failures = 0
        self.table_mismatches = 0
        self._record_of: dict[int, StreamStep] = {}
        self._output_of: dict[int, Any] = {}
        # The workers' side of the connector's transfers (SchedulerSpec.connector).
        self.transfers: Any = None
        if spec.connector:
            from kvmem.integrations.vllm._connector_script import WorkerStandIn

            self.transfers = WorkerStandIn()

    def add(self, r: StreamRequest) -> None:
        req = make_request(r, self.spec.block_size)
        self.requests[r.rid] = req
        if self.transfers is not None:  # what the connector will find for it
            conn = self.sched.connector
            if r.external:
                conn.hits[r.rid] = (r.external, r.load_async)
            if r.delay_free:
                conn.delay_free.add(r.rid)
            if r.load_fails is not None:
                self.transfers.fail_loads[r.rid] = ("request" if r.load_fails < 0
                                                    else r.load_fails)
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
        rec = StreamStep(
            new=[(nr.req_id, nr.num_computed_tokens) for nr in out.scheduled_new_reqs],
            cached=list(c.req_ids), resumed=sorted(c.resumed_req_ids),
            num_scheduled=dict(out.num_scheduled_tokens),
            preempted=sorted(out.preempted_req_ids), finished=sorted(out.finished_req_ids),
            sharing=self.worker.sharing(), usage=self.sched.get_kv_cache_usage(),
            computed=list(c.num_computed_tokens),
            drafts={rid: len(t) for rid, t in out.scheduled_spec_decode_tokens.items()},
            waiting_for_kv=sorted(rid for rid, r in self.sched.requests.items()
                                  if r.status.name == "WAITING_FOR_REMOTE_KVS"))
        self.records.append(rec)
        self._record_of[id(out)] = rec
        # The model runs the step as scheduled, whenever its output is handed back.
        self._output_of[id(out)] = model_output(self.sched, out, self.seed,
                                                self.spec.draft_acceptance)
        if self.transfers is not None:  # what the workers' transfers report with it
            self._output_of[id(out)].kv_connector_output = self.transfers.output(
                self.sched, out, len(self.records))
        if self.kvmem and self.check_tables:
            self.table_mismatches += _table_mismatches(self.sched, self.worker)
        return out

    def update(self, out: Any) -> None:
        self.sched.update_from_output(out, self._output_of.pop(id(out)))
        if self.spec.spec_method is not None and not self.spec.async_scheduling:
            # A synchronous engine hands the drafter's tokens over after each step (an async
            # one schedules placeholders and fills them in on the workers).
            self.sched.update_draft_token_ids(draft_token_ids(self.sched, out, self.spec,
                                                              self.seed))
        recorder: EventRecorder = self.sched.kv_event_publisher
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
    if not isinstance(stream, StreamSpec):
        raise ArgumentTypeError(f"stream={show(stream)}: expected a StreamSpec.")
    d = Driver(stream.sched, kvmem, stream.seed, check_tables)
    arrivals: dict[int, list[StreamRequest]] = {}
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


def _describe(a: StreamStep, b: StreamStep) -> str:
    for name in ("new", "cached", "resumed", "num_scheduled", "preempted", "finished",
                 "sharing", "usage", "events", "computed", "drafts"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            return f"{name}: vLLM {x!r} / kvmem {y!r}"
    return "equal"


def compare(stream: StreamSpec) -> Comparison:
    """Run the stream on vLLM's manager and on kvmem's; list every difference."""
    if not isinstance(stream, StreamSpec):
        raise ArgumentTypeError(f"stream={show(stream)}: expected a StreamSpec.")
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


def as_dict(c: Comparison) -> dict[str, Any]:
    return {"steps": c.steps, "mismatched_steps": len(c.mismatched_steps),
            "first_difference": c.first_difference, "outputs_differ": c.outputs_differ,
            "verify_failures": c.verify_failures, "table_mismatches": c.table_mismatches,
            "stream": dataclasses.asdict(c.stream)}
