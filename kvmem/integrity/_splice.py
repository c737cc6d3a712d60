"""The spliced fast path's contract: how a step's CSR is patched from the one before, and what
the verifier reads of a reserved step to prove it without the full check.

``reserve`` builds a step's ``kv_indices`` by splicing (``kvmem.allocator.StepBuilder``): it
keeps the runs of the base step's entries whose rows did not change and puts the changed rows'
new entries between them; the verifier proves a step by the same operation on its proof
(``kvmem.integrity.Verifier``). Both call :func:`splice`::

    old        | a a a | b b | c c c c |          kept runs (lo, hi) of old, new pieces between
    kept       | a a a |     | c c c c |          b's entries cut (gone), b' and d spliced in
    result     | a a a | b' b' b' | c c c c | d |

:class:`SplicedStep` is what the verifier reads of a reserved step (``StepRecord`` has these
fields; mypy checks it against this protocol where the manager hands one over), and
:class:`Splice` how its ``indices`` were patched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["DecodeSlots", "Splice", "SplicedStep", "checked_beside", "max_spliced_rows", "splice"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]
_EMPTY_TAGS = np.empty(0, dtype=np.int64)
_EMPTY_TAGS.flags.writeable = False


def max_spliced_rows(num_entries: int, proved: bool = False) -> int:
    """Changed rows up to which patching a CSR of ``num_entries`` entries (reserve's
    ``kv_indices``, the verifier's proof) beats rebuilding it: a splice costs a few
    microseconds of Python a row, a rebuild about one per thousand entries; ``proved``: the
    rebuild also restarts a proof, whose full check of every entry costs 15-30 ns each."""
    return min(64, 8 + num_entries // (256 if proved else 1024))


def checked_beside(size: int, proven_size: int) -> bool:
    """Whether a batch of ``size`` rows is checked beside the proven batch of ``proven_size``
    (alone, in full, the proof kept: a prefill chunk between decode steps) rather than taking
    the proof's place."""
    return size < proven_size and size <= max(8, proven_size // 8)


class Splice(NamedTuple):
    """How a step's ``indices`` was patched from its base's: ``changed`` the batch positions
    whose entries were cut or added (``[c]``, intp), ``pages`` the entries spliced in (a
    snapshot, in order), ``wants`` the qualified tags the tracker had recorded for them then
    (empty without a CheckingTracker), ``gone`` the base's entries cut out."""

    base_serial: int
    changed: IntpArray
    pages: Int32Array
    wants: Int64Array
    gone: list[Int32Array]


class DecodeSlots(NamedTuple):
    """Where a decode step's one token per row lands: its page (``[B]``, int32), its slot
    within the page (``[B]``, int64) and the page's position in the row (``[B]``, int64)."""

    token_pages: Int32Array
    offsets: Int64Array
    cols: Int64Array


class SplicedStep(Protocol):
    """What the verifier reads of a reserved step (``kvmem.allocator.StepRecord``): its
    private copies of the arrays ``reserve`` handed out and the state it was built from.

    ``decode`` is set for the decode step (``k == 1``, no copy-on-write): where each row's one
    token lands.
    """

    serial: int
    rows: IntpArray  # [B] page-table rows, read-only
    rows_w: Int64Array  # rows * max_pages_per_seq
    gens: Int64Array  # the rows' generations when built
    tracker_changes: int  # the tracker's num_changes when built (-1: no checking tracker)
    counts: Int64Array  # [B] pages listed per row
    indptr: Int32Array  # [B + 1]
    indices: Int32Array  # [nnz]
    qo_indptr: Int32Array  # [B + 1]
    start: Int64Array  # [B] tokens each row held before the reserve ...
    end: Int64Array  # ... and after it
    k: int  # tokens per row when the batch got one count (-1: per-row counts)
    slots: Int64Array  # [T] the new tokens' slots
    decode: DecodeSlots | None  # the decode step's token pages, offsets, columns
    splice: Splice | None  # how indices was patched from the base step's (None: gathered)


def splice(old: npt.NDArray[Any], kept_lo: Sequence[int], kept_hi: Sequence[int],
           new: npt.NDArray[Any], new_lo: Sequence[int], new_num: Sequence[int],
           tags: Int64Array | None = None, tags_lo: Sequence[int] | None = None
           ) -> tuple[npt.NDArray[Any], npt.NDArray[Any], Int64Array, list[npt.NDArray[Any]]]:
    """``old[kept_lo[0]:kept_hi[0]]``, ``new[new_lo[0]:][:new_num[0]]``, ``old[kept_lo[1]:
    kept_hi[1]]``, … ``old[kept_lo[m]:kept_hi[m]]``, concatenated (``m + 1`` kept runs of
    ``old``, ascending and disjoint; ``m`` new pieces between them).

    Returns (the result, the new pieces concatenated, ``tags[tags_lo[i]:][:new_num[i]]``
    concatenated (empty without ``tags``; ``tags_lo`` defaults to ``new_lo``), the runs of
    ``old`` left out (gone), in order).
    """
    parts: list[npt.NDArray[Any]] = []
    pieces: list[npt.NDArray[Any]] = []
    wants: list[Int64Array] = []
    gone: list[npt.NDArray[Any]] = []
    at = 0  # the end of the last kept run
    for lo, hi, a, n, t in zip(kept_lo, kept_hi, new_lo, new_num,
                               new_lo if tags_lo is None else tags_lo):
        if lo > at:
            gone.append(old[at:lo])
        parts.append(old[lo:hi])
        piece = new[a : a + n]
        parts.append(piece)
        pieces.append(piece)
        if tags is not None:
            wants.append(tags[t : t + n])
        at = hi
    lo, hi = kept_lo[-1], kept_hi[-1]
    if lo > at:
        gone.append(old[at:lo])
    if old.size > hi:
        gone.append(old[hi:])
    if not pieces:
        return old[lo:hi], new[:0], _EMPTY_TAGS, gone
    parts.append(old[lo:hi])
    return (np.concatenate(parts), np.concatenate(pieces),
            np.concatenate(wants) if wants else _EMPTY_TAGS, gone)
