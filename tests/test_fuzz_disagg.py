"""The disaggregated fuzz engine (kvmem/testing/_fuzz_disagg.py): a decode manager fed by a
prefill manager over the in-process transport; the seven transfer faults of the catalog, each
found by its oracle, shrunk, and replaying; the fault-free runs silent."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest
import torch

from kvmem.cli import main
from kvmem.testing import ENGINES, FuzzConfig, FuzzFailure, campaign, hunt, replay
from kvmem.testing._fuzz_disagg import DisaggEngine, read_values, write_values
from kvmem.testing.faults import CATALOG

# Each transfer fault: the oracle that finds it, and its shortest interleaving (seed 0, "small",
# found by hunt(seed=0, max_campaigns=25, moves_per_campaign=1500, shrink_replays=100)).
FAULTS: dict[str, tuple[str, list[tuple[str, int, int]]]] = {
    # The sender holds nothing under the read: the prefill side frees the pages at once.
    "stale_transfer_reference": ("transfer_lifetime", [
        ("receive", 197981, 0), ("transfer", 0, 0), ("notice", 0, 0), ("notice", 0, 0),
        ("launch", 0, 0)]),
    # Aborted mid-read: the destination pages are freed while the read still writes them.
    "late_write_after_abort": ("happens_before", [("receive", 86374, 0), ("abort", 0, 0)]),
    # The lease expires, then the read lands: committed on its digests, decoded.
    "commit_after_lease_expiry": ("transfer_lifetime", [
        ("receive", 919360, 0), ("expire", 0, 0), ("transfer", 0, 0), ("launch", 0, 0)]),
    # The confirm arrives twice: the sender ends the lease a second time.
    "duplicated_completion": ("kvmem_error", [
        ("receive", 0, 0), ("transfer", 0, 0), ("notice", 0, 865351)]),
    # The confirm is lost and no lease ever expires: the pages are stranded.
    "lost_completion": ("leases", [("receive", 0, 0), ("transfer", 0, 0), ("notice", 0, 353614)]),
    # The prefill process dies mid-read; the failed read is taken as done and decoded.
    "killed_sender_read_as_done": ("reads", [
        ("receive", 700609, 0), ("kill", 0, 0), ("transfer", 0, 0), ("launch", 0, 0)]),
    # The load fails (no answer in time), its pages are cached anyway, the recompute hits them.
    "recompute_with_shared_pages": ("transfer_lifetime", [
        ("receive", 700609, 0), ("expire", 0, 0), ("transfer", 0, 0), ("launch", 0, 0)]),
}


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    logging.disable(logging.WARNING)  # fallbacks are what the faults are for
    yield
    logging.disable(logging.NOTSET)


def test_the_engine_is_registered_and_its_faults_apply_to_it_alone() -> None:
    assert ENGINES["disagg"] is DisaggEngine
    mine = [n for n, f in CATALOG.items() if f.engines == ("disagg",)]
    assert mine == list(FAULTS)
    for name in mine:
        assert CATALOG[name].side == "kvmem" and CATALOG[name].timeline
        assert CATALOG[name].expected == FAULTS[name][0]


def test_slot_values_survive_the_pool_exactly() -> None:
    """The engine stores each slot's int64 K/V value as 16-bit chunks in a float32 pool: what a
    transfer moves reads back bit for bit (negative values and the extremes included)."""
    engine = DisaggEngine(FuzzConfig.preset("small"))
    values = np.array([1, -1, 2**63 - 1, -(2**63), 123456789012345678], dtype=np.int64)
    slots = np.array([0, 5, 9, 30, 31], dtype=np.int64)
    write_values(engine.pool, slots, values)
    assert np.array_equal(read_values(engine.pool, slots), values)
    assert torch.count_nonzero(engine.pool.data[0, :, 1]) == 0  # V holds nothing


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_transfer_fault_fires_its_oracle_on_its_shortest_interleaving(fault: str) -> None:
    """The pinned interleaving fires the fault's oracle, and runs clean without the fault (the
    oracle fires on the fault, not on the interleaving)."""
    oracle, schedule = FAULTS[fault]
    with pytest.raises(FuzzFailure) as e:
        replay(schedule, "disagg", fault, 0, "small")
    assert e.value.oracle == oracle, e.value
    run = replay(schedule, "disagg", None, 0, "small")
    assert run.transfers is not None and run.transfers.counts["transfers"] >= 1


@pytest.mark.parametrize("fault", ["late_write_after_abort", "commit_after_lease_expiry",
                                   "killed_sender_read_as_done"])
def test_a_hunt_finds_and_shrinks_a_transfer_fault(fault: str) -> None:
    r = hunt(fault, "disagg", "small", seed=0, max_campaigns=5, moves_per_campaign=400,
             shrink_replays=100)
    assert r.detected and r.detected_by == FAULTS[fault][0], r
    assert r.schedule_len is not None and r.schedule_len <= 4
    with pytest.raises(FuzzFailure) as e:
        replay(r.schedule, "disagg", fault, r.seed, "small")
    assert e.value.oracle == r.detected_by


def test_fault_free_campaigns_are_silent_and_exercise_every_transfer_path() -> None:
    """Receives, landings, notices delivered, lost and duplicated, expiries and kills: no
    oracle fires, and loads both load and fall back."""
    loaded = recompute = tainted = 0
    for seed in range(4):
        r = campaign("disagg", "small", None, seed, max_moves=1500)
        assert r.failure is None, r.failure
        run = replay(r.schedule, "disagg", None, seed, "small")
        counts = run.engine.receiver.counts  # type: ignore[attr-defined]
        loaded += counts["loaded"]
        recompute += counts["recompute"]
        assert run.transfers is not None
        tainted += run.transfers.counts["tainted"]
        moves = {m[0] for m in r.schedule}
        assert {"receive", "transfer", "notice", "expire", "kill"} <= moves
    assert loaded and recompute and tainted  # stale reads happened, and were never used


def test_the_drain_leaves_both_sides_empty() -> None:
    run = replay([("receive", 5, 1), ("receive", 77, 2), ("notice", 0, 2), ("transfer", 0, 0)],
                 "disagg", None, 0, "small")
    run.final_check()
    engine: Any = run.engine
    assert engine.source_manager.fences.leases == () and engine.notices_in_flight() == 0
    assert engine.manager.fences.leases == () and engine.receiver.loading == ()


def test_kvmem_fuzz_runs_a_transfer_fault_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--faults", "late_write_after_abort", "--engine", "disagg",
                 "--minutes", "0.2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(e["fault"], e["detected"], e["detected_by"]) for e in out] == [
        ("late_write_after_abort", True, "happens_before"), ("none", False, None)]
