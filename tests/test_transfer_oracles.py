"""The transfer oracles (kvmem/testing/_transfer_oracles.py) on two real managers: a source (a
prefill pool) and the fuzzed destination (a decode pool)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.manager import KVCacheManager
from kvmem.testing import FuzzFailure, Launch
from kvmem.testing._transfer_oracles import TransferOracles

PROMPT = np.arange(8, dtype=np.int64)


def _manager() -> KVCacheManager:
    return KVCacheManager(16, page_size=4, max_seqs=4, tracker="checking", watermark=0.0)


def _transfer(src: KVCacheManager, dst: KVCacheManager) -> tuple[TransferOracles, Launch]:
    """Request "a" prefilled on ``src``; ``dst`` admits it and a transfer reads its pages."""
    src.admit("a", PROMPT, None)
    src.reserve(("a",), 8)
    src.commit("a", PROMPT)
    oracles = TransferOracles(src, dst)
    dst.admit("a", PROMPT, None)
    step = dst.reserve(("a",), 8)
    op = Launch(("a",), [0], [8], step.kv_indptr, step.kv_indices, step.slot_mapping,
                kind="transfer", source_pages=src.pages_of("a"))
    oracles.posted(op)
    return oracles, op


def _decode(dst: KVCacheManager) -> Launch:
    dst.commit("a", PROMPT)
    step = dst.reserve(("a",), 1)
    return Launch(("a",), [8], [1], step.kv_indptr, step.kv_indices, step.slot_mapping)


def test_transfer_lifetime_fires_on_a_step_that_reads_bytes_of_an_ended_source_lifetime() -> None:
    """The source frees the pages while the read is pending (a lease that did not hold, or
    none); the read lands; the next decode step reads those bytes: a stale reference served
    as live (vllm#52234), even where the bytes still look right."""
    src, dst = _manager(), _manager()
    oracles, op = _transfer(src, dst)
    src.release("a")
    src.clear_prefix_cache()  # the source pages are free now: their lifetime ended
    oracles.after_move()
    oracles.landed(op, ok=True)
    with pytest.raises(FuzzFailure) as e:
        oracles.check_launch(_decode(dst))
    assert e.value.oracle == "transfer_lifetime"
    assert "before the read completed" in e.value.detail


def test_transfer_lifetime_is_silent_when_the_source_outlives_the_read() -> None:
    src, dst = _manager(), _manager()
    oracles, op = _transfer(src, dst)
    oracles.landed(op, ok=True)
    src.release("a")  # after the read completed: fine
    oracles.after_move()
    oracles.check_launch(_decode(dst))
    assert oracles.counts == {"transfers": 1, "tainted": 0, "launch_checks": 1}


def test_transfer_lifetime_forgets_slots_a_step_rewrote() -> None:
    """A fallback that recomputes the prompt into the same pages clears what the stale read
    left there: later steps read the recomputed K/V."""
    src, dst = _manager(), _manager()
    oracles, op = _transfer(src, dst)
    src.release("a")
    src.clear_prefix_cache()
    oracles.after_move()
    oracles.landed(op, ok=True)
    assert oracles.counts["tainted"] == 1
    recompute = Launch(("a",), [0], [8], op.kv_indptr, op.kv_indices, op.slot_mapping)
    oracles.check_launch(recompute)  # reads no old position, rewrites them all
    oracles.check_launch(_decode(dst))


def test_a_failed_read_taints_nothing() -> None:
    """A read that failed moved no byte: the receiver must not use the slots, but nothing it
    could read came from the ended lifetime."""
    src, dst = _manager(), _manager()
    oracles, op = _transfer(src, dst)
    src.release("a")
    src.clear_prefix_cache()
    oracles.after_move()
    oracles.landed(op, ok=False)
    assert oracles.counts["tainted"] == 0


def test_leases_fires_when_an_idle_source_still_holds_a_lease() -> None:
    """A lease no confirm and no expiry ended (a lost completion nobody times out) strands
    the source's pages; once it ends, the idle check is silent."""
    src, dst = _manager(), _manager()
    src.admit("a", PROMPT, None)
    src.reserve(("a",), 8)
    src.commit("a", PROMPT)
    oracles = TransferOracles(src, dst)
    lease = src.lease("a")
    src.release("a")
    oracles.after_move()
    oracles.full_check(idle=False)  # a read may still be on its way: nothing stranded yet
    with pytest.raises(FuzzFailure) as e:
        oracles.full_check(idle=True)
    assert e.value.oracle == "leases" and str(lease.lease_id) in e.value.detail
    assert src.end_lease(lease)
    oracles.after_move()
    oracles.full_check(idle=True)
