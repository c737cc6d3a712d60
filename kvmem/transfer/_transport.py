"""What kvmem needs from a transport: one-sided reads of registered memory, and small notices.

A transport moves bytes between *agents* (one per process, or several in one process for tests).
Each agent registers the memory it serves or receives into (a pool's storage tensors, a staging
buffer), hands its metadata to a peer out of band (a pipe, a socket: the engine's choice), and
then the decode side READs page runs from the prefill side's memory into its own. Small control
messages (the transfer message, confirmations) travel as notices between the same agents.

Descriptors are numpy arrays, one row per contiguous byte range::

    descs  int64 [n, 3]   (address, nbytes, device id)   device id: 0 for host memory,
                                                        the CUDA ordinal for device memory

The local and remote descriptor lists of one read have the same length and row ``i`` of each has
the same ``nbytes``: row ``i`` of the remote list lands in row ``i`` of the local list. The
device id alone does not tell host memory from CUDA device 0: a transport knows a row's memory
kind from the registered region it falls in (every row of a read lies inside one).

kvmem builds the descriptors (``kvmem.transfer.page_descs`` / ``paired_descs``, merged where
contiguous), registers whole tensors once (``tensor_descs``), and sends one read per load, whose
``notice`` is the receiver's confirm (see docs/disaggregation.md).

Two implementations: :class:`~kvmem.transfer.InProcessTransport` (a memmove between agents of
one process: unit tests) and :class:`~kvmem.transfer.NixlTransport` (NIXL over UCX: two
processes, or two machines).
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["ReadState", "Transport"]

ReadState = Literal["pending", "done", "failed"]
Descs = npt.NDArray[np.int64]


class Transport(Protocol):
    """One agent's view of a transport (see the module docstring for the descriptor format)."""

    name: str  # "nixl", "inprocess": what carried the pages
    agent: str  # this agent's name, unique among the agents that talk to each other

    def register(self, descs: Descs) -> None:
        """Make ``descs`` (whole regions: a tensor's storage, a buffer) readable by peers."""
        ...

    def metadata(self) -> bytes:
        """What a peer passes to :meth:`add_peer` to reach this agent's registered memory."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Connect to the agent that produced ``metadata``; returns its name."""
        ...

    def read(self, peer: str, local: Descs, remote: Descs, notice: bytes = b"") -> int:
        """Start reading ``remote`` (peer's memory) into ``local``; returns a handle.

        ``notice``, when given, reaches ``peer`` once the read has completed (it is how the
        sender learns that its pages were read). A read that cannot start raises; a read that
        fails later reports ``"failed"`` from :meth:`state`.
        """
        ...

    def state(self, handle: int) -> ReadState:
        """Where the read stands. ``"done"`` and ``"failed"`` are final: no byte moves after."""
        ...

    def release(self, handle: int) -> None:
        """Forget a finished read (``state`` not ``"pending"``); raises on a pending one."""
        ...

    def notify(self, peer: str, message: bytes) -> None:
        """Send a small control message to ``peer``."""
        ...

    def notices(self) -> list[tuple[str, bytes]]:
        """Notices received since the last call, as ``(sender, message)`` in arrival order."""
        ...

    def close(self) -> None:
        """Deregister memory and drop peers; the agent cannot be used after."""
        ...
