"""A hypothesis state machine over KVCacheManager, checked against a reference model.

Rules admit requests whose prompts share prefixes across a few namespaces, reserve (decode and
chunks), commit, verify, fork, preempt, resume, release, begin and retire steps, and clear the
prefix cache, in any interleaving, with few enough pages that eviction and OutOfPagesError
happen. After every rule:

* ``manager.check()``: refcounts equal holders, conservation, namespace of every mapped page;
* ``stats()``: free + used + cached + fenced == total;
* no page is mapped by requests of two namespaces;
* no page mapped when a step began changes lifetime (tag) before that step retires;
* every running request reads, through its pages, exactly the KV its own tokens imply
  (:class:`ToyEngine`): no wrong hit, no missed copy-on-write, no reuse under a reader;
* a prefix hit is exactly the longest committed prefix in the same namespace while nothing
  was evicted (and never more than that afterwards);
* ``can_admit`` is truthful (watermark 0): it is True exactly when ``admit`` succeeds;
* ``verify`` never aborts anything.

Subclass and override :meth:`ManagerMachine.make_manager` to run the same checks over your own
:class:`~kvmem.allocator._prefix_cache.PrefixCache` or tracker. Needs ``hypothesis``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmem._validate import integer
from kvmem.errors import KVMemError, OutOfPagesError
from kvmem.manager import KVCacheManager, StepMetadata
from kvmem.testing._toy import ToyEngine

__all__ = ["NAMESPACES", "ManagerMachine", "prompts"]

NAMESPACES = (None, "tenant-a", ("lora", 7))
# A few stems so that prompts share prefixes (tokens 0..3 only: collisions are frequent).
_STEMS = ((1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0), (1, 2, 3, 0, 3, 3, 3, 3), (2,) * 12)


@st.composite
def prompts(draw: st.DrawFn, max_len: int = 20) -> list[int]:
    """A prompt of 1 .. ``max_len`` tokens: a prefix of a shared stem, then its own tokens."""
    integer(max_len, "max_len", minimum=1)
    stem = draw(st.sampled_from(_STEMS))
    head = list(stem[: draw(st.integers(0, min(len(stem), max_len)))])
    tail = draw(st.lists(st.integers(0, 3), max_size=max(0, max_len - len(head))))
    return (head + tail) or [0]


def _verify_args(step: StepMetadata, form: str) -> dict[str, Any]:
    """``verify`` keyword arguments that pass ``step``'s metadata in one of its forms."""
    if form == "step":
        return {"step": step}
    if form == "csr":
        return {"kv_indptr": step.kv_indptr, "kv_indices": step.kv_indices}
    if form == "numpy":
        return {"metadata": step.fields()}
    if form == "tensors":
        return {"metadata": step.tensors("cpu")}
    return {"metadata": {"block_table": step.block_table, "slot_mapping": step.slot_mapping,
                         "seq_lens": step.seq_lens}}


class ManagerMachine(RuleBasedStateMachine):
    """Drives a small KVCacheManager through a :class:`ToyEngine` (see the module docstring)."""

    num_pages = 24
    page_size = 4
    max_seqs = 6
    max_pages_per_seq = 8

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(
            num_pages=self.num_pages, page_size=self.page_size, max_seqs=self.max_seqs,
            max_pages_per_seq=self.max_pages_per_seq, tracker="paranoid", watermark=0.0,
        )

    def __init__(self) -> None:
        super().__init__()
        self.mgr = self.make_manager()
        self.engine = ToyEngine(self.mgr)
        self.next_id = 0
        self.steps: dict[Any, dict[int, int]] = {}  # open step -> {page: tag} mapped at begin
        # Reference model of the prefix cache while nothing is evicted: committed full pages,
        # as (namespace, token prefix up to the page's end).
        self.committed_prefixes: set[tuple[Any, tuple[int, ...]]] = set()
        self.prefixes_exact = True

    # -- helpers -----------------------------------------------------------------------------

    def _running(self) -> list[Any]:
        return list(self.mgr.running)

    def _note_commits(self, ids: list[Any], before: dict[Any, int]) -> None:
        """Model the pages that just became full (only those are offered to the cache)."""
        p = self.page_size
        for rid in ids:
            seq = self.engine.seqs[rid]
            for end in range((before[rid] // p + 1) * p, seq.committed + 1, p):
                self.committed_prefixes.add((seq.namespace, tuple(seq.tokens[:end])))

    def _expected_hit(self, prompt: list[int], namespace: Any) -> int:
        p = self.page_size
        k = 0
        while (k + 1) * p <= len(prompt) - 1 and (
            namespace, tuple(prompt[: (k + 1) * p])
        ) in self.committed_prefixes:
            k += 1
        return k * p

    def _snapshot(self) -> tuple[Any, ...]:
        s = self.mgr.stats()
        return (s.num_free, s.num_used, s.num_cached, s.num_fenced, s.num_running,
                s.num_preempted, self.mgr.allocator.tags.sum())

    # -- rules ----------------------------------------------------------------------------------

    @rule(prompt=prompts(), namespace=st.sampled_from(NAMESPACES))
    def admit(self, prompt: list[int], namespace: Any) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        can = self.mgr.can_admit(np.array(prompt), namespace)
        before = self._snapshot()
        try:
            res = self.engine.admit(rid, prompt, namespace)
        except (OutOfPagesError, KVMemError) as e:
            assert not can, f"can_admit said yes but admit raised {e!r}"
            assert self._snapshot() == before, "a failed admit changed the manager"
            return
        assert can, "can_admit said no but admit succeeded"
        expected = self._expected_hit(prompt, namespace) if self.mgr.cache is not None else 0
        if self.prefixes_exact:
            assert res.num_cached_tokens == expected, (res, expected)
        else:
            assert res.num_cached_tokens <= expected, (res, expected)
        assert res.num_cached_tokens <= len(prompt) - 1

    @precondition(lambda self: self.mgr.running)
    @rule(data=st.data(), num=st.sampled_from([1, 1, 1, 2, 3, 6]))
    def step(self, data: st.DataObject, num: int) -> None:
        running = self._running()
        ids = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
        if any(self.mgr.num_tokens(r) + num > self.max_pages_per_seq * self.page_size
               for r in ids):
            return
        can = self.mgr.can_reserve(ids, num)
        before = self._snapshot()
        try:
            step = self.engine.step(ids, num)
        except OutOfPagesError:
            assert not can, "can_reserve said yes but reserve raised OutOfPagesError"
            assert self._snapshot() == before, "a failed reserve changed the manager"
            return
        assert can, "can_reserve said no but reserve succeeded"
        form = data.draw(st.sampled_from(["none", "step", "csr", "numpy", "tensors", "table"]))
        if form != "none":  # the step's metadata, in one of the forms an engine checks it
            report = self.mgr.verify(ids, **_verify_args(step, form))
            assert report.ok, f"verify aborted requests on a correct step: {report.aborted}"

    @precondition(lambda self: self.mgr.running)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self._running()), min_size=1, unique=True))
        before = {rid: self.engine.seqs[rid].committed for rid in ids}
        self.engine.commit(ids)
        self._note_commits(ids, before)

    @precondition(lambda self: self.mgr.running)
    @rule(data=st.data())
    def reject(self, data: st.DataObject) -> None:
        """Give back some uncommitted slots (a speculative step's rejected drafts)."""
        rid = data.draw(st.sampled_from(self._running()))
        most = self.mgr.num_tokens(rid) - self.mgr.num_committed(rid)
        self.engine.reject(rid, data.draw(st.integers(0, most)))

    @precondition(lambda self: self.mgr.running)
    @rule()
    def verify(self) -> None:
        report = self.mgr.verify(self._running())
        assert report.ok, f"verify aborted requests on a correct run: {report.aborted}"

    @precondition(lambda self: self.mgr.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._running()))
        child = f"r{self.next_id}"
        self.next_id += 1
        before = self._snapshot()
        try:
            self.engine.fork(parent, child)
        except (OutOfPagesError, KVMemError):
            assert self._snapshot() == before, "a failed fork changed the manager"

    @precondition(lambda self: self.mgr.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.engine.preempt(data.draw(st.sampled_from(self._running())))

    @precondition(lambda self: self.mgr.preempted)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(list(self.mgr.preempted)))
        can = self.mgr.can_resume(rid)
        before = self._snapshot()
        try:
            self.engine.resume(rid)
        except (OutOfPagesError, KVMemError) as e:
            assert not can, f"can_resume said yes but resume raised {e!r}"
            assert self._snapshot() == before, "a failed resume changed the manager"
            return
        assert can, "can_resume said no but resume succeeded"

    @precondition(lambda self: self.engine.seqs)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.engine.release(data.draw(st.sampled_from(sorted(self.engine.seqs, key=str))))

    @precondition(lambda self: len(self.steps) < 3)
    @rule()
    def begin_step(self) -> None:
        mapped = {int(p) for r in self._running() for p in self.mgr.pages_of(r)}
        handle = self.mgr.begin_step()
        self.steps[handle] = {p: int(self.mgr.allocator.tags[p]) for p in mapped}

    @precondition(lambda self: self.steps)
    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.steps, key=lambda h: h.step_id)))
        del self.steps[handle]
        self.mgr.retire(handle)

    @rule(data=st.data())
    def bad_call(self, data: st.DataObject) -> None:
        """An operation with a bad argument raises a KVMemError and changes nothing."""
        running = self._running() or ["nobody"]
        rid = data.draw(st.sampled_from(running))
        bad: Any = data.draw(st.sampled_from([True, 1.5, "2", -1, 2**63, None, [1.5], "AB"]))
        call = data.draw(st.sampled_from([
            lambda: self.mgr.reserve([rid], bad),
            lambda: self.mgr.reserve(bad, 1),
            lambda: self.mgr.commit(rid, bad),
            lambda: self.mgr.commit_batch([rid], [bad]),
            lambda: self.mgr.reject(rid, bad),
            lambda: self.mgr.admit(f"r{self.next_id}", bad),
            lambda: self.mgr.admit(f"r{self.next_id}", [1, 2], [bad]),
            lambda: self.mgr.verify([rid, rid]),
            lambda: self.mgr.release_batch(bad),
            lambda: self.mgr.fork(rid, rid),
            lambda: self.mgr.namespace_of_page(bad),
            lambda: self.mgr.allocator.free(bad),
        ]))
        before = (self._snapshot(), self.mgr.allocator.refcounts.tobytes(),
                  self.mgr.table.num_tokens.tobytes(), self.mgr.table.num_committed.tobytes())
        try:
            call()
        except KVMemError:
            pass
        else:
            raise AssertionError(f"a call with the bad argument {bad!r} did not raise")
        assert before == (self._snapshot(), self.mgr.allocator.refcounts.tobytes(),
                          self.mgr.table.num_tokens.tobytes(),
                          self.mgr.table.num_committed.tobytes()), "a failed call changed state"

    @rule()
    def clear_prefix_cache(self) -> None:
        self.mgr.clear_prefix_cache()
        self.committed_prefixes.clear()

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.mgr.check()
        s = self.mgr.stats()
        assert s.num_free + s.num_used + s.num_cached + s.num_fenced == s.num_pages, s
        if s.num_evictions:
            self.prefixes_exact = False

    @invariant()
    def no_page_in_two_namespaces(self) -> None:
        owner: dict[int, Any] = {}
        for rid in self._running():
            ns = self.engine.seqs[rid].namespace
            for p in self.mgr.pages_of(rid).tolist():
                assert owner.setdefault(p, ns) == ns, f"page {p} is mapped from two namespaces"

    @invariant()
    def no_reuse_under_a_step_in_flight(self) -> None:
        tags = self.mgr.allocator.tags
        for handle, mapped in self.steps.items():
            for p, tag in mapped.items():
                assert tags[p] == tag, f"page {p} changed lifetime while step {handle} runs"

    @invariant()
    def every_request_reads_its_own_kv(self) -> None:
        self.engine.check_kv()
