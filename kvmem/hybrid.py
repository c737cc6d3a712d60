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
from operator import attrgetter
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
    StateSpec,
    check_groups,
    token_counts,
)
from kvmem.errors import (
    ArgumentError,
    ArgumentTypeError,
    ConfigError,
    IntegrityError,
    KVMemError,
    OutOfPagesError,
)
from kvmem.integrity import check_hybrid_step

__all__ = ["HybridAdmit", "HybridCopy", "HybridManager", "HybridReport"]

log = logging.getLogger(__name__)
_TOKENS = attrgetter("tokens")
_NO_ROWS = np.empty(0, dtype=np.intp)


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
    max_seqs: requests running at once (default 256)
    max_tokens_per_seq: a request's most tokens (default 131072)
    enable_prefix_caching: cache prefixes at checkpoints
    checkpoint_tokens: tokens between checkpoints, a multiple of every token group's page size
        (default: their least common multiple)
    seed: the prefix keys' seed (a restarted manager with the same seed finds the same keys)
    """

    def __init__(self, groups: Sequence[GroupSpec], budget_bytes: int, *,
                 chunk_bytes: int | None = None, max_seqs: int = 256,
                 max_tokens_per_seq: int = 131072, enable_prefix_caching: bool = True,
                 checkpoint_tokens: int | None = None, seed: int = 0) -> None:
        self.groups = check_groups(groups)
        self.allocator = GroupAllocator(self.groups, budget_bytes, chunk_bytes)
        # Each group's lifetime tags now (read-only views of the allocators', live)
        self._tags = {g.name: self.allocator.tags(g.name) for g in self.groups}
        self.max_tokens_per_seq = integer(max_tokens_per_seq, "max_tokens_per_seq", minimum=1)
        self.table = GroupTable(self.groups, integer(max_seqs, "max_seqs", minimum=1),
                                self.max_tokens_per_seq)
        sizes = [g.page_size for g in self.groups if not isinstance(g, StateSpec)]
        least = math.lcm(*sizes) if sizes else 1
        C = least if checkpoint_tokens is None else integer(checkpoint_tokens,
                                                            "checkpoint_tokens", minimum=1)
        if C % least:
            raise ConfigError(f"checkpoint_tokens={C} is not a multiple of every token group's "
                              f"page size {sizes}: use a multiple of {least}.")
        self.checkpoint_tokens = C
        self.cache = (GroupPrefixCache(self.allocator, tuple(self.table.states), C,
                                       integer(seed, "seed"))
                      if enable_prefix_caching else None)
        self._copies: list[HybridCopy] = []
        # The latest batch's ids and rows (forgotten when a request leaves).
        self._last_batch: tuple[tuple[Any, ...], npt.NDArray[np.intp]] = ((), _NO_ROWS)
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
        """Whether ``admit`` would succeed and the prompt's prefill, in chunks of ``chunk``
        tokens (default the whole prompt), would surely find its pages in every group: a
        bound that counts a sliding window at its window and a chunk, plus a page. Changes
        nothing."""
        tokens = self._prompt(token_ids)
        if not self.table.num_free_rows:
            return False
        end, keys, chain = self._match(tokens, namespace)
        n = len(tokens)
        chunk = n if chunk is None else integer(chunk, "chunk", minimum=1)
        needs = {name: 1 for name in self.table.states}
        for name, t in self.table.tokens.items():
            P = t.page_size
            if t.window:  # at most its window and a chunk, held
                peak = min(-(-n // P), -(-(t.window + chunk) // P) + 1)
                needs[name] = max(0, peak - (len(chain[-1].pages[name]) if chain else 0))
            else:
                needs[name] = -(-n // P) - end // P
        return self._fits(needs, set(keys))

    def admit(self, request_id: Any, token_ids: Any, namespace: Any = None) -> HybridAdmit:
        """Admit a request: restore its longest cached prefix every group can serve, allocate
        a slot in every state group. Tokens from the restored prefix on are computed in
        ``reserve`` steps.

        Raises ArgumentError (duplicate id, empty or too long prompt), OutOfPagesError (no
        room for its state slots), KVMemError (``max_seqs`` requests running); nothing
        changed then.
        """
        self._new_id(request_id)
        tokens = self._prompt(token_ids)
        self._require_row(request_id)
        end, keys, chain = self._match(tokens, namespace)
        needs = {name: 1 for name in self.table.states}
        self._make_room(needs, set(keys))
        req = self.table.open(request_id, namespace, tokens, end)
        shared: dict[str, list[int]] = {}
        for name, t in self.table.tokens.items():
            released = int(t.first_page(end)) if chain else 0
            if t.window:
                pages = [RELEASED] * released + (chain[-1].pages[name] if chain else [])
            else:
                pages = [p for e in chain for p in e.pages[name]]
            held = pages[released:]
            t.restore(req.row, pages, [0] * released + self._tags[name][held].tolist(),
                      released)
            if held:
                shared[name] = held
        if shared:
            self.allocator.share(shared)
        slots = self.allocator.allocate(needs) if needs else {}
        for name, slot in slots.items():
            s = int(slot[0])
            self.table.states[name].take(req.row, s, int(self._tags[name][s]), end)
            if chain:
                self._copy(name, chain[-1].states[name], s)
        if self.cache is not None and keys:
            self.cache.touch(keys)
        req.keys = keys
        return HybridAdmit(request_id, end, len(tokens))

    # -- the step ----------------------------------------------------------------------------

    def can_reserve(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]) -> bool:
        """Whether ``reserve(request_ids, num_tokens)`` would find its pages now."""
        _, rows, counts = self._batch(request_ids, num_tokens)
        growth = self.table.growth(rows, self.table.num_tokens[rows] + counts)
        return self._fits(dict(zip(self.table.tokens, growth.sum(axis=1).tolist())))

    def reserve(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]
                ) -> HybridStep:
        """Give every request of the batch ``num_tokens`` more token slots (an int, or one
        count per request) in every token group, and return the step's metadata. Evicts
        cached prefixes if it must. All or nothing.

        Raises ArgumentError (unknown or repeated id, too many tokens), OutOfPagesError (not
        enough room even after evicting every cached prefix); nothing changed then.
        """
        ids, rows, counts = self._batch(request_ids, num_tokens)
        starts = self.table.num_tokens[rows]
        ends = starts + counts
        growth = self.table.growth(rows, ends)
        needs = {k: v for k, v in zip(self.table.tokens, growth.sum(axis=1).tolist()) if v}
        try:  # (a step usually fits: room is made, evicting cached prefixes, only if not)
            new = self.allocator.allocate(needs)
        except OutOfPagesError:
            self._make_room(needs)
            new = self.allocator.allocate(needs)
        for g, (name, t) in enumerate(self.table.tokens.items()):
            if name in new:
                t.append(rows, growth[g], new[name], self._tags[name][new[name]])
        self.table.set_tokens(rows, ends)
        if self._held_for_copies:  # the engine made the listed copies before this step
            held, self._held_for_copies = self._held_for_copies, {}
            self.allocator.free(held)
        return self.table.step(ids, rows, starts, ends)

    def verify(self, request_ids: Sequence[Any], step: HybridStep) -> HybridReport:
        """Check the step's metadata in every group against what each request recorded and
        the pages' lifetimes now (``kvmem.integrity.check_hybrid_step``). Each request that
        fails is released (its pages dropped) and reported; the others run."""
        ids = id_tuple(request_ids, "request_ids")
        if ids != tuple(step.request_ids):
            raise ArgumentError(f"verify() was given {len(ids)} request ids that are not the "
                                "step's batch; pass the ids the step was reserved for")
        reqs = self.table.requests
        if ids == self._last_batch[0]:  # (the batch reserve just saw)
            rows = self._last_batch[1]
            known = np.ones(len(ids), dtype=bool)
        else:
            found = [reqs.get(rid) if is_hashable(rid) else None for rid in ids]
            known = np.array([r is not None for r in found], dtype=bool)
            rows = np.array([0 if r is None else r.row for r in found], dtype=np.intp)
        num_tokens = np.where(known, self.table.num_tokens[rows], -1)
        table = self.table
        running = (np.array([r.row for r in reqs.values()], dtype=np.intp)
                   if self.table.states else _NO_ROWS)
        states = {}
        for name, s in self.table.states.items():
            slot = s.slot[rows]
            holders = np.bincount(s.slot[running], minlength=self.allocator.allocator(
                name).num_pages) if running.size else np.zeros(1, dtype=np.int64)
            states[name] = (slot, s.tag[rows], s.tokens[rows], holders[slot])
        bad = check_hybrid_step(step, known, num_tokens,
                                lambda starts, ends: table.kernels(rows, starts, ends),
                                tuple(table.tokens),
                                self._tags,
                                states)
        aborted = {ids[b]: why for b, why in bad.items()}
        for rid, why in aborted.items():
            log.warning("request %r aborted: %s", rid, why)
            if is_hashable(rid) and rid in reqs:
                self.release(rid)
        return HybridReport(aborted)

    def commit(self, request_id: Any, token_ids: Any) -> None:
        """``commit_batch`` of one request."""
        self.commit_batch([request_id], [token_ids])

    def commit_batch(self, request_ids: Sequence[Any], token_ids: Any) -> None:
        """The KV (and states) of these tokens, each request's next reserved ones, is written:
        ``token_ids`` one list per request, or ``[B]`` ints (one token each). Pages the next
        query's window leaves are released; each checkpoint reached is cached (its states
        too when the commit ends exactly there). Raises ArgumentError, changing nothing, if a
        request commits more tokens than it reserved or a prompt token that differs."""
        ids, rows, _ = self._batch(request_ids, 0)
        one_each = isinstance(token_ids, np.ndarray) and token_ids.ndim == 1
        if one_each:
            ones = token_array(token_ids, "token_ids").tolist()
            lists: list[list[int]] = []
            counts = np.ones(len(ones), dtype=np.int64)
        else:
            lists = [token_array(t, "token_ids[i]").tolist() for t in token_ids]
            counts = np.array([len(x) for x in lists], dtype=np.int64)
        if counts.size != len(ids):
            raise ArgumentError(f"token_ids has {counts.size} entries for {len(ids)} requests")
        before = self.table.num_committed[rows]
        over = np.flatnonzero(counts > self.table.num_tokens[rows] - before)
        if over.size:
            i = int(over[0])
            raise ArgumentError(f"request {ids[i]!r}: commits {counts[i]} tokens but has "
                                f"{self.table.num_tokens[rows[i]] - before[i]} reserved, "
                                "uncommitted slots (nothing changed)")
        reqs = list(map(self.table.requests.__getitem__, ids))
        # (a request's known tokens: its prompt, then its committed ones)
        inside = np.flatnonzero(before < self.table.prompt_len[rows]).tolist()
        if one_each and not inside:  # the decode step: a new token each
            for tokens, t in zip(map(_TOKENS, reqs), ones):
                tokens.append(t)
        else:
            if one_each:
                lists = [[t] for t in ones]
            for i in inside:
                c, toks = int(before[i]), lists[i]
                prompt = reqs[i].tokens[c : c + len(toks)]
                if toks[: len(prompt)] != prompt:
                    raise ArgumentError(f"request {ids[i]!r}: the committed tokens differ "
                                        f"from its prompt at positions {c}..{c + len(prompt) - 1}"
                                        " (nothing changed)")
            for req, toks, c in zip(reqs, lists, before.tolist()):
                if c + len(toks) > len(req.tokens):
                    req.tokens.extend(toks[len(req.tokens) - c :])
        after = before + counts
        self.table.set_committed(rows, after)
        for s in self.table.states.values():
            s.advance(rows, after)
        if self.cache is not None:
            C = self.checkpoint_tokens
            for i in np.flatnonzero(after // C > before // C).tolist():
                self._checkpoint(reqs[i])
        gone = self.table.release_windows(rows, after)
        if gone:
            self.allocator.free(gone)

    def release(self, request_id: Any) -> None:
        """Forget a request (finished or aborted): drop every page and slot it holds."""
        self._running(request_id)
        self._last_batch = ((), _NO_ROWS)
        held = self.table.close(request_id)
        if held:
            self.allocator.free(held)

    def fork(self, parent_id: Any, child_id: Any) -> list[HybridCopy]:
        """Start ``child_id`` as a copy of ``parent_id`` (beam search, parallel sampling): it
        shares the parent's full pages, gets its own copy of each partly filled tail page and
        of every state (listed in ``take_copies()``; also returned). All or nothing."""
        parent = self._running(parent_id)
        self._new_id(child_id)
        p = parent.row
        n = int(self.table.num_tokens[p])
        if self.table.num_committed[p] != n:
            raise ArgumentError(f"request {parent_id!r} has {n - self.table.num_committed[p]} "
                                "reserved, uncommitted slots; commit its step before forking "
                                "it (nothing changed)")
        self._require_row(child_id)
        tails = [name for name, t in self.table.tokens.items() if n % t.page_size]
        needs = dict.fromkeys([*tails, *self.table.states], 1)
        self._make_room(needs)
        new = self.allocator.allocate(needs) if needs else {}
        child = self.table.open(child_id, parent.namespace, list(parent.tokens), n)
        copies: list[HybridCopy] = []
        shared = {}
        for name, t in self.table.tokens.items():
            held = t.held(p)
            tail = None
            if name in tails:
                src, dst = int(t.pages[p, t.num_pages[p] - 1]), int(new[name][0])
                copies.append(self._copy(name, src, dst))
                tail = (dst, int(self._tags[name][dst]))
                held = held[:-1]
            t.fork(p, child.row, tail)
            if held.size:
                shared[name] = held
        if shared:
            self.allocator.share(shared)
        for name, s in self.table.states.items():
            dst = int(new[name][0])
            copies.append(self._copy(name, int(s.slot[p]), dst))
            s.take(child.row, dst, int(self._tags[name][dst]), int(s.tokens[p]))
        child.keys = list(parent.keys)
        return copies

    def take_copies(self) -> list[HybridCopy]:
        """The copies listed since the last call (restores, checkpoints, forks), in order;
        the engine performs them before its next step (``reserve`` releases their holds)."""
        out, self._copies = self._copies, []
        return out

    # -- queries -----------------------------------------------------------------------------

    def num_tokens(self, request_id: Any) -> int:
        return int(self.table.num_tokens[self._running(request_id).row])

    def num_committed(self, request_id: Any) -> int:
        return int(self.table.num_committed[self._running(request_id).row])

    def pages_of(self, request_id: Any, group: str) -> npt.NDArray[np.int32]:
        """``[k]`` int32: the request's row in a token group (``-1`` where released), or its
        slot in a state group."""
        row = self._running(request_id).row
        if group in self.table.states:
            return self.table.states[group].slot[row : row + 1].copy()
        t = self.table.tokens.get(group) if isinstance(group, str) else None
        if t is None:
            raise ArgumentError(f"group={group!r}: no such group; the groups are "
                                f"{[g.name for g in self.groups]}")
        return t.pages[row, : t.num_pages[row]].copy()

    def stats(self) -> GroupStats:
        return self.allocator.stats()

    def check(self) -> None:
        """Verify the bookkeeping: every page's holders are exactly the running requests, the
        cache's entries and the pending copies that hold it, and each request's recorded tags
        are its pages' tags now; raises IntegrityError naming the problems."""
        self.allocator.check()
        problems = []
        rows = [req.row for req in self.table.requests.values()]
        refs = self.cache.references() if self.cache is not None else {}
        for g, name in enumerate(self.allocator.names):
            alloc = self.allocator.allocator(name)
            held: list[Any] = [refs.get(name, []), self._held_for_copies.get(name, [])]
            if name in self.table.states:
                s = self.table.states[name]
                held.append(s.slot[rows])
                stale = [r for r in rows if alloc.tags[s.slot[r]] != s.tag[r]]
            else:
                t = self.table.tokens[name]
                stale = []
                for r in rows:
                    span = slice(t.released[r], t.num_pages[r])
                    mapped = t.pages[r, span] != RELEASED
                    pages = t.pages[r, span][mapped]
                    held.append(pages)
                    if (alloc.tags[pages] != t.tags[r, span][mapped]).any():
                        stale.append(r)
            flat = np.concatenate([np.asarray(h, dtype=np.int64) for h in held])
            counts = np.bincount(flat, minlength=alloc.num_pages)
            ppc = self.allocator.pages_per_chunk[g]
            mine = np.repeat(self.allocator.arena.owners == g, ppc)
            wrong = np.flatnonzero(mine & (alloc.refcounts != counts))
            if wrong.size:
                problems.append(f"group {name!r}: pages {wrong[:8].tolist()} have holders "
                                f"{alloc.refcounts[wrong[:8]].tolist()}, expected "
                                f"{counts[wrong[:8]].tolist()}")
            if stale:
                problems.append(f"group {name!r}: rows {stale[:8]} hold pages whose lifetime "
                                "changed")
        if problems:
            raise IntegrityError("HybridManager.check() failed: " + "; ".join(problems))

    # -- internals ---------------------------------------------------------------------------

    def _running(self, request_id: Any) -> HybridRequest:
        req = self.table.requests.get(request_id) if is_hashable(request_id) else None
        if req is None:
            raise ArgumentError(f"request {request_id!r} is not running (admit it first)")
        return req

    def _new_id(self, request_id: Any) -> None:
        if not is_hashable(request_id):
            raise ArgumentTypeError(f"request id {request_id!r:.60} is not hashable: use a str "
                                    "or an int (nothing changed)")
        if request_id in self.table.requests:
            raise ArgumentError(f"request {request_id!r} is already running; release it first "
                                "or use a new id (nothing changed)")

    def _require_row(self, request_id: Any) -> None:
        if not self.table.num_free_rows:
            raise KVMemError(f"request {request_id!r}: all {self.table.num_tokens.size} rows "
                             "(max_seqs) are running requests; release one first (nothing "
                             "changed)")

    def _batch(self, request_ids: Sequence[Any], num_tokens: int | Sequence[int]
               ) -> tuple[tuple[Any, ...], npt.NDArray[np.intp], npt.NDArray[np.int64]]:
        ids = id_tuple(request_ids, "request_ids")
        if ids == self._last_batch[0]:  # (a decode step's batch, again: no request left)
            rows = self._last_batch[1]
        else:
            if len(set(ids)) != len(ids):
                raise ArgumentError(f"request_ids lists a request twice: {list(ids)[:8]}")
            rows = np.array([self._running(rid).row for rid in ids], dtype=np.intp)
            rows.flags.writeable = False
            self._last_batch = (ids, rows)
        given = token_counts(num_tokens, len(ids), self.max_tokens_per_seq)
        counts = (np.full(len(ids), given, dtype=np.int64) if isinstance(given, int)
                  else given.astype(np.int64))
        over = np.flatnonzero(self.table.num_tokens[rows] + counts > self.max_tokens_per_seq)
        if over.size:
            i = int(over[0])
            raise ArgumentError(f"request {ids[i]!r} would hold "
                                f"{self.table.num_tokens[rows[i]] + counts[i]} tokens, more "
                                f"than max_tokens_per_seq={self.max_tokens_per_seq} (nothing "
                                "was reserved)")
        return ids, rows, counts

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
        if self.allocator.fit(needs).fits:
            return
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
        self._held_for_copies.setdefault(group, []).extend((src, dst))
        return copy

    def _checkpoint(self, req: HybridRequest) -> None:
        """Cache each checkpoint ``req``'s committed tokens reached since the last one."""
        assert self.cache is not None
        C = self.checkpoint_tokens
        committed = int(self.table.num_committed[req.row])
        keys = req.keys
        while (len(keys) + 1) * C <= committed:
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
            if end == committed and len(entry.states) < len(self.table.states):
                self._take_states(req, key, entry)

    def _entry(self, req: HybridRequest, end: int) -> CheckpointEntry | None:
        """The entry of ``req``'s prefix at checkpoint ``end`` (None: a page it needs is no
        longer held)."""
        C = self.checkpoint_tokens
        pages = {}
        for name, t in self.table.tokens.items():
            P = t.page_size
            lo = int(t.first_page(end)) if t.window else (end - C) // P
            part = t.pages[req.row, lo : end // P].tolist()
            if RELEASED in part:
                return None
            pages[name] = part
        return CheckpointEntry(end, tuple(req.tokens[end - C : end]), pages)

    def _take_states(self, req: HybridRequest, key: bytes, entry: CheckpointEntry) -> None:
        """A checkpoint slot for each state the entry lacks, copied from the request's state
        (the state after exactly ``entry.end`` tokens); skipped if there is no free room."""
        assert self.cache is not None
        missing = {name: 1 for name in self.table.states if name not in entry.states}
        if not self.allocator.fit(missing).fits:
            self.num_checkpoints_skipped += 1
            return
        slots = self.allocator.allocate(missing)
        states = {name: int(s[0]) for name, s in slots.items()}
        for name, dst in states.items():
            self._copy(name, int(self.table.states[name].slot[req.row]), dst)
        self.cache.add_states(key, states)
