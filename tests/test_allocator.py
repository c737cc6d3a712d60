"""PageAllocator: allocation, refcounts, tags, frees, and its state machine."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmem import (
    CheckingTracker,
    IntegrityError,
    InvalidFreeError,
    KVMemError,
    OutOfPagesError,
    PageAllocator,
    PageTable,
)
from kvmem.errors import ArgumentError, ArgumentTypeError
from kvmem.testing import ToyEngine, faults


def allocator_state(alloc: PageAllocator) -> tuple[bytes, ...]:
    """Every byte of allocator state, to prove a failed call changed nothing."""
    return (
        alloc._free_stack.tobytes(),
        alloc._refcounts.tobytes(),
        alloc._tags.tobytes(),
        bytes([alloc._num_free % 256]),
        str((alloc._num_free, alloc._last_tag, alloc._num_frees)).encode(),
    )


def corrupt(alloc: PageAllocator, how: str) -> None:
    if how == "leak":  # a page neither free nor held (deferred free never completed)
        alloc._free_stack[alloc._num_free - 1] = alloc._free_stack[0]
        alloc._num_free -= 1
    elif how == "duplicate-free":
        alloc._free_stack[1] = alloc._free_stack[0]
    elif how == "free-with-refcount":
        alloc._refcounts[int(alloc._free_stack[0])] = 1
    elif how == "free-with-tag":
        alloc._tags[int(alloc._free_stack[0])] = 7
    elif how == "live-without-tag":
        alloc._tags[0] = 0


NUM_PAGES, MAX_SEQS, MAX_PAGES, PAGE_SIZE = 24, 6, 10, 4


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.table = PageTable(MAX_SEQS, MAX_PAGES, PAGE_SIZE)
        self.tracker = CheckingTracker(MAX_SEQS, MAX_PAGES)
        # Reference model: each live row's pages (in order) and token count.
        self.ref_pages: dict[int, list[int]] = {}
        self.ref_tokens: dict[int, int] = {}

    def holders(self) -> Counter[int]:
        return Counter(p for pages in self.ref_pages.values() for p in pages)

    @precondition(lambda self: len(self.ref_pages) < MAX_SEQS)
    @rule()
    def open_request(self) -> None:
        row = self.table.add_row()
        assert row not in self.ref_pages
        self.ref_pages[row], self.ref_tokens[row] = [], 0

    @precondition(lambda self: self.ref_pages)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        live = sorted(self.ref_pages)
        rows = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        counts = data.draw(st.lists(st.integers(0, 9), min_size=len(rows), max_size=len(rows)))
        needed = [
            max(0, -(-(self.ref_tokens[r] + k) // PAGE_SIZE) - len(self.ref_pages[r]))
            for r, k in zip(rows, counts)
        ]
        if any(len(self.ref_pages[r]) + n > MAX_PAGES for r, n in zip(rows, needed)):
            return
        free_before = self.alloc.num_free
        try:
            result = self.table.grow(rows, counts, self.alloc)
        except OutOfPagesError:
            assert sum(needed) > free_before
            assert self.alloc.num_free == free_before
            return
        assert result.new_pages.size == sum(needed)
        self.tracker.record(
            result.new_page_rows, result.new_page_positions, self.alloc.tags[result.new_pages]
        )
        slots = []
        for r, k, n in zip(rows, counts, needed):
            got = result.new_pages[result.new_page_rows == r].tolist()
            assert len(got) == n
            self.ref_pages[r] += got
            for t in range(self.ref_tokens[r], self.ref_tokens[r] + k):
                slots.append(self.ref_pages[r][t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE)
            self.ref_tokens[r] += k
        assert result.slot_mapping.tolist() == slots

    @precondition(lambda self: len(self.ref_pages) >= 2)
    @rule(data=st.data())
    def share_prefix(self, data: st.DataObject) -> None:
        """A request maps another's full pages (prefix reuse), holding them too."""
        src, dst = data.draw(st.lists(st.sampled_from(sorted(self.ref_pages)), min_size=2,
                                      max_size=2, unique=True))
        if self.ref_tokens[dst] != 0 or self.ref_pages[dst]:
            return
        full = self.ref_tokens[src] // PAGE_SIZE
        pages = self.ref_pages[src][:full]
        if not pages:
            return
        self.alloc.share(pages)
        self.table.map_pages(dst, pages)
        self.table.set_num_tokens(dst, full * PAGE_SIZE)
        self.tracker.record([dst] * full, list(range(full)), self.alloc.tags[pages])
        self.ref_pages[dst] = list(pages)
        self.ref_tokens[dst] = full * PAGE_SIZE

    @precondition(lambda self: self.ref_pages)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.ref_pages)))
        pages = self.table.remove_row(row)
        assert pages.tolist() == self.ref_pages.pop(row)
        del self.ref_tokens[row]
        released = self.alloc.free(pages)
        self.tracker.forget([row])
        still_held = self.holders()
        assert sorted(released.tolist()) == sorted(p for p in set(pages.tolist())
                                                   if p not in still_held)

    @precondition(lambda self: any(self.ref_tokens.values()))
    @rule()
    def verify(self) -> None:
        rows = np.array([r for r in sorted(self.ref_pages) if self.ref_tokens[r] > 0])
        bt = self.table.block_table(rows)
        csr = self.table.csr(rows)
        n = np.array([-(-self.ref_tokens[r] // PAGE_SIZE) for r in rows])
        assert self.tracker.verify(rows, n, self.alloc.tags, block_table=bt).ok
        assert self.tracker.verify(
            rows, n, self.alloc.tags, kv_indptr=csr.kv_indptr, kv_indices=csr.kv_indices
        ).ok

    @invariant()
    def conservation_and_refcounts(self) -> None:
        self.alloc.check()
        holders = self.holders()
        assert self.alloc.num_used == len(holders)
        assert self.alloc.num_free + len(holders) == NUM_PAGES
        expected = np.zeros(NUM_PAGES, dtype=np.int32)
        for page, count in holders.items():
            expected[page] = count
        np.testing.assert_array_equal(self.alloc.refcounts, expected)
        for row, pages in self.ref_pages.items():
            assert self.table.row_pages(row).tolist() == pages
            assert self.table.num_tokens[row] == self.ref_tokens[row]


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)


def run_prompt(eng: ToyEngine, rid: Any, prompt: Any, ns: Any = None) -> None:
    """Admit, prefill in one chunk, commit."""
    res = eng.admit(rid, prompt, ns)
    eng.step([rid], len(prompt) - res.num_cached_tokens)
    eng.commit([rid])


def test_allocate_gives_fresh_tags_and_one_holder() -> None:
    alloc = PageAllocator(8)
    pages = alloc.allocate(3)
    assert pages.dtype == np.int32
    assert pages.tolist() == [0, 1, 2]
    assert alloc.refcounts[pages].tolist() == [1, 1, 1]
    assert alloc.tags[pages].tolist() == [1, 2, 3]
    assert alloc.num_free == 5 and alloc.num_used == 3
    alloc.check()


def test_tags_never_repeat_across_lifetimes() -> None:
    alloc = PageAllocator(4)
    seen: set[int] = set()
    for _ in range(50):
        pages = alloc.allocate(4)
        tags = alloc.tags[pages].tolist()
        assert not seen & set(tags)
        seen |= set(tags)
        alloc.free(pages)
        assert alloc.tags.tolist() == [0, 0, 0, 0]
    assert alloc.stats().num_allocations == 200


def test_free_returns_released_pages_and_zeroes_tags() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.share(pages[:1])
    released = alloc.free(pages)
    assert released.tolist() == [int(pages[1])]
    assert alloc.refcounts[pages].tolist() == [1, 0]
    assert alloc.tags[pages[1]] == 0 and alloc.tags[pages[0]] > 0
    assert alloc.free(pages[:1]).tolist() == [int(pages[0])]
    assert alloc.num_free == 4
    alloc.check()


def test_share_counts_duplicates() -> None:
    alloc = PageAllocator(2)
    page = alloc.allocate(1)
    alloc.share([page[0], page[0]])
    assert alloc.refcounts[page[0]] == 3
    assert alloc.stats().num_shared == 1
    alloc.free([page[0], page[0], page[0]])
    assert alloc.num_free == 2


def test_public_arrays_are_read_only() -> None:
    alloc = PageAllocator(2)
    with pytest.raises(ValueError):
        alloc.refcounts[0] = 5
    with pytest.raises(ValueError):
        alloc.tags[0] = 5


def test_out_of_pages_changes_nothing_and_says_why() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(3)
    before = allocator_state(alloc)
    assert not alloc.can_allocate(2)
    with pytest.raises(OutOfPagesError, match="asked for 2 pages but only 1 are free") as info:
        alloc.allocate(2)
    assert (info.value.num_requested, info.value.num_free) == (2, 1)
    assert allocator_state(alloc) == before


@pytest.mark.parametrize(
    "bad_free",
    [
        pytest.param(lambda pages: [pages[0], pages[0]], id="listed-twice-one-holder"),
        pytest.param(lambda pages: [pages[1], 3], id="one-free-page-in-call"),
        pytest.param(lambda pages: [pages[0], 99], id="out-of-range"),
        pytest.param(lambda pages: [-1], id="negative"),
    ],
)
def test_bad_free_changes_nothing(bad_free) -> None:  # type: ignore[no-untyped-def]
    alloc = PageAllocator(4)
    pages = alloc.allocate(2).tolist()
    before = allocator_state(alloc)
    with pytest.raises(InvalidFreeError):
        alloc.free(bad_free(pages))
    assert allocator_state(alloc) == before
    alloc.check()


def test_double_free_across_calls_is_rejected() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    before = allocator_state(alloc)
    with pytest.raises(InvalidFreeError, match="double free"):
        alloc.free(pages[:1])
    assert allocator_state(alloc) == before


def test_share_of_free_page_is_rejected() -> None:
    alloc = PageAllocator(4)
    before = allocator_state(alloc)
    with pytest.raises(InvalidFreeError):
        alloc.share([2])
    assert allocator_state(alloc) == before


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(TypeError):
        PageAllocator(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PageAllocator(4).allocate(-1)


def test_pop_changed_pages() -> None:
    alloc = PageAllocator(8)
    a = alloc.allocate(3)
    alloc.free(a[:1])
    assert alloc.pop_changed_pages().tolist() == [0, 1, 2]
    assert alloc.pop_changed_pages().size == 0
    alloc.share(a[1:2])
    assert alloc.pop_changed_pages().size == 0  # sharing keeps the tag


def test_stats_is_a_frozen_snapshot() -> None:
    alloc = PageAllocator(8)
    stats = alloc.stats()
    alloc.allocate(2)
    assert stats.num_free == 8 and alloc.stats().num_free == 6
    assert alloc.stats().usage == 0.25
    with pytest.raises(AttributeError):
        stats.num_free = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "how", ["leak", "duplicate-free", "free-with-refcount", "free-with-tag", "live-without-tag"]
)
def test_check_fires(how: str) -> None:
    alloc = PageAllocator(8)
    alloc.allocate(2)
    alloc.check()  # silent on a correct allocator
    corrupt(alloc, how)
    with pytest.raises(IntegrityError, match="check\\(\\) failed"):
        alloc.check()


def test_large_batches_in_one_call() -> None:
    """100k pages allocated, shared and freed in single calls."""
    alloc = PageAllocator(200_000)
    pages = alloc.allocate(100_000)
    assert np.unique(pages).size == 100_000
    alloc.share(pages)
    assert alloc.free(pages).size == 0
    assert alloc.free(pages).size == 100_000
    alloc.check()


@pytest.mark.parametrize("seed", range(4))
def test_the_distinct_paths_match_the_general_ones(seed: int) -> None:
    """free_distinct / share_distinct (int32 or intp pages, listed once) leave exactly the state
    free / share leave, return the same pages, and hand out the same pages afterwards."""
    rng = np.random.default_rng(seed)
    fast, slow = PageAllocator(48), PageAllocator(48)
    for step in range(300):
        live = np.flatnonzero(slow.refcounts > 0)
        op = rng.integers(0, 3)
        if op == 0 and slow.num_free:
            n = int(rng.integers(1, slow.num_free + 1))
            assert fast.allocate(n).tolist() == slow.allocate(n).tolist()
        elif live.size:
            pick = rng.choice(live, size=int(rng.integers(1, live.size + 1)), replace=False)
            pages = pick.astype(np.intp if step % 2 else np.int32)
            if op == 1:
                fast.share_distinct(pages)
                slow.share(pick)
            else:
                freed = fast.free_distinct(pages)
                want = slow.free(pick)
                assert freed.dtype == want.dtype == np.int32
                assert freed.tolist() == want.tolist() == sorted(want.tolist())
        assert allocator_state(fast) == allocator_state(slow)
    fast.check()
    assert fast.pop_changed_pages().tolist() == slow.pop_changed_pages().tolist()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda pages: [pages[1], 3], id="one-free-page-in-call"),
        pytest.param(lambda pages: [pages[0], 99], id="out-of-range"),
        pytest.param(lambda pages: [-1], id="negative"),
    ],
)
@pytest.mark.parametrize("dtype", [np.int32, np.intp])
def test_bad_distinct_calls_change_nothing(bad, dtype) -> None:  # type: ignore[no-untyped-def]
    alloc = PageAllocator(4)
    pages = alloc.allocate(2).tolist()
    before = allocator_state(alloc)
    for call in (alloc.free_distinct, alloc.share_distinct):
        with pytest.raises(InvalidFreeError):
            call(np.array(bad(pages), dtype=dtype))
        assert allocator_state(alloc) == before
    assert alloc.free_distinct(np.empty(0, dtype=dtype)).size == 0
    alloc.check()


def test_free_without_repeats_and_with_them_agree() -> None:
    """free() checks for repeats before the fast path: a page listed twice loses two holders."""
    a, b = PageAllocator(8), PageAllocator(8)
    for alloc in (a, b):
        alloc.allocate(4)
        alloc.share([1, 2])
    assert a.free([2, 1, 2, 1, 0]).tolist() == [0, 1, 2]
    assert b.free([0, 1, 2]).tolist() == [0]
    assert b.free([2, 1]).tolist() == [1, 2]
    assert allocator_state(a) == allocator_state(b)


# -- mutation survivors (benchmarks/mutation_campaign.py over _page_allocator.py) ----------------


def test_can_allocate_is_exact_at_the_free_count_and_refuses_a_negative_count() -> None:
    """Guards can_allocate: exactly ``num_free`` pages fit (``<=``, not ``<``), 0 pages fit even
    with none free, and a negative count raises ArgumentError naming ``num`` and its bound."""
    from kvmem.errors import ArgumentError

    alloc = PageAllocator(4)
    alloc.allocate(1)
    assert alloc.can_allocate(3) and not alloc.can_allocate(4)
    alloc.allocate(3)
    assert alloc.can_allocate(0) and not alloc.can_allocate(1)
    with pytest.raises(ArgumentError, match=r"^num=-1: expected an integer >= 0"):
        alloc.can_allocate(-1)


def test_stats_counts_frees_and_only_pages_with_two_holders_or_more_as_shared() -> None:
    """Guards AllocatorStats: ``num_frees`` counts the pages returned to the free list, and
    ``num_shared`` the pages with more than one holder (one holder is not shared; two are)."""
    alloc = PageAllocator(8)
    pages = alloc.allocate(3)
    alloc.share(pages[:1])
    s = alloc.stats()
    assert (s.num_shared, s.num_frees, s.num_used) == (1, 0, 3)
    alloc.free(pages[1:])
    s = alloc.stats()
    assert (s.num_shared, s.num_frees, s.num_used) == (1, 2, 1)
    alloc.free(pages[:1])  # two holders -> one: no longer shared, not freed
    s = alloc.stats()
    assert (s.num_shared, s.num_frees, s.num_used) == (0, 2, 1)


def test_equal_arrays_compares_shape_and_every_element() -> None:
    """Guards equal_arrays (the prefix cache confirms a hit's tags with it): equal only when
    the shapes and every element agree."""
    from kvmem.allocator._page_allocator import equal_arrays

    a = np.array([1, 2, 3], dtype=np.int64)
    assert equal_arrays(a, a.copy())
    assert not equal_arrays(a, np.array([1, 2, 4], dtype=np.int64))
    assert not equal_arrays(a, np.array([9, 2, 3], dtype=np.int64))
    assert not equal_arrays(a, a[:2])
    assert not equal_arrays(a[:1], np.array([1, 1], dtype=np.int64))  # (broadcasts: shape)
    assert equal_arrays(a[:0], a[:0])


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.pytestmark = [pytest.mark.long]  # 150 examples of 40 steps


@pytest.mark.parametrize("drift", [None, "evictable while held", "free while mapped"])
def test_a_page_in_two_lists_is_reported(make_manager: Any, drift: str | None) -> None:
    """BUGS.md 15: a cached page gains a holder the cache's accounting does not see, so it is
    counted evictable while in use; or a page a request maps is also on the free list.
    check() (conservation, no page in two lists) reports either. On the correct run a page
    two requests share is never evictable, and check() is silent."""
    mgr = make_manager(num_pages=16)
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(9)))
    run_prompt(eng, "b", list(range(9)))  # shares a's two full pages
    cache = mgr.cache
    assert cache is not None
    eng.release("a")
    assert cache.num_evictable == 0  # b still holds them
    mgr.check()
    if drift is None:
        eng.release("b")
        assert cache.num_evictable == 2
        mgr.check()
    elif drift == "evictable while held":
        eng.release("b")
        page = int(cache.match(np.arange(9), None, 2, 0).pages[0])
        mgr.allocator.share([page])  # a holder behind the accounting's back
        with pytest.raises(IntegrityError, match="evictable pages") as e:
            mgr.check()
        assert "differ from their holders" in str(e.value)
    else:
        page = faults.free_behind_back(mgr, "b", 2)  # b's own tail
        with pytest.raises(IntegrityError, match=rf"pages \[{page}\] are free and held"):
            mgr.check()


@pytest.mark.parametrize("pages", [np.int64(2**32 + 1), [1.7], [True], 1, np.array([2**32 + 1])])
def test_free_never_wraps_truncates_or_takes_one_id(pages: Any) -> None:
    a = PageAllocator(8)
    a.allocate(3)
    before = (a.refcounts.tolist(), a.tags.tolist(), a.num_free)
    with pytest.raises((ArgumentError, ArgumentTypeError)):
        a.free(pages)
    assert (a.refcounts.tolist(), a.tags.tolist(), a.num_free) == before


@pytest.mark.parametrize("n", [True, 1.0, "1"])
def test_allocate_takes_an_integer_count(n: Any) -> None:
    a = PageAllocator(8)
    with pytest.raises(ArgumentTypeError):
        a.allocate(n)
    assert a.num_free == 8


@pytest.mark.parametrize(("pages", "error"), [
    ([8], "InvalidFreeError"), ([-1], "InvalidFreeError"), ([5], "InvalidFreeError"),
    ([0, 0], "InvalidFreeError"), ([2**32 + 1], "ArgumentError"), ([1.0], "ArgumentTypeError")])
def test_free_refuses_the_whole_call_naming_why(pages: list[Any], error: str) -> None:
    from kvmem import PageAllocator

    a = PageAllocator(8)
    a.allocate(3)
    before = (a.refcounts.tolist(), a.tags.tolist(), a.num_free)
    with pytest.raises(KVMemError) as info:
        a.free([0, *pages])  # page 0 is fine: the call is refused whole
    assert type(info.value).__name__ == error
    assert (a.refcounts.tolist(), a.tags.tolist(), a.num_free) == before
    a.check()


def _pages(ids: Any) -> str:
    return str([int(p) for p in ids][:16])


@pytest.mark.parametrize("num_bad", [1, 2, 17])
@pytest.mark.parametrize("how", ["out-of-range", "duplicate-free", "leak", "free-with-refcount",
                                 "free-with-tag", "live-without-tag", "negative-refcount"])
def test_check_names_each_broken_invariant_and_its_first_16_pages(how: str, num_bad: int) -> None:
    """check() says exactly which invariant broke and lists the offending pages (the first
    16), one sentence per broken invariant, joined by "; "; and nothing it does not see:
    page 0 free, ids at both ends of the range, pages listed once, are all fine."""
    alloc = PageAllocator(64)
    live = alloc.allocate(40)  # pages 0..39
    alloc.free(live[:1])  # page 0 is free too (ids at 0 are in range)
    free = alloc._free_stack[: alloc._num_free].copy()  # 25 pages, top of the stack last
    bad = live[1 : 1 + num_bad]
    if how == "out-of-range":  # extra ids past the free pages, below 0 and at num_pages
        ids = [(-1 - i // 2) if i % 2 == 0 else 64 + i // 2 for i in range(num_bad)]
        alloc._free_stack[alloc._num_free : alloc._num_free + num_bad] = ids
        alloc._num_free += num_bad
        want = [f"free stack holds out-of-range ids {ids[:16]}"]
    elif how == "duplicate-free":
        alloc._free_stack[alloc._num_free : alloc._num_free + num_bad] = free[:num_bad]
        alloc._num_free += num_bad
        want = [f"pages {_pages(sorted(free[:num_bad]))} appear more than once in the free stack"]
    elif how == "leak":  # neither free nor held
        alloc._refcounts[bad] = 0
        want = [f"conservation broken: 25 free + {39 - num_bad} live != 64 total; pages "
                f"neither free nor held: {_pages(bad)}"]
    elif how == "free-with-refcount":
        alloc._refcounts[free[:num_bad]] = 1
        want = [f"conservation broken: 25 free + {39 + num_bad} live != 64 total; pages "
                "neither free nor held: []",
                f"free pages {_pages(sorted(free[:num_bad]))} have refcount != 0"]
    elif how == "free-with-tag":
        alloc._tags[free[:num_bad]] = 7
        want = [f"free pages {_pages(sorted(free[:num_bad]))} have tag != 0"]
    elif how == "live-without-tag":
        alloc._tags[bad] = 0
        want = [f"live pages {_pages(bad)} have tag <= 0"]
    else:
        alloc._refcounts[bad] = -1
        want = [f"conservation broken: 25 free + {39 - num_bad} live != 64 total; pages "
                "neither free nor held: []",
                f"pages {_pages(bad)} have negative refcounts"]
    with pytest.raises(IntegrityError) as e:
        alloc.check()
    assert str(e.value) == "PageAllocator.check() failed: " + "; ".join(want)


def test_pop_changed_pages_returns_every_page_when_it_fell_behind() -> None:
    """A reader that let more changes pile up than the log keeps gets every page (int32,
    ascending), then only what changed since; with no change, an empty int32 array."""
    alloc = PageAllocator(8)
    alloc.pop_changed_pages()
    assert alloc.pop_changed_pages().dtype == np.int32
    for _ in range(alloc.changes.limit):
        alloc.free(alloc.allocate(1))
    everything = alloc.pop_changed_pages()
    assert everything.dtype == np.int32 and everything.tolist() == list(range(8))
    none = alloc.pop_changed_pages()
    assert none.dtype == np.int32 and none.size == 0
    alloc.allocate(2)
    assert alloc.pop_changed_pages().tolist() == [0, 1]


@pytest.mark.parametrize("call", ["free", "share", "share_distinct", "free_distinct"])
def test_an_out_of_range_page_error_gives_the_valid_range(call: str) -> None:
    """free() and share() (and their distinct-page twins) of an id outside the pool name the
    call, the id and the valid range."""
    alloc = PageAllocator(8)
    alloc.allocate(2)
    name = call.removesuffix("_distinct")
    with pytest.raises(InvalidFreeError, match=rf"^{name}\(\) got page ids \[8\] outside "
                       r"0\.\.7; nothing changed"):
        getattr(alloc, call)(np.array([8]))


def test_a_free_listing_a_page_too_often_names_only_that_page() -> None:
    """free() of a page listed more times than it has holders names that page and its
    holders, not the pages the call would free correctly."""
    alloc = PageAllocator(8)
    alloc.allocate(3)
    alloc.share([2])
    with pytest.raises(InvalidFreeError, match=r"lists pages \[0\] more times than they have "
                       r"holders \(holders \[1\]\)"):
        alloc.free([0, 0, 1, 2, 2])
    assert alloc.refcounts.tolist()[:3] == [1, 1, 2]


@pytest.mark.parametrize("call", ["free", "share"])
@pytest.mark.parametrize("pages", [np.zeros((1, 1), dtype=np.int32), "01", 3])
def test_page_ids_must_be_a_one_dimensional_sequence(call: str, pages: Any) -> None:
    """free() and share() take a 1-D sequence of page ids: a 2-D array (even of int32), a
    string or one id is refused, naming ``pages``, and nothing changes."""
    alloc = PageAllocator(4)
    alloc.allocate(2)
    before = allocator_state(alloc)
    with pytest.raises(ArgumentTypeError, match=r"^pages must be a 1-D sequence of page ids"):
        getattr(alloc, call)(pages)
    assert allocator_state(alloc) == before


def test_the_change_log_counts_every_allocate_and_free() -> None:
    """changes.num_logged counts the arrays logged: one per allocate and per free (sharing
    changes no tag)."""
    alloc = PageAllocator(4)
    assert alloc.changes.num_logged == 0
    pages = alloc.allocate(2)
    alloc.share(pages)
    assert alloc.changes.num_logged == 1
    alloc.free(pages)
    alloc.free(pages)
    assert alloc.changes.num_logged == 3


def test_the_pool_holds_one_page_up_to_int32_max() -> None:
    """One page is a valid pool; more than int32 can number is refused by name, before any
    array is made (2**40 here, so that a missing bound fails at once, not after 8 GiB)."""
    alloc = PageAllocator(1)
    assert alloc.allocate(1).tolist() == [0]
    with pytest.raises(ArgumentError, match=r"^num_pages=1099511627776: expected an integer"):
        PageAllocator(2**40)


def test_take_allocates_exactly_the_listed_free_pages() -> None:
    alloc = PageAllocator(8)
    alloc.allocate(2)
    alloc.take([5, 3])
    assert alloc.refcounts.tolist() == [1, 1, 0, 1, 0, 1, 0, 0]
    assert alloc.tags[[5, 3]].tolist() == [3, 4] and alloc.num_free == 4
    assert sorted(alloc.allocate(4).tolist()) == [2, 4, 6, 7]  # 3 and 5 left the free stack
    alloc.check()
    assert alloc.pop_changed_pages().tolist() == list(range(8))


@pytest.mark.parametrize("pages, words", [
    ([1], "held, not free"), ([4, 4], "twice"), ([8], "0..7"), ([-1], "0..7")])
def test_a_bad_take_changes_nothing(pages: list[int], words: str) -> None:
    alloc = PageAllocator(8)
    alloc.allocate(2)
    before = allocator_state(alloc)
    with pytest.raises(ArgumentError, match=words):
        alloc.take(pages)
    assert allocator_state(alloc) == before


def test_a_planned_free_frees_what_free_would_and_only_while_nothing_changed() -> None:
    """plan_free validates without changing anything; apply_free carries the plan out on
    the allocator that made it, unchanged since (a group allocator plans every group's free
    before applying any): another allocator's plan, a stale one, or no plan is refused."""
    alloc, twin = PageAllocator(8), PageAllocator(8)
    pages = alloc.allocate(4)
    twin.allocate(4)
    alloc.share(pages[:1])
    before = allocator_state(alloc)
    plan = alloc.plan_free([pages[0], pages[0], pages[1]])
    assert allocator_state(alloc) == before
    with pytest.raises(InvalidFreeError, match="more times"):
        alloc.plan_free([pages[1], pages[1]])
    for bad, words in ((twin.plan_free(pages[:1]), "of this allocator"),
                       ((plan.pages, plan.remaining), "of this allocator")):
        with pytest.raises(ArgumentError, match=words):
            alloc.apply_free(bad)  # type: ignore[arg-type]
        assert allocator_state(alloc) == before
    assert alloc.apply_free(plan).tolist() == sorted(pages[:2].tolist())
    after = allocator_state(alloc)
    with pytest.raises(ArgumentError, match="before this allocator last changed"):
        alloc.apply_free(plan)  # (applied once already: stale)
    stale = alloc.plan_free(pages[2:3])
    alloc.allocate(1)
    with pytest.raises(ArgumentError, match="before this allocator last changed"):
        alloc.apply_free(stale)
    assert alloc.refcounts[pages[2]] == 1 and allocator_state(alloc) != after
    alloc.check()
