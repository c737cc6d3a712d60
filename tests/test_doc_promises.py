"""Promises of README.md and docs/{manager,integrity,errors,data_types,capacity_planning}.md,
each probed where an audit found it broken (or held but untested)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmem import ArgumentError, ArgumentTypeError, KVCacheManager, KVMemError


def manager() -> KVCacheManager:
    mgr = KVCacheManager(64, page_size=4, max_seqs=8, tracker="checking")
    mgr.admit("a", list(range(10)))
    return mgr


def state(mgr: KVCacheManager) -> tuple[Any, ...]:
    return (mgr.allocator.tags.tobytes(), mgr.allocator.refcounts.tobytes(),
            mgr.table.pages.tobytes(), mgr.table.num_tokens.tobytes(),
            mgr.table.num_committed.tobytes(), mgr.stats(), mgr.running, mgr.preempted)


# -- docs/errors.md: a kvmem error, argument errors are ValueError/TypeError, nothing changed --

@pytest.mark.parametrize("call", ["admit", "can_admit", "match_prefix", "commit", "resume"])
def test_ragged_token_ids_are_an_argument_error(call: str) -> None:
    mgr = manager()
    mgr.reserve(["a"], 2)
    mgr.preempt("a") if call == "resume" else None
    before = state(mgr)
    ragged = [[1], [2, 3]]
    with pytest.raises(ArgumentError, match="token_ids"):
        {"admit": lambda: mgr.admit("b", ragged), "can_admit": lambda: mgr.can_admit(ragged),
         "match_prefix": lambda: mgr.match_prefix(ragged),
         "commit": lambda: mgr.commit("a", ragged),
         "resume": lambda: mgr.resume("a", ragged)}[call]()
    assert state(mgr) == before


@pytest.mark.parametrize("tokens", [[True, False], [1.0, 2.0], np.array([1.5]), ["1", "2"]])
def test_token_ids_of_the_wrong_type_are_a_type_error(tokens: Any) -> None:
    mgr = manager()
    before = state(mgr)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        mgr.admit("b", tokens)
    assert state(mgr) == before


@pytest.mark.parametrize("tokens", [[1.5], [True], np.array([2.0])])
def test_commit_batch_refuses_non_integer_tokens_by_type(tokens: Any) -> None:
    mgr = manager()
    mgr.reserve(["a"], 1)
    before = state(mgr)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        mgr.commit_batch(["a"], tokens)
    assert state(mgr) == before


def test_commit_batch_with_the_wrong_count_names_token_ids() -> None:
    mgr = manager()
    mgr.reserve(["a"], 1)
    with pytest.raises(ArgumentError, match=r"token_ids=\[1, 2\].*2 token lists for 1 requests"):
        mgr.commit_batch(["a"], [1, 2])


@pytest.mark.parametrize("call", [
    lambda m: m.reserve(["zz"], 1), lambda m: m.commit("zz", [1]), lambda m: m.verify(["zz"]),
    lambda m: m.preempt("zz"), lambda m: m.release("zz"), lambda m: m.release_batch(["zz"]),
    lambda m: m.resume("a"), lambda m: m.can_resume("a"), lambda m: m.fork("zz", "c"),
    lambda m: m.admit("a", [1, 2]), lambda m: m.fork("a", "a"), lambda m: m.pages_of("zz"),
    lambda m: m.commit("a", list(range(50))), lambda m: m.admit("b", list(range(1000))),
    lambda m: m.namespace_of_page(63),
])
def test_an_unknown_or_unfit_request_argument_is_an_argument_error(call: Any) -> None:
    """An id the manager does not know (or knows already), a prompt or chunk too long for a
    row: argument mistakes, so ArgumentError (a ValueError), changing nothing."""
    mgr = manager()
    before = state(mgr)
    with pytest.raises(ArgumentError):
        call(mgr)
    assert state(mgr) == before


def test_a_reserve_past_max_pages_per_seq_is_an_argument_error() -> None:
    mgr = manager()
    mgr.reserve(["a"], 200)
    before = state(mgr)
    with pytest.raises(ArgumentError, match="max_pages_per_seq"):
        mgr.reserve(["a"], 100)
    assert state(mgr) == before


def test_a_repeated_request_id_is_named() -> None:
    mgr = manager()
    mgr.admit("b", [5, 6])
    for call in (lambda: mgr.reserve(["a", "b", "a"], 1), lambda: mgr.verify(["b", "a", "b"]),
                 lambda: mgr.release_batch(["a", "b", "b"])):
        with pytest.raises(ArgumentError, match=r"lists '[ab]' twice"):
            call()
    assert set(mgr.running) == {"a", "b"}


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


def test_every_manager_error_is_a_kvmem_error() -> None:
    mgr = manager()
    with pytest.raises(KVMemError):
        mgr.reserve([["zz"]], 1)  # unhashable id


# -- docs/integrity.md: the tracker records only well-formed entries; malformed metadata is a
# MetadataError ----------------------------------------------------------------------------

@pytest.mark.parametrize("rows, positions, tags, kind", [
    ([0], [0, 1], [5], ArgumentError),  # lengths differ: no broadcasting
    ([0], [0], [-5], ArgumentError),  # a tag is never negative
    ([0], [0], [5.0], ArgumentTypeError),  # [1.7] is not page 1, 5.0 not tag 5
    ([0], [0], [True], ArgumentTypeError),
    (0, 0, 5, ArgumentTypeError),  # one id where a list is expected
    ([1.0], [0], [5], ArgumentTypeError),
])
def test_tracker_record_refuses_malformed_entries(rows: Any, positions: Any, tags: Any,
                                                  kind: type) -> None:
    from kvmem import CheckingTracker

    tracker = CheckingTracker(4, 8)
    tracker.record([1], [0], [7])
    before = (tracker.expected_tags.tobytes(), tracker.versions.tobytes(), tracker.num_changes)
    with pytest.raises(kind):
        tracker.record(rows, positions, tags)
    assert (tracker.expected_tags.tobytes(), tracker.versions.tobytes(),
            tracker.num_changes) == before


def test_tracker_forget_refuses_one_row_and_the_constructor_checks_its_types() -> None:
    from kvmem import CheckingTracker

    tracker = CheckingTracker(4, 8)
    tracker.record([0], [0], [7])
    with pytest.raises(ArgumentTypeError, match="rows"):
        tracker.forget(0)
    assert tracker.expected_tags[0, 0] == 7
    with pytest.raises(ArgumentTypeError, match="max_seqs"):
        CheckingTracker(True, 8)
    with pytest.raises(ArgumentTypeError, match="paranoid"):
        CheckingTracker(4, 8, paranoid=1)


def test_tracker_verify_refuses_malformed_metadata_with_a_metadata_error() -> None:
    from kvmem import CheckingTracker, MetadataError

    tracker = CheckingTracker(4, 8)
    tracker.record([0], [0], [5])
    tags = np.zeros(8, dtype=np.int64)
    tags[3] = 5
    indptr, indices = np.array([0, 1]), np.array([3])
    assert tracker.verify([0], [1], tags, kv_indptr=indptr, kv_indices=indices).ok
    for kwargs in ({}, {"block_table": np.array([[3]]), "kv_indptr": indptr,
                        "kv_indices": indices},
                   {"kv_indptr": [0, 1], "kv_indices": [3]},  # Python lists
                   {"kv_indptr": np.array([0, 1, 1]), "kv_indices": indices}):
        with pytest.raises(MetadataError):
            tracker.verify([0], [1], tags, **kwargs)
    with pytest.raises(ArgumentError, match="rows"):
        tracker.verify([9], [1], tags, kv_indptr=indptr, kv_indices=indices)
    with pytest.raises(ArgumentError, match="num_pages"):
        tracker.verify([0], [1, 1], tags, kv_indptr=indptr, kv_indices=indices)
    with pytest.raises(ArgumentTypeError, match="tags"):
        tracker.verify([0], [1], tags.tolist(), kv_indptr=indptr, kv_indices=indices)


# -- docs/errors.md for kvmem.PageTable: ids never wrap, one id is not a list, bools and floats
# are not counts, and a refused call changes nothing -----------------------------------------

def table_with_a_row() -> tuple[Any, int]:
    from kvmem import PageAllocator, PageTable

    table = PageTable(4, 8, 4)
    row = table.add_row()
    table.grow([row], [5], PageAllocator(32))
    return table, row


def table_state(table: Any) -> tuple[bytes, ...]:
    return (table.pages.tobytes(), table.num_pages.tobytes(), table.num_tokens.tobytes(),
            table.generation.tobytes(), bytes(table.num_free_rows))


@pytest.mark.parametrize("call, kind", [
    (lambda t, r: t.remove_rows(r), ArgumentTypeError),  # one row where a list is expected
    (lambda t, r: t.remove_rows([0.0]), ArgumentTypeError),
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


def test_a_checking_tracker_serves_one_manager() -> None:
    """docs/integrity.md: the tracker is the only writer of its expected tags; two managers on
    one tracker would overwrite each other's rows (like a prefix cache, it binds to one)."""
    from kvmem import CheckingTracker

    tracker = CheckingTracker(8, 16)
    first = KVCacheManager(64, page_size=4, max_seqs=8, max_pages_per_seq=16, tracker=tracker)
    with pytest.raises(ArgumentError, match="tracker"):
        KVCacheManager(64, page_size=4, max_seqs=8, max_pages_per_seq=16, tracker=tracker)
    first.admit("a", [1, 2, 3])
    assert first.tracker is tracker and tracker.expected_tags[first.row_of("a"), 0] > 0
    with pytest.raises(ArgumentTypeError, match="tracker"):
        KVCacheManager(64, tracker=3)
    with pytest.raises(ArgumentTypeError, match="pool"):
        KVCacheManager(64, pool=object())


# -- docs/manager.md (hooks) and docs/data_types.md (nonfinite="raise") --------------------------

def test_hook_arguments_of_the_wrong_type_or_kind_are_refused_by_name() -> None:
    mgr = manager()
    for kind in (3, ["admit"], None):
        with pytest.raises(ArgumentTypeError, match="kind"):
            mgr.add_hook(kind, print)
    with pytest.raises(ArgumentTypeError, match="callable"):
        mgr.add_hook("admit", 3)
    with pytest.raises(ArgumentError, match="kind='nope'"):
        mgr.remove_hook("nope", print)
    with pytest.raises(ArgumentError, match="not registered"):
        mgr.remove_hook("admit", print)
    mgr.admit("b", [1])  # no hook was added by the refused calls


def test_a_nonfinite_write_under_raise_is_a_config_error_and_writes_nothing() -> None:
    import torch

    from kvmem import ConfigError, PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1,
                             head_dim=4, dtype="fp8_e4m3", nonfinite="raise", device="cpu"))
    before = pool.page_bytes.clone()
    k = torch.tensor([[[float("nan"), 1.0, 2.0, 3.0]]])
    with pytest.raises(ConfigError, match="nonfinite"):
        pool.write(0, torch.tensor([0]), k, torch.zeros(1, 1, 4))
    assert torch.equal(pool.page_bytes, before) and pool.stats().num_nonfinite == 0


def test_a_pool_serves_one_manager() -> None:
    from kvmem import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1,
                             head_dim=4, device="cpu"))
    KVCacheManager(8, page_size=4, pool=pool)
    with pytest.raises(ArgumentError, match="already claimed"):
        KVCacheManager(8, page_size=4, pool=pool)


# -- docs/manager.md: reserve's StepMetadata ------------------------------------------------------

def test_step_metadata_shapes_and_dtypes_are_the_documented_ones() -> None:
    mgr = manager()  # "a": 10 prompt tokens, page size 4
    mgr.admit("b", [7, 8])
    step = mgr.reserve(["a", "b"], [10, 2])
    assert step.slot_mapping.dtype == np.int64 and step.slot_mapping.shape == (12,)
    for name, shape in (("qo_indptr", (3,)), ("kv_indptr", (3,)), ("kv_indices", (4,)),
                        ("kv_last_page_len", (2,)), ("seq_lens", (2,))):
        field = getattr(step, name)
        assert field.dtype == np.int32 and field.shape == shape, name
    assert step.kv_last_page_len.tolist() == [2, 2] and step.seq_lens.tolist() == [10, 2]
    assert step.block_table.dtype == np.int32
    assert step.block_table.tolist() == [mgr.pages_of("a").tolist(),
                                         [*mgr.pages_of("b").tolist(), -1, -1]]
    tensors = step.tensors("cpu")
    assert str(tensors["slot_mapping"].dtype) == "torch.int64"
    assert all(str(t.dtype) == "torch.int32" for k, t in tensors.items() if k != "slot_mapping")


@pytest.mark.parametrize("device", ["tpu", 3, object()])
def test_step_tensors_on_a_device_torch_cannot_use_is_an_argument_error(device: Any) -> None:
    step = manager().reserve(["a"], 1)
    with pytest.raises(ArgumentError, match="device"):
        step.tensors(device)


# -- docs/integrity.md: lifetime_of(q) and namespace_id_of(q) decode one --------------------------

def test_qualified_tags_decode_and_refuse_what_is_no_tag() -> None:
    from kvmem.integrity import lifetime_of, namespace_id_of

    q = 41 << 20 | 3
    assert (lifetime_of(q), namespace_id_of(q)) == (41, 3)
    assert (lifetime_of(np.int64(q)), namespace_id_of(np.int64(q))) == (41, 3)
    assert lifetime_of(np.array([q, 0])).tolist() == [41, 0]
    for bad, kind in ((1.5, ArgumentTypeError), (True, ArgumentTypeError), ("3", ArgumentTypeError),
                      (-1, ArgumentError), (np.array([1.5]), ArgumentTypeError)):
        with pytest.raises(kind):
            lifetime_of(bad)
        with pytest.raises(kind):
            namespace_id_of(bad)


# -- docs/manager.md: the key function PrefixKeys(seed, page_size), usable alone -------------------

@pytest.mark.parametrize("seed, page_size, kind", [
    ("x", 16, ArgumentTypeError), (1.5, 16, ArgumentTypeError), (True, 16, ArgumentTypeError),
    (-1, 16, ArgumentError), (0, 0, ArgumentError), (0, True, ArgumentTypeError),
])
def test_prefix_keys_check_their_arguments(seed: Any, page_size: Any, kind: type) -> None:
    from kvmem.allocator import PrefixKeys

    with pytest.raises(kind):
        PrefixKeys(seed, page_size)


def test_prefix_keys_of_a_list_equal_those_of_an_array_and_floats_are_refused() -> None:
    from kvmem import HashedPrefixCache
    from kvmem.allocator import PrefixKeys

    keys = PrefixKeys(7, 4)
    root = keys.root("tenant")
    tokens = list(range(9))
    assert np.array_equal(keys.prompt_keys(tokens, root), keys.prompt_keys(np.arange(9), root))
    assert keys.prompt_keys(tokens, root).shape == (2, 2)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        keys.prompt_keys(np.array([1.5] * 4), root)
    for bad in ("x", 1.5):
        with pytest.raises(ArgumentTypeError, match="seed"):
            HashedPrefixCache(seed=bad)


# -- kvmem.StepFences: ids never wrap, a refused call changes nothing ------------------------------

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
        with pytest.raises(kind, match="num_pages"):
            StepFences(bad)


def test_verify_given_something_that_is_no_step_is_a_type_error() -> None:
    mgr = manager()
    mgr.reserve(["a"], 3)
    before = state(mgr)
    for bad in (3, {"a": 1}, "step"):
        with pytest.raises(ArgumentTypeError, match="step="):
            mgr.verify(["a"], bad)
    other = KVCacheManager(32, page_size=4, tracker="checking").reserve([], 1)
    with pytest.raises(ArgumentError, match="a step of 0"):
        mgr.verify(["a"], other)  # a step of another batch size
    assert state(mgr) == before


def test_the_error_tree_is_the_one_errors_md_draws() -> None:
    import kvmem

    parents = {
        "OutOfPagesError": kvmem.KVMemError, "InvalidFreeError": kvmem.KVMemError,
        "IntegrityError": kvmem.KVMemError, "ConcurrentUseError": kvmem.KVMemError,
        "HookError": kvmem.KVMemError, "ArgumentError": kvmem.KVMemError,
        "ConfigError": kvmem.ArgumentError, "MetadataError": kvmem.ArgumentError,
        "ArgumentTypeError": kvmem.KVMemError,
    }
    for name, parent in parents.items():
        assert getattr(kvmem, name).__bases__[0] is parent, name
    assert issubclass(kvmem.ArgumentError, ValueError)
    assert issubclass(kvmem.ArgumentTypeError, TypeError)
    assert not issubclass(kvmem.HookError, kvmem.ConcurrentUseError)
