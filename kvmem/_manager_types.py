"""The manager's results, events and configuration (frozen snapshots and small records), and
the guard every public operation runs under (:func:`public`).

:class:`~kvmem.manager.KVCacheManager` returns these; they are importable from
``kvmem.manager``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from kvmem._validate import INT32_MAX, integer
from kvmem.allocator import HashedPrefixCache, Pages, PrefixCache, StepMetadata, page_classes
from kvmem.errors import ArgumentError, ArgumentTypeError, ConcurrentUseError, HookError
from kvmem.integrity import IntegrityReport, Tracker, VerifierStats, tracker_for

if TYPE_CHECKING:
    from kvmem.transfer import OffloadStats

__all__ = [
    "HOOK_KINDS",
    "AdmitResult",
    "AllPagesCleared",
    "HookError",
    "KVEvent",
    "ManagerConfig",
    "ManagerEvent",
    "ManagerStats",
    "PagesRemoved",
    "PagesStored",
    "StepMetadata",
    "VerifierStats",
    "VerifyReport",
    "check_pool",
    "make_cache",
    "make_tracker",
    "public",
]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]

HOOK_KINDS = (
    "admit",  # a request was admitted or resumed: request_id, pages (all it maps), detail
    "allocate",  # pages were allocated: request_id (None for a batch), pages
    "free",  # pages returned to the allocator: pages
    "evict",  # cached pages were evicted to make room: pages
    "preempt",  # a request was preempted: request_id, pages (references dropped)
    "release",  # a request was released (finished or aborted): request_id, pages
    "fork",  # request_id (the child), detail (the parent)
    "step_begin",  # a step was launched: detail (the step id)
    "step_end",  # a step retired: detail (the step id), pages (references it released)
    "integrity_failure",  # a request failed verification and was aborted: request_id, detail
    "kv_event",  # a KV event for routers: event (PagesStored / PagesRemoved / AllPagesCleared)
    "offload_drop",  # a tier dropped pages it was given (no room, a failing write or store):
    # detail (medium, number of pages)
)


# -- the guard of every public operation --------------------------------------------------------


_F = TypeVar("_F", bound=Callable[..., Any])


def public(fn: _F) -> _F:
    """A public operation of a :class:`~kvmem.manager.KVCacheManager` (its ``_lock``, ``_hooks``
    and ``_mutations``): one thread at a time (re-entry from the same thread, e.g. a hook,
    is allowed); hooks it queued run once it completed (dropped if it raised: an operation
    that raises has changed nothing)."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"{fn.__name__}() was called while another thread is inside this manager; a "
                "KVCacheManager is used by one thread at a time (hold a lock of your own around "
                "it). Nothing changed."
            )
        try:
            self._mutations += 1  # invalidates can_admit()'s remembered plan
            try:
                result = fn(self, *args, **kwargs)
            except BaseException:
                self._hooks.discard()
                raise
            if self._hooks.pending:
                try:
                    self._hooks.flush()
                except HookError as e:
                    e.result = result  # what the operation, which stands, returned
                    raise
            return result
        finally:
            self._lock.release()

    return wrapper  # type: ignore[return-value]


# -- boundary and results -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """The numeric configuration of a :class:`KVCacheManager` (validated by :meth:`make`)."""

    num_pages: int
    page_size: int
    max_seqs: int
    max_pages_per_seq: int
    watermark: float
    kv_events: bool
    evict_ahead: int  # extra pages an eviction takes (num_pages // 512 unless given)

    @classmethod
    def make(cls, num_pages: Any, page_size: Any, max_seqs: Any, max_pages_per_seq: Any,
             watermark: Any, kv_events: Any, evict_ahead: Any = None) -> ManagerConfig:
        """Check every argument (ArgumentError / ArgumentTypeError naming it)."""
        n = integer(num_pages, "num_pages", minimum=1, maximum=INT32_MAX)
        if max_pages_per_seq is None:
            max_pages_per_seq = min(n, 2048)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float, np.floating)):
            raise ArgumentTypeError(f"watermark must be a float in [0, 1), got {watermark!r}")
        if not 0.0 <= float(watermark) < 1.0:
            raise ArgumentError(f"watermark must be in [0, 1), got {watermark!r}")
        if not isinstance(kv_events, (bool, np.bool_)):
            raise ArgumentTypeError(f"kv_events must be a bool, got {kv_events!r}")
        ahead = n >> 9 if evict_ahead is None else integer(evict_ahead, "evict_ahead",
                                                            minimum=0, maximum=n)
        return cls(n, integer(page_size, "page_size", minimum=1, maximum=1 << 16),
                   integer(max_seqs, "max_seqs", minimum=1, maximum=1 << 24),
                   integer(max_pages_per_seq, "max_pages_per_seq", minimum=1, maximum=INT32_MAX),
                   float(watermark), bool(kv_events), ahead)


class AdmitResult(NamedTuple):
    """What :meth:`KVCacheManager.admit` did.

    num_cached_tokens: prompt tokens whose KV is already in mapped pages (skip their prefill)
    num_prompt_tokens: the prompt's length
    num_pages: pages mapped (the whole prompt's)
    num_hit_pages: how many of them came from the prefix cache
    num_host_pages: how many came from the host tier (loaded into fresh pages, after the hits)
    num_disk_pages: how many came from the disk tier (after the host's)
    loading: the loads have not landed (``OffloadConfig(copies="deferred")``): the request is
        not ready before ``land_copies`` reports it
    """

    request_id: Any
    num_cached_tokens: int
    num_prompt_tokens: int
    num_pages: int
    num_hit_pages: int
    num_host_pages: int = 0
    num_disk_pages: int = 0
    loading: bool = False


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`KVCacheManager.verify`.

    request_ids: the batch verified, in order
    aborted: ``{request_id: reason}`` for every request that failed (now released)
    integrity: the tracker's report (bad entries), when it found any
    """

    request_ids: tuple[Any, ...] = ()
    aborted: dict[Any, str] = field(default_factory=dict)
    integrity: IntegrityReport | None = None

    @property
    def ok(self) -> bool:
        return not self.aborted

    @property
    def keep(self) -> npt.NDArray[np.bool_]:
        """``[B]``, bool — which requests of the batch may proceed."""
        return np.array([i not in self.aborted for i in self.request_ids], dtype=bool)

    @property
    def ok_ids(self) -> tuple[Any, ...]:
        return tuple(i for i in self.request_ids if i not in self.aborted)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A snapshot of the manager; it does not change when the manager does.

    Every page is in exactly one of: free, used (mapped by a request), cached (remembered by
    the prefix cache, no request maps it: evictable, or held by a fence too), fenced (held only
    by a step fence until that step retires). ``num_free + num_used + num_cached + num_fenced ==
    num_pages``.
    """

    num_pages: int
    page_size: int
    num_free: int
    num_used: int
    num_cached: int
    num_fenced: int  # held only by step fences (or by copy-on-write sources awaiting a copy)
    num_running: int
    num_preempted: int
    num_prefix_queries: int  # admissions (and resumes) that looked up the prefix cache
    prefix_query_tokens: int
    prefix_hit_tokens: int  # found on the device (host-tier loads: ``offload.loaded_pages``)
    num_evictions: int  # pages evicted from the prefix cache
    num_preemptions: int
    num_integrity_failures: int
    num_cow_copies: int
    num_forks: int
    steps_in_flight: int
    offload: OffloadStats | None = None  # the host tier's and its loads' counts (None: no tier)

    @classmethod
    def of(cls, pages: Pages, counters: dict[str, int], num_running: int, num_preempted: int,
           num_cow_copies: int, offload: OffloadStats | None = None) -> ManagerStats:
        """A snapshot of a manager's pages (a few numpy passes over them) and counters."""
        used, cached, fenced = page_classes(pages)
        c = counters
        return cls(
            num_pages=pages.num_pages, page_size=pages.page_size,
            num_free=pages.allocator.num_free, num_used=int(used.sum()),
            num_cached=int(cached.sum()), num_fenced=int(fenced.sum()),
            num_running=num_running, num_preempted=num_preempted,
            num_prefix_queries=c["prefix_queries"], prefix_query_tokens=c["prefix_query_tokens"],
            prefix_hit_tokens=c["prefix_hit_tokens"], num_evictions=pages.num_evictions,
            num_preemptions=c["preemptions"], num_integrity_failures=c["integrity_failures"],
            num_cow_copies=num_cow_copies, num_forks=c["forks"],
            steps_in_flight=len(pages.fences.open_steps), offload=offload,
        )

    @property
    def usage(self) -> float:
        """Fraction of pages mapped by requests (cached and fenced pages are reclaimable)."""
        return self.num_used / self.num_pages

    @property
    def prefix_hit_rate(self) -> float:
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


@dataclass(frozen=True, slots=True)
class ManagerEvent:
    """What a hook receives: ``kind`` (one of :data:`HOOK_KINDS`) and what it concerns."""

    kind: str
    request_id: Any = None
    pages: Int32Array | None = None
    detail: Any = None


# KV events in the shape vLLM publishes (BlockStored / BlockRemoved / AllBlocksCleared), so a
# cache-aware router can follow which prefixes this manager holds. Hashes are 128-bit ints.


@dataclass(frozen=True, slots=True)
class PagesStored:
    page_hashes: tuple[int, ...]
    parent_page_hash: int | None  # the page before the first one (None at the prompt's start)
    token_ids: tuple[int, ...]  # len(page_hashes) * page_size tokens
    page_size: int
    namespace: Any
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    page_hashes: tuple[int, ...]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllPagesCleared:
    medium: str = "GPU"


KVEvent = PagesStored | PagesRemoved | AllPagesCleared


# -- the constructor's other arguments -----------------------------------------------------------


def make_cache(spec: str | PrefixCache | None) -> PrefixCache | None:
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec != "hashed":
            raise ArgumentError(f"prefix_cache={spec!r} is not known; use 'hashed', None, or a "
                                "PrefixCache")
        return HashedPrefixCache()
    if not isinstance(spec, PrefixCache):
        raise ArgumentError(
            f"prefix_cache must be 'hashed', None or a PrefixCache, got {type(spec).__name__}"
        )
    return spec


def make_tracker(spec: Tracker | str | None, cfg: ManagerConfig) -> Tracker:
    """The manager's tracker (``kvmem.integrity.tracker_for``)."""
    return tracker_for(spec, cfg.max_seqs, cfg.max_pages_per_seq)


def check_pool(pool: Any, cfg: ManagerConfig) -> None:
    """A pool must hold the manager's pages: the same page count and page size."""
    if pool is None:
        return
    spec = getattr(pool, "spec", None)
    n = getattr(spec, "num_pages", None)
    size = getattr(spec, "page_size", None)
    if n is None or size is None or not hasattr(pool, "copy_pages"):
        raise ArgumentTypeError(f"pool must be a kvmem.cuda.PagePool, got {type(pool).__name__}")
    if int(n) != cfg.num_pages:
        raise ArgumentError(
            f"the pool holds {n} pages but the manager was asked to manage {cfg.num_pages}; "
            "build both with the same page count"
        )
    if int(size) != cfg.page_size:
        raise ArgumentError(
            f"the pool's pages hold {size} tokens but the manager's page_size is "
            f"{cfg.page_size}; build both with the same page size"
        )
