"""The vLLM adapter's queue and its flush: the queued allocations as one ``reserve``, the
batch's check (one ``verify``) and its commits (one ``commit_batch``). ``_adapter.py``'s
docstring says how the queue works."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter, getitem, itemgetter
from typing import Any

import numpy as np

from kvmem.allocator import PAD
from kvmem.errors import KVMemError
from kvmem.integrations.vllm._blocks import KVMemBlocks, RequestState
from kvmem.integrations.vllm._keys import namespace_of
from kvmem.manager import KVCacheManager

__all__ = ["FlushQueue"]

# Field getters for the queue's (request, state, tokens, commit target, computed tokens)
# entries (the first also for (batch index, pages, out) results) and for requests.
_REQUEST, _STATE, _NUM, _QUEUED_AT = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(4)
_RID = attrgetter("rid")
# What kvmem keys a request's pages by (set when the adapter admits it, see _keys.py): the
# list behind vLLM's Request.all_token_ids, or a view of it with multimodal blocks folded.
_TOKENS = attrgetter("_kvmem_keys")
_COMPUTED = attrgetter("num_computed_tokens")
_COMMITTED = attrgetter("committed")


class FlushQueue:
    """The allocations :class:`~kvmem.integrations.vllm.VllmKVCacheAdapter` has decided and not
    yet performed, and their flush (see ``_adapter.py``'s docstring). The adapter holds one and
    appends to it; :meth:`flush` performs the batch.

    Parameters
    ----------
    manager: the adapter's kvmem manager
    requests: the adapter's running requests (id -> state), read and never written here
    async_outputs: a step's tokens are known only after it ran (an ``AsyncScheduler``, or
        speculative decoding's drafts): committed tokens are tracked in each request's state
    worker_block_table: the paranoid check's block table (None: kvmem's incremental check)
    on_aborted: called with ``{request id: reason}`` when verify aborted requests (the adapter
        forgets, logs and reports them)
    speculative: drafts may be rejected: before reserving, each queued running request gives
        back the slots kvmem holds past its computed tokens (what vLLM rolled back)

    Attributes
    ----------
    entries: the queued allocations: (request, state, tokens, commit target or None: all
        scheduled tokens that are known, the request's computed tokens when queued)
    new_blocks: the new-block results to fill at the flush: (index in ``entries``, new pages,
        out)
    num_pages: pages the queued allocations will take
    first_admit: the index in ``entries`` of the first queued admission (its commit target is
        explicit), -1 when none is queued
    lookahead: (index in ``entries``, slots) reserved past an entry's scheduled tokens: the
        lookahead slots of an allocation that takes pages (vLLM allocates blocks for them)
    commits: ``cache_blocks()`` calls since the last flush: (request, state, commit target)
    num_flushes: flushes that had work (allocations or commits), in all
    num_verified_steps, num_verified_requests: batches and requests verify checked, in all
    """

    def __init__(self, manager: KVCacheManager, requests: dict[str, RequestState], *,
                 async_outputs: bool, worker_block_table: Any,
                 on_aborted: Callable[[dict[Any, str]], None], speculative: bool = False
                 ) -> None:
        self.manager = manager
        self.async_outputs = async_outputs
        self.speculative = speculative
        # A resumable request was admitted: its computed tokens may be rolled back when it
        # stops with steps in flight (set by the adapter).
        self.resumable = False
        self.worker_block_table = worker_block_table
        self._reqs = requests
        self._aborted = on_aborted
        self.entries: list[tuple[Any, RequestState, int, int | None, int]] = []
        self.new_blocks: list[tuple[int, int, KVMemBlocks]] = []
        self.num_pages = 0
        self.first_admit = -1
        self.lookahead: list[tuple[int, int]] = []
        self.num_resync = 0  # queued entries of add_resync (their commit targets are explicit)
        self.commits: list[tuple[Any, RequestState, int]] = []
        self.num_flushes = 0
        self.num_verified_steps = 0
        self.num_verified_requests = 0
        self.page_size = manager.page_size
        # The queued commits that fill a page (what the flush will offer the prefix cache),
        # for changes_lookup(): (first token, end token, request), committing tokens
        # [first, end); entries[:_scanned] are listed, the admissions among them at add time.
        self._fills: list[tuple[int, int, Any]] = []
        self._scanned = 0

    def add_growth(self, request: Any, st: RequestState, num_new_tokens: int, computed: int,
                   need: int, out: KVMemBlocks, lookahead: int = 0) -> None:
        """Queue a running request's ``num_new_tokens`` tokens after its ``computed`` ones
        and ``lookahead`` slots past them that take ``need`` new pages (``out`` gets their
        block ids at the flush)."""
        if lookahead:
            self.lookahead.append((len(self.entries), lookahead))
        self.new_blocks.append((len(self.entries), need, out))
        self.entries.append((request, st, num_new_tokens, None, computed))
        self.num_pages += need

    def add_resync(self, request: Any, st: RequestState, num_slots: int, upto: int,
                   num_tokens: int, need: int, out: KVMemBlocks | None) -> None:
        """Queue a running request whose kvmem slots are out of step with vLLM's computed
        tokens (KV connectors: a load done or failed): ``num_slots`` slots after its
        ``num_tokens`` reserved ones, ``need`` new pages (``out`` gets their block ids), commit
        from its committed tokens up to ``upto``."""
        if out is not None:
            self.new_blocks.append((len(self.entries), need, out))
        self.entries.append((request, st, num_slots, upto, num_tokens))
        self.num_pages += need
        self.num_resync += 1

    def add_admission(self, request: Any, st: RequestState, num_new_tokens: int, upto: int,
                      need: int, num_pages: int, out: KVMemBlocks, lookahead: int = 0) -> None:
        """Queue an admitted request's first step: ``num_new_tokens`` and ``lookahead`` slots
        past them in ``need`` pages past its hit (``num_pages`` of them still to take; ``out``
        gets their block ids), commit up to ``upto``."""
        if self.manager.cache is not None:  # (its range is known now, not from the request)
            self._scan()
            self._scanned += 1
            if upto // self.page_size > st.committed // self.page_size:
                self._fills.append((st.committed, upto, request))
        if lookahead:
            self.lookahead.append((len(self.entries), lookahead))
        self.new_blocks.append((len(self.entries), need, out))
        if self.first_admit < 0:
            self.first_admit = len(self.entries)
        self.entries.append((request, st, num_new_tokens, upto, st.committed))
        self.num_pages += num_pages

    # -- would the flush change a prefix lookup? ---------------------------------------------

    def changes_lookup(self, tokens: list[int], namespace: Any, pages: Any, max_pages: int
                       ) -> bool:
        """Whether flushing now could change a prefix lookup that found ``pages`` (``[m]``
        page ids) of the prompt ``tokens`` in ``namespace`` (at most ``max_pages``): True when
        the queued allocations would evict one of ``pages`` (they take the first
        ``num_pages`` pages of the free order: the free pages, then the cache's next
        evictions), or a queued commit fills, with the same namespace and leading tokens, the
        page the lookup missed (page ``m``: then the lookup would go on). A commit of any
        other page adds no key the lookup reads first: a page whose prefix is the prompt's
        and is already full is cached, so the lookup found it or a duplicate cached before.
        Conservative: True when it cannot tell (a prefix cache that cannot say what it
        evicts next)."""
        m = len(pages)
        if m:
            short = self.num_pages - self.manager.allocator.num_free
            cache = self.manager.cache
            if short > 0 and cache is not None:
                peek = getattr(cache, "next_evicted", None)
                if peek is None or not set(peek(short)).isdisjoint(pages.tolist()):
                    return True
        if m >= max_pages:
            return False
        end = (m + 1) * self.page_size  # the tokens through the missed page
        self._scan()
        fills = self._fills
        if self.commits:  # (async scheduling's cache_blocks: few)
            fills = fills + [(st.committed, upto, request) for request, st, upto in self.commits]
        head = None
        for first, last, request in fills:
            if first < end <= last and namespace_of(request) == namespace:
                if head is None:
                    head = tokens[:end]
                if request._kvmem_keys[:end] == head:
                    return True
        return False

    def _scan(self) -> None:
        """List in ``_fills`` the queued running requests (``entries[_scanned:]``) whose commit
        fills a page: tokens from their computed ones (synchronous scheduling: committed when
        scheduled) or committed ones (async), to their computed + scheduled ones (a bound:
        async scheduling commits only the known ones). The computed tokens are those the entry
        noted when queued (read then anyway: here, 256 requests' objects would be read again,
        cache-cold). Vectorized: a batch is 256 requests."""
        q = self.entries
        n = len(q) - self._scanned
        if n <= 0:
            return
        new = q[self._scanned :] if self._scanned else q
        self._scanned = len(q)
        first = np.fromiter(map(_QUEUED_AT, new), dtype=np.int64, count=n)
        end = first + np.fromiter(map(_NUM, new), dtype=np.int64, count=n)
        if self.async_outputs:
            np.minimum(first, _committed(new), out=first)
        p = self.page_size
        some = np.flatnonzero(end // p > first // p).tolist()
        if some:
            fills = self._fills
            for i, lo, hi in zip(some, first[some].tolist(), end[some].tolist()):
                fills.append((lo, hi, new[i][0]))

    def flush(self) -> None:
        """Perform the queued allocations (one reserve), check the batch's mapping (one verify)
        and commit every scheduled token whose id is known (one commit_batch)."""
        q, commits = self.entries, self.commits
        self._fills, self._scanned = [], 0
        if not q:
            if commits:
                self.num_flushes += 1
                self.commits = []
                if not self._commit_arrived(commits):
                    self._commit_general([], commits)
            return
        if self.speculative:
            self._give_back_rejected(q)
        elif self.resumable:
            # A resumable session that stopped with steps in flight: vLLM rolled its computed
            # tokens back to what it had sampled, keeping the blocks (as for rejected drafts).
            self._give_back_rejected([e for e in q if e[0].resumable])
        outs, first_admit, lookahead = self.new_blocks, self.first_admit, self.lookahead
        resync, self.num_resync = self.num_resync, 0
        self.entries, self.new_blocks, self.num_pages, self.first_admit = [], [], 0, -1
        self.commits, self.lookahead = [], []
        self.num_flushes += 1
        ids = tuple(map(_RID, map(_STATE, q)))  # C-level gathers: a batch is 256 requests
        nums = list(map(_NUM, q))
        n0 = nums[0]
        uniform = nums.count(n0) == len(nums)
        mgr = self.manager
        # Per-request counts as an array: the manager checks them in one pass, not one by one.
        counts: Any = n0 if uniform and not lookahead else np.array(nums, dtype=np.int64)
        for i, k in lookahead:
            counts[i] += k
        step = mgr.reserve(ids, counts)
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
            first_admit = 0 if first_admit >= 0 else -1
        if not q and not commits:
            return
        if resync:  # explicit commit targets: the general path
            self._commit_general(q, commits)
            return
        if (first_admit > 0 and not commits and nums[:first_admit].count(1) == first_admit
                and all(e[3] is not None for e in q[first_admit:])):
            # The step's running requests' decodes, then its admissions (a churning batch):
            # the decodes as the decode step's commit, then the admissions' prefill, in the
            # queue's order (which vLLM caches in).
            self._commit_decodes(q[:first_admit], ids[:first_admit])
            self._commit_general(q[first_admit:], [])
            return
        if uniform and n0 == 1 and first_admit < 0 and not commits:
            self._commit_decodes(q, ids)
            return
        self._commit_general(q, commits)

    def _give_back_rejected(self, q: list[tuple[Any, RequestState, int, int | None, int]]
                            ) -> None:
        """Each queued running request's slots past its computed tokens (the drafts vLLM's
        scheduler rejected, by rolling its computed tokens back, and the lookahead slots of
        its last step) go back to kvmem, its pages kept (as vLLM keeps its blocks). Checked
        for the whole queue first: on error nothing is given back and the queue stays."""
        mgr = self.manager
        back: list[tuple[str, int]] = []
        for _, st, _, upto, computed in q:
            if upto is not None:  # admitted in this flush: nothing reserved before
                continue
            extra = mgr.num_tokens(st.rid) - computed
            if extra < 0:
                raise KVMemError(
                    f"request {st.rid!r}: vLLM counts {computed} computed tokens but kvmem "
                    f"reserved only {computed + extra} slots; the scheduler advanced the "
                    "request without allocate_slots() (a path this adapter does not support)")
            if extra > 0:
                if mgr.num_committed(st.rid) > computed:
                    raise KVMemError(
                        f"request {st.rid!r}: vLLM rolled it back to {computed} computed "
                        f"tokens, below the {mgr.num_committed(st.rid)} whose outputs were "
                        "known (and committed) when their step was scheduled; kvmem cannot "
                        "un-commit tokens (an engine that hands drafts over while the "
                        "request's step is in flight is not supported)")
                back.append((st.rid, extra))
        for rid, extra in back:
            mgr.reject(rid, extra, keep_pages=True)

    def _commit_decodes(self, q: list[tuple[Any, RequestState, int, int | None, int]],
                        ids: tuple[str, ...]) -> None:
        """The commit of running requests scheduled one token each (the decode step)."""
        if not self.async_outputs:
            # Synchronous scheduling: without output placeholders every scheduled token is
            # known and was committed when scheduled, so each request's committed tokens are
            # its computed ones and it commits the one at that position. (``committed`` is
            # kept only for async scheduling; here the request's computed tokens say it.)
            reqs = list(map(_REQUEST, q))
            self.manager.commit_batch(ids, np.array(
                list(map(getitem, map(_TOKENS, reqs), map(_COMPUTED, reqs))), dtype=np.int64))
        elif not self._commit_next_known(q, ids):
            self._commit_general(q, [])

    def _commit_next_known(self, q: list[tuple[Any, RequestState, int, int | None, int]],
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
        # One new page each (the decode step's growth) in one gather; longer runs by slices.
        lasts = (indices[ends - 1] + 1).tolist() if indices.size else [0] * len(outs)
        for (_, k, out), block, end in zip(outs, lasts, ends.tolist()):
            out.ids = [block] if k == 1 else (indices[end - k : end] + 1).tolist()

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
        resynced: set[int] = set()
        for b, e in enumerate(q):
            if e[3] is not None and e[1].row >= 0:
                # (KV connectors: a request reconciled with vLLM's computed tokens, whose
                # row may hold pages past the step's: the row is the pages it maps)
                row = int(rows[b])
                pages = self.manager.pages_of(e[1].rid)
                wt[row] = PAD
                wt[row, : pages.size] = pages
                resynced.add(b)
            elif e[3] is not None:  # admitted in this flush: the row is its whole table
                row = int(rows[b])
                e[1].row = row
                lo, hi = int(indptr[b]), int(indptr[b + 1])
                wt[row] = PAD
                wt[row, : hi - lo] = indices[lo:hi]
        for b, k, out in outs:
            row = int(rows[b])
            if b in resynced:
                n = int(self.manager.pages_of(q[b][1].rid).size)
            else:
                n = int(indptr[b + 1] - indptr[b])
                if q[b][3] is None:  # a running request appends its new blocks
                    wt[row, n - k : n] = indices[int(indptr[b + 1]) - k : int(indptr[b + 1])]
            out.ids = (wt[row, n - k : n] + 1).tolist()
        table = wt[rows]
        # Speculative decoding: a row may hold pages past those the step's tokens fill (its
        # lookahead slots', its rejected drafts': vLLM keeps their blocks, and so does
        # kvmem). The step's kernels read none of them: the step's table is checked without
        # them, and each must be the page kvmem maps for the row at its place.
        counts = (indptr[1:] - indptr[:-1]).astype(np.intp)
        past = np.arange(table.shape[1]) >= counts[:, None]
        held = past & (table != PAD)
        wrong: dict[Any, str] = {}
        if held.any():
            for b in np.flatnonzero(held.any(axis=1)).tolist():
                mapped = self.manager.pages_of(ids[b])
                got = wt[int(rows[b]), int(counts[b]):]
                n = mapped.size - int(counts[b])
                if not (np.array_equal(got[:n], mapped[int(counts[b]):])
                        and np.all(got[n:] == PAD)):
                    wrong[ids[b]] = (f"block table entries past the step's {int(counts[b])} "
                                     f"pages are {got[got != PAD][:8].tolist()}, not the "
                                     f"pages the request maps there "
                                     f"{mapped[int(counts[b]):][:8].tolist()}")
            table[past] = PAD
        report = self.manager.verify(ids, metadata={
            "block_table": table, "slot_mapping": step.slot_mapping,
            "seq_lens": step.seq_lens, "num_new_tokens": step.num_new_tokens})
        for rid, reason in wrong.items():
            if rid not in report.aborted:
                self.manager.release(rid)
                report.aborted[rid] = reason
        return report

    def _commit_general(self, q: list[tuple[Any, RequestState, int, int | None, int]],
                        commits: list[tuple[Any, RequestState, int]]) -> None:
        """Commit, for each request queued or named by cache_blocks(), its known tokens up to
        its target (vLLM caches the blocks they fill now)."""
        sync = not self.async_outputs
        entries: list[tuple[Any, RequestState, int, int]] = []  # (request, state, from, to)
        for request, st, n, upto, _ in q:
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
            tokens: Any = np.array([e[0]._kvmem_keys[e[2]] for e in entries], dtype=np.int64)
        else:
            tokens = [e[0]._kvmem_keys[e[2] : e[3]] for e in entries]
        self.manager.commit_batch(ids, tokens)
        for e in entries:
            e[1].committed = e[3]


def _committed(entries: list[Any]) -> Any:
    """The committed tokens of each ``(request, state, ...)`` entry's request: ``[n]`` int64."""
    return np.fromiter(map(_COMMITTED, map(_STATE, entries)), dtype=np.int64, count=len(entries))
