"""HostOffload: a manager's evicted prefix pages kept in a host tier, and loaded back on admission.

::

    evict   Pages.make_room -> cache.evict -> store(pages, keys, namespace_ids)
            the pages' bytes (every layer, scales), tokens, prefix keys and namespace go into
            the tier as one bundle per namespace, before the freed pages are handed out again
    admit   device hits h (the prefix cache) -> keys of the prompt's next pages chained from
            page h - 1 -> tier.longest_prefix -> tier.get (every page's digest checked) ->
            fetch() keeps the leading pages whose tokens, namespace and static scales are the
            request's -> the manager allocates, write_into() copies them into its fresh pages

A store reads a page only when no step can still write it: the cache evicts only pages it
holds alone, which are committed full pages (the engine committed their K/V, so no step
writes them any more) and no request maps; a reference a request dropped while a step was in
flight is held by that step's fence until it retires, so no step in flight can read or write
an evictable page either. The store runs inside the eviction, before the allocator hands the
pages out again. A store that fails drops those pages (counted) and never stops the eviction.

Loads are synchronous (inside ``admit``): the bytes land before the request is mapped, so no
step can read a loaded page before its bytes are there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvmem.allocator import PrefixCache, namespace_bytes
from kvmem.errors import ArgumentTypeError, ConfigError
from kvmem.transfer._bundle import PageBundle, static_scales_of
from kvmem.transfer._identity import CacheIdentity
from kvmem.transfer._tier import HostTier, TierStats, require_identity

if TYPE_CHECKING:
    from kvmem.cuda import PagePool

__all__ = ["HostOffload", "OffloadStats"]

log = logging.getLogger(__name__)

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
KeyArray = npt.NDArray[np.uint64]
# fn(prefix keys [k, 2], token ids [k, page_size], namespace) after pages entered the tier
OnStored = Callable[[KeyArray, Int64Array, Any], None]


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """A snapshot of a manager's host offload: the tier's own counts, and the manager's side.

    stored_pages: evicted pages handed to the tier (those it kept)
    failed_stores: evicted pages a failing store dropped (not in the tier)
    loaded_pages: pages admissions loaded from the tier into the pool
    load_misses: pages ``longest_prefix`` promised that ``get`` did not serve intact (a failed
        digest or identity check; recomputed) or whose tokens, namespace or static scales were
        not the request's
    """

    tier: TierStats
    stored_pages: int
    failed_stores: int
    loaded_pages: int
    load_misses: int


def _head(bundle: PageBundle, n: int) -> PageBundle:
    """The first ``n`` pages of ``bundle``."""
    return PageBundle(bundle.identity, bundle.namespace, bundle.token_ids[:n],
                      bundle.prefix_keys[:n], {k: v[:, :n] for k, v in bundle.pages.items()},
                      bundle.static_scales, bundle.page_digests[:n])


class HostOffload:
    """The host tier of one manager: stores its evicted pages, loads them on admission.

    Parameters
    ----------
    tier: a :class:`HostTier` whose identity is the pool's (model and weights as the tier says).
    pool: the manager's page pool (``kvmem.cuda.PagePool``).
    cache: the manager's prefix cache (its keys name the stored pages).

    The constructor only checks (it changes nothing, so a manager that refuses its other
    arguments leaves the tier free); :meth:`attach` binds the tier once the manager exists.

    Raises
    ------
    ArgumentTypeError: ``tier`` is not a HostTier.
    ConfigError: no pool or no prefix cache, or the tier serves another manager.
    IncompatibleCacheError: the tier's identity differs from the pool's in the named field.
    """

    def __init__(self, tier: Any, pool: PagePool | None, cache: PrefixCache | None) -> None:
        if not isinstance(tier, HostTier):
            raise ArgumentTypeError(f"offload: expected a kvmem.transfer.HostTier, got "
                                    f"{type(tier).__name__} (a DiskTier is not wired to the "
                                    "manager yet)")
        if pool is None:
            raise ConfigError("offload needs the pool whose page bytes it stores: pass pool=")
        if cache is None:
            raise ConfigError("offload stores pages the prefix cache evicts: keep a prefix "
                              "cache (prefix_cache='hashed')")
        ident = tier.identity
        require_identity(CacheIdentity.of(pool.spec, ident.model, ident.weights), ident)
        if tier.on_removed is not None:
            raise ConfigError("this HostTier already serves a manager; give each manager a "
                              "tier of its own")
        self.tier, self.pool, self.cache = tier, pool, cache
        self.identity: CacheIdentity = ident
        self.page_size = ident.page_size  # (the pool's, as checked)
        self._page_tokens: Int32Array = np.zeros((0, self.page_size), dtype=np.int32)
        self._namespace: Callable[[int], Any] = lambda ns: None
        self.on_stored: OnStored | None = None  # pages that entered the tier
        self.on_removed: Callable[[KeyArray], None] | None = None  # pages that left it
        self.stored_pages = self.failed_stores = self.loaded_pages = self.load_misses = 0

    def attach(self, page_tokens: Int32Array, namespace: Callable[[int], Any]) -> None:
        """Bind the tier to this manager: ``page_tokens`` ``[num_pages, page_size]`` int32,
        the token ids committed into each page; ``namespace(namespace_id) -> namespace``."""
        self._page_tokens, self._namespace = page_tokens, namespace
        self.tier.on_removed = self._removed

    # -- store on eviction ------------------------------------------------------------------------

    def store(self, pages: Int32Array, keys: KeyArray, namespace_ids: Int64Array) -> None:
        """Put evicted ``pages`` (``[k]`` int32; ``keys`` ``[k, 2]`` uint64, their prefix keys;
        ``namespace_ids`` ``[k]``) into the tier, one bundle per namespace. The pages were
        just freed and are not handed out yet. Never raises: a failing store is counted."""
        order = np.arange(pages.size)[::-1]  # the last evicted (most recently used) first
        for ns in np.unique(namespace_ids).tolist():
            sel = order[namespace_ids[order] == ns]
            namespace = self._namespace(int(ns))
            try:
                bundle = PageBundle.of(self.pool, pages[sel], self._page_tokens[pages[sel]],
                                       self.identity, namespace, keys[sel])
                self.tier.put(bundle)
            except Exception:  # a store is best effort: eviction must go on
                self.failed_stores += int(sel.size)
                log.warning("host offload: storing %d evicted pages failed; dropped",
                            sel.size, exc_info=True)
                continue
            kept = min(int(sel.size), self.tier.num_slots)  # a larger bundle keeps its head
            self.stored_pages += kept
            if self.on_stored is not None and kept:
                self.on_stored(keys[sel[:kept]], bundle.token_ids[:kept], namespace)

    # -- load on admission ------------------------------------------------------------------------

    def num_pages(self, tokens: Int64Array, parent_key: KeyArray, first: int, stop: int) -> int:
        """How many prompt pages ``first..stop-1`` (``tokens`` the prompt, ``parent_key`` the
        key of page ``first - 1`` or the root) the tier holds, leading ones only. Reads no
        bytes and changes nothing."""
        if stop <= first:
            return 0
        return self.tier.longest_prefix(self._keys(tokens, parent_key, first, stop))

    def fetch(self, tokens: Int64Array, namespace: Any, parent_key: KeyArray, first: int,
              stop: int) -> PageBundle | None:
        """The tier's pages for prompt pages ``first..stop-1`` in ``namespace``: the leading
        ones present, intact (digests checked) and confirmed (their tokens the prompt's, their
        namespace and static scales the pool's), or None. Only ``get``'s LRU touch and its
        removal of a corrupted page change the tier."""
        if stop <= first:
            return None
        keys = self._keys(tokens, parent_key, first, stop)
        promised = self.tier.longest_prefix(keys)
        if promised == 0:
            return None
        bundle = self.tier.get(keys[:promised])
        n = 0 if bundle is None else bundle.num_pages
        if bundle is not None:
            P = self.page_size
            asked = tokens[first * P : (first + n) * P].reshape(n, P)
            same = (bundle.token_ids == asked).all(axis=1)
            n = n if same.all() else int(np.argmin(same))
            static = static_scales_of(self.pool)
            if (namespace_bytes(bundle.namespace) != namespace_bytes(namespace)
                    or not _same(static, bundle.static_scales)):
                n = 0
        self.load_misses += promised - n
        if n == 0 or bundle is None:
            return None
        return bundle if n == bundle.num_pages else _head(bundle, n)

    def load(self, bundle: PageBundle, pages: Int32Array) -> None:
        """Write ``bundle``'s bytes into ``pages`` (``[n]`` int32, fresh, mapped by nobody yet):
        bit for bit, data and scales together."""
        bundle.write_into(self.pool, pages)
        self.loaded_pages += bundle.num_pages

    def _keys(self, tokens: Int64Array, parent_key: KeyArray, first: int, stop: int) -> KeyArray:
        P = self.page_size
        return self.cache.run_keys(parent_key, first,
                                   tokens[first * P : stop * P].reshape(stop - first, P))

    # -- the rest ---------------------------------------------------------------------------------

    def _removed(self, keys: KeyArray) -> None:
        if self.on_removed is not None:
            self.on_removed(keys)

    def clear(self) -> int:
        """Forget every page of the tier; how many there were."""
        return self.tier.clear()

    def stats(self) -> OffloadStats:
        return OffloadStats(self.tier.stats(), self.stored_pages, self.failed_stores,
                            self.loaded_pages, self.load_misses)


def _same(a: npt.NDArray[Any] | None, b: npt.NDArray[Any] | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None
                                         and np.array_equal(a, b))
