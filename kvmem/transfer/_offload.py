"""Offload: a manager's prefix pages kept in tiers below the device, loaded back on admission.

::

    store   write="evict" (default): Pages.make_room -> cache.evict -> store_evicted(pages, ...)
            write="through": commit -> the pages the cache took -> store_committed(pages, ...)
            the pages' bytes (every layer, scales), tokens, prefix keys and namespace go into
            the top tier as one bundle per namespace; the host tier's own LRU evictions go to
            the disk tier below it (when there is one)
    admit   device hits h (the prefix cache) -> keys of the prompt's next pages chained from
            page h - 1 -> host: longest prefix -> disk: longest prefix after the host's ->
            load or recompute (estimated times) -> tier.get (every page's digest checked) ->
            the leading pages whose tokens, namespace and static scales are the request's ->
            the manager allocates; the bytes are written into its fresh pages now
            (copies="sync") or when the engine calls ``land_copies`` (copies="deferred")

Copies that cannot race:

- A store on eviction runs inside the eviction, before the allocator hands the pages out
  again: the cache evicts only pages it holds alone (committed full pages no request maps; a
  reference a request dropped while a step was in flight is held by that step's fence until it
  retires), so no step can write them any more.
- A write-through store reads pages the engine has just committed (their K/V is written). With
  copies="deferred" it holds a lease on them until the copy lands: they cannot be evicted,
  freed or reused before.
- A deferred load leases its destination pages and marks them *landing* until the copy lands:
  the pages are never reused before (whatever happens to the request), the request is not
  ready (``KVCacheManager.is_loading``), and ``verify`` aborts a request whose step would read a
  landing page. The loaded tokens are committed (and offered to the prefix cache) only when the
  bytes have landed. A reset (``clear_prefix_cache``) cancels pending loads (the request
  recomputes those tokens) and pending stores.

A page that round-trips is bit-exact: its bytes are copied, never converted, and checked
against the digest taken when it was stored; a digest failure is a miss (counted, the prefix
recomputed), never wrong K/V.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvmem.allocator import PrefixCache, namespace_bytes
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError
from kvmem.transfer._bundle import PageBundle, static_scales_of
from kvmem.transfer._identity import CacheIdentity
from kvmem.transfer._tier import DiskTier, HostTier, TierStats, join_pages, require_identity

if TYPE_CHECKING:
    from kvmem.allocator import Lease
    from kvmem.cuda import PagePool

__all__ = ["Landed", "Offload", "OffloadConfig", "OffloadFaults", "OffloadStats", "PendingLoad"]

log = logging.getLogger(__name__)

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
KeyArray = npt.NDArray[np.uint64]
Tier = HostTier | DiskTier
# fn(prefix keys [k, 2], token ids [k, page_size], namespace, medium) after pages entered a tier
OnStored = Callable[[KeyArray, Int64Array, Any, str], None]

WRITE_POLICIES = ("evict", "through")
COPY_MODES = ("sync", "deferred")


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """What a manager keeps below the device, and how.

    tiers: a :class:`HostTier`, a :class:`DiskTier`, or both as ``(host, disk)``: evicted pages
        go to the first; the host tier's evictions go to the disk tier.
    write: ``"evict"`` (default: a page is stored when the device evicts it) or ``"through"``
        (stored when committed, so an eviction finds it stored already).
    copies: ``"sync"`` (default: a load's bytes land inside ``admit``) or ``"deferred"``
        (loads and write-through stores land at ``KVCacheManager.land_copies()``; until then
        their pages are fenced, and a request whose load has not landed is not ready).
    prefill_tokens_per_s: the engine's prefill rate, for the load-or-recompute choice (None:
        learnt from ``Offload.observe_prefill``; until known, tier hits are loaded).
    """

    tiers: tuple[Tier, ...]
    write: str = "evict"
    copies: str = "sync"
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        tiers = self.tiers
        if not tiers or not all(isinstance(t, HostTier | DiskTier) for t in tiers):
            raise ArgumentTypeError(f"offload: expected a HostTier, a DiskTier or (HostTier, "
                                    f"DiskTier), got {[type(t).__name__ for t in tiers]}")
        if len(tiers) > 2 or (len(tiers) == 2 and not (isinstance(tiers[0], HostTier)
                                                      and isinstance(tiers[1], DiskTier))):
            raise ConfigError("offload: tiers are a HostTier, a DiskTier, or (HostTier, "
                              f"DiskTier) in that order; got {[t.medium for t in tiers]}")
        if self.write not in WRITE_POLICIES:
            raise ArgumentError(f"offload write={self.write!r}: expected one of {WRITE_POLICIES}")
        if self.copies not in COPY_MODES:
            raise ArgumentError(f"offload copies={self.copies!r}: expected one of {COPY_MODES}")
        rate = self.prefill_tokens_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)):
            raise ArgumentTypeError(f"offload prefill_tokens_per_s={rate!r}: expected a number "
                                    "of tokens per second, or None")
        if rate is not None and not 0 < rate < math.inf:
            raise ArgumentError(f"offload prefill_tokens_per_s={rate!r}: expected a positive, "
                                "finite number of tokens per second, or None")

    @classmethod
    def of(cls, value: Any) -> OffloadConfig:
        """``value`` as a config: a config, a tier, or a sequence of tiers."""
        if isinstance(value, OffloadConfig):
            return value
        if isinstance(value, HostTier | DiskTier):
            return cls((value,))
        if isinstance(value, Sequence) and not isinstance(value, str | bytes):
            return cls(tuple(value))
        raise ArgumentTypeError(f"offload: expected a HostTier, a DiskTier, (HostTier, DiskTier) "
                                f"or an OffloadConfig, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """A snapshot of a manager's offload: each tier's own counts, and the manager's side.

    tiers: each tier's :class:`TierStats`, top first (``tier``: the top one)
    stored_pages: pages handed to the top tier and kept there
    failed_stores: pages a failing store dropped (not in the tier)
    loaded_pages: pages admissions loaded into the pool (landed), per medium in
        ``loaded_by_medium``
    load_misses: pages ``longest_prefix`` promised that ``get`` did not serve intact (a failed
        digest or identity check; recomputed) or whose tokens, namespace or static scales were
        not the request's
    chose_load, chose_recompute: tier hits loaded / recomputed because that was estimated
        faster (pages)
    pending_loads, pending_stores: deferred copies not landed yet
    cancelled_loads: deferred loads a reset cancelled (their tokens recomputed)
    """

    tiers: tuple[TierStats, ...]
    stored_pages: int
    failed_stores: int
    loaded_pages: int
    loaded_by_medium: dict[str, int]
    load_misses: int
    chose_load: int
    chose_recompute: int
    pending_loads: int
    pending_stores: int
    cancelled_loads: int

    @property
    def tier(self) -> TierStats:
        return self.tiers[0]


@dataclass(frozen=True, slots=True)
class Fetched:
    """Pages a tier lookup found: ``bundle``'s first ``media[medium]`` pages came from the
    host tier, the rest from the disk tier (in the tiers' order)."""

    bundle: PageBundle
    media: dict[str, int]


@dataclass(slots=True)
class PendingLoad:
    """A deferred load: ``bundle``'s pages go into ``pages`` (leased by ``lease``), then
    ``num_tokens`` tokens from ``first_token`` of request ``request_id``'s row are committed."""

    request_id: Any
    row: int
    fetched: Fetched
    pages: Int32Array
    lease: Lease | None
    first_token: int
    tokens: Int64Array
    cancelled: bool = False  # by a reset: its bytes are not written
    left: bool = False  # its request was released, preempted or aborted


@dataclass(slots=True)
class PendingStore:
    """A deferred write-through store of ``pages`` (leased by ``lease``)."""

    pages: Int32Array
    keys: KeyArray
    namespace_ids: Int64Array
    lease: Lease | None


@dataclass(frozen=True, slots=True)
class Landed:
    """A deferred load that ended: ``ok`` when its bytes were written (not cancelled by a reset,
    its request still there)."""

    load: PendingLoad
    ok: bool


@dataclass(slots=True)
class _Rate:
    """A rate learnt from measurements (exponential moving average of ``amount / seconds``)."""

    value: float | None = None

    def observe(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            rate = amount / seconds
            self.value = rate if self.value is None else 0.7 * self.value + 0.3 * rate


@dataclass(slots=True)
class OffloadFaults:
    """Switches that turn off one of the offload's protections (fault injection only:
    ``kvmem.testing``). All off by default."""

    load_without_fence: bool = False  # a deferred load neither leases nor marks its pages
    store_without_fence: bool = False  # a deferred store does not lease its source pages
    skip_digest: bool = False  # the host tier serves pages without checking their digests
    reset_keeps_pending: bool = False  # a reset lets pending loads land and stores enter
    partial_restore: bool = False  # a load writes all but the last page of its run
    namespace_blind: bool = False  # tier lookups chain from no namespace's root, unconfirmed


def _head(bundle: PageBundle, n: int) -> PageBundle:
    """The first ``n`` pages of ``bundle``."""
    return PageBundle(bundle.identity, bundle.namespace, bundle.token_ids[:n],
                      bundle.prefix_keys[:n], {k: v[:, :n] for k, v in bundle.pages.items()},
                      bundle.static_scales, bundle.page_digests[:n])


class Offload:
    """The tiers of one manager: stores its prefix pages, loads them on admission.

    Parameters
    ----------
    config: an :class:`OffloadConfig` (or what :meth:`OffloadConfig.of` takes); every tier's
        identity is the pool's (model and weights as the tiers say).
    pool: the manager's page pool (``kvmem.cuda.PagePool``).
    cache: the manager's prefix cache (its keys name the stored pages).

    The constructor only checks (it changes nothing, so a manager that refuses its other
    arguments leaves the tiers free); :meth:`attach` binds the tiers once the manager exists.

    Raises
    ------
    ArgumentTypeError / ArgumentError / ConfigError: a bad config; no pool or no prefix cache;
        a tier that serves another manager.
    IncompatibleCacheError: a tier's identity differs from the pool's in the named field.
    """

    def __init__(self, config: Any, pool: PagePool | None, cache: PrefixCache | None) -> None:
        config = OffloadConfig.of(config)
        if pool is None:
            raise ConfigError("offload needs the pool whose page bytes it stores: pass pool=")
        if cache is None:
            raise ConfigError("offload stores pages the prefix cache evicts: keep a prefix "
                              "cache (prefix_cache='hashed')")
        ident = config.tiers[0].identity
        for tier in config.tiers:
            require_identity(CacheIdentity.of(pool.spec, ident.model, ident.weights),
                             tier.identity)
            if tier.on_removed is not None:
                raise ConfigError(f"this {type(tier).__name__} already serves a manager; give "
                                  "each manager tiers of its own")
        disk = [t for t in config.tiers if isinstance(t, DiskTier)]
        if disk and getattr(cache, "seed_given", True) is False:
            # Keys that survive a restart: the directory's seed, not a per-process one.
            cache.seed = disk[0].key_seed  # type: ignore[attr-defined]
        self.config, self.tiers, self.pool, self.cache = config, config.tiers, pool, cache
        self.identity: CacheIdentity = ident
        self.page_size = ident.page_size  # (the pool's, as checked)
        self.deferred = config.copies == "deferred"
        self.faults = OffloadFaults()
        self._page_tokens: Int32Array = np.zeros((0, self.page_size), dtype=np.int32)
        self._namespace: Callable[[int], Any] = lambda ns: None
        self._refs: Any = None  # the manager's PageRefs (leases)
        # landing[page]: a deferred load's destination not landed yet ([num_pages + 1]: PAD,
        # -1, reads the last entry, always False)
        self.landing: npt.NDArray[np.bool_] = np.zeros(1, dtype=bool)
        self.loads: list[PendingLoad] = []
        self.stores: list[PendingStore] = []
        self.on_stored: OnStored | None = None  # pages that entered a tier
        self.on_removed: Callable[[KeyArray, str], None] | None = None  # pages that left one
        self.on_dropped: Callable[[str, int], None] | None = None  # (medium, pages) not stored
        self.stored_pages = self.failed_stores = self.load_misses = 0
        self.chose_load = self.chose_recompute = self.cancelled_loads = 0
        self.loaded: dict[str, int] = {t.medium: 0 for t in self.tiers}
        self.prefill_rate = _Rate(config.prefill_tokens_per_s)
        self.bandwidth = {t.medium: _Rate() for t in self.tiers}  # bytes per second of get()

    def attach(self, refs: Any, namespace: Callable[[int], Any]) -> None:
        """Bind the tiers to this manager: ``refs`` its ``PageRefs`` (tokens of each page,
        leases); ``namespace(namespace_id) -> namespace``."""
        self._refs, self._page_tokens, self._namespace = refs, refs.tokens, namespace
        self.landing = np.zeros(refs.tokens.shape[0] + 1, dtype=bool)
        for tier in self.tiers:
            medium = tier.medium
            tier.on_removed = lambda keys, medium=medium: self._removed(keys, medium)
        if len(self.tiers) == 2:
            self.tiers[0].on_evicted = self._cascade

    # -- stores -----------------------------------------------------------------------------------

    def store_evicted(self, pages: Int32Array, keys: KeyArray, namespace_ids: Int64Array) -> None:
        """Put evicted ``pages`` (``[k]`` int32; ``keys`` ``[k, 2]`` uint64, their prefix keys;
        ``namespace_ids`` ``[k]``) into the top tier (write="evict"; with write="through" only
        those not stored yet). The pages were just freed and are not handed out yet. Never
        raises: a failing store is counted."""
        self._store(pages, keys, namespace_ids, last_first=True)

    def store_committed(self, pages: Int32Array, keys: KeyArray,
                        namespace_ids: Int64Array) -> None:
        """write="through": ``pages`` the prefix cache just took from a commit (their K/V is
        written). Stored now (copies="sync"), or leased until ``land`` copies them."""
        if not self.deferred:
            self._store(pages, keys, namespace_ids, last_first=False)
            return
        lease = None if self.faults.store_without_fence else self._refs.lease(pages)
        self.stores.append(PendingStore(pages.copy(), keys.copy(), namespace_ids.copy(), lease))

    def _store(self, pages: Int32Array, keys: KeyArray, namespace_ids: Int64Array,
               last_first: bool) -> None:
        top = self.tiers[0]
        order = np.arange(pages.size)
        if last_first:  # evicted least recently used first: store the most recent first
            order = order[::-1]
        for ns in np.unique(namespace_ids).tolist():
            sel = order[namespace_ids[order] == ns]
            namespace = self._namespace(int(ns))
            dropped = top.num_dropped_stores
            try:
                bundle = PageBundle.of(self.pool, pages[sel], self._page_tokens[pages[sel]],
                                       self.identity, namespace, keys[sel])
                kept = top.put(bundle)
            except Exception:  # a store is best effort: eviction must go on
                self.failed_stores += int(sel.size)
                log.warning("offload: storing %d pages failed; dropped", sel.size, exc_info=True)
                self._dropped(top.medium, int(sel.size))
                continue
            self._dropped(top.medium, top.num_dropped_stores - dropped)
            self.stored_pages += kept
            if self.on_stored is not None and kept:
                self.on_stored(keys[sel[:kept]], bundle.token_ids[:kept], namespace, top.medium)

    def _cascade(self, bundle: PageBundle) -> None:
        """The host tier's LRU evictions, into the disk tier."""
        disk = self.tiers[1]
        dropped = disk.num_dropped_stores
        kept = disk.put(bundle)
        self._dropped(disk.medium, disk.num_dropped_stores - dropped)
        if self.on_stored is not None and kept:
            self.on_stored(bundle.prefix_keys[:kept], bundle.token_ids[:kept],
                           bundle.namespace, disk.medium)

    # -- loads ------------------------------------------------------------------------------------

    def num_pages(self, tokens: Int64Array, parent_key: KeyArray, first: int, stop: int) -> int:
        """How many prompt pages ``first..stop-1`` (``tokens`` the prompt, ``parent_key`` the
        key of page ``first - 1`` or the root) the tiers hold, leading ones only (host pages,
        then disk pages after them). Reads no bytes and changes nothing."""
        if stop <= first or not any(map(len, self.tiers)):  # (an empty tier: no keys to hash)
            return 0
        return sum(self._promised(self._keys(tokens, parent_key, first, stop)))

    def _promised(self, keys: KeyArray) -> list[int]:
        """Per tier, the pages of ``keys`` it would serve: the host's leading run, then the
        disk's run after it."""
        counts, at = [], 0
        for tier in self.tiers:
            n = tier.longest_prefix(keys[at:]) if at < len(keys) else 0
            counts.append(n)
            at += n
        return counts

    def fetch(self, tokens: Int64Array, namespace: Any, parent_key: KeyArray, first: int,
              stop: int) -> Fetched | None:
        """The tiers' pages for prompt pages ``first..stop-1`` in ``namespace``: the leading
        ones present, intact (digests checked) and confirmed (their tokens the prompt's, their
        namespace and static scales the pool's), or None, also when recomputing them is
        estimated faster than loading. Only the tiers' LRU touches and their removal of a
        corrupted page change them."""
        if stop <= first or not any(map(len, self.tiers)):
            return None
        keys = self._keys(tokens, parent_key, first, stop)
        promised = self._promised(keys)
        total = sum(promised)
        if total == 0:
            return None
        if not self._load_is_faster(promised):
            self.chose_recompute += total
            return None
        self.chose_load += total
        parts: list[PageBundle] = []
        at = 0
        for tier, want in zip(self.tiers, promised, strict=True):
            if want == 0:
                continue
            started = time.perf_counter()
            got = (tier.get(keys[at : at + want], check_digests=False)
                   if self.faults.skip_digest and isinstance(tier, HostTier)
                   else tier.get(keys[at : at + want]))
            n = 0 if got is None else got.num_pages
            self.bandwidth[tier.medium].observe(n * self._page_nbytes(),
                                                time.perf_counter() - started)
            if got is not None:
                parts.append(got)
            at += n
            if n < want:  # a gap: nothing after it is of use
                break
        bundle = None if not parts else parts[0] if len(parts) == 1 else join_pages(parts)
        n = self._confirmed(bundle, tokens, namespace, first)
        self.load_misses += total - n
        if n == 0 or bundle is None:
            return None
        media, left = {}, n
        for tier, want in zip(self.tiers, promised, strict=True):
            media[tier.medium] = min(left, want)
            left -= media[tier.medium]
        return Fetched(bundle if n == bundle.num_pages else _head(bundle, n), media)

    def _confirmed(self, bundle: PageBundle | None, tokens: Int64Array, namespace: Any,
                   first: int) -> int:
        """How many leading pages of ``bundle`` hold the prompt's tokens from page ``first``,
        in ``namespace``, with the pool's static scales."""
        if bundle is None:
            return 0
        n, P = bundle.num_pages, self.page_size
        if self.faults.namespace_blind:
            namespace = bundle.namespace
        if (namespace_bytes(bundle.namespace) != namespace_bytes(namespace)
                or not _same(static_scales_of(self.pool), bundle.static_scales)):
            return 0
        same = (bundle.token_ids == tokens[first * P : (first + n) * P].reshape(n, P)).all(axis=1)
        return n if same.all() else int(np.argmin(same))

    def _page_nbytes(self) -> int:
        return self.pool.spec.bytes_per_page

    def _load_is_faster(self, promised: list[int]) -> bool:
        """Whether loading the promised pages is estimated no slower than recomputing their
        tokens (load when either rate is not known yet)."""
        prefill = self.prefill_rate.value
        if prefill is None:
            return True
        seconds = 0.0
        for tier, n in zip(self.tiers, promised, strict=True):
            bandwidth = self.bandwidth[tier.medium].value
            if n and bandwidth is None:
                return True
            seconds += 0.0 if n == 0 else n * self._page_nbytes() / bandwidth  # type: ignore[operator]
        return seconds <= sum(promised) * self.page_size / prefill

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine prefilled ``num_tokens`` in ``seconds`` (its rate, for the choice)."""
        self.prefill_rate.observe(num_tokens, seconds)

    def load(self, fetched: Fetched, pages: Int32Array) -> None:
        """Write ``fetched``'s bytes into ``pages`` (``[n]`` int32, fresh, mapped by nobody but
        their new request): bit for bit, data and scales together."""
        bundle = fetched.bundle
        if self.faults.partial_restore and bundle.num_pages > 1:
            bundle, pages = _head(bundle, bundle.num_pages - 1), pages[:-1]
        bundle.write_into(self.pool, pages)
        for medium, n in fetched.media.items():
            self.loaded[medium] += n

    def defer_load(self, request_id: Any, row: int, fetched: Fetched, pages: Int32Array,
                   first_token: int, tokens: Int64Array) -> None:
        """copies="deferred": lease ``pages`` and mark them landing until :meth:`land`."""
        lease = None
        if not self.faults.load_without_fence:
            lease = self._refs.lease(pages)
            self.landing[pages] = True
        self.loads.append(PendingLoad(request_id, row, fetched, pages.copy(), lease,
                                      first_token, tokens.copy()))

    def loading(self, request_id: Any) -> bool:
        """Whether a deferred load into ``request_id``'s pages has not landed."""
        return any(p.request_id == request_id and not p.left for p in self.loads)

    def cancel(self, request_id: Any) -> None:
        """``request_id`` left (released, preempted, aborted): its pending load still lands
        into its leased pages, but nothing is committed."""
        for p in self.loads:
            if p.request_id == request_id:
                p.left = True

    def land(self) -> list[Landed]:
        """Land every deferred copy: stores enter the top tier, loads write their pages; each
        lease ends, each landing mark clears. The loads that ended, in order."""
        stores, self.stores = self.stores, []
        for s in stores:
            self._store(s.pages, s.keys, s.namespace_ids, last_first=False)
            if s.lease is not None:
                self._refs.end_lease(s.lease)
        loads, self.loads = self.loads, []
        for p in loads:
            ok = not (p.cancelled or p.left)
            if ok:
                self.load(p.fetched, p.pages)
            if p.lease is not None:
                self.landing[p.pages] = False
                self._refs.end_lease(p.lease)
        return [Landed(p, not (p.cancelled or p.left)) for p in loads]

    def reset(self) -> None:
        """A reset: cancel pending loads (their bytes may be of the old weights) and drop
        pending stores (their leases end)."""
        if self.faults.reset_keeps_pending:
            return
        for p in self.loads:
            if not p.cancelled:
                p.cancelled = True
                self.cancelled_loads += 1
        stores, self.stores = self.stores, []
        for s in stores:
            if s.lease is not None:
                self._refs.end_lease(s.lease)

    def _keys(self, tokens: Int64Array, parent_key: KeyArray, first: int, stop: int) -> KeyArray:
        P = self.page_size
        if self.faults.namespace_blind and first == 0:
            parent_key = self.cache.root_key(None)
        return self.cache.run_keys(parent_key, first,
                                   tokens[first * P : stop * P].reshape(stop - first, P))

    # -- the rest ---------------------------------------------------------------------------------

    def _dropped(self, medium: str, num_pages: int) -> None:
        if num_pages and self.on_dropped is not None:
            self.on_dropped(medium, num_pages)

    def _removed(self, keys: KeyArray, medium: str) -> None:
        if self.on_removed is not None:
            self.on_removed(keys, medium)

    def clear(self) -> list[str]:
        """Forget every page of every tier (and cancel pending copies); the media cleared."""
        self.reset()
        for tier in self.tiers:
            tier.clear()
        return [t.medium for t in self.tiers]

    def stats(self) -> OffloadStats:
        return OffloadStats(tuple(t.stats() for t in self.tiers), self.stored_pages,
                            self.failed_stores, sum(self.loaded.values()), dict(self.loaded),
                            self.load_misses, self.chose_load, self.chose_recompute,
                            len(self.loads), len(self.stores),
                            self.cancelled_loads)


def _same(a: npt.NDArray[Any] | None, b: npt.NDArray[Any] | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None
                                         and np.array_equal(a, b))

