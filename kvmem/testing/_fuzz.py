"""Fuzzing runs: moves, random campaigns, exact replay, shrinking, saved reproducers, the catalog.

A *schedule* is a list of moves ``(name, a, b)``: ``name`` picks the actor that moves (see
:data:`MOVES`), ``a`` and ``b`` are small ints that pick what it does (which request, how many
tokens, which prompt), interpreted against the state at that point. A move that does not apply
(nothing to complete, no request to abort) is skipped, so any list of moves is a valid
schedule: hypothesis can generate and shrink them, and :func:`shrink` can delete moves freely.
A run is deterministic: the same schedule, engine, fault, seed and config replay exactly.

Random campaigns (:func:`campaign`) draw moves with a seeded ``random.Random`` (no hypothesis
per move); a failure is shrunk by delta debugging (:func:`shrink`: delete chunks of moves, then
single moves, then zero the arguments, as long as the same oracle still fires) and saved as a
pytest file that replays it (:func:`save_reproducer`).
"""

from __future__ import annotations

import bisect
import logging
import pprint
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import KVMemError
from kvmem.testing._engine_protocol import FuzzConfig, FuzzEngine, stable_pick
from kvmem.testing._engines import ENGINES, make_engine
from kvmem.testing._launch import Launch, RequestSpec
from kvmem.testing._oracles import FuzzFailure
from kvmem.testing._timeline import Timeline

__all__ = [
    "HOOK_KINDS_FAILED",
    "MOVES",
    "CampaignResult",
    "FaultResult",
    "Move",
    "Run",
    "campaign",
    "hunt",
    "replay",
    "save_reproducer",
    "schedules",
    "shrink",
]

Move = tuple[str, int, int]

MOVES = ("submit", "launch", "retire", "finish", "complete", "copy", "transfer", "abort", "fork",
         "preempt", "resume", "receive", "clear", "hook", "inject")
"""Every move: ``submit`` (a request arrives), ``launch`` (the scheduler launches a step),
``retire`` (the host learns that the oldest op done on the device is done: its fence is
retired), ``finish`` (the host processes the oldest done op's outputs: commit, release
finished requests), ``complete`` (the device completes the oldest step), ``copy`` (its next
page copy lands), ``transfer`` (a transfer lands), ``abort``
(a client cancels), ``fork``, ``preempt``, ``resume``, ``receive`` (a request arrives with its
prompt K/V on a transfer), ``clear`` (the prefix cache is cleared), ``hook`` (the next hook of
some kind raises), ``inject`` (the fault's one-shot injection)."""

class ArmedHookFailure(RuntimeError):
    """What an armed hook raises (the manager turns it into a HookError)."""


class _QuietArmedHooks(logging.Filter):
    """Keeps the manager's log free of the fuzzer's own, deliberate hook failures."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ArmedHookFailure)


_QUIET = _QuietArmedHooks()

HOOK_KINDS_FAILED = ("admit", "fork", "preempt", "release", "step_end")
"""Hook kinds the ``hook`` move makes fail: those whose operation returns nothing the engine
needs (see the report: a HookError loses ``reserve``'s metadata)."""

_OPTIONAL = {"fork": "fork", "preempt": "preempt", "resume": "resume", "receive": "receive",
             "clear": "clear", "hook": "hooks"}


def _fault(fault: Any) -> Any:
    if fault is None or fault == "none":
        return None
    if isinstance(fault, str):
        from kvmem.testing.faults import CATALOG

        if fault not in CATALOG:
            raise KVMemError(f"no fault {fault!r} in the catalog; choose one of "
                             f"{sorted(CATALOG)}")
        return CATALOG[fault]
    return fault


class Run:
    """One fuzzed system: an engine on its manager, the timeline, an optional fault.

    Parameters
    ----------
    engine: an adapter name from :data:`ENGINES` or a factory ``config -> FuzzEngine``
    config: the system's shape (:class:`FuzzConfig`, a dict of its fields, or a preset name)
    fault: a :data:`~kvmem.testing.faults.CATALOG` name or a :class:`~kvmem.testing.faults.Fault`
    seed: picks the prompts and sampled tokens (moves pick among them)
    """

    def __init__(self, engine: str | Callable[[FuzzConfig], FuzzEngine] = "manager",
                 config: FuzzConfig | dict[str, Any] | str | None = None, fault: Any = None,
                 seed: int = 0) -> None:
        self.config = c = _config(config)
        self.engine = make_engine(engine, c) if isinstance(engine, str) else engine(c)
        self.fault = _fault(fault)
        self.seed = seed
        mgr = self.engine.manager
        ordered = self.engine.stream_ordered
        self.timeline = Timeline(mgr, c.max_requests, c.max_len, c.check_every,
                                 c.strict_commits and not ordered, ordered)
        self.timeline.extra_check = self.engine.check
        rng = np.random.default_rng(seed)
        self._material = rng.integers(0, c.vocab, size=1 << 16).astype(np.int64)
        self._stems = [rng.integers(0, c.vocab, size=c.prompt_len[1]).astype(np.int64)
                       for _ in range(3)]
        self.alive: dict[Any, None] = {}  # submitted, not finished or aborted (in order)
        self._used_ids: set[str] = set()
        self.num_moves = 0  # moves that applied
        self.num_calls = 0  # moves run (a failure's ``move`` is its index among them)
        self._armed: set[str] = set()
        caps = set(self.engine.capabilities)
        self.moves_enabled = tuple(m for m in MOVES if (m not in _OPTIONAL or
                                                         _OPTIONAL[m] in caps)
                                   and (m != "inject" or (self.fault is not None
                                                          and self.fault.injects)))
        if "hooks" in caps:
            log = logging.getLogger(type(mgr).__module__)
            if _QUIET not in log.filters:
                log.addFilter(_QUIET)
            for kind in HOOK_KINDS_FAILED:
                mgr.add_hook(kind, self._failing_hook(kind))
        if self.fault is not None:
            if self.fault.engines is not None and self.engine.name not in self.fault.engines:
                raise KVMemError(f"fault {self.fault.name!r} applies to engines "
                                 f"{self.fault.engines}, not {self.engine.name!r}")
            self.fault.install(self)

    # -- helpers ---------------------------------------------------------------------------------

    def _failing_hook(self, kind: str) -> Callable[[Any], None]:
        def hook(event: Any) -> None:
            if kind in self._armed:
                self._armed.discard(kind)
                raise ArmedHookFailure(f"an armed {kind!r} hook fails (fuzzer)")
        return hook

    def pending_copy_sources(self) -> npt.NDArray[np.int64]:
        """Sources of the copies launched and not yet landed."""
        parts = [op.copy_src[op.copy_src.size - op.pending_copies :]
                 for op in self.timeline.in_flight if op.pending_copies]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _new_id(self, a: int, b: int, parent: Any = None) -> str:
        """A request id derived from the move that creates it (so deleting another move while
        shrinking renames nothing); taken for good by :meth:`_took_id` once the move applied."""
        base = f"{parent}.{b % 997}" if parent is not None else f"r{(a * 31 + b) % 99991}"
        rid, k = base, 1
        while rid in self._used_ids:
            k += 1
            rid = f"{base}~{k}"
        return rid

    def _took_id(self, rid: str) -> None:
        self._used_ids.add(rid)

    def _spec(self, a: int, b: int) -> RequestSpec:
        c = self.config
        lo, hi = c.prompt_len
        plen = lo + a % (hi - lo + 1)
        head = (a >> 6) % (plen + 1)  # tokens taken from a shared stem
        stem = self._stems[(a >> 12) % len(self._stems)]
        gen = c.max_new[0] + (b >> 3) % (c.max_new[1] - c.max_new[0] + 1)
        off = (b * 2654435761) % (self._material.size - c.max_len)
        tokens = np.concatenate([stem[:head], self._material[off : off + plen - head + gen]])
        ns = c.namespaces[(b >> 9) % len(c.namespaces)]
        return RequestSpec(self._new_id(a, b), ns, tokens, plen)

    def _make_child(self, a: int, b: int) -> Callable[[Any, int], RequestSpec | None]:
        def make(parent_id: Any, keep: int) -> RequestSpec | None:
            parent = self.timeline.reqs[parent_id].spec
            room = self.config.max_len - keep
            if room < 1:
                return None
            gen = min(room, self.config.max_new[0] + b % (self.config.max_new[1] + 1))
            off = (b * 40503 + a) % (self._material.size - self.config.max_len)
            tokens = np.concatenate([parent.tokens[:keep], self._material[off : off + gen]])
            return RequestSpec(self._new_id(a, b, parent_id), parent.namespace, tokens, keep,
                               parent=parent_id)
        return make

    def _retire(self, op: Launch) -> None:
        self.engine.retire(op)
        self.timeline.host_retired(op)
        self.timeline.after_host_move()

    def _finish(self, op: Launch) -> None:
        for rid in self.engine.finish(op):
            self.alive.pop(rid, None)
            self.timeline.forget(rid)
        self.timeline.host_finished(op)
        self.timeline.after_host_move()

    def _settle_sync(self, op: Launch | None) -> None:
        """A synchronous engine's step completes (and is finished) within its launch move."""
        tl = self.timeline
        tl.after_host_move(op)
        if op is None:
            return
        while tl.land_copy():
            pass
        tl.complete()
        if op.fence is not None:
            self._retire(op)
        self._finish(op)

    # -- moves -------------------------------------------------------------------------------------

    def step(self, name: str, a: int, b: int) -> bool:
        """Run one move; returns whether it applied (a move that does not apply changes
        nothing). Raises :class:`FuzzFailure` when an oracle fires."""
        index = self.num_calls
        self.num_calls += 1
        try:
            applied = bool(getattr(self, "_m_" + name)(a, b))
        except FuzzFailure as f:
            f.move = index
            raise
        except KVMemError as e:
            raise FuzzFailure("kvmem_error", f"{name}({a}, {b}) raised {type(e).__name__}: {e}",
                              index) from e
        except (AttributeError, AssertionError, IndexError, KeyError, ValueError,
                TypeError, RuntimeError) as e:
            if isinstance(e, AttributeError) and not hasattr(self, "_m_" + name):
                raise KVMemError(f"no move {name!r}; moves are {MOVES}") from None
            raise FuzzFailure("engine", f"{name}({a}, {b}) raised {type(e).__name__}: {e}",
                              index) from e
        if applied:
            self.num_moves += 1
        return applied

    def _m_submit(self, a: int, b: int) -> bool:
        if len(self.alive) >= self.config.target_running:
            return False
        spec = self._spec(a, b)
        self._took_id(spec.request_id)
        self.timeline.add_request(spec)
        self.alive[spec.request_id] = None
        self.engine.submit(spec)
        self.timeline.after_host_move()
        return True

    def _m_launch(self, a: int, b: int) -> bool:
        tl = self.timeline
        cap = self.engine.max_in_flight
        if cap and len(tl.in_flight) >= cap:
            return False
        op = self.engine.launch(a)
        if cap == 0:
            self._settle_sync(op)
        else:
            tl.after_host_move(op)
        return True

    def _m_retire(self, a: int, b: int) -> bool:
        op = self.timeline.next_to_retire()
        if op is None:
            return False
        self._retire(op)
        return True

    def _m_finish(self, a: int, b: int) -> bool:
        op = self.timeline.next_to_finish()
        if op is None:
            return False
        self._finish(op)
        return True

    def _m_complete(self, a: int, b: int) -> bool:
        return self.timeline.complete()

    def _m_copy(self, a: int, b: int) -> bool:
        return self.timeline.land_copy()

    def _m_transfer(self, a: int, b: int) -> bool:
        return self.timeline.land_transfer(a)

    def _m_abort(self, a: int, b: int) -> bool:
        if not self.alive:
            return False
        ids = list(self.alive)
        rid = ids[stable_pick(a, ids)]
        self.engine.abort(rid)
        del self.alive[rid]
        self.timeline.forget(rid)
        self.timeline.after_host_move()
        return True

    def _m_fork(self, a: int, b: int) -> bool:
        made: list[RequestSpec] = []
        make = self._make_child(a, b)

        def make_and_note(parent_id: Any, keep: int) -> RequestSpec:
            spec = make(parent_id, keep)
            if spec is not None:
                made.append(spec)
            return spec  # type: ignore[return-value]

        if len(self.alive) >= self.config.target_running + self.config.max_seqs:
            return False
        if not self.engine.fork(a, make_and_note):
            return False
        child = made[-1]
        self._took_id(child.request_id)
        self.timeline.add_request(child)
        self.alive[child.request_id] = None
        self.timeline.after_host_move()
        return True

    def _m_preempt(self, a: int, b: int) -> bool:
        if not self.engine.preempt(a):
            return False
        self.timeline.after_host_move()
        return True

    def _m_resume(self, a: int, b: int) -> bool:
        if not self.engine.resume(a):
            return False
        self.timeline.after_host_move()
        return True

    def _m_receive(self, a: int, b: int) -> bool:
        if len(self.alive) >= self.config.target_running:
            return False
        spec = self._spec(a, b)
        op = self.engine.receive(spec)
        if op is None:
            return False
        self._took_id(spec.request_id)
        self.timeline.add_request(spec)
        self.alive[spec.request_id] = None
        self.timeline.after_host_move(op)
        return True

    def _m_clear(self, a: int, b: int) -> bool:
        if not self.engine.clear_cache():
            return False
        self.timeline.after_host_move()
        return True

    def _m_hook(self, a: int, b: int) -> bool:
        self._armed.add(HOOK_KINDS_FAILED[a % len(HOOK_KINDS_FAILED)])
        self.timeline.after_device_move()
        return True

    def _m_inject(self, a: int, b: int) -> bool:
        if self.fault is None or not self.fault.inject(self, a, b):
            return False
        self.timeline.after_host_move()
        return True

    # -- the end ----------------------------------------------------------------------------------

    def drain_moves(self) -> list[Move]:
        """The moves that let the device finish everything in flight and the host process it,
        in order (run them with :meth:`step`: a campaign records them, so a failure they
        trigger has a move index and shrinks like any other)."""
        tl = self.timeline
        if tl.can_land_copy():
            return [("copy", 0, 0)]
        if tl.can_complete():
            return [("complete", 0, 0)]
        if tl.transfers:
            return [("transfer", 0, 0)]
        if tl.next_to_retire() is not None:
            return [("retire", 0, 0)]
        if tl.next_to_finish() is not None:
            return [("finish", 0, 0)]
        return []

    def drain(self) -> None:
        """Let the device finish everything in flight and the host process it (in order)."""
        while True:
            moves = self.drain_moves()
            if not moves:
                return
            for move in moves:
                self.step(*move)

    def final_check(self) -> None:
        """Drain the device, then the full check (raises :class:`FuzzFailure`)."""
        try:
            self.drain()
            self.timeline.full_check()
        except FuzzFailure as f:
            f.move = None  # the final check's
            raise
        except KVMemError as e:
            raise FuzzFailure("kvmem_error", f"draining raised {type(e).__name__}: {e}") from e


def _config(config: FuzzConfig | dict[str, Any] | str | None) -> FuzzConfig:
    if config is None:
        return FuzzConfig()
    if isinstance(config, str):
        return FuzzConfig.preset(config)
    if isinstance(config, dict):
        return FuzzConfig.from_dict(config)
    return config


# -- campaigns ------------------------------------------------------------------------------------


@dataclass
class CampaignResult:
    """What one random campaign did: the schedule it ran (up to the failure), the failure."""

    schedule: list[Move]
    failure: FuzzFailure | None
    moves: int
    seconds: float
    seed: int


def campaign(engine: str | Callable[[FuzzConfig], FuzzEngine] = "manager",
             config: FuzzConfig | dict[str, Any] | str | None = None, fault: Any = None,
             seed: int = 0, max_moves: int = 2000, deadline: float | None = None
             ) -> CampaignResult:
    """One random campaign of up to ``max_moves`` moves (or until ``deadline``, a
    ``time.perf_counter()`` value), then the final check. Moves are drawn with the config's
    weights (merged with the fault's) from a ``random.Random(seed)``."""
    t0 = time.perf_counter()
    run = Run(engine, config, fault, seed)
    weights = dict(run.config.weights)
    if run.fault is not None:
        weights.update(run.fault.weights)
    names = [m for m in run.moves_enabled if weights.get(m, 0) > 0]
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
        while run.num_moves < max_moves:
            tries += 1
            if deadline is not None and not tries & 255 and time.perf_counter() > deadline:
                break
            name = names[bisect.bisect(cum, rand() * total)]
            move = (name, bits(20), bits(20))
            schedule.append(move)
            if not step(*move):
                schedule.pop()
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
    run = Run(engine, config, fault, seed)
    for name, a, b in schedule:
        run.step(str(name), int(a), int(b))
    run.final_check()
    return run


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
    go to :func:`replay` (engine, fault, seed, config). Raises KVMemError if the schedule does
    not fail with ``oracle`` to begin with.
    """
    ok, failure = _fails(schedule, oracle, kwargs)
    if not ok or failure is None:
        raise KVMemError(f"the schedule does not make {oracle!r} fire (it gave {failure!r}); "
                         "nothing to shrink")
    s = list(schedule)
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
    for i in range(len(s)):
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
                    engine: str, fault: str | None, seed: int, config: FuzzConfig,
                    name: str | None = None) -> Path:
    """Write a runnable pytest file that replays ``schedule`` exactly; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = name or f"{fault or 'none'}_{engine}_{seed}_{failure.oracle}"
    stem = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem)
    path = directory / f"test_fuzz_{stem}.py"
    moves = "\n".join(f"    ({m[0]!r}, {m[1]}, {m[2]})," for m in schedule)
    message = " ".join(str(failure.detail).split()).replace('"""', "'''")
    path.write_text(_REPRODUCER.format(
        n=len(schedule), oracle=failure.oracle, message=message[:400], engine=engine,
        fault=fault, seed=seed, filename=path.name, name=stem,
        config=pprint.pformat(config.to_dict(), indent=4, sort_dicts=False), moves=moves,
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
    f = _fault(fault)
    cfg = _config(config)
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

    factory: Any = ENGINES.get(engine)
    caps = set(getattr(factory, "capabilities", ()))
    names = [m for m in MOVES if m != "inject" and (m not in _OPTIONAL or _OPTIONAL[m] in caps)]
    move = st.tuples(st.sampled_from(names), st.integers(0, (1 << 20) - 1),
                     st.integers(0, (1 << 20) - 1))
    return st.lists(move, max_size=max_size)
