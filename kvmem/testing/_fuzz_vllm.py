"""vLLM's scheduler on kvmem under the fuzzer: ``vllm`` (``KVMemScheduler``) and ``vllm-async``
(``KVMemAsyncScheduler``). Imports vLLM; :data:`kvmem.testing.ENGINES` lists these engines only
when it is importable.

vLLM schedules itself, so the adapter only relays::

    fuzzer              vLLM's scheduler (on kvmem)          the adapter
    submit(spec)        add_request(Request)                 cache_salt = the namespace
    launch(choice)      schedule()                           -> Launch (see below)
    finish(op)          update_from_output(out, model out)   the model samples spec.tokens
    abort(id)           finish_requests(id, FINISHED_ABORTED)

A :class:`Launch` is the step as the kernels see it: per scheduled request its
``num_computed_tokens`` (start) and ``num_scheduled_tokens``, the pages of the block table a
worker builds from the scheduler's outputs (block id - 1; the CSR), and the slot mapping of the
kvmem step(s) the adapter flushed while scheduling (kvmem's ``reserve``: its start and count
must agree with the scheduler's). No step fence: vLLM frees and reuses blocks while a step
runs and relies on one stream's order (steps run in launch order), and it caches a block when
the step that computes it is scheduled.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvmem.errors import KVMemError
from kvmem.testing._fuzz_protocol import FuzzConfig, FuzzEngine
from kvmem.testing._launch import Launch, RequestSpec
from kvmem.testing._oracles import FuzzFailure

__all__ = ["VLLM_ENGINES", "VllmAsyncEngine", "VllmEngine"]

Int64Array = npt.NDArray[np.int64]


def _forget(request: Any) -> None:
    """A ``free`` that frees nothing (the ``leak_on_abort`` switch)."""


class VllmEngine(FuzzEngine):
    """vLLM 0.33's ``Scheduler`` on kvmem (``KVMemScheduler``), as vLLM's engine core drives it
    without a batch queue: each step is scheduled, run and its output processed before the
    next (``max_in_flight = 0``; aborts arrive between steps)."""

    name: ClassVar[str] = "vllm"
    capabilities: ClassVar[frozenset[str]] = frozenset({"clear"})
    stream_ordered: ClassVar[bool] = True
    async_scheduling: ClassVar[bool] = False

    def __init__(self, config: FuzzConfig) -> None:
        super().__init__()
        from kvmem.integrations.vllm import vllm_import_error

        missing = vllm_import_error()
        if missing is not None:
            raise KVMemError(f"the {self.name!r} fuzz engine needs vLLM: {missing}")
        from vllm.v1.request import RequestStatus

        from kvmem.integrations.vllm.conformance import SchedulerSpec, make_scheduler

        self._aborted = RequestStatus.FINISHED_ABORTED
        p = config.page_size
        self.page_size = p
        spec = SchedulerSpec(
            num_blocks=config.num_pages + 1,  # block 0 is vLLM's null block
            block_size=p, max_num_seqs=config.max_seqs,
            max_num_batched_tokens=max(config.max_batch_tokens, config.max_seqs),
            max_model_len=-(-(config.max_len + 1) // p) * p,
            long_prefill_token_threshold=config.chunk,
            async_scheduling=self.async_scheduling, kv_events=False)
        self.sched = make_scheduler(spec, kvmem=True)
        self.manager = self.sched.kvmem
        self.max_in_flight = 2 if self.async_scheduling else 0
        self.specs: dict[Any, RequestSpec] = {}
        self.tables: dict[str, list[int]] = {}  # the workers' block tables (block ids)
        self.outputs: dict[Launch, tuple[Any, Any]] = {}  # scheduler output, model output
        self._steps: list[tuple[tuple[Any, ...], Any]] = []  # kvmem reserves since the launch
        # What the runs exercised (a correct run must show them all > 0).
        self.counts = {"steps": 0, "preemptions": 0, "prefix_hits": 0, "same_step_hits": 0}
        # The steps vLLM's adapter flushes: the manager has no reserve hook, so this instance's
        # reserve is wrapped (what it returns is untouched).
        reserve = self.manager.reserve

        def recorded(request_ids: Any, num_tokens: Any) -> Any:
            step = reserve(request_ids, num_tokens)
            self._steps.append((tuple(request_ids), step))
            return step

        self.manager.reserve = recorded

    # -- requests -------------------------------------------------------------------------------

    def _request(self, spec: RequestSpec) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        ns = None if "namespace_dropped" in self.bugs else spec.namespace
        # One more token than the fuzzer's stream: vLLM samples a token it never computes, so
        # the K/V of every position of the stream is computed before the request finishes.
        params = SamplingParams(max_tokens=spec.max_len - spec.prompt_len + 1, ignore_eos=True)
        return Request(request_id=spec.request_id, prompt_token_ids=spec.prompt.tolist(),
                       sampling_params=params, pooling_params=None,
                       cache_salt=None if ns is None else repr(ns))

    def submit(self, spec: RequestSpec) -> None:
        self.specs[spec.request_id] = spec
        self.sched.add_request(self._request(spec))

    def abort(self, request_id: Any) -> None:
        self.specs.pop(request_id, None)
        if request_id not in self.sched.requests:
            return
        kv = self.sched.kv_cache_manager
        if "leak_on_abort" in self.bugs:
            kv.free = _forget  # the abort path forgets the request's blocks
        try:
            self.sched.finish_requests([request_id], self._aborted)
        finally:
            kv.__dict__.pop("free", None)

    def clear_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache()`` (refused while a request holds blocks)."""
        return bool(self.sched.reset_prefix_cache())

    # -- steps ----------------------------------------------------------------------------------

    def _apply(self, out: Any) -> None:
        """The workers' block tables after ``out`` (as vLLM's model runner keeps them)."""
        tables = self.tables
        for rid in out.finished_req_ids:
            tables.pop(rid, None)
        for rid in out.preempted_req_ids:
            tables.pop(rid, None)
        for nr in out.scheduled_new_reqs:
            tables[nr.req_id] = list(nr.block_ids[0])
        c = out.scheduled_cached_reqs
        for rid, nb in zip(c.req_ids, c.new_block_ids):
            if rid in c.resumed_req_ids:
                tables[rid] = list(nb[0]) if nb is not None else []
            elif nb is not None:
                tables.setdefault(rid, []).extend(nb[0])

    def launch(self, choice: int) -> Launch | None:
        out = self.sched.schedule()
        self._apply(out)
        steps, self._steps = self._steps, []  # (reserves outside schedule() would show here)
        self.counts["preemptions"] += len(out.preempted_req_ids)
        n_sched = out.num_scheduled_tokens
        if not n_sched:
            return None
        start_of = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
        c = out.scheduled_cached_reqs
        start_of.update(zip(c.req_ids, c.num_computed_tokens))
        # Each request's slots in the kvmem step that reserved them (the latest one).
        slots_of: dict[Any, tuple[int, int, Any]] = {}
        for step_ids, step in steps:
            qo = step.qo_indptr
            for b, rid in enumerate(step_ids):
                k = int(step.num_new_tokens[b])
                slots_of[rid] = (int(step.seq_lens[b]) - k, k,
                                 step.slot_mapping[qo[b] : qo[b + 1]])
        ids = tuple(n_sched)
        p = self.page_size
        starts = np.array([start_of[r] for r in ids], dtype=np.int64)
        counts = np.array([n_sched[r] for r in ids], dtype=np.int64)
        rows, slot_parts = [], []
        for rid, a, k in zip(ids, starts.tolist(), counts.tolist()):
            kv = slots_of.get(rid)
            if kv is None or kv[0] != a or kv[1] != k:
                raise FuzzFailure("engine", f"vLLM scheduled {rid!r} at {a} for {k} tokens but "
                                  f"kvmem reserved {kv[:2] if kv else 'nothing'} for it")
            rows.append(np.asarray(self.tables[rid][: -(-(a + k) // p)], dtype=np.int64) - 1)
            slot_parts.append(kv[2])
        indptr = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum([r.size for r in rows], out=indptr[1:])
        op = Launch(ids, starts, counts, indptr, np.concatenate(rows),
                    np.concatenate(slot_parts), writes_first=True)
        self._count_hits(out, op)
        self.outputs[op] = (out, self._model_output(ids, starts + counts))
        self.counts["steps"] += 1
        return op

    def _count_hits(self, out: Any, op: Launch) -> None:
        """Prefix hits, and those on a page another request of the step writes (same-step)."""
        written = op.slot_mapping // self.page_size
        for nr in out.scheduled_new_reqs:
            if nr.num_computed_tokens:
                self.counts["prefix_hits"] += 1
                hit = np.asarray(nr.block_ids[0][: nr.num_computed_tokens // self.page_size]) - 1
                self.counts["same_step_hits"] += int(np.isin(hit, written).any())

    def _model_output(self, ids: tuple[Any, ...], ends: Int64Array) -> Any:
        """The model's sampled tokens: for each request whose prompt (or resumed sequence) is
        complete after this step, ``spec.tokens`` at the next position."""
        from vllm.v1.outputs import ModelRunnerOutput

        sampled: list[list[int]] = []
        for rid, end in zip(ids, ends.tolist()):
            req = self.sched.requests.get(rid)
            spec = self.specs.get(rid)
            if req is None or spec is None or req.is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([int(spec.tokens[end]) if end < spec.max_len else 0])
        return ModelRunnerOutput(req_ids=list(ids),
                                 req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled)

    def finish(self, op: Launch) -> Sequence[Any]:
        out, model = self.outputs.pop(op)
        self.sched.update_from_output(out, model)
        requests = self.sched.requests
        done = [rid for rid in op.request_ids if rid in self.specs and rid not in requests]
        for rid in done:
            del self.specs[rid]
        return done

    def check(self) -> None:
        from kvmem.errors import IntegrityError

        try:
            self.sched.kv_cache_manager.check()
        except IntegrityError as e:
            raise FuzzFailure("engine", f"VllmKVCacheAdapter.check: {e}") from None


class VllmAsyncEngine(VllmEngine):
    """vLLM 0.33's ``AsyncScheduler`` on kvmem (``KVMemAsyncScheduler``): step ``n + 1`` is
    scheduled before step ``n``'s output is processed (``max_in_flight = 2``)."""

    name: ClassVar[str] = "vllm-async"
    async_scheduling: ClassVar[bool] = True


VLLM_ENGINES: dict[str, Callable[[FuzzConfig], FuzzEngine]] = (
    {"vllm": VllmEngine, "vllm-async": VllmAsyncEngine}
    if importlib.util.find_spec("vllm") is not None else {})
"""The vLLM engines, where vLLM is installed (its import is not tried: it takes seconds)."""
