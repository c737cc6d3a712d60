"""InProcessTransport: the :class:`~kvmem.transfer.Transport` contract between agents of one
process (unit tests), over host memory with ``ctypes.memmove``.

Agents find each other in a registry by name (:class:`InProcessHub`; one default hub per
process). A read checks that every remote row lies in memory the peer registered and every
local row in memory this agent registered, then copies at once and is ``"done"``; its notice is
then put in the peer's inbox. Device memory is not supported (the rows' device id must be 0).

Public knobs make the faults a real transport has, for tests:

    hold_reads = True      new reads stay "pending" until complete(handle, ok) moves their
                           bytes ("done") or fails them ("failed", no byte moved)
    hold_notices = True    notices sent to this agent wait in ``in_flight`` until deliver(i)
                           puts one in the inbox, drop(i) loses it, or duplicate(i) delivers
                           it and keeps it in flight (to arrive again)
    close()                a closed peer: its pending reads fail when completed, new reads
                           to it raise
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError, KVMemError
from kvmem.transfer._transport import ReadState

__all__ = ["InProcessHub", "InProcessTransport"]

log = logging.getLogger(__name__)
Descs = npt.NDArray[np.int64]


@dataclass
class InProcessHub:
    """The agents of one process, by name."""

    agents: dict[str, InProcessTransport] = field(default_factory=dict)


_HUB = InProcessHub()


def _descs(descs: npt.ArrayLike, name: str) -> Descs:
    d = np.asarray(descs)
    if d.ndim != 2 or d.shape[1] != 3 or d.dtype.kind not in "iu":
        raise ArgumentError(f"{name}: expected descriptors int64 [n, 3], got {d.dtype} "
                            f"{d.shape}")
    d = d.astype(np.int64)
    if d.size and (d[:, 1].min() < 0 or d[:, 0].min() < 0):
        raise ArgumentError(f"{name}: negative address or size")
    return d


@dataclass
class _Read:
    peer: str
    local: Descs
    remote: Descs
    notice: bytes
    state: ReadState = "pending"


class InProcessTransport:
    """One agent of the in-process transport (see the module docstring).

    Parameters
    ----------
    agent: this agent's name, unique in ``hub``.
    hub: the registry of agents (default: one per process).
    """

    name = "inprocess"

    def __init__(self, agent: str, hub: InProcessHub | None = None) -> None:
        self.hub = _HUB if hub is None else hub
        if agent in self.hub.agents:
            raise ArgumentError(f"an in-process agent named {agent!r} exists; names are unique")
        self.agent = agent
        self.hub.agents[agent] = self
        self.regions = np.empty((0, 3), dtype=np.int64)
        self.peers: set[str] = set()
        self.hold_reads = False
        self.hold_notices = False
        self.in_flight: list[tuple[str, bytes]] = []  # notices held (hold_notices)
        self.closed = False
        self._reads: dict[int, _Read] = {}
        self._next = 1
        self._inbox: list[tuple[str, bytes]] = []

    def _open(self) -> None:
        if self.closed:
            raise KVMemError(f"agent {self.agent!r} is closed")

    def register(self, descs: Descs) -> None:
        self._open()
        self.regions = np.concatenate([self.regions, _descs(descs, "descs")])

    def metadata(self) -> bytes:
        return self.agent.encode()

    def add_peer(self, metadata: bytes) -> str:
        self._open()
        name = bytes(metadata).decode()
        if name not in self.hub.agents:
            raise ArgumentError(f"no in-process agent named {name!r}")
        self.peers.add(name)
        return name

    def _peer(self, peer: str) -> InProcessTransport:
        agent = self.hub.agents.get(peer)
        if peer not in self.peers or agent is None or agent.closed:
            raise KVMemError(f"agent {self.agent!r}: peer {peer!r} is not connected (add_peer) "
                             "or has closed")
        return agent

    def read(self, peer: str, local: Descs, remote: Descs, notice: bytes = b"") -> int:
        self._open()
        other = self._peer(peer)
        local, remote = _descs(local, "local"), _descs(remote, "remote")
        if local.shape != remote.shape or np.any(local[:, 1] != remote[:, 1]):
            raise ArgumentError("local and remote descriptors differ in rows or sizes")
        _require_inside(local, self.regions, f"agent {self.agent!r}'s")
        _require_inside(remote, other.regions, f"agent {peer!r}'s")
        handle = self._next
        self._next += 1
        self._reads[handle] = _Read(peer, local, remote, bytes(notice))
        if not self.hold_reads:
            self.complete(handle)
        return handle

    def complete(self, handle: int, ok: bool = True) -> None:
        """Finish a pending read: copy its bytes and send its notice (``ok``), or fail it. A
        read from a peer that closed meanwhile fails."""
        r = self._reads.get(handle)
        if r is None or r.state != "pending":
            raise ArgumentError(f"read {handle} is not pending")
        other = self.hub.agents.get(r.peer)
        if not ok or other is None or other.closed:
            r.state = "failed"
            return
        for (dst, n, _), (src, _, _) in zip(r.local.tolist(), r.remote.tolist(), strict=True):
            ctypes.memmove(dst, src, n)
        r.state = "done"
        if r.notice:
            other._post(self.agent, r.notice)

    @property
    def pending(self) -> list[int]:
        """Handles of the reads not finished."""
        return [h for h, r in self._reads.items() if r.state == "pending"]

    def state(self, handle: int) -> ReadState:
        r = self._reads.get(handle)
        if r is None:
            raise ArgumentError(f"agent {self.agent!r} has no read {handle}")
        return r.state

    def release(self, handle: int) -> None:
        if self.state(handle) == "pending":
            raise ArgumentError(f"read {handle} is pending; release it once it is final")
        del self._reads[handle]

    def notify(self, peer: str, message: bytes) -> None:
        self._open()
        self._peer(peer)._post(self.agent, bytes(message))

    def _post(self, sender: str, message: bytes) -> None:
        (self.in_flight if self.hold_notices else self._inbox).append((sender, message))

    def notices(self) -> list[tuple[str, bytes]]:
        out, self._inbox = self._inbox, []
        return out

    def _held(self, i: int) -> tuple[str, bytes]:
        if not 0 <= i < len(self.in_flight):
            raise ArgumentError(f"agent {self.agent!r} holds {len(self.in_flight)} notices in "
                                f"flight; there is no notice {i}")
        return self.in_flight[i]

    def deliver(self, i: int = 0) -> None:
        """Held notice ``i`` (``in_flight[i]``) arrives: it leaves the flight for the inbox."""
        self._inbox.append(self._held(i))
        del self.in_flight[i]

    def drop(self, i: int = 0) -> None:
        """Held notice ``i`` is lost."""
        self._held(i)
        del self.in_flight[i]

    def duplicate(self, i: int = 0) -> None:
        """Held notice ``i`` arrives, and a copy of it stays in flight."""
        self._inbox.append(self._held(i))

    def close(self) -> None:
        """Drop this agent: peers' pending reads from it fail when completed."""
        self.closed = True
        self.regions = np.empty((0, 3), dtype=np.int64)
        if self.hub.agents.get(self.agent) is self:
            del self.hub.agents[self.agent]


def _require_inside(descs: Descs, regions: Descs, whose: str) -> None:
    """Raise unless every row lies inside one registered region of the same device."""
    if len(descs) == 0:
        return
    if len(regions) == 0:
        raise ArgumentError(f"{whose} memory has no registered region")
    if np.any(descs[:, 2] != 0):
        raise ArgumentError("the in-process transport moves host memory only (device id 0)")
    start, end = descs[:, 0], descs[:, 0] + descs[:, 1]
    r0, r1 = regions[:, 0], regions[:, 0] + regions[:, 1]
    inside = (start[:, None] >= r0[None, :]) & (end[:, None] <= r1[None, :])
    if not inside.any(axis=1).all():
        bad = int(np.flatnonzero(~inside.any(axis=1))[0])
        raise ArgumentError(f"descriptor row {bad} ({start[bad]:#x}, {descs[bad, 1]} B) is "
                            f"outside {whose} registered memory")
