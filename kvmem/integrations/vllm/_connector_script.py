"""A scripted KV connector (scheduler side) and the worker stand-in that answers for it, to
drive vLLM's scheduler through the connector paths on both managers (imports vLLM).

:class:`ScriptedConnector` is a ``KVConnectorBase_V1``: what each request finds outside the
GPU cache, whether it loads asynchronously and whether its blocks stay with the connector
after it finished come from ``kv_connector_extra_config``::

    {"hits": {request id: [tokens found, asynchronous load]},
     "delay_free": [request ids whose blocks the connector reads after they finished],
     "events": true}   # the connector reports one BlockStored (medium "CPU") per finish

:class:`WorkerStandIn` plays the workers: it reports loads done (``finished_recving``),
sends done (``finished_sending``) ``lag`` steps after they began, and the failures the
script names (``failed_recving``, ``invalid_block_ids``), in each step's
``KVConnectorOutput``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

__all__ = ["SCRIPTED_CONNECTOR", "ScriptedConnector", "WorkerStandIn", "connector_config"]

#: (module, class) of :class:`ScriptedConnector`, for ``KVTransferConfig``.
SCRIPTED_CONNECTOR = (__name__, "ScriptedConnector")


def connector_config(hits: dict[str, tuple[int, bool]] | None = None,
                     delay_free: tuple[str, ...] = (), events: bool = False,
                     policy: str = "recompute") -> Any:
    """vLLM's ``KVTransferConfig`` for :class:`ScriptedConnector` (``policy``: vLLM's
    ``kv_load_failure_policy``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=SCRIPTED_CONNECTOR[1], kv_connector_module_path=SCRIPTED_CONNECTOR[0],
        kv_role="kv_both", kv_load_failure_policy=policy,
        kv_connector_extra_config={
            "hits": {rid: list(h) for rid, h in (hits or {}).items()},
            "delay_free": list(delay_free), "events": events})


class ScriptedConnector(KVConnectorBase_V1):
    """The scheduler side of a connector whose answers the config scripts (see the module
    doc). Records what the scheduler told it: ``allocs`` (request id, block ids, external
    tokens) per ``update_state_after_alloc``, ``finished`` (request id, block ids) per
    ``request_finished``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.hits: dict[str, tuple[int, bool]] = {
            rid: (int(n), bool(a)) for rid, (n, a) in extra.get("hits", {}).items()}
        self.delay_free = set(extra.get("delay_free", ()))
        self.report_events = bool(extra.get("events", False))
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[tuple[str, list[int]]] = []
        self._served: set[str] = set()
        self._events: list[Any] = []

    # -- worker side: nothing runs here ---------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # -- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self.hits or rid in self._served:  # (found once: a retry recomputes)
            return 0, False
        found, is_async = self.hits[rid]
        # (a synchronous load leaves the last token to compute; an asynchronous one may
        # bring every token: vLLM recomputes the last one when it is done)
        most = request.num_tokens if is_async else request.num_tokens - 1
        extra = max(0, min(found, most) - num_computed_tokens)
        return extra, is_async and extra > 0

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        ids = [b.block_id for b in blocks.blocks[0]] if blocks.blocks else []
        if num_external_tokens:
            self._served.add(request.request_id)
        self.allocs.append((request.request_id, ids, num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.finished.append((rid, list(block_ids)))
        if self.report_events:
            self._events.append(BlockStored(
                block_hashes=[len(self.finished)], parent_block_hash=None,
                token_ids=list(request.prompt_token_ids or ())[:4], block_size=4, lora_id=None,
                medium="CPU", lora_name=None))
        return rid in self.delay_free and bool(block_ids), None

    def take_events(self) -> Any:
        events, self._events = self._events, []
        return events


class WorkerStandIn:
    """The workers' side of the connector's transfers, as ``KVConnectorOutput`` per step.

    ``lag``: steps between a load (or a send) beginning and its end being reported.
    ``fail_loads``: request id -> ``"request"`` (the whole load fails: ``failed_recving``) or
    a block index (the load of the request's block at that index fails:
    ``invalid_block_ids``); an asynchronous load fails when it would have ended, a
    synchronous one in the step that ran it.
    """

    def __init__(self, lag: int = 2, fail_loads: dict[str, Any] | None = None) -> None:
        self.lag = lag
        self.fail_loads = dict(fail_loads or {})
        self._began: dict[tuple[str, str], int] = {}
        self._reported: set[tuple[str, str]] = set()  # (a pipelined engine asks again)

    def output(self, sched: Any, scheduler_output: Any, step: int) -> KVConnectorOutput:
        """What the workers report after running ``scheduler_output`` (step ``step``)."""
        recving: set[str] = set()
        sending: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        for rid, req in sched.requests.items():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS or req.is_finished():
                kind = "send" if req.is_finished() else "load"
                began = self._began.setdefault((kind, rid), step)
                if step - began < self.lag or (kind, rid) in self._reported:
                    continue
                self._reported.add((kind, rid))
                if kind == "send":
                    sending.add(rid)
                    continue
                recving.add(rid)
                how = self.fail_loads.pop(rid, None)
                if how == "request":
                    failed.add(rid)
                elif how is not None:
                    invalid.update(self._loaded_block(sched, rid, how, req.num_computed_tokens))
        for new in scheduler_output.scheduled_new_reqs:  # synchronous loads ran now
            rid = new.req_id
            how = self.fail_loads.get(rid)
            if how is not None and how != "request":
                del self.fail_loads[rid]
                invalid.update(self._loaded_block(sched, rid, how, new.num_computed_tokens))
        return KVConnectorOutput(finished_sending=sending or None,
                                 finished_recving=recving or None, failed_recving=failed,
                                 invalid_block_ids=invalid)

    @staticmethod
    def _loaded_block(sched: Any, rid: str, k: int, num_computed: int) -> list[int]:
        """The id of the ``k``-th block the connector loaded for ``rid`` (after its local
        prefix hit; ``num_computed``: hit + loaded tokens), if it loaded that many."""
        loaded = next((n for r, _, n in reversed(sched.connector.allocs) if r == rid and n), 0)
        size = sched.block_size
        index = (num_computed - loaded) // size + k
        ids = sched.kv_cache_manager.get_block_ids(rid)[0]
        if loaded and index < min(len(ids), -(-num_computed // size)):
            return [ids[index]]
        return []


class OffloadingWorkerStandIn:
    """The workers' side of vLLM's ``OffloadingConnector``: each transfer job of a step's
    ``OffloadingConnectorMetadata`` is reported done (``kv_connector_worker_meta``) ``lag``
    steps later; a request waiting for its loads gets ``finished_recving`` once they are
    done, a finished request whose blocks the connector kept ``finished_sending`` once its
    stores are."""

    def __init__(self, lag: int = 1) -> None:
        self.lag = lag
        self._jobs: dict[int, tuple[str, int]] = {}  # job id -> (request id, step issued)

    def output(self, sched: Any, scheduler_output: Any, step: int) -> KVConnectorOutput:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        meta = scheduler_output.kv_connector_metadata
        for jobs in (meta.load_jobs, meta.store_jobs):
            for job_id, job in jobs.items():
                self._jobs[job_id] = (job.req_id, step)
        done = {j: 1 for j, (_, t) in self._jobs.items() if step - t >= self.lag}
        for j in done:
            del self._jobs[j]
        busy = {rid for rid, _ in self._jobs.values()}
        recving, sending = set(), set()
        for rid, req in sched.requests.items():
            if rid in busy:
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                recving.add(rid)
            elif req.is_finished():
                sending.add(rid)
        return KVConnectorOutput(finished_sending=sending or None,
                                 finished_recving=recving or None,
                                 kv_connector_worker_meta=OffloadingWorkerMetadata(done))
