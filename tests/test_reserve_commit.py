"""reserve and commit: chunked, speculative and decode steps, token checks, the step metadata."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from engine_helpers import busy_manager, decoding, prefill

from kvmem import (
    ArgumentError,
    ArgumentTypeError,
    KVMemError,
    OutOfPagesError,
)
from kvmem.manager import (
    KVCacheManager,
)


def manager() -> KVCacheManager:
    mgr = KVCacheManager(64, page_size=4, max_seqs=8, tracker="checking")
    mgr.admit("a", list(range(10)))
    return mgr


P = 4


BOOL_TOKENS = [[5, True], (np.True_, 3, 4), [1, 2, False]]


CALLS = {
    "admit": lambda m, v: m.admit("new", v),
    "can_admit": lambda m, v: m.can_admit(v),
    "match_prefix": lambda m, v: m.match_prefix(v),
    "resume": lambda m, v: m.resume("p", v),
    "commit": lambda m, v: m.commit("a", v),
    "commit_batch ragged": lambda m, v: m.commit_batch(["a", "c"], [v, [1]]),
}


def test_commit_batch_takes_a_plain_list_and_a_tensor_of_one_token_each(make_manager: Any) -> None:
    import torch

    mgr = make_manager(max_seqs=6, max_pages_per_seq=8)
    for rid in ("a", "b"):
        mgr.admit(rid, [1, 2, 3])
        mgr.reserve([rid], 3)
        mgr.commit(rid, [1, 2, 3])
    mgr.reserve(["a", "b"], 1)
    mgr.commit_batch(["a", "b"], [5, 7])
    mgr.reserve(["a", "b"], 1)
    mgr.commit_batch(["a", "b"], torch.tensor([6, 8]))
    assert mgr.tokens_of("a").tolist() == [1, 2, 3, 5, 6]
    assert mgr.tokens_of("b").tolist() == [1, 2, 3, 7, 8]


@pytest.mark.parametrize("chunk", [1, 18, 100, 256])
def test_reserve_takes_any_chunk_up_to_the_rows_room(chunk: int) -> None:
    """A chunk longer than max(max_pages_per_seq, max_seqs) + 1 but at most page_size raised a
    raw numpy error after it had advanced num_tokens."""
    mgr = KVCacheManager(64, page_size=256, max_pages_per_seq=16, max_seqs=8)
    mgr.admit("a", np.arange(300))
    step = mgr.reserve(["a"], chunk)
    assert step.slot_mapping.size == chunk and mgr.num_tokens("a") == chunk
    mgr.commit("a", np.arange(chunk))
    before = mgr.num_tokens("a")
    with pytest.raises(ArgumentError):
        mgr.reserve(["a"], 2**63 - 256)
    assert mgr.num_tokens("a") == before


def test_speculative_reserve_longer_than_the_rows() -> None:
    mgr = KVCacheManager(16, page_size=16, max_pages_per_seq=4, max_seqs=2)
    mgr.admit("a", [1, 2])
    mgr.reserve(["a"], 2)
    assert mgr.reserve(["a"], 8).slot_mapping.size == 8


def test_reserve_between_the_table_bounds_and_a_page_is_atomic(snapshot: Any) -> None:
    m = KVCacheManager(64, page_size=16, max_seqs=2, max_pages_per_seq=2)
    m.admit("a", [1, 2, 3])
    before = snapshot(m)
    try:
        m.reserve(["a"], 5)
    except KVMemError:
        assert snapshot(m) == before
    else:
        assert m.num_tokens("a") == 5


@pytest.mark.parametrize("k", [2**63 - 16, 2**63 - 1])
@pytest.mark.parametrize("form", ["int", "list"])
def test_a_huge_reserve_is_refused_and_changes_nothing(snapshot: Any, k: int, form: str) -> None:
    m = KVCacheManager(64, page_size=16, max_seqs=2)
    m.admit("a", [1, 2, 3])
    m.reserve(["a"], 3)
    m.commit("a", [1, 2, 3])
    before = snapshot(m)
    with pytest.raises(KVMemError):
        m.reserve(["a"], k if form == "int" else [k])
    assert snapshot(m) == before


@pytest.mark.parametrize("form", ["list", "tensor"])
def test_commit_batch_takes_one_token_per_request(form: str) -> None:
    m = KVCacheManager(64, page_size=4, max_seqs=4)
    m.admit("a", [1, 2])
    m.admit("b", [3, 4])
    m.reserve(["a", "b"], 2)
    m.commit_batch(["a", "b"], [[1, 2], [3, 4]])
    m.reserve(["a", "b"], 1)
    if form == "list":
        tokens: Any = [5, 7]
    else:
        import torch

        tokens = torch.tensor([5, 7])
    m.commit_batch(["a", "b"], tokens)
    assert m.num_committed("a") == m.num_committed("b") == 3


@pytest.mark.parametrize("call", ["admit", "can_admit", "match_prefix", "commit", "resume"])
def test_ragged_token_ids_are_an_argument_error(snapshot: Any, call: str) -> None:
    mgr = manager()
    mgr.reserve(["a"], 2)
    mgr.preempt("a") if call == "resume" else None
    before = snapshot(mgr)
    ragged = [[1], [2, 3]]
    with pytest.raises(ArgumentError, match="token_ids"):
        {"admit": lambda: mgr.admit("b", ragged), "can_admit": lambda: mgr.can_admit(ragged),
         "match_prefix": lambda: mgr.match_prefix(ragged),
         "commit": lambda: mgr.commit("a", ragged),
         "resume": lambda: mgr.resume("a", ragged)}[call]()
    assert snapshot(mgr) == before


@pytest.mark.parametrize("tokens", [[True, False], [1.0, 2.0], np.array([1.5]), ["1", "2"]])
def test_token_ids_of_the_wrong_type_are_a_type_error(snapshot: Any, tokens: Any) -> None:
    mgr = manager()
    before = snapshot(mgr)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        mgr.admit("b", tokens)
    assert snapshot(mgr) == before


@pytest.mark.parametrize("tokens", [[1.5], [True], np.array([2.0])])
def test_commit_batch_refuses_non_integer_tokens_by_type(snapshot: Any, tokens: Any) -> None:
    mgr = manager()
    mgr.reserve(["a"], 1)
    before = snapshot(mgr)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        mgr.commit_batch(["a"], tokens)
    assert snapshot(mgr) == before


def test_commit_batch_with_the_wrong_count_names_token_ids() -> None:
    mgr = manager()
    mgr.reserve(["a"], 1)
    with pytest.raises(ArgumentError, match=r"token_ids=\[1, 2\].*2 token lists for 1 requests"):
        mgr.commit_batch(["a"], [1, 2])


def test_a_reserve_past_max_pages_per_seq_is_an_argument_error(snapshot: Any) -> None:
    mgr = manager()
    mgr.reserve(["a"], 200)
    before = snapshot(mgr)
    with pytest.raises(ArgumentError, match="max_pages_per_seq"):
        mgr.reserve(["a"], 100)
    assert snapshot(mgr) == before


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


def test_decode_step_metadata_for_a_batch(make_manager: Any) -> None:
    mgr = make_manager()
    for rid, n in (("a", 4), (7, 5), ("c", 1)):
        assert mgr.admit(rid, np.arange(n) + 10 * n).num_cached_tokens == 0
        mgr.reserve([rid], n)
        mgr.commit(rid, np.arange(n) + 10 * n)
    step = mgr.reserve(["a", 7, "c"], 1)
    assert step.request_ids == ("a", 7, "c")
    assert step.seq_lens.tolist() == [5, 6, 2] and step.qo_indptr.tolist() == [0, 1, 2, 3]
    assert step.kv_indptr.tolist() == [0, 2, 4, 5]
    assert step.kv_last_page_len.tolist() == [1, 2, 2]
    # "a" crossed a page boundary: its new token opens its second page.
    assert step.slot_mapping[0] == mgr.pages_of("a")[1] * P
    table = step.block_table
    assert table.dtype == np.int32 and table.shape == (3, 2)
    assert table.tolist() == [mgr.pages_of("a").tolist(), mgr.pages_of(7).tolist(),
                              [mgr.pages_of("c")[0], -1]]
    assert step.num_pages.tolist() == [2, 2, 1]


def test_speculative_and_per_request_token_counts(make_manager: Any) -> None:
    mgr = make_manager()
    for rid in ("a", "b"):
        mgr.admit(rid, np.arange(3))
        mgr.reserve([rid], 3)
    step = mgr.reserve(["a", "b"], [4, 0])
    assert step.qo_indptr.tolist() == [0, 4, 4] and step.seq_lens.tolist() == [7, 3]
    assert step.slot_mapping.size == 4


def test_the_manager_keeps_its_own_copy_of_token_ids(make_manager: Any) -> None:
    mgr = make_manager()
    prompt = np.arange(6)
    mgr.admit("a", prompt)
    prompt[:] = 77  # the engine reuses its buffer
    mgr.preempt("a")
    assert mgr.resume("a").num_prompt_tokens == 6
    mgr.reserve(["a"], 6)
    mgr.commit("a", np.arange(6))
    assert mgr.tokens_of("a").tolist() == list(range(6))


def test_commit_batch_takes_one_token_each_k_each_or_ragged_lists(make_manager: Any) -> None:
    mgr = make_manager()
    for rid in ("a", "b"):
        mgr.admit(rid, np.arange(2) + (10 if rid == "b" else 0))
    mgr.reserve(["a", "b"], 2)
    mgr.commit_batch(["a", "b"], np.array([[0, 1], [10, 11]]))
    mgr.reserve(["a", "b"], [3, 1])
    mgr.commit_batch(["a", "b"], [np.array([2, 3, 4]), [12]])
    mgr.reserve(["a", "b"], 1)
    mgr.commit_batch(["a", "b"], np.array([5, 13], dtype=np.int32))
    assert mgr.tokens_of("a").tolist() == [0, 1, 2, 3, 4, 5]
    assert mgr.tokens_of("b").tolist() == [10, 11, 12, 13]
    with pytest.raises(KVMemError, match="token lists"):
        mgr.commit_batch(["a", "b"], [[1]])
    with pytest.raises(KVMemError):
        mgr.commit_batch(["a", "b"], np.array([-1, 2]))


def test_speculative_and_chunked_steps_of_a_decoding_batch(make_manager: Any) -> None:
    mgr, eng, ids = decoding(make_manager)
    for n in (3, 1, [2, 0, 5, 1, 4], 16, 1):
        step = eng.step(ids, n)
        assert mgr.verify(ids, step).ok
        eng.commit(ids)
    eng.check_kv()
    assert mgr.verify(ids).ok


@pytest.mark.parametrize("call", ["reserve", "can_reserve"])
def test_ragged_token_counts_are_an_argument_error(
        make_manager: Any, snapshot: Any, call: str) -> None:
    m = make_manager(max_pages_per_seq=8)
    m.admit("a", [1, 2, 3])
    before = snapshot(m)
    with pytest.raises(KVMemError, match="num_tokens") as info:
        getattr(m, call)(["a"], [[1, 2], [3]])
    assert isinstance(info.value, (ArgumentError, ArgumentTypeError))
    assert snapshot(m) == before


def test_the_managers_out_of_pages_error_says_what_an_engine_does(
        make_manager: Any, snapshot: Any) -> None:
    from kvmem.errors import OutOfPagesError

    m = make_manager(num_pages=6, prefix_cache=None, max_pages_per_seq=8)
    prefill(m, "a", list(range(10)))  # 3 pages
    m.admit("b", [1, 2, 3, 4, 5])  # 2 pages: 1 free
    m.reserve(["b"], 5)
    m.commit("b", [1, 2, 3, 4, 5])
    m.fork("b", "f")  # promises the shared tail's copy: nothing left
    before = snapshot(m)
    for call in (lambda: m.admit("c", list(range(9))), lambda: m.reserve(["a", "b"], 4),
                 lambda: m.fork("a", "g")):
        with pytest.raises(OutOfPagesError, match=r"can_admit\(\), can_reserve\(\)") as info:
            call()
        assert "can_allocate" not in str(info.value)
        assert snapshot(m) == before


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("tokens", BOOL_TOKENS, ids=["int-bool", "npbool-int", "int-false"])
def test_a_token_list_holding_a_bool_is_refused(
        make_manager: Any, snapshot: Any, call: str, tokens: Any) -> None:
    """errors.md: integer-like is never a bool, and a list holding a bool is refused; numpy
    reads [5, True] as [5, 1], so it was taken as token 1."""
    mgr = busy_manager(make_manager)
    before = snapshot(mgr)
    with pytest.raises(ArgumentTypeError, match="bool"):
        CALLS[call](mgr, tokens)
    assert snapshot(mgr) == before
    mgr.check()


@pytest.mark.parametrize("bad", [torch.tensor(5), np.array(5), np.int64(5), 5],
                         ids=["0-d tensor", "0-d array", "numpy scalar", "int"])
def test_commit_batch_refuses_one_scalar_for_a_batch(
        make_manager: Any, snapshot: Any, bad: Any) -> None:
    """A 0-d tensor (or array) raised numpy's 'len() of unsized object' TypeError."""
    mgr = busy_manager(make_manager)
    before = snapshot(mgr)
    with pytest.raises(ArgumentTypeError, match="token_ids"):
        mgr.commit_batch(["a", "c"], bad)
    assert snapshot(mgr) == before
    mgr.commit_batch(["a", "c"], torch.tensor([5, 6]))  # ... and the batch still commits


def test_a_decode_commit_never_lands_in_the_slots_of_a_closed_request_of_the_same_id() -> None:
    """A one-token commit reuses a recent decode reserve's slots only while the rows are the
    ones it reserved for (same generations). Here "a" reserved a decode token, was released
    and admitted again under the same id with as many committed tokens: its next one-token
    commit must land in its own next slot, not in the old reserve's."""
    mgr = KVCacheManager(64, page_size=4, max_seqs=8, tracker="checking", prefix_cache=None)
    prefill(mgr, "b", [9, 9])  # "a" gets another row the second time
    prefill(mgr, "a", [1, 2, 3, 4, 5])
    mgr.reserve(["a"], 1)  # a decode record for ("a",) with 5 committed
    mgr.release("a")
    mgr.admit("a", [6, 7])
    mgr.reserve(["a"], 6)
    mgr.commit_batch(["a"], [[6, 7, 8, 9, 10]])
    mgr.commit_batch(["a"], [11])
    assert mgr.tokens_of("a").tolist() == [6, 7, 8, 9, 10, 11]
    mgr.check()


def two_decoding() -> KVCacheManager:
    """Requests "a" and "b" with 3 committed tokens each and one reserved slot each."""
    m = KVCacheManager(64, page_size=P, max_seqs=4)
    for rid in ("a", "b"):
        m.admit(rid, [1, 2, 3])
        m.reserve([rid], 3)
        m.commit(rid, [1, 2, 3])
    m.reserve(["a", "b"], 1)
    return m


RANGE_MESSAGE = r"^token ids must be in 0\.\.2147483647 \(nothing was committed\)$"


@pytest.mark.parametrize("form", ["array", "list", "2-d array"])
@pytest.mark.parametrize("bad", [-1, 2**31])
def test_commit_batch_checks_the_token_range_on_every_path(
        snapshot: Any, form: str, bad: int) -> None:
    """A token id below 0 or above INT32_MAX is refused by the decode step's [B] array path,
    the list path and the [B, k] path alike (guards each half of the range check and its
    message); INT32_MAX itself is a token id."""
    m = two_decoding()
    tokens: Any = {"array": np.array([5, bad]), "list": [5, bad],
                   "2-d array": np.array([[5], [bad]])}[form]
    before = snapshot(m)
    with pytest.raises(ArgumentError, match=RANGE_MESSAGE):
        m.commit_batch(["a", "b"], tokens)
    assert snapshot(m) == before
    top = 2**31 - 1
    m.commit_batch(["a", "b"], {"array": np.array([5, top]), "list": [5, top],
                                "2-d array": np.array([[5], [top]])}[form])
    assert m.tokens_of("b").tolist() == [1, 2, 3, top]


@pytest.mark.parametrize("tokens", [np.array([5, 6, 7]), np.array([5])],
                         ids=["one too many", "one too few"])
def test_commit_batch_refuses_a_token_array_of_the_wrong_length(snapshot: Any,
                                                                  tokens: Any) -> None:
    """A [B'] int array with B' != B is not the decode step's one token per request: it was
    taken as such when the length test was inverted."""
    m = two_decoding()
    before = snapshot(m)
    with pytest.raises(ArgumentError, match=rf"holds {tokens.size} token lists for 2 requests: "
                       r"give one token \(or token list\) per request; nothing was committed$"):
        m.commit_batch(["a", "b"], tokens)
    assert snapshot(m) == before


def test_commit_batch_refuses_a_3d_token_array(snapshot: Any) -> None:
    """Only [B] and [B, k] arrays are token batches: a [B, 1, 2] array is refused, naming
    token_ids, not flattened into B one-token commits."""
    m = two_decoding()
    before = snapshot(m)
    with pytest.raises(ArgumentError, match=r"\btoken_ids=array.*expected a 1-D sequence"):
        m.commit_batch(["a", "b"], np.zeros((2, 1, 2), dtype=np.int64))
    assert snapshot(m) == before


def test_commit_batch_of_more_tokens_than_reserved_names_the_request(snapshot: Any) -> None:
    """Two tokens each after a one-token reserve: refused by the commit check (naming the
    request), never written into the decode step's one slot per row."""
    m = two_decoding()
    before = snapshot(m)
    with pytest.raises(ArgumentError, match=r"^request 'a' commits 2 tokens after 3 but only 4 "
                       r"slots are reserved; reserve\(\) them first \(nothing was committed\)$"):
        m.commit_batch(["a", "b"], np.array([[5, 6], [7, 8]]))
    assert snapshot(m) == before


@pytest.mark.parametrize(("tokens", "kind", "message"), [
    (np.array([1.5, 2.5]), ArgumentTypeError,
     r"^token_ids has dtype float64: expected integer token ids \(not bool, float or str\); "
     r"nothing was committed$"),
    (np.array([[1.5], [2.5]]), ArgumentTypeError,
     r"^token_ids has dtype float64: expected integer token ids \(not bool, float or str\); "
     r"nothing was committed$"),
    (5, ArgumentTypeError,
     r"^token_ids=5 \(int\): expected \[B\] or \[B, k\] ints or B token lists, one per "
     r"request; nothing was committed$"),
    ([[1, 2], 1.5], ArgumentTypeError,
     r"^token_ids holds 1\.5 \(float\): expected integer token ids \(int or numpy integer; "
     r"not bool, float or str\); nothing was committed$"),
    ([[1, 2], 3], ArgumentError, r"^token_ids=3 \(int\): expected a 1-D sequence of token ids"),
    ([2**70, 1], ArgumentError, r"^token_ids=1180591620717411303424 \(int\): expected a 1-D "),
], ids=["float array", "float 2-d array", "scalar", "float among lists", "int among lists",
        "int beyond int64"])
def test_commit_batch_errors_say_what_was_wrong(snapshot: Any, tokens: Any, kind: type,
                                                message: str) -> None:
    """Each refusal's type and whole message: an int where a token list is expected (or an
    int too big for any integer array) is a value error naming token_ids, never a type
    error; a float is a type error that shows the value."""
    m = two_decoding()
    before = snapshot(m)
    with pytest.raises(kind, match=message) as info:
        m.commit_batch(["a", "b"], tokens)
    if kind is ArgumentError:
        assert not isinstance(info.value, TypeError)
    assert snapshot(m) == before


@pytest.mark.parametrize("empty", [[], (), np.empty(0, dtype=np.int32), range(0)],
                         ids=["list", "tuple", "array", "range"])
def test_batch_tokens_of_an_empty_batch_are_integers(empty: Any) -> None:
    """An empty batch's tokens are an empty integer array (numpy reads [] as float64) and its
    counts an int or an int64 array, whatever empty sequence held them."""
    from kvmem.allocator._commits import batch_tokens

    flat, counts = batch_tokens(empty, 0)
    assert flat.shape == (0,) and flat.dtype.kind in "iu"
    if isinstance(counts, int):
        assert counts == 1 and not isinstance(empty, range)
    else:
        assert counts.shape == (0,) and counts.dtype == np.int64
    flat, counts = batch_tokens([[1, 2], [3]], 2)
    assert flat.tolist() == [1, 2, 3] and counts.dtype == np.int64 and counts.tolist() == [2, 1]


def small(num_pages: int, max_pages_per_seq: int = 16) -> KVCacheManager:
    """No prefix cache (every page is free or held by a request) and no watermark."""
    return KVCacheManager(num_pages, page_size=P, max_seqs=12, prefix_cache=None,
                          max_pages_per_seq=max_pages_per_seq, watermark=0.0)


def test_can_reserve_is_true_exactly_up_to_the_free_pages() -> None:
    """A row at 6 tokens (2 pages) with 6 free pages: 26 more tokens (32, a page boundary)
    take exactly the 6, 27 take 7; and a step inside the row's last page needs no page at
    all when none is free. Guards the ceil division, the count of mapped pages and the
    comparison against the free pages at both edges."""
    m = small(8)
    m.admit("a", list(range(6)))
    m.reserve(["a"], 6)
    assert m.can_reserve(["a"], 26) and not m.can_reserve(["a"], 27)
    with pytest.raises(OutOfPagesError):
        m.reserve(["a"], 27)
    m.reserve(["a"], 25)  # 31 tokens: every page mapped, the last one has a free slot
    assert m.stats().num_free == 0
    assert m.can_reserve(["a"], 1) and not m.can_reserve(["a"], 2)
    m.reserve(["a"], 1)


def test_can_reserve_is_false_past_max_pages_per_seq_however_many_pages_are_free() -> None:
    """max_pages_per_seq=4 and 64 free pages: 16 tokens fit a row exactly, 17 never do."""
    m = small(64, max_pages_per_seq=4)
    m.admit("a", list(range(6)))
    m.reserve(["a"], 6)
    assert m.can_reserve(["a"], 10) and not m.can_reserve(["a"], 11)
    assert not m.can_reserve(["a"], [11])
    m.reserve(["a"], 10)


def forked_at_a_partial_page(num_pages: int) -> KVCacheManager:
    """Parent "p" at 6 tokens (page 1 holds 2 of 4) forked into "c": one copy promised."""
    m = small(num_pages)
    m.admit("p", list(range(6)))
    m.reserve(["p"], 6)
    m.commit("p", list(range(6)))
    m.fork("p", "c")
    return m


def test_can_reserve_counts_a_forks_promised_copy_once() -> None:
    """One free page, promised to the copy the fork's shared tail needs: the child may write
    into its tail (the copy takes the promised page) but not also grow into a new page.
    Guards the copies counted in the pages needed and in the pages at hand."""
    m = forked_at_a_partial_page(3)
    assert m.stats().num_free == 1
    assert m.can_reserve(["c"], 1) and m.can_reserve(["c"], 2)
    assert not m.can_reserve(["c"], 3)
    with pytest.raises(OutOfPagesError):
        m.reserve(["c"], 3)
    step = m.reserve(["c"], 2)
    assert step.copy_src.size == 1


def test_cow_copies_are_counted_across_steps() -> None:
    """stats().num_cow_copies sums the copies of every step (one here, one in a later step)."""
    m = forked_at_a_partial_page(16)
    m.reserve(["c"], 1)
    m.commit("c", [9])
    m.fork("p", "d")  # p's tail is still shared (with d now) and partly filled
    m.reserve(["d"], 1)
    assert m.stats().num_cow_copies == 2


def test_a_reserve_of_too_many_too_long_requests_names_the_first_eight(snapshot: Any) -> None:
    """The message lists at most eight of the requests that would exceed max_pages_per_seq."""
    m = small(64, max_pages_per_seq=1)
    ids = [f"r{i}" for i in range(9)]
    for rid in ids:
        m.admit(rid, [1, 2, 3])
        m.reserve([rid], 3)
    before = snapshot(m)
    names = ", ".join(repr(r) for r in ids[:8])
    with pytest.raises(ArgumentError, match=rf"^requests \[{names}\] would need more than "
                       r"max_pages_per_seq=1 pages; finish them or raise the limit \(nothing "
                       r"was reserved\)$"):
        m.reserve(ids, 2)
    assert snapshot(m) == before


def test_a_stored_event_after_already_cached_pages_names_its_real_parent() -> None:
    """Two requests with one prompt, both admitted before either commits: the second one's
    commit of three pages caches only the third (the first two are cached already, the
    first's), and its PagesStored event names the second page's key as the parent."""
    from kvmem.manager import PagesStored

    m = KVCacheManager(32, page_size=P, max_seqs=4, kv_events=True, watermark=0.0)
    prompt = list(range(12))
    for rid in ("a", "b"):
        m.admit(rid, prompt)
        m.reserve([rid], 12)
    m.commit("a", prompt[:8])
    (first,) = m.take_events()
    m.commit("b", prompt)
    (second,) = m.take_events()
    assert isinstance(first, PagesStored) and isinstance(second, PagesStored)
    assert len(first.page_hashes) == 2 and len(second.page_hashes) == 1
    assert second.parent_page_hash == first.page_hashes[1]
    assert second.token_ids == tuple(prompt[8:])


@pytest.mark.parametrize("call", ["reserve", "can_reserve"])
@pytest.mark.parametrize(("count", "message"), [
    (-1, r"^num_tokens=-1: expected an integer in 0\.\.32 "),
    (33, r"^num_tokens=33: expected an integer in 0\.\.32 "),
    (np.int64(33), r"^num_tokens=33: expected an integer in 0\.\.32 "),
    ([-1], r"^num_tokens holds counts from -1 to -1: expected every count in 0\.\.32\. "),
    ([33], r"^num_tokens holds counts from 33 to 33: expected every count in 0\.\.32\. "),
    ([1, 2], r"^num_tokens lists 2 counts: expected 1, one per request\. "),
])
def test_token_counts_are_checked_by_name_up_to_a_rows_most_tokens(
        snapshot: Any, call: str, count: Any, message: str) -> None:
    """A count is 0 .. max_pages_per_seq * page_size (32 here), as an int or one per
    request; a refusal names num_tokens and changes nothing; 32 itself is a count."""
    m = small(64, max_pages_per_seq=8)
    m.admit("a", [1])
    before = snapshot(m)
    with pytest.raises(ArgumentError, match=message):
        getattr(m, call)(["a"], count)
    assert snapshot(m) == before
    m.release("a")
    m.admit("b", [1])
    assert m.can_reserve(["b"], 32) and m.can_reserve(["b"], [32])
    assert m.reserve(["b"], [32]).slot_mapping.size == 32


@pytest.mark.parametrize("count", [np.array(3), torch.tensor(3), 1.5])
def test_a_count_that_is_no_integer_is_a_type_error_naming_num_tokens(count: Any) -> None:
    """A 0-d array or tensor or a float is not a token count (reserve takes ints or one int
    per request): refused by type, naming num_tokens."""
    m = small(64, max_pages_per_seq=8)
    m.admit("a", [1])
    with pytest.raises(ArgumentTypeError, match=r"^num_tokens=.*: expected an integer in "
                       r"0\.\.32 "):
        m.reserve(["a"], count)
    assert m.num_tokens("a") == 0


def test_commit_batch_in_another_order_than_the_reserve_lands_each_token_in_its_slot() -> None:
    """One token each, committed for the batch in another order than it was reserved (so
    not by the decode step's record): each token still lands in its own request's slot."""
    m = two_decoding()
    m.commit_batch(["b", "a"], np.array([70, 50]))
    assert m.tokens_of("a").tolist() == [1, 2, 3, 50]
    assert m.tokens_of("b").tolist() == [1, 2, 3, 70]


def test_an_over_commit_names_the_request_that_over_commits(snapshot: Any) -> None:
    """Ragged counts: the error names the one request (and its count) that commits more than
    it reserved, not the first of the batch."""
    m = two_decoding()
    before = snapshot(m)
    with pytest.raises(ArgumentError, match=r"^request 'b' commits 2 tokens after 3 but only 4 "):
        m.commit_batch(["a", "b"], [[5], [7, 8]])
    assert snapshot(m) == before


def test_a_full_batch_of_decode_commits_that_fill_pages_emits_one_event_per_request() -> None:
    """Every row of a max_seqs batch fills a page at the same decode step: one PagesStored
    event per request, each with its page's tokens."""
    from kvmem.manager import PagesStored

    m = KVCacheManager(64, page_size=P, max_seqs=4, kv_events=True, watermark=0.0)
    ids = ["r0", "r1", "r2", "r3"]
    for i, rid in enumerate(ids):
        m.admit(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3])
        m.reserve([rid], 3)
        m.commit(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3])
    m.take_events()
    m.reserve(ids, 1)
    m.commit_batch(ids, np.array([4, 14, 24, 34]))
    events = m.take_events()
    assert [type(e) for e in events] == [PagesStored] * 4
    assert sorted(e.token_ids for e in events) == [
        (10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4) for i in range(4)]
    assert all(e.parent_page_hash is None and len(e.page_hashes) == 1 for e in events)


def test_a_batch_of_prefills_from_page_0_stores_events_with_no_parent() -> None:
    """Two requests commit two full pages each in one commit_batch: each run starts at
    the prompt's page 0, so each event has no parent."""
    from kvmem.manager import PagesStored

    m = KVCacheManager(64, page_size=P, max_seqs=4, kv_events=True, watermark=0.0)
    for rid, base in (("a", 0), ("b", 100)):
        m.admit(rid, list(range(base, base + 9)))
    m.reserve(["a", "b"], 8)
    m.commit_batch(["a", "b"], np.array([range(8), range(100, 108)]))
    events = m.take_events()
    assert len(events) == 2 and all(isinstance(e, PagesStored) for e in events)
    assert [e.parent_page_hash for e in events] == [None, None]
    assert [len(e.page_hashes) for e in events] == [2, 2]


@pytest.mark.parametrize("first", [4, 8, 12])
def test_pages_committed_later_chain_from_the_last_page_committed_before(first: int) -> None:
    """A commit of one or more full pages leaves the row's prefix key at its last page, so
    the pages of the next commit are cached under the whole prefix's keys: a prompt with
    that prefix hits every page."""
    m = KVCacheManager(64, page_size=P, max_seqs=4, watermark=0.0)
    prompt = list(range(16))
    m.admit("a", prompt)
    m.reserve(["a"], 16)
    m.commit("a", prompt[:first])
    m.commit("a", prompt[first:])
    assert m.match_prefix([*prompt, 99]).num_pages == 4


# -- speculative decoding: reject the drafts a verifier refused ---------------------------------


def speculate(mgr: KVCacheManager, rid: Any, num_drafts: int, accepted: list[int]) -> Any:
    """One speculative step: reserve the next token and ``num_drafts`` drafts, commit the
    accepted tokens, reject the rest. The step's metadata."""
    step = mgr.reserve([rid], 1 + num_drafts)
    assert mgr.verify([rid], step).ok
    mgr.commit(rid, accepted)
    mgr.reject(rid, 1 + num_drafts - len(accepted))
    mgr.check()
    return step


@pytest.mark.parametrize("tracker", [None, "checking", "paranoid"])
def test_rejected_drafts_give_back_their_slots_and_the_pages_they_emptied(
        make_manager: Any, tracker: Any) -> None:
    mgr = make_manager(num_pages=8, tracker=tracker)
    mgr.admit("a", list(range(6)))
    mgr.reserve(["a"], 6)
    mgr.commit("a", list(range(6)))
    free = mgr.allocator.num_free
    speculate(mgr, "a", 4, [7, 8])  # 6 + 5 slots span 3 pages; 8 tokens fill 2
    assert (mgr.num_tokens("a"), mgr.num_committed("a"), mgr.pages_of("a").size) == (8, 8, 2)
    assert mgr.allocator.num_free == free
    speculate(mgr, "a", 3, [9, 10, 11, 12])  # every draft accepted: nothing to give back
    assert (mgr.num_tokens("a"), mgr.num_committed("a")) == (12, 12)
    step = mgr.reserve(["a"], 1)  # the next step sees the request as it is now
    assert mgr.verify(["a"], step).ok and step.seq_lens.tolist() == [13]
    mgr.commit("a", [13])
    assert mgr.tokens_of("a").tolist() == [*range(6), *range(7, 14)]
    mgr.check()


def test_a_read_through_the_step_before_a_rejection_fails_verify(make_manager: Any) -> None:
    """Guards the end of the rejected tail's lifetime: a kernel given the page list of the
    speculative step (the rejected page still listed) or its lengths (rejected slots still
    counted) is aborted by ``verify``; the other request of the batch goes on."""
    for stale in ("indices", "lengths"):
        mgr = make_manager(num_pages=16)
        for rid in ("a", "b"):
            mgr.admit(rid, list(range(7)))
            mgr.reserve([rid], 7 - mgr.num_tokens(rid))
            mgr.commit(rid, list(range(mgr.num_committed(rid), 7)))
        step = mgr.reserve(["a", "b"], 2)  # a's drafts cross into a new page
        mgr.commit_batch(["a", "b"], [[7, 8], [7, 8]])
        spec = mgr.reserve(["a", "b"], [4, 1])
        mgr.commit_batch(["a", "b"], [[9], [9]])
        mgr.reject("a", 3)
        assert mgr.pages_of("a").size == 3 and spec.kv_indptr.tolist()[1] == 4
        fresh = mgr.reserve(["a", "b"], 1)
        if stale == "indices":
            report = mgr.verify(["a", "b"], kv_indptr=spec.kv_indptr, kv_indices=spec.kv_indices)
        else:
            report = mgr.verify(["a", "b"], metadata={
                "kv_indptr": fresh.kv_indptr, "kv_indices": fresh.kv_indices,
                "slot_mapping": fresh.slot_mapping,
                "seq_lens": np.array([14, 11], dtype=np.int32)})
        assert list(report.aborted) == ["a"], stale
        mgr.check()
    del step


@pytest.mark.parametrize("tracker", [None, "checking", "paranoid"])
def test_rejecting_with_keep_pages_gives_back_only_the_slots(make_manager: Any,
                                                             tracker: Any) -> None:
    """``reject(keep_pages=True)`` (vLLM's manager keeps a request's blocks when its drafts
    are rejected): the slots go back, every page stays mapped and held, and the next reserve
    writes into them without allocating; a read of a rejected slot through the speculative
    step's lengths still fails ``verify``."""
    mgr = make_manager(num_pages=16, tracker=tracker)
    for rid, prompt in (("a", list(range(6))), ("b", list(range(100, 106)))):
        mgr.admit(rid, prompt)
        mgr.reserve([rid], 6)
        mgr.commit(rid, prompt)
    spec = mgr.reserve(["a", "b"], 1 + 5)  # 12 slots each: 3 pages
    assert spec.seq_lens.tolist() == [12, 12]
    b_slots = spec.slot_mapping[6:].copy()  # (a step's arrays are reused by the next one)
    pages = mgr.pages_of("a").tolist()
    free = mgr.allocator.num_free
    for rid in ("a", "b"):
        mgr.commit(rid, [6, 7])
        mgr.reject(rid, 4, keep_pages=True)
    assert (mgr.num_tokens("a"), mgr.num_committed("a")) == (8, 8)
    assert mgr.pages_of("a").tolist() == pages and mgr.allocator.num_free == free
    mgr.check()
    step = mgr.reserve(["a"], 4)  # the kept page takes them: nothing allocated
    assert mgr.allocator.num_free == free and mgr.pages_of("a").tolist() == pages
    assert mgr.verify(["a"], step).ok and step.seq_lens.tolist() == [12]
    mgr.commit("a", [8, 9, 10, 11])
    assert mgr.tokens_of("a").tolist() == list(range(12))
    if tracker is not None:
        # b read as the speculative step saw it: its own (kept) pages, but 12 tokens where it
        # holds 8 now.
        report = mgr.verify(["b"], metadata={
            "kv_indptr": np.array([0, 3], dtype=np.int32),
            "kv_indices": mgr.pages_of("b").astype(np.int32),
            "slot_mapping": b_slots, "seq_lens": np.array([12], dtype=np.int32)})
        assert list(report.aborted) == ["b"]
    mgr.check()


def test_a_bad_keep_pages_is_refused_and_changes_nothing(make_manager: Any,
                                                         snapshot: Any) -> None:
    mgr = make_manager()
    mgr.admit("a", list(range(5)))
    mgr.reserve(["a"], 7)
    before = snapshot(mgr)
    for bad in (1, "yes", None):
        with pytest.raises(ArgumentTypeError, match="keep_pages"):
            mgr.reject("a", 2, keep_pages=bad)
    assert snapshot(mgr) == before


def test_rejecting_more_than_the_uncommitted_slots_is_refused_and_changes_nothing(
        make_manager: Any, snapshot: Any) -> None:
    mgr = make_manager()
    mgr.admit("a", list(range(5)))
    mgr.reserve(["a"], 5)
    mgr.commit("a", list(range(5)))
    mgr.reserve(["a"], 3)
    mgr.commit("a", [5])
    before = snapshot(mgr)
    for bad, error in ((3, ArgumentError), (-1, ArgumentError), (2**63, ArgumentError),
                       (1.0, ArgumentTypeError), (True, ArgumentTypeError),
                       ("2", ArgumentTypeError), ([1], ArgumentTypeError),
                       (None, ArgumentTypeError)):
        with pytest.raises(error):
            mgr.reject("a", bad)
    with pytest.raises(ArgumentError, match=r"unknown|not running"):
        mgr.reject("nobody", 1)
    assert snapshot(mgr) == before
    mgr.reject("a", np.int64(2))
    assert mgr.num_tokens("a") == 6


def test_a_rejected_page_a_step_in_flight_reads_is_held_until_it_retires(
        make_manager: Any) -> None:
    mgr = make_manager(num_pages=6)
    mgr.admit("a", list(range(4)))
    mgr.reserve(["a"], 4)
    mgr.commit("a", list(range(4)))
    mgr.reserve(["a"], 4)  # drafts fill a second page
    handle = mgr.begin_step()
    rejected = int(mgr.pages_of("a")[1])
    mgr.reject("a", 4)
    assert mgr.allocator.refcounts[rejected] == 1  # (the fence's reference)
    mgr.retire(handle)
    assert mgr.allocator.refcounts[rejected] == 0
    mgr.check()


def test_drafts_are_never_cached_and_a_fork_keeps_its_pages(make_manager: Any) -> None:
    mgr = make_manager(num_pages=16)
    prompt = list(range(8))
    mgr.admit("a", prompt)
    mgr.reserve(["a"], 8)
    mgr.commit("a", prompt)
    mgr.fork("a", "child")
    speculate(mgr, "a", 4, [8])  # the parent's drafts: a page of its own, rejected
    assert mgr.tokens_of("child").tolist() == prompt
    assert mgr.match_prefix([*prompt, 8, 9, 10, 11, 12]).num_pages == 2  # the committed pages
    step = mgr.reserve(["a", "child"], 1)
    assert mgr.verify(["a", "child"], step).ok


def test_a_churning_steps_decodes_commit_before_its_admission_by_the_reserved_rows() -> None:
    """The leading requests of the reserved batch (a churning step's decodes, committed
    before its admission: StepBuilder.leading_rows) commit into their own rows, as after a
    fresh lookup; once a row changed, or in another order, the ids are looked up again."""
    mgr = KVCacheManager(64, page_size=P, max_seqs=8, tracker="checking")
    for rid in ("a", "b", "c"):
        mgr.admit(rid, [1, 2, 3])
        mgr.reserve([rid], 3)
        mgr.commit(rid, [1, 2, 3])
    mgr.admit("d", [7, 8, 9, 10, 11])
    mgr.reserve(["a", "b", "c", "d"], np.array([1, 1, 1, 5]))
    assert mgr.steps.leading_rows(("a", "b", "c")) is not None
    assert mgr.steps.leading_rows(("b", "a")) is None  # (not the leading requests, in order)
    mgr.commit_batch(["a", "b", "c"], [4, 5, 6])
    mgr.commit("d", [7, 8, 9, 10, 11])
    assert [mgr.tokens_of(r).tolist() for r in "abcd"] == [
        [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [7, 8, 9, 10, 11]]
    mgr.reserve(["a", "b", "c", "d"], 1)
    mgr.release("d")  # a row changed: the reserved rows are no longer taken as they are
    assert mgr.steps.leading_rows(("a", "b")) is None
    mgr.commit_batch(["b", "a"], [15, 14])
    with pytest.raises(ArgumentError):
        mgr.commit_batch(["a", "d"], [1, 1])
    assert mgr.tokens_of("a").tolist() == [1, 2, 3, 4, 14]
    assert mgr.tokens_of("b").tolist() == [1, 2, 3, 5, 15]
    mgr.check()


def test_a_prefill_commit_lands_in_the_reserved_slots_whole_or_in_parts() -> None:
    """Guards Committer._reserved_slots: one request's commit takes the slots its reserve just
    handed out only when it commits exactly them; a part of them, or a commit after another
    row's reserve, reads its slots from the row."""
    mgr = KVCacheManager(64, page_size=P, max_seqs=8, tracker="checking")
    mgr.admit("a", list(range(1, 11)))
    mgr.admit("b", [5, 6, 7])
    step = mgr.reserve(["a"], 10)
    mgr.commit("a", list(range(1, 11)))  # exactly the reserved tokens: the reserve's slots
    pages = mgr.pages_of("a")
    want = (pages[np.arange(10) // P].astype(np.int64) * P + np.arange(10) % P).tolist()
    assert step.slot_mapping.tolist() == want
    assert mgr.pages.tokens_at(np.array(want)).tolist() == list(range(1, 11))
    mgr.reserve(["b"], 3)
    mgr.reserve(["a"], 5)
    mgr.commit("a", [11, 12])  # a part of the reserved tokens
    mgr.commit("a", [13, 14, 15])  # the rest, not the whole reserve any more
    mgr.commit("b", [5, 6, 7])  # after another row's reserve
    assert mgr.tokens_of("a").tolist() == list(range(1, 16))
    assert mgr.tokens_of("b").tolist() == [5, 6, 7]
    mgr.check()


def test_ragged_token_lists_convert_at_once_as_row_by_row() -> None:
    """Guards batch_tokens' one-conversion path for B lists of ints (a mixed step's commits):
    the same flat tokens and counts as converting each row, and every list it cannot take
    (a bool, a float, a negative or huge id, a nested list, a tuple row) goes row by row,
    raising what that path raises."""
    from kvmem._validate import token_array
    from kvmem.allocator._commits import batch_tokens

    rng = np.random.default_rng(0)
    for _ in range(50):
        rows = [rng.integers(0, 1 << 31, rng.integers(0, 5)).tolist() for _ in range(6)]
        flat, counts = batch_tokens(rows, 6)
        parts = [token_array(r, "token_ids") for r in rows]
        assert flat.dtype == np.int64 and flat.tolist() == np.concatenate(parts).tolist()
        assert counts.tolist() == [len(r) for r in rows]
    for bad, error in (([[1, True], [2]], ArgumentTypeError), ([[1, 2.5], [2]], ArgumentTypeError),
                       ([[1, -1], [2]], ArgumentError), ([[1, 1 << 40], [2]], ArgumentError),
                       ([[1, [2]], [3]], ArgumentError), ([[1, "a"], [2]], ArgumentTypeError)):
        with pytest.raises(error):
            batch_tokens(bad, 2)
    assert batch_tokens([[], []], 2)[1].tolist() == [0, 0]
    assert batch_tokens([(1, 2), [3]], 2)[0].tolist() == [1, 2, 3]
