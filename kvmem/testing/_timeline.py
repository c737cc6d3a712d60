"""The device timeline: a deterministic model of an asynchronous engine's device.

An engine that overlaps host scheduling with device work has several actors: the scheduler
(admit, reserve, commit, preempt, abort, release), the device's step stream (steps launched in
order, several in flight, completing in order), page copies that land later (copy-on-write) and
transfers that land on their own clock (P/D disaggregation, offload). :class:`Timeline` models
the device side and checks, after every move, what must hold whatever the interleaving::

    host move  -> manager calls -> hook events -> mapping model -> oracles -> register device op
    device     -> copy lands (after the steps before its step)  -> written K/V visible
               -> step completes (oldest first, its copies landed): reads checked, writes land
               -> transfer lands (any order): writes land
    host       -> retire(op): the engine learns the op is done on the device (retires its fence)
               -> finish(op): the engine processes the op's outputs (commit, release finished)

Device memory (:class:`~kvmem.testing._device_memory.DeviceMemory`) holds one int64 "K/V value"
per token slot, so a read through a wrong page, of a slot not yet written, or of another
tenant's page is visible. The oracles are an :class:`~kvmem.testing._oracles.OracleSet` the
timeline holds: it tells the set's model what the manager's events and the launches say, and
calls its checks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import integer, show
from kvmem.errors import ArgumentTypeError, KVMemError
from kvmem.testing._device_memory import DeviceMemory
from kvmem.testing._launch import EMPTY64, Launch, RequestSpec
from kvmem.testing._oracles import FuzzFailure, OracleSet

__all__ = ["Timeline"]

Int64Array = npt.NDArray[np.int64]

_max = np.maximum.reduce  # (a little cheaper than ndarray.max())


class _Req:
    __slots__ = ("alive", "mrow", "spec")

    def __init__(self, spec: RequestSpec, mrow: int) -> None:
        self.spec = spec
        self.mrow = mrow
        self.alive = True


class Timeline:
    """The device and the reference model of one run over a :class:`KVCacheManager`.

    Parameters
    ----------
    manager: the engine's manager (the oracles read its public state and subscribe to its hooks)
    max_requests: most requests (submitted and not yet forgotten) at once
    max_len: most tokens per request
    check_every: run ``manager.check()`` and the full model comparison every this many moves
    strict_commits: ``landed_hit`` holds the engine to kvmem's contract (commit means the K/V
        landed); False for an engine that commits when it schedules and relies on one stream's
        order (a hit is read by a later step, after the write): then only a same-step hit, which
        ``reads`` sees, is a failure
    stream_ordered: the engine's steps run in launch order on one stream and it relies on that
        (vLLM): a page a step lists may be freed or reused while the step runs, since every
        later writer runs after it; ``happens_before`` then guards only transfers and copies

    Attributes
    ----------
    kv: ``[num_pages * page_size]``, int64 — device memory: the K/V value in each slot (0 = never
        written)
    oracles: the :class:`~kvmem.testing._oracles.OracleSet` it calls after every move
    counts: how often each check ran (a correct run shows them all > 0 and silent)
    """

    def __init__(self, manager: Any, max_requests: int, max_len: int,
                 check_every: int = 64, strict_commits: bool = True,
                 stream_ordered: bool = False) -> None:
        if not all(hasattr(manager, a) for a in ("page_size", "num_pages", "allocator",
                                                 "add_hook")):
            raise ArgumentTypeError(f"manager={show(manager)}: expected the engine's "
                                    "KVCacheManager")
        integer(max_requests, "max_requests", minimum=1)
        integer(max_len, "max_len", minimum=1)
        integer(check_every, "check_every", minimum=1)
        self.mgr = manager
        self.strict_commits = strict_commits
        self.stream_ordered = stream_ordered
        self.P = P = int(manager.page_size)
        self.num_pages = n = int(manager.num_pages)
        self.max_len = max_len
        self.check_every = check_every
        self.counts = {"page_checks": 0, "tag_changes": 0, "reads": 0, "hits": 0,
                       "retires": 0, "full_checks": 0, "launches": 0}
        self.oracles = OracleSet(manager, self.counts)
        self._init_rows(max_requests)
        self.memory = DeviceMemory(n, P, max_requests, max_len, self.width)
        self.kv = self.memory.kv
        self._arange = self.memory.arange
        self._copy_hold_pages = EMPTY64  # the latest reserve's copy-on-write sources
        self._page_mask = np.zeros(n, dtype=bool)  # scratch, all False between uses
        self._init_queues()
        self.moves = 0
        self.aborted_by_verify: list[tuple[Any, str]] = []
        self.extra_check: Callable[[], None] | None = None  # the engine's own checks
        # The engine's own device work (deferred tier copies): (ops it started, ops that ended
        # without landing) since the last call; None: an engine that starts none.
        self.copies: Callable[[], tuple[list[Launch], list[Launch]]] | None = None
        for kind in ("admit", "fork", "preempt", "release", "integrity_failure", "step_end"):
            manager.add_hook(kind, self._on_event)

    def _init_rows(self, max_requests: int) -> None:
        """Per model row (one per request the model follows)."""
        max_len = self.max_len
        width = -(-max_len // self.P) + 1
        self.width = width
        self.map = np.full((max_requests, width), -1, dtype=np.int64)  # pages each maps
        self._map_flat = self.map.reshape(-1)
        self.map_len = np.zeros(max_requests, dtype=np.int64)
        self._free_mrows = list(range(max_requests - 1, -1, -1))
        self.reqs: dict[Any, _Req] = {}
        self._mrow_of: dict[Any, int] = {}  # request id -> its row (written with ``reqs``)

    def _init_queues(self) -> None:
        """The device's queues, and the fences they hold."""
        self.in_flight: deque[Launch] = deque()  # steps, launch order
        self.transfers: list[Launch] = []
        # Done on the device; the host has yet to retire their fence / process their outputs.
        self.to_retire: deque[Launch] = deque()
        self.to_finish: deque[Launch] = deque()
        self._next_op = 0
        self._open_fences: dict[int, Launch] = {}  # fence -> op not yet completed on device
        self._must_retire: set[int] = set()  # fences the host was told to retire
        self._retired: set[int] = set()
        self._events: list[tuple[str, Any, Any, Any]] = []

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        """Follow a request the fuzzer submitted (or forked): compute its K/V values."""
        if spec.max_len > self.max_len:
            raise KVMemError(f"{spec!r} is longer than the timeline's max_len={self.max_len}")
        if not self._free_mrows:
            self._collect()
            if not self._free_mrows:
                raise KVMemError(
                    f"the timeline follows {len(self.reqs)} requests, its max_requests; finish "
                    "or abort some before submitting more"
                )
        mrow = self._free_mrows.pop()
        self.memory.load(mrow, spec)
        self.map[mrow] = -1
        self.map_len[mrow] = 0
        self.reqs[spec.request_id] = _Req(spec, mrow)
        self._mrow_of[spec.request_id] = mrow

    def forget(self, request_id: Any) -> None:
        """The fuzzer is done with a request (finished or aborted): its row can be reused once
        no device op lists it."""
        req = self.reqs.get(request_id)
        if req is not None:
            req.alive = False

    def _collect(self) -> None:
        """Forget the finished requests that no op on the device lists (their rows are free)."""
        listed: set[int] = set()
        for op in (*self.in_flight, *self.transfers):
            listed.update(op.mrows.tolist())
        for rid in [r for r, q in self.reqs.items() if not q.alive and q.mrow not in listed]:
            q = self.reqs.pop(rid)
            del self._mrow_of[rid]
            if self.map_len[q.mrow]:
                self._unmap(q.mrow)
            self.memory.unload(q.mrow)
            self._free_mrows.append(q.mrow)

    # -- the mapping model ----------------------------------------------------------------------

    def _on_event(self, event: Any) -> None:
        self._events.append((event.kind, event.request_id, event.pages, event.detail))

    def _set_map(self, mrow: int, pages: Int64Array) -> None:
        self._unmap(mrow)
        k = pages.size
        if k > self.width:
            raise FuzzFailure("refcounts", f"a request maps {k} pages, more than it can use")
        self.map[mrow, :k] = pages
        self.map_len[mrow] = k
        self.oracles.hold(pages)

    def _unmap(self, mrow: int) -> None:
        k = int(self.map_len[mrow])
        if k:
            self.oracles.unhold(self.map[mrow, :k].copy())
            self.map[mrow, :k] = -1
            self.map_len[mrow] = 0

    def truncate(self, request_id: Any, num_pages: int) -> None:
        """``request_id`` maps only its first ``num_pages`` pages now (its rejected drafts were
        given back: the pages past them are no longer its)."""
        req = self.reqs.get(request_id)
        if req is None:
            return
        m, k = req.mrow, int(self.map_len[req.mrow])
        if k > num_pages:
            self.oracles.unhold(self.map[m, num_pages:k].copy())
            self.map[m, num_pages:k] = -1
            self.map_len[m] = num_pages
            self.memory.vseen[m, num_pages:] = -1

    def _process_events(self) -> None:
        events, self._events = self._events, []
        for kind, rid, pages, detail in events:
            if kind == "step_end":
                fence = int(detail)
                self._retired.add(fence)
                self.counts["retires"] += 1
                op = self._open_fences.get(fence)
                if op is not None:
                    raise FuzzFailure(
                        "fences", f"fence {fence} was retired while {op!r} still runs on the "
                        "device: pages it reads or writes can be reused under it")
                self._must_retire.discard(fence)
                continue
            req = self.reqs.get(rid)
            if req is None:
                continue  # a request the fuzzer does not follow (the engine's own)
            if kind in ("admit", "fork"):
                p = pages.astype(np.int64)
                self._set_map(req.mrow, p)
                self.memory.vseen[req.mrow] = -1
                if kind == "admit" and detail and self.strict_commits:
                    hits = p[: int(detail) // self.P]
                    self.counts["hits"] += 1
                    bad = self._unlanded_among(hits)
                    if bad.size:
                        raise FuzzFailure(
                            "landed_hit", f"request {rid!r} reuses cached pages "
                            f"{bad.tolist()[:8]} whose K/V writes have not landed yet")
            elif kind in ("preempt", "release", "integrity_failure"):
                self._unmap(req.mrow)
                if kind == "integrity_failure":
                    self.aborted_by_verify.append((rid, str(detail)))

    def _observe_launch(self, op: Launch, reserved: bool = True) -> None:
        """The launch's metadata tells the model each request's first pages now (growth and
        copy-on-write happen in reserve, which emits no per-request event). ``reserved``: the
        op comes from a reserve (which replaces the copy-on-write sources held); an engine's
        own copy does not."""
        ids = op.request_ids
        try:
            mrows = np.fromiter(map(self._mrow_of.__getitem__, ids), dtype=np.int64,
                                count=len(ids))
        except KeyError as e:
            raise FuzzFailure("engine", f"{op!r} lists request {e.args[0]!r}, which the "
                              "fuzzer never submitted") from None
        op.mrows = mrows
        indptr, pages = op.kv_indptr, op.kv_indices
        nnz = pages.size
        if nnz and int(_max(pages.view(np.uint64))) >= self.num_pages:  # (negatives wrap)
            raise FuzzFailure("reads", f"{op!r} lists page ids outside 0..{self.num_pages - 1}")
        counts = indptr[1:] - indptr[:-1]
        if indptr[0] != 0 or indptr[-1] != nnz or (
                counts.size and int(_max(counts)) > self.width):
            raise FuzzFailure("reads", f"{op!r} has a malformed CSR (kv_indptr {indptr[:8]})")
        # Entry k of the CSR is column k - indptr[b] of its request b's model row.
        ar = self._arange if nnz <= self._arange.size else np.arange(nnz, dtype=np.int64)
        flat = (mrows * self.width - indptr[:-1]).repeat(counts)
        flat += ar[:nnz]
        op.ent_flat = flat
        op.kv_counts = counts
        old = self._map_flat.take(flat)
        changed = (old != pages).nonzero()[0]
        if changed.size:
            o = old[changed]
            o = o[o >= 0]  # (none when the changed entries are pages just added at the end)
            if o.size:
                self.oracles.unhold(o)
            new = pages[changed]
            self.oracles.hold(new)
            self._map_flat[flat[changed]] = new
            # A request's CSR covers its first columns: it maps at least that many now (.at: a
            # request listed twice by a buggy engine keeps the longer).
            np.maximum.at(self.map_len, mrows, counts)
        # The manager keeps the latest reserve's copy-on-write sources until the next reserve.
        if not reserved:
            return
        if self._copy_hold_pages.size:
            self.oracles.unhold_copies(self._copy_hold_pages)
        self._copy_hold_pages = op.held_sources
        if op.held_sources.size:
            self.oracles.hold_copies(op.held_sources)

    def note_reserve_without_launch(self) -> None:
        """The engine reserved but launched nothing (e.g. everything it reserved was aborted by
        verify): the previous copy-on-write sources are no longer held."""
        if self._copy_hold_pages.size:
            self.oracles.unhold_copies(self._copy_hold_pages)
            self._copy_hold_pages = EMPTY64

    # -- host moves -------------------------------------------------------------------------------

    def after_host_move(self, op: Launch | None = None) -> None:
        """Check every oracle after a host move (``op``: the device work it launched), then put
        ``op`` on the device."""
        self.moves += 1
        if self._events:
            self._process_events()
        if op is not None:
            self._observe_launch(op)
        started: list[Launch] = []
        if self.copies is not None:
            started, ended = self.copies()
            for extra in started:
                self._observe_launch(extra, reserved=False)
            for extra in ended:  # (cancelled: they land nothing)
                self.transfers.remove(extra)
                self._finish_on_device(extra, reads=False, landed=EMPTY64)
        self.oracles.check_pages(self._op_listing)
        if self.aborted_by_verify:
            rid, reason = self.aborted_by_verify[0]
            raise FuzzFailure("verify", f"verify aborted request {rid!r}: {reason}")
        if self._must_retire:
            fence = min(self._must_retire)
            raise FuzzFailure("fences", f"the host processed the completion of the op covered by "
                              f"fence {fence} but never retired it: the pages it holds leak")
        if op is not None:
            self._register(op)
        for extra in started:
            self._register(extra)
        if self.check_every and self.moves % self.check_every == 0:
            self.full_check()

    def after_device_move(self) -> None:
        self.moves += 1

    def full_check(self) -> None:
        """Every oracle at once (``manager.check()``, the model over every page, the requests,
        the engine's ``extra_check``), after forgetting the finished requests no op lists."""
        self._collect()
        reqs = self.reqs
        self.oracles.full_check(
            alive=lambda rid: rid in reqs and reqs[rid].alive, idle=self.idle,
            extra_check=self.extra_check)

    @property
    def num_reads(self) -> int:
        """Steps whose reads were checked."""
        return self.oracles.num_reads

    def _op_listing(self, page: int) -> Launch | None:
        """The op in flight that lists ``page`` (None: none)."""
        for op in (*self.in_flight, *self.transfers):
            if np.count_nonzero(op.guard == page):
                return op
        return None

    # -- device ---------------------------------------------------------------------------------

    def _register(self, op: Launch) -> None:
        self.counts["launches"] += 1
        op.id = self._next_op
        self._next_op += 1
        P = self.P
        slots = op.slot_mapping
        if slots.size and int(_max(slots.view(np.uint64))) >= self.num_pages * P:
            raise FuzzFailure("reads", f"{op!r} writes slots outside the pool")
        op.write_pages = slots // P
        if op.copy_src.size:
            copies = np.concatenate([op.copy_src, op.copy_dst])
            if int(_max(copies.view(np.uint64))) >= self.num_pages:
                raise FuzzFailure("engine", f"{op!r} copies page ids outside "
                                  f"0..{self.num_pages - 1}")
        if not (self.stream_ordered and op.kind == "step" and not op.copy_src.size):
            op.guard = (np.concatenate([op.kv_indices, op.write_pages, op.copy_src, op.copy_dst])
                        if op.copy_src.size else np.concatenate([op.kv_indices, op.write_pages,
                                                                 op.read_pages]))
            self.oracles.guard_pages(op.guard)
        op.pending_copies = int(op.copy_src.size)
        if op.fence is not None:
            if op.fence in self._retired:
                raise FuzzFailure("fences", f"{op!r} was launched under fence {op.fence}, which "
                                  "is already retired: nothing holds what is dropped while it "
                                  "runs")
            self._open_fences[op.fence] = op
        if op.kind == "transfer":
            self.transfers.append(op)
        else:
            self.in_flight.append(op)


    def unlanded_pages(self) -> Int64Array:
        """Pages with K/V writes launched and not yet landed (steps, copies, transfers)."""
        parts = [op.write_pages for op in self.in_flight]
        parts += [op.copy_dst[op.copy_dst.size - op.pending_copies :]
                  for op in self.in_flight if op.pending_copies]
        parts += [op.write_pages for op in self.transfers]
        return np.concatenate(parts) if parts else EMPTY64

    def _unlanded_among(self, pages: Int64Array) -> Int64Array:
        """Those of ``pages`` that a launched write has not landed in yet."""
        if not pages.size:
            return EMPTY64
        pending = self.unlanded_pages()
        if not pending.size:
            return EMPTY64
        mask = self._page_mask
        mask[pending] = True
        found = pages[mask[pages]]
        mask[pending] = False
        return found

    def can_land_copy(self) -> bool:
        return bool(self.in_flight) and self.in_flight[0].pending_copies > 0

    def land_copy(self) -> bool:
        """The next copy of the oldest step lands (its earlier steps have all completed)."""
        if not self.can_land_copy():
            return False
        op = self.in_flight[0]
        i = op.copy_src.size - op.pending_copies
        self.memory.copy_page(int(op.copy_src[i]), int(op.copy_dst[i]))
        self.oracles.unguard_pages(op.copy_src[i : i + 1])  # the copy no longer reads its source
        op.pending_copies -= 1
        self.after_device_move()
        return True

    def can_complete(self) -> bool:
        return bool(self.in_flight) and self.in_flight[0].pending_copies == 0

    def complete(self) -> bool:
        """The oldest step completes: its reads are checked, then its writes land."""
        if not self.can_complete():
            return False
        op = self.in_flight.popleft()
        self._finish_on_device(op, reads=True)
        self.after_device_move()
        return True

    def land_transfer(self, choice: int, landed: Int64Array | None = None) -> bool:
        """One of the transfers in flight lands (any order): ``transfers[choice % n]``.
        ``landed``: ``[T]`` int64, what it really wrote into its slots (default: its requests'
        own K/V)."""
        if not self.transfers:
            return False
        op = self.transfers.pop(choice % len(self.transfers))
        self._finish_on_device(op, reads=False, landed=landed)
        self.after_device_move()
        return True

    def _finish_on_device(self, op: Launch, reads: bool,
                          landed: Int64Array | None = None) -> None:
        if reads:
            self.oracles.check_reads(op, self.memory)
        else:
            self.memory.land_writes(op, landed)
        g = op.guard
        if op.copy_src.size:  # each copy's source was released when it landed
            g = np.concatenate([op.kv_indices, op.write_pages, op.copy_dst])
        self.oracles.unguard_pages(g)
        if op.fence is not None:
            self._open_fences.pop(op.fence, None)
        if op.fence is not None:
            self.to_retire.append(op)
        self.to_finish.append(op)

    # -- host learns completions ---------------------------------------------------------------

    def next_to_retire(self) -> Launch | None:
        """The oldest op done on the device whose fence the host has not retired."""
        return self.to_retire[0] if self.to_retire else None

    def next_to_finish(self) -> Launch | None:
        """The oldest op done on the device whose outputs the host has not processed."""
        return self.to_finish[0] if self.to_finish else None

    def host_retired(self, op: Launch) -> None:
        """The engine was told ``op`` is done on the device (call after ``engine.retire(op)``):
        its fence must be retired by the end of the move."""
        self.to_retire.remove(op)
        if op.fence is not None:
            if op.fence in self._retired:
                self._retired.discard(op.fence)
            else:
                self._must_retire.add(op.fence)

    def host_finished(self, op: Launch) -> None:
        """The engine processed ``op``'s outputs (call after ``engine.finish(op)``)."""
        if self.to_finish and self.to_finish[0] is op:
            self.to_finish.popleft()
        else:
            self.to_finish.remove(op)

    @property
    def idle(self) -> bool:
        return not (self.in_flight or self.transfers or self.to_retire or self.to_finish)
