"""The timeline's oracles: what must hold after every move, whatever the interleaving.

Oracles (each named; :class:`FuzzFailure.oracle` says which fired):

=================  ==========================================================================
``happens_before`` no page listed by a launched op (step reads and writes, copy source and
                   destination, transfer, a tier store's source) changes lifetime (tag) before
                   the op completes
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
``admission``,     the values the manager returns and stores, against the engine's model
``step_metadata``, (:mod:`kvmem.testing._value_oracles`)
``request_state``,
``stats``
``transfer_lifetime``, bytes a transfer read from a source page whose lifetime ended are
``leases``         never used; nothing stranded at the source
                   (:mod:`kvmem.testing._transfer_oracles`)
=================  ==========================================================================

:class:`OracleSet` holds the page oracles (``happens_before``, ``tags``, ``refcounts``,
``conservation``, ``requests``, ``check``, the idle side of ``fences``) and ``reads``, with the
reference model they compare the manager with; a :class:`~kvmem.testing.Timeline` holds one and
calls it, and a test can drive one on its own. The checks after a move are incremental: one
comparison of the tags, refcounts and fence holds with their previous values finds the pages
that changed, and only those are checked; a step's reads re-read only the pages that changed or
were written since its request last read them. (``landed_hit``, the retire side of ``fences``
and ``verify`` fire where the timeline processes the manager's events and host moves, in
:mod:`kvmem.testing._timeline`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import IntegrityError
from kvmem.testing._launch import Launch

if TYPE_CHECKING:
    from kvmem.testing._device_memory import DeviceMemory

__all__ = ["ORACLES", "FuzzFailure", "OracleSet"]

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]

ORACLES = ("happens_before", "fences", "reads", "landed_hit", "tags", "refcounts",
           "conservation", "verify", "requests", "check", "kvmem_error", "engine",
           "admission", "step_metadata", "request_state", "stats", "transfer_lifetime",
           "leases")



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



class OracleSet:
    """The page oracles over one :class:`~kvmem.manager.KVCacheManager` and the reference model
    they compare it with: which pages requests map (``holders``), which copy-on-write sources
    wait for their copy (``copy_hold``) and which pages a device op in flight lists
    (``guard``). Whoever drives the manager (a :class:`~kvmem.testing.Timeline`, or a test on
    its own) tells the model what it knows with :meth:`hold` / :meth:`unhold` and friends, and
    calls :meth:`check_pages` after every move, :meth:`full_check` now and then and, with a
    :class:`~kvmem.testing._device_memory.DeviceMemory`, :meth:`check_reads` for each step
    that completes. Each check raises :class:`FuzzFailure` naming its oracle.

    Parameters
    ----------
    manager: the manager whose public state the oracles read
    counts: the dict that counts how often each check ran (a timeline shares its own; None: a
        new one)
    """

    def __init__(self, manager: Any, counts: dict[str, int] | None = None) -> None:
        self.mgr = manager
        self.P = int(manager.page_size)
        self.num_pages = n = int(manager.num_pages)
        self.counts = counts if counts is not None else {
            "page_checks": 0, "tag_changes": 0, "reads": 0, "full_checks": 0}
        self.holders = np.zeros(n, dtype=np.int64)  # request mappings in the model
        self.copy_hold = np.zeros(n, dtype=np.int64)  # copy-on-write sources awaiting a reserve
        self.guard = np.zeros(n, dtype=np.int64)  # in-flight ops listing the page
        self.num_reads = 0  # steps whose reads were checked
        # What the last move saw (copies in the manager's own dtypes: compared every move).
        self._seen_tags = manager.allocator.tags.copy()
        self._max_tag = int(self._seen_tags.max(initial=0))
        self._seen_rc = manager.allocator.refcounts.copy()
        self._seen_held = manager.fences.held.copy()
        self._held_any = True
        self._dirty: list[Int64Array] = []

    # -- the model ------------------------------------------------------------------------------

    def hold(self, pages: Int64Array) -> None:
        """A request maps ``pages`` now (once per listing)."""
        np.add.at(self.holders, pages, 1)
        self._dirty.append(pages)

    def unhold(self, pages: Int64Array) -> None:
        """A request no longer maps ``pages``."""
        np.subtract.at(self.holders, pages, 1)
        self._dirty.append(pages)

    def hold_copies(self, pages: Int64Array) -> None:
        """The manager keeps ``pages`` alive as copy-on-write sources (until the next reserve)."""
        np.add.at(self.copy_hold, pages, 1)
        self._dirty.append(pages)

    def unhold_copies(self, pages: Int64Array) -> None:
        """The copy-on-write sources ``pages`` are no longer held."""
        np.subtract.at(self.copy_hold, pages, 1)
        self._dirty.append(pages)

    def guard_pages(self, pages: Int64Array) -> None:
        """A device op in flight lists ``pages``: they may not change lifetime until it is done."""
        np.add.at(self.guard, pages, 1)

    def unguard_pages(self, pages: Int64Array) -> None:
        """A device op no longer needs ``pages``."""
        np.subtract.at(self.guard, pages, 1)

    # -- the pages ------------------------------------------------------------------------------

    def check_pages(self, op_listing: Callable[[int], Any] | None = None) -> None:
        """Tags, happens-before, refcounts and conservation over the pages that changed.

        One comparison per page array (tags, refcounts, fence holds) with what the previous
        move saw finds the pages that changed, whoever changed them; only those are checked.
        ``op_listing(page)``: the op in flight that lists a guarded page (named in the
        ``happens_before`` message)."""
        alloc = self.mgr.allocator
        tags = alloc.tags
        self.counts["page_checks"] += 1
        changed = (tags != self._seen_tags).nonzero()[0]
        if changed.size:
            self.counts["tag_changes"] += 1
            self._check_tags(changed, tags, op_listing)
        rc = alloc.refcounts
        parts = self._dirty
        d_rc = (rc != self._seen_rc).nonzero()[0]
        if d_rc.size:
            parts.append(d_rc)
            self._seen_rc[d_rc] = rc[d_rc]
            live = int(np.count_nonzero(rc))
            if alloc.num_free + live != self.num_pages:
                raise FuzzFailure(
                    "conservation", f"{alloc.num_free} free + {live} live pages != "
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

    def _check_tags(self, changed: Int64Array, tags: Int64Array,
                    op_listing: Callable[[int], Any] | None) -> None:
        if np.count_nonzero(self.guard[changed]):
            p = int(changed[self.guard[changed] > 0][0])
            op = op_listing(p) if op_listing is not None else "an op"
            was = int(self._seen_tags[p])
            now = int(tags[p])
            raise FuzzFailure(
                "happens_before", f"page {p} changed lifetime (tag {was} -> {now}: "
                f"{'freed' if now == 0 else 'reallocated'}) while {op!r}, which lists it, "
                "has not completed on the device")
        new = tags[changed]
        self._seen_tags[changed] = new
        new = new[new != 0]  # (a freed page's tag is 0)
        new.sort()
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

    def full_check(self, alive: Callable[[Any], bool] | None = None, idle: bool | None = None,
                   extra_check: Callable[[], None] | None = None) -> None:
        """Everything at once: ``manager.check()`` and the model over every page; with ``alive``
        (does the engine still have this request?), the manager's requests; with ``idle`` (is
        the device idle?), the steps kvmem holds open; ``extra_check``: the engine's own."""
        mgr = self.mgr
        self.counts["full_checks"] += 1
        if alive is not None:
            known = set(mgr.running) | set(mgr.preempted)
            extra = [rid for rid in known if not alive(rid)]
            if extra:
                raise FuzzFailure(
                    "requests", f"the manager still holds requests {sorted(map(str, extra))[:8]} "
                    "that the engine finished or aborted: their pages leak")
        try:
            mgr.check()
        except IntegrityError as e:
            raise FuzzFailure("check", str(e)) from None
        pages = np.arange(self.num_pages, dtype=np.int64)
        self._check_refcounts(pages, mgr.allocator.refcounts, mgr.fences.held)
        if np.count_nonzero(mgr.allocator.tags != self._seen_tags):
            raise FuzzFailure("tags", "the tags changed without the per-move check seeing it")
        live = int(np.count_nonzero(mgr.allocator.refcounts))
        if mgr.allocator.num_free + live != self.num_pages:
            raise FuzzFailure("conservation", f"{mgr.allocator.num_free} free + {live} live "
                              f"pages != {self.num_pages}")
        if extra_check is not None:
            extra_check()
        held_for_steps = mgr.fences.num_held - int(self.copy_hold.sum())
        if idle and (mgr.fences.in_flight or held_for_steps > 0):
            raise FuzzFailure(
                "fences", f"nothing runs on the device but steps {mgr.fences.open_steps} are "
                "open in kvmem: a completion was lost, the pages they hold leak")

    # -- a step's reads -------------------------------------------------------------------------

    def check_reads(self, op: Launch, memory: DeviceMemory) -> None:
        """The step ``op`` completes in ``memory``: every position a request reads (``< starts
        + num_new``) holds its own value, and the step's writes land.

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
        landed = memory.land_writes(op) if op.writes_first else None
        dirty = (memory.vseen_flat.take(flat) != memory.pver.take(pages)).nonzero()[0]
        if dirty.size:
            db = indptr.searchsorted(dirty, side="right") - 1  # each dirty entry's request
            first = (dirty - indptr[db]) * P  # the first position its page holds
            some_old = (first < starts[db]).nonzero()[0]  # (a page just added holds none)
            if some_old.size:
                dirty, db, first = dirty[some_old], db[some_old], first[some_old]
                pos = first[:, None] + memory.arange_p
                old = pos < starts[db][:, None]
                slots = (pages[dirty] * P)[:, None] + memory.arange_p
                want = memory.val[mrows[db][:, None], np.minimum(pos, memory.max_len)]
                got = memory.kv[slots]
                bad = old & (got != want)
                if np.count_nonzero(bad):
                    self._read_failure(op, memory, db, pos, slots, bad, got,
                                       "after the step's writes" if landed is not None else
                                       "before the step's writes")
        tb, pos, values = memory.land_writes(op) if landed is None else landed
        if pos.size:
            col, off = np.divmod(pos, P)
            slots = pages[indptr[tb] + col] * P + off
            got = memory.kv[slots]
            bad = got != values
            if np.count_nonzero(bad):
                self._read_failure(op, memory, tb[:, None], pos[:, None], slots[:, None],
                                   bad[:, None], got[:, None], "after the step's writes")
        memory.vseen_flat[flat] = memory.pver.take(pages)
        self.num_reads += 1
        self.counts["reads"] += 1

    def _read_failure(self, op: Launch, memory: DeviceMemory, db: Int64Array, pos: Int64Array,
                      slots: Int64Array, bad: npt.NDArray[np.bool_], got: Int64Array,
                      when: str) -> None:
        i, j = (int(x[0]) for x in np.nonzero(bad))
        b = int(np.asarray(db).reshape(-1)[i])
        rid = op.request_ids[b]
        slot = int(slots[i, j])
        found = int(got[i, j])
        owner = "a slot nothing wrote" if found == 0 else memory.whose(found)
        raise FuzzFailure(
            "reads", f"{op!r}: request {rid!r} reads position {int(pos[i, j])} from slot {slot} "
            f"(page {slot // self.P}) {when} and finds {owner}, not its own K/V")
