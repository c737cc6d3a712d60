"""Fuzzing campaigns: random campaigns, exact replay, shrinking, saved reproducers, the catalog.

A run of a schedule (a list of moves ``(name, a, b)``) is :class:`~kvmem.testing._run.Run`'s.
Random campaigns (:func:`campaign`) draw moves with a seeded ``random.Random`` (no hypothesis
per move); a failure is shrunk by delta debugging (:func:`shrink`: delete chunks of moves, then
single moves, then zero the arguments, as long as the same oracle still fires) and saved as a
pytest file that replays it (:func:`save_reproducer`).
"""

from __future__ import annotations

import bisect
import numbers
import pprint
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmem._validate import integer
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError
from kvmem.testing._fuzz_protocol import FuzzConfig, FuzzEngine
from kvmem.testing._fuzz_registry import ENGINES
from kvmem.testing._oracles import ORACLES, FuzzFailure
from kvmem.testing._run import MOVES, OPTIONAL_MOVES, Move, Run, to_config, to_fault

__all__ = [
    "CampaignResult",
    "FaultResult",
    "campaign",
    "hunt",
    "replay",
    "save_reproducer",
    "schedules",
    "shrink",
]


# -- campaigns ------------------------------------------------------------------------------------


@dataclass
class CampaignResult:
    """What one random campaign did: the schedule it ran (up to the failure), the failure."""

    schedule: list[Move]
    failure: FuzzFailure | None
    moves: int
    seconds: float
    seed: int


_IDLE_DRAWS = 10_000  # a campaign whose weights leave no move that applies ends (no hang)


def campaign(engine: str | Callable[[FuzzConfig], FuzzEngine] = "manager",
             config: FuzzConfig | dict[str, Any] | str | None = None, fault: Any = None,
             seed: int = 0, max_moves: int = 2000, deadline: float | None = None
             ) -> CampaignResult:
    """One random campaign of up to ``max_moves`` moves (or until ``deadline``, a
    ``time.perf_counter()`` value), then the final check. Moves are drawn with the config's
    weights (merged with the fault's) from a ``random.Random(seed)``; it also ends when 10,000
    draws in a row apply nothing (weights that leave no move that can apply)."""
    t0 = time.perf_counter()
    integer(max_moves, "max_moves", minimum=0)
    seed = integer(seed, "seed", minimum=0)
    run = Run(engine, config, fault, seed)
    weights = dict(run.config.weights)
    if run.fault is not None:
        weights.update(run.fault.weights)
    names = [m for m in run.moves_enabled if weights.get(m, 0) > 0]
    if not names:
        raise ArgumentError(f"no move the {run.engine.name!r} engine offers "
                            f"({list(run.moves_enabled)}) has a weight > 0 in the config; give "
                            "one of them a weight")
    cum: list[float] = []
    total = 0.0
    for m in names:
        total += weights[m]
        cum.append(total)
    rnd = random.Random(seed)
    schedule: list[Move] = []
    failure = None
    step = run.step
    rand = rnd.random
    bits = rnd.getrandbits
    try:
        tries = 0
        idle = 0  # draws in a row that applied nothing
        while run.num_moves < max_moves and idle < _IDLE_DRAWS:
            tries += 1
            if deadline is not None and not tries & 255 and time.perf_counter() > deadline:
                break
            name = names[bisect.bisect(cum, rand() * total)]
            move = (name, bits(20), bits(20))
            schedule.append(move)
            if step(*move):
                idle = 0
            else:
                schedule.pop()
                idle += 1
        while True:  # drain the device with recorded moves, then the final check
            moves = run.drain_moves()
            if not moves:
                break
            for move in moves:
                schedule.append(move)
                step(*move)
        run.final_check()
    except FuzzFailure as f:
        if f.move is not None:
            f.move = len(schedule) - 1  # the move that fired is the last one recorded
        failure = f
    return CampaignResult(schedule, failure, run.num_moves, time.perf_counter() - t0, seed)


def replay(schedule: Sequence[Sequence[Any]],
           engine: str | Callable[[FuzzConfig], FuzzEngine] = "manager",
           fault: Any = None, seed: int = 0,
           config: FuzzConfig | dict[str, Any] | str | None = None) -> Run:
    """Run a schedule exactly, then the final check; raises :class:`FuzzFailure` if an oracle
    fires. Returns the run (its manager, timeline and engine) when nothing fired."""
    moves = _checked_schedule(schedule)
    run = Run(engine, config, fault, seed)
    for name, a, b in moves:
        run.step(name, a, b)
    run.final_check()
    return run


def _checked_schedule(schedule: Any) -> list[Move]:
    """``schedule`` as a list of ``(move name, int, int)``; raises ArgumentError (or
    ArgumentTypeError) naming the first move that is not one."""
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence):
        raise ArgumentTypeError(f"schedule={type(schedule).__name__}: expected a list of "
                                "(move, int, int) tuples, as a campaign or a reproducer records")
    out: list[Move] = []
    for i, move in enumerate(schedule):
        ok = (isinstance(move, (tuple, list)) and len(move) == 3 and move[0] in MOVES
              and all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                      and int(x) >= 0 for x in move[1:]))
        if not ok:
            raise ArgumentError(f"schedule[{i}]={move!r}: expected (move, int >= 0, int >= 0) "
                                f"with move one of {list(MOVES)}")
        out.append((str(move[0]), int(move[1]), int(move[2])))
    return out


def _fails(schedule: Sequence[Move], oracle: str, kwargs: dict[str, Any]
           ) -> tuple[bool, FuzzFailure | None]:
    try:
        replay(schedule, **kwargs)
    except FuzzFailure as f:
        return f.oracle == oracle, f
    return False, None


def shrink(schedule: Sequence[Move], oracle: str, *, max_replays: int = 400,
           deadline: float | None = None, **kwargs: Any) -> tuple[list[Move], FuzzFailure]:
    """The shortest schedule found (delta debugging) on which ``oracle`` still fires first.

    Tries deleting chunks of moves (halves, quarters, ... down to single moves), then zeroing
    each move's arguments; stops after ``max_replays`` replays or at ``deadline``. ``kwargs``
    go to :func:`replay` (engine, fault, seed, config). Raises ArgumentError (a KVMemError) if
    the schedule does not fail with ``oracle`` to begin with.
    """
    integer(max_replays, "max_replays", minimum=0)
    if oracle not in ORACLES:
        raise ArgumentError(f"oracle={oracle!r}: expected one of {list(ORACLES)}")
    unknown = sorted(set(kwargs) - {"engine", "fault", "seed", "config"})
    if unknown:
        raise ArgumentError(f"shrink got {unknown}: expected replay's engine, fault, seed, "
                            "config")
    ok, failure = _fails(_checked_schedule(schedule), oracle, kwargs)
    if not ok or failure is None:
        raise ArgumentError(f"the schedule does not make {oracle!r} fire (it gave "
                            f"{failure!r}); nothing to shrink")
    s = _checked_schedule(schedule)
    replays = 1

    def cut(sched: list[Move], f: FuzzFailure) -> list[Move]:
        return sched[: f.move + 1] if f.move is not None else sched

    s = cut(s, failure)

    def budget() -> bool:
        return replays < max_replays and (deadline is None or time.perf_counter() < deadline)

    n = 2
    while len(s) >= 2 and budget():
        chunk = -(-len(s) // n)
        for start in range(0, len(s), chunk):
            if not budget():
                break
            cand = s[:start] + s[start + chunk :]
            replays += 1
            ok, f = _fails(cand, oracle, kwargs)
            if ok and f is not None:
                s, failure = cut(cand, f), f
                n = max(n - 1, 2)
                break
        else:
            if n >= len(s):
                break
            n = min(2 * n, len(s))
    i = 0
    while i < len(s):  # (a simpler move may make it fail earlier: the cut shortens s)
        name, a, b = s[i]
        for simpler in ((name, 0, 0), (name, a, 0), (name, 0, b)):
            if simpler == s[i] or not budget():
                continue
            cand = [*s[:i], simpler, *s[i + 1 :]]
            replays += 1
            ok, f = _fails(cand, oracle, kwargs)
            if ok and f is not None:
                s, failure = cut(cand, f), f
                break
        i += 1
    return s, failure


# -- reproducers ----------------------------------------------------------------------------------


_REPRODUCER = '''"""kvmem fuzz found this interleaving ({n} moves).

{oracle}: {message}

engine {engine!r}, fault {fault!r}, seed {seed}. This test fails while the bug is there:
``pytest {filename}``.
"""

from kvmem.testing import replay

CONFIG = {config}

SCHEDULE = [
{moves}
]


def test_{name}() -> None:
    replay(SCHEDULE, engine={engine!r}, fault={fault!r}, seed={seed}, config=CONFIG)
'''


def save_reproducer(directory: str | Path, schedule: Sequence[Move], failure: FuzzFailure,
                    engine: str, fault: str | None, seed: int,
                    config: FuzzConfig | dict[str, Any] | str | None,
                    name: str | None = None) -> Path:
    """Write a runnable pytest file that replays ``schedule`` exactly; returns its path.
    ``config`` may be anything :func:`replay` takes (a FuzzConfig, a dict, a preset name)."""
    moves_ = _checked_schedule(schedule)
    if not isinstance(failure, FuzzFailure):
        raise ArgumentTypeError(f"failure={failure!r}: expected the FuzzFailure replay raised")
    if not isinstance(engine, str):
        raise ArgumentTypeError(f"engine={engine!r}: expected an ENGINES name (the reproducer "
                                "replays by name)")
    seed = integer(seed, "seed", minimum=0)
    if fault is not None and not isinstance(fault, str):
        raise ArgumentTypeError(f"fault={fault!r}: expected a catalog name or None")
    to_fault(fault)  # an unknown name is refused
    if name is not None and not isinstance(name, str):
        raise ArgumentTypeError(f"name={name!r}: expected a str (the test's name) or None")
    cfg = to_config(config)
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVMemError(f"cannot create the reproducer folder {str(directory)!r} "
                         f"({e.strerror}); name a folder you can write") from None
    stem = name or f"{fault or 'none'}_{engine}_{seed}_{failure.oracle}"
    stem = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem)
    path = directory / f"test_fuzz_{stem}.py"
    moves = "\n".join(f"    ({m[0]!r}, {m[1]}, {m[2]})," for m in moves_)
    message = " ".join(str(failure.detail).split()).replace('"""', "'''")
    path.write_text(_REPRODUCER.format(
        n=len(moves_), oracle=failure.oracle, message=message[:400], engine=engine,
        fault=fault, seed=seed, filename=path.name, name=stem,
        config=pprint.pformat(cfg.to_dict(), indent=4, sort_dicts=False), moves=moves,
    ))
    return path


# -- the catalog --------------------------------------------------------------------------------


@dataclass
class FaultResult:
    """One catalog entry's outcome (``fault == "none"``: the fault-free campaign)."""

    fault: str
    detected: bool
    detected_by: str | None
    schedule_len: int | None
    seconds: float
    moves: int
    bugs: tuple[int, ...] = ()
    timeline: bool = False
    expected: str = ""
    also: tuple[str, ...] = ()
    message: str = ""
    engine: str = "manager"
    seed: int | None = None
    schedule: list[Move] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.fault, "detected": self.detected, "detected_by": self.detected_by,
                "schedule_len": self.schedule_len, "seconds": round(self.seconds, 3),
                "moves": self.moves, "engine": self.engine, "bugs": list(self.bugs),
                "timeline": self.timeline, "expected": self.expected, "also": list(self.also),
                "seed": self.seed, "message": self.message[:300]}


def hunt(fault: Any, engine: str | Callable[[FuzzConfig], FuzzEngine] = "manager",
         config: FuzzConfig | dict[str, Any] | str | None = None, seed: int = 0,
         max_campaigns: int = 40, moves_per_campaign: int = 1500,
         deadline: float | None = None, shrink_replays: int = 300,
         shrink_deadline_s: float | None = None,
         progress: Callable[[str], None] | None = None) -> FaultResult:
    """Run campaigns with ``fault`` switched on (seeds ``seed, seed + 1, ...``) until an oracle
    fires, then shrink the failing schedule (``shrink_replays=0``: keep it as found).
    ``fault=None`` hunts on a correct system (a failure then is a bug in kvmem, the engine or
    the fuzzer). Without ``deadline`` the result depends only on the arguments."""
    t0 = time.perf_counter()
    integer(max_campaigns, "max_campaigns", minimum=1)
    integer(moves_per_campaign, "moves_per_campaign", minimum=1)
    integer(shrink_replays, "shrink_replays", minimum=0)
    seed = integer(seed, "seed", minimum=0)
    f = to_fault(fault)
    cfg = to_config(config)
    moves = 0
    for i in range(max_campaigns):
        if deadline is not None and time.perf_counter() > deadline:
            break
        s = seed + i
        r = campaign(engine, cfg, f, s, moves_per_campaign, deadline)
        moves += r.moves
        if progress is not None:
            progress(f"{getattr(f, 'name', 'none')}: campaign {i + 1}, {moves} moves, "
                     f"{time.perf_counter() - t0:.1f}s")
        if r.failure is not None:
            oracle = r.failure.oracle
            small, failure = r.schedule, r.failure
            if shrink_replays > 0:
                sd = (None if shrink_deadline_s is None
                      else time.perf_counter() + shrink_deadline_s)
                small, failure = shrink(r.schedule, oracle, max_replays=shrink_replays,
                                        deadline=sd, engine=engine, fault=f, seed=s, config=cfg)
            return FaultResult(
                getattr(f, "name", "none"), True, failure.oracle, len(small),
                time.perf_counter() - t0, moves, getattr(f, "bugs", ()),
                getattr(f, "timeline", False), getattr(f, "expected", ""), failure.also,
                str(failure.detail), _engine_name(engine), s, small)
    return FaultResult(getattr(f, "name", "none"), False, None, None, time.perf_counter() - t0,
                       moves, getattr(f, "bugs", ()), getattr(f, "timeline", False),
                       getattr(f, "expected", ""), engine=_engine_name(engine))


def _engine_name(engine: Any) -> str:
    return engine if isinstance(engine, str) else str(getattr(engine, "name", engine))


def schedules(max_size: int = 200, engine: str = "manager") -> Any:
    """A hypothesis strategy of schedules (lists of moves) for ``engine``: hypothesis picks which
    actor moves next and shrinks a failure to a minimal interleaving by itself."""
    from hypothesis import strategies as st

    integer(max_size, "max_size", minimum=0)
    factory: Any = ENGINES.get(engine)
    if factory is None:
        raise ArgumentError(f"no fuzz engine {engine!r}; choose one of {sorted(ENGINES)}")
    caps = set(getattr(factory, "capabilities", ()))
    names = [m for m in MOVES if m != "inject"
             and (m not in OPTIONAL_MOVES or OPTIONAL_MOVES[m] in caps)]
    move = st.tuples(st.sampled_from(names), st.integers(0, (1 << 20) - 1),
                     st.integers(0, (1 << 20) - 1))
    return st.lists(move, max_size=max_size)
