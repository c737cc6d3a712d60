"""The verifier: the verdict of the full check (``kvmem.integrity._full_check``) on a
batch's metadata, proved incrementally for a fraction of its cost when it can be.

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

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvmem.errors import IntegrityError
from kvmem.integrity._check import validate_csr
from kvmem.integrity._full_check import FullCheck, Verdict, Writers, _Table
from kvmem.integrity._metadata import Metadata
from kvmem.integrity._recorder import Recorder
from kvmem.integrity._splice import SplicedStep, checked_beside, max_spliced_rows, splice
from kvmem.integrity._step_checks import length_mismatches, slot_mismatches, validate_step_fields
from kvmem.integrity._tags import TagMirror, qualify_live

__all__ = ["Verifier", "VerifierStats"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]
_EMPTY = np.empty(0, dtype=np.int64)


_ONE = np.int32(1)  # np.add.at with a same-dtype one: numpy 2's fast path


_PROVED = Verdict({})  # (never mutated)
# The most rows of a step, besides its one-token rows, whose writes the spliced check looks at
# one by one (a decode step that requests joined; as kvmem.allocator's reserve_mixed takes).
MIXED_TAIL = 8


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


class _Proof(NamedTuple):
    serial: int  # the step record whose own arrays were proved (-1: none)
    rows: IntpArray
    gens: Int64Array
    changes: int  # the tracker's num_changes when proved
    versions: Int64Array | None  # the rows' tracker versions then (None: not gathered)
    counts: Int64Array  # pages listed per row
    indptr: Int64Array
    indices: Int32Array


class Verifier(FullCheck):
    """Checks batches for a manager (see the module docstring).

    Parameters
    ----------
    recorder: the manager's records in its tracker (the fast paths need a
        :class:`CheckingTracker`'s)
    table: the page table (rows, tokens, generations)
    tags, namespace_ids: ``[num_pages]``, int64 — the allocator's tags and each page's
        namespace id (read-only here)
    mirror: the qualified tags (host and device copies)
    changes: a reader of the allocator's change log, this verifier's own
    writers: ``pages -> [k]`` holders that may read or write each page's future slots
    """

    def __init__(self, recorder: Recorder, table: _Table, tags: Int64Array,
                 namespace_ids: Int64Array, mirror: TagMirror, changes: Any,
                 writers: Writers) -> None:
        super().__init__(recorder.tracker, table, mirror, writers)
        self._tags = tags
        self._namespace_ids = namespace_ids
        self.num_pages = tags.size
        self._changes = changes
        self._recorder = recorder
        self._expected: Int64Array | None = recorder.expected_tags
        self._versions: Int64Array | None = recorder.versions
        self.paranoid = recorder.paranoid
        self._proof: _Proof | None = None
        self._refs = np.zeros(self.num_pages, dtype=np.int32)  # proven entries per page
        self._counts = dict.fromkeys(VerifierStats._fields, 0)
        self._offsets = np.arange(self.page_size, dtype=np.int64)  # a slot's offset in its page
        # One request's step takes the checks sized for one row (False: the batch's, for a
        # differential test).
        self.per_request = True

    @property
    def stats(self) -> VerifierStats:
        return VerifierStats(**self._counts)

    # -- the entry point ----------------------------------------------------------------------

    def check(self, ids: tuple[Any, ...], rows: IntpArray, md: Metadata,
              latest: SplicedStep | None = None) -> Verdict:
        """The verdict of the full check on ``rows`` (page-table rows of the batch ``ids``,
        distinct) and ``md``. ``latest``: the step record of the latest reserve, when it is
        this batch's (its private copies make the spliced check possible; set aside when some
        of its slots were committed since: the write set is no longer the step's)."""
        if latest is not None and np.count_nonzero(self.table.num_committed[rows] > latest.start):
            latest = None
        checked = False  # md was found well formed
        if self._expected is not None and md.is_numpy_csr:
            proved = latest is not None and self.check_spliced(md, latest)
            if proved:
                self._try("spliced", True)
            else:
                own = latest is not None and _equal(md.indptr, latest.indptr) and _equal(
                    md.indices, latest.indices)  # md holds the record's own CSR
                # Refuse malformed metadata before any counter or the proof changes (reserve's
                # own CSR is well formed by construction; its slot mapping is the caller's).
                self._require_well_formed(rows, md, csr=not own)
                checked = not own
                if latest is not None:
                    self._try("spliced", False)
                proved = self._try("incremental",
                                   self.check_incremental(rows, md, latest if own else None))
            if proved:
                if self.paranoid:
                    self._paranoid(ids, rows, md)
                return _PROVED
        if not checked:
            self._require_well_formed(rows, md)
        self.forget()
        self._counts["full_checks"] += 1
        return self.full_check(ids, rows, md)

    def _require_well_formed(self, rows: IntpArray, md: Metadata, csr: bool = True) -> None:
        """Refuse (MetadataError) a CSR that is malformed as a whole (``csr``: check it) or a
        slot mapping shorter than the batch's new tokens."""
        if csr and md.indices is not None:
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

    # -- the spliced check (the decode loop) --------------------------------------------------

    def check_spliced(self, md: Metadata, b: SplicedStep) -> bool:
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
        return self._recorder.num_changes

    def _step_ok(self, b: SplicedStep, fields: Mapping[str, Any] | None) -> bool:
        """The step's writes are the manager's, for ``b``, the latest reserve's record, whose
        own CSR the metadata holds: its given fields equal reserve's private copies, the rows
        hold what reserve left them, and each written page has one writer. (reserve's record
        is consistent by construction: slots from the rows' pages at their offsets, lengths
        from the token counts; paranoid mode checks that trust beside every answer.)"""
        t = self.table
        P = self.page_size
        d = b.decode
        if fields is not None:
            get = fields.get
            slot_mapping, seq_lens = get("slot_mapping"), get("seq_lens")
            last_len, num_new, qo = get("kv_last_page_len"), get("num_new_tokens"), get(
                "qo_indptr")
            if not ((slot_mapping is None or _equal(slot_mapping, b.slots))
                    and (seq_lens is None or _equal(seq_lens, b.end))
                    and (last_len is None or (_equal(last_len - 1, d.offsets) if d is not None
                                              else _equal(last_len, (b.end - 1) % P + 1)))
                    and (num_new is None or (
                        (num_new.shape == b.rows.shape and not np.count_nonzero(num_new != 1))
                        if d is not None else _equal(num_new, b.end - b.start)))
                    and (qo is None or _equal(qo, b.qo_indptr))):
                return False
        if not _equal(t.num_tokens[b.rows], b.end):
            return False
        # Without a slot mapping the step writes into the pages the page table lists.
        by_table = fields is None or fields.get("slot_mapping") is None
        if d is not None:  # the decode step: each token lands in the last page its row lists
            return (_equal(b.indices[b.indptr[1:] - 1], d.token_pages)
                    and (not by_table or _equal(t.pages.reshape(-1)[b.rows_w + d.cols],
                                                d.token_pages))
                    and not np.count_nonzero(self.writers(d.token_pages) != 1))
        if by_table:
            return self._writes_ok(b.rows, fields, b.indptr, b.indices)
        # reserve's slots come from the page table and its CSR partly from the base step's: a
        # row entry changed behind the manager's back since would make them disagree.
        if self.per_request:
            if b.rows.size == 1:
                return self._one_row_writes_ok(b)
            mixed = self._mixed_writes_ok(b)
            if mixed is not None:
                return mixed
        return not (b.slots.size and (np.count_nonzero(self.writers(b.slots // P) != 1)
                                      or slot_mismatches({"kv_indptr": b.indptr,
                                                          "kv_indices": b.indices,
                                                          "slot_mapping": b.slots},
                                                         b.start, b.end - b.start, P)[0].size))

    def _one_row_writes_ok(self, b: SplicedStep) -> bool:
        """The last check of :meth:`_step_ok` for one request's step (a prefill chunk): its
        slots are its CSR row's pages at the tokens' offsets, and each page it writes has one
        writer. The same answer as the batch's ``slot_mismatches`` and ``writers`` over every
        slot, from a slice of the row: the slots equal, they land in exactly these pages."""
        P = self.page_size
        start, end = int(b.start[0]), int(b.end[0])
        if end == start:
            return True
        first, skip = divmod(start, P)
        pages = b.indices[first : -(-end // P)]
        want = (np.multiply(pages[:, None], P, dtype=np.int64) + self._offsets).reshape(-1)
        return (_equal(b.slots, want[skip : skip + end - start])
                and not np.count_nonzero(self.writers(pages) != 1))

    def _mixed_writes_ok(self, b: SplicedStep) -> bool | None:
        """The last check of :meth:`_step_ok` for a decode step that a few requests joined
        (every row one new token but at most ``MIXED_TAIL``): the one-token rows' slots are
        the last pages of their CSR rows at the tokens' offsets (vectorized), each other
        row's as :meth:`_one_row_writes_ok` finds them, and each page written has one writer.
        The same answer as the batch's ``slot_mismatches`` and ``writers`` over every slot;
        None when more rows are not of one token (the caller takes the batch's check)."""
        P = self.page_size
        new = b.end - b.start
        other = (new != 1).nonzero()[0]
        if other.size > MIXED_TAIL or b.slots.size != int(b.qo_indptr[-1]):
            return None
        one = (new == 1).nonzero()[0] if other.size else slice(None)
        start = b.start[one]
        at = b.indptr[:-1][one] + start // P  # (each one-token row's page in its CSR row)
        if np.count_nonzero(at >= b.indptr[1:][one]):
            return False
        pages = [b.indices[at]]
        want = np.multiply(pages[0], P, dtype=np.int64)
        want += start % P
        if not _equal(b.slots[b.qo_indptr[:-1][one]], want):
            return False
        for i, first_slot in zip(other.tolist(), b.qo_indptr[other].tolist()):
            lo, hi = int(b.start[i]), int(b.end[i])
            if hi == lo:
                continue
            first, skip = divmod(lo, P)
            row = b.indices[int(b.indptr[i]) : int(b.indptr[i + 1])][first : -(-hi // P)]
            slots = (np.multiply(row[:, None], P, dtype=np.int64) + self._offsets).reshape(-1)
            if not _equal(b.slots[first_slot : first_slot + hi - lo], slots[skip : skip + hi - lo]):
                return False
            pages.append(row)
        written = np.concatenate(pages) if len(pages) > 1 else pages[0]
        return not np.count_nonzero(self.writers(written) != 1)

    # -- the incremental check ----------------------------------------------------------------

    def check_incremental(self, rows: IntpArray, md: Metadata,
                          latest: SplicedStep | None = None) -> bool:
        """True only if the full check would find nothing (False: look closer); the proof then
        covers ``md``. ``latest``: the step record whose own arrays ``md`` holds, if any (the
        proof is tagged with it; its writes are checked against its private copies)."""
        assert self._expected is not None
        t = self.table
        P = self.page_size
        indptr, indices = md.indptr, md.indices
        counts = indptr[1:] - indptr[:-1]
        need = (t.num_tokens[rows] + (P - 1)) // P
        if not np.array_equal(counts, need) or not (
                self._step_ok(latest, md.fields) if latest is not None
                else self._writes_ok(rows, md.fields, indptr, indices)):
            return False
        serial = -1 if latest is None else latest.serial
        p = self._proof
        if p is not None and checked_beside(rows.size, p.rows.size):
            # A small batch beside the proven one (a prefill chunk between decode steps):
            # checked alone, in full, and the proof (and its change-log cursor) kept.
            if rows.size == 1 and self.per_request:  # (one request: a slice of its row)
                want = self._expected[int(rows[0]), : indices.size]
            else:
                want = self._expected[np.repeat(rows, counts),
                                      np.arange(indices.size) - np.repeat(indptr[:-1], counts)]
            return self._fresh_ok(indices, want, count=False)
        gens = t.generation[rows]
        changes = self._changes_now()
        assert self._versions is not None
        versions = self._versions[rows]
        changed: IntpArray = np.empty(0, dtype=np.intp)
        first = None
        if p is not None:
            kept = gens == p.gens if p.rows.size == rows.size else None
            if kept is not None and changes != p.changes:  # re-recorded since: which rows?
                kept = kept & (versions == p.versions) if p.versions is not None else None
            if kept is not None:
                first = np.where(kept, p.counts, 0)  # entries each row keeps from the proof
                changed = ((counts != first) | ~kept).nonzero()[0]
            if kept is None or changed.size > max_spliced_rows(indices.size, proved=True):
                # another batch, or so many changed rows that checking every entry afresh
                # costs less than splicing them into the proof: start over
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
        # Kept: the proof's entries up to each changed row's cut and from its end on.
        end_old = p.indptr[changed + 1].tolist()
        proven, pages, want, gone = splice(
            p.indices, [0, *end_old], [*(p.indptr[changed] + first).tolist(), p.indices.size],
            indices, (indptr[changed] + first).tolist(), (counts[changed] - first).tolist(),
            self._expected.reshape(-1),
            (rows[changed] * self._expected.shape[1] + first).tolist())
        # The kept runs sit where the new entries' rows say (counts were checked), so one
        # comparison proves every kept entry equal to the one proven before.
        if not np.array_equal(proven, indices) or not self._kept_unchanged(gone):
            return None
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

    def _fresh_ok(self, pages: npt.NDArray[np.integer], want: Int64Array,
                  count: bool = True) -> bool:
        """Entries checked in full: in range, live qualified tag == the recorded one (never 0:
        unrecorded); then (``count``) counted in the per-page counts."""
        if not pages.size:
            return True
        pages = pages.astype(np.intp)
        if int(pages.min()) < 0 or int(pages.max()) >= self.num_pages:
            return False
        live = qualify_live(self._tags[pages], self._namespace_ids[pages])
        if not _equal(live, want) or np.count_nonzero(want) != want.size:
            return False
        if count:
            self._count_refs(pages)
        return True

    def _count_refs(self, pages: npt.NDArray[np.integer]) -> None:
        """``refs[p] += 1`` once per listing of ``p`` (never fewer: a count that is too low
        could hide a changed page)."""
        np.add.at(self._refs, pages, _ONE)  # (faster than a bincount or a distinct scatter)

    def _writes_ok(self, rows: IntpArray, fields: Mapping[str, Any] | None, indptr: Any,
                   indices: Any) -> bool:
        """One writer per written page; given the step's fields, its slots (against the CSR
        ``indptr``, ``indices``) and lengths are the manager's."""
        _, _, pages = self.write_set(rows, fields)
        if np.count_nonzero(self.writers(pages) != 1):
            return False
        t = self.table
        start = t.write_from[rows]
        total = t.num_tokens[rows]
        given = None if fields is None else fields.get("slot_mapping")
        if given is None and self.table_write_mismatches(  # it writes where the table says
                rows, {"kv_indptr": indptr, "kv_indices": indices})[0].size:
            return False
        if fields is None:
            return True
        if length_mismatches(fields, total, total - start, self.page_size).size:
            return False
        slots = given
        return slots is None or not slot_mismatches(
            {"kv_indptr": indptr, "kv_indices": indices, "slot_mapping": slots},
            start, total - start, self.page_size)[0].size


def _equal(a: Any, b: Any) -> bool:
    """``np.array_equal`` of numpy arrays without its conversions."""
    return bool(a.shape == b.shape and not np.count_nonzero(a != b))


