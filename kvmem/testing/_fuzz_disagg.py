"""The disaggregated engine: the reference engine as the decode side, fed by a prefill side over
a real transport (``kvmem fuzz --engine disagg``).

::

    prefill side (source_manager)            decode side (manager: ManagerEngine's)
    KVCacheManager + PagePool, no cache      KVCacheManager + PagePool, prefix cache
    Sender (leases)                          Receiver (policy "recompute")
    InProcessTransport "prefill<k>"  <-----  InProcessTransport "decode"
                                     read    (hold_reads: a read lands on the ``transfer`` move)
              notices in flight both ways (hold_notices: the ``notice`` move)

    receive   the prefill side computes the prompt (each slot's K/V value written exactly into
              its pool), exports it under a lease and releases the request; the receiver admits
              it and starts one read: a transfer Launch of the destination pages it fills
    transfer  the read completes (``land``): the values the decode pool holds now
    notice    a notice in flight (confirm, answer) is delivered, lost or duplicated
    expire    the clock passes the lease term and the answer timeout
    kill      the prefill side dies (its agent closes: reads from it fail); a fresh one starts
    (every move that can change a load polls both sides; a load that ends hands its request to
    the decode scheduler: "loaded" resumes after the loaded pages, "recompute" prefills the rest)

A slot's K/V value (one int64) is stored as four 16-bit chunks in the K vector of a float32
pool (one layer, one head of dimension 4), so a transfer moves it exactly and the fuzzer
reads back what really moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from kvmem.cuda import PagePool, PoolSpec
from kvmem.testing._fuzz_manager import ManagerEngine
from kvmem.testing._fuzz_protocol import FuzzConfig
from kvmem.testing._fuzz_slots import RECEIVING, RUNNING, WAITING
from kvmem.testing._kv_values import kv_value_array, namespace_key
from kvmem.testing._launch import Launch, RequestSpec
from kvmem.testing._oracles import FuzzFailure
from kvmem.transfer import (
    CacheIdentity,
    InProcessHub,
    InProcessTransport,
    LoadResult,
    Receiver,
    Sender,
    TransferFaults,
    TransferMessage,
)

__all__ = ["DisaggEngine"]

Int64Array = npt.NDArray[np.int64]

LEASE_S = 10.0  # the sender's lease term and the receiver's answer timeout (seconds)
_SHIFTS = np.array([0, 16, 32, 48], dtype=np.uint64)


def _pool_spec(config: FuzzConfig) -> PoolSpec:
    return PoolSpec(num_layers=1, num_pages=config.num_pages, page_size=config.page_size,
                    num_kv_heads=1, head_dim=4, dtype="fp32", device="cpu")


def write_values(pool: PagePool, slots: Int64Array, values: Int64Array) -> None:
    """Store ``values`` (``[T]`` int64) in ``slots`` (``[T]``) of layer 0, exactly."""
    chunks = (values.view(np.uint64)[:, None] >> _SHIFTS) & np.uint64(0xFFFF)
    k = torch.from_numpy(chunks.astype(np.float32)).reshape(-1, 1, 4)
    pool.write(0, torch.from_numpy(slots.astype(np.int64)), k, torch.zeros_like(k))


def read_values(pool: PagePool, slots: Int64Array) -> Int64Array:
    """The int64 values ``slots`` (``[T]``) of layer 0 hold: ``[T]``."""
    P = pool.spec.page_size
    k = pool.data[0, slots // P, 0, slots % P, 0].numpy()  # [T, 4] float32
    return (k.astype(np.uint64) << _SHIFTS).sum(axis=1, dtype=np.uint64).view(np.int64)


class _PrefillSide:
    """One prefill process: a manager without a prefix cache, its pool, agent and sender."""

    def __init__(self, config: FuzzConfig, name: str, hub: InProcessHub,
                 identity: CacheIdentity, faults: TransferFaults, decode: InProcessTransport,
                 max_pages_per_seq: int) -> None:
        from kvmem.manager import KVCacheManager

        self.manager = KVCacheManager(config.num_pages, page_size=config.page_size,
                                      max_seqs=config.max_seqs,
                                      max_pages_per_seq=max_pages_per_seq, prefix_cache=None,
                                      watermark=0.0)
        self.pool = PagePool(_pool_spec(config))
        self.transport = InProcessTransport(name, hub)
        self.transport.hold_notices = True
        self.sender = Sender(self.manager, self.pool, self.transport, identity, LEASE_S)
        self.sender.faults = faults
        self.transport.add_peer(decode.metadata())
        decode.add_peer(self.transport.metadata())

    def offer(self, spec: RequestSpec, namespace: Any, now: float) -> bytes:
        """Compute ``spec``'s prompt, export it under a lease, release the request."""
        m, rid, prompt = self.manager, spec.request_id, spec.prompt
        m.admit(rid, prompt, namespace)
        step = m.reserve((rid,), spec.prompt_len)
        write_values(self.pool, step.slot_mapping,
                     kv_value_array(namespace_key(spec.namespace), prompt))
        m.commit(rid, prompt)
        offer = self.sender.export(rid, now)
        m.release(rid)  # the prefill is done: the lease alone holds the pages
        return offer


class DisaggEngine(ManagerEngine):
    """The reference engine as the decode side of P/D disaggregation (see the module docstring).

    Attributes
    ----------
    faults: the :class:`~kvmem.transfer.TransferFaults` its sender and receiver share
    now: the clock (seconds; the ``expire`` move advances it)
    """

    name: ClassVar[str] = "disagg"
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {"fork", "preempt", "resume", "receive", "clear", "transport", "leases", "kill",
         "notices"})

    def __init__(self, config: FuzzConfig) -> None:
        super().__init__(config)
        self.hub = InProcessHub()
        self.faults = TransferFaults()
        self.now = 0.0
        spec = _pool_spec(config)
        self.identity = CacheIdentity.of(spec, "fuzz", "w0")
        self.pool = PagePool(spec)
        self.transport = InProcessTransport("decode", self.hub)
        self.transport.hold_reads = self.transport.hold_notices = True
        self.receiver = Receiver(self.manager, self.pool, self.transport, self.identity,
                                 answer_timeout=LEASE_S)
        self.receiver.faults = self.faults
        self.reads: dict[Launch, int | None] = {}  # transfer op -> its read (None: no bytes)
        self.expiries: dict[str, float] = {}  # offer -> its lease expiry
        self.started: dict[Any, float] = {}  # loading request -> when its load started
        self.kills = 0
        self._start_prefill()

    def _start_prefill(self) -> None:
        self.prefill = _PrefillSide(self.config, f"prefill{self.kills}", self.hub,
                                    self.identity, self.faults, self.transport,
                                    self.manager.max_pages_per_seq)
        self.source_manager = self.prefill.manager

    # -- the transfer ------------------------------------------------------------------------

    def receive(self, spec: RequestSpec) -> Launch | None:
        mgr, P, rid = self.manager, self.manager.page_size, spec.request_id
        ns = self._namespace(spec)
        prompt = spec.prompt
        if not (mgr.can_admit(prompt, ns) and self.prefill.manager.can_admit(prompt, ns)):
            return None
        offer = self.prefill.offer(spec, ns, self.now)
        msg = TransferMessage.from_bytes(offer)
        self.expiries[msg.transfer_id] = msg.lease_expiry
        s = self._new_slot(spec)
        match = self.values.lookup(prompt, ns)
        got = self.receiver.receive(offer, self.now)
        cached = self.values.admitted(s, rid, prompt, match, got.admitted)
        self.sched[s] = self.comm[s] = cached
        self._start_running(s)
        self.state[s] = RECEIVING
        lo, hi = cached // P, cached // P + got.pages.size
        slots = (got.pages.astype(np.int64)[:, None] * P + np.arange(P)).reshape(-1)
        # The read writes the destination pages (the receiver's lease holds them) and reads no
        # page here: an empty CSR (the admission told the fuzzer what the request maps).
        op = Launch((rid,), [lo * P], [(hi - lo) * P], [0, 0], np.empty(0, dtype=np.int64),
                    slots, kind="transfer", source_pages=msg.page_ids[lo:hi],
                    source_tags=msg.tags[lo:hi])
        self.busy[s] += 1
        self.ops[op] = (None, np.array([s], dtype=np.int64), self.inc[[s]].copy())
        self.reads[op] = got.handle
        if got.handle is not None:
            self.started[rid] = self.now
        return op

    def land(self, op: Launch) -> tuple[bool, Any]:
        handle = self.reads.pop(op)
        ok = True
        if handle is not None:
            if self.transport.state(handle) == "pending":
                self.transport.complete(handle)
            ok = self.transport.state(handle) == "done"
        return ok, read_values(self.pool, op.slot_mapping)

    def finish(self, op: Launch) -> Sequence[Any]:
        if op.kind != "transfer":
            return super().finish(op)
        _, slots, _ = self.ops.pop(op)
        self._release_ops(slots)
        self._poll()
        return []

    def _poll(self) -> None:
        """Both sides take their notices and advance; the loads that ended join the batch."""
        self.prefill.sender.poll(self.now)
        for result in self.receiver.poll(self.now):
            self._load_ended(result)
        open_ = set(self.prefill.sender.open_transfers)
        self.expiries = {t: e for t, e in self.expiries.items() if t in open_}

    def _load_ended(self, result: LoadResult) -> None:
        rid, k = result.request_id, result.num_computed_tokens
        self.started.pop(rid, None)
        s = self.slot_of.get(rid)
        if s is None or self.state[s] != RECEIVING:
            return  # aborted meanwhile
        mgr, P = self.manager, self.manager.page_size
        if result.status == "loaded":
            c = int(self.comm[s])
            if k > c:  # the receiver reserved and committed the loaded pages
                pages = mgr.pages_of(rid)[: k // P].astype(np.int64)
                slots = (pages[c // P :, None] * P + np.arange(P)).reshape(-1)
                self.values.reserved(np.array([s]), np.array([c]), np.array([k - c]),
                                     np.array([0, pages.size]), pages, slots, np.array([k]),
                                     np.array([k - c]), np.empty(0, dtype=np.int64))
        elif result.status != "recompute":
            raise FuzzFailure("engine", f"the load of {rid!r} ended {result.status!r} under "
                              f"the recompute policy: {result.reason}")
        elif rid not in mgr.running:  # released for a fresh admission
            self.order.remove(s)
            self._order_arr = None
            self.state[s] = WAITING
            self.inc[s] += 1
            self.sched[s] = self.comm[s] = 0
            self.waiting.appendleft(s)
            return
        self.sched[s] = self.comm[s] = k
        self.state[s] = RUNNING

    # -- other moves -------------------------------------------------------------------------

    def launch(self, choice: int) -> Launch | None:
        self._poll()  # (the engine's loop takes its transfers' news before it schedules)
        return super().launch(choice)

    def abort(self, request_id: Any) -> None:
        s = self.slot_of.get(request_id)
        if (s is not None and self.state[s] == RECEIVING
                and request_id in self.receiver.loading):
            self.receiver.abort(request_id)
            self.started.pop(request_id, None)
            self._drop_slot(s)
            return
        super().abort(request_id)

    def expire(self, choice: int) -> bool:
        self.now += LEASE_S + 1
        self._poll()
        return True

    def kill(self, choice: int) -> bool:
        self.prefill.transport.close()
        self.expiries.clear()
        self.kills += 1
        self._start_prefill()
        self._poll()
        return True

    def _held(self) -> list[tuple[InProcessTransport, int]]:
        return [(t, i) for t in (self.transport, self.prefill.transport)
                for i in range(len(t.in_flight))]

    def notice(self, a: int, b: int) -> bool:
        held = self._held()
        if not held:
            return False
        agent, i = held[a % len(held)]
        how = b % 4  # 0, 1: delivered; 2: lost; 3: duplicated
        (agent.deliver if how < 2 else agent.drop if how == 2 else agent.duplicate)(i)
        self._poll()
        return True

    def notices_in_flight(self) -> int:
        return len(self._held())

    def waiting_on_clock(self) -> bool:
        loading = set(self.receiver.loading)
        return (any(e > self.now for e in self.expiries.values())
                or any(t + LEASE_S >= self.now for r, t in self.started.items()
                       if r in loading))
