"""The batched check of a hybrid model's step: every group's kernel metadata against what each
request recorded when it mapped its pages, and the pages' lifetime tags now.

For request ``b`` computing tokens ``s .. e`` (``e = seq_lens[b]``, ``s = e - num_new[b]``):

- its lengths are the ones it reserved (``e`` its reserved tokens);
- in each token group it lists exactly its row's pages from the first one its first query
  reads (row index ``first_page(s)``: 0, or a sliding window's first) through ``ceil(e / P)``,
  each one it still holds (not released) and in the lifetime it recorded (tag unchanged);
- each new token's slot is ``page * P + offset`` of its own row's page;
- no slot of the step is written by two tokens;
- in each state group it lists its own slot, in the lifetime it recorded, holding the state
  after exactly ``s`` tokens (a prefix hit restores every group or none), and no other running
  request records that slot (a fork must copy the state, never share it).

Vectorized: a constant number of numpy calls per group whatever the batch; a request that fails
is reported with one line saying what broke first, and the others are not touched by its
failure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["check_hybrid_step"]

I64 = npt.NDArray[np.int64]


def _mark(bad: npt.NDArray[np.bool_], why: dict[int, str], hit: npt.NDArray[np.bool_],
          reason: Callable[[int], str]) -> None:
    if not hit.any():
        return
    for b in np.flatnonzero(hit & ~bad).tolist():
        why[b] = reason(b)
    bad |= hit


def check_hybrid_step(step: Any, known: npt.NDArray[np.bool_], num_tokens: I64,
                      expected: Callable[[I64, I64], Any], token_groups: Sequence[str],
                      tags: Mapping[str, I64],
                      states: Mapping[str, tuple[Any, Any, Any, Any]]) -> dict[int, str]:
    """``{batch index: reason}`` for each request of ``step`` (a ``HybridStep``) whose
    metadata is wrong in some group (module doc).

    known: ``[B]`` bool, the request is running
    num_tokens: ``[B]`` its reserved tokens
    expected: ``fn(starts, ends)`` -> what the batch's own rows list for those tokens in the
        ``token_groups`` (in that order), a ``kvmem.allocator.TokenKernels``: ``.indptr``
        ``[G*B+1]``, ``.indices`` (RELEASED -1 where not held), ``.tags`` (recorded),
        ``.first`` ``[G, B]``, ``.slots`` ``[G, N]``, ``.group(g)``
    tags: each group's lifetime tags now, ``[num_pages]`` int64
    states: per state group, ``(slot, recorded tag, tokens absorbed, running requests that
        record the slot)``, each ``[B]``
    """
    B = len(step.request_ids)
    seq = np.asarray(step.seq_lens, dtype=np.int64)
    new = np.asarray(step.num_new_tokens, dtype=np.int64)
    if seq.shape != (B,) or new.shape != (B,):
        return {b: f"the step lists {seq.size} lengths for {B} requests" for b in range(B)}
    why: dict[int, str] = {}
    bad = np.zeros(B, dtype=bool)
    _mark(bad, why, ~known, lambda b: "not a running request")
    _mark(bad, why, (seq != num_tokens) | (new < 0) | (new > seq),
          lambda b: f"lengths {seq[b]} (new {new[b]}) are not its reserved {num_tokens[b]} "
                    "tokens")
    sized = ~bad  # the requests whose tokens are their own: their slots are compared
    ends = np.where(bad, 0, seq)
    starts = np.where(bad, 0, seq - new)
    rows = expected(starts, ends)
    if bad.any() or not _all_good(step, token_groups, rows, tags, B, int(new.sum())):
        for g, name in enumerate(token_groups):
            meta = step.groups.get(name) if isinstance(step.groups, Mapping) else None
            if meta is None:
                for b in np.flatnonzero(~bad).tolist():
                    why[b] = f"group {name!r}: the step lists no metadata"
                bad[:] = True
                continue
            _check_group(name, meta, rows.group(g), tags[name], new, sized, bad, why)
    for name, (slot, tag, absorbed, holders) in states.items():
        _check_state(name, np.asarray(step.state_slots[name], dtype=np.int64), slot, tag,
                     absorbed, holders, tags[name], starts, known, bad, why)
    return dict(sorted(why.items()))


def _all_good(step: Any, names: Sequence[str], rows: Any, tags: Mapping[str, I64], B: int,
              N: int) -> bool:
    """Whether every token group's metadata is exactly what the rows list, every page in the
    lifetime its row recorded, no slot written twice in a group: the usual step, checked in
    one pass over all groups' arrays together. Any doubt answers False (the per-group check
    then says what broke)."""
    groups = step.groups
    if not isinstance(groups, Mapping):
        return False
    ends, listed, firsts, slots, now = [], [], [], [], []
    nnz = 0
    for name in names:
        meta = groups.get(name)
        if meta is None:
            return False
        indptr, indices = np.asarray(meta.indptr), np.asarray(meta.indices)
        first, slot = np.asarray(meta.first), np.asarray(meta.slot_mapping)
        if (indptr.shape != (B + 1,) or indices.ndim != 1 or first.shape != (B,)
                or slot.shape != (N,) or indptr[0] != 0 or indptr[-1] != indices.size):
            return False
        ends.append(indptr[1:] + nnz)
        lo, nnz = nnz, nnz + indices.size
        if nnz > rows.indices.size:
            return False
        try:  # (the pages the rows list, their lifetimes now)
            now.append(tags[name].take(rows.indices[lo:nnz]))
        except IndexError:
            return False
        listed.append(indices)
        firsts.append(first)
        slots.append(slot)
    if not names:
        return True
    if nnz != rows.indices.size:
        return False
    ordered = np.sort(rows.slots, axis=1)
    return not ((np.concatenate(ends) != rows.indptr[1:]).any()
                or (np.concatenate(firsts) != rows.first.ravel()).any()
                or (np.concatenate(listed) != rows.indices).any()
                or (rows.indices < 0).any()
                or (np.concatenate(now) != rows.tags).any()
                or (np.concatenate(slots) != rows.slots.ravel()).any()
                or (ordered[:, 1:] == ordered[:, :-1]).any())


def _check_state(name: str, listed: I64, slot: Any, tag: Any, absorbed: Any, holders: Any,
                 live: I64, starts: I64, known: npt.NDArray[np.bool_],
                 bad: npt.NDArray[np.bool_], why: dict[int, str]) -> None:
    """One state group's part of the check (module doc), marking ``bad`` and ``why``."""
    B = bad.size
    if listed.shape != (B,):
        _mark(bad, why, np.ones(B, dtype=bool),
              lambda b: f"state group {name!r}: slots shaped for another batch")
        return
    inside = (listed >= 0) & (listed < live.size)
    now = np.where(inside, live[np.where(inside, listed, 0)], -1)
    _mark(bad, why, (listed != slot) | (now != tag),
          lambda b: f"state group {name!r}: lists slot {listed[b]}, the request holds slot "
                    f"{slot[b]} (lifetime {'ok' if now[b] == tag[b] else 'ended'})")
    _mark(bad, why, known & (absorbed != starts),
          lambda b: f"state group {name!r}: the state holds {absorbed[b]} tokens, the step "
                    f"starts at token {starts[b]} (a prefix restored in the other groups but "
                    "not in this one)")
    _mark(bad, why, known & (holders != 1),
          lambda b: f"state group {name!r}: slot {slot[b]} is recorded by {holders[b]} running "
                    "requests (a fork must copy a state, not share it)")


def _check_group(name: str, meta: Any, expected: tuple[I64, npt.NDArray[np.int32], I64, I64, I64],
                 live: I64, new: I64, sized: npt.NDArray[np.bool_],
                 bad: npt.NDArray[np.bool_], why: dict[int, str]) -> None:
    """One token group's part of the check (module doc), marking ``bad`` and ``why``."""
    B = bad.size
    exp_indptr, exp_pages, exp_tags, exp_first, exp_slots = expected
    indptr = np.asarray(meta.indptr, dtype=np.int64)
    indices = np.asarray(meta.indices, dtype=np.int64)
    first = np.asarray(meta.first, dtype=np.int64)
    slots = np.asarray(meta.slot_mapping, dtype=np.int64)
    counts = indptr[1:] - indptr[:-1]
    if (indptr.shape != (B + 1,) or indices.ndim != 1 or first.shape != (B,)
            or slots.shape != (int(new.sum()),)
            or indptr[0] != 0 or indptr[-1] != indices.size or (counts < 0).any()):
        _mark(bad, why, np.ones(B, dtype=bool),
              lambda b: f"group {name!r}: metadata shaped for another batch")
        return
    exp_counts = exp_indptr[1:] - exp_indptr[:-1]
    _mark(bad, why, (first != exp_first) | (counts != exp_counts),
          lambda b: f"group {name!r}: lists {counts[b]} pages from row index {first[b]}, "
                    f"expected {exp_counts[b]} from {exp_first[b]}")
    # Entries of the requests still good, against their own rows' (aligned: same counts).
    if not bad.any() and indices.size and indices.min() >= 0 and indices.max() < live.size:
        # (every request so far good, every id a page: the usual step, in whole arrays)
        seg = at = None
        listed, own = indices, exp_pages
        wrong = (listed != own) | (live.take(listed) != exp_tags)
    else:
        seg = np.repeat(np.arange(B), counts)
        at = np.flatnonzero(~bad[seg])
        pos = exp_indptr[seg[at]] + (at - indptr[seg[at]])
        listed = indices[at]
        own = exp_pages[pos].astype(np.int64)
        inside = (listed >= 0) & (listed < live.size)
        now = np.where(inside, live[np.where(inside, listed, 0)], -1)
        wrong = (listed != own) | (own < 0) | (now != exp_tags[pos])
    if wrong.any():
        if seg is None:
            seg = np.repeat(np.arange(B), counts)
            at = np.arange(indices.size)
        assert at is not None
        first_wrong: dict[int, int] = {}
        for k in np.flatnonzero(wrong).tolist():
            first_wrong.setdefault(int(seg[at[k]]), k)
        hit = np.zeros(B, dtype=bool)
        hit[list(first_wrong)] = True

        def reason(b: int) -> str:
            k = first_wrong[b]
            i = int(first[b] + at[k] - indptr[b])
            held = ("a page it released" if own[k] < 0 else f"page {own[k]}"
                    if own[k] != listed[k] else "that page, whose lifetime ended")
            return f"group {name!r}: row index {i} lists page {listed[k]}, the request holds {held}"

        _mark(bad, why, hit, reason)
    # Slots: the length-checked requests' tokens, in order, against their own rows' slots.
    every = sized.all()
    mine = None if every else np.repeat(sized, new)
    diff = (slots if mine is None else slots[mine]) != exp_slots
    if diff.any():
        owner = np.repeat(np.arange(B), new) if mine is None else np.repeat(np.arange(B), new)[mine]
        hit = np.zeros(B, dtype=bool)
        hit[owner[diff]] = True
        _mark(bad, why, hit, lambda b: f"group {name!r}: a new token's slot is not in its own "
                                       "page")
    ordered = np.sort(slots)
    if slots.size > 1 and (ordered[1:] == ordered[:-1]).any():
        _, inverse, times = np.unique(slots, return_inverse=True, return_counts=True)
        twice = times[inverse] > 1
        hit = np.zeros(B, dtype=bool)
        hit[np.repeat(np.arange(B), new)[twice]] = True
        _mark(bad, why, hit, lambda b: f"group {name!r}: writes a slot another token of the "
                                       "step writes")
