from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmem import PAD, CheckingTracker, NoOpTracker, PageAllocator, PageTable, Tracker
from kvmem.integrity import Reason, check_block_table, check_csr


class Batch:
    """Three requests with mapped pages and a tracker that recorded them."""

    def __init__(self) -> None:
        self.alloc = PageAllocator(32)
        self.table = PageTable(max_seqs=4, max_pages_per_seq=8, page_size=4)
        self.tracker = CheckingTracker(4, 8)
        self.rows = np.array([self.table.add_row() for _ in range(3)])
        self.grow([9, 5, 2])

    def grow(self, num_new_tokens: list[int] | int) -> None:
        g = self.table.grow(self.rows, num_new_tokens, self.alloc)
        self.tracker.record(g.new_page_rows, g.new_page_positions, self.alloc.tags[g.new_pages])

    def num_pages(self) -> np.ndarray:
        return (self.table.num_tokens[self.rows] + 3) // 4

    def verify_all_forms(self, block_table: np.ndarray | None = None):  # type: ignore[no-untyped-def]
        """Verify with block table and CSR, numpy and torch; all four must agree."""
        bt = self.table.block_table(self.rows) if block_table is None else block_table
        csr = self.table.csr(self.rows)
        n = self.num_pages()
        tags = self.alloc.tags
        reports = [
            self.tracker.verify(self.rows, n, tags, block_table=bt),
            self.tracker.verify(
                self.rows, n, torch.from_numpy(tags.copy()), block_table=torch.from_numpy(bt)
            ),
        ]
        if block_table is None:
            reports += [
                self.tracker.verify(self.rows, n, tags, kv_indptr=csr.kv_indptr,
                                    kv_indices=csr.kv_indices),
                self.tracker.verify(
                    self.rows, n, torch.from_numpy(tags.copy()),
                    kv_indptr=torch.from_numpy(csr.kv_indptr),
                    kv_indices=torch.from_numpy(csr.kv_indices),
                ),
            ]
        first = reports[0]
        for other in reports[1:]:
            assert other.failed == first.failed
            for a, b in zip(first.entries, other.entries):
                np.testing.assert_array_equal(a, b)
        return first


def test_silent_on_correct_batch_across_steps() -> None:
    batch = Batch()
    for _ in range(20):
        batch.grow(1)
        report = batch.verify_all_forms()
        assert report.ok and report.failed == () and report.reasons() == {}


def test_fires_on_page_freed_and_reallocated_to_another_request() -> None:
    batch = Batch()
    victim, other = batch.rows[1], batch.rows[2]
    stolen = int(batch.table.pages[victim, 0])
    batch.alloc.free([stolen])  # freed behind the request's back ...
    # ... and handed to another request, which maps it
    batch.alloc._free_stack[batch.alloc._num_free - 1] = stolen  # next page out is the stolen one
    new = batch.alloc.allocate(1)
    assert int(new[0]) == stolen
    batch.table.map_pages(other, new)
    report = batch.verify_all_forms()
    assert report.failed == (int(victim),)
    e = report.entries
    assert e.reason.tolist() == [Reason.REALLOCATED]
    assert (e.position.tolist(), e.page.tolist()) == ([0], [stolen])
    assert e.found_tag[0] == batch.alloc.tags[stolen] != e.expected_tag[0]
    assert "reallocated" in report.reasons()[int(victim)]


def test_fires_on_page_freed_but_not_reused() -> None:
    batch = Batch()
    victim = batch.rows[0]
    page = int(batch.table.pages[victim, 2])
    batch.alloc.free([page])
    report = batch.verify_all_forms()
    assert report.failed == (int(victim),)
    assert report.entries.reason.tolist() == [Reason.FREED]
    assert report.entries.found_tag.tolist() == [0]


def test_fires_on_wrong_page_in_row() -> None:
    batch = Batch()
    victim, other = batch.rows[0], batch.rows[1]
    batch.table.pages[victim, 1] = batch.table.pages[other, 0]  # another request's live page
    report = batch.verify_all_forms()
    assert report.failed == (int(victim),)
    assert report.entries.reason.tolist() == [Reason.REALLOCATED]


def test_fires_on_corrupted_padding_and_out_of_range() -> None:
    batch = Batch()
    bt = batch.table.block_table(batch.rows)
    bt[2, 2] = 5  # stale column past request 2's single page
    bt[1, 0] = 1000  # out of range
    report = batch.verify_all_forms(block_table=bt)
    assert report.failed == (int(batch.rows[1]), int(batch.rows[2]))
    assert sorted(report.entries.reason.tolist()) == [Reason.OUT_OF_RANGE, Reason.PADDING]


def test_fires_on_csr_length_mismatch() -> None:
    batch = Batch()
    csr = batch.table.csr(batch.rows)
    n = batch.num_pages()
    n[0] += 1  # the request maps more pages than the metadata gives the kernel
    entries = check_csr(csr.kv_indptr, csr.kv_indices, n, batch.tracker.expected_tags[batch.rows],
                        batch.alloc.tags)
    assert entries.reason.tolist() == [Reason.LENGTH] and entries.batch_index.tolist() == [0]


def test_unrecorded_page_fires() -> None:
    batch = Batch()
    batch.tracker.forget([batch.rows[0]])
    report = batch.verify_all_forms()
    assert report.failed == (int(batch.rows[0]),)
    assert set(report.entries.reason.tolist()) == {Reason.UNMAPPED}


def test_report_uses_request_ids() -> None:
    batch = Batch()
    batch.alloc.free([int(batch.table.pages[batch.rows[2], 0])])
    bt = batch.table.block_table(batch.rows)
    report = batch.tracker.verify(batch.rows, batch.num_pages(), batch.alloc.tags,
                                  block_table=bt, ids=("a", "b", "c"))
    assert report.failed == ("c",)
    assert list(report.reasons()) == ["c"]


def test_noop_tracker_records_nothing_and_passes() -> None:
    tracker = NoOpTracker()
    assert isinstance(tracker, Tracker) and isinstance(CheckingTracker(1, 1), Tracker)
    assert not tracker.enabled
    tracker.record([0], [0], [1])
    assert tracker.verify([0], [1], np.zeros(1, dtype=np.int64), block_table=np.array([[7]])).ok


def test_verify_needs_exactly_one_metadata_form() -> None:
    batch = Batch()
    with pytest.raises(ValueError):
        batch.tracker.verify(batch.rows, batch.num_pages(), batch.alloc.tags)


def test_check_block_table_direct() -> None:
    tags = np.array([0, 5, 6], dtype=np.int64)
    bt = np.array([[1, 2], [2, PAD]], dtype=np.int32)
    expected = np.array([[5, 6], [6, 0]], dtype=np.int64)
    assert check_block_table(bt, np.array([2, 1]), expected, tags).num_bad == 0
    tags[2] = 9
    bad = check_block_table(bt, np.array([2, 1]), expected, tags)
    assert bad.batch_index.tolist() == [0, 1] and bad.found_tag.tolist() == [9, 9]


# -- the qualified tag format (mutation survivors of kvmem/integrity/_tags.py) ---------------------


def test_qualify_packs_lifetime_and_namespace_and_refuses_what_would_spill() -> None:
    """Guards qualify's bounds and messages: namespace ids -1 (a free page) .. MAX_NAMESPACES - 1
    pass, as one int or one per tag; anything else raises naming ``tags`` or ``namespace_ids``
    and what each must hold (an id of MAX_NAMESPACES would spill into the lifetime bits)."""
    from kvmem.errors import ArgumentError, ArgumentTypeError
    from kvmem.integrity._tags import MAX_NAMESPACES, NS_BITS, qualify

    top = MAX_NAMESPACES - 1
    got = qualify(np.array([1, 0, 3]), np.array([top, 5, -1]))
    assert got.tolist() == [1 << NS_BITS | top, 0, 3 << NS_BITS]
    assert qualify(np.array([2]), 0).tolist() == [2 << NS_BITS]
    assert qualify(np.array([2]), -1).tolist() == [2 << NS_BITS]
    assert qualify(np.array([2]), top).tolist() == [2 << NS_BITS | top]
    bound = rf"-1\.\.{top}"
    cases = [
        (np.array([1.5]), 0, ArgumentTypeError, r"^tags has dtype float64: expected a 1-D "
         r"sequence of integer tags"),
        (np.array([-1]), 0, ArgumentError, r"^tags holds tags from -1 to -1: expected every "
         r"tag in >= 0"),
        (np.array([1]), -2, ArgumentError, rf"^namespace_ids=-2: expected an integer in {bound}"),
        (np.array([1]), MAX_NAMESPACES, ArgumentError,
         rf"^namespace_ids={MAX_NAMESPACES}: expected an integer in {bound}"),
        (np.array([1]), np.array([-2]), ArgumentError, r"^namespace_ids holds namespace ids "
         rf"from -2 to -2: expected every namespace id in {bound}"),
        (np.array([1]), np.array([MAX_NAMESPACES]), ArgumentError,
         rf"^namespace_ids holds namespace ids from {MAX_NAMESPACES}"),
        (np.array([1]), np.array([1, 2]), ArgumentError, r"^namespace_ids has 2 entries for 1 "
         r"tags: give one per tag, or one int for all$"),
    ]
    for tags, ns, error, message in cases:
        with pytest.raises(error, match=message):
            qualify(tags, ns)


def test_lifetime_and_namespace_of_read_ints_numpy_and_torch_integers_only() -> None:
    """Guards the readers of qualified tags: ints >= 0, numpy arrays and torch tensors of any
    integer dtype (uint64 included) are split into lifetime and namespace id; a float dtype or
    a negative int raises naming what it got."""
    from kvmem.errors import ArgumentError, ArgumentTypeError
    from kvmem.integrity._tags import (
        NS_BITS,
        lifetime_of,
        namespace_id_of,
        raw_lifetime_of,
        raw_namespace_id_of,
    )

    q = 5 << NS_BITS | 3
    assert (lifetime_of(q), namespace_id_of(q)) == (5, 3)
    assert (raw_lifetime_of(q), raw_namespace_id_of(q)) == (5, 3)
    assert lifetime_of(0) == 0 and namespace_id_of(0) == 0
    assert lifetime_of(np.array([q])).tolist() == [5]
    assert namespace_id_of(np.array([q], dtype=np.uint64)).tolist() == [3]
    assert lifetime_of(torch.tensor([q])).tolist() == [5]
    assert namespace_id_of(torch.tensor([q], dtype=torch.int64)).tolist() == [3]
    with pytest.raises(ArgumentTypeError, match=r"^qualified tags have dtype float64: "
                       r"expected integers$"):
        lifetime_of(np.array([1.0]))
    with pytest.raises(ArgumentTypeError, match=r"^qualified tags have dtype torch\.float32: "
                       r"expected integers$"):
        namespace_id_of(torch.tensor([1.0]))
    with pytest.raises(ArgumentError, match=r"^qualified=-1: expected an integer >= 0"):
        lifetime_of(-1)
