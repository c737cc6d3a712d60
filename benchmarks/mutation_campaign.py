"""A mutation campaign over kvmem's allocator and integrity code, with two killers.

    python benchmarks/mutation_campaign.py             # kvmem/allocator and kvmem/integrity
    python benchmarks/mutation_campaign.py --paths kvmem/integrity/_tags.py --max-minutes 8

mutmut (PyPI, 3.x; installed with pip into the running environment when missing) writes every
mutant of the modules under ``--paths`` into a scratch copy of the repository (``--workdir``)
and runs a fast subset of the tests (``--tests``) against each: the first killer. Each mutant
the tests leave alive then meets ``kvmem fuzz`` on the manager engine, run on mutmut's mutated
copy with that mutant switched on (``--fuzz-moves`` fault-free moves per seed, ``--fuzz-seeds``
seeds, ``--fuzz-jobs`` side by side): the second killer. The repository itself is never changed.

Prints one JSON object: ``mutants``, ``killed_by_tests``, ``killed_by_fuzz``, the scores, and
``survivors`` (each with ``name``, ``file``, ``line`` and ``diff``), to review by hand: a
survivor is either equivalent (no behaviour changed) or a gap a test must close.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvmem.cli.args import Parser, number

ROOT = Path(__file__).resolve().parents[1]

# The tests of the allocator's and the integrity checks' subjects: under 40 s together on 2
# cores (mutmut runs, for each mutant, only those that reach its function).
FAST_TESTS = ("tests/test_allocator.py", "tests/test_page_table.py", "tests/test_tracker.py",
              "tests/test_verify.py", "tests/test_verify_faults.py", "tests/test_oracle_set.py",
              "tests/test_fences.py", "tests/test_fork.py", "tests/test_prefix_cache.py",
              "tests/test_reserve_commit.py", "tests/test_release.py",
              "tests/test_admission.py", "tests/test_manager.py")
DEFAULT_PATHS = ("kvmem/allocator", "kvmem/integrity")


def ensure_mutmut() -> None:
    """Install mutmut 3.x with pip into this environment if it is not importable."""
    if importlib.util.find_spec("mutmut") is None:
        print("mutmut is missing: pip install 'mutmut>=3,<4'", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "mutmut>=3,<4"],
                       check=True)


def scratch_copy(workdir: Path) -> None:
    """The repository's tracked files (as they are on disk) in a fresh ``workdir``."""
    if workdir.exists():
        shutil.rmtree(workdir)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            dst = workdir / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def write_config(workdir: Path, paths: list[str], tests: list[str]) -> None:
    """mutmut's settings, in the scratch copy's setup.cfg."""
    only = [p if p.endswith(".py") else p.rstrip("/") + "/*" for p in paths]
    lines = ["[mutmut]", "source_paths = kvmem", "only_mutate ="]
    lines += [f"    {p}" for p in only]
    lines += ["pytest_add_cli_args_test_selection ="] + [f"    {t}" for t in tests]
    lines += ["pytest_add_cli_args =", "    -p", "    no:cacheprovider", "    -q", ""]
    (workdir / "setup.cfg").write_text("\n".join(lines))


# mutmut runs each mutant's tests in a child forked from a server that has imported torch; an
# OpenMP pool inherited across fork() deadlocks, and mutmut reports the hang as a timeout. One
# thread per process keeps a timeout meaning "the tests hung".
ONE_THREAD = {"PYTHONPATH": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_mutmut(workdir: Path, max_children: int, budget_s: float) -> None:
    """The first killer: the tests, against every mutant (cut at ``budget_s``)."""
    env = {**os.environ, **ONE_THREAD}
    try:
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children",
                        str(max_children)], cwd=workdir, env=env, timeout=budget_s,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        print(f"mutmut run cut after {budget_s:.0f} s; unchecked mutants are reported as such",
              file=sys.stderr)


def statuses(workdir: Path) -> dict[str, str]:
    """Each mutant's status (mutmut's words: killed, survived, no tests, timeout, ...)."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                         cwd=workdir, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\w.]+__mutmut_\d+): (.+)$", line)
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


def diff_of(workdir: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=workdir,
                         capture_output=True, text=True).stdout
    return "\n".join(out.splitlines()[1:]).strip()


def module_of(name: str) -> str:
    """The module of a mutant (mutmut names them ``module.x_func__mutmut_N`` or
    ``module.x\u01c1Class\u01c1method__mutmut_N``)."""
    return re.split("\\.x[_\u01c1]", name)[0]


def where(workdir: Path, name: str, diff: str) -> tuple[str, int]:
    """``file, line`` of a mutant's first changed line (mutmut's diff counts lines from its
    function's ``def``)."""
    module = module_of(name)
    file = module.replace(".", "/") + ".py"
    rest = name[len(module) + 2 : name.rindex("__mutmut_")]  # (after "module.x")
    func = [rest[1:]] if rest.startswith("_") else rest.split("\u01c1")
    lines = (workdir / file).read_text().splitlines()
    start = 0
    for part in func if len(func) == 1 else func[1:]:  # (class, then method)
        pattern = re.compile(rf"\s*(?:async\s+)?(?:def|class)\s+{re.escape(part)}\b")
        start = next((i for i in range(start, len(lines)) if pattern.match(lines[i])), start)
    hunk = re.search(r"^@@ -(\d+)", diff, flags=re.M)
    offset = int(hunk.group(1)) if hunk else 1
    if hunk:  # (the hunk starts with context lines)
        for text in diff[hunk.end():].splitlines()[1:]:
            if text.startswith(("-", "+")):
                break
            offset += 1
    return file, start + offset


def fuzz_kills(workdir: Path, name: str, moves: int, seeds: int, timeout_s: float
               ) -> str | None:
    """The second killer: ``kvmem fuzz`` on the manager engine, run on mutmut's mutated copy
    of the package with ``MUTANT_UNDER_TEST`` naming the mutant (mutmut's trampolines then call
    it in place of the original; no source is rewritten, so any number run side by side).
    Returns what killed it (None: survived)."""
    env = {**os.environ, **ONE_THREAD, "MUTANT_UNDER_TEST": name}
    for seed in range(seeds):
        try:
            r = subprocess.run([sys.executable, "-m", "kvmem.cli", "fuzz", "--engine",
                                "manager", "--moves", str(moves), "--seed", str(seed),
                                "--json"], cwd=workdir / "mutants", capture_output=True,
                               text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return "timeout"
        if r.returncode == 1:
            try:
                return str(json.loads(r.stdout)[0]["detected_by"])
            except (ValueError, LookupError, TypeError):
                return "crash"
        if r.returncode != 0:
            return f"crash (exit {r.returncode})"
    return None


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="mutation_campaign.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS),
                   help="modules or packages to mutate (relative to the repository)")
    p.add_argument("--tests", nargs="+",
                   default=[t for t in FAST_TESTS if (ROOT / t).exists()],
                   help="the first killer: test files (fast: under 40 s together)")
    p.add_argument("--fuzz-moves", type=number(int, 1), default=20000,
                   help="fault-free moves per seed of the second killer")
    p.add_argument("--fuzz-seeds", type=number(int, 1), default=2)
    p.add_argument("--max-children", type=number(int, 1), default=2,
                   help="mutmut's parallel workers")
    p.add_argument("--max-minutes", type=number(float, 0, above=True), default=60.0,
                   help="time budget of the test killer (the fuzz killer comes after)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvmem-mutation"),
                   help="the scratch copy (deleted and made anew)")
    p.add_argument("--report-only", action="store_true",
                   help="summarize the mutmut run already in --workdir (and run the fuzz killer)")
    p.add_argument("--fuzz-jobs", type=number(int, 1), default=2,
                   help="fuzz runs side by side")
    p.add_argument("--no-fuzz", action="store_true", help="the test killer only")
    p.add_argument("--resume", action="store_true",
                   help="keep --workdir and check only the mutants it has not checked yet")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    ensure_mutmut()
    if not args.report_only:
        if not args.resume:
            scratch_copy(args.workdir)
            write_config(args.workdir, args.paths, args.tests)
        run_mutmut(args.workdir, args.max_children, args.max_minutes * 60)
    status = statuses(args.workdir)
    # A timeout is a kill (the tests did not pass; a failing hypothesis test shrinks long).
    killed = sorted(n for n, s in status.items() if s in ("killed", "timeout"))
    alive = sorted(n for n, s in status.items() if s in ("survived", "no tests"))
    unchecked = sorted(n for n, s in status.items() if s == "not checked")
    other = {n: s for n, s in status.items()
             if n not in killed and n not in alive and s != "not checked"}
    by_fuzz: dict[str, str] = {}
    survivors: list[dict[str, Any]] = []
    with ThreadPoolExecutor(args.fuzz_jobs) as jobs:
        oracles = {} if args.no_fuzz else dict(zip(alive, jobs.map(
            lambda n: fuzz_kills(args.workdir, n, args.fuzz_moves, args.fuzz_seeds, 300),
            alive)))
    for name in alive:
        diff = diff_of(args.workdir, name)
        if oracles.get(name) is not None:
            by_fuzz[name] = str(oracles[name])
            continue
        file, line = where(args.workdir, name, diff)
        survivors.append({"name": name, "tests_status": status[name], "file": file,
                          "line": line, "diff": diff})
    total = len(status) - len(unchecked)
    summary = {
        "paths": args.paths, "tests": args.tests,
        "fuzz": f"kvmem fuzz --engine manager --moves {args.fuzz_moves} x {args.fuzz_seeds} "
                "seeds",
        "mutants": len(status), "checked": total, "unchecked_when_cut": len(unchecked),
        "killed_by_tests": len(killed),
        "timeouts": sum(status[n] == "timeout" for n in killed),
        "not_killed_by_tests": len(alive), "killed_by_fuzz": len(by_fuzz),
        "fuzz_kills": by_fuzz, "other": other,
        "test_score": round(len(killed) / total, 4) if total else None,
        "combined_score": round((len(killed) + len(by_fuzz)) / total, 4) if total else None,
        "survivors": survivors, "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
