"""KVCacheManager: the one object an inference engine embeds to run every request's KV pages.

Life of a request (``P`` = page_size)::

    admit(id, prompt)      match the cached prefix (full pages, same namespace), share those
                           pages, allocate pages for the rest of the prompt *now* (a capacity
                           guarantee: prefill never runs out of pages), map them.
                           -> num_cached_tokens (a multiple of P, at most len(prompt) - 1)
    reserve(ids, n)        every request of the batch gains n token slots (a prefill chunk, a
                           decode token, k speculative tokens); pages are allocated only where
                           a request crosses a page boundary past what it holds; a write into a
                           shared, partly filled page first copies it (copy-on-write).
                           -> slot_mapping for the new tokens, CSR / block table over all tokens
    commit(id, tokens)     the KV of these tokens is written: pages that became full are offered
                           to the prefix cache (never earlier: a page is reusable only once its
                           tokens are committed)
    verify(ids)            the integrity check before decode (CheckingTracker); failing requests
                           are aborted and released, the rest proceed
    fork / preempt / resume / release

This module is the facade: the public methods, each documented where an engine author reads
it; none holds a mechanism. Each mechanism lives in the room that owns its data::

    kvmem.allocator   Pages (references, eviction, page contents), PageTable (rows and per-row
                      state), Reserver (reserve), StepBuilder (kernel metadata), Committer
                      (commit, offers to the prefix cache), StepFences, the prefix cache
    kvmem.integrity   the qualified tag format and its mirror, the trackers, the Verifier
    kvmem._hooks      hooks and KV events; kvmem._requests the request registry

A manager is used by one thread at a time; a second thread that enters while another is inside
is refused with :class:`~kvmem.errors.ConcurrentUseError` before it changes anything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._hooks import HookBus
from kvmem._manager_types import (
    HOOK_KINDS,
    AdmitResult,
    AllPagesCleared,
    HookError,
    KVEvent,
    ManagerConfig,
    ManagerEvent,
    ManagerStats,
    PagesRemoved,
    PagesStored,
    StepMetadata,
    VerifierStats,
    VerifyReport,
    check_pool,
    make_cache,
    make_tracker,
    public,
)
from kvmem._requests import Request, Requests
from kvmem._validate import flag, id_tuple, integer, is_hashable, token_array
from kvmem.allocator import (
    Admission,
    Committer,
    Forks,
    Lease,
    Namespaces,
    PageTable,
    Plan,
    PrefixCache,
    PrefixMatch,
    Reserver,
    StepBuilder,
    StepHandle,
    StepRecord,
    batch_tokens,
    problems,
    token_counts,
)
from kvmem.allocator import Pages as PageRefs
from kvmem.allocator import keys_as_ints as _keys_as_ints
from kvmem.errors import ArgumentError, IntegrityError, KVMemError
from kvmem.integrity import Recorder, TagMirror, Tracker, Verifier, resolve_metadata

__all__ = [
    "HOOK_KINDS",
    "AdmitResult",
    "AllPagesCleared",
    "HookError",
    "KVCacheManager",
    "ManagerConfig",
    "ManagerEvent",
    "ManagerStats",
    "PagesRemoved",
    "PagesStored",
    "StepHandle",
    "StepMetadata",
    "VerifierStats",
    "VerifyReport",
]

logger = logging.getLogger(__name__)

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]


class KVCacheManager:
    """Pages, prefix reuse, fences, integrity checks and hooks for an engine's requests.

    Parameters
    ----------
    num_pages: physical pages (the pool's page count).
    page_size: token slots per page.
    max_seqs: most requests mapped at once (running; preempted ones hold no row).
    max_pages_per_seq: most pages one request maps (context limit ``* page_size``); default
        ``min(num_pages, 2048)``.
    prefix_cache: ``"hashed"`` (default, :class:`HashedPrefixCache`), ``None`` (no reuse) or a
        :class:`PrefixCache` instance (bound to this manager's allocator).
    tracker: ``NoOpTracker()`` (default: verification costs nothing), ``"checking"``,
        ``"paranoid"`` (a checking tracker that also runs the full check beside every fast
        verification and raises on any disagreement) or a :class:`CheckingTracker` shaped
        ``[>= max_seqs, >= max_pages_per_seq]``.
    pool: an optional page pool (``kvmem.cuda.PagePool``) with the same page size and page
        count: copy-on-write calls ``pool.copy_pages(src, dst)``, and the manager
        claims the pool's tag mirror (``pool.tags``) and keeps it current, so ``verify`` checks
        device metadata on the device.
    watermark: fraction of pages ``can_admit`` keeps free for running requests to grow into.
    kv_events: record KV events (``take_events()``) for a cache-aware router.
    evict_ahead: when cached pages must be evicted, how many least-recently-used pages to take
        beyond the shortfall (an eviction has a fixed cost; the next allocations find them
        free). Default ``num_pages // 512``; 0 evicts exactly the shortfall (vLLM's behaviour).
    offload: tiers below the device, of the pool's identity (IncompatibleCacheError naming
        the field otherwise): a ``kvmem.transfer.HostTier``, a ``DiskTier``, ``(host, disk)``,
        or a ``kvmem.transfer.OffloadConfig`` (write policy, deferred copies). Pages the
        prefix cache evicts (or, write-through, commits) are stored there, and admission loads
        the prompt pages they hold after the device hits into fresh pages
        (``kvmem.transfer._offload``, docs/offload.md). Needs ``pool`` and a prefix cache
        (ConfigError).

    Attributes
    ----------
    allocator, fences, cache: the page references (``PageAllocator``, ``StepFences``, the prefix
        cache or None); table: the ``PageTable``; tracker: the tracker; steps: the
        ``StepBuilder`` (the latest reserved batches); verifier: the ``Verifier``;
        fault_hooks: :class:`~kvmem.allocator.FaultHooks` (fault injection only).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int = 16,
        max_seqs: int = 256,
        max_pages_per_seq: int | None = None,
        prefix_cache: str | PrefixCache | None = "hashed",
        tracker: Tracker | str | None = None,
        pool: Any = None,
        watermark: float = 0.01,
        kv_events: bool = False,
        evict_ahead: int | None = None,
        offload: Any = None,
    ) -> None:
        cfg = ManagerConfig.make(num_pages, page_size, max_seqs, max_pages_per_seq, watermark,
                                 kv_events, evict_ahead)
        self.config = cfg
        self.num_pages, self.page_size = cfg.num_pages, cfg.page_size
        self.max_seqs, self.max_pages_per_seq = cfg.max_seqs, cfg.max_pages_per_seq
        self.watermark_pages = int(cfg.watermark * cfg.num_pages)
        self._most_tokens = cfg.max_pages_per_seq * cfg.page_size  # a request's most tokens
        check_pool(pool, cfg)
        cache = make_cache(prefix_cache)
        self.offload = None if offload is None else self._offload(offload, pool, cache)
        self.tracker = make_tracker(tracker, cfg)
        self._recorder = Recorder(self.tracker, cfg.max_pages_per_seq)
        self._lock = threading.RLock()
        self._hooks = HookBus(cfg.kv_events)
        self.table = PageTable(cfg.max_seqs, cfg.max_pages_per_seq, cfg.page_size)
        self._forks = Forks(self.table)  # (the owner of the copies forks promised)
        self.pages = PageRefs(cfg.num_pages, cfg.page_size, cache, self._evicted, self._freed,
                              cfg.evict_ahead, self._forks.promised)
        self.allocator, self.fences = self.pages.allocator, self.pages.fences
        self.fault_hooks = self.pages.faults
        self.steps = StepBuilder(self.table, self._recorder.expected_flat)
        self.pool = pool
        self._reserver = Reserver(self.table, self.pages, self.steps, self._forks, self._recorder,
                                  None if pool is None else pool.copy_pages, self._allocated)
        through = None
        if self.offload is not None and self.offload.config.write == "through":
            through = self.offload.store_committed
        self._committer = Committer(self.table, self.pages, self.steps,
                                    self._stored if cfg.kv_events else None, through)
        self.mirror = TagMirror(self.allocator.tags, self.pages.namespace_ids,
                                None if pool is None else self.allocator.changes.reader(), pool)
        self.verifier = Verifier(self._recorder, self.table, self.allocator.tags,
                                 self.pages.namespace_ids, self.mirror,
                                 self.allocator.changes.reader(), self.pages.writers)
        self._requests = Requests(cfg.max_seqs)
        self._rows = self._requests.rows  # running request -> page-table row
        self.namespaces = Namespaces()
        self._admission = Admission(self.pages, self.table, self.namespaces)
        self._mutations = 0  # public operations run so far
        self._counters = dict.fromkeys(("prefix_queries", "prefix_query_tokens",
                                        "prefix_hit_tokens", "preemptions",
                                        "integrity_failures", "forks"), 0)
        self._recorder.claim()  # its rows are this manager's (make_tracker refuses a 2nd)
        if self.offload is not None:  # (last: a refused manager leaves the tier free)
            self.offload.attach(self.pages, self.namespaces.name)

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache (None: no reuse)."""
        return self.pages.cache

    @cache.setter
    def cache(self, cache: PrefixCache | None) -> None:
        """Replace the cache of a running manager: for fault injection only
        (``kvmem.testing.faults``): the new object must wrap the old, bound one."""
        self.pages.cache = cache

    # -- events the rooms report -------------------------------------------------------------------

    def _offload(self, config: Any, pool: Any, cache: PrefixCache | None) -> Any:
        """The offload of ``config``, checked (changes nothing until ``attach``)."""
        from kvmem.transfer import Offload  # (torch: only with a tier)

        offload = Offload(config, pool, cache)
        offload.on_dropped = lambda medium, n: self._hooks.emit("offload_drop",
                                                               detail=(medium, n))
        if self.config.kv_events:
            offload.on_stored = self._stored_below
            offload.on_removed = self._removed
        return offload

    def _evicted(self, pages: Int32Array, keys: npt.NDArray[np.uint64],
                 namespace_ids: Int64Array) -> None:
        self._hooks.emit("evict", pages=pages)
        self._hooks.emit("free", pages=pages)
        self._removed(keys)
        if self.offload is not None:  # (the pages are free, their bytes not yet overwritten)
            self.offload.store_evicted(pages, keys, namespace_ids)

    def _removed(self, keys: npt.NDArray[np.uint64], medium: str = "GPU") -> None:
        if self._hooks.kv_events and keys.size:
            self._hooks.kv_event(PagesRemoved(tuple(_keys_as_ints(keys)), medium))

    def _stored_below(self, keys: npt.NDArray[np.uint64], tokens: Int64Array,
                      namespace: Any, medium: str) -> None:
        # Stored page by page as evicted: the parent of a run is not known (as vLLM's offload).
        self._hooks.kv_event(PagesStored(tuple(_keys_as_ints(keys)), None,
                                         tuple(tokens.reshape(-1).tolist()), self.page_size,
                                         namespace, medium))

    def _freed(self, pages: Int32Array) -> None:
        self._hooks.emit("free", pages=pages)

    def _allocated(self, pages: Int32Array) -> None:
        self._hooks.emit("allocate", pages=pages)

    def _stored(self, row: int, keys: tuple[int, ...], parent: int | None,
                tokens: tuple[int, ...]) -> None:
        namespace = self._requests.at_row(row).namespace
        self._hooks.kv_event(PagesStored(keys, parent, tokens, self.page_size, namespace))

    @public
    def add_hook(self, kind: str, fn: Callable[[ManagerEvent], Any]) -> None:
        """Call ``fn(event)`` after every operation that produces an event of ``kind``."""
        self._hooks.add(kind, fn)

    @public
    def remove_hook(self, kind: str, fn: Callable[[ManagerEvent], Any]) -> None:
        self._hooks.remove(kind, fn)

    @public
    def take_events(self) -> list[KVEvent]:
        """KV events since the last call (only recorded with ``kv_events=True``)."""
        return self._hooks.take_events()

    # -- the registry ------------------------------------------------------------------------------

    def _batch(self, request_ids: Any, what: str
               ) -> tuple[tuple[Any, ...], IntpArray, StepRecord | None]:
        """(ids, rows, the latest reserve's record if it is this batch's and no row changed
        since) of a batch of distinct running requests (rows read-only, intp)."""
        ids = id_tuple(request_ids, "request_ids")
        b = self.steps.current(ids)
        if b is not None:
            return ids, b.rows, b
        rows = self.steps.leading_rows(ids)  # (distinct running rows: checked when reserved)
        return ids, self._requests.rows_of(ids, what) if rows is None else rows, None

    # -- admission ---------------------------------------------------------------------------------

    @public
    def can_admit(self, token_ids: Any, namespace: Any = None) -> bool:
        """Whether ``admit(…, token_ids, namespace)`` would succeed now and leave the
        watermark's pages free. Counts the prefix pages the request would reuse. Changes
        nothing."""
        plan = self._admission.plan(token_array(token_ids, "token_ids"), namespace, False)
        self._admission.remember(self._mutations, plan)  # for the admit() right after
        return self._admission.fits(plan, self.watermark_pages)

    def match_prefix(self, token_ids: Any, namespace: Any = None,
                     max_pages: int | None = None) -> PrefixMatch:
        """The cached pages holding ``token_ids``' leading full pages in ``namespace`` (at
        most ``max_pages``; default ``(len - 1) // page_size``, as ``admit`` reuses), each
        confirmed against its tokens, lifetime and namespace. A lookup: takes no reference and
        changes nothing (an engine that schedules itself, e.g. vLLM's, asks first)."""
        tokens = token_array(token_ids, "token_ids")
        most = ((tokens.size - 1) // self.page_size if max_pages is None
                else integer(max_pages, "max_pages", minimum=0))
        match = self._admission.match(tokens, namespace, most,
                                      self._mutations)  # (an admit right after may reuse it)
        most = min(most, tokens.size // self.page_size)  # (full pages only)
        if self.offload is None or match.pages.size >= most:
            return match
        return match._replace(num_offloaded=self.offload.num_pages(
            tokens, match.last_key, match.pages.size, most))

    @public
    def admit(self, request_id: Any, token_ids: Any, namespace: Any = None) -> AdmitResult:
        """Admit a request: reuse its cached prefix, allocate and map pages for the whole prompt.

        The watermark is ``can_admit``'s policy; ``admit`` only needs the pages to exist.

        Parameters
        ----------
        request_id: the engine's id (str or int), not already known to the manager
        token_ids: ``[n]`` ints — the prompt
        namespace: tenant / LoRA adapter / cache salt; pages are shared only within one

        Raises
        ------
        OutOfPagesError: not enough free + evictable pages (nothing changed)
        ArgumentError: duplicate id, prompt too long or empty (nothing changed)
        KVMemError: no free row (nothing changed)
        """
        if self._requests.is_known(request_id):
            raise ArgumentError(f"request {request_id!r} is already known to the manager; release "
                             "it first or use a new id")
        # The counter moved once since a can_admit of this prompt (or a match_prefix, which
        # does not count): for this admit.
        plan = self._admission.recall(self._mutations - 1, token_ids, namespace)
        if plan is None:
            plan = self._admission.plan(token_array(token_ids, "token_ids"), namespace, True,
                                        f"request {request_id!r}", self._mutations - 1)
        return self._admit(request_id, plan, namespace)

    def _admit(self, request_id: Any, plan: Plan, namespace: Any) -> AdmitResult:
        fetched = None
        if self.offload is not None and plan.match is not None:
            self._admission.require(plan)  # (a refused admission leaves the tier untouched)
            fetched = self.offload.fetch(plan.tokens, namespace, plan.match.last_key, plan.hits,
                                         (plan.tokens.size - 1) // self.page_size)
        num_loaded = 0 if fetched is None else fetched.bundle.num_pages
        row, pages, new = self._admission.map(plan, num_loaded)
        if fetched is not None and not self.offload.deferred:  # type: ignore[union-attr]
            self._load(row, fetched, new[:num_loaded])
        num_cached = (plan.hits + num_loaded) * self.page_size
        if plan.match is not None:
            self._counters["prefix_queries"] += 1
            self._counters["prefix_query_tokens"] += plan.tokens.size
            self._counters["prefix_hit_tokens"] += plan.hits * self.page_size
        self._open(request_id, row, pages, Request(namespace, plan.namespace_id, plan.tokens))
        first = plan.hits * self.page_size
        if fetched is not None and self.offload.deferred:  # type: ignore[union-attr]
            self.offload.defer_load(request_id, row, fetched,  # type: ignore[union-attr]
                                    new[:num_loaded], first, plan.tokens[first:num_cached])
        elif num_loaded:  # the loaded pages' K/V is written: committed, offered to the cache
            self._commit_loaded(request_id, row, plan.tokens[first:num_cached])
        self._hooks.emit("allocate", request_id, new)
        self._hooks.emit("admit", request_id, pages, detail=num_cached)
        media = {} if fetched is None else fetched.media
        return AdmitResult(request_id, num_cached, int(plan.tokens.size), plan.num_pages,
                           plan.hits, media.get("CPU", 0), media.get("DISK", 0),
                           fetched is not None and self.offload.deferred)  # type: ignore[union-attr]

    def _load(self, row: int, fetched: Any, pages: Int32Array) -> None:
        """Write a tier's pages into a new row's first fresh pages; if that fails, close the
        row again (its pages dropped: nothing leaks) and raise."""
        assert self.offload is not None
        try:
            self.offload.load(fetched, pages)
        except BaseException:
            self.pages.drop(self.table.remove_row(row))
            raise

    def _commit_loaded(self, request_id: Any, row: int, tokens: Int64Array) -> None:
        """A load's tokens landed in the row's pages after its committed ones: commit them
        (the full pages are offered to the prefix cache)."""
        self._committer.commit(np.array([row], dtype=np.intp),
                               np.array([tokens.size], dtype=np.int64), tokens, (request_id,))

    @public
    def land_copies(self) -> dict[Any, int]:
        """Land the offload's deferred copies (``OffloadConfig(copies="deferred")``; a no-op
        otherwise): write-through stores enter the tier, loads write their pages, and each
        request whose load landed has its loaded tokens committed. The engine calls it once a
        step, before scheduling.

        Returns ``{request_id: tokens computed}`` for each running request whose load ended:
        its committed tokens now (the loaded ones included when the load landed, not when a
        reset cancelled it: then the request recomputes them, and its reserved slots end at its
        committed tokens)."""
        if self.offload is None or not (self.offload.loads or self.offload.stores):
            return {}
        done: dict[Any, int] = {}
        for ended in self.offload.land():
            p = ended.load
            rid = p.request_id
            if p.left:
                continue  # (the request left before its load landed)
            row = p.row
            if ended.ok and int(self.table.num_committed[row]) == p.first_token:
                self._commit_loaded(rid, row, p.tokens)
            else:  # cancelled by a reset: the loaded slots are the request's to recompute
                self.table.truncate(row, int(self.table.num_committed[row]),
                                    int(self.table.num_pages[row]))  # (its pages all kept)
            done[rid] = int(self.table.num_committed[row])
        return done

    def is_loading(self, request_id: Any) -> bool:
        """Whether a deferred load into a running request's pages has not landed (the engine
        must not schedule it: ``verify`` would abort it)."""
        return self.offload is not None and self.offload.loading(request_id)

    def _open(self, request_id: Any, row: int, pages: Int32Array, req: Request) -> None:
        """Register a request that maps a new row; its tracker records the row's pages."""
        if self._recorder.enabled:
            self._recorder.record_row(row, self._reserver.expected(pages, req.namespace_id))
        self._requests.open(request_id, row, req)

    # -- the step ----------------------------------------------------------------------------------

    def can_reserve(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]) -> bool:
        """Whether ``reserve(request_ids, num_tokens)`` would find enough pages now."""
        _, rows, _ = self._batch(request_ids, "reserved")
        return self._reserver.can_reserve(rows, token_counts(num_tokens, rows.size,
                                                               self._most_tokens))

    @public
    def reserve(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]
                ) -> StepMetadata:
        """Give every request of the batch ``num_tokens`` more token slots and return the
        step's kernel metadata. All or nothing: on any error nothing changed.

        Parameters
        ----------
        request_ids: ``[B]`` running requests, distinct
        num_tokens: int or ``[B]`` ints >= 0 — a prefill chunk, 1 for decode, k to speculate

        Raises
        ------
        OutOfPagesError: not enough free + evictable pages; preempt a request and retry
        ArgumentError: a request is not running, listed twice, or would exceed
            max_pages_per_seq
        """
        ids, rows, _ = self._batch(request_ids, "reserved")
        return self._reserver.reserve(ids, rows, token_counts(num_tokens, rows.size,
                                                              self._most_tokens))

    @public
    def commit(self, request_id: Any, token_ids: Any) -> None:
        """Record that the KV of these tokens (the request's next reserved slots) is written.

        Pages that became full are offered to the prefix cache (a page is reusable only once
        all its tokens are committed). Raises, changing nothing, if more tokens are committed
        than were reserved.

        Parameters
        ----------
        token_ids: ``[k]`` ints — the tokens whose K/V the engine wrote, in order
        """
        row = self._requests.row_of(request_id)
        tokens = token_array(token_ids, "token_ids")
        self._committer.commit(np.array([row], dtype=np.intp),
                               np.array([tokens.size], dtype=np.int64), tokens, (request_id,))

    @public
    def reject(self, request_id: Any, num_tokens: int, *, keep_pages: bool = False) -> None:
        """Give back a running request's last ``num_tokens`` reserved, uncommitted slots: the
        draft tokens a speculative step's verifier rejected (``reserve(ids, 1 + k)``, commit
        the accepted ones, reject the rest).

        ``keep_pages``: only the slots go back; every page stays mapped for the slots the
        request reserves next (vLLM's manager keeps a request's blocks when its drafts are
        rejected: an engine that mirrors its block tables passes True).

        The request ends at its committed tokens plus the slots it keeps; pages that no longer
        hold any of them (past the pages its prompt was admitted with, which it keeps unless
        shared: the prompt's capacity guarantee) are unmapped and their references dropped
        (held by a step fence while a step in flight may still read them, then freed: their
        lifetime ends, so a later read through an old page list fails ``verify``); the
        tracker forgets them. A tail partly filled again and shared with a fork is copied on
        the next write. A read of a rejected slot in a page the request keeps fails ``verify``
        too: the request's lengths no longer cover it. Changes nothing on error.

        Raises
        ------
        ArgumentError: ``num_tokens`` is negative or more than the request's uncommitted slots
            (committed tokens cannot be rejected); the request is not running.
        """
        row = self._requests.row_of(request_id)
        t = self.table
        total, committed = int(t.num_tokens[row]), int(t.num_committed[row])
        n = integer(num_tokens, "num_tokens", minimum=0)
        flag(keep_pages, "keep_pages")
        if n > total - committed:
            raise ArgumentError(
                f"request {request_id!r} has {total - committed} reserved, uncommitted slots "
                f"({total} reserved, {committed} committed); cannot reject {n} (committed "
                "tokens are never rejected; nothing was changed)")
        if n == 0:
            return
        keep = int(t.num_pages[row]) if keep_pages else -(-(total - n) // self.page_size)
        # The prompt's own pages past them stay (its capacity guarantee); a shared one, and
        # every page after it, goes (the next write would land in another holder's page).
        prompt_pages = -(-self._requests.known[request_id].prompt.size // self.page_size)
        room = t.pages[row, keep : min(prompt_pages, int(t.num_pages[row]))]
        if room.size:
            own = self.pages.writers(room) == 1
            keep += room.size if own.all() else int(np.argmin(own))
        recorded = self._recorder.recorded(row, keep)
        if recorded is None and self._recorder.enabled:
            recorded = self._reserver.expected(t.row_pages(row)[:keep],
                                               int(t.namespace_ids[row]))
        dropped = t.truncate(row, total - n, keep)
        if recorded is not None:
            self._recorder.truncate(row, keep, recorded.copy())
        self.pages.drop(dropped)
        if (total - n) % self.page_size and self.pages.writers(
                t.pages[row, (total - n) // self.page_size : keep])[0] > 1:
            # Its tail is partly filled again and shared (a fork's): copied on the next write.
            t.set_forked(np.array([row]), True)

    @public
    def commit_batch(self, request_ids: Sequence[Any], token_ids: Any) -> None:
        """:meth:`commit` for a batch in one vectorized call.

        Parameters
        ----------
        request_ids: ``[B]`` distinct running requests
        token_ids: ``[B]`` ints (one token each: the decode step; a list, an array or a
            tensor), ``[B, k]`` ints, or a list of ``B`` 1-D int sequences (ragged)
        """
        ids, rows, _ = self._batch(request_ids, "committed")
        flat, counts = batch_tokens(token_ids, rows.size)
        self._committer.commit_batch(ids, rows, counts, flat)

    # -- integrity ---------------------------------------------------------------------------------

    @public
    def verify(self, request_ids: Sequence[Any], step: StepMetadata | None = None, *,
               kv_indptr: Any = None, kv_indices: Any = None,
               metadata: Mapping[str, Any] | None = None) -> VerifyReport:
        """The integrity check before decode; aborts (and releases) only failing requests.

        With ``NoOpTracker`` this returns an empty report at once. Otherwise, for each request:
        every page its metadata lists is live, in the lifetime (tag) recorded when the request
        mapped it, and holds the request's namespace's content (one comparison of namespace-
        qualified tags); it lists as many pages as the request's tokens fill; and every page it
        is about to write has no other holder that reads or writes its future slots (step
        fences and a copy-on-write source awaiting its copy only keep a page from reuse). Given
        the step's metadata (``step`` or ``metadata``), also: its slot mapping sends each new
        token into the page its CSR lists for it, at its offset (padding slots -1), and its
        lengths (``seq_lens``, ``kv_last_page_len``, ``num_new_tokens``, ``qo_indptr``, those
        given) are the request's own. "New" means the tokens of the request's latest
        ``reserve``: verify a step before reserving the next one for the same requests.

        Which metadata is checked, most faithful first: ``metadata`` (a mapping with
        ``slot_mapping``, the CSR ``kv_indptr`` + ``kv_indices`` or else a ``block_table``
        (PAD past each row's pages), and optionally the lengths, named as
        ``StepMetadata.tensors`` names them: the very arrays or tensors the kernels will read,
        e.g. on the pool's device, checked there against the pool's tag mirror); ``kv_indptr`` /
        ``kv_indices`` (the CSR alone); ``step`` (the arrays ``reserve`` returned); none (fresh
        CSR from the page table). Every form gives the verdict of the full check
        (``kvmem.integrity.Verifier``). Malformed metadata (a field of the wrong shape, a CSR
        whose ``kv_indptr`` does not fit ``kv_indices``) raises MetadataError, changing nothing.
        Failing requests are released, counted, sent to the ``integrity_failure`` hook and
        listed in ``report.aborted``.
        """
        landing: dict[Any, tuple[int, str]] = {}
        aborted: dict[Any, str] = {}
        if self.offload is not None and self.offload.loads:
            landing = self._reads_landing(id_tuple(request_ids, "request_ids"))
        if not self.tracker.enabled:  # nothing recorded, nothing to look at
            ids, report = id_tuple(request_ids, "request_ids"), None
        else:
            ids, rows, b = self._batch(request_ids, "verified")
            md = resolve_metadata(rows.size, step, kv_indptr, kv_indices, metadata,
                                  None if b is None else b.step, lambda: self.table.csr(rows)[:2])
            verdict = self.verifier.check(ids, rows, md, b)
            report = verdict.report
            for i, (first_bad, reason) in verdict.failed.items():
                aborted[ids[i]] = reason
                self._abort(ids[i], first_bad, reason)
        for rid, (first_bad, reason) in landing.items():
            if rid not in aborted:
                aborted[rid] = reason
                self._abort(rid, first_bad, reason)
        return VerifyReport(ids, aborted, report)

    def _reads_landing(self, ids: tuple[Any, ...]) -> dict[Any, tuple[int, str]]:
        """(first landing position, reason) of each request of ``ids`` that maps a page whose
        deferred load has not landed."""
        assert self.offload is not None
        found = {}
        for rid in ids:
            row = self._requests.row_of(rid)
            landing = np.flatnonzero(self.offload.landing[self.table.row_pages(row)])
            if landing.size:
                found[rid] = (int(landing[0]), f"its step would read page position "
                              f"{int(landing[0])} before the tier's load into it landed; "
                              "schedule a request only once land_copies() reported it")
        return found

    def _abort(self, request_id: Any, first_bad: int, reason: str) -> None:
        row = self._rows[request_id]
        self._counters["integrity_failures"] += 1
        logger.warning("kvmem: aborting request %r: %s", request_id, reason)
        owned = self._owned_pages(row)
        # Pages after the bad one may hold KV computed from a corrupted context: never offer
        # them to later requests (requests that already hold them keep them).
        for keys in self.pages.uncache(owned[owned[:, 0] > first_bad, 1].astype(np.int32)):
            self._removed(keys)
        self._hooks.emit("integrity_failure", request_id, detail=reason)
        self._close([request_id], owned[:, 1].astype(np.int32))
        del self._requests.known[request_id]

    def _owned_pages(self, row: int) -> Any:
        """(position, page) of each reference a row really holds (``owned_pages``)."""
        return self._recorder.owned_pages(row, self.table.row_pages(row), self.allocator)

    # -- fork, preempt, resume, release ------------------------------------------------------------

    def can_fork(self, parent_id: Any) -> bool:
        """Whether ``fork(parent_id, …)`` would find its pages now: the child's own pages for
        the parent's unfilled room, and a copy of a shared, partly filled tail page."""
        need = self._forks.pages_needed(self._requests.row_of(parent_id))
        return self.table.num_free_rows > 0 and need <= self.pages.available()

    @public
    def fork(self, parent_id: Any, child_id: Any) -> None:
        """Start ``child_id`` as a copy of running ``parent_id`` (parallel sampling, beams).

        The child shares every page that holds tokens (a shared, partly filled tail is copied on
        the first write into it) and gets its own pages for the parent's reserved room.
        """
        prow = self._requests.row_of(parent_id)
        if self._requests.is_known(child_id):
            raise ArgumentError(f"request {child_id!r} is already known; fork into a new id")
        if self.table.num_free_rows == 0:
            raise KVMemError(f"all max_seqs={self.max_seqs} rows are mapped; release a request "
                             "before forking")
        if self.is_loading(parent_id):
            raise ArgumentError(f"request {parent_id!r} waits for a tier load into its pages; "
                                "fork it once land_copies() reported it (nothing was changed)")
        row, pages, own = self._forks.fork(prow, self.pages)
        parent = self._requests.known[parent_id]
        self._open(child_id, row, pages,
                   Request(parent.namespace, parent.namespace_id, parent.prompt))
        self._counters["forks"] += 1
        if own.size:
            self._hooks.emit("allocate", child_id, own)
        self._hooks.emit("fork", child_id, pages, detail=parent_id)

    def _close(self, request_ids: Sequence[Any], owned: Int32Array | None = None
               ) -> list[Int32Array]:
        """Unmap running requests' rows and drop the references they hold, all in one drop:
        each row's pages, or (``owned``, given for one request, or found when its row disagrees
        with what it recorded) only those it provably holds. The pages dropped, per request."""
        runs = []
        loads = self.offload is not None and self.offload.loads
        for request_id in request_ids:
            if loads:
                self.offload.cancel(request_id)  # type: ignore[union-attr]
            row = self._requests.close(request_id)
            pages = owned
            if pages is None and not self._recorder.holds(row, self.table.row_pages(row),
                                                          self.allocator.tags):
                pages = self._owned_pages(row)[:, 1].astype(np.int32)
                self._counters["integrity_failures"] += 1
                reason = ("its page-table row was changed behind the manager's back; only the "
                          "pages it provably holds were released")
                logger.warning("kvmem: request %r: %s", request_id, reason)
                self._hooks.emit("integrity_failure", request_id, detail=reason)
            if self._recorder.enabled:
                self._recorder.clear_row(row)
            mapped = self.table.remove_row(row)
            runs.append(mapped if pages is None else pages)
        self.pages.drop_runs(runs)
        if not self._rows and self.fences.copies_pending:  # no request is left to copy for
            self.pages.copies_done()
        return runs

    def _tokens_of(self, row: int) -> Int64Array:
        committed = int(self.table.num_committed[row])
        return self.pages.tokens_at(self.table._token_slots([row], [0], [committed]))

    def tokens_of(self, request_id: Any) -> Int64Array:
        """The committed token ids of a running request: ``[k]``, int64 (a copy)."""
        return self._tokens_of(self._requests.row_of(request_id))

    @public
    def preempt(self, request_id: Any) -> None:
        """Release a running request's pages, keeping its tokens so it can be resumed by
        recomputation (``resume``). Its committed full pages stay in the prefix cache, so a
        resume usually finds most of them."""
        row = self._requests.row_of(request_id)
        req = self._requests.known[request_id]
        done = self._tokens_of(row)
        req.saved = np.concatenate([done, req.prompt[done.size :]])
        pages = self._close([request_id])[0]
        self._counters["preemptions"] += 1
        self._hooks.emit("preempt", request_id, pages)

    def can_resume(self, request_id: Any) -> bool:
        req, saved = self._requests.preempted(request_id)
        plan = self._admission.plan(saved, req.namespace, False, f"request {request_id!r}")
        return self._admission.fits(plan, self.watermark_pages)

    @public
    def resume(self, request_id: Any, token_ids: Any = None) -> AdmitResult:
        """Re-admit a preempted request with its saved tokens (committed tokens, then the rest
        of the prompt), or with ``token_ids`` if given. Recompute from ``num_cached_tokens``.
        A resume that raises changes nothing (the request stays preempted, in its place)."""
        req, saved = self._requests.preempted(request_id, "; only a preempted request can resume")
        tokens = saved if token_ids is None else token_array(token_ids, "token_ids")
        # What must be recomputed is the request's prompt from now on. (_admit replaces the
        # registry entry in place, so the request keeps its place; if it raises, nothing
        # changed.)
        return self._admit(request_id, self._admission.plan(tokens, req.namespace, True,
                                                            f"request {request_id!r}"),
                           req.namespace)

    @public
    def release(self, request_id: Any) -> None:
        """Forget a request (finished or cancelled), running or preempted; drop its pages."""
        if not is_hashable(request_id) or request_id not in self._requests.known:
            raise ArgumentError(f"request {request_id!r} is unknown or already released")
        pages = self._close([request_id])[0] if request_id in self._rows else None
        del self._requests.known[request_id]
        self._hooks.emit("release", request_id, pages)

    @public
    def release_batch(self, request_ids: Sequence[Any]) -> None:
        """:meth:`release` for several requests at once (a step's finished requests): one free
        and one cache update for all their pages. The same result as releasing them one by one
        in order; all or nothing (an unknown or repeated id raises, releasing none).
        """
        ids = id_tuple(request_ids, "request_ids")
        self._requests.releasable(ids)
        running = [rid for rid in ids if rid in self._rows]
        owned = dict(zip(running, self._close(running)))
        for rid in ids:
            del self._requests.known[rid]
            self._hooks.emit("release", rid, owned.get(rid))

    # -- fences ------------------------------------------------------------------------------------

    @public
    def begin_step(self) -> StepHandle:
        """Mark a step as launched: page references dropped from now on are held until
        ``retire(handle)``."""
        handle = self.fences.begin()
        self._hooks.emit("step_begin", detail=handle.step_id)
        return handle

    @public
    def retire(self, handle: StepHandle) -> None:
        """The device finished the step: free the references that waited only for it."""
        pages = self.fences.retire(handle)
        self.pages.retired(pages)
        self._hooks.emit("step_end", pages=pages, detail=handle.step_id)

    @public
    def lease(self, request_id: Any, start: int = 0, stop: int | None = None) -> Lease:
        """Hold pages ``start:stop`` of a running request's pages (all by default) until
        :meth:`end_lease`: they stay live, keep their tags and are never reused, whatever
        happens to the request meanwhile (release, abort, preemption). For pages a transfer
        reads (the sender's) or writes (the receiver's).

        Returns
        -------
        Lease: ``pages`` ``[n]`` int32 and their lifetime ``tags`` ``[n]`` int64 now
        """
        row_pages = self.table.row_pages(self._requests.row_of(request_id))
        stop = row_pages.size if stop is None else integer(stop, "stop", minimum=0,
                                                             maximum=row_pages.size)
        start = integer(start, "start", minimum=0, maximum=stop)
        return self.pages.lease(row_pages[start:stop])

    @public
    def end_lease(self, lease: Lease) -> bool:
        """Drop a lease's references (its pages are freed now, or when the steps in flight
        retire, unless someone else holds them); whether every page was still in the lifetime
        the lease named (False: one was freed behind the lease's back, its bytes may be
        another lifetime's). Ending a lease twice raises, changing nothing."""
        return self.pages.end_lease(lease)

    # -- queries -----------------------------------------------------------------------------------

    @property
    def running(self) -> tuple[Any, ...]:
        return tuple(self._rows)

    @property
    def preempted(self) -> tuple[Any, ...]:
        return tuple(r for r in self._requests.known if r not in self._rows)

    def row_of(self, request_id: Any) -> int:
        """The page-table row a running request maps (``table.pages[row]``)."""
        return self._requests.row_of(request_id)

    def num_tokens(self, request_id: Any) -> int:
        """Token slots handed out to a running request (cached + reserved)."""
        return int(self.table.num_tokens[self._requests.row_of(request_id)])

    def num_committed(self, request_id: Any) -> int:
        """Tokens of a running request that were committed (their K/V written)."""
        return int(self.table.num_committed[self._requests.row_of(request_id)])

    def pages_of(self, request_id: Any) -> Int32Array:
        """Pages a running request maps, in order: ``[k]``, int32 (a copy)."""
        return self.table.row_pages(self._requests.row_of(request_id)).copy()

    def namespace_of(self, request_id: Any) -> Any:
        """The namespace a known request (running or preempted) was admitted in."""
        if not is_hashable(request_id) or request_id not in self._requests.known:
            raise ArgumentError(f"request {request_id!r} is unknown or already released")
        return self._requests.known[request_id].namespace

    def namespace_of_page(self, page: int) -> Any:
        """The namespace whose content a live page holds (None's id is 0)."""
        page = integer(page, "page", minimum=0, maximum=self.num_pages - 1)
        ns = int(self.pages.namespace_ids[page])
        if ns < 0:
            raise ArgumentError(f"page {page} is free")
        return self.namespaces.name(ns)

    def stats(self) -> ManagerStats:
        """A frozen snapshot (costs a few numpy passes over the pages)."""
        return ManagerStats.of(self.pages, self._counters, len(self._rows),
                               len(self._requests.known) - len(self._rows),
                               self._reserver.num_cow_copies,
                               None if self.offload is None else self.offload.stats())

    def check(self) -> None:
        """Verify every bookkeeping invariant (``kvmem.allocator._invariants``); raise
        IntegrityError listing each problem."""
        found = problems(self.pages, self.table, self._rows.items())
        if found:
            raise IntegrityError("KVCacheManager.check() failed: " + "; ".join(found))

    @public
    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix, on the device and in every tier (pending deferred copies
        are cancelled: their bytes may be of other weights); return how many
        device pages the cache forgot (those no request or step fence holds return to the free
        list; the others stay with their holders)."""
        if self.cache is None:
            return 0
        num = self.pages.clear_cache()
        self._hooks.kv_event(AllPagesCleared())
        if self.offload is not None:
            for medium in self.offload.clear():
                self._hooks.kv_event(AllPagesCleared(medium))
        return num

    def __repr__(self) -> str:
        return (f"KVCacheManager(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"running={len(self._rows)}, free={self.allocator.num_free})")
