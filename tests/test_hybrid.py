"""HybridManager: a model's KV cache groups (full attention, sliding window, recurrent state,
indexer) run together from one byte budget: admission, steps, windows, prefix hits every group
can restore, forks, the batched check in every group, and its detectors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmem.allocator import FullAttentionSpec, IndexerSpec, SlidingWindowSpec, StateSpec
from kvmem.allocator._group_table import RELEASED
from kvmem.errors import ArgumentError, ConfigError, IntegrityError, OutOfPagesError
from kvmem.hybrid import HybridCopy, HybridManager

FULL = FullAttentionSpec("full", page_size=16, bytes_per_token=64)
SWA = SlidingWindowSpec("swa", window=32, page_size=8, bytes_per_token=64)
STATE = StateSpec("gdn", bytes_per_state=4096)
INDEXER = IndexerSpec("idx", attention=FULL, bytes_per_token=8)
GROUPS = (FULL, SWA, STATE, INDEXER)


def manager(budget: int = 1 << 20, groups: Any = GROUPS, **kw: Any) -> HybridManager:
    return HybridManager(groups, budget_bytes=budget, **kw)


def prefill(m: HybridManager, rid: Any, prompt: list[int], chunk: int = 16) -> None:
    """Admit ``rid`` and compute its prompt in chunks (checked and committed step by step)."""
    done = m.admit(rid, prompt).num_cached_tokens
    m.take_copies()
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        step = m.reserve([rid], n)
        assert m.verify([rid], step).ok
        m.commit(rid, prompt[done : done + n])
        m.take_copies()  # (the engine makes the checkpoints' copies)
        done += n
        m.check()


def decode(m: HybridManager, ids: list[Any], token: int = 7) -> Any:
    step = m.reserve(ids, 1)
    report = m.verify(ids, step)
    for rid in ids:
        if rid not in report.aborted:
            m.commit(rid, [token])
    return report


# -- groups, budget, windows ---------------------------------------------------------------


def test_each_group_holds_its_own_pages_at_its_true_size() -> None:
    """A 100-token request holds ceil(100/16) full and indexer pages, one state, and in the
    sliding group only the pages from its next query's window on: no group padded."""
    m = manager()
    prefill(m, "a", list(range(100)))
    full = m.pages_of("a", "full")
    assert full.size == 7 and (full >= 0).all()
    assert m.pages_of("a", "idx").size == 7
    swa = m.pages_of("a", "swa")
    first = (100 - 32 + 1) // 8  # the first page the query at 100 reads
    assert (swa[:first] == RELEASED).all() and (swa[first:] >= 0).all()
    assert swa.size == 13
    assert m.pages_of("a", "gdn").size == 1
    used = {g.name: g.num_used_pages for g in m.stats().groups}
    cached = m.cache is not None and len(m.cache.entries)
    assert cached  # checkpoints at 16 .. 96 hold pages too
    m.cache.clear()  # type: ignore[union-attr]
    used = {g.name: g.num_used_pages for g in m.stats().groups}
    assert used == {"full": 7, "swa": 13 - first, "gdn": 1, "idx": 7}
    m.check()


def test_a_sliding_groups_kernel_lists_only_its_window_and_released_pages_are_freed() -> None:
    m = manager(enable_prefix_caching=False)
    prefill(m, "a", list(range(40)))
    for t in range(30):
        step = m.reserve(["a"], 1)
        swa = step.groups["swa"]
        first = (40 + t - 32 + 1) // 8
        assert int(swa.first[0]) == first
        assert swa.indices.tolist() == m.pages_of("a", "swa")[first:].tolist()
        assert step.groups["full"].indices.size == -(-(41 + t) // 16)
        assert m.verify(["a"], step).ok
        m.commit("a", [t])
        m.check()
    # The window moved 30 tokens: the pages before it went back; it holds 70 tokens' window.
    held = m.pages_of("a", "swa")
    first = (70 - 32 + 1) // 8
    assert (held[:first] == RELEASED).all() and np.count_nonzero(held >= 0) == 9 - first
    assert {g.name: g.num_used_pages for g in m.stats().groups}["swa"] == 9 - first


def test_a_model_of_states_alone_steps_with_no_token_group() -> None:
    """A pure recurrent model (every layer a state, no attention): steps list no token
    group, only the slot each request reads and writes."""
    m = manager(groups=(STATE,))
    prefill(m, "a", list(range(40)))
    step = m.reserve(["a"], 1)
    assert step.groups == {} and step.state_slots["gdn"].tolist() == m.pages_of("a", "gdn")
    assert m.verify(["a"], step).ok
    m.commit("a", [1])
    m.check()


def test_release_and_clear_return_every_chunk_to_the_budget() -> None:
    m = manager()
    for i in range(4):
        prefill(m, i, list(range(i * 1000, i * 1000 + 70)))
    m.fork(0, "f")
    m.take_copies()
    decode(m, [0, 1, 2, 3, "f"])
    for rid in [0, 1, 2, 3, "f"]:
        m.release(rid)
    m.reserve([], 0)  # (the copies' holds go with the next step)
    m.cache.clear()  # type: ignore[union-attr]
    m.check()
    s = m.stats()
    assert s.num_free_chunks == s.num_chunks
    assert all(g.num_used_pages == 0 for g in s.groups)


# -- prefix hits across groups ---------------------------------------------------------------


def test_a_prefix_hit_is_the_longest_checkpoint_every_group_restores() -> None:
    m = manager()
    prompt = list(range(100))
    prefill(m, "a", prompt, chunk=16)  # every chunk ends on a checkpoint: states taken
    m.release("a")
    hit = m.admit("b", [*prompt, 1, 2, 3])
    assert hit.num_cached_tokens == 96
    copies = m.take_copies()
    assert [c.group for c in copies] == ["gdn"] and copies[0].dst == m.pages_of("b", "gdn")[0]
    # Full and indexer pages of the 96 tokens are the cached ones; the window's pages too.
    assert m.pages_of("b", "full").size == 6
    swa = m.pages_of("b", "swa")
    first = (96 - 32 + 1) // 8
    assert (swa[:first] == RELEASED).all() and (swa[first:] >= 0).all()
    step = m.reserve(["b"], 7)
    assert m.verify(["b"], step).ok
    m.commit("b", ([*prompt, 1, 2, 3])[96:])
    m.check()


def test_no_hit_past_the_last_state_checkpoint() -> None:
    """A prompt prefilled in one chunk leaves its pages cached but no state at any
    checkpoint: a request with the same prompt restores nothing (the attention pages alone
    would leave the recurrent state empty); without a state group, the pages are a hit."""
    prompt = list(range(100))
    m = manager()
    prefill(m, "a", prompt, chunk=100)
    assert len(m.cache.entries) == 6  # type: ignore[union-attr]
    m.release("a")
    assert m.match_prefix([*prompt, 1]) == 0
    prefill(m, "b", [*prompt[:48], 9], chunk=48)  # a commit ends at 48: a state there
    m.release("b")
    assert m.match_prefix([*prompt, 1]) == 48
    attention_only = manager(groups=(FULL, SWA, INDEXER))
    prefill(attention_only, "a", prompt, chunk=100)
    attention_only.release("a")
    assert attention_only.match_prefix([*prompt, 1]) == 96


def test_hits_are_per_namespace_and_confirm_their_tokens() -> None:
    m = manager()
    prompt = list(range(64))
    m.admit("a", prompt, namespace="t1")
    for lo in range(0, 64, 16):
        m.verify(["a"], m.reserve(["a"], 16))
        m.commit("a", prompt[lo : lo + 16])
    m.release("a")
    assert m.match_prefix([*prompt, 0], namespace="t1") == 64
    assert m.match_prefix([*prompt, 0], namespace="t2") == 0
    assert m.match_prefix(prompt[:40] + [0] * 30, namespace="t1") == 32


def test_eviction_makes_room_and_can_reserve_is_exact() -> None:
    """A budget of few chunks: cached prefixes are evicted, least recently used first, when a
    step needs their room; can_reserve answers exactly what reserve then does."""
    m = manager(budget=64 << 10)
    for i in range(40):
        prompt = list(range(i * 1000, i * 1000 + 50))
        ok = m.can_admit(prompt)
        try:
            m.admit(i, prompt)
        except OutOfPagesError:
            assert not ok
            continue
        m.take_copies()
        done = 0
        while done < 50:
            can = m.can_reserve([i], 16)
            try:
                step = m.reserve([i], 16)
            except OutOfPagesError:
                assert not can
                break
            assert can
            assert m.verify([i], step).ok
            m.commit(i, prompt[done : done + 16])
            done += 16
        m.release(i)
        m.check()
    assert m.cache.num_evicted > 0  # type: ignore[union-attr]


def test_failed_calls_change_nothing() -> None:
    m = manager(budget=64 << 10)
    prefill(m, "a", list(range(40)))

    def snapshot() -> Any:
        t = m.table
        return (m.stats(), t.num_tokens.tobytes(), t.num_committed.tobytes(),
                [(r.pages.tobytes(), r.num_pages.tobytes()) for r in t.tokens.values()],
                len(m.cache.entries))  # type: ignore[union-attr]

    before = snapshot()
    with pytest.raises(OutOfPagesError):
        m.reserve(["a"], 60_000)
    with pytest.raises(ArgumentError):
        m.reserve(["a", "a"], 1)
    with pytest.raises(ArgumentError):
        m.reserve(["nobody"], 1)
    with pytest.raises(ArgumentError):
        m.admit("a", [1, 2])
    with pytest.raises(ArgumentError):
        m.admit("b", [])
    with pytest.raises(ArgumentError):
        m.commit("a", [1])  # nothing reserved
    m.reserve(["a"], 2)
    with pytest.raises(ArgumentError):
        m.commit("a", [1, 2, 3])
    before = snapshot()
    with pytest.raises(ArgumentError):
        m.fork("a", "c")  # a step reserved and not committed
    assert snapshot() == before
    with pytest.raises(ConfigError):
        manager(checkpoint_tokens=12)  # not a multiple of 16 and 8


# -- forks -----------------------------------------------------------------------------------


def test_a_fork_shares_full_pages_and_copies_tails_and_states() -> None:
    m = manager()
    prefill(m, "p", list(range(37)))
    copies = m.fork("p", "c")
    assert m.take_copies() == copies
    groups = {c.group for c in copies}
    assert groups == {"full", "swa", "idx", "gdn"}  # 37 tokens: every token group's tail
    for name in ("full", "idx"):
        p, c = m.pages_of("p", name), m.pages_of("c", name)
        assert (p[:-1] == c[:-1]).all() and p[-1] != c[-1]
        assert HybridCopy(name, int(p[-1]), int(c[-1])) in copies
    assert m.pages_of("p", "gdn")[0] != m.pages_of("c", "gdn")[0]
    report = decode(m, ["p", "c"])
    assert report.ok
    m.check()


# -- the batched check in every group, and its detectors -----------------------------------


def two_running() -> HybridManager:
    m = manager()
    prefill(m, "a", list(range(60)))
    prefill(m, "b", list(range(500, 560)))
    return m


def test_verify_is_silent_on_correct_steps() -> None:
    m = two_running()
    for _ in range(40):
        assert decode(m, ["a", "b"]).ok
        m.check()


def test_a_window_page_freed_while_still_read_aborts_only_its_request() -> None:
    """The fault a sliding window invites: a page released one step early (and given to
    someone else) while the step's kernel still reads it."""
    m = two_running()
    step = m.reserve(["a", "b"], 1)
    row = m.table.requests["a"].row
    first = int(step.groups["swa"].first[0])
    swa = m.table.tokens["swa"]
    page = int(swa.pages[row, first])
    swa.release_before(np.array([row]), np.array([first + 1]))  # the bug: one page too early
    m.allocator.free({"swa": [page]})
    report = m.verify(["a", "b"], step)
    assert list(report.aborted) == ["a"]
    assert "released" in report.aborted["a"]
    m.commit("b", [1])
    m.check()


def test_a_window_page_released_before_the_step_is_read_as_released_and_caught() -> None:
    """The same bug one step sooner: the page was released before ``reserve``, so the step
    and the row agree on listing ``RELEASED`` where the kernel still reads; verify must not
    take the agreement for a correct step."""
    m = two_running()
    row = m.table.requests["a"].row
    swa = m.table.tokens["swa"]
    first = int(np.max([int(m.num_tokens("a")) - SWA.window + 1, 0]) // SWA.page_size)
    page = int(swa.pages[row, first])
    swa.release_before(np.array([row]), np.array([first + 1]))  # the bug: one page too early
    m.allocator.free({"swa": [page]})
    # (the recorded tag made to match what a lookup of page -1 finds: only RELEASED tells)
    swa.tags[row, first] = m.allocator.tags("swa")[-1]
    step = m.reserve(["a", "b"], 1)
    assert int(step.groups["swa"].indices[0]) == RELEASED
    report = m.verify(["a", "b"], step)
    assert list(report.aborted) == ["a"]
    assert "released" in report.aborted["a"]


def test_two_requests_mapped_to_one_tail_page_are_both_caught() -> None:
    """A fork that shared its parent's partly filled tail page instead of copying it: both
    rows agree with the step, and only the check that no slot is written twice tells."""
    m = two_running()  # (a and b both hold 60 tokens: their next tokens share an offset)
    a, b = m.table.requests["a"].row, m.table.requests["b"].row
    full = m.table.tokens["full"]
    last = int(full.num_pages[a]) - 1
    own = int(full.pages[b, last])
    full.pages[b, last], full.tags[b, last] = full.pages[a, last], full.tags[a, last]
    m.allocator.share({"full": [int(full.pages[a, last])]})
    m.allocator.free({"full": [own]})
    step = m.reserve(["a", "b"], 1)
    report = m.verify(["a", "b"], step)
    assert set(report.aborted) == {"a", "b"}
    assert all("another token" in why for why in report.aborted.values())


def test_a_page_listed_from_another_request_aborts_only_the_reader() -> None:
    m = two_running()
    step = m.reserve(["a", "b"], 1)
    full = step.groups["full"]
    full.indices[0] = full.indices[int(full.indptr[1])]  # a's first page: b's
    report = m.verify(["a", "b"], step)
    assert list(report.aborted) == ["a"]


def test_a_state_slot_shared_after_fork_without_a_copy_is_caught() -> None:
    m = two_running()
    m.fork("a", "c")
    m.take_copies()
    child, parent = m.table.requests["c"].row, m.table.requests["a"].row
    gdn = m.table.states["gdn"]
    own = int(gdn.slot[child])
    gdn.take(child, int(gdn.slot[parent]), int(gdn.tag[parent]), int(gdn.tokens[parent]))
    m.allocator.share({"gdn": [int(gdn.slot[parent])]})  # the fork's bug: the state shared
    m.allocator.free({"gdn": [own]})
    step = m.reserve(["a", "b", "c"], 1)
    report = m.verify(["a", "b", "c"], step)
    assert set(report.aborted) == {"a", "c"}
    assert "fork" in report.aborted["c"]


def test_a_prefix_hit_restoring_the_pages_but_not_the_state_is_caught() -> None:
    m = manager()
    prompt = list(range(100))
    prefill(m, "a", prompt)
    m.release("a")
    m.admit("b", [*prompt, 1])
    m.take_copies()
    prefill(m, "o", list(range(900, 930)))
    m.table.states["gdn"].tokens[m.table.requests["b"].row] = 0  # the bug: a fresh state
    step = m.reserve(["b", "o"], [5, 1])
    report = m.verify(["b", "o"], step)
    assert list(report.aborted) == ["b"]
    assert "restored" in report.aborted["b"]


def test_a_slot_mapping_into_another_page_is_caught() -> None:
    m = two_running()
    step = m.reserve(["a", "b"], 1)
    step.groups["idx"].slot_mapping[1] = step.groups["idx"].slot_mapping[0]
    report = m.verify(["a", "b"], step)
    assert "b" in report.aborted


def _shift_first(step: Any) -> None:
    step.groups["swa"].first[0] += 1


def _move_b_start(step: Any) -> None:
    step.groups["swa"].indptr[1] += 1


def _drop_group(step: Any) -> None:
    del step.groups["idx"]


def _fold_indices(step: Any) -> None:
    pages = step.groups["full"]
    object.__setattr__(pages, "indices", pages.indices.reshape(1, -1))


def _short_slots(step: Any) -> None:
    pages = step.groups["swa"]
    object.__setattr__(pages, "slot_mapping", pages.slot_mapping[:1])


def _twice_in_one_step(step: Any) -> None:
    swa = step.groups["swa"]
    swa.indices[int(swa.indptr[1])] = swa.indices[int(swa.indptr[1]) - 1]


@pytest.mark.parametrize(("tamper", "aborted", "words"), [
    (_shift_first, {"a"}, "from row index"),
    (_move_b_start, {"a", "b"}, "pages from row index"),
    (_drop_group, {"a", "b"}, "lists no metadata"),
    (_fold_indices, {"a", "b"}, "shaped for another batch"),
    (_short_slots, {"a", "b"}, "shaped for another batch"),
    (_twice_in_one_step, {"b"}, "lists page"),
])
def test_any_wrong_group_metadata_leaves_the_one_pass_check_for_the_named_one(
        tamper: Any, aborted: set[str], words: str) -> None:
    """verify first checks every group's arrays in one pass over all of them together and
    only on a mismatch runs the per-group check that names what broke: each kind of damage,
    in any one group, must fail the one pass (a mutant that lets it through would run the
    step) and abort exactly the requests it breaks."""
    m = two_running()
    assert decode(m, ["a", "b"]).ok
    step = m.reserve(["a", "b"], 1)
    tamper(step)
    report = m.verify(["a", "b"], step)
    assert set(report.aborted) == aborted
    assert all(words in why for why in report.aborted.values()), report.aborted
    m.check()


def test_check_finds_a_leaked_and_a_stale_page() -> None:
    m = two_running()
    m.check()
    m.allocator.share({"full": [int(m.pages_of("a", "full")[0])]})
    with pytest.raises(IntegrityError, match="holders"):
        m.check()
    stale = two_running()
    stale.table.tokens["swa"].tags[stale.table.requests["b"].row, -1 + int(
        stale.table.tokens["swa"].num_pages[stale.table.requests["b"].row])] += 1
    with pytest.raises(IntegrityError, match="lifetime changed"):
        stale.check()


# -- a random workload ---------------------------------------------------------------------


class HybridMachine(RuleBasedStateMachine):
    """Admissions of prompts that share prefixes, chunked prefills (some ending on
    checkpoints), decode steps, forks, releases: every step verifies clean, check() holds
    after every call, can_reserve answers what reserve does, and a prefix hit never passes a
    checkpoint where a state was not taken."""

    def __init__(self) -> None:
        super().__init__()
        self.m = manager(budget=96 << 10)
        self.prompts: dict[Any, list[int]] = {}
        self.next_id = 0

    @rule(base=st.integers(0, 2), extra=st.integers(1, 60))
    def admit(self, base: int, extra: int) -> None:
        prompt = list(range(base * 100, base * 100 + 40)) + list(range(7, 7 + extra))
        rid = self.next_id
        self.next_id += 1
        try:
            hit = self.m.admit(rid, prompt)
        except OutOfPagesError:
            return
        assert hit.num_cached_tokens % 16 == 0 and hit.num_cached_tokens < len(prompt)
        for c in self.m.take_copies():
            assert c.group == "gdn"
        self.prompts[rid] = prompt

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.prompts)), min_size=1,
                                 unique=True))
        counts = []
        for rid in ids:
            left = len(self.prompts[rid]) - self.m.num_tokens(rid)
            counts.append(data.draw(st.sampled_from([16, 5, left])) if left > 0 else 1)
        can = self.m.can_reserve(ids, counts)
        try:
            step = self.m.reserve(ids, counts)
        except OutOfPagesError:
            assert not can
            return
        assert can
        report = self.m.verify(ids, step)
        assert report.ok, report.aborted
        for rid, n in zip(ids, counts):
            start = self.m.num_committed(rid)
            known = self.prompts[rid][start : start + n]
            self.m.commit(rid, known + [3] * (n - len(known)))
            self.prompts[rid] = self.prompts[rid][: start] + known + [3] * (n - len(known)) \
                if start + n > len(self.prompts[rid]) else self.prompts[rid]

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.prompts)))
        self.m.release(rid)
        del self.prompts[rid]

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.prompts)))
        child = self.next_id
        self.next_id += 1
        try:
            self.m.fork(rid, child)
        except OutOfPagesError:
            return
        self.m.take_copies()
        self.prompts[child] = list(self.prompts[rid])

    @invariant()
    def sound(self) -> None:
        self.m.check()
        s = self.m.stats()
        assert (s.num_chunks - s.num_free_chunks) * s.chunk_bytes <= s.budget_bytes


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("call", [
    lambda m: m.reserve(["a"], True), lambda m: m.reserve(["a"], 1.5),
    lambda m: m.reserve(["a"], "3"), lambda m: m.reserve(["a"], -1),
    lambda m: m.reserve(["a"], 2**63), lambda m: m.reserve(["a"], None),
    lambda m: m.reserve("a", 1), lambda m: m.reserve(["a"], [True]),
    lambda m: m.reserve(["a"], [[1]]), lambda m: m.reserve(["a"], [1, 2]),
    lambda m: m.admit("b", [[1, 2]]), lambda m: m.admit("b", [True, 2]),
    lambda m: m.admit("b", [-1, 2]), lambda m: m.admit(["x"], [1, 2]),
    lambda m: m.admit("b", "abc"), lambda m: m.commit("a", [1]),
    lambda m: m.commit_batch("a", [[1]]), lambda m: m.commit_batch(["a"], [[1], [2]]),
    lambda m: m.release("zz"), lambda m: m.fork("a", "a"), lambda m: m.fork("a", ["x"]),
    lambda m: m.pages_of("a", 3), lambda m: m.can_admit([1, 2, 3], chunk=True),
    lambda m: m.can_admit([1, 2, 3], chunk=0), lambda m: m.match_prefix([1, 2], namespace=[1]),
])
def test_bad_arguments_get_a_kvmem_error_and_change_nothing(call: Any) -> None:
    """Bools, floats, strings, None, negative and huge counts, one id where a list is
    expected, malformed token arrays, unknown and unhashable ids: each a KVMemError (a
    ValueError or TypeError) naming what was wrong, the manager unchanged."""
    from kvmem.errors import KVMemError

    m = manager(budget=64 << 10)
    m.admit("a", list(range(1, 41)))

    def snapshot() -> Any:
        t = m.table
        return (m.stats(), t.num_tokens.tobytes(), t.num_committed.tobytes(),
                [(r.pages.tobytes(), r.num_pages.tobytes()) for r in t.tokens.values()],
                sorted(map(str, t.requests)), dict(m._held_for_copies), len(m.take_copies()))

    before = snapshot()
    with pytest.raises(KVMemError):
        call(m)
    assert snapshot() == before
