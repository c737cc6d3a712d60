"""kvmem.testing's public functions refuse bad arguments with kvmem's errors, naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvmem.testing as t
from kvmem import KVCacheManager
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError


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
