"""Peer: a second process for two-process tests, examples and benchmarks.

The child is started with multiprocessing's "spawn" context (a fresh interpreter: no forked
NIXL or torch state) and runs ``target(conn, *args)``; ``conn`` is its end of a Pipe, over
which the two sides swap agent metadata out of band and the child returns results::

    def serve(conn, num_pages):              # module level: spawn imports it by name
        t = NixlTransport("prefill")
        ...
        conn.send(t.metadata())
        conn.recv()                          # wait for "done"

    with Peer(serve, 64) as peer:
        name = transport.add_peer(peer.recv())
        ...
        peer.send("done")

An exception in the child comes back as a :class:`PeerError` with the child's traceback from the
next :meth:`Peer.recv`; a child that exits or stays silent past the timeout raises there too,
so a test never hangs on a dead peer.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any

from kvmem.errors import KVMemError

__all__ = ["Peer", "PeerError"]


class PeerError(KVMemError):
    """The peer process raised, exited, or sent nothing in time."""


class _Raised:
    def __init__(self, text: str) -> None:
        self.text = text


def _run(target: Callable[..., Any], conn: Connection, args: tuple[Any, ...]) -> None:
    try:
        target(conn, *args)
    except BaseException:
        conn.send(_Raised(traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()


class Peer:
    """A child process running ``target(conn, *args)`` (see the module docstring).

    timeout: seconds :meth:`recv` waits by default (a fresh interpreter that imports torch and
    nixl takes a few seconds to send its first message).
    """

    def __init__(self, target: Callable[..., Any], *args: Any, timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.timeout = timeout
        self.process = ctx.Process(target=_run, args=(target, child_conn, args), daemon=True)
        self.process.start()
        child_conn.close()

    def send(self, obj: Any) -> None:
        """Send a picklable object to the child."""
        self.conn.send(obj)

    def recv(self, timeout: float | None = None) -> Any:
        """The child's next message; raises :class:`PeerError` if it raised, exited or sent
        nothing within ``timeout`` seconds (default: the peer's)."""
        wait = self.timeout if timeout is None else timeout
        # The child's exit ends the wait too: a child that dies before it unpickles its end of
        # the pipe (an import error in the spawned interpreter) never closes that end.
        mp_wait([self.conn, self.process.sentinel], wait)
        try:
            ready = self.conn.poll(0)
            msg = self.conn.recv() if ready else None
        except (EOFError, OSError):
            ready, msg = False, None
        if isinstance(msg, _Raised):
            raise PeerError(f"the peer process raised:\n{msg.text}")
        if not ready:
            self.process.join(0.5)
            code = self.process.exitcode
            if code is not None:
                raise PeerError(f"the peer process exited with code {code} before it sent a "
                                "message (its stderr says why)")
            raise PeerError(f"no message from the peer process in {wait} s; it is still running")
        return msg

    def kill(self) -> None:
        """SIGKILL the child (no cleanup in it) and reap it."""
        self.process.kill()
        self.process.join(10)

    def close(self, timeout: float = 10.0) -> int | None:
        """Wait up to ``timeout`` s for the child to exit, kill it if it has not; its exit code."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self.conn.close()
        return self.process.exitcode

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
