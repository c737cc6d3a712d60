"""KVCacheManager.verify against faults: every fault, in every form of metadata, aborts its
victims and only them."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from kvmem import KVMemError
from kvmem.errors import ArgumentError, IntegrityError, MetadataError
from kvmem.manager import KVCacheManager, StepMetadata
from kvmem.testing import ToyEngine, faults

P = 4


def decoding(make_manager: Any, mgr: KVCacheManager | None = None, steps: int = 3
             ) -> tuple[KVCacheManager, ToyEngine, list[str]]:
    """Five requests (two share a prefix) that decoded a few verified steps."""
    mgr = mgr or make_manager(num_pages=64, tracker="paranoid")
    eng = ToyEngine(mgr)
    ids = ["a", "b", "c", "d", "e"]
    for i, rid in enumerate(ids):
        prompt = list(range(10)) if rid in "ab" else [i] * (5 + 3 * i)
        res = eng.admit(rid, prompt)
        eng.step([rid], len(prompt) - res.num_cached_tokens)
        eng.commit([rid])
    for _ in range(steps):
        assert mgr.verify(ids, eng.step(ids, 1)).ok
        eng.commit(ids)
    return mgr, eng, ids


def forms(step: StepMetadata) -> dict[str, dict[str, Any]]:
    """The ways of calling verify with a step's metadata (keyword arguments)."""
    tensors = step.tensors("cpu")
    numpy_fields = step.fields()
    return {
        "ids": {},
        "step": {"step": step},
        "csr": {"kv_indptr": step.kv_indptr, "kv_indices": step.kv_indices},
        "numpy dict": {"metadata": numpy_fields},
        "block table": {"metadata": {"block_table": step.block_table,
                                     "slot_mapping": step.slot_mapping,
                                     "seq_lens": step.seq_lens}},
        "tensors": {"metadata": tensors},
    }


BAD = {
    "indptr decreases": lambda s: {"kv_indptr": np.array([0, 3, 2, 5, 6, 8], np.int32),
                                   "kv_indices": s.kv_indices[:8]},
    "indptr too short": lambda s: {"kv_indptr": s.kv_indptr[:-1], "kv_indices": s.kv_indices},
    "indptr of floats": lambda s: {"kv_indptr": s.kv_indptr.astype(float),
                                   "kv_indices": s.kv_indices},
    "indices 2-D": lambda s: {"kv_indptr": s.kv_indptr, "kv_indices": s.kv_indices[None]},
    "lists": lambda s: {"kv_indptr": s.kv_indptr.tolist(), "kv_indices": s.kv_indices.tolist()},
    "tensor of a wrong shape": lambda s: {"kv_indptr": torch.from_numpy(s.kv_indptr[:-2]),
                                          "kv_indices": torch.from_numpy(s.kv_indices)},
    "block table missing a row": lambda s: {"metadata": {"block_table": s.block_table[1:],
                                                         "slot_mapping": s.slot_mapping}},
    "block table 1-D": lambda s: {"metadata": {"block_table": s.block_table[0],
                                               "slot_mapping": s.slot_mapping}},
    "slot mapping too short": lambda s: {"metadata": {**s.fields(),
                                                      "slot_mapping": s.slot_mapping[:2]}},
    "slot mapping 2-D": lambda s: {"metadata": {**s.fields(),
                                                "slot_mapping": s.slot_mapping[None]}},
    "seq_lens too long": lambda s: {"metadata": {**s.fields(),
                                                 "seq_lens": np.append(s.seq_lens, 1)}},
    "qo_indptr tensor too short": lambda s: {"metadata": {
        **s.tensors("cpu"), "qo_indptr": torch.from_numpy(s.qo_indptr[:-1])}},
}


def pooled(make_manager: Any) -> tuple[KVCacheManager, Any]:
    from kvmem.cuda import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=64, num_kv_heads=1, head_dim=8,
                             page_size=P, dtype="fp32", device="cpu"))
    return make_manager(pool=pool, num_pages=64, tracker="paranoid"), pool


FAULTS = {
    "free": lambda m, r: faults.free_behind_back(m, r, 0),
    "reallocate": lambda m, r: faults.reallocate_behind_back(m, r, 0),
    "overwrite": lambda m, r: faults.overwrite_page_entry(m, r, 0, int(m.pages_of("x0")[0])),
    "share write page": lambda m, r: faults.share_write_page(m, r),
    "drain log": lambda m, r: (faults.free_behind_back(m, r, 0),
                               m.allocator.pop_changed_pages())[0],
}


def verified(mgr: KVCacheManager, eng: ToyEngine, ids: list[str], step: StepMetadata, form: str,
             victim: str | None, fault: str, allowed: set[str]) -> Any:
    """verify ``step`` in ``form``: what it aborts is within ``allowed`` and includes the
    victim (except when only the page table was overwritten after the step's metadata was
    built: that metadata is still right, release copes later). Without a victim the batch
    commits and reads back its own K/V. The report, or None after a fault."""
    report = mgr.verify(ids, **forms(step)[form])
    assert set(report.aborted) <= allowed, (form, fault, report.aborted)
    for rid in report.aborted:
        eng.seqs.pop(rid)
    if victim is not None:
        if fault != "overwrite" or form == "ids":
            assert victim in report.aborted, (form, fault)
        return None
    ok = [r for r in ids if r not in report.aborted and r in mgr.running]
    eng.commit(ok)
    eng.check_kv(ok)
    return report


def test_a_short_or_long_csr_is_refused_never_passed(make_manager: Any, snapshot: Any) -> None:
    """Finding 1: with a request that reads 2 pages, a CSR listing one entry passed."""
    mgr = make_manager(num_pages=64, tracker="paranoid")
    mgr.admit("a", np.arange(6))
    s = mgr.reserve(["a"], 6)
    assert s.kv_indptr.tolist() == [0, 2]
    before = snapshot(mgr)
    for indices in (s.kv_indices[:1], s.kv_indices[1:], np.concatenate([s.kv_indices, [0]])):
        with pytest.raises(MetadataError, match="kv_indptr"):
            mgr.verify(["a"], kv_indptr=s.kv_indptr, kv_indices=indices)
    assert snapshot(mgr) == before
    assert mgr.verify(["a"], kv_indptr=s.kv_indptr, kv_indices=s.kv_indices).ok


@pytest.mark.parametrize("bad", sorted(BAD))
def test_malformed_metadata_is_refused_before_anything_changes(
        make_manager: Any, snapshot: Any, bad: str) -> None:
    """Finding 2: these crashed verify with numpy/torch errors; now MetadataError."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    before = snapshot(mgr)
    with pytest.raises(MetadataError) as info:
        mgr.verify(ids, **BAD[bad](step))
    assert isinstance(info.value, KVMemError) and isinstance(info.value, ValueError)
    assert any(name in str(info.value) for name in (
        "kv_indptr", "kv_indices", "block_table", "slot_mapping", "seq_lens", "qo_indptr"))
    assert snapshot(mgr) == before
    assert mgr.verify(ids, step).ok  # the real metadata still verifies


def test_a_block_table_wider_than_the_rows_is_fine_when_padded(make_manager: Any) -> None:
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    wide = np.full((len(ids), 40), -1, dtype=np.int32)
    wide[:, : step.block_table.shape[1]] = step.block_table
    meta = {"block_table": wide, "slot_mapping": step.slot_mapping}
    assert mgr.verify(ids, metadata=meta).ok
    wide[1, 39] = int(mgr.pages_of("d")[0])  # a stale column far past the row's pages
    assert list(mgr.verify(ids, metadata=meta).aborted) == [ids[1]]


@pytest.mark.parametrize("form", ["ids", "step", "csr", "numpy dict", "block table", "tensors"])
def test_a_drained_change_log_hides_no_freed_page(make_manager: Any, form: str) -> None:
    """Finding 3: free a page of "d" behind the manager's back, drain the allocator's public
    log (as PagePool.sync_tags does), then reserve + verify: every form aborts "d"."""
    mgr, eng, ids = decoding(make_manager, make_manager(tracker="checking", num_pages=64))
    faults.free_behind_back(mgr, "d", 0)
    mgr.allocator.pop_changed_pages()
    step = eng.step(ids, 1)
    report = mgr.verify(ids, **forms(step)[form])
    assert list(report.aborted) == ["d"], report.aborted


def test_change_log_readers_have_their_own_cursors() -> None:
    from kvmem.allocator import PageAllocator

    alloc = PageAllocator(8)
    mine, yours = alloc.changes.reader(), alloc.changes.reader()
    pages = alloc.allocate(3)
    assert alloc.pop_changed_pages().tolist() == [0, 1, 2]
    assert mine.read_pages().tolist() == [0, 1, 2]  # the pop hid nothing from this reader
    alloc.free(pages[:1])
    assert yours.read_pages().tolist() == [0, 1, 2]
    assert mine.read_pages().tolist() == [0] and mine.read_pages().tolist() == []


def test_a_reader_that_falls_too_far_behind_is_told_so() -> None:
    from kvmem.allocator import ChangeLog

    log = ChangeLog(limit=4)
    slow, fast = log.reader(), log.reader()
    for i in range(10):
        log.append(np.array([i], dtype=np.int32))
        assert fast.read() is not None
    assert slow.read() is None  # lost: "anything may have changed"
    log.append(np.array([42], dtype=np.int32))
    assert [a.tolist() for a in slow.read() or []] == [[42]]  # back in step


def test_nobody_but_the_manager_writes_a_managed_pools_tags(make_manager: Any) -> None:
    """Finding 4: sync_tags on a managed pool wrote raw tags over the qualified ones, and the
    next verify of device metadata aborted a healthy request."""
    mgr, pool = pooled(make_manager)
    _, eng, ids = decoding(make_manager, mgr)
    before = pool.tags.clone()
    for call in (lambda: pool.sync_tags(mgr.allocator), lambda: pool.load_tags(before * 0),
                 lambda: pool.update_tags([0], [5])):
        with pytest.raises(KVMemError, match="written by the KVCacheManager"):
            call()
    assert torch.equal(pool.tags, before)
    step = eng.step(ids, 1)
    assert mgr.verify(ids, metadata=step.tensors("cpu")).ok
    assert torch.equal(pool.tags, torch.as_tensor(mgr.mirror.sync()))
    with pytest.raises(KVMemError, match="already claimed"):
        make_manager(pool=pool, num_pages=64, tracker="paranoid")


def test_an_unmanaged_pool_still_follows_an_allocator() -> None:
    from kvmem.allocator import PageAllocator
    from kvmem.cuda import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=8, num_kv_heads=1, head_dim=8,
                             page_size=P, dtype="fp32", device="cpu"))
    alloc = PageAllocator(8)
    alloc.allocate(2)
    assert pool.sync_tags(alloc) == 2 and pool.tags[:3].tolist() == [1, 2, 0]


@pytest.mark.parametrize("how", ["release", "preempt", "release_batch"])
def test_release_of_a_row_overwritten_behind_the_managers_back(make_manager: Any, how: str) -> None:
    """Finding 5: a row entry overwritten after the step's metadata was built: verify of that
    metadata passes, and release then dropped another request's reference and leaked its own."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    failures: list[Any] = []
    mgr.add_hook("integrity_failure", lambda e: failures.append(e.request_id))
    own = int(mgr.pages_of("c")[0])
    other = int(mgr.pages_of("e")[0])
    held = int(mgr.allocator.refcounts[other])
    faults.overwrite_page_entry(mgr, "c", 0, other)
    assert mgr.verify(ids, step).ok  # the metadata handed out is right
    eng.commit(ids)
    if how == "release_batch":
        mgr.release_batch(["c"])
    else:
        getattr(mgr, how)("c")
    assert int(mgr.allocator.refcounts[other]) == held  # "e"'s page untouched
    assert int(mgr.allocator.refcounts[own]) == 0 or mgr.cache is not None
    assert failures == ["c"] and mgr.stats().num_integrity_failures == 1
    mgr.check()  # nothing leaked, nothing over-freed
    rest = [r for r in ids if r != "c"]
    eng.seqs.pop("c")
    assert mgr.verify(rest, eng.step(rest, 1)).ok


def test_a_healthy_release_counts_no_failure(make_manager: Any) -> None:
    mgr, eng, _ = decoding(make_manager)
    eng.release("c")
    mgr.release_batch(["a", "d"])
    assert mgr.stats().num_integrity_failures == 0
    mgr.check()


def test_a_request_listed_twice_in_verify_is_refused(make_manager: Any, snapshot: Any) -> None:
    """Finding 6: a failing request listed twice was aborted once, then a KeyError escaped."""
    mgr, _, _ = decoding(make_manager)
    faults.free_behind_back(mgr, "c", 0)
    before = snapshot(mgr)
    with pytest.raises(ArgumentError, match="distinct"):
        mgr.verify(["c", "a", "c"])
    assert snapshot(mgr) == before
    assert list(mgr.verify(["c", "a"]).aborted) == ["c"]


def test_paranoid_mode_fires_when_a_fast_path_is_wrong(make_manager: Any) -> None:
    """The detector behind the differential test: a fast path made to lie is caught by the
    full check beside it. The lie: reserve's record of the step's CSR (what the quick check of
    a decode step trusts for the entries it did not splice in) lists another request's page,
    and so does the step handed out, as a bug in reserve would make them."""
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    b = mgr.steps.latest
    assert b is not None and b.splice is not None
    c = ids.index("c")
    j = int(b.indptr[c])  # c's first page: kept from the proven step, not spliced in
    b.indices[j] = step.kv_indices[j] = int(mgr.pages_of("e")[0])
    with pytest.raises(IntegrityError, match="paranoid"):
        mgr.verify(ids, step)
    quiet = make_manager(tracker="checking",
                         num_pages=64)  # without paranoid mode the lie would pass
    _, eng2, _ = decoding(make_manager, quiet)
    step = eng2.step(ids, 1)
    b = quiet.steps.latest
    assert b is not None
    b.indices[j] = step.kv_indices[j] = int(quiet.pages_of("e")[0])
    assert quiet.verify(ids, step).ok


@pytest.mark.parametrize("seed", range(int(os.environ.get("KVMEM_DIFF_SEEDS", "30"))))
def test_every_form_gives_the_full_checks_verdict_under_random_faults(
        make_manager: Any, seed: int) -> None:
    """A differential test in paranoid mode: random decode runs (admissions, releases,
    replacements, k-token steps), a random fault now and then, and verify in a random form;
    every fast answer is checked by the full check beside it (paranoid raises otherwise), a
    victim is aborted with its batch proceeding, and no healthy request is ever aborted."""
    rng = np.random.default_rng(seed)
    mgr = make_manager(num_pages=96, tracker="paranoid")
    eng = ToyEngine(mgr, seed=seed)
    next_id = 0
    for _ in range(60):
        running = list(mgr.running)
        if len(running) < 5:
            rid = f"x{next_id}"
            next_id += 1
            prompt = rng.integers(0, 4, int(rng.integers(1, 14))).tolist()
            if mgr.can_admit(np.array(prompt)):
                res = eng.admit(rid, prompt)
                eng.step([rid], len(prompt) - res.num_cached_tokens)
                eng.commit([rid])
            continue
        ids = [running[i] for i in rng.permutation(len(running))[: int(rng.integers(1, 6))]]
        k = int(rng.choice([1, 1, 1, 2, 3]))
        if not mgr.can_reserve(ids, k):
            eng.release(running[0])
            continue
        victim, fault = None, ""
        if rng.random() < 0.25 and "x0" in mgr.running and ids[0] != "x0":
            victim = ids[0]
            fault = list(FAULTS)[int(rng.integers(len(FAULTS)))]
        step = eng.step(ids, k)
        allowed = set()
        if victim is not None:
            mapped = {r: set(mgr.pages_of(r).tolist()) for r in ids}
            page = FAULTS[fault](mgr, victim)
            allowed = {victim} | ({r for r in ids if page in mapped[r]}
                                  if fault != "overwrite" else set())
        form = list(forms(step))[int(rng.integers(6))]
        if verified(mgr, eng, ids, step, form, victim, fault, allowed) is None:
            break


@pytest.mark.parametrize("seed", range(int(os.environ.get("KVMEM_DIFF_SEEDS", "30"))))
def test_requests_leaving_and_joining_give_the_full_checks_verdict_under_random_faults(
        make_manager: Any,
        seed: int) -> None:
    """The differential test of a continuous batch: requests finish anywhere in it and join at
    its end (each prefilled alone, checked beside the decode batch), so rows change position
    between steps; now and then a step skips some rows or reorders them. Reserve splices
    from the proven batch by page-table row, and paranoid mode checks every fast answer
    against the full check; a faulted victim is aborted, no healthy request ever is, and most
    decode steps are proved on the spliced path."""
    rng = np.random.default_rng(seed)
    mgr = make_manager(num_pages=96, tracker="paranoid")
    eng = ToyEngine(mgr, seed=seed)
    order: list[str] = []
    decode_steps = 0
    for n in range(80):
        if order and rng.random() < 0.2:
            eng.release(order.pop(int(rng.integers(len(order)))))
        prompt = rng.integers(0, 4, int(rng.integers(1, 14))).tolist()
        if len(order) < 6 and rng.random() < 0.4 and mgr.can_admit(np.array(prompt)):
            rid = f"j{n}"
            res = eng.admit(rid, prompt)
            step = eng.step([rid], len(prompt) - res.num_cached_tokens)
            assert mgr.verify([rid], step).ok
            eng.commit([rid])
            order.append(rid)
        ids = [r for r in order if rng.random() < 0.9] if rng.random() < 0.3 else list(order)
        if len(ids) > 2 and rng.random() < 0.1:
            ids[0], ids[1] = ids[1], ids[0]
        if not ids:
            continue
        if not mgr.can_reserve(ids, 1):
            eng.release(order.pop(0))
            continue
        victim, fault = None, ""
        if rng.random() < 0.15 and len(ids) > 1:
            victim = ids[int(rng.integers(len(ids)))]
            fault = list(FAULTS)[int(rng.integers(len(FAULTS)))]
            if fault == "overwrite" and victim == order[0]:
                victim = None  # (the fault points the victim at order[0]'s page: not a fault)
        step = eng.step(ids, 1)
        decode_steps += 1
        allowed: set[str] = set()
        if victim is not None:
            mapped = {r: set(mgr.pages_of(r).tolist()) for r in ids}
            page = (faults.overwrite_page_entry(mgr, victim, 0, int(mgr.pages_of(order[0])[0]))
                    if fault == "overwrite" else FAULTS[fault](mgr, victim))
            allowed = {victim} | ({r for r in ids if page in mapped[r]}
                                  if fault != "overwrite" else set())
        form = "step" if rng.random() < 0.7 else list(forms(step))[int(rng.integers(6))]
        report = verified(mgr, eng, ids, step, form, victim, fault, allowed)
        if report is None:
            break
        order = [r for r in order if r not in report.aborted]
    stats = mgr.verifier.stats
    assert stats.paranoid_checks >= stats.spliced_proved + stats.incremental_proved
    if decode_steps >= 20:
        assert stats.spliced_proved >= decode_steps // 10, (stats, decode_steps)


def test_requests_that_finish_or_join_keep_the_spliced_path_and_faults_still_caught(
        make_manager: Any) -> None:
    """A request that finishes moves every later one up a position (vLLM's running list), and
    one that joins comes at the end: rows are matched by page-table row, so each next decode
    step still splices from the proven batch and is proved checking only its new pages. A
    page freed behind the manager's back in a row that moved is still caught, and only its
    request is aborted."""
    mgr, eng, _ = decoding(make_manager)

    def decode(batch: list[str]) -> Any:
        before = mgr.verifier.stats
        report = mgr.verify(batch, eng.step(batch, 1))
        after = mgr.verifier.stats
        return report, after.spliced_proved - before.spliced_proved, (
            after.full_checks - before.full_checks)

    eng.release("c")
    batch = ["a", "b", "d", "e"]  # "d", "e" moved up
    report, spliced, full = decode(batch)
    assert report.ok and spliced == 1 and full == 0
    eng.commit(batch)
    eng.admit("f", [9] * 6)
    assert mgr.verify(["f"], eng.step(["f"], 6)).ok  # a prefill beside the decode batch
    eng.commit(["f"])
    batch = ["a", "b", "d", "e", "f"]
    report, spliced, full = decode(batch)
    assert report.ok and spliced == 1 and full == 0
    eng.commit(batch)
    eng.release("a")
    batch = ["b", "d", "e", "f"]
    report, spliced, full = decode(batch)
    assert report.ok and spliced == 1 and full == 0
    eng.commit(batch)
    eng.check_kv(batch)
    faults.free_behind_back(mgr, "e", 0)
    report, spliced, _ = decode(batch)
    assert list(report.aborted) == ["e"] and spliced == 0


def test_a_prefill_verified_between_decode_steps_keeps_the_decode_proof(make_manager: Any) -> None:
    """A one-request prefill chunk verified between two decode steps is checked alone, in
    full; the decode batch's proof survives it, so the next decode step is proved spliced."""
    mgr, eng, ids = decoding(make_manager)
    eng.admit("new", [5] * 7)
    before = mgr.verifier.stats
    assert mgr.verify(["new"], eng.step(["new"], 7)).ok
    eng.commit(["new"])
    assert mgr.verify(ids, eng.step(ids, 1)).ok
    after = mgr.verifier.stats
    assert after.spliced_proved - before.spliced_proved == 1
    assert after.full_checks == before.full_checks
    faults.free_behind_back(mgr, "a", 0)  # and the kept proof still sees a fault
    eng.commit(ids)
    assert mgr.verify(["new"], eng.step(["new"], 1)).ok
    assert "a" in mgr.verify(ids, eng.step(ids, 1)).aborted


def test_step_n_committed_after_step_n_plus_1_was_reserved(make_manager: Any) -> None:
    """Overlap scheduling: reserve n + 1 before committing n. The commit of n lands in n's
    slots (a recent record's fast path) exactly as the general path would put it."""
    fast, slow = make_manager(num_pages=64, tracker="paranoid"), make_manager(num_pages=64,
                                                                              tracker="paranoid")
    for mgr in (fast, slow):
        for rid, n in (("a", 5), ("b", 9)):
            mgr.admit(rid, np.arange(n))
            mgr.reserve([rid], n)
            mgr.commit(rid, np.arange(n))
    ids = ["a", "b"]
    for step in range(6):
        tokens = np.array([100 + step, 200 + step])
        for mgr in (fast, slow):
            mgr.reserve(ids, 1)
            if step:
                previous = tokens - 1
                if mgr is fast:
                    mgr.commit_batch(ids, previous)  # step n, one token each: the fast path
                else:
                    mgr.commit_batch(ids, [previous[:1], previous[1:]])  # ragged: general
    for rid in ids:
        assert fast.tokens_of(rid).tolist() == slow.tokens_of(rid).tolist()
    assert fast.cache is not None and slow.cache is not None
    assert fast.cache.num_cached == slow.cache.num_cached
    fast.check()
    slow.check()


def test_two_steps_in_flight_are_verified_on_the_fast_path_and_faults_still_caught(
        make_manager: Any) -> None:
    """Async scheduling reserves and verifies step n + 1 before step n's tokens are committed:
    the rows' committed counts lag the record's start, which leaves the step's write set as
    reserve made it, so verify answers from the record (paranoid mode checks every answer
    against the full check). A commit into the step's own slots before its verify sends it to
    the general path; a page freed behind the manager's back is still caught."""
    mgr = make_manager(num_pages=64, tracker="paranoid")
    ids = ["a", "b", "c"]
    for i, rid in enumerate(ids):
        prompt = np.arange(5 + 3 * i) + 10 * i
        mgr.admit(rid, prompt)
        mgr.reserve([rid], prompt.size)
        mgr.commit(rid, prompt)
    step_n = mgr.reserve(ids, 1)
    assert mgr.verify(ids, step_n).ok
    for n in range(6):  # step n + 1 reserved and verified, then step n committed
        before = mgr.verifier.stats
        step = mgr.reserve(ids, 1)
        assert mgr.verify(ids, step).ok
        after = mgr.verifier.stats
        assert after.full_checks == before.full_checks
        assert after.paranoid_checks == before.paranoid_checks + 1  # a fast path answered
        assert after.spliced_proved == before.spliced_proved + 1  # ... from reserve's record
        mgr.commit_batch(ids, np.full(3, 100 + n))
    # Committed into its own slots before its verify: the write set shrank; still proved.
    mgr.commit_batch(ids, np.full(3, 7))
    step = mgr.reserve(ids, 1)
    mgr.commit_batch(ids, np.full(3, 8))
    assert mgr.verify(ids, step).ok
    step = mgr.reserve(ids, 1)
    faults.free_behind_back(mgr, "b", 0)
    assert list(mgr.verify(ids, step).aborted) == ["b"]


def test_a_raising_hook_hands_back_the_operations_result(make_manager: Any) -> None:
    from kvmem.manager import HookError

    mgr = make_manager(tracker="checking", num_pages=64)
    mgr.admit("a", [1, 2, 3])

    def boom(event: Any) -> None:
        raise RuntimeError("hook")

    mgr.add_hook("step_begin", boom)
    with pytest.raises(HookError) as info:
        mgr.begin_step()
    handle = info.value.result
    assert handle is not None and mgr.fences.open_steps == (handle.step_id,)
    mgr.retire(handle)


@pytest.mark.parametrize("k", [1, 3])
def test_a_page_table_entry_overwritten_after_reserve_is_caught_without_a_slot_mapping(
        make_manager: Any, k: int
                                                                                       ) -> None:
    """Given only the CSR, a step writes into the pages the page table lists: an entry
    overwritten there after reserve (with a shared page) fails the write check, on the fast
    paths too (the step's own copies still list the right page)."""
    mgr = make_manager(num_pages=32, tracker="checking")
    for rid, prompt in (("a", np.arange(10, 18)), ("b", np.arange(30, 32)),
                        ("c", np.arange(40, 42))):
        mgr.admit(rid, prompt)
        mgr.reserve([rid], prompt.size)
        mgr.commit(rid, prompt)  # a's two full pages are cached: two holders each
    assert mgr.allocator.refcounts[mgr.pages_of("a")[0]] == 2
    for _ in range(2):  # proofs to splice from
        step = mgr.reserve(["b", "c"], k)
        assert not mgr.verify(["b", "c"], step).aborted
        mgr.commit_batch(["b", "c"], np.full((2, k), 7))
    step = mgr.reserve(["b", "c"], k)
    writes_at = mgr.num_committed("b") // mgr.page_size
    faults.overwrite_page_entry(mgr, "b", writes_at, int(mgr.pages_of("a")[0]))
    report = mgr.verify(["b", "c"], kv_indptr=step.kv_indptr, kv_indices=step.kv_indices)
    assert list(report.aborted) == ["b"]
    assert "2 holders" in report.aborted["b"]


def test_one_splice_agrees_with_cutting_and_pasting_by_hand() -> None:
    """kvmem.integrity.splice, which reserve's CSR splice and the verifier's proof both call,
    against the same result built entry by entry: the kept runs of ``old`` with the new pieces
    between them, the pieces and their tags, and the runs of ``old`` left out (what the proof
    uncounts; a run missed there would keep a changed page's count too high, never too low)."""
    from kvmem.integrity import splice

    rng = np.random.default_rng(0)
    for _ in range(300):
        old = rng.integers(0, 1000, int(rng.integers(0, 40))).astype(np.int32)
        bounds = np.sort(rng.integers(0, old.size + 1, 2 * int(rng.integers(0, 6)) + 2))
        lo, hi = bounds[0::2].tolist(), bounds[1::2].tolist()
        new = rng.integers(0, 1000, 60).astype(np.int32)
        tags = rng.integers(1, 1 << 40, 60)
        new_lo = rng.integers(0, 50, len(lo) - 1).tolist()
        num = rng.integers(0, 10, len(lo) - 1).tolist()
        tags_lo = rng.integers(0, 50, len(lo) - 1).tolist()
        got, pieces, wants, gone = splice(old, lo, hi, new, new_lo, num, tags, tags_lo)
        want: list[int] = []
        for i in range(len(lo)):
            want += old[lo[i]:hi[i]].tolist()
            if i < len(num):
                want += new[new_lo[i]:new_lo[i] + num[i]].tolist()
        assert got.tolist() == want
        assert pieces.tolist() == [int(x) for a, n in zip(new_lo, num) for x in new[a:a + n]]
        assert wants.tolist() == [int(x) for a, n in zip(tags_lo, num) for x in tags[a:a + n]]
        kept = np.zeros(old.size, dtype=bool)
        for a, b in zip(lo, hi):
            kept[a:b] = True
        assert (np.concatenate(gone).tolist() if gone else []) == old[~kept].tolist()


@pytest.mark.parametrize("bad", ["indptr decreases", "slot mapping too short"])
def test_refused_metadata_leaves_the_verifiers_proof_and_counters_as_they_were(
        make_manager: Any, bad: str) -> None:
    """A verify refused for malformed metadata changes nothing. What broke: it counted a
    declined spliced or incremental check, and for a short slot mapping beside reserve's own
    CSR dropped the verifier's held proof, before refusing (found by the whole-state snapshot).
    """
    mgr, eng, ids = decoding(make_manager)
    step = eng.step(ids, 1)
    verifier: Any = mgr.verifier
    proof, refs, counts = verifier._proof, verifier._refs.tobytes(), dict(verifier._counts)
    with pytest.raises(MetadataError):
        mgr.verify(ids, **BAD[bad](step))
    assert verifier._proof is proof
    assert (verifier._refs.tobytes(), dict(verifier._counts)) == (refs, counts)
