"""The fuzz benchmark at two revisions in lockstep: before/after in one window (one JSON object).

``bench_fuzz.py`` run twice, a minute apart, compares two states of a shared machine as much as
two trees: the development VM's speed swings by 2x within a minute. Here four processes (each
tree, with and without the manager's calls timed, ``bench_fuzz.py``'s two runs) take turns,
``--moves`` moves each, ``--slices`` times, so every figure of both trees comes from the same
minutes. Each runs the yardstick (the manager's lockstep decode, 300 steps in one piece) before
its first and after its last moves; it is the same code in both trees when the manager did not
change, so the eight loops are pooled for ``moves_per_s_at_12k`` (see ``bench_fuzz.py``).

Run: ``taskset -c 1 python benchmarks/bench_fuzz_lockstep.py BASE [--new REV]`` (git revisions;
without ``--new``, the working tree). Keys per tree (``base``, ``new``): ``moves_per_s``
(untimed run), ``manager_us_per_move``, ``fuzzer_us_per_move`` and ``raw_manager_ops_per_s``
(timed run), ``moves_per_s_at_12k`` (pooled yardstick).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from kvmem.cli.args import Parser, number

ROOT = Path(__file__).resolve().parents[1]


def _export(rev: str, into: Path) -> Path:
    """The tree at ``rev``, extracted under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return into


def worker(split: bool) -> None:
    """Answer ``moves N`` and ``done`` on stdin, one line each on stdout."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_fuzz as B  # (this file's sibling; kvmem comes from PYTHONPATH, the tree's)

    from kvmem.testing import FuzzConfig, Run

    run = Run("manager", FuzzConfig.preset("bench"), None, 1)
    mgr = run.engine.manager
    spent = [0.0, 0.0]
    if split:
        for name in B._TIMED:
            setattr(mgr, name, B._timed(getattr(mgr, name), spent))
    moves = B._driver(run, 1)
    while len(mgr.running) < 64:
        moves(200)
    spent[:] = [0.0, 0.0]
    yardstick = B.Yardstick()
    yardstick.loop()
    cpu, done = 0.0, 0
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "moves":
            c0 = time.process_time()
            moves(int(arg[0]))
            cpu += time.process_time() - c0
            done += int(arg[0])
        else:
            yardstick.loop()
            run.final_check()
            out: dict[str, Any] = {"moves": done, "moves_per_s": done / cpu,
                                   **yardstick.result()}
            if split:
                inside, around = B.timer_cost()
                out["manager_us_per_move"] = (spent[0] - spent[1] * inside) / done * 1e6
                out["fuzzer_us_per_move"] = (cpu - spent[0] - spent[1] * around) / done * 1e6
            print(json.dumps(out), flush=True)
            return
        print("ok", flush=True)


def _ask(p: subprocess.Popen[str], line: str) -> str:
    stdin: IO[str] | None = p.stdin
    stdout: IO[str] | None = p.stdout
    assert stdin is not None and stdout is not None
    stdin.write(line + "\n")
    stdin.flush()
    return stdout.readline()


def main() -> None:
    ap = Parser(prog="bench_fuzz_lockstep.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("base", nargs="?", default="HEAD", help="git revision of the 'before' tree")
    ap.add_argument("--new", help="git revision of the 'after' tree (default: the working tree)")
    ap.add_argument("--slices", type=number(int, 1), default=60)
    ap.add_argument("--moves", type=number(int, 1), default=250, help="moves per slice")
    ap.add_argument("--worker", choices=("plain", "split"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker == "split")
        return
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": _export(args.base, Path(tmp) / "base"),
                 "new": ROOT if args.new is None else _export(args.new, Path(tmp) / "new")}
        procs = {}
        for tree, root in trees.items():
            for mode in ("plain", "split"):
                env = dict(os.environ, PYTHONPATH=str(root))
                procs[tree, mode] = p = subprocess.Popen(
                    [sys.executable, __file__, "--worker", mode], cwd=root, env=env,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        load = round(os.getloadavg()[0], 2)
        for i in range(args.slices):
            turn = list(procs.values())
            for p in turn if i % 2 == 0 else reversed(turn):
                _ask(p, f"moves {args.moves}")
        res = {key: json.loads(_ask(p, "done")) for key, p in procs.items()}
    raw = len(res) / sum(1 / r["raw_manager_ops_per_s"] for r in res.values())
    out: dict[str, Any] = {"base_rev": args.base, "new_rev": args.new or "working tree",
                           "moves": args.slices * args.moves, "load_average": load,
                           "raw_manager_ops_per_s_pooled": raw}
    for tree in trees:
        plain, split = res[tree, "plain"], res[tree, "split"]
        per_move = (split["manager_us_per_move"] + split["fuzzer_us_per_move"]) * 1e-6
        out[tree] = {"moves_per_s": plain["moves_per_s"],
                     "manager_us_per_move": split["manager_us_per_move"],
                     "fuzzer_us_per_move": split["fuzzer_us_per_move"],
                     "raw_manager_ops_per_s": split["raw_manager_ops_per_s"],
                     "moves_per_s_at_12k": 12_000 / raw / per_move}
    out["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(_rounded(out), indent=2))


def _rounded(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return round(v, 2) if isinstance(v, float) else v


if __name__ == "__main__":
    main()
