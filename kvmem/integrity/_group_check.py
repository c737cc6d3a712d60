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

A request that fails any of these is reported with one line saying what broke; the others
are not touched by its failure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["check_hybrid_step"]


def check_hybrid_step(step: Any, records: Sequence[Any], page_sizes: Mapping[str, int],
                      first_page: Callable[[str, int], int],
                      tags: Mapping[str, npt.NDArray[np.int64]],
                      state_holders: Mapping[str, Mapping[int, int]]) -> dict[int, str]:
    """``{batch index: reason}`` for each request of ``step`` (a ``HybridStep``) whose
    metadata is wrong in some group (module doc).

    records: per batch index, the running request's record (``num_tokens``, ``rows[group]``
        with ``pages`` and ``tags`` lists, ``states[group] = (slot, tag)``,
        ``state_tokens[group]``), None when unknown
    page_sizes: tokens per page of each token group
    first_page: ``fn(group, position)``: the first row index a query at ``position`` reads
    tags: each group's lifetime tags now, ``[num_pages]`` int64
    state_holders: per state group, how many running requests record each slot
    """
    bad: dict[int, str] = {}
    B = len(step.request_ids)
    seq_lens = np.asarray(step.seq_lens).tolist()
    num_new = np.asarray(step.num_new_tokens).tolist()
    if len(seq_lens) != B or len(num_new) != B:
        return {b: f"the step lists {len(seq_lens)} lengths for {B} requests" for b in range(B)}
    for b, rec in enumerate(records):
        if rec is None:
            bad[b] = "not a running request"
        elif seq_lens[b] != rec.num_tokens or not 0 <= num_new[b] <= seq_lens[b]:
            bad[b] = (f"lengths {seq_lens[b]} (new {num_new[b]}) are not its reserved "
                      f"{rec.num_tokens} tokens")
    for name, P in page_sizes.items():
        meta = step.groups[name]
        indptr = np.asarray(meta.indptr).tolist()
        indices = np.asarray(meta.indices).tolist()
        firsts = np.asarray(meta.first).tolist()
        slots = np.asarray(meta.slot_mapping).tolist()
        if len(indptr) != B + 1 or len(firsts) != B or len(slots) != sum(num_new):
            for b in range(B):
                bad.setdefault(b, f"group {name!r}: metadata shaped for another batch")
            continue
        live = tags[name]
        at = 0
        for b, rec in enumerate(records):
            n = num_new[b]
            mine = slots[at : at + n]
            at += n
            if b in bad:
                continue
            e = seq_lens[b]
            s = e - n
            row = rec.rows[name]
            first = first_page(name, s)
            listed = indices[indptr[b] : indptr[b + 1]]
            if firsts[b] != first or len(listed) != -(-e // P) - first:
                bad[b] = (f"group {name!r}: lists {len(listed)} pages from row index "
                          f"{firsts[b]}, expected {-(-e // P) - first} from {first}")
                continue
            for j, page in enumerate(listed):
                i = first + j
                if page != row.pages[i] or page < 0 or int(live[page]) != row.tags[i]:
                    why = ("a page it released" if row.pages[i] < 0 else
                           f"page {row.pages[i]}" if page != row.pages[i] else
                           "that page, whose lifetime ended")
                    bad[b] = (f"group {name!r}: row index {i} lists page {page}, the request "
                              f"holds {why}")
                    break
            else:
                for t, slot in zip(range(s, e), mine):
                    page = row.pages[t // P]
                    if slot != page * P + t % P:
                        bad[b] = (f"group {name!r}: token {t} writes slot {slot}, its own is "
                                  f"{page * P + t % P}")
                        break
        if at == len(slots):
            _shared_writes(name, slots, num_new, bad)
    for name, listed_slots in step.state_slots.items():
        listed = np.asarray(listed_slots).tolist()
        holders = state_holders[name]
        live = tags[name]
        for b, rec in enumerate(records):
            if b in bad:
                continue
            slot, tag = rec.states[name]
            if b >= len(listed) or listed[b] != slot or int(live[slot]) != tag:
                bad[b] = (f"state group {name!r}: lists slot "
                          f"{listed[b] if b < len(listed) else None}, the request holds "
                          f"slot {slot} (lifetime {'ended' if int(live[slot]) != tag else 'ok'})")
            elif rec.state_tokens[name] != seq_lens[b] - num_new[b]:
                bad[b] = (f"state group {name!r}: the state holds {rec.state_tokens[name]} "
                          f"tokens, the step starts at token {seq_lens[b] - num_new[b]} (a "
                          "prefix restored in the other groups but not in this one)")
            elif holders.get(slot, 0) != 1:
                bad[b] = (f"state group {name!r}: slot {slot} is recorded by "
                          f"{holders.get(slot, 0)} running requests (a fork must copy a "
                          "state, not share it)")
    return bad


def _shared_writes(name: str, slots: list[int], num_new: list[int], bad: dict[int, str]
                   ) -> None:
    """Flag every request with a token whose slot another token of the step also writes."""
    if len(set(slots)) == len(slots):
        return
    owner = np.repeat(np.arange(len(num_new)), num_new)
    arr = np.asarray(slots, dtype=np.int64)
    uniq, counts = np.unique(arr, return_counts=True)
    twice = np.isin(arr, uniq[counts > 1])
    for b in np.unique(owner[twice]).tolist():
        bad.setdefault(b, f"group {name!r}: writes a slot another token of the step writes")
