"""The toy engine (:class:`~kvmem.testing.ToyEngine`, synchronous) under the fuzzer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvmem.errors import OutOfPagesError
from kvmem.testing._fuzz_protocol import FuzzConfig, subset_step
from kvmem.testing._fuzz_slots import PREEMPTED, RUNNING, WAITING, SlotEngine
from kvmem.testing._launch import Launch
from kvmem.testing._oracles import FuzzFailure

__all__ = ["ToyEngineAdapter"]

Int64Array = npt.NDArray[np.int64]


class ToyEngineAdapter(SlotEngine):
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
        from kvmem.testing._toy import ToyEngine

        mgr = self.new_manager(config)
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
        slots = slots[(self.inc[slots] == incs) & (self.state[slots] == RUNNING)]
        return self._finish_done(slots)

    def _release(self, ids: list[Any]) -> None:
        for rid in ids:
            self.toy.release(rid)

    def _preempt_slot(self, s: int) -> None:
        self.toy.preempt(self.ids[s])
        self.order.remove(s)
        self._order_arr = None
        self.state[s] = PREEMPTED
        self.inc[s] += 1

    def abort(self, request_id: Any) -> None:
        s = self.slot_of.get(request_id)
        if s is None:
            return
        if self.state[s] == WAITING:
            self.waiting.remove(s)
        elif "leak_on_abort" in self.bugs and self.state[s] == RUNNING:
            self.toy.abort(request_id)  # forgotten by the engine, never released in kvmem
        else:
            self.toy.release(request_id)
        self._drop_slot(s)

    def _fork_room(self) -> bool:
        return bool(self._free)

    def _fork(self, parent: Any, child: Any) -> None:
        self.toy.fork(parent, child)

    def resume(self, choice: int) -> bool:
        s = self._pick(PREEMPTED, choice)
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
