"""The standalone integrity checkers and the testing helpers keep what docs/integrity.md and
their docstrings promise: every kind of bad entry gets its reason, both forms agree, and input
they cannot compare is refused with a MetadataError (never an IndexError from numpy)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvmem.errors import ArgumentError, ArgumentTypeError, MetadataError
from kvmem.integrity import (
    BadEntries,
    CheckingTracker,
    Reason,
    check_block_table,
    check_block_table_torch,
    check_csr,
    check_csr_torch,
)

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


# -- what each checker returns --------------------------------------------------------------------


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


# -- what each checker refuses --------------------------------------------------------------------

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


# -- kvmem.testing: ToyEngine, kv_value_array ---------------------------------------------------


def _manager() -> Any:
    from kvmem import KVCacheManager

    return KVCacheManager(num_pages=16, page_size=4, max_seqs=4, max_pages_per_seq=8,
                          tracker="checking")


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


# -- helpers the doc names: owned_pages, validate_step_fields, prompts ----------------------------


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


def test_prompts_keep_to_max_len() -> None:
    """prompts(max_len=3) drew the stem's head whole: prompts of up to 12 tokens."""
    from hypothesis import given, settings

    from kvmem.testing import prompts

    @settings(max_examples=200, database=None)
    @given(prompts(max_len=3))
    def short(prompt: list[int]) -> None:
        assert 1 <= len(prompt) <= 3, prompt

    @settings(max_examples=1, database=None)
    @given(prompts(max_len=0))
    def empty(prompt: list[int]) -> None:
        pass

    short()
    with pytest.raises(ArgumentError, match="max_len"):
        empty()


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
