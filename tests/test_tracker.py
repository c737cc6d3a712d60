"""Trackers and the integrity checks: recording tags, checking a step's metadata in every form."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from pool_fixtures import small_pool

from kvmem import PAD, CheckingTracker, NoOpTracker, PageAllocator, PageTable, Tracker
from kvmem.errors import ArgumentError, ArgumentTypeError, MetadataError
from kvmem.integrity import (
    BadEntries,
    IntegrityReport,
    Reason,
    check_block_table,
    check_block_table_torch,
    check_csr,
    check_csr_torch,
    checked_beside,
    owned_pages,
    row_is_own,
    validate_block_table,
    validate_step_fields,
)


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


TAGS = np.array([0, 5, 6, 7], dtype=np.int64)  # page 0 free, pages 1..3 live


def _entries(e: BadEntries) -> list[tuple[int, ...]]:
    return list(zip(e.batch_index.tolist(), e.position.tolist(), e.page.tolist(),
                    e.expected_tag.tolist(), e.found_tag.tolist(), e.reason.tolist()))


def _t(*arrays: Any) -> list[Any]:
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _both_block_table(*args: Any) -> list[tuple[int, ...]]:
    """check_block_table's entries, after asserting the torch form gives the same."""
    got = _entries(check_block_table(*args))
    assert _entries(check_block_table_torch(*_t(*args))) == got
    return got


def _both_csr(*args: Any) -> list[tuple[int, ...]]:
    got = _entries(check_csr(*args))
    assert _entries(check_csr_torch(*_t(*args))) == got
    return got


BT = np.array([[1, 2, -1]], dtype=np.int32)


EXPECTED = np.array([[5, 6, 0]], dtype=np.int64)


NUM = np.array([2])


BAD_INPUTS = {  # (num_pages, expected_tags, tags) -> the field the error names
    "num_pages 2-D": ((NUM[None], EXPECTED, TAGS), "num_pages"),
    "num_pages of floats": ((NUM.astype(float), EXPECTED, TAGS), "num_pages"),
    "num_pages None": ((None, EXPECTED, TAGS), "num_pages"),
    "expected_tags 1-D": ((NUM, EXPECTED[0], TAGS), "expected_tags"),
    "expected_tags of another batch": ((NUM, np.zeros((2, 3), np.int64), TAGS),
                                       "expected_tags"),
    "expected_tags of floats": ((NUM, EXPECTED.astype(float), TAGS), "expected_tags"),
    "tags a list": ((NUM, EXPECTED, TAGS.tolist()), "tags"),
    "tags 2-D": ((NUM, EXPECTED, TAGS[None]), "tags"),
    "tags of floats": ((NUM, EXPECTED, TAGS.astype(float)), "tags"),
}


def _manager() -> Any:
    from kvmem import KVCacheManager

    return KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8,
                          tracker="checking")


def test_the_tag_mirror_takes_every_non_negative_int64() -> None:
    """Tags are non-negative int64; the largest, 2**63 - 1, was refused ("valid tags are
    0..2**63 - 2")."""
    import numpy as np

    pool = small_pool()
    top = 2**63 - 1
    pool.update_tags([1], [top])
    assert int(pool.tags[1]) == top
    pool.load_tags(np.full(4, top, dtype=np.int64))
    assert pool.tags.tolist() == [top] * 4
    before = pool.tags.clone()
    with pytest.raises(ArgumentError):
        pool.update_tags([0], np.array([2**63], dtype=np.uint64))
    with pytest.raises(ArgumentError, match="tags from -1"):
        pool.update_tags([0], [-1])
    assert torch.equal(pool.tags, before)


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


def test_a_block_table_narrower_than_a_requests_pages_is_a_length_failure() -> None:
    """The kernel reads num_pages[b] entries of row b: a table of 2 columns for a request of
    4 pages passed (both listed pages were good), in both forms and through the tracker."""
    bt = np.array([[1, 2], [3, -1]], dtype=np.int32)
    expected = np.array([[5, 6, 0, 0], [7, 0, 0, 0]], dtype=np.int64)
    got = _both_block_table(bt, np.array([4, 1]), expected, TAGS)
    assert got == [(0, -1, -1, 0, -1, Reason.LENGTH)]
    tracker = CheckingTracker(2, 4)
    tracker.record([0, 0, 1], [0, 1, 0], [5, 6, 7])
    report = tracker.verify([0, 1], [4, 1], TAGS, block_table=bt)
    assert report.failed == (0,)
    assert report.entries.reason.tolist() == [Reason.LENGTH]
    assert tracker.verify([0, 1], [2, 1], TAGS, block_table=bt).ok


def test_csr_with_nothing_recorded_is_unmapped_not_an_index_error() -> None:
    """expected_tags ``[B, 0]`` (nothing recorded anywhere): the block-table form answered
    UNMAPPED, the CSR forms raised IndexError."""
    got = _both_csr(np.array([0, 2]), np.array([1, 2]), np.array([2]),
                    np.zeros((1, 0), dtype=np.int64), TAGS)
    assert got == [(0, 0, 1, 0, 5, Reason.UNMAPPED), (0, 1, 2, 0, 6, Reason.UNMAPPED)]


def test_with_no_physical_page_every_listed_page_is_out_of_range() -> None:
    """tags ``[0]``: every form raised IndexError."""
    no_pages = TAGS[:0]
    expected = np.array([[5, 0]], dtype=np.int64)
    assert _both_block_table(np.array([[1, -1]]), np.array([1]), expected, no_pages) == [
        (0, 0, 1, 5, -1, Reason.OUT_OF_RANGE)]
    assert _both_csr(np.array([0, 1]), np.array([1]), np.array([1]), expected, no_pages) == [
        (0, 0, 1, 5, -1, Reason.OUT_OF_RANGE)]


def test_both_forms_agree_on_an_unsigned_block_table() -> None:
    """A uint8 table holding 255 past the request's pages: numpy flagged PADDING, torch
    compared 255 with -1 as uint8 (equal) and passed it."""
    bt = np.array([[1, 2, 255]], dtype=np.uint8)
    got = _both_block_table(bt, np.array([2]), np.array([[5, 6, 0]]), TAGS)
    assert got == [(0, 2, 255, 0, -1, Reason.PADDING)]


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
@pytest.mark.parametrize("form", ["block table", "csr"])
def test_inputs_a_check_cannot_compare_are_a_metadata_error_naming_them(bad: str,
                                                                        form: str) -> None:
    """They raised IndexError, AttributeError or a numpy ValueError, or (floats) were
    compared as they came: a float64 tag past 2**53 is not the tag it was."""
    (num, expected, tags), field = BAD_INPUTS[bad]
    with pytest.raises(MetadataError, match=field):
        if form == "block table":
            check_block_table(BT, num, expected, tags)
        else:
            check_csr(np.array([0, 2]), np.array([1, 2]), num, expected, tags)


@pytest.mark.parametrize("fn, meta", [
    (check_block_table_torch, (BT,)),
    (check_csr_torch, (np.array([0, 2]), np.array([1, 2]))),
])
def test_a_mix_of_numpy_and_tensors_is_a_metadata_error(fn: Any, meta: tuple[Any, ...]) -> None:
    """The doc: a mix is refused with a MetadataError. The torch forms given numpy arrays, or
    a numpy tags array, raised TypeError or AttributeError from torch; the numpy forms took
    tensors by accident."""
    with pytest.raises(MetadataError, match="numpy"):
        fn(*_t(*meta), *_t(NUM, EXPECTED), TAGS)
    with pytest.raises(MetadataError, match="numpy"):
        fn(*meta, NUM, EXPECTED, TAGS)
    numpy_fn = check_block_table if fn is check_block_table_torch else check_csr
    with pytest.raises(MetadataError, match="tags"):
        numpy_fn(*meta, NUM, EXPECTED, torch.from_numpy(TAGS))
    # Through a tracker: metadata of the other kind than the tags, refused, nothing changed.
    tracker = CheckingTracker(1, 3)
    tracker.record([0, 0], [0, 1], EXPECTED[0, :2])
    before = tracker.expected_tags.copy(), tracker.num_changes
    names = ("block_table",) if fn is check_block_table_torch else ("kv_indptr", "kv_indices")
    for tags, given in ((TAGS, _t(*meta)), (torch.from_numpy(TAGS), meta)):
        with pytest.raises(MetadataError, match="where the tags are"):
            tracker.verify([0], NUM, tags, **dict(zip(names, given)))
    assert np.array_equal(tracker.expected_tags, before[0])
    assert tracker.num_changes == before[1]
    assert tracker.verify([0], NUM, TAGS, **dict(zip(names, meta))).ok


def test_tensors_on_different_devices_are_a_metadata_error() -> None:
    """They raised torch's RuntimeError ("Tensor on device cpu is not on the expected
    device")."""
    meta = torch.zeros((1, 3), dtype=torch.int32, device="meta")
    with pytest.raises(MetadataError, match="different devices"):
        check_block_table_torch(meta, *_t(NUM, EXPECTED, TAGS))
    tracker = CheckingTracker(1, 3)
    with pytest.raises(MetadataError, match="different devices"):
        tracker.verify([0], [2], torch.from_numpy(TAGS).to("meta"),
                       block_table=torch.from_numpy(BT))


def test_tracker_verify_refuses_counts_and_labels_it_cannot_use() -> None:
    """num_pages ``["1"]`` or ``[1.5]`` failed the request with LENGTH; float tags were
    compared as floats; ids shorter than the batch raised IndexError when ``failed`` was
    read; ids ``"ab"`` labelled two rows."""
    tracker = CheckingTracker(2, 3)
    tracker.record([0], [0], [5])
    csr = {"kv_indptr": np.array([0, 1]), "kv_indices": np.array([1], np.int32)}
    before = tracker.expected_tags.copy(), tracker.num_changes
    for num in (["1"], [1.5]):
        with pytest.raises(MetadataError, match="num_pages"):
            tracker.verify([0], num, TAGS, **csr)
    with pytest.raises(MetadataError, match="tags"):
        tracker.verify([0], [1], TAGS.astype(float), **csr)
    with pytest.raises(ArgumentError, match="ids"):
        tracker.verify([0, 1], [1, 0], TAGS, kv_indptr=np.array([0, 1, 1]),
                       kv_indices=np.array([9], np.int32), ids=("a",))
    with pytest.raises(ArgumentTypeError, match="ids"):  # one label, not two
        tracker.verify([0, 1], [1, 0], TAGS, kv_indptr=np.array([0, 1, 1]),
                       kv_indices=np.array([9], np.int32), ids="ab")
    assert np.array_equal(tracker.expected_tags, before[0])
    assert tracker.num_changes == before[1]
    assert tracker.verify([0], [1], TAGS, **csr).ok
    assert tracker.verify([], [], TAGS, kv_indptr=np.array([0]),
                          kv_indices=np.array([], np.int32)).ok


@pytest.mark.parametrize("prompt, kind", [
    ([1.5, 2.0], ArgumentTypeError), ("abc", ArgumentError), ([[1, 2]], ArgumentError),
    ([-1, 2], ArgumentError),
])
def test_the_toy_engine_refuses_a_prompt_the_manager_would_and_changes_nothing(
        prompt: Any, kind: type) -> None:
    """np.asarray(prompt, dtype=int64) turned [1.5, 2.0] into [1, 2] and admitted it (the
    manager refuses float token ids), keeping 1.5 as the engine's token; "abc" raised numpy's
    ValueError."""
    from kvmem.testing import ToyEngine

    mgr = _manager()
    engine = ToyEngine(mgr)
    with pytest.raises(kind):
        engine.admit("a", prompt)
    assert engine.seqs == {} and not mgr.running and mgr.stats().num_free == 16
    engine.admit("a", np.array([1, 2, 3], dtype=np.int32))
    engine.step(["a"], 3)
    engine.check_kv()
    assert engine.seqs["a"].tokens == [1, 2, 3]


def test_the_toy_engine_refuses_a_sampler_it_cannot_call() -> None:
    """sampler=5 was accepted and raised "'int' object is not callable" at the first step past
    a prompt."""
    from kvmem.testing import ToyEngine

    with pytest.raises(ArgumentTypeError, match="sampler"):
        ToyEngine(_manager(), sampler=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("ns_key, tokens, kind", [
    (-1, [1], ArgumentError), (1 << 64, [1], ArgumentError),
    (1, [1.5], ArgumentTypeError), (1, [[1, 2], [3, 4]], ArgumentError),
    (1, "abc", ArgumentError), (1, [2**63], ArgumentError), (1, None, ArgumentError),
])
def test_kv_value_array_refuses_what_is_no_namespace_key_or_token_stream(
        ns_key: Any, tokens: Any, kind: type) -> None:
    """It raised OverflowError (a negative key, a key of 2**64, a token past int64), numpy's
    ValueError (2-D, a str) or TypeError (None), and gave [1.5] the values of [1]."""
    from kvmem.testing import kv_value_array

    with pytest.raises(kind):
        kv_value_array(ns_key, tokens)
    top = kv_value_array((1 << 64) - 1, np.array([0, 3], dtype=np.uint8))
    assert top.dtype == np.int64 and top.shape == (2,) and top.all()
    assert np.array_equal(kv_value_array(7, torch.tensor([1, 2])), kv_value_array(7, [1, 2]))


def test_owned_pages_refuses_recorded_tags_that_do_not_fit_the_row() -> None:
    """Three pages with two recorded tags raised numpy's IndexError (row_is_own said False)."""
    from kvmem.integrity import owned_pages

    q = (np.array([5, 6], dtype=np.int64) << 20) | 1
    refcounts = np.array([0, 1, 1, 1])
    with pytest.raises(ArgumentError, match="recorded"):
        owned_pages(np.array([1, 2, 3]), q, TAGS, refcounts)
    assert owned_pages(np.array([1, 3]), q, TAGS, refcounts).tolist() == [[0, 1], [1, 2]]


@pytest.mark.parametrize("meta", [None, [("slot_mapping", np.arange(3))]])
def test_validate_step_fields_refuses_what_is_no_mapping(meta: Any) -> None:
    """It raised AttributeError ('NoneType' object has no attribute 'get')."""
    from kvmem.integrity import validate_step_fields

    with pytest.raises(ArgumentTypeError, match="mapping"):
        validate_step_fields(meta, 1)
    validate_step_fields({"slot_mapping": np.arange(3), "seq_lens": np.array([3])}, 1, 3)


def test_qualify_refuses_a_namespace_id_that_would_spill_into_the_lifetime() -> None:
    """A namespace id of 2**20 or more was OR-ed into the lifetime bits: page 5 of namespace
    2**20 qualified as page 6 of namespace 0; a bool id was taken as 1, a float one raised a
    numpy error."""
    from kvmem.integrity import MAX_NAMESPACES, lifetime_of, namespace_id_of, qualify

    tags = np.array([5, 0, 7], dtype=np.int64)
    for bad in (MAX_NAMESPACES, np.array([1, 2, MAX_NAMESPACES + 3]), -2, 2**70):
        with pytest.raises(ArgumentError, match="namespace_ids"):
            qualify(tags, bad)
    good = qualify(tags, np.array([MAX_NAMESPACES - 1, -1, 3]))
    assert lifetime_of(good).tolist() == [5, 0, 7]
    assert namespace_id_of(good).tolist() == [MAX_NAMESPACES - 1, 0, 3]
    assert qualify(tags, np.int32(3)).tolist() == qualify(tags, [3, 3, 3]).tolist()
    # Arguments qualify cannot use are refused by name (numpy errors and silent bools before).
    for bad_ns, kind in ((True, ArgumentTypeError), (1.5, ArgumentTypeError),
                         ("a", ArgumentTypeError), (None, ArgumentTypeError),
                         (np.array([1.0, 2.0, 3.0]), ArgumentTypeError),
                         ([1, 2], ArgumentError), (np.array([[1]]), ArgumentError)):
        with pytest.raises(kind, match="namespace_ids"):
            qualify(tags, bad_ns)
    for bad_tags, kind in ((np.array([5.0]), ArgumentTypeError), (np.array([-1]), ArgumentError),
                           ("x", ArgumentTypeError)):
        with pytest.raises(kind, match="tags"):
            qualify(bad_tags, 0)
    assert tags.tolist() == [5, 0, 7]


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


def test_record_and_forget_each_count_one_change_and_bump_only_their_rows() -> None:
    """A verifier learns which rows ``record``/``forget`` touched from ``num_changes`` (one
    per call) and ``versions`` (the touched rows take the new count; the others keep theirs:
    a kept row's proof stays usable)."""
    tracker = CheckingTracker(4, 8)
    tracker.record([1, 1], [0, 1], [5, 6])
    assert tracker.num_changes == 1 and tracker.versions.tolist() == [0, 1, 0, 0]
    tracker.forget([2])
    assert tracker.num_changes == 2 and tracker.versions.tolist() == [0, 1, 2, 0]
    tracker.record([3, 0], [0, 0], [7, 8])
    assert tracker.num_changes == 3 and tracker.versions.tolist() == [3, 1, 2, 3]
    assert tracker.expected_tags[:, :2].tolist() == [[8, 0], [5, 6], [0, 0], [7, 0]]


@pytest.mark.parametrize("args, message", [
    (([0], [8], [5]), r"^positions holds positions from 8 to 8: expected every position in "
                      r"0\.\.7\. Nothing was changed\.$"),
    (([0], [0], [-5]), r"^tags holds tags from -5 to -5: expected every tag in >= 0\. "
                       r"Nothing was changed\.$"),
    (([0], [0, 1], [5]), r"^record\(\) got 1 rows, 2 positions and 1 tags: give one position "
                         r"and one tag per row entry\. Nothing was changed\.$"),
])
def test_record_refuses_bad_entries_with_an_error_that_names_them(args: Any,
                                                                  message: str) -> None:
    """The error says which argument, what it held and what is allowed (a position past the
    tracker's width is refused, never wrapped); nothing changes."""
    tracker = CheckingTracker(4, 8)
    with pytest.raises(ArgumentError, match=message):
        tracker.record(*args)
    assert tracker.num_changes == 0 and not tracker.expected_tags.any()


def test_an_empty_report_holds_empty_int64_entries() -> None:
    """The report of a clean batch (and NoOpTracker's) has every ``BadEntries`` field an empty
    int64 array, like a failing one's, so callers index them alike."""
    for report in (IntegrityReport(),
                   NoOpTracker().verify([0], [1], TAGS, block_table=np.array([[1]]))):
        assert report.ok and report.failed == () and report.reasons() == {}
        for name, field in zip(BadEntries._fields, report.entries):
            assert isinstance(field, np.ndarray), name
            assert field.dtype == np.int64 and field.shape == (0,), name


def test_reasons_name_the_first_bad_entry_and_count_them() -> None:
    """One line per failed request: its first bad entry and how many it has ("1 bad entry",
    "2 bad entries")."""
    e = BadEntries(*(np.array(v, dtype=np.int64) for v in (
        [1, 0, 1], [2, 0, 3], [7, 9, 8], [50, 60, 70], [0, 61, 71],
        [Reason.FREED, Reason.REALLOCATED, Reason.REALLOCATED])))
    report = IntegrityReport(("x", "y"), e)
    assert report.failed == ("x", "y")
    assert report.reasons() == {
        "x": "page was reallocated to another lifetime (tag changed): position 0, page 9, "
             "expected tag 60, found tag 61 (1 bad entry)",
        "y": "page was freed (tag 0) while still mapped: position 2, page 7, expected tag 50, "
             "found tag 0 (2 bad entries)",
    }


def test_a_page_id_out_of_range_is_never_the_rows_own() -> None:
    """row_is_own answers False for a negative page id (never indexed from the end, where it
    may meet the recorded lifetime) and for one past the last page (no IndexError)."""
    q = (np.array([7, 5], dtype=np.int64) << 20) | 1  # lifetimes 7 (page 3's) and 5 (page 1's)
    assert row_is_own(np.array([3, 1]), q, TAGS)
    assert not row_is_own(np.array([-1, 1]), q, TAGS)  # TAGS[-1] is page 3's tag, 7
    assert not row_is_own(np.array([4, 1]), q, TAGS)
    assert not row_is_own(np.array([3, 2]), q, TAGS)


def test_bad_entries_are_int64_in_both_forms() -> None:
    """``BadEntries`` fields are int64 arrays (the documented contract), whatever the
    metadata's dtype, in the numpy and torch forms of both checks."""
    bt = np.array([[1, 3, 5]], dtype=np.int32)  # page 3 is another lifetime; 5 a stale column
    expected = np.array([[5, 6, 0]], dtype=np.int64)
    for e in (check_block_table(bt, NUM, expected, TAGS),
              check_block_table_torch(*_t(bt, NUM, expected, TAGS)),
              check_csr(np.array([0, 2], np.int32), bt[0, :2], NUM, expected, TAGS),
              check_csr_torch(*_t(np.array([0, 2], np.int32), bt[0, :2], NUM, expected, TAGS))):
        assert e.num_bad
        for name, field in zip(BadEntries._fields, e):
            assert isinstance(field, np.ndarray) and field.dtype == np.int64, name


@pytest.mark.parametrize("page", [4, -9])
def test_a_page_id_just_past_the_last_or_far_below_zero_is_out_of_range(page: int) -> None:
    """Page ``num_pages`` is out of range (not the last page's tag), and a page id below
    ``-num_pages`` too (the torch form raised IndexError), in both forms of both checks."""
    expected = np.array([[7, 0]], dtype=np.int64)
    want = [(0, 0, page, 7, -1, Reason.OUT_OF_RANGE)]
    assert _both_block_table(np.array([[page, -1]]), np.array([1]), expected, TAGS) == want
    assert _both_csr(np.array([0, 1]), np.array([page]), np.array([1]), expected, TAGS) == want


def test_a_request_reading_no_page_must_still_have_padding_only() -> None:
    """A block-table row of a request that reads no page holds PAD only: a stale column there
    is PADDING even though no listed entry needs checking."""
    got = _both_block_table(np.array([[3, -1]]), np.array([0]), np.zeros((1, 2), np.int64),
                            TAGS)
    assert got == [(0, 0, 3, 0, 7, Reason.PADDING)]
    assert _both_block_table(np.array([[-1, -1]]), np.array([0]), np.zeros((1, 2), np.int64),
                             TAGS) == []


def test_a_csr_row_longer_than_the_recorded_width_is_unmapped_past_it_in_both_forms() -> None:
    """An entry past the tracker's width was recorded nothing (expected 0): UNMAPPED even when
    it lists the same page as the last recorded position (the torch form compared it with
    that position's tag)."""
    expected = np.array([[5, 6]], dtype=np.int64)
    got = _both_csr(np.array([0, 3]), np.array([1, 2, 2]), np.array([3]), expected, TAGS)
    assert got == [(0, 2, 2, 0, 6, Reason.UNMAPPED)]


def test_the_numpy_checks_refuse_tensors_naming_them() -> None:
    """check_block_table / check_csr are the numpy forms: tensors are refused with a
    MetadataError (the torch forms take them), never compared."""
    with pytest.raises(MetadataError, match="tensors"):
        check_block_table(*_t(BT, NUM, EXPECTED, TAGS))
    with pytest.raises(MetadataError, match="tensors"):
        check_csr(*_t(np.array([0, 2]), BT[0, :2], NUM, EXPECTED, TAGS))


def test_a_block_table_of_another_batch_is_refused_naming_the_field() -> None:
    with pytest.raises(MetadataError, match=r"^block_table must be integers shaped \[2, \*\]"):
        validate_block_table(BT, 2)


def test_the_constructor_names_a_bad_width_and_versions_are_int64() -> None:
    with pytest.raises(ArgumentError, match=r"^max_pages_per_seq=0: expected an integer >= 1"):
        CheckingTracker(4, 0)
    tracker = CheckingTracker(2, 4)
    assert tracker.versions.dtype == np.int64 and tracker.expected_tags.dtype == np.int64


@pytest.mark.parametrize("call, kind, message", [
    (lambda t: t.verify([0], [1], [5], block_table=np.array([[1]])), ArgumentTypeError,
     r"^tags=\[5\] \(list\): expected the live tags as an int64 numpy array or torch tensor "
     r"\(allocator\.tags, pool\.tags\)$"),
    (lambda t: t.verify([0], [1], TAGS, block_table=np.array([[1]]), ids=("a", "b")),
     ArgumentError, r"^ids lists 2 labels for 1 rows: give one per row, in batch order\. "
                    r"Nothing was checked\.$"),
])
def test_tracker_verify_errors_say_what_was_given(call: Any, kind: type, message: str) -> None:
    with pytest.raises(kind, match=message):
        call(CheckingTracker(2, 4))


_ONE_OF_KIND = ("{name}: got tensors where the others are numpy arrays: the check runs where "
                "the tags are; pass numpy metadata with numpy tags (allocator.tags, a step's "
                "arrays), tensors on one device with a device mirror (pool.tags, "
                "step.tensors(device)). Nothing was checked")


@pytest.mark.parametrize("field, args, message", [
    ("kv_indices", (np.array([0, 1]), np.array([[1]]), NUM[:1], EXPECTED, TAGS),
     r"^kv_indices must be integers shaped \[\*\]"),
    ("tags", (np.array([0, 1]), np.array([1]), NUM[:1], EXPECTED, TAGS[None]),
     r"^tags must be integers shaped \[\*\]"),
    ("expected_tags", (np.array([0, 1]), np.array([1]), NUM[:1], torch.from_numpy(EXPECTED),
                       TAGS), "^" + re.escape(_ONE_OF_KIND.format(name="expected_tags")) + "$"),
    ("tags", (np.array([0, 1]), np.array([1]), NUM[:1], EXPECTED, torch.from_numpy(TAGS)),
     "^" + re.escape(_ONE_OF_KIND.format(name="tags")) + "$"),
])
def test_check_input_errors_name_the_field_and_what_to_pass(field: str, args: Any,
                                                           message: str) -> None:
    """The MetadataError of a check names the field it refuses (by its argument name) and,
    for a numpy/tensor mix, which kind was found, which was expected and what to pass."""
    with pytest.raises(MetadataError, match=message):
        check_csr(*args)


def test_length_failures_are_int64_entries() -> None:
    """A LENGTH failure's entries (position, page, found tag -1) are int64 like the others."""
    e = check_csr(np.array([0, 1]), np.array([1]), np.array([2]), EXPECTED, TAGS)
    assert e.reason.tolist() == [Reason.LENGTH]
    for name, field in zip(BadEntries._fields, e):
        assert field.dtype == np.int64, name
    assert (e.position.tolist(), e.page.tolist(), e.found_tag.tolist()) == ([-1], [-1], [-1])


def test_owned_pages_counts_page_zero_like_any_other() -> None:
    """Page 0 is a page: held when live (no records) or when it carries its recorded
    lifetime, in row order."""
    tags = np.array([4, 5, 6, 7], dtype=np.int64)
    refcounts = np.array([1, 1, 0, 1])
    assert owned_pages(np.array([0, 1, 2]), None, tags, refcounts).tolist() == [[0, 0], [1, 1]]
    q = (np.array([4, 5], dtype=np.int64) << 20) | 1
    assert owned_pages(np.array([0, 1]), q, tags, refcounts).tolist() == [[0, 0], [1, 1]]


def test_validate_step_fields_names_a_malformed_slot_mapping() -> None:
    with pytest.raises(MetadataError, match=r"^slot_mapping must be integers shaped \[\*\]"):
        validate_step_fields({"slot_mapping": np.zeros((1, 2), np.int64)}, 1)


def test_a_batch_of_nine_beside_a_proof_of_up_to_71_replaces_it() -> None:
    """A batch is checked beside the proven one only when it is smaller and at most
    max(8, proven / 8) rows (a prefill chunk between decode steps)."""
    assert checked_beside(8, 10) and not checked_beside(9, 10) and not checked_beside(9, 71)
    assert checked_beside(9, 72) and not checked_beside(10, 10)


@pytest.mark.cuda
def test_the_torch_checks_run_on_a_cuda_device_and_agree_with_numpy() -> None:
    """Every tensor the torch forms build lives on their inputs' device; bad entries come
    back as host int64 arrays equal to the numpy form's."""
    bt = np.array([[1, 3, 5]], dtype=np.int32)
    expected = np.array([[5, 6, 0]], dtype=np.int64)
    on = [torch.from_numpy(a).cuda() for a in (bt, NUM, expected, TAGS)]
    assert _entries(check_block_table_torch(*on)) == _entries(
        check_block_table(bt, NUM, expected, TAGS))
    indptr = np.array([0, 2], np.int32)
    on = [torch.from_numpy(a).cuda() for a in (indptr, bt[0, :2], NUM, expected, TAGS)]
    assert _entries(check_csr_torch(*on)) == _entries(
        check_csr(indptr, bt[0, :2], NUM, expected, TAGS))
    tracker = CheckingTracker(1, 3)
    tracker.record([0, 0], [0, 1], [5, 6])
    report = tracker.verify([0], torch.tensor([2]).cuda(), TAGS, kv_indptr=indptr,
                            kv_indices=bt[0, :2])  # counts on the device, tags on the host
    assert report.entries.reason.tolist() == [Reason.REALLOCATED]


_CSR = {"kv_indptr": np.array([0, 1]), "kv_indices": np.array([1], np.int32)}


@pytest.mark.parametrize("call, kind, message", [
    (lambda t: t.verify([0], [1], TAGS), MetadataError,
     r"^verify\(\) needs exactly one of block_table or kv_indptr \+ kv_indices; nothing was "
     r"checked$"),
    (lambda t: t.verify([0], [1], TAGS, block_table=np.array([[1]]), **_CSR), MetadataError,
     r"^verify\(\) needs exactly one of block_table"),
    (lambda t: t.verify([0], [1], TAGS, block_table=np.array([[1]]),
                        kv_indptr=_CSR["kv_indptr"]), MetadataError,
     r"^verify\(\) needs exactly one of block_table"),
    (lambda t: t.verify([0], [1], TAGS, kv_indptr=np.array([0, 1, 1]),
                        kv_indices=_CSR["kv_indices"]), MetadataError,
     r"^kv_indptr must be integers shaped \[2\], got shape \[3\]"),
    (lambda t: t.verify([0], [1], TAGS, kv_indptr=_CSR["kv_indptr"]), MetadataError,
     r"^kv_indices must be a numpy array or a torch tensor of integers, got NoneType"),
    (lambda t: t.verify([9], [1], TAGS, **_CSR), ArgumentError,
     r"^rows holds rows from 9 to 9: expected every row in 0\.\.1\. Nothing was changed\.$"),
    (lambda t: t.verify([0], [1, 1], TAGS, **_CSR), ArgumentError,
     r"^num_pages has shape \(2,\): expected \(1,\), one count per row\. Nothing was "
     r"checked\.$"),
    (lambda t: t.verify([0], [1.5], TAGS, **_CSR), MetadataError,
     r"^num_pages must be integers shaped \[1\], got shape \[1\] of float64"),
    (lambda t: t.verify([0], [1], TAGS, block_table=np.array([1])), MetadataError,
     r"^block_table must be integers shaped \[1, \*\], got shape \[1\]"),
    (lambda t: t.verify([0], [1], TAGS, kv_indptr=np.array([0, 2]),
                        kv_indices=np.array([1], np.int32)), MetadataError,
     r"^kv_indptr must start at 0, never decrease, and end at len\(kv_indices\) = 1; got "
     r"first 0, last 2\. Nothing was checked or changed$"),
    (lambda t: t.verify([0], [1], TAGS, ids=5, **_CSR), ArgumentTypeError, r"^ids=5 \(int\)"),
])
def test_tracker_verify_refusals_name_the_argument_and_change_nothing(
        call: Any, kind: type, message: str) -> None:
    tracker = CheckingTracker(2, 3)
    tracker.record([0], [0], [5])
    before = tracker.expected_tags.copy(), tracker.versions.copy(), tracker.num_changes
    with pytest.raises(kind, match=message):
        call(tracker)
    assert np.array_equal(tracker.expected_tags, before[0])
    assert np.array_equal(tracker.versions, before[1]) and tracker.num_changes == before[2]


@pytest.mark.parametrize("tags_form", ["numpy", "torch"])
def test_tracker_verify_of_an_empty_batch_a_wide_csr_and_tensor_counts(tags_form: str) -> None:
    """An empty batch is clean; a CSR row longer than the tracker is wide is checked past its
    width (UNMAPPED there, not an IndexError); counts may come as a tensor with numpy tags."""
    tracker = CheckingTracker(2, 2)
    tracker.record([0, 0], [0, 1], [5, 6])
    tags: Any = TAGS if tags_form == "numpy" else torch.from_numpy(TAGS.copy())
    conv = (lambda a: a) if tags_form == "numpy" else torch.from_numpy
    empty = tracker.verify([], [], tags, kv_indptr=conv(np.array([0])),
                           kv_indices=conv(np.array([], np.int32)))
    assert empty.ok and empty.failed == ()
    report = tracker.verify([0], torch.tensor([3]), tags, kv_indptr=conv(np.array([0, 3])),
                            kv_indices=conv(np.array([1, 2, 2], np.int32)), ids=("a",))
    assert _entries(report.entries) == [(0, 2, 2, 0, 6, Reason.UNMAPPED)]
    assert report.failed == ("a",)
    bt = conv(np.array([[1, 2, 2]], np.int32))
    report = tracker.verify([0], [3], tags, block_table=bt)
    assert _entries(report.entries) == [(0, 2, 2, 0, 6, Reason.UNMAPPED)]


def test_a_checking_tracker_is_not_paranoid_by_default_and_its_arrays_are_read_only() -> None:
    """The tracker is the only writer of ``expected_tags`` and ``versions`` (docstring):
    the views it hands out refuse writes."""
    tracker = CheckingTracker(2, 2)
    assert tracker.paranoid is False and tracker.claimed is False
    for view in (tracker.expected_tags, tracker.versions):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
    with pytest.raises(ArgumentError, match=r"^max_seqs=0: expected an integer >= 1"):
        CheckingTracker(0, 4)
    with pytest.raises(ArgumentTypeError, match=r"^paranoid=1 \(int\)"):
        CheckingTracker(4, 8, paranoid=1)


def test_a_closed_row_expects_nothing_and_a_reopened_one_only_its_pages() -> None:
    """clear_row leaves 0 (nothing recorded) everywhere in the row, so a request that reuses
    the row expects no page past the ones record_row gave it."""
    tracker = CheckingTracker(2, 4)
    tracker.record_row(1, np.array([5, 6, 7], dtype=np.int64))
    tracker.clear_row(1)
    assert tracker.expected_tags[1].tolist() == [0, 0, 0, 0]
    tracker.record_row(1, np.array([9], dtype=np.int64))
    assert tracker.expected_tags[1].tolist() == [9, 0, 0, 0]


@pytest.mark.parametrize("value, message", [
    (memoryview(bytes(2)), r"^kv_indptr must be a numpy array or a torch tensor of integers, "
                           r"got memoryview"),
    (torch.zeros(2), r"^kv_indptr must be integers shaped \[\*\], got shape \[2\] of "
                     r"torch\.float32"),
    (torch.zeros(2, dtype=torch.bool), r"^kv_indptr must be integers shaped \[\*\], got "
                                       r"shape \[2\] of torch\.bool"),
    (torch.zeros(2, dtype=torch.complex64), r"^kv_indptr must be integers shaped"),
])
def test_require_int_array_refuses_what_is_no_integer_array_or_tensor(value: Any,
                                                                      message: str) -> None:
    """An object with a shape that is no tensor, and float, bool or complex tensors, are
    refused with a MetadataError naming the field (bools are no page ids)."""
    from kvmem.integrity import require_int_array

    with pytest.raises(MetadataError, match=message):
        require_int_array("kv_indptr", value, (None,))


def test_owned_pages_lists_a_page_once_when_another_position_records_its_lifetime() -> None:
    """A row whose position 1 recorded the lifetime of the page at its position 0 (a wrong
    ``tracker.record``) listed page 0 twice: aborting the request then freed it twice and
    verify raised InvalidFreeError."""
    tags = np.array([4, 5, 6, 7], dtype=np.int64)
    refcounts = np.array([1, 1, 1, 0])
    q = (np.array([4, 4], dtype=np.int64) << 20) | 1  # position 1 names page 0's lifetime
    assert owned_pages(np.array([0, 1]), q, tags, refcounts).tolist() == [[0, 0]]


def test_verify_aborts_a_request_whose_record_names_its_own_other_page_and_frees_it_once(
        ) -> None:
    """The same fault through the manager: verify aborts only that request without freeing a
    page twice (it raised InvalidFreeError), the rest of the batch verifies, and the page whose
    recorded tag lies is not freed (kvmem cannot tell it from another request's page) but
    reported by ``check()`` as held by no one."""
    from engine_helpers import prefill

    from kvmem import KVCacheManager
    from kvmem.errors import IntegrityError

    mgr = KVCacheManager(32, page_size=4, max_seqs=4, tracker="checking", prefix_cache=None)
    prefill(mgr, "a", list(range(8)))  # two pages
    prefill(mgr, "b", list(range(10, 18)))
    row = mgr.row_of("a")
    second = int(mgr.pages_of("a")[1])
    mgr.tracker.record([row], [1], [int(mgr.tracker.expected_tags[row, 0])])
    report = mgr.verify(["a", "b"])
    assert list(report.aborted) == ["a"] and mgr.running == ("b",)
    assert mgr.verify(["b"]).ok
    with pytest.raises(IntegrityError, match=rf"pages \[{second}\] are held by no row"):
        mgr.check()
