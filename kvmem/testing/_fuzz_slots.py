"""The adapters' shared base: per-request bookkeeping in numpy arrays indexed by a slot."""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import HookError, KVMemError, OutOfPagesError
from kvmem.testing._fuzz_protocol import FuzzConfig, FuzzEngine, stable_pick
from kvmem.testing._launch import Launch, RequestSpec
from kvmem.testing._value_oracles import ValueOracles

__all__ = ["GONE", "PREEMPTED", "RECEIVING", "RUNNING", "WAITING", "SlotEngine"]

Int64Array = npt.NDArray[np.int64]

# Request states in the adapters.
GONE, WAITING, RUNNING, PREEMPTED, RECEIVING = 0, 1, 2, 3, 4


class SlotEngine(FuzzEngine):
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
        # what the manager must answer (admission, step metadata, request state, stats)
        self.values = ValueOracles(manager, n, config.max_len)

    # -- slots ------------------------------------------------------------------------------------

    @staticmethod
    def new_manager(config: FuzzConfig) -> Any:
        """The manager a fuzzed engine runs on: ``config``'s pool, rows and tracker, room for
        ``max_len`` tokens a request, no admission watermark."""
        from kvmem.manager import KVCacheManager

        return KVCacheManager(
            config.num_pages, page_size=config.page_size, max_seqs=config.max_seqs,
            max_pages_per_seq=-(-config.max_len // config.page_size) + 1,
            tracker=config.tracker, watermark=0.0,
        )

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
        if self.state[s] in (RUNNING, RECEIVING):
            self.order.remove(s)
            self._order_arr = None
        self.state[s] = GONE
        self.inc[s] += 1
        rid = self.ids[s]
        if self.slot_of.get(rid) == s:
            del self.slot_of[rid]
        if self.busy[s] == 0:
            self._free.append(s)

    def _start_running(self, s: int) -> None:
        self.state[s] = RUNNING
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

    def fork(self, choice: int,
             make_child: Callable[[Any, int], RequestSpec | None]) -> bool:
        p = self._pick(RUNNING, choice, idle=True)
        if p is None or self.manager.table.num_free_rows == 0:
            return False
        parent = self.ids[p]
        # The child shares what the parent computed and the parent's prompt (kvmem's fork).
        child = make_child(parent, int(max(self.sched[p], self.plen[p])))
        if child is None or not self._fork_room():
            return False
        try:
            self._fork(parent, child.request_id)
        except OutOfPagesError:
            return False
        s = self._new_slot(child)
        self.values.note_fork(s, child.request_id)
        self.sched[s] = self.sched[p]
        self.comm[s] = self.comm[p]
        self.plen[s] = self.plen[p]
        self._start_running(s)
        return True

    def _fork_room(self) -> bool:
        """Whether the engine has room for a forked request (asked after ``make_child``)."""
        return True

    def _fork(self, parent: Any, child: Any) -> None:
        raise NotImplementedError

    def preempt(self, choice: int) -> bool:
        s = self._pick(RUNNING, choice)
        if s is None:
            return False
        self._preempt_slot(s)
        return True

    def _preempt_slot(self, s: int) -> None:
        raise NotImplementedError

    def _pick(self, state: int, choice: int, idle: bool = False) -> int | None:
        """A request in ``state`` (the ``choice``-th, deterministically); ``idle``: only one that
        no op in flight lists and whose reserved tokens are all committed."""
        if state == PREEMPTED:
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
        slots = order[(self.state[order] == RUNNING) & (self.sched[order] < self.mlen[order])]
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
        for s in slots[(self.state[slots] == GONE) & (self.busy[slots] == 0)].tolist():
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
        self.state[s] = WAITING
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
            match = self.values.lookup(prompt, ns)
            res = self._call(mgr.admit, spec.request_id, prompt, ns)
            cached = self.values.admitted(s, spec.request_id, prompt, match, res)
            self.sched[s] = self.comm[s] = cached
            self._start_running(s)
            self._admitted(s)

    def _admitted(self, s: int) -> None:
        """Slot ``s`` was just admitted (an engine that must wait for something overrides)."""
