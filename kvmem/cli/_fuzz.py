"""``kvmem fuzz``: random campaigns, the fault catalog, and the CI profile.

::

    kvmem fuzz [--engine manager] [--minutes 1 | --moves N] [--save DIR] [--json]
    kvmem fuzz --faults [NAME ...] [--engine manager] [--minutes N] [--json] [--save DIR]
    kvmem fuzz --profile ci [--json]
    kvmem fuzz --profile ci-vllm [--json]      # needs vLLM (docs/vllm.md)

Without ``--faults``: fault-free random campaigns for ``--minutes`` (or ``--moves``); every
failure is shrunk and, with ``--save``, written as a pytest file that replays it. With
``--faults``: each catalog fault (all that apply to the engine, or those named) is hunted until
an oracle fires, the failing interleaving is shrunk, and a fault-free campaign of at least
10,000 moves follows (``fault: "none"``). ``--json`` prints one JSON list, one entry per fault
(``fault``, ``detected``, ``detected_by``, ``schedule_len``, ``seconds``, ...). ``--profile ci``
is the derandomized CI run (fixed seeds and move budgets, the shipped engines and the hybrid
one, about a minute on two cores): it exits 1 if a fault goes undetected or a fault-free run
trips a check. ``--engine hybrid`` runs a HybridManager's own campaigns and its three faults
(``kvmem.testing._fuzz_hybrid``; no ``--save``, no ``--config``). ``--profile ci-vllm`` is
the same for vLLM's scheduler on kvmem (``vllm``, ``vllm-async``).
A progress line goes to stderr. Exit status: 0, or 1 when the outcome is not the expected one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from kvmem.errors import ArgumentError, KVMemError

__all__ = ["add_fuzz_parser", "run_fuzz"]

_CLEAN_MOVES = 10_000  # the fault-free campaign's least size (issue #14)


def add_fuzz_parser(sub: Any) -> None:
    """Register ``kvmem fuzz`` on the CLI's subparsers."""
    p = sub.add_parser(
        "fuzz",
        help="property-based fuzzing of allocation races (device timeline, fault catalog)",
        description=textwrap.dedent((__doc__ or "").split("\n\n")[2]),  # the usage forms
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine",
                   help="engine adapter: manager (kvmem's, async), toy (synchronous), disagg "
                   "(a decode side fed over a transport), offload (a host tier below a small "
                   "pool, deferred copies), offload-disk (and a disk tier below it), vllm "
                   "and vllm-async (vLLM's Scheduler / AsyncScheduler on kvmem; need vLLM), "
                   "hybrid (a HybridManager: full, sliding-window and state groups), or one "
                   "registered in "
                   "kvmem.testing.ENGINES (default manager)")
    p.add_argument("--minutes", type=float,
                   help="time budget, > 0 (default 1 without --faults; with --faults, 0.25 a "
                   "fault, at least 1)")
    p.add_argument("--moves", type=int,
                   help="fault-free moves to run instead of --minutes (>= 1; not with --faults)")
    p.add_argument("--faults", nargs="*", metavar="NAME",
                   help="run the fault catalog (all faults that apply, or those named)")
    p.add_argument("--profile", choices=["ci", "ci-vllm"],
                   help="ci: the derandomized CI profile (manager, toy, disagg, offload, "
                   "hybrid); "
                   "ci-vllm: the same for the vLLM engines")
    p.add_argument("--config",
                   help="system shape: small (finds races fast; the default) or bench (4,096 "
                   "pages, 64 running)")
    p.add_argument("--seed", type=int, help="first campaign seed (default 0)")
    p.add_argument("--save", metavar="DIR", help="write each failure as a pytest reproducer")
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.add_argument("--list", action="store_true",
                   help="list the fault catalog and exit (with --json: as a JSON list)")
    p.set_defaults(func=run_fuzz)


class _Progress:
    """One progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last = now
        if self.tty:
            sys.stderr.write("\r\033[K" + text[:150])
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def run_fuzz(args: argparse.Namespace) -> int:
    from kvmem.testing import ENGINES, HYBRID_FAULTS, FuzzConfig
    from kvmem.testing.faults import CATALOG

    # verify's "aborting request" warnings are what faults are for: keep the output readable.
    logging.getLogger("kvmem").setLevel(logging.ERROR)
    if args.list:
        given = [f"--{name}" for name in ("engine", "faults", "minutes", "moves", "config",
                                          "seed", "save", "profile")
                 if getattr(args, name) is not None]
        if given:
            raise ArgumentError(f"--list prints the catalog and runs nothing; it takes no "
                                f"{', '.join(given)} (only --json)")
        if args.json:
            print(json.dumps([{"fault": name, "bugs": list(f.bugs), "side": f.side,
                               "timeline": f.timeline,
                               "engines": list(f.engines) if f.engines else None,
                               "description": f.describe()} for name, f in CATALOG.items()]
                             + [{"fault": name, "bugs": [], "side": "kvmem", "timeline": False,
                                 "engines": ["hybrid"], "description": f.describe()}
                                for name, f in HYBRID_FAULTS.items()], indent=1))
            return 0
        for name, f in CATALOG.items():
            engines = ",".join(f.engines) if f.engines else "any"
            print(f"{name:32s} BUGS {','.join(map(str, f.bugs)):8s} {f.side:8s} "
                  f"{'timeline' if f.timeline else '        '} {engines:12s} {f.describe()}")
        for name, h in HYBRID_FAULTS.items():
            print(f"{name:32s} BUGS {'':8s} {'kvmem':8s} {'':8s} {'hybrid':12s} {h.describe()}")
        return 0
    config_given = args.config
    _check_args(args)
    engine = "vllm" if args.profile == "ci-vllm" else args.engine
    if engine == "hybrid" and args.profile is None:
        progress = _Progress()
        results, ok = _hybrid(args, config_given, progress)
        progress.done()
        print(json.dumps([r.to_json() for r in results], indent=1) if args.json
              else _table(results))
        return 0 if ok else 1
    if engine not in ENGINES:
        if engine in _VLLM_ENGINES:
            from kvmem.integrations.vllm import SETUP_HINT

            raise KVMemError(f"the {engine!r} fuzz engine needs vLLM: {SETUP_HINT}")
        raise ArgumentError(f"no fuzz engine {engine!r}; choose one of {sorted(ENGINES)}")
    config = FuzzConfig.preset(args.config)
    if args.faults is not None and args.profile is None:
        _names(args, args.engine)
    _save_folder(args)  # last: a refused command creates no folder
    progress = _Progress()
    if args.profile is not None:
        results, ok = _ci_profile(progress, _VLLM_ENGINES if args.profile == "ci-vllm"
                                  else _CI_ENGINES)
        if args.profile == "ci":
            hybrid, hybrid_ok = _ci_hybrid(progress)
            results += hybrid
            ok &= hybrid_ok
    elif args.faults is not None:
        results, ok = _catalog(args, config, progress)
    else:
        results, ok = _campaigns(args, config, progress)
    progress.done()
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=1))
    else:
        print(_table(results))
    return 0 if ok else 1


def _check_args(args: argparse.Namespace) -> None:
    """Refuse (ArgumentError, before any work) what would be ignored or run forever; fill in
    the defaults."""
    if args.profile is not None:
        given = [f"--{name}" for name in ("engine", "faults", "minutes", "moves", "config",
                                          "seed", "save") if getattr(args, name) is not None]
        if given:
            raise ArgumentError(f"--profile {args.profile} runs fixed engines, seeds and budgets; "
                                f"it takes no {', '.join(given)} (drop them, or run without "
                                "--profile)")
    if args.minutes is not None and not (math.isfinite(args.minutes) and args.minutes > 0):
        raise ArgumentError(f"--minutes {args.minutes}: expected a number of minutes > 0, e.g. "
                            "--minutes 0.5")
    if args.moves is not None:
        if args.moves < 1:
            raise ArgumentError(f"--moves {args.moves}: expected at least 1 move")
        if args.minutes is not None:
            raise ArgumentError("--moves and --minutes are alternatives (a run's length in "
                                "moves or in time): give one")
        if args.faults is not None:
            raise ArgumentError("--faults hunts each fault for a share of --minutes and then "
                                f"runs {_CLEAN_MOVES:,} fault-free moves; it takes no --moves "
                                "(use --minutes)")
    args.engine = "manager" if args.engine is None else args.engine
    args.config = "small" if args.config is None else args.config
    args.seed = 0 if args.seed is None else args.seed
    if args.seed < 0:
        raise ArgumentError(f"--seed {args.seed}: expected a seed >= 0")


def _save_folder(args: argparse.Namespace) -> None:
    """Create the --save folder (ArgumentError when it cannot be created or written)."""
    if args.save is not None:
        try:
            Path(args.save).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArgumentError(f"--save {args.save}: cannot create the folder ({e.strerror}); "
                                "name a folder you can write") from None
        if not os.access(args.save, os.W_OK):
            raise ArgumentError(f"--save {args.save}: the folder is not writable; name a "
                                "folder you can write")


def _names(args: argparse.Namespace, engine: str) -> list[str]:
    from kvmem.testing.faults import CATALOG

    names = args.faults or [n for n, f in CATALOG.items()
                            if f.engines is None or engine in f.engines]
    unknown = [n for n in names if n not in CATALOG]
    if unknown:
        raise ArgumentError(f"unknown faults {unknown}; `kvmem fuzz --list` shows the catalog")
    elsewhere = [n for n in names if engine not in (CATALOG[n].engines or (engine,))]
    if elsewhere:  # refused before any work, not after the faults named before them
        raise ArgumentError(f"faults {elsewhere} do not apply to the {engine!r} engine (`kvmem "
                            "fuzz --list` shows where each applies); drop them or pick another "
                            "--engine")
    return names


def _catalog(args: argparse.Namespace, config: Any, progress: _Progress) -> tuple[list[Any], bool]:
    from kvmem.testing import hunt

    names = _names(args, args.engine)
    budget = 60.0 * (args.minutes or max(1.0, 0.25 * len(names)))
    per_fault = budget / (len(names) + 1)
    results = []
    for name in names:
        deadline = time.perf_counter() + per_fault
        r = hunt(name, args.engine, config, seed=args.seed, max_campaigns=10**6,
                 moves_per_campaign=2000, deadline=deadline, shrink_replays=400,
                 shrink_deadline_s=min(20.0, 0.5 * per_fault), progress=progress)
        progress(f"{name}: {'found by ' + str(r.detected_by) if r.detected else 'NOT FOUND'}"
                 f" ({r.moves} moves, {r.seconds:.1f}s)", force=True)
        _save(args, r, config)
        results.append(r)
    clean = _clean_run(args.engine, config, args.seed, _CLEAN_MOVES, None, progress)
    _save(args, clean, config)
    results.append(clean)
    return results, all(r.detected for r in results[:-1]) and not clean.detected


def _campaigns(args: argparse.Namespace, config: Any,
               progress: _Progress) -> tuple[list[Any], bool]:
    deadline = None
    if args.moves is None:
        deadline = time.perf_counter() + 60.0 * (args.minutes or 1.0)
    clean = _clean_run(args.engine, config, args.seed, args.moves or 10**12, deadline,
                       progress, save=args)
    return [clean], not clean.detected


def _clean_run(engine: str, config: Any, seed: int, moves: int, deadline: float | None,
               progress: _Progress, save: argparse.Namespace | None = None) -> Any:
    """Fault-free campaigns of 3,000 moves each (seeds ``seed + 10**6, ...``) until ``moves``
    or ``deadline``; the first failure is shrunk (and saved) and ends the run."""
    from kvmem.testing import FaultResult, campaign, shrink

    t0 = time.perf_counter()
    done = 0
    s = seed + 10**6
    while done < moves and (deadline is None or time.perf_counter() < deadline):
        r = campaign(engine, config, None, s, min(3000, moves - done), deadline)
        done += r.moves
        progress(f"fault-free: {done} moves, {done / max(time.perf_counter() - t0, 1e-9):.0f}"
                 f" moves/s, seed {s}")
        if r.failure is not None:
            small, failure = shrink(r.schedule, r.failure.oracle, max_replays=400,
                                    deadline=time.perf_counter() + 60, engine=engine,
                                    seed=s, config=config)
            result = FaultResult("none", True, failure.oracle, len(small),
                                 time.perf_counter() - t0, done, message=str(failure.detail),
                                 engine=engine, seed=s, schedule=small)
            if save is not None:
                _save(save, result, config)
            return result
        s += 1
    return FaultResult("none", False, None, None, time.perf_counter() - t0, done,
                       engine=engine, seed=seed + 10**6)


def _save(args: argparse.Namespace, r: Any, config: Any) -> None:
    if not args.save or not r.detected or not r.schedule:
        return
    from kvmem.testing import FuzzFailure, replay, save_reproducer

    fault = None if r.fault == "none" else r.fault
    try:
        replay(r.schedule, r.engine, fault, r.seed, config)
    except FuzzFailure as failure:
        path = save_reproducer(args.save, r.schedule, failure, r.engine, fault, r.seed, config)
        r.message = f"{r.message} (saved {path})"


def _hybrid(args: argparse.Namespace, config_given: str | None,
            progress: _Progress) -> tuple[list[Any], bool]:
    """``--engine hybrid``: its own campaigns on a HybridManager (kvmem.testing._fuzz_hybrid)."""
    from kvmem.testing import HYBRID_FAULTS, hybrid_clean, hybrid_hunt

    if args.save is not None or config_given not in (None, "small"):
        raise ArgumentError("--engine hybrid runs its own small hybrid system: it takes no "
                            "--save and no --config (drop them)")
    names = args.faults or list(HYBRID_FAULTS)
    if args.faults is not None:
        unknown = [n for n in names if n not in HYBRID_FAULTS]
        if unknown:
            raise ArgumentError(f"faults {unknown} do not apply to the 'hybrid' engine; its "
                                f"faults are {list(HYBRID_FAULTS)}")
    if args.faults is None:
        deadline = None
        if args.moves is None:
            deadline = time.perf_counter() + 60.0 * (args.minutes or 1.0)
        clean = hybrid_clean(args.seed, args.moves or 10**12, deadline, progress)
        return [clean], not clean.detected
    budget = 60.0 * (args.minutes or max(1.0, 0.25 * len(names)))
    per_fault = budget / (len(names) + 1)
    results = []
    for name in names:
        r = hybrid_hunt(name, args.seed, max_campaigns=10**6, moves_per_campaign=2000,
                        shrink_replays=400, deadline=time.perf_counter() + per_fault,
                        progress=progress)
        progress(f"{name}: {'found by ' + str(r.detected_by) if r.detected else 'NOT FOUND'}"
                 f" ({r.moves} moves, {r.seconds:.1f}s)", force=True)
        results.append(r)
    clean = hybrid_clean(args.seed, _CLEAN_MOVES, None, progress)
    results.append(clean)
    return results, all(r.detected for r in results[:-1]) and not clean.detected


# The CI profiles: fixed seeds and budgets, so the outcome depends on the code only.
_CI_ENGINES = ("manager", "toy", "disagg", "offload")
_VLLM_ENGINES = ("vllm", "vllm-async")  # ci-vllm: vLLM's import alone takes 5-20 s
_CI_CAMPAIGNS, _CI_MOVES, _CI_SHRINK = 25, 1500, 100
_CI_CLEAN = {"manager": 5 * _CLEAN_MOVES, "toy": _CLEAN_MOVES, "disagg": _CLEAN_MOVES,
             "offload": _CLEAN_MOVES,
             "vllm": _CLEAN_MOVES // 2, "vllm-async": _CLEAN_MOVES // 2}  # fault-free moves


def _ci_profile(progress: _Progress,
                engines: tuple[str, ...] = _CI_ENGINES) -> tuple[list[Any], bool]:
    from kvmem.testing import FuzzConfig, hunt
    from kvmem.testing.faults import CATALOG

    config = FuzzConfig.preset("small")
    results = []
    ok = True
    for engine in engines:
        for name, f in CATALOG.items():
            if f.engines is not None and engine not in f.engines:
                continue
            r = hunt(name, engine, config, seed=0, max_campaigns=_CI_CAMPAIGNS,
                     moves_per_campaign=_CI_MOVES, shrink_replays=_CI_SHRINK)
            progress(f"ci {engine}: {name}: "
                     f"{r.detected_by if r.detected else 'NOT DETECTED'}", force=True)
            ok &= r.detected
            results.append(r)
        clean = _clean_run(engine, config, 0, _CI_CLEAN[engine], None, progress)
        ok &= not clean.detected
        results.append(clean)
    return results, ok


def _ci_hybrid(progress: _Progress) -> tuple[list[Any], bool]:
    """The hybrid engine's part of ``--profile ci``: its catalog, then 10,000 fault-free
    moves, with the CI's seeds and budgets."""
    from kvmem.testing import HYBRID_FAULTS, hybrid_clean, hybrid_hunt

    results = []
    for name in HYBRID_FAULTS:
        r = hybrid_hunt(name, 0, max_campaigns=_CI_CAMPAIGNS, moves_per_campaign=_CI_MOVES,
                        shrink_replays=_CI_SHRINK)
        progress(f"ci hybrid: {name}: {r.detected_by if r.detected else 'NOT DETECTED'}",
                 force=True)
        results.append(r)
    clean = hybrid_clean(0, _CLEAN_MOVES, None, progress)
    results.append(clean)
    return results, all(r.detected for r in results[:-1]) and not clean.detected


def _table(results: list[Any]) -> str:
    lines = [f"{'engine':10s} {'fault':32s} {'BUGS':8s} {'detected by':15s} {'moves':>7s} "
             f"{'shrunk':>6s} {'seconds':>8s}"]
    for r in results:
        if r.fault == "none":
            what = f"TRIPPED {r.detected_by}" if r.detected else "clean"
        else:
            what = r.detected_by if r.detected else "NOT DETECTED"
        lines.append(f"{r.engine:10s} {r.fault:32s} {','.join(map(str, r.bugs)):8s} "
                     f"{what:15s} {r.moves:7d} {r.schedule_len or '':>6} {r.seconds:8.1f}")
        if r.detected and r.fault == "none":
            lines.append(f"    {r.message}")
    return "\n".join(lines)
