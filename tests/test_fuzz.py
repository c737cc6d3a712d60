"""The fuzzer: its engines, the faults it finds, error handling, vLLM engines and the manager
state machines."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import kvmem.testing as t
from kvmem import KVCacheManager
from kvmem.cli import main
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError
from kvmem.integrations.vllm import vllm_import_error
from kvmem.testing import (
    ENGINES,
    FuzzConfig,
    FuzzFailure,
    Launch,
    ManagerEngine,
    ManagerMachine,
    Run,
    campaign,
    faults,
    hunt,
    kv_value_array,
    replay,
    save_reproducer,
    schedules,
    shrink,
)
from kvmem.testing.faults import CATALOG

# kvmem's own engines; the vLLM ones (registered where vLLM is installed) are
# tested below, where vLLM is importable.
CORE_ENGINES = [e for e in sorted(ENGINES) if e not in ("vllm", "vllm-async")]


_FIND_A_RACE = """
from hypothesis import HealthCheck, find, settings
from kvmem.testing import FuzzFailure, replay, schedules

def fails(schedule):
    try:
        replay(schedule, "manager", "free_before_step_completes", 0, "small")
    except FuzzFailure:
        return True
    return False

found = find(schedules(max_size=20), fails,
             settings=settings(max_examples=400, derandomize=True, database=None,
                               suppress_health_check=list(HealthCheck)))
print([move[0] for move in found])
"""


# The shortest interleavings the fuzzer found for each fault (manager engine, seed 0, "small"),
# and the oracle that caught it: these pin every detector, and each one shows the bug.
MINIMAL = {
    "free_before_step_completes": ("happens_before", [("receive", 0, 0), ("abort", 0, 0)]),
    "transfer_without_fence": ("happens_before", [("receive", 0, 0), ("abort", 0, 0)]),
    "cow_source_reused_before_copy": ("happens_before", [
        ("receive", 0, 0), ("transfer", 0, 0), ("finish", 0, 0), ("fork", 0, 0),
        ("launch", 0, 0), ("abort", 0, 0), ("preempt", 0, 0)]),
    "retire_at_launch": ("fences", [("submit", 0, 0), ("launch", 0, 0)]),
    "fence_completion_lost": ("fences", [("receive", 0, 0)]),
    "prefix_hit_before_write_lands": ("landed_hit", [
        ("submit", 272545, 0), ("launch", 0, 0), ("preempt", 0, 0), ("resume", 0, 0)]),
    "commit_on_abort": ("landed_hit", [
        ("submit", 162304, 330863), ("launch", 0, 0), ("abort", 0, 0),
        ("submit", 641427, 14806)]),
    "fence_drops_references": ("refcounts", [("receive", 0, 0), ("abort", 0, 0)]),
    "refcount_overincrement": ("refcounts", [("receive", 0, 0), ("inject", 0, 0)]),
    "cow_copy_skipped": ("reads", [
        ("submit", 0, 204043), ("launch", 0, 0), ("complete", 0, 0), ("launch", 0, 0),
        ("complete", 0, 0), ("finish", 0, 0), ("finish", 0, 0), ("fork", 0, 0),
        ("launch", 0, 0)]),
    "tenant_salt_dropped": ("reads", [
        ("submit", 517553, 0), ("submit", 335601, 917595), ("launch", 0, 0),
        ("complete", 0, 0), ("finish", 0, 0), ("preempt", 967922, 0), ("resume", 0, 0),
        ("launch", 0, 0)]),
    "tenantless_cache_key": ("verify", [
        ("submit", 517553, 0), ("submit", 335601, 917595), ("launch", 0, 0),
        ("complete", 0, 0), ("finish", 0, 0), ("preempt", 967922, 0), ("abort", 0, 0),
        ("resume", 0, 0), ("launch", 0, 0)]),
    "leak_on_abort": ("requests", [("submit", 0, 0), ("abort", 0, 0)]),
    "release_retried_on_hook_error": ("kvmem_error", [
        ("receive", 0, 0), ("hook", 883383, 0), ("abort", 0, 0)]),
    "stale_page_table_entry": ("verify", [
        ("submit", 0, 215729), ("fork", 0, 0), ("inject", 0, 91144), ("launch", 417284, 0)]),
    "stale_block_table": ("verify", [
        ("submit", 517553, 868287), ("fork", 0, 0), ("launch", 0, 0), ("abort", 0, 0),
        ("submit", 601742, 0), ("launch", 0, 0)]),
    "wrong_chunk_slice": ("verify", [("submit", 517553, 0), ("launch", 0, 0)]),
}


class _Allocator:
    """The allocator as the oracles see it, with one fact bent."""

    def __init__(self, real: Any, **override: Any) -> None:
        self._real = real
        self._override = override

    def __getattr__(self, name: str) -> Any:
        return self._override.get(name, getattr(self._real, name))


def _busy_run() -> Run:
    run = Run("manager", "small", None, 0)
    for move in [("submit", 0, 0), ("submit", 5, 9), ("launch", 1, 0), ("complete", 0, 0),
                 ("retire", 0, 0), ("finish", 0, 0)]:
        run.step(*move)
    return run


class _SlotAstray(ManagerEngine):
    """Writes every decode token one slot further than the kernel's CSR says."""

    def launch(self, choice: int) -> Any:
        op = super().launch(choice)
        if op is not None and op.slot_mapping.size and np.all(op.num_new == 1):
            op.slot_mapping = op.slot_mapping + 1
        return op


class _Crashes(ManagerEngine):
    def launch(self, choice: int) -> Any:
        raise IndexError("the engine's own bug")


class _TransferAstray(ManagerEngine):
    """A transfer's first token lands in the first slot of the request admitted first."""

    def receive(self, spec: Any) -> Any:
        first = self.manager.running[0] if self.manager.running else None
        op = super().receive(spec)
        if op is not None and first is not None:
            op.slot_mapping = op.slot_mapping.copy()
            op.slot_mapping[0] = int(self.manager.pages_of(first)[0]) * self.manager.page_size
        return op


def _applicable() -> list[tuple[str, str]]:
    return [(engine, name) for engine in CORE_ENGINES for name, f in CATALOG.items()
            if f.engines is None or engine in f.engines]


class _StreamOrdered(ManagerEngine):
    stream_ordered = True


ROOT = Path(__file__).resolve().parents[1]


VLLM = ("vllm", "vllm-async")


requires_vllm = pytest.mark.skipif(vllm_import_error() is not None,
                                   reason="vLLM 0.33 is not importable (see setup_vllm_cpu.sh)")


def _import_testing(block_vllm: bool) -> str:
    """``kvmem.testing``'s engines in a fresh interpreter, and whether vLLM got imported
    (``block_vllm``: as if vLLM were not installed)."""
    code = ("import sys; " + ("sys.modules['vllm'] = None; " if block_vllm else "")
            + "import kvmem.testing as t; "
            + "print(sorted(t.ENGINES), sys.modules.get('vllm') is not None)")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, cwd=ROOT, check=True,
                          timeout=300).stdout.strip()


# The shortest interleavings on which kvmem's own, stricter contract fires on vLLM (found by the
# fuzzer, shrunk): each is correct on vLLM, and the engine runs them clean.
STREAM_ORDER = {
    # An aborted request's blocks are freed while the step that computes it still runs: the next
    # step that reuses them runs after it on the stream.
    "happens_before": ("vllm-async", [("submit", 0, 0), ("launch", 0, 0), ("abort", 0, 0)]),
    # The next step hits the blocks the step in flight writes (cached when scheduled): it reads
    # them after that step completed.
    "landed_hit": ("vllm-async", [("submit", 985426, 0), ("launch", 0, 0),
                                  ("submit", 1034724, 0), ("launch", 0, 0)]),
    # Two requests with one prompt prefix, admitted in one step: the second hits the blocks the
    # first writes in that very step (vLLM's backends write a layer's K/V before attention).
    "reads": ("vllm", [("submit", 909230, 85325), ("submit", 651036, 3922), ("launch", 0, 0)]),
}


def _strict(engine: str) -> Any:
    """The engine held to kvmem's contract: step fences, commits that mean landed, and the
    reads of a step's old positions before its writes."""
    base: Any = ENGINES[engine]

    class Strict(base):  # type: ignore[misc, valid-type]
        stream_ordered = False

        def launch(self, choice: int) -> Launch | None:
            op = super().launch(choice)
            if op is not None:
                op.writes_first = False
            return op

    return Strict


# The oracle that finds each fault that applies to the vLLM engines (docs/fuzzing.md says why
# the others do not apply).
FOUND_BY = {
    "tenant_salt_dropped": "reads",
    "tenantless_cache_key": "verify",
    "weak_prefix_key": "reads",
    "leak_on_abort": "requests",
    "second_release_path": "refcounts",
    "refcount_overincrement": "refcounts",
    "stale_page_table_entry": "verify",
}


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class HashedCacheMachine(ManagerMachine):
    pass


class NoReuseMachine(ManagerMachine):
    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_pages=self.num_pages, page_size=self.page_size,
                              max_seqs=self.max_seqs, max_pages_per_seq=self.max_pages_per_seq,
                              prefix_cache=None, tracker="paranoid", watermark=0.0)


class RoomyMachine(ManagerMachine):
    """Enough pages that nothing is evicted: every prefix hit must be exact."""

    num_pages = 96


def test_kv_values_depend_on_the_namespace_and_the_whole_prefix() -> None:
    a = kv_value_array(1, [1, 2, 3, 4])
    assert np.array_equal(a, kv_value_array(1, [1, 2, 3, 4, 5])[:4])  # a prefix's values
    assert np.array_equal(a[:2], kv_value_array(1, [1, 2, 0, 0])[:2])
    assert not np.any(a[2:] == kv_value_array(1, [1, 2, 0, 4])[2:])  # all later ones differ
    assert not np.any(a == kv_value_array(2, [1, 2, 3, 4]))  # another namespace
    assert np.count_nonzero(a) == a.size  # 0 means "never written"


@pytest.mark.long
@pytest.mark.parametrize("engine", CORE_ENGINES)
def test_a_correct_run_trips_no_oracle_and_every_check_ran(engine: str) -> None:
    totals: dict[str, int] = {}
    for seed in range(3):
        r = campaign(engine, "small", None, seed, max_moves=1200)
        assert r.failure is None, r.failure
        assert r.moves >= 1200 and r.moves == len(r.schedule)  # (and the final drain's)
        # The same schedule replays to the very same state.
        again = replay(r.schedule, engine, None, seed, "small")
        mgr = again.engine.manager
        counts = again.timeline.counts
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
        assert mgr.allocator.tags.max() > 0
    for check in ("page_checks", "tag_changes", "reads", "hits", "full_checks", "launches"):
        assert totals[check] > 0, (check, totals)
    if engine == "manager":  # the asynchronous engine retires fences
        assert totals["retires"] > 0


def test_replay_is_exact() -> None:
    r = campaign("manager", "small", None, 7, max_moves=600)
    a = replay(r.schedule, "manager", None, 7, "small")
    b = replay(r.schedule, "manager", None, 7, "small")
    for run in (a, b):
        assert run.num_moves == len(r.schedule)
    assert np.array_equal(a.engine.manager.allocator.tags, b.engine.manager.allocator.tags)
    assert np.array_equal(a.timeline.kv, b.timeline.kv)
    assert a.engine.manager.running == b.engine.manager.running


@pytest.mark.long
@settings(max_examples=25, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(schedules(max_size=60))
def test_any_schedule_hypothesis_draws_is_a_correct_run(schedule: list[Any]) -> None:
    replay(schedule, "manager", None, 0, "small")


@pytest.mark.long
def test_hypothesis_finds_a_race_and_shrinks_it_to_its_two_moves() -> None:
    # In a fresh interpreter: hypothesis draws integers from the constants in the source of
    # every module loaded from outside site-packages, so what the rest of a test session has
    # imported (vLLM's unzipped wheel, for one) changes the search, derandomized or not.
    out = subprocess.run([sys.executable, "-c", _FIND_A_RACE], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    # A request arrives with its prompt K/V on a transfer; it is aborted while the transfer
    # still writes its pages, and with the fence bypassed they are freed under it.
    assert out.split("\n")[-2] == "['receive', 'abort']"


@pytest.mark.parametrize("fault", sorted(MINIMAL))
def test_each_fault_fires_its_oracle_on_its_shortest_interleaving(fault: str) -> None:
    oracle, schedule = MINIMAL[fault]
    with pytest.raises(FuzzFailure) as e:
        replay(schedule, "manager", fault, 0, "small")
    assert e.value.oracle == oracle, e.value
    # ... and the same interleaving is harmless without the fault.
    replay(schedule, "manager", None, 0, "small")


def test_the_tags_oracle_fires_on_a_repeated_tag() -> None:
    run = _busy_run()
    mgr = run.engine.manager
    tags = mgr.allocator.tags.copy()
    free = int(np.flatnonzero(tags == 0)[0])
    tags[free] = int(tags.max())  # a lifetime tag handed out twice
    mgr.allocator = _Allocator(mgr.allocator, tags=tags)
    with pytest.raises(FuzzFailure) as e:
        run.timeline.after_host_move()
    assert e.value.oracle == "tags"


def test_the_conservation_oracle_fires_when_a_page_is_neither_free_nor_held() -> None:
    run = _busy_run()
    mgr = run.engine.manager
    rc = mgr.allocator.refcounts.copy()
    rc[int(np.flatnonzero(rc == 1)[0])] = 0  # lost: not free, no holder
    mgr.allocator = _Allocator(mgr.allocator, refcounts=rc)
    with pytest.raises(FuzzFailure) as e:
        run.timeline.after_host_move()
    assert e.value.oracle == "conservation"


def test_the_check_oracle_runs_kvmem_check() -> None:
    run = _busy_run()
    mgr = run.engine.manager
    rid = mgr.running[0]
    faults.overwrite_page_entry(mgr, rid, 0, int(mgr.pages_of(mgr.running[1])[0]))
    with pytest.raises(FuzzFailure) as e:
        run.timeline.full_check()
    assert e.value.oracle == "check" and "differ from their holders" in str(e.value)


def test_the_reads_oracle_fires_on_a_slot_mapping_that_disagrees_with_the_csr() -> None:
    cfg = FuzzConfig(tracker=None)  # verify would catch it first
    with pytest.raises(FuzzFailure) as e:
        replay([("submit", 3, 0), ("launch", 1, 0), ("complete", 0, 0), ("launch", 1, 0),
                ("complete", 0, 0)], _SlotAstray, None, 0, cfg)
    assert e.value.oracle == "reads" and "after the step's writes" in str(e.value)
    replay([("submit", 3, 0), ("launch", 1, 0), ("complete", 0, 0), ("launch", 1, 0),
            ("complete", 0, 0)], ManagerEngine, None, 0, cfg)


def test_the_reads_oracle_rereads_a_page_written_right_after_the_last_read() -> None:
    # r279's prefill completes (its read), then the very next landing, a transfer, writes into
    # r279's first page: r279's next step must read that page again, not trust its last read.
    cfg = FuzzConfig(tracker=None)  # (nothing verifies a transfer's slots)
    schedule = [("submit", 9, 0), ("launch", 0, 0), ("complete", 0, 0), ("retire", 0, 0),
                ("finish", 0, 0), ("receive", 5, 1), ("transfer", 0, 0), ("launch", 0, 0),
                ("complete", 0, 0)]
    with pytest.raises(FuzzFailure) as e:
        replay(schedule, _TransferAstray, None, 0, cfg)
    assert e.value.oracle == "reads" and e.value.move == len(schedule) - 1
    assert "before the step's writes" in str(e.value)
    replay(schedule, ManagerEngine, None, 0, cfg)


def test_the_tags_oracle_fires_on_a_negative_tag() -> None:
    run = _busy_run()
    mgr = run.engine.manager
    tags = mgr.allocator.tags.copy()
    tags[int(np.flatnonzero(tags == 0)[0])] = -5  # (the distinctness check sorts the tags)
    mgr.allocator = _Allocator(mgr.allocator, tags=tags)
    with pytest.raises(FuzzFailure) as e:
        run.timeline.after_host_move()
    assert e.value.oracle == "tags"


def test_the_engine_oracle_reports_an_adapter_that_raises() -> None:
    with pytest.raises(FuzzFailure) as e:
        replay([("submit", 0, 0), ("launch", 0, 0)], _Crashes, None, 0, "small")
    assert e.value.oracle == "engine" and "IndexError" in str(e.value)


@pytest.mark.parametrize("engine, fault", _applicable())
def test_random_campaigns_find_every_fault(engine: str, fault: str) -> None:
    r = hunt(fault, engine, "small", seed=0, max_campaigns=25, moves_per_campaign=1500,
             shrink_replays=0)
    assert r.detected, f"{fault} on {engine}: not found in {r.moves} moves"
    assert r.detected_by is not None


def test_the_catalog_covers_the_issue() -> None:
    assert len(CATALOG) >= 12
    timeline = {n for n, f in CATALOG.items() if f.timeline}
    assert {"free_before_step_completes", "fence_completion_lost",
            "cow_source_reused_before_copy", "prefix_hit_before_write_lands"} <= timeline
    rows = len(re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "BUGS.md").read_text(), re.M))
    for f in CATALOG.values():
        assert f.bugs and all(1 <= b <= rows for b in f.bugs), f.name
        assert f.describe(), f.name


def test_fault_functions_use_public_surfaces_only() -> None:
    source = inspect.getsource(faults)
    assert "mgr._" not in source and "manager._" not in source and "._pending" not in source


def test_shrink_finds_a_short_interleaving_that_still_fires() -> None:
    r = campaign("manager", "small", "free_before_step_completes", 0, max_moves=1500)
    assert r.failure is not None
    small, failure = shrink(r.schedule, r.failure.oracle, max_replays=200, engine="manager",
                            fault="free_before_step_completes", seed=0, config="small")
    assert len(small) <= 4 < len(r.schedule)
    assert failure.oracle == r.failure.oracle
    with pytest.raises(FuzzFailure):
        replay(small, "manager", "free_before_step_completes", 0, "small")


def test_shrink_refuses_a_schedule_that_does_not_fail() -> None:
    with pytest.raises(KVMemError, match="nothing to shrink"):
        shrink([("submit", 0, 0)], "reads", engine="manager", seed=0, config="small")


def test_a_saved_reproducer_is_a_pytest_file_that_fails_while_the_bug_is_there(
        tmp_path: Path) -> None:
    oracle, schedule = MINIMAL["retire_at_launch"]
    with pytest.raises(FuzzFailure) as e:
        replay(schedule, "manager", "retire_at_launch", 0, "small")
    path = save_reproducer(tmp_path, schedule, e.value, "manager", "retire_at_launch", 0,
                           FuzzConfig())
    spec = importlib.util.spec_from_file_location("reproducer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tests = [getattr(module, n) for n in dir(module) if n.startswith("test_")]
    assert len(tests) == 1
    with pytest.raises(FuzzFailure) as again:
        tests[0]()
    assert again.value.oracle == oracle


def test_bad_names_and_configs_are_refused() -> None:
    with pytest.raises(KVMemError, match="no fuzz engine"):
        Run("nope")
    with pytest.raises(KVMemError, match="no fault"):
        Run("manager", fault="nope")
    with pytest.raises(KVMemError, match="applies to engines"):
        Run("toy", fault="retire_at_launch")
    with pytest.raises(KVMemError, match="exceeds max_len"):
        FuzzConfig(prompt_len=(1, 60), max_new=(1, 10), max_len=64)
    with pytest.raises(KVMemError, match="no move"):
        Run().step("teleport", 0, 0)
    assert FuzzConfig.from_dict(FuzzConfig.preset("bench").to_dict()).to_dict() == \
        FuzzConfig.preset("bench").to_dict()


def test_landed_hit_is_kvmems_contract_and_can_defer_to_stream_order() -> None:
    oracle, schedule = MINIMAL["prefix_hit_before_write_lands"]
    lenient = FuzzConfig(strict_commits=False)
    # Committed before landing, read by a later step: one stream's order makes it harmless.
    replay(schedule, "manager", "prefix_hit_before_write_lands", 0, lenient)
    assert oracle == "landed_hit"


def test_a_stream_ordered_engine_may_free_a_running_steps_pages_but_not_a_transfers() -> None:
    # The fence bypassed: an abort frees the pages of a step in flight. On one stream the next
    # writer runs after the step (vLLM relies on it); a transfer lands in any order.
    step = [("submit", 0, 0), ("launch", 0, 0), ("abort", 0, 0)]
    transfer = [("receive", 0, 0), ("abort", 0, 0)]
    for schedule in (step, transfer):
        with pytest.raises(FuzzFailure) as e:
            replay(schedule, "manager", "free_before_step_completes", 0, "small")
        assert e.value.oracle == "happens_before"
    replay(step, _StreamOrdered, "free_before_step_completes", 0, "small")
    with pytest.raises(FuzzFailure) as e:
        replay(transfer, _StreamOrdered, "free_before_step_completes", 0, "small")
    assert e.value.oracle == "happens_before"


# -- the value oracles: a wrong answer fires even when no page check does -------------------------

# Moves that admit, preempt, resume, fork and receive often, so each value is asked for.
_VALUES = FuzzConfig(weights={"resume": 8, "preempt": 6, "fork": 6, "receive": 4, "hook": 0})
# The same without the tracker: verify checks nothing, so only the value oracles can see it.
_UNCHECKED = FuzzConfig(tracker=None, weights=_VALUES.weights)


def _value_failure(monkeypatch: pytest.MonkeyPatch, method: str, wrong: Any,
                   config: FuzzConfig = _VALUES) -> FuzzFailure:
    """The first failure of fault-free campaigns on the manager engine once
    ``KVCacheManager.<method>`` returns ``wrong(manager, its true answer, *args)``."""
    from kvmem.manager import KVCacheManager

    true = getattr(KVCacheManager, method)

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrong(self, true(self, *args, **kwargs), *args)

    monkeypatch.setattr(KVCacheManager, method, patched)
    for seed in range(6):
        r = campaign("manager", config, None, seed, max_moves=1500)
        if r.failure is not None:
            return r.failure
    raise AssertionError(f"a wrong {method}() went unnoticed")


def test_the_value_oracles_are_silent_on_correct_runs_and_each_checked() -> None:
    """A fault-free campaign answers every value check, and each check ran."""
    ran = dict.fromkeys(("admission", "step_metadata", "request_state", "stats"), 0)
    for seed in range(2):
        r = campaign("manager", _VALUES, None, seed, max_moves=1500)
        assert r.failure is None, r.failure
        run = replay(r.schedule, "manager", None, seed, _VALUES)
        for k, v in run.engine.values.ran.items():
            ran[k] += v
    assert all(v > 0 for v in ran.values()), ran


def test_admission_fires_when_resume_leaves_one_token_fewer_to_compute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards resume's AdmitResult: one cached token too many (one token fewer to recompute)
    would skip a position's K/V."""
    f = _value_failure(monkeypatch, "resume",
                       lambda m, r, *a: r._replace(num_cached_tokens=r.num_cached_tokens + 1))
    assert f.oracle == "admission" and "resume(" in str(f), f


def test_admission_fires_when_admit_reports_a_page_more_of_hits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards admit's AdmitResult: a hit page more than the request got would skip a page's
    prefill."""
    f = _value_failure(monkeypatch, "admit", lambda m, r, *a: r._replace(
        num_hit_pages=r.num_hit_pages + 1, num_cached_tokens=r.num_cached_tokens + m.page_size))
    assert f.oracle == "admission" and "admit(" in str(f), f


def test_admission_fires_when_match_prefix_disagrees_with_admit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards match_prefix (what an engine that schedules itself asks first): a lookup that
    stops one page short of what admit then reuses."""
    f = _value_failure(monkeypatch, "match_prefix",
                       lambda m, r, *a: r._replace(pages=r.pages[:-1]) if r.pages.size else r)
    assert f.oracle == "admission" and "match_prefix" in str(f), f


def test_step_metadata_fires_on_a_slot_mapping_one_slot_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards reserve's slot mapping: the last new token written one slot past its place
    (verify catches it too, where a tracker checks; here none does)."""
    import dataclasses

    def wrong(m: Any, step: Any, *a: Any) -> Any:
        if not step.slot_mapping.size:
            return step
        slots = step.slot_mapping.copy()
        slots[-1] += 1
        return dataclasses.replace(step, slot_mapping=slots)

    f = _value_failure(monkeypatch, "reserve", wrong, _UNCHECKED)
    assert f.oracle == "step_metadata" and "slot mapping" in str(f), f


def test_step_metadata_fires_on_a_seq_len_one_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards reserve's seq_lens: a kernel told one token fewer would not attend to the
    newest."""
    import dataclasses

    f = _value_failure(monkeypatch, "reserve", lambda m, step, *a: dataclasses.replace(
        step, seq_lens=step.seq_lens - 1), _UNCHECKED)
    assert f.oracle == "step_metadata", f


def test_request_state_fires_when_num_tokens_reports_the_committed_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards num_tokens: the committed count in its place (equal after admit, wrong once a
    step is reserved and not yet committed)."""
    from kvmem.manager import KVCacheManager

    f = _value_failure(monkeypatch, "num_tokens",
                       lambda m, n, rid: KVCacheManager.num_committed(m, rid))
    assert f.oracle == "request_state", f


def test_request_state_fires_when_tokens_of_drops_the_last_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards tokens_of: the committed tokens, all of them."""
    f = _value_failure(monkeypatch, "tokens_of", lambda m, t, *a: t[:-1] if t.size else t)
    assert f.oracle in ("admission", "request_state"), f


def test_stats_fires_when_preempted_counts_every_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards stats(): num_preempted counted over every known request, running ones too."""
    import dataclasses

    f = _value_failure(monkeypatch, "stats", lambda m, st: dataclasses.replace(
        st, num_preempted=st.num_preempted + st.num_running))
    assert f.oracle == "stats" and "num_preempted" in str(f), f


def test_stats_fires_when_hit_tokens_are_counted_in_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards stats()'s prefix counters: hit tokens counted as pages."""
    import dataclasses

    f = _value_failure(monkeypatch, "stats", lambda m, st: dataclasses.replace(
        st, prefix_hit_tokens=st.prefix_hit_tokens // m.page_size))
    assert f.oracle == "stats" and "prefix_hit_tokens" in str(f), f


def test_every_oracle_is_in_the_docs_oracle_table() -> None:
    """docs/fuzzing.md's oracle table names every oracle a FuzzFailure can report."""
    from kvmem.testing import ORACLES

    doc = (Path(__file__).resolve().parents[1] / "docs" / "fuzzing.md").read_text()
    table = doc[doc.index("## Oracles") : doc.index("## The fault catalog")]
    named = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)? \|", table, flags=re.M))
    assert set(ORACLES) <= {n for pair in named for n in pair if n}, named


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"num_pages": 0}, ArgumentError, "num_pages=0: expected an integer in 1..2147483647"),
    ({"page_size": 2.5}, ArgumentTypeError, "page_size=2.5"),
    ({"check_every": 0}, ArgumentError, "check_every=0"),
    ({"max_in_flight": True}, ArgumentTypeError, "max_in_flight=True"),
    ({"prompt_len": 5}, ArgumentTypeError, "prompt_len=5: expected a (lo, hi) pair"),
    ({"max_new": (1, "x")}, ArgumentTypeError, "max_new='x'"),
    ({"tracker": "paranoid"}, ArgumentError, "expected 'checking' or None"),
    ({"weights": {"teleport": 1}}, ArgumentError, "unknown moves ['teleport']"),
    ({"weights": {"submit": -1}}, ArgumentError, "expected finite numbers >= 0"),
    ({"weights": {"submit": float("nan")}}, ArgumentError, "expected finite numbers >= 0"),
])
def test_a_bad_fuzz_config_is_refused_naming_the_field(kwargs: dict[str, Any], error: type,
                                                       message: str) -> None:
    with pytest.raises(error, match=None) as info:
        t.FuzzConfig(**kwargs)
    assert message in str(info.value)


def test_a_config_dict_with_an_unknown_field_is_refused() -> None:
    with pytest.raises(ArgumentError, match=r"no FuzzConfig field \['pages'\]"):
        t.campaign("manager", {"pages": 8}, None, 0, 10)


@pytest.mark.parametrize(("schedule", "error", "message"), [
    (5, ArgumentTypeError, "schedule=int: expected a list of (move, int, int)"),
    ("submit", ArgumentTypeError, "schedule=str"),
    ([("teleport", 1, 2)], ArgumentError, "schedule[0]=('teleport', 1, 2)"),
    ([("submit", 1, 2), ("submit", 1)], ArgumentError, "schedule[1]=('submit', 1)"),
    ([("submit", -1, 2)], ArgumentError, "schedule[0]=('submit', -1, 2)"),
    ([("submit", 1.5, 2)], ArgumentError, "schedule[0]=('submit', 1.5, 2)"),
])
def test_a_malformed_schedule_is_refused_before_any_move(schedule: Any, error: type,
                                                         message: str) -> None:
    with pytest.raises(error) as info:
        t.replay(schedule)
    assert message in str(info.value)


def test_a_schedule_of_numpy_ints_replays_as_one_of_ints() -> None:
    found = t.campaign("manager", None, None, seed=3, max_moves=200)
    as_numpy = [(name, np.int64(a), np.int64(b)) for name, a, b in found.schedule]
    run = t.replay(as_numpy, seed=3)
    assert run.num_moves == t.replay(found.schedule, seed=3).num_moves > 0


@pytest.mark.parametrize(("call", "message"), [
    (lambda: t.campaign("manager", None, None, 0, -1), "max_moves=-1"),
    (lambda: t.campaign("manager", None, None, "x", 10), "seed='x'"),
    (lambda: t.hunt("retire_at_launch", max_campaigns=0), "max_campaigns=0"),
    (lambda: t.hunt("retire_at_launch", moves_per_campaign=0), "moves_per_campaign=0"),
    (lambda: t.hunt("retire_at_launch", shrink_replays=-1), "shrink_replays=-1"),
    (lambda: t.schedules(-1), "max_size=-1"),
    (lambda: t.schedules(10, engine="nope"), "no fuzz engine 'nope'"),
    (lambda: t.subset_step(None, np.ones(2, bool)), "expected the StepMetadata"),
    (lambda: t.Run("manager", None, None, "x"), "seed='x'"),
    (lambda: t.Timeline(None, 4, 16), "expected the engine's KVCacheManager"),
    (lambda: t.Timeline(KVCacheManager(16, page_size=4, max_seqs=4), 0, 16), "max_requests=0"),
    (lambda: t.Timeline(KVCacheManager(16, page_size=4, max_seqs=4), 4, -1), "max_len=-1"),
    (lambda: t.kv_value_array("x", [1, 2]), "ns_key='x'"),
    (lambda: t.campaign("manager", None, None, -1, 10), "seed=-1"),
    (lambda: t.hunt("retire_at_launch", seed=-1), "seed=-1"),
    (lambda: t.replay([], seed=-1), "seed=-1"),
    (lambda: t.ToyEngine(KVCacheManager(16, page_size=4, max_seqs=4), seed=-1), "seed=-1"),
    (lambda: t.FuzzConfig(num_pages=10**30), "num_pages=1000000000000000000000000000000"),
])
def test_bad_counts_seeds_and_engines_are_refused(call: Any, message: str) -> None:
    with pytest.raises(KVMemError) as info:
        call()
    assert message in str(info.value)
    assert isinstance(info.value, (ValueError, TypeError))  # argument mistakes


def test_subset_step_refuses_a_mask_of_the_wrong_shape() -> None:
    mgr = KVCacheManager(16, page_size=4, max_seqs=4)
    for rid in ("a", "b"):
        mgr.admit(rid, np.arange(5))
    step = mgr.reserve(["a", "b"], 1)
    with pytest.raises(ArgumentError, match=r"expected a bool mask of shape \(2,\)"):
        t.subset_step(step, np.ones(3, bool))
    indptr, _, slots, nn = t.subset_step(step, np.array([False, True]))
    assert indptr.tolist() == [0, int(step.kv_indptr[2] - step.kv_indptr[1])]
    assert slots.tolist() == step.slot_mapping[1:].tolist() and nn.tolist() == [1]


def test_a_reproducer_folder_that_cannot_be_created_is_a_kvmem_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    found = t.hunt("retire_at_launch", max_campaigns=5, shrink_replays=0)
    assert found.detected
    with pytest.raises(KVMemError, match="cannot create the reproducer folder"):
        t.save_reproducer(blocker / "sub", found.schedule, t.FuzzFailure("fences", "x"),
                          "manager", "retire_at_launch", found.seed, t.FuzzConfig())


def test_the_toy_engine_refuses_what_is_not_its_own_and_changes_nothing() -> None:
    with pytest.raises(ArgumentTypeError, match="manager=None"):
        t.ToyEngine(None)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="vocab=0"):
        t.ToyEngine(KVCacheManager(16, page_size=4, max_seqs=4), vocab=0)
    eng = t.ToyEngine(KVCacheManager(16, page_size=4, max_seqs=4))
    eng.admit("a", [1, 2, 3])
    step = eng.step(["a"], 3)
    with pytest.raises(ArgumentError, match="request 'zz' is not in this engine"):
        eng.commit(["a", "zz"])
    assert eng.mgr.num_committed("a") == 0  # "a" was not committed either
    with pytest.raises(ArgumentTypeError, match="request_ids='a'"):
        eng.commit("a")  # type: ignore[arg-type]
    for call in (lambda: eng.read("zz"), lambda: eng.resume("zz"),
                 lambda: eng.check_kv(["zz"])):
        with pytest.raises(ArgumentError, match="not in this engine"):
            call()
    for call in (lambda: eng.check_step(None), lambda: eng.apply_copies(None)):
        with pytest.raises(ArgumentTypeError, match="expected the StepMetadata"):
            call()  # type: ignore[arg-type]
    eng.check_step(step)
    eng.commit(["a"])
    assert eng.mgr.num_committed("a") == 3
    eng.check_kv()


def test_one_shot_faults_refuse_a_position_the_request_does_not_map() -> None:
    mgr = KVCacheManager(16, page_size=4, max_seqs=4)
    mgr.admit("a", np.arange(1, 6))
    mgr.reserve(["a"], 5)  # two pages
    for call in (lambda: t.faults.free_behind_back(mgr, "a", 2),
                 lambda: t.faults.reallocate_behind_back(mgr, "a", 99),
                 lambda: t.faults.overwrite_page_entry(mgr, "a", 2, 0),
                 lambda: t.faults.overwrite_page_entry(mgr, "a", 0, 16)):
        with pytest.raises(ArgumentError):
            call()
    mgr.check()  # nothing was done
    assert t.faults.overwrite_page_entry(mgr, "a", 1, int(mgr.pages_of("a")[0])) >= 0


def test_numpy_int_seeds_run_as_the_same_ints() -> None:
    a = t.campaign("manager", None, None, np.int64(3), 200)
    b = t.campaign("manager", None, None, 3, 200)
    assert a.schedule == b.schedule and a.moves == b.moves > 0
    assert t.hunt("retire_at_launch", seed=np.int64(2), shrink_replays=0).detected


def test_kvmem_testing_imports_without_vllm_and_never_imports_it() -> None:
    shipped = "'disagg', 'manager', 'manager-spec', 'offload', 'offload-disk', 'toy'"
    assert _import_testing(block_vllm=True) == f"[{shipped}] False"
    if vllm_import_error() is None:  # registered where vLLM is installed, still not imported
        assert _import_testing(block_vllm=False) == f"[{shipped}, 'vllm', 'vllm-async'] False"


def test_without_vllm_the_cli_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for name in VLLM:
        monkeypatch.delitem(ENGINES, name, raising=False)
    for argv in (["fuzz", "--engine", "vllm-async"], ["fuzz", "--profile", "ci-vllm"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "needs vLLM" in err and "setup_vllm_cpu.sh" in err and err.count("\n") == 1


@requires_vllm
@pytest.mark.parametrize("engine", VLLM)
def test_a_correct_run_trips_no_oracle_and_exercises_the_scheduler(engine: str) -> None:
    totals: dict[str, int] = {}
    for seed in range(2):
        r = campaign(engine, "small", None, seed, max_moves=1500)
        assert r.failure is None, r.failure
        run = replay(r.schedule, engine, None, seed, "small")  # exact: the same state again
        for counts in (run.engine.counts, run.timeline.counts):  # type: ignore[attr-defined]
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
    # vLLM preempted, hit the prefix cache (also on pages the same step writes), and every
    # step's reads were checked.
    for check in ("steps", "preemptions", "prefix_hits", "same_step_hits", "reads",
                  "tag_changes", "full_checks"):
        assert totals[check] > 0, (check, totals)
    assert totals["launches"] == totals["steps"] == totals["reads"]


@requires_vllm
def test_the_cli_runs_both_engines_clean(capsys: pytest.CaptureFixture[str]) -> None:
    for engine in VLLM:
        assert main(["fuzz", "--engine", engine, "--moves", "1000"]) == 0
        out = capsys.readouterr().out
        assert engine in out and "clean" in out


@requires_vllm
@pytest.mark.parametrize("oracle", sorted(STREAM_ORDER))
def test_what_vllm_relies_on_is_correct_and_kvmems_contract_would_flag_it(oracle: str) -> None:
    engine, schedule = STREAM_ORDER[oracle]
    replay(schedule, engine, None, 0, "small")
    with pytest.raises(FuzzFailure) as e:
        replay(schedule, _strict(engine), None, 0, "small")
    assert e.value.oracle == oracle, e.value


def test_the_faults_that_apply_to_vllm_are_the_documented_ones() -> None:
    for engine in VLLM:
        applies = {n for n, f in CATALOG.items() if f.engines is None or engine in f.engines}
        assert applies == set(FOUND_BY), engine
    doc = (ROOT / "docs" / "fuzzing.md").read_text()
    start = doc.index("### On vLLM's scheduler")
    section = doc[start : doc.index("\n## ", start)]
    for name in CATALOG:
        assert f"`{name}`" in section, name


@requires_vllm
@pytest.mark.parametrize("engine, fault", [(e, f) for e in VLLM for f in sorted(FOUND_BY)])
def test_random_campaigns_find_every_fault_that_applies(engine: str, fault: str) -> None:
    r = hunt(fault, engine, "small", seed=0, max_campaigns=25, moves_per_campaign=1500,
             shrink_replays=0)
    assert r.detected, f"{fault} on {engine}: not found in {r.moves} moves"
    assert r.detected_by == FOUND_BY[fault], r.message


TestHashedCache = HashedCacheMachine.TestCase


TestHashedCache.pytestmark = [pytest.mark.long]
TestHashedCache.settings = SETTINGS


TestNoReuse = NoReuseMachine.TestCase


TestNoReuse.pytestmark = [pytest.mark.long]
TestNoReuse.settings = settings(SETTINGS, max_examples=25)


TestRoomy = RoomyMachine.TestCase


TestRoomy.pytestmark = [pytest.mark.long]
TestRoomy.settings = settings(SETTINGS, max_examples=30)
