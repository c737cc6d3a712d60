"""PageTable: rows, mapping pages, slots, and argument checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmem import (
    PAD,
    KVMemError,
    OutOfPagesError,
    PageAllocator,
    PageTable,
)
from kvmem.errors import ArgumentError, ArgumentTypeError


def table_with_a_row() -> tuple[Any, int]:
    from kvmem import PageAllocator, PageTable

    table = PageTable(4, 8, 4)
    row = table.add_row()
    table.grow([row], [5], PageAllocator(32))
    return table, row


def table_state(table: Any) -> tuple[bytes, ...]:
    return (table.pages.tobytes(), table.num_pages.tobytes(), table.num_tokens.tobytes(),
            table.generation.tobytes(), bytes(table.num_free_rows))


def make(page_size: int = 4) -> tuple[PageAllocator, PageTable]:
    return PageAllocator(64), PageTable(max_seqs=8, max_pages_per_seq=16, page_size=page_size)


def reference_slots(table: PageTable, row: int, start: int, count: int) -> list[int]:
    ps = table.page_size
    return [int(table.pages[row, t // ps]) * ps + t % ps for t in range(start, start + count)]


def test_map_pages_refuses_a_negative_page() -> None:
    table = PageTable(4, 4, 16)
    row = table.add_row()
    with pytest.raises(ArgumentError):
        table.map_pages(row, [-1])


@pytest.mark.parametrize("call, kind", [
    (lambda t, r: t.remove_row(True), ArgumentTypeError),
    (lambda t, r: t.remove_row(3), ArgumentError),
    (lambda t, r: t.add_rows(-1), ArgumentError),
    (lambda t, r: t.add_rows(True), ArgumentTypeError),
    (lambda t, r: t.set_num_tokens(r, True), ArgumentTypeError),
    (lambda t, r: t.pages_needed([9], [1]), ArgumentError),
    (lambda t, r: t.pages_needed([r], [-1]), ArgumentError),
    (lambda t, r: t.grow([r], 1.5, None), ArgumentTypeError),  # not truncated to 1
    (lambda t, r: t.grow([r], True, None), ArgumentTypeError),
    (lambda t, r: t.grow([0.0], 1, None), ArgumentTypeError),  # [0.0] is not row 0
    (lambda t, r: t.grow([r], [-5], None), ArgumentError),
    (lambda t, r: t.grow([r, r], 1, None), ArgumentError),
    (lambda t, r: t.slot_mapping([r], [8]), ArgumentError),  # past the row's pages
    (lambda t, r: t.slot_mapping([r], [-1]), ArgumentError),
    (lambda t, r: t.token_slots([r], 6, 5), ArgumentError),
    (lambda t, r: t.csr([5]), ArgumentError),
    (lambda t, r: t.csr([r], [1000]), ArgumentError),
    (lambda t, r: t.block_table([r], width=0), ArgumentError),  # narrower than the row
    (lambda t, r: t.row_pages(9), ArgumentError),
])
def test_page_table_refuses_bad_arguments_and_changes_nothing(call: Any, kind: type) -> None:
    table, row = table_with_a_row()
    before = table_state(table)
    with pytest.raises(kind):
        call(table, row)
    assert table_state(table) == before


def test_page_table_answers_for_good_arguments() -> None:
    table, row = table_with_a_row()
    pages = table.row_pages(np.int64(row)).tolist()
    assert table.slot_mapping([row], [4]).tolist() == [pages[1] * 4]
    assert table.token_slots([row], 3, 2).tolist() == [pages[0] * 4 + 3, pages[1] * 4]
    assert table.pages_needed([row], [4]).tolist() == [1]
    assert table.csr([row], [3]).kv_last_page_len.tolist() == [3]
    assert table.block_table([row], width=4).tolist() == [[*pages, -1, -1]]


def test_grow_allocates_only_at_page_boundaries() -> None:
    alloc, table = make()
    rows = np.array([table.add_row() for _ in range(3)])
    table.grow(rows, [4, 3, 1], alloc)
    assert table.num_pages[rows].tolist() == [1, 1, 1]
    result = table.grow(rows, 1, alloc)  # only the full row 0 crosses a boundary
    assert result.new_page_rows.tolist() == [int(rows[0])]
    assert result.new_page_positions.tolist() == [1]
    assert table.num_tokens[rows].tolist() == [5, 4, 2]
    assert result.slot_mapping.dtype == np.int64
    expected = [reference_slots(table, int(r), int(n) - 1, 1)[0] for r, n in
                zip(rows, table.num_tokens[rows])]
    assert result.slot_mapping.tolist() == expected


def test_grow_many_tokens_maps_slots_in_order() -> None:
    alloc, table = make()
    r0, r1 = table.add_row(), table.add_row()
    result = table.grow([r0, r1], [9, 2], alloc)
    assert result.slot_mapping.tolist() == reference_slots(table, r0, 0, 9) + reference_slots(
        table, r1, 0, 2
    )
    assert table.num_pages[[r0, r1]].tolist() == [3, 1]
    assert table.token_slots([r1, r0], [0, 4], [2, 3]).tolist() == reference_slots(
        table, r1, 0, 2
    ) + reference_slots(table, r0, 4, 3)


def test_token_slots_of_one_row_equal_the_reference_at_every_start_and_count() -> None:
    alloc, table = make()
    r0, r1 = table.add_row(), table.add_row()
    for _ in range(8):  # the rows' pages interleave: a row's page ids are not contiguous
        table.grow([r0, r1], [5, 4], alloc)
    assert np.diff(table.pages[r0, :10]).max() > 1
    for start in range(41):
        for count in range(41 - start):
            want = reference_slots(table, r0, start, count)
            assert table.token_slots([r0], start, count).tolist() == want
            assert table.token_slots([r0], [start], [count]).dtype == np.int64


def test_grow_is_all_or_nothing_on_oom() -> None:
    alloc = PageAllocator(3)
    table = PageTable(4, 8, 4)
    rows = [table.add_row(), table.add_row()]
    table.grow(rows, [4, 4], alloc)
    before = (table.pages.copy(), table.num_pages.copy(), table.num_tokens.copy(), alloc.num_free)
    with pytest.raises(OutOfPagesError):
        table.grow(rows, [4, 4], alloc)
    after = (table.pages, table.num_pages, table.num_tokens, alloc.num_free)
    for b, a in zip(before[:3], after[:3]):
        np.testing.assert_array_equal(a, b)
    assert before[3] == after[3]


def test_grow_rejects_bad_rows_and_overlong() -> None:
    alloc, table = make()
    row = table.add_row()
    with pytest.raises(KVMemError, match="not live"):
        table.grow([row + 1], 1, alloc)
    with pytest.raises(ValueError, match="distinct"):
        table.grow([row, row], 1, alloc)
    with pytest.raises(KVMemError, match="max_pages_per_seq"):
        table.grow([row], 16 * 4 + 1, alloc)
    with pytest.raises(ValueError):
        table.grow([row], -1, alloc)
    assert table.num_tokens[row] == 0 and alloc.num_used == 0


def test_csr_and_block_table() -> None:
    alloc, table = make()
    r0, r1, r2 = table.add_row(), table.add_row(), table.add_row()
    table.grow([r0, r1, r2], [9, 4, 1], alloc)
    csr = table.csr([r2, r0, r1])
    assert csr.kv_indptr.dtype == csr.kv_indices.dtype == csr.kv_last_page_len.dtype == np.int32
    assert csr.kv_indptr.tolist() == [0, 1, 4, 5]
    assert csr.kv_indices.tolist() == (
        table.row_pages(r2).tolist() + table.row_pages(r0).tolist() + table.row_pages(r1).tolist()
    )
    assert csr.kv_last_page_len.tolist() == [1, 1, 4]
    bt = table.block_table([r2, r0, r1])
    assert bt.dtype == np.int32 and bt.shape == (3, 3)
    assert bt[0].tolist() == [table.pages[r2, 0], PAD, PAD]
    assert bt[1].tolist() == table.row_pages(r0).tolist()
    # seq_lens shorter than the row (chunked prefill reads a prefix of the pages)
    part = table.csr([r0], seq_lens=[5])
    assert part.kv_indices.tolist() == table.row_pages(r0)[:2].tolist()
    assert part.kv_last_page_len.tolist() == [1]
    assert table.block_table([r0], width=5)[0, 3:].tolist() == [PAD, PAD]


def test_pages_reserved_ahead_are_not_in_metadata() -> None:
    alloc, table = make()
    row = table.add_row()
    table.map_pages(row, alloc.allocate(3))
    table.set_num_tokens(row, 5)
    assert table.csr([row]).kv_indices.size == 2
    result = table.grow([row], 6, alloc)  # fits in the 3 pages already mapped
    assert result.new_pages.size == 0 and table.num_tokens[row] == 11
    with pytest.raises(KVMemError):
        table.set_num_tokens(row, 13)


def test_remove_row_returns_pages_and_clears_padding() -> None:
    alloc, table = make()
    row = table.add_row()
    table.grow([row], 9, alloc)
    pages = table.remove_row(row)
    assert pages.tolist() == [0, 1, 2]
    assert (table.pages[row] == PAD).all() and table.num_tokens[row] == 0
    with pytest.raises(KVMemError):
        table.remove_row(row)
    assert table.add_row() == row  # rows are reused


def test_rows_run_out_with_clear_error() -> None:
    table = PageTable(2, 4, 4)
    table.add_row()
    table.add_row()
    with pytest.raises(KVMemError, match="but 0 of 2 are free"):
        table.add_row()


def test_generations_change_unless_a_row_only_appends() -> None:
    """A row's generation names "this request, nothing but appends since": growing keeps it;
    replacing a page (copy-on-write), closing and reopening the row each change it."""
    alloc, table = make()
    row = table.add_row()
    gen = int(table.generation[row])
    table.grow([row], 5, alloc)
    assert table.generation[row] == gen
    table.replace_pages(np.array([row]), np.array([1]), np.array([42], dtype=np.int32))
    assert table.pages[row, 1] == 42 and table.generation[row] != gen
    gen = int(table.generation[row])
    table.remove_row(row)
    again = table.add_row()
    assert again == row and table.generation[row] not in (gen, 0)


@pytest.mark.parametrize("call, name", [
    (lambda t, r: t.add_rows(-1), "num"),
    (lambda t, r: t.set_num_tokens(1.5, 1), "row"),
    (lambda t, r: t.set_num_tokens(r, -1), "num_tokens"),
    (lambda t, r: t.pages_needed([r], 1.5), "num_new_tokens"),
    (lambda t, r: t.grow([r], [-5], None), "num_new_tokens"),
    (lambda t, r: t.slot_mapping(1.5, [0]), "token_rows"),
    (lambda t, r: t.block_table([r], width=0), "width"),
    (lambda t, r: t.csr([r], 1.5), "seq_lens"),
    (lambda t, r: t.row_pages(1.5), "row"),
])
def test_argument_errors_name_the_argument(call: Any, name: str) -> None:
    """An argument error names the argument the caller got wrong (word for word), so that
    the message points at the call site; nothing changes."""
    table, row = table_with_a_row()
    before = table_state(table)
    with pytest.raises((ArgumentError, ArgumentTypeError), match=rf"\b{name}\b"):
        call(table, row)
    assert table_state(table) == before


def test_slot_mapping_errors_say_what_positions_are_expected() -> None:
    """slot_mapping() names ``positions`` and says what one must pass: a sequence of
    positions, one per token."""
    table, row = table_with_a_row()
    with pytest.raises(ArgumentTypeError, match=r"^positions=1\.5 \(float\): expected a 1-D "
                       r"sequence of integer positions .*one position is passed as \[position\]"):
        table.slot_mapping([row], 1.5)
    with pytest.raises(ArgumentError, match="got 1 token_rows and 2 positions: give one "
                       "position per token"):
        table.slot_mapping([row], [0, 1])


def test_slot_mapping_reaches_the_last_mapped_slot() -> None:
    """Every slot of the row's mapped pages has a slot mapping, the last one included (the
    bound is ``position < num_pages * page_size``)."""
    table, row = table_with_a_row()  # 5 tokens in 2 pages of 4: slots 0..7 are mapped
    last = int(table.pages[row, 1]) * 4 + 3
    assert table.slot_mapping([row], [7]).tolist() == [last]
    with pytest.raises(ArgumentError, match=r"tokens 8\.\.8 are not in them"):
        table.slot_mapping([row], [8])


def test_add_rows_hands_out_the_lowest_free_rows_in_order_as_int32() -> None:
    """add_rows(num) returns ``[num]`` int32 rows, lowest first; 0 rows is a valid request."""
    table = PageTable(6, 4, 4)
    empty = table.add_rows(0)
    assert empty.dtype == np.int32 and empty.size == 0 and table.num_free_rows == 6
    rows = table.add_rows(3)
    assert rows.dtype == np.int32 and rows.tolist() == [0, 1, 2]
    assert table.live_rows.tolist() == [0, 1, 2]
    assert table.add_rows(2).tolist() == [3, 4]


def test_set_num_tokens_accepts_every_count_from_zero_to_the_mapped_slots() -> None:
    """set_num_tokens() takes 0 .. num_pages * page_size (both ends); past that it says to map
    more pages, and changes nothing."""
    table, row = table_with_a_row()  # 2 pages of 4
    for n in (0, 8, 3):
        table.set_num_tokens(row, n)
        assert table.num_tokens[row] == n
    with pytest.raises(ArgumentError, match=r"cannot hold 9 tokens; map more pages first"):
        table.set_num_tokens(row, 9)
    assert table.num_tokens[row] == 3


def test_map_pages_names_the_negative_ids_it_refuses() -> None:
    """map_pages() lists the negative ids it got (at most 8; a page 0 is fine) and says that
    PAD marks a row's end."""
    table = PageTable(4, 16, 4)
    row = table.add_row()
    with pytest.raises(ArgumentError, match=r"got page ids \[-1, -2, -3, -4, -5, -6, -7, -8\]; "
                       r"page ids are >= 0 \(PAD marks the end of a row\)"):
        table.map_pages(row, [0, 1, -1, -2, -3, -4, -5, -6, -7, -8, -9])
    assert table.num_pages[row] == 0


def test_map_pages_fills_a_row_to_max_pages_per_seq_and_no_further() -> None:
    """A row takes pages up to exactly max_pages_per_seq; one more raises, naming the limit,
    and changes nothing."""
    table = PageTable(2, 4, 4)
    row = table.add_row()
    table.map_pages(row, [5, 6, 7])
    with pytest.raises(KVMemError, match=r"maps 3 pages and cannot take 2 more "
                       r"\(max_pages_per_seq=4\)"):
        table.map_pages(row, [8, 9])
    table.map_pages(row, [8])
    assert table.row_pages(row).tolist() == [5, 6, 7, 8]
    with pytest.raises(KVMemError, match="max_pages_per_seq=4"):
        table.map_pages(row, [9])
    assert table.row_pages(row).tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("num_new_tokens", [4, [4, 4]], ids=["one-page-step", "per-row"])
def test_grow_fills_rows_to_max_pages_per_seq_and_refuses_one_page_more(
        num_new_tokens: Any) -> None:
    """Both growth paths (a step of at most one page, counts per row) fill a row to exactly
    max_pages_per_seq pages; one token more raises ArgumentError naming the limit, and
    changes nothing: a full row never writes into its neighbour's columns."""
    alloc, table = PageAllocator(64), PageTable(3, 2, 4)
    rows = table.add_rows(2)
    table.grow(rows, 4, alloc)
    table.grow(rows, num_new_tokens, alloc)
    assert table.num_pages[rows].tolist() == [2, 2]
    other = table.add_row()
    before = table_state(table)
    with pytest.raises(ArgumentError, match=r"rows \[0, 1\] would need more than "
                       r"max_pages_per_seq=2 pages"):
        table.grow(rows, 1, alloc)
    with pytest.raises(ArgumentError, match="max_pages_per_seq=2"):
        table.grow(rows, [1, 1], alloc)
    assert table_state(table) == before and table.num_pages[other] == 0
    assert alloc.num_used == 4


def test_grow_error_lists_at_most_eight_rows() -> None:
    """The overlong-rows error lists the first 8 rows only."""
    alloc, table = PageAllocator(64), PageTable(10, 1, 4)
    rows = table.add_rows(10)
    with pytest.raises(ArgumentError, match=r"rows \[0, 1, 2, 3, 4, 5, 6, 7\] would need"):
        table.grow(rows, [5] * 10, alloc)


@pytest.mark.parametrize("num_new", [2, 3, 4])
def test_a_step_of_several_tokens_maps_each_token_in_order(num_new: int) -> None:
    """grow() by a few tokens per row (at most one page each: the decode step's path) maps
    every new token, row by row and in order, to its own slot."""
    alloc, table = make()
    rows = np.array([table.add_row() for _ in range(3)])
    table.grow(rows, [4, 3, 1], alloc)
    start = table.num_tokens[rows].copy()
    result = table.grow(rows, num_new, alloc)
    want = [slot for r, s in zip(rows, start)
            for slot in reference_slots(table, int(r), int(s), num_new)]
    assert result.slot_mapping.tolist() == want
    assert table.num_tokens[rows].tolist() == (start + num_new).tolist()


def test_not_live_and_repeated_rows_are_listed_up_to_sixteen() -> None:
    """Errors about rows list the first 16 rows given."""
    alloc, table = PageAllocator(64), PageTable(20, 2, 4)
    first16 = ", ".join(str(r) for r in range(16))
    with pytest.raises(ArgumentError, match=rf"rows \[{first16}\] include rows that are not"):
        table.grow(list(range(17)), 1, alloc)
    table.add_rows(1)
    zeros16 = ", ".join(["0"] * 16)
    with pytest.raises(ArgumentError, match=rf"rows must be distinct, got \[{zeros16}\]$"):
        table.grow([0] * 17, 1, alloc)


def test_num_forked_counts_the_rows_marked_forked() -> None:
    """num_forked follows set_forked() whether rows were marked before or not."""
    table = PageTable(4, 2, 4)
    a, b, c = table.add_rows(3)
    table.set_forked(np.array([a, b]), True)
    assert table.num_forked == 2
    table.set_forked(np.array([b, c]), True)
    assert table.num_forked == 3
    table.set_forked(np.array([a, c]), False)
    assert table.num_forked == 1
    table.remove_row(b)
    assert table.num_forked == 0 and not table.forked.any()


def test_csr_and_block_table_take_seq_lens_from_one_to_the_mapped_slots() -> None:
    """A row's seq_len may be 1 (one token read) up to its mapped slots; 0 or past them
    raises, saying the range."""
    table, row = table_with_a_row()  # 2 pages of 4
    first = int(table.pages[row, 0])
    assert table.csr([row], [1]).kv_indices.tolist() == [first]
    assert table.block_table([row], [1]).tolist() == [[first]]
    assert table.csr([row], [8]).kv_last_page_len.tolist() == [4]
    for bad in (0, 9):
        with pytest.raises(ArgumentError, match=r"each must be in 1\.\.the row's mapped slots "
                           r"\(num_pages \* page_size\)"):
            table.csr([row], [bad])


@pytest.mark.parametrize("num_pages, num_tokens", [(5, 8), (2, 9), (2, -1)])
def test_open_row_refuses_too_many_pages_or_tokens_they_cannot_hold(num_pages: int,
                                                                    num_tokens: int) -> None:
    """open_row() refuses more pages than max_pages_per_seq, and a token count outside
    0 .. the pages' slots, each on its own; nothing changes."""
    table = PageTable(2, 4, 4)
    before = table_state(table)
    with pytest.raises(KVMemError, match="cannot map"):
        table.open_row(np.arange(num_pages, dtype=np.int32), num_tokens)
    assert table_state(table) == before
    row = table.open_row(np.arange(2, dtype=np.int32), 8)
    assert table.row_pages(row).tolist() == [0, 1] and table.num_tokens[row] == 8


def test_the_table_needs_at_least_one_row_column_and_slot() -> None:
    """A table of 1 row, 1 column, 1 slot per page is fine; 0 of any is refused by name."""
    table = PageTable(1, 1, 1)
    assert table.pages.shape == (1, 1)
    for i, name in enumerate(("max_seqs", "max_pages_per_seq", "page_size")):
        args = [1, 1, 1]
        args[i] = 0
        with pytest.raises(ArgumentError, match=rf"^{name} must be a positive int, got 0$"):
            PageTable(*args)


def test_token_slots_of_several_rows_with_one_start_and_count() -> None:
    """token_slots() with one start and count for several rows gives every row's slots, row
    by row."""
    alloc, table = make()
    r0, r1 = table.add_row(), table.add_row()
    table.grow([r0, r1], [6, 6], alloc)
    assert table.token_slots([r0, r1], 3, 2).tolist() == (
        reference_slots(table, r0, 3, 2) + reference_slots(table, r1, 3, 2))


def test_slots_of_a_page_id_near_the_int32_limit_do_not_wrap() -> None:
    """Slots are int64: page id * page_size past 2**31 does not wrap (page ids are int32,
    slots are not)."""
    table = PageTable(1, 2, 16)
    row = table.add_row()
    table.map_pages(row, [2**30, 2**30 + 1])
    table.set_num_tokens(row, 20)
    want = [2**34 + 15, 2**34 + 16, 2**34 + 17]
    assert table.token_slots([row], 15, 3).tolist() == want
    assert table.slot_mapping([row, row, row], [15, 16, 17]).tolist() == want
