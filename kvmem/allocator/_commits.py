"""Commit: the engine wrote the K/V of these tokens; pages that filled become reusable.

A row's committed tokens are recorded in the page-token store (``Pages.tokens``, written only
here) and every page that a commit fills is offered to the prefix cache, chained from the
row's last offered page (``PageTable.prefix_keys``). A page is never offered before all its
tokens are committed, so a same-step prefix hit can never map a page whose K/V is not written
yet (BUGS 6). One request's commit (a prefill chunk) takes :meth:`Committer.commit_one`, sized
for one row (Python ints, slices of the row), a few rows :meth:`Committer.commit_few` (a slice
of each row, one offer), a batch :meth:`Committer.commit`; all give the same state and raise
the same errors (``Committer.per_request`` switches the first two off)::

    row    | full p0 | full p1 | p2 (5/16) |        commit 11 more tokens
    row    | full p0 | full p1 | full p2 | p3 (0/16) ...   -> p2 offered: key(p2) = f(key(p1), p2)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import INT32_MAX, holds_a_bool, is_integer_like, show, token_array
from kvmem.allocator._page_table import PageTable
from kvmem.allocator._pages import Pages
from kvmem.allocator._step_metadata import StepBuilder, StepRecord
from kvmem.errors import ArgumentError, ArgumentTypeError

__all__ = ["Committer", "batch_tokens", "keys_as_ints"]

# The most rows of a commit that commit_few writes row by row (numpy's fixed cost per call is
# what a few requests' prefill chunks pay); more take the batch's vectorized commit.
FEW_ROWS = 4

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]
KeyArray = npt.NDArray[np.uint64]
# fn(row, page keys, parent key (None at the prompt's start), token ids) per run of pages a
# commit inserted into the cache: what a KV event (PagesStored) says.
OnStored = Callable[[int, tuple[int, ...], "int | None", tuple[int, ...]], None]
# fn(pages [k] int32, their prefix keys [k, 2] uint64, namespace ids [k] int64) with the pages a
# commit inserted into the cache (their K/V is written): a write-through tier's stores.
OnCached = Callable[[Int32Array, KeyArray, Int64Array], None]


def keys_as_ints(keys: KeyArray) -> list[int]:
    """128-bit keys ``[k, 2]`` as Python ints (as vLLM's events carry block hashes)."""
    return [int.from_bytes(k, "big") for k in
            np.ascontiguousarray(keys).view(np.dtype((np.void, 16))).ravel().tolist()]


class Committer:
    """Records committed tokens and offers full pages to the prefix cache.

    Parameters
    ----------
    table, pages, steps: the manager's page table, page references (with the cache) and step
        builder (the latest reserved batches, whose slots a decode commit reuses).
    on_stored: called per run of pages newly cached (KV events), or None.
    on_cached: called with every commit's newly cached pages (a write-through tier), or None.
    """

    def __init__(self, table: PageTable, pages: Pages, steps: StepBuilder,
                 on_stored: OnStored | None, on_cached: OnCached | None = None) -> None:
        self.table = table
        self.pages = pages
        self.steps = steps
        self.on_stored = on_stored
        self.on_cached = on_cached
        self._ones = np.ones(table.max_seqs, dtype=np.int64)
        self._ones.flags.writeable = False
        self._arange = np.arange(table.max_seqs + 1, dtype=np.int64)
        # One row's commit takes commit_one, the leading decode rows of a step that requests
        # joined commit_head (False: the batch path, for a differential test).
        self.per_request = True

    def commit_batch(self, ids: tuple[Any, ...], rows: IntpArray, counts: Int64Array | int,
                     flat: npt.NDArray[np.integer]) -> None:
        """:meth:`commit`, by the decode step's path when the batch commits one token per row
        into the slots a recent reserve handed out (:meth:`StepBuilder.uncommitted`)."""
        if isinstance(counts, int) and counts == 1:
            b = self.steps.uncommitted(ids, self.table.num_committed[rows])
            if b is not None:
                self.commit_decode(b, flat)
                return
            b = (self.steps.uncommitted_head(ids, self.table.num_committed[rows])
                 if self.per_request else None)
            if b is not None:
                self.commit_head(b, flat)
                return
        self.commit(rows, counts, flat, ids)

    def commit(self, rows: IntpArray, counts: Int64Array | int, flat: npt.NDArray[np.integer],
               ids: Sequence[Any]) -> None:
        """Tokens ``flat`` (row by row, ``counts`` each) are the rows' next committed ones.
        Raises, changing nothing, if a row commits more than it reserved."""
        if rows.size == 1 and self.per_request:
            self.commit_one(int(rows[0]), flat.size, flat, ids[0])
            return
        if rows.size <= FEW_ROWS and self.per_request:
            self.commit_few(rows, counts, flat, ids)
            return
        t = self.table
        start = t.num_committed[rows]
        end = start + counts
        over = end > t.num_tokens[rows]
        if np.count_nonzero(over):
            i = int(np.argmax(over))
            num = counts if isinstance(counts, int) else int(counts[i])
            raise ArgumentError(
                f"request {ids[i]!r} commits {num} tokens after {int(start[i])} but only "
                f"{int(t.num_tokens[rows[i]])} slots are reserved; reserve() them first "
                "(nothing was committed)"
            )
        if isinstance(counts, int) and counts == 1:  # the decode step: one token per request
            slots = t._slots(rows, start)
        else:
            slots = t._token_slots(rows, start, counts)
        self.pages.write_tokens(slots, flat)
        t.set_committed(rows, end)
        if self.pages.cache is not None:
            first = start // t.page_size
            full = end // t.page_size - first  # pages that just became full
            some = full.nonzero()[0]
            if some.size:  # (one token a row fills at most one page: offer's one-page path)
                self.offer(rows[some], first[some],
                           None if isinstance(counts, int) and counts == 1 else full[some])

    def commit_one(self, row: int, count: int, flat: npt.NDArray[np.integer],
                   request_id: Any) -> None:
        """:meth:`commit` of one row's ``count`` tokens ``flat``: the same checks and state,
        in Python ints and slices of the row (numpy's fixed cost per call is what one request
        pays)."""
        t = self.table
        start = int(t.num_committed[row])
        end = start + count
        reserved = int(t.num_tokens[row])
        if end > reserved:
            raise ArgumentError(
                f"request {request_id!r} commits {count} tokens after {start} but only "
                f"{reserved} slots are reserved; reserve() them first (nothing was committed)"
            )
        if count:
            self.pages.write_tokens(self._reserved_slots(row, start, end), flat)
        t.set_committed(row, end)
        first = start // t.page_size
        full = end // t.page_size - first  # pages that just became full
        if full > 0 and self.pages.cache is not None:
            if self.on_stored is not None:  # (the events' path is the batch's)
                self.offer(np.array([row], dtype=np.intp), np.array([first], dtype=np.int64),
                           np.array([full], dtype=np.int64))
                return
            self.offer_run(row, first, full)

    def commit_few(self, rows: IntpArray, counts: Int64Array | int,
                   flat: npt.NDArray[np.integer], ids: Sequence[Any]) -> None:
        """:meth:`commit` of a few rows (the prefill chunks of requests that joined a step):
        the same checks, writes and offers, each row's slots one slice of its row."""
        t = self.table
        P = t.page_size
        nums = [counts] * rows.size if isinstance(counts, int) else counts.tolist()
        rows_l = rows.tolist()
        starts = []
        for i, (row, num) in enumerate(zip(rows_l, nums)):
            start, reserved = int(t.num_committed[row]), int(t.num_tokens[row])
            if start + num > reserved:
                raise ArgumentError(
                    f"request {ids[i]!r} commits {num} tokens after {start} but only "
                    f"{reserved} slots are reserved; reserve() them first (nothing was "
                    "committed)")
            starts.append(start)
        # Every row's tokens are written before any page is offered (a page two rows share
        # gets its last writer's tokens, as the batch's one write leaves it).
        at = 0
        filled = []
        for b, (row, num, start) in enumerate(zip(rows_l, nums, starts)):
            if num:
                self.pages.write_tokens(t.row_slots(row, start, num), flat[at : at + num])
                at += num
            t.set_committed(row, start + num)
            if (start + num) // P > start // P:
                filled.append(b)
        if filled and self.pages.cache is not None:
            some = np.array(filled, dtype=np.intp)
            first = np.array([starts[b] // P for b in filled], dtype=np.int64)
            full = np.array([(starts[b] + nums[b]) // P for b in filled], dtype=np.int64) - first
            self.offer(rows[some], first,
                       None if isinstance(counts, int) and counts == 1 else full)

    def _reserved_slots(self, row: int, start: int, end: int) -> Int64Array:
        """The slots of a row's tokens ``start .. end-1``: those the latest reserve handed out
        when it reserved exactly them for this row alone and no row changed since (the
        prefill chunk just reserved), else read from the row."""
        b = self.steps.latest
        if (b is not None and b.rows.size == 1 and b.epoch == self.table.epoch
                and int(b.rows[0]) == row and int(b.start[0]) == start
                and int(b.end[0]) == end):
            return b.slots
        return self.table.row_slots(row, start, end - start)

    def offer_run(self, row: int, first: int, count: int) -> None:
        """:meth:`offer` of one row's ``count`` newly full pages from column ``first``."""
        t = self.table
        cache = self.pages.cache
        assert cache is not None
        pages = t.pages[row, first : first + count].copy()
        keys = cache.run_keys(t.prefix_keys[row], first, self.pages.tokens[pages])
        namespace_ids = np.full(count, t.namespace_ids[row], dtype=np.int64)
        inserted = cache.insert(keys, pages, namespace_ids)
        t.set_prefix_keys(row, keys[-1])
        if self.on_cached is not None and inserted.size:
            self._cached(pages, keys, namespace_ids, inserted)

    def commit_decode(self, b: StepRecord, tokens: npt.NDArray[np.integer]) -> None:
        """:meth:`commit` of one token per row of ``b``, the latest reserve's batch, when
        nothing was committed since: the tokens land in the slots it handed out."""
        d = b.decode
        assert d is not None
        self.pages.write_tokens(b.slots, tokens)
        self.table.set_committed(b.rows, b.end)
        if self.pages.cache is not None:
            full = (d.offsets == self.table.page_size - 1).nonzero()[0]  # pages that just filled
            if full.size:
                self.offer(b.rows[full], d.cols[full], None, d.token_pages[full])

    def commit_head(self, b: StepRecord, tokens: npt.NDArray[np.integer]) -> None:
        """:meth:`commit` of one token per row into the leading rows of ``b``, the latest
        reserve's batch (a decode step that requests joined), each reserved one token there
        and nothing committed since (:meth:`StepBuilder.uncommitted_head`): the tokens land
        in the first slots it handed out."""
        t = self.table
        P = t.page_size
        m = tokens.size
        rows, start, slots = b.rows[:m], b.start[:m], b.slots[:m]
        self.pages.write_tokens(slots, tokens)
        t.set_committed(rows, b.end[:m])
        if self.pages.cache is not None:
            full = (start % P == P - 1).nonzero()[0]  # pages that just filled
            if full.size:
                self.offer(rows[full], start[full] // P, None,
                           (slots[full] // P).astype(np.int32))

    def offer(self, rows: IntpArray, first: Int64Array, counts: Int64Array | None,
              pages: Int32Array | None = None) -> None:
        """Give newly full pages (runs of ``counts`` pages from column ``first``; one page each
        when ``counts`` is None, then ``pages`` may name them) to the cache."""
        t = self.table
        cache = self.pages.cache
        assert cache is not None
        last: Int64Array | None = None  # run ends (None: one page per run)
        if counts is None:  # one page per row: the decode step
            rep, cols, starts = rows, first, self._arange[: rows.size]
            counts = self._ones[: rows.size]
            if pages is None:
                pages = t.pages[rows, first]
        else:
            total = int(counts.sum())
            starts = np.cumsum(counts) - counts
            cols = np.repeat(first, counts) + np.arange(total) - np.repeat(starts, counts)
            rep = np.repeat(rows, counts)
            pages = t.pages[rep, cols]
            last = starts + counts - 1
        tokens = self.pages.tokens[pages]
        parent = t.prefix_keys[rows]
        keys = cache.page_keys(parent, counts, first, tokens)
        namespace_ids = t.namespace_ids[rep]
        inserted = cache.insert(keys, pages, namespace_ids)
        t.set_prefix_keys(rows, keys if last is None else keys[last])
        if self.on_cached is not None and inserted.size:
            self._cached(pages, keys, namespace_ids, inserted)
        if self.on_stored is not None and inserted.size:
            # A page listed by two rows (a fork's shared page, committed by both in one batch)
            # is cached once: one event, at its first listing.
            _, first_at = np.unique(pages, return_index=True)
            is_new = np.zeros(pages.size, dtype=bool)
            is_new[first_at[np.isin(pages[first_at], inserted)]] = True
            self._stored(rows, starts, counts, cols, keys, parent, tokens, is_new)

    def _cached(self, pages: Int32Array, keys: KeyArray, namespace_ids: npt.NDArray[np.integer],
                inserted: Int32Array) -> None:
        """``on_cached`` with the pages the cache took (each once, in commit order)."""
        assert self.on_cached is not None
        _, first_at = np.unique(pages, return_index=True)
        at = np.sort(first_at[np.isin(pages[first_at], inserted)])
        self.on_cached(pages[at], keys[at], namespace_ids[at].astype(np.int64))

    def _stored(self, rows: IntpArray, starts: Int64Array, counts: Int64Array,
                cols: Int64Array, keys: KeyArray, parent: KeyArray, tokens: Int32Array,
                is_new: npt.NDArray[np.bool_]) -> None:
        """One ``on_stored`` call per row's run of newly cached pages."""
        assert self.on_stored is not None
        parents = np.empty_like(keys)
        parents[1:] = keys[:-1]
        parents[starts] = parent
        for r, s, c in zip(rows.tolist(), starts.tolist(), counts.tolist()):
            sel = np.flatnonzero(is_new[s : s + c]) + s
            if sel.size:
                at_root = int(cols[sel[0]]) == 0
                self.on_stored(r, tuple(keys_as_ints(keys[sel])),
                               None if at_root else keys_as_ints(parents[sel[:1]])[0],
                               tuple(tokens[sel].reshape(-1).tolist()))


def batch_tokens(token_ids: Any, size: int
                 ) -> tuple[npt.NDArray[np.integer], Int64Array | int]:
    """A batch's committed tokens as (flat, counts): ``[B]`` ints (one each: counts 1),
    ``[B, k]`` (counts k), or ``B`` 1-D sequences (ragged: counts ``[B]``). Lists, arrays and
    tensors; raises ArgumentError naming what was wrong."""
    if hasattr(token_ids, "detach"):
        token_ids = token_ids.detach().cpu().numpy()
    if type(token_ids) is np.ndarray and token_ids.ndim == 1 and token_ids.shape[0] == size and (
            token_ids.dtype.kind in "iu") and size:  # the decode step's [B] ints
        if int(np.minimum.reduce(token_ids)) < 0 or int(np.maximum.reduce(token_ids)) > INT32_MAX:
            raise ArgumentError(f"token ids must be in 0..{INT32_MAX} (nothing was committed)")
        return token_ids, 1
    arr = None
    if isinstance(token_ids, np.ndarray) or (
            isinstance(token_ids, (list, tuple)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in token_ids)):
        arr = np.asarray(token_ids)
        if token_ids is not arr and arr.size == 0:
            arr = arr.astype(np.int64)
    if arr is not None and arr.ndim in (1, 2) and arr.shape[0] == size and (
            arr.size == 0 or arr.dtype.kind in "iu"):
        flat = arr.reshape(-1)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) > INT32_MAX):
            raise ArgumentError(f"token ids must be in 0..{INT32_MAX} (nothing was committed)")
        return flat, 1 if arr.ndim == 1 else int(arr.shape[1])
    if arr is not None and arr.dtype.kind not in "iuO" and arr.size:
        raise ArgumentTypeError(f"token_ids has dtype {arr.dtype}: expected integer token ids "
                                "(not bool, float or str); nothing was committed")
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__") or (
            isinstance(token_ids, np.ndarray) and token_ids.ndim == 0):
        raise ArgumentTypeError(f"token_ids={show(token_ids)}: expected [B] or [B, k] ints or B "
                                "token lists, one per request; nothing was committed")
    if len(token_ids) != size:
        raise ArgumentError(f"token_ids={show(token_ids)} holds {len(token_ids)} token lists for "
                            f"{size} requests: give one token (or token list) per request; "
                            "nothing was committed")
    fast = _ragged_lists(token_ids)
    if fast is not None:
        return fast
    odd = [t for t in token_ids if not is_integer_like(t) and not hasattr(t, "__len__")]
    if odd:
        raise ArgumentTypeError(f"token_ids holds {show(odd[0])}: expected integer token ids "
                                "(int or numpy integer; not bool, float or str); nothing was "
                                "committed")
    parts = [token_array(t, "token_ids") for t in token_ids]
    counts = np.array([p.size for p in parts], dtype=np.int64)
    return (np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)), counts


def _ragged_lists(token_ids: Sequence[Any]) -> tuple[Int64Array, Int64Array] | None:
    """``B`` lists of Python ints (a mixed step's commits, as the vLLM adapter gives them) in
    one conversion instead of one per row: (flat, counts), or None when a row is not a plain
    list or a check would fail (the row-by-row path then raises naming what is wrong)."""
    if not all(type(t) is list for t in token_ids):
        return None
    flat_list = list(chain.from_iterable(token_ids))
    try:
        flat = np.array(flat_list)
    except (ValueError, TypeError, OverflowError):
        return None
    counts = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    if not flat.size:
        return flat.astype(np.int64), counts
    if flat.ndim != 1 or flat.dtype.kind not in "iu" or holds_a_bool(flat_list, flat):
        return None
    if int(np.minimum.reduce(flat)) < 0 or int(np.maximum.reduce(flat)) > INT32_MAX:
        return None
    return flat.astype(np.int64), counts
