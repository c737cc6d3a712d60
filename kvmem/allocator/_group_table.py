"""GroupTable: every running request's pages in each KV cache group, the tag each page had when
the request mapped it, and a step's kernel metadata per group (:class:`HybridStep`).

::

    request r, 14 tokens computed, 4 reserved      full (page 4)   | 3 | 9 | 2 | 7 | 5 |
                                                   swa (page 4, W 6) | - | - | 8 | 1 | 6 |
                                                   gdn (state)       slot 11
    the step's kernel lists   full: 3 9 2 7 5 (first 0)   swa: 8 1 6 (first 2)   gdn: 11

A token group's row maps row index ``i`` (tokens ``i * page_size ..``) to a page, or to
``RELEASED`` where the request let go of it (a sliding window's pages before the next query's
window) or never mapped it (a prefix hit restores only the window's pages). Beside each page
the row keeps the page's lifetime tag at the time it was mapped: the expectations the batched
check compares with (``kvmem.integrity.check_hybrid_step``). A state group holds one slot per
request, with its tag.

Pure bookkeeping: pages are allocated and freed by the caller (the hybrid manager, through its
:class:`~kvmem.allocator.GroupAllocator`); this table says which it needs and which it drops.
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
    first_window_page,
)

__all__ = ["RELEASED", "GroupPages", "GroupTable", "HybridRequest", "HybridStep", "TokenRow"]

RELEASED = -1
TokenSpec = FullAttentionSpec | SlidingWindowSpec | IndexerSpec


class TokenRow:
    """One request's pages in one token group: ``pages[i]`` holds row index ``i``'s tokens
    (``RELEASED`` when not held), ``tags[i]`` its tag when mapped."""

    __slots__ = ("pages", "tags")

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.tags: list[int] = []

    def restore(self, pages: list[int], tags: list[int]) -> None:
        """Map ``pages`` (``RELEASED`` where not held) with their tags, from row index 0."""
        self.pages, self.tags = list(pages), list(tags)

    def extend(self, pages: list[int], tags: list[int]) -> None:
        self.pages.extend(pages)
        self.tags.extend(tags)

    def set_last(self, page: int, tag: int) -> None:
        """Map another page at the last row index (a fork's copy of its tail)."""
        self.pages[-1], self.tags[-1] = page, tag

    def release_before(self, stop: int) -> list[int]:
        """Mark row indices before ``stop`` ``RELEASED``; returns the pages they held."""
        stop = min(stop, len(self.pages))
        gone = [p for p in self.pages[:stop] if p != RELEASED]
        if gone:
            self.pages[:stop] = [RELEASED] * stop
        return gone


class HybridRequest:
    """A running request: its tokens (prompt, then every committed one), slots reserved
    (``num_tokens``) and committed, a :class:`TokenRow` per token group, a ``(slot, tag)``
    per state group with the tokens that state has absorbed (``state_tokens``: its
    committed tokens, or the checkpoint it was restored from), and the prefix cache's keys of
    its checkpoints so far."""

    __slots__ = ("keys", "namespace", "num_committed", "num_tokens", "rows", "state_tokens",
                 "states", "tokens")

    def __init__(self, namespace: Any, tokens: list[int], groups: tuple[GroupSpec, ...]) -> None:
        self.namespace = namespace
        self.tokens = tokens
        self.num_tokens = 0
        self.num_committed = 0
        self.rows = {g.name: TokenRow() for g in groups if not isinstance(g, StateSpec)}
        self.states: dict[str, tuple[int, int]] = {}
        self.state_tokens: dict[str, int] = {}  # the tokens each state has absorbed
        self.keys: list[bytes] = []  # its prefix's checkpoint keys (at C, 2C, ...), so far


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


class GroupTable:
    """The running requests of a hybrid manager, by id, and what each maps in every group."""

    def __init__(self, groups: tuple[GroupSpec, ...]) -> None:
        self.groups = groups
        self.token_groups: tuple[TokenSpec, ...] = tuple(
            g for g in groups if not isinstance(g, StateSpec))
        self.state_groups = tuple(g for g in groups if isinstance(g, StateSpec))
        self.requests: dict[Any, HybridRequest] = {}

    def first_page(self, spec: TokenSpec, num_computed: int) -> int:
        """The first row index a query at ``num_computed`` reads in ``spec``'s group."""
        if isinstance(spec, SlidingWindowSpec):
            return first_window_page(num_computed, spec.window, spec.page_size)
        return 0

    def growth(self, req: HybridRequest, end: int) -> dict[str, int]:
        """Pages each token group must add for ``req`` to hold tokens up to ``end``."""
        return {g.name: max(0, -(-end // g.page_size) - len(req.rows[g.name].pages))
                for g in self.token_groups}

    def append(self, req: HybridRequest, pages: dict[str, npt.NDArray[np.int32]],
               tags: dict[str, npt.NDArray[np.int64]]) -> None:
        """Map newly allocated pages at the end of each token row."""
        for name, new in pages.items():
            if new.size:
                req.rows[name].extend(new.tolist(), tags[name].tolist())

    def outside_window(self, req: HybridRequest) -> dict[str, list[int]]:
        """Release (mark ``RELEASED``) each sliding row's pages wholly before the window of
        the request's next query (at ``num_committed``); returns them, for the caller to
        drop its holds."""
        out: dict[str, list[int]] = {}
        for g in self.token_groups:
            if not isinstance(g, SlidingWindowSpec):
                continue
            gone = req.rows[g.name].release_before(
                first_window_page(req.num_committed, g.window, g.page_size))
            if gone:
                out[g.name] = gone
        return out

    def held(self, req: HybridRequest) -> dict[str, list[int]]:
        """Every page and slot ``req`` holds, per group."""
        out = {name: [p for p in row.pages if p != RELEASED] for name, row in req.rows.items()}
        for name, (slot, _) in req.states.items():
            out[name] = [slot]
        return out

    def step(self, ids: tuple[Any, ...], starts: list[int], ends: list[int]) -> HybridStep:
        """The kernel metadata of a step in which request ``ids[b]`` computes tokens
        ``starts[b]:ends[b]`` (its pages already mapped)."""
        reqs = [self.requests[rid] for rid in ids]
        groups = {}
        for g in self.token_groups:
            P = g.page_size
            firsts = [self.first_page(g, s) for s in starts]
            lists = [req.rows[g.name].pages[f : -(-e // P)]
                     for req, f, e in zip(reqs, firsts, ends)]
            indptr = np.zeros(len(ids) + 1, dtype=np.int32)
            np.cumsum([len(x) for x in lists], out=indptr[1:])
            indices = np.array([p for x in lists for p in x], dtype=np.int32)
            slots = [req.rows[g.name].pages[t // P] * P + t % P
                     for req, s, e in zip(reqs, starts, ends) for t in range(s, e)]
            groups[g.name] = GroupPages(indptr, indices, np.array(firsts, dtype=np.int32),
                                        np.array(slots, dtype=np.int64))
        states = {g.name: np.array([req.states[g.name][0] for req in reqs], dtype=np.int32)
                  for g in self.state_groups}
        end = np.array(ends, dtype=np.int32)
        return HybridStep(ids, end - np.array(starts, dtype=np.int32), end, groups, states)
