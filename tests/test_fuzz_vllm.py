"""The fuzzer on vLLM's scheduler on kvmem: the ``vllm`` and ``vllm-async`` engines.

Most tests need vLLM 0.33 importable (``bash benchmarks/setup_vllm_cpu.sh DIR`` and
``PYTHONPATH=DIR/site:DIR/deps``) and are skipped otherwise; the real scheduler runs, nothing of
vLLM is mocked. The first two tests hold without vLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmem.cli import main
from kvmem.integrations.vllm import vllm_import_error
from kvmem.testing import ENGINES, FuzzFailure, Launch, campaign, hunt, replay
from kvmem.testing.faults import CATALOG

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


def test_kvmem_testing_imports_without_vllm_and_never_imports_it() -> None:
    assert _import_testing(block_vllm=True) == "['manager', 'toy'] False"
    if vllm_import_error() is None:  # registered where vLLM is installed, still not imported
        assert _import_testing(block_vllm=False) == (
            "['manager', 'toy', 'vllm', 'vllm-async'] False")


def test_without_vllm_the_cli_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for name in VLLM:
        monkeypatch.delitem(ENGINES, name, raising=False)
    for argv in (["fuzz", "--engine", "vllm-async"], ["fuzz", "--profile", "ci-vllm"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "needs vLLM" in err and "setup_vllm_cpu.sh" in err and err.count("\n") == 1


# -- fault-free runs ------------------------------------------------------------------------------


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


# -- what vLLM relies on, and that kvmem's contract would flag it ------------------------------

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


@requires_vllm
@pytest.mark.parametrize("oracle", sorted(STREAM_ORDER))
def test_what_vllm_relies_on_is_correct_and_kvmems_contract_would_flag_it(oracle: str) -> None:
    engine, schedule = STREAM_ORDER[oracle]
    replay(schedule, engine, None, 0, "small")
    with pytest.raises(FuzzFailure) as e:
        replay(schedule, _strict(engine), None, 0, "small")
    assert e.value.oracle == oracle, e.value


# -- the fault catalog ----------------------------------------------------------------------------

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
