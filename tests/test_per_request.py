"""The per-request paths against the batched ones: the same calls, the same state.

One request's admission reuses the ``match_prefix`` lookup right before it
(``Admission.reuse_lookups``), its prefill chunk is reserved by ``Reserver.reserve_one`` (a
decode step that requests join by ``Reserver.reserve_mixed``, its decodes committed by
``Committer.commit_head``, its writes checked by the verifier's ``_mixed_writes_ok``),
verified by the verifier's one-row checks and committed by ``Committer.commit_one`` (a few
rows' chunks by ``Committer.commit_few``) (``per_request``): sized for one row. A manager with those
switches off takes the batched paths for everything. Two managers, one of each, run the same
seeded random workload (admissions with shared prefixes and namespaces, chunks, commits,
verifies, forks, preemptions, fences, releases, and calls that must fail); after every call
the results (step metadata, admit results, reports, errors and their messages) and the whole
state (``full_snapshot``: page table, tags, refcounts, tracker, prefix cache, ...) must be
equal, with the checking tracker and with the paranoid one (a full check beside every fast
verification).
"""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
from conftest import full_snapshot

from kvmem import KVCacheManager, KVMemError
from kvmem.allocator import HashedPrefixCache
from kvmem.integrations.vllm._prefix_cache import VllmOrderPrefixCache
from kvmem.manager import StepMetadata

P = 4


def batched(mgr: KVCacheManager) -> KVCacheManager:
    """Switch a manager's per-request paths off: every call takes the batched path."""
    mgr._admission.reuse_lookups = False
    mgr._reserver.per_request = False
    mgr._committer.per_request = False
    mgr.verifier.per_request = False
    return mgr


def outcome(value: Any) -> Any:
    """A comparable form of what a call returned."""
    if isinstance(value, StepMetadata):
        return tuple((f.name, (getattr(value, f.name).dtype.str,
                               getattr(value, f.name).tolist()))
                     if isinstance(getattr(value, f.name), np.ndarray)
                     else (f.name, getattr(value, f.name)) for f in fields(value))
    if hasattr(value, "aborted"):  # a VerifyReport
        return value.request_ids, value.aborted
    if hasattr(value, "pages") and hasattr(value, "num_evictable"):  # a PrefixMatch
        return value.pages.tolist(), value.keys.tolist(), value.num_evictable
    return value


def call(mgr: KVCacheManager, op: tuple[Any, ...]) -> Any:
    """Run one workload step on ``mgr``: (``"ok"``, result) or (``"error"``, type, message)."""
    name, *args = op
    try:
        if name == "reserve_verify":  # an engine's step: its reserve, then its check
            ids, counts = args
            step = mgr.reserve(ids, counts)
            return "ok", (outcome(step), outcome(mgr.verify(ids, step)))
        if name == "lookup_admit":  # an engine that looks the prefix up first (vLLM's)
            rid, tokens, ns, cut = args
            match = mgr.match_prefix(tokens, ns)
            hit = match.num_pages * P if cut else len(tokens) - 1
            return "ok", (outcome(match), mgr.admit(rid, tokens[: hit + 1], ns))
        result = getattr(mgr, name)(*args)
    except KVMemError as e:
        return "error", type(e).__name__, str(e)
    return "ok", outcome(result)


class Workload:
    """Seeded random calls over a few prompt families (shared prefixes) and namespaces,
    mostly ones that fit the state of ``mgr`` (a request commits its own prompt, so its full
    pages can be hit later), some that must fail."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_id = 0
        self.prompts: dict[str, list[int]] = {}
        self.families = [[self.rng.randrange(50) for _ in range(6 * P)] for _ in range(3)]
        self.joined: list[Any] = []  # the decode rows of the latest reserve_join
        self.join_ids: list[Any] = []  # and all its rows

    def prompt(self) -> list[int]:
        r = self.rng
        head = r.choice(self.families)[: r.randrange(0, 6 * P + 1)]
        return head + [r.randrange(50) for _ in range(r.randrange(1 if not head else 0, 3 * P))]

    def op(self, mgr: KVCacheManager) -> tuple[Any, ...]:
        r = self.rng
        running = list(mgr.running)
        known = list(self.prompts)
        if running and r.random() < 0.9:
            some = r.choice(running)
        else:
            some = r.choice(known) if known and r.random() < 0.95 else "nobody"
        kind = r.choices(["admit", "lookup_admit", "reserve", "reserve_batch", "commit",
                          "commit_batch", "verify", "release", "preempt", "resume", "fork",
                          "fence", "retire", "can_admit", "take_events", "reserve_join",
                          "commit_join", "commit_rows"],
                         [3, 4, 8, 2, 8, 2, 2, 3, 1, 1, 1, 1, 1, 1, 1, 3, 1, 3])[0]
        if self.joined and r.random() < 0.5:  # (often right after the step they check)
            kind = r.choice(["commit_join", "verify_join"])
        ns = r.choice([None, None, "t"])
        if kind in ("admit", "lookup_admit", "fork"):
            rid = f"r{self.next_id}" if r.random() < 0.95 else some
            self.next_id += 1
            tokens = self.prompt()
            if r.random() < 0.03:
                tokens = [1] * (20 * P)  # longer than a row: refused
            self.prompts.setdefault(rid, tokens)
            if kind == "fork":
                self.prompts[rid] = self.prompts.get(some, tokens)
                return ("fork", some, rid)
            if kind == "admit":
                return ("admit", rid, tokens, ns)
            return ("lookup_admit", rid, tokens, ns, r.random() < 0.8)
        if kind == "reserve":
            return ("reserve", [some], r.choice([0, 1, P - 1, P + 1, 2 * P + 3, 5 * P, 40 * P]))
        if kind == "reserve_batch":
            ids = r.sample(running, min(len(running), 3)) or ["nobody"]
            return ("reserve", ids, [r.randrange(3 * P) for _ in ids])
        if kind == "reserve_join":  # a decode step that requests join: k each, then chunks
            ids = r.sample(running, len(running)) or ["nobody"]
            head = r.randrange(1, len(ids) + 1)
            k = r.choice([0, 1, 1, 1, 2, P])
            tail = [r.choice([0, 1, P + 1, 3 * P, 5 * P + 2, 40 * P]) for _ in ids[head:]]
            self.joined, self.join_ids = ids[:head], ids
            return (r.choice(["reserve", "reserve_verify"]), ids, [k] * head + tail)
        if kind == "verify_join":  # the step just reserved, with its metadata
            return ("verify", self.join_ids)
        if kind == "commit_join":  # the decodes of the step just reserved
            ids = self.joined[: r.randrange(len(self.joined)) + 1] if self.joined else ["nobody"]
            self.joined = []
            return ("commit_batch", ids, [r.randrange(50) for _ in ids])
        if kind == "commit_rows":  # a few requests' chunks in one call
            ids = r.sample(running, min(len(running), r.randrange(2, 5))) or ["nobody"]
            tokens = []
            for rid in ids:
                done = mgr.num_committed(rid) if rid in running else 0
                room = mgr.num_tokens(rid) - done if rid in running else 3
                count = r.randrange(room + 1) if r.random() < 0.95 else room + 1
                own = self.prompts.get(rid, [])[done : done + count]
                tokens.append(own + [r.randrange(50) for _ in range(count - len(own))])
            return ("commit_batch", ids, tokens)
        if kind in ("commit", "commit_batch"):
            done = mgr.num_committed(some) if some in running else 0
            room = mgr.num_tokens(some) - done if some in running else 3
            count = r.randrange(room + 1) if r.random() < 0.9 else room + 1
            own = self.prompts.get(some, [])[done : done + count]
            tokens = own + [r.randrange(50) for _ in range(count - len(own))]
            return ("commit", some, tokens) if kind == "commit" else (
                "commit_batch", [some], [tokens])
        if kind == "verify":
            return ("verify", [some])
        if kind == "can_admit":
            return ("can_admit", self.prompt(), ns)
        if kind in ("release", "preempt", "resume"):
            return (kind, some)
        return (kind,)  # fence, retire, take_events


def fence(mgr: KVCacheManager, handles: list[Any]) -> tuple[str, Any]:
    handles.append(mgr.begin_step())
    return "ok", None


CACHES = {"hashed": HashedPrefixCache, "vllm order": VllmOrderPrefixCache,
          "hashed, KV events": HashedPrefixCache}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("tracker", ["checking", "paranoid"])
@pytest.mark.parametrize("seed", range(6))
def test_per_request_paths_leave_the_state_the_batched_paths_leave(
        make_manager: Any, tracker: str, seed: int, cache: str) -> None:
    """Guards every per-request path (admission's reuse of a lookup, reserve_one, the
    verifier's one-row checks, commit_one with its run of keys): a workload through them and
    through the batched paths gives equal results, errors and state after every call, with
    either prefix cache, and with KV events (``take_events`` calls compare them)."""
    fast, slow = (make_manager(40, page_size=P, max_seqs=5, max_pages_per_seq=12,
                               tracker=tracker, prefix_cache=CACHES[cache](seed=seed),
                               kv_events="events" in cache)
                  for _ in range(2))
    batched(slow)
    work = Workload(seed)
    handles: dict[int, list[Any]] = {id(fast): [], id(slow): []}
    errors = 0
    for i in range(400):
        op = work.op(fast)
        got = []
        for mgr in (fast, slow):
            if op[0] == "fence":
                got.append(fence(mgr, handles[id(mgr)]))
            elif op[0] == "retire":
                mine = handles[id(mgr)]
                got.append(("ok", mgr.retire(mine.pop(0))) if mine else ("ok", None))
            else:
                got.append(call(mgr, op))
        assert got[0] == got[1], f"call {i} {op}"
        assert full_snapshot(fast) == full_snapshot(slow), f"state after call {i} {op}"
        errors += got[0][0] == "error"
    fast.check()
    slow.check()
    assert errors  # the workload reached the checks (refused calls are compared too)


def test_reserve_one_and_commit_one_take_one_request(make_manager: Any) -> None:
    """The per-request paths are the ones a single request's chunk takes (a regression that
    sent it to the batched path would leave the differential test above comparing a path
    with itself)."""
    mgr = make_manager()
    taken: list[str] = []
    reserver, committer = mgr._reserver, mgr._committer
    one, any_ = reserver.reserve_one, reserver.reserve_any
    reserver.reserve_one = lambda *a: taken.append("reserve_one") or one(*a)
    reserver.reserve_any = lambda *a: taken.append("reserve_any") or any_(*a)
    commit_one = committer.commit_one
    committer.commit_one = lambda *a: taken.append("commit_one") or commit_one(*a)
    mgr.admit("a", list(range(10)))
    mgr.reserve(["a"], 10)
    mgr.commit("a", list(range(10)))
    assert taken == ["reserve_one", "commit_one"]
    batched(mgr)
    taken.clear()
    mgr.reserve(["a"], 2 * P)
    mgr.commit("a", list(range(2 * P)))
    assert taken == ["reserve_any"]


def test_a_decode_step_that_requests_join_takes_reserve_mixed(make_manager: Any) -> None:
    """A batch whose leading rows gain one count of at most a page and whose last few gain
    others (a decode step that requests join) takes ``reserve_mixed``; more joining rows, or
    rows of the head's count after them, take ``reserve_any`` (a regression that sent every
    such step to one path would leave the differential test above comparing a path with
    itself)."""
    mgr = make_manager(64, page_size=P, max_seqs=16)
    taken: list[str] = []
    reserver = mgr._reserver
    mixed, any_ = reserver.reserve_mixed, reserver.reserve_any
    reserver.reserve_mixed = lambda *a: taken.append("mixed") or mixed(*a)
    reserver.reserve_any = lambda *a: taken.append("any") or any_(*a)
    for i in range(12):
        mgr.admit(i, list(range(10 * i, 10 * i + 3)))
    step = mgr.reserve([0, 1, 2, 3], [1, 1, 3, 2 * P])
    assert taken == ["mixed"]
    assert step.num_new_tokens.tolist() == [1, 1, 3, 2 * P]
    mgr.reserve([0, 1, 2, 3], [1, 2 * P, 1, 1])  # the head's count after the joining row
    mgr.reserve(list(range(12)), [1, 1] + [2] * 10)  # more joining rows than MIXED_TAIL
    assert taken == ["mixed", "any", "any"]
    mgr.check()


def test_admit_reuses_the_lookup_right_before_it_only(make_manager: Any) -> None:
    """An admit right after match_prefix (same tokens, namespace, pages) reuses its match; any
    manager call in between, or other tokens, matches again (BUGS 7: a hit evicted and
    reallocated in between must never be acquired)."""
    mgr = make_manager()
    prompt = list(range(4 * P + 1))
    mgr.admit("a", prompt)
    mgr.reserve(["a"], len(prompt))
    mgr.commit("a", prompt)
    mgr.release("a")  # its 4 full pages stay cached
    cache = mgr.cache
    matched: list[int] = []
    real = cache.match
    cache.match = lambda *a: matched.append(1) or real(*a)
    hit = mgr.match_prefix(prompt)
    assert hit.num_pages == 4 and len(matched) == 1
    assert mgr.admit("b", prompt[: 4 * P + 1]).num_hit_pages == 4
    assert len(matched) == 1  # reused
    mgr.release("b")
    mgr.match_prefix(prompt)
    mgr.can_admit(prompt)  # a manager call in between
    matched.clear()
    assert mgr.admit("c", prompt).num_hit_pages == 4
    assert len(matched) == 1  # matched again
    mgr.release("c")
    mgr.match_prefix(prompt)
    matched.clear()
    other = [*prompt[: 2 * P], 99, *prompt[2 * P + 1 :]]
    assert mgr.admit("d", other).num_hit_pages == 2
    assert len(matched) == 1
