"""KV cache groups: specs, the byte arena, GroupAllocator, WindowRow and per-request costs."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvmem.allocator import (
    ByteArena,
    FullAttentionSpec,
    GroupAllocator,
    GroupSpec,
    IndexerSpec,
    PaddedLayout,
    SlidingWindowSpec,
    StateSpec,
    WindowRow,
    check_groups,
    first_window_page,
    padded_layout,
    request_cost,
)
from kvmem.errors import (
    ArgumentError,
    ArgumentTypeError,
    ConfigError,
    IntegrityError,
    InvalidFreeError,
    OutOfPagesError,
)

FULL = FullAttentionSpec("full", page_size=16, bytes_per_token=1024)
SWA = SlidingWindowSpec("swa", window=128, page_size=32, bytes_per_token=512)
STATE = StateSpec("state", bytes_per_state=40_000)
INDEXER = IndexerSpec("indexer", attention=FULL, bytes_per_token=132)
GROUPS = (FULL, SWA, STATE, INDEXER)


def state_of(ga: GroupAllocator) -> tuple[bytes, ...]:
    """Every byte of a GroupAllocator's state, to prove a failed call changed nothing."""
    out = [ga.arena.owners.tobytes(), ga.arena._free[: ga.arena.num_free].tobytes()]
    for name in ga.names:
        alloc = ga.allocator(name)
        out += [alloc._free_stack[: alloc.num_free].tobytes(), alloc.refcounts.tobytes(),
                alloc.tags.tobytes(), str(alloc.num_free).encode()]
    out += [used.tobytes() for used in ga._used]
    return tuple(out)


# -- specs ---------------------------------------------------------------------------------


def test_specs_give_their_page_geometry() -> None:
    assert (FULL.page_bytes, FULL.num_pages(0), FULL.num_pages(16), FULL.num_pages(17)) == (
        16 * 1024, 0, 1, 2)
    assert (STATE.page_size, STATE.page_bytes, STATE.num_pages(0), STATE.num_pages(10**6)) == (
        0, 40_000, 1, 1)
    assert (INDEXER.page_size, INDEXER.page_bytes, INDEXER.num_pages(33)) == (16, 16 * 132, 3)
    assert SWA.page_bytes == 32 * 512


@pytest.mark.parametrize("make, error, words", [
    (lambda: FullAttentionSpec("full", 0, 8), ConfigError, "page_size=0"),
    (lambda: FullAttentionSpec("full", 16, -1), ConfigError, "bytes_per_token=-1"),
    (lambda: FullAttentionSpec("full", 16.0, 8), ArgumentTypeError,  # type: ignore[arg-type]
     "page_size=16.0"),
    (lambda: FullAttentionSpec("full", True, 8), ArgumentTypeError, "page_size=True"),
    (lambda: FullAttentionSpec("", 16, 8), ConfigError, "name=''"),
    (lambda: FullAttentionSpec(3, 16, 8), ArgumentTypeError, "name=3"),  # type: ignore[arg-type]
    (lambda: SlidingWindowSpec("swa", 0, 16, 8), ConfigError, "window=0"),
    (lambda: SlidingWindowSpec("swa", "128", 16, 8),  # type: ignore[arg-type]
     ArgumentTypeError, "window='128'"),
    (lambda: StateSpec("state", 0), ConfigError, "bytes_per_state=0"),
    (lambda: IndexerSpec("idx", SWA, 132), ArgumentTypeError, "FullAttentionSpec"),  # type: ignore[arg-type]
    (lambda: IndexerSpec("idx", FULL, 0), ConfigError, "bytes_per_token=0"),
])
def test_a_bad_spec_says_which_field_and_value(make: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=r"invalid .*Spec") as info:
        make()
    assert words in str(info.value)


def test_specs_are_frozen_and_take_numpy_integers() -> None:
    spec = FullAttentionSpec("full", np.int64(16), np.int32(8))
    assert type(spec.page_size) is int and spec == FullAttentionSpec("full", 16, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.page_size = 32  # type: ignore[misc]


def test_check_groups_refuses_sets_that_cannot_serve_one_model() -> None:
    assert check_groups([FULL, INDEXER]) == (FULL, INDEXER)
    with pytest.raises(ConfigError, match="at least one"):
        check_groups([])
    with pytest.raises(ConfigError, match=r"\['full'\] more than once"):
        check_groups([FULL, FullAttentionSpec("full", 32, 8)])
    with pytest.raises(ConfigError, match="indexes attention group 'full'"):
        check_groups([INDEXER, STATE])
    with pytest.raises(ArgumentTypeError, match=r"groups\[1\]"):
        check_groups([FULL, "swa"])  # type: ignore[list-item]
    with pytest.raises(ArgumentTypeError, match="list of group specs"):
        check_groups(FULL)  # type: ignore[arg-type]


@given(num_computed=st.integers(0, 300), window=st.integers(1, 70), page_size=st.integers(1, 20))
def test_first_window_page_is_the_first_page_a_later_query_reads(
        num_computed: int, window: int, page_size: int) -> None:
    """Brute force: page i is still read iff one of its tokens t has t >= q - window + 1 for
    some query q >= num_computed, i.e. its last token reaches the next query's window."""
    first = first_window_page(num_computed, window, page_size)
    for page in range(first + 3):
        last_token = (page + 1) * page_size - 1
        read = last_token >= num_computed - window + 1
        assert read == (page >= first), (page, first)


@given(num_tokens=st.integers(0, 400), window=st.integers(1, 100), page_size=st.integers(1, 24))
def test_sliding_window_pages_are_the_pages_of_the_last_tokens_still_read(
        num_tokens: int, window: int, page_size: int) -> None:
    """The pages holding keys the next query (position num_tokens) reads, including the
    partly filled page it is written into."""
    spec = SlidingWindowSpec("swa", window, page_size, 2)
    num_row_pages = -(-num_tokens // page_size)
    read = {t // page_size for t in range(max(0, num_tokens - window + 1), num_tokens + 1)}
    assert spec.num_pages(num_tokens) == len({p for p in read if p < num_row_pages})


# -- the byte arena ------------------------------------------------------------------------


def test_the_arena_lends_chunks_whole_and_takes_them_back() -> None:
    arena = ByteArena(budget_bytes=1050, chunk_bytes=100)
    assert (arena.num_chunks, arena.unused_bytes, arena.num_free) == (10, 50, 10)
    chunks = arena.lend(2, 3)
    assert chunks.tolist() == [0, 1, 2] and arena.owners[chunks].tolist() == [2, 2, 2]
    with pytest.raises(OutOfPagesError, match="asked for 8 chunks but only 7"):
        arena.lend(0, 8)
    assert arena.num_free == 7
    with pytest.raises(IntegrityError, match="not lent to group 1"):
        arena.give_back(1, chunks[:1])
    arena.give_back(2, chunks[1:2])
    assert arena.owners.tolist()[:3] == [2, -1, 2] and arena.check() == []
    with pytest.raises(ArgumentError, match="holds 0 chunks"):
        ByteArena(budget_bytes=99, chunk_bytes=100)


# -- GroupAllocator ------------------------------------------------------------------------


def test_each_group_is_carved_in_its_own_page_size() -> None:
    ga = GroupAllocator(GROUPS, budget_bytes=10_000_000, chunk_bytes=200_000)
    assert ga.pages_per_chunk == (12, 12, 5, 94)
    assert ga.arena.num_chunks == 50
    pages = ga.allocate({"full": 13, "state": 1, "indexer": 13})
    assert {k: v.size for k, v in pages.items()} == {"full": 13, "state": 1, "indexer": 13}
    stats = ga.stats()
    usage = {g.name: g for g in stats.groups}
    assert (usage["full"].num_chunks, usage["state"].num_chunks, usage["indexer"].num_chunks,
            usage["swa"].num_chunks) == (2, 1, 1, 0)
    assert stats.used_bytes == 13 * 16 * 1024 + 40_000 + 13 * 16 * 132  # true bytes
    assert stats.stranded_bytes == (11 * 16 * 1024 + 4 * 40_000 + 81 * 16 * 132)
    # carving: under one page per chunk held
    assert stats.carve_bytes == 2 * (200_000 % 16384) + 0 + 200_000 % 2112
    for g in stats.groups:
        assert g.num_chunks * (200_000 % g.page_bytes) < max(g.num_chunks, 1) * g.page_bytes
    ga.check()


def test_fit_answers_for_every_group_at_once_in_pages_chunks_and_bytes() -> None:
    ga = GroupAllocator([FULL, STATE], budget_bytes=4 * 65_536, chunk_bytes=65_536)
    assert ga.pages_per_chunk == (4, 1)
    ga.allocate({"full": 1})
    fit = ga.fit({"full": 7, "state": 2})
    assert fit.num_free_pages == (3, 0)
    assert fit.num_chunks == (1, 2) and fit.num_free_chunks == 3 and fit.fits
    assert fit.page_bytes == 7 * 16384 + 2 * 40_000 and fit.chunk_bytes == 3 * 65_536
    assert not ga.can_allocate({"full": 8, "state": 2})
    assert ga.fit({"full": 8, "state": 2}).num_chunks_short == 1


def test_a_request_that_does_not_fit_in_one_group_gets_nothing_in_any() -> None:
    ga = GroupAllocator([FULL, STATE], budget_bytes=4 * 65_536, chunk_bytes=65_536)
    ga.allocate({"state": 2})
    before = state_of(ga)
    with pytest.raises(OutOfPagesError, match=r"3 chunks but only 2.*'full' 2, 'state' 1"):
        ga.allocate({"full": 8, "state": 1})
    assert state_of(ga) == before
    ga.check()


def test_a_bad_free_in_one_group_frees_nothing_in_any() -> None:
    ga = GroupAllocator(GROUPS, budget_bytes=10_000_000, chunk_bytes=200_000)
    pages = ga.allocate({"full": 3, "state": 2})
    ga.free({"state": pages["state"][:1]})
    before = state_of(ga)
    bad_frees: list[tuple[dict[str, Any], str]] = [
        ({"full": pages["full"], "state": pages["state"][:1]}, r"group .state.*free \(no holder\)"),
        ({"full": pages["full"], "state": [pages["state"][1]] * 2}, "more times"),
        ({"full": pages["full"], "indexer": [0]}, "chunks the group does not hold"),
        ({"full": pages["full"], "swa": [10**6]}, "outside 0.."),
    ]
    for bad, words in bad_frees:
        with pytest.raises(InvalidFreeError, match=words):
            ga.free(bad)
        assert state_of(ga) == before
    with pytest.raises(ArgumentError, match="no such group"):
        ga.free({"full": pages["full"], "mamba": [0]})
    with pytest.raises(ArgumentTypeError, match="dict of group name"):
        ga.free(pages["full"])  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError):
        ga.allocate({"full": 1.5})  # type: ignore[dict-item]
    assert state_of(ga) == before
    ga.check()


def test_a_chunk_returns_when_its_last_page_is_freed_and_serves_another_group() -> None:
    ga = GroupAllocator([FULL, STATE], budget_bytes=65_536, chunk_bytes=65_536)
    full = ga.allocate({"full": 2})["full"]
    assert not ga.can_allocate({"state": 1})
    ga.share({"full": full[:1]})
    ga.free({"full": full})  # page 0 keeps its second holder
    assert ga.stats().num_free_chunks == 0
    ga.free({"full": full[:1]})
    assert ga.stats().num_free_chunks == 1 and ga.can_allocate({"state": 1})
    ga.check()
    state = ga.allocate({"state": 1})["state"]
    assert ga.arena.owners.tolist() == [1] and ga.byte_offsets("state", state).tolist() == [0]
    ga.check()


def test_a_chunk_emptied_and_refilled_by_its_group_skips_the_arena() -> None:
    """A sliding window frees a step's pages and takes as many at the next: the emptied
    chunks stay with the group until its next allocate, which refills them (fresh tags), or
    gives back those it does not need; to every query they are the arena's meanwhile."""
    ga = GroupAllocator([FULL, STATE], budget_bytes=4 * 65_536, chunk_bytes=65_536)
    ppc = ga.pages_per_chunk[0]
    pages = ga.allocate({"full": 2 * ppc})["full"]
    ga.free({"full": pages})
    s = ga.stats()
    assert s.num_free_chunks == 4 and s.groups[0].num_chunks == 0
    assert s.groups[0].num_free_pages == 0 and ga.fit({"state": 4}).fits
    ga.check()
    tags = ga.tags("full")[pages].copy()
    again = ga.allocate({"full": ppc + 1})["full"]  # two chunks' worth refilled: no lending
    assert set(again.tolist()) <= set(pages.tolist())
    assert (ga.tags("full")[again] > tags.max()).all()
    assert ga.stats().num_free_chunks == 2
    ga.check()
    ga.free({"full": again})
    ga.allocate({"state": 3})  # another group's need returns the emptied chunks first
    assert ga.stats().num_free_chunks == 1 and ga.arena.owners.tolist().count(0) == 0
    ga.check()
    held = ga.allocate({"full": 1})["full"]
    ga._emptied[0] = np.array([held[0] // ppc], dtype=np.int32)  # the bug: a used chunk
    with pytest.raises(IntegrityError, match="held-page counts"):
        ga.check()


def test_tags_change_whenever_a_page_is_reused_even_through_another_group() -> None:
    """A page's tag names one lifetime: a request that kept a stale reference to a page of a
    chunk that went to another group and came back sees a different tag."""
    ga = GroupAllocator([FULL, STATE], budget_bytes=65_536, chunk_bytes=65_536)
    seen: dict[tuple[str, int], set[int]] = {}
    for _ in range(5):
        for group in ("full", "state"):
            got = ga.allocate({group: 1})[group]
            page = int(got[0])
            tag = int(ga.tags(group)[page])
            assert tag > 0 and tag not in seen.setdefault((group, page), set())
            seen[(group, page)].add(tag)
            ga.free({group: got})
            assert ga.tags(group)[page] != tag  # the arena took the page back: a new lifetime
    assert len(seen[("full", 3)]) == 5 or len(seen[("full", 0)]) == 5  # the same page reused


def test_pages_of_all_groups_never_overlap_in_bytes() -> None:
    ga = GroupAllocator(GROUPS, budget_bytes=3_000_000, chunk_bytes=200_000)
    pages = ga.allocate({"full": 30, "swa": 20, "state": 7, "indexer": 30})
    spans = sorted((int(o), int(o) + ga.page_bytes[ga.names.index(g)])
                   for g, ids in pages.items() for o in ga.byte_offsets(g, ids))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] <= ga.arena.num_chunks * ga.chunk_bytes


def test_a_chunk_smaller_than_a_page_is_refused() -> None:
    with pytest.raises(ConfigError, match="smaller than group 'state'"):
        GroupAllocator([FULL, STATE], budget_bytes=10**6, chunk_bytes=20_000)
    ga = GroupAllocator([FULL, STATE], budget_bytes=10**6)
    assert ga.chunk_bytes == 4 * 40_000


class GroupsMachine(RuleBasedStateMachine):
    """Random allocations, shares and frees across four groups on a small budget: the budget
    is never exceeded, no chunk leaks, a refused call changes nothing, can_allocate agrees
    with allocate, and no page lifetime's tag repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.ga = GroupAllocator(GROUPS, budget_bytes=1_000_000, chunk_bytes=90_000)
        self.holders: Counter[tuple[str, int]] = Counter()  # the model: holders per page
        self.tags_seen: dict[str, set[int]] = {name: set() for name in self.ga.names}
        self.live_tag: dict[tuple[str, int], int] = {}

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        needs = data.draw(st.dictionaries(st.sampled_from(self.ga.names), st.integers(0, 25),
                                          max_size=4))
        fits = self.ga.can_allocate(needs)
        before = state_of(self.ga)
        if not fits:
            with pytest.raises(OutOfPagesError):
                self.ga.allocate(needs)
            assert state_of(self.ga) == before
            return
        got = self.ga.allocate(needs)
        for name, num in needs.items():
            assert got[name].size == num and np.unique(got[name]).size == num
            tags = self.ga.tags(name)[got[name]].tolist()
            assert not self.tags_seen[name] & set(tags)
            self.tags_seen[name] |= set(tags)
            for page, tag in zip(got[name].tolist(), tags):
                assert self.holders[(name, page)] == 0
                self.holders[(name, page)] = 1
                self.live_tag[(name, page)] = tag

    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        held = sorted(k for k, v in self.holders.items() if v)
        if not held:
            return
        picked = data.draw(st.lists(st.sampled_from(held), max_size=4))
        by_group: dict[str, list[int]] = {}
        for name, page in picked:
            by_group.setdefault(name, []).append(page)
            self.holders[(name, page)] += 1
        self.ga.share(by_group)

    @rule(data=st.data(), extra=st.booleans())
    def free(self, data: st.DataObject, extra: bool) -> None:
        held = sorted(k for k, v in self.holders.items() if v)
        picked = data.draw(st.lists(st.sampled_from(held), unique=True, max_size=8)) if held \
            else []
        by_group: dict[str, list[int]] = {}
        for name, page in picked:
            by_group.setdefault(name, []).append(page)
        if extra:  # one page more than it holds, or a free page: the whole call is refused
            name = data.draw(st.sampled_from(self.ga.names))
            page = data.draw(st.integers(0, self.ga.allocator(name).num_pages - 1))
            by_group.setdefault(name, []).extend([page] * (self.holders[(name, page)] + 1))
            before = state_of(self.ga)
            with pytest.raises(InvalidFreeError):
                self.ga.free(by_group)
            assert state_of(self.ga) == before
            return
        released = self.ga.free(by_group)
        for name, page in picked:
            self.holders[(name, page)] -= 1
        for name, pages in released.items():
            assert sorted(pages.tolist()) == sorted(
                p for (g, p) in picked if g == name and self.holders[(g, p)] == 0)
            assert np.all(self.ga.tags(name)[pages] != [self.live_tag[(name, p)]
                                                        for p in pages.tolist()])

    @invariant()
    def within_budget_no_leak(self) -> None:
        self.ga.check()
        stats = self.ga.stats()
        lent = sum(g.num_chunks for g in stats.groups)
        assert lent + stats.num_free_chunks == stats.num_chunks
        assert lent * stats.chunk_bytes <= stats.budget_bytes
        assert stats.used_bytes + stats.carve_bytes + stats.stranded_bytes == \
            lent * stats.chunk_bytes
        for g in stats.groups:  # a chunk is held only while a page in it is
            pages = [p for (name, p), n in self.holders.items() if name == g.name and n]
            assert g.num_used_pages == len(pages)
            assert g.num_chunks == len({p // g.pages_per_chunk for p in pages})


TestGroupsMachine = GroupsMachine.TestCase
TestGroupsMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# -- sliding windows -----------------------------------------------------------------------


def test_a_window_row_releases_each_page_once_as_it_advances() -> None:
    row = WindowRow(SlidingWindowSpec("swa", window=6, page_size=4, bytes_per_token=8))
    row.append([17, 40, 22, 9, 31])  # tokens 0..19
    assert row.advance(5).tolist() == []  # next query 5 reads 0..5
    assert row.advance(8).tolist() == []  # reads 3..8: page 0 still
    assert row.advance(9).tolist() == [17]  # reads 4..9
    assert row.advance(9).tolist() == []
    assert row.advance(14).tolist() == [40]  # reads 9..14: page 1 (4..7) out, page 2 (8..) in
    pages, first = row.kernel_pages(16)
    assert (pages.tolist(), first) == ([22, 9], 2)
    assert row.kernel_pages()[0].tolist() == [22, 9, 31]
    assert row.held_pages().tolist() == [22, 9, 31]
    assert row.advance(20).tolist() == [22]  # reads 15..20: page 3 (12..15) still
    with pytest.raises(ArgumentError, match="num_computed=19"):
        row.advance(19)  # never goes back
    with pytest.raises(ArgumentError, match="num_computed=21"):
        row.advance(21)  # past the tokens its pages hold
    with pytest.raises(ArgumentError, match="append pages first"):
        row.kernel_pages(21)


@settings(max_examples=200)
@given(window=st.integers(1, 40), page_size=st.integers(1, 12),
       steps=st.lists(st.integers(0, 17), min_size=1, max_size=12))
def test_window_pages_released_plus_listed_cover_the_row_and_listed_hold_the_window(
        window: int, page_size: int, steps: list[int]) -> None:
    spec = SlidingWindowSpec("swa", window, page_size, 1)
    row = WindowRow(spec)
    released: list[int] = []
    computed = 0
    for step in steps:
        end = computed + step
        need = -(-end // page_size) - row.num_pages
        if need > 0:
            row.append(list(range(row.num_pages, row.num_pages + need)))  # page id = index
        pages, first = row.kernel_pages(end)
        # every key the step's queries read is on a listed page
        for q in range(computed, end):
            for key in range(max(0, q - window + 1), q + 1):
                assert key // page_size in pages.tolist()
        assert pages.tolist() == list(range(first, -(-end // page_size)))
        computed = end
        released += row.advance(computed).tolist()
        assert released == list(range(len(released)))  # in order, each once
        assert len(released) == min(first_window_page(computed, window, page_size),
                                     row.num_pages)
    assert sorted(released + row.held_pages().tolist()) == list(range(row.num_pages))


@settings(max_examples=50, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=30))
def test_one_group_on_the_arena_fits_exactly_what_a_plain_pool_would(
        steps: list[tuple[bool, int]]) -> None:
    """With a single group nothing is stranded: whatever the history, n pages fit exactly
    when n <= pages in all chunks - pages held (the plain PageAllocator's answer)."""
    ga = GroupAllocator([FULL], budget_bytes=10 * 3 * FULL.page_bytes,
                        chunk_bytes=3 * FULL.page_bytes)
    held: list[int] = []
    for allocate, num in steps:
        total = ga.arena.num_chunks * ga.pages_per_chunk[0]
        assert ga.can_allocate({"full": num}) == (num <= total - len(held))
        if allocate and ga.can_allocate({"full": num}):
            held += ga.allocate({"full": num})["full"].tolist()
        elif held:
            gone, held = held[:num], held[num:]
            ga.free({"full": gone})
    ga.free({"full": held})
    assert ga.stats().num_free_chunks == ga.arena.num_chunks


def test_a_long_decode_in_a_window_group_holds_a_bounded_number_of_chunks() -> None:
    """WindowRow and GroupAllocator together: pages released as the window moves go back to
    the allocator, chunks that empty go back to the arena, and a 2,000-token decode never
    holds more than the pages of its window and the chunks under them."""
    swa = SlidingWindowSpec("swa", window=40, page_size=8, bytes_per_token=64)
    ga = GroupAllocator([FULL, swa], budget_bytes=40 * 4 * FULL.page_bytes)
    row = WindowRow(swa)
    most_pages = 0
    for num_computed in range(1, 2001):
        if row.num_pages * swa.page_size < num_computed:
            row.append(ga.allocate({"swa": 1})["swa"])
        released = row.advance(num_computed)
        if released.size:
            ga.free({"swa": released})
        held = row.held_pages().size
        assert held == swa.num_pages(num_computed)  # the spec's count is what the row holds
        most_pages = max(most_pages, held)
        ga.check()
    usage = ga.stats().groups[1]
    assert most_pages <= 40 // 8 + 2 and usage.num_used_pages == row.held_pages().size
    assert usage.num_chunks <= -(-most_pages // ga.pages_per_chunk[1]) + 1


# -- per-request cost --------------------------------------------------------------------------


# Qwen3-Next-80B-A3B as vLLM groups it: 12 attention layers (2 KV heads of 256, bf16), and
# 3 x 12 gated-delta-net layers (conv state 8192 x 3, SSM state 32 x 128 x 128, bf16)
QWEN3_NEXT: tuple[GroupSpec, ...] = (
    FullAttentionSpec("attention", page_size=16, bytes_per_token=12 * 2 * 2 * 256 * 2),
    *(StateSpec(f"gdn{i}", bytes_per_state=12 * (8192 * 3 * 2 + 32 * 128 * 128 * 2))
      for i in range(3)),
)


def test_the_padded_layout_is_vllms_block_size_rule() -> None:
    """vLLM raises the attention block size to align * ceil(state / (align * bytes per
    token)) and pads the state page to it: Qwen3-Next's GDN state (1,097,728 bytes per layer)
    over 2,048 attention bytes per token per layer gives 544-token pages, the state padded by
    1.49%."""
    layout = padded_layout(QWEN3_NEXT)
    assert layout.page_size == 544
    assert layout.page_bytes == 544 * 12 * 2048
    state = QWEN3_NEXT[1].page_bytes
    assert round(100 * (layout.page_bytes - state) / state, 2) == 1.49
    # no state group: the token groups' own page size; only states: the largest state
    assert padded_layout([FULL, INDEXER]) == PaddedLayout(16, 16 * 1024)
    assert padded_layout([STATE, StateSpec("s2", 7)]) == PaddedLayout(0, 40_000)


def test_a_short_prompt_pins_a_padded_page_in_every_group() -> None:
    """The vllm#54458 effect: with 23 groups on 7,808-token pages, a 12-token prompt pins one
    padded page in each. A pool of 457,880 tokens of the attention group's bytes holds 58 whole
    padded pages, so the request takes 23/58 = 39.7% of it. kvmem charges the same groups
    their true bytes: 35.8% here, since 21 states of almost a padded page each dominate; the
    two attention-side groups cost a page of 64 tokens instead of 7,808."""
    attention = FullAttentionSpec("attention", page_size=64, bytes_per_token=1024)
    groups: list[GroupSpec] = [attention, IndexerSpec("indexer", attention, 256),
              *(StateSpec(f"gdn{i}", bytes_per_state=7808 * 1024 - 100) for i in range(21))]
    cost = request_cost(groups, 12)
    assert cost.padded.page_size == 7808
    assert cost.padded_num_pages == (1,) * 23 and cost.num_pages == (1,) * 23
    kvmem_share, padded_share = cost.pool_share(457_880 * 1024)
    assert padded_share == 23 / 58
    assert kvmem_share == (64 * 1024 + 64 * 256 + 21 * (7808 * 1024 - 100)) / (457_880 * 1024)
    assert round(100 * kvmem_share, 1) == 35.8
    kvmem_tokens, padded_tokens = cost.tokens_per_gib()
    assert kvmem_tokens / padded_tokens == pytest.approx(cost.total_padded_bytes
                                                         / cost.total_bytes)
    assert padded_tokens == 12 * 2**30 / (23 * 7808 * 1024)


@given(num_tokens=st.integers(0, 5000))
def test_true_bytes_never_exceed_padded_bytes(num_tokens: int) -> None:
    for groups in (QWEN3_NEXT, GROUPS, (FULL, SWA)):
        cost = request_cost(groups, num_tokens)
        assert cost.bytes == tuple(n * g.page_bytes for n, g in zip(cost.num_pages, groups))
        assert sum(cost.bytes) <= sum(cost.padded_bytes) or num_tokens == 0
        assert cost.padded_bytes == tuple(n * cost.padded.page_bytes
                                          for n in cost.padded_num_pages)


def test_request_cost_counts_a_qwen3_next_prompt() -> None:
    cost = request_cost(QWEN3_NEXT, 1000)
    assert cost.num_pages == (63, 1, 1, 1) and cost.padded_num_pages == (2, 1, 1, 1)
    ga = GroupAllocator(QWEN3_NEXT, budget_bytes=4 * cost.total_bytes)
    pages = ga.allocate(cost.needs)
    assert ga.stats().used_bytes == cost.total_bytes
    assert {name: ids.size for name, ids in pages.items()} == cost.needs
    assert cost.bytes[0] == 63 * 16 * 12 * 2048
    with pytest.raises(ArgumentError, match="num_tokens=-1"):
        request_cost(QWEN3_NEXT, -1)
    with pytest.raises(ArgumentError, match="pool_bytes=0"):
        cost.pool_share(0)
