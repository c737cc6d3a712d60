"""The surface of vLLM's ``KVCacheManager`` that its ``Scheduler`` calls, on a kvmem manager.

kvmem page ``p`` is vLLM block ``p + 1``: vLLM keeps block 0 as its null block (never handed
out, and the padding value of its block tables), so the kvmem manager manages the other
``num_blocks - 1`` blocks, as vLLM's free queue does.

How vLLM's per-request calls map onto kvmem's batched ones::

    scheduler (one call per request)        adapter                     kvmem (one per batch)
    ---------------------------------------------------------------------------------------
    get_computed_blocks(req)                 cache.match(); flush and    -
                                             match again only if the
                                             flush could change it (*)
    allocate_slots(new req, n, hit)          capacity check; admit now   admit(prompt[:hit+1])
                                             and queue its first step
    allocate_slots(running req, n)           capacity check; queue it    -
    get_blocks(req) (after an admission)     filled at the flush         -
    (anything else, or the step's end)       flush the queue:            reserve(batch, n)
                                                                         verify(batch, step)
                                                                         commit_batch(batch)
    free(req)                                flush; release              release(req)

A queued allocation is decided at once (vLLM's own arithmetic on kvmem's free + evictable
pages, less the pages the queue will take), so ``allocate_slots`` returns exactly when vLLM's
would; the pages themselves are taken at the flush, before any other operation could observe
the difference (a free, the events, a block id read, the step's output). So a step's decodes
and the requests joining it usually go out as one flush.

(*) What a flush changes that a prefix lookup reads (:meth:`FlushQueue.changes_lookup`):

    the queue's commits   cache the pages they fill, as vLLM caches them in allocate_slots.
                          A lookup that found m pages can change only if a queued commit
                          fills page m of a prompt with the same namespace and leading tokens
                          (any other page with the prompt's prefix is full already, so
                          cached: found, or a duplicate cached after the one found).
    the queue's pages     are the first ``num_pages`` of the free order: free pages first,
                          then the cache's next evictions (vLLM's free-queue order,
                          ``VllmOrderPrefixCache.next_evicted``). A lookup can change only if
                          one of the pages it found is among them.

Anything else the flush does is invisible to a lookup: reserve takes only fresh pages, verify
only aborts on a broken mapping (kvmem's own fault, which vLLM has no counterpart of), and
``cache_blocks``' commits (async scheduling) are queued commits like the others. An admission
maps its hit and takes one page at once, ahead of the queue's pages; the step takes the same
pages of the free order either way (a permutation of ids, which vLLM cannot observe: the
sharing structure, the evicted prefixes, the events and the counts are the same), and the
cache evicts exactly the same prefixes because a lookup whose hit the queue would evict
flushes first.

Prefix caching follows vLLM's timing: a block is offered to the cache when the step that
computes it is scheduled (vLLM caches in ``allocate_slots``), so a request admitted later in the
same step can hit it, as in vLLM; under async scheduling a decode token is committed when
``cache_blocks`` says its output arrived (queued, committed at the next flush).

KV connectors (``connector=True``; docs/vllm.md, *KV connectors*): external tokens are
reserved with the admission's step and committed with it, or, for an asynchronous load, when
``cache_blocks`` says it is done; a request whose kvmem slots are out of step with vLLM's
computed tokens (a load in flight, a failed load's rollback) is in ``_resync`` and reconciled
at its next ``allocate_slots``; a finished request whose blocks the connector still reads is
released and its pages leased until ``free`` (``hold``, ``pop_blocks_for_free``).

The integrity check runs at every flush on the batch whose block ids are about to be handed out
(the ids are sliced from the very CSR ``verify`` checked); with ``verify_block_tables`` (the
paranoid check) the ids come from a block table kept as the workers build theirs, and that
table is what kvmem checks. A request the check aborts is released by kvmem and reported in
``integrity_aborts`` for the scheduler to take out of the step's output.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvmem._validate import INT32_MAX, flag, integer, is_integer_like, real
from kvmem.allocator import PAD
from kvmem.errors import ArgumentError, KVMemError
from kvmem.integrations.vllm._blocks import (
    KVMemBlock,
    KVMemBlocks,
    PrefixHit,
    RequestState,
    vllm_events,
)
from kvmem.integrations.vllm._flush import FlushQueue
from kvmem.integrations.vllm._keys import KeyTokens, key_tokens, namespace_of
from kvmem.integrations.vllm._prefix_cache import VllmOrderPrefixCache
from kvmem.manager import KVCacheManager

logger = logging.getLogger(__name__)

__all__ = ["VllmKVCacheAdapter"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_args(num_blocks: Any, block_size: Any, max_model_len: Any, max_num_seqs: Any,
                watermark: Any, seed: Any, **flags: Any) -> None:
    """The adapter's arguments, checked by their own names before anything is built (the
    manager's checks would name its ``num_pages`` / ``page_size``, or fail on arithmetic)."""
    if is_integer_like(num_blocks) and num_blocks < 2:
        raise ArgumentError(f"num_blocks={int(num_blocks)}: vLLM asked for fewer than 2 KV cache "
                            "blocks; kvmem needs at least 2 (block 0 is vLLM's null block)")
    integer(num_blocks, "num_blocks", minimum=2, maximum=INT32_MAX)
    integer(block_size, "block_size", minimum=1, maximum=1 << 16)  # the manager's page_size
    integer(max_model_len, "max_model_len", minimum=1)
    limit = (INT32_MAX - 1) * int(block_size)  # (block_size is checked above)
    if max_model_len > limit:  # the manager's max_pages_per_seq (its pages + 1) is an int32
        raise ArgumentError(f"max_model_len={int(max_model_len)}: expected at most {limit} "
                            f"tokens at block_size={int(block_size)} (a request's blocks + 1 "
                            "must fit in int32)")
    integer(max_num_seqs, "max_num_seqs", minimum=1, maximum=1 << 24)  # its max_seqs
    real(watermark, "watermark", minimum=0.0)
    if watermark >= 1.0:  # vLLM's SchedulerConfig: 0.0 <= watermark < 1.0
        raise ArgumentError(f"watermark={float(watermark)!r}: expected a fraction in [0.0, 1.0) "
                            "of the blocks kept free when admitting (vLLM's range)")
    if seed is not None:  # (checked even when prefix caching is off and nothing uses it)
        integer(seed, "seed", minimum=0)
    for name, value in flags.items():
        flag(value, name)


class VllmKVCacheAdapter:
    """vLLM 0.33's ``KVCacheManager`` surface over a :class:`kvmem.KVCacheManager`.

    Parameters
    ----------
    num_blocks: vLLM's ``kv_cache_config.num_blocks`` (block 0 is vLLM's null block)
    block_size: tokens per block (kvmem's ``page_size``)
    max_model_len: the model's context length
    max_num_seqs: the most requests running at once (kvmem rows)
    enable_caching: vLLM's prefix caching
    log_stats: keep vLLM's ``PrefixCacheStats``
    enable_kv_cache_events: record KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``)
    watermark: vLLM's ``scheduler_config.watermark`` (fraction of blocks kept free when admitting)
    tracker: kvmem tracker (``"checking"``: the integrity check runs every step)
    seed: seeds kvmem's prefix keys (None: a per-process secret)
    async_scheduling: the scheduler is an ``AsyncScheduler`` (a decode step's token is known
        only after its step, so it is committed when ``cache_blocks`` says so)
    speculative: vLLM's ``speculative_config`` is set: a step may carry draft tokens, which
        are known (and committed) only once the verifier accepted them, and the scheduler
        rolls a request's computed tokens back when it rejects some; the adapter gives the
        rejected slots back to kvmem (``reject(keep_pages=True)``: vLLM keeps the blocks)
        when it next queues the request
    use_eagle: vLLM's ``use_eagle`` (EAGLE/MTP with the last-block drop): a prefix hit drops
        its last block (those tokens are recomputed for the drafter)
    verify_block_tables: the paranoid check: hand out block ids from a block table kept as the
        workers build theirs and verify that table every step (every entry; slower) instead of
        the step's CSR the ids are sliced from (kvmem's incremental check)
    connector: vLLM's ``kv_transfer_config`` is set (a KV connector's scheduler side runs):
        external tokens in ``allocate_slots``, delayed cache commits of asynchronous loads,
        blocks held for the connector after their request finished (``hold`` /
        ``pop_blocks_for_free``, kvmem leases), ``block_pool.free_blocks`` of held blocks

    The queued allocations and their flush are a :class:`~kvmem.integrations.vllm._flush.
    FlushQueue` the adapter holds; every flush goes through :meth:`flush`.
    """

    def __init__(self, *, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, enable_caching: bool = True, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, watermark: float = 0.0,
                 tracker: Any = "checking", seed: int | None = None,
                 async_scheduling: bool = False, verify_block_tables: bool = False,
                 speculative: bool = False, use_eagle: bool = False,
                 connector: bool = False) -> None:
        _check_args(num_blocks, block_size, max_model_len, max_num_seqs, watermark, seed,
                    enable_caching=enable_caching, log_stats=log_stats,
                    enable_kv_cache_events=enable_kv_cache_events,
                    async_scheduling=async_scheduling, verify_block_tables=verify_block_tables,
                    speculative=speculative, use_eagle=use_eagle, connector=connector)
        try:
            from vllm.v1.metrics.stats import PrefixCacheStats
            from vllm.v1.request import RequestStatus
        except ImportError as e:  # this module loads without vLLM; the adapter needs it
            from kvmem.integrations.vllm import vllm_import_error

            raise ImportError(f"VllmKVCacheAdapter needs vLLM. {vllm_import_error()}") from e

        self._PrefixCacheStats = PrefixCacheStats
        self._admitting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.enable_kv_cache_events = enable_kv_cache_events
        self.num_gpu_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.manager = KVCacheManager(
            num_blocks - 1, page_size=block_size, max_seqs=max_num_seqs,
            max_pages_per_seq=_cdiv(max_model_len, block_size) + 1,
            prefix_cache=VllmOrderPrefixCache(seed) if enable_caching else None,
            tracker=tracker, watermark=0.0, kv_events=enable_kv_cache_events, evict_ahead=0)
        # A step's tokens are known only after it ran (async scheduling's placeholders, or
        # drafts the verifier may reject): committed tokens are tracked per request.
        self.async_outputs = async_scheduling or speculative
        self.speculative = speculative
        self.use_eagle = use_eagle and enable_caching
        # The paranoid check's block table, [max_seqs, max_pages], int32, page ids (PAD past a
        # request's blocks), one row per kvmem row: the ids handed to the workers come from it.
        self.worker_block_table = (
            np.full((self.manager.max_seqs, self.manager.max_pages_per_seq), PAD, np.int32)
            if verify_block_tables else None)
        self.num_kv_cache_groups = 1
        self.empty_kv_cache_blocks = KVMemBlocks(None, [])
        self._free_view = self.manager.allocator  # num_free
        self._reqs: dict[str, RequestState] = {}
        # The queue (see the module doc) and its flush.
        self._queue = FlushQueue(self.manager, self._reqs, async_outputs=self.async_outputs,
                                 worker_block_table=self.worker_block_table,
                                 on_aborted=self._aborted, speculative=speculative)
        self._empty = self.empty_kv_cache_blocks
        # get_blocks() results to fill at the flush: (request id, out).
        self._row_blocks: list[tuple[str, KVMemBlocks]] = []
        # Requests the integrity check aborted since the scheduler last asked: id -> reason.
        self.integrity_aborts: dict[str, str] = {}
        self.num_integrity_aborts = 0  # requests the check aborted, in all
        # Resets since take_events() last ran with no prefix cache to report them (vLLM's block
        # pool reports AllBlocksCleared whether or not prefix caching is on; kvmem's manager
        # has no cache to clear then, and no event).
        self._uncached_resets = 0
        # The id of each LoRA adapter's namespace, for its KV events (vLLM's lora_id).
        self._lora_ids: dict[Any, int] = {}
        # KV connectors. Requests whose kvmem slots may run ahead of (or uncommitted behind)
        # vLLM's computed tokens: an asynchronous load (its tokens are committed when the load
        # is done), a load failure (vLLM rolls the request back); their next allocation
        # reconciles them first (see _reconcile).
        self.connector = connector
        self._resync: set[str] = set()
        # Pages held for the connector after their request was released: key -> kvmem lease
        # (a request id for a delayed free, an int for pop_blocks_for_free).
        self._held: dict[Any, Any] = {}
        self._num_pops = 0
        if connector:
            self.block_pool = HeldBlockPool(self)

    # -- the queue ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Perform the queued allocations (one reserve), check the batch's mapping (one verify)
        and commit every scheduled token whose id is known (one commit_batch); then fill the
        block ids ``get_blocks`` handed out meanwhile."""
        self._queue.flush()
        if self._row_blocks:
            outs, self._row_blocks = self._row_blocks, []
            for rid, out in outs:
                out.ids = self._block_ids(rid)

    def _flush_pending(self) -> None:
        """Flush if anything is queued (through :meth:`flush`, which a profiler may wrap)."""
        if self._queue.entries or self._queue.commits:
            self.flush()

    @property
    def num_flushes(self) -> int:
        """Flushes that had work to do (allocations or commits), in all."""
        return self._queue.num_flushes

    @property
    def num_verified_steps(self) -> int:
        """Batches the integrity check verified (one per flush that allocated)."""
        return self._queue.num_verified_steps

    @property
    def num_verified_requests(self) -> int:
        """Requests the integrity check verified, summed over the batches."""
        return self._queue.num_verified_requests

    # -- capacity ------------------------------------------------------------------------------

    def _num_free(self) -> int:
        """vLLM's ``get_num_free_blocks()``: free + evictable cached pages, less the queue's."""
        cache = self.manager.cache
        return (self._free_view.num_free + (cache.num_evictable if cache is not None else 0)
                - self._queue.num_pages)

    @property
    def usage(self) -> float:
        """KV cache usage (0.0 .. 1.0), as vLLM computes it."""
        return 1.0 - self._num_free() / self.manager.num_pages

    # -- prefix lookup -------------------------------------------------------------------------

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    @staticmethod
    def namespace_of(request: Any) -> Any:
        """kvmem's namespace for the request: its ``cache_salt`` and LoRA adapter
        (:func:`~kvmem.integrations.vllm._keys.namespace_of`)."""
        return namespace_of(request)

    def key_tokens(self, request: Any) -> Any:
        """What kvmem keys the request's pages by: its token list, or a view of it with the
        blocks that cover multimodal inputs folded (:mod:`~kvmem.integrations.vllm._keys`)."""
        return key_tokens(request, self.block_size)

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None
                            ) -> tuple[KVMemBlocks, int, int]:
        """The request's cached prefix, as vLLM's lookup would find it after the queued
        allocations and commits: looked up with the queue pending, and again after a flush
        only when the flush could change the answer (:meth:`FlushQueue.changes_lookup`)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        # The list behind all_token_ids, as it is: match_prefix checks and converts it once
        # (a multimodal request's key tokens as a list).
        tokens = self.key_tokens(request)
        if isinstance(tokens, KeyTokens):
            tokens = tokens[:]
        namespace = self.namespace_of(request)
        max_pages = max_cache_hit_length // self.block_size
        match = self.manager.match_prefix(tokens, namespace, max_pages)
        q = self._queue
        if (q.entries or q.commits) and q.changes_lookup(tokens, namespace, match.pages,
                                                         max_pages):
            self.flush()
            match = self.manager.match_prefix(tokens, namespace, max_pages)
        if not match.num_pages:
            return self.empty_kv_cache_blocks, 0, 0
        pages, num_evictable = match.pages, match.num_evictable
        if self.use_eagle:
            # vLLM's EAGLE drop: the longest hit, less its last block (found, then dropped).
            pages = pages[:-1]
            if not pages.size:
                return self.empty_kv_cache_blocks, 0, 0
            cache = self.manager.cache
            assert isinstance(cache, VllmOrderPrefixCache)
            num_evictable -= cache.is_evictable(int(match.pages[-1]))
        hit = PrefixHit((pages + 1).tolist(), num_evictable)
        return hit, int(pages.size) * self.block_size, 0

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._PrefixCacheStats()
        return stats

    # -- allocation ----------------------------------------------------------------------------

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> KVMemBlocks | None:
        """Slots for ``num_new_tokens`` more tokens (None when they do not fit, changing
        nothing): vLLM's arithmetic, kvmem's pages.

        A running request that needs no new page (the decode step's usual case) costs a dict
        lookup and an append: the slots are reserved at the flush, for the whole batch."""
        st = self._reqs.get(request.request_id)
        if st is not None and not num_new_computed_tokens and not num_external_computed_tokens:
            if self._resync and st.rid in self._resync:
                return self._allocate_resync(request, st, num_new_tokens, num_lookahead_tokens,
                                             reserved_blocks, full_sequence_must_fit,
                                             has_scheduled_reqs)
            computed = request.num_computed_tokens
            if num_new_tokens and computed + num_new_tokens + num_lookahead_tokens <= st.cap:
                self._queue.entries.append((request, st, num_new_tokens, None, computed))
                return self._empty
            return self._grow(request, st, num_new_tokens, num_lookahead_tokens,
                              reserved_blocks)
        if num_encoder_tokens:
            raise KVMemError(
                "allocate_slots() got encoder tokens; kvmem's vLLM adapter refuses "
                "encoder-decoder models at construction, so this path should not be reachable")
        if (num_external_computed_tokens or delay_cache_blocks) and not self.connector:
            raise KVMemError(
                "allocate_slots() got external (KV connector) tokens but the adapter was built "
                "without connector=True (the scheduler sets it when kv_transfer_config is set)")
        if st is not None:
            raise KVMemError(
                f"allocate_slots() got {num_new_computed_tokens} new prefix-hit and "
                f"{num_external_computed_tokens} external tokens for request "
                f"{request.request_id!r}, which already maps pages; a running request has no "
                "new prefix hits")
        integer(num_external_computed_tokens, "num_external_computed_tokens", minimum=0)
        if num_new_computed_tokens + num_external_computed_tokens > request.num_tokens:
            raise ArgumentError(
                f"request {request.request_id!r}: {num_new_computed_tokens} prefix-hit + "
                f"{num_external_computed_tokens} external tokens exceed its "
                f"{request.num_tokens} tokens; nothing was admitted")
        return self._admit(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                           num_lookahead_tokens, full_sequence_must_fit, reserved_blocks,
                           has_scheduled_reqs, num_external_computed_tokens,
                           bool(delay_cache_blocks))

    def _growth(self, request: Any, st: RequestState, num_new_tokens: int,
                num_lookahead_tokens: int) -> tuple[int, int, int]:
        """A running request's step: ``(its computed tokens, the tokens its pages must hold,
        the pages it needs beyond its reservation)``; vLLM's ValueError (kvmem's
        ArgumentError, a ValueError too) for a step of no new tokens."""
        if num_new_tokens == 0:
            raise ArgumentError(
                f"request {request.request_id!r}: num_new_tokens must be greater than 0 when "
                "there are no computed tokens to adopt (got 0 new tokens; nothing changed)")
        computed = request.num_computed_tokens
        need_tokens = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        p = self.block_size
        return computed, need_tokens, _cdiv(need_tokens, p) - st.cap // p

    def _grow(self, request: Any, st: RequestState, num_new_tokens: int, num_lookahead_tokens: int,
              reserved_blocks: int) -> KVMemBlocks | None:
        """A running request that needs new pages: decided now, allocated at the flush."""
        computed, need_tokens, need = self._growth(request, st, num_new_tokens,
                                                   num_lookahead_tokens)
        p = self.block_size
        if need > self._num_free() - reserved_blocks:
            return None
        if need <= 0:
            self._queue.entries.append((request, st, num_new_tokens, None, computed))
            return self._empty
        st.cap += need * p
        out = KVMemBlocks(self, None)
        # The lookahead slots are reserved too, so that kvmem maps the pages vLLM allocates.
        self._queue.add_growth(request, st, num_new_tokens, computed, need, out,
                               need_tokens - computed - num_new_tokens)
        return out

    def _admit(self, request: Any, num_new_tokens: int, num_hit_tokens: int, hit: Any,
               num_lookahead_tokens: int, full_sequence_must_fit: bool, reserved_blocks: int,
               has_scheduled_reqs: bool, num_external: int = 0, delay_cache: bool = False
               ) -> KVMemBlocks | None:
        """Admit a request with ``num_hit_tokens`` of kvmem's prefix hit and ``num_external``
        tokens a KV connector supplies after them (their slots are reserved with the step's
        ``num_new_tokens``; committed with them, or, ``delay_cache``, when ``cache_blocks``
        says the asynchronous load is done)."""
        if num_new_tokens == 0 and num_hit_tokens == 0 and num_external == 0:
            # vLLM's ValueError, as kvmem's (a ValueError too): nothing was admitted.
            raise ArgumentError(
                f"request {request.request_id!r}: num_new_tokens must be greater than 0 when "
                "there are no computed tokens to adopt (got 0 new and 0 prefix-hit tokens)")
        p = self.block_size
        need_tokens = min(num_hit_tokens + num_external + num_new_tokens + num_lookahead_tokens,
                          self.max_model_len)
        num_hit = num_hit_tokens // p
        evictable = hit.num_evictable if isinstance(hit, PrefixHit) else 0
        watermark = (self.watermark_blocks
                     if has_scheduled_reqs and request.status in self._admitting else 0)
        free = self._num_free()
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if _cdiv(full, p) - num_hit + evictable + watermark > free:
                return None
        need = _cdiv(need_tokens, p) - num_hit
        if need + evictable + watermark > free - reserved_blocks:
            return None
        if self.connector and len(self._reqs) >= self.manager.max_seqs:
            return None  # every kvmem row is taken (loads in flight hold rows too)
        rid = request.request_id
        tokens = self.key_tokens(request)
        # admit() maps the hit and one page for the next token: with num_hit_tokens + 1 tokens
        # its prefix match can find at most the hit (nothing changed since the lookup), and a
        # request that must not read the cache (num_hit_tokens == 0) finds nothing.
        res = self.manager.admit(rid, tokens[: num_hit_tokens + 1],
                                 namespace=self.namespace_of(request))
        if res.num_cached_tokens != num_hit_tokens:
            self.manager.release(rid)
            raise KVMemError(
                f"request {rid!r}: the prefix lookup found {num_hit_tokens} cached tokens but "
                f"admission then found {res.num_cached_tokens}; nothing may change between "
                "get_computed_blocks() and allocate_slots() (the request was not admitted)")
        # The flush commits the request's tokens from its key tokens (the same list, unless
        # it has multimodal inputs).
        request._kvmem_keys = tokens
        if request.resumable:
            self._queue.resumable = True
        if request.lora_request is not None and self.enable_kv_cache_events:
            self._lora_ids[self.namespace_of(request)] = request.lora_request.adapter_id
        st = RequestState(rid, _cdiv(need_tokens, p) * p, num_hit_tokens)
        self._reqs[rid] = st
        upto = (num_hit_tokens if delay_cache
                else min(num_hit_tokens + num_external + num_new_tokens, len(tokens)))
        if delay_cache:
            self._resync.add(rid)
        out = KVMemBlocks(self, None)  # the pages past the hit (the scheduler asks get_blocks)
        self._queue.add_admission(request, st, num_external + num_new_tokens, upto, need,
                                  need - res.num_pages + res.num_hit_pages, out,
                                  need_tokens - num_hit_tokens - num_external - num_new_tokens)
        return out

    # -- KV connectors: requests whose slots are out of step with vLLM's computed tokens ------

    def _reconcile(self, request: Any, st: RequestState) -> int:
        """Bring a request of ``_resync`` in line with vLLM's computed tokens ``c``: its
        uncommitted slots past ``max(c, committed)`` go back to kvmem (its pages kept, as vLLM
        keeps its blocks: a failed or partial load's tail, rolled back). Returns kvmem's slots
        after it (more than ``c`` after a load failure's rollback: vLLM recomputes those
        tokens into the same slots, which kvmem holds committed already)."""
        self._flush_pending()
        mgr, rid = self.manager, st.rid
        computed = request.num_computed_tokens
        total, committed = mgr.num_tokens(rid), mgr.num_committed(rid)
        keep = max(computed, committed)
        if total > keep:
            mgr.reject(rid, total - keep, keep_pages=True)
        st.committed = committed
        if committed == computed:
            self._resync.discard(rid)
        return mgr.num_tokens(rid)

    def _allocate_resync(self, request: Any, st: RequestState, num_new_tokens: int,
                         num_lookahead_tokens: int, reserved_blocks: int,
                         full_sequence_must_fit: bool = False, has_scheduled_reqs: bool = True
                         ) -> KVMemBlocks | None:
        """``allocate_slots`` for a request of ``_resync`` (a loaded request joining the
        batch is still waiting: vLLM's watermark and full-sequence checks apply to it):
        reconciled first, then queued with an explicit commit target (its committed tokens
        are not its computed ones)."""
        computed, need_tokens, need = self._growth(request, st, num_new_tokens,
                                                   num_lookahead_tokens)
        p = self.block_size
        free = self._num_free()
        watermark = (self.watermark_blocks
                     if has_scheduled_reqs and request.status in self._admitting else 0)
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if _cdiv(full, p) - st.cap // p + watermark > free:
                return None
        if need + watermark > free - reserved_blocks:
            return None
        start = self._reconcile(request, st)  # kvmem's slots now
        upto = min(computed + num_new_tokens, len(request._all_token_ids))
        count = max((need_tokens if need > 0 else computed + num_new_tokens) - start, 0)
        if need <= 0 and count == 0 and upto <= st.committed:
            return self._empty
        out = None
        if need > 0:
            st.cap += need * p
            out = KVMemBlocks(self, None)
        self._queue.add_resync(request, st, count, upto, start, max(need, 0), out)
        return out if out is not None else self._empty

    def _aborted(self, aborted: dict[Any, str]) -> None:
        for rid, reason in aborted.items():
            logger.warning("kvmem integrity check aborted request %r: %s", rid, reason)
            self._reqs.pop(rid, None)
            self.integrity_aborts[rid] = reason
            self.num_integrity_aborts += 1

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Commit the request's known tokens up to ``num_computed_tokens`` (async scheduling's
        tokens arrive after their step was scheduled); done at the next flush, which comes
        before anything could observe the difference (a lookup, a free, the events). An
        asynchronous load's tokens (KV connectors) are committed now, whether or not prefix
        caching is on: kvmem holds them written from now on."""
        rid = request.request_id
        if self._resync and rid in self._resync:
            self._commit_loaded(request, self._reqs[rid], num_computed_tokens)
            return
        if not self.enable_caching:
            return
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        known = len(request._all_token_ids)
        upto = num_computed_tokens if num_computed_tokens < known else known
        if upto > st.committed:  # (usually not: committed when their step was scheduled)
            self._queue.commits.append((request, st, upto))

    def _commit_loaded(self, request: Any, st: RequestState, num_computed_tokens: int) -> None:
        """Commit a loaded request's tokens up to ``num_computed_tokens`` (those a KV
        connector loaded, or the valid prefix of a failed load)."""
        integer(num_computed_tokens, "num_computed_tokens", minimum=0)
        self._flush_pending()
        rid = st.rid
        committed = self.manager.num_committed(rid)
        upto = min(num_computed_tokens, self.manager.num_tokens(rid),
                   len(request._all_token_ids))
        if upto > committed:
            self.manager.commit(rid, request._all_token_ids[committed:upto])
            st.committed = upto

    def free(self, request: Any) -> None:
        self._flush_pending()
        rid = request.request_id
        lease = self._held.pop(rid, None)
        if lease is not None:  # held for the connector since its request finished
            self.manager.end_lease(lease)
            return
        self._resync.discard(rid)
        if self._reqs.pop(rid, None) is not None:
            self.manager.release(rid)

    def hold(self, request: Any) -> None:
        """A finished request whose blocks a KV connector still reads (or an asynchronous
        load still writes): vLLM keeps them until ``free``. kvmem releases the request (its
        row) and leases its pages: they stay live, keep their tags and are never reused
        until ``free`` ends the lease (cached ones stay in the prefix cache)."""
        rid = request.request_id
        self._flush_pending()
        if rid in self._held:
            raise ArgumentError(f"request {rid!r}: its blocks are already held; nothing changed")
        if rid not in self._reqs:
            return
        self._held[rid] = self._lease_and_release(rid)

    def _lease_and_release(self, rid: str) -> Any:
        lease = self.manager.lease(rid)
        self._reqs.pop(rid)
        self._resync.discard(rid)
        self.manager.release(rid)
        return lease

    # -- block ids -----------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVMemBlocks:
        """The request's block ids; while allocations are queued, an object filled at the
        flush (vLLM asks right after admitting a request, and reads the ids only when it builds
        the step's output: nothing between changes a queued request's blocks but the flush)."""
        if self._queue.entries:
            out = KVMemBlocks(self, None)
            self._row_blocks.append((request_id, out))
            return out
        self._flush_pending()
        if request_id not in self._reqs:
            return self.empty_kv_cache_blocks
        return KVMemBlocks(self, self._block_ids(request_id))

    def _block_ids(self, request_id: str) -> list[int]:
        st = self._reqs.get(request_id)
        if st is None:
            return []
        if self.worker_block_table is not None and st.row >= 0:
            n = st.cap // self.block_size
            return (self.worker_block_table[st.row, :n] + 1).tolist()
        return (self.manager.pages_of(request_id) + 1).tolist()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        self._flush_pending()
        return (self._block_ids(request_id),)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int
                                          ) -> tuple[list[int], ...]:
        (ids,) = self.get_block_ids(request_id)
        return (ids[: _cdiv(num_computed_tokens, self.block_size)],)

    def estimate_cached_tokens(self, request: Any) -> int:
        if request.request_id not in self._reqs or not self.enable_caching:
            return 0
        self._flush_pending()
        committed = self.manager.num_committed(request.request_id)
        return committed // self.block_size * self.block_size

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0]

    # -- step hooks, events, reset -------------------------------------------------------------

    def new_step_starts(self) -> None:
        self._flush_pending()

    def take_new_block_ids(self) -> list[int]:
        self._flush_pending()
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        self._flush_pending()
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        self._flush_pending()
        return {}

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Full attention skips no blocks."""

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        return []

    def take_events(self) -> list[Any]:
        """kvmem's KV events as vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
        (hashes: kvmem's 128-bit chained keys; a namespace is reported as vLLM reports its
        ``cache_salt`` and LoRA adapter: ``_blocks.vllm_events``)."""
        self._flush_pending()
        if not self.enable_kv_cache_events:
            return []
        out = vllm_events(self.manager.take_events(), self._lora_ids)
        if self._uncached_resets:
            from vllm.distributed.kv_events import AllBlocksCleared

            out.extend(AllBlocksCleared() for _ in range(self._uncached_resets))
            self._uncached_resets = 0
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while a request maps pages, as vLLM."""
        self._flush_pending()
        if self.manager.running:
            logger.warning("Failed to reset prefix cache because %d requests still map pages",
                           len(self.manager.running))
            return False
        self.manager.clear_prefix_cache()
        if self.manager.cache is None and self.enable_kv_cache_events:
            self._uncached_resets += 1
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    # -- KV connector paths -------------------------------------------------------------------

    def num_blocks_to_hold(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request needs beyond those it maps to hold ``num_tokens`` tokens."""
        st = self._reqs.get(request_id)
        have = st.cap // self.block_size if st is not None else 0
        return max(_cdiv(num_tokens, self.block_size) - have, 0)

    def rolled_back(self, request_id: str, block_ids: list[int]) -> None:
        """vLLM rolled a request's computed tokens back to before ``block_ids`` (a failed
        load left them invalid): its next allocation reconciles it, and the blocks leave the
        prefix cache now, whatever the failure policy (vLLM keeps them cached under
        ``recompute``, so a later request could read them before they are recomputed)."""
        pages = self._pages_of_blocks(block_ids, "rolled_back()")
        if request_id not in self._reqs:
            raise ArgumentError(f"rolled_back(): request {request_id!r} maps no blocks here")
        self._flush_pending()
        self._resync.add(request_id)
        mgr = self.manager
        for keys in mgr.pages.uncache(pages):
            mgr._removed(keys)

    def cached_blocks(self, block_ids: list[int]) -> list[bool]:
        """Whether each block is in kvmem's prefix cache (what vLLM's ``block_hash`` says)."""
        cache = self.manager.cache
        if cache is None or not block_ids:
            return [False] * len(block_ids)
        return cache.is_cached(np.array(block_ids, dtype=np.int32) - 1).tolist()

    def pop_blocks_for_free(self, request: Any) -> list[KVMemBlock]:
        """vLLM's deferred free: the request is forgotten now, its blocks returned for the
        caller to give back later through ``block_pool.free_blocks`` (kvmem leases them
        meanwhile: never reused before that)."""
        self._flush_pending()
        rid = request.request_id
        if rid not in self._reqs:
            return []
        ids = self._block_ids(rid)
        self._num_pops += 1
        key = self._num_pops
        self._held[key] = self._lease_and_release(rid)
        return [KVMemBlock(i, None, key) for i in ids]

    def end_holds(self, blocks: Any) -> None:
        """``block_pool.free_blocks`` of blocks ``pop_blocks_for_free`` returned: their leases
        end (checked first: on error nothing is released)."""
        blocks = list(blocks)
        keys = {getattr(b, "hold", None) for b in blocks}
        bad = [b for b in blocks if not isinstance(b, KVMemBlock) or b.hold not in self._held]
        if bad:
            raise ArgumentError(f"free_blocks() got {bad[:4]!r}: not blocks that "
                                "pop_blocks_for_free() returned and still holds; nothing freed")
        for key in keys:
            self.manager.end_lease(self._held.pop(key))

    def _pages_of_blocks(self, block_ids: Any, what: str) -> Any:
        ids = list(block_ids)
        n = self.num_gpu_blocks
        if not all(is_integer_like(i) and 0 < int(i) < n for i in ids):
            raise ArgumentError(f"{what}: block ids must be ints in [1, {n}) (0 is the null "
                                f"block); got {sorted(map(repr, ids))[:8]}; nothing changed")
        return np.array(sorted(int(i) for i in ids), dtype=np.int32) - 1

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Take the blocks out of the prefix cache (a failed load left them invalid): no later
        lookup finds them; requests that map them keep them."""
        pages = self._pages_of_blocks(block_ids, "evict_blocks()")
        self._flush_pending()
        mgr = self.manager
        for keys in mgr.pages.uncache(pages):  # (as verify uncaches a broken request's pages)
            mgr._removed(keys)

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> KVMemBlocks:
        """A prefix hit cut at ``num_computed_tokens`` (block-aligned): its first blocks, the
        count of those only the cache holds recomputed."""
        integer(num_computed_tokens, "num_computed_tokens", minimum=0)
        ids = [] if blocks is None else blocks.get_block_ids()[0]
        if num_computed_tokens % self.block_size or num_computed_tokens // self.block_size > len(
                ids):
            raise ArgumentError(
                f"truncate_computed_blocks(): num_computed_tokens={num_computed_tokens} must be "
                f"a multiple of block_size={self.block_size} within the hit's {len(ids)} blocks")
        kept = ids[: num_computed_tokens // self.block_size]
        if not kept:
            return self.empty_kv_cache_blocks
        cache = self.manager.cache
        assert isinstance(cache, VllmOrderPrefixCache)
        return PrefixHit(kept, sum(cache.is_evictable(i - 1) for i in kept))

    def get_computed_blocks_for_connector(self, request: Any,
                                          max_cache_hit_length: int | None = None
                                          ) -> tuple[KVMemBlocks, int, int, bool]:
        """``get_computed_blocks`` (one full-attention group: hits never diverge)."""
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """vLLM zeroes new blocks only for Mamba or mixed-precision caches, which kvmem's
        adapter refuses: nothing to record (``take_new_block_ids`` is always empty). Checked
        as vLLM checks it."""
        integer(start_token, "start_token", minimum=0)
        if start_token % self.block_size:
            raise ArgumentError(f"record_blocks_for_zeroing(): start_token={start_token} must be "
                                f"a multiple of block_size={self.block_size}")

    def check(self) -> None:
        """kvmem's full bookkeeping check, plus the adapter's: every running request's page
        count and committed tokens agree with the manager's (raises ``IntegrityError``)."""
        from kvmem.errors import IntegrityError

        self._flush_pending()
        self.manager.check()
        running = set(self.manager.running)
        if running != set(self._reqs):
            raise IntegrityError(f"the adapter tracks {sorted(self._reqs)[:8]} but the manager "
                                 f"runs {sorted(running)[:8]}")
        for rid, s in self._reqs.items():
            n = int(self.manager.pages_of(rid).size)
            # Synchronous scheduling commits every scheduled token when it is scheduled (not a
            # connector's request being loaded or rolled back).
            committed = (s.committed if self.async_outputs or rid in self._resync
                         else self.manager.num_tokens(rid))
            if n != s.cap // self.block_size or self.manager.num_committed(rid) != committed:
                raise IntegrityError(
                    f"request {rid!r}: the adapter expects {s.cap // self.block_size} pages and "
                    f"{committed} committed tokens, the manager has {n} and "
                    f"{self.manager.num_committed(rid)}")


class HeldBlockPool:
    """What vLLM's scheduler and connectors call of vLLM's ``BlockPool``: ``free_blocks`` of
    the blocks ``pop_blocks_for_free`` returned (vLLM's deferred frees) and
    ``get_num_free_blocks``. The adapter's ``block_pool`` when it serves a connector (its
    other, private, state has no counterpart here)."""

    def __init__(self, adapter: VllmKVCacheAdapter) -> None:
        self._adapter = adapter

    def free_blocks(self, blocks: Any) -> None:
        self._adapter.end_holds(blocks)

    def get_num_free_blocks(self) -> int:
        """vLLM's free blocks: kvmem's free and evictable pages, less the queued ones."""
        return self._adapter._num_free()
