"""Allocator + PageTable + CheckingTracker driven by hypothesis against a plain reference model."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmem import CheckingTracker, OutOfPagesError, PageAllocator, PageTable

NUM_PAGES, MAX_SEQS, MAX_PAGES, PAGE_SIZE = 24, 6, 10, 4


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.table = PageTable(MAX_SEQS, MAX_PAGES, PAGE_SIZE)
        self.tracker = CheckingTracker(MAX_SEQS, MAX_PAGES)
        # Reference model: each live row's pages (in order) and token count.
        self.ref_pages: dict[int, list[int]] = {}
        self.ref_tokens: dict[int, int] = {}

    def holders(self) -> Counter[int]:
        return Counter(p for pages in self.ref_pages.values() for p in pages)

    @precondition(lambda self: len(self.ref_pages) < MAX_SEQS)
    @rule()
    def open_request(self) -> None:
        row = self.table.add_row()
        assert row not in self.ref_pages
        self.ref_pages[row], self.ref_tokens[row] = [], 0

    @precondition(lambda self: self.ref_pages)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        live = sorted(self.ref_pages)
        rows = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        counts = data.draw(st.lists(st.integers(0, 9), min_size=len(rows), max_size=len(rows)))
        needed = [
            max(0, -(-(self.ref_tokens[r] + k) // PAGE_SIZE) - len(self.ref_pages[r]))
            for r, k in zip(rows, counts)
        ]
        if any(len(self.ref_pages[r]) + n > MAX_PAGES for r, n in zip(rows, needed)):
            return
        free_before = self.alloc.num_free
        try:
            result = self.table.grow(rows, counts, self.alloc)
        except OutOfPagesError:
            assert sum(needed) > free_before
            assert self.alloc.num_free == free_before
            return
        assert result.new_pages.size == sum(needed)
        self.tracker.record(
            result.new_page_rows, result.new_page_positions, self.alloc.tags[result.new_pages]
        )
        slots = []
        for r, k, n in zip(rows, counts, needed):
            got = result.new_pages[result.new_page_rows == r].tolist()
            assert len(got) == n
            self.ref_pages[r] += got
            for t in range(self.ref_tokens[r], self.ref_tokens[r] + k):
                slots.append(self.ref_pages[r][t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE)
            self.ref_tokens[r] += k
        assert result.slot_mapping.tolist() == slots

    @precondition(lambda self: len(self.ref_pages) >= 2)
    @rule(data=st.data())
    def share_prefix(self, data: st.DataObject) -> None:
        """A request maps another's full pages (prefix reuse), holding them too."""
        src, dst = data.draw(st.lists(st.sampled_from(sorted(self.ref_pages)), min_size=2,
                                      max_size=2, unique=True))
        if self.ref_tokens[dst] != 0 or self.ref_pages[dst]:
            return
        full = self.ref_tokens[src] // PAGE_SIZE
        pages = self.ref_pages[src][:full]
        if not pages:
            return
        self.alloc.share(pages)
        self.table.map_pages(dst, pages)
        self.table.set_num_tokens(dst, full * PAGE_SIZE)
        self.tracker.record([dst] * full, list(range(full)), self.alloc.tags[pages])
        self.ref_pages[dst] = list(pages)
        self.ref_tokens[dst] = full * PAGE_SIZE

    @precondition(lambda self: self.ref_pages)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.ref_pages)))
        pages = self.table.remove_row(row)
        assert pages.tolist() == self.ref_pages.pop(row)
        del self.ref_tokens[row]
        released = self.alloc.free(pages)
        self.tracker.forget([row])
        still_held = self.holders()
        assert sorted(released.tolist()) == sorted(p for p in set(pages.tolist())
                                                   if p not in still_held)

    @precondition(lambda self: any(self.ref_tokens.values()))
    @rule()
    def verify(self) -> None:
        rows = np.array([r for r in sorted(self.ref_pages) if self.ref_tokens[r] > 0])
        bt = self.table.block_table(rows)
        csr = self.table.csr(rows)
        n = np.array([-(-self.ref_tokens[r] // PAGE_SIZE) for r in rows])
        assert self.tracker.verify(rows, n, self.alloc.tags, block_table=bt).ok
        assert self.tracker.verify(
            rows, n, self.alloc.tags, kv_indptr=csr.kv_indptr, kv_indices=csr.kv_indices
        ).ok

    @invariant()
    def conservation_and_refcounts(self) -> None:
        self.alloc.check()
        holders = self.holders()
        assert self.alloc.num_used == len(holders)
        assert self.alloc.num_free + len(holders) == NUM_PAGES
        expected = np.zeros(NUM_PAGES, dtype=np.int32)
        for page, count in holders.items():
            expected[page] = count
        np.testing.assert_array_equal(self.alloc.refcounts, expected)
        for row, pages in self.ref_pages.items():
            assert self.table.row_pages(row).tolist() == pages
            assert self.table.num_tokens[row] == self.ref_tokens[row]


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
