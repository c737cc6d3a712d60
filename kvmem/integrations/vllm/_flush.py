"""The vLLM adapter's queue flush: the queued allocations as one ``reserve``, the batch's check
(one ``verify``) and its commits (one ``commit_batch``). ``_adapter.py``'s docstring says how
the queue works."""

from __future__ import annotations

from operator import attrgetter, getitem, itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmem.allocator import PAD
from kvmem.integrations.vllm._blocks import KVMemBlocks, RequestState
from kvmem.manager import KVCacheManager

__all__ = ["QueueFlush"]

# Field getters for the queue's (request, state, tokens, commit target) entries (the first
# also for (batch index, pages, out) results) and for requests.
_REQUEST, _STATE, _NUM = itemgetter(0), itemgetter(1), itemgetter(2)
_RID = attrgetter("rid")
_TOKENS = attrgetter("_all_token_ids")  # the list behind vLLM's Request.all_token_ids
_COMPUTED = attrgetter("num_computed_tokens")
_COMMITTED = attrgetter("committed")


class QueueFlush:
    """The flush of :class:`~kvmem.integrations.vllm.VllmKVCacheAdapter` (its base class): the
    queue and the state it reads are the adapter's, declared here."""

    manager: KVCacheManager
    async_outputs: bool
    worker_block_table: Any
    num_verified_steps: int
    num_verified_requests: int
    _reqs: dict[str, RequestState]
    _q: list[tuple[Any, RequestState, int, int | None]]
    _q_blocks: list[tuple[int, int, KVMemBlocks]]
    _q_pages: int
    _q_admits: bool
    _q_commits: list[tuple[Any, RequestState, int]]

    if TYPE_CHECKING:  # the adapter's: it logs and reports what verify aborted
        def _aborted(self, aborted: dict[Any, str]) -> None: ...

    def flush(self) -> None:
        """Perform the queued allocations (one reserve), check the batch's mapping (one verify)
        and commit every scheduled token whose id is known (one commit_batch)."""
        q, commits = self._q, self._q_commits
        if not q:
            if commits:
                self._q_commits = []
                if not self._commit_arrived(commits):
                    self._commit_general([], commits)
            return
        outs, admits = self._q_blocks, self._q_admits
        self._q, self._q_blocks, self._q_pages, self._q_admits = [], [], 0, False
        self._q_commits = []
        ids = tuple(map(_RID, map(_STATE, q)))  # C-level gathers: a batch is 256 requests
        nums = list(map(_NUM, q))
        n0 = nums[0]
        uniform = nums.count(n0) == len(nums)
        mgr = self.manager
        step = mgr.reserve(ids, n0 if uniform else nums)
        if self.worker_block_table is None:
            report = mgr.verify(ids, step)
            if outs:
                self._new_block_ids(step, outs)
        else:
            report = self._verify_worker_table(ids, q, step, outs)
        self.num_verified_steps += 1
        self.num_verified_requests += len(ids)
        if report.aborted:
            self._aborted(report.aborted)
            q = [e for e in q if e[1].rid not in report.aborted]
            commits = [c for c in commits if c[1].rid not in report.aborted]
            ids = tuple([e[1].rid for e in q])
            uniform = False  # the commit below takes the general path
        if not q and not commits:
            return
        if uniform and n0 == 1 and not admits and not commits and not self.async_outputs:
            # The synchronous decode step: without output placeholders every scheduled token
            # is known and was committed when scheduled, so each request's committed tokens
            # are its computed ones and it commits the one at that position. (``committed``
            # is kept only for async scheduling; here the request's computed tokens say it.)
            reqs = list(map(_REQUEST, q))
            mgr.commit_batch(ids, np.array(
                list(map(getitem, map(_TOKENS, reqs), map(_COMPUTED, reqs))), dtype=np.int64))
            return
        if (uniform and n0 == 1 and not admits and not commits and self.async_outputs
                and self._commit_next_known(q, ids)):
            return
        self._commit_general(q, commits)

    def _commit_next_known(self, q: list[tuple[Any, RequestState, int, int | None]],
                           ids: tuple[str, ...]) -> bool:
        """Async scheduling's decode step (every queued request runs and was scheduled one
        token): each request's known tokens up to its computed ones + 1, past its committed
        ones, as ``_commit_general`` would, vectorized: False, nothing done, if one would
        commit more than one token."""
        n = len(q)
        reqs = list(map(_REQUEST, q))
        computed = np.fromiter(map(_COMPUTED, reqs), dtype=np.int64, count=n)
        known = np.fromiter(map(len, map(_TOKENS, reqs)), dtype=np.int64, count=n)
        return self._commit_one_each(q, np.minimum(computed + 1, known), _committed(q), ids)

    def _commit_arrived(self, commits: list[tuple[Any, RequestState, int]]) -> bool:
        """Async scheduling's ``cache_blocks`` targets, as ``_commit_general`` would commit
        them, vectorized: False, nothing done, if a request is named twice or would commit
        more than one token."""
        if not self.async_outputs:
            return False
        n = len(commits)
        upto = np.fromiter(map(_NUM, commits), dtype=np.int64, count=n)
        committed = _committed(commits)
        if not np.count_nonzero(upto > committed):
            return True  # (the usual case: they were committed when their step was scheduled)
        states = list(map(_STATE, commits))
        if len(set(states)) != n or not all(map(self._reqs.__contains__, map(_RID, states))):
            return False
        return self._commit_one_each(commits, upto, committed)

    def _commit_one_each(self, entries: list[Any], upto: Any, committed: Any,
                         ids: tuple[str, ...] | None = None) -> bool:
        """Commit, for each ``(request, state, ...)`` entry, the request's tokens from its
        ``committed`` ones up to ``upto`` (both ``[n]`` int64) when that is at most one token
        each (one ``commit_batch``); False, nothing done, otherwise. ``ids``: the entries'
        request ids (the batch's tuple, which the manager recognizes), if at hand."""
        gain = upto - committed
        if np.count_nonzero(gain > 1):
            return False
        some = np.flatnonzero(gain > 0).tolist()
        if not some:
            return True
        chosen = [entries[i] for i in some] if len(some) < len(entries) else entries
        at = committed[some].tolist()
        self.manager.commit_batch(
            ids if ids is not None and chosen is entries else tuple(map(_RID, map(_STATE, chosen))),
            np.array(list(map(getitem, map(_TOKENS, map(_REQUEST, chosen)), at)), dtype=np.int64))
        for st, c in zip(map(_STATE, chosen), at):
            st.committed = c + 1
        return True

    @staticmethod
    def _new_block_ids(step: Any, outs: list[tuple[int, int, KVMemBlocks]]) -> None:
        """Each grown request's new block ids: the last ``k`` pages of its CSR row, + 1."""
        indptr = step.kv_indptr
        indices = step.kv_indices
        ends = indptr[np.fromiter(map(_REQUEST, outs), dtype=np.intp, count=len(outs)) + 1]
        if all(o[1] == 1 for o in outs):  # the decode step: one new page each
            for (_, _, out), block in zip(outs, (indices[ends - 1] + 1).tolist()):
                out.ids = [block]
            return
        for (_, k, out), end in zip(outs, ends.tolist()):
            out.ids = (indices[end - k : end] + 1).tolist()

    def _verify_worker_table(self, ids: tuple[str, ...], q: list[Any], step: Any,
                             outs: list[tuple[int, int, KVMemBlocks]]) -> Any:
        """The paranoid check: the block ids handed to the workers come from
        ``worker_block_table`` (a row per kvmem row, as the worker appends them: ``[max_seqs,
        max_pages]``, int32, page ids, PAD past each request's blocks), and kvmem checks that
        very table (``verify(metadata=...)``: every entry, the padding, the slot mapping and
        lengths), not the CSR the table was written from."""
        wt = self.worker_block_table
        assert wt is not None
        indptr = step.kv_indptr
        indices = step.kv_indices
        rows = step.rows.astype(np.intp)
        for b, e in enumerate(q):
            if e[3] is not None:  # admitted in this flush: the row is its whole table
                row = int(rows[b])
                e[1].row = row
                lo, hi = int(indptr[b]), int(indptr[b + 1])
                wt[row] = PAD
                wt[row, : hi - lo] = indices[lo:hi]
        for b, k, out in outs:
            row = int(rows[b])
            n = int(indptr[b + 1] - indptr[b])
            if q[b][3] is None:  # a running request appends its new blocks
                wt[row, n - k : n] = indices[int(indptr[b + 1]) - k : int(indptr[b + 1])]
            out.ids = (wt[row, n - k : n] + 1).tolist()
        table = wt[rows]
        return self.manager.verify(ids, metadata={
            "block_table": table, "slot_mapping": step.slot_mapping,
            "seq_lens": step.seq_lens, "num_new_tokens": step.num_new_tokens})

    def _commit_general(self, q: list[tuple[Any, RequestState, int, int | None]],
                        commits: list[tuple[Any, RequestState, int]]) -> None:
        """Commit, for each request queued or named by cache_blocks(), its known tokens up to
        its target (vLLM caches the blocks they fill now)."""
        sync = not self.async_outputs
        entries: list[tuple[Any, RequestState, int, int]] = []  # (request, state, from, to)
        for request, st, n, upto in q:
            lo = st.committed  # an admission's (its hit), or async scheduling's
            if upto is None:  # a running request
                c = request.num_computed_tokens
                upto = c + n
                known = len(request._all_token_ids)
                if upto > known:
                    upto = known
                if sync:
                    lo = c  # synchronous: everything computed was committed when scheduled
            if upto > lo:
                entries.append((request, st, lo, upto))
        if commits:
            # Both queued and cache_blocks() targets (rare): one per request, the furthest.
            merged = {e[1].rid: e for e in entries}
            reqs = self._reqs
            for request, st, upto in commits:
                if st.rid not in reqs:
                    continue
                prev = merged.get(st.rid)
                if prev is None:
                    lo = self.manager.num_committed(st.rid) if sync else st.committed
                    if upto > lo:
                        merged[st.rid] = (request, st, lo, upto)
                elif prev[3] < upto:
                    merged[st.rid] = (request, st, prev[2], upto)
            entries = list(merged.values())
        if not entries:
            return
        ids = [e[1].rid for e in entries]
        if all(e[3] - e[2] == 1 for e in entries):  # one token each (the async decode step)
            tokens: Any = np.array([e[0]._all_token_ids[e[2]] for e in entries], dtype=np.int64)
        else:
            tokens = [e[0]._all_token_ids[e[2] : e[3]] for e in entries]
        self.manager.commit_batch(ids, tokens)
        for e in entries:
            e[1].committed = e[3]


def _committed(entries: list[Any]) -> Any:
    """The committed tokens of each ``(request, state, ...)`` entry's request: ``[n]`` int64."""
    return np.fromiter(map(_COMMITTED, map(_STATE, entries)), dtype=np.int64, count=len(entries))
