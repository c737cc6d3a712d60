"""KV cache groups on one byte budget: a hybrid model's requests on kvmem's HybridManager.

A Qwen3-Next-like layout (sizes scaled down): full-attention layers, a sliding-window group,
a gated-delta-net state per request, and a DSA-style indexer on the attention pages. Two
requests share a prompt prefix; the second restores it from the checkpoints (pages in every
token group, the state from its checkpoint slot). One is forked. Then a fault is injected: a
sliding-window page released one step early while the step still reads it; verify aborts
that request only, and the others decode on.

    python examples/hybrid_groups.py
"""

from __future__ import annotations

import numpy as np

from kvmem import HybridManager
from kvmem.allocator import FullAttentionSpec, IndexerSpec, SlidingWindowSpec, StateSpec


def main() -> None:
    full = FullAttentionSpec("full", page_size=16, bytes_per_token=2048)
    groups = [full,
              SlidingWindowSpec("swa", window=64, page_size=16, bytes_per_token=2048),
              StateSpec("gdn", bytes_per_state=96 << 10),
              IndexerSpec("indexer", attention=full, bytes_per_token=132)]
    mgr = HybridManager(groups, budget_bytes=32 << 20, max_seqs=8)
    prompt = list(range(1000, 1200))
    for rid, tokens in (("a", prompt), ("b", [*prompt[:160], 7, 8, 9])):
        hit = mgr.admit(rid, tokens).num_cached_tokens
        print(f"{rid}: {len(tokens)} prompt tokens, {hit} restored from the cache, copies "
              f"{mgr.take_copies()}")
        done = hit
        while done < len(tokens):  # chunks ending on checkpoints: states are checkpointed
            n = min(32, len(tokens) - done)
            step = mgr.reserve([rid], n)
            assert mgr.verify([rid], step).ok
            mgr.commit(rid, tokens[done : done + n])
            mgr.take_copies()  # (an engine copies each state into its checkpoint slot here)
            done += n
    mgr.fork("a", "a2")
    print(f"fork a -> a2 copies: {mgr.take_copies()}")
    ids = ["a", "b", "a2"]
    for _ in range(40):
        step = mgr.reserve(ids, 1)
        assert mgr.verify(ids, step).ok
        mgr.commit_batch(ids, np.full(len(ids), 5))
    swa = mgr.pages_of("a", "swa")
    print(f"a's sliding rows after 240 tokens: {np.count_nonzero(swa < 0)} pages released, "
          f"{np.count_nonzero(swa >= 0)} held; full attention holds "
          f"{mgr.pages_of('a', 'full').size}")
    for g in mgr.stats().groups:
        print(f"  group {g.name:8s} {g.num_used_pages:4d} pages of {g.page_bytes:6d} B in use")

    step = mgr.reserve(ids, 1)
    row = mgr.table.requests["b"].row
    first = int(step.groups["swa"].first[1])
    rows = mgr.table.tokens["swa"]
    page = int(rows.pages[row, first])
    rows.release_before(np.array([row]), np.array([first + 1]))  # the injected fault
    mgr.allocator.free({"swa": [page]})
    report = mgr.verify(ids, step)
    print(f"injected: b's window page {page} released while the step reads it")
    for rid, why in report.aborted.items():
        print(f"  aborted {rid}: {why}")
    survivors = [r for r in ids if r not in report.aborted]
    mgr.commit_batch(survivors, np.full(len(survivors), 5))
    step = mgr.reserve(survivors, 1)
    print(f"the others decode on: {mgr.verify(survivors, step).ok}")
    mgr.check()


if __name__ == "__main__":
    main()
