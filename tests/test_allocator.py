from __future__ import annotations

import numpy as np
import pytest

from kvmem import IntegrityError, InvalidFreeError, OutOfPagesError, PageAllocator


def snapshot(alloc: PageAllocator) -> tuple[bytes, ...]:
    """Every byte of allocator state, to prove a failed call changed nothing."""
    return (
        alloc._free_stack.tobytes(),
        alloc._refcounts.tobytes(),
        alloc._tags.tobytes(),
        bytes([alloc._num_free % 256]),
        str((alloc._num_free, alloc._last_tag, alloc._num_frees)).encode(),
    )


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
    before = snapshot(alloc)
    assert not alloc.can_allocate(2)
    with pytest.raises(OutOfPagesError, match="asked for 2 pages but only 1 are free") as info:
        alloc.allocate(2)
    assert (info.value.num_requested, info.value.num_free) == (2, 1)
    assert snapshot(alloc) == before


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
    before = snapshot(alloc)
    with pytest.raises(InvalidFreeError):
        alloc.free(bad_free(pages))
    assert snapshot(alloc) == before
    alloc.check()


def test_double_free_across_calls_is_rejected() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    before = snapshot(alloc)
    with pytest.raises(InvalidFreeError, match="double free"):
        alloc.free(pages[:1])
    assert snapshot(alloc) == before


def test_share_of_free_page_is_rejected() -> None:
    alloc = PageAllocator(4)
    before = snapshot(alloc)
    with pytest.raises(InvalidFreeError):
        alloc.share([2])
    assert snapshot(alloc) == before


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


# -- check() fires on every corruption it exists for --------------------------------------------


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
        assert snapshot(fast) == snapshot(slow)
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
    before = snapshot(alloc)
    for call in (alloc.free_distinct, alloc.share_distinct):
        with pytest.raises(InvalidFreeError):
            call(np.array(bad(pages), dtype=dtype))
        assert snapshot(alloc) == before
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
    assert snapshot(a) == snapshot(b)


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
