"""Every benchmark script refuses a bad option the way kvmem's CLI does: one line on stderr naming
the option, exit status 2, before any work (they used to print a traceback, or NaN figures from
zero steps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(("script", "argv", "named"), [
    ("ab_manager.py", ["--batch", "0"], "--batch"),
    ("bench_allocator.py", ["--steps", "0"], "--steps"),
    ("bench_engine.py", ["--steps", "0"], "--steps"),
    ("bench_floor.py", ["--batch", "x"], "--batch"),
    ("bench_fp8.py", ["--repeat", "0"], "--repeat"),
    ("bench_fuzz.py", ["--moves", "0"], "--moves"),
    ("bench_fuzz_lockstep.py", ["--slices", "-1"], "--slices"),
    ("bench_manager.py", ["--seed", "-1"], "--seed"),
    ("bench_pool.py", ["--device", "nope"], "--device"),
    ("bench_vllm_scheduler.py", ["--decode-steps", "0"], "--decode-steps"),
    ("bench_vllm_floor.py", ["--requests", "0"], "--requests"),
    ("mutation_campaign.py", ["--fuzz-moves", "0"], "--fuzz-moves"),
])
def test_a_bad_benchmark_option_is_one_line_and_status_2(script: str, argv: list[str],
                                                         named: str) -> None:
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), *argv], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in run.stderr, run.stderr
