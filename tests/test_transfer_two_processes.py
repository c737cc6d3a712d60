"""Sender and Receiver in two real processes over NIXL (UCX, ``UCX_TLS=tcp,self``).

The prefill side (a real KVCacheManager, PagePool and Sender) runs in a spawned Peer and obeys
commands from its pipe (:func:`prefill_side`). Between commands it blocks on the pipe and makes
no NIXL call, and with no progress thread a tcp read of its pages cannot progress: that is how a
test holds a read pending without a timed race. The decode side (a real Receiver over a
NixlTransport) is this process. The in-process versions of these guarantees are in
tests/test_transfer.py; the transport alone is in tests/test_nixl.py.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

from kvmem import IncompatibleCacheError, IntegrityError, KVCacheManager, PagePool, PoolSpec
from kvmem.transfer import CacheIdentity, LoadResult, Peer, Receiver, Sender, TransferMessage
from kvmem.transfer._message import answer_bytes

try:
    import nixl._api  # noqa: F401
except ImportError:
    pytest.skip("nixl is not installed (pip install 'nixl>=1.5,<2' after torch)",
                allow_module_level=True)

P = 4  # page size
NUM_PAGES = 32
SHAPE: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "page_size": P,
                         "num_pages": NUM_PAGES, "device": "cpu"}
PROMPT = list(range(100, 111))  # 11 tokens: 2 full pages and a tail of 3
WAIT = 30.0  # seconds: a bound on anything that should take milliseconds (no test hangs)
_agents = itertools.count()


def cache(dtype: str = "bf16", scales: str | None = None, head_dim: int = 16,
          model: str = "smol") -> tuple[KVCacheManager, PagePool, CacheIdentity]:
    spec = PoolSpec(**SHAPE, head_dim=head_dim, dtype=dtype, scales=scales)
    pool = PagePool(spec)
    manager = KVCacheManager(spec.num_pages, page_size=P, max_seqs=8, max_pages_per_seq=8,
                             pool=pool, tracker="checking")
    return manager, pool, CacheIdentity.of(spec, model, "w1")


def kv(num_tokens: int, seed: int, head_dim: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v), each ``[num_tokens, 2, head_dim]`` bfloat16; token t's values depend
    on the seed and t only, so both processes can make them."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, 2, head_dim, generator=g).bfloat16()[:num_tokens],
             torch.randn(64, 2, head_dim, generator=g).bfloat16()[:num_tokens])
            for _ in range(2)]


def kv_of_tokens(prompt: list[int], head_dim: int = 16
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v), each ``[len(prompt), 2, head_dim]`` bfloat16; token i's values depend
    on ``prompt[: i + 1]`` only, as a model's do: requests that share a prefix share its pages'
    bytes, in either process and after a restart."""
    rows = [torch.randn(4, 2, head_dim, generator=torch.Generator().manual_seed(
        zlib.crc32(np.asarray(prompt[: i + 1], dtype=np.int64).tobytes())))
        for i in range(len(prompt))]
    x = torch.stack(rows, 1).bfloat16()  # [2 layers * (k, v), len(prompt), 2, head_dim]
    return [(x[0], x[1]), (x[2], x[3])]


def prefill(manager: KVCacheManager, pool: PagePool, rid: str, prompt: list[int],
            seed: int | None, start: int | None = None) -> None:
    """Admit (or continue from ``start`` computed tokens), write the K/V of the tokens not
    cached through the pool (from ``seed``, or from the tokens when it is None), commit."""
    if start is None:
        start = manager.admit(rid, prompt).num_cached_tokens
    n = len(prompt) - start
    step = manager.reserve([rid], n)
    hd = pool.spec.head_dim or 0
    values = kv_of_tokens(prompt, hd) if seed is None else kv(len(prompt), seed, hd)
    for layer, (k, v) in enumerate(values):
        pool.write(layer, step.slot_mapping, k[start:], v[start:])
    manager.commit(rid, prompt[start:])


def page_bytes(pool: PagePool, pages: Any) -> list[np.ndarray]:
    """The pages' bytes in every layer ``[L, k, page_nbytes]`` uint8, and their token scales."""
    ids = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    out = [pool.page_bytes.index_select(1, ids).numpy()]
    if pool.token_scales is not None:
        out.append(pool.token_scales.index_select(1, ids).numpy())
    return out


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# -- the prefill process ---------------------------------------------------------------------


def prefill_side(conn: Connection, agent: str, head_dim: int, model: str,
                 lease_seconds: float) -> None:
    """The prefill process: a Sender over NIXL, obeying ``(command, *args)`` from the pipe.

    prefill rid prompt seed  -> the bytes of the request's full pages (None if it does not fit)
    export rid now           -> notify the offer; (its transfer id, the offer)
    poll now answers         -> Sender.poll(now) until that many confirms were answered (at
                                most WAIT s; at least one call); what was answered
    notify [bytes]           -> send raw notices to the decode side (duplicates, late ones)
    release rid              -> release the request (None: none) and clear the prefix cache
    state                    -> counts, open transfers, free pages, check()'s problem or ""
    stop
    """
    from kvmem.transfer import NixlTransport

    manager, pool, identity = cache(head_dim=head_dim, model=model)
    transport = NixlTransport(agent)
    sender = Sender(manager, pool, transport, identity, lease_seconds=lease_seconds)
    conn.send((transport.metadata(), identity.to_json()))
    decode = transport.add_peer(conn.recv())
    transport.notify(decode, b"hello")
    _wait_notice(transport)
    while True:
        cmd, *args = conn.recv()  # blocks: no NIXL call, so no read of this side progresses
        reply: Any = None
        if cmd == "stop":
            transport.close()
            return
        if cmd == "prefill":
            rid, prompt, seed = args
            if manager.can_admit(prompt):
                prefill(manager, pool, rid, prompt, seed)
                reply = page_bytes(pool, manager.pages_of(rid)[: len(prompt) // P])
        elif cmd == "export":
            offer = sender.export(args[0], args[1])
            transport.notify(decode, offer)
            reply = (TransferMessage.from_bytes(offer).transfer_id, offer)
        elif cmd == "poll":
            now, answers = args
            reply = sender.poll(now)
            deadline = time.monotonic() + WAIT
            while len(reply) < answers and time.monotonic() < deadline:
                time.sleep(0.0005)
                reply += sender.poll(now)
        elif cmd == "notify":
            for data in args[0]:
                transport.notify(decode, data)
        elif cmd == "release":
            if args[0] is not None:
                manager.release(args[0])
            manager.clear_prefix_cache()
        elif cmd == "state":
            try:
                manager.check()
                problem = ""
            except IntegrityError as e:
                problem = str(e)
            reply = {"counts": dict(sender.counts), "open": sender.open_transfers,
                     "num_free": manager.allocator.num_free, "check": problem}
        conn.send(reply)


def _wait_notice(transport: Any) -> None:
    """Poll NIXL until a notice comes (at most WAIT s). A connection's first notice leaves only
    while both agents make progress: this handshake lets the prefill process stop polling after
    an offer without stranding it."""
    deadline = time.monotonic() + WAIT
    while not transport.notices() and time.monotonic() < deadline:
        time.sleep(0.0005)


# -- the decode process (this one) -----------------------------------------------------------


@dataclass
class Decode:
    manager: KVCacheManager
    pool: PagePool
    identity: CacheIdentity
    transport: Any
    receiver: Receiver

    def pump(self, until: Callable[[list[LoadResult]], bool], now: float = 0.0
             ) -> list[LoadResult]:
        """Receiver.poll(now) until ``until(results so far)``; fails after WAIT s."""
        results: list[LoadResult] = []
        deadline = time.monotonic() + WAIT
        while not until(results):
            if time.monotonic() > deadline:
                pytest.fail(f"the decode side saw nothing of the kind in {WAIT} s: {results}")
            results += self.receiver.poll(now)
            time.sleep(0.0005)
        return results


class Prefill:
    """The prefill process as the decode side sees it."""

    def __init__(self, decode: Decode, head_dim: int, model: str, lease_seconds: float) -> None:
        self.peer = Peer(prefill_side, f"prefill{next(_agents)}", head_dim, model, lease_seconds,
                         timeout=WAIT)
        metadata, identity = self.peer.recv()
        self.identity = CacheIdentity.from_json(identity)
        name = decode.transport.add_peer(metadata)
        self.peer.send(decode.transport.metadata())
        _wait_notice(decode.transport)  # the handshake (see _wait_notice)
        decode.transport.notify(name, b"hello")

    def ask(self, *cmd: Any) -> Any:
        self.peer.send(cmd)
        return self.peer.recv()

    def start(self, *cmd: Any) -> None:
        """Send a command whose reply comes later (``self.peer.recv()``), e.g. a poll that
        waits for the decode side."""
        self.peer.send(cmd)

    def stop(self) -> None:
        if self.peer.process.is_alive():
            self.peer.send(("stop",))
        self.peer.close()


Link = Callable[..., tuple[Prefill, Decode]]


@pytest.fixture
def link() -> Iterator[Link]:
    """``link(dtype=, scales=, policy=, head_dim=, model=, lease_seconds=)``: a prefill process
    and a decode side connected over NIXL; both stopped at the test's end."""
    made: list[tuple[Prefill, Decode]] = []

    def make(dtype: str = "bf16", scales: str | None = None, policy: str = "recompute",
             head_dim: int = 16, model: str = "smol", lease_seconds: float = 30.0
             ) -> tuple[Prefill, Decode]:
        from kvmem.transfer import NixlTransport

        manager, pool, identity = cache(dtype, scales)
        transport = NixlTransport(f"decode{next(_agents)}", ucx_tls="tcp,self")
        receiver = Receiver(manager, pool, transport, identity,
                            policy=policy)  # type: ignore[arg-type]
        decode = Decode(manager, pool, identity, transport, receiver)
        made.append((Prefill(decode, head_dim, model, lease_seconds), decode))
        return made[-1]

    yield make
    for p, d in made:
        p.stop()
        d.transport.close()


def load(p: Prefill, d: Decode, rid: str, now: float = 0.0) -> tuple[str, LoadResult, Any]:
    """Export ``rid`` and let the sender poll until it answered: (transfer id, the load's result,
    the sender's answers)."""
    tid, _ = p.ask("export", rid, now)
    p.start("poll", now, 1)
    (result,) = d.pump(lambda r: bool(r))
    return tid, result, p.peer.recv()


# -- a. a load, and the prefix cache it feeds --------------------------------------------------


def test_a_loaded_request_holds_the_senders_bytes_and_serves_a_shared_prefix(link: Link) -> None:
    p, d = link()
    want = p.ask("prefill", "a", PROMPT, 1)
    tid, res, answered = load(p, d, "a")
    assert answered == [(tid, True)]
    assert (res.request_id, res.status, res.num_computed_tokens) == ("a", "loaded", 8)
    pages_a = d.manager.pages_of("a")[:2]
    assert same(page_bytes(d.pool, pages_a), want)
    page_nbytes = want[0].nbytes // 2
    assert d.receiver.counts["bytes_read"] == 2 * page_nbytes
    # "b" shares "a"'s two full pages: the receiver's prefix cache serves them, one page moves
    prompt_b = [*PROMPT[:8], 300, 301, 302, 303, 304]  # 13 tokens: 3 full pages
    want_b = p.ask("prefill", "b", prompt_b, 2)
    tid_b, res_b, answered_b = load(p, d, "b")
    assert answered_b == [(tid_b, True)]
    assert (res_b.status, res_b.num_computed_tokens) == ("loaded", 12)
    assert d.receiver.counts["bytes_read"] == 3 * page_nbytes
    assert np.array_equal(d.manager.pages_of("b")[:2], pages_a)
    assert same(page_bytes(d.pool, d.manager.pages_of("b")[:3]), want_b)
    d.manager.check()
    # the sender's leases ended with its answers: released, its pages all go back
    state = p.ask("state")
    assert state["open"] == () and state["counts"]["confirmed"] == 2 and state["check"] == ""
    p.ask("release", "a")
    p.ask("release", "b")
    state = p.ask("state")
    assert state["num_free"] == NUM_PAGES and state["check"] == ""


# -- b. identity -----------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("head_dim", 8), ("model", "other")])
def test_a_sender_of_another_identity_is_refused_naming_the_field(link: Link, field: str,
                                                                  value: Any) -> None:
    p, d = link(**{field: value})
    with pytest.raises(IncompatibleCacheError) as e:  # the check when they connect
        d.identity.check(p.identity)
    assert e.value.field == field
    p.ask("prefill", "a", PROMPT, 1)
    before = d.manager.stats()
    tid, res, answered = load(p, d, "a")  # the offer, refused
    assert (res.request_id, res.status) == ("a", "failed") and field in res.reason
    assert d.manager.stats() == before and d.manager.running == ()
    assert d.receiver.loading == () and d.receiver.counts["bytes_read"] == 0
    assert answered == [(tid, False)]  # declined: the sender's lease ends at once
    state = p.ask("state")
    assert state["counts"]["declined"] == 1 and state["open"] == () and state["check"] == ""
    d.manager.check()


# -- c. lease expiry -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_lease_expired_before_the_confirm_makes_the_request_fall_back(link: Link,
                                                                        policy: str) -> None:
    """The sender's lease (5 s on its clock) expires before it reads the confirm: the answer is
    "stale" although the bytes were intact; the receiver falls back by its policy, and the
    pages it read never enter its prefix cache."""
    p, d = link(policy=policy, lease_seconds=5.0)
    p.ask("prefill", "base", PROMPT, 1)
    assert load(p, d, "base")[1].status == "loaded"
    prompt = [*PROMPT[:4], 400, 401, 402, 403, 404, 405, 406]  # shares "base"'s first page
    want = p.ask("prefill", "x", prompt, 1)
    tid, _ = p.ask("export", "x", 0.0)
    p.start("poll", 10.0, 1)  # the lease expires first, then the confirm is read
    (res,) = d.pump(lambda r: bool(r))
    assert p.peer.recv() == [(tid, False)]
    assert res.request_id == "x" and "stale" in res.reason
    assert d.manager.match_prefix(prompt).num_pages == 1  # the hit only
    if policy == "fail":
        assert res.status == "failed" and "x" not in d.manager.running
        assert d.manager.allocator.num_free == NUM_PAGES - 3  # "base"'s 3 pages
    else:
        assert (res.status, res.num_computed_tokens) == ("recompute", 4)
        assert d.manager.num_committed("x") == 4
        prefill(d.manager, d.pool, "x", prompt, 1, start=4)  # the engine recomputes the rest
        assert same(page_bytes(d.pool, d.manager.pages_of("x")[:2]), want)
    state = p.ask("state")
    assert state["counts"]["expired"] == 1 and state["counts"]["stale"] == 1
    assert state["open"] == () and state["check"] == ""
    d.manager.check()


# -- d. a killed prefill process -------------------------------------------------------------


def test_killing_the_prefill_process_mid_transfer_fails_only_the_pending_load(link: Link
                                                                              ) -> None:
    """"a" is loaded; "b"'s read is pending (the sender stopped polling) when the prefill
    process is SIGKILLed: "b" falls back, "a" keeps its pages and bytes. "a"'s offer again,
    duplicate and late answers for "a" and a malformed notice, sent before the sender died, are
    ignored (the dead process sends nothing after)."""
    p, d = link()
    want_a = p.ask("prefill", "a", PROMPT, 1)
    p.ask("prefill", "b", list(range(200, 211)), 2)
    tid_a, offer_a = p.ask("export", "a", 0.0)
    p.start("poll", 0.0, 1)
    assert [r.status for r in d.pump(lambda r: bool(r))] == ["loaded"]
    assert p.peer.recv() == [(tid_a, True)]
    pages_a = d.manager.pages_of("a").copy()
    p.ask("notify", [offer_a, answer_bytes(tid_a, True), answer_bytes(tid_a, False, "late"),
                     b"junk"])
    assert d.pump(lambda r: d.receiver.counts["ignored"] == 4) == []
    p.ask("export", "b", 0.0)
    assert d.pump(lambda r: "b" in d.receiver.loading) == []
    assert d.receiver.poll(0.0) == [] and d.receiver.loading == ("b",)  # its read is pending
    p.peer.kill()
    (res_b,) = d.pump(lambda r: bool(r))
    assert (res_b.request_id, res_b.status, res_b.num_computed_tokens) == ("b", "recompute", 0)
    assert "read failed" in res_b.reason and d.receiver.loading == ()
    assert np.array_equal(d.manager.pages_of("a"), pages_a) and d.manager.num_committed("a") == 8
    assert same(page_bytes(d.pool, pages_a[:2]), want_a)
    assert d.manager.num_committed("b") == 0 and d.manager.match_prefix(PROMPT).num_pages == 2
    assert d.receiver.poll(100.0) == [] and d.receiver.counts["ignored"] == 4
    d.manager.check()


# -- e. a receiver abort while its read is pending -------------------------------------------


@pytest.mark.parametrize("then", ["resume", "kill"])
def test_an_abort_keeps_the_destination_pages_until_the_read_is_final(link: Link,
                                                                      then: str) -> None:
    """The receiver aborts "a" while its read is pending: the destination pages stay leased (no
    other request gets them) until the read ends, done when the sender polls again or failed
    when it is killed; bytes land in those pages only, then they go back."""
    p, d = link()
    want = p.ask("prefill", "a", PROMPT, 1)
    tid, _ = p.ask("export", "a", 0.0)
    d.pump(lambda r: "a" in d.receiver.loading)
    dst = d.manager.pages_of("a")[:2].copy()
    d.receiver.abort("a")
    assert "a" not in d.manager.running and d.receiver.loading == ()
    refcounts = d.manager.allocator.refcounts
    assert (refcounts[dst] == 1).all()  # the lease alone holds them
    others: list[str] = []
    while d.manager.allocator.num_free:
        others.append(f"o{len(others)}")
        d.manager.admit(others[-1], list(range(min(d.manager.allocator.num_free, 8) * P)))
        assert not np.isin(dst, d.manager.pages_of(others[-1])).any()
    assert d.receiver.poll(0.0) == [] and (refcounts[dst] == 1).all()  # the read is pending
    if then == "resume":
        p.start("poll", 0.0, 1)
    else:
        p.peer.kill()
    assert d.pump(lambda r: bool((refcounts[dst] == 0).all())) == []
    rest = np.setdiff1d(np.arange(NUM_PAGES), dst)
    assert not page_bytes(d.pool, rest)[0].any()  # nothing landed outside the fenced pages
    if then == "resume":
        assert same(page_bytes(d.pool, dst), want)
        assert p.peer.recv() == [(tid, True)]  # the read did complete: the sender's lease ends
        d.pump(lambda r: d.receiver.counts["ignored"] == 1)  # its answer comes late
    d.manager.release_batch(others)
    assert d.manager.allocator.num_free == NUM_PAGES
    assert d.receiver.counts["aborted"] == 1 and d.receiver.counts["loaded"] == 0
    d.manager.check()


# -- f. dtype conversion ---------------------------------------------------------------------


@pytest.mark.parametrize("scales", ["token_head", "tensor"])
def test_bf16_pages_read_into_an_fp8_pool_equal_a_direct_fp8_write(link: Link,
                                                                   scales: str) -> None:
    p, d = link(dtype="fp8_e4m3", scales=scales)
    p.ask("prefill", "a", PROMPT, 3)
    tid, res, answered = load(p, d, "a")
    assert answered == [(tid, True)] and (res.status, res.num_computed_tokens) == ("loaded", 8)
    dst = d.manager.pages_of("a")[:2]
    direct = PagePool(d.pool.spec)
    slots = torch.as_tensor((dst.astype(np.int64)[:, None] * P + np.arange(P)).reshape(-1))
    for layer, (k, v) in enumerate(kv(len(PROMPT), 3)):
        direct.write(layer, slots, k[:8], v[:8])
    assert same(page_bytes(direct, dst), page_bytes(d.pool, dst))
    if scales == "tensor":
        assert torch.equal(direct.static_scales, d.pool.static_scales)  # type: ignore[arg-type]
    d.manager.check()


# -- g. a seeded campaign --------------------------------------------------------------------


# Seeds whose runs (40 moves by default, 120 in the long runs) both load and fall back.
DEFAULT_SEEDS = (0, 1, 3)
LONG_SEEDS = (4, 5, 6, 7, 8, 9, 10, 11, 12)


@pytest.mark.parametrize("seed", [*DEFAULT_SEEDS, *(
    pytest.param(seed, marks=pytest.mark.long) for seed in LONG_SEEDS)])
def test_check_holds_on_both_sides_after_a_random_campaign_over_nixl(link: Link,
                                                                     seed: int) -> None:
    """Random moves between two processes: prefill and export of a new request (some share a
    first page); the sender polls (every pending read completes, every confirm is answered,
    leases past their expiry on its clock end first) or stays silent (reads stay pending);
    the sender releases a request; the receiver aborts a loading request or releases a loaded
    or recomputed one; an offer or answers the live sender sent before, and junk, come again;
    the prefill process is SIGKILLed and a fresh one connects. After every move check() holds
    on both managers; every "loaded" request holds the bytes the sender's pages had at export,
    every recomputed one the same bytes once the engine (this test) prefills the rest. After
    draining (every read final, every lease ended, everything released) both sides hold no
    page. Odd seeds run the "fail" policy. With KVMEM_LONG_TESTS=1, more seeds, longer."""
    rng = np.random.default_rng(seed)
    num_moves = 40 if seed in DEFAULT_SEEDS else 120
    lease = 3.0
    p, d = link(policy=("recompute", "fail")[seed % 2], lease_seconds=lease)
    rx = d.receiver
    started = [p]  # prefill processes started here after a kill (the fixture stops the first)
    now = 0.0
    prompts: dict[str, list[int]] = {}
    want: dict[str, list[np.ndarray]] = {}  # the sender's bytes of a request's full pages
    offers: dict[str, tuple[str, bytes]] = {}  # the live sender's offers: tid -> (rid, offer)
    answers: dict[str, bytes] = {}  # the live sender's answers, by transfer id
    due: set[str] = set()  # transfers whose confirm (the read's notice or a decline) is owed
    on_sender: list[str] = []  # requests running on the live sender
    finished: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    kills = i = 0

    def settle(results: list[LoadResult]) -> None:
        for res in results:
            rid, status = res.request_id, res.status
            finished[rid] += 1
            statuses[status] += 1
            n = len(prompts[rid]) // P
            if status == "loaded":
                assert res.num_computed_tokens == n * P
            elif status == "recompute":
                assert d.manager.num_committed(rid) == res.num_computed_tokens
                prefill(d.manager, d.pool, rid, prompts[rid], None, start=res.num_computed_tokens)
            else:
                assert status == "failed" and rid not in d.manager.running, res
                continue
            assert same(page_bytes(d.pool, d.manager.pages_of(rid)[:n]), want[rid]), res

    def pump(until: Callable[[], bool]) -> None:
        """Receiver.poll(now), each result settled at once, until ``until()`` (at most WAIT s)."""
        deadline = time.monotonic() + WAIT
        while not until():
            if time.monotonic() > deadline:
                pytest.fail(f"the decode side did not get there in {WAIT} s (move {i})")
            settle(rx.poll(now))
            time.sleep(0.0005)

    def sender_poll() -> None:
        p.start("poll", now, len(due))
        pump(lambda: p.peer.conn.poll(0))
        answered = p.peer.recv()
        assert sorted(t for t, _ in answered) == sorted(due)
        answers.update((t, answer_bytes(t, ok)) for t, ok in answered)
        live = {offers[t][0] for t, _ in answered}
        due.clear()
        pump(lambda: not live & set(rx.loading))  # their answers reached their loads

    def export(rid: str, prompt: list[int]) -> None:
        got = p.ask("prefill", rid, prompt, None)
        if got is None:  # it does not fit the sender's pool now
            return
        prompts[rid], want[rid] = prompt, got
        on_sender.append(rid)
        tid, offer = p.ask("export", rid, now)
        offers[tid] = (rid, offer)
        due.add(tid)
        pump(lambda: rid in rx.loading or finished[rid] > 0)  # received, read started or not

    def offer_again(tid: str) -> None:
        """An offer again: ignored, whether its load runs or ended (its request is never
        admitted a second time)."""
        rid, offer = offers[tid]
        ignored, before = rx.counts["ignored"], finished[rid]
        p.ask("notify", [offer])
        pump(lambda: rx.counts["ignored"] > ignored)
        assert finished[rid] == before and rx.counts["ignored"] == ignored + 1

    def answers_again() -> None:
        """Answers whose loads ended, and junk: all ignored (a load that reads again would
        take its transfer's answer)."""
        late = [a for t, a in answers.items() if offers[t][0] not in rx.loading]
        ignored = rx.counts["ignored"] + len(late) + 1
        p.ask("notify", [*late, b"junk"])
        pump(lambda: rx.counts["ignored"] == ignored)

    try:
        for i in range(num_moves):
            now += float(rng.uniform(0, 1.0))
            move = int(rng.choice(7, p=[0.35, 0.13, 0.12, 0.1, 0.1, 0.12, 0.08]))
            if move == 0 and len(on_sender) < 4:  # prefill and export a new request
                rid = f"q{i}"
                prompt = [int(rng.integers(3))] * P + rng.integers(
                    0, 50, int(rng.integers(2, 15))).tolist()
                export(rid, prompt)
            elif move == 1:
                sender_poll()
            elif move == 2 and on_sender:
                p.ask("release", on_sender.pop(int(rng.integers(len(on_sender)))))
            elif move == 3 and rx.loading:
                rx.abort(rx.loading[int(rng.integers(len(rx.loading)))])
            elif move == 4:
                done = [r for r in d.manager.running if r not in rx.loading]
                if done:
                    d.manager.release(done[int(rng.integers(len(done)))])
            elif move == 5 and offers:  # notices again: an offer, or answers and junk
                if rng.integers(2):
                    offer_again(list(offers)[int(rng.integers(len(offers)))])
                else:
                    answers_again()
            elif move == 6 and kills < 2:  # the prefill process dies; a fresh one connects
                kills += 1
                p.peer.kill()
                pump(lambda: not rx.loading and not d.manager.fences.leases)
                p = Prefill(d, 16, "smol", lease)
                started.append(p)
                offers.clear(), answers.clear(), due.clear(), on_sender.clear()
            settle(rx.poll(now))
            d.manager.check()
            assert p.ask("state")["check"] == ""
        now += 100.0  # drain: every lease expires, every read completes, every confirm is stale
        sender_poll()
        pump(lambda: not rx.loading and not d.manager.fences.leases)
        for rid in [*on_sender, None]:
            p.ask("release", rid)
        state = p.ask("state")
        assert state["open"] == () and state["check"] == "" and state["num_free"] == NUM_PAGES
        d.manager.release_batch(d.manager.running)
        d.manager.clear_prefix_cache()
        d.manager.check()
        assert d.manager.allocator.num_free == NUM_PAGES and rx.loading == ()
        assert statuses["loaded"] and statuses["recompute"] + statuses["failed"], statuses
    finally:
        for q in started[1:]:
            q.stop()
