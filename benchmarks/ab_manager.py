"""Lockstep A/B of KVCacheManager: the working tree's against another commit's, in one process.

The three measures of ``bench_manager.py``, on its traces and runners: ``decode_step``
(``reserve`` + ``verify`` + ``commit_batch`` for batch 256, prefix reuse, CheckingTracker),
``admit`` (shared-prompt ``can_admit`` + ``admit``) and ``admit_prefill`` (the same plus the
prompt's ``reserve`` + ``commit``). The package ``kvmem`` of ``--base`` (default ``HEAD``) is
extracted with ``git archive`` into a temporary folder as ``kvmem_base`` (its imports of
``kvmem`` rewritten) and imported beside the working tree's ``kvmem``. Both managers run in
lockstep: step i of one, then step i of the other, the first alternating, so a change in the
shared machine's speed hits both alike. After each step the two step metadata (the decode
step's, or the admitted prompt's prefill) must be identical (``slot_mapping``, ``kv_indptr``,
``kv_indices``, ``seq_lens``), else the run stops: a refactor must not change behaviour.

Per measure (``decode_step`` also split into its ``reserve``, ``verify`` and ``commit``):
``base_us_median``, ``new_us_median``, ``ratio_of_medians`` (new over base: above 1,
the working tree is slower) and ``paired_ratio_median`` (the median over steps of new over base
for the same step). HEAD against a clean working tree shows the harness's noise.

    python benchmarks/ab_manager.py [--base REV] [--steps 2000] [--requests 1000] [--json]
"""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from bench_manager import KvmemDecode, KvmemShared, decode_trace, lockstep, shared_prompt_trace

import kvmem
from kvmem.cli.args import Parser, number

BASE = "kvmem_base"
FIELDS = ("slot_mapping", "kv_indptr", "kv_indices", "seq_lens")
REPO = Path(kvmem.__file__).resolve().parent.parent


def git(*args: str) -> bytes:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True)
    if done.returncode:
        raise SystemExit(f"ab_manager: git {' '.join(args)}: {done.stderr.decode().strip()}")
    return done.stdout


def commit(rev: str) -> str:
    return git("rev-parse", "--short", "--verify", f"{rev}^{{commit}}").decode().strip()


def import_base(rev: str, folder: Path) -> Any:
    """``kvmem`` of commit ``rev``, extracted into ``folder`` and imported as ``kvmem_base``."""
    with tarfile.open(fileobj=io.BytesIO(git("archive", commit(rev), "kvmem"))) as tar:
        tar.extractall(folder, filter="data")
    package = (folder / "kvmem").rename(folder / BASE)
    for path in package.rglob("*.py"):
        text = re.sub(r"\b(from|import) kvmem\b", rf"\1 {BASE}", path.read_text())
        path.write_text(re.sub(r"([\"'])kvmem\.", rf"\1{BASE}.", text))  # lazy imports by name
    before = set(sys.modules)
    sys.path.insert(0, str(folder))
    base = importlib.import_module(BASE)
    base.KVCacheManager  # noqa: B018  (imports its manager module, lazily exported)
    stray = sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "kvmem")
    if stray:
        raise SystemExit(f"ab_manager: the base package imported the working tree's {stray}")
    return base


def same_metadata(runners: list[Any], what: str) -> Callable[[int], None]:
    """A lockstep ``after`` that stops the run where the two runners' last steps differ."""
    base, new = runners

    def check(i: int) -> None:
        for name in FIELDS:
            a, b = getattr(base.last_step, name), getattr(new.last_step, name)
            if np.array_equal(a, b):
                continue
            if a.shape != b.shape:
                where = f"sizes {a.size} and {b.size}"
            else:
                j = int(np.flatnonzero(a != b)[0])
                where = f"first at index {j}: {a[j]} and {b[j]}"
            raise SystemExit(
                f"ab_manager: {what} {i}: the base's and the new manager's {name} differ "
                f"({where}): the working tree changed the manager's behaviour")
    return check


def measure(base: list[float], new: list[float]) -> dict[str, float]:
    a, b = np.asarray(base), np.asarray(new)
    return {"base_us_median": round(float(np.median(a)), 2),
            "new_us_median": round(float(np.median(b)), 2),
            "ratio_of_medians": round(float(np.median(b) / np.median(a)), 3),
            "paired_ratio_median": round(float(np.median(b / a)), 3)}


def main() -> None:
    parser = Parser(prog="ab_manager.py", description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--base", default="HEAD", help="git revision to compare against")
    parser.add_argument("--steps", type=number(int, 1), default=2000, help="decode steps")
    parser.add_argument("--requests", type=number(int, 1), default=1000,
                        help="shared-prompt admissions")
    parser.add_argument("--batch", type=number(int, 1), default=256)
    parser.add_argument("--seed", type=number(int, 0), default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    prompts, steps = decode_trace(args.seed, args.steps, args.batch)
    _system, shared = shared_prompt_trace(args.seed, args.requests)
    with tempfile.TemporaryDirectory(prefix="ab_manager_") as folder:
        managers = (import_base(args.base, Path(folder)).KVCacheManager, kvmem.KVCacheManager)
        dec = [KvmemDecode(prompts, steps, "checking", args.batch * 200, manager)
               for manager in managers]
        lockstep(dec, len(steps), same_metadata(dec, "decode step"))
        adm = [KvmemShared(shared, "checking", manager) for manager in managers]
        lockstep(adm, len(shared), same_metadata(adm, "admission"))

    result: dict[str, Any] = {
        "base_rev": f"{commit(args.base)} ({args.base})",
        "new": {"head": commit("HEAD"),
                "dirty": bool(git("status", "--porcelain", "--", "kvmem"))},  # kvmem/ edited
        "steps": args.steps,
        "requests": args.requests,
        "batch": args.batch,
        "lockstep": True,
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "decode_step": measure(dec[0].times["decode"], dec[1].times["decode"]),
        **{f"decode_{part}": measure(dec[0].times[part], dec[1].times[part])
           for part in ("reserve", "verify", "commit")},  # the decode step's three calls
        "admit": measure(adm[0].admit_us[1:], adm[1].admit_us[1:]),
        "admit_prefill": measure(adm[0].prefill_us[1:], adm[1].prefill_us[1:]),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    new = result["new"]
    print(f"base {result['base_rev']} vs new {new['head']}"
          f"{' + uncommitted kvmem/ changes' if new['dirty'] else ''}: {args.steps} decode "
          f"steps, {args.requests} admissions, lockstep, metadata identical; "
          f"load {result['load_average_1min']}")
    print(f"{'measure':<16}{'base µs':>10}{'new µs':>10}{'new/base':>10}{'paired':>8}")
    for key in ("decode_step", "decode_reserve", "decode_verify", "decode_commit", "admit",
                "admit_prefill"):
        m = result[key]
        print(f"{key:<16}{m['base_us_median']:>10.1f}{m['new_us_median']:>10.1f}"
              f"{m['ratio_of_medians']:>10.3f}{m['paired_ratio_median']:>8.3f}")


if __name__ == "__main__":
    main()
