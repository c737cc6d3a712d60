"""A mutation campaign over kvmem's allocator and integrity code, with two killers.

    python benchmarks/mutation_campaign.py             # kvmem/allocator and kvmem/integrity
    python benchmarks/mutation_campaign.py --paths kvmem/integrity/_tags.py --max-minutes 8
    python benchmarks/mutation_campaign.py --resume --sample 0.1   # a tenth of what is left
    python benchmarks/mutation_campaign.py --report-only --triage triage.json

mutmut (PyPI, 3.x; installed with pip into the running environment when missing) writes every
mutant of the modules under ``--paths`` into a scratch copy of the repository (``--workdir``)
and runs a fast subset of the tests (``--tests``) against each: the first killer. Each mutant
the tests leave alive then meets ``kvmem fuzz`` on the manager engine, run on mutmut's mutated
copy with that mutant switched on (``--fuzz-moves`` fault-free moves per seed, ``--fuzz-seeds``
seeds, ``--fuzz-jobs`` side by side): the second killer. The repository itself is never changed.

Every mutant costs the tests that reach its function (a survivor all of them): all 8,000 take
hours on 2 cores, cheapest first. ``--sample F`` checks a seeded fraction of each module's
mutants not yet checked; ``estimate`` then weighs each sampled mutant by its module's pool.
``--triage`` files (``[{"name", "verdict"}]``) mark survivors judged equivalent or dead (out of
the score) or killed by a test written after the run (checked against the mutated copy with
``MUTANT_UNDER_TEST``).

Prints one JSON object: ``mutants``, ``killed_by_tests``, ``killed_by_fuzz``, the scores, and
``survivors`` (each with ``name``, ``file``, ``line`` and ``diff``), to review by hand: a
survivor is either equivalent (no behaviour changed) or a gap a test must close.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
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


def run_mutmut(workdir: Path, max_children: int, budget_s: float,
               names: list[str] | None = None) -> None:
    """The first killer: the tests, against every mutant not yet checked, or against
    ``names`` (cut at ``budget_s``)."""
    env = {**os.environ, **ONE_THREAD}
    try:
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children",
                        str(max_children), *(names or [])], cwd=workdir, env=env,
                       timeout=budget_s, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        print(f"mutmut run cut after {budget_s:.0f} s; unchecked mutants are reported as such",
              file=sys.stderr)


def module_of(name: str) -> str:
    """The module of a mutant (mutmut names them ``module.x_func__mutmut_N`` or
    ``module.x\u01c1Class\u01c1method__mutmut_N``)."""
    return re.split("\\.x[_\u01c1]", name)[0]


def generate(workdir: Path) -> None:
    """mutmut's mutants and per-test stats, without checking any mutant (a name that matches
    none stops mutmut right after it wrote them)."""
    subprocess.run([sys.executable, "-m", "mutmut", "run", "kvmem.__no_such_mutant__"],
                   cwd=workdir, env={**os.environ, **ONE_THREAD}, capture_output=True)


def sample_unchecked(status: dict[str, str], fraction: float, seed: int) -> list[str]:
    """A seeded uniform sample (``fraction``, at least one per module that has any) of each
    module's mutants not yet checked."""
    by_module: dict[str, list[str]] = {}
    for name, s in sorted(status.items()):
        if s == "not checked":
            by_module.setdefault(module_of(name), []).append(name)
    rng = random.Random(seed)
    return [n for names in by_module.values()
            for n in rng.sample(names, max(1, round(fraction * len(names))))]


def weights(workdir: Path, status: dict[str, str]) -> dict[str, float]:
    """How many mutants each stands for: 1, or for a mutant of the latest ``--sample``, its
    module's unchecked pool over the module's sample size."""
    path = workdir / "sample.json"
    if not path.exists():
        return dict.fromkeys(status, 1.0)
    sample = json.loads(path.read_text())
    sampled = Counter(module_of(n) for n in sample["names"])
    names = set(sample["names"])
    return {n: sample["pool"][module_of(n)] / sampled[module_of(n)] if n in names else 1.0
            for n in status}


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


def diffs(workdir: Path, names: list[str]) -> dict[str, tuple[str, int, str]]:
    """``file, line, diff`` of each mutant: its function in mutmut's mutated copy against the
    original's copy there (the ``-``/``+`` lines only), and the first changed line's number in
    the original file."""
    found: dict[str, tuple[str, int, str]] = {}
    by_module: dict[str, list[str]] = {}
    for name in names:
        by_module.setdefault(module_of(name), []).append(name)
    for module, members in by_module.items():
        file = module.replace(".", "/") + ".py"
        text = (workdir / "mutants" / file).read_text()
        lines = text.splitlines()
        funcs = {node.name: lines[node.lineno - 1 : node.end_lineno]
                 for node in ast.walk(ast.parse(text))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        original = (workdir / file).read_text().splitlines()
        for name in members:
            func = name[len(module) + 1 :]
            mutant = funcs.get(func, [])
            orig = funcs.get(re.sub(r"__mutmut_\d+$", "__mutmut_orig", func), [])
            changed = [d for d in difflib.unified_diff(orig[1:], mutant[1:], lineterm="", n=0)
                       if d[:1] in "+-" and not d.startswith(("+++", "---"))]
            first = next((d[1:] for d in changed if d.startswith("-")), "")
            line = next((i + 1 for i, text in enumerate(original) if first and text == first), 0)
            found[name] = (file, line, "\n".join(changed))
    return found


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
    p.add_argument("--sample", type=number(float, 0, above=True, maximum=1), default=1.0,
                   help="check only this seeded fraction of each module's unchecked mutants "
                        "(scores become stratified estimates)")
    p.add_argument("--seed", type=number(int), default=0, help="the sample's seed")
    p.add_argument("--triage", type=Path, nargs="*", default=[],
                   help="JSON lists of {name, verdict}: verdict 'equivalent' or 'dead' (taken "
                        "out of the score), 'killed' (by a test added after the run)")
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
        names = None
        if args.sample < 1:
            if not args.resume:
                generate(args.workdir)
            before = statuses(args.workdir)
            names = sample_unchecked(before, args.sample, args.seed)
            pool = Counter(module_of(n) for n, st in before.items() if st == "not checked")
            (args.workdir / "sample.json").write_text(json.dumps({"pool": pool,
                                                                  "names": names}))
            print(f"checking a sample of {len(names)} unchecked mutants", file=sys.stderr)
        run_mutmut(args.workdir, args.max_children, args.max_minutes * 60, names)
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
    where = diffs(args.workdir, alive)
    for name in alive:
        if oracles.get(name) is not None:
            by_fuzz[name] = str(oracles[name])
            continue
        file, line, diff = where[name]
        survivors.append({"name": name, "tests_status": status[name], "file": file,
                          "line": line, "diff": diff})
    total = len(status) - len(unchecked)
    weight = weights(args.workdir, status)
    verdicts = {t["name"]: t["verdict"] for f in args.triage for t in json.loads(f.read_text())}
    gone = [n for n in status if verdicts.get(n) in ("equivalent", "dead")]
    late = [n for n in alive if verdicts.get(n) == "killed"]

    def counted(names: list[str]) -> float:
        return sum(weight[n] for n in names if n not in unchecked)
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
        "estimate": {  # (sampled mutants stand for their module's unchecked pool)
            "mutants": round(counted(list(status))),
            "test_score": round(counted(killed) / counted(list(status)), 4) if total else None,
            "combined_score": round(counted(killed + list(by_fuzz)) / counted(list(status)), 4)
            if total else None,
        },
        "triage": {  # (--triage: survivors judged equivalent or dead, or killed by new tests)
            "equivalent_or_dead": len(gone), "killed_by_new_tests": len(late),
            "test_score_of_non_equivalent": round(
                counted(killed + late) / (counted(list(status)) - counted(gone)), 4)
            if total and args.triage else None,
        },
        "survivors": survivors, "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
