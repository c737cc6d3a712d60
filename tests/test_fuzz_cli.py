"""``kvmem fuzz``: the catalog's JSON, fault-free campaigns, saved reproducers, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.cli import main
from kvmem.testing.faults import CATALOG


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_faults_json_has_one_entry_per_fault_and_a_fault_free_campaign(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "fuzz", "--faults", "retire_at_launch", "wrong_chunk_slice",
                           "leak_on_abort", "--minutes", "1", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert [e["fault"] for e in data] == ["retire_at_launch", "wrong_chunk_slice",
                                          "leak_on_abort", "none"]
    for e in data:
        assert {"fault", "detected", "detected_by", "schedule_len", "seconds"} <= set(e)
    for e in data[:-1]:
        assert e["detected"] is True and e["detected_by"] and e["schedule_len"] >= 1
    none = data[-1]
    assert none["detected"] is False and none["detected_by"] is None
    assert none["moves"] >= 10_000
    assert "retire_at_launch" in err  # the progress line


def test_a_fault_free_campaign_reports_clean(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "fuzz", "--moves", "1500", "--engine", "toy")
    assert status == 0
    assert "none" in out and "clean" in out


def test_save_writes_a_reproducer_that_pytest_runs_and_fails(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, _, _ = run(capsys, "fuzz", "--faults", "retire_at_launch", "--minutes", "0.2",
                       "--save", str(tmp_path))
    assert status == 0
    files = sorted(tmp_path.glob("test_fuzz_*.py"))
    assert len(files) == 1 and "retire_at_launch" in files[0].name
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(files[0])], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the bug is still there
    assert "FuzzFailure" in proc.stdout and "fences" in proc.stdout


def test_list_shows_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "fuzz", "--list")
    assert status == 0
    assert all(name in out for name in CATALOG)


def test_list_json_is_the_catalog_as_one_json_list(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "fuzz", "--list", "--json")
    assert status == 0
    entries = json.loads(out)
    assert [e["fault"] for e in entries] == list(CATALOG)
    for e in entries:
        f = CATALOG[e["fault"]]
        assert e["bugs"] == list(f.bugs) and e["timeline"] == f.timeline
        assert e["engines"] == (list(f.engines) if f.engines else None)
        assert e["description"] == f.describe()


@pytest.mark.parametrize("argv, message", [
    (["fuzz", "--engine", "nope"], "no fuzz engine"),
    (["fuzz", "--faults", "nope"], "unknown faults"),
    (["fuzz", "--config", "huge"], "no fuzz config preset"),
    # what would run forever, run nothing, or be ignored is refused before any work
    (["fuzz", "--minutes", "0"], "--minutes 0.0: expected a number of minutes > 0"),
    (["fuzz", "--minutes", "-1"], "--minutes -1.0: expected"),
    (["fuzz", "--minutes", "nan"], "--minutes nan: expected"),
    (["fuzz", "--minutes", "inf"], "--minutes inf: expected"),
    (["fuzz", "--moves", "0"], "--moves 0: expected at least 1 move"),
    (["fuzz", "--moves", "-5"], "--moves -5: expected at least 1 move"),
    (["fuzz", "--moves", "10", "--minutes", "1"], "--moves and --minutes are alternatives"),
    (["fuzz", "--faults", "--moves", "10"], "it takes no --moves"),
    (["fuzz", "--profile", "ci", "--engine", "toy"], "it takes no --engine"),
    (["fuzz", "--profile", "ci", "--seed", "3", "--minutes", "1"], "it takes no --minutes, --seed"),
    (["fuzz", "--moves", "10", "--save", "/proc/kvmem-no-such-dir"], "--save /proc/kvmem-no-such"),
    (["fuzz", "--moves", "10", "--seed", "-1"], "--seed -1: expected a seed >= 0"),
])
def test_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                            message: str) -> None:
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert message in err and err.count("\n") == 1


def test_help_shows_each_usage_form_on_its_own_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "fuzz", "--help")
    assert status == 0
    lines = out.splitlines()
    for form in ("kvmem fuzz [--engine manager] [--minutes 1 | --moves N] [--save DIR] [--json]",
                 "kvmem fuzz --profile ci [--json]"):
        assert form in lines
