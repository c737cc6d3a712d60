"""vLLM ``Scheduler`` subclasses whose KV cache bookkeeping is kvmem's (imports vLLM).

Use as vLLM's ``scheduler_cls``::

    vllm serve MODEL --scheduler-cls kvmem.integrations.vllm.KVMemScheduler
    # or, with async scheduling:  --async-scheduling \\
    #    --scheduler-cls kvmem.integrations.vllm.KVMemAsyncScheduler

The scheduler builds vLLM's own manager in ``__init__`` (which reads a few of its attributes
while constructing) and then replaces ``kv_cache_manager`` with
:class:`~kvmem.integrations.vllm.VllmKVCacheAdapter`. Each ``schedule()`` ends with kvmem's
integrity check of every block id handed to the workers; a request whose mapping broke is
taken out of the step's output and finished as aborted (its client gets the reason), the rest of
the batch proceeds.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.outputs import RequestError
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MLAAttentionSpec
from vllm.v1.request import Request, RequestStatus

from kvmem.errors import ArgumentError, KVMemError
from kvmem.integrations.vllm._adapter import VllmKVCacheAdapter

# The mixin's super() calls reach vLLM's Scheduler or AsyncScheduler, whichever it is mixed into.
if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object

logger = logging.getLogger(__name__)

__all__ = ["KVMemAsyncScheduler", "KVMemScheduler", "check_supported"]

_VERIFY_ENV = "KVMEM_VLLM_VERIFY_BLOCK_TABLES"


def _env_verify_block_tables() -> bool:
    return os.environ.get(_VERIFY_ENV, "") == "1"


_SUPPORTED = ("one full-attention KV cache group, prefix caching on or off, chunked prefill, "
              "preemption by recompute, aborts, cache_salt, KV events, speculative decoding "
              "(n-gram, draft models, EAGLE/MTP with vLLM's last-block drop), LoRA adapters, "
              "multimodal inputs, resumable (streaming input) requests, KV connectors "
              "(kv_transfer_config)")
_OWN_SCHEDULER = "vLLM's own Scheduler (drop --scheduler-cls)"


def _refuse(option: str, found: str, fix: str | None = None) -> KVMemError:
    """``option``: what is not supported; ``found``: what was found, as text; ``fix``: what to
    do (by default: unset the option)."""
    if fix is None:
        fix = f"Unset {option.split(' (')[0]} or use {_OWN_SCHEDULER}."
    return KVMemError(
        f"kvmem's vLLM scheduler does not support {option} (found {found}); it supports "
        f"{_SUPPORTED}. {fix}")


def _refuse_model(what: str, found: str) -> KVMemError:
    return _refuse(what, found, f"Serve this model with {_OWN_SCHEDULER}.")


def check_supported(vllm_config: Any, kv_cache_config: KVCacheConfig, block_size: int,
                    hash_block_size: int | None) -> None:
    """Raise :class:`KVMemError` naming the first option outside the supported set.

    The engine's options come first (a DCP run also changes the scheduler's block size: the
    refusal names DCP, not the block size), then the model's KV cache groups and block sizes."""
    checks = (
        ("ec_transfer_config (encoder cache connectors)", vllm_config.ec_transfer_config),
    )
    for option, value in checks:
        if value is not None:
            raise _refuse(option, type(value).__name__)
    par = vllm_config.parallel_config
    for option in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(par, option, 1) != 1:
            raise _refuse(f"parallel_config.{option} (DCP/PCP)",
                          f"{option}={getattr(par, option)!r}",
                          f"Set {option}=1 or use {_OWN_SCHEDULER}.")
    mc = vllm_config.model_config
    if mc.is_encoder_decoder:
        raise _refuse_model("encoder-decoder models (cross-attention)", repr(mc.model))
    if getattr(mc, "enable_prompt_embeds", False):
        raise _refuse("model_config.enable_prompt_embeds (prompt embeddings: their hashes are "
                      "in vLLM's block keys, not in kvmem's page keys)", "True",
                      f"Unset enable_prompt_embeds or use {_OWN_SCHEDULER}.")
    if getattr(vllm_config.observability_config, "kv_cache_metrics", False):
        raise _refuse("observability_config.kv_cache_metrics", "True")
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and aux.enabled:
        raise _refuse("aux_output_config", "enabled")
    if vllm_config.num_hash_lookahead_tokens:
        raise _refuse(
            "lookahead block hashes (EAGLE/MTP with prefix caching hashes each block with the "
            "tokens after it; kvmem keys a page by its own tokens)",
            f"num_hash_lookahead_tokens={vllm_config.num_hash_lookahead_tokens!r}",
            "Set speculative_config.disable_lookahead_block_hashes=True (vLLM then drops the "
            "last block of a prefix hit instead, as kvmem does), turn prefix caching off, or "
            f"use {_OWN_SCHEDULER}.")
    if (vllm_config.num_prefill_lookahead_tokens > 1
            and vllm_config.cache_config.enable_prefix_caching):
        raise _refuse(
            "multi-module MTP with prefix caching (vLLM keeps a request's last "
            f"{vllm_config.num_prefill_lookahead_tokens - 1} computed tokens out of its cache; "
            "kvmem caches every committed page)",
            f"num_prefill_lookahead_tokens={vllm_config.num_prefill_lookahead_tokens!r}",
            f"Turn prefix caching off or use {_OWN_SCHEDULER}.")
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise _refuse_model("a model without a KV cache (no KV cache group)", "0 groups")
    if len(groups) != 1:
        # vLLM's workers lay every group's blocks out in one page byte size (the smaller
        # groups padded up) and index them by block id; kvmem's unpadded groups (HybridManager)
        # place pages by byte offset in one budget, which those workers cannot address.
        raise _refuse_model("several KV cache groups (hybrid models, Mamba: vLLM's workers "
                            "address every group in one padded page size; kvmem's "
                            "HybridManager pays each group its own, see docs/hybrid.md)",
                            f"{len(groups)} groups: "
                            f"{[type(g.kv_cache_spec).__name__ for g in groups]}")
    spec = groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise _refuse_model("a KV cache spec other than full attention",
                            repr(type(spec).__name__))
    if spec.block_size != block_size:
        raise _refuse_model("a KV cache group whose block size is not the scheduler's",
                            f"kv_cache_spec.block_size={spec.block_size!r}, "
                            f"block_size={block_size!r}")
    if hash_block_size not in (None, block_size):
        raise _refuse("hash_block_size different from block_size (partial prefix hits)",
                      f"hash_block_size={hash_block_size!r}, block_size={block_size!r}",
                      f"Pass hash_block_size=None (or block_size) or use {_OWN_SCHEDULER}.")
    num_blocks = kv_cache_config.num_blocks
    if num_blocks < 2:
        raise KVMemError(
            f"kv_cache_config.num_blocks={num_blocks!r}: kvmem's vLLM scheduler needs at least 2 "
            "KV cache blocks (block 0 is vLLM's null block); give the KV cache more memory "
            "(gpu_memory_utilization, num_gpu_blocks_override).")


class _KVMemMixin(_SchedulerBase):
    """What both schedulers add: the adapter, the per-step check, integrity aborts."""

    kv_cache_manager: Any
    #: The paranoid check: verify, every step, the block table the workers build from the ids
    #: handed out (every entry) instead of the step's CSR they are sliced from (incremental).
    #: Subclass to set it, or set KVMEM_VLLM_VERIFY_BLOCK_TABLES=1.
    verify_block_tables: bool = os.environ.get(_VERIFY_ENV, "") == "1"

    def __init__(self, vllm_config: Any, kv_cache_config: KVCacheConfig,
                 structured_output_manager: Any, block_size: int,
                 hash_block_size: int | None = None, *args: Any, **kwargs: Any) -> None:
        check_supported(vllm_config, kv_cache_config, block_size, hash_block_size)
        # The environment is read here too (not only when this module was imported), so a
        # process that sets it before building the scheduler gets the paranoid check.
        self.verify_block_tables = bool(self.verify_block_tables) or _env_verify_block_tables()
        super().__init__(vllm_config, kv_cache_config, structured_output_manager, block_size,
                         hash_block_size, *args, **kwargs)
        self._install_kvmem(vllm_config, kv_cache_config, block_size, self.log_stats,
                            self.enable_kv_cache_events)

    def add_request(self, request: Request) -> None:
        self._check_request(request)
        super().add_request(request)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        return self._after_schedule(super().schedule(throttle_prefills))

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        # (a scheduler built without __init__, as some of vLLM's tests do, has none)
        if getattr(self, "_kvmem_aborted", None):
            self._report_aborted(outputs)
        return outputs

    def _on_kvmem(self) -> bool:
        """Whether the KV cache manager is kvmem's (a test may attach another one after
        construction: then the scheduler is vLLM's own, unchanged)."""
        return isinstance(self.kv_cache_manager, VllmKVCacheAdapter)

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        out = super()._free_request(request, delay_free_blocks)
        if request.request_id in self.requests and self._on_kvmem():
            # A KV connector still reads its blocks (or a load still writes them): vLLM frees
            # them on finished_sending / finished_recving; kvmem holds them until then.
            self.kv_cache_manager.hold(request)
        return out

    def _update_requests_with_invalid_blocks(
            self, requests: Any, invalid_block_ids: set[int],
            num_scheduled_tokens: dict[str, int], evict_blocks: bool = True
    ) -> tuple[set[str], int, set[int]]:
        """A failed load's invalid blocks under the ``recompute`` policy: every request that
        maps one among its computed blocks goes back to its own first invalid block and
        recomputes from there, a request that shares the block with another one included
        (vLLM lets the sharer go on as if the first one had recomputed the block, which it
        may not have yet: vllm#49250, wrong outputs). Returns the affected requests, the
        tokens they give up, and the blocks to evict (each affected request's blocks from its
        first invalid one, with ``evict_blocks``)."""
        if not self._on_kvmem() or not self.recompute_kv_load_failures:
            # (under "fail" every affected request finishes: vLLM's own bookkeeping)
            return super()._update_requests_with_invalid_blocks(
                requests, invalid_block_ids, num_scheduled_tokens, evict_blocks)
        adapter = self.kv_cache_manager
        affected: set[str] = set()
        num_tokens = 0
        to_evict: set[int] = set()
        size = self.block_size
        for request in requests:
            rid = request.request_id
            (block_ids,) = adapter.get_block_ids(rid)
            computed = request.num_computed_tokens - num_scheduled_tokens.get(rid, 0)
            computed_blocks = block_ids[: -(-computed // size)]
            first = next((i for i, b in enumerate(computed_blocks) if b in invalid_block_ids),
                         None)
            if first is None:
                continue
            request.num_computed_tokens = first * size
            num_tokens += computed - first * size
            affected.add(rid)
            adapter.rolled_back(rid, block_ids[first:])
            if evict_blocks:
                to_evict.update(block_ids[first:])
        return affected, num_tokens, to_evict

    def _request_remaining_blocks(self, request: Request) -> int:
        """Blocks ``request`` still needs to hold its full sequence (an asynchronous load's
        reservation), from kvmem's pages."""
        if not self._on_kvmem():
            return super()._request_remaining_blocks(request)
        sched: Any = self
        num_tokens = min(request.num_tokens, sched.max_model_len)
        if sched.num_spec_tokens:
            num_tokens += 1 + sched.num_spec_tokens + sched.num_lookahead_tokens
        return self.kv_cache_manager.num_blocks_to_hold(request.request_id, num_tokens)

    def _install_kvmem(self, vllm_config: Any, kv_cache_config: KVCacheConfig,
                       block_size: int, log_stats: bool, enable_kv_cache_events: bool) -> None:
        sc = vllm_config.scheduler_config
        max_seqs = max(sc.max_num_seqs, sc.max_num_active_seqs or 0)
        if self.connector is not None:
            # Requests waiting for an asynchronous load hold blocks (a kvmem row each) but
            # are not running: rows for as many of them as there are blocks, up to
            # max(max_seqs, 256) more (past that, a load waits for a row).
            max_seqs += min(kv_cache_config.num_blocks - 1, max(max_seqs, 256))
        self.kv_cache_manager = VllmKVCacheAdapter(
            num_blocks=kv_cache_config.num_blocks, block_size=block_size,
            max_model_len=vllm_config.model_config.max_model_len, max_num_seqs=max_seqs,
            enable_caching=bool(vllm_config.cache_config.enable_prefix_caching),
            log_stats=log_stats, enable_kv_cache_events=enable_kv_cache_events,
            watermark=sc.watermark, tracker="checking",
            async_scheduling=isinstance(self, AsyncScheduler),
            verify_block_tables=self.verify_block_tables,
            speculative=vllm_config.speculative_config is not None,
            use_eagle=self.use_eagle_block_drop, connector=self.connector is not None)
        if self.connector is not None:
            # vLLM's __init__ bound the connector to the manager it built; bind it to kvmem's.
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)
        # Requests aborted by the check, reported to their clients by the next
        # update_from_output: id -> (client index, reason).
        self._kvmem_aborted: dict[str, tuple[int, str]] = {}

    @property
    def kvmem(self) -> Any:
        """The :class:`kvmem.KVCacheManager` behind the adapter."""
        return self.kv_cache_manager.manager

    def _check_request(self, request: Request) -> None:
        """Refuse (before the scheduler sees it) a request whose KV this scheduler cannot key."""
        if not self._on_kvmem():
            return
        rid = request.request_id
        if request.prompt_embeds is not None:
            raise _refuse("prompt embeddings (prompt_embeds)", f"request {rid!r} has them",
                          f"Send request {rid!r} without them, or use {_OWN_SCHEDULER}.")
        sched: Any = self
        adapter = self.kv_cache_manager
        if rid in sched.requests:
            # A resumable request's next input chunk (or its end): vLLM appends it to the
            # session, which keeps its blocks.
            if request.mm_features:
                raise _refuse(
                    "multimodal inputs in a streaming-input update (they may start inside a "
                    "block kvmem has keyed already, whose key vLLM then recomputes; kvmem keys "
                    "a page once)", f"an update of request {rid!r} has them",
                    f"Send the session's multimodal inputs with its first chunk, or use "
                    f"{_OWN_SCHEDULER}.")
            request._block_hasher = None
            return
        if request.mm_features:
            if adapter.enable_kv_cache_events:
                raise _refuse(
                    "multimodal inputs with KV events (vLLM's BlockStored of a block that "
                    "covers an mm input carries its identifier and token ids; kvmem's pages "
                    "hold folded key tokens)", f"request {rid!r} has them",
                    f"Turn KV events off, send request {rid!r} without multimodal inputs, or "
                    f"use {_OWN_SCHEDULER}.")
            adapter.key_tokens(request)  # checks the inputs (ArgumentError, nothing added)
        if not request.num_prompt_tokens:
            # vLLM's engine refuses it before the scheduler; admitted, every schedule() failed.
            raise ArgumentError(f"request {rid!r} has an empty prompt (0 tokens): a request "
                                "needs at least one prompt token; nothing was added")
        namespace = adapter.namespace_of(request)
        if namespace is not None:
            # A new salt or adapter is registered now: past the manager's namespace limit the
            # request is refused here, not in the admission inside schedule() (which then
            # failed every step, the request staying at the head of the queue).
            try:
                self.kvmem.namespaces.id_of(namespace, register=True)
            except KVMemError as e:
                lora = request.lora_request
                adapter_name = "" if lora is None else f" with LoRA adapter {lora.lora_name!r}"
                raise KVMemError(f"request {rid!r}: cache_salt={request.cache_salt!r}"
                                 f"{adapter_name} is refused: {e}; nothing was added") from e
        # vLLM's block hashes serve vLLM's own prefix cache, which this scheduler does not use
        # (kvmem keys its pages itself, when they fill): stop hashing every output token.
        # KV connectors key what they store and load by them: kept then.
        if self.connector is None:
            request._block_hasher = None

    def _after_schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        if not self._on_kvmem():
            return out
        adapter = self.kv_cache_manager
        adapter.flush()
        failed = adapter.integrity_aborts
        if not failed:
            return out
        adapter.integrity_aborts = {}
        self._drop_from_output(out, failed)
        return out

    def _drop_from_output(self, out: SchedulerOutput, failed: dict[str, str]) -> None:
        sched: Any = self
        ids = [rid for rid in failed if rid in sched.requests]
        for rid in ids:
            n = out.num_scheduled_tokens.pop(rid, 0)
            out.total_num_scheduled_tokens -= n
            out.scheduled_spec_decode_tokens.pop(rid, None)
            out.scheduled_encoder_inputs.pop(rid, None)
            self._kvmem_aborted[rid] = (sched.requests[rid].client_index, failed[rid])
        gone = set(ids)
        out.scheduled_new_reqs = [r for r in out.scheduled_new_reqs if r.req_id not in gone]
        cached = out.scheduled_cached_reqs
        keep = [i for i, rid in enumerate(cached.req_ids) if rid not in gone]
        if len(keep) != len(cached.req_ids):
            for name in ("req_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens"):
                values = getattr(cached, name)
                setattr(cached, name, [values[i] for i in keep])
            if cached.new_token_ids:
                cached.new_token_ids = [cached.new_token_ids[i] for i in keep]
            cached.resumed_req_ids = cached.resumed_req_ids - gone
            for rid in gone:
                cached.all_token_ids.pop(rid, None)
        # The adapter already released their pages; the scheduler forgets them now, and the
        # workers hear of it through the next step's finished_req_ids.
        sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def _report_aborted(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        from vllm.v1.engine import FinishReason

        aborted, self._kvmem_aborted = self._kvmem_aborted, {}
        for rid, (client, reason) in aborted.items():
            error = RequestError(code="kv_integrity_error",
                                 message=f"kvmem integrity check: {reason}")
            out = EngineCoreOutput(request_id=rid, new_token_ids=[],
                                   finish_reason=FinishReason.ABORT, error=error)
            if client in outputs:
                outputs[client].outputs.append(out)
            else:
                outputs[client] = EngineCoreOutputs(outputs=[out])


class KVMemScheduler(_KVMemMixin, Scheduler):
    """vLLM's ``Scheduler`` with kvmem's KV cache bookkeeping and integrity check."""


class KVMemAsyncScheduler(_KVMemMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with kvmem's KV cache bookkeeping and integrity check."""
