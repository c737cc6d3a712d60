"""The offload fuzz engine (kvmem/testing/_fuzz_offload.py): the reference engine over a small
device pool with a host tier, write-through stores and deferred copies; the six tier faults of
the catalog, each found by its oracle, shrunk, and replaying; the fault-free runs silent."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmem.cli import main
from kvmem.testing import ENGINES, FuzzFailure, campaign, hunt, replay
from kvmem.testing._fuzz_offload import OffloadDiskEngine, OffloadEngine, epoch_key
from kvmem.testing._kv_values import namespace_key
from kvmem.testing.faults import CATALOG

Schedule = list[tuple[str, int, int]]

# Each tier fault: the oracle that finds it, and a short interleaving (seed 0, "small", found by
# hunt(seed=0, max_campaigns=25, moves_per_campaign=1500) and shrunk).
FAULTS: dict[str, tuple[str, Schedule]] = {
    # A tier hit's request is aborted before its load lands: its destination pages are
    # freed while the load still writes them.
    "tier_load_after_reuse": ("happens_before", [
        ('submit', 709048, 165893), ('launch', 0, 0), ('submit', 294527, 141387),
        ('complete', 0, 0), ('submit', 553200, 927932), ('finish', 0, 0), ('abort', 851878, 0),
        ('retire', 0, 0), ('transfer', 0, 0), ('submit', 124679, 0), ('submit', 895419, 967594),
        ('launch', 0, 0), ('abort', 291933, 0), ('submit', 42638, 0), ('complete', 0, 0),
        ('retire', 0, 0), ('submit', 1029611, 0), ('abort', 497029, 0)]),
    # A committed page whose write-through store is pending (no lease) is evicted and
    # reallocated, for a fork, before the store reads it.
    "tier_store_after_free": ("happens_before", [
        ('submit', 335601, 0), ('submit', 578045, 305230), ('launch', 0, 0), ('complete', 0, 0),
        ('finish', 0, 0), ('submit', 231169, 390133), ('submit', 731560, 0), ('submit', 0, 0),
        ('preempt', 560147, 0), ('retire', 0, 0), ('submit', 201651, 0), ('fork', 595749, 0),
        ('fork', 0, 0)]),
    # A stored page's bytes change in host memory; a resumed request loads it unchecked
    # and reads it.
    "tier_digest_skipped": ("reads", [
        ('submit', 0, 0), ('submit', 231169, 390133), ('abort', 0, 0), ('submit', 731560, 0),
        ('submit', 601742, 665013), ('submit', 22687, 204043), ('submit', 272545, 73404),
        ('launch', 678350, 0), ('launch', 0, 0), ('complete', 0, 0), ('finish', 0, 0),
        ('transfer', 0, 0), ('launch', 0, 0), ('retire', 0, 0), ('complete', 0, 0),
        ('preempt', 291933, 0), ('retire', 0, 0), ('complete', 0, 0), ('retire', 0, 0),
        ('finish', 0, 0), ('submit', 901653, 0), ('corrupt', 317513, 0), ('finish', 0, 0),
        ('finish', 0, 0), ('resume', 0, 0), ('transfer', 0, 0), ('launch', 706487, 0)]),
    # One tenant's prefix is stored; another tenant's prompt with the same tokens loads
    # it and reads it.
    "tier_namespace_blind": ("reads", [
        ('submit', 715684, 0), ('launch', 0, 0), ('complete', 0, 0), ('finish', 0, 0),
        ('transfer', 0, 0), ('submit', 407211, 34895), ('transfer', 0, 0), ('launch', 45935, 0)]),
    # A store is pending at a weights reset; it lands after the reset, the preempted
    # request resumes from the tier and reads the old weights' K/V.
    "tier_reset_keeps_pending": ("reads", [
        ('submit', 220805, 0), ('launch', 0, 0), ('complete', 0, 0), ('finish', 0, 0),
        ('clear', 0, 0), ('transfer', 0, 0), ('resume', 0, 0), ('transfer', 0, 0),
        ('launch', 0, 0)]),
    # A load writes all but the last page of its run; the request reads that page.
    "tier_partial_restore": ("reads", [
        ('submit', 335601, 917595), ('submit', 578045, 305230), ('fork', 967922, 869647),
        ('fork', 618451, 0), ('launch', 0, 0), ('submit', 231169, 0), ('submit', 731560, 0),
        ('complete', 0, 0), ('submit', 22687, 0), ('launch', 678350, 0), ('retire', 0, 0),
        ('finish', 0, 0), ('launch', 375972, 0), ('preempt', 177654, 0), ('complete', 0, 0),
        ('transfer', 0, 0), ('launch', 625781, 0), ('retire', 0, 0), ('complete', 0, 0),
        ('retire', 0, 0), ('submit', 553200, 927932), ('launch', 1047968, 0), ('complete', 0, 0),
        ('retire', 0, 0), ('resume', 529530, 0), ('transfer', 0, 0), ('launch', 0, 0)]),
}


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    logging.disable(logging.WARNING)  # digest failures and aborts are what the faults are for
    yield
    logging.disable(logging.NOTSET)


def test_the_engine_is_registered_and_its_faults_apply_to_it_alone() -> None:
    assert ENGINES["offload"] is OffloadEngine and ENGINES["offload-disk"] is OffloadDiskEngine
    mine = [n for n, f in CATALOG.items() if f.engines == ("offload", "offload-disk")]
    assert mine == list(FAULTS)
    for name in mine:
        assert CATALOG[name].side == "kvmem"
        assert CATALOG[name].expected == FAULTS[name][0]


def test_the_docs_table_names_each_tier_fault_and_its_oracle() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "fuzzing.md").read_text()
    section = doc[doc.index("### On the offload engine") : doc.index("## Engines plug in")]
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)`.*?\| `(\w+)` \|", section, flags=re.M)
    assert [(name, oracle) for name, _, oracle in rows] == [
        (name, oracle) for name, (oracle, _) in FAULTS.items()]
    for name, switch, _ in rows:
        assert CATALOG[name].switch == switch  # type: ignore[attr-defined]


def test_the_ci_profile_finds_each_tier_fault_as_the_docs_table_says() -> None:
    """The same hunts as `kvmem fuzz --profile ci` runs on the offload engine (fixed seeds and
    budgets): the oracle, the moves to find and the shrunk length are the table's."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "fuzzing.md").read_text()
    section = doc[doc.index("### On the offload engine") : doc.index("## Engines plug in")]
    rows = re.findall(r"^\| `(\w+)` \|.*\| `(\w+)` \| ([\d,]+) \| (\d+) \|$", section, flags=re.M)
    assert len(rows) == len(FAULTS)
    for name, oracle, moves, shrunk in rows:
        r = hunt(name, "offload", "small", seed=0, max_campaigns=25, moves_per_campaign=1500,
                 shrink_replays=100)
        assert r.detected and r.detected_by == oracle, (name, r)
        assert (r.moves, r.schedule_len) == (int(moves.replace(",", "")), int(shrunk)), name


def test_the_pool_holds_salted_values_that_change_with_the_weights() -> None:
    """The pool's value key of a namespace differs from the device model's at every epoch, and
    from one epoch to the next: K/V of other weights never reads back as the model's."""
    for ns in (None, "tenant-a", ("lora", 7)):
        key = namespace_key(ns)
        salted = {epoch_key(key, e) for e in range(4)}
        assert key not in salted and len(salted) == 4


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_tier_fault_fires_its_oracle_on_its_shortest_interleaving(fault: str) -> None:
    """The pinned interleaving fires the fault's oracle, and runs clean without the fault (the
    oracle fires on the fault, not on the interleaving)."""
    oracle, schedule = FAULTS[fault]
    with pytest.raises(FuzzFailure) as e:
        replay(schedule, "offload", fault, 0, "small")
    assert e.value.oracle == oracle, e.value
    run = replay(schedule, "offload", None, 0, "small")
    assert run.engine.counts["landings"] >= 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("fault", ["tier_store_after_free", "tier_reset_keeps_pending"])
def test_a_hunt_finds_and_shrinks_a_tier_fault_that_replays(fault: str) -> None:
    r = hunt(fault, "offload", "small", seed=0, max_campaigns=25, moves_per_campaign=1500,
             shrink_replays=100)
    assert r.detected and r.detected_by == FAULTS[fault][0], r
    assert r.schedule_len is not None and r.schedule_len <= 20
    with pytest.raises(FuzzFailure) as e:
        replay(r.schedule, "offload", fault, r.seed, "small")
    assert e.value.oracle == r.detected_by


def test_fault_free_campaigns_are_silent_and_exercise_the_tier() -> None:
    """Evictions, stores, tier hits, deferred loads, corruptions and weights resets: no oracle
    fires, corrupted pages are caught by their digests (misses), and loads land."""
    totals: dict[str, int] = {}
    for seed in range(4):
        r = campaign("offload", "small", None, seed, max_moves=1500)
        assert r.failure is None, r.failure
        run = replay(r.schedule, "offload", None, seed, "small")
        engine: Any = run.engine
        st = engine.manager.stats()
        off = st.offload
        for k, v in {**engine.counts, "evictions": st.num_evictions,
                     "loaded_pages": off.loaded_pages, "digest_failures":
                     off.tier.num_digest_failures, "tier_evictions": off.tier.num_evictions,
                     "reads": run.timeline.counts["reads"]}.items():
            totals[k] = totals.get(k, 0) + v
    for key in ("loads", "stores", "landings", "corruptions", "resets", "evictions",
                "loaded_pages", "digest_failures", "tier_evictions", "reads"):
        assert totals[key] > 0, (key, totals)


def test_the_disk_engine_cascades_to_disk_loads_from_it_and_removes_its_directory() -> None:
    """offload-disk: the host tier's evictions go to a disk tier in a temporary directory,
    loads come from both tiers, corrupted files are misses, no oracle fires; the directory is
    gone once the engine is."""
    loaded: dict[str, int] = {}
    disk_failures = 0
    directories = []
    for seed in range(3):
        r = campaign("offload-disk", "small", None, seed, max_moves=1500)
        assert r.failure is None, r.failure
        run = replay(r.schedule, "offload-disk", None, seed, "small")
        engine: Any = run.engine
        directories.append(engine.disk.root)
        off = engine.manager.stats().offload
        for medium, n in off.loaded_by_medium.items():
            loaded[medium] = loaded.get(medium, 0) + n
        disk_failures += off.tiers[1].num_digest_failures
        del run, engine
    assert loaded["CPU"] > 0 and loaded["DISK"] > 0 and disk_failures > 0
    import gc

    gc.collect()
    assert not any(d.exists() for d in directories)


def test_a_reset_cancels_a_pending_load_and_the_request_recomputes() -> None:
    """Guards OffloadFaults.reset_keeps_pending's protection on the load side: a request whose
    only K/V is a pending tier load stays through a weights reset, its load is cancelled (the
    bytes are the old weights'), land_copies reports it with nothing computed, and it
    recomputes its prompt clean."""
    cancelled = 0
    for seed in range(12):
        r = campaign("offload", "small", None, seed, max_moves=1500)
        assert r.failure is None, r.failure
        run = replay(r.schedule, "offload", None, seed, "small")
        cancelled += run.engine.manager.stats().offload.cancelled_loads  # type: ignore[attr-defined]
        if cancelled:
            break
    assert cancelled > 0


def test_a_corrupted_tier_page_is_a_miss_never_wrong_kv() -> None:
    """The digest interleaving without its fault: the corrupted page fails its digest, the
    prefix is recomputed, and every read is the request's own K/V."""
    _, schedule = FAULTS["tier_digest_skipped"]
    run = replay(schedule, "offload", None, 0, "small")
    off = run.engine.manager.stats().offload
    assert off.tier.num_digest_failures >= 1 and off.load_misses >= 1


def test_the_drain_lands_every_copy() -> None:
    _, schedule = FAULTS["tier_reset_keeps_pending"]
    run = replay(schedule, "offload", None, 0, "small")
    offload = run.engine.manager.offload
    assert not offload.loads and not offload.stores
    assert run.engine.manager.fences.leases == ()
    assert not np.count_nonzero(offload.landing)


def test_kvmem_fuzz_runs_a_tier_fault_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--faults", "tier_store_after_free", "--engine", "offload",
                 "--minutes", "0.2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(e["fault"], e["detected"], e["detected_by"]) for e in out] == [
        ("tier_store_after_free", True, "happens_before"), ("none", False, None)]
    assert out[1]["moves"] >= 10_000
