"""The value oracles: every value the manager returns or stores, against the engine's model.

The page oracles (:mod:`kvmem.testing._oracles`) see a wrong answer only once it breaks a
page's lifetime or a read. These see it where it is given: an engine that runs on the manager
keeps its own model of each request (its prompt, the positions it scheduled and committed, the
pages its last step read) and of the manager's counters, and compares every value the manager
hands back with it.

=================  ==========================================================================
``admission``      what ``admit``, ``resume`` and a transfer's ``admit`` return and leave:
                   the prompt's length and pages, a cached count that is a whole number of hit
                   pages below the prompt's length, the very pages ``match_prefix`` found just
                   before, the hit pages holding exactly the prompt's leading tokens
                   (``tokens_of``), ``num_tokens`` and ``num_committed`` (the cached tokens)
                   right after
``step_metadata``  what ``reserve`` returns: per request the tokens reserved and the sequence
                   length, a CSR covering exactly the pages those tokens need, a slot mapping
                   into them, and the pages of positions already held unchanged (unless a
                   copy-on-write destination replaced one)
``request_state``  ``num_tokens``, ``num_committed``, ``tokens_of`` and ``pages_of`` of every
                   running request, and the preempted requests, against the engine's model
                   (every full check)
``stats``          ``stats()``: running and preempted requests, free and used pages, prefix
                   queries and hit tokens, forks, preemptions, copy-on-write copies, integrity
                   failures and steps in flight, against the engine's counts (every full check)
=================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.testing._oracles import FuzzFailure

__all__ = ["VALUE_ORACLES", "ValueOracles"]

Int64Array = npt.NDArray[np.int64]

VALUE_ORACLES = ("admission", "step_metadata", "request_state", "stats")


def _same(a: Any, b: Any) -> bool:
    a = np.asarray(a)
    b = np.asarray(b)
    return a.shape == b.shape and not np.count_nonzero(a != b)


class ValueOracles:
    """The engine-side model of what the manager must answer, and the checks against it.

    An engine calls :meth:`lookup` before an admission and :meth:`admitted` after it,
    :meth:`reserved` after each ``reserve`` it launches, the ``note_*`` counters as it forks,
    preempts and sees verify abort, and :meth:`check_requests` / :meth:`check_stats` in its
    full check. Each check raises :class:`~kvmem.testing.FuzzFailure` naming its oracle.

    ``ran`` counts how often each oracle checked (a correct run shows them all > 0 and silent).

    Parameters
    ----------
    manager: the engine's manager
    max_requests: the engine's slots (one model row each)
    max_len: most tokens per request
    """

    def __init__(self, manager: Any, max_requests: int, max_len: int) -> None:
        self.mgr = manager
        self.P = P = int(manager.page_size)
        self.width = width = -(-max_len // P) + 1
        self.pages = np.full((max_requests, width), -1, dtype=np.int64)  # last pages seen
        self.num_pages = np.zeros(max_requests, dtype=np.int64)
        self._held_flat = self.pages.reshape(-1)
        self._arange = np.arange(max_requests * width, dtype=np.int64)
        self.counts = {"prefix_queries": 0, "prefix_query_tokens": 0, "prefix_hit_tokens": 0,
                       "forks": 0, "preemptions": 0, "cow_copies": 0, "integrity_failures": 0}
        self._evictions = 0
        self.ran = dict.fromkeys(VALUE_ORACLES, 0)  # how often each check ran

    # -- admission --------------------------------------------------------------------------------

    def lookup(self, tokens: Int64Array, namespace: Any) -> Any:
        """What ``match_prefix`` finds for a prompt about to be admitted (None: no cache)."""
        if self.mgr.cache is None:
            return None
        return self.mgr.match_prefix(tokens, namespace)

    def admitted(self, slot: int, request_id: Any, tokens: Int64Array, match: Any,
                 result: Any, what: str = "admit") -> int:
        """``request_id`` was admitted (or resumed) with prompt ``tokens``; ``match``: the
        :meth:`lookup` just before; ``result``: the AdmitResult (None: a hook failed and took
        it with it). Returns the cached tokens (what is left to compute starts there)."""
        mgr, P, n = self.mgr, self.P, int(tokens.size)
        self.ran["admission"] += 1
        cached = mgr.num_committed(request_id)
        pages = mgr.pages_of(request_id)
        hits = cached // P

        def fail(msg: str) -> FuzzFailure:
            return FuzzFailure("admission", f"{what}({request_id!r}) of a {n}-token prompt: "
                                            f"{msg}")

        if result is not None:
            got = (result.request_id, result.num_prompt_tokens, result.num_pages,
                   result.num_hit_pages, result.num_cached_tokens)
            want = (request_id, n, -(-n // P), hits, cached)
            if got != want:
                raise fail(f"returned (request_id, num_prompt_tokens, num_pages, "
                           f"num_hit_pages, num_cached_tokens) = {got}, expected {want} (the "
                           "prompt, and the manager's own num_committed)")
        if mgr.num_tokens(request_id) != cached or pages.size != -(-n // P):
            raise fail(f"the request holds {mgr.num_tokens(request_id)} tokens in "
                       f"{pages.size} pages, expected its {cached} committed tokens in the "
                       f"prompt's {-(-n // P)} pages")
        if cached % P or cached > (n - 1) // P * P:
            raise fail(f"{cached} cached tokens: not whole pages below the prompt's length")
        if match is not None and not _same(match.pages, pages[:hits]):
            raise fail(f"hit pages {pages[:hits].tolist()[:8]}, but match_prefix found "
                       f"{np.asarray(match.pages).tolist()[:8]} just before")
        if hits and not _same(mgr.tokens_of(request_id), tokens[:cached]):
            raise fail(f"its {hits} hit pages do not hold the prompt's first {cached} tokens")
        if mgr.cache is not None:
            c = self.counts
            c["prefix_queries"] += 1
            c["prefix_query_tokens"] += n
            c["prefix_hit_tokens"] += cached
        self.num_pages[slot] = k = min(pages.size, self.width)
        self.pages[slot, :k] = pages[:k]
        return int(cached)

    # -- the step -----------------------------------------------------------------------------

    def reserved(self, slots: Int64Array, starts: Int64Array, n: Int64Array,
                 indptr: Any, indices: Any, slot_mapping: Any, seq_lens: Any,
                 num_new: Any, copy_dst: Any) -> None:
        """A reserved step, as it will be launched, for the requests at ``slots`` (positions
        ``starts`` onwards, ``n`` tokens each)."""
        P = self.P
        self.ran["step_metadata"] += 1
        seq = starts + n
        counts = indptr[1:] - indptr[:-1]
        if (seq_lens.shape != seq.shape or num_new.shape != n.shape
                or slot_mapping.size != int(n.sum()) or indptr[0] != 0
                or indptr[-1] != indices.size or np.count_nonzero(seq_lens != seq)
                or np.count_nonzero(num_new != n)
                or np.count_nonzero(counts != (seq + (P - 1)) // P)):
            raise FuzzFailure(
                "step_metadata", f"reserve returned seq_lens {seq_lens[:8]}, num_new_tokens "
                f"{num_new[:8]}, pages {counts[:8]} per request and {slot_mapping.size} slots; "
                f"the engine scheduled {n[:8]} tokens from {starts[:8]} "
                f"({(seq + (P - 1)) // P} pages)")
        if slot_mapping.size == n.size:  # (one token each: decode)
            pos = starts
            where = indices[indptr[:-1] + starts // P] * P + starts % P
        else:
            b = np.repeat(np.arange(n.size), n)
            pos = np.arange(slot_mapping.size) - (np.cumsum(n) - n)[b] + starts[b]
            where = indices[indptr[b] + pos // P] * P + pos % P
        if np.count_nonzero(slot_mapping != where):
            bad = int(np.flatnonzero(slot_mapping != where)[0])
            raise FuzzFailure(
                "step_metadata", f"the slot mapping writes position {int(pos[bad])} of a "
                f"request to slot {int(slot_mapping[bad])}, not to its page in the CSR (slot "
                f"{int(where[bad])})")
        # The pages of the positions held before the step: those the request mapped before.
        nnz = indices.size
        if nnz:
            ar = self._arange if nnz <= self._arange.size else np.arange(nnz)
            flat = (slots * self.width - indptr[:-1]).repeat(counts)
            flat += ar[:nnz]
            changed = (self._held_flat.take(flat) != indices).nonzero()[0]
            if changed.size:
                rb = indptr.searchsorted(changed, side="right") - 1
                cols = changed - indptr[rb]
                moved = cols < np.minimum(self.num_pages[slots], -(-starts // P))[rb]
                if np.count_nonzero(moved):  # (only a copy-on-write destination may replace)
                    moved &= ~np.isin(indices[changed], copy_dst)
                if np.count_nonzero(moved):
                    i = int(np.flatnonzero(moved)[0])
                    raise FuzzFailure(
                        "step_metadata", f"reserve moved page {int(cols[i])} of the request "
                        f"at slot {int(slots[rb[i]])} from page "
                        f"{int(self._held_flat[flat[changed[i]]])} to {int(indices[changed[i]])} "
                        "without a copy-on-write copy")
                self._held_flat[flat[changed]] = indices[changed]
            self.num_pages[slots] = np.maximum(self.num_pages[slots], counts)
        self.counts["cow_copies"] += int(copy_dst.size)

    # -- counters -----------------------------------------------------------------------------

    def note_fork(self, slot: int, request_id: Any) -> None:
        """The engine forked ``request_id`` into ``slot``."""
        self.counts["forks"] += 1
        pages = self.mgr.pages_of(request_id)
        self.num_pages[slot] = k = min(pages.size, self.width)
        self.pages[slot, :k] = pages[:k]

    def rejected(self, slot: int, num_pages: int) -> None:
        """The request at ``slot`` gave back rejected drafts and maps its first ``num_pages``
        pages now."""
        if self.num_pages[slot] > num_pages:
            self.pages[slot, num_pages:] = -1
            self.num_pages[slot] = num_pages

    def note_preempt(self) -> None:
        self.counts["preemptions"] += 1

    def note_aborted(self, k: int) -> None:
        """Verify aborted ``k`` requests."""
        self.counts["integrity_failures"] += k

    # -- the full check -----------------------------------------------------------------------

    def check_requests(self, running: Sequence[tuple[int, Any, int, int, int, Int64Array]],
                       preempted: Sequence[Any]) -> Int64Array:
        """``running``: ``(slot, request_id, scheduled, committed, prompt_len, tokens)`` of
        each request the engine runs; ``preempted``: the ids it holds preempted. Returns the
        pages the running requests map."""
        mgr, P = self.mgr, self.P
        self.ran["request_state"] += 1
        parts = []
        for s, rid, sched, comm, plen, toks in running:
            got = (mgr.num_tokens(rid), mgr.num_committed(rid))
            pages = mgr.pages_of(rid)
            k = int(self.num_pages[s])
            want_pages = max(-(-sched // P), -(-plen // P))
            if got != (sched, comm) or pages.size != want_pages:
                raise FuzzFailure(
                    "request_state", f"request {rid!r} holds (num_tokens, num_committed) = "
                    f"{got} in {pages.size} pages; the engine scheduled {sched} and committed "
                    f"{comm} ({want_pages} pages)")
            if not _same(pages[:k], self.pages[s, :k]):
                raise FuzzFailure(
                    "request_state", f"request {rid!r} maps pages {pages[:k].tolist()[:8]}, "
                    f"but its last step read {self.pages[s, :k].tolist()[:8]}")
            if not _same(mgr.tokens_of(rid), toks[:comm]):
                raise FuzzFailure("request_state", f"tokens_of({rid!r}) is not the "
                                                   f"{comm} tokens the engine committed")
            parts.append(pages)
        if set(mgr.preempted) != set(preempted):
            raise FuzzFailure("request_state", f"the manager holds preempted requests "
                              f"{sorted(map(str, mgr.preempted))[:8]}; the engine "
                              f"{sorted(map(str, preempted))[:8]}")
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    def check_stats(self, num_running: int, num_preempted: int, used: Int64Array,
                    steps_in_flight: int) -> None:
        """``stats()`` against the engine's counts (``used``: the pages requests map)."""
        mgr = self.mgr
        self.ran["stats"] += 1
        st = mgr.stats()
        c = self.counts
        want = {"num_running": num_running, "num_preempted": num_preempted,
                "num_free": int(mgr.allocator.num_free), "num_used": int(used.size),
                "num_prefix_queries": c["prefix_queries"],
                "prefix_query_tokens": c["prefix_query_tokens"],
                "prefix_hit_tokens": c["prefix_hit_tokens"], "num_forks": c["forks"],
                "num_preemptions": c["preemptions"], "num_cow_copies": c["cow_copies"],
                "num_integrity_failures": c["integrity_failures"],
                "steps_in_flight": steps_in_flight}
        bad: dict[str, tuple[Any, Any]] = {
            k: (getattr(st, k), v) for k, v in want.items() if getattr(st, k) != v}
        if st.num_free + st.num_used + st.num_cached + st.num_fenced != st.num_pages:
            bad["num_free + num_used + num_cached + num_fenced"] = (
                st.num_free + st.num_used + st.num_cached + st.num_fenced, st.num_pages)
        if st.num_evictions < self._evictions:
            bad["num_evictions"] = (st.num_evictions, f">= {self._evictions}")
        if bad:
            raise FuzzFailure("stats", "stats() disagrees with the engine's counts (stats, "
                              f"expected): {bad}")
        self._evictions = st.num_evictions
