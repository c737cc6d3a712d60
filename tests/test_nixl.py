"""NixlTransport between two real processes (NIXL over UCX, ``UCX_TLS=tcp,self``).

A spawned "prefill" process registers a pool-shaped tensor ``[L, P, page_bytes]`` and serves
commands over a pipe; it hands over its :class:`Region`, from which this process's "decode"
agent computes both sides' descriptors (as a receiver does) and reads page runs. A stopped peer
(SIGSTOP) cannot serve a tcp read, so a read to it stays pending for as long as the test needs:
that is how the tests hold a read in flight without a timed race.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvmem.errors import ArgumentError, ConfigError, KVMemError
from kvmem.transfer._descs import Region, page_descs, paired_descs, tensor_descs
from kvmem.transfer._peer import Peer, PeerError

try:
    import nixl._api  # noqa: F401

    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False

needs_nixl = pytest.mark.skipif(
    not HAVE_NIXL, reason="nixl is not installed (pip install 'nixl>=1.5,<2' after torch)")

L, P, PAGE_BYTES = 3, 32, 1024
ROOT = Path(__file__).resolve().parents[1]  # the kvmem under test, for child interpreters
WAIT = 30.0  # seconds: a generous bound on anything that should take milliseconds


def serve(conn: Connection, agent: str, seed: int) -> None:
    """The prefill process: register random pages, then answer commands until "stop"."""
    from kvmem.transfer import NixlTransport

    transport = NixlTransport(agent)
    pages = torch.randint(0, 256, (L, P, PAGE_BYTES), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
    transport.register(tensor_descs(pages))
    conn.send((transport.metadata(), Region.of(pages), pages.numpy().copy()))
    inbox: list[tuple[str, bytes]] = []
    while True:
        while not conn.poll(0.0005):  # a sender polls its notices: that serves tcp reads too
            inbox += transport.notices()
        cmd, *args = conn.recv()
        if cmd == "stop":
            transport.close()
            return
        if cmd == "peer":
            conn.send(transport.add_peer(args[0]))
        elif cmd == "notices":  # the notices so far, or wait for the first
            # (_wait_notices returns the inbox itself when it holds some: adding it to itself
            # sent a notice that arrived while idle twice)
            inbox = _wait_notices(transport, inbox)
            conn.send(inbox)
            inbox = []
        elif cmd == "echo":  # wait for a notice and send it back, reversed
            (sender, msg), *_ = _wait_notices(transport, inbox)
            inbox = []
            transport.notify(sender, msg[::-1])
            conn.send(None)


def _wait_notices(transport: Any, inbox: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    deadline = time.monotonic() + WAIT
    if inbox:
        return inbox
    while time.monotonic() < deadline:
        got = transport.notices()
        if got:
            return list(got)
        time.sleep(0.001)
    return []


def _wait_final(transport: Any, handle: int) -> str:
    deadline = time.monotonic() + WAIT
    while (state := transport.state(handle)) == "pending" and time.monotonic() < deadline:
        time.sleep(0.001)
    return str(state)


class Prefill:
    """The prefill peer as the decode side sees it."""

    def __init__(self, decode: Any, agent: str, seed: int) -> None:
        self.peer = Peer(serve, agent, seed)
        metadata, self.region, self.pages = self.peer.recv()
        self.name = decode.add_peer(metadata)
        self.ask("peer", decode.metadata())

    def ask(self, *cmd: Any) -> Any:
        self.peer.send(cmd)
        return self.peer.recv()

    def stop(self) -> None:
        if self.peer.process.is_alive():
            self.peer.send(("stop",))
        self.peer.close()


@pytest.fixture(scope="module")
def decode() -> Iterator[Any]:
    from kvmem.transfer import NixlTransport

    transport = NixlTransport("decode", ucx_tls="tcp,self")
    transport.pages = torch.zeros((L, P, PAGE_BYTES), dtype=torch.uint8)
    transport.register(tensor_descs(transport.pages))
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def prefill(decode: Any) -> Iterator[Prefill]:
    side = Prefill(decode, "prefill", seed=1)
    yield side
    side.stop()


def _read(decode: Any, prefill: Prefill, src: np.ndarray, dst: np.ndarray, merge: bool = True,
          notice: bytes = b"") -> int:
    remote, local = paired_descs(prefill.region, src, Region.of(decode.pages), dst, merge)
    return int(decode.read(prefill.name, local, remote, notice))


@needs_nixl
@pytest.mark.parametrize("merge", [True, False])
def test_page_runs_arrive_byte_exact_and_nothing_else_changes(decode: Any, prefill: Prefill,
                                                              merge: bool) -> None:
    decode.pages.zero_()
    src = np.array([3, 4, 5, 9, 0, 1, 31])
    dst = np.array([10, 11, 12, 1, 20, 22, 0])  # 20 -> 22 breaks the run 0, 1 on this side
    handle = _read(decode, prefill, src, dst, merge)
    assert _wait_final(decode, handle) == "done"
    got = decode.pages.numpy()
    assert np.array_equal(got[:, dst], prefill.pages[:, src])
    untouched = np.setdiff1d(np.arange(P), dst)
    assert not got[:, untouched].any()
    decode.release(handle)
    with pytest.raises(ArgumentError):
        decode.state(handle)


@needs_nixl
def test_a_reads_notice_reaches_the_target(decode: Any, prefill: Prefill) -> None:
    handle = _read(decode, prefill, np.array([7]), np.array([7]), notice=b"read 7 done")
    assert _wait_final(decode, handle) == "done"
    assert prefill.ask("notices") == [("decode", b"read 7 done")]
    decode.release(handle)


@needs_nixl
def test_notices_round_trip(decode: Any, prefill: Prefill) -> None:
    prefill.peer.send(("echo",))
    decode.notify(prefill.name, b"ping 1")
    assert prefill.peer.recv() is None
    deadline = time.monotonic() + WAIT
    got: list[tuple[str, bytes]] = []
    while not got and time.monotonic() < deadline:
        got = decode.notices()
    assert got == [("prefill", b"1 gnip")]


@needs_nixl
def test_release_refuses_a_pending_read_and_takes_it_once_final(decode: Any,
                                                                prefill: Prefill) -> None:
    """A stopped peer cannot serve a tcp read: the read stays pending until it runs again."""
    decode.pages.zero_()
    local = page_descs(Region.of(decode.pages), np.arange(8))
    remote = page_descs(prefill.region, np.arange(8))
    os.kill(prefill.peer.process.pid, signal.SIGSTOP)
    try:
        handle = decode.read(prefill.name, local, remote)
        assert decode.state(handle) == "pending"
        with pytest.raises(ArgumentError, match="pending"):
            decode.release(handle)
        assert decode.state(handle) == "pending"  # the refusal changed nothing
    finally:
        os.kill(prefill.peer.process.pid, signal.SIGCONT)
    assert _wait_final(decode, handle) == "done"
    assert np.array_equal(decode.pages.numpy()[:, :8], prefill.pages[:, :8])
    decode.release(handle)


@needs_nixl
@pytest.mark.parametrize("where", ["past the end", "before the start"])
def test_a_read_outside_the_peers_registered_memory_fails_cleanly(decode: Any, prefill: Prefill,
                                                                  where: str) -> None:
    """Raises at read() or reports "failed"; no crash, and the agent still reads after."""
    remote = page_descs(prefill.region, np.array([P - 1]))
    remote[:, 0] += PAGE_BYTES // 2 if where == "past the end" else -PAGE_BYTES * P
    local = page_descs(Region.of(decode.pages), np.array([0]))
    try:
        handle = decode.read(prefill.name, local, remote)
    except ArgumentError:
        pass
    else:
        assert _wait_final(decode, handle) == "failed"
        decode.release(handle)
    handle = _read(decode, prefill, np.array([2]), np.array([2]))
    assert _wait_final(decode, handle) == "done"
    decode.release(handle)


@needs_nixl
def test_bad_reads_raise_before_nixl_sees_them(decode: Any, prefill: Prefill) -> None:
    local = page_descs(Region.of(decode.pages), np.array([0, 1]))
    remote = page_descs(prefill.region, np.array([0, 1]))
    with pytest.raises(ArgumentError, match="no peer"):
        decode.read("nobody", local, remote)
    with pytest.raises(ArgumentError, match="differ"):
        decode.read(prefill.name, local[:1], remote)
    with pytest.raises(ArgumentError, match=r"\[n, 3\]"):
        decode.read(prefill.name, local[:0], remote[:0])
    with pytest.raises(ArgumentError):
        decode.release(10**9)


@needs_nixl
def test_a_killed_peer_fails_its_pending_read_without_hanging(decode: Any) -> None:
    """The peer is SIGKILLed while a read from it is in flight (held by SIGSTOP): the read ends
    "failed", never "done", and a read posted to the dead peer afterwards fails or raises."""
    victim = Prefill(decode, "victim", seed=2)
    local = page_descs(Region.of(decode.pages), np.arange(4))
    remote = page_descs(victim.region, np.arange(4))
    os.kill(victim.peer.process.pid, signal.SIGSTOP)
    handle = decode.read(victim.name, local, remote)
    assert decode.state(handle) == "pending"
    victim.peer.kill()
    assert _wait_final(decode, handle) == "failed"
    decode.release(handle)
    try:
        late = decode.read(victim.name, local, remote)
    except KVMemError:
        return
    assert _wait_final(decode, late) == "failed"
    decode.release(late)


_START_AGENT = """
from kvmem.transfer import NixlTransport
NixlTransport("quiet").close()
"""


@needs_nixl
@pytest.mark.parametrize("level", [None, "INFO"])
def test_a_transport_keeps_nixls_info_lines_off_stdout_unless_asked(level: str | None) -> None:
    """NIXL's logging config prints INFO lines to stdout, which broke ``--json`` output of a
    program using NixlTransport: a child that starts one writes nothing to stdout, unless the
    user asked NIXL for INFO with NIXL_LOG_LEVEL."""
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if level is not None:
        env["NIXL_LOG_LEVEL"] = level
    child = subprocess.run([sys.executable, "-c", _START_AGENT], capture_output=True, text=True,
                           env=env, timeout=WAIT * 4, check=True)
    if level is None:
        assert child.stdout == ""
    else:
        assert "Initialized NIXL agent: quiet" in child.stdout


def test_a_peer_that_raises_reports_its_traceback() -> None:
    with Peer(_raise, timeout=WAIT) as peer, pytest.raises(PeerError, match="ZeroDivisionError"):
        peer.recv()


def test_a_silent_peer_times_out() -> None:
    with Peer(_sleep, 60.0) as peer:
        with pytest.raises(PeerError, match="still running"):
            peer.recv(timeout=0.2)
        peer.kill()
        assert peer.process.exitcode == -signal.SIGKILL


def test_a_peer_that_dies_before_it_starts_is_reported_as_exited(tmp_path: Any,
                                                                  monkeypatch: Any) -> None:
    """A child that cannot even import its target (it dies before it unpickles its end of the
    pipe, which then never closes) is reported as exited, not waited for until the timeout."""
    (tmp_path / "dies_in_child.py").write_text(
        "import os, sys\n"
        "if os.environ.get('KVMEM_TEST_DIE_ON_IMPORT'):\n"
        "    sys.exit(3)\n"
        "def target(conn):\n"
        "    conn.send('never')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import dies_in_child

    monkeypatch.setenv("KVMEM_TEST_DIE_ON_IMPORT", "1")  # the child inherits it, dies importing
    with Peer(dies_in_child.target, timeout=600.0) as peer:
        with pytest.raises(PeerError, match="exited with code 3 before it sent") as err:
            peer.recv()
        assert "still running" not in str(err.value)


def _raise(conn: Connection) -> None:
    1 / 0  # noqa: B018


def _sleep(conn: Connection, seconds: float) -> None:
    time.sleep(seconds)


def test_without_nixl_a_transport_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmem.transfer import NixlTransport

    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(ConfigError, match=r"pip install 'nixl>=1.5,<2'"):
        NixlTransport("x")
