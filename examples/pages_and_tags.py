"""Allocate, share, free and verify pages: the integrity check catching a stale mapping.

Three requests grow page by page; two share a prefix page; then one request's page is freed behind
its back and handed to another request, as buggy release paths in real engines have done. The
batched check before decode aborts exactly that request and leaves the others alone.

    python examples/pages_and_tags.py
"""

from __future__ import annotations

import numpy as np

from kvmem import CheckingTracker, PageAllocator, PageTable

PAGE_SIZE = 4


def main() -> None:
    alloc = PageAllocator(num_pages=32)
    table = PageTable(max_seqs=4, max_pages_per_seq=8, page_size=PAGE_SIZE)
    tracker = CheckingTracker(max_seqs=4, max_pages_per_seq=8)

    def record(result) -> None:  # type: ignore[no-untyped-def]
        tracker.record(result.new_page_rows, result.new_page_positions,
                       alloc.tags[result.new_pages])

    # Request "a" prefills 8 tokens (two pages); "b" reuses a's first page as a shared prefix.
    a, b, c = table.add_rows(3)
    record(table.grow([a], 8, alloc))
    shared = table.row_pages(a)[:1]
    alloc.share(shared)
    table.map_pages(b, shared)
    table.set_num_tokens(b, PAGE_SIZE)
    tracker.record([b], [0], alloc.tags[shared])
    record(table.grow([b, c], [3, 6], alloc))
    print(f"pages a={table.row_pages(a).tolist()} b={table.row_pages(b).tolist()} "
          f"c={table.row_pages(c).tolist()}; refcount of shared page {int(shared[0])}: "
          f"{int(alloc.refcounts[shared[0]])}")

    rows = np.array([a, b, c])
    names = ("a", "b", "c")
    for step in range(3):
        slots = table.grow(rows, 1, alloc)
        record(slots)
        bt = table.block_table(rows)
        num_pages = (table.num_tokens[rows] + PAGE_SIZE - 1) // PAGE_SIZE
        report = tracker.verify(rows, num_pages, alloc.tags, block_table=bt, ids=names)
        print(f"decode step {step}: slots {slots.slot_mapping.tolist()}, verify ok={report.ok}")

    # The fault: c's last page is freed by a second release path and reallocated to b.
    stolen = table.row_pages(c)[-1:]
    alloc.free(stolen)
    record(table.grow([b], PAGE_SIZE * 2, alloc))
    print(f"fault injected: c's page {int(stolen[0])} freed and reallocated; b now maps "
          f"{table.row_pages(b).tolist()}")
    bt = table.block_table(rows)
    num_pages = (table.num_tokens[rows] + PAGE_SIZE - 1) // PAGE_SIZE
    report = tracker.verify(rows, num_pages, alloc.tags, block_table=bt, ids=names)
    for request, reason in report.reasons().items():
        print(f"abort {request}: {reason}")
    # Abort only the failing request: release its row, freeing only the pages that are still its
    # own (the stolen page now belongs to b's lifetime).
    for request in report.failed:
        row = int(rows[names.index(request)])
        expected = tracker.expected_tags[row, : table.num_pages[row]].copy()
        pages = table.remove_row(row)
        tracker.forget([row])
        alloc.free(pages[alloc.tags[pages] == expected])
    alloc.check()
    live = {int(p) for r in (a, b) for p in table.row_pages(r)}
    assert alloc.num_used == len(live), "a page leaked"

    stats = alloc.stats()
    print(f"after abort: {stats.num_used} pages used, {stats.num_free} free, "
          f"{stats.num_shared} shared; allocator check passed")


if __name__ == "__main__":
    main()
