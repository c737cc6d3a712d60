"""GroupTable: every running request's pages in each KV cache group, the tag each page had when
the request mapped it, and a step's kernel metadata per group (:class:`HybridStep`).

::

    request r, 14 tokens computed, 4 reserved      full (page 4)   | 3 | 9 | 2 | 7 | 5 |
                                                   swa (page 4, W 6) | - | - | 8 | 1 | 6 |
                                                   gdn (state)       slot 11
    the step's kernel lists   full: 3 9 2 7 5 (first 0)   swa: 8 1 6 (first 2)   gdn: 11

A request owns one row (``0 .. max_seqs - 1``) in every group. A token group's row maps row
index ``i`` (tokens ``i * page_size ..``) to a page, or to ``RELEASED`` where the request let
go of it (a sliding window's pages before the next query's window) or never mapped it (a
prefix hit restores only the window's pages). Beside each page the row keeps the page's
lifetime tag at the time it was mapped: the expectations the batched check compares with
(``kvmem.integrity.check_hybrid_step``). A state group holds one slot per row, its tag and
the tokens the state has absorbed.

Numpy arrays, one writer (:class:`TokenRows`, :class:`StateRows`); a batch's operations are a
constant number of numpy calls whatever its size. The token groups' rows are slices of one
``[G, max_seqs, max_pages]`` pair of arrays (pages, tags), so a step's pages in every token
group are one gather (:class:`TokenKernels`), which the batched check compares in one pass.
Pages are allocated and freed by the caller (the hybrid manager, through its
:class:`~kvmem.allocator.GroupAllocator`): this table says which it needs and which it drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.allocator._groups import (
    FullAttentionSpec,
    GroupSpec,
    IndexerSpec,
    SlidingWindowSpec,
    StateSpec,
)

__all__ = ["RELEASED", "GroupPages", "GroupTable", "HybridRequest", "HybridStep", "StateRows",
           "TokenKernels", "TokenRows", "ragged"]

RELEASED = -1
TokenSpec = FullAttentionSpec | SlidingWindowSpec | IndexerSpec
I64 = npt.NDArray[np.int64]


def ragged(lengths: I64) -> tuple[I64, I64, I64]:
    """For segments of ``lengths``: ``(indptr [n+1], segment of each element, offset of each
    element in its segment)``, int64."""
    indptr = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    seg = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    return indptr, seg, np.arange(indptr[-1], dtype=np.int64) - indptr[seg]


class TokenRows:
    """One token group's rows: ``pages`` ``[max_seqs, max_pages]`` int32 (``RELEASED`` where
    not held), ``tags`` the same shape int64 (each page's tag when mapped), ``num_pages``
    ``[max_seqs]`` row lengths, ``released`` ``[max_seqs]`` row indices before it released."""

    def __init__(self, spec: TokenSpec, pages: npt.NDArray[np.int32],
                 tags: npt.NDArray[np.int64], num_pages: I64) -> None:
        """``pages`` and ``tags`` (``[max_seqs, max_pages]``, ``pages`` all ``RELEASED``) and
        ``num_pages`` (``[max_seqs]`` zeros): arrays this object alone writes, slices of
        :class:`GroupTable`'s arrays of every token group."""
        self.spec = spec
        self.page_size = spec.page_size
        self.window = spec.window if isinstance(spec, SlidingWindowSpec) else 0
        self.pages = pages
        self.tags = tags
        self.num_pages = num_pages
        self.released = np.zeros(pages.shape[0], dtype=np.int64)
        self.version = 0  # moves with every write: a kernel computed at one version holds

    def first_page(self, positions: Any) -> Any:
        """The first row index a query at each position reads (0 but for a sliding window)."""
        if not self.window:
            return positions * 0
        return np.maximum(positions - self.window + 1, 0) // self.page_size

    def held(self, row: int) -> npt.NDArray[np.int32]:
        pages = self.pages[row, self.released[row] : self.num_pages[row]]
        return pages[pages != RELEASED]

    # -- writes ----------------------------------------------------------------------------

    def restore(self, row: int, pages: list[int], tags: list[int], released: int) -> None:
        """Map ``pages`` (``RELEASED`` before row index ``released``) with their tags."""
        self.version += 1
        n = len(pages)
        self.pages[row, :n] = pages
        self.tags[row, :n] = tags
        self.num_pages[row] = n
        self.released[row] = released

    def clear(self, row: int) -> None:
        self.version += 1
        self.pages[row, : self.num_pages[row]] = RELEASED
        self.num_pages[row] = 0
        self.released[row] = 0

    def append(self, rows: npt.NDArray[np.intp], counts: I64, pages: npt.NDArray[np.int32],
               tags: I64) -> None:
        """Map ``counts[i]`` new pages (``pages``, in row order) at the end of ``rows[i]``."""
        self.version += 1
        if counts.size and counts.max() <= 1:  # (a decode step: a page at most each)
            r = rows[counts > 0]
            cols = self.num_pages[r]
        else:
            _, seg, off = ragged(counts)
            r = rows[seg]
            cols = self.num_pages[r] + off
        self.pages[r, cols] = pages
        self.tags[r, cols] = tags
        self.num_pages[rows] += counts

    def release_before(self, rows: npt.NDArray[np.intp], stop: I64) -> npt.NDArray[np.int32]:
        """Mark each row's indices before ``stop`` released; returns the pages they held."""
        released = self.released[rows]
        gain = np.minimum(stop, self.num_pages[rows]) - released
        most = gain.max() if gain.size else 0
        if most <= 0:
            return np.empty(0, dtype=np.int32)
        self.version += 1
        if most == 1:  # (a decode step: a page at most each)
            moved = gain > 0
            r, cols = rows[moved], released[moved]
            self.released[r] = cols + 1
        else:
            gain = np.maximum(gain, 0)
            _, seg, off = ragged(gain)
            r = rows[seg]
            cols = released[seg] + off
            self.released[rows] = released + gain
        gone = self.pages[r, cols]
        self.pages[r, cols] = RELEASED
        return gone[gone != RELEASED]

    def fork(self, src: int, dst: int, tail: tuple[int, int] | None) -> None:
        """Row ``dst`` maps what ``src`` maps; ``tail``: its last index maps ``(page, tag)``."""
        self.version += 1
        n = self.num_pages[src]
        self.pages[dst, :n] = self.pages[src, :n]
        self.tags[dst, :n] = self.tags[src, :n]
        self.num_pages[dst] = n
        self.released[dst] = self.released[src]
        if tail is not None:
            self.pages[dst, n - 1], self.tags[dst, n - 1] = tail


class StateRows:
    """One state group's rows: ``slot`` ``[max_seqs]`` int32, ``tag`` its tag when taken,
    ``tokens`` the tokens the state has absorbed."""

    def __init__(self, spec: StateSpec, max_seqs: int) -> None:
        self.spec = spec
        self.slot = np.full(max_seqs, RELEASED, dtype=np.int32)
        self.tag = np.zeros(max_seqs, dtype=np.int64)
        self.tokens = np.zeros(max_seqs, dtype=np.int64)

    def take(self, row: int, slot: int, tag: int, tokens: int) -> None:
        self.slot[row], self.tag[row], self.tokens[row] = slot, tag, tokens

    def clear(self, row: int) -> None:
        self.slot[row] = RELEASED

    def advance(self, rows: npt.NDArray[np.intp], tokens: I64) -> None:
        self.tokens[rows] = tokens


class HybridRequest:
    """A running request: its row, namespace, tokens (prompt, then every committed one) and
    the prefix cache's keys of its checkpoints so far (at C, 2C, ...)."""

    __slots__ = ("keys", "namespace", "row", "tokens")

    def __init__(self, row: int, namespace: Any, tokens: list[int]) -> None:
        self.row = row
        self.namespace = namespace
        self.tokens = tokens
        self.keys: list[bytes] = []


@dataclass(frozen=True)
class GroupPages:
    """One token group's part of a step's metadata (B requests, ``N`` new tokens in all).

    indptr: ``[B+1]`` int32; request b's pages are ``indices[indptr[b]:indptr[b+1]]``
    indices: ``[nnz]`` int32 page ids, in token order from row index ``first[b]``
    first: ``[B]`` int32 row index of each request's first listed page (0 but for a sliding
        window: the first page the step's first query reads)
    slot_mapping: ``[N]`` int64 ``page * page_size + offset`` of each new token
    """

    indptr: npt.NDArray[np.int32]
    indices: npt.NDArray[np.int32]
    first: npt.NDArray[np.int32]
    slot_mapping: npt.NDArray[np.int64]


@dataclass(frozen=True)
class HybridStep:
    """A step's kernel metadata in every group (B requests).

    request_ids: the batch, in order
    num_new_tokens: ``[B]`` int32 tokens each request computes this step
    seq_lens: ``[B]`` int32 its tokens after the step
    groups: ``{token group: GroupPages}``
    state_slots: ``{state group: [B] int32}`` the slot each request reads and writes
    """

    request_ids: tuple[Any, ...]
    num_new_tokens: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    groups: dict[str, GroupPages]
    state_slots: dict[str, npt.NDArray[np.int32]]


@dataclass(frozen=True)
class TokenKernels:
    """What a step's ``B`` requests read and write in the ``G`` token groups (in table
    order), as the rows list them, in one set of arrays (``N`` new tokens).

    indptr: ``[G*B+1]`` int64; group g's request b lists ``indices[indptr[g*B+b] :
        indptr[g*B+b+1]]``
    indices: ``[nnz]`` int32 pages (``RELEASED`` where not held)
    tags: ``[nnz]`` int64 each page's tag when its row mapped it
    first: ``[G, B]`` int64 row index of each request's first listed page
    slots: ``[G, N]`` int64 each new token's ``page * page_size + offset``
    """

    indptr: I64
    indices: npt.NDArray[np.int32]
    tags: I64
    first: I64
    slots: I64

    def group(self, g: int) -> tuple[I64, npt.NDArray[np.int32], I64, I64, I64]:
        """Group ``g``'s part: ``(indptr [B+1] from 0, indices, tags, first [B], slots [N])``."""
        B = self.first.shape[1]
        indptr = self.indptr[g * B : (g + 1) * B + 1]
        lo, hi = int(indptr[0]), int(indptr[-1])
        return (indptr - lo, self.indices[lo:hi], self.tags[lo:hi], self.first[g],
                self.slots[g])


class GroupTable:
    """The running requests of a hybrid manager: rows in every group, token counts."""

    def __init__(self, groups: tuple[GroupSpec, ...], max_seqs: int, max_tokens: int) -> None:
        self.groups = groups
        specs = [g for g in groups if not isinstance(g, StateSpec)]
        # Every token group's rows in one array (a step's kernel is one gather for them all).
        width = max((-(-max_tokens // g.page_size) for g in specs), default=0)
        self.pages = np.full((len(specs), max_seqs, width), RELEASED, dtype=np.int32)
        self.tags = np.zeros((len(specs), max_seqs, width), dtype=np.int64)
        self.num_pages = np.zeros((len(specs), max_seqs), dtype=np.int64)
        self.tokens = {g.name: TokenRows(g, self.pages[i], self.tags[i], self.num_pages[i])
                       for i, g in enumerate(specs)}
        self._group_index = np.arange(len(specs), dtype=np.int64)[:, None]  # [G, 1]
        self._page_size = np.array([g.page_size for g in specs], dtype=np.int64)[:, None]
        self._windowed = [g for g, t in enumerate(self.tokens.values()) if t.window]
        self._windows = {name: t for name, t in self.tokens.items() if t.window}
        self.states = {g.name: StateRows(g, max_seqs) for g in groups if isinstance(g, StateSpec)}
        self.num_tokens = np.zeros(max_seqs, dtype=np.int64)
        self.num_committed = np.zeros(max_seqs, dtype=np.int64)
        self.prompt_len = np.zeros(max_seqs, dtype=np.int64)  # tokens known at admission
        self.requests: dict[Any, HybridRequest] = {}
        self._kernels: tuple[int, Any, I64, I64, TokenKernels] | None = None
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def open(self, request_id: Any, namespace: Any, tokens: list[int], num_tokens: int
             ) -> HybridRequest:
        req = HybridRequest(self._free_rows.pop(), namespace, tokens)
        self.requests[request_id] = req
        self.num_tokens[req.row] = self.num_committed[req.row] = num_tokens
        self.prompt_len[req.row] = len(tokens)
        return req

    def close(self, request_id: Any) -> dict[str, npt.NDArray[np.int32]]:
        """Forget a request; returns every page and slot it held, per group."""
        req = self.requests.pop(request_id)
        row = req.row
        held = {}
        for name, rows in self.tokens.items():
            held[name] = rows.held(row)
            rows.clear(row)
        for name, states in self.states.items():
            held[name] = states.slot[row : row + 1].copy()
            states.clear(row)
        self._free_rows.append(row)
        return {k: v for k, v in held.items() if v.size}

    def growth(self, rows: npt.NDArray[np.intp], ends: I64) -> I64:
        """``[G, B]``: pages each token group (in table order) must add to ``rows`` for them
        to hold tokens to ``ends``."""
        out: I64 = np.maximum(-(-ends // self._page_size) - self.num_pages[:, rows], 0)
        return out

    def release_windows(self, rows: npt.NDArray[np.intp], committed: I64
                        ) -> dict[str, npt.NDArray[np.int32]]:
        """In each sliding-window group, release the pages of ``rows`` wholly before the
        window of their next query (after ``committed`` tokens); returns them per group."""
        gone = {}
        for name, t in self._windows.items():
            pages = t.release_before(rows, t.first_page(committed))
            if pages.size:
                gone[name] = pages
        return gone

    def set_tokens(self, rows: npt.NDArray[np.intp], num_tokens: I64) -> None:
        self.num_tokens[rows] = num_tokens

    def set_committed(self, rows: npt.NDArray[np.intp], num_committed: I64) -> None:
        self.num_committed[rows] = num_committed

    @property
    def version(self) -> int:
        """Moves with every write to a token group's rows."""
        return sum(t.version for t in self.tokens.values())

    def kernels(self, rows: npt.NDArray[np.intp], starts: I64, ends: I64) -> TokenKernels:
        """What a step computing tokens ``starts:ends`` of ``rows`` reads and writes in every
        token group, computed together (one gather for all groups): the one the latest
        :meth:`step` computed when nothing changed since (same rows array, tokens, version)."""
        last = self._kernels
        if (last is not None and last[0] == self.version and last[1] is rows
                and np.array_equal(last[2], starts) and np.array_equal(last[3], ends)):
            return last[4]
        P = self._page_size
        first = np.zeros((P.shape[0], rows.size), dtype=np.int64)
        for g, t in zip(self._windowed, self._windows.values()):
            first[g] = t.first_page(starts)
        indptr, seg, off = ragged((-(-ends // P) - first).ravel())
        _, S, M = self.pages.shape
        flat = ((self._group_index * S + rows) * M + first).ravel()[seg] + off
        new = ends - starts
        if new.size and (new == 1).all():  # the decode step: one token each
            positions, token_rows = starts, rows
        else:
            _, tseg, toff = ragged(new)
            positions, token_rows = starts[tseg] + toff, rows[tseg]
        cols = positions // P
        slots = self.pages[self._group_index, token_rows, cols].astype(np.int64) * P \
            + (positions - cols * P)
        return TokenKernels(indptr, self.pages.ravel().take(flat),
                            self.tags.ravel().take(flat), first, slots)

    def step(self, ids: tuple[Any, ...], rows: npt.NDArray[np.intp], starts: I64, ends: I64
             ) -> HybridStep:
        """The kernel metadata of a step in which ``rows`` compute tokens ``starts:ends``
        (the engine gets copies; the table keeps what it computed, for :meth:`kernels`)."""
        self._kernels = None
        k = self.kernels(rows, starts, ends)
        self._kernels = (self.version, rows, starts, ends, k)
        B = rows.size
        indptr, indices = k.indptr.astype(np.int32), k.indices.copy()
        first, slots = k.first.astype(np.int32), k.slots.copy()
        groups = {}
        for g, name in enumerate(self.tokens):
            lo, hi = int(indptr[g * B]), int(indptr[(g + 1) * B])
            groups[name] = GroupPages(indptr[g * B : (g + 1) * B + 1] - lo, indices[lo:hi],
                                      first[g], slots[g])
        states = {name: s.slot[rows].copy() for name, s in self.states.items()}
        end = ends.astype(np.int32)
        return HybridStep(ids, end - starts.astype(np.int32), end, groups, states)
