"""Promises of docs/capacity_planning.md, docs/errors.md and the planning and simulation
docstrings, checked by an adversary: each test here failed before the fix it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# -- kvmem plan: "a setting that would be ignored is refused rather than dropped" -----------------


@pytest.mark.parametrize("policy", [["--reserve-gib", "2"], ["--mem-fraction", "0.8"]])
def test_runtime_overhead_with_another_reserve_is_refused_not_ignored(
    capsys: pytest.CaptureFixture[str], policy: list[str]
) -> None:
    """--runtime-overhead-gib applies to the SGLang-like policy only; with --reserve-gib or
    --mem-fraction it used to be dropped without a word."""
    status, out, err = run(capsys, "plan", "llama-3.1-8b", *policy, "--runtime-overhead-gib", "4")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "--runtime-overhead-gib" in err and policy[0] in err


def test_runtime_overhead_alone_still_shrinks_the_sglang_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run(capsys, "plan", "llama-3.1-8b", "--json")
    base = json.loads(out)
    status, out, _ = run(capsys, "plan", "llama-3.1-8b", "--runtime-overhead-gib", "4", "--json")
    assert status == 0
    less = json.loads(out)
    assert less["kv_budget_gib_per_gpu"] == pytest.approx(base["kv_budget_gib_per_gpu"] - 4)


# -- kvmem plan --plot: refused before any work ------------------------------------------------


def test_plot_with_a_format_matplotlib_cannot_write_is_refused_before_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table used to be printed first, then the error (status 2 after the work)."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "conc.txt"
    status, out, err = run(capsys, "plan", "llama-3.1-8b", "--plot", str(target))
    assert status == 2 and out == "", out
    assert err.count("\n") == 1 and ".txt" in err and "png" in err
    assert not target.exists()


def test_plot_with_an_empty_file_name_is_refused_not_ignored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--plot ''` used to print the table, plot nothing and exit 0."""
    status, out, err = run(capsys, "plan", "llama-3.1-8b", "--plot", "")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "--plot" in err


def test_plot_without_matplotlib_is_refused_before_the_table(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # not installed\n"
        "from kvmem.cli import main\n"
        f"raise SystemExit(main(['plan', 'llama-3.1-8b', '--plot', {str(tmp_path / 'c.png')!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "pip install" in proc.stderr, proc.stderr
