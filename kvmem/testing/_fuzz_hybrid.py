"""The hybrid engine under the fuzzer: random campaigns on a :class:`~kvmem.hybrid.HybridManager`
(full attention + sliding window + recurrent state), its oracles and its three faults.

The device timeline of :mod:`kvmem.testing._run` follows one :class:`~kvmem.manager.KVCacheManager`;
a hybrid manager has other calls and one page table per group, so this module runs its own,
smaller campaigns: a synchronous engine (each step is reserved, verified, run on a value model
and committed within one move), random moves, replay and delta-debugging shrinking::

    move (name, a, b)   what the engine does
    submit              admit a prompt (prefixes shared across requests, two tenants): a prefix
                        hit restores pages and a state through the listed copies
    step                a batch: prompt chunks (some ending on a checkpoint) or one decode token
                        each; reserve -> verify -> the device reads and writes -> commit_batch
    fork                a running request forks (tails and state copied), then diverges
    release             a running request is cancelled

The value model: every token group's page holds, at position ``i`` of a request, a hash of the
request's tenant and tokens ``0..i``; a state slot holds the hash of the tokens it absorbed.
Copies listed by ``take_copies()`` are made at once. The oracles (:data:`HYBRID_ORACLES`):

* ``hybrid_reads``: every page a step reads (in every token group, from its window's first
  position to the step's first new token) and every state it reads holds the values of that
  request's own tokens;
* ``hybrid_verify``: ``verify`` aborts no request (a correct system never breaks a mapping);
* ``hybrid_check``: ``check()`` passes after every move, ``can_reserve`` answers what
  ``reserve`` then does, and at the end, with every request released and the cache cleared,
  every chunk is back in the budget;
* ``hybrid_error``: a call the engine makes by the rules raises no KVMemError.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvmem.allocator import FullAttentionSpec, SlidingWindowSpec, StateSpec
from kvmem.errors import ArgumentError, IntegrityError, KVMemError, OutOfPagesError
from kvmem.hybrid import HybridCopy, HybridManager
from kvmem.testing._fuzz import FaultResult
from kvmem.testing._fuzz_protocol import stable_bit, stable_pick
from kvmem.testing._oracles import FuzzFailure

__all__ = ["HYBRID_FAULTS", "HYBRID_ORACLES", "HybridFault", "HybridRun", "hybrid_campaign",
           "hybrid_clean",
           "hybrid_hunt", "hybrid_replay", "hybrid_shrink"]

HYBRID_ORACLES = ("hybrid_reads", "hybrid_verify", "hybrid_check", "hybrid_error")
MOVES: dict[str, float] = {"submit": 3, "step": 10, "fork": 2, "release": 1}
Move = tuple[str, int, int]

PAGE = 4  # tokens per page in both token groups (a checkpoint every 4 tokens)
GROUPS = (FullAttentionSpec("full", page_size=PAGE, bytes_per_token=16),
          SlidingWindowSpec("swa", window=6, page_size=PAGE, bytes_per_token=16),
          StateSpec("gdn", bytes_per_state=64))
BUDGET = 24 * 256  # 24 chunks of four 64-byte pages: eviction and OutOfPages happen
MAX_SEQS = 8
MAX_TOKENS = 64  # a request's most tokens (a submit plans at most 40 + 8 + 10)
NAMESPACES = (None, "tenant-a")
BASES = [random.Random(k).choices(range(3), k=40) for k in range(3)]  # shared prompt heads
_MASK = (1 << 62) - 1


def _mix(h: int, token: int) -> int:
    return (h * 6364136223846793005 + token * 1442695040888963407 + 1) & _MASK


class _Request:
    """A running request as the engine sees it: its whole planned token list (prompt, then
    what it will generate), the prompt's length, and the value of each position."""

    __slots__ = ("hashes", "namespace", "prompt_len", "tokens")

    def __init__(self, namespace: int, tokens: list[int], prompt_len: int) -> None:
        self.namespace = namespace
        self.tokens = tokens
        self.prompt_len = prompt_len
        h = 1_000_003 * (namespace + 1)
        self.hashes = [h]  # hashes[i]: the value after i tokens (hashes[0]: the fresh state)
        for t in tokens:
            h = _mix(h, t)
            self.hashes.append(h)


class HybridFault:
    """A bug class switched on in a :class:`HybridRun` (``kvmem fuzz --engine hybrid
    --faults NAME``); ``expected`` names the oracle meant to catch it."""

    name: ClassVar[str] = ""
    expected: ClassVar[str] = ""
    weights: ClassVar[dict[str, float]] = {}

    def install(self, run: HybridRun) -> None:
        raise NotImplementedError

    @classmethod
    def describe(cls) -> str:
        return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


class WindowPageFreedEarly(HybridFault):
    """The manager releases one sliding-window page too early: after a commit, the first page
    the next query reads is dropped (and may be given to another request) while still read."""

    name = "window_page_freed_while_read"
    expected = "hybrid_verify"

    def install(self, run: HybridRun) -> None:
        m = run.manager
        commit_batch = m.commit_batch

        def early(request_ids: Sequence[Any], token_ids: Any) -> None:
            commit_batch(request_ids, token_ids)
            swa = m.table.tokens["swa"]
            rows = np.array([m.table.requests[r].row for r in request_ids], dtype=np.intp)
            stop = swa.first_page(m.table.num_committed[rows]) + 1  # the bug: one page more
            gone = swa.release_before(rows, stop)
            if gone.size:
                m.allocator.free({"swa": gone})

        m.commit_batch = early  # type: ignore[method-assign]


class StateSharedAfterFork(HybridFault):
    """A fork gives the child the parent's state slot instead of a copy: both requests
    advance one recurrent state."""

    name = "state_shared_after_fork"
    expected = "hybrid_verify"
    weights: ClassVar[dict[str, float]] = {"fork": 4}

    def install(self, run: HybridRun) -> None:
        m = run.manager
        fork = m.fork

        def shared(parent_id: Any, child_id: Any) -> list[HybridCopy]:
            copies = fork(parent_id, child_id)
            gdn = m.table.states["gdn"]
            parent, child = m.table.requests[parent_id].row, m.table.requests[child_id].row
            own, slot = int(gdn.slot[child]), int(gdn.slot[parent])
            gdn.take(child, slot, int(gdn.tag[parent]), int(gdn.tokens[parent]))
            m.allocator.share({"gdn": [slot]})
            m.allocator.free({"gdn": [own]})
            run.skip_copies.add(HybridCopy("gdn", slot, own))
            return [c for c in copies if c.group != "gdn"]

        m.fork = shared  # type: ignore[method-assign]


class HitWithoutStateRestore(HybridFault):
    """A prefix hit restores the attention and window pages but not the recurrent state: the
    checkpoint's copy into the new request's slot is never made."""

    name = "prefix_hit_without_state_restore"
    expected = "hybrid_reads"
    weights: ClassVar[dict[str, float]] = {"submit": 6}

    def install(self, run: HybridRun) -> None:
        m = run.manager
        admit = m.admit

        def no_restore(request_id: Any, token_ids: Any, namespace: Any = None) -> Any:
            hit = admit(request_id, token_ids, namespace)
            if hit.num_cached_tokens:
                slot = int(m.pages_of(request_id, "gdn")[0])
                run.skip_dst.add(("gdn", slot))
            return hit

        m.admit = no_restore  # type: ignore[method-assign]


HYBRID_FAULTS: dict[str, HybridFault] = {f.name: f for f in (
    WindowPageFreedEarly(), StateSharedAfterFork(), HitWithoutStateRestore())}


class HybridRun:
    """A hybrid manager, the engine's requests and the value model, driven one move at a time
    (:meth:`step`); raises :class:`FuzzFailure` when an oracle fires."""

    def __init__(self, fault: str | None = None, seed: int = 0) -> None:
        self.manager = HybridManager(GROUPS, BUDGET, max_seqs=MAX_SEQS,
                                     max_tokens_per_seq=MAX_TOKENS, seed=seed)
        m = self.manager
        self.kv = {name: np.full((m.allocator.allocator(name).num_pages, PAGE), -1,
                                 dtype=np.int64) for name in m.table.tokens}
        self.states = {name: np.full(m.allocator.allocator(name).num_pages, -1, dtype=np.int64)
                       for name in m.table.states}
        self.requests: dict[int, _Request] = {}
        self.next_id = 0
        self.num_moves = 0
        self.num_hits = 0  # admissions that restored a cached prefix
        self.skip_copies: set[HybridCopy] = set()  # copies a fault drops
        self.skip_dst: set[tuple[str, int]] = set()
        self.fault = None
        if fault is not None:
            if fault not in HYBRID_FAULTS:
                raise ArgumentError(f"no hybrid fault {fault!r}; choose one of "
                                    f"{sorted(HYBRID_FAULTS)}")
            self.fault = HYBRID_FAULTS[fault]
            self.fault.install(self)

    # -- moves ---------------------------------------------------------------------------------

    def step(self, name: str, a: int, b: int) -> bool:
        """One move; returns whether it did anything (a move that cannot apply is a no-op)."""
        try:
            did = getattr(self, "_" + name)(a, b)
        except FuzzFailure as f:
            f.move = self.num_moves
            raise
        except IntegrityError as e:
            raise FuzzFailure("hybrid_check", str(e), self.num_moves) from None
        except KVMemError as e:
            raise FuzzFailure("hybrid_error", f"{type(e).__name__}: {e}",
                              self.num_moves) from None
        if did:
            try:
                self.manager.check()
            except IntegrityError as e:
                raise FuzzFailure("hybrid_check", str(e), self.num_moves) from None
            self.num_moves += 1
        return bool(did)

    def _submit(self, a: int, b: int) -> bool:
        m = self.manager
        if not m.table.num_free_rows:
            return False
        rnd = random.Random(a << 20 | b)
        head = BASES[a % len(BASES)][: rnd.randint(0, 40)]
        prompt = head + rnd.choices(range(3), k=rnd.randint(1, 8))
        tokens = prompt + rnd.choices(range(3), k=rnd.randint(1, 10))
        ns = (a >> 4) % len(NAMESPACES)
        try:
            hit = m.admit(self.next_id, prompt, NAMESPACES[ns])
        except OutOfPagesError:
            return False
        req = self.requests[self.next_id] = _Request(ns, tokens, len(prompt))
        self.num_hits += hit.num_cached_tokens > 0
        if not hit.num_cached_tokens:  # a fresh state: the engine zeroes it
            for name in m.table.states:
                self.states[name][int(m.pages_of(self.next_id, name)[0])] = req.hashes[0]
        self.next_id += 1
        self._copy()
        return True

    def _step(self, a: int, b: int) -> bool:
        m = self.manager
        ids = [r for r in self.requests if stable_bit(a, r)]
        if not ids:
            if not self.requests:
                return False
            ids = [list(self.requests)[stable_pick(a, list(self.requests))]]
        counts = []
        C = m.checkpoint_tokens
        for i, rid in enumerate(ids):
            req, done = self.requests[rid], m.num_committed(rid)
            left = req.prompt_len - done
            if left <= 0:
                counts.append(1)
                continue
            # to the next checkpoint, a few tokens, the rest of the prompt, two checkpoints
            kind = (b >> (2 * i)) % 4
            n = (C - done % C, 1 + (b >> 8) % 7, left, 2 * C)[kind]
            counts.append(min(n, left))
        can = m.can_reserve(ids, counts)
        try:
            step = m.reserve(ids, counts)
        except OutOfPagesError:
            if can:
                raise FuzzFailure("hybrid_check", "can_reserve said yes, reserve found no "
                                  "room") from None
            return False
        if not can:
            raise FuzzFailure("hybrid_check", "can_reserve said no, reserve found room")
        report = m.verify(ids, step)
        if report.aborted:
            for rid in report.aborted:
                self.requests.pop(rid, None)
            raise FuzzFailure("hybrid_verify", f"verify aborted {report.aborted}")
        self._run(step)
        starts = (step.seq_lens - step.num_new_tokens).tolist()
        m.commit_batch(ids, [self.requests[r].tokens[s:e]
                             for r, s, e in zip(ids, starts, step.seq_lens.tolist())])
        self._copy()
        for rid, e in zip(ids, step.seq_lens.tolist()):
            if e == len(self.requests[rid].tokens):
                m.release(rid)
                del self.requests[rid]
        return True

    def _fork(self, a: int, b: int) -> bool:
        m = self.manager
        if not self.requests or not m.table.num_free_rows:
            return False
        parent = list(self.requests)[stable_pick(a, list(self.requests))]
        p = self.requests[parent]
        kept = p.tokens[: max(m.num_committed(parent), p.prompt_len)]
        if len(kept) >= MAX_TOKENS:  # (no room to generate a token of its own)
            return False
        try:
            m.fork(parent, self.next_id)
        except OutOfPagesError:
            return False
        rnd = random.Random(a << 20 | b)
        tokens = kept + rnd.choices(range(3), k=min(rnd.randint(1, 8), MAX_TOKENS - len(kept)))
        self.requests[self.next_id] = _Request(p.namespace, tokens, p.prompt_len)
        self.next_id += 1
        self._copy()
        return True

    def _release(self, a: int, b: int) -> bool:
        if not self.requests:
            return False
        rid = list(self.requests)[stable_pick(a, list(self.requests))]
        self.manager.release(rid)
        del self.requests[rid]
        return True

    # -- the device: copies, reads, writes -----------------------------------------------------

    def _copy(self) -> None:
        """Make the copies the manager listed (those a fault drops are not made)."""
        for c in self.manager.take_copies():
            if c in self.skip_copies or (c.group, c.dst) in self.skip_dst:
                self.skip_copies.discard(c)
                self.skip_dst.discard((c.group, c.dst))
                continue
            values = self.kv.get(c.group)
            if values is None:
                self.states[c.group][c.dst] = self.states[c.group][c.src]
            else:
                values[c.dst] = values[c.src]

    def _run(self, step: Any) -> None:
        """The step on the device: check what it reads (``hybrid_reads``), then write its
        tokens' values and advance its states."""
        ends = step.seq_lens.tolist()
        starts = (step.seq_lens - step.num_new_tokens).tolist()
        for name, g in step.groups.items():
            window = self.manager.table.tokens[name].window
            values = self.kv[name]
            for b, rid in enumerate(step.request_ids):
                req, s = self.requests[rid], starts[b]
                pages = g.indices[g.indptr[b] : g.indptr[b + 1]].tolist()
                first = int(g.first[b])
                lo = max(0, s - window + 1) if window else 0
                for pos in range(lo, s):
                    k = pos // PAGE - first
                    page = pages[k] if 0 <= k < len(pages) else None
                    if page is None or page < 0:
                        raise FuzzFailure("hybrid_reads", f"request {rid}: group {name!r} "
                                          f"position {pos} is in no page the step lists "
                                          f"({pages}, first {first})")
                    if values[page, pos % PAGE] != req.hashes[pos + 1]:
                        raise FuzzFailure("hybrid_reads", f"request {rid}: group {name!r} page "
                                          f"{page} holds at position {pos} a value not of its "
                                          "own tokens")
        for name, slots in step.state_slots.items():
            for b, rid in enumerate(step.request_ids):
                if self.states[name][slots[b]] != self.requests[rid].hashes[starts[b]]:
                    raise FuzzFailure("hybrid_reads", f"request {rid}: state {name!r} slot "
                                      f"{int(slots[b])} does not hold the state after its "
                                      f"{starts[b]} tokens")
        for name, g in step.groups.items():
            flat = self.kv[name].reshape(-1)
            written = [h for b, rid in enumerate(step.request_ids)
                       for h in self.requests[rid].hashes[starts[b] + 1 : ends[b] + 1]]
            flat[g.slot_mapping] = written
        for name, slots in step.state_slots.items():
            for b, rid in enumerate(step.request_ids):
                self.states[name][slots[b]] = self.requests[rid].hashes[ends[b]]

    def final_check(self) -> None:
        """Every request released, the cache cleared: every chunk back in the budget."""
        m = self.manager
        try:
            for rid in list(self.requests):
                m.release(rid)
            self.requests.clear()
            m.reserve([], 0)  # (the copies' holds go with the next step)
            if m.cache is not None:
                m.cache.clear()
            m.check()
        except IntegrityError as e:
            raise FuzzFailure("hybrid_check", str(e)) from None
        s = m.stats()
        if s.num_free_chunks != s.num_chunks:
            raise FuzzFailure("hybrid_check", f"{s.num_chunks - s.num_free_chunks} chunks still "
                              "held with no request running and the cache cleared")


# -- campaigns, replay, shrinking ---------------------------------------------------------------


@dataclass
class HybridCampaign:
    """One campaign: the moves it ran (up to the failure), the failure, its size and time, and
    the run (its manager, requests and value model as the campaign left them)."""

    schedule: list[Move]
    failure: FuzzFailure | None
    moves: int
    seconds: float
    seed: int
    run: HybridRun


def hybrid_campaign(fault: str | None = None, seed: int = 0, max_moves: int = 2000,
                    deadline: float | None = None) -> HybridCampaign:
    """Random moves (``random.Random(seed)``, the fault's weights over :data:`MOVES`) until
    ``max_moves`` did something, an oracle fires, or ``deadline`` passes; then the final check."""
    t0 = time.perf_counter()
    run = HybridRun(fault, seed)
    weights = {**MOVES, **(run.fault.weights if run.fault else {})}
    names = list(weights)
    cum = np.cumsum([weights[n] for n in names]).tolist()
    rnd = random.Random(seed)
    schedule: list[Move] = []
    failure = None
    try:
        tries = 0
        while run.num_moves < max_moves and tries < 20 * max_moves + 100:
            tries += 1
            if deadline is not None and not tries & 63 and time.perf_counter() > deadline:
                break
            move = (names[bisect.bisect(cum, rnd.random() * cum[-1])], rnd.getrandbits(20),
                    rnd.getrandbits(20))
            schedule.append(move)
            if not run.step(*move):
                schedule.pop()
        run.final_check()
    except FuzzFailure as f:
        failure = f
    return HybridCampaign(schedule, failure, run.num_moves, time.perf_counter() - t0, seed,
                          run)


def hybrid_replay(schedule: Sequence[Move], fault: str | None = None, seed: int = 0
                  ) -> HybridRun:
    """Run ``schedule`` exactly, then the final check; raises :class:`FuzzFailure` if an
    oracle fires, else returns the run."""
    for i, move in enumerate(schedule):
        if not (isinstance(move, (tuple, list)) and len(move) == 3 and move[0] in MOVES
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                        for x in move[1:])):
            raise ArgumentError(f"schedule[{i}]={move!r}: expected (move, int >= 0, int >= 0) "
                                f"with move one of {list(MOVES)}")
    run = HybridRun(fault, seed)
    for name, a, b in schedule:
        run.step(name, a, b)
    run.final_check()
    return run


def hybrid_shrink(schedule: Sequence[Move], oracle: str, fault: str | None = None,
                  seed: int = 0, max_replays: int = 300, deadline: float | None = None
                  ) -> list[Move]:
    """The shortest schedule found (delete chunks of moves, halves down to single moves) on
    which ``oracle`` still fires first; at most ``max_replays`` replays, until ``deadline``
    (a ``time.perf_counter()`` value)."""

    def fails(s: list[Move]) -> bool:
        try:
            hybrid_replay(s, fault, seed)
        except FuzzFailure as f:
            return f.oracle == oracle
        return False

    s = list(schedule)
    replays = 0

    def budget() -> bool:
        return replays < max_replays and (deadline is None or time.perf_counter() < deadline)

    n = 2
    while len(s) >= 2 and budget():
        chunk = -(-len(s) // n)
        cut = False
        start = 0
        while start < len(s) and budget():
            cand = s[:start] + s[start + chunk :]
            replays += 1
            if cand and fails(cand):
                s, cut = cand, True
            else:
                start += chunk
        if not cut:
            if chunk == 1:
                break
            n = min(2 * n, len(s))
        else:
            n = max(n - 1, 2)
    return s


def hybrid_hunt(fault: str | None, seed: int = 0, max_campaigns: int = 20,
                moves_per_campaign: int = 1500, shrink_replays: int = 200,
                deadline: float | None = None,
                progress: Callable[[str], None] | None = None) -> FaultResult:
    """Campaigns with ``fault`` on (seeds ``seed, seed + 1, ...``) until an oracle fires, the
    failing schedule shrunk (for at most a minute); ``fault=None``: a fault-free hunt (a
    failure is a bug)."""
    t0 = time.perf_counter()
    if fault is not None and fault not in HYBRID_FAULTS:
        raise ArgumentError(f"no hybrid fault {fault!r}; choose one of {list(HYBRID_FAULTS)}")
    expected = HYBRID_FAULTS[fault].expected if fault is not None else ""
    moves = 0
    for s in range(seed, seed + max_campaigns):
        if deadline is not None and time.perf_counter() > deadline:
            break
        c = hybrid_campaign(fault, s, moves_per_campaign, deadline)
        moves += c.moves
        if progress is not None:
            progress(f"hybrid {fault or 'fault-free'}: {moves} moves, seed {s}")
        if c.failure is not None:
            f = c.failure
            small = c.schedule
            if shrink_replays and f.move is not None:
                small = hybrid_shrink(c.schedule[: f.move + 1], f.oracle, fault, s,
                                      shrink_replays, time.perf_counter() + 60)
            return FaultResult(fault or "none", True, f.oracle, len(small),
                               time.perf_counter() - t0, moves, expected=expected,
                               message=str(f), engine="hybrid", seed=s, schedule=small)
    return FaultResult(fault or "none", False, None, None, time.perf_counter() - t0, moves,
                       expected=expected, engine="hybrid", seed=seed)



def hybrid_clean(seed: int = 0, moves: int = 10_000, deadline: float | None = None,
                 progress: Callable[[str], None] | None = None,
                 shrink_replays: int = 300) -> FaultResult:
    """Fault-free campaigns of 3,000 moves each (seeds ``seed + 10**6, ...``) until ``moves``
    or ``deadline``; the first failure is shrunk (for at most a minute) and ends the run."""
    t0 = time.perf_counter()
    done = 0
    s = seed + 10**6
    while done < moves and (deadline is None or time.perf_counter() < deadline):
        c = hybrid_campaign(None, s, min(3000, moves - done), deadline)
        done += c.moves
        if progress is not None:
            progress(f"hybrid fault-free: {done} moves, "
                     f"{done / max(time.perf_counter() - t0, 1e-9):.0f} moves/s, seed {s}")
        f = c.failure
        if f is not None:
            small = c.schedule
            if shrink_replays and f.move is not None:
                small = hybrid_shrink(c.schedule[: f.move + 1], f.oracle, None, s,
                                      shrink_replays, time.perf_counter() + 60)
            return FaultResult("none", True, f.oracle, len(small), time.perf_counter() - t0,
                               done, message=str(f), engine="hybrid", seed=s, schedule=small)
        s += 1
    return FaultResult("none", False, None, None, time.perf_counter() - t0, done,
                       engine="hybrid", seed=seed + 10**6)
