"""KVCacheManager.verify: what it proves, what it aborts, its fast paths and the forms of
metadata it takes."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import decoding, run_prompt

from kvmem import (
    CheckingTracker,
    IntegrityError,
    KVMemError,
    PageAllocator,
)
from kvmem.allocator import HashedPrefixCache, Namespace
from kvmem.cuda import PagePool, PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError
from kvmem.manager import (
    KVCacheManager,
    ManagerEvent,
    StepMetadata,
)
from kvmem.testing import ToyEngine, faults


def manager() -> KVCacheManager:
    mgr = KVCacheManager(64, page_size=4, max_seqs=8, tracker="checking")
    mgr.admit("a", list(range(10)))
    return mgr


P = 4


def three_running(make_manager: Any, **kw: Any) -> tuple[KVCacheManager, ToyEngine]:
    mgr = make_manager(**kw)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(10)))
    run_prompt(eng, "b", list(range(10)))  # shares two pages with "a"
    run_prompt(eng, "c", [9] * 6)
    eng.step(["a", "b", "c"], 1)
    return mgr, eng


class NamespaceBlindCache(HashedPrefixCache):
    """A cache whose key forgets the namespace and which confirms only tokens (BUG 11)."""

    def root_key(self, namespace: Namespace) -> Any:
        return super().root_key(None)

    def match(self, token_ids: Any, namespace: Namespace, max_pages: int,
              namespace_id: int | None = None) -> Any:
        return super().match(token_ids, namespace, max_pages, None)


def pooled(make_manager: Any, num_pages: int = 16) -> tuple[KVCacheManager, Any]:

    pool = PagePool(PoolSpec(num_layers=2, num_pages=num_pages, num_kv_heads=1, head_dim=8,
                             page_size=P, dtype="fp32", device="cpu"))
    return make_manager(num_pages=num_pages, pool=pool), pool


def the_rest_proceed(mgr: KVCacheManager, eng: ToyEngine, ids: list[str],
                     victims: list[str], faulted_pages: bool = False) -> None:
    """After verify aborted ``victims``: the others commit, take another step that verifies,
    and read exactly their own KV; nothing leaked (unless the fault itself took or gave page
    references behind the manager's back: ``faulted_pages``)."""
    for v in victims:
        eng.abort(v)
    rest = [r for r in ids if r not in victims]
    eng.commit(rest)
    step = eng.step(rest, 1)
    assert mgr.verify(rest, step).ok
    eng.check_kv(rest)
    if not faulted_pages:
        mgr.check()


class Spliced:
    """What the verifier's quick check of a decode step's spliced entries answered since
    this was made (from the verifier's counters)."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.verifier = mgr.verifier
        self.before = mgr.verifier.stats

    def answers(self) -> tuple[int, int]:
        """(proved, declined) since."""
        now = self.verifier.stats
        return (now.spliced_proved - self.before.spliced_proved,
                now.spliced_declined - self.before.spliced_declined)


def spy_spliced(mgr: KVCacheManager) -> Spliced:
    return Spliced(mgr)


def prefill(m: KVCacheManager, rid: Any, prompt: list[int], ns: Any = None) -> int:
    res = m.admit(rid, prompt, namespace=ns)
    m.reserve([rid], len(prompt) - res.num_cached_tokens)
    m.commit(rid, prompt[res.num_cached_tokens:])
    return res.num_cached_tokens


def _malformed_metadata(step: Any) -> list[dict[str, Any]]:
    import torch

    t = step.tensors("cpu")
    return [
        {"kv_indptr": t["kv_indptr"], "kv_indices": step.kv_indices},
        {"kv_indptr": step.kv_indptr, "kv_indices": t["kv_indices"]},
        {"kv_indptr": step.kv_indptr.astype(np.uint64), "kv_indices": step.kv_indices},
        {"metadata": {**step.fields(), "seq_lens": torch.as_tensor(step.seq_lens)}},
        {"metadata": {"slot_mapping": t["slot_mapping"], "block_table": step.block_table}},
    ]


def forms(step: StepMetadata) -> dict[str, dict[str, Any]]:
    """Every way of handing verify a step's metadata (keyword arguments)."""
    return {
        "ids": {},
        "step": {"step": step},
        "csr": {"kv_indptr": step.kv_indptr, "kv_indices": step.kv_indices},
        "numpy dict": {"metadata": step.fields()},
        "block table": {"metadata": {"block_table": step.block_table,
                                     "slot_mapping": step.slot_mapping}},
        "block table alone": {"metadata": {"block_table": step.block_table,
                                           "slot_mapping": step.slot_mapping,
                                           "seq_lens": step.seq_lens}},
        "tensors": {"metadata": step.tensors("cpu")},
        "csr tensors": {"kv_indptr": torch.from_numpy(step.kv_indptr),
                        "kv_indices": torch.from_numpy(step.kv_indices)},
    }


def _decoding_three(make_manager: Any, tracker: str, k: int) -> tuple[KVCacheManager, list[str]]:
    mgr = make_manager(tracker=tracker, num_pages=64, max_seqs=10)
    ids = ["x", "y", "z"]
    for i, rid in enumerate(ids):
        prompt = np.arange(5 + i) + 10 * i
        mgr.admit(rid, prompt)
        mgr.reserve([rid], prompt.size)
        mgr.commit(rid, prompt)
    for _ in range(2):  # proofs for the next steps to splice from
        assert mgr.verify(ids, mgr.reserve(ids, k)).ok
        mgr.commit_batch(ids, np.full((3, k), 7))
    return mgr, ids


class _Lockstep:
    """Two managers driven alike: ``fast`` takes every fast path (paranoid), ``plain`` is sent
    down the plain ones (its step records and proof forgotten before every reserve and verify,
    its commits ragged). Their step metadata, verdicts and states must be equal."""

    def __init__(self, seed: int, make_manager: Any, snapshot: Any) -> None:
        self.snapshot = snapshot
        self.rng = np.random.default_rng(seed)
        # one prefix-cache seed for both, so that their whole states compare equal
        self.fast, self.plain = (
            make_manager(num_pages=80, max_seqs=10, tracker="paranoid",
                         prefix_cache=HashedPrefixCache(seed=seed)),
            make_manager(num_pages=80, max_seqs=10, tracker="paranoid",
                         prefix_cache=HashedPrefixCache(seed=seed)))
        self.engines = {id(m): ToyEngine(m, seed=seed) for m in (self.fast, self.plain)}
        self.order: list[str] = []
        self.left: dict[str, int] = {}  # prompt tokens not reserved yet
        self.next_id = 0
        self.faulted = False

    def eng(self, m: KVCacheManager) -> ToyEngine:
        return self.engines[id(m)]

    def both(self, fn: Any) -> list[Any]:
        return [fn(m, self.eng(m)) for m in (self.fast, self.plain)]

    def forget(self, rid: str) -> None:
        for m in (self.fast, self.plain):
            self.eng(m).seqs.pop(rid, None)
        self.left.pop(rid, None)
        if rid in self.order:
            self.order.remove(rid)

    def step(self, ids: list[str], n: Any) -> tuple[StepMetadata, StepMetadata]:
        self.plain.steps.forget()
        fast, plain = self.both(lambda m, e: e.step(ids, n))  # (ToyEngine.check_step: a gather)
        for name, value in fast.fields().items():
            assert np.array_equal(value, plain.fields()[name]), name
        assert np.array_equal(fast.copy_src, plain.copy_src)
        return fast, plain

    def verify(self, ids: list[str], steps: tuple[StepMetadata, StepMetadata], form: str
               ) -> set[str]:
        self.plain.steps.forget()
        self.plain.verifier.forget()
        fast = self.fast.verify(ids, **forms(steps[0])[form])
        plain = self.plain.verify(ids, **forms(steps[1])[form])
        assert dict(fast.aborted) == dict(plain.aborted), form
        for rid in fast.aborted:
            self.forget(rid)
        return set(fast.aborted)

    def commit(self, ids: list[str], one: bool = False) -> None:
        for m in (self.fast, self.plain):
            seqs = self.eng(m).seqs
            tokens = [seqs[r].tokens[seqs[r].committed: seqs[r].committed + 1 if one
                                     else seqs[r].written] for r in ids]
            if m is self.fast and all(len(t) == 1 for t in tokens):
                m.commit_batch(ids, np.array([t[0] for t in tokens]))  # the decode path
            else:
                m.commit_batch(ids, tokens)  # ragged: the general path
            for r, t in zip(ids, tokens):
                seqs[r].committed += len(t)

    def lifecycle(self) -> None:
        """Now and then: a fork, a preemption, a resume, releases, fences, a cleared cache."""
        rng, fast = self.rng, self.fast
        if self.order and rng.random() < 0.1:
            rid = self.order[int(rng.integers(len(self.order)))]
            seq = self.eng(fast).seqs[rid]
            if seq.committed == seq.written and not self.left[rid] and fast.can_fork(rid):
                child = f"r{self.next_id}"
                self.next_id += 1
                self.both(lambda m, e: e.fork(rid, child))
                self.order.append(child)
                self.left[child] = 0
        if self.order and rng.random() < 0.08:
            rid = self.order[int(rng.integers(len(self.order)))]
            self.both(lambda m, e: e.preempt(rid))
            self.order.remove(rid)
            self.left.pop(rid)
        if fast.preempted and rng.random() < 0.2 and fast.can_resume(fast.preempted[0]):
            rid = fast.preempted[0]
            res = self.both(lambda m, e: e.resume(rid))
            assert res[0] == res[1]
            self.order.append(rid)
            self.left[rid] = res[0].num_prompt_tokens - res[0].num_cached_tokens
        if self.order and rng.random() < 0.12:
            gone = [self.order[i] for i in sorted(rng.permutation(len(self.order))[:2])]
            self.both(lambda m, e: m.release_batch(gone))
            for rid in gone:
                self.forget(rid)
        if rng.random() < 0.1:
            self.handles.append(self.both(lambda m, e: m.begin_step()))
        if self.handles and rng.random() < 0.15:
            pair = self.handles.pop(int(rng.integers(len(self.handles))))
            self.fast.retire(pair[0])
            self.plain.retire(pair[1])
        if rng.random() < 0.03:
            cleared = self.both(lambda m, e: m.clear_prefix_cache())
            assert cleared[0] == cleared[1]

    def admit(self) -> None:
        rng = self.rng
        prompt = rng.integers(0, 3, int(rng.integers(1, 15))).tolist()
        ns = [None, "t"][int(rng.integers(2))]
        if len(self.order) < 8 and rng.random() < 0.35 and self.fast.can_admit(prompt, ns):
            rid = f"r{self.next_id}"
            self.next_id += 1
            res = self.both(lambda m, e: e.admit(rid, prompt, ns))
            assert res[0] == res[1]
            self.order.append(rid)
            self.left[rid] = len(prompt) - res[0].num_cached_tokens

    def fault(self, ids: list[str]) -> str | None:
        """Now and then a fault behind both managers' backs (then their states stay equal but
        are no longer checked for health)."""
        rng = self.rng
        if len(ids) < 2 or rng.random() > 0.08:
            return None
        victim = ids[int(rng.integers(len(ids)))]
        other = next(r for r in ids if r != victim)
        kind = int(rng.integers(4))
        for m in (self.fast, self.plain):
            if kind == 0:
                faults.free_behind_back(m, victim, 0)
            elif kind == 1:
                faults.reallocate_behind_back(m, victim, 0)
            elif kind == 2:
                faults.overwrite_page_entry(m, victim, int(m.num_committed(victim)) // P
                                            if m.num_committed(victim) < m.pages_of(victim).size
                                            * P else 0, int(m.pages_of(other)[0]))
            else:
                faults.share_write_page(m, victim)
        self.faulted = True
        return victim

    def run(self, moves: int) -> None:
        self.handles: list[list[Any]] = []
        rng = self.rng
        for _ in range(moves):
            self.admit()
            self.lifecycle()
            ids = [r for r in self.order if rng.random() < 0.8] if rng.random() < 0.3 \
                else list(self.order)
            if len(ids) > 2 and rng.random() < 0.1:
                ids[0], ids[1] = ids[1], ids[0]
            if not ids:
                continue
            prefilling = [r for r in ids if self.left[r]]
            if prefilling and rng.random() < 0.5:  # a prefill chunk alone, beside the batch
                ids = prefilling[:1]
            counts = [min(self.left[r], int(rng.integers(1, 9))) or 1 for r in ids]
            n: Any = 1 if set(counts) == {1} and rng.random() < 0.8 else counts
            if not self.fast.can_reserve(ids, n):
                assert not self.plain.can_reserve(ids, n)
                first = self.order.pop(0)
                self.both(lambda m, e, rid=first: e.preempt(rid))
                self.left.pop(first)
                continue
            steps = self.step(ids, n)
            for r, c in zip(ids, counts):
                self.left[r] -= min(c, self.left[r])
            victim = self.fault(ids)
            form = "step" if rng.random() < 0.6 else list(forms(steps[0]))[int(rng.integers(8))]
            aborted = self.verify(ids, steps, form)
            if victim is not None and victim not in aborted:
                self.both(lambda m, e, rid=victim: m.release(rid))  # (its row may disagree)
                self.forget(victim)
            ok = [r for r in ids if r in self.fast.running]
            if (victim is None and ok and not any(self.left[r] for r in ok)
                    and rng.random() < 0.4 and self.fast.can_reserve(ok, 1)):
                # step n + 1 reserved and verified before step n is committed
                aborted = self.verify(ok, self.step(ok, 1), "step")
                ok = [r for r in ok if r not in aborted]
                if not aborted:
                    self.commit(ok, one=True)
            self.commit(ok)
            assert self.snapshot(self.fast) == self.snapshot(self.plain)
            if not self.faulted:
                self.eng(self.fast).check_kv()
                self.fast.check()


@pytest.mark.parametrize("reallocated", [False, True])
def test_the_tag_recheck_at_completion_aborts_only_the_receiver(
        make_manager: Any, reallocated: bool) -> None:
    """BUGS.md 1, 9: a page a transfer (or an offload copy) writes is freed and reallocated
    before it lands; verify at completion re-checks the tags and aborts that request only."""
    mgr = make_manager(num_pages=16)
    eng = ToyEngine(mgr)
    run_prompt(eng, "r", list(range(9)))
    run_prompt(eng, "o", [7] * 9)
    done = mgr.begin_step()
    if reallocated:
        faults.reallocate_behind_back(mgr, "r", 2)
    report = mgr.verify(["r", "o"])
    mgr.retire(done)
    assert list(report.aborted) == (["r"] if reallocated else [])
    if reallocated:
        assert "reallocated" in report.aborted["r"]
    assert mgr.verify(["o"]).ok


def test_tracker_forget_refuses_a_negative_row() -> None:
    tracker = CheckingTracker(4, 4)
    tracker.record([3], [0], [7])
    with pytest.raises(ArgumentError):
        tracker.forget([-1])
    assert tracker.expected_tags[3].tolist() == [7, 0, 0, 0]


@pytest.mark.parametrize("rows, positions, tags, kind", [
    ([0], [0, 1], [5], ArgumentError),  # lengths differ: no broadcasting
    ([0], [0], [-5], ArgumentError),  # a tag is never negative
    ([0], [0], [5.0], ArgumentTypeError),  # [1.7] is not page 1, 5.0 not tag 5
    ([0], [0], [True], ArgumentTypeError),
    (0, 0, 5, ArgumentTypeError),  # one id where a list is expected
    ([1.0], [0], [5], ArgumentTypeError),
])
def test_tracker_record_refuses_malformed_entries(rows: Any, positions: Any, tags: Any,
                                                  kind: type) -> None:
    from kvmem import CheckingTracker

    tracker = CheckingTracker(4, 8)
    tracker.record([1], [0], [7])
    before = (tracker.expected_tags.tobytes(), tracker.versions.tobytes(), tracker.num_changes)
    with pytest.raises(kind):
        tracker.record(rows, positions, tags)
    assert (tracker.expected_tags.tobytes(), tracker.versions.tobytes(),
            tracker.num_changes) == before


def test_tracker_forget_refuses_one_row_and_the_constructor_checks_its_types() -> None:
    from kvmem import CheckingTracker

    tracker = CheckingTracker(4, 8)
    tracker.record([0], [0], [7])
    with pytest.raises(ArgumentTypeError, match="rows"):
        tracker.forget(0)
    assert tracker.expected_tags[0, 0] == 7
    with pytest.raises(ArgumentTypeError, match="max_seqs"):
        CheckingTracker(True, 8)
    with pytest.raises(ArgumentTypeError, match="paranoid"):
        CheckingTracker(4, 8, paranoid=1)


def test_tracker_verify_refuses_malformed_metadata_with_a_metadata_error() -> None:
    from kvmem import CheckingTracker, MetadataError

    tracker = CheckingTracker(4, 8)
    tracker.record([0], [0], [5])
    tags = np.zeros(8, dtype=np.int64)
    tags[3] = 5
    indptr, indices = np.array([0, 1]), np.array([3])
    assert tracker.verify([0], [1], tags, kv_indptr=indptr, kv_indices=indices).ok
    for kwargs in ({}, {"block_table": np.array([[3]]), "kv_indptr": indptr,
                        "kv_indices": indices},
                   {"kv_indptr": [0, 1], "kv_indices": [3]},  # Python lists
                   {"kv_indptr": np.array([0, 1, 1]), "kv_indices": indices}):
        with pytest.raises(MetadataError):
            tracker.verify([0], [1], tags, **kwargs)
    with pytest.raises(ArgumentError, match="rows"):
        tracker.verify([9], [1], tags, kv_indptr=indptr, kv_indices=indices)
    with pytest.raises(ArgumentError, match="num_pages"):
        tracker.verify([0], [1, 1], tags, kv_indptr=indptr, kv_indices=indices)
    with pytest.raises(ArgumentTypeError, match="tags"):
        tracker.verify([0], [1], tags.tolist(), kv_indptr=indptr, kv_indices=indices)


def test_a_checking_tracker_serves_one_manager() -> None:
    """docs/integrity.md: the tracker is the only writer of its expected tags; two managers on
    one tracker would overwrite each other's rows (like a prefix cache, it binds to one)."""
    from kvmem import CheckingTracker

    tracker = CheckingTracker(8, 16)
    first = KVCacheManager(64, page_size=4, max_seqs=8, max_pages_per_seq=16, tracker=tracker)
    with pytest.raises(ArgumentError, match="tracker"):
        KVCacheManager(64, page_size=4, max_seqs=8, max_pages_per_seq=16, tracker=tracker)
    first.admit("a", [1, 2, 3])
    assert first.tracker is tracker and tracker.expected_tags[first.row_of("a"), 0] > 0
    with pytest.raises(ArgumentTypeError, match="tracker"):
        KVCacheManager(64, tracker=3)
    with pytest.raises(ArgumentTypeError, match="pool"):
        KVCacheManager(64, pool=object())


def test_verify_given_something_that_is_no_step_is_a_type_error(snapshot: Any) -> None:
    mgr = manager()
    mgr.reserve(["a"], 3)
    before = snapshot(mgr)
    for bad in (3, {"a": 1}, "step"):
        with pytest.raises(ArgumentTypeError, match="step="):
            mgr.verify(["a"], bad)
    other = KVCacheManager(32, page_size=4, tracker="checking").reserve([], 1)
    with pytest.raises(ArgumentError, match="a step of 0"):
        mgr.verify(["a"], other)  # a step of another batch size
    assert snapshot(mgr) == before


def test_verify_is_silent_on_a_correct_run(make_manager: Any) -> None:
    mgr, eng = three_running(make_manager)
    for _ in range(10):
        step = eng.step(["a", "b", "c"], 1)
        report = mgr.verify(["a", "b", "c"], step)
        assert report.ok and report.keep.tolist() == [True] * 3 and report.integrity is None
        eng.commit(["a", "b", "c"])
    assert mgr.verify(["a", "b", "c"]).ok
    assert mgr.stats().num_integrity_failures == 0


@pytest.mark.parametrize("fault, victims, what, leaks", [
    (lambda m: faults.free_behind_back(m, "c", 0), ["c"], "freed", False),
    (lambda m: faults.reallocate_behind_back(m, "c", 1), ["c"], "reallocated", True),
    (lambda m: faults.free_behind_back(m, "a", 0), ["a", "b"], "freed", False),  # shared page
    (lambda m: faults.free_behind_back(m, "a", 2), ["a"], "freed", False),
    (lambda m: faults.overwrite_page_entry(m, "a", 2, int(m.pages_of("c")[0])), ["a"],
     "reallocated", False),
    (lambda m: faults.share_write_page(m, "c"), ["c"], "holders", True),
])
def test_verify_aborts_only_the_victims(
        make_manager: Any, fault: Any, victims: list[str], what: str,
                                        leaks: bool) -> None:
    mgr, eng = three_running(make_manager)
    failures: list[ManagerEvent] = []
    mgr.add_hook("integrity_failure", failures.append)
    fault(mgr)
    report = mgr.verify(["a", "b", "c"])
    assert list(report.aborted) == victims
    assert all(what in report.aborted[v] for v in victims)
    assert report.keep.tolist() == [r not in victims for r in "abc"]
    assert report.ok_ids == tuple(r for r in "abc" if r not in victims)
    assert not set(victims) & {*mgr.running, *mgr.preempted}
    assert [e.request_id for e in failures] == victims
    assert mgr.stats().num_integrity_failures == len(victims)
    for v in victims:
        eng.abort(v)
    others = [r for r in "abc" if r not in victims]
    assert mgr.verify(others).ok  # the rest proceed
    eng.check_kv(others)
    if leaks:  # the fault left a holder the manager does not know: check() reports it
        with pytest.raises(IntegrityError, match="differ from their holders"):
            mgr.check()
    else:  # the victims' own references were released, nobody else's
        mgr.check()


def test_verify_checks_the_arrays_the_kernel_reads(make_manager: Any) -> None:
    """BUGS 12, 13: the kernel is handed a wrong slice or stale columns."""
    mgr, eng = three_running(make_manager)
    step = eng.step(["a", "b", "c"], 1)
    bad = step.kv_indices.copy()
    bad[-1] = mgr.pages_of("a")[0]  # "c"'s last entry points into "a"
    tampered = type(step)(**{**step.__dict__, "kv_indices": bad})
    assert list(mgr.verify(["a", "b", "c"], tampered).aborted) == ["c"]
    mgr2, eng2 = three_running(make_manager)
    step = eng2.step(["a", "b", "c"], 1)
    indptr = step.kv_indptr.copy()
    indptr[1] -= 1  # "a" loses a page, "b" gains one: both are wrong
    tampered = type(step)(**{**step.__dict__, "kv_indptr": indptr})
    assert sorted(mgr2.verify(["a", "b", "c"], tampered).aborted) == ["a", "b"]


def test_a_reused_row_has_no_stale_columns(make_manager: Any) -> None:
    """BUG 13: a reused block-table row keeps columns past the new request's pages."""
    mgr = make_manager()
    eng = ToyEngine(mgr)
    run_prompt(eng, "long", [1] * 30)
    eng.release("long")
    run_prompt(eng, "short", [2] * 3)
    step = eng.step(["short"], 1)
    assert step.block_table.tolist() == [[mgr.pages_of("short")[0]]]
    assert (mgr.table.pages[step.rows[0], 1:] == -1).all()
    assert mgr.verify(["short"], step).ok


def test_a_cross_namespace_hit_is_caught_before_decode(make_manager: Any) -> None:
    """BUG 11: the cache key misses an input, and a tenant maps another tenant's pages."""
    mgr = make_manager(prefix_cache=NamespaceBlindCache(seed=3))
    eng = ToyEngine(mgr)
    run_prompt(eng, "t1", list(range(9)), ns="tenant-1")
    run_prompt(eng, "own", [5] * 5, ns="tenant-2")
    res = eng.admit("t2", list(range(9)), "tenant-2")
    assert res.num_cached_tokens == 8  # the faulty cache handed over tenant-1's pages
    eng.step(["t2"], 1)
    report = mgr.verify(["t1", "own", "t2"])
    assert list(report.aborted) == ["t2"]
    assert "namespace" in report.aborted["t2"]
    eng.abort("t2")
    mgr.check()
    assert mgr.verify(["t1", "own"]).ok


def test_pages_written_after_a_failure_are_not_offered_again(make_manager: Any) -> None:
    """BUG 8: pages of an aborted request inserted into the prefix index with bad KV."""
    mgr = make_manager()
    eng = ToyEngine(mgr)
    run_prompt(eng, "v", list(range(13)))  # pages 0..2 cached
    faults.free_behind_back(mgr, "v", 0)
    assert list(mgr.verify(["v"]).aborted) == ["v"]
    eng.abort("v")
    # Page 0 was lost; pages 1 and 2 were computed from it and must not be reused.
    assert mgr.stats().num_cached == 0
    mgr.check()
    assert eng.admit("w", list(range(13))).num_cached_tokens == 0


def test_noop_tracker_verification_costs_nothing(make_manager: Any) -> None:
    mgr = make_manager(tracker=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    faults.free_behind_back(mgr, "a", 0)
    report = mgr.verify(["a", "not-even-a-request"])  # does not look at anything
    assert report.ok and report.request_ids == ("a", "not-even-a-request")


def test_verify_on_the_pool_device_against_its_tag_mirror(make_manager: Any) -> None:
    import torch

    mgr, pool = pooled(make_manager)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(9)))
    run_prompt(eng, "b", [7] * 5)
    step = eng.step(["a", "b"], 1)
    qtags = mgr.mirror.sync()
    assert torch.equal(pool.tags, torch.as_tensor(qtags))  # the mirror holds qualified tags
    t = step.tensors("cpu")
    assert t["slot_mapping"].dtype == torch.int64 and t["kv_indices"].dtype == torch.int32
    assert t["block_table"].tolist() == step.block_table.tolist()
    indptr, indices = t["kv_indptr"], t["kv_indices"]
    assert mgr.verify(["a", "b"], kv_indptr=indptr, kv_indices=indices).ok
    lost = faults.free_behind_back(mgr, "b", 0)
    report = mgr.verify(["a", "b"], kv_indptr=indptr, kv_indices=indices)
    assert list(report.aborted) == ["b"] and "freed" in report.aborted["b"]
    assert int(pool.tags[lost]) == 0  # the mirror saw the page go before the check ran


def test_a_decode_loop_checks_only_the_entries_reserve_spliced_in(make_manager: Any) -> None:
    """Once a step is verified, the next step's verify proves the unchanged entries by
    comparison and checks the fresh ones (grown pages, replaced requests) in full."""
    mgr, eng, ids = decoding(make_manager)
    spliced = spy_spliced(mgr)
    for i in range(16):
        if i in (3, 9):  # a request finishes and another takes its batch slot
            slot = i % len(ids)
            eng.release(ids[slot])
            ids[slot] = f"new{i}"
            run_prompt(eng, ids[slot], [i] * (3 + i))  # (not verified yet: fresh entries)
        step = eng.step(ids, 1)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    assert spliced.answers() == (16, 0)
    eng.check_kv()
    mgr.check()


# (A page freed behind a request's back may be handed out again by the step's own allocation;
# the page a step writes exists once the step is reserved.)
@pytest.mark.parametrize("fault, victims, what, after_reserve", [
    (lambda m: faults.free_behind_back(m, "c", 0), ["c"], ("freed", "reallocated"), False),
    (lambda m: faults.reallocate_behind_back(m, "d", 1), ["d"], ("reallocated",), False),
    (lambda m: faults.free_behind_back(m, "a", 0), ["a", "b"], ("freed", "reallocated"), False),
    (lambda m: faults.free_behind_back(m, "e", 1), ["e"], ("freed",), True),
    (lambda m: faults.share_write_page(m, "e"), ["e"], ("holders",), True),
])
def test_verify_of_the_next_step_catches_faults_on_entries_it_proved_before(make_manager: Any,
        fault: Any, victims: list[str], what: tuple[str, ...], after_reserve: bool) -> None:
    mgr, eng, ids = decoding(make_manager)
    spliced = spy_spliced(mgr)
    if not after_reserve:
        fault(mgr)
    step = eng.step(ids, 1)
    if after_reserve:
        fault(mgr)
    report = mgr.verify(ids, step)
    assert spliced.answers() == (0, 1)  # the quick check of the spliced entries saw it too
    assert list(report.aborted) == victims
    assert all(any(w in report.aborted[v] for w in what) for v in victims)
    the_rest_proceed(mgr, eng, ids, victims, faulted_pages=True)


@pytest.mark.parametrize("num_tokens", [1, 2, 5])
@pytest.mark.parametrize("where", ["another request's page", "an earlier slot of its own"])
def test_a_slot_mapping_that_sends_a_token_astray_aborts_only_that_request(make_manager: Any,
        num_tokens: int, where: str) -> None:
    """BUGS 12 for the kernel that stores K/V: verify checks the step's slot mapping against
    the pages its CSR lists, not only that the page written has one holder."""
    mgr, eng, ids = decoding(make_manager)
    spliced = spy_spliced(mgr)
    step = eng.step(ids, num_tokens)
    first = step.qo_indptr.tolist()  # each request's first token in the slot mapping
    c, d = first[ids.index("c")], first[ids.index("d")]
    if where == "another request's page":  # one "d" holds alone and writes now: one holder
        step.slot_mapping[c] = step.slot_mapping[d] // P * P + step.slot_mapping[c] % P
    else:  # overwrites a token "c" committed before (its own page or the one before)
        step.slot_mapping[c] -= 1
    report = mgr.verify(ids, step)
    assert spliced.answers() == (0, 1) if num_tokens == 1 else spliced.answers()[0] == 0
    assert list(report.aborted) == ["c"] and "slot mapping" in report.aborted["c"]
    the_rest_proceed(mgr, eng, ids, ["c"])


def test_the_decode_quick_check_catches_a_reserve_that_sent_a_slot_astray(
        make_manager: Any) -> None:
    """A bug in reserve itself (its own slots and the step's agree, but not with the CSR it
    built): the quick check of a decode step sees that the token's page is not the last one
    its row lists, and the full check aborts exactly that request."""
    mgr, eng, ids = decoding(make_manager)
    spliced = spy_spliced(mgr)
    step = eng.step(ids, 1)
    b = mgr.steps.latest
    assert b is not None and b.decode is not None
    c, d = ids.index("c"), ids.index("d")
    stray = int(b.decode.token_pages[d])  # "d" holds it alone: one writer
    for slots in (b.slots, step.slot_mapping):
        slots[c] = stray * P + slots[c] % P
    b.decode.token_pages[c] = stray
    report = mgr.verify(ids, step)
    assert spliced.answers() == (0, 1)
    assert list(report.aborted) == ["c"] and "slot mapping" in report.aborted["c"]
    the_rest_proceed(mgr, eng, ids, ["c"])


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("field", ["kv_last_page_len", "seq_lens", "num_new_tokens"])
def test_step_lengths_that_are_not_the_requests_own_abort_only_that_request(make_manager: Any,
        num_tokens: int, field: str) -> None:
    """A last page said longer than it is makes the kernel read slots no token of the request
    wrote (a previous holder's KV); wrong sequence or query lengths read the wrong tokens."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, num_tokens)
    c = ids.index("c")
    getattr(step, field)[c] += 1
    if field == "num_new_tokens":  # the query ranges move with it
        step.qo_indptr[c + 1 :] += 1
    report = mgr.verify(ids, step)
    assert list(report.aborted) == ["c"] and "lengths" in report.aborted["c"]
    the_rest_proceed(mgr, eng, ids, ["c"])


@pytest.mark.parametrize("fault", ["slot", "last_page_len", "padding"])
def test_verify_of_tensor_metadata_checks_slots_and_lengths_on_their_device(
        make_manager: Any, fault: str) -> None:
    """verify(ids, metadata=step.tensors(device)): what an engine with a device pool checks
    (here CPU tensors); padding slots (-1) after the step's tokens are allowed."""
    import torch

    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 2)
    t = step.tensors("cpu")
    t["slot_mapping"] = torch.cat([t["slot_mapping"], torch.full((3,), -1)])  # padded
    assert mgr.verify(ids, metadata=t).ok
    c, d = step.qo_indptr[ids.index("c")], step.qo_indptr[ids.index("d")]
    if fault == "slot":
        t["slot_mapping"][c] = t["slot_mapping"][d] // P * P + t["slot_mapping"][c] % P
    elif fault == "last_page_len":
        t["kv_last_page_len"][ids.index("c")] += 1
    else:  # a padding slot that writes somewhere: no token of the step can be trusted
        t["slot_mapping"][-1] = t["slot_mapping"][0]
    report = mgr.verify(ids, metadata=t)
    assert list(report.aborted) == (ids if fault == "padding" else ["c"])
    if fault != "padding":
        the_rest_proceed(mgr, eng, ids, ["c"])
    with pytest.raises(KVMemError, match="slot_mapping"):
        mgr.verify(mgr.running, metadata={"kv_indptr": t["kv_indptr"],
                                          "kv_indices": t["kv_indices"]})


@pytest.mark.parametrize("fault", [None, "slot", "stale column", "page"])
@pytest.mark.parametrize("as_tensors", [False, True])
def test_verify_of_a_block_table_with_its_slot_mapping(make_manager: Any, fault: str | None,
                                                       as_tensors: bool) -> None:
    """The vLLM form: block table, slot mapping and sequence lengths, as numpy or tensors."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    meta: dict[str, Any] = {"block_table": step.block_table.copy(),
                            "slot_mapping": step.slot_mapping.copy(),
                            "seq_lens": step.seq_lens.copy()}
    c = ids.index("c")
    n = int(step.seq_lens[c] - 1) // P  # c's last page
    if fault == "slot":  # its token into "d"'s page, same offset
        d = ids.index("d")
        meta["slot_mapping"][c] = (meta["slot_mapping"][d] // P * P
                                   + meta["slot_mapping"][c] % P)
    elif fault == "stale column":  # BUGS 13: a reused buffer keeps a column past c's pages
        meta["block_table"][c, n + 1] = mgr.pages_of("d")[0]
    elif fault == "page":  # c's last page listed as another request's
        meta["block_table"][c, n] = mgr.pages_of("d")[0]
    if as_tensors:
        import torch

        meta = {k: torch.from_numpy(v) for k, v in meta.items()}
    report = mgr.verify(ids, metadata=meta)
    assert list(report.aborted) == ([] if fault is None else ["c"])
    if fault is not None:
        the_rest_proceed(mgr, eng, ids, ["c"])


def test_slot_mappings_of_correct_steps_pass_on_every_path(make_manager: Any) -> None:
    """The slot check stays silent: decode steps (quick path), speculative and ragged steps
    (the general path), and the detailed check of a batch that changed."""
    mgr, eng, ids = decoding(make_manager)
    for num in (1, 3, [2, 1, 4, 1, 16], 1, 1):
        step = eng.step(ids, num)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    mgr.verifier.forget()  # nothing proven: the next verify checks everything
    step = eng.step(ids[::-1], 2)
    assert mgr.verify(ids[::-1], step).ok
    assert mgr.verify(ids[::-1], metadata=step.tensors("cpu")).ok  # as tensors, detailed
    eng.commit(ids)
    eng.check_kv()
    assert mgr.stats().num_integrity_failures == 0


def test_verify_of_the_next_step_checks_the_arrays_it_is_given(make_manager: Any) -> None:
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    bad = step.kv_indices.copy()
    bad[0] = mgr.pages_of("c")[0]  # an entry verify proved last step now points elsewhere
    tampered = type(step)(**{**step.__dict__, "kv_indices": bad})
    assert list(mgr.verify(ids, tampered).aborted) == ["a"]
    mgr2, eng2, ids2 = decoding(make_manager)
    step = eng2.step(ids2, 1)
    step.kv_indices[-1] = step.kv_indices[0]  # in place: the engine's own array
    assert list(mgr2.verify(ids2, step).aborted) == ["e"]


def test_a_page_table_entry_overwritten_after_a_verified_step_is_caught(make_manager: Any) -> None:
    """BUGS 12, 13 after the snapshot: verify() of fresh metadata sees the table's entry."""
    mgr, _eng, ids = decoding(make_manager)
    faults.overwrite_page_entry(mgr, "d", 0, int(mgr.pages_of("c")[0]))
    report = mgr.verify(ids)
    assert list(report.aborted) == ["d"] and "namespace" not in report.aborted["d"]


def test_replaced_requests_in_a_decode_batch_are_checked_in_full(make_manager: Any) -> None:
    mgr, eng, ids = decoding(make_manager)
    for slot, rid in ((1, "b2"), (3, "d2")):  # finished requests replaced in place
        eng.release(ids[slot])
        run_prompt(eng, rid, list(range(10)) if rid == "b2" else [7] * 21)
        ids[slot] = rid
    for _ in range(20):  # rows grow pages; the CSR is spliced from the previous step's
        step = eng.step(ids, 1)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    eng.check_kv()
    eng.release("c")
    run_prompt(eng, "c2", [3] * 9)
    ids[2] = "c2"
    faults.free_behind_back(mgr, "c2", 0)
    step = eng.step(ids, 1)
    assert list(mgr.verify(ids, step).aborted) == ["c2"]
    mgr.check()


def test_alternating_batches_of_one_size_are_each_checked_in_full(make_manager: Any) -> None:
    mgr = make_manager(num_pages=64, max_seqs=8)
    eng = ToyEngine(mgr)
    for i in range(6):
        run_prompt(eng, i, [i] * (6 + i))
    one, two = [0, 1, 2], [3, 4, 5]
    for _ in range(6):
        for batch in (one, two):
            step = eng.step(batch, 1)
            assert mgr.verify(batch, step).ok
            eng.commit(batch)
    faults.free_behind_back(mgr, 4, 0)
    step = eng.step(two, 1)
    assert list(mgr.verify(two, step).aborted) == [4]
    eng.abort(4)
    step = eng.step(one, 1)
    assert mgr.verify(one, step).ok
    eng.check_kv()


@pytest.mark.parametrize("case", range(5))
def test_metadata_of_mixed_kinds_or_uint64_is_a_metadata_error(
        make_manager: Any, snapshot: Any, case: int) -> None:
    from kvmem.errors import MetadataError

    m = make_manager(max_pages_per_seq=8)
    for rid in ("a", "b"):
        prefill(m, rid, [int(rid == "a"), 2, 3, 4, 5, 6])
    step = m.reserve(["a", "b"], 1)
    before = snapshot(m)
    kwargs = _malformed_metadata(step)[case]
    with pytest.raises(MetadataError, match=r"kv_indptr|kv_indices|seq_lens|slot_mapping"):
        m.verify(["a", "b"], **kwargs)
    assert snapshot(m) == before
    assert m.verify(["a", "b"], step).ok


@pytest.mark.parametrize("form", ["host-tags", "device-tags"])
def test_tracker_verify_of_metadata_not_of_the_tags_kind_is_a_metadata_error(form: str) -> None:
    import torch

    from kvmem import CheckingTracker
    from kvmem.errors import MetadataError

    tracker, alloc = CheckingTracker(4, 6), PageAllocator(8)
    pages = alloc.allocate(3)
    tracker.record(np.zeros(3, dtype=np.int64), np.arange(3), alloc.tags[pages])
    tags = alloc.tags if form == "host-tags" else torch.as_tensor(alloc.tags.copy())
    indptr, indices = np.array([0, 3], dtype=np.int32), pages.astype(np.int32)
    other = torch.as_tensor if form == "host-tags" else np.asarray
    same = (lambda a: a) if form == "host-tags" else torch.as_tensor
    assert tracker.verify([0], [3], tags, kv_indptr=same(indptr), kv_indices=same(indices)).ok
    for kw in ({"kv_indptr": other(indptr), "kv_indices": same(indices)},
               {"kv_indptr": same(indptr), "kv_indices": other(indices)},
               {"block_table": other(indices[None, :])}):
        with pytest.raises(MetadataError, match="tags"):
            tracker.verify([0], [3], tags, **kw)


@pytest.mark.parametrize("pad", [-1, 5])
def test_slot_mapping_padding_must_be_minus_one_or_every_request_aborts(
        make_manager: Any, pad: int) -> None:
    m = make_manager(max_pages_per_seq=8)
    prefill(m, "a", [1, 2, 3, 4, 5, 6])
    prefill(m, "b", [9, 8, 7, 6, 5])
    step = m.reserve(["a", "b"], 1)
    md = {"slot_mapping": np.concatenate([step.slot_mapping, [-1, pad]]),
          "kv_indptr": step.kv_indptr, "kv_indices": step.kv_indices}
    report = m.verify(["a", "b"], metadata=md)
    assert report.ok_ids == (("a", "b") if pad == -1 else ())
    assert report.keep.tolist() == [pad == -1] * 2
    m.check()


@pytest.mark.parametrize("tracker", [None, "checking"])
def test_verify_refuses_unknown_or_repeated_ids_unless_its_tracker_checks_nothing(
        make_manager: Any, snapshot: Any,
        tracker: Any) -> None:
    m = make_manager(tracker=tracker, max_pages_per_seq=8)
    prefill(m, "a", [1, 2, 3, 4, 5])
    for ids in (["a", "ghost"], ["a", "a"]):
        before = snapshot(m)
        if tracker is None:
            assert m.verify(ids).ok_ids == tuple(ids)
        else:
            with pytest.raises(ArgumentError, match=r"ghost|'a' twice"):
                m.verify(ids)
        assert snapshot(m) == before


def test_a_checking_tracker_wider_than_the_table_serves_the_decode_loop(make_manager: Any) -> None:
    # manager.py: tracker "a CheckingTracker shaped [>= max_seqs, >= max_pages_per_seq]".
    from kvmem import CheckingTracker
    from kvmem.testing import faults

    m = make_manager(num_pages=64, tracker=CheckingTracker(16, 32, paranoid=True),
                     max_pages_per_seq=8)
    ids = ["a", "b", "c"]
    for i, rid in enumerate(ids):
        prefill(m, rid, [i, 2, 3, 4, 5])
    for k in range(6):
        assert m.verify(ids, m.reserve(ids, 1 + k % 3)).ok
        m.commit_batch(ids, [[k] * (1 + k % 3)] * 3)
    faults.free_behind_back(m, "b", 1)
    assert m.verify(ids, m.reserve(ids, 1)).aborted.keys() == {"b"}
    m.check()


@pytest.mark.parametrize("tracker", ["checking", "paranoid"])
@pytest.mark.parametrize("form", ["step", "csr", "numpy dict", "block table", "tensors",
                                  "csr tensors", "ids"])
def test_a_write_sent_into_another_requests_page_is_caught_in_every_form(
        make_manager: Any, tracker: str,
                                                                          form: str) -> None:
    """x's page-table entry for the page it writes next is overwritten, between steps, with
    y's partly filled tail (one holder: y). reserve(ids, 2) splices x's CSR entry from the
    previous step (the right page) but takes its slots from the page table: two of the
    step's tokens went to the same slot of y's page. The spliced proof passed it (paranoid
    mode raised: the full check disagreed), and given the CSR alone the full check passed it
    too (the written page has one holder, y). verify must abort x, and only x."""
    mgr, ids = _decoding_three(make_manager, tracker, 2)
    col = mgr.num_committed("x") // P
    y_tail = int(mgr.pages_of("y")[(mgr.num_tokens("y") - 1) // P])
    assert mgr.allocator.refcounts[y_tail] == 1 and col < mgr.pages_of("x").size
    faults.overwrite_page_entry(mgr, "x", col, y_tail)
    step = mgr.reserve(ids, 2)
    x_pages = set((step.slot_mapping[:2] // P).tolist())
    assert y_tail in x_pages  # the fault's consequence: x's tokens would land in y's page
    report = mgr.verify(ids, **forms(step)[form])
    assert list(report.aborted) == ["x"], (form, report.aborted)
    assert mgr.running == ("y", "z")
    assert mgr.verify(["y", "z"]).ok


def test_a_healthy_speculative_step_stays_on_the_spliced_path(make_manager: Any) -> None:
    """The new slot check of k > 1 steps leaves a healthy decode loop proved spliced."""
    mgr, ids = _decoding_three(make_manager, "paranoid", 3)
    before = mgr.verifier.stats
    for _ in range(4):
        assert mgr.verify(ids, mgr.reserve(ids, 3)).ok
        mgr.commit_batch(ids, np.full((3, 3), 5))
    after = mgr.verifier.stats
    assert after.spliced_proved - before.spliced_proved == 4
    assert after.full_checks == before.full_checks


@pytest.mark.parametrize("seed", [*range(3), *(pytest.param(seed, marks=pytest.mark.long)
                                                for seed in range(3, 12))])
def test_fast_paths_agree_with_plain_ones_under_an_engines_sequences(
        make_manager: Any, snapshot: Any, seed: int) -> None:
    """Admissions with prefix hits in two namespaces, chunked prefill beside and inside the
    decode batch, partial and reordered batches, two steps in flight, forks with
    copy-on-write, preemption and resume, batch releases, step fences, a cleared prefix cache
    and faults behind the managers' backs: the fast manager's step metadata equals a fresh
    gather and the plain manager's, its verdicts equal the plain full-entry check's (paranoid
    mode checks every fast answer against the full check), its state equals the plain
    manager's after every move, and until a fault every request reads its own KV."""
    logging.disable(logging.WARNING)
    try:
        drive = _Lockstep(seed, make_manager, snapshot)
        drive.run(120)
    finally:
        logging.disable(logging.NOTSET)
    stats = drive.fast.verifier.stats
    assert stats.spliced_proved > 0 and stats.paranoid_checks >= stats.spliced_proved


def test_a_request_joining_at_the_front_keeps_the_proof_of_the_first_kept_page(
        make_manager: Any) -> None:
    """When a new request joins a verified decode batch at its front, reserve's spliced CSR
    cuts nothing from the batch it spliced from: the proof still counts the first request's
    first page, so a fault on that page afterwards is caught by the next verify."""
    mgr = make_manager(num_pages=64)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 6)
    run_prompt(eng, "b", [2] * 6)
    for _ in range(2):
        step = eng.step(["a", "b"], 1)
        assert mgr.verify(["a", "b"], step).ok
        eng.commit(["a", "b"])
    run_prompt(eng, "z", [3] * 5)  # a prefill alone: checked beside, the proof stays
    ids = ["z", "a", "b"]
    step = eng.step(ids, 1)
    assert mgr.verify(ids, step).ok
    eng.commit(ids)
    faults.free_behind_back(mgr, "a", 0)
    report = mgr.verify(ids, eng.step(ids, 1))
    assert list(report.aborted) == ["a"]


def test_a_page_grown_by_an_unverified_step_is_checked_by_the_next_verify(
        make_manager: Any) -> None:
    """A step reserved and committed without verify becomes the base the next step splices
    from, while the proof still covers the step before it: the next verify must not take
    the splice as proved against that older proof, so a fault on the page the unverified
    step grew is caught."""
    mgr = make_manager(num_pages=64)
    eng = ToyEngine(mgr)
    ids = ["a", "b"]
    run_prompt(eng, "a", [1] * 6)
    run_prompt(eng, "b", [2] * 6)
    for _ in range(2):  # tokens 7 and 8: the proof covers two pages a row
        step = eng.step(ids, 1)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    eng.step(ids, 1)  # token 9: a third page each, not verified
    eng.commit(ids)
    step = eng.step(ids, 1)
    faults.free_behind_back(mgr, "a", 2)
    assert list(mgr.verify(ids, step).aborted) == ["a"]


def _incremental(mgr: KVCacheManager) -> tuple[int, int, int]:
    """(incremental_proved, incremental_declined, full_checks) so far."""
    s = mgr.verifier.stats
    return s.incremental_proved, s.incremental_declined, s.full_checks


@pytest.mark.parametrize("form", ["ids", "step", "csr"])
def test_a_decode_loop_without_step_records_is_proved_by_splicing_the_proof(
        make_manager: Any, form: str) -> None:
    """Metadata that is not reserve's latest record (an engine that builds its own, or step
    records forgotten) is proved by splicing into the proof only the rows that changed: rows
    that grew a page (their proven entries kept up to the cut), a request replaced in its
    batch slot (its old entries cut out), a row re-recorded by ``tracker.record``. A healthy
    loop stays on that path (paranoid mode checks every answer against the full check)."""
    mgr, eng, ids = decoding(make_manager, tracker="paranoid")
    before = _incremental(mgr)
    for i in range(12):
        if i == 5:  # a finished request's batch slot taken by a new one (its tail page freed)
            eng.release("c")
            run_prompt(eng, "c2", [8] * 7)
            ids[ids.index("c")] = "c2"
        if i == 8:  # the same tag recorded again: the row's version changes, nothing else
            row = mgr.row_of("d")
            mgr.tracker.record([row], [0], [mgr.tracker.expected_tags[row, 0]])
        step = eng.step(ids, 1)
        mgr.steps.forget()  # no step record: the incremental path
        assert mgr.verify(ids, **forms(step)[form]).ok
        eng.commit(ids)
    proved, declined, full = _incremental(mgr)
    assert (proved - before[0], declined - before[1], full - before[2]) == (12, 0, 0)
    eng.check_kv()
    mgr.check()


@pytest.mark.parametrize("fault", ["free kept", "free kept of a grown row", "reallocate kept",
                                   "share write page"])
@pytest.mark.parametrize("form", ["ids", "step"])
def test_a_spliced_proof_catches_faults_on_the_entries_it_keeps(make_manager: Any, fault: str,
                                                               form: str) -> None:
    """A page the proof lists (kept by the splice, in a row that did or did not grow a page
    this step) freed or reallocated behind the request's back, or the page it writes shared,
    aborts that request on the incremental path (step records forgotten)."""
    mgr, eng, ids = decoding(make_manager)
    for _ in range(2):  # a proof made without step records
        step = eng.step(ids, 1)
        mgr.steps.forget()
        assert mgr.verify(ids, **forms(step)[form]).ok
        eng.commit(ids)
    grows = [r for r in ids if mgr.num_tokens(r) % P == 0]  # gets a new page next step
    steady = [r for r in ids if r not in grows and r not in "ab"]
    assert grows and steady
    victim = grows[0] if fault == "free kept of a grown row" else steady[0]
    if fault == "share write page":
        step = eng.step(ids, 1)
        faults.share_write_page(mgr, victim)
    else:
        position = mgr.pages_of(victim).size - 1
        if fault == "reallocate kept":
            faults.reallocate_behind_back(mgr, victim, position)
        else:
            faults.free_behind_back(mgr, victim, position)
        step = eng.step(ids, 1)
    mgr.steps.forget()
    report = mgr.verify(ids, **forms(step)[form])
    assert list(report.aborted) == [victim]


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("fault", ["slot astray", "seq_lens", "kv_last_page_len",
                                   "shared write page behind an overwritten entry"])
def test_the_incremental_path_checks_the_steps_slots_lengths_and_writers(
        make_manager: Any, num_tokens: int, fault: str) -> None:
    """Given a step's fields without its step record (the incremental path), verify checks
    its slot mapping against the CSR, its lengths against the requests', and the writers of
    the pages its slot mapping names (not those the page table names: an entry overwritten
    behind the manager's back must not hide a shared page the step writes). Only "c" aborts."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, num_tokens)
    mgr.steps.forget()
    assert mgr.verify(ids, step).ok  # a proof of this batch, made on the incremental path
    eng.commit(ids)
    step = eng.step(ids, num_tokens)
    c, d = ids.index("c"), ids.index("d")
    first = step.qo_indptr.tolist()
    if fault == "slot astray":  # into "d"'s page, which "d" holds alone: one writer
        step.slot_mapping[first[c]] = (step.slot_mapping[first[d]] // P * P
                                       + step.slot_mapping[first[c]] % P)
    elif fault == "shared write page behind an overwritten entry":
        faults.share_write_page(mgr, "c")
        e_tail = int(mgr.pages_of("e")[-1])  # one holder: "e"
        faults.overwrite_page_entry(mgr, "c", mgr.num_committed("c") // P, e_tail)
    else:
        getattr(step, fault)[c] += 1
    mgr.steps.forget()
    before = _incremental(mgr)
    report = mgr.verify(ids, step)
    assert _incremental(mgr)[1] == before[1] + 1  # the incremental path declined
    assert list(report.aborted) == ["c"]
    assert ("holders" if fault.startswith("shared") else
            "slot mapping" if fault == "slot astray" else "lengths") in report.aborted["c"]


def _one_entry(reason: int, expected: int, found: int) -> Any:
    from kvmem.integrity import BadEntries

    return BadEntries(*(np.array([v], dtype=np.int64) for v in (0, 2, 9, expected, found,
                                                                reason)))


@pytest.mark.parametrize("reason, expected, found, num_bad, line", [
    (3, 5 << 20, 8 << 20, 1, "page was reallocated to another lifetime (tag changed) "
                             "(expected tag 5, found 8): position 2, page 9"),
    (3, 5 << 20, 8 << 20, 2, "page was reallocated to another lifetime (tag changed) "
                             "(expected tag 5, found 8): position 2, page 9 (2 bad entries)"),
    (3, 5 << 20 | 1, 5 << 20 | 2, 1, "page holds namespace 2's content, the request is in "
                                     "namespace 1: position 2, page 9"),
    (2, 5 << 20, 0, 1, "page was freed (tag 0) while still mapped: position 2, page 9"),
    (4, 0, 8 << 20, 1, "no page was recorded at this position: position 2, page 9"),
    (1, 5 << 20, -1, 1, "page id out of range: position 2, page 9"),
    (6, 0, -1, 1, "metadata lists a different number of pages than the request maps"),
    (6, 0, -1, 3, "metadata lists a different number of pages than the request maps "
                  "(3 bad entries)"),
])
def test_an_aborted_requests_reason_reads_its_first_bad_entry(
        reason: int, expected: int, found: int, num_bad: int, line: str) -> None:
    """The one readable line an abort logs and reports: what went wrong (tags decoded to
    lifetimes, both given only when both pages were live), where, and how many entries were
    bad when more than one."""
    from kvmem.integrity._full_check import describe

    assert describe(_one_entry(reason, expected, found), 0, num_bad) == line


def test_a_request_with_no_token_yet_in_a_replaced_slot_is_proved_incrementally(
        make_manager: Any) -> None:
    """A request admitted but not reserved yet lists no page: taking a finished request's
    batch slot, it is spliced into the proof as a row of zero entries (nothing cut past it,
    nothing new), and the batch is proved without the full check."""
    mgr, eng, ids = decoding(make_manager, tracker="paranoid")
    mgr.steps.forget()
    assert mgr.verify(ids).ok
    eng.release("c")
    mgr.admit("c2", [8] * 7)
    assert mgr.num_tokens("c2") == 0
    ids[ids.index("c")] = "c2"
    before = _incremental(mgr)
    assert mgr.verify(ids).ok
    assert _incremental(mgr) == (before[0] + 1, before[1], before[2])


def test_a_refused_verify_counts_nothing_and_keeps_the_proof(make_manager: Any) -> None:
    """A CSR malformed as a whole (handed as tensors: the full check's form) is refused
    before the verifier drops its proof or counts a full check: the next step is still
    proved by the spliced check."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    bad = torch.from_numpy(step.kv_indptr.copy())
    bad[1] = bad[2] + 1  # it decreases
    before = mgr.verifier.stats
    with pytest.raises(KVMemError, match="kv_indptr"):
        mgr.verify(ids, kv_indptr=bad, kv_indices=torch.from_numpy(step.kv_indices))
    assert mgr.verifier.stats == before
    spliced = spy_spliced(mgr)
    assert mgr.verify(ids, step).ok
    assert spliced.answers() == (1, 0)


@pytest.mark.parametrize("form", ["block table", "tensors", "csr tensors"])
def test_the_full_checks_report_names_request_ids_and_is_none_when_clean(
        make_manager: Any, form: str) -> None:
    """``report.integrity`` (the tracker's bad entries) labels them with the request ids, on
    the full check of every form; a clean batch has none."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    report = mgr.verify(ids, **forms(step)[form])
    assert report.ok and report.integrity is None
    eng.commit(ids)
    faults.free_behind_back(mgr, "c", 0)
    step = eng.step(ids, 1)
    report = mgr.verify(ids, **forms(step)[form])
    assert report.integrity is not None and report.integrity.failed == ("c",)
    assert list(report.integrity.reasons()) == ["c"]


@pytest.mark.parametrize("page", ["num_pages", "far past"])
def test_a_page_id_past_the_pool_is_out_of_range_on_the_incremental_path(
        make_manager: Any, page: str) -> None:
    """An entry naming no page of the pool (one past the last, or far past) in metadata the
    incremental path checks in full aborts its request as out of range (no IndexError)."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    mgr.steps.forget()
    mgr.verifier.forget()  # nothing proven: every entry is checked in full
    indices = step.kv_indices.copy()
    c_first = int(step.kv_indptr[ids.index("c")])  # (not the page "c" writes: its last)
    indices[c_first] = mgr.num_pages if page == "num_pages" else 10 * mgr.num_pages
    report = mgr.verify(ids, kv_indptr=step.kv_indptr, kv_indices=indices)
    assert list(report.aborted) == ["c"] and "out of range" in report.aborted["c"]


def test_a_batch_that_replaces_the_proof_forgets_the_old_batchs_pages(
        make_manager: Any) -> None:
    """A larger batch takes the proof's place: pages only the old batch listed are no longer
    counted, so freeing them later (the old batch's request released) does not send the new
    batch off the incremental path."""
    mgr = make_manager(num_pages=64, tracker="paranoid")
    eng = ToyEngine(mgr)
    for i, rid in enumerate("vwxyz"):
        run_prompt(eng, rid, [i] * (6 + i))
    old, new = ["v", "w"], ["x", "y", "z"]
    mgr.steps.forget()
    assert mgr.verify(old).ok
    assert mgr.verify(new).ok  # (not a small batch beside the proven one: it replaces it)
    eng.release("v")  # its tail page is freed
    before = _incremental(mgr)
    assert mgr.verify(new).ok
    assert _incremental(mgr) == (before[0] + 1, before[1], before[2])


def test_a_verifier_that_lost_track_of_the_change_log_checks_in_full(
        make_manager: Any) -> None:
    """The allocator's change log keeps a bounded backlog: a verifier that fell behind no
    longer knows which pages changed and must not keep its proof; a page freed behind a
    request's back meanwhile is caught."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    faults.free_behind_back(mgr, "d", 0)
    for _ in range(2100):  # more changes than the log keeps for a slow reader
        mgr.allocator.free(mgr.allocator.allocate(1))
    mgr.steps.forget()
    report = mgr.verify(ids, step)
    assert list(report.aborted) == ["d"]


def test_a_shared_page_zero_about_to_be_written_is_caught(make_manager: Any) -> None:
    """Page 0 is a page like any other: a step about to write into it while another holder
    keeps it aborts the writer (the write set taken from the slot mapping kept page ids > 0
    only)."""
    mgr = make_manager(num_pages=16)
    eng = ToyEngine(mgr)
    run_prompt(eng, "z", [1, 2])
    run_prompt(eng, "o", [3] * 5)
    assert int(mgr.pages_of("z")[0]) == 0
    step = eng.step(["z", "o"], 1)
    faults.share_write_page(mgr, "z")
    report = mgr.verify(["z", "o"], metadata=step.fields())
    assert list(report.aborted) == ["z"] and "holders" in report.aborted["z"]


def test_a_slot_past_the_pool_aborts_its_request(make_manager: Any) -> None:
    """A slot mapping entry past the pool's last slot is the slot check's to report (the
    writer count skips it: no IndexError)."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    step.slot_mapping[ids.index("c")] = mgr.num_pages * P + 1
    report = mgr.verify(ids, metadata=step.fields())
    assert list(report.aborted) == ["c"] and "slot mapping" in report.aborted["c"]


def test_a_step_whose_query_ranges_are_not_the_requests_own_is_caught(
        make_manager: Any) -> None:
    """qo_indptr alone wrong (request "c" starts a token late: "b" gets two queries, "c"
    none): both read another request's queries."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    step.qo_indptr[ids.index("c")] += 1
    report = mgr.verify(ids, step)
    assert list(report.aborted) == ["b", "c"]
    assert all("are not its own: a kernel would read past its tokens or another request's "
               "queries" in why for why in report.aborted.values())


@pytest.mark.parametrize("given", ["kv_indptr", "kv_indices"])
def test_verify_refuses_half_a_csr(make_manager: Any, given: str) -> None:
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    with pytest.raises(ArgumentError, match=r"^verify\(\) needs both kv_indptr and kv_indices"):
        mgr.verify(ids, **{given: getattr(step, given)})
    assert mgr.verify(ids, step).ok


def test_verify_of_a_step_of_another_batch_says_what_to_pass(make_manager: Any) -> None:
    mgr, _eng, ids = decoding(make_manager)
    other = mgr.reserve(ids[:2], 1)
    with pytest.raises(ArgumentError, match=r"a step of 2; pass the StepMetadata the batch's "
                                            r"reserve returned$"):
        mgr.verify(ids, other)


class _OwnTracker:
    """A tracker of the user's own (not a CheckingTracker): it checks like one, and the
    manager knows nothing of its records."""

    enabled = True

    def __init__(self) -> None:
        self.inner = CheckingTracker(8, 16)
        self.recorded: list[list[int]] = []

    def record(self, rows: Any, positions: Any, tags: Any) -> None:
        self.recorded.append(np.asarray(tags).tolist())
        self.inner.record(rows, positions, tags)

    def forget(self, rows: Any) -> None:
        self.inner.forget(rows)

    def verify(self, *args: Any, **kw: Any) -> Any:
        return self.inner.verify(*args, **kw)


def test_a_tracker_of_the_users_own_records_rows_and_aborts_like_a_checking_one(
        make_manager: Any) -> None:
    """A Tracker that is no CheckingTracker is told each new row's tags (``record``) and
    checks every batch in full; a request it fails is released with the pages its row maps
    (nothing recorded to go by), and nothing leaks."""
    tracker = _OwnTracker()
    mgr = make_manager(tracker=tracker)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(9)))
    run_prompt(eng, "b", [7] * 6)
    assert tracker.recorded[0] == mgr.mirror.sync()[mgr.pages_of("a")].tolist()
    faults.reallocate_behind_back(mgr, "b", 0)
    report = mgr.verify(["a", "b"])
    assert list(report.aborted) == ["b"]
    eng.seqs.pop("b")
    assert mgr.verify(["a"]).ok


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["tensors", "csr tensors", "block table tensors"])
def test_verify_of_cuda_metadata_runs_on_the_device(make_manager: Any, form: str) -> None:
    """Tensors on the pool's CUDA device are checked there, against its tag mirror (every
    array the check builds is made on their device), and a fault aborts only its victim."""
    pool = PagePool(PoolSpec(num_layers=1, num_pages=64, num_kv_heads=1, head_dim=8,
                             page_size=P, dtype="fp32", device="cuda"))
    mgr = make_manager(num_pages=64, pool=pool)
    eng = ToyEngine(mgr)
    ids = ["a", "b", "c"]
    for i, rid in enumerate(ids):
        run_prompt(eng, rid, [i] * (5 + 3 * i))
    step = eng.step(ids, 1)
    t = step.tensors("cuda")
    md: dict[str, Any] = {
        "tensors": {"metadata": t},
        "csr tensors": {"kv_indptr": t["kv_indptr"], "kv_indices": t["kv_indices"]},
        "block table tensors": {"metadata": {"block_table": t["block_table"],
                                             "slot_mapping": t["slot_mapping"],
                                             "seq_lens": t["seq_lens"]}},
    }[form]
    assert mgr.verify(ids, **md).ok
    faults.free_behind_back(mgr, "c", 0)
    report = mgr.verify(ids, **md)
    assert list(report.aborted) == ["c"] and "freed" in report.aborted["c"]


@pytest.mark.parametrize("kwargs, kind, message", [
    (lambda s: {"step": s, "metadata": s.fields()}, ArgumentError,
     r"^verify\(\) takes metadata= alone, without step or kv_indptr/kv_indices$"),
    (lambda s: {"metadata": [1]}, ArgumentError,
     r"^metadata must be a mapping of field names to arrays, got list$"),
    (lambda s: {"metadata": {"kv_indptr": s.kv_indptr, "kv_indices": s.kv_indices}},
     ArgumentError, r"^verify\(metadata=\.\.\.\) got \['kv_indices', 'kv_indptr'\]; it needs "
                    r"slot_mapping and either kv_indptr \+ kv_indices or block_table \(the "
                    r"names of step\.tensors\(device\)\)$"),
    (lambda s: {"metadata": {"slot_mapping": s.slot_mapping}}, ArgumentError,
     r"^verify\(metadata=\.\.\.\) got \['slot_mapping'\]; it needs"),
    (lambda s: {"kv_indptr": s.kv_indptr.astype(np.uint64), "kv_indices": s.kv_indices},
     KVMemError, r"^kv_indptr has dtype uint64: expected int32 or int64 \(the dtypes kernels "
                 r"read\)\. Nothing was checked or changed$"),
    (lambda s: {"step": 3}, ArgumentTypeError,
     r"^step=3 \(int\): expected the StepMetadata the batch's reserve returned \(or None\)$"),
])
def test_verify_refuses_metadata_it_cannot_resolve_saying_what_to_pass(
        make_manager: Any, snapshot: Any, kwargs: Any, kind: type, message: str) -> None:
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    before = snapshot(mgr)
    with pytest.raises(kind, match=message):
        mgr.verify(ids, **kwargs(step))
    assert snapshot(mgr) == before
    assert mgr.verify(ids, step).ok


def test_a_step_partly_committed_before_its_verify_is_not_proved_by_its_record(
        make_manager: Any) -> None:
    """Once some of a step's slots are committed, its record no longer holds the step's write
    set: verify sets the record aside (the spliced check is not even tried) and checks the
    rows as they are."""
    mgr, ids = _decoding_three(make_manager, "paranoid", 3)
    step = mgr.reserve(ids, 3)
    mgr.commit("y", [5])
    spliced = spy_spliced(mgr)
    assert mgr.verify(ids, step).ok
    assert spliced.answers() == (0, 0)


@pytest.mark.parametrize("form", ["csr", "ids"])
def test_a_decode_write_the_page_table_sends_astray_after_reserve_is_caught(
        make_manager: Any, form: str) -> None:
    """Decode step (k = 1), no slot mapping given: the token goes where the page table says.
    x's entry for the page it writes is overwritten after reserve with y's tail (one holder,
    y): the spliced check must see that the table no longer names the page reserve planned,
    and verify aborts x only."""
    mgr, ids = _decoding_three(make_manager, "checking", 1)
    step = mgr.reserve(ids, 1)
    col = (mgr.num_tokens("x") - 1) // P
    y_tail = int(mgr.pages_of("y")[(mgr.num_tokens("y") - 1) // P])
    faults.overwrite_page_entry(mgr, "x", col, y_tail)
    spliced = spy_spliced(mgr)
    report = mgr.verify(ids, **forms(step)[form])
    assert spliced.answers() == (0, 1)
    assert list(report.aborted) == ["x"]


def test_each_full_check_is_counted_once(make_manager: Any) -> None:
    """``stats.full_checks`` counts the full checks run: one per verify of tensor metadata."""
    mgr, eng, ids = decoding(make_manager)
    before = mgr.verifier.stats.full_checks
    for _ in range(2):
        step = eng.step(ids, 1)
        assert mgr.verify(ids, metadata=step.tensors("cpu")).ok
        eng.commit(ids)
    assert mgr.verifier.stats.full_checks == before + 2


def test_a_record_changed_since_reserve_sends_the_step_to_the_full_check(
        make_manager: Any) -> None:
    """``tracker.record`` (anyone may call it) after reserve changes what a row expects: the
    spliced check cannot prove the step, and the full check aborts the row whose record no
    longer matches its page."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    row = mgr.row_of("c")
    stale = (1 << 40) << 20  # a lifetime no page has had
    mgr.tracker.record([row], [0], [stale])
    spliced = spy_spliced(mgr)
    report = mgr.verify(ids, step)
    assert spliced.answers() == (0, 1)
    assert list(report.aborted) == ["c"]


def test_a_step_spliced_from_an_unverified_one_is_not_proved_by_an_older_proof(
        make_manager: Any) -> None:
    """reserve splices step n + 1 from step n; if step n was never verified, the proof is of
    an older step and does not cover the entries step n added. A page step n added, then
    reallocated behind its request's back (still one holder), is caught at step n + 1."""
    mgr, eng, ids = decoding(make_manager)
    grows = [r for r in ids if mgr.num_tokens(r) % P == 0]  # gets a new page at step n
    assert grows
    victim = grows[0]
    eng.step(ids, 1)  # step n: not verified
    eng.commit(ids)
    faults.reallocate_behind_back(mgr, victim, mgr.pages_of(victim).size - 1)
    step = eng.step(ids, 1)
    report = mgr.verify(ids, step)
    assert list(report.aborted) == [victim]


def test_num_new_tokens_alone_wrong_on_a_decode_step_is_caught(make_manager: Any) -> None:
    """num_new_tokens is compared on the spliced path too (its query ranges left right)."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    step.num_new_tokens[ids.index("c")] += 1
    report = mgr.verify(ids, step)
    assert list(report.aborted) == ["c"] and "lengths" in report.aborted["c"]


@pytest.mark.parametrize("joining", [True, False])
def test_a_joining_step_whose_written_page_has_another_holder_is_aborted(
        make_manager: Any, joining: bool) -> None:
    """The verifier's check of a decode step that a request joined (``_mixed_writes_ok``: the
    one-token rows vectorized, the joining row by its slice) finds a page that the step
    writes and that another holder shares, in a one-token row's page or in the joining
    row's, and the full check then aborts that request alone (the paranoid tracker would
    raise had the fast check proved the batch)."""
    mgr = make_manager(num_pages=64, max_seqs=8, tracker="paranoid")
    P = mgr.page_size
    for i in range(4):
        mgr.admit(i, list(range(10 * i, 10 * i + 2 * P)))
    mgr.reserve([0, 1, 2, 3], [2 * P] * 4)
    mgr.commit_batch([0, 1, 2, 3], [list(range(10 * i, 10 * i + 2 * P)) for i in range(4)])
    mgr.admit(4, list(range(100, 100 + 3 * P)))
    ids = [0, 1, 2, 3, 4]
    step = mgr.reserve(ids, [1, 1, 1, 1, 3 * P])
    taken: list[Any] = []
    mixed = mgr.verifier._mixed_writes_ok
    mgr.verifier._mixed_writes_ok = lambda b: taken.append(mixed(b)) or taken[-1]
    victim = 4 if joining else 1
    written = int(mgr.pages_of(victim)[-1])  # (the one-token rows write their third page)
    mgr.allocator.share_distinct(np.array([written], dtype=np.int32))  # behind kvmem's back
    report = mgr.verify(ids, step)
    assert taken and taken[0] is False
    assert list(report.aborted) == [victim]
