"""The fuzzer's reference engine: an asynchronous engine written directly on the manager."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvmem.errors import OutOfPagesError
from kvmem.testing._fuzz_protocol import FuzzConfig, subset_step
from kvmem.testing._fuzz_slots import GONE, PREEMPTED, RECEIVING, RUNNING, WAITING, SlotEngine
from kvmem.testing._launch import EMPTY64, Launch, RequestSpec
from kvmem.testing._oracles import FuzzFailure

__all__ = ["ManagerEngine", "SpeculativeManagerEngine"]

Int64Array = npt.NDArray[np.int64]


class ManagerEngine(SlotEngine):
    """An asynchronous engine written directly on :class:`KVCacheManager` (kvmem's reference).

    Each launch admits waiting requests (first come, first served, while ``can_admit``), builds
    one batch (prefill chunks and decode tokens together, like vLLM's scheduler), reserves it
    (preempting the latest admitted request while pages are short), verifies it, and launches
    it under a step fence (``begin_step``); ``finish`` retires the fence, commits the tokens
    whose K/V landed and releases finished requests. Up to ``max_in_flight`` steps overlap, and a
    request may be in several of them (async scheduling). ``receive`` admits a request whose
    prompt K/V arrives by a transfer (P/D disaggregation) that holds its own fence.
    """

    name: ClassVar[str] = "manager"
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {"fork", "preempt", "resume", "receive", "clear", "hooks"})
    max_drafts: ClassVar[int] = 0  # draft tokens per speculative decode step (0: none)

    def __init__(self, config: FuzzConfig) -> None:
        mgr = self.new_manager(config)
        super().__init__(config, mgr)
        self.max_in_flight = config.max_in_flight
        self._bt: npt.NDArray[np.int32] | None = None  # block-table buffer (stale_block_table)
        n = config.max_requests
        self.num_drafts = np.zeros(n, dtype=np.int64)  # drafts each slot gets in this launch
        self.drafting = np.zeros(n, dtype=bool)  # a speculative step in flight lists the slot
        self.stale_drafts = np.zeros(n, dtype=np.int64)  # (draft_lengths_kept)
        self.num_rejected = 0  # draft tokens given back
        self._drafted: dict[Launch, Int64Array] = {}  # per speculative op: the slots drafting
        self._truncated: list[tuple[Any, int]] = []

    # -- the step ------------------------------------------------------------------------------

    def launch(self, choice: int) -> Launch | None:
        mgr = self.manager
        self._admit_waiting()
        slots, sched, n = self._batch(choice)
        if not slots.size:
            return None
        while True:
            ids = self._ids(slots)
            k = int(n[0])
            try:
                step = mgr.reserve(ids, k if np.count_nonzero(n != k) == 0 else n)
                break
            except OutOfPagesError:
                victim = self._preempt_victim()
                if victim is None:
                    return None
                keep = slots != victim
                slots, sched, n = slots[keep], sched[keep], n[keep]
                if not slots.size:
                    return None
        report = self._verify(ids, step)
        if report is not None and report.aborted:
            keep = report.keep
            for s in slots[~keep].tolist():
                self._drop_slot(s)
            slots, sched, n = slots[keep], sched[keep], n[keep]
            indptr, indices, slot_mapping, num_new = subset_step(step, keep)
            seq_lens = step.seq_lens[keep]
            ids = tuple(i for i, k in zip(ids, keep.tolist()) if k)
        else:
            indptr, indices, slot_mapping = step.kv_indptr, step.kv_indices, step.slot_mapping
            seq_lens, num_new = step.seq_lens, step.num_new_tokens
        copy_src, copy_dst = step.copy_src, step.copy_dst
        self.values.reserved(slots, sched, n, indptr, indices, slot_mapping, seq_lens, num_new,
                             copy_dst)
        if not slots.size and not copy_src.size:
            return None
        handle = mgr.begin_step()
        if "retire_at_launch" in self.bugs:
            self._call(mgr.retire, handle)
        if "skip_cow_copy" in self.bugs:
            copy_src = copy_dst = np.empty(0, dtype=np.int32)
        op = Launch(ids, sched, n, indptr, indices, slot_mapping, copy_src, copy_dst,
                    fence=handle.step_id, held_sources=step.copy_src)
        if self.max_drafts:
            self._draft(op, slots, choice)
        self.sched[slots] = sched + n
        self.busy[slots] += 1
        self.ops[op] = (handle, slots, self.inc[slots])  # (fancy indexing copies)
        self.handles[op] = handle
        if "commit_at_launch" in self.bugs:
            self._commit(slots, sched, n)
        return op

    # -- speculative decoding ------------------------------------------------------------------

    def _batch(self, choice: int) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The base batch; with ``max_drafts``, every third launch a speculative one: each
        decode token gets up to ``max_drafts`` draft tokens after it (within its request)."""
        slots, sched, n = super()._batch(choice)
        if not self.max_drafts or not slots.size:
            return slots, sched, n
        keep = ~self.drafting[slots]  # (a request's next step waits for its drafts' verdict)
        slots, sched, n = slots[keep], sched[keep], n[keep]
        self.num_drafts[slots] = 0
        if (choice >> 7) % 3 == 0:
            decode = (n == 1) & (sched >= self.plen[slots])
            k = np.minimum(1 + (choice >> 9) % self.max_drafts, self.mlen[slots] - sched - 1)
            k = np.where(decode, np.maximum(k, 0), 0)
            self.num_drafts[slots] = k
            n = n + k
        return slots, sched, n

    def _draft(self, op: Launch, slots: Int64Array, choice: int) -> None:
        """``op`` computes drafts: how many of each request's the verifier accepts (``choice``
        and the request decide); the rest are rejected, and the device writes them with
        draft values."""
        k = self.num_drafts[slots]
        if not np.count_nonzero(k):
            return
        accepted = np.array([zlib.crc32(f"{choice}:{rid}".encode()) for rid in op.request_ids],
                            dtype=np.int64) % (k + 1)
        op.rejected = k - accepted
        self._drafted[op] = drafted = slots[k > 0]
        self.drafting[drafted] = True

    def _reject(self, slots: Int64Array, rejected: Int64Array) -> None:
        """Give back the rejected drafts of the (live) requests at ``slots``: each ends at its
        committed tokens and maps only the pages they fill (past its prompt: kvmem's reject)."""
        P = self.config.page_size
        for s, r in zip(slots.tolist(), rejected.tolist()):
            if not r:
                continue
            rid = self.ids[s]
            self._call(self.manager.reject, rid, r)
            self.num_rejected += r
            self.sched[s] = self.comm[s]
            num_pages = -(-int(self.comm[s]) // P)
            self.values.rejected(s, num_pages)
            self._truncated.append((rid, num_pages))
            if "draft_lengths_kept" in self.bugs:
                self.stale_drafts[s] += r

    def take_truncations(self) -> list[tuple[Any, int]]:
        if not self.max_drafts:  # (subclasses with their own __init__ draft nothing)
            return []
        out, self._truncated = self._truncated, []
        return out

    def _kept_lengths_metadata(self, ids: tuple[Any, ...], step: Any) -> dict[str, Any] | None:
        """The engine's kernel lengths still count each request's rejected drafts (its own
        length was never rolled back): the next step reads the rejected slots."""
        stale = self.stale_drafts[[self.slot_of[i] for i in ids]]
        if not np.count_nonzero(stale):
            return None
        return {"kv_indptr": step.kv_indptr, "kv_indices": step.kv_indices,
                "slot_mapping": step.slot_mapping, "seq_lens": step.seq_lens + stale}

    def _verify(self, ids: tuple[Any, ...], step: Any) -> Any:
        mgr = self.manager
        if not mgr.tracker.enabled:
            return None
        if "draft_lengths_kept" in self.bugs:
            stale = self._kept_lengths_metadata(ids, step)
            if stale is not None:
                report = mgr.verify(ids, metadata=stale)
                self.values.note_aborted(len(report.aborted))
                return report
        if "stale_block_table" in self.bugs:
            return mgr.verify(ids, metadata=self._block_table_metadata(step))
        if "wrong_chunk_slice" in self.bugs:
            return mgr.verify(ids, metadata=self._shifted_metadata(step))
        report = mgr.verify(ids, step)
        self.values.note_aborted(len(report.aborted))
        return report

    def _block_table_metadata(self, step: Any) -> dict[str, Any]:
        """The engine's own block table, in a buffer it reuses without clearing the columns
        past each request's pages (BUGS.md 13)."""
        counts = np.diff(step.kv_indptr)
        width = int(counts.max(initial=1))
        if self._bt is None or self._bt.shape[0] < counts.size or self._bt.shape[1] < width:
            rows = max(counts.size, self.config.max_seqs)
            cols = max(width, -(-self.config.max_len // self.config.page_size) + 1)
            self._bt = np.full((rows, cols), -1, dtype=np.int32)
        bt = self._bt[: counts.size, :width]
        for b in range(counts.size):
            bt[b, : counts[b]] = step.kv_indices[step.kv_indptr[b] : step.kv_indptr[b + 1]]
        return {"block_table": bt.copy(), "slot_mapping": step.slot_mapping,
                "seq_lens": step.seq_lens}

    def _shifted_metadata(self, step: Any) -> dict[str, Any]:
        """The kernel's CSR for chunked-prefill requests starts one page late in the row: the
        first two pages swapped (BUGS.md 12)."""
        indices = step.kv_indices.copy()
        for b in np.flatnonzero(step.num_new_tokens > 1).tolist():
            lo, hi = int(step.kv_indptr[b]), int(step.kv_indptr[b + 1])
            if hi - lo >= 2:
                indices[lo], indices[lo + 1] = indices[lo + 1], indices[lo]
        return {"kv_indptr": step.kv_indptr, "kv_indices": indices,
                "slot_mapping": step.slot_mapping, "seq_lens": step.seq_lens}

    def _preempt_victim(self) -> int | None:
        """Preempt the latest admitted running request (vLLM's policy); returns its slot."""
        for s in reversed(self.order):
            if self.state[s] == RUNNING:
                self._preempt_slot(s)
                return s
        return None

    def _preempt_slot(self, s: int) -> None:
        self._call(self.manager.preempt, self.ids[s])
        self.values.note_preempt()
        self.order.remove(s)
        self._order_arr = None
        self.state[s] = PREEMPTED
        self.inc[s] += 1

    def _commit(self, slots: Int64Array, starts: Int64Array, n: Int64Array,
                ids: Sequence[Any] | None = None) -> None:
        """Commit ``n`` tokens from ``starts`` for ``slots`` (``ids``: their request ids)."""
        if not slots.size:
            return
        if ids is None:
            ids = [self.ids[s] for s in slots.tolist()]
        if np.count_nonzero(self.comm[slots] != starts):
            raise FuzzFailure("engine", f"{self.name} commits out of order: requests {ids[:4]} "
                              f"committed {self.comm[slots][:4]} but the step started at "
                              f"{starts[:4]}")
        one = n == 1
        if np.count_nonzero(one) == one.size:
            self.manager.commit_batch(ids, self.tok[slots, starts])
        elif np.count_nonzero(one) > 8:  # decode tokens in one call, chunks in another
            d = np.flatnonzero(one)
            self.manager.commit_batch([ids[i] for i in d.tolist()],
                                      self.tok[slots[d], starts[d]])
            c = np.flatnonzero(~one)
            self.manager.commit_batch(
                [ids[i] for i in c.tolist()],
                [self.tok[s, a : a + k] for s, a, k in
                 zip(slots[c].tolist(), starts[c].tolist(), n[c].tolist())])
        else:
            self.manager.commit_batch(ids, [self.tok[s, a : a + k] for s, a, k in
                                            zip(slots.tolist(), starts.tolist(), n.tolist())])
        self.comm[slots] = starts + n

    def finish(self, op: Launch) -> Sequence[Any]:
        _, slots, incs = self.ops.pop(op)
        self.busy[slots] -= 1
        st = self.state[slots]
        live = (self.inc[slots] == incs) & ((st == RUNNING) | (st == RECEIVING))
        ids: Sequence[Any] | None = None
        rejected = op.rejected
        if rejected.size:
            self.drafting[self._drafted.pop(op)] = False
            if "commit_rejected_drafts" in self.bugs:  # the drafts taken for accepted
                rejected = EMPTY64
        if np.count_nonzero(live) == live.size:  # (the usual case: nothing gone, all commit)
            starts, n, ids = op.starts, op.num_new, op.request_ids
        else:
            # (_release_ops, with the states at hand: gone requests' slots become reusable)
            for s in slots[(st == GONE) & (self.busy[slots] == 0)].tolist():
                self._free.append(s)
            slots, starts, n = slots[live], op.starts[live], op.num_new[live]
            rejected = rejected[live] if rejected.size else rejected
        if rejected.size:  # the accepted tokens are committed, the rejected drafts given back
            n = n - rejected
        if "commit_at_launch" not in self.bugs or op.kind == "transfer":
            self._commit(slots, starts, n, ids)
        if rejected.size:
            self._reject(slots, rejected)
        if op.kind == "transfer":
            self.state[slots] = RUNNING
        return self._finish_done(slots)

    def retire(self, op: Launch) -> None:
        handle = self.handles.pop(op, None)
        if handle is not None and "drop_completion" not in self.bugs and (
                "retire_at_launch" not in self.bugs):
            self._call(self.manager.retire, handle)

    # -- other host moves ----------------------------------------------------------------------

    def abort(self, request_id: Any) -> None:
        s = self.slot_of.get(request_id)
        if s is None:
            return
        state = self.state[s]
        if state == WAITING:
            self.waiting.remove(s)
        elif "leak_on_abort" in self.bugs and state == RUNNING:
            pass  # the engine forgets the request but never tells kvmem
        else:
            if "commit_on_abort" in self.bugs and state == RUNNING and (
                    self.sched[s] > self.comm[s]):
                # Commits what was scheduled, landed or not (BUGS.md 8).
                self.manager.commit(request_id, self.tok[s, self.comm[s] : self.sched[s]])
            self._call(self.manager.release, request_id)
        self._drop_slot(s)

    def _fork(self, parent: Any, child: Any) -> None:
        self._call(self.manager.fork, parent, child)

    def resume(self, choice: int) -> bool:
        s = self._pick(PREEMPTED, choice)
        if s is None:
            return False
        rid = self.ids[s]
        mgr = self.manager
        if not mgr.can_resume(rid):
            return False
        # The resumed request's prompt is what the manager kept: its committed tokens, then
        # the rest of its prompt.
        plen = max(int(self.comm[s]), int(self.plen[s]))
        prompt = self.tok[s, :plen]
        spec = self.specs[s]
        assert spec is not None
        match = self.values.lookup(prompt, self._namespace(spec))
        res = self._call(mgr.resume, rid)
        self.plen[s] = plen
        cached = self.values.admitted(s, rid, prompt, match, res, "resume")
        self.sched[s] = self.comm[s] = cached
        self.inc[s] += 1
        self._start_running(s)
        return True

    def receive(self, spec: RequestSpec) -> Launch | None:
        mgr = self.manager
        ns = self._namespace(spec)
        if not mgr.can_admit(spec.prompt, ns):
            return None
        s = self._new_slot(spec)
        match = self.values.lookup(spec.prompt, ns)
        res = self._call(mgr.admit, spec.request_id, spec.prompt, ns)
        cached = self.values.admitted(s, spec.request_id, spec.prompt, match, res)
        n = spec.prompt_len - cached
        step = mgr.reserve((spec.request_id,), n)
        self.values.reserved(np.array([s]), np.array([cached]), np.array([n]), step.kv_indptr,
                             step.kv_indices, step.slot_mapping, step.seq_lens,
                             step.num_new_tokens, step.copy_dst)
        fence = None
        handle = None
        if "no_transfer_fence" not in self.bugs:
            handle = mgr.begin_step()
            fence = handle.step_id
        self.sched[s] = spec.prompt_len
        self.comm[s] = cached
        self._start_running(s)
        self.state[s] = RECEIVING
        op = Launch((spec.request_id,), [cached], [n], step.kv_indptr, step.kv_indices,
                    step.slot_mapping, fence=fence, kind="transfer")
        self.busy[s] += 1
        self.ops[op] = (handle, np.array([s], dtype=np.int64), self.inc[[s]].copy())
        if handle is not None:
            self.handles[op] = handle
        return op

    def clear_cache(self) -> bool:
        self.manager.clear_prefix_cache()
        return True

    def check(self) -> None:
        """The ``request_state`` and ``stats`` oracles: what the manager stores against the
        engine's model."""
        running = [(s, self.ids[s], int(self.sched[s]), int(self.comm[s]), int(self.plen[s]),
                    self.tok[s]) for s in self.order]
        preempted = [self.ids[s] for s in self.slot_of.values() if self.state[s] == PREEMPTED]
        used = self.values.check_requests(running, preempted)
        self.values.check_stats(len(running), len(preempted), used, len(self.handles))


class SpeculativeManagerEngine(ManagerEngine):
    """:class:`ManagerEngine` with speculative decoding: every third launch or so, each decode
    token of the step gets up to three draft tokens after it (``reserve(ids, 1 + k)``); the
    device writes the drafts the verifier will reject with draft values (a wrong token's K/V),
    and ``finish`` commits the accepted tokens and gives back the rest
    (``manager.reject``). A later step that read a rejected draft's slot would find its draft
    value (``reads``)."""

    name: ClassVar[str] = "manager-spec"
    max_drafts: ClassVar[int] = 3
