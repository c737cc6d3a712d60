"""One fuzzed run: the moves (:data:`MOVES`) and :class:`Run`, which plays them on an engine and
checks the timeline's oracles after each.

A *schedule* is a list of moves ``(name, a, b)``: ``name`` picks the actor that moves (see
:data:`MOVES`), ``a`` and ``b`` are small ints that pick what it does (which request, how many
tokens, which prompt), interpreted against the state at that point. A move that does not apply
(nothing to complete, no request to abort) is skipped, so any list of moves is a valid
schedule: hypothesis can generate and shrink them, and :func:`shrink` can delete moves freely.
A run is deterministic: the same schedule, engine, fault, seed and config replay exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import integer
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError
from kvmem.testing._fuzz_protocol import FuzzConfig, FuzzEngine, stable_pick
from kvmem.testing._fuzz_registry import make_engine
from kvmem.testing._launch import Launch, RequestSpec
from kvmem.testing._oracles import FuzzFailure
from kvmem.testing._timeline import Timeline
from kvmem.testing._transfer_oracles import TransferOracles

__all__ = ["HOOK_KINDS_FAILED", "MOVES", "OPTIONAL_MOVES", "ArmedHookFailure", "Move", "Run",
           "to_config", "to_fault"]

Move = tuple[str, int, int]

MOVES = ("submit", "launch", "retire", "finish", "complete", "copy", "transfer", "abort", "fork",
         "preempt", "resume", "receive", "clear", "hook", "inject", "expire", "kill", "notice",
         "corrupt")
"""Every move: ``submit`` (a request arrives), ``launch`` (the scheduler launches a step),
``retire`` (the host learns that the oldest op done on the device is done: its fence is
retired), ``finish`` (the host processes the oldest done op's outputs: commit, release
finished requests), ``complete`` (the device completes the oldest step), ``copy`` (its next
page copy lands), ``transfer`` (a transfer lands), ``abort``
(a client cancels), ``fork``, ``preempt``, ``resume``, ``receive`` (a request arrives with its
prompt K/V on a transfer), ``clear`` (the prefix cache is cleared), ``hook`` (the next hook of
some kind raises), ``inject`` (the fault's one-shot injection); with a source manager over a
real transport: ``expire`` (the clock passes the lease term), ``kill`` (the source process
dies), ``notice`` (a notice in flight is delivered, lost or duplicated); with tiers below the
device: ``corrupt`` (a stored page's bytes change), and ``transfer`` lands every deferred tier
copy at once (the engine's ``land_copies``)."""

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

OPTIONAL_MOVES = {"fork": "fork", "preempt": "preempt", "resume": "resume", "receive": "receive",
                  "clear": "clear", "hook": "hooks", "expire": "leases", "kill": "kill",
                  "notice": "notices", "corrupt": "tiers"}  # optional move -> capability


def to_fault(fault: Any) -> Any:
    if fault is None or fault == "none":
        return None
    if isinstance(fault, str):
        from kvmem.testing.faults import CATALOG

        if fault not in CATALOG:
            raise ArgumentError(f"no fault {fault!r} in the catalog; choose one of "
                                f"{sorted(CATALOG)}")
        return CATALOG[fault]
    from kvmem.testing.faults import Fault

    if not isinstance(fault, Fault):
        raise ArgumentTypeError(f"fault={fault!r}: expected None, a catalog name or a Fault "
                                "(kvmem.testing.faults.CATALOG lists them)")
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
        seed = integer(seed, "seed", minimum=0)
        self.config = c = to_config(config)
        if not (isinstance(engine, str) or callable(engine)):
            raise ArgumentTypeError(f"engine={engine!r}: expected an ENGINES name or a factory "
                                    "config -> FuzzEngine (a FuzzEngine subclass)")
        self.engine = make_engine(engine, c) if isinstance(engine, str) else engine(c)
        self.fault = to_fault(fault)
        self.seed = seed
        mgr = self.engine.manager
        ordered = self.engine.stream_ordered
        self.timeline = Timeline(mgr, c.max_requests, c.max_len, c.check_every,
                                 c.strict_commits and not ordered, ordered)
        self.transfers: TransferOracles | None = None
        if self.engine.source_manager is not None:
            self.transfers = TransferOracles(self.engine.source_manager, mgr)
        self.timeline.extra_check = self._extra_check
        if "copies" in self.engine.capabilities:
            self.timeline.copies = self.engine.take_copies
        rng = np.random.default_rng(seed)
        self._material = rng.integers(0, c.vocab, size=1 << 16).astype(np.int64)
        self._stems = [rng.integers(0, c.vocab, size=c.prompt_len[1]).astype(np.int64)
                       for _ in range(3)]
        self.alive: dict[Any, None] = {}  # submitted, not finished or aborted (in order)
        self._used_ids: set[str] = set()
        self.num_moves = 0  # moves that applied
        self.num_calls = 0  # moves run (a failure's ``move`` is its index among them)
        self._armed: set[str] = set()
        self._last_move = ""
        caps = set(self.engine.capabilities)
        self.moves_enabled = tuple(m for m in MOVES if (m not in OPTIONAL_MOVES or
                                                        OPTIONAL_MOVES[m] in caps)
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
                raise ArgumentError(f"fault {self.fault.name!r} applies to engines "
                                    f"{self.fault.engines}, not {self.engine.name!r}")
            self.fault.install(self)

    # -- helpers ---------------------------------------------------------------------------------

    def _extra_check(self) -> None:
        self.engine.check()
        if self.transfers is not None:
            self.transfers.full_check(self.timeline.idle and not self.engine.notices_in_flight()
                                      and not self.engine.waiting_on_clock())

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
        for rid, num_pages in self.engine.take_truncations():
            self.timeline.truncate(rid, num_pages)
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
        self._last_move = name
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
                raise ArgumentError(f"no move {name!r}; moves are {MOVES}") from None
            raise FuzzFailure("engine", f"{name}({a}, {b}) raised {type(e).__name__}: {e}",
                              index) from e
        if applied:
            self.num_moves += 1
            if self.transfers is not None:
                try:
                    self.transfers.after_move()
                except FuzzFailure as f:
                    f.move = index
                    raise
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
        if op is not None and self.transfers is not None:
            self.transfers.check_launch(op)
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
        tl = self.timeline
        if tl.copies is not None:  # the engine lands every deferred copy at once
            if not tl.transfers:
                return False
            for op, landed in self.engine.land_copies():
                tl.land_transfer(tl.transfers.index(op), landed)
            tl.after_host_move()  # (what landing commits may start copies)
            return True
        if self.transfers is None or not tl.transfers:
            return tl.land_transfer(a)
        op = tl.transfers[a % len(tl.transfers)]
        ok, landed = self.engine.land(op)
        if not ok:  # no byte moved: the slots keep what they held
            landed = tl.kv[op.slot_mapping].copy()
        tl.land_transfer(a, landed)
        self.transfers.landed(op, ok)
        return True

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
        if self.transfers is not None:
            self.transfers.posted(op)
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

    def _m_expire(self, a: int, b: int) -> bool:
        if not self.engine.expire(a):
            return False
        self.timeline.after_host_move()
        return True

    def _m_kill(self, a: int, b: int) -> bool:
        if not self.engine.kill(a):
            return False
        if self.transfers is not None:
            self.transfers.new_source(self.engine.source_manager)
        self.timeline.after_host_move()
        return True

    def _m_notice(self, a: int, b: int) -> bool:
        if not self.engine.notice(a, b):
            return False
        self.timeline.after_host_move()
        return True

    def _m_corrupt(self, a: int, b: int) -> bool:
        if not self.engine.corrupt(a, b):
            return False
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
        if self.engine.notices_in_flight():
            return [("notice", 0, 0)]  # (b = 0: delivered)
        if self.engine.waiting_on_clock() and self._last_move != "expire":
            return [("expire", 0, 0)]  # what no notice ended, the lease term does
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


def to_config(config: FuzzConfig | dict[str, Any] | str | None) -> FuzzConfig:
    if config is None:
        return FuzzConfig()
    if isinstance(config, str):
        return FuzzConfig.preset(config)
    if isinstance(config, dict):
        return FuzzConfig.from_dict(config)
    if not isinstance(config, FuzzConfig):
        raise ArgumentTypeError(f"config={config!r}: expected a FuzzConfig, a dict of its "
                                "fields, a preset name ('small', 'bench') or None")
    return config
