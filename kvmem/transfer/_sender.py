"""Sender: the prefill side. Exports a request's full pages under a lease, answers confirmations.

::

    export(rid, now)     lease the request's full pages (manager.lease: they stay live and keep
                         their tags whatever happens to the request), digest them, -> offer bytes
                         (the engine sends them: transport.notify(peer, offer), or its own pipe)
    poll(now)            end the leases that expired (their pages go back, or to the request
                         if it still runs); answer each confirm: "ok" if its lease is still
                         open and every page is in the lifetime the offer named, else "stale"

Time is the caller's (``now``, seconds on the sender's clock), so tests are deterministic. A
confirm after expiry is stale even when the bytes were fine: the pages may have been reused
while the read ran, and the sender cannot tell.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmem.allocator import Lease
from kvmem.errors import ArgumentError, KVMemError
from kvmem.transfer._bundle import pool_page_digests, static_scales_of
from kvmem.transfer._descs import register_pool
from kvmem.transfer._faults import TransferFaults
from kvmem.transfer._identity import CacheIdentity
from kvmem.transfer._message import TransferMessage, answer_bytes, parse_notice
from kvmem.transfer._transport import Transport

if TYPE_CHECKING:
    from kvmem.cuda import PagePool
    from kvmem.manager import KVCacheManager

__all__ = ["Sender"]

log = logging.getLogger(__name__)


@dataclass
class _Out:
    request_id: Any
    lease: Lease | None  # (None: only with faults.lease_pages off)
    expiry: float


class Sender:
    """The prefill side of page transfers.

    Parameters
    ----------
    manager, pool: the sender's manager and the pool it manages.
    transport: this side's transport agent (the pool's tensors are registered with it).
    identity: this cache's identity (``CacheIdentity.of(pool.spec, model, weights)``).
    lease_seconds: how long a lease holds the pages for a receiver to read and confirm.

    Attributes
    ----------
    counts: ``{"confirmed", "stale", "expired", "declined", "ignored"}`` notices and leases so
        far.
    faults: :class:`TransferFaults` (all on; fault injection only)
    """

    def __init__(self, manager: KVCacheManager, pool: PagePool, transport: Transport,
                 identity: CacheIdentity, lease_seconds: float = 30.0) -> None:
        if pool.spec.page_size != manager.page_size or pool.spec.num_pages != manager.num_pages:
            raise ArgumentError("the pool and the manager differ in page size or page count")
        self.manager, self.pool, self.transport, self.identity = manager, pool, transport, identity
        self.lease_seconds = float(lease_seconds)
        self.regions = register_pool(pool, transport)
        self._out: dict[str, _Out] = {}
        self._next = 1
        self.counts = dict.fromkeys(("confirmed", "stale", "expired", "declined", "ignored"), 0)
        self.faults = TransferFaults()
        self._answered: dict[str, _Out] = {}  # (only with faults.end_lease_once off)

    @property
    def open_transfers(self) -> tuple[str, ...]:
        """Transfer ids whose lease is still open."""
        return tuple(self._out)

    def export(self, request_id: Any, now: float, token_ids: Any = None) -> bytes:
        """Lease a running request's full pages and describe them: the offer's bytes.

        ``token_ids`` (``[m]``): what the receiver admits (default: the committed tokens); it
        must begin with the tokens of the full pages.
        """
        m = self.manager
        P = m.page_size
        committed = m.tokens_of(request_id)
        n = committed.size // P
        tokens = committed if token_ids is None else np.asarray(token_ids, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size < n * P or np.any(tokens[: n * P] != committed[: n * P]):
            raise ArgumentError(f"token_ids must begin with the {n * P} tokens of request "
                                f"{request_id!r}'s full pages; nothing changed")
        namespace = m.namespace_of(request_id)
        lease = m.lease(request_id, 0, n) if self.faults.lease_pages else None
        if lease is not None:
            pages, tags = lease.pages, lease.tags
        else:  # (fault) page ids with no lifetime behind them
            pages = m.pages_of(request_id)[:n]
            tags = m.allocator.tags[pages]
        page_tokens = tokens[: n * P].reshape(n, P)
        static = static_scales_of(self.pool)
        digests = pool_page_digests(self.pool, pages, page_tokens, static)
        cache = m.cache
        keys = (cache.run_keys(cache.root_key(namespace), 0, page_tokens)
                if cache is not None and n else np.zeros((n, 2), dtype=np.uint64))
        transfer_id = f"{self.transport.agent}:{self._next}"
        self._next += 1
        expiry = float(now) + self.lease_seconds
        self._out[transfer_id] = _Out(request_id, lease, expiry)
        msg = TransferMessage(transfer_id, self.transport.agent, request_id, self.identity,
                              namespace, tokens.copy(), pages.copy(), tags.copy(),
                              np.asarray(keys, dtype=np.uint64), self.regions, static, digests,
                              expiry)
        return msg.to_bytes()

    def cancel(self, transfer_id: str) -> None:
        """End a transfer's lease now (its confirm will be answered "stale")."""
        out = self._out.pop(transfer_id, None)
        if out is None:
            raise ArgumentError(f"transfer {transfer_id!r} has no open lease")
        if out.lease is not None:
            self.manager.end_lease(out.lease)

    def poll(self, now: float) -> list[tuple[str, bool]]:
        """End expired leases, answer confirms: ``[(transfer_id, ok)]`` answered now."""
        for tid, out in list(self._out.items()):
            if out.expiry <= now and self.faults.expire_leases:
                del self._out[tid]
                if out.lease is not None:
                    self.manager.end_lease(out.lease)
                self.counts["expired"] += 1
                log.info("kvmem transfer %s: lease expired (request %r)", tid, out.request_id)
        answered = []
        for peer, data in self.transport.notices():
            try:
                kind, head, arrays = parse_notice(data)
            except KVMemError as e:
                self.counts["ignored"] += 1
                log.warning("kvmem sender: ignored a notice from %r: %s", peer, e)
                continue
            if kind != "confirm":
                self.counts["ignored"] += 1
                continue
            tid = head["transfer_id"]
            ok, reason = self._confirm(tid, arrays.get("tags"))
            answered.append((tid, ok))
            try:
                self.transport.notify(peer, answer_bytes(tid, ok, reason))
            except KVMemError as e:  # the receiver is gone: its load falls back on its own
                log.warning("kvmem transfer %s: could not answer %r: %s", tid, peer, e)
        return answered

    def _confirm(self, tid: str, tags: Any) -> tuple[bool, str]:
        out = self._out.pop(tid, None)
        if out is None and not self.faults.end_lease_once:
            out = self._answered.get(tid)  # (fault) an answered confirm's lease ends again
        elif out is not None and not self.faults.end_lease_once:
            self._answered[tid] = out
        if out is None:
            self.counts["stale"] += 1
            return False, "no open lease (expired, cancelled or answered already)"
        if out.lease is None:  # (fault) nothing to check the pages against
            self.counts["confirmed"] += 1
            return True, ""
        intact = self.manager.end_lease(out.lease)
        if tags is None or tags.size == 0:
            self.counts["declined"] += 1
            return False, "declined by the receiver"
        if not intact or not np.array_equal(tags, out.lease.tags):
            self.counts["stale"] += 1
            log.warning("kvmem transfer %s: a page left the lifetime the offer named", tid)
            return False, "a page's lifetime changed under the lease"
        self.counts["confirmed"] += 1
        return True, ""
