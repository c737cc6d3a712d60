"""docs/BUGS.md, row by row: the rows no other test pins, each on real components with the
check its "Caught by" column names firing on the bug and silent on the correct run; and the
doc's "Where the tests catch each one" section, which must name an existing test for every
row."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvmem import IntegrityError
from kvmem.cuda import PagePool, PoolSpec
from kvmem.manager import KVCacheManager
from kvmem.testing import ToyEngine, faults

ROOT = Path(__file__).resolve().parents[1]
P = 4


def make(num_pages: int = 16, **kw: Any) -> KVCacheManager:
    kw.setdefault("tracker", "checking")
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(num_pages=num_pages, page_size=P, max_seqs=8, max_pages_per_seq=16,
                          **kw)


def run_prompt(eng: ToyEngine, rid: Any, prompt: Any, ns: Any = None) -> None:
    """Admit, prefill in one chunk, commit."""
    res = eng.admit(rid, prompt, ns)
    eng.step([rid], len(prompt) - res.num_cached_tokens)
    eng.commit([rid])


# -- BUGS.md 1 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fenced", [True, False])
def test_a_request_aborted_while_its_transfer_is_in_flight(fenced: bool) -> None:
    """BUGS.md 1: a request receives its prompt K/V by a transfer (P/D); it is aborted while
    the transfer is in flight. The transfer's fence holds the pages until it is done, so the
    tag re-check at completion finds the lifetimes it started with; with the fence switched
    off (``fault_hooks.hold_dropped_pages``) the pages go to the next request and the
    re-check fires."""
    mgr = make(num_pages=4, prefix_cache=None)
    mgr.fault_hooks.hold_dropped_pages = fenced
    eng = ToyEngine(mgr)
    eng.admit("r", list(range(8)))
    pages = mgr.pages_of("r").copy()
    transfer = mgr.begin_step()  # the transfer into r's pages is launched
    launched_tags = mgr.allocator.tags[pages].copy()
    eng.release("r")  # the client aborts it
    if fenced:
        assert mgr.stats().num_fenced == 2
        eng.admit("x", list(range(100, 108)))  # the two pages still free
    else:
        eng.admit("x", list(range(100, 116)))  # takes r's pages too
    # The transfer completes: the tag re-check.
    same = mgr.allocator.tags[pages] == launched_tags
    assert same.all() == fenced
    assert bool(np.isin(pages, mgr.pages_of("x")).any()) != fenced
    mgr.retire(transfer)
    mgr.check()


@pytest.mark.parametrize("reallocated", [False, True])
def test_the_tag_recheck_at_completion_aborts_only_the_receiver(reallocated: bool) -> None:
    """BUGS.md 1, 9: a page a transfer (or an offload copy) writes is freed and reallocated
    before it lands; verify at completion re-checks the tags and aborts that request only."""
    mgr = make()
    eng = ToyEngine(mgr)
    run_prompt(eng, "r", list(range(9)))
    run_prompt(eng, "o", [7] * 9)
    done = mgr.begin_step()
    if reallocated:
        faults.reallocate_behind_back(mgr, "r", 2)
    report = mgr.verify(["r", "o"])
    mgr.retire(done)
    assert list(report.aborted) == (["r"] if reallocated else [])
    if reallocated:
        assert "reallocated" in report.aborted["r"]
    assert mgr.verify(["o"]).ok


# -- BUGS.md 2 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("retire_frees", [True, False])
def test_a_deferred_free_that_never_completes_breaks_conservation(retire_frees: bool) -> None:
    """BUGS.md 2: the deferred-free path gets its completion but never frees
    (``fault_hooks.retire_frees`` off): the pages are held by no row, cache or fence, and the
    conservation check (free + used + cached + fenced == total) names them."""
    mgr = make(num_pages=8, prefix_cache=None)
    mgr.fault_hooks.retire_frees = retire_frees
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", [1] * 8)
    pages = mgr.pages_of("a").tolist()
    step = mgr.begin_step()
    eng.release("a")
    mgr.check()  # held by the fence: accounted for
    mgr.retire(step)
    if retire_frees:
        mgr.check()
        assert mgr.allocator.num_free == 8
        return
    with pytest.raises(IntegrityError, match="conservation") as e:
        mgr.check()
    assert f"pages {pages} are held by no row, cache or fence" in str(e.value)


# -- BUGS.md 7 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("between", [None, "evicted", "evicted and reallocated"])
def test_a_lookup_then_acquire_never_acquires_a_page_evicted_in_between(
        between: str | None) -> None:
    """BUGS.md 7: ``can_admit`` looks the prefix up, ``admit`` right after acquires what it
    found. A cached page evicted (and reallocated) in between, behind the manager's back,
    must not be acquired: the acquire validates each hit's tag and liveness in one step and
    matches again."""
    mgr = make(num_pages=8)
    eng = ToyEngine(mgr)
    prompt: Any = np.arange(9)  # one array: the admit right after can_admit recalls its plan
    run_prompt(eng, "a", prompt)
    eng.release("a")
    assert mgr.can_admit(prompt)  # the lookup: pages 0 and 1 of "a" hit
    cache = mgr.cache
    assert cache is not None
    if between is not None:
        evicted, _ = cache.evict(2)
        assert evicted.size == 2
        if between == "evicted and reallocated":
            taken = mgr.allocator.allocate(mgr.allocator.num_free)  # someone else's now
            mgr.allocator.free(taken[~np.isin(taken, evicted)])
    res = eng.admit("b", prompt)  # the acquire
    assert res.num_cached_tokens == (8 if between is None else 0)
    if between == "evicted and reallocated":
        assert not np.isin(mgr.pages_of("b"), evicted).any()
        mgr.allocator.free(evicted)  # the other lifetime ends
    eng.step(["b"], 9 - res.num_cached_tokens)
    eng.commit(["b"])
    assert mgr.verify(["b"]).ok
    eng.check_kv()
    mgr.check()


# -- BUGS.md 15 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("drift", [None, "evictable while held", "free while mapped"])
def test_a_page_in_two_lists_is_reported(drift: str | None) -> None:
    """BUGS.md 15: a cached page gains a holder the cache's accounting does not see, so it is
    counted evictable while in use; or a page a request maps is also on the free list.
    check() (conservation, no page in two lists) reports either. On the correct run a page
    two requests share is never evictable, and check() is silent."""
    mgr = make()
    eng = ToyEngine(mgr)
    run_prompt(eng, "a", list(range(9)))
    run_prompt(eng, "b", list(range(9)))  # shares a's two full pages
    cache = mgr.cache
    assert cache is not None
    eng.release("a")
    assert cache.num_evictable == 0  # b still holds them
    mgr.check()
    if drift is None:
        eng.release("b")
        assert cache.num_evictable == 2
        mgr.check()
    elif drift == "evictable while held":
        eng.release("b")
        page = int(cache.match(np.arange(9), None, 2, 0).pages[0])
        mgr.allocator.share([page])  # a holder behind the accounting's back
        with pytest.raises(IntegrityError, match="evictable pages") as e:
            mgr.check()
        assert "differ from their holders" in str(e.value)
    else:
        page = faults.free_behind_back(mgr, "b", 2)  # b's own tail
        with pytest.raises(IntegrityError, match=rf"pages \[{page}\] are free and held"):
            mgr.check()


# -- BUGS.md 16 -----------------------------------------------------------------------------------


def test_a_copy_on_write_of_an_fp8_page_moves_its_scales() -> None:
    """BUGS.md 16: the copy-on-write of a partly filled FP8 tail (per-token scales) moves data
    and scales together, so the child reads exactly the parent's K/V; a copy of the data alone
    (the shipped bug) reads back different values, which the same comparison catches."""
    pool = PagePool(PoolSpec(num_layers=2, num_pages=16, num_kv_heads=1, head_dim=8,
                             page_size=P, dtype="fp8_e4m3", scales="token_head", device="cpu"))
    mgr = make(pool=pool)
    mgr.admit("p", np.arange(6))
    step = mgr.reserve(["p"], 6)
    mag = torch.tensor([1.0, 30.0, 0.01, 500.0, 7.0, 2000.0]).reshape(6, 1, 1)
    kv = torch.linspace(-1, 1, 6 * 8).reshape(6, 1, 8) * mag
    for layer in range(2):
        pool.write(layer, torch.as_tensor(step.slot_mapping), kv, -kv)
    mgr.commit("p", np.arange(6))
    mgr.fork("p", "c")
    step = mgr.reserve(["p", "c"], 1)  # the manager copies the shared tail through the pool
    tail_p, tail_c = int(mgr.pages_of("p")[1]), int(mgr.pages_of("c")[1])
    assert tail_p != tail_c and mgr.stats().num_cow_copies == 1
    # The bug, beside it: the data bytes of the parent's tail copied to a free page alone.
    spare = int(np.flatnonzero(mgr.allocator.refcounts == 0)[0])
    data = pool.storage_tensors()["data"]
    data[:, spare] = data[:, tail_p]
    for layer in range(2):
        kp, vp = pool.read(layer, [tail_p])
        kc, vc = pool.read(layer, [tail_c])
        ks, _ = pool.read(layer, [spare])
        assert torch.equal(kp[:, :2], kc[:, :2]) and torch.equal(vp[:, :2], vc[:, :2])
        assert not torch.equal(kp[:, :2], ks[:, :2])
    assert mgr.verify(["p", "c"], step).ok


# -- the doc's map -----------------------------------------------------------------------------

SECTION = "## Where the tests catch each one"


def _listed() -> dict[int, list[str]]:
    doc = (ROOT / "docs" / "BUGS.md").read_text()
    assert SECTION in doc
    rows: dict[int, list[str]] = {}
    row = None
    for line in doc[doc.index(SECTION):].splitlines():
        m = re.match(r"- \*\*(\d+)\*\*", line)
        if m:
            row = int(m.group(1))
            rows[row] = []
        elif not line.startswith("  "):  # a bullet runs on over its indented lines
            row = None
        if row is not None:
            rows[row] += re.findall(r"`(tests/[\w/]+\.py::[^`]+)`", line)
    return rows


def test_every_row_of_bugs_md_lists_tests_that_exist() -> None:
    """docs/BUGS.md's "Where the tests catch each one" names at least one test per row
    1..17, and pytest collects every test it names."""
    rows = _listed()
    assert sorted(rows) == list(range(1, 18))
    assert all(rows[n] for n in rows), [n for n in rows if not rows[n]]
    ids = {i for ids in rows.values() for i in ids}
    files = sorted({i.split("::")[0] for i in ids})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *files], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert collected, out.stdout + out.stderr
    assert not _missing(ids, collected), _missing(ids, collected)
    assert _missing({"tests/test_bugs.py::test_no_such_test"}, collected)  # the check can fail


def _missing(ids: set[str], collected: set[str]) -> list[str]:
    """The ids pytest did not collect; one named without its parameters stands for them all."""
    return [i for i in sorted(ids) if i not in collected
            and not any(c.startswith(i + "[") for c in collected)]
