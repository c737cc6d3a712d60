"""KVCacheManager in one screen: a tiny engine loop with prefix reuse, a fork, a fenced step,
verification before decode, and a fault that verification catches. CPU, a second or two.

    python examples/manager_basics.py
"""

from __future__ import annotations

import numpy as np

from kvmem.manager import KVCacheManager
from kvmem.testing import ToyEngine, faults


def main() -> None:
    mgr = KVCacheManager(num_pages=64, page_size=16, max_seqs=8, max_pages_per_seq=16,
                         tracker="checking", kv_events=True)
    # ToyEngine does what an engine does around the manager (reserve, write K/V into the slots
    # the step names, copy-on-write copies, commit) and keeps "KV" we can check.
    engine = ToyEngine(mgr)
    system = list(range(100, 148))  # a 48-token system prompt: 3 full pages

    # 1. Admit and prefill one request in two chunks; its full pages become reusable on commit.
    res = engine.admit("alice", [*system, 1, 2, 3], namespace="tenant-a")
    print(f"alice: {res.num_cached_tokens} of {res.num_prompt_tokens} prompt tokens cached")
    engine.step(["alice"], 32)
    engine.step(["alice"], res.num_prompt_tokens - 32)
    engine.commit(["alice"])

    # 2. Same system prompt, same namespace: the prefix is reused. Another tenant: never.
    res = engine.admit("bob", [*system, 7, 8], namespace="tenant-a")
    print(f"bob (same tenant): {res.num_cached_tokens} cached tokens")
    res = engine.admit("carol", [*system, 9], namespace="tenant-b")
    print(f"carol (other tenant): {res.num_cached_tokens} cached tokens")
    rest = [len(engine.seqs[r].tokens) - engine.seqs[r].written for r in ("bob", "carol")]
    engine.step(["bob", "carol"], rest)  # one batched prefill step, a chunk per request
    engine.commit(["bob", "carol"])

    # 3. Parallel sampling: fork alice; the shared, partly filled tail is copied on first write.
    engine.fork("alice", "alice-2")

    # 4. Decode steps for the whole batch: reserve -> verify -> (kernel) -> commit.
    batch = ["alice", "alice-2", "bob", "carol"]
    for _ in range(20):
        handle = mgr.begin_step()  # pages dropped while this step runs wait for retire()
        step = engine.step(batch, 1)
        report = mgr.verify(batch, step)
        assert report.ok, report.aborted
        engine.commit(batch)
        mgr.retire(handle)
    print(f"decode: slot_mapping {step.slot_mapping.tolist()}, kv_indptr "
          f"{step.kv_indptr.tolist()}, copy-on-write copies so far: "
          f"{mgr.stats().num_cow_copies}")
    engine.check_kv()  # every request reads exactly the KV its own tokens imply

    # 5. A bug elsewhere frees one of carol's pages behind the manager's back: verification
    #    aborts carol only, and the rest of the batch proceeds.
    faults.free_behind_back(mgr, "carol", 1)
    report = mgr.verify(batch)
    engine.abort("carol")
    print(f"verify aborted: {report.aborted}")
    print(f"still running: {mgr.running}")

    #    A vLLM-style engine checks the very block table and slot mapping its kernels read
    #    (tensors on the pool's device in a real engine): a token sent into another request's
    #    slot aborts the request whose mapping went wrong, and only it.
    batch = ["alice", "alice-2", "bob"]
    step = engine.step(batch, 1)
    meta = {"block_table": step.block_table, "slot_mapping": step.slot_mapping.copy(),
            "seq_lens": step.seq_lens}
    meta["slot_mapping"][0] = meta["slot_mapping"][1]  # alice's token into alice-2's slot
    report = mgr.verify(batch, metadata=meta)
    engine.abort("alice")
    engine.commit(["alice-2", "bob"])
    print(f"verify of a block table aborted: {report.aborted}")

    # 6. Stats (a frozen snapshot) and KV events for a cache-aware router.
    s = mgr.stats()
    print(f"pages: {s.num_free} free, {s.num_used} used, {s.num_cached} cached, "
          f"{s.num_fenced} fenced; prefix hit rate {s.prefix_hit_rate:.2f}; integrity "
          f"failures {s.num_integrity_failures}")
    events = mgr.take_events()
    print(f"{len(events)} KV events, first: {type(events[0]).__name__} with "
          f"{len(events[0].page_hashes)} page hashes")  # type: ignore[union-attr]
    mgr.check()
    np.testing.assert_equal(s.num_free + s.num_used + s.num_cached + s.num_fenced, s.num_pages)


if __name__ == "__main__":
    main()
