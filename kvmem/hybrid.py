"""HybridManager: the KV pages of a model whose layers keep different kinds of cache.

One manager holds every KV cache group of the model (``kvmem.allocator``'s group specs), each
with its own page size, all paid from one byte budget with no group padded to another's size::

    groups = [FullAttentionSpec("full", 16, 4096), SlidingWindowSpec("swa", 128, 32, 4096),
              StateSpec("gdn", 1 << 20), IndexerSpec("idx", full, 132)]
    mgr = HybridManager(groups, budget_bytes=8 << 30)

Life of a request (``C`` = ``checkpoint_tokens``)::

    admit(id, prompt)    the longest cached prefix every group can restore (a multiple of C,
                         at most len(prompt) - 1): its pages shared, a state slot allocated;
                         copies (checkpoint -> the new slot) listed for the engine
    reserve(ids, n)      every request gains n token slots: pages in every token group where
                         it crosses a page boundary (a sliding window's from its window's
                         first page on), all groups or none -> HybridStep (per-group CSR,
                         slot mappings, state slots)
    verify(ids, step)    the batched check in every group; only the broken requests fail
    commit(id, tokens)   their KV is written: sliding-window pages the next query no longer
                         reads are released; at each checkpoint the prefix is cached (a state
                         checkpoint when the commit ends exactly there: a copy listed)
    fork / release

``take_copies()`` hands the engine the state and page copies to perform (restores, checkpoints,
a fork's copies) before its next step: their pages and slots stay held until the next
``reserve``. A manager is used by one thread at a time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvmem._validate import id_tuple, integer, is_hashable, token_array
from kvmem.allocator import (
    RELEASED,
    CheckpointEntry,
    GroupAllocator,
    GroupPrefixCache,
    GroupSpec,
    GroupStats,
    GroupTable,
    HybridRequest,
    HybridStep,
    SlidingWindowSpec,
    StateSpec,
    check_groups,
)
from kvmem.errors import ArgumentError, ConfigError, IntegrityError, OutOfPagesError
from kvmem.integrity import check_hybrid_step

__all__ = ["HybridAdmit", "HybridCopy", "HybridManager", "HybridReport"]

log = logging.getLogger(__name__)


class HybridCopy(NamedTuple):
    """A copy the engine performs before its next step: group ``group``'s page or slot
    ``src`` into ``dst`` (whole pages / states)."""

    group: str
    src: int
    dst: int


@dataclass(frozen=True)
class HybridAdmit:
    """``admit``'s answer: tokens restored from the prefix cache (their KV and states are in
    the request's pages once ``take_copies()``' copies are made) and the prompt's length."""

    request_id: Any
    num_cached_tokens: int
    num_prompt_tokens: int


@dataclass(frozen=True)
class HybridReport:
    """``verify``'s answer: ``aborted`` maps each request whose metadata broke in some group
    to the reason (those requests are released); the others may run."""

    aborted: dict[Any, str]

    @property
    def ok(self) -> bool:
        return not self.aborted


class HybridManager:
    """The pages of every KV cache group of one model, for its running requests.

    Parameters
    ----------
    groups: the model's group specs (``FullAttentionSpec``, ``SlidingWindowSpec``,
        ``StateSpec``, ``IndexerSpec``), distinct names
    budget_bytes: bytes every group's pages share
    chunk_bytes: the arena's unit (default: four of the largest page)
    max_tokens_per_seq: a request's most tokens (default 131072)
    enable_prefix_caching: cache prefixes at checkpoints
    checkpoint_tokens: tokens between checkpoints, a multiple of every token group's page size
        (default: their least common multiple)
    seed: the prefix keys' seed (a restarted manager with the same seed finds the same keys)
    """

    def __init__(self, groups: Sequence[GroupSpec], budget_bytes: int, *,
                 chunk_bytes: int | None = None, max_tokens_per_seq: int = 131072,
                 enable_prefix_caching: bool = True, checkpoint_tokens: int | None = None,
                 seed: int = 0) -> None:
        self.groups = check_groups(groups)
        self.allocator = GroupAllocator(self.groups, budget_bytes, chunk_bytes)
        self.table = GroupTable(self.groups)
        self.max_tokens_per_seq = integer(max_tokens_per_seq, "max_tokens_per_seq", minimum=1)
        sizes = [g.page_size for g in self.table.token_groups]
        least = math.lcm(*sizes) if sizes else 1
        C = least if checkpoint_tokens is None else integer(checkpoint_tokens,
                                                            "checkpoint_tokens", minimum=1)
        if C % least:
            raise ConfigError(f"checkpoint_tokens={C} is not a multiple of every token group's "
                              f"page size {sizes}: use a multiple of {least}.")
        self.checkpoint_tokens = C
        self.cache = (GroupPrefixCache(self.allocator, tuple(g.name for g in
                                                             self.table.state_groups), C,
                                       integer(seed, "seed"))
                      if enable_prefix_caching else None)
        self._page_sizes = {g.name: g.page_size for g in self.table.token_groups}
        self._specs = {g.name: g for g in self.groups}
        self._copies: list[HybridCopy] = []
        self._held_for_copies: dict[str, list[int]] = {}
        self.num_checkpoints_skipped = 0  # state checkpoints not taken for want of room

    # -- admission ---------------------------------------------------------------------------

    def _match(self, tokens: list[int], namespace: Any
               ) -> tuple[int, list[bytes], list[CheckpointEntry]]:
        if self.cache is None or len(tokens) < 2:
            return 0, [], []
        C = self.checkpoint_tokens
        return self.cache.match(tokens, namespace, (len(tokens) - 1) // C * C)

    def _prompt(self, token_ids: Any) -> list[int]:
        tokens: list[int] = token_array(token_ids, "token_ids").tolist()
        if not tokens:
            raise ArgumentError("token_ids is empty: a request needs at least one prompt token "
                                "(nothing changed)")
        if len(tokens) > self.max_tokens_per_seq:
            raise ArgumentError(f"the prompt has {len(tokens)} tokens, more than "
                                f"max_tokens_per_seq={self.max_tokens_per_seq} (nothing changed)")
        return tokens

    def match_prefix(self, token_ids: Any, namespace: Any = None) -> int:
        """Tokens of ``token_ids`` an ``admit`` now would restore from the cache (a lookup:
        changes nothing)."""
        return self._match(self._prompt(token_ids), namespace)[0]

    def can_admit(self, token_ids: Any, namespace: Any = None, chunk: int | None = None
                  ) -> bool:
        """Whether ``admit`` would succeed and the prompt's prefill would then find its pages
        in every group (in chunks of ``chunk`` tokens, default the whole prompt: a sliding
        window holds at most its window and one chunk). Changes nothing."""
        tokens = self._prompt(token_ids)
        end, keys, chain = self._match(tokens, namespace)
        n = len(tokens)
        chunk = n if chunk is None else integer(chunk, "chunk", minimum=1)
        needs = {}
        for g in self.groups:
            if isinstance(g, StateSpec):
                needs[g.name] = 1
            elif isinstance(g, SlidingWindowSpec):  # at most its window and a chunk, held
                peak = min(-(-n // g.page_size), -(-(g.window + chunk) // g.page_size) + 1)
                restored = len(chain[-1].pages[g.name]) if chain else 0
                needs[g.name] = max(0, peak - restored)
            else:
                needs[g.name] = -(-n // g.page_size) - end // g.page_size
        return self._fits(needs, set(keys))

    def admit(self, request_id: Any, token_ids: Any, namespace: Any = None) -> HybridAdmit:
        """Admit a request: restore its longest cached prefix every group can serve, allocate
        a slot in every state group. Tokens from the restored prefix on are computed in
        ``reserve`` steps.

        Raises ArgumentError (duplicate id, empty or too long prompt), OutOfPagesError (no
        room for its state slots); nothing changed then.
        """
        if not is_hashable(request_id) or request_id in self.table.requests:
            raise ArgumentError(f"request {request_id!r} is already running (or not hashable); "
                                "release it first or use a new id")
        tokens = self._prompt(token_ids)
        end, keys, chain = self._match(tokens, namespace)
        needs = {g.name: 1 for g in self.table.state_groups}
        self._make_room(needs, set(keys))
        req = HybridRequest(namespace, tokens, self.groups)
        shared: dict[str, list[int]] = {}
        for g in self.table.token_groups:
            if isinstance(g, SlidingWindowSpec):
                first = self.table.first_page(g, end)
                pages = [RELEASED] * first + (chain[-1].pages[g.name] if chain else [])
            else:
                pages = [p for e in chain for p in e.pages[g.name]]
            shared[g.name] = [p for p in pages if p != RELEASED]
            tags = self.allocator.tags(g.name)
            req.rows[g.name].restore(pages, [int(tags[p]) if p != RELEASED else 0
                                             for p in pages])
        if any(shared.values()):
            self.allocator.share({k: v for k, v in shared.items() if v})
        slots = self.allocator.allocate(needs) if needs else {}
        for name, slot in slots.items():
            s = int(slot[0])
            req.states[name] = (s, int(self.allocator.tags(name)[s]))
            req.state_tokens[name] = end
            if chain:
                src = chain[-1].states[name]
                self._copy(name, src, s)
        req.num_tokens = req.num_committed = end
        if self.cache is not None and keys:
            self.cache.touch(keys)
        self.table.requests[request_id] = req
        req.keys = keys
        return HybridAdmit(request_id, end, len(tokens))

    # -- the step ----------------------------------------------------------------------------

    def can_reserve(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]) -> bool:
        """Whether ``reserve(request_ids, num_tokens)`` would find its pages now."""
        reqs, counts = self._batch(request_ids, num_tokens)
        return self._fits(self._growth(reqs, counts))

    def reserve(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]
                ) -> HybridStep:
        """Give every request of the batch ``num_tokens`` more token slots (an int, or one
        count per request) in every token group, and return the step's metadata. Evicts
        cached prefixes if it must. All or nothing.

        Raises ArgumentError (unknown or repeated id, too many tokens), OutOfPagesError (not
        enough room even after evicting every cached prefix); nothing changed then.
        """
        reqs, counts = self._batch(request_ids, num_tokens)
        needs = self._growth(reqs, counts)
        self._make_room(needs)
        new = self.allocator.allocate({k: v for k, v in needs.items() if v})
        at = dict.fromkeys(new, 0)
        starts, ends = [], []
        for req, n in zip(reqs, counts):
            end = req.num_tokens + n
            grow = self.table.growth(req, end)
            pages = {}
            tags = {}
            for name, k in grow.items():
                if k:
                    pages[name] = new[name][at[name] : at[name] + k]
                    tags[name] = self.allocator.tags(name)[pages[name]]
                    at[name] += k
            self.table.append(req, pages, tags)
            starts.append(req.num_tokens)
            ends.append(end)
            req.num_tokens = end
        if self._held_for_copies:  # the engine made the listed copies before this step
            held, self._held_for_copies = self._held_for_copies, {}
            self.allocator.free(held)
        ids = id_tuple(request_ids, "request_ids")
        return self.table.step(ids, starts, ends)

    def verify(self, request_ids: Sequence[Any], step: HybridStep) -> HybridReport:
        """Check the step's metadata in every group against what each request recorded and
        the pages' lifetimes now (``kvmem.integrity.check_hybrid_step``). Each request that
        fails is released (its pages dropped) and reported; the others run."""
        ids = id_tuple(request_ids, "request_ids")
        if ids != tuple(step.request_ids):
            raise ArgumentError(f"verify() was given {len(ids)} request ids that are not the "
                                "step's batch; pass the ids the step was reserved for")
        records = [self.table.requests.get(rid) if is_hashable(rid) else None for rid in ids]
        holders: dict[str, dict[int, int]] = {g.name: {} for g in self.table.state_groups}
        for req in self.table.requests.values():
            for name, (slot, _) in req.states.items():
                holders[name][slot] = holders[name].get(slot, 0) + 1
        bad = check_hybrid_step(step, records, self._page_sizes, self._first_page,
                                {g.name: self.allocator.tags(g.name) for g in self.groups},
                                holders)
        aborted = {ids[b]: why for b, why in sorted(bad.items())}
        for rid, why in aborted.items():
            log.warning("request %r aborted: %s", rid, why)
            if rid in self.table.requests:
                self.release(rid)
        return HybridReport(aborted)

    def commit(self, request_id: Any, token_ids: Any) -> None:
        """The KV (and state) of these tokens, the request's next reserved ones, is written.
        Pages the next query's window leaves are released; each checkpoint reached is cached
        (its state too when the commit ends exactly there). Raises ArgumentError, changing
        nothing, if more tokens than reserved are committed or a prompt token differs."""
        req = self._running(request_id)
        tokens: list[int] = token_array(token_ids, "token_ids").tolist()
        c = req.num_committed
        if len(tokens) > req.num_tokens - c:
            raise ArgumentError(f"request {request_id!r}: commits {len(tokens)} tokens but has "
                                f"{req.num_tokens - c} reserved, uncommitted slots (nothing "
                                "changed)")
        known = req.tokens[c : c + len(tokens)]
        if tokens[: len(known)] != known:
            raise ArgumentError(f"request {request_id!r}: the committed tokens differ from its "
                                f"prompt at positions {c}..{c + len(known) - 1} (nothing "
                                "changed)")
        req.tokens.extend(tokens[len(known):])
        req.num_committed = c + len(tokens)
        for name in req.state_tokens:
            req.state_tokens[name] = req.num_committed
        if self.cache is not None:
            self._checkpoint(req)
        gone = self.table.outside_window(req)
        if gone:
            self.allocator.free(gone)

    def release(self, request_id: Any) -> None:
        """Forget a request (finished or aborted): drop every page and slot it holds."""
        req = self._running(request_id)
        held = {k: v for k, v in self.table.held(req).items() if v}
        if held:
            self.allocator.free(held)
        del self.table.requests[request_id]

    def fork(self, parent_id: Any, child_id: Any) -> list[HybridCopy]:
        """Start ``child_id`` as a copy of ``parent_id`` (beam search, parallel sampling): it
        shares the parent's full pages, gets its own copy of each partly filled tail page and
        of every state (listed in ``take_copies()``; also returned). All or nothing."""
        parent = self._running(parent_id)
        if not is_hashable(child_id) or child_id in self.table.requests:
            raise ArgumentError(f"request {child_id!r} is already running (or not hashable)")
        if parent.num_committed != parent.num_tokens:
            pending = parent.num_tokens - parent.num_committed
            raise ArgumentError(f"request {parent_id!r} has {pending} reserved, uncommitted "
                                "slots; commit its step before forking it (nothing changed)")
        tails = {g.name: parent.num_tokens % g.page_size != 0 for g in self.table.token_groups}
        needs = {name: 1 for name, t in tails.items() if t}
        needs.update({g.name: 1 for g in self.table.state_groups})
        self._make_room(needs)
        new = self.allocator.allocate(needs) if needs else {}
        child = HybridRequest(parent.namespace, list(parent.tokens), self.groups)
        child.num_tokens = child.num_committed = parent.num_committed
        copies: list[HybridCopy] = []
        shared: dict[str, list[int]] = {}
        for name, prow in parent.rows.items():
            row = child.rows[name]
            row.restore(prow.pages, prow.tags)
            if tails[name]:
                dst = int(new[name][0])
                copies.append(self._copy(name, prow.pages[-1], dst))
                row.set_last(dst, int(self.allocator.tags(name)[dst]))
            shared[name] = [p for p in prow.pages[: len(prow.pages) - tails[name]]
                            if p != RELEASED]
        if any(shared.values()):
            self.allocator.share({k: v for k, v in shared.items() if v})
        for name, (slot, _) in parent.states.items():
            dst = int(new[name][0])
            copies.append(self._copy(name, slot, dst))
            child.states[name] = (dst, int(self.allocator.tags(name)[dst]))
            child.state_tokens[name] = parent.state_tokens[name]
        self.table.requests[child_id] = child
        child.keys = list(parent.keys)
        return copies

    def take_copies(self) -> list[HybridCopy]:
        """The copies listed since the last call (restores, checkpoints, forks), in order;
        the engine performs them before its next step (``reserve`` releases their holds)."""
        out, self._copies = self._copies, []
        return out

    # -- queries -----------------------------------------------------------------------------

    def num_tokens(self, request_id: Any) -> int:
        return self._running(request_id).num_tokens

    def num_committed(self, request_id: Any) -> int:
        return self._running(request_id).num_committed

    def pages_of(self, request_id: Any, group: str) -> npt.NDArray[np.int32]:
        """``[k]`` int32: the request's row in a token group (``-1`` where released), or its
        slot in a state group."""
        req = self._running(request_id)
        if group in req.states:
            return np.array([req.states[group][0]], dtype=np.int32)
        if group not in req.rows:
            raise ArgumentError(f"group={group!r}: no such group; the groups are "
                                f"{[g.name for g in self.groups]}")
        return np.array(req.rows[group].pages, dtype=np.int32)

    def stats(self) -> GroupStats:
        return self.allocator.stats()

    def check(self) -> None:
        """Verify the bookkeeping: every page's holders are exactly the running requests, the
        cache's entries and the pending copies that hold it, and each request's recorded tags
        are its pages' tags now; raises IntegrityError naming the problems."""
        self.allocator.check()
        problems = []
        for g in self.groups:
            counts: dict[int, int] = {}
            for req in self.table.requests.values():
                for p in self.table.held(req).get(g.name, []):
                    counts[p] = counts.get(p, 0) + 1
            if self.cache is not None:
                for p in self.cache.references().get(g.name, []):
                    counts[p] = counts.get(p, 0) + 1
            for p in self._held_for_copies.get(g.name, []):
                counts[p] = counts.get(p, 0) + 1
            alloc = self.allocator.allocator(g.name)
            ppc = self.allocator.pages_per_chunk[self.allocator.names.index(g.name)]
            owners = self.allocator.arena.owners
            mine = np.flatnonzero(np.repeat(owners, ppc) == self.allocator.names.index(g.name))
            rc = alloc.refcounts
            wrong = [p for p in mine.tolist() if rc[p] != counts.get(p, 0)]
            if wrong:
                problems.append(f"group {g.name!r}: pages {wrong[:8]} have holders "
                                f"{[int(rc[p]) for p in wrong[:8]]}, expected "
                                f"{[counts.get(p, 0) for p in wrong[:8]]}")
            tags = alloc.tags
            for rid, req in self.table.requests.items():
                if g.name in req.rows:
                    row = req.rows[g.name]
                    stale = [i for i, (p, t) in enumerate(zip(row.pages, row.tags))
                             if p != RELEASED and int(tags[p]) != t]
                elif g.name in req.states:
                    slot, tag = req.states[g.name]
                    stale = [0] if int(tags[slot]) != tag else []
                else:
                    stale = []
                if stale:
                    problems.append(f"request {rid!r}, group {g.name!r}: row indices "
                                    f"{stale[:8]} hold pages whose lifetime changed")
        if problems:
            raise IntegrityError("HybridManager.check() failed: " + "; ".join(problems))

    # -- internals ---------------------------------------------------------------------------

    def _first_page(self, group: str, position: int) -> int:
        return self.table.first_page(self._specs[group], position)  # type: ignore[arg-type]

    def _running(self, request_id: Any) -> HybridRequest:
        req = self.table.requests.get(request_id) if is_hashable(request_id) else None
        if req is None:
            raise ArgumentError(f"request {request_id!r} is not running (admit it first)")
        return req

    def _batch(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]
               ) -> tuple[list[HybridRequest], list[int]]:
        ids = id_tuple(request_ids, "request_ids")
        if len(set(ids)) != len(ids):
            raise ArgumentError(f"request_ids lists a request twice: {list(ids)[:8]}")
        reqs = [self._running(rid) for rid in ids]
        if isinstance(num_tokens, (int, np.integer)):
            counts = [integer(num_tokens, "num_tokens", minimum=0)] * len(ids)
        else:
            counts = [integer(n, "num_tokens[i]", minimum=0) for n in num_tokens]
            if len(counts) != len(ids):
                raise ArgumentError(f"num_tokens has {len(counts)} counts for {len(ids)} "
                                    "requests")
        for rid, req, n in zip(ids, reqs, counts):
            if req.num_tokens + n > self.max_tokens_per_seq:
                raise ArgumentError(f"request {rid!r} would hold {req.num_tokens + n} tokens, "
                                    f"more than max_tokens_per_seq={self.max_tokens_per_seq} "
                                    "(nothing was reserved)")
        return reqs, counts

    def _growth(self, reqs: list[HybridRequest], counts: list[int]) -> dict[str, int]:
        needs = dict.fromkeys(self._page_sizes, 0)
        for req, n in zip(reqs, counts):
            for name, k in self.table.growth(req, req.num_tokens + n).items():
                needs[name] += k
        return needs

    def _fits(self, needs: Mapping[str, int], keep: set[bytes] | None = None) -> bool:
        if self.allocator.fit(needs).fits:
            return True
        if self.cache is None:
            return False
        freeing = {k: np.array(v, dtype=np.int32)
                   for k, v in self.cache.references(keep or set()).items()}
        return self.allocator.fit(needs, freeing).fits

    def _make_room(self, needs: Mapping[str, int], keep: set[bytes] | None = None) -> None:
        """Evict cached prefixes (least recently used first, never ``keep``) until ``needs``
        fits; raises OutOfPagesError, evicting nothing, when even all of them would not do."""
        if not self._fits(needs, keep):
            fit = self.allocator.fit(needs)
            raise OutOfPagesError(sum(fit.num_chunks), fit.num_free_chunks,
                                  f"Pages per group asked: {dict(needs)}. Release or preempt a "
                                  "request first (every cached prefix would not make room).",
                                  unit="chunks")
        while not self.allocator.fit(needs).fits:
            assert self.cache is not None and self.cache.evict(keep or set())

    def _copy(self, group: str, src: int, dst: int) -> HybridCopy:
        """List a copy and hold its source and destination until the next reserve."""
        copy = HybridCopy(group, src, dst)
        self._copies.append(copy)
        self.allocator.share({group: [src, dst]})
        held = self._held_for_copies.setdefault(group, [])
        held += [src, dst]
        return copy

    def _checkpoint(self, req: HybridRequest) -> None:
        """Cache each checkpoint ``req``'s committed tokens reached since the last one."""
        assert self.cache is not None
        C = self.checkpoint_tokens
        keys = req.keys
        while (len(keys) + 1) * C <= req.num_committed:
            end = (len(keys) + 1) * C
            parent = keys[-1] if keys else self.cache.root(req.namespace)
            key = self.cache.next_key(parent, req.tokens[end - C : end])
            keys.append(key)
            entry = self.cache.entries.get(key)
            if entry is None:
                entry = self._entry(req, end)
                if entry is None:
                    continue
                self.cache.insert(key, entry)
            if end == req.num_committed and len(entry.states) < len(self.table.state_groups):
                self._take_states(req, key, entry)

    def _entry(self, req: HybridRequest, end: int) -> CheckpointEntry | None:
        """The entry of ``req``'s prefix at checkpoint ``end`` (None: a page it needs is no
        longer held)."""
        C = self.checkpoint_tokens
        pages = {}
        for g in self.table.token_groups:
            row = req.rows[g.name].pages
            P = g.page_size
            lo = self.table.first_page(g, end) if isinstance(g, SlidingWindowSpec) else \
                (end - C) // P
            part = row[lo : end // P]
            if RELEASED in part:
                return None
            pages[g.name] = list(part)
        return CheckpointEntry(end, tuple(req.tokens[end - C : end]), pages)

    def _take_states(self, req: HybridRequest, key: bytes, entry: CheckpointEntry) -> None:
        """A checkpoint slot for each state the entry lacks, copied from the request's state
        (the state after exactly ``entry.end`` tokens); skipped if there is no free room."""
        assert self.cache is not None
        missing = {g.name: 1 for g in self.table.state_groups if g.name not in entry.states}
        if not self.allocator.fit(missing).fits:
            self.num_checkpoints_skipped += 1
            return
        slots = self.allocator.allocate(missing)
        states = {name: int(s[0]) for name, s in slots.items()}
        for name, dst in states.items():
            self._copy(name, req.states[name][0], dst)
        self.cache.add_states(key, states)

