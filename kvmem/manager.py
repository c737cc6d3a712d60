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

A request's row of pages::

    | hit | hit | own | own | own (tail, 5/16) | reserved | reserved |   PAD ...
      cached prefix   computed here                          prompt room not yet reserved()
      (shared, full)                      ^ committed          ^ num_tokens (slots handed out)

Step fences: ``begin_step()`` returns a handle; every page reference dropped while a step is in
flight (release, preempt, abort, copy-on-write) is held until ``retire(handle)``, so a launched
kernel never reads a page that was handed to someone else.

Hooks: ``add_hook(kind, fn)``; ``fn(event)`` is called after the operation has completed, so a
hook that raises never leaves the manager half-changed (the operation stands; the hook's error
is re-raised as :class:`HookError` once every hook has run).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

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
    VerifyReport,
)
from kvmem.allocator._fences import StepFences, StepHandle
from kvmem.allocator._page_allocator import PageAllocator, equal_arrays
from kvmem.allocator._page_table import PAD, GrowResult, PageTable
from kvmem.allocator._prefix_cache import HashedPrefixCache, PrefixCache, PrefixMatch
from kvmem.errors import IntegrityError, KVMemError, OutOfPagesError
from kvmem.integrity import CheckingTracker, NoOpTracker, Tracker
from kvmem.integrity._check import Reason

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
    "VerifyReport",
]

logger = logging.getLogger(__name__)

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
# Rows and pages used as indices are intp: numpy indexes with intp arrays several times faster
# than with int32 ones (which it converts on every call).
IntpArray = npt.NDArray[np.intp]
RequestId = Hashable
_INT32_MAX = int(np.iinfo(np.int32).max)
# Tags the manager records and checks are qualified by the namespace of the page's content:
# (allocator tag << _NS_BITS) | namespace id, 0 for a free page. One comparison then proves a
# page is live, in the lifetime the request mapped, and holding the request's namespace.
_NS_BITS = 20


@dataclass(slots=True)
class _Request:
    namespace: Any
    namespace_id: int
    prompt: Int64Array  # the prompt token ids (a private copy)
    saved: Int64Array | None = None  # tokens to recompute on resume (set while preempted)


@dataclass(slots=True, eq=False)
class _Batch:
    """The latest ``reserve()``: its batch, and what ``verify``/``commit_batch`` of the same
    batch reuse. ``indptr``/``indices`` are private copies of the CSR handed out: the next
    reserve builds its CSR from them, copying the rows that only grew (see ``_build_csr``)."""

    ids: tuple[Any, ...]
    rows: IntpArray  # read-only; rows32 is its int32 copy (StepMetadata.rows)
    rows32: Int32Array
    rows_w: Int64Array  # rows * max_pages_per_seq: flat index of each row's column 0
    gens: Int64Array  # the rows' generations when reserved (see KVCacheManager._row_gen)
    counts: Int64Array  # pages listed per row
    indptr: Int32Array
    indices: Int32Array
    epoch: int
    step: StepMetadata | None = None
    start: Int64Array | None = None  # tokens each row held before the reserve
    end: Int64Array | None = None  # ... and after it
    k: int = -1  # tokens per row when the batch got one count (-1: per-row counts)
    slots: Int64Array | None = None  # k == 1: the slot each new token lands in (private) ...
    token_pages: Int32Array | None = None  # ... its page ...
    offsets: Int64Array | None = None  # ... its slot within the page ...
    cols: Int64Array | None = None  # ... and the page's position in the row
    uncommitted: bool = True  # no commit since the reserve: the write set is the step's
    splice: _Splice | None = None  # how indices was patched from a previous batch's


class _Splice(NamedTuple):
    """How ``_build_csr`` patched a batch's ``indices`` from ``base.indices``: ``pages`` are the
    entries spliced in (a snapshot, in order), ``wants`` the namespace-qualified tags the
    CheckingTracker recorded for them when they were spliced (empty without one), ``gone`` the
    base's entries cut out. ``verify`` of the batch's step, when the previous verify proved
    ``base``, then checks only the spliced-in entries."""

    base: _Batch
    pages: Int32Array
    wants: Int64Array
    gone: list[Int32Array]


@dataclass(slots=True, eq=False)
class _Verified:
    """The metadata the latest ``verify()`` proved good (private copies), so that the next one
    checks in full only the entries this one did not see, and the rest by comparison plus the
    pages whose tag changed since (``KVCacheManager._verified_refs``)."""

    rows: IntpArray
    gens: Int64Array
    counts: Int64Array  # pages listed per row
    indptr: Int64Array
    indices: Int32Array


_EMPTY_PAGES = np.empty(0, dtype=np.int32)
_EMPTY_PAGES.flags.writeable = False
_EMPTY_TAGS = np.empty(0, dtype=np.int64)
# Rows that changed since the previous step (grew a page, or hold another request) up to which
# the CSR is patched by splicing slices (more: one vectorized rebuild / the full check).
_MAX_SPLICES = 64


def _ranges(starts: npt.NDArray[np.integer], lengths: npt.NDArray[np.integer]) -> Int64Array:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` in four numpy calls.

    ``starts``, ``lengths``: ``[m]`` ints (lengths >= 0) -> ``[sum(lengths)]``, int64.
    """
    ends = np.cumsum(lengths, dtype=np.int64)
    out = np.repeat(np.asarray(starts, dtype=np.int64) - ends + lengths, lengths)
    out += np.arange(out.size)
    return out


def _step_fields(step: StepMetadata) -> dict[str, Any]:
    """The arrays of a step that a kernel reads, by the names ``StepMetadata.tensors`` uses."""
    return {"slot_mapping": step.slot_mapping, "qo_indptr": step.qo_indptr,
            "kv_indptr": step.kv_indptr, "kv_indices": step.kv_indices,
            "kv_last_page_len": step.kv_last_page_len, "seq_lens": step.seq_lens,
            "num_new_tokens": step.num_new_tokens}


_F = TypeVar("_F", bound=Callable[..., Any])


def _public(fn: _F) -> _F:
    """Run hooks queued by a public operation once it has completed (and drop them if it
    raised: an operation that raises has changed nothing)."""

    @functools.wraps(fn)
    def wrapper(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        self._mutations += 1  # invalidates can_admit()'s remembered plan
        try:
            result = fn(self, *args, **kwargs)
        except BaseException:
            self._queued.clear()
            raise
        if self._queued:
            self._flush_hooks()
        return result

    return wrapper  # type: ignore[return-value]


def _keys_as_ints(keys: npt.NDArray[np.uint64]) -> list[int]:
    return [int.from_bytes(k, "big") for k in
            np.ascontiguousarray(keys).view(np.dtype((np.void, 16))).ravel().tolist()]


# -- the manager --------------------------------------------------------------------------------


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
    tracker: ``NoOpTracker()`` (default: verification costs nothing), ``"checking"`` or a
        :class:`CheckingTracker` shaped ``[>= max_seqs, >= max_pages_per_seq]``.
    pool: an optional page pool (duck-typed ``kvmem.cuda.PagePool``): copy-on-write calls
        ``pool.copy_pages(src, dst)``, and tag changes are mirrored with
        ``pool.update_tags(pages, tags)`` so ``verify`` can check device metadata on device.
    watermark: fraction of pages ``can_admit`` keeps free for running requests to grow into.
    kv_events: record KV events (``take_events()``) for a cache-aware router.
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
    ) -> None:
        if max_pages_per_seq is None and isinstance(num_pages, int):
            max_pages_per_seq = min(num_pages, 2048)
        self.config = ManagerConfig(
            num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
            max_pages_per_seq=max_pages_per_seq, watermark=watermark, kv_events=kv_events,
        )
        cfg = self.config
        self.num_pages = cfg.num_pages
        self.page_size = cfg.page_size
        self.max_seqs = cfg.max_seqs
        self.max_pages_per_seq = cfg.max_pages_per_seq
        self.watermark_pages = int(cfg.watermark * cfg.num_pages)
        self._evict_ahead = cfg.num_pages >> 9  # see _make_room
        self.allocator = PageAllocator(cfg.num_pages)
        self.table = PageTable(cfg.max_seqs, cfg.max_pages_per_seq, cfg.page_size)
        self.fences = StepFences(cfg.num_pages)
        self.cache = self._make_cache(prefix_cache)
        self.tracker = self._make_tracker(tracker)
        # A CheckingTracker's expected tags as a flat view, (row, col) at row * W + col as in
        # the page table, when its rows are that wide.
        self._expected_flat: Int64Array | None = None
        if type(self.tracker) is CheckingTracker:
            expected = self.tracker.expected_tags
            if expected.shape[1] == cfg.max_pages_per_seq and expected.flags.c_contiguous:
                self._expected_flat = expected.reshape(-1)
        self.pool = pool
        if pool is not None:
            spec = getattr(pool, "spec", None)
            n: Any = getattr(pool, "num_pages", None) or getattr(spec, "num_pages", None)
            if n is not None and int(n) < cfg.num_pages:
                raise KVMemError(
                    f"the pool holds {n} pages but the manager was asked to manage {num_pages}; "
                    "give the manager at most the pool's page count"
                )
        # Per request.
        self._requests: dict[Any, _Request] = {}
        self._rows: dict[Any, int] = {}  # running request -> page-table row
        self._row_ids: list[Any] = [None] * cfg.max_seqs
        # Per row.
        self._committed = np.zeros(cfg.max_seqs, dtype=np.int64)
        # First token slot handed out by the row's latest reserve(): the step's write set is
        # [max(committed, write_from), num_tokens).
        self._write_from = np.zeros(cfg.max_seqs, dtype=np.int64)
        self._row_ns = np.zeros(cfg.max_seqs, dtype=np.int64)
        self._row_key = np.zeros((cfg.max_seqs, 2), dtype=np.uint64)
        # Per page: whose namespace the content belongs to (-1 when free), and the token ids
        # committed into each slot (mirrors the KV in the pool; used to offer full pages to the
        # cache and to resume preempted requests).
        self._page_ns = np.full(cfg.num_pages, -1, dtype=np.int64)
        self._qtags = np.zeros(cfg.num_pages, dtype=np.int64)  # see _NS_BITS
        self._forked = np.zeros(cfg.max_seqs, dtype=bool)  # rows whose tail a fork may share
        self._num_forked = 0
        # A row's generation changes whenever its mapped columns may change other than by
        # appending (the row is opened, closed, or copied-on-write); _epoch counts such changes
        # over all rows. Cached batches (reserve -> verify -> commit) are valid while they hold.
        # Generations are unique over all rows (from _epoch), so equal generations mean the
        # same row holding the same request with nothing but appends since.
        self._row_gen = np.zeros(cfg.max_seqs, dtype=np.int64)
        self._epoch = 0
        self._mutations = 0  # public operations run so far
        self._plan_memo: tuple[int, Any, Int64Array, int, PrefixMatch | None] | None = None
        self._arange = np.arange(max(cfg.max_pages_per_seq, cfg.max_seqs) + 1, dtype=np.int64)
        self._ones = np.ones(cfg.max_seqs, dtype=np.int64)
        self._ones.flags.writeable = False
        self._flat_pages = self.table.pages.reshape(-1)  # a view: (row, col) at row * W + col
        self._batch: _Batch | None = None
        # Recent batches by size (a decode batch survives the prefill reserves between steps):
        # the CSR base of the next reserve of a batch that size.
        self._bases: dict[int, _Batch] = {}
        self._qo_cache: dict[tuple[int, int], tuple[Int32Array, Int32Array]] = {}
        # The verified snapshot; per page, how many of its entries list the page; and the pages
        # whose tag changed since it was taken (arrays, as the allocator logged them).
        self._verified: _Verified | None = None
        self._verified_refs = np.zeros(cfg.num_pages, dtype=np.int32)
        self._page_stamp = np.zeros(cfg.num_pages, dtype=np.int64)  # scratch: distinct pages
        self._arange_pages = np.arange(4096, dtype=np.int64)
        self._verified_dirty: list[Int32Array] = []
        self._page_tokens = np.zeros((cfg.num_pages, cfg.page_size), dtype=np.int32)
        self._page_tokens_flat = self._page_tokens.reshape(-1)
        self._ns_ids: dict[Any, int] = {None: 0}
        self._copy_hold: list[Int32Array] = []  # CoW sources kept until the next reserve()
        # Hooks and events.
        self._hooks: dict[str, list[Callable[[ManagerEvent], Any]]] = {k: [] for k in HOOK_KINDS}
        self._queued: list[tuple[Callable[[ManagerEvent], Any], ManagerEvent]] = []
        self._events: list[KVEvent] = []
        # Counters.
        self._num_prefix_queries = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._num_evictions = 0
        self._num_preemptions = 0
        self._num_integrity_failures = 0
        self._num_cow_copies = 0
        self._num_forks = 0

    def _make_cache(self, spec: str | PrefixCache | None) -> PrefixCache | None:
        if spec is None:
            return None
        if isinstance(spec, str):
            if spec != "hashed":
                raise KVMemError(
                    f"prefix_cache={spec!r} is not known; use 'hashed', None, or a PrefixCache"
                )
            spec = HashedPrefixCache()
        if not isinstance(spec, PrefixCache):
            raise KVMemError(
                f"prefix_cache must be 'hashed', None or a PrefixCache, got {type(spec).__name__}"
            )
        spec.bind(self.allocator, self.page_size)
        return spec

    def _make_tracker(self, spec: Tracker | str | None) -> Tracker:
        if spec is None:
            return NoOpTracker()
        if isinstance(spec, str):
            if spec != "checking":
                raise KVMemError(f"tracker={spec!r} is not known; use 'checking' or a Tracker")
            return CheckingTracker(self.max_seqs, self.max_pages_per_seq)
        expected = getattr(spec, "expected_tags", None)
        if expected is not None and (
            expected.shape[0] < self.max_seqs or expected.shape[1] < self.max_pages_per_seq
        ):
            raise KVMemError(
                f"the tracker records {expected.shape} (rows, pages) but the manager needs "
                f"({self.max_seqs}, {self.max_pages_per_seq}); build it with "
                "CheckingTracker(max_seqs, max_pages_per_seq) or pass tracker='checking'"
            )
        return spec

    # -- small helpers -----------------------------------------------------------------------

    def _namespace_id(self, namespace: Any, register: bool) -> int:
        ns = self._ns_ids.get(namespace)
        if ns is None:
            if not register:
                return -1  # unseen: no page can belong to it
            try:
                hash(namespace)
            except TypeError:
                raise KVMemError(
                    f"namespace {namespace!r} is not hashable; use a str, int, bytes or tuple"
                ) from None
            ns = len(self._ns_ids)
            if ns >= 1 << _NS_BITS:
                raise KVMemError(
                    f"this manager has seen {ns} namespaces, the most it can tell apart; "
                    "use fewer (a namespace is a tenant, adapter or salt, not a request)"
                )
            self._ns_ids[namespace] = ns
        return ns

    @staticmethod
    def _as_tokens(token_ids: Any) -> Int64Array:
        if hasattr(token_ids, "detach"):  # a torch tensor, on any device
            token_ids = token_ids.detach().cpu().numpy()
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            if tokens.size == 0 and tokens.ndim == 1:
                return tokens.astype(np.int64)
            raise KVMemError(
                f"token ids must be a 1-D sequence of ints, got shape {tokens.shape} of "
                f"{tokens.dtype}"
            )
        if tokens.size and (int(np.minimum.reduce(tokens)) < 0
                            or int(np.maximum.reduce(tokens)) > _INT32_MAX):
            raise KVMemError(
                f"token ids must be in 0..{_INT32_MAX}, got min {int(tokens.min())} and max "
                f"{int(tokens.max())}"
            )
        return tokens.astype(np.int64)  # a private copy: the engine keeps its own object

    def _rows_of(self, ids: tuple[Any, ...]) -> IntpArray:
        """Page-table rows of running requests: ``[B]``, intp (the latest reserve's own array
        when ``ids`` is its batch and no row changed since)."""
        b = self._batch
        if b is not None and b.epoch == self._epoch and ids == b.ids:
            return b.rows
        try:
            return np.fromiter(map(self._rows.__getitem__, ids), dtype=np.intp, count=len(ids))
        except KeyError as e:
            rid = e.args[0]
            state = "preempted" if rid in self._requests else "unknown or released"
            raise KVMemError(
                f"request {rid!r} is not running ({state}); admit or resume it first"
            ) from None

    @staticmethod
    def _require_distinct(ids: tuple[Any, ...], what: str) -> None:
        """Raise ValueError unless the request ids (so their rows) are distinct."""
        if len(set(ids)) != len(ids):
            raise ValueError(f"request_ids must be distinct (nothing was {what})")

    @staticmethod
    def _require_distinct_rows(rows: IntpArray, what: str) -> None:
        """:meth:`_require_distinct` for running requests, by their rows (one per request)."""
        if rows.size > 1 and np.maximum.reduce(np.bincount(rows)) > 1:
            raise ValueError(f"request_ids must be distinct (nothing was {what})")

    def _touch_row(self, row: int | npt.NDArray[np.integer]) -> None:
        """The row's mapped columns changed other than by appending: cached batches that list
        it must look at it again."""
        if isinstance(row, (int, np.integer)):
            self._epoch += 1
            self._row_gen[row] = self._epoch
        else:
            self._row_gen[row] = self._epoch + 1 + np.arange(len(row))
            self._epoch += len(row)

    def _row_of(self, request_id: Any) -> int:
        row = self._rows.get(request_id)
        if row is None:
            state = "preempted" if request_id in self._requests else "unknown or released"
            raise KVMemError(
                f"request {request_id!r} is not running ({state}); admit or resume it first"
            )
        return row

    def _emit(self, kind: str, request_id: Any = None, pages: Int32Array | None = None,
              detail: Any = None) -> None:
        hooks = self._hooks[kind]
        if hooks:
            event = ManagerEvent(kind, request_id, None if pages is None else pages.copy(), detail)
            self._queued.extend((fn, event) for fn in hooks)

    def _kv_event(self, event: KVEvent) -> None:
        self._events.append(event)
        self._emit("kv_event", detail=event)

    def _flush_hooks(self) -> None:
        queued, self._queued = self._queued, []
        errors: list[tuple[ManagerEvent, BaseException]] = []
        for fn, event in queued:
            try:
                fn(event)
            except Exception as e:  # every hook runs; the first error is raised below
                logger.exception("kvmem hook %r raised on %s", fn, event.kind)
                errors.append((event, e))
        if errors:
            event, first = errors[0]
            raise HookError(
                f"{len(errors)} hook call(s) raised; the first, on {event.kind!r} "
                f"(request {event.request_id!r}), raised {first!r}. The operation itself "
                "completed and the manager is consistent; fix or remove the hook."
            ) from first

    def add_hook(self, kind: str, fn: Callable[[ManagerEvent], Any]) -> None:
        """Call ``fn(event)`` after every operation that produces an event of ``kind``."""
        if kind not in self._hooks:
            raise KVMemError(f"no hook kind {kind!r}; choose one of {HOOK_KINDS}")
        self._hooks[kind].append(fn)

    def remove_hook(self, kind: str, fn: Callable[[ManagerEvent], Any]) -> None:
        if kind not in self._hooks or fn not in self._hooks[kind]:
            raise KVMemError(f"{fn!r} is not registered for {kind!r}")
        self._hooks[kind].remove(fn)

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call (only recorded with ``kv_events=True``)."""
        events, self._events = self._events, []
        return events

    # -- page references -----------------------------------------------------------------------

    def _available(self) -> int:
        """Pages that allocation can obtain now: free ones plus evictable cached ones."""
        return self.allocator.num_free + (self.cache.num_evictable if self.cache else 0)

    def _make_room(self, num: int) -> None:
        """Evict cached pages until ``num`` are free (the caller checked that they can be).

        An eviction has a fixed cost (a few dozen numpy calls), so in a big pool it takes up to
        ``num_pages / 512`` more of the least recently used pages than it must: the next
        allocations then find them free. (Pools under 512 pages evict exactly what they need.)
        """
        short = num - self.allocator.num_free
        if short <= 0:
            return
        assert self.cache is not None
        ahead = min(self._evict_ahead, self.cache.num_evictable - short)
        pages, keys = self.cache.evict(short + max(ahead, 0))
        self._page_ns[pages] = -1
        self._num_evictions += pages.size
        self._emit("evict", pages=pages)
        self._emit("free", pages=pages)
        if self.config.kv_events:
            self._kv_event(PagesRemoved(tuple(_keys_as_ints(keys))))

    def _allocate(self, num: int, namespace_ids: Int64Array | int) -> Int32Array:
        self._make_room(num)
        pages = self.allocator.allocate(num)
        self._page_ns[pages] = namespace_ids
        return pages

    def _drop(self, pages: Int32Array) -> None:
        """Drop one reference per listed page: now, or when the steps in flight retire."""
        if pages.size == 0:
            return
        if self.fences.in_flight:
            self.fences.defer(pages)
        else:
            self._free(pages)

    def _forget_freed(self, pages: Int32Array) -> None:
        """After the cache dropped its references: pages now free lose their namespace."""
        freed = pages[self.allocator.refcounts[pages] == 0]
        self._page_ns[freed] = -1
        if freed.size:
            self._emit("free", pages=freed)

    def _free(self, pages: Int32Array, runs: list[Int32Array] | None = None) -> None:
        """Drop one reference per listed page now; ``runs``: ``pages`` is their concatenation,
        one run per holder, released in that order (the cache's LRU order follows)."""
        freed = self.allocator.free(pages)
        self._page_ns[freed] = -1
        if self.cache is not None:
            if runs is None:
                self.cache.released(pages)
            else:
                self.cache.released_many(runs)
        if freed.size:
            self._emit("free", pages=freed)

    # -- admission -----------------------------------------------------------------------------

    def _plan(self, tokens: Int64Array, namespace: Any, register: bool
              ) -> tuple[int, int, PrefixMatch | None]:
        """(pages the prompt needs, namespace id, prefix match); raises if it can never fit."""
        n = tokens.size
        if n == 0:
            raise KVMemError("a request needs at least one prompt token; got none")
        num_pages = -(-n // self.page_size)
        if num_pages > self.max_pages_per_seq:
            raise KVMemError(
                f"a prompt of {n} tokens needs {num_pages} pages but a request may map at most "
                f"max_pages_per_seq={self.max_pages_per_seq}; shorten it or raise the limit"
            )
        ns = self._namespace_id(namespace, register)
        match = None
        if self.cache is not None:
            # At most (n - 1) // P pages: the last prompt token is always computed (it yields
            # the first logits), and it must land in a page the request holds alone.
            match = self.cache.match(tokens, namespace, (n - 1) // self.page_size, ns)
        return num_pages, ns, match

    def can_admit(self, token_ids: Any, namespace: Any = None) -> bool:
        """Whether ``admit(…, token_ids, namespace)`` would succeed now and leave the
        watermark's pages free. Counts the prefix pages the request would reuse. Changes
        nothing."""
        tokens = self._as_tokens(token_ids)
        num_pages, _, match = self._plan(tokens, namespace, register=False)
        # admit() right after (nothing changed in between) reuses this plan instead of
        # matching the prompt a second time.
        self._plan_memo = (self._mutations, namespace, tokens, num_pages, match)
        return self._fits(num_pages, match, self.watermark_pages)

    def _planned(self, tokens: Int64Array, namespace: Any
                 ) -> tuple[int, int, PrefixMatch | None]:
        memo = self._plan_memo
        if memo is not None:
            self._plan_memo = None
            # The counter moved once: for the admit() being run now.
            if (memo[0] == self._mutations - 1 and memo[1] == namespace
                    and (memo[2] is tokens or (memo[2].size == tokens.size
                                               and equal_arrays(memo[2], tokens)))):
                return memo[3], self._namespace_id(namespace, register=True), memo[4]
        return self._plan(tokens, namespace, register=True)

    def _fits(self, num_pages: int, match: PrefixMatch | None, reserve: int) -> bool:
        if self.table.num_free_rows == 0:
            return False
        hits = match.num_pages if match is not None else 0
        lost = match.num_evictable if match is not None else 0  # hits stop being evictable
        return num_pages - hits + reserve <= self._available() - lost

    @_public
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
        KVMemError: duplicate id, no free row, prompt too long or empty (nothing changed)
        """
        if request_id in self._requests:
            raise KVMemError(
                f"request {request_id!r} is already known to the manager; release it first or "
                "use a new id"
            )
        memo = self._plan_memo
        if (memo is not None and isinstance(token_ids, np.ndarray)
                and memo[0] == self._mutations - 1 and memo[2].shape == token_ids.shape
                and equal_arrays(memo[2], token_ids)):
            tokens = memo[2]  # the prompt can_admit() just validated and copied
        else:
            tokens = self._as_tokens(token_ids)
        return self._admit(request_id, tokens, namespace, tokens)

    def _admit(self, request_id: Any, tokens: Int64Array, namespace: Any,
               prompt: Int64Array) -> AdmitResult:
        num_pages, ns, match = self._planned(tokens, namespace)
        if self.table.num_free_rows == 0:
            raise KVMemError(
                f"all max_seqs={self.max_seqs} rows are mapped; release or preempt a request "
                "before admitting another"
            )
        if not self._fits(num_pages, match, 0):
            hits = match.num_pages if match is not None else 0
            raise OutOfPagesError(num_pages - hits, self._available()
                                  - (match.num_evictable if match is not None else 0))
        hit_pages = match.pages if match is not None else _EMPTY_PAGES
        if hit_pages.size:
            # A match lists distinct pages (one per prefix position).
            self.allocator.share_distinct(hit_pages)
            assert self.cache is not None
            self.cache.acquired(hit_pages)
        new = self._allocate(num_pages - hit_pages.size, ns)
        pages = np.concatenate([hit_pages, new]) if hit_pages.size else new
        num_cached = hit_pages.size * self.page_size
        row = self.table.open_row(pages, num_cached)
        self._touch_row(row)
        self._committed[row] = self._write_from[row] = num_cached
        self._row_ns[row] = ns
        if match is not None:
            self._row_key[row] = match.last_key
            self._num_prefix_queries += 1
            self._prefix_query_tokens += tokens.size
            self._prefix_hit_tokens += num_cached
        if self.tracker.enabled:
            self._record_row(row, pages, ns)
        self._rows[request_id] = row
        self._row_ids[row] = request_id
        self._requests[request_id] = _Request(namespace, ns, prompt)
        self._emit("allocate", request_id, new)
        self._emit("admit", request_id, pages, detail=num_cached)
        return AdmitResult(request_id, num_cached, int(prompt.size), num_pages,
                           int(hit_pages.size))

    # -- the step --------------------------------------------------------------------------------

    def can_reserve(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]) -> bool:
        """Whether ``reserve(request_ids, num_tokens)`` would find enough pages now."""
        rows = self._rows_of(tuple(request_ids))
        n = self._num_new(num_tokens, rows.size)
        need = self.table.pages_needed(rows, n)
        if (self.table.num_pages[rows] + need > self.max_pages_per_seq).any():
            return False
        cow = self._cow_candidates(rows, n)
        return int(need.sum()) + (0 if cow is None else cow[0].size) <= self._available()

    @staticmethod
    def _num_new(num_tokens: int | Sequence[int], size: int) -> Int64Array:
        n = np.asarray(num_tokens, dtype=np.int64)
        if n.ndim == 0:
            n = np.full(size, int(n), dtype=np.int64)
        if n.shape != (size,):
            raise KVMemError(
                f"num_tokens must be an int or one per request ({size}), got shape {n.shape}"
            )
        if size and int(n.min()) < 0:
            raise KVMemError(f"num_tokens must be >= 0, got {n[n < 0].tolist()[:8]}")
        return n

    def _cow_candidates(self, rows: IntpArray, n: Int64Array | int
                        ) -> tuple[IntpArray, Int64Array, Int32Array] | None:
        """Rows whose next write lands in a shared, partly filled page: (rows, columns, pages).

        Only a fork shares a partly filled page (cached prefix pages are full, and a prompt's
        last token always lands in a page of its own), so only rows marked at a fork are looked
        at; the decode step of a batch without forks pays one check.
        """
        if not self._num_forked:
            return None
        forked = self._forked[rows] & (np.asarray(n) > 0)
        if not forked.any():
            return None
        r = rows[forked]
        tok = self.table.num_tokens[r]
        partial = tok % self.page_size != 0
        r, cols = r[partial], tok[partial] // self.page_size
        pages = self.table.pages[r, cols]
        holders = self._writers(pages)
        shared = holders > 1
        if not shared.any():
            return None
        r, cols, pages, holders = r[shared], cols[shared], pages[shared], holders[shared]
        # When every holder of a page writes into it this step, the first keeps it.
        _, first, count = np.unique(pages, return_index=True, return_counts=True)
        whole = first[count == holders[first]]
        if whole.size:
            keep = np.ones(pages.size, dtype=bool)
            keep[whole] = False
            r, cols, pages = r[keep], cols[keep], pages[keep]
        return (r, cols, pages) if pages.size else None

    def _writers(self, pages: npt.NDArray[np.integer]) -> Int64Array:
        """Holders that may read or write these pages' future slots: requests and the cache.

        A step fence holds a dropped reference only so the page is not reused while a launched
        step reads its existing slots; a copy-on-write source is held only until the engine
        copied it. Neither reads a slot that a request is about to write.
        """
        holders = self.allocator.refcounts[pages]
        if self.fences.holds_any:
            holders = holders - self.fences.held[pages]
        if self._copy_hold:
            held = np.bincount(np.concatenate(self._copy_hold), minlength=self.num_pages)
            holders = holders - held[pages]
        return holders

    @_public
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
        KVMemError: a request is not running or would exceed max_pages_per_seq
        """
        ids = request_ids if type(request_ids) is tuple else tuple(request_ids)
        rows = self._rows_of(ids)
        known = self._batch is not None and rows is self._batch.rows  # checked when reserved
        if not known:
            rows.flags.writeable = False  # the next steps reuse it
        if isinstance(num_tokens, (int, np.integer)):
            k = int(num_tokens)
            if k < 0:
                raise KVMemError(f"num_tokens must be >= 0, got {k}")
            if k <= self.page_size and not self._num_forked and not self._copy_hold:
                if not known:
                    self._require_distinct_rows(rows, "reserved")
                return self._reserve_small(ids, rows, k)
            return self._reserve_any(ids, rows, k, known)
        return self._reserve_any(ids, rows, self._num_new(num_tokens, rows.size), known)

    def _reserve_small(self, ids: tuple[Any, ...], rows: IntpArray, k: int) -> StepMetadata:
        """Every row gains ``k <= page_size`` tokens (decode, short speculation), so at most one
        page, and no row writes into a page a fork shares: a constant number of numpy calls."""
        P = self.page_size
        tbl = self.table
        rows_w, rows32 = self._row_arrays(rows)
        start = tbl.num_tokens[rows]
        end = start + k
        cap = tbl.num_pages[rows]
        grow = (end > cap * P).nonzero()[0]
        if grow.size:
            cols = cap[grow]
            if np.maximum.reduce(cols) >= self.max_pages_per_seq:
                self._too_long(ids, grow[cols >= self.max_pages_per_seq])
            n = grow.size
            if n > self.allocator.num_free:
                if n > self._available():
                    raise OutOfPagesError(n, self._available())
                self._make_room(n)
            new = self.allocator.allocate(n)
            at = rows_w[grow] + cols  # (row, column) of each new page, flat
            self._flat_pages[at] = new
            grow_rows = rows[grow]
            tbl.num_pages[grow_rows] = cols + 1
            ns = self._row_ns[grow_rows]
            new_i = new.astype(np.intp)
            self._page_ns[new_i] = ns
            if self._expected_flat is not None:  # CheckingTracker: record in place
                self._expected_flat[at] = self._expected(new_i, ns)
            elif self.tracker.enabled:
                self._record(grow_rows, cols, self._expected(new_i, ns), appended=True)
            if self._hooks["allocate"]:
                self._emit("allocate", pages=new)
        tbl.num_tokens[rows] = end
        self._write_from[rows] = start
        token_pages = offset = col = None
        if k == 1:
            col = start // P
            offset = start - col * P
            token_pages = self._flat_pages[rows_w + col]
            slots = np.multiply(token_pages, P, dtype=np.int64)
            slots += offset
            counts = col + 1
            last_len = np.add(offset, 1, dtype=np.int32)
        else:
            positions = (start[:, None] + self._arange[:k]).reshape(-1)
            slots = tbl.slot_mapping(np.repeat(rows, k), positions)
            counts = (end + (P - 1)) // P
            last_len = ((end - 1) % P + 1).astype(np.int32)
        gens = self._row_gen[rows]
        indptr, indices, splice = self._build_csr(rows, rows_w, gens, counts)
        num_new, qo_indptr = self._step_counts(rows.size, k)
        step = StepMetadata(
            ids, rows32, num_new, slots.copy(), qo_indptr, indptr.copy(), indices.copy(),
            last_len, end.astype(np.int32), _EMPTY_PAGES, _EMPTY_PAGES, P, self._epoch,
        )
        self._remember(_Batch(ids, rows, rows32, rows_w, gens, counts, indptr, indices,
                              self._epoch, step, start, end, k, slots, token_pages, offset, col,
                              splice=splice))
        self._take_changes()
        return step

    def _row_arrays(self, rows: IntpArray) -> tuple[Int64Array, Int32Array]:
        """``rows * max_pages_per_seq`` (flat index of each row's column 0) and the rows as a
        read-only int32 array (StepMetadata.rows); the latest reserve's when it is the batch."""
        b = self._batch
        if b is not None and rows is b.rows:
            return b.rows_w, b.rows32
        rows32 = rows.astype(np.int32)
        rows32.flags.writeable = False
        return rows * self.max_pages_per_seq, rows32

    def _reserve_any(self, ids: tuple[Any, ...], rows: IntpArray, n: Int64Array | int,
                     known: bool) -> StepMetadata:
        """The general step: per-row counts, long chunks, copy-on-write of forked tails."""
        P = self.page_size
        k = n if isinstance(n, int) else -1
        mapped = self.table.num_pages[rows]
        need = np.maximum((self.table.num_tokens[rows] + (n + P - 1)) // P - mapped, 0)
        too_long = mapped + need > self.max_pages_per_seq
        if np.count_nonzero(too_long):
            self._too_long(ids, np.flatnonzero(too_long))
        cow = self._cow_candidates(rows, n)
        total = int(need.sum()) + (0 if cow is None else cow[0].size)
        held = np.concatenate(self._copy_hold) if self._copy_hold else None
        if not known:
            self._require_distinct_rows(rows, "reserved")
        if total > self.allocator.num_free or cow is not None or held is not None:
            # This path mutates before grow() validates: validate everything here.
            if total > self._available():
                raise OutOfPagesError(total, self._available())
            if held is not None:  # the engine has done last step's copies by now
                self._copy_hold = []
                self._drop(held)
            self._make_room(total)
        copy_src = copy_dst = _EMPTY_PAGES
        if cow is not None:
            copy_src, copy_dst = self._copy_on_write(*cow)
        if total == 0:  # the rows map the pages already (an admitted prompt's prefill chunks)
            start = self.table.num_tokens[rows]
            seq_lens = start + n
            self.table.num_tokens[rows] = seq_lens
            grown = GrowResult(self.table.token_slots(rows, start, n), _EMPTY_PAGES,
                               rows[:0], _EMPTY_PAGES)
        else:
            grown = self.table.grow(rows, n, self.allocator)
            seq_lens = self.table.num_tokens[rows]
            start = seq_lens - n
        if self._num_forked:
            self._num_forked -= int(np.count_nonzero(self._forked[rows]))
            self._forked[rows] = False  # every write into a shared tail was just handled
        self._write_from[rows] = start
        if grown.new_pages.size:
            ns = self._row_ns[grown.new_page_rows]
            self._page_ns[grown.new_pages] = ns
            if self.tracker.enabled:
                self._record(grown.new_page_rows, grown.new_page_positions,
                             self._expected(grown.new_pages, ns), appended=True)
            self._emit("allocate", pages=grown.new_pages)
        counts = (seq_lens + (P - 1)) // P
        rows_w, rows32 = self._row_arrays(rows)
        gens = self._row_gen[rows]
        indptr, indices, splice = self._build_csr(rows, rows_w, gens, counts)
        if k >= 0:
            num_new, qo_indptr = self._step_counts(rows.size, k)
        else:
            num_new = np.asarray(n).astype(np.int32)
            qo_indptr = np.zeros(rows.size + 1, dtype=np.int32)
            np.cumsum(n, out=qo_indptr[1:])
        last_len = ((seq_lens - 1) % P + 1).astype(np.int32)
        step = StepMetadata(
            ids, rows32, num_new, grown.slot_mapping, qo_indptr, indptr.copy(), indices.copy(),
            last_len, seq_lens.astype(np.int32), copy_src, copy_dst, P, self._epoch,
        )
        self._remember(_Batch(ids, rows, rows32, rows_w, gens, counts, indptr, indices,
                              self._epoch, step, start, seq_lens, k, splice=splice))
        self._take_changes()
        return step

    def _remember(self, batch: _Batch) -> None:
        self._batch = batch
        bases = self._bases
        bases.pop(batch.rows.size, None)
        bases[batch.rows.size] = batch
        if len(bases) > 4:
            del bases[next(iter(bases))]  # the least recently reserved size

    def _too_long(self, ids: tuple[Any, ...], where: npt.NDArray[np.integer]) -> None:
        raise KVMemError(
            f"requests {[ids[i] for i in where[:8].tolist()]} would need more than "
            f"max_pages_per_seq={self.max_pages_per_seq} pages; finish them or raise the limit "
            "(nothing was reserved)"
        )

    def _step_counts(self, size: int, k: int) -> tuple[Int32Array, Int32Array]:
        """``num_new_tokens`` ``[size]`` (all ``k``) and ``qo_indptr`` ``[size + 1]``
        (``0, k, 2k, ...``), int32: fresh copies of cached arrays."""
        got = self._qo_cache.get((size, k))
        if got is None:
            got = (np.full(size, k, dtype=np.int32),
                   np.multiply(self._arange[: size + 1], k, dtype=np.int32))
            if k > self.page_size:  # a prefill chunk's length: rarely seen twice
                return got
            if len(self._qo_cache) > 64:
                self._qo_cache.clear()
            self._qo_cache[(size, k)] = got
        return got[0].copy(), got[1].copy()

    def _build_csr(self, rows: IntpArray, rows_w: Int64Array, gens: Int64Array,
                   counts: Int64Array) -> tuple[Int32Array, Int32Array, _Splice | None]:
        """FlashInfer ``kv_indptr``, ``kv_indices`` over each row's first ``counts`` pages.

        When the previous reserve of a batch this size had, at the same position, the same row
        with nothing but appends since (same generation), the row keeps its previous entries:
        the new ``kv_indices`` is the old one cut at the few rows that changed (grew, or hold
        another request), with their new pages (contiguous in the page table) spliced in, in one
        concatenation (returned as a :class:`_Splice`, with a snapshot of the spliced-in pages
        and of the tags the tracker expects of them). Otherwise one masked gather of the page
        table (and no splice).
        """
        size = rows.size
        indptr = np.zeros(size + 1, dtype=np.int32)
        np.add.accumulate(counts, out=indptr[1:], dtype=np.int32)
        if size == 1:  # one request (a prefill chunk): a slice of its row
            at = int(rows_w[0])
            return indptr, self._flat_pages[at : at + int(counts[0])].copy(), None
        c = self._bases.get(size)
        if c is not None and size:
            if rows is c.rows and c.epoch == self._epoch:  # the same requests, only appends
                changed = (counts != c.counts).nonzero()[0]
                first = c.counts[changed]
            else:
                kept = gens == c.gens
                first = c.counts * kept  # entries the row keeps
                changed = ((counts != first) | ~kept).nonzero()[0]
                first = first[changed]
            fresh = counts[changed] - first
            if changed.size <= _MAX_SPLICES and not np.count_nonzero(fresh < 0):
                c.splice = None  # (a batch keeps only its own splice, not a chain of them)
                if not changed.size:
                    return indptr, c.indices, _Splice(c, _EMPTY_PAGES, _EMPTY_TAGS, [])
                old = c.indices
                flat = self._flat_pages
                expected = self._expected_flat
                parts: list[Int32Array] = []
                pages: list[Int32Array] = []  # the entries spliced in ...
                wants: list[Int64Array] = []  # ... and the tags the tracker expects of them
                gone: list[Int32Array] = []  # the entries cut out
                at = 0
                for cut, resume, src, num in zip(
                        (c.indptr[changed] + first).tolist(), c.indptr[changed + 1].tolist(),
                        (rows_w[changed] + first).tolist(), fresh.tolist()):
                    piece = flat[src : src + num]
                    parts.append(old[at:cut])
                    parts.append(piece)
                    pages.append(piece)
                    if expected is not None:
                        wants.append(expected[src : src + num])
                    if resume > cut:
                        gone.append(old[cut:resume])
                    at = resume
                parts.append(old[at:])
                indices = np.concatenate(parts)
                return indptr, indices, _Splice(
                    c, np.concatenate(pages), np.concatenate(wants) if wants else _EMPTY_TAGS,
                    gone)
        width = int(counts.max()) if size else 0
        mask = self._arange[:width] < counts[:, None]
        return indptr, self.table.pages[rows, :width][mask], None

    def _record(self, rows: npt.ArrayLike, positions: npt.ArrayLike, tags: Int64Array,
                appended: bool = False) -> None:
        """Every tracker write goes through here (or _record_row). Recording at positions a
        row already mapped (not ``appended`` past them) changes what a previous verify proved
        about the row: the row is touched, so the next verify checks it in full."""
        if not appended:
            self._touch_row(np.asarray(rows, dtype=np.int64))
        self.tracker.record(rows, positions, tags)

    def _record_row(self, row: int, pages: Int32Array, ns: int) -> None:
        """The tracker records a new row's pages (a CheckingTracker's row is written at once)."""
        self._touch_row(row)
        if type(self.tracker) is CheckingTracker:
            self.tracker.expected_tags[row, : pages.size] = self._expected(pages, ns)
        else:
            self.tracker.record(np.full(pages.size, row), np.arange(pages.size),
                                self._expected(pages, ns))

    def _expected(self, pages: npt.NDArray[np.integer], namespace_ids: Int64Array | int
                  ) -> Int64Array:
        """The namespace-qualified tag a request records for pages it maps: ``[k]``, int64."""
        return (self.allocator.tags[pages] << _NS_BITS) | namespace_ids

    def _take_changes(self) -> None:
        """Hand the allocator's log of pages whose tag changed to those that follow it: the
        pool's tag mirror (kept current) and the verified snapshot (checked at next verify)."""
        log = self.allocator.take_changed()
        if not log:
            return
        if self.pool is not None:
            changed = np.unique(np.concatenate(log))
            tags = self.allocator.tags[changed]
            qtags = np.where(tags == 0, 0,
                             (tags << _NS_BITS) | np.maximum(self._page_ns[changed], 0))
            self._qtags[changed] = qtags
            self.pool.update_tags(changed, qtags)
        if self._verified is not None:
            self._verified_dirty.extend(log)
            if len(self._verified_dirty) > 1024:  # nobody verifies: stop following
                self._forget_verified()

    def _sync_tags(self) -> Int64Array:
        """The qualified tag of every page (0 when free); with a pool, also its mirror."""
        self._take_changes()
        if self.pool is not None:
            return self._qtags
        tags = self.allocator.tags
        return np.where(tags == 0, 0, (tags << _NS_BITS) | np.maximum(self._page_ns, 0))

    def _copy_on_write(self, rows: IntpArray, cols: Int64Array, old: Int32Array
                       ) -> tuple[Int32Array, Int32Array]:
        ns = self._page_ns[old]
        new = self._allocate(old.size, ns)
        self.table.pages[rows, cols] = new
        self._touch_row(rows)
        self._page_tokens[new] = self._page_tokens[old]
        if self.tracker.enabled:
            self._record(rows, cols, self._expected(new, ns))
        self._num_cow_copies += old.size
        self._emit("allocate", pages=new)
        if self.pool is not None:
            self.pool.copy_pages(old, new)
            self._drop(old)
            return _EMPTY_PAGES, _EMPTY_PAGES
        self._copy_hold.append(old)  # the engine copies before writing; keep the source alive
        return old.copy(), new

    @_public
    def commit(self, request_id: Any, token_ids: Any) -> None:
        """Record that the KV of these tokens (the request's next reserved slots) is written.

        Pages that became full are offered to the prefix cache (a page is reusable only once
        all its tokens are committed). Raises, changing nothing, if more tokens are committed
        than were reserved.

        Parameters
        ----------
        token_ids: ``[k]`` ints — the tokens whose K/V the engine wrote, in order
        """
        row = self._row_of(request_id)
        tokens = self._as_tokens(token_ids)
        self._commit(np.array([row], dtype=np.intp), np.array([tokens.size], dtype=np.int64),
                     tokens, (request_id,))

    @_public
    def commit_batch(self, request_ids: Sequence[Any], token_ids: Any) -> None:
        """:meth:`commit` for a batch in one vectorized call.

        Parameters
        ----------
        request_ids: ``[B]`` distinct running requests
        token_ids: ``[B]`` ints (one token each: the decode step), ``[B, k]`` ints, or a list of
            ``B`` 1-D int sequences (ragged)
        """
        ids = request_ids if type(request_ids) is tuple else tuple(request_ids)
        rows = self._rows_of(ids)
        b = self._batch
        known = b is not None and rows is b.rows
        if isinstance(token_ids, np.ndarray) and token_ids.ndim in (1, 2) and (
            token_ids.shape[0] == rows.size
        ):
            if token_ids.dtype.kind not in "iu":
                raise KVMemError(f"token ids must be ints, got {token_ids.dtype}")
            flat = token_ids.reshape(-1)
            if flat.size and (int(flat.min()) < 0 or (
                    flat.dtype.itemsize > 4 and int(flat.max()) > _INT32_MAX)):
                raise KVMemError(f"token ids must be in 0..{_INT32_MAX} (nothing was committed)")
            k = 1 if token_ids.ndim == 1 else token_ids.shape[1]
            counts: Int64Array | int = k
            if (known and k == 1 and b is not None and b.k == 1 and b.token_pages is not None
                    and b.start is not None and equal_arrays(self._committed[rows], b.start)):
                self._commit_decode(b, flat)  # exactly the tokens the latest reserve handed out
                return
        else:
            if len(token_ids) != rows.size:
                raise KVMemError(
                    f"commit_batch got {len(token_ids)} token lists for {rows.size} requests"
                )
            parts = [self._as_tokens(t) for t in token_ids]
            counts = np.array([p.size for p in parts], dtype=np.int64)
            flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        if len(ids) > 1 and not known:
            try:
                self._require_distinct_rows(rows, "committed")
            except ValueError as e:
                raise KVMemError(str(e)) from None
        self._commit(rows, counts, flat, ids)

    def _commit_decode(self, b: _Batch, tokens: npt.NDArray[np.integer]) -> None:
        """commit_batch of the latest reserve's batch, one token each, nothing committed since."""
        assert b.end is not None and b.token_pages is not None and b.slots is not None
        self._page_tokens_flat[b.slots] = tokens
        rows = b.rows
        self._committed[rows] = b.end
        b.uncommitted = False
        if self.cache is not None:
            assert b.offsets is not None and b.cols is not None
            full = (b.offsets == self.page_size - 1).nonzero()[0]  # pages that just filled
            if full.size:
                self._offer(rows[full], b.cols[full], None, b.token_pages[full])

    def _commit(self, rows: IntpArray, counts: Int64Array | int, flat: npt.NDArray[np.integer],
                ids: Sequence[Any]) -> None:
        """Write committed tokens into their pages' token slots; offer pages that filled up."""
        start = self._committed[rows]
        end = start + counts
        over = end > self.table.num_tokens[rows]
        if np.count_nonzero(over):
            i = int(np.argmax(over))
            num = counts if isinstance(counts, int) else int(counts[i])
            raise KVMemError(
                f"request {ids[i]!r} commits {num} tokens after {int(start[i])} but only "
                f"{int(self.table.num_tokens[rows[i]])} slots are reserved; reserve() them first "
                "(nothing was committed)"
            )
        if isinstance(counts, int) and counts == 1:  # the decode step: one token per request
            slots = self.table.slot_mapping(rows, start)
        else:
            slots = self.table.token_slots(rows, start, counts)
        self._page_tokens_flat[slots] = flat
        self._committed[rows] = end
        if self._batch is not None:
            self._batch.uncommitted = False
        if self.cache is not None:
            first = start // self.page_size
            full = end // self.page_size - first  # pages that just became full
            some = full.nonzero()[0]
            if some.size:
                self._offer(rows[some], first[some], full[some])

    def _offer(self, rows: IntpArray, first: Int64Array, counts: Int64Array | None,
               pages: Int32Array | None = None) -> None:
        """Give newly full pages (runs of ``counts`` pages from column ``first``; one page each
        when ``counts`` is None, then ``pages`` may name them) to the cache."""
        assert self.cache is not None
        last: Int64Array | None = None  # run ends (None: one page per run)
        if counts is None:  # one page per row: the decode step
            rep, cols, starts = rows, first, self._arange[: rows.size]
            counts = self._ones[: rows.size]
            if pages is None:
                pages = self.table.pages[rows, first]
        else:
            total = int(counts.sum())
            starts = np.cumsum(counts) - counts
            cols = np.repeat(first, counts) + np.arange(total) - np.repeat(starts, counts)
            rep = np.repeat(rows, counts)
            pages = self.table.pages[rep, cols]
            last = starts + counts - 1
        tokens = self._page_tokens[pages]
        parent = self._row_key[rows]
        keys = self.cache.page_keys(parent, counts, first, tokens)
        inserted = self.cache.insert(keys, pages, tokens, self._row_ns[rep])
        self._row_key[rows] = keys if last is None else keys[last]
        if self.config.kv_events and inserted.size:
            parents = np.empty_like(keys)
            parents[1:] = keys[:-1]
            parents[starts] = parent
            is_new = np.isin(pages, inserted)
            for r, s, c in zip(rows.tolist(), starts.tolist(), counts.tolist()):
                sel = np.flatnonzero(is_new[s : s + c]) + s
                if sel.size:
                    at_root = int(cols[sel[0]]) == 0
                    self._kv_event(PagesStored(
                        tuple(_keys_as_ints(keys[sel])),
                        None if at_root else _keys_as_ints(parents[sel[:1]])[0],
                        tuple(tokens[sel].reshape(-1).tolist()), self.page_size,
                        self._requests[self._row_ids[r]].namespace,
                    ))

    # -- integrity ---------------------------------------------------------------------------------

    @_public
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
        ``kv_indices`` (the CSR tensors alone); ``step`` (the arrays ``reserve`` returned);
        none (fresh CSR from the page table). Failing requests are released, counted, sent to
        the ``integrity_failure`` hook and listed in ``report.aborted``.

        numpy metadata that is correct is proven so incrementally: entries equal to those the
        previous verify proved (same request, same batch position) are compared with its copy,
        and their pages must not have changed lifetime since; every other entry is checked in
        full. Anything else, or any doubt, runs the detailed check.
        """
        if not self.tracker.enabled:
            return VerifyReport(tuple(request_ids))
        ids = request_ids if type(request_ids) is tuple else tuple(request_ids)
        rows = self._rows_of(ids)
        current = None  # the latest reserve's step, nothing committed since
        meta: Mapping[str, Any] | None = None  # the step's metadata, for the slot checks
        if metadata is not None:
            if step is not None or kv_indptr is not None or kv_indices is not None:
                raise KVMemError("verify() takes metadata= alone, without step or kv_indptr/"
                                 "kv_indices")
            has_csr = {"kv_indptr", "kv_indices"} <= set(metadata)
            if "slot_mapping" not in metadata or not (has_csr or "block_table" in metadata):
                raise KVMemError(
                    f"verify(metadata=...) got {sorted(metadata)}; it needs slot_mapping and "
                    "either kv_indptr + kv_indices or block_table (the names of "
                    "step.tensors(device))")
            meta = metadata
            indptr, indices = (metadata["kv_indptr"], metadata["kv_indices"]) if has_csr else (
                None, None)
        elif kv_indptr is not None or kv_indices is not None:
            if kv_indptr is None or kv_indices is None:
                raise KVMemError("verify() needs both kv_indptr and kv_indices, or neither")
            indptr, indices = kv_indptr, kv_indices
        elif step is not None:
            if step.batch_size != rows.size:
                raise KVMemError(
                    f"verify() got {rows.size} requests but a step of {step.batch_size}; pass the "
                    "ids the step was reserved for"
                )
            indptr, indices = step.kv_indptr, step.kv_indices
            meta = _step_fields(step)
            b = self._batch
            if b is not None and step is b.step and rows is b.rows and b.uncommitted:
                current = step
        else:
            csr = self.table.csr(rows)
            indptr, indices = csr.kv_indptr, csr.kv_indices
        expected_tags = getattr(self.tracker, "expected_tags", None)
        if expected_tags is not None and isinstance(indices, np.ndarray) and isinstance(
                indptr, np.ndarray):
            if current is not None and self._verify_spliced(indptr, indices):
                return VerifyReport(ids)
            if self._verify_fast(rows, indptr, indices, current, expected_tags, meta):
                return VerifyReport(ids)
        self._forget_verified()
        return self._verify_detailed(ids, rows, indptr, indices, meta)

    def _forget_verified(self) -> None:
        if self._verified is not None:
            self._verified = None
            self._verified_refs.fill(0)
        self._verified_dirty = []

    def _verify_spliced(self, indptr: npt.NDArray[np.integer], indices: npt.NDArray[np.integer]
                        ) -> bool:
        """verify() of the latest reserve's own step, when the previous verify proved the CSR
        that reserve spliced this one from (the decode loop): True only if the detailed check
        would find nothing (False: the caller looks closer, from scratch).

        ::

            unchanged   the arrays equal reserve's private copies: every kept entry is the
                        proven one, at the same place
            kept        no page the proven CSR still lists changed tag since (_verified_refs)
            fresh       each entry reserve spliced in is in range and its live qualified tag
                        equals the one recorded for (row, position) when it was spliced in
                        (never 0: unrecorded)
            writes      the slot mapping sends each token into the page the CSR lists for
                        it, at its offset; every page about to be written has one writer
            lengths     seq_lens, kv_last_page_len, num_new_tokens, qo_indptr are the
                        manager's
        """
        b = self._batch
        assert b is not None
        s = b.splice
        v = self._verified
        if s is None or v is None or s.base.indices is not v.indices or (
                self._expected_flat is None):
            return False
        if not (equal_arrays(indptr, b.indptr) and equal_arrays(indices, b.indices)
                and self._step_ok(b)):
            return False
        if self._spliced_entries_ok(s):
            self._verified = _Verified(b.rows, b.gens, b.counts, b.indptr.astype(np.int64),
                                       b.indices)
            return True
        self._forget_verified()  # the refcounts were half updated: start over
        return False

    def _step_ok(self, b: _Batch) -> bool:
        """The batch's step gives the kernel the manager's lengths (:meth:`_length_mismatches`)
        and writes every token into the page its CSR lists for it, at its offset
        (:meth:`_slot_mismatches`), and every page it writes has exactly one writer. For a
        one-token step in a few calls: its arrays equal reserve's (the step counts: the cached
        originals), and each token lands in the last page its row lists."""
        step = b.step
        assert step is not None
        counts = self._qo_cache.get((b.rows.size, b.k))
        if b.k != 1 or b.token_pages is None or b.slots is None or b.offsets is None or (
                b.end is None or counts is None):
            return self._writes_ok(b.rows, step, _step_fields(step))
        return (equal_arrays(step.slot_mapping, b.slots)
                and equal_arrays(b.indices[b.indptr[1:] - 1], b.token_pages)
                and equal_arrays(step.seq_lens, b.end)
                and equal_arrays(step.kv_last_page_len, b.offsets + 1)
                and equal_arrays(step.num_new_tokens, counts[0])
                and equal_arrays(step.qo_indptr, counts[1])
                and not np.count_nonzero(self._writers(b.token_pages) != 1))

    def _spliced_entries_ok(self, s: _Splice) -> bool:
        """The kept and fresh checks of :meth:`_verify_spliced` (updates _verified_refs)."""
        self._take_changes()
        return self._kept_pages_unchanged(s.gone) and self._fresh_ok(s.pages, s.wants)

    def _kept_pages_unchanged(self, gone: list[Int32Array]) -> bool:
        """Take the entries ``gone`` out of ``_verified_refs``; then no page the proven entries
        still list may be in the log of pages whose tag changed since the last verify."""
        refs = self._verified_refs
        if gone:  # (a page listed twice in one scatter counts once: errs high, still safe)
            refs[np.concatenate(gone) if len(gone) > 1 else gone[0]] -= 1
        dirty = self._verified_dirty
        self._verified_dirty = []
        return not (dirty and np.count_nonzero(
            refs[np.concatenate(dirty) if len(dirty) > 1 else dirty[0]]))

    def _fresh_ok(self, pages: npt.NDArray[np.integer], want: Int64Array) -> bool:
        """Entries checked in full: in range, live qualified tag == the recorded one (never 0:
        unrecorded); then counted in ``_verified_refs``."""
        if not pages.size:
            return True
        pages = pages.astype(np.intp)
        if int(pages.min()) < 0 or int(pages.max()) >= self.num_pages:
            return False
        live = self.allocator.tags[pages] << _NS_BITS
        live |= self._page_ns[pages]
        if not equal_arrays(live, want) or np.count_nonzero(want) != want.size:
            return False
        self._count_refs(pages)
        return True

    def _verify_fast(self, rows: IntpArray, indptr: npt.NDArray[np.integer],
                     indices: npt.NDArray[np.integer], step: StepMetadata | None,
                     expected_tags: Int64Array, meta: Mapping[str, Any] | None) -> bool:
        """True only if the detailed check would find nothing (False: look closer).

        ::

            lengths     each row lists ceil(num_tokens / page_size) pages (counts from indptr)
            kept        a row at the same batch position as in the snapshot, same generation
                        (same request, only appended since): its first snapshot-count entries
                        equal the snapshot's (the arrays cut at the rows that changed, and the
                        pieces compared at once), and no page the snapshot lists changed tag
                        since, except in rows that left (_verified_refs)
            new         every other entry: in range, and its live qualified tag equals the one
                        recorded for (row, position) (never 0: 0 means unrecorded)
            write set   every page about to be written has exactly one writer
            slots       (given the step's metadata) its slot mapping sends each token into
                        the page the CSR lists for it, at its offset, and its lengths are the
                        manager's (_slot_mismatches, _length_mismatches)
        """
        P = self.page_size
        size = rows.size
        if indptr.shape != (size + 1,) or indices.ndim != 1 or indptr[0] != 0 or (
                indptr[-1] != indices.size):
            return False
        counts = indptr[1:] - indptr[:-1]
        need = self.table.num_tokens[rows] + (P - 1)
        need //= P
        if not np.array_equal(counts, need) or not self._writes_ok(rows, step, meta):
            return False
        gens = self._row_gen[rows]
        self._take_changes()
        v = self._verified
        changed: npt.NDArray[np.intp] = np.empty(0, dtype=np.intp)
        if v is not None:
            kept = gens == v.gens if v.rows.size == size else None
            if kept is not None:
                first = np.where(kept, v.counts, 0)  # entries each row keeps from the snapshot
                changed = ((counts != first) | ~kept).nonzero()[0]
            if kept is None or changed.size > _MAX_SPLICES:  # another batch: start over
                self._forget_verified()
                v = None
        if v is None:  # nothing proven yet: every entry is new
            pages = indices
            want = expected_tags[np.repeat(rows, counts),
                                 np.arange(indices.size) - np.repeat(indptr[:-1], counts)]
            proven = indices.astype(np.int32)
        else:
            first = first[changed]
            if (counts[changed] < first).any():
                return False
            # Per changed row: where its kept entries end and it ends, in the new and in the
            # proven arrays; its row; the positions of its new entries.
            cut_new = indptr[changed] + first
            cut_old = v.indptr[changed] + first
            spec = zip(cut_new.tolist(), indptr[changed + 1].tolist(), cut_old.tolist(),
                       v.indptr[changed + 1].tolist(), rows[changed].tolist(), first.tolist(),
                       counts[changed].tolist())
            old = v.indices
            parts: list[npt.NDArray[np.integer]] = []  # proven kept runs, then new entries
            fresh: list[npt.NDArray[np.integer]] = []
            wants: list[Int64Array] = []
            gone: list[Int32Array] = []
            at = 0
            for new_at, end_new, old_at, end_old, row, lo, hi in spec:
                parts.append(old[at:old_at])
                piece = indices[new_at:end_new]
                parts.append(piece)
                fresh.append(piece)
                wants.append(expected_tags[row, lo:hi])
                if end_old > old_at:
                    gone.append(old[old_at:end_old])
                at = end_old
            parts.append(old[at:])
            proven = np.concatenate(parts) if len(parts) > 1 else old
            # The kept runs sit where the new entries' rows say (counts were checked above), so
            # one comparison proves every kept entry equal to the one proven before.
            if not np.array_equal(proven, indices):
                return False
            if not self._kept_pages_unchanged(gone):
                return False
            pages = np.concatenate(fresh) if len(fresh) > 1 else (fresh[0] if fresh
                                                                   else _EMPTY_PAGES)
            want = np.concatenate(wants) if len(wants) > 1 else (wants[0] if wants
                                                                 else _EMPTY_TAGS)
        if not self._fresh_ok(pages, want):
            return False
        b = self._batch
        if step is not None and b is not None and step is b.step and (
                proven is b.indices or np.array_equal(proven, b.indices)):
            proven = b.indices  # the next reserve splices from it: see _verify_spliced
        self._verified = _Verified(rows, gens, counts, indptr.astype(np.int64), proven)
        return True

    def _count_refs(self, pages: npt.NDArray[np.integer]) -> None:
        """``_verified_refs[p] += 1`` once per listing of ``p`` (never fewer: a count that is
        too low could hide a changed page; one too high only costs a detailed check)."""
        refs = self._verified_refs
        if pages.size <= 64:  # (add.at is the cheaper of the two up to here)
            np.add.at(refs, pages, 1)
            return
        if pages.size > 4096:
            refs += np.bincount(pages, minlength=self.num_pages).astype(np.int32)
            return
        index = self._arange_pages[: pages.size] if pages.size <= self._arange_pages.size else (
            np.arange(pages.size))
        self._page_stamp[pages] = index
        if equal_arrays(self._page_stamp[pages], index):  # distinct: a plain scatter
            refs[pages] += 1
        else:
            np.add.at(refs, pages, 1)

    def _writes_ok(self, rows: IntpArray, step: StepMetadata | None,
                   meta: Mapping[str, Any] | None) -> bool:
        """Every page the step writes has exactly one writer (:meth:`_write_set_ok`) and, given
        the step's metadata, its slots and lengths are the manager's (:meth:`_slot_mismatches`,
        :meth:`_length_mismatches`)."""
        return self._write_set_ok(rows, step) and (meta is None or not (
            self._slot_mismatches(rows, meta)[0].size or self._length_mismatches(rows, meta).size))

    def _write_set_ok(self, rows: IntpArray, step: StepMetadata | None) -> bool:
        """Every page the step writes (``step``: its slot mapping; otherwise the slots reserved
        and not committed yet) has exactly one writer."""
        pages: npt.NDArray[np.integer]
        if step is not None:
            pages = step.slot_mapping // self.page_size
            if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
                return False
        else:
            pages = self._write_set(rows)[2]
        return not np.count_nonzero(self._writers(pages) != 1)

    def _write_set(self, rows: IntpArray) -> tuple[Int64Array, Int64Array, Int32Array]:
        """Tokens the latest reserve() handed out and nobody committed yet: (batch index, page
        position, page) of each."""
        start = np.maximum(self._committed[rows], self._write_from[rows])
        todo = self.table.num_tokens[rows] - start
        wb = np.repeat(np.arange(rows.size), todo)
        wpos = _ranges(start, todo) // self.page_size
        return wb, wpos, self.table.pages[rows[wb], wpos]

    def _slot_mismatches(self, rows: IntpArray, meta: Mapping[str, Any]
                         ) -> tuple[IntpArray, Int64Array]:
        """The step's tokens whose slot (``meta["slot_mapping"]``) is not in the page its CSR
        (``meta["kv_indptr"]``, ``meta["kv_indices"]``) or else its block table
        (``meta["block_table"]``) lists for them, at their offset (the kernel that stores K/V
        reads the slot mapping: BUGS 12): (batch index, page position) of each. A row's tokens
        are the latest reserve's, ``[write_from, num_tokens)``, in batch order; slots past them
        must be -1 (padding). numpy arrays or torch tensors (compared on their device)."""
        P = self.page_size
        start = self._write_from[rows]
        count = self.table.num_tokens[rows] - start
        batch = np.repeat(np.arange(rows.size), count)
        tokens = _ranges(start, count)
        positions = tokens // P
        slots = meta["slot_mapping"]
        if "kv_indices" in meta:  # CSR: a token's page is at indptr[b] + position
            table, indptr = meta["kv_indices"], meta["kv_indptr"]
            if tuple(indptr.shape) != (rows.size + 1,) or len(table.shape) != 1:
                return batch, positions  # not this batch's metadata: every token is suspect
        else:  # a block table: at [b, position]
            table, indptr = meta["block_table"], None
            if len(table.shape) != 2 or table.shape[0] != rows.size:
                return batch, positions
        if len(slots.shape) != 1 or slots.shape[0] < batch.size or not table.shape[0]:
            return batch, positions
        # One computation for numpy arrays and for tensors (on their device): ``here`` puts a
        # host array (or a cast) where the metadata lives.
        here: Any = np.asarray
        where: Any = np.where
        wide: Any = np.int64
        if not isinstance(slots, np.ndarray):
            import torch

            here = functools.partial(torch.as_tensor, device=slots.device)
            where, wide = torch.where, torch.int64
        b, pos = here(batch), here(positions)
        if indptr is None:
            listed = pos < table.shape[1]
            pages = here(table[b, where(listed, pos, 0)], dtype=wide)
            listed &= pages != PAD
        else:
            ip = here(indptr, dtype=wide)
            at = ip[b] + pos
            listed = (at < ip[b + 1]) & (at < table.shape[0])
            pages = here(table[where(listed, at, 0)], dtype=wide)
        bad = ~listed | (pages * P + here(tokens % P) != here(slots[: batch.size], dtype=wide))
        if not isinstance(bad, np.ndarray):
            bad = bad.cpu().numpy()
        padded = bool((slots[batch.size :] != -1).any())
        if padded:  # a padding slot writes somewhere: every token is suspect
            return batch, positions
        return batch[bad], positions[bad]

    def _length_mismatches(self, rows: IntpArray, meta: Mapping[str, Any]) -> IntpArray:
        """Batch indices of the requests whose metadata gives the kernel other lengths than
        the manager's (those of ``meta``'s fields that are there): ``seq_lens`` and
        ``kv_last_page_len`` (a last page said longer than it is reads slots no token of the
        request wrote: a previous holder's KV), ``num_new_tokens`` and ``qo_indptr`` (the
        latest reserve's new tokens, ``num_tokens - write_from``). numpy arrays or torch
        tensors (compared on their device)."""
        total = self.table.num_tokens[rows]
        new = total - self._write_from[rows]
        want = {"seq_lens": total, "kv_last_page_len": (total - 1) % self.page_size + 1,
                "num_new_tokens": new}
        qo = meta.get("qo_indptr")
        got = [(meta[name], value) for name, value in want.items() if meta.get(name) is not None]
        if qo is not None:
            if tuple(qo.shape) != (rows.size + 1,) or int(qo[0]) != 0:
                return np.arange(rows.size)  # not this batch's metadata
            got.append((qo[1:] - qo[:-1], new))
        if any(tuple(g.shape) != rows.shape for g, _ in got):
            return np.arange(rows.size)
        bad = np.zeros(rows.size, dtype=bool)
        for g, value in got:
            if isinstance(g, np.ndarray):
                bad |= g != value
            else:  # a tensor: compared on its device
                import torch

                bad |= (g.long() != torch.as_tensor(value, device=g.device)).cpu().numpy()
        return bad.nonzero()[0]

    def _verify_detailed(self, ids: tuple[Any, ...], rows: IntpArray, indptr: Any,
                         indices: Any, meta: Mapping[str, Any] | None = None) -> VerifyReport:
        """The tracker's check of every entry, then the write set and (given the step's
        metadata ``meta``) its slot mapping and lengths; aborts the failing requests with a
        reason each."""
        qtags = self._sync_tags()
        num_pages = (self.table.num_tokens[rows] + self.page_size - 1) // self.page_size
        wb, wpos, wpages = self._write_set(rows)
        holders = self._writers(wpages)
        tags: Any = qtags
        read = indices if indices is not None else meta["block_table"] if meta else None
        if read is not None and not isinstance(read, np.ndarray):  # tensors: on their device
            import torch

            tags = (self.pool.tags if self.pool is not None
                    else torch.as_tensor(qtags, device=read.device))
        if indices is None:  # a block table (metadata=): the tracker checks it, padding too
            assert meta is not None
            report = self.tracker.verify(rows, num_pages, tags, block_table=meta["block_table"],
                                         ids=ids)
        else:
            report = self.tracker.verify(rows, num_pages, tags, kv_indptr=indptr,
                                         kv_indices=indices, ids=ids)
        first_bad: dict[int, int] = {}  # batch index -> first bad page position
        reasons: dict[int, str] = {}
        if not report.ok:
            e = report.entries
            for k in np.argsort(e.position, kind="stable").tolist():
                i = int(e.batch_index[k])
                if i not in reasons:
                    reasons[i] = self._describe(e, k, int(np.count_nonzero(e.batch_index == i)))
                    first_bad[i] = max(int(e.position[k]), 0)
        for k in np.flatnonzero(holders != 1).tolist():
            i, pos = int(wb[k]), int(wpos[k])
            reasons.setdefault(i, f"page {int(wpages[k])} at position {pos} is about to be written "
                                  f"but has {int(holders[k])} holders (a shared page is written "
                                  "only after copy-on-write)")
            first_bad[i] = min(first_bad.get(i, pos), pos)
        if meta is not None:
            first_new = self._write_from[rows] // self.page_size
            for i in self._length_mismatches(rows, meta).tolist():
                reasons.setdefault(i, "its step's lengths (seq_lens, kv_last_page_len, "
                                      "num_new_tokens or qo_indptr) are not its own: a kernel "
                                      "would read past its tokens or another request's queries")
                first_bad[i] = min(first_bad.get(i, int(first_new[i])), int(first_new[i]))
            for i, pos in zip(*(a.tolist() for a in self._slot_mismatches(rows, meta))):
                reasons.setdefault(i, f"its slot mapping sends a token of page position {pos} "
                                      "outside the page its metadata lists there (another "
                                      "request's page, or the wrong slot)")
                first_bad[i] = min(first_bad.get(i, pos), pos)
        aborted: dict[Any, str] = {}
        for i in sorted(reasons):
            aborted[ids[i]] = reasons[i]
            self._abort(ids[i], first_bad[i], reasons[i])
        return VerifyReport(ids, aborted, None if report.ok else report)

    @staticmethod
    def _describe(e: Any, k: int, num_bad: int) -> str:
        """One readable line for bad entry ``k`` (qualified tags decoded)."""
        reason, pos, page = int(e.reason[k]), int(e.position[k]), int(e.page[k])
        expected, found = int(e.expected_tag[k]), int(e.found_tag[k])
        mask = (1 << _NS_BITS) - 1
        more = f" ({num_bad} bad entries)" if num_bad > 1 else ""
        if reason == Reason.REALLOCATED and expected >> _NS_BITS == found >> _NS_BITS:
            what = (f"page holds namespace {found & mask}'s content, the request is in "
                    f"namespace {expected & mask}")
        elif reason == Reason.LENGTH:
            return f"{Reason.NAMES[reason]}{more}"
        else:
            what = Reason.NAMES.get(reason, f"reason {reason}")
            if expected > 0 and found > 0:
                what += f" (expected tag {expected >> _NS_BITS}, found {found >> _NS_BITS})"
        return f"{what}: position {pos}, page {page}{more}"

    def _abort(self, request_id: Any, first_bad: int, reason: str) -> None:
        row = self._rows[request_id]
        self._num_integrity_failures += 1
        logger.warning("kvmem: aborting request %r: %s", request_id, reason)
        owned = self._owned_pages(row)
        if self.cache is not None:
            stale = self.cache.stale()  # entries whose page was freed behind everyone's back
            if stale.size:
                keys = self.cache.forget(stale)
                if self.config.kv_events:
                    self._kv_event(PagesRemoved(tuple(_keys_as_ints(keys))))
            # Pages after the bad one may hold KV computed from a corrupted context: never offer
            # them to later requests (requests that already hold them keep them).
            later = owned[owned[:, 0] > first_bad, 1].astype(np.int32)
            removed, keys = self.cache.remove(later)
            self._forget_freed(removed)
            if removed.size and self.config.kv_events:
                self._kv_event(PagesRemoved(tuple(_keys_as_ints(keys))))
        self._emit("integrity_failure", request_id, detail=reason)
        self._release_row(request_id, owned[:, 1].astype(np.int32))
        del self._requests[request_id]

    def _owned_pages(self, row: int) -> Int64Array:
        """(position, page) of each reference a failing row really holds: ``[k, 2]``, int64.

        A row entry whose page no longer carries the recorded tag is not this request's
        reference: the page was freed (maybe reallocated) behind its back, or the entry was
        overwritten. In the last case the recorded page is found by its (unique) tag.
        """
        pages = self.table.row_pages(row).astype(np.int64)
        positions = np.arange(pages.size)
        expected = getattr(self.tracker, "expected_tags", None)
        if expected is None:
            live = (pages >= 0) & (pages < self.num_pages)
            live[live] = self.allocator.refcounts[pages[live]] > 0
            return np.stack([positions[live], pages[live]], axis=1)
        want = expected[row, : pages.size]
        qtags = self._sync_tags()
        ok = (pages >= 0) & (pages < self.num_pages)
        ok[ok] = (qtags[pages[ok]] >> _NS_BITS) == (want[ok] >> _NS_BITS)
        ok &= want > 0
        out = [np.stack([positions[ok], pages[ok]], axis=1)]
        for j in np.flatnonzero(~ok & (want > 0)).tolist():
            found = np.flatnonzero((qtags >> _NS_BITS) == (int(want[j]) >> _NS_BITS))
            if found.size == 1:
                out.append(np.array([[j, int(found[0])]], dtype=np.int64))
        return np.concatenate(out)

    # -- fork, preempt, resume, release ---------------------------------------------------------

    @_public
    def fork(self, parent_id: Any, child_id: Any) -> None:
        """Start ``child_id`` as a copy of running ``parent_id`` (parallel sampling, beams).

        The child shares every page that holds tokens (a shared, partly filled tail is copied on
        the first write into it) and gets its own pages for the parent's reserved room.
        """
        prow = self._row_of(parent_id)
        if child_id in self._requests:
            raise KVMemError(f"request {child_id!r} is already known; fork into a new id")
        if self.table.num_free_rows == 0:
            raise KVMemError(
                f"all max_seqs={self.max_seqs} rows are mapped; release a request before forking"
            )
        ntok = int(self.table.num_tokens[prow])
        used = -(-ntok // self.page_size)
        total = int(self.table.num_pages[prow])
        if total - used > self._available():
            raise OutOfPagesError(total - used, self._available())
        shared = self.table.pages[prow, :used].copy()
        self.allocator.share(shared)
        ns = int(self._row_ns[prow])
        own = self._allocate(total - used, ns)
        pages = np.concatenate([shared, own])
        row = self.table.add_row()
        self._touch_row(row)
        self.table.map_pages(row, pages)
        self.table.set_num_tokens(row, ntok)
        self._committed[row] = self._committed[prow]
        # A fork happens between steps: what the parent reserved is written by now.
        self._write_from[[prow, row]] = ntok
        self._row_ns[row] = ns
        self._row_key[row] = self._row_key[prow]
        if self.tracker.enabled:
            self._record_row(row, pages, ns)
        parent = self._requests[parent_id]
        self._rows[child_id] = row
        self._row_ids[row] = child_id
        self._requests[child_id] = _Request(parent.namespace, parent.namespace_id, parent.prompt)
        self._num_forks += 1
        if ntok % self.page_size:  # both now write into one partly filled page: copy-on-write
            self._num_forked += int(not self._forked[prow]) + int(not self._forked[row])
            self._forked[[prow, row]] = True
        if own.size:
            self._emit("allocate", child_id, own)
        self._emit("fork", child_id, pages, detail=parent_id)

    def _release_row(self, request_id: Any, owned: Int32Array | None = None) -> Int32Array:
        pages = self._close_row(request_id)
        if owned is not None:
            pages = owned
        self._drop(pages)
        return pages

    def _close_row(self, request_id: Any) -> Int32Array:
        """Unmap a running request's row; returns the pages it mapped (references to drop)."""
        row = self._rows.pop(request_id)
        self._touch_row(row)
        self._row_ids[row] = None
        if self._forked[row]:
            self._forked[row] = False
            self._num_forked -= 1
        if self.tracker.enabled:
            self.tracker.forget([row])
        self._committed[row] = 0
        return self.table.remove_row(row)

    def _tokens_of(self, row: int) -> Int64Array:
        committed = int(self._committed[row])
        slots = self.table.token_slots([row], [0], [committed])
        return self._page_tokens.reshape(-1)[slots].astype(np.int64)

    @_public
    def preempt(self, request_id: Any) -> None:
        """Release a running request's pages, keeping its tokens so it can be resumed by
        recomputation (``resume``). Its committed full pages stay in the prefix cache, so a
        resume usually finds most of them."""
        row = self._row_of(request_id)
        req = self._requests[request_id]
        done = self._tokens_of(row)
        req.saved = np.concatenate([done, req.prompt[done.size :]])
        pages = self._release_row(request_id)
        self._num_preemptions += 1
        self._emit("preempt", request_id, pages)

    def can_resume(self, request_id: Any) -> bool:
        req = self._requests.get(request_id)
        if req is None or req.saved is None:
            raise KVMemError(f"request {request_id!r} is not preempted")
        num_pages, _, match = self._plan(req.saved, req.namespace, register=False)
        return self._fits(num_pages, match, self.watermark_pages)

    @_public
    def resume(self, request_id: Any, token_ids: Any = None) -> AdmitResult:
        """Re-admit a preempted request with its saved tokens (committed tokens, then the rest
        of the prompt), or with ``token_ids`` if given. Recompute from ``num_cached_tokens``."""
        req = self._requests.get(request_id)
        if req is None or req.saved is None:
            raise KVMemError(
                f"request {request_id!r} is not preempted; only a preempted request can resume"
            )
        tokens = req.saved if token_ids is None else self._as_tokens(token_ids)
        del self._requests[request_id]
        try:
            # What must be recomputed is the request's prompt from now on.
            return self._admit(request_id, tokens, req.namespace, tokens)
        except BaseException:
            self._requests[request_id] = req
            raise

    @_public
    def release(self, request_id: Any) -> None:
        """Forget a request (finished or cancelled), running or preempted; drop its pages."""
        if request_id not in self._requests:
            raise KVMemError(f"request {request_id!r} is unknown or already released")
        pages = None
        if request_id in self._rows:
            pages = self._release_row(request_id)
        del self._requests[request_id]
        self._emit("release", request_id, pages)

    @_public
    def release_batch(self, request_ids: Sequence[Any]) -> None:
        """:meth:`release` for several requests at once (a step's finished requests): one free
        and one cache update for all their pages. The same result as releasing them one by one
        in order; all or nothing (an unknown or repeated id raises, releasing none).
        """
        ids = request_ids if type(request_ids) is tuple else tuple(request_ids)
        unknown = [rid for rid in ids if rid not in self._requests]
        if unknown:
            raise KVMemError(f"requests {unknown[:8]!r} are unknown or already released "
                             "(nothing was released)")
        self._require_distinct(ids, "released")
        running = [rid for rid in ids if rid in self._rows]
        runs = [self._close_row(rid) for rid in running]
        if runs and self.fences.in_flight:
            for pages in runs:
                self._drop(pages)
        elif runs:
            self._free(np.concatenate(runs), runs)
        owned = dict(zip(running, runs))
        for rid in ids:
            del self._requests[rid]
            self._emit("release", rid, owned.get(rid))

    # -- fences --------------------------------------------------------------------------------

    @_public
    def begin_step(self) -> StepHandle:
        """Mark a step as launched: page references dropped from now on are held until
        ``retire(handle)``."""
        handle = self.fences.begin()
        self._emit("step_begin", detail=handle.step_id)
        return handle

    @_public
    def retire(self, handle: StepHandle) -> None:
        """The device finished the step: free the references that waited only for it."""
        pages = self.fences.retire(handle)
        if pages.size:
            self._free(pages)
        self._emit("step_end", pages=pages, detail=handle.step_id)

    # -- queries -------------------------------------------------------------------------------

    @property
    def running(self) -> tuple[Any, ...]:
        return tuple(self._rows)

    @property
    def preempted(self) -> tuple[Any, ...]:
        return tuple(r for r in self._requests if r not in self._rows)

    def num_tokens(self, request_id: Any) -> int:
        """Token slots handed out to a running request (cached + reserved)."""
        return int(self.table.num_tokens[self._row_of(request_id)])

    def num_committed(self, request_id: Any) -> int:
        return int(self._committed[self._row_of(request_id)])

    def pages_of(self, request_id: Any) -> Int32Array:
        """Pages a running request maps, in order: ``[k]``, int32 (a copy)."""
        return self.table.row_pages(self._row_of(request_id)).copy()

    def namespace_of_page(self, page: int) -> Any:
        """The namespace whose content a live page holds (None's id is 0)."""
        ns = int(self._page_ns[page])
        if ns < 0:
            raise KVMemError(f"page {page} is free")
        for name, i in self._ns_ids.items():
            if i == ns:
                return name
        raise KVMemError(f"page {page} has an unknown namespace id {ns}")

    def _cached_mask(self) -> npt.NDArray[np.bool_]:
        if self.cache is None:
            return np.zeros(self.num_pages, dtype=bool)
        return self.cache.is_cached(np.arange(self.num_pages, dtype=np.int32))

    def _held(self) -> Int64Array:
        """References held per page by fences and by copy-on-write sources awaiting a copy."""
        held = self.fences.held.astype(np.int64)
        if self._copy_hold:
            held = held + np.bincount(np.concatenate(self._copy_hold), minlength=self.num_pages)
        return held

    def _page_classes(self) -> tuple[npt.NDArray[np.bool_], ...]:
        rc = self.allocator.refcounts
        cached = self._cached_mask()
        held = self._held()
        used = rc - held - cached > 0
        in_cache = ~used & cached
        fenced = ~used & ~cached & (held > 0)
        return used, in_cache, fenced

    def stats(self) -> ManagerStats:
        """A frozen snapshot (costs a few numpy passes over the pages)."""
        used, cached, fenced = self._page_classes()
        return ManagerStats(
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_free=self.allocator.num_free,
            num_used=int(used.sum()),
            num_cached=int(cached.sum()),
            num_fenced=int(fenced.sum()),
            num_running=len(self._rows),
            num_preempted=len(self._requests) - len(self._rows),
            num_prefix_queries=self._num_prefix_queries,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            num_evictions=self._num_evictions,
            num_preemptions=self._num_preemptions,
            num_integrity_failures=self._num_integrity_failures,
            num_cow_copies=self._num_cow_copies,
            num_forks=self._num_forks,
            steps_in_flight=len(self.fences.open_steps),
        )

    def check(self) -> None:
        """Verify every bookkeeping invariant; raise IntegrityError listing each problem.

        Allocator invariants; each page's refcount equals its holders (request rows + the cache
        + fences); free + used + cached + fenced == total; every page a request maps holds its
        namespace's content; committed <= reserved <= mapped slots; the cache's own invariants.
        """
        problems: list[str] = []
        try:
            self.allocator.check()
        except IntegrityError as e:
            problems.append(str(e))
        rows = np.array(sorted(self._rows.values()), dtype=np.int32)
        mapped = (np.concatenate([self.table.row_pages(r) for r in rows.tolist()])
                  if rows.size else np.empty(0, dtype=np.int32))
        holders = np.bincount(mapped, minlength=self.num_pages)[: self.num_pages]
        cached = self._cached_mask()
        holders = holders + cached + self._held()
        bad = np.flatnonzero(holders != self.allocator.refcounts)
        if bad.size:
            problems.append(
                f"refcounts {self.allocator.refcounts[bad].tolist()[:8]} of pages "
                f"{bad.tolist()[:8]} differ from their holders {holders[bad].tolist()[:8]}"
            )
        used, in_cache, fenced = self._page_classes()
        total = self.allocator.num_free + int(used.sum() + in_cache.sum() + fenced.sum())
        if total != self.num_pages:
            problems.append(f"free + used + cached + fenced = {total} != {self.num_pages} pages")
        for rid, row in self._rows.items():
            pages = self.table.row_pages(row)
            foreign = pages[self._page_ns[pages] != self._row_ns[row]]
            if foreign.size:
                problems.append(f"request {rid!r} maps pages {foreign.tolist()[:8]} of another "
                                "namespace")
            if not (self._committed[row] <= self.table.num_tokens[row]
                    <= self.table.num_pages[row] * self.page_size):
                problems.append(f"request {rid!r}: committed {self._committed[row]} > reserved "
                                f"{self.table.num_tokens[row]} or beyond its pages")
        if self.cache is not None:
            cpages = np.flatnonzero(cached)
            if hasattr(self.cache, "namespaces_of"):
                wrong = cpages[self.cache.namespaces_of(cpages) != self._page_ns[cpages]]
                if wrong.size:
                    problems.append(f"cached pages {wrong.tolist()[:8]} disagree on namespace")
            if hasattr(self.cache, "check"):
                problems.extend(self.cache.check())
        if problems:
            raise IntegrityError("KVCacheManager.check() failed: " + "; ".join(problems))

    @_public
    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix (pages no request maps return to the free list)."""
        if self.cache is None:
            return 0
        pages = self.cache.clear()
        self._forget_freed(pages)
        if self.config.kv_events:
            self._kv_event(AllPagesCleared())
        return int(pages.size)

    def __repr__(self) -> str:
        return (f"KVCacheManager(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"running={len(self._rows)}, free={self.allocator.num_free})")
