"""The manager's promises against its fast paths (a second audit): every form of verify gives
the full check's verdict and that verdict catches a write into another request's page; the
spliced CSR, the decode commit and the incremental proofs agree with the plain paths under an
engine's sequences; bad input raises a kvmem error and changes nothing."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from kvmem import ArgumentTypeError, KVMemError
from kvmem.manager import KVCacheManager, StepMetadata
from kvmem.testing import ToyEngine, faults

P = 4


def make(**kw: Any) -> KVCacheManager:
    kw.setdefault("tracker", "paranoid")
    return KVCacheManager(num_pages=kw.pop("num_pages", 64), page_size=P,
                          max_seqs=kw.pop("max_seqs", 10), max_pages_per_seq=16, watermark=0.0,
                          **kw)


def snapshot(m: KVCacheManager) -> tuple[Any, ...]:
    """Tags, refcounts, free count, page table, per-row state, page tokens, stats, registry."""
    t = m.table
    return (m.allocator.tags.tobytes(), m.allocator.refcounts.tobytes(), m.allocator.num_free,
            t.pages.tobytes(), t.num_tokens.tobytes(), t.num_committed.tobytes(),
            t.write_from.tobytes(), m.pages.tokens.tobytes(), m.stats(), m.running, m.preempted,
            m.fences.held.tobytes(), 0 if m.cache is None else m.cache.num_cached)


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


# -- verify: a row entry changed between steps sends a write into another request's page --------


def _decoding_three(tracker: str, k: int) -> tuple[KVCacheManager, list[str]]:
    mgr = make(tracker=tracker)
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


@pytest.mark.parametrize("tracker", ["checking", "paranoid"])
@pytest.mark.parametrize("form", ["step", "csr", "numpy dict", "block table", "tensors",
                                  "csr tensors", "ids"])
def test_a_write_sent_into_another_requests_page_is_caught_in_every_form(tracker: str,
                                                                          form: str) -> None:
    """x's page-table entry for the page it writes next is overwritten, between steps, with
    y's partly filled tail (one holder: y). reserve(ids, 2) splices x's CSR entry from the
    previous step (the right page) but takes its slots from the page table: two of the
    step's tokens went to the same slot of y's page. The spliced proof passed it (paranoid
    mode raised: the full check disagreed), and given the CSR alone the full check passed it
    too (the written page has one holder, y). verify must abort x, and only x."""
    mgr, ids = _decoding_three(tracker, 2)
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


def test_a_healthy_speculative_step_stays_on_the_spliced_path() -> None:
    """The new slot check of k > 1 steps leaves a healthy decode loop proved spliced."""
    mgr, ids = _decoding_three("paranoid", 3)
    before = mgr.verifier.stats
    for _ in range(4):
        assert mgr.verify(ids, mgr.reserve(ids, 3)).ok
        mgr.commit_batch(ids, np.full((3, 3), 5))
    after = mgr.verifier.stats
    assert after.spliced_proved - before.spliced_proved == 4
    assert after.full_checks == before.full_checks


# -- hostile arguments: a kvmem error, nothing changed ---------------------------------------------


def _busy() -> KVCacheManager:
    mgr = make()
    for rid, prompt in (("a", list(range(9))), ("b", list(range(9))), ("c", [7] * 5),
                        ("p", [3] * 6)):
        res = mgr.admit(rid, prompt)
        mgr.reserve([rid], len(prompt) - res.num_cached_tokens)
        mgr.commit(rid, prompt[res.num_cached_tokens:])
    mgr.preempt("p")
    mgr.reserve(["a", "c"], 1)  # a decode step reserved: the fast paths' records exist
    return mgr


BOOL_TOKENS = [[5, True], (np.True_, 3, 4), [1, 2, False]]
CALLS = {
    "admit": lambda m, v: m.admit("new", v),
    "can_admit": lambda m, v: m.can_admit(v),
    "match_prefix": lambda m, v: m.match_prefix(v),
    "resume": lambda m, v: m.resume("p", v),
    "commit": lambda m, v: m.commit("a", v),
    "commit_batch ragged": lambda m, v: m.commit_batch(["a", "c"], [v, [1]]),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("tokens", BOOL_TOKENS, ids=["int-bool", "npbool-int", "int-false"])
def test_a_token_list_holding_a_bool_is_refused(call: str, tokens: Any) -> None:
    """errors.md: integer-like is never a bool, and a list holding a bool is refused; numpy
    reads [5, True] as [5, 1], so it was taken as token 1."""
    mgr = _busy()
    before = snapshot(mgr)
    with pytest.raises(ArgumentTypeError, match="bool"):
        CALLS[call](mgr, tokens)
    assert snapshot(mgr) == before
    mgr.check()


@pytest.mark.parametrize("bad", [torch.tensor(5), np.array(5), np.int64(5), 5],
                         ids=["0-d tensor", "0-d array", "numpy scalar", "int"])
def test_commit_batch_refuses_one_scalar_for_a_batch(bad: Any) -> None:
    """A 0-d tensor (or array) raised numpy's 'len() of unsized object' TypeError."""
    mgr = _busy()
    before = snapshot(mgr)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        mgr.commit_batch(["a", "c"], bad)
    assert snapshot(mgr) == before
    mgr.commit_batch(["a", "c"], torch.tensor([5, 6]))  # ... and the batch still commits


BAD_IDS = [1.5, float("nan"), None, True, np.True_, b"x", (1, 2), torch.tensor(3), object()]


@pytest.mark.parametrize("bad", BAD_IDS, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("call", ["admit", "fork"])
def test_a_request_id_is_a_str_or_an_int(call: str, bad: Any) -> None:
    """errors.md, manager.md: request ids are the engine's, str or int. A float, None, a
    bool (True is not request 1 here), bytes, a tuple, a tensor or an object were admitted."""
    mgr = _busy()
    before = snapshot(mgr)
    with pytest.raises(ArgumentTypeError, match="request_id"):
        if call == "admit":
            mgr.admit(bad, [1, 2, 3])
        else:
            mgr.fork("c", bad)
    assert snapshot(mgr) == before


def test_a_numpy_integer_request_id_is_its_int() -> None:
    mgr = make()
    mgr.admit(np.int64(7), [1, 2, 3])
    assert mgr.running == (7,) and mgr.num_tokens(7) == 0
    mgr.reserve([7], 3)
    mgr.commit(np.int32(7), [1, 2, 3])
    mgr.fork(7, np.int16(8))
    assert mgr.running == (7, 8)
    with pytest.raises(KVMemError, match="already known"):
        mgr.admit(8, [4])


# -- the fast paths against the plain ones, in lockstep ----------------------------------------


class _Lockstep:
    """Two managers driven alike: ``fast`` takes every fast path (paranoid), ``plain`` is sent
    down the plain ones (its step records and proof forgotten before every reserve and verify,
    its commits ragged). Their step metadata, verdicts and states must be equal."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.fast, self.plain = make(num_pages=80), make(num_pages=80)
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
            assert snapshot(self.fast) == snapshot(self.plain)
            if not self.faulted:
                self.eng(self.fast).check_kv()
                self.fast.check()


@pytest.mark.parametrize("seed", range(12))
def test_fast_paths_agree_with_plain_ones_under_an_engines_sequences(seed: int) -> None:
    """Admissions with prefix hits in two namespaces, chunked prefill beside and inside the
    decode batch, partial and reordered batches, two steps in flight, forks with
    copy-on-write, preemption and resume, batch releases, step fences, a cleared prefix cache
    and faults behind the managers' backs: the fast manager's step metadata equals a fresh
    gather and the plain manager's, its verdicts equal the plain full-entry check's (paranoid
    mode checks every fast answer against the full check), its state equals the plain
    manager's after every move, and until a fault every request reads its own KV."""
    logging.disable(logging.WARNING)
    try:
        drive = _Lockstep(seed)
        drive.run(120)
    finally:
        logging.disable(logging.NOTSET)
    stats = drive.fast.verifier.stats
    assert stats.spliced_proved > 0 and stats.paranoid_checks >= stats.spliced_proved


# -- a step fence holds a lifetime, not a page id ------------------------------------------------


@pytest.mark.parametrize("released", [1, 2])
def test_a_fence_never_frees_a_page_whose_lifetime_ended_behind_its_back(released: int) -> None:
    """Requests sharing a prefix page are released while a step is in flight (the fence holds
    their references); the page is then freed behind everyone's back and handed to a new
    request. retire freed the fence's references again: the new request's page was freed
    under it (one reference), or retire raised InvalidFreeError after it had closed the step
    (two). A fence holds a lifetime: retire frees nothing of a lifetime that already ended,
    the new request keeps its page, and only the request that mapped the lost page fails."""
    mgr = make(num_pages=8, tracker="checking")
    prompt = np.arange(5)
    for rid in ("a", "b", "c"):
        res = mgr.admit(rid, prompt)
        mgr.reserve([rid], prompt.size - res.num_cached_tokens)
        mgr.commit(rid, prompt[res.num_cached_tokens:])
    shared = int(mgr.pages_of("a")[0])
    assert [int(mgr.pages_of(r)[0]) for r in "bc"] == [shared, shared]
    handle = mgr.begin_step()
    mgr.release_batch(["a", "b"][:released])
    faults.free_behind_back(mgr, "c", 0)  # every holder's reference, the fence's too
    mgr.admit("d", np.arange(20, 26))  # takes the free pages, the lost one among them
    assert shared in mgr.pages_of("d").tolist()
    tag = int(mgr.allocator.tags[shared])
    mgr.retire(handle)
    assert int(mgr.allocator.tags[shared]) == tag and mgr.allocator.refcounts[shared] == 1
    assert mgr.fences.open_steps == () and not mgr.fences.held.any()
    report = mgr.verify(["c", "d"])
    assert list(report.aborted) == ["c"]


# -- docs/manager.md's concrete figures -----------------------------------------------------------


def test_the_documented_defaults_dtypes_stats_and_hook_kinds() -> None:
    import dataclasses

    from kvmem.manager import HOOK_KINDS, ManagerStats

    assert KVCacheManager(100, page_size=4, watermark=0.29).watermark_pages == 28
    assert KVCacheManager(1024, page_size=4).config.evict_ahead == 2
    assert KVCacheManager(1024, page_size=4).pages._evict_ahead == 2  # num_pages // 512
    assert KVCacheManager(511, page_size=4).pages._evict_ahead == 0  # exactly what it needs
    assert KVCacheManager(1024, page_size=4, evict_ahead=0).pages._evict_ahead == 0
    assert set(HOOK_KINDS) == {"admit", "allocate", "free", "evict", "preempt", "release",
                               "fork", "step_begin", "step_end", "integrity_failure",
                               "kv_event"}
    stats = {f.name for f in dataclasses.fields(ManagerStats)} | {"usage", "prefix_hit_rate"}
    assert {"num_free", "num_used", "num_cached", "num_fenced", "usage", "num_running",
            "num_preempted", "num_prefix_queries", "prefix_query_tokens", "prefix_hit_tokens",
            "prefix_hit_rate", "num_evictions", "num_preemptions", "num_integrity_failures",
            "num_cow_copies", "num_forks", "steps_in_flight"} <= stats
    mgr = make()
    res = mgr.admit("a", np.arange(9))
    assert res.num_cached_tokens == 0
    step = mgr.reserve(["a"], 9)
    assert step.slot_mapping.dtype == np.int64
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "seq_lens",
                 "num_new_tokens"):
        assert getattr(step, name).dtype == np.int32, name
    assert step.block_table.dtype == np.int32 and step.kv_last_page_len.tolist() == [1]
    mgr.commit("a", np.arange(9))
    again = mgr.admit("b", np.arange(9))  # two full pages cached, the last token computed
    assert again.num_cached_tokens == 8 and again.num_cached_tokens % P == 0
