"""Receiver: the decode side. Admits an offered request on its own manager, reads the pages it
lacks, checks them, and hands the request to the engine loaded, or to recompute.

Life of a load (``hits``: full pages the receiver's prefix cache already held)::

    receive(offer, now)   check the identity (IncompatibleCacheError names the field); admit the
                          request (its own pages and tags: nothing in the offer names a page
                          here); lease destination pages hits..n (fenced: never reused while a
                          byte may still land); start one read (its notice is the confirm)
       waiting            (converting load: staging pages are busy) -> read when they free
       reading            transport.state(handle) is "pending"
       checking           final: the lease on the destination ends (no byte moves after);
                          "failed" or a page digest that differs -> fallback
       confirming         wait for the sender's answer: "ok" -> convert (if the dtypes differ),
                          reserve + commit the pages' tokens (prefix keys registered) -> loaded;
                          "stale", or no answer within answer_timeout -> fallback

    fallback  policy "recompute": the request stays admitted, computed up to its prefix hits
              (the engine prefills the rest); "fail": the request is released
    abort(rid)            the request is released now; its destination pages stay leased
                          until the read is final, then go back

Only pages this load allocated are ever written (by the read or the conversion), and they
enter the prefix cache only through commit after every check passed, so a failed load never
touches a page another request shares (a recompute writes them again through its own slots).
Answers for transfers this receiver does not wait for (duplicates, late ones), and offers of a
transfer it is loading or has finished (the last ``REMEMBERED`` transfers: loaded, fallen back,
failed, aborted or declined) or of a request it holds (duplicates), are counted and ignored: a
late copy of an offer never admits its request a second time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvmem.allocator import Lease, PageAllocator
from kvmem.cuda import PagePool
from kvmem.errors import ArgumentError, IntegrityError, KVMemError
from kvmem.transfer._bundle import pool_page_digests, static_scales_of
from kvmem.transfer._descs import Region, paired_descs, register_pool
from kvmem.transfer._faults import TransferFaults
from kvmem.transfer._identity import CacheIdentity
from kvmem.transfer._message import TransferMessage, confirm_bytes, parse_notice
from kvmem.transfer._transport import Transport

if TYPE_CHECKING:
    from kvmem.manager import KVCacheManager

__all__ = ["LoadResult", "Receiver", "Receiving"]

log = logging.getLogger(__name__)
Policy = Literal["recompute", "fail"]
REMEMBERED = 65536  # transfer ids whose loads ended, kept to ignore late copies of their offers
_READ_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LoadResult(NamedTuple):
    """A load that finished. ``status``: "loaded" (pages filled and committed up to
    ``num_computed_tokens``), "recompute" (admitted, computed up to ``num_computed_tokens``:
    the engine prefills the rest), "failed" (released) or "aborted"."""

    request_id: Any
    status: str
    num_computed_tokens: int
    reason: str = ""


class Receiving(NamedTuple):
    """What :meth:`Receiver.receive` admitted and started. ``admitted``: the manager's
    AdmitResult (``num_cached_tokens``: the prefix hits, whole pages); ``pages``: ``[k]`` int32,
    the destination pages the read fills (the request's pages ``hits .. num_pages``, leased
    until the read is final; empty when every page hit); ``handle``: the transport's read (None:
    nothing to read, or waiting for staging pages)."""

    transfer_id: str
    admitted: Any
    pages: npt.NDArray[np.int32]
    handle: int | None


@dataclass
class _Staging:
    pool: PagePool
    free: PageAllocator
    regions: dict[str, Region]


@dataclass
class _Load:
    msg: TransferMessage
    hits: int
    dst: npt.NDArray[np.int32]  # destination pages (this manager's), positions hits..n
    hold: Lease | None
    started: float
    staging: _Staging | None = None
    staging_pages: npt.NDArray[np.int32] | None = None
    handle: int | None = None
    state: str = "waiting"
    answer: tuple[bool, str] | None = None
    aborted: bool = False


class Receiver:
    """The decode side of page transfers (see the module docstring).

    Parameters
    ----------
    manager, pool: the receiver's manager and the pool it manages.
    transport: this side's agent; the sender's agent must be a peer (``add_peer``).
    identity: this cache's identity.
    policy: "recompute" (default) or "fail": what a failed load does to its request.
    answer_timeout: seconds (receiver's clock) to wait for the sender's answer after the read.
    staging_pages: pages of a staging pool per sender identity that needs conversion (default
        the manager's ``max_pages_per_seq``).

    Attributes
    ----------
    counts: loads by how they ended (``loaded``, ``recompute``, ``failed``, ``aborted``),
        notices ``ignored``, and what the reads moved: ``bytes_read``, ``descriptors``.
    """

    def __init__(self, manager: KVCacheManager, pool: PagePool, transport: Transport,
                 identity: CacheIdentity, policy: Policy = "recompute",
                 answer_timeout: float = 30.0, staging_pages: int | None = None) -> None:
        if policy not in ("recompute", "fail"):
            raise ArgumentError(f"policy={policy!r}: expected 'recompute' or 'fail'")
        if pool.spec.page_size != manager.page_size or pool.spec.num_pages != manager.num_pages:
            raise ArgumentError("the pool and the manager differ in page size or page count")
        self.manager, self.pool, self.transport, self.identity = manager, pool, transport, identity
        self.policy: Policy = policy
        self.answer_timeout = float(answer_timeout)
        self.staging_pages = manager.max_pages_per_seq if staging_pages is None else staging_pages
        self.regions = register_pool(pool, transport)
        self._loads: dict[str, _Load] = {}
        self._staging: dict[str, _Staging] = {}
        self._results: list[LoadResult] = []
        self.counts = dict.fromkeys(("loaded", "recompute", "failed", "aborted", "ignored",
                                     "bytes_read", "descriptors"), 0)
        self.faults = TransferFaults()  # (fault injection only: all on)
        self._ended: dict[str, None] = {}  # transfers whose loads ended, oldest first

    @property
    def loading(self) -> tuple[Any, ...]:
        """Requests admitted here whose pages are still being loaded (do not schedule them)."""
        return tuple(ld.msg.request_id for ld in self._loads.values() if not ld.aborted)

    # -- receive -----------------------------------------------------------------------------

    def receive(self, offer: bytes | TransferMessage, now: float) -> Receiving:
        """Admit the offered request and start reading the pages this cache lacks; what was
        admitted and started (:class:`Receiving`).

        Raises, changing nothing: IncompatibleCacheError (naming the field), OutOfPagesError,
        ArgumentError (malformed offer, request id known here)."""
        msg = offer if isinstance(offer, TransferMessage) else TransferMessage.from_bytes(offer)
        self.identity.check(msg.identity)
        m, P, rid = self.manager, self.manager.page_size, msg.request_id
        if msg.transfer_id in self._loads or msg.transfer_id in self._ended:
            raise ArgumentError(f"transfer {msg.transfer_id!r} has already been received here; "
                                "a transfer is received once (nothing changed)")
        convert = not self.identity.same_storage(msg.identity) or not _same(
            static_scales_of(self.pool), msg.static_scales)
        if convert and msg.num_pages > self.staging_pages:
            raise ArgumentError(f"a load of {msg.num_pages} pages needs more than the "
                                f"{self.staging_pages} staging pages; raise staging_pages")
        admitted = m.admit(rid, msg.token_ids, msg.namespace)
        n, hits = msg.num_pages, admitted.num_cached_tokens // P
        if hits >= n:  # every page is here already: the sender's lease can end
            self._ended_now(msg.transfer_id)
            self._decline(msg)
            self._finish_result(LoadResult(rid, "loaded", hits * P), "loaded")
            return Receiving(msg.transfer_id, admitted, np.empty(0, dtype=np.int32), None)
        hold = m.lease(rid, hits, n)
        load = _Load(msg, hits, hold.pages, hold, float(now))
        try:
            if convert:
                load.staging = self._staging_for(msg.identity)
            self._start(load)
        except BaseException:
            m.end_lease(hold)
            m.release(rid)
            self._free_staging(load)
            raise
        self._loads[msg.transfer_id] = load
        return Receiving(msg.transfer_id, admitted, load.dst, load.handle)

    def _staging_for(self, identity: CacheIdentity) -> _Staging:
        key = repr(identity.to_json())
        st = self._staging.get(key)
        if st is None:
            pool = PagePool(identity.pool_spec(self.staging_pages, str(self.pool.device)))
            st = self._staging[key] = _Staging(pool, PageAllocator(self.staging_pages),
                                               register_pool(pool, self.transport))
        return st

    def _start(self, load: _Load) -> None:
        """Start the read (or leave the load waiting for staging pages)."""
        msg, lo, hi = load.msg, load.hits, load.msg.num_pages
        src_pages = msg.page_ids[lo:hi]
        if load.staging is None:
            dst_regions, dst_pages = self.regions, load.dst
        else:
            if not load.staging.free.can_allocate(hi - lo):
                return  # waiting
            load.staging_pages = load.staging.free.allocate(hi - lo)
            dst_regions, dst_pages = load.staging.regions, load.staging_pages
        local, remote = [], []
        for name, dst in dst_regions.items():
            r, d = paired_descs(msg.regions[name], src_pages, dst, dst_pages)
            remote.append(r)
            local.append(d)
        local_descs = np.concatenate(local)
        load.handle = self.transport.read(msg.sender, local_descs, np.concatenate(remote),
                                          confirm_bytes(msg.transfer_id, msg.tags))
        load.state = "reading"
        self.counts["bytes_read"] += int(local_descs[:, 1].sum())
        self.counts["descriptors"] += int(local_descs.shape[0])

    def _decline(self, msg: TransferMessage) -> None:
        """Tell the sender its lease can end (a confirm naming no tags)."""
        try:
            self.transport.notify(msg.sender, confirm_bytes(msg.transfer_id,
                                                            np.empty(0, dtype=np.int64)))
        except KVMemError as e:
            log.warning("kvmem transfer %s: could not decline: %s", msg.transfer_id, e)

    # -- poll --------------------------------------------------------------------------------

    def poll(self, now: float) -> list[LoadResult]:
        """Take notices (offers, answers), advance every load; the loads that finished."""
        for peer, data in self.transport.notices():
            self._notice(peer, data, now)
        for tid, load in list(self._loads.items()):
            self._advance(tid, load, now)
        out, self._results = self._results, []
        return out

    def _notice(self, peer: str, data: bytes, now: float) -> None:
        try:
            kind, head, arrays = parse_notice(data)
        except KVMemError as e:
            self.counts["ignored"] += 1
            log.warning("kvmem receiver: ignored a notice from %r: %s", peer, e)
            return
        if kind == "offer":
            msg = None
            try:
                msg = TransferMessage.from_parts(head, arrays)
                if self._duplicate(msg):
                    self.counts["ignored"] += 1
                    return
                self.receive(msg, now)
            except KVMemError as e:
                log.warning("kvmem receiver: refused an offer from %r: %s", peer, e)
                if msg is not None:
                    self._ended_now(msg.transfer_id)
                    self._decline(msg)
                    self._finish_result(LoadResult(msg.request_id, "failed", 0, str(e)),
                                        "failed")
            return
        load = self._loads.get(head["transfer_id"])
        if kind != "answer" or load is None or load.answer is not None or load.aborted:
            self.counts["ignored"] += 1  # a duplicate or late answer, or not ours
            return
        load.answer = (bool(head.get("ok")), str(head.get("reason", "")))

    def _duplicate(self, msg: TransferMessage) -> bool:
        """Whether an offer notice repeats one received here: its transfer is loading or has
        ended here, or its request is known here (loaded, or recomputing). Declining it would
        end the lease of the live load, a "failed" result would name a request that runs, and
        receiving it again would admit a finished request a second time."""
        if msg.transfer_id in self._loads or msg.transfer_id in self._ended:
            return True
        m, rid = self.manager, msg.request_id
        return rid in m.running or rid in m.preempted

    def _advance(self, tid: str, load: _Load, now: float) -> None:
        if load.state == "waiting":
            self._start(load)
        if load.state == "reading":
            assert load.handle is not None
            state = self.transport.state(load.handle)
            if state == "pending":
                return
            self.transport.release(load.handle)
            self._end_hold(load)  # final: no byte of this read moves any more
            if load.aborted:
                self._drop(tid, load)
                return
            if state == "failed" and not self.faults.fail_failed_reads:
                self._complete(tid, load)  # (fault) as if its bytes had moved
                return
            if state == "failed":
                self._fallback(tid, load, "the read failed")
                return
            if not self._digests_match(load):
                self._fallback(tid, load, "a page's bytes do not match its digest")
                return
            load.state = "confirming"
            if not self.faults.wait_for_answer:
                self._complete(tid, load)  # (fault) on the digests alone
                return
        if load.state == "confirming":
            if load.answer is None:
                if now - load.started > self.answer_timeout:
                    self._fallback(tid, load, "the sender did not answer")
                return
            ok, reason = load.answer
            if not ok:
                self._fallback(tid, load, f"the sender answered stale: {reason}")
                return
            self._complete(tid, load)

    def _digests_match(self, load: _Load) -> bool:
        msg, P = load.msg, self.manager.page_size
        lo, hi = load.hits, msg.num_pages
        if load.staging is None:
            pool, pages = self.pool, load.dst
        else:
            assert load.staging_pages is not None
            pool, pages = load.staging.pool, load.staging_pages
        tokens = msg.token_ids[lo * P : hi * P].reshape(hi - lo, P)
        found = pool_page_digests(pool, pages, tokens, msg.static_scales)
        return bool(np.array_equal(found, msg.page_digests[lo:hi]))

    def _complete(self, tid: str, load: _Load, count: bool = True) -> None:
        m, msg, P = self.manager, load.msg, self.manager.page_size
        rid, lo, hi = msg.request_id, load.hits, msg.num_pages
        if rid not in m.running or not np.array_equal(m.pages_of(rid)[lo:hi], load.dst):
            self._drop(tid, load)  # released behind the receiver's back
            self._finish_result(LoadResult(rid, "aborted", 0, "released during the load"),
                                "aborted")
            return
        slots = (load.dst.astype(np.int64)[:, None] * P + np.arange(P)).reshape(-1)
        if load.staging is not None:
            self._convert(load, slots)
        step = m.reserve([rid], (hi - lo) * P)
        if not np.array_equal(step.slot_mapping, slots):
            raise IntegrityError(f"request {rid!r}: reserve gave slots other than the pages "
                                 "the load filled")
        m.commit(rid, msg.token_ids[lo * P : hi * P])
        self._drop(tid, load)
        if count:
            self._finish_result(LoadResult(rid, "loaded", hi * P), "loaded")

    def _convert(self, load: _Load, slots: npt.NDArray[np.int64]) -> None:
        """Write the staged pages through this pool (quantized as a direct write would be)."""
        assert load.staging is not None and load.staging_pages is not None
        sp, msg = load.staging.pool, load.msg
        if sp.static_scales is not None and msg.static_scales is not None:
            sp.static_scales.copy_(torch.from_numpy(msg.static_scales.copy()))
        dtype = _READ_DTYPE.get(msg.identity.dtype, torch.float32)
        ids = torch.as_tensor(load.staging_pages.astype(np.int64))
        slot_t = torch.as_tensor(slots, device=self.pool.device)
        for layer in range(self.pool.spec.num_layers):
            kv = sp.read(layer, ids, dtype)
            if isinstance(kv, tuple):
                k, v = kv
                self.pool.write(layer, slot_t, k.reshape(-1, *k.shape[2:]),
                                v.reshape(-1, *v.shape[2:]))
            else:
                self.pool.write(layer, slot_t, kv.reshape(-1, kv.shape[-1]))

    # -- endings -----------------------------------------------------------------------------

    def _end_hold(self, load: _Load) -> None:
        if load.hold is not None:
            self.manager.end_lease(load.hold)
            load.hold = None

    def _free_staging(self, load: _Load) -> None:
        if load.staging is not None and load.staging_pages is not None:
            load.staging.free.free(load.staging_pages)
            load.staging_pages = None

    def _drop(self, tid: str, load: _Load) -> None:
        self._end_hold(load)
        self._free_staging(load)
        self._loads.pop(tid, None)
        self._ended_now(tid)

    def _ended_now(self, tid: str) -> None:
        """Remember that ``tid``'s load ended (the last REMEMBERED of them)."""
        self._ended[tid] = None
        if len(self._ended) > REMEMBERED:
            del self._ended[next(iter(self._ended))]

    def _finish_result(self, result: LoadResult, status: str) -> None:
        self.counts[status] += 1
        self._results.append(result)

    def _fallback(self, tid: str, load: _Load, reason: str) -> None:
        rid = load.msg.request_id
        log.warning("kvmem transfer %s: request %r falls back (%s): %s", tid, rid, self.policy,
                    reason)
        if (not self.faults.commit_checked_only and load.state != "waiting"
                and rid in self.manager.running):
            # (fault) the failed load's pages enter the prefix cache; the request is admitted
            # again by the engine, through them
            self._complete(tid, load, count=False)
            self.manager.release(rid)
            self._finish_result(LoadResult(rid, "recompute", 0, reason), "recompute")
            return
        self._drop(tid, load)
        if self.policy == "fail":
            self.manager.release(rid)
            self._finish_result(LoadResult(rid, "failed", 0, reason), "failed")
        else:
            self._finish_result(LoadResult(rid, "recompute",
                                           load.hits * self.manager.page_size, reason),
                                "recompute")

    def abort(self, request_id: Any) -> None:
        """Abort a loading request: released now; its destination pages stay leased until the
        read is final (a late byte lands only in a page nobody else holds), then go back."""
        found = [(tid, ld) for tid, ld in self._loads.items()
                 if ld.msg.request_id == request_id and not ld.aborted]
        if not found:
            raise ArgumentError(f"request {request_id!r} is not loading here")
        tid, load = found[0]
        self.manager.release(request_id)
        if load.state == "reading" and not self.faults.hold_until_final:
            self._end_hold(load)  # (fault) the destinations go back while bytes may land
        if load.state == "reading":
            load.aborted = True  # poll drops it once the read is final
        else:
            self._drop(tid, load)
        self.counts["aborted"] += 1


def _same(a: npt.NDArray[Any] | None, b: npt.NDArray[Any] | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None
                                         and np.array_equal(a, b))
