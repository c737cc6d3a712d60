"""Engines under test: the protocol the fuzzer drives, and the adapters kvmem ships.

The fuzzer plays the clients (requests arrive, get cancelled), the device (steps complete, copies
and transfers land) and the model (the token each step samples is ``spec.tokens[position]``).
An engine adapter plays the host: its scheduler decides what each step computes and calls its
:class:`~kvmem.manager.KVCacheManager`. What the fuzzer calls and what it observes::

    fuzzer -> engine                          engine -> fuzzer
    submit(spec)      a request arrives       (manager hooks: admit, fork, preempt, release,
    abort(id)         the client cancels       integrity_failure, step_end: seen by the fuzzer)
    launch(choice)    schedule + launch ...   -> Launch: per request the positions computed,
                                                 the pages read (CSR), the slots written, the
                                                 copies to do first, the fence that covers it
    retire(op)        the device finished op: retire its fence (ops with a fence only)
    finish(op)        process op's outputs    -> ids of the requests that finished
    fork / preempt / resume / receive / clear_cache (optional, see ``capabilities``)
    land(op) / expire / kill / notice   (optional: a real transport from a source manager)
    check()           engine-specific checks (optional; raise FuzzFailure("engine", ...))

Rules an adapter follows (they are what an engine on kvmem must do anyway):

* every successful ``reserve`` is run by exactly one :class:`Launch` (a step or a transfer):
  the fuzzer learns each request's pages from it;
* ``retire`` and ``finish`` are each called in completion order, in either order for one op,
  only after the op completed on the device; ``retire`` retires the op's fence, ``finish``
  commits what the op computed and releases the requests it finished;
* the token at position ``i`` of a request is ``spec.tokens[i]``.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvmem._validate import INT32_MAX, integer
from kvmem.errors import ArgumentError, ArgumentTypeError
from kvmem.testing._launch import Launch, RequestSpec

__all__ = ["FuzzConfig", "FuzzEngine", "stable_bit", "stable_pick", "subset_step"]

Int64Array = npt.NDArray[np.int64]


class FuzzConfig:
    """The shape of a fuzzed system: pool, limits, request sizes, the device's depth.

    Parameters
    ----------
    num_pages, page_size, max_seqs: the manager's pool and rows
    max_len: most tokens per request (prompt + generated)
    prompt_len: ``(lo, hi)`` prompt tokens
    max_new: ``(lo, hi)`` tokens generated per request
    vocab: tokens are drawn from ``0 .. vocab - 1`` (small: prompts share prefixes)
    namespaces: the tenants requests are spread over
    target_running: the fuzzer submits requests until this many are alive
    max_in_flight: steps an asynchronous engine keeps launched at once
    chunk: most prefill tokens per request per step; max_batch_tokens: per step
    tracker: ``"checking"`` or ``None`` (NoOpTracker: verify checks nothing)
    check_every: ``manager.check()`` and the full model comparison every this many moves
    weights: relative frequency of each move in random campaigns
    strict_commits: hold engines to "commit means the K/V landed" (see :class:`Timeline`)
    """

    DEFAULT_WEIGHTS: ClassVar[dict[str, float]] = {
        "submit": 6, "launch": 10, "complete": 10, "retire": 10, "finish": 10, "copy": 6,
        "transfer": 4,
        "abort": 2, "fork": 3, "preempt": 2, "resume": 3, "receive": 2, "clear": 0.3,
        "hook": 1, "inject": 2, "expire": 1, "kill": 0.3, "notice": 8, "corrupt": 1,
    }

    def __init__(self, num_pages: int = 48, page_size: int = 4, max_seqs: int = 10,
                 max_len: int = 64, prompt_len: tuple[int, int] = (1, 36),
                 max_new: tuple[int, int] = (1, 16), vocab: int = 3,
                 namespaces: Sequence[Any] = (None, "tenant-a", ("lora", 7)),
                 target_running: int = 8, max_in_flight: int = 2, chunk: int = 12,
                 max_batch_tokens: int = 64, tracker: str | None = "checking",
                 check_every: int = 64, weights: dict[str, float] | None = None,
                 strict_commits: bool = True) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("max_seqs", max_seqs), ("max_len", max_len), ("vocab", vocab),
                            ("target_running", target_running), ("max_in_flight", max_in_flight),
                            ("chunk", chunk), ("max_batch_tokens", max_batch_tokens),
                            ("check_every", check_every)):
            integer(value, name, minimum=1, maximum=INT32_MAX)
        for name, pair in (("prompt_len", prompt_len), ("max_new", max_new)):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ArgumentTypeError(f"{name}={pair!r}: expected a (lo, hi) pair of ints")
            for bound in pair:
                integer(bound, name, minimum=0)
        if tracker not in ("checking", None):
            raise ArgumentError(f"tracker={tracker!r}: expected 'checking' or None (NoOpTracker)")
        unknown = sorted(set(weights or {}) - set(self.DEFAULT_WEIGHTS))
        if unknown:
            raise ArgumentError(f"weights name unknown moves {unknown}; the moves are "
                                f"{list(self.DEFAULT_WEIGHTS)}")
        if any(not (isinstance(w, (int, float)) and 0 <= w < float("inf"))
               for w in (weights or {}).values()):
            raise ArgumentError(f"weights={weights!r}: expected finite numbers >= 0")
        if isinstance(namespaces, (str, bytes)) or not isinstance(namespaces, Sequence) \
                or not namespaces:
            raise ArgumentError(f"namespaces={namespaces!r}: expected a non-empty sequence of "
                                "tenants (None: no tenant), e.g. (None, 'tenant-a')")
        if not isinstance(strict_commits, (bool, np.bool_)):
            raise ArgumentTypeError(f"strict_commits={strict_commits!r}: expected True or False")
        if not any(w > 0 for w in {**self.DEFAULT_WEIGHTS, **(weights or {})}.values()):
            raise ArgumentError(f"weights={weights!r}: every move has weight 0; give at least "
                                "one move a weight > 0")
        if prompt_len[0] < 1 or prompt_len[1] < prompt_len[0] or max_new[1] < max_new[0]:
            raise ArgumentError(f"prompt_len {prompt_len} and max_new {max_new} must be (lo, hi) "
                                "ranges with lo <= hi and prompts of at least one token")
        if prompt_len[1] + max_new[1] > max_len:
            raise ArgumentError(f"prompt_len[1] + max_new[1] = {prompt_len[1] + max_new[1]} "
                                f"exceeds max_len={max_len}; raise max_len")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.prompt_len = (int(prompt_len[0]), int(prompt_len[1]))
        self.max_new = (int(max_new[0]), int(max_new[1]))
        self.vocab = vocab
        self.namespaces = tuple(namespaces)
        self.target_running = target_running
        self.max_in_flight = max_in_flight
        self.chunk = chunk
        self.max_batch_tokens = max_batch_tokens
        self.tracker = tracker
        self.check_every = check_every
        self.weights = {**self.DEFAULT_WEIGHTS, **(weights or {})}
        self.strict_commits = strict_commits

    @property
    def max_requests(self) -> int:
        """Requests the model follows at once (alive ones, plus some finishing on the device)."""
        return 2 * self.target_running + 2 * self.max_seqs + 16

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_pages": self.num_pages, "page_size": self.page_size, "max_seqs": self.max_seqs,
            "max_len": self.max_len, "prompt_len": list(self.prompt_len),
            "max_new": list(self.max_new), "vocab": self.vocab,
            "namespaces": list(self.namespaces), "target_running": self.target_running,
            "max_in_flight": self.max_in_flight, "chunk": self.chunk,
            "max_batch_tokens": self.max_batch_tokens, "tracker": self.tracker,
            "check_every": self.check_every, "weights": dict(self.weights),
            "strict_commits": self.strict_commits,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FuzzConfig:
        """The config :meth:`to_dict` gave (lists for tuples, as JSON has them); fields left out
        take their defaults."""
        if not isinstance(d, dict):
            raise ArgumentTypeError(f"from_dict({d!r}): expected a dict of FuzzConfig fields, "
                                    "as to_dict() gives")
        d = dict(d)
        fields = list(inspect.signature(cls).parameters)
        unknown = sorted(set(d) - set(fields), key=str)
        if unknown:
            raise ArgumentError(f"no FuzzConfig field {unknown}; the fields are {fields}")
        for key in ("prompt_len", "max_new"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        if isinstance(d.get("namespaces"), list):
            d["namespaces"] = tuple(tuple(n) if isinstance(n, list) else n
                                    for n in d["namespaces"])
        return cls(**d)

    @classmethod
    def preset(cls, name: str) -> FuzzConfig:
        """``"small"`` (finds races fast: few pages, short requests, deep overlap) or
        ``"bench"`` (4,096 pages of 16 tokens, 64 requests running, the benchmark's setting)."""
        if name == "small":
            return cls()
        if name == "bench":
            return cls(num_pages=4096, page_size=16, max_seqs=96, max_len=640,
                       prompt_len=(32, 384), max_new=(64, 240), vocab=4, target_running=64,
                       max_in_flight=2, chunk=256, max_batch_tokens=768, check_every=2048,
                       weights={"submit": 3, "launch": 10, "complete": 10, "retire": 10,
                                "finish": 10,
                                "copy": 4, "transfer": 4, "abort": 0.4, "fork": 0.3,
                                "preempt": 0.2, "resume": 1, "receive": 0.3, "clear": 0.01,
                                "hook": 0.5})
        raise ArgumentError(f"no fuzz config preset {name!r}; use 'small' or 'bench'")


class FuzzEngine:
    """Base class of an engine under test (see the module docstring for the protocol).

    Subclasses set ``manager`` and ``max_in_flight`` and implement :meth:`submit`,
    :meth:`abort`, :meth:`launch` and :meth:`finish`; the optional moves default to "not
    supported" (return False / None) and are only offered when named in ``capabilities``.

    Attributes
    ----------
    manager: the :class:`~kvmem.manager.KVCacheManager` the engine runs on
    max_in_flight: steps launched and not yet completed at most (0: a synchronous engine, whose
        every step completes, and is finished, within the move that launched it)
    capabilities: optional moves the engine supports: ``"fork"``, ``"preempt"``, ``"resume"``,
        ``"receive"``, ``"clear"`` (:meth:`clear_cache`), ``"hooks"`` (the ``hook`` move: the
        next manager hook of some kind raises), ``"transport"`` (transfers land through
        :meth:`land`), ``"leases"``, ``"kill"``, ``"notices"`` (the ``expire``, ``kill`` and
        ``notice`` moves), ``"copies"`` (deferred copies the engine starts itself,
        :meth:`take_copies`, landing together at the ``transfer`` move, :meth:`land_copies`),
        ``"tiers"`` (the ``corrupt`` move)
    bugs: engine-side fault switches the adapter honours (see :mod:`kvmem.testing.faults`)
    source_manager: for an engine that receives pages from another manager over a real
        transport (capability ``"transport"``), that manager (the prefill side): the fuzzer
        watches its lifetimes (:mod:`kvmem.testing._transfer_oracles`); None otherwise
    stream_ordered: the engine runs its steps in launch order on one stream and relies on that
        order instead of step fences (vLLM): it frees and reuses pages while a step runs and
        commits a step's tokens when it schedules the step. The timeline then guards no step's
        pages (``happens_before``) and allows hits on unlanded writes (``landed_hit`` off, as
        with ``strict_commits=False``): every later step runs after the write; ``reads`` still
        sees a step read what it must not
    """

    name: ClassVar[str] = "engine"
    capabilities: ClassVar[frozenset[str]] = frozenset()
    stream_ordered: ClassVar[bool] = False
    manager: Any
    max_in_flight: int = 2
    source_manager: Any = None

    def __init__(self) -> None:
        self.bugs: set[str] = set()

    def submit(self, spec: RequestSpec) -> None:
        raise NotImplementedError

    def abort(self, request_id: Any) -> None:
        raise NotImplementedError

    def launch(self, choice: int) -> Launch | None:
        raise NotImplementedError

    def retire(self, op: Launch) -> None:
        """The device finished ``op``: retire the fence that covers it (default: none)."""

    def finish(self, op: Launch) -> Sequence[Any]:
        raise NotImplementedError

    def fork(self, choice: int,
             make_child: Callable[[Any, int], RequestSpec | None]) -> bool:
        return False

    def preempt(self, choice: int) -> bool:
        return False

    def resume(self, choice: int) -> bool:
        return False

    def receive(self, spec: RequestSpec) -> Launch | None:
        return None

    def clear_cache(self) -> bool:
        return False

    def land(self, op: Launch) -> tuple[bool, Any]:
        """(``"transport"``) The transport completes transfer ``op``'s read: ``(ok, landed)``,
        whether its bytes moved and ``[T]`` int64, what its slots hold now."""
        raise NotImplementedError

    def expire(self, choice: int) -> bool:
        """(``"leases"``) The clock passes the lease term: the source's leases expire."""
        return False

    def kill(self, choice: int) -> bool:
        """(``"kill"``) The source process dies (a fresh one takes its place)."""
        return False

    def notice(self, a: int, b: int) -> bool:
        """(``"notices"``) A notice in flight between the sides is delivered, lost or
        duplicated."""
        return False

    def notices_in_flight(self) -> int:
        """(``"notices"``) Notices sent and not yet delivered or lost."""
        return 0

    def waiting_on_clock(self) -> bool:
        """(``"leases"``) Whether a lease or an answer still waits for a term the clock has not
        passed (the drain's ``expire`` ends it; a lease past its term is stranded)."""
        return False

    def take_copies(self) -> tuple[list[Launch], list[Launch]]:
        """(``"copies"``) Device work the engine started on its own since the last call
        (deferred copies to and from a tier: transfer ops, a store's ``read_pages`` guarded),
        and those of its ops that ended without landing (cancelled)."""
        return [], []

    def land_copies(self) -> list[tuple[Launch, Any]]:
        """(``"copies"``) Every deferred copy lands now (the ``transfer`` move): each op in
        flight with what it wrote into its slots (``[T]`` int64)."""
        raise NotImplementedError

    def take_truncations(self) -> list[tuple[Any, int]]:
        """``(request_id, num_pages)`` for each request that gave back pages since the last
        call without a hook saying so (a speculative step's rejected drafts): it maps only its
        first ``num_pages`` pages now."""
        return []

    def corrupt(self, a: int, b: int) -> bool:
        """(``"tiers"``) A stored page's bytes change in a tier below the device."""
        return False

    def check(self) -> None:
        """Engine-specific checks, run with the timeline's full check."""


def stable_pick(choice: int, keys: Sequence[Any]) -> int:
    """The index of the key that ``choice`` picks, by rendezvous hashing: the pick does not
    change when other keys come or go (so deleting an unrelated move while shrinking does not
    change what a later move does)."""
    head = zlib.crc32(f"{choice}:".encode())  # (crc32 of f"{choice}:{k}", the head once)
    best, best_i = -1, -1
    for i, k in enumerate(keys):
        h = zlib.crc32(f"{k}".encode(), head)
        if h > best:
            best, best_i = h, i
    return best_i


def stable_bit(choice: int, key: Any) -> bool:
    """A coin that ``choice`` flips for ``key`` (the same whatever else exists)."""
    return bool(zlib.crc32(f"{choice}/{key}".encode()) & 1)


def subset_step(step: Any, keep: npt.NDArray[np.bool_]) -> tuple[Int64Array, ...]:
    """The CSR, slot mapping and counts of a reserved step for the requests ``keep`` selects:
    ``(kv_indptr, kv_indices, slot_mapping, num_new_tokens)``."""
    if not all(hasattr(step, f) for f in ("kv_indptr", "kv_indices", "slot_mapping",
                                          "num_new_tokens")):
        raise ArgumentTypeError(f"step={type(step).__name__}: expected the StepMetadata a "
                                "reserve() returned")
    counts = np.diff(step.kv_indptr)
    keep = np.asarray(keep)
    if keep.dtype != np.bool_ or keep.shape != counts.shape:
        raise ArgumentError(f"keep has dtype {keep.dtype} and shape {keep.shape}: expected a "
                            f"bool mask of shape ({counts.size},), one per request of the step")
    indptr = np.zeros(int(np.count_nonzero(keep)) + 1, dtype=np.int64)
    np.cumsum(counts[keep], out=indptr[1:])
    indices = step.kv_indices[np.repeat(keep, counts)]
    nn = step.num_new_tokens
    slots = step.slot_mapping[np.repeat(keep, nn)]
    return indptr, indices, slots, nn[keep].astype(np.int64)
