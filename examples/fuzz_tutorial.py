"""Fuzz a made-up engine: write its adapter, find the planted race, check the fix.

MiniServe is an engine on kvmem with a scheduler of its own (first come first served, the whole
prompt prefilled in one step, then one token per step). Its authors turned on overlap
scheduling (step n + 1 is scheduled while step n runs) and forgot that kvmem must be told which
steps are in flight. ``MiniServeAdapter`` (under 100 lines with MiniServe itself) lets the
fuzzer drive it; ``kvmem.testing.hunt`` finds the race in a few moves and shrinks it. See
``docs/fuzzing.md``. Runs in seconds on a CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmem.errors import OutOfPagesError
from kvmem.manager import KVCacheManager
from kvmem.testing import FuzzConfig, FuzzEngine, Launch, RequestSpec, campaign, hunt

# -- the engine (not kvmem's: any engine that embeds a KVCacheManager) ---------------------------


@dataclass
class Batch:
    ids: list[Any]
    starts: list[int]
    counts: list[int]
    step: Any  # the StepMetadata kvmem returned
    fence: Any  # the StepHandle, or None


class MiniServe:
    def __init__(self, num_pages: int, page_size: int, fenced: bool) -> None:
        self.kv = KVCacheManager(num_pages, page_size, max_seqs=8, tracker="checking",
                                 watermark=0.0)
        self.fenced = fenced  # the fix: a step fence while each step runs
        self.waiting: deque[Any] = deque()
        self.reqs: dict[Any, list[Any]] = {}  # id -> [tokens, scheduled, prompt_len, tenant]

    def add_request(self, rid: Any, tokens: np.ndarray, prompt_len: int, tenant: Any) -> None:
        self.reqs[rid] = [tokens, 0, prompt_len, tenant]
        self.waiting.append(rid)

    def cancel(self, rid: Any) -> None:
        if rid in self.waiting:
            self.waiting.remove(rid)
        else:
            self.kv.release(rid)
        del self.reqs[rid]

    def schedule(self) -> Batch | None:
        while self.waiting:
            tokens, _, plen, tenant = self.reqs[self.waiting[0]]
            if not self.kv.can_admit(tokens[:plen], tenant):
                break
            rid = self.waiting.popleft()
            self.reqs[rid][1] = self.kv.admit(rid, tokens[:plen], tenant).num_cached_tokens
        ids = [r for r in self.kv.running if self.reqs[r][1] < len(self.reqs[r][0])]
        if not ids:
            return None
        starts = [self.reqs[r][1] for r in ids]
        counts = [max(self.reqs[r][2] - self.reqs[r][1], 1) for r in ids]
        try:
            step = self.kv.reserve(ids, counts)
        except OutOfPagesError:
            return None
        self.kv.verify(ids, step)
        for r, n in zip(ids, counts):
            self.reqs[r][1] += n
        return Batch(ids, starts, counts, step, self.kv.begin_step() if self.fenced else None)

    def device_finished(self, fence: Any) -> None:
        if fence is not None:
            self.kv.retire(fence)

    def process_outputs(self, batch: Batch) -> list[Any]:
        done = []
        for rid, start, n in zip(batch.ids, batch.starts, batch.counts):
            if rid in self.reqs and rid in self.kv.running:
                tokens = self.reqs[rid][0]
                self.kv.commit(rid, tokens[start : start + n])
                if start + n == len(tokens):
                    self.kv.release(rid)
                    del self.reqs[rid]
                    done.append(rid)
        return done


# -- the adapter: what the fuzzer calls, what it sees --------------------------------------------


class MiniServeAdapter(FuzzEngine):
    name = "miniserve"
    fenced = False

    def __init__(self, config: FuzzConfig) -> None:
        super().__init__()
        self.engine = MiniServe(config.num_pages, config.page_size, self.fenced)
        self.manager = self.engine.kv
        self.max_in_flight = 2  # overlap scheduling
        self.batches: dict[Launch, Batch] = {}
        self.fences: dict[Launch, Any] = {}

    def submit(self, spec: RequestSpec) -> None:
        self.engine.add_request(spec.request_id, spec.tokens, spec.prompt_len, spec.namespace)

    def abort(self, request_id: Any) -> None:
        if request_id in self.engine.reqs:
            self.engine.cancel(request_id)

    def launch(self, choice: int) -> Launch | None:
        batch = self.engine.schedule()
        if batch is None:
            return None
        s = batch.step
        op = Launch(batch.ids, batch.starts, batch.counts, s.kv_indptr, s.kv_indices,
                    s.slot_mapping, s.copy_src, s.copy_dst,
                    fence=None if batch.fence is None else batch.fence.step_id)
        self.batches[op] = batch
        self.fences[op] = batch.fence
        return op

    def retire(self, op: Launch) -> None:
        self.engine.device_finished(self.fences.pop(op))

    def finish(self, op: Launch) -> Sequence[Any]:
        return self.engine.process_outputs(self.batches.pop(op))


class FixedMiniServeAdapter(MiniServeAdapter):
    fenced = True


def main() -> None:
    found = hunt(None, MiniServeAdapter, "small", max_campaigns=20, shrink_replays=300)
    assert found.detected, "the planted race was not found"
    print(f"MiniServe: {found.detected_by} after {found.moves} moves; shrunk to "
          f"{found.schedule_len} moves: {found.schedule}")
    print(f"  {found.message}")
    clean = campaign(FixedMiniServeAdapter, "small", None, seed=0, max_moves=3000)
    assert clean.failure is None, clean.failure
    print(f"MiniServe with step fences: {clean.moves} moves, no oracle fired")


if __name__ == "__main__":
    main()
