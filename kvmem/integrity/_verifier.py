"""The verifier: the full check of a batch's metadata, and the incremental proof that gives
the same verdict for a fraction of its cost.

**The full check** (:meth:`Verifier.full_check`), for each request ``b`` of the batch:

* every page its metadata lists (CSR or block table) is in range, live, and carries the
  qualified tag the tracker recorded for ``(row, position)`` (``kvmem.integrity._tags``): the
  same lifetime and namespace as when the request mapped it; block-table padding is PAD;
* it lists as many pages as its tokens fill;
* the pages the step writes (its slot mapping's, else the slots the latest reserve handed
  out) each have one writer, and, given the step's fields, its slots and lengths are its own
  (``kvmem.integrity._step_checks``).

**The incremental proof** (numpy metadata, a :class:`CheckingTracker`) remembers what it proved
last (the rows, their generations and tracker versions, the CSR) and, per page, how many
proven entries list it. The next batch is then proved by comparison::

    lengths     kv_indptr's row lengths == ceil(num_tokens / page_size)
    kept rows   same batch position, same row generation and tracker version (the same
                request, nothing but appends since): its proven entries equal the new ones
                (the proof cut at the rows that changed, new entries spliced in, and the
                result compared with kv_indices in one pass)
    tags        no page a kept entry lists changed lifetime since: the verifier reads the
                allocator's change log through a cursor of its own, and looks the changed
                pages up in its per-page counts
    new entries every other entry is checked in full: in range, live qualified tag == the
                recorded one (never 0)
    writes      one writer per written page; slots and lengths (given) are the manager's

In the decode loop (the step ``reserve`` just built, spliced from the batch the previous proof
covered: :meth:`Verifier.check_spliced`) not even the cut is needed: the step's arrays are
compared with reserve's private copies and only the spliced-in entries are checked in full.

The fast paths answer only "proved good" or "look closer"; anything else runs the full check,
whose verdict is the one returned. With ``CheckingTracker(paranoid=True)`` the full check also
runs after every fast "proved good" and an :class:`~kvmem.errors.IntegrityError` is raised if
it disagrees. :attr:`Verifier.stats` counts what each path answered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from kvmem.errors import IntegrityError
from kvmem.integrity._check import Reason, validate_csr
from kvmem.integrity._step_checks import (
    length_mismatches,
    ranges,
    slot_mismatches,
    validate_step_fields,
    write_set,
)
from kvmem.integrity._tags import TagMirror, lifetime_of, namespace_id_of, qualify_live
from kvmem.integrity._tracker import IntegrityReport, Tracker

__all__ = ["Metadata", "Verdict", "Verifier", "VerifierStats"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]
_EMPTY = np.empty(0, dtype=np.int64)
# More changed rows than this: the proof starts over (one full gather is cheaper).
MAX_CHANGED_ROWS = 64


class Metadata(NamedTuple):
    """What the kernels of a step will read, shapes and dtypes checked
    (:func:`~kvmem.integrity.require_int_array`): the CSR (``indptr``, ``indices``) or a
    ``block_table``, and the step's other fields by ``StepMetadata.tensors`` names (None when
    only the page lists were given). numpy arrays or torch tensors. The verifier checks the
    values that make it well formed (:func:`~kvmem.integrity.validate_csr`, the slot count)
    unless they are reserve's own."""

    indptr: Any
    indices: Any
    block_table: Any
    fields: Mapping[str, Any] | None
    is_numpy_csr: bool  # a CSR, every array a numpy array (the fast paths' domain)

    @classmethod
    def of(cls, indptr: Any, indices: Any, block_table: Any,
           fields: Mapping[str, Any] | None) -> Metadata:
        numpy = indices is not None and type(indptr) is np.ndarray and type(
            indices) is np.ndarray and (fields is None or all(
                type(v) is np.ndarray for v in fields.values() if v is not None))
        return cls(indptr, indices, block_table, fields, numpy)


class Verdict(NamedTuple):
    """Per failing batch index: (first bad page position, one readable reason)."""

    failed: dict[int, tuple[int, str]]
    report: IntegrityReport | None = None

    @property
    def ok(self) -> bool:
        return not self.failed


_PROVED = Verdict({})  # (never mutated)


class VerifierStats(NamedTuple):
    """What the verifier's paths answered so far (a snapshot).

    spliced_proved / spliced_declined: decode steps proved by the spliced check, or sent on
    incremental_proved / incremental_declined: batches proved by comparison, or sent on
    full_checks: full checks run (declined batches, tensors, block tables, paranoid mode)
    paranoid_checks: full checks run beside a fast "proved good" (all agreed, or it raised)
    """

    spliced_proved: int = 0
    spliced_declined: int = 0
    incremental_proved: int = 0
    incremental_declined: int = 0
    full_checks: int = 0
    paranoid_checks: int = 0


class _Table(Protocol):
    """What the verifier reads of the page table (kvmem.PageTable)."""

    pages: Int32Array
    num_tokens: Int64Array
    num_committed: Int64Array
    write_from: Int64Array
    generation: Int64Array
    page_size: int


class _Proof(NamedTuple):
    serial: int  # the step record whose own arrays were proved (-1: none)
    rows: IntpArray
    gens: Int64Array
    changes: int  # the tracker's num_changes when proved
    versions: Int64Array | None  # the rows' tracker versions then (None: not gathered)
    counts: Int64Array  # pages listed per row
    indptr: Int64Array
    indices: Int32Array


class Verifier:
    """Checks batches for a manager (see the module docstring).

    Parameters
    ----------
    tracker: the manager's tracker (the fast paths need a :class:`CheckingTracker`)
    table: the page table (rows, tokens, generations)
    tags, namespace_ids: ``[num_pages]``, int64 — the allocator's tags and each page's
        namespace id (read-only here)
    mirror: the qualified tags (host and device copies)
    changes: a reader of the allocator's change log, this verifier's own
    writers: ``pages -> [k]`` holders that may read or write each page's future slots
    """

    def __init__(self, tracker: Tracker, table: _Table, tags: Int64Array,
                 namespace_ids: Int64Array, mirror: TagMirror, changes: Any,
                 writers: Callable[[npt.NDArray[np.integer]], npt.NDArray[np.integer]]) -> None:
        self.tracker = tracker
        self.table = table
        self.page_size = table.page_size
        self._tags = tags
        self._namespace_ids = namespace_ids
        self.num_pages = tags.size
        self.mirror = mirror
        self._changes = changes
        self.writers = writers
        expected = getattr(tracker, "expected_tags", None)
        self._expected: Int64Array | None = expected
        self._versions: Int64Array | None = getattr(tracker, "versions", None)
        self._tracker = tracker if self._versions is not None else None
        self.paranoid = bool(getattr(tracker, "paranoid", False))
        self._proof: _Proof | None = None
        self._refs = np.zeros(self.num_pages, dtype=np.int32)  # proven entries per page
        self._stamp = np.zeros(self.num_pages, dtype=np.int64)  # scratch: distinct pages
        self._counts = dict.fromkeys(VerifierStats._fields, 0)

    @property
    def stats(self) -> VerifierStats:
        return VerifierStats(**self._counts)

    # -- the entry point ----------------------------------------------------------------------

    def check(self, ids: tuple[Any, ...], rows: IntpArray, md: Metadata,
              latest: Any = None) -> Verdict:
        """The verdict of the full check on ``rows`` (page-table rows of the batch ``ids``,
        distinct) and ``md``. ``latest``: the step record of the latest reserve, when it is
        this batch's and nothing was committed since (its private copies make the spliced check
        possible)."""
        if self._expected is not None and md.is_numpy_csr:
            proved = latest is not None and self._try("spliced", self.check_spliced(md, latest))
            if not proved:
                self._require_well_formed(rows, md)
                serial = -1  # the step record whose own arrays md holds, if any
                if latest is not None and _equal(md.indptr, latest.indptr) and _equal(
                        md.indices, latest.indices):
                    serial = latest.serial
                proved = self._try("incremental", self.check_incremental(rows, md, serial))
            if proved:
                if self.paranoid:
                    self._paranoid(ids, rows, md)
                return _PROVED
        self.forget()
        self._require_well_formed(rows, md)
        self._counts["full_checks"] += 1
        return self.full_check(ids, rows, md)

    def _require_well_formed(self, rows: IntpArray, md: Metadata) -> None:
        """Refuse (MetadataError) a CSR that is malformed as a whole or a slot mapping shorter
        than the batch's new tokens."""
        if md.indices is not None:
            validate_csr(md.indptr, md.indices, rows.size)
        if md.fields is not None and md.fields.get("slot_mapping") is not None:
            t = self.table
            new = int(t.num_tokens[rows].sum() - t.write_from[rows].sum())
            validate_step_fields({"slot_mapping": md.fields["slot_mapping"]}, rows.size, new)

    def _try(self, path: str, proved: bool) -> bool:
        self._counts[path + ("_proved" if proved else "_declined")] += 1
        return proved

    def _paranoid(self, ids: tuple[Any, ...], rows: IntpArray, md: Metadata) -> None:
        self._counts["paranoid_checks"] += 1
        verdict = self.full_check(ids, rows, md)
        if not verdict.ok:
            i, (_, reason) = next(iter(verdict.failed.items()))
            raise IntegrityError(
                f"paranoid verify: the fast path proved the batch good but the full check fails "
                f"batch index {i} ({reason}); this is a bug in kvmem's fast path, please report it"
            )

    def forget(self) -> None:
        """Drop the proof (the next fast check starts from nothing)."""
        if self._proof is not None:
            self._proof = None
            self._refs.fill(0)

    def _dirty(self) -> list[Int32Array] | None:
        """Pages whose tag changed since this verifier last looked (None: lost track)."""
        return self._changes.read()

    # -- the full check -----------------------------------------------------------------------

    def full_check(self, ids: tuple[Any, ...], rows: IntpArray, md: Metadata) -> Verdict:
        """Every entry, the write set and (given) the step's slots and lengths; one reason per
        failing request. Changes nothing but the tag mirror."""
        t = self.table
        P = self.page_size
        qtags = self.mirror.sync()
        total = t.num_tokens[rows]
        num_pages = (total + P - 1) // P
        read = md.indices if md.indices is not None else md.block_table
        tags: Any = qtags
        if not isinstance(read, np.ndarray):  # tensors: on their device, against the mirror
            import torch

            tags = self.mirror.device
            if tags is None or tags.device != read.device:
                tags = torch.as_tensor(qtags, device=read.device)
        if md.indices is None:
            report = self.tracker.verify(rows, num_pages, tags, block_table=md.block_table,
                                         ids=ids)
        else:
            report = self.tracker.verify(rows, num_pages, tags, kv_indptr=md.indptr,
                                         kv_indices=md.indices, ids=ids)
        failed: dict[int, tuple[int, str]] = {}
        e = report.entries
        for k in np.argsort(e.position, kind="stable").tolist():
            i = int(e.batch_index[k])
            if i not in failed:
                failed[i] = (max(int(e.position[k]), 0),
                             describe(e, k, int(np.count_nonzero(e.batch_index == i))))
        for i, pos, reason in self._write_failures(rows, md):
            first, why = failed.get(i, (pos, reason))
            failed[i] = (min(first, pos), why)
        return Verdict(dict(sorted(failed.items())), None if report.ok else report)

    def _write_failures(self, rows: IntpArray, md: Metadata) -> list[tuple[int, int, str]]:
        """(batch index, page position, reason) of each failing write: a written page with
        another holder, a stray slot, lengths that are not the request's."""
        t = self.table
        P = self.page_size
        start = t.write_from[rows]
        total = t.num_tokens[rows]
        out: list[tuple[int, int, str]] = []
        wb, wpos, wpages = self.write_set(rows, md.fields)
        holders = self.writers(wpages)
        for k in np.flatnonzero(holders != 1).tolist():
            out.append((int(wb[k]), int(wpos[k]),
                        f"page {int(wpages[k])} at position {int(wpos[k])} is about to be "
                        f"written but has {int(holders[k])} holders (a shared page is written "
                        "only after copy-on-write)"))
        if md.fields is None:
            return out
        first_new = start // P
        for i in length_mismatches(md.fields, total, total - start, P).tolist():
            out.append((i, int(first_new[i]),
                        "its step's lengths (seq_lens, kv_last_page_len, num_new_tokens or "
                        "qo_indptr) are not its own: a kernel would read past its tokens or "
                        "another request's queries"))
        if md.fields.get("slot_mapping") is not None:
            csr = {"kv_indptr": md.indptr, "kv_indices": md.indices} if md.indices is not None \
                else {"block_table": md.block_table}
            bad_b, bad_pos = slot_mismatches({**csr, "slot_mapping": md.fields["slot_mapping"]},
                                             start, total - start, P)
            for i, pos in zip(bad_b.tolist(), bad_pos.tolist()):
                out.append((i, pos, f"its slot mapping sends a token of page position {pos} "
                                    "outside the page its metadata lists there (another "
                                    "request's page, or the wrong slot)"))
        return out

    def write_set(self, rows: IntpArray, fields: Mapping[str, Any] | None
                  ) -> tuple[IntpArray, Int64Array, Int64Array]:
        """(batch index, page position, page) of each token the step is about to write: the
        slots its latest reserve handed out that nobody committed yet, in the pages the step's
        slot mapping names when given (slots out of range are left to the slot check), else in
        the page table's."""
        t = self.table
        P = self.page_size
        start = t.write_from[rows]
        done = np.maximum(t.num_committed[rows], start)
        total = t.num_tokens[rows]
        wb, wpos, wpages = write_set(t.pages, rows, done, total, P)
        slots = None if fields is None else fields.get("slot_mapping")
        if slots is None:
            return wb, wpos, wpages
        first = np.cumsum(total - start) - (total - start)  # each row's first slot index
        at = ranges(first + done - start, total - done)
        picked = slots[at] if isinstance(slots, np.ndarray) else slots[at].cpu().numpy()
        spages = np.asarray(picked, dtype=np.int64) // P
        ok = (spages >= 0) & (spages < self.num_pages)
        return wb[ok], wpos[ok], spages[ok]

    # -- the spliced check (the decode loop) --------------------------------------------------

    def check_spliced(self, md: Metadata, b: Any) -> bool:
        """True only if the full check would find nothing in ``md``, the metadata of the step
        record ``b`` (the latest reserve: its private copies ``b.indptr``, ``b.indices``, its
        splice of the batch the current proof covers). False: look closer."""
        s = b.splice
        p = self._proof
        if s is None or p is None or s.base_serial != p.serial or self._expected is None:
            return False
        # Nothing re-recorded (tracker.record / forget) since the proof.
        if not self._changes_now() == b.tracker_changes == p.changes:
            return False
        if not (_equal(md.indptr, b.indptr) and _equal(md.indices, b.indices)
                and self._step_ok(b, md.fields)):
            return False
        if self._kept_unchanged(s.gone) and self._fresh_ok(s.pages, s.wants):
            self._proof = _Proof(b.serial, b.rows, b.gens, p.changes, None, b.counts,
                                 b.indptr.astype(np.int64), b.indices)
            return True
        self.forget()  # the counts were half updated: start over
        return False

    def _changes_now(self) -> int:
        return int(getattr(self._tracker, "num_changes", -1))

    def _step_ok(self, b: Any, fields: Mapping[str, Any] | None) -> bool:
        """The step's writes are the manager's: for a one-token step in a few calls (its given
        fields equal reserve's copies, each token lands in the last page its row lists, one
        writer each); otherwise the general checks."""
        if b.k != 1 or b.token_pages is None:
            return self._writes_ok(b.rows, fields, b.indptr, b.indices)
        if fields is not None:
            get = fields.get
            slot_mapping, seq_lens = get("slot_mapping"), get("seq_lens")
            last_len, num_new, qo = get("kv_last_page_len"), get("num_new_tokens"), get(
                "qo_indptr")
            if not ((slot_mapping is None or _equal(slot_mapping, b.slots))
                    and (seq_lens is None or _equal(seq_lens, b.end))
                    and (last_len is None or _equal(last_len - 1, b.offsets))
                    and (num_new is None or (num_new.shape == b.rows.shape
                                             and not np.count_nonzero(num_new != 1)))
                    and (qo is None or _equal(qo, b.qo_indptr))):
                return False
        # reserve's record is consistent by construction (slots = token_pages * P + offsets,
        # end = start + 1); paranoid mode checks that trust beside every answer.
        return (_equal(self.table.num_tokens[b.rows], b.end)
                and _equal(b.indices[b.indptr[1:] - 1], b.token_pages)
                and not np.count_nonzero(self.writers(b.token_pages) != 1))

    # -- the incremental check ----------------------------------------------------------------

    def check_incremental(self, rows: IntpArray, md: Metadata, serial: int = -1) -> bool:
        """True only if the full check would find nothing (False: look closer); the proof then
        covers ``md`` (tagged with the step record ``serial`` whose own arrays ``md`` holds)."""
        assert self._expected is not None
        t = self.table
        P = self.page_size
        indptr, indices = md.indptr, md.indices
        counts = indptr[1:] - indptr[:-1]
        need = (t.num_tokens[rows] + (P - 1)) // P
        if not np.array_equal(counts, need) or not self._writes_ok(rows, md.fields, indptr,
                                                                    indices):
            return False
        gens = t.generation[rows]
        changes = self._changes_now()
        assert self._versions is not None
        versions = self._versions[rows]
        p = self._proof
        changed: IntpArray = np.empty(0, dtype=np.intp)
        first = None
        if p is not None:
            kept = gens == p.gens if p.rows.size == rows.size else None
            if kept is not None and changes != p.changes:  # re-recorded since: which rows?
                kept = kept & (versions == p.versions) if p.versions is not None else None
            if kept is not None:
                first = np.where(kept, p.counts, 0)  # entries each row keeps from the proof
                changed = ((counts != first) | ~kept).nonzero()[0]
            if kept is None or changed.size > MAX_CHANGED_ROWS:  # another batch: start over
                self.forget()
                p = None
        if p is None or first is None:  # nothing proven: every entry is new
            self._dirty()  # (what changed before is no news to an empty proof)
            pages = indices
            want = self._expected[np.repeat(rows, counts),
                                  np.arange(indices.size) - np.repeat(indptr[:-1], counts)]
            proven = indices.astype(np.int32)
        else:
            got = self._splice_proof(p, rows, indptr, indices, counts, first, changed)
            if got is None:
                return False
            proven, pages, want = got
        if not self._fresh_ok(pages, want):
            return False
        self._proof = _Proof(serial, rows, gens, changes, versions, counts.astype(np.int64),
                             indptr.astype(np.int64), proven)
        return True

    def _splice_proof(self, p: _Proof, rows: IntpArray, indptr: Any, indices: Any,
                      counts: Any, first: Int64Array, changed: IntpArray
                      ) -> tuple[Int32Array, Any, Int64Array] | None:
        """Cut the proof at the changed rows, splice the new entries in, compare with
        ``indices``; check the kept pages' tags. (proof-to-be, new pages, their recorded tags),
        or None (look closer)."""
        assert self._expected is not None
        first = first[changed]
        if (counts[changed] < first).any():
            return None
        spec = zip((indptr[changed] + first).tolist(), indptr[changed + 1].tolist(),
                   (p.indptr[changed] + first).tolist(), p.indptr[changed + 1].tolist(),
                   rows[changed].tolist(), first.tolist(), counts[changed].tolist())
        old = p.indices
        parts: list[Any] = []  # proven kept runs, then new entries
        fresh: list[Any] = []
        wants: list[Int64Array] = []
        gone: list[Int32Array] = []
        at = 0
        for new_at, end_new, old_at, end_old, row, lo, hi in spec:
            parts.append(old[at:old_at])
            piece = indices[new_at:end_new]
            parts.append(piece)
            fresh.append(piece)
            wants.append(self._expected[row, lo:hi])
            if end_old > old_at:
                gone.append(old[old_at:end_old])
            at = end_old
        parts.append(old[at:])
        proven = np.concatenate(parts) if len(parts) > 1 else old
        # The kept runs sit where the new entries' rows say (counts were checked), so one
        # comparison proves every kept entry equal to the one proven before.
        if not np.array_equal(proven, indices) or not self._kept_unchanged(gone):
            return None
        pages = np.concatenate(fresh) if fresh else _EMPTY
        want = np.concatenate(wants) if wants else _EMPTY
        return proven.astype(np.int32, copy=False), pages, want

    def _kept_unchanged(self, gone: list[Int32Array]) -> bool:
        """Take the entries ``gone`` out of the per-page counts; then no page the proven
        entries still list may have changed tag since the last look."""
        refs = self._refs
        if gone:  # (a page listed twice in one scatter counts once: errs high, still safe)
            refs[np.concatenate(gone) if len(gone) > 1 else gone[0]] -= 1
        dirty = self._dirty()
        if dirty is None:
            return False
        return not (dirty and np.count_nonzero(
            refs[np.concatenate(dirty) if len(dirty) > 1 else dirty[0]]))

    def _fresh_ok(self, pages: npt.NDArray[np.integer], want: Int64Array) -> bool:
        """Entries checked in full: in range, live qualified tag == the recorded one (never 0:
        unrecorded); then counted in the per-page counts."""
        if not pages.size:
            return True
        pages = pages.astype(np.intp)
        if int(pages.min()) < 0 or int(pages.max()) >= self.num_pages:
            return False
        live = qualify_live(self._tags[pages], self._namespace_ids[pages])
        if not _equal(live, want) or np.count_nonzero(want) != want.size:
            return False
        self._count_refs(pages)
        return True

    def _count_refs(self, pages: npt.NDArray[np.integer]) -> None:
        """``refs[p] += 1`` once per listing of ``p`` (never fewer: a count that is too low
        could hide a changed page; one too high only costs a full check)."""
        refs = self._refs
        if pages.size <= 64:  # (add.at is the cheaper of the two up to here)
            np.add.at(refs, pages, 1)
        elif pages.size > 4096:
            refs += np.bincount(pages, minlength=self.num_pages).astype(np.int32)
        else:
            index = np.arange(pages.size)
            self._stamp[pages] = index
            if _equal(self._stamp[pages], index):  # distinct: a plain scatter
                refs[pages] += 1
            else:
                np.add.at(refs, pages, 1)

    def _writes_ok(self, rows: IntpArray, fields: Mapping[str, Any] | None, indptr: Any,
                   indices: Any) -> bool:
        """One writer per written page; given the step's fields, its slots (against the CSR
        ``indptr``, ``indices``) and lengths are the manager's."""
        _, _, pages = self.write_set(rows, fields)
        if np.count_nonzero(self.writers(pages) != 1):
            return False
        if fields is None:
            return True
        t = self.table
        start = t.write_from[rows]
        total = t.num_tokens[rows]
        if length_mismatches(fields, total, total - start, self.page_size).size:
            return False
        slots = fields.get("slot_mapping")
        return slots is None or not slot_mismatches(
            {"kv_indptr": indptr, "kv_indices": indices, "slot_mapping": slots},
            start, total - start, self.page_size)[0].size


def _equal(a: Any, b: Any) -> bool:
    """``np.array_equal`` of numpy arrays without its conversions."""
    return bool(a.shape == b.shape and not np.count_nonzero(a != b))


def describe(e: Any, k: int, num_bad: int) -> str:
    """One readable line for bad entry ``k`` of :class:`BadEntries` (qualified tags decoded)."""
    reason, pos, page = int(e.reason[k]), int(e.position[k]), int(e.page[k])
    expected, found = int(e.expected_tag[k]), int(e.found_tag[k])
    more = f" ({num_bad} bad entries)" if num_bad > 1 else ""
    if reason == Reason.REALLOCATED and lifetime_of(expected) == lifetime_of(found):
        what = (f"page holds namespace {namespace_id_of(found)}'s content, the request is in "
                f"namespace {namespace_id_of(expected)}")
    elif reason == Reason.LENGTH:
        return f"{Reason.NAMES[reason]}{more}"
    else:
        what = Reason.NAMES.get(reason, f"reason {reason}")
        if expected > 0 and found > 0:
            what += f" (expected tag {lifetime_of(expected)}, found {lifetime_of(found)})"
    return f"{what}: position {pos}, page {page}{more}"
