"""Step fences: pages freed during a step, retire, lost completions, transfers in flight."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from engine_helpers import finished_batch, run_prompt

from kvmem import (
    ArgumentError,
    ArgumentTypeError,
    IntegrityError,
    KVMemError,
    OutOfPagesError,
)
from kvmem.manager import (
    KVCacheManager,
)
from kvmem.testing import ToyEngine, faults

P = 4


def manager() -> KVCacheManager:
    mgr = KVCacheManager(64, page_size=4, max_seqs=8, tracker="checking")
    mgr.admit("a", list(range(10)))
    return mgr


def prefill(m: KVCacheManager, rid: Any, prompt: list[int], ns: Any = None) -> int:
    res = m.admit(rid, prompt, namespace=ns)
    m.reserve([rid], len(prompt) - res.num_cached_tokens)
    m.commit(rid, prompt[res.num_cached_tokens:])
    return res.num_cached_tokens


@pytest.mark.parametrize("fenced", [True, False])
def test_a_request_aborted_while_its_transfer_is_in_flight(make_manager: Any, fenced: bool) -> None:
    """BUGS.md 1: a request receives its prompt K/V by a transfer (P/D); it is aborted while
    the transfer is in flight. The transfer's fence holds the pages until it is done, so the
    tag re-check at completion finds the lifetimes it started with; with the fence switched
    off (``fault_hooks.hold_dropped_pages``) the pages go to the next request and the
    re-check fires."""
    mgr = make_manager(num_pages=4, prefix_cache=None)
    mgr.fault_hooks.hold_dropped_pages = fenced
    eng = ToyEngine(mgr)
    eng.admit("r", list(range(8)))
    pages = mgr.pages_of("r").copy()
    transfer = mgr.begin_step()  # the transfer into r's pages is launched
    launched_tags = mgr.allocator.tags[pages].copy()
    eng.release("r")  # the client aborts it
    if fenced:
        assert mgr.stats().num_fenced == 2
        eng.admit("x", list(range(100, 108)))  # the two pages still free
    else:
        eng.admit("x", list(range(100, 116)))  # takes r's pages too
    # The transfer completes: the tag re-check.
    same = mgr.allocator.tags[pages] == launched_tags
    assert same.all() == fenced
    assert bool(np.isin(pages, mgr.pages_of("x")).any()) != fenced
    mgr.retire(transfer)
    mgr.check()


@pytest.mark.parametrize("retire_frees", [True, False])
def test_a_deferred_free_that_never_completes_breaks_conservation(
        make_manager: Any, retire_frees: bool) -> None:
    """BUGS.md 2: the deferred-free path gets its completion but never frees
    (``fault_hooks.retire_frees`` off): the pages are held by no row, cache or fence, and the
    conservation check (free + used + cached + fenced == total) names them."""
    mgr = make_manager(num_pages=8, prefix_cache=None)
    mgr.fault_hooks.retire_frees = retire_frees
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    pages = mgr.pages_of("a").tolist()
    step = mgr.begin_step()
    eng.release("a")
    mgr.check()  # held by the fence: accounted for
    mgr.retire(step)
    if retire_frees:
        mgr.check()
        assert mgr.allocator.num_free == 8
        return
    with pytest.raises(IntegrityError, match="conservation") as e:
        mgr.check()
    assert f"pages {pages} are held by no row, cache or fence" in str(e.value)


def test_an_idle_manager_holds_no_fenced_page(make_manager: Any) -> None:
    """No pool: a copy-on-write source is held until the engine copied it (the next reserve);
    once no request is left to copy for, it is released and an admission that fits fits."""
    mgr = make_manager(num_pages=6, prefix_cache=None, max_seqs=6, max_pages_per_seq=8)
    mgr.admit("a", [1] * 6)
    mgr.reserve(["a"], 6)
    mgr.commit("a", [1] * 6)
    mgr.fork("a", "b")
    step = mgr.reserve(["a"], 1)  # copies the shared tail: the source is held
    assert step.copy_src.size == 1 and mgr.stats().num_fenced == 0
    mgr.release("a")
    mgr.release("b")
    assert mgr.stats().num_fenced == 0 and mgr.allocator.num_free == 6
    assert mgr.can_admit([1] * 24)
    mgr.admit("c", [1] * 24)


@pytest.mark.parametrize("handle, kind", [(3, ArgumentTypeError), (None, ArgumentTypeError),
                                          ("h", ArgumentTypeError)])
def test_retire_of_something_that_is_no_handle_is_a_type_error(handle: Any, kind: type) -> None:
    mgr = manager()
    h = mgr.begin_step()
    with pytest.raises(kind, match="handle"):
        mgr.retire(handle)
    mgr.retire(h)
    with pytest.raises(ArgumentError, match="not an open step"):
        mgr.retire(h)  # retired twice
    assert mgr.stats().steps_in_flight == 0


def test_step_fences_refuse_pages_out_of_range_before_holding_any() -> None:
    from kvmem import StepFences

    fences = StepFences(8)
    handle = fences.begin()
    for bad, kind in (([-1], ArgumentError), ([8], ArgumentError), (1, ArgumentTypeError)):
        with pytest.raises(kind):
            fences.defer(bad)
        with pytest.raises(kind):
            fences.hold_for_copy(bad)
        assert fences.num_held == 0 and not fences.held.any()
    fences.defer([1, 1])
    assert fences.retire(handle).tolist() == [1, 1]  # nothing else was held
    for bad, kind in ((0, ArgumentError), (True, ArgumentTypeError), (2.0, ArgumentTypeError)):
        with pytest.raises(kind, match=r"^num_pages=.*: expected an integer in 1\.\.2147483647 "):
            StepFences(bad)


def test_pages_released_during_a_step_are_freed_when_it_retires(make_manager: Any) -> None:
    """BUGS 1, 9: pages freed and reused while a launched step still reads them."""
    mgr = make_manager(num_pages=6, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 12)  # 3 pages
    pages = mgr.pages_of("a")
    tags = mgr.allocator.tags[pages].copy()
    h1 = mgr.begin_step()
    h2 = mgr.begin_step()
    eng.release("a")
    s = mgr.stats()
    assert (s.num_free, s.num_fenced, s.steps_in_flight) == (3, 3, 2)
    assert not mgr.can_admit(np.arange(16))
    with pytest.raises(OutOfPagesError):
        mgr.admit("b", np.arange(16))
    assert (mgr.allocator.tags[pages] == tags).all()
    mgr.check()
    mgr.retire(h2)  # out of order: h1 still reads them
    assert mgr.stats().num_fenced == 3
    mgr.retire(h1)
    assert mgr.stats().num_fenced == 0 and mgr.allocator.num_free == 6
    with pytest.raises(KVMemError, match="not an open step"):
        mgr.retire(h1)
    mgr.check()


def test_release_batch_is_all_or_nothing_and_fenced(make_manager: Any, snapshot: Any) -> None:
    mgr = make_manager(num_pages=64)
    ids = finished_batch(mgr)
    before = snapshot(mgr)
    with pytest.raises(KVMemError, match="unknown"):
        mgr.release_batch([2, "nope", 0])
    with pytest.raises(ValueError, match="distinct"):
        mgr.release_batch([2, 0, 2])
    assert snapshot(mgr) == before
    handle = mgr.begin_step()
    mgr.release_batch(ids)
    assert mgr.stats().num_fenced > 0
    mgr.check()
    mgr.retire(handle)
    assert mgr.stats().num_fenced == 0
    mgr.check()


def test_a_step_opened_after_a_release_does_not_hold_its_pages(make_manager: Any) -> None:
    mgr = make_manager(num_pages=6, prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    h1 = mgr.begin_step()
    eng.release("a")
    h2 = mgr.begin_step()
    mgr.retire(h1)
    assert mgr.stats().num_fenced == 0  # h2 began after the release
    mgr.retire(h2)


def test_preemption_and_abort_during_a_step_are_fenced(make_manager: Any) -> None:
    mgr = make_manager(num_pages=8)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(9)))
    run_prompt(eng, "b", list(range(50, 59)))
    h = mgr.begin_step()
    eng.preempt("a")
    faults.free_behind_back(mgr, "b", 2)
    assert list(mgr.verify(["b"]).aborted) == ["b"]
    assert mgr.stats().num_fenced == 1  # a's private tail; the full pages stay cached
    mgr.check()
    mgr.retire(h)
    mgr.check()
    assert mgr.stats().num_fenced == 0


def test_a_lost_fence_completion_is_reported_as_a_leak(make_manager: Any) -> None:
    """BUG 2: the deferred free never gets its completion signal."""
    mgr = make_manager(prefix_cache=None)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    mgr.begin_step()
    eng.release("a")
    mgr.check()  # fenced pages are accounted for
    assert faults.lose_fence_completion(mgr) == 2
    with pytest.raises(IntegrityError, match="differ from their holders"):
        mgr.check()


def test_a_cached_page_a_fence_holds_counts_as_cached_and_is_not_evictable(
        make_manager: Any, snapshot: Any) -> None:
    m = make_manager(num_pages=8, max_pages_per_seq=8)
    prefill(m, "a", list(range(9)))  # pages 0, 1 full and cached, page 2 holds one token
    h = m.begin_step()
    m.release("a")
    s = m.stats()
    assert (s.num_free, s.num_cached, s.num_fenced, s.num_used) == (5, 2, 1, 0)
    seven_pages = list(range(100, 128))
    assert not m.can_admit(seven_pages)
    before = snapshot(m)
    with pytest.raises(KVMemError):
        m.admit("b", seven_pages)
    assert snapshot(m) == before
    m.retire(h)
    s = m.stats()
    assert (s.num_free, s.num_cached, s.num_fenced) == (6, 2, 0)
    assert m.can_admit(seven_pages)
    m.admit("b", seven_pages)  # evicts one cached page now
    assert m.stats().num_evictions == 1
    m.check()


@pytest.mark.parametrize("released", [1, 2])
def test_a_fence_never_frees_a_page_whose_lifetime_ended_behind_its_back(
        make_manager: Any, released: int) -> None:
    """Requests sharing a prefix page are released while a step is in flight (the fence holds
    their references); the page is then freed behind everyone's back and handed to a new
    request. retire freed the fence's references again: the new request's page was freed
    under it (one reference), or retire raised InvalidFreeError after it had closed the step
    (two). A fence holds a lifetime: retire frees nothing of a lifetime that already ended,
    the new request keeps its page, and only the request that mapped the lost page fails."""
    mgr = make_manager(num_pages=8, tracker="checking", max_seqs=10)
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


def test_step_fence_errors_say_what_was_wrong() -> None:
    """Each refusal's whole message: the page range (what was given, what is allowed), the
    handle shown as given, and what to do instead of a defer with no step in flight."""
    from kvmem import StepFences

    fences = StepFences(8)
    with pytest.raises(KVMemError, match=r"^defer\(\) needs a step in flight; free the pages "
                       r"directly instead$"):
        fences.defer([1])
    with pytest.raises(ArgumentError, match=r"^pages holds ids from 2 to 9: expected page ids "
                       r"in 0\.\.7; nothing changed$"):
        fences.hold_for_copy([2, 9])
    with pytest.raises(ArgumentTypeError, match=r"^handle='h' \(str\): expected a StepHandle "
                       r"returned by begin_step\(\); nothing changed$"):
        fences.retire("h")  # type: ignore[arg-type]
    assert fences.num_held == 0 and not fences.in_flight


def test_copy_holds_wait_for_copies_done_not_for_any_step() -> None:
    """Copy-on-write sources are held until copies_done, whatever steps begin and retire
    meanwhile (step ids never reach the copies' own wait), and copies_done clears
    copies_pending."""
    from kvmem import StepFences

    fences = StepFences(8)
    first, second = fences.begin(), fences.begin()
    assert first.step_id != second.step_id
    fences.hold_for_copy([3])
    assert fences.copies_pending
    assert fences.retire(second).size == 0 and fences.retire(first).size == 0
    third = fences.begin()
    assert fences.retire(third).size == 0
    assert fences.copies_pending and fences.held[3] == 1
    assert fences.copies_done().tolist() == [3]
    assert not fences.copies_pending and fences.num_held == 0


def test_new_step_fences_hold_nothing_and_show_a_read_only_int32_count() -> None:
    """``held`` is ``[num_pages]`` int32, read-only (the fences are its one writer), all
    zero; no copy is pending and no step is open before the first begin."""
    from kvmem import StepFences

    fences = StepFences(8)
    assert fences.held.dtype == np.int32 and fences.held.shape == (8,)
    assert not fences.held.flags.writeable and not fences.held.any()
    assert not fences.copies_pending and not fences.in_flight and not fences.holds_any
    with pytest.raises(ValueError):
        fences.held[0] = 1
