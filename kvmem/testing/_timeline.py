"""The device timeline: a deterministic model of an asynchronous engine's device, and the oracles.

An engine that overlaps host scheduling with device work has several actors: the scheduler
(admit, reserve, commit, preempt, abort, release), the device's step stream (steps launched in
order, several in flight, completing in order), page copies that land later (copy-on-write) and
transfers that land on their own clock (P/D disaggregation, offload). :class:`Timeline` models
the device side and checks, after every move, what must hold whatever the interleaving::

    host move  -> manager calls -> hook events -> mapping model -> oracles -> register device op
    device     -> copy lands (after the steps before its step)  -> written K/V visible
               -> step completes (oldest first, its copies landed): reads checked, writes land
               -> transfer lands (any order): writes land
    host       -> retire(op): the engine learns the op is done on the device (retires its fence)
               -> finish(op): the engine processes the op's outputs (commit, release finished)

Device memory holds one int64 "K/V value" per token slot; the value of position ``i`` of a
request depends on its namespace and every token up to ``i`` (:func:`kv_value_array`), so a
read through a wrong page, of a slot not yet written, or of another tenant's page is visible.

Oracles (each named; :class:`FuzzFailure.oracle` says which fired):

=================  ==========================================================================
``happens_before`` no page listed by a launched op (step reads and writes, copy source and
                   destination, transfer) changes lifetime (tag) before the op completes
``fences``         an op's fence (step handle) is not retired before the op completes on the
                   device, and is retired when the host learns of the completion
``reads``          every read of a step sees exactly the K/V of its request's own tokens in its
                   own namespace (old positions before the step's writes land, new ones after)
``landed_hit``     a prefix hit never reuses a page whose write has not landed (kvmem's contract:
                   commit means written; ``strict_commits=False`` leaves only the same-step
                   hit, which ``reads`` sees, for engines that rely on one stream's order)
``tags``           every new lifetime gets a tag above every earlier one (tags never repeat)
``refcounts``      each page's refcount equals its holders in the model: request mappings (from
                   admit/fork events and the launched steps' metadata) + the prefix cache + the
                   step fences + copy-on-write sources awaiting their copy
``conservation``   free + live pages == total
``verify``         verify aborted a request (a false positive on a correct run)
``requests``       the manager holds exactly the requests the engine has not finished or aborted
``check``          ``KVCacheManager.check()`` (full bookkeeping), every ``check_every`` moves
``kvmem_error``    a manager call raised where the engine did not expect it
=================  ==========================================================================

The checks after a move are incremental: one comparison of the tags, refcounts and fence holds
with their previous values finds the pages that changed, and only those are checked; a step's
reads re-read only the pages that changed or were written since its request last read them.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import IntegrityError, KVMemError

__all__ = [
    "ORACLES",
    "FuzzFailure",
    "Launch",
    "RequestSpec",
    "Timeline",
    "kv_value_array",
    "namespace_key",
]

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]

ORACLES = ("happens_before", "fences", "reads", "landed_hit", "tags", "refcounts",
           "conservation", "verify", "requests", "check", "kvmem_error", "engine")

_EMPTY32 = np.empty(0, dtype=np.int32)
_EMPTY32.flags.writeable = False
_EMPTY64 = np.empty(0, dtype=np.int64)
_EMPTY64.flags.writeable = False
_min = np.minimum.reduce  # the ufunc reductions: a little cheaper than ndarray.min() / .max()
_max = np.maximum.reduce


class FuzzFailure(IntegrityError):
    """An oracle fired: the interleaving broke an invariant (or a fault was detected).

    Attributes
    ----------
    oracle: the oracle that fired first (one of :data:`ORACLES`)
    move: index of the move after which it fired (None: the final check)
    also: other oracles that fired at the same move
    """

    def __init__(self, oracle: str, message: str, move: int | None = None,
                 also: tuple[str, ...] = ()) -> None:
        self.oracle = oracle
        self.detail = message
        self.move = move
        self.also = also
        super().__init__(oracle, message)

    def __str__(self) -> str:
        where = "at the final check" if self.move is None else f"after move {self.move}"
        return f"[{self.oracle}] {where}: {self.detail}"


# -- K/V values --------------------------------------------------------------------------------

_B = 0x9E3779B97F4A7C15  # odd, so invertible mod 2**64
_B_INV = pow(_B, -1, 1 << 64)
_POS = np.uint64(0xD6E8FEB86659FD93)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_powers: dict[str, npt.NDArray[np.uint64]] = {}


def _power_table(n: int) -> tuple[npt.NDArray[np.uint64], ...]:
    """``B**i``, ``B**-i`` and ``i * POS`` mod 2**64 for ``i < n`` (grown on demand, shared)."""
    have = _powers.get("b")
    if have is None or have.size < n:
        size = max(n, 1024, 0 if have is None else 2 * have.size)
        with np.errstate(over="ignore"):
            b = np.full(size, _B, dtype=np.uint64)
            b[0] = 1
            binv = np.full(size, _B_INV, dtype=np.uint64)
            binv[0] = 1
            _powers["b"] = np.multiply.accumulate(b)
            _powers["binv"] = np.multiply.accumulate(binv)
            _powers["pos"] = np.arange(size, dtype=np.uint64) * _POS
    return _powers["b"][:n], _powers["binv"][:n], _powers["pos"][:n]


def namespace_key(namespace: Any) -> int:
    """A stable 64-bit key of a namespace (the same in every process)."""
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def kv_value_array(ns_key: int, tokens: npt.ArrayLike) -> Int64Array:
    """The K/V value of every position of a token stream: ``[n]``, int64, never 0.

    Position ``i``'s value mixes the namespace key, ``i`` and a polynomial hash of tokens
    ``0 .. i`` (computed for all positions at once: ``h(i) = B**i * sum_j (t_j + 1) B**-j``), so
    two streams agree at ``i`` only if they agree on the namespace and the whole prefix.
    """
    t = np.asarray(tokens, dtype=np.int64).view(np.uint64)  # (the same bits as astype)
    n = t.size
    if n == 0:
        return np.empty(0, dtype=np.int64)
    pb, pinv, pos = _power_table(n)
    # (Array arithmetic wraps mod 2**64 silently: no np.errstate needed, it costs 2 us a call.)
    s = t + np.uint64(1)
    s *= pinv
    np.cumsum(s, out=s)
    h = pb * s
    h ^= np.uint64(ns_key)
    h += pos
    h ^= h >> _S33
    h *= _M1
    h ^= h >> _S33
    h *= _M2
    h ^= h >> _S33
    out = h.view(np.int64)
    out |= 1  # never 0: 0 is a slot nothing wrote
    return out


# -- what the fuzzer gives engines and what they give back -------------------------------------


class RequestSpec:
    """A request the fuzzer submits: its namespace and its whole token stream.

    ``tokens[:prompt_len]`` is the prompt; ``tokens[i]`` for ``i >= prompt_len`` is the token the
    model samples at position ``i`` (an engine must use exactly these). The request finishes when
    the K/V of every position ``< len(tokens)`` has been computed.
    """

    __slots__ = ("namespace", "parent", "prompt_len", "request_id", "tokens")

    def __init__(self, request_id: Any, namespace: Any, tokens: Int64Array, prompt_len: int,
                 parent: Any = None) -> None:
        self.request_id = request_id
        self.namespace = namespace
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.parent = parent

    @property
    def prompt(self) -> Int64Array:
        return self.tokens[: self.prompt_len]

    @property
    def max_len(self) -> int:
        return int(self.tokens.size)

    def __repr__(self) -> str:
        return (f"RequestSpec({self.request_id!r}, ns={self.namespace!r}, "
                f"prompt_len={self.prompt_len}, max_len={self.max_len})")


class Launch:
    """Device work an engine launched: a step (or a transfer), as its kernels see it.

    Parameters
    ----------
    request_ids: ``[B]`` the requests the step computes
    starts: ``[B]`` int — first position each request computes in this step
    num_new: ``[B]`` int — positions computed (``starts[b] .. starts[b] + num_new[b] - 1``)
    kv_indptr: ``[B + 1]`` int; kv_indices: ``[nnz]`` int — the pages each request reads, in
        order (FlashInfer CSR, as the attention kernel gets it), covering every position up to
        ``starts + num_new``
    slot_mapping: ``[T]`` int — where each computed position's K/V is written
        (``page * page_size + offset``), request by request, ``T = sum(num_new)``
    copy_src, copy_dst: ``[C]`` int — page copies the step does before anything else
        (copy-on-write); they land on the device after every earlier step completed
    held_sources: ``[C']`` int — copy-on-write sources the manager keeps alive for this
        reserve's copies until the next reserve (default ``copy_src``; an engine that does not
        do the copies it was asked for still reports what the manager holds)
    fence: the ``step_id`` of the :class:`~kvmem.manager.StepHandle` that covers this work, or
        None when the engine took none
    kind: ``"step"`` (reads and writes; completes in launch order) or ``"transfer"`` (writes
        only, e.g. KV arriving from a prefill node; lands in any order)
    writes_first: the step's kernels write its K/V before attention reads (vLLM's backends,
        layer by layer), so a request may read another's same-step write (a same-step prefix
        hit); default False: old positions are read before the step's writes land
    """

    __slots__ = ("copy_dst", "copy_src", "ent_flat", "fence", "guard", "held_sources", "id",
                 "kind", "kv_counts", "kv_indices", "kv_indptr", "mrows", "num_new",
                 "pending_copies", "request_ids", "slot_mapping", "starts", "write_pages",
                 "writes_first")

    def __init__(self, request_ids: tuple[Any, ...], starts: npt.ArrayLike,
                 num_new: npt.ArrayLike, kv_indptr: npt.ArrayLike, kv_indices: npt.ArrayLike,
                 slot_mapping: npt.ArrayLike, copy_src: npt.ArrayLike = _EMPTY32,
                 copy_dst: npt.ArrayLike = _EMPTY32, fence: int | None = None,
                 kind: str = "step", held_sources: npt.ArrayLike | None = None,
                 writes_first: bool = False) -> None:
        if kind not in ("step", "transfer"):
            raise KVMemError(f"Launch kind must be 'step' or 'transfer', got {kind!r}")
        self.request_ids = tuple(request_ids)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.num_new = np.asarray(num_new, dtype=np.int64)
        self.kv_indptr = np.asarray(kv_indptr, dtype=np.int64)
        self.kv_indices = np.asarray(kv_indices, dtype=np.int64)
        self.slot_mapping = np.asarray(slot_mapping, dtype=np.int64)
        self.copy_src = np.asarray(copy_src, dtype=np.int64)
        self.copy_dst = np.asarray(copy_dst, dtype=np.int64)
        self.held_sources = (self.copy_src if held_sources is None or held_sources is copy_src
                             else np.asarray(held_sources, dtype=np.int64))
        self.fence = fence
        self.kind = kind
        self.writes_first = writes_first
        b = len(self.request_ids)
        if (self.starts.shape != (b,) or self.num_new.shape != (b,)
                or self.kv_indptr.shape != (b + 1,) or self.copy_src.shape != self.copy_dst.shape):
            raise KVMemError(
                f"a Launch of {b} requests needs starts/num_new [{b}], kv_indptr [{b + 1}] and "
                f"copy_src/copy_dst of one shape; got {self.starts.shape}, "
                f"{self.num_new.shape}, {self.kv_indptr.shape}, {self.copy_src.shape}/"
                f"{self.copy_dst.shape}"
            )
        # Filled by the timeline when it registers the op.
        self.id = -1
        self.mrows = _EMPTY64
        self.guard = _EMPTY64
        self.write_pages = _EMPTY64
        self.ent_flat = _EMPTY64  # per CSR entry: its place in the model's [rows, width]
        self.kv_counts = _EMPTY64  # pages each request reads
        self.pending_copies = 0

    def __repr__(self) -> str:
        return (f"Launch(#{self.id} {self.kind}, {len(self.request_ids)} requests, "
                f"{int(self.num_new.sum())} tokens, {self.copy_src.size} copies, "
                f"fence={self.fence})")


# -- the timeline ----------------------------------------------------------------------------


class _Req:
    __slots__ = ("alive", "mrow", "spec")

    def __init__(self, spec: RequestSpec, mrow: int) -> None:
        self.spec = spec
        self.mrow = mrow
        self.alive = True


class Timeline:
    """The device and the reference model of one run over a :class:`KVCacheManager`.

    Parameters
    ----------
    manager: the engine's manager (the oracles read its public state and subscribe to its hooks)
    max_requests: most requests (submitted and not yet forgotten) at once
    max_len: most tokens per request
    check_every: run ``manager.check()`` and the full model comparison every this many moves
    strict_commits: ``landed_hit`` holds the engine to kvmem's contract (commit means the K/V
        landed); False for an engine that commits when it schedules and relies on one stream's
        order (a hit is read by a later step, after the write): then only a same-step hit, which
        ``reads`` sees, is a failure
    stream_ordered: the engine's steps run in launch order on one stream and it relies on that
        (vLLM): a page a step lists may be freed or reused while the step runs, since every
        later writer runs after it; ``happens_before`` then guards only transfers and copies

    Attributes
    ----------
    kv: ``[num_pages * page_size]``, int64 — device memory: the K/V value in each slot (0 = never
        written)
    """

    def __init__(self, manager: Any, max_requests: int, max_len: int,
                 check_every: int = 64, strict_commits: bool = True,
                 stream_ordered: bool = False) -> None:
        self.mgr = manager
        self.strict_commits = strict_commits
        self.stream_ordered = stream_ordered
        self.P = P = int(manager.page_size)
        self.num_pages = n = int(manager.num_pages)
        self.max_len = max_len
        self.check_every = check_every
        self.kv = np.zeros(n * P, dtype=np.int64)
        width = -(-max_len // P) + 1
        self.width = width
        # Per model row (one per request the model follows).
        self.val = np.zeros((max_requests, max_len + P), dtype=np.int64)
        self.map = np.full((max_requests, width), -1, dtype=np.int64)  # pages each maps
        self._map_flat = self.map.reshape(-1)
        self.map_len = np.zeros(max_requests, dtype=np.int64)
        # The version (see ``pver``) of the page each entry held when the request last read it.
        self.vseen = np.full((max_requests, width), -1, dtype=np.int64)
        self._vseen_flat = self.vseen.reshape(-1)
        self._arange = np.arange(max_requests * width + 1, dtype=np.int64)
        self._free_mrows = list(range(max_requests - 1, -1, -1))
        self.reqs: dict[Any, _Req] = {}
        self._mrow_of: dict[Any, int] = {}  # request id -> its row (written with ``reqs``)
        self._ns_keys: dict[str, int] = {}  # repr(namespace) -> namespace_key(namespace)
        # Per page.
        self.holders = np.zeros(n, dtype=np.int64)  # request mappings in the model
        self.copy_hold = np.zeros(n, dtype=np.int64)  # copy-on-write sources awaiting a reserve
        self._copy_hold_pages = _EMPTY64
        self.guard = np.zeros(n, dtype=np.int64)  # in-flight ops listing the page
        # Which page it is and which landing last wrote it (epoch * num_pages + page): a read
        # through an entry is new if the entry's page or that page's content changed since.
        self.pver = np.arange(n, dtype=np.int64)
        self.epoch = 1
        # What the last move saw (copies in the manager's own dtypes: compared every move).
        self._seen_tags = manager.allocator.tags.copy()
        self._max_tag = int(self._seen_tags.max(initial=0))
        self._seen_rc = manager.allocator.refcounts.copy()
        self._num_live = int(np.count_nonzero(self._seen_rc))  # pages with a holder, as seen
        self._seen_held = manager.fences.held.copy()
        self._held_any = True
        self._dirty: list[Int64Array] = []
        self._page_mask = np.zeros(n, dtype=bool)  # scratch, all False between uses
        # Device queues.
        self.in_flight: deque[Launch] = deque()  # steps, launch order
        self.transfers: list[Launch] = []
        # Done on the device; the host has yet to retire their fence / process their outputs.
        self.to_retire: deque[Launch] = deque()
        self.to_finish: deque[Launch] = deque()
        self._next_op = 0
        self._open_fences: dict[int, Launch] = {}  # fence -> op not yet completed on device
        self._must_retire: set[int] = set()  # fences the host was told to retire
        self._retired: set[int] = set()
        self._events: list[tuple[str, Any, Any, Any]] = []
        self.moves = 0
        self.num_reads = 0  # steps whose reads were checked
        # How often each check ran (a correct run must show them all > 0 and silent).
        self.counts = {"page_checks": 0, "tag_changes": 0, "reads": 0, "hits": 0,
                       "retires": 0, "full_checks": 0, "launches": 0}
        self.aborted_by_verify: list[tuple[Any, str]] = []
        self._arange_p = np.arange(P, dtype=np.int64)
        self.extra_check: Callable[[], None] | None = None  # the engine's own checks
        for kind in ("admit", "fork", "preempt", "release", "integrity_failure", "step_end"):
            manager.add_hook(kind, self._on_event)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        """Follow a request the fuzzer submitted (or forked): compute its K/V values."""
        if spec.max_len > self.max_len:
            raise KVMemError(f"{spec!r} is longer than the timeline's max_len={self.max_len}")
        if not self._free_mrows:
            self._collect()
            if not self._free_mrows:
                raise KVMemError(
                    f"the timeline follows {len(self.reqs)} requests, its max_requests; finish "
                    "or abort some before submitting more"
                )
        mrow = self._free_mrows.pop()
        ns = repr(spec.namespace)  # (what namespace_key hashes: 1 and True are two tenants)
        key = self._ns_keys.get(ns)
        if key is None:
            key = self._ns_keys[ns] = namespace_key(spec.namespace)
        self.val[mrow, : spec.max_len] = kv_value_array(key, spec.tokens)
        self.vseen[mrow] = -1
        self.map[mrow] = -1
        self.map_len[mrow] = 0
        self.reqs[spec.request_id] = _Req(spec, mrow)
        self._mrow_of[spec.request_id] = mrow

    def forget(self, request_id: Any) -> None:
        """The fuzzer is done with a request (finished or aborted): its row can be reused once
        no device op lists it."""
        req = self.reqs.get(request_id)
        if req is not None:
            req.alive = False

    def _collect(self) -> None:
        """Forget the finished requests that no op on the device lists (their rows are free)."""
        listed: set[int] = set()
        for op in (*self.in_flight, *self.transfers):
            listed.update(op.mrows.tolist())
        for rid in [r for r, q in self.reqs.items() if not q.alive and q.mrow not in listed]:
            q = self.reqs.pop(rid)
            del self._mrow_of[rid]
            if self.map_len[q.mrow]:
                self._unmap(q.mrow)
            self._free_mrows.append(q.mrow)

    # -- the mapping model ----------------------------------------------------------------------

    def _on_event(self, event: Any) -> None:
        self._events.append((event.kind, event.request_id, event.pages, event.detail))

    def _set_map(self, mrow: int, pages: Int64Array) -> None:
        self._unmap(mrow)
        k = pages.size
        if k > self.width:
            raise FuzzFailure("refcounts", f"a request maps {k} pages, more than it can use")
        self.map[mrow, :k] = pages
        self.map_len[mrow] = k
        np.add.at(self.holders, pages, 1)
        self._dirty.append(pages)

    def _unmap(self, mrow: int) -> None:
        k = int(self.map_len[mrow])
        if k:
            old = self.map[mrow, :k].copy()
            np.subtract.at(self.holders, old, 1)
            self._dirty.append(old)
            self.map[mrow, :k] = -1
            self.map_len[mrow] = 0

    def _process_events(self) -> None:
        events, self._events = self._events, []
        for kind, rid, pages, detail in events:
            if kind == "step_end":
                fence = int(detail)
                self._retired.add(fence)
                self.counts["retires"] += 1
                op = self._open_fences.get(fence)
                if op is not None:
                    raise FuzzFailure(
                        "fences", f"fence {fence} was retired while {op!r} still runs on the "
                        "device: pages it reads or writes can be reused under it")
                self._must_retire.discard(fence)
                continue
            req = self.reqs.get(rid)
            if req is None:
                continue  # a request the fuzzer does not follow (the engine's own)
            if kind in ("admit", "fork"):
                p = pages.astype(np.int64)
                self._set_map(req.mrow, p)
                self.vseen[req.mrow] = -1
                if kind == "admit" and detail and self.strict_commits:
                    hits = p[: int(detail) // self.P]
                    self.counts["hits"] += 1
                    bad = self._unlanded_among(hits)
                    if bad.size:
                        raise FuzzFailure(
                            "landed_hit", f"request {rid!r} reuses cached pages "
                            f"{bad.tolist()[:8]} whose K/V writes have not landed yet")
            elif kind in ("preempt", "release", "integrity_failure"):
                self._unmap(req.mrow)
                if kind == "integrity_failure":
                    self.aborted_by_verify.append((rid, str(detail)))

    def _observe_launch(self, op: Launch) -> None:
        """The launch's metadata tells the model each request's first pages now (growth and
        copy-on-write happen in reserve, which emits no per-request event)."""
        ids = op.request_ids
        try:
            mrows = np.fromiter(map(self._mrow_of.__getitem__, ids), dtype=np.int64,
                                count=len(ids))
        except KeyError as e:
            raise FuzzFailure("engine", f"{op!r} lists request {e.args[0]!r}, which the "
                              "fuzzer never submitted") from None
        op.mrows = mrows
        indptr, pages = op.kv_indptr, op.kv_indices
        nnz = pages.size
        if nnz and int(_max(pages.view(np.uint64))) >= self.num_pages:  # (negatives wrap)
            raise FuzzFailure("reads", f"{op!r} lists page ids outside 0..{self.num_pages - 1}")
        counts = indptr[1:] - indptr[:-1]
        if indptr[0] != 0 or indptr[-1] != nnz or (
                counts.size and int(_max(counts)) > self.width):
            raise FuzzFailure("reads", f"{op!r} has a malformed CSR (kv_indptr {indptr[:8]})")
        # Entry k of the CSR is column k - indptr[b] of its request b's model row.
        ar = self._arange if nnz <= self._arange.size else np.arange(nnz, dtype=np.int64)
        flat = (mrows * self.width - indptr[:-1]).repeat(counts)
        flat += ar[:nnz]
        op.ent_flat = flat
        op.kv_counts = counts
        old = self._map_flat.take(flat)
        changed = (old != pages).nonzero()[0]
        if changed.size:
            o = old[changed]
            o = o[o >= 0]  # (none when the changed entries are pages just added at the end)
            if o.size:
                np.subtract.at(self.holders, o, 1)
                self._dirty.append(o)
            new = pages[changed]
            np.add.at(self.holders, new, 1)
            self._map_flat[flat[changed]] = new
            self._dirty.append(new)
            # A request's CSR covers its first columns: it maps at least that many now (.at: a
            # request listed twice by a buggy engine keeps the longer).
            np.maximum.at(self.map_len, mrows, counts)
        # The manager keeps the latest reserve's copy-on-write sources until the next reserve.
        if self._copy_hold_pages.size:
            np.subtract.at(self.copy_hold, self._copy_hold_pages, 1)
            self._dirty.append(self._copy_hold_pages)
        self._copy_hold_pages = op.held_sources
        if op.held_sources.size:
            np.add.at(self.copy_hold, op.held_sources, 1)
            self._dirty.append(op.held_sources)

    def note_reserve_without_launch(self) -> None:
        """The engine reserved but launched nothing (e.g. everything it reserved was aborted by
        verify): the previous copy-on-write sources are no longer held."""
        if self._copy_hold_pages.size:
            np.subtract.at(self.copy_hold, self._copy_hold_pages, 1)
            self._dirty.append(self._copy_hold_pages)
            self._copy_hold_pages = _EMPTY64

    # -- host moves -------------------------------------------------------------------------------

    def after_host_move(self, op: Launch | None = None) -> None:
        """Check every oracle after a host move (``op``: the device work it launched), then put
        ``op`` on the device."""
        self.moves += 1
        if self._events:
            self._process_events()
        if op is not None:
            self._observe_launch(op)
        self._check_pages()
        if self.aborted_by_verify:
            rid, reason = self.aborted_by_verify[0]
            raise FuzzFailure("verify", f"verify aborted request {rid!r}: {reason}")
        if self._must_retire:
            fence = min(self._must_retire)
            raise FuzzFailure("fences", f"the host processed the completion of the op covered by "
                              f"fence {fence} but never retired it: the pages it holds leak")
        if op is not None:
            self._register(op)
        if self.check_every and self.moves % self.check_every == 0:
            self.full_check()

    def after_device_move(self) -> None:
        self.moves += 1

    def _check_pages(self) -> None:
        """Tags, happens-before, refcounts and conservation over the pages that changed.

        One comparison per page array (tags, refcounts, fence holds) with what the previous
        move saw finds the pages that changed, whoever changed them; only those are checked."""
        alloc = self.mgr.allocator
        tags = alloc.tags
        self.counts["page_checks"] += 1
        changed = (tags != self._seen_tags).nonzero()[0]
        if changed.size:
            self.counts["tag_changes"] += 1
            self._check_tags(changed, tags)
        rc = alloc.refcounts
        parts = self._dirty
        d_rc = (rc != self._seen_rc).nonzero()[0]
        if d_rc.size:
            # (Only the pages that changed are touched: the page arrays are the memory traffic.)
            parts.append(d_rc)
            now = rc[d_rc]
            self._num_live += (int(np.count_nonzero(now))
                               - int(np.count_nonzero(self._seen_rc[d_rc])))
            self._seen_rc[d_rc] = now
            if alloc.num_free + self._num_live != self.num_pages:
                raise FuzzFailure(
                    "conservation", f"{alloc.num_free} free + {self._num_live} live pages != "
                    f"{self.num_pages}")
        fences = self.mgr.fences
        held = fences.held
        holds = fences.holds_any
        if holds or self._held_any:
            d_held = (held != self._seen_held).nonzero()[0]
            if d_held.size:
                parts.append(d_held)
                self._seen_held[d_held] = held[d_held]
            self._held_any = holds
        if parts:
            dirty = np.concatenate(parts) if len(parts) > 1 else parts[0]
            self._dirty = []
            if dirty.size:
                self._check_refcounts(dirty, rc, held)

    def _check_tags(self, changed: Int64Array, tags: Int64Array) -> None:
        if np.count_nonzero(self.guard[changed]):
            p = int(changed[self.guard[changed] > 0][0])
            op = self._op_guarding(p)
            was = int(self._seen_tags[p])
            now = int(tags[p])
            raise FuzzFailure(
                "happens_before", f"page {p} changed lifetime (tag {was} -> {now}: "
                f"{'freed' if now == 0 else 'reallocated'}) while {op!r}, which lists it, "
                "has not completed on the device")
        new = tags[changed]
        self._seen_tags[changed] = new
        new = np.sort(new[new != 0])  # (a freed page's tag is 0)
        if new.size:
            if int(new[0]) <= self._max_tag or np.count_nonzero(new[1:] == new[:-1]):
                raise FuzzFailure(
                    "tags", f"pages {changed.tolist()[:8]} got tags {new.tolist()[:8]}, not "
                    f"all above the previous highest tag {self._max_tag} and distinct")
            self._max_tag = int(new[-1])

    def _check_refcounts(self, pages: Int64Array, rc: Int32Array, held: Int32Array) -> None:
        # (held: the fences' references, copy-on-write sources awaiting their copy included)
        cache = self.mgr.cache
        want = self.holders[pages] + held[pages]
        if cache is not None:  # (int32 ids: the cache converts nothing)
            want += cache.is_cached(pages.astype(np.int32))
        bad = (rc[pages] != want).nonzero()[0]
        if bad.size:
            p = pages[bad]
            raise FuzzFailure(
                "refcounts", f"pages {p.tolist()[:8]} have refcounts {rc[p].tolist()[:8]} but "
                f"the model counts {want[bad].tolist()[:8]} holders (request mappings "
                f"{self.holders[p].tolist()[:8]}, fences {held[p].tolist()[:8]}, copy sources "
                f"{self.copy_hold[p].tolist()[:8]}, cache)"
                + (": a leak" if int((rc[p] - want[bad]).max()) > 0 else ": freed under a holder"))

    def full_check(self) -> None:
        """Everything at once: ``manager.check()``, the model over every page, the requests."""
        mgr = self.mgr
        self.counts["full_checks"] += 1
        known = set(mgr.running) | set(mgr.preempted)
        extra = [rid for rid in known if rid not in self.reqs or not self.reqs[rid].alive]
        if extra:
            raise FuzzFailure(
                "requests", f"the manager still holds requests {sorted(map(str, extra))[:8]} that "
                "the engine finished or aborted: their pages leak")
        self._collect()
        try:
            mgr.check()
        except IntegrityError as e:
            raise FuzzFailure("check", str(e)) from None
        pages = np.arange(self.num_pages, dtype=np.int64)
        self._check_refcounts(pages, mgr.allocator.refcounts, mgr.fences.held)
        if np.count_nonzero(mgr.allocator.tags != self._seen_tags):
            raise FuzzFailure("tags", "the tags changed without the per-move check seeing it")
        live = int(np.count_nonzero(mgr.allocator.refcounts))
        if live != self._num_live or mgr.allocator.num_free + live != self.num_pages:
            raise FuzzFailure("conservation", f"{mgr.allocator.num_free} free + {live} live "
                              f"pages != {self.num_pages}, or the per-move count "
                              f"({self._num_live}) missed a change")
        if self.extra_check is not None:
            self.extra_check()
        held_for_steps = mgr.fences.num_held - int(self.copy_hold.sum())
        if self.idle and (mgr.fences.in_flight or held_for_steps > 0):
            raise FuzzFailure(
                "fences", f"nothing runs on the device but steps {mgr.fences.open_steps} are "
                "open in kvmem: a completion was lost, the pages they hold leak")

    # -- device ---------------------------------------------------------------------------------

    def _register(self, op: Launch) -> None:
        self.counts["launches"] += 1
        op.id = self._next_op
        self._next_op += 1
        P = self.P
        slots = op.slot_mapping
        if slots.size and int(_max(slots.view(np.uint64))) >= self.num_pages * P:
            raise FuzzFailure("reads", f"{op!r} writes slots outside the pool")
        op.write_pages = slots // P
        if op.copy_src.size:
            copies = np.concatenate([op.copy_src, op.copy_dst])
            if int(_max(copies.view(np.uint64))) >= self.num_pages:
                raise FuzzFailure("engine", f"{op!r} copies page ids outside "
                                  f"0..{self.num_pages - 1}")
        if not (self.stream_ordered and op.kind == "step" and not op.copy_src.size):
            op.guard = (np.concatenate([op.kv_indices, op.write_pages, op.copy_src, op.copy_dst])
                        if op.copy_src.size else np.concatenate([op.kv_indices, op.write_pages]))
            np.add.at(self.guard, op.guard, 1)
        op.pending_copies = int(op.copy_src.size)
        if op.fence is not None:
            if op.fence in self._retired:
                raise FuzzFailure("fences", f"{op!r} was launched under fence {op.fence}, which "
                                  "is already retired: nothing holds what is dropped while it "
                                  "runs")
            self._open_fences[op.fence] = op
        if op.kind == "transfer":
            self.transfers.append(op)
        else:
            self.in_flight.append(op)

    def _op_guarding(self, page: int) -> Launch | None:
        for op in (*self.in_flight, *self.transfers):
            if np.count_nonzero(op.guard == page):
                return op
        return None

    def unlanded_pages(self) -> Int64Array:
        """Pages with K/V writes launched and not yet landed (steps, copies, transfers)."""
        parts = [op.write_pages for op in self.in_flight]
        parts += [op.copy_dst[op.copy_dst.size - op.pending_copies :]
                  for op in self.in_flight if op.pending_copies]
        parts += [op.write_pages for op in self.transfers]
        return np.concatenate(parts) if parts else _EMPTY64

    def _unlanded_among(self, pages: Int64Array) -> Int64Array:
        """Those of ``pages`` that a launched write has not landed in yet."""
        if not pages.size:
            return _EMPTY64
        pending = self.unlanded_pages()
        if not pending.size:
            return _EMPTY64
        mask = self._page_mask
        mask[pending] = True
        found = pages[mask[pages]]
        mask[pending] = False
        return found

    def can_land_copy(self) -> bool:
        return bool(self.in_flight) and self.in_flight[0].pending_copies > 0

    def land_copy(self) -> bool:
        """The next copy of the oldest step lands (its earlier steps have all completed)."""
        if not self.can_land_copy():
            return False
        op = self.in_flight[0]
        i = op.copy_src.size - op.pending_copies
        src, dst = int(op.copy_src[i]), int(op.copy_dst[i])
        P = self.P
        self.kv[dst * P : (dst + 1) * P] = self.kv[src * P : (src + 1) * P]
        self.pver[dst] = self.epoch * self.num_pages + dst
        self.epoch += 1
        self.guard[src] -= 1  # the copy no longer reads its source
        op.pending_copies -= 1
        self.after_device_move()
        return True

    def can_complete(self) -> bool:
        return bool(self.in_flight) and self.in_flight[0].pending_copies == 0

    def complete(self) -> bool:
        """The oldest step completes: its reads are checked, then its writes land."""
        if not self.can_complete():
            return False
        op = self.in_flight.popleft()
        self._finish_on_device(op, reads=True)
        self.after_device_move()
        return True

    def land_transfer(self, choice: int) -> bool:
        """One of the transfers in flight lands (any order)."""
        if not self.transfers:
            return False
        op = self.transfers.pop(choice % len(self.transfers))
        self._finish_on_device(op, reads=False)
        self.after_device_move()
        return True

    def _finish_on_device(self, op: Launch, reads: bool) -> None:
        if reads:
            self._check_reads(op)
        else:
            self._land_writes(op)
        g = op.guard
        if op.copy_src.size:  # each copy's source was released when it landed
            g = np.concatenate([op.kv_indices, op.write_pages, op.copy_dst])
        np.subtract.at(self.guard, g, 1)
        if op.fence is not None:
            self._open_fences.pop(op.fence, None)
        if op.fence is not None:
            self.to_retire.append(op)
        self.to_finish.append(op)

    def _land_writes(self, op: Launch) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The op's K/V writes land; returns each written token's request (index in the op),
        position and value."""
        counts = op.num_new
        b = counts.size
        if b and op.slot_mapping.size == b and int(_min(counts)) == 1:  # a token each (decode)
            tb = self._arange[:b]
            pos = op.starts
            values = self.val[op.mrows, pos]
        else:
            total = int(counts.sum())
            if not total:
                return _EMPTY64, _EMPTY64, _EMPTY64
            ar = self._arange if total <= self._arange.size else np.arange(total,
                                                                            dtype=np.int64)
            tb = ar[:b].repeat(counts)
            pos = (op.starts - np.cumsum(counts) + counts)[tb] + ar[:total]
            values = self.val[op.mrows[tb], pos]
        self.kv[op.slot_mapping] = values
        wp = op.write_pages
        self.pver[wp] = self.epoch * self.num_pages + wp
        self.epoch += 1
        return tb, pos, values

    def _check_reads(self, op: Launch) -> None:
        """Every position a request reads (``< starts + num_new``) holds its own value.

        Old positions (``< starts``) are read before the step's writes land (another request's
        same-step write is not visible yet), and only through entries whose page changed, or
        was written by a landing, since the request last read it (the rest were read then and
        have not changed). New positions are read after the writes land, token by token,
        through the CSR the kernel got (a slot mapping that disagrees with it, or two writes
        into one slot, leaves a wrong value there). A ``writes_first`` step lands its writes
        before any read."""
        P = self.P
        pages, mrows, starts, indptr = op.kv_indices, op.mrows, op.starts, op.kv_indptr
        flat = op.ent_flat
        landed = self._land_writes(op) if op.writes_first else None
        dirty = (self._vseen_flat.take(flat) != self.pver.take(pages)).nonzero()[0]
        if dirty.size:
            db = indptr.searchsorted(dirty, side="right") - 1  # each dirty entry's request
            first = (dirty - indptr[db]) * P  # the first position its page holds
            some_old = (first < starts[db]).nonzero()[0]  # (a page just added holds none)
            if some_old.size:
                dirty, db, first = dirty[some_old], db[some_old], first[some_old]
                pos = first[:, None] + self._arange_p
                old = pos < starts[db][:, None]
                slots = (pages[dirty] * P)[:, None] + self._arange_p
                want = self.val[mrows[db][:, None], np.minimum(pos, self.max_len)]
                got = self.kv[slots]
                bad = old & (got != want)
                if np.count_nonzero(bad):
                    self._read_failure(op, db, pos, slots, bad, got, want,
                                       "after the step's writes" if landed is not None else
                                       "before the step's writes")
        tb, pos, values = self._land_writes(op) if landed is None else landed
        if pos.size:
            col, off = np.divmod(pos, P)
            slots = pages[indptr[tb] + col] * P + off
            got = self.kv[slots]
            bad = got != values
            if np.count_nonzero(bad):
                self._read_failure(op, tb[:, None], pos[:, None], slots[:, None], bad[:, None],
                                   got[:, None], values[:, None], "after the step's writes")
        self._vseen_flat[flat] = self.pver.take(pages)
        self.num_reads += 1
        self.counts["reads"] += 1

    def _read_failure(self, op: Launch, db: Int64Array, pos: Int64Array, slots: Int64Array,
                      bad: npt.NDArray[np.bool_], got: Int64Array, want: Int64Array,
                      when: str) -> None:
        i, j = (int(x[0]) for x in np.nonzero(bad))
        b = int(np.asarray(db).reshape(-1)[i])
        rid = op.request_ids[b]
        slot = int(slots[i, j])
        found = int(got[i, j])
        owner = "a slot nothing wrote" if found == 0 else self._whose(found)
        raise FuzzFailure(
            "reads", f"{op!r}: request {rid!r} reads position {int(pos[i, j])} from slot {slot} "
            f"(page {slot // self.P}) {when} and finds {owner}, not its own K/V")

    def _whose(self, value: int) -> str:
        hits = np.argwhere(self.val == value)
        if not hits.size:
            return "a value no request's tokens imply"
        mrow, p = (int(x) for x in hits[0])
        for rid, q in self.reqs.items():
            if q.mrow == mrow:
                return f"the K/V of request {rid!r} (ns {q.spec.namespace!r}) at position {p}"
        return f"the K/V of a finished request at position {p}"

    # -- host learns completions ---------------------------------------------------------------

    def next_to_retire(self) -> Launch | None:
        """The oldest op done on the device whose fence the host has not retired."""
        return self.to_retire[0] if self.to_retire else None

    def next_to_finish(self) -> Launch | None:
        """The oldest op done on the device whose outputs the host has not processed."""
        return self.to_finish[0] if self.to_finish else None

    def host_retired(self, op: Launch) -> None:
        """The engine was told ``op`` is done on the device (call after ``engine.retire(op)``):
        its fence must be retired by the end of the move."""
        self.to_retire.remove(op)
        if op.fence is not None:
            if op.fence in self._retired:
                self._retired.discard(op.fence)
            else:
                self._must_retire.add(op.fence)

    def host_finished(self, op: Launch) -> None:
        """The engine processed ``op``'s outputs (call after ``engine.finish(op)``)."""
        if self.to_finish and self.to_finish[0] is op:
            self.to_finish.popleft()
        else:
            self.to_finish.remove(op)

    @property
    def idle(self) -> bool:
        return not (self.in_flight or self.transfers or self.to_retire or self.to_finish)
