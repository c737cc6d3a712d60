"""Engines under test: the protocol the fuzzer drives, and the adapters kvmem ships.

The fuzzer plays the clients (requests arrive, get cancelled), the device (steps complete, copies
and transfers land) and the model (the token each step samples is ``spec.tokens[position]``).
An engine adapter plays the host: its scheduler decides what each step computes and calls its
:class:`~kvmem.manager.KVCacheManager`. What the fuzzer calls and what it observes::

    fuzzer -> engine                          engine -> fuzzer
    submit(spec)      a request arrives       (manager hooks: admit, fork, preempt, release,
    abort(id)         the client cancels       integrity_failure, step_end: seen by the fuzzer)
    launch(choice)    schedule + launch ...   -> Launch: per request the positions computed,
                                                 the pages read (CSR), the slots written, the
                                                 copies to do first, the fence that covers it
    retire(op)        the device finished op: retire its fence (ops with a fence only)
    finish(op)        process op's outputs    -> ids of the requests that finished
    fork / preempt / resume / receive / clear_cache (optional, see ``capabilities``)
    check()           engine-specific checks (optional; raise FuzzFailure("engine", ...))

Rules an adapter follows (they are what an engine on kvmem must do anyway):

* every successful ``reserve`` is run by exactly one :class:`Launch` (a step or a transfer):
  the fuzzer learns each request's pages from it;
* ``retire`` and ``finish`` are each called in completion order, in either order for one op,
  only after the op completed on the device; ``retire`` retires the op's fence, ``finish``
  commits what the op computed and releases the requests it finished;
* the token at position ``i`` of a request is ``spec.tokens[i]``.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvmem.errors import HookError, KVMemError, OutOfPagesError
from kvmem.testing._launch import Launch, RequestSpec
from kvmem.testing._oracles import FuzzFailure

__all__ = ["ENGINES", "FuzzConfig", "FuzzEngine", "ManagerEngine", "ToyEngineAdapter",
           "make_engine", "subset_step"]

Int64Array = npt.NDArray[np.int64]

# Request states in the adapters.
_GONE, _WAITING, _RUNNING, _PREEMPTED, _RECEIVING = 0, 1, 2, 3, 4


class FuzzConfig:
    """The shape of a fuzzed system: pool, limits, request sizes, the device's depth.

    Parameters
    ----------
    num_pages, page_size, max_seqs: the manager's pool and rows
    max_len: most tokens per request (prompt + generated)
    prompt_len: ``(lo, hi)`` prompt tokens
    max_new: ``(lo, hi)`` tokens generated per request
    vocab: tokens are drawn from ``0 .. vocab - 1`` (small: prompts share prefixes)
    namespaces: the tenants requests are spread over
    target_running: the fuzzer submits requests until this many are alive
    max_in_flight: steps an asynchronous engine keeps launched at once
    chunk: most prefill tokens per request per step; max_batch_tokens: per step
    tracker: ``"checking"`` or ``None`` (NoOpTracker: verify checks nothing)
    check_every: ``manager.check()`` and the full model comparison every this many moves
    weights: relative frequency of each move in random campaigns
    strict_commits: hold engines to "commit means the K/V landed" (see :class:`Timeline`)
    """

    DEFAULT_WEIGHTS: ClassVar[dict[str, float]] = {
        "submit": 6, "launch": 10, "complete": 10, "retire": 10, "finish": 10, "copy": 6,
        "transfer": 4,
        "abort": 2, "fork": 3, "preempt": 2, "resume": 3, "receive": 2, "clear": 0.3,
        "hook": 1, "inject": 2,
    }

    def __init__(self, num_pages: int = 48, page_size: int = 4, max_seqs: int = 10,
                 max_len: int = 64, prompt_len: tuple[int, int] = (1, 36),
                 max_new: tuple[int, int] = (1, 16), vocab: int = 3,
                 namespaces: Sequence[Any] = (None, "tenant-a", ("lora", 7)),
                 target_running: int = 8, max_in_flight: int = 2, chunk: int = 12,
                 max_batch_tokens: int = 64, tracker: str | None = "checking",
                 check_every: int = 64, weights: dict[str, float] | None = None,
                 strict_commits: bool = True) -> None:
        if prompt_len[0] < 1 or prompt_len[1] < prompt_len[0] or max_new[1] < max_new[0]:
            raise KVMemError(f"prompt_len {prompt_len} and max_new {max_new} must be (lo, hi) "
                             "ranges with lo <= hi and prompts of at least one token")
        if prompt_len[1] + max_new[1] > max_len:
            raise KVMemError(f"prompt_len[1] + max_new[1] = {prompt_len[1] + max_new[1]} "
                             f"exceeds max_len={max_len}; raise max_len")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.prompt_len = (int(prompt_len[0]), int(prompt_len[1]))
        self.max_new = (int(max_new[0]), int(max_new[1]))
        self.vocab = vocab
        self.namespaces = tuple(namespaces)
        self.target_running = target_running
        self.max_in_flight = max_in_flight
        self.chunk = chunk
        self.max_batch_tokens = max_batch_tokens
        self.tracker = tracker
        self.check_every = check_every
        self.weights = {**self.DEFAULT_WEIGHTS, **(weights or {})}
        self.strict_commits = strict_commits

    @property
    def max_requests(self) -> int:
        """Requests the model follows at once (alive ones, plus some finishing on the device)."""
        return 2 * self.target_running + 2 * self.max_seqs + 16

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_pages": self.num_pages, "page_size": self.page_size, "max_seqs": self.max_seqs,
            "max_len": self.max_len, "prompt_len": list(self.prompt_len),
            "max_new": list(self.max_new), "vocab": self.vocab,
            "namespaces": list(self.namespaces), "target_running": self.target_running,
            "max_in_flight": self.max_in_flight, "chunk": self.chunk,
            "max_batch_tokens": self.max_batch_tokens, "tracker": self.tracker,
            "check_every": self.check_every, "weights": dict(self.weights),
            "strict_commits": self.strict_commits,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FuzzConfig:
        d = dict(d)
        for key in ("prompt_len", "max_new"):
            if key in d:
                d[key] = tuple(d[key])
        if "namespaces" in d:
            d["namespaces"] = tuple(tuple(n) if isinstance(n, list) else n
                                    for n in d["namespaces"])
        return cls(**d)

    @classmethod
    def preset(cls, name: str) -> FuzzConfig:
        """``"small"`` (finds races fast: few pages, short requests, deep overlap) or
        ``"bench"`` (4,096 pages of 16 tokens, 64 requests running, the benchmark's setting)."""
        if name == "small":
            return cls()
        if name == "bench":
            return cls(num_pages=4096, page_size=16, max_seqs=96, max_len=640,
                       prompt_len=(32, 384), max_new=(64, 240), vocab=4, target_running=64,
                       max_in_flight=2, chunk=256, max_batch_tokens=768, check_every=2048,
                       weights={"submit": 3, "launch": 10, "complete": 10, "retire": 10,
                                "finish": 10,
                                "copy": 4, "transfer": 4, "abort": 0.4, "fork": 0.3,
                                "preempt": 0.2, "resume": 1, "receive": 0.3, "clear": 0.01,
                                "hook": 0.5})
        raise KVMemError(f"no fuzz config preset {name!r}; use 'small' or 'bench'")


class FuzzEngine:
    """Base class of an engine under test (see the module docstring for the protocol).

    Subclasses set ``manager`` and ``max_in_flight`` and implement :meth:`submit`,
    :meth:`abort`, :meth:`launch` and :meth:`finish`; the optional moves default to "not
    supported" (return False / None) and are only offered when named in ``capabilities``.

    Attributes
    ----------
    manager: the :class:`~kvmem.manager.KVCacheManager` the engine runs on
    max_in_flight: steps launched and not yet completed at most (0: a synchronous engine, whose
        every step completes, and is finished, within the move that launched it)
    capabilities: optional moves the engine supports: ``"fork"``, ``"preempt"``, ``"resume"``,
        ``"receive"``, ``"clear"``
    bugs: engine-side fault switches the adapter honours (see :mod:`kvmem.testing.faults`)
    stream_ordered: the engine runs its steps in launch order on one stream and relies on that
        order instead of step fences (vLLM): it frees and reuses pages while a step runs and
        commits a step's tokens when it schedules the step. The timeline then guards no step's
        pages (``happens_before``) and allows hits on unlanded writes (``landed_hit`` off, as
        with ``strict_commits=False``): every later step runs after the write; ``reads`` still
        sees a step read what it must not
    """

    name: ClassVar[str] = "engine"
    capabilities: ClassVar[frozenset[str]] = frozenset()
    stream_ordered: ClassVar[bool] = False
    manager: Any
    max_in_flight: int = 2

    def __init__(self) -> None:
        self.bugs: set[str] = set()

    def submit(self, spec: RequestSpec) -> None:
        raise NotImplementedError

    def abort(self, request_id: Any) -> None:
        raise NotImplementedError

    def launch(self, choice: int) -> Launch | None:
        raise NotImplementedError

    def retire(self, op: Launch) -> None:
        """The device finished ``op``: retire the fence that covers it (default: none)."""

    def finish(self, op: Launch) -> Sequence[Any]:
        raise NotImplementedError

    def fork(self, choice: int,
             make_child: Callable[[Any, int], RequestSpec | None]) -> bool:
        return False

    def preempt(self, choice: int) -> bool:
        return False

    def resume(self, choice: int) -> bool:
        return False

    def receive(self, spec: RequestSpec) -> Launch | None:
        return None

    def clear_cache(self) -> bool:
        return False

    def check(self) -> None:
        """Engine-specific checks, run with the timeline's full check."""


def stable_pick(choice: int, keys: Sequence[Any]) -> int:
    """The index of the key that ``choice`` picks, by rendezvous hashing: the pick does not
    change when other keys come or go (so deleting an unrelated move while shrinking does not
    change what a later move does)."""
    head = zlib.crc32(f"{choice}:".encode())  # (crc32 of f"{choice}:{k}", the head once)
    best, best_i = -1, -1
    for i, k in enumerate(keys):
        h = zlib.crc32(f"{k}".encode(), head)
        if h > best:
            best, best_i = h, i
    return best_i


def stable_bit(choice: int, key: Any) -> bool:
    """A coin that ``choice`` flips for ``key`` (the same whatever else exists)."""
    return bool(zlib.crc32(f"{choice}/{key}".encode()) & 1)


def subset_step(step: Any, keep: npt.NDArray[np.bool_]) -> tuple[Int64Array, ...]:
    """The CSR, slot mapping and counts of a reserved step for the requests ``keep`` selects:
    ``(kv_indptr, kv_indices, slot_mapping, num_new_tokens)``."""
    counts = np.diff(step.kv_indptr)
    indptr = np.zeros(int(np.count_nonzero(keep)) + 1, dtype=np.int64)
    np.cumsum(counts[keep], out=indptr[1:])
    indices = step.kv_indices[np.repeat(keep, counts)]
    nn = step.num_new_tokens
    slots = step.slot_mapping[np.repeat(keep, nn)]
    return indptr, indices, slots, nn[keep].astype(np.int64)


class _SlotEngine(FuzzEngine):
    """Per-request bookkeeping in numpy arrays indexed by a slot (shared by the adapters)."""

    def __init__(self, config: FuzzConfig, manager: Any) -> None:
        super().__init__()
        self.config = config
        self.manager = manager
        n = config.max_requests
        self.tok = np.zeros((n, config.max_len), dtype=np.int64)
        self.sched = np.zeros(n, dtype=np.int64)  # positions handed out (reserved)
        self.comm = np.zeros(n, dtype=np.int64)  # positions committed
        self.plen = np.zeros(n, dtype=np.int64)  # prompt (what is prefilled) length
        self.mlen = np.zeros(n, dtype=np.int64)
        self.inc = np.zeros(n, dtype=np.int64)  # incarnation: bumped by preempt / resume
        self.busy = np.zeros(n, dtype=np.int64)  # ops in flight listing the request
        self.state = np.zeros(n, dtype=np.int64)
        self.ids: list[Any] = [None] * n
        self.specs: list[RequestSpec | None] = [None] * n
        self.slot_of: dict[Any, int] = {}
        self._free = list(range(n - 1, -1, -1))
        self.order: list[int] = []  # running / receiving slots, by admission
        self._order_arr: Int64Array | None = None
        self.waiting: deque[int] = deque()
        self.ops: dict[Launch, tuple[Any, Int64Array, Int64Array]] = {}
        self._last_batch: tuple[Int64Array, tuple[Any, ...], int] | None = None
        self._slots_epoch = 0  # bumped whenever a slot changes hands
        self.handles: dict[Launch, Any] = {}  # the step handle of each op with a fence

    # -- slots ------------------------------------------------------------------------------------

    def _new_slot(self, spec: RequestSpec) -> int:
        if not self._free:
            raise KVMemError(f"{self.name} follows {len(self.slot_of)} requests, its limit")
        s = self._free.pop()
        self._slots_epoch += 1
        self.tok[s, : spec.max_len] = spec.tokens
        self.sched[s] = self.comm[s] = self.busy[s] = 0
        self.plen[s] = spec.prompt_len
        self.mlen[s] = spec.max_len
        self.inc[s] += 1
        self.ids[s] = spec.request_id
        self.specs[s] = spec
        self.slot_of[spec.request_id] = s
        return s

    def _drop_slot(self, s: int) -> None:
        """The request is gone for the engine; the slot is reused once no op lists it."""
        if self.state[s] in (_RUNNING, _RECEIVING):
            self.order.remove(s)
            self._order_arr = None
        self.state[s] = _GONE
        self.inc[s] += 1
        rid = self.ids[s]
        if self.slot_of.get(rid) == s:
            del self.slot_of[rid]
        if self.busy[s] == 0:
            self._free.append(s)

    def _start_running(self, s: int) -> None:
        self.state[s] = _RUNNING
        self.order.append(s)
        self._order_arr = None

    def _order(self) -> Int64Array:
        if self._order_arr is None:
            self._order_arr = np.array(self.order, dtype=np.int64)
        return self._order_arr

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call the manager; a HookError means the operation completed (the hook failed)."""
        try:
            return fn(*args)
        except HookError:
            if "hook_error_retried" in self.bugs and fn.__name__.startswith("release"):
                return fn(*args)  # the engine thinks the release failed and does it again
            return None

    def _pick(self, state: int, choice: int, idle: bool = False) -> int | None:
        """A request in ``state`` (the ``choice``-th, deterministically); ``idle``: only one that
        no op in flight lists and whose reserved tokens are all committed."""
        if state == _PREEMPTED:
            cand = [s for s in self.slot_of.values() if self.state[s] == state]
        else:
            cand = [s for s in self.order if self.state[s] == state]
        if idle:
            cand = [s for s in cand if self.busy[s] == 0 and self.comm[s] == self.sched[s]]
        return cand[stable_pick(choice, [self.ids[s] for s in cand])] if cand else None

    def _batch(self, choice: int) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The next step's requests (slots), their first positions and token counts.

        Like SGLang's scheduler, a step is a prefill step (requests with prompt left, a chunk
        each, within ``max_batch_tokens``) or a decode step (every request past its prompt,
        one token); ``choice`` picks which when both have candidates, now and then a mixed
        step (vLLM's), and now and then only some of the candidates."""
        order = self._order()
        if not order.size:
            return order, order, order
        slots = order[(self.state[order] == _RUNNING) & (self.sched[order] < self.mlen[order])]
        if not slots.size:
            return slots, slots, slots
        sched = self.sched[slots]
        rem = self.plen[slots] - sched
        prefill = rem > 0
        mode = choice % 16
        kind = 0  # 1: prefill only, -1: decode only, 0: both
        if mode != 5:  # 5: a mixed step
            num_prefill = int(np.count_nonzero(prefill))
            use_prefill = num_prefill > 0 and (mode % 4 != 0 or num_prefill == prefill.size)
            if 0 < num_prefill < prefill.size:
                keep = prefill if use_prefill else ~prefill
                slots, sched, rem = slots[keep], sched[keep], rem[keep]
            kind = 1 if use_prefill else -1
        if (choice >> 4) % 8 == 0 and slots.size > 1:  # now and then a partial batch
            # stable_bit(choice, id) for each id, the shared prefix hashed once
            head = zlib.crc32(f"{choice}/".encode())
            ids = self.ids
            keep = np.array([zlib.crc32(f"{ids[s]}".encode(), head) & 1
                             for s in slots.tolist()], dtype=bool)
            if np.count_nonzero(keep):
                slots, sched, rem = slots[keep], sched[keep], rem[keep]
        if kind < 0:
            n = np.ones(slots.size, dtype=np.int64)
        elif kind > 0:
            n = np.minimum(rem, self.config.chunk)
        else:
            n = np.where(rem > 0, np.minimum(rem, self.config.chunk), 1)
        budget = self.config.max_batch_tokens
        if (n.size if kind < 0 else int(n.sum())) > budget:
            over = np.cumsum(n) > budget
            if over[0]:
                n[0] = budget
                over[0] = False
            slots, sched, n = slots[~over], sched[~over], n[~over]
        return slots, sched, n

    def _ids(self, slots: Int64Array) -> tuple[Any, ...]:
        """The request ids of ``slots`` (the previous tuple when the batch is the same: the
        manager recognizes a batch it has seen by its ids)."""
        last = self._last_batch
        if (last is not None and last[2] == self._slots_epoch and last[0].shape == slots.shape
                and not np.count_nonzero(last[0] != slots)):
            return last[1]
        ids = tuple(map(self.ids.__getitem__, slots.tolist()))
        self._last_batch = (slots, ids, self._slots_epoch)
        return ids

    def _release_ops(self, slots: Int64Array) -> None:
        """An op that listed these slots is done: gone requests' slots become reusable."""
        self.busy[slots] -= 1
        for s in slots[(self.state[slots] == _GONE) & (self.busy[slots] == 0)].tolist():
            self._free.append(s)

    def _finish_done(self, slots: Int64Array) -> list[Any]:
        """Release the requests among ``slots`` whose every position is committed."""
        done = slots[self.comm[slots] >= self.mlen[slots]]
        finished = [self.ids[s] for s in done.tolist()]
        if finished:
            self._release(finished)
            for s in done.tolist():
                self._drop_slot(s)
        return finished

    def _release(self, ids: list[Any]) -> None:
        self._call(self.manager.release_batch, ids)

    # -- admission --------------------------------------------------------------------------------

    def submit(self, spec: RequestSpec) -> None:
        s = self._new_slot(spec)
        self.state[s] = _WAITING
        self.waiting.append(s)
        self._admit_waiting()

    def _namespace(self, spec: RequestSpec) -> Any:
        return None if "namespace_dropped" in self.bugs else spec.namespace

    def _admit_waiting(self) -> None:
        mgr = self.manager
        while self.waiting:
            s = self.waiting[0]
            spec = self.specs[s]
            assert spec is not None
            prompt = spec.prompt
            ns = self._namespace(spec)
            if not mgr.can_admit(prompt, ns):
                return
            self.waiting.popleft()
            res = self._call(mgr.admit, spec.request_id, prompt, ns)
            cached = res.num_cached_tokens if res is not None else mgr.num_tokens(
                spec.request_id)
            self.sched[s] = self.comm[s] = cached
            self._start_running(s)


class ManagerEngine(_SlotEngine):
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

    def __init__(self, config: FuzzConfig) -> None:
        from kvmem.manager import KVCacheManager

        mgr = KVCacheManager(
            config.num_pages, page_size=config.page_size, max_seqs=config.max_seqs,
            max_pages_per_seq=-(-config.max_len // config.page_size) + 1,
            tracker=config.tracker, watermark=0.0,
        )
        super().__init__(config, mgr)
        self.max_in_flight = config.max_in_flight
        self._bt: npt.NDArray[np.int32] | None = None  # block-table buffer (stale_block_table)

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
            indptr, indices, slot_mapping, _ = subset_step(step, keep)
            ids = tuple(i for i, k in zip(ids, keep.tolist()) if k)
        else:
            indptr, indices, slot_mapping = step.kv_indptr, step.kv_indices, step.slot_mapping
        copy_src, copy_dst = step.copy_src, step.copy_dst
        if not slots.size and not copy_src.size:
            return None
        handle = mgr.begin_step()
        if "retire_at_launch" in self.bugs:
            self._call(mgr.retire, handle)
        if "skip_cow_copy" in self.bugs:
            copy_src = copy_dst = np.empty(0, dtype=np.int32)
        op = Launch(ids, sched, n, indptr, indices, slot_mapping, copy_src, copy_dst,
                    fence=handle.step_id, held_sources=step.copy_src)
        self.sched[slots] = sched + n
        self.busy[slots] += 1
        self.ops[op] = (handle, slots, self.inc[slots])  # (fancy indexing copies)
        self.handles[op] = handle
        if "commit_at_launch" in self.bugs:
            self._commit(slots, sched, n)
        return op

    def _verify(self, ids: tuple[Any, ...], step: Any) -> Any:
        mgr = self.manager
        if not mgr.tracker.enabled:
            return None
        if "stale_block_table" in self.bugs:
            return mgr.verify(ids, metadata=self._block_table_metadata(step))
        if "wrong_chunk_slice" in self.bugs:
            return mgr.verify(ids, metadata=self._shifted_metadata(step))
        return mgr.verify(ids, step)

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
            if self.state[s] == _RUNNING:
                self._preempt_slot(s)
                return s
        return None

    def _preempt_slot(self, s: int) -> None:
        self._call(self.manager.preempt, self.ids[s])
        self.order.remove(s)
        self._order_arr = None
        self.state[s] = _PREEMPTED
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
        live = (self.inc[slots] == incs) & ((st == _RUNNING) | (st == _RECEIVING))
        ids: Sequence[Any] | None = None
        if np.count_nonzero(live) == live.size:  # (the usual case: nothing gone, all commit)
            starts, n, ids = op.starts, op.num_new, op.request_ids
        else:
            # (_release_ops, with the states at hand: gone requests' slots become reusable)
            for s in slots[(st == _GONE) & (self.busy[slots] == 0)].tolist():
                self._free.append(s)
            slots, starts, n = slots[live], op.starts[live], op.num_new[live]
        if "commit_at_launch" not in self.bugs or op.kind == "transfer":
            self._commit(slots, starts, n, ids)
        if op.kind == "transfer":
            self.state[slots] = _RUNNING
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
        if state == _WAITING:
            self.waiting.remove(s)
        elif "leak_on_abort" in self.bugs and state == _RUNNING:
            pass  # the engine forgets the request but never tells kvmem
        else:
            if "commit_on_abort" in self.bugs and state == _RUNNING and (
                    self.sched[s] > self.comm[s]):
                # Commits what was scheduled, landed or not (BUGS.md 8).
                self.manager.commit(request_id, self.tok[s, self.comm[s] : self.sched[s]])
            self._call(self.manager.release, request_id)
        self._drop_slot(s)

    def fork(self, choice: int,
             make_child: Callable[[Any, int], RequestSpec | None]) -> bool:
        p = self._pick(_RUNNING, choice, idle=True)
        if p is None or self.manager.table.num_free_rows == 0:
            return False
        parent = self.ids[p]
        # The child shares what the parent computed and the parent's prompt (kvmem's fork).
        child = make_child(parent, int(max(self.sched[p], self.plen[p])))
        if child is None:
            return False
        try:
            self._call(self.manager.fork, parent, child.request_id)
        except OutOfPagesError:
            return False
        s = self._new_slot(child)
        self.sched[s] = self.sched[p]
        self.comm[s] = self.comm[p]
        self.plen[s] = self.plen[p]
        self._start_running(s)
        return True

    def preempt(self, choice: int) -> bool:
        s = self._pick(_RUNNING, choice)
        if s is None:
            return False
        self._preempt_slot(s)
        return True

    def resume(self, choice: int) -> bool:
        s = self._pick(_PREEMPTED, choice)
        if s is None:
            return False
        rid = self.ids[s]
        mgr = self.manager
        if not mgr.can_resume(rid):
            return False
        res = self._call(mgr.resume, rid)
        # The resumed request's prompt is what the manager kept: its committed tokens, then
        # the rest of its prompt (num_prompt_tokens, or the same worked out here when a hook
        # failed and took the result with it).
        self.plen[s] = (res.num_prompt_tokens if res is not None
                        else max(int(self.comm[s]), int(self.plen[s])))
        cached = res.num_cached_tokens if res is not None else mgr.num_tokens(rid)
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
        res = self._call(mgr.admit, spec.request_id, spec.prompt, ns)
        cached = res.num_cached_tokens if res is not None else mgr.num_tokens(spec.request_id)
        n = spec.prompt_len - cached
        step = mgr.reserve((spec.request_id,), n)
        fence = None
        handle = None
        if "no_transfer_fence" not in self.bugs:
            handle = mgr.begin_step()
            fence = handle.step_id
        self.sched[s] = spec.prompt_len
        self.comm[s] = cached
        self._start_running(s)
        self.state[s] = _RECEIVING
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


class ToyEngineAdapter(_SlotEngine):
    """:class:`~kvmem.testing.ToyEngine`, a synchronous engine, under the fuzzer.

    The toy engine writes each step's K/V into its own numpy pool as it reserves it and commits
    at once, so its steps complete within the move that launches them (``max_in_flight = 0``);
    the fuzzer still interleaves admissions, forks, preemptions, resumes, aborts and cache
    clears in any order, and the engine's own ``check_kv`` runs with the full check. (It does
    not survive failing hooks: its bookkeeping follows the manager's return values.)
    """

    name: ClassVar[str] = "toy"
    capabilities: ClassVar[frozenset[str]] = frozenset({"fork", "preempt", "resume", "clear"})

    def __init__(self, config: FuzzConfig) -> None:
        from kvmem.manager import KVCacheManager
        from kvmem.testing._toy_engine import ToyEngine

        mgr = KVCacheManager(
            config.num_pages, page_size=config.page_size, max_seqs=config.max_seqs,
            max_pages_per_seq=-(-config.max_len // config.page_size) + 1,
            tracker=config.tracker, watermark=0.0,
        )
        super().__init__(config, mgr)
        self.max_in_flight = 0
        self.toy = ToyEngine(mgr, sampler=self._sample)

    def _sample(self, request_id: Any, position: int) -> int:
        return int(self.tok[self.slot_of[request_id], position])

    def _admit_waiting(self) -> None:
        while self.waiting:
            s = self.waiting[0]
            spec = self.specs[s]
            assert spec is not None
            ns = self._namespace(spec)
            if not self.manager.can_admit(spec.prompt, ns):
                return
            self.waiting.popleft()
            res = self.toy.admit(spec.request_id, spec.prompt.tolist(), ns)
            self.sched[s] = self.comm[s] = res.num_cached_tokens
            self._start_running(s)

    def launch(self, choice: int) -> Launch | None:
        self._admit_waiting()
        slots, sched, n = self._batch(choice)
        if not slots.size:
            return None
        while True:
            ids = [self.ids[s] for s in slots.tolist()]
            try:
                step = self.toy.step(ids, n.tolist())
                break
            except OutOfPagesError:
                if not self.order:
                    return None
                victim = self.order[-1]
                self._preempt_slot(victim)
                keep = slots != victim
                slots, sched, n = slots[keep], sched[keep], n[keep]
                if not slots.size:
                    return None
        indptr: npt.NDArray[Any] = step.kv_indptr
        indices: npt.NDArray[Any] = step.kv_indices
        slot_mapping: npt.NDArray[Any] = step.slot_mapping
        if self.manager.tracker.enabled:
            report = self.manager.verify(ids, step)
            if report.aborted:
                keep = report.keep
                for s in slots[~keep].tolist():
                    self.toy.abort(self.ids[s])
                    self._drop_slot(s)
                slots, sched, n = slots[keep], sched[keep], n[keep]
                indptr, indices, slot_mapping, _ = subset_step(step, keep)
                ids = [i for i, k in zip(ids, keep.tolist()) if k]
        copy_src, copy_dst = step.copy_src, step.copy_dst
        if "skip_cow_copy" in self.bugs:
            copy_src = copy_dst = np.empty(0, dtype=np.int32)
        op = Launch(tuple(ids), sched, n, indptr, indices, slot_mapping, copy_src, copy_dst,
                    held_sources=step.copy_src)
        self.sched[slots] = sched + n
        self.toy.commit(ids)
        self.comm[slots] = sched + n
        self.busy[slots] += 1
        self.ops[op] = (None, slots, self.inc[slots].copy())
        return op

    def finish(self, op: Launch) -> Sequence[Any]:
        _, slots, incs = self.ops.pop(op)
        self._release_ops(slots)
        slots = slots[(self.inc[slots] == incs) & (self.state[slots] == _RUNNING)]
        return self._finish_done(slots)

    def _release(self, ids: list[Any]) -> None:
        for rid in ids:
            self.toy.release(rid)

    def _preempt_slot(self, s: int) -> None:
        self.toy.preempt(self.ids[s])
        self.order.remove(s)
        self._order_arr = None
        self.state[s] = _PREEMPTED
        self.inc[s] += 1

    def abort(self, request_id: Any) -> None:
        s = self.slot_of.get(request_id)
        if s is None:
            return
        if self.state[s] == _WAITING:
            self.waiting.remove(s)
        elif "leak_on_abort" in self.bugs and self.state[s] == _RUNNING:
            self.toy.abort(request_id)  # forgotten by the engine, never released in kvmem
        else:
            self.toy.release(request_id)
        self._drop_slot(s)

    def fork(self, choice: int,
             make_child: Callable[[Any, int], RequestSpec | None]) -> bool:
        p = self._pick(_RUNNING, choice, idle=True)
        if p is None or self.manager.table.num_free_rows == 0:
            return False
        parent = self.ids[p]
        child = make_child(parent, int(max(self.sched[p], self.plen[p])))
        if child is None or not self._free:
            return False
        try:
            self.toy.fork(parent, child.request_id)
        except OutOfPagesError:
            return False
        s = self._new_slot(child)
        self.sched[s] = self.sched[p]
        self.comm[s] = self.comm[p]
        self.plen[s] = self.plen[p]
        self._start_running(s)
        return True

    def preempt(self, choice: int) -> bool:
        s = self._pick(_RUNNING, choice)
        if s is None:
            return False
        self._preempt_slot(s)
        return True

    def resume(self, choice: int) -> bool:
        s = self._pick(_PREEMPTED, choice)
        if s is None or not self.manager.can_resume(self.ids[s]):
            return False
        res = self.toy.resume(self.ids[s])
        self.sched[s] = self.comm[s] = res.num_cached_tokens
        self.plen[s] = res.num_prompt_tokens
        self.inc[s] += 1
        self._start_running(s)
        return True

    def clear_cache(self) -> bool:
        self.manager.clear_prefix_cache()
        return True

    def check(self) -> None:
        try:
            self.toy.check_kv()
        except AssertionError as e:
            raise FuzzFailure("engine", f"ToyEngine.check_kv: {e}") from None


ENGINES: dict[str, Callable[[FuzzConfig], FuzzEngine]] = {
    "manager": ManagerEngine,
    "toy": ToyEngineAdapter,
}


def make_engine(name: str, config: FuzzConfig) -> FuzzEngine:
    """An engine adapter by name (``kvmem.testing.ENGINES`` lists them; add yours there)."""
    factory = ENGINES.get(name)
    if factory is None:
        raise KVMemError(f"no fuzz engine {name!r}; choose one of {sorted(ENGINES)} (register "
                         "yours in kvmem.testing.ENGINES)")
    return factory(config)
