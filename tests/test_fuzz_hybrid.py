"""The hybrid engine under the fuzzer (kvmem.testing._fuzz_hybrid): a HybridManager with full,
sliding-window and state groups driven by random moves on a value model; its three faults,
each found by its oracle and shrunk; fault-free campaigns silent; ``kvmem fuzz --engine
hybrid``."""

from __future__ import annotations

import json
import logging

import pytest

from kvmem.cli import _fuzz as _fuzz_cli
from kvmem.cli import main
from kvmem.errors import ArgumentError
from kvmem.testing._fuzz_hybrid import (
    HYBRID_FAULTS,
    HybridRun,
    hybrid_campaign,
    hybrid_hunt,
    hybrid_replay,
)
from kvmem.testing._oracles import FuzzFailure

EXPECTED = {"window_page_freed_while_read": "hybrid_verify",
            "state_shared_after_fork": "hybrid_verify",
            "prefix_hit_without_state_restore": "hybrid_reads"}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("kvmem").setLevel(logging.ERROR)  # verify's abort warnings


def test_the_catalog_names_the_three_hybrid_faults_and_their_oracles() -> None:
    assert {n: f.expected for n, f in HYBRID_FAULTS.items()} == EXPECTED
    assert all(f.describe() for f in HYBRID_FAULTS.values())


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_each_fault_is_found_by_its_oracle_and_shrunk(fault: str) -> None:
    r = hybrid_hunt(fault, seed=0, max_campaigns=5, moves_per_campaign=1000,
                    shrink_replays=150)
    assert r.detected and r.detected_by == EXPECTED[fault], r
    assert r.moves <= 200 and r.schedule_len is not None and r.schedule_len <= 15, r
    with pytest.raises(FuzzFailure) as e:  # the shrunk schedule still fails the same way
        hybrid_replay(r.schedule, fault, r.seed)
    assert e.value.oracle == EXPECTED[fault]
    hybrid_replay(r.schedule, None, r.seed)  # and passes without the fault


def test_fault_free_campaigns_are_silent_and_exercise_every_mechanism() -> None:
    """A few thousand moves: submits with prefix hits, chunked prefills (some ending on
    checkpoints), decodes, forks, releases, evictions: no oracle fires. (Seed 1000007 guards
    a fuzzer bug: forks of forks planned tokens past max_tokens_per_seq, and reserve refused
    them at move 1434.)"""
    moves = hits = evicted = 0
    for seed in (0, 1_000_007):
        c = hybrid_campaign(None, seed, 1500)
        assert c.failure is None, c.failure
        assert {name for name, _, _ in c.schedule} == {"submit", "step", "fork", "release"}
        moves += c.moves
        hits += c.run.num_hits
        assert c.run.manager.cache is not None
        evicted += c.run.manager.cache.num_evicted
    assert moves == 3000 and hits > 50 and evicted > 50


def test_the_reads_oracle_fires_on_a_copy_not_made() -> None:
    """hybrid_reads sees content, not bookkeeping: a fork's tail-page copy not made (every
    book of the manager correct, verify silent) is caught when the child reads its tail."""
    run = HybridRun(None, 0)
    m = run.manager
    assert run.step("submit", 5, 5)
    rid = max(run.requests)
    while m.num_committed(rid) < 6 or m.num_committed(rid) % 4 == 0:
        assert run.step("step", 1, 1)
    assert run.step("fork", 0, 0)
    child = max(run.requests)
    tail = int(m.pages_of(child, "full")[-1])
    assert tail != int(m.pages_of(rid, "full")[-1])
    run.kv["full"][tail] = -1  # the copy never landed
    step = m.reserve([child], 1)
    assert m.verify([child], step).ok
    with pytest.raises(FuzzFailure) as e:
        run._run(step)
    assert e.value.oracle == "hybrid_reads" and f"page {tail}" in e.value.detail


def test_bad_arguments_are_refused_before_any_move() -> None:
    with pytest.raises(ArgumentError, match="no hybrid fault 'cow_copy_skipped'"):
        hybrid_hunt("cow_copy_skipped")
    with pytest.raises(ArgumentError, match="no hybrid fault"):
        HybridRun("nope")
    with pytest.raises(ArgumentError, match=r"schedule\[1\]"):
        hybrid_replay([("submit", 1, 2), ("launch", 1, 2)])
    with pytest.raises(ArgumentError, match=r"schedule\[0\]"):
        hybrid_replay([("step", -1, 2)])


def test_cli_runs_the_hybrid_catalog_and_reports_each_oracle(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fuzz_cli, "_CLEAN_MOVES", 2000)  # (10,000 by default: seconds)
    status = main(["fuzz", "--engine", "hybrid", "--faults", "--minutes", "0.5", "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    data = json.loads(out)
    assert [e["fault"] for e in data] == [*EXPECTED, "none"]
    assert [e["detected_by"] for e in data] == [*EXPECTED.values(), None]
    assert all(e["schedule_len"] <= 15 for e in data[:-1])
    assert data[-1]["moves"] == 2000 and all(e["engine"] == "hybrid" for e in data)


def test_cli_fault_free_moves_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--engine", "hybrid", "--moves", "500"]) == 0
    out, _ = capsys.readouterr()
    assert "hybrid" in out and "clean" in out
    assert main(["fuzz", "--engine", "hybrid", "--faults", "cow_copy_skipped"]) == 2
    _, err = capsys.readouterr()
    assert "do not apply to the 'hybrid' engine" in err
    assert main(["fuzz", "--engine", "hybrid", "--moves", "5", "--config", "bench"]) == 2
    _, err = capsys.readouterr()
    assert "takes no --save and no --config" in err


def test_the_ci_profile_finds_the_three_faults_and_runs_clean(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvmem fuzz --profile ci``'s hybrid part: fixed seeds and budgets, every fault found by
    its oracle, then fault-free moves (10,000 there; fewer here)."""
    monkeypatch.setattr(_fuzz_cli, "_CLEAN_MOVES", 1500)
    results, ok = _fuzz_cli._ci_hybrid(_fuzz_cli._Progress())
    assert ok
    assert [(r.fault, r.detected_by) for r in results] == [*EXPECTED.items(), ("none", None)]
    assert results[-1].moves == 1500
