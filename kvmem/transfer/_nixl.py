"""NixlTransport: the :class:`~kvmem.transfer.Transport` contract over NIXL's UCX backend.

One NIXL agent per transport. ``nixl`` is imported when the first transport is made, so kvmem
imports without it (``pip install 'kvmem[transfer]'`` or ``pip install 'nixl>=1.5,<2'``; install
it after torch, or pip pulls a CUDA torch).

UCX picks its transports from ``UCX_TLS``, read once per process when the first agent starts.
Unless the caller set it, kvmem pins ``tcp,self`` (``DEFAULT_UCX_TLS``): it needs no permission a
container may lack. NIXL's UCX backend refuses the shared-memory transports (``posix``,
``sysv``: no peer-failure handler), and ``cma`` (``process_vm_readv``) reads between processes
on one host without a copy through a socket but needs ptrace rights over the peer
(``UCX_TLS=cma,tcp,self`` where those are granted). The value in force is logged and kept in
``NixlTransport.ucx_tls``.

Memory kind: one transport moves one kind, host memory ("DRAM", the default) or CUDA memory
("VRAM", ``memory="VRAM"``; the descriptors' device ids are CUDA ordinals). Each side's kind
travels in its :meth:`~NixlTransport.metadata`, so a host pool can read a device pool. The VRAM
path is NIXL's own; it is not tested on a CPU-only machine.

Progress: by default the agent has no background thread (NIXL's spins a core); it moves reads
and notices when :meth:`~NixlTransport.state` or :meth:`~NixlTransport.notices` is called.

Logging: NIXL's logging config prints INFO lines to stdout, where they would corrupt a program's
own output (``--json``). Unless the user chose a level with ``NIXL_LOG_LEVEL`` (the variable
NIXL's ``logging.py`` reads), the first transport of a process sets NIXL's ``"nixl"`` logger to
WARNING; a level set on that logger afterwards is the user's and stays.

Handles are ints. A read NIXL reports as "ERR" (the peer died, the remote range is not the
peer's registered memory, the connection broke) is ``"failed"``; one whose request NIXL refused
to make raises at :meth:`~NixlTransport.read`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError, ConfigError, KVMemError
from kvmem.transfer._transport import ReadState

__all__ = ["DEFAULT_UCX_TLS", "NixlTransport"]

log = logging.getLogger(__name__)
Descs = npt.NDArray[np.int64]
Memory = Literal["DRAM", "VRAM"]

DEFAULT_UCX_TLS = "tcp,self"
_nixl_log_level_set = False
_STATES: dict[str, ReadState] = {"DONE": "done", "PROC": "pending", "ERR": "failed"}


def _import_nixl() -> tuple[Any, Any, tuple[type[Exception], ...]]:
    """nixl's agent class, its config class and the exceptions its bindings raise."""
    try:
        from nixl import _bindings
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise ConfigError(
            f"the NIXL transport needs the nixl package ({e}); install it after torch, so that "
            "pip keeps the CPU or CUDA torch you have: pip install 'nixl>=1.5,<2' (or "
            "pip install 'kvmem[transfer]')"
        ) from e
    errors = tuple(
        v for k, v in vars(_bindings).items()
        if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type)
    )
    _quiet_nixl_logging()
    return nixl_agent, nixl_agent_config, errors


def _quiet_nixl_logging() -> None:
    """Once per process: NIXL's logger at WARNING unless ``NIXL_LOG_LEVEL`` names a level.
    Importing ``nixl._api`` has configured it (INFO, to stdout) and read the variable."""
    global _nixl_log_level_set
    if _nixl_log_level_set:
        return
    _nixl_log_level_set = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


def _descs(descs: npt.ArrayLike, name: str) -> Descs:
    d = np.asarray(descs)
    if d.ndim != 2 or d.shape[1] != 3 or d.shape[0] == 0 or d.dtype.kind not in "iu":
        raise ArgumentError(f"{name}: expected descriptors int64 [n, 3] with n >= 1, got "
                            f"{d.dtype} {d.shape}")
    d = np.ascontiguousarray(d, dtype=np.int64)
    if d[:, 0].min() <= 0 or d[:, 1].min() <= 0 or d[:, 2].min() < 0:
        raise ArgumentError(f"{name}: every row needs an address > 0, nbytes > 0 and a device "
                            "id >= 0")
    return d


class NixlTransport:
    """One NIXL agent (see the module docstring).

    Parameters
    ----------
    agent: this agent's name, unique among the agents that talk to each other.
    memory: the kind of memory this agent registers and reads into: "DRAM" or "VRAM".
    ucx_tls: UCX transports, set in ``UCX_TLS`` before the agent starts; default: the
        environment's ``UCX_TLS``, else ``DEFAULT_UCX_TLS``. Fixed per process once an agent
        has started.
    progress_thread: NIXL's background progress thread. Off (the default), the agent makes
        progress only inside this object's calls: a side whose memory is read over ``tcp`` must
        call :meth:`notices` (or :meth:`state`) while reads are expected, as a sender polling
        for confirmations does each step. On, reads are served with no call, at the cost of a
        core: NIXL's Python API runs the thread with no pause between polls.
    """

    name = "nixl"

    def __init__(self, agent: str, *, memory: Memory = "DRAM", ucx_tls: str | None = None,
                 progress_thread: bool = False) -> None:
        if memory not in ("DRAM", "VRAM"):
            raise ArgumentError(f"memory must be 'DRAM' or 'VRAM', got {memory!r}")
        nixl_agent, nixl_agent_config, self._errors = _import_nixl()
        os.environ["UCX_TLS"] = ucx_tls or os.environ.get("UCX_TLS") or DEFAULT_UCX_TLS
        self.ucx_tls = os.environ["UCX_TLS"]
        self.agent = agent
        self.memory: Memory = memory
        try:
            self._nixl = nixl_agent(agent, nixl_agent_config(
                enable_prog_thread=progress_thread, backends=["UCX"]))
        except self._errors as e:
            raise ConfigError(f"NIXL could not start agent {agent!r} with UCX_TLS="
                              f"{self.ucx_tls!r} ({type(e).__name__}): UCX needs a transport "
                              f"with peer-failure handling, e.g. {DEFAULT_UCX_TLS!r}") from e
        log.info("NIXL agent %r: UCX backend, UCX_TLS=%s, %s memory", agent, self.ucx_tls, memory)
        self._registered: list[Any] = []
        self._peers: dict[str, Memory] = {}
        self._reads: dict[int, tuple[Any, ReadState]] = {}
        self._next = 1
        self._closed = False

    def _open(self) -> None:
        if self._closed:
            raise KVMemError(f"NIXL agent {self.agent!r} is closed")

    def register(self, descs: Descs) -> None:
        """Register whole regions ``int64 [n, 3]`` for reads (call before :meth:`metadata`)."""
        self._open()
        d = _descs(descs, "descs")
        rows = [(int(a), int(n), int(dev), "") for a, n, dev in d.tolist()]
        try:
            self._registered.append(self._nixl.register_memory(rows, self.memory))
        except self._errors as e:
            raise ArgumentError(f"NIXL refused to register {len(rows)} {self.memory} regions "
                                f"({type(e).__name__}: {e})") from e

    def metadata(self) -> bytes:
        """This agent's memory kind and NIXL metadata (its registrations so far)."""
        self._open()
        return self.memory.encode() + bytes(self._nixl.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's :meth:`metadata`; returns the peer's agent name."""
        self._open()
        memory, md = bytes(metadata[:4]).decode(errors="replace"), bytes(metadata[4:])
        if memory not in ("DRAM", "VRAM"):
            raise ArgumentError("not a NixlTransport's metadata (it starts with DRAM or VRAM)")
        try:
            name = self._nixl.add_remote_agent(md)
        except self._errors as e:
            raise ArgumentError(f"NIXL refused the peer's metadata ({type(e).__name__}: {e})"
                                ) from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers[name] = memory  # type: ignore[assignment]
        return name

    def read(self, peer: str, local: Descs, remote: Descs, notice: bytes = b"") -> int:
        """Post a READ of ``remote`` (the peer's memory) into ``local``; ``notice`` reaches the
        peer when it completes. Raises if NIXL refuses to make the request."""
        self._open()
        if peer not in self._peers:
            raise ArgumentError(f"agent {self.agent!r} has no peer {peer!r} (add_peer first); "
                                f"peers: {sorted(self._peers)}")
        local, remote = _descs(local, "local"), _descs(remote, "remote")
        if local.shape != remote.shape or np.any(local[:, 1] != remote[:, 1]):
            raise ArgumentError(f"local and remote descriptors differ in rows or sizes: "
                                f"{local.shape} vs {remote.shape}")
        try:
            xfer = self._nixl.initialize_xfer(
                "READ",
                self._nixl.get_xfer_descs(local, self.memory),
                self._nixl.get_xfer_descs(remote, self._peers[peer]),
                peer,
                bytes(notice),
            )
        except self._errors as e:
            raise ArgumentError(
                f"NIXL refused a read of {len(remote)} ranges from {peer!r} "
                f"({type(e).__name__}: {e}): every remote row must lie in memory {peer!r} "
                "registered before its metadata was taken, every local row in this agent's"
            ) from e
        try:
            state = _STATES[self._nixl.transfer(xfer)]
        except self._errors as e:
            log.warning("NIXL read from %r failed to post: %s: %s", peer, type(e).__name__, e)
            state = "failed"
        handle, self._next = self._next, self._next + 1
        self._reads[handle] = (xfer, state)
        return handle

    def state(self, handle: int) -> ReadState:
        """"pending", "done" or "failed" (final)."""
        entry = self._reads.get(handle)
        if entry is None:
            raise ArgumentError(f"agent {self.agent!r} has no read {handle}")
        xfer, state = entry
        if state != "pending":
            return state
        try:
            state = _STATES[self._nixl.check_xfer_state(xfer)]
        except self._errors as e:
            log.warning("NIXL read %d failed: %s: %s", handle, type(e).__name__, e)
            state = "failed"
        if state != "pending":
            self._reads[handle] = (xfer, state)
        return state

    def release(self, handle: int) -> None:
        """Free a final read's NIXL request; a pending one is refused (nothing changes)."""
        if self.state(handle) == "pending":
            raise ArgumentError(f"read {handle} is pending; release it once state() is final")
        xfer, _ = self._reads.pop(handle)
        try:
            self._nixl.release_xfer_handle(xfer)
        except self._errors as e:
            log.warning("NIXL could not release read %d: %s: %s", handle, type(e).__name__, e)

    def notify(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer`` (a NIXL notification)."""
        self._open()
        if peer not in self._peers:
            raise ArgumentError(f"agent {self.agent!r} has no peer {peer!r} (add_peer first)")
        try:
            self._nixl.send_notif(peer, bytes(message))
        except self._errors as e:
            raise KVMemError(f"NIXL could not send a notice to {peer!r} "
                             f"({type(e).__name__}: {e})") from e

    def notices(self) -> list[tuple[str, bytes]]:
        """Notices received since the last call, in arrival order per sender."""
        self._open()
        new = self._nixl.get_new_notifs()
        return [(str(sender), bytes(m)) for sender, msgs in new.items() for m in msgs]

    def close(self) -> None:
        """Release final reads, deregister memory, drop peers. Pending reads are left to NIXL
        (it cancels what it can when the agent goes)."""
        if self._closed:
            return
        for handle in list(self._reads):
            if self.state(handle) != "pending":
                self.release(handle)
        for reg in self._registered:
            try:
                self._nixl.deregister_memory(reg)
            except self._errors as e:
                log.warning("NIXL could not deregister memory: %s: %s", type(e).__name__, e)
        for peer in self._peers:
            try:
                self._nixl.remove_remote_agent(peer)
            except self._errors as e:
                log.warning("NIXL could not drop peer %r: %s: %s", peer, type(e).__name__, e)
        self._closed = True
        self._reads.clear()
        self._registered.clear()
        self._peers.clear()
        del self._nixl
