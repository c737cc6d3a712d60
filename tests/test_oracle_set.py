"""The fuzzer's oracle set on its own: a test drives a manager, tells the set's model which
pages each request maps, and runs the checks a timeline would run after every move."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmem import KVCacheManager
from kvmem.testing import FuzzFailure
from kvmem.testing._oracles import OracleSet
from kvmem.testing.faults import free_behind_back, share_write_page

SYSTEM = list(range(100, 112))  # three pages of a shared prefix at page_size 4


class _Driver:
    """A manager, an oracle set without a timeline, and the model kept in step: after each
    move, each running request maps exactly the pages the manager says it does."""

    def __init__(self) -> None:
        self.mgr = KVCacheManager(num_pages=32, page_size=4, max_seqs=4, max_pages_per_seq=8)
        self.oracles = OracleSet(self.mgr)
        self.mapped: dict[Any, np.ndarray] = {}

    def moved(self) -> None:
        for rid in list(self.mapped):
            if rid not in self.mgr.running:
                self.oracles.unhold(self.mapped.pop(rid))
        for rid in self.mgr.running:
            pages = self.mgr.pages_of(rid).astype(np.int64)
            old = self.mapped.get(rid)
            if old is None or not np.array_equal(old, pages):
                if old is not None:
                    self.oracles.unhold(old)
                self.oracles.hold(pages)
                self.mapped[rid] = pages
        self.oracles.check_pages()

    def correct_sequence(self, fault: Any = None) -> None:
        mgr = self.mgr
        mgr.admit("a", np.array([*SYSTEM, 1, 2], dtype=np.int64))
        self.moved()
        mgr.reserve(("a",), 14)
        mgr.commit_batch(["a"], [[*SYSTEM, 1, 2]])
        self.moved()
        res = mgr.admit("b", np.array([*SYSTEM, 7], dtype=np.int64))  # a hit on a's pages
        assert res.num_cached_tokens == 12
        self.moved()
        mgr.reserve(("b",), 1)
        mgr.commit_batch(["b"], [[7]])
        self.moved()
        if fault is not None:
            fault(mgr)
            self.moved()
        for token in range(3):
            mgr.reserve(("a", "b"), 1)
            self.moved()
            mgr.commit_batch(("a", "b"), np.array([token, token], dtype=np.int64))
            self.moved()
        mgr.release("a")
        self.moved()
        self.oracles.full_check(alive=lambda rid: rid in self.mapped, idle=True)


def test_the_oracle_set_stays_silent_on_a_correct_sequence() -> None:
    d = _Driver()
    d.correct_sequence()
    counts = d.oracles.counts
    assert counts["page_checks"] >= 8 and counts["tag_changes"] > 0
    assert counts["full_checks"] == 1


@pytest.mark.parametrize(("fault", "oracle", "says"), [
    # a page freed while a request maps it (BUGS 5, 9): the model still counts the holder
    (lambda mgr: free_behind_back(mgr, "a", 3), "refcounts", "freed under a holder"),
    # a phantom holder on the page a request writes (BUG 14): one reference too many
    (lambda mgr: share_write_page(mgr, "b"), "refcounts", "a leak"),
])
def test_the_oracle_set_fires_on_a_fault_without_a_timeline(fault: Any, oracle: str,
                                                            says: str) -> None:
    d = _Driver()
    with pytest.raises(FuzzFailure, match=says) as info:
        d.correct_sequence(fault)
    assert info.value.oracle == oracle


def test_happens_before_fires_when_a_guarded_page_changes_lifetime() -> None:
    """A page that a device op in flight lists is freed: the oracle set names the op."""
    d = _Driver()
    d.mgr.admit("a", np.array([*SYSTEM, 1, 2], dtype=np.int64))
    d.moved()
    pages = d.mgr.pages_of("a").astype(np.int64)
    d.oracles.guard_pages(pages)
    with pytest.raises(FuzzFailure, match=r"changed lifetime .* while 'the step'") as info:
        free_behind_back(d.mgr, "a", 3)
        d.oracles.check_pages(lambda page: "the step")
    assert info.value.oracle == "happens_before"
    d.oracles.unguard_pages(pages)
    assert not d.oracles.guard.any()
