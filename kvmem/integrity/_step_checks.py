"""The checks of a step's writes: one writer per page, the slot mapping, the lengths.

A step's new tokens are each request's ``[write_from, num_tokens)``: the slots its latest
``reserve`` handed out. Before the kernels run, for each request:

* **one writer**: every page the step writes has exactly one holder that may read or write its
  future slots (a shared tail is written only after copy-on-write; BUGS 14);
* **slots**: the slot mapping (what the kernel that stores K/V reads) sends each new token into
  the page the step's CSR or block table lists for it, at the token's offset; slots past the
  step's tokens are padding (-1) (BUGS 12, the write side);
* **lengths**: ``seq_lens``, ``kv_last_page_len``, ``num_new_tokens`` and ``qo_indptr`` are the
  request's own (a last page said longer than it is reads a previous holder's KV).

numpy arrays or torch tensors (compared on their own device). Fields that are malformed as a
whole are refused first (:func:`validate_step_fields`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import show
from kvmem.errors import ArgumentTypeError, MetadataError
from kvmem.integrity._check import PAD, require_int_array

__all__ = ["LENGTH_FIELDS", "length_mismatches", "ranges", "slot_mismatches", "table_slots",
           "validate_step_fields", "write_set"]

Int64Array = npt.NDArray[np.int64]
IntpArray = npt.NDArray[np.intp]
LENGTH_FIELDS = ("seq_lens", "kv_last_page_len", "num_new_tokens")


def ranges(starts: npt.NDArray[np.integer], lengths: npt.NDArray[np.integer]) -> Int64Array:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` in four numpy calls.

    ``starts``, ``lengths``: ``[m]`` ints (lengths >= 0) -> ``[sum(lengths)]``, int64.
    """
    ends = np.cumsum(lengths, dtype=np.int64)
    out = np.repeat(np.asarray(starts, dtype=np.int64) - ends + lengths, lengths)
    out += np.arange(out.size)
    return out


def write_set(pages: npt.NDArray[np.int32], rows: IntpArray, start: Int64Array,
              end: Int64Array, page_size: int) -> tuple[IntpArray, Int64Array, Int64Array]:
    """The pages a step writes: tokens ``[start, end)`` of each row of ``pages`` (the page
    table, ``[max_seqs, W]``): (batch index, page position, page) of each token, ``[T]``."""
    todo = end - start
    batch = np.repeat(np.arange(rows.size), todo)
    positions = ranges(start, todo) // page_size
    return batch, positions, pages[rows[batch], positions].astype(np.int64)


def table_slots(pages: npt.NDArray[np.int32], rows: IntpArray, start: Int64Array,
                end: Int64Array, page_size: int) -> Int64Array:
    """The slots the page table gives tokens ``[start, end)`` of each row, in batch order:
    what a step given without a slot mapping writes into. ``[T]``, int64."""
    _, _, pages_at = write_set(pages, rows, start, end, page_size)
    return pages_at * page_size + ranges(start, end - start) % page_size


def validate_step_fields(meta: Mapping[str, Any], batch_size: int,
                         num_new: int | None = None) -> None:
    """Refuse a step's slot mapping and lengths (those given) unless they are integer arrays
    or tensors shaped for a batch of ``batch_size`` requests (with ``num_new`` new tokens, when
    given): ``slot_mapping [>= num_new]``, ``seq_lens`` / ``kv_last_page_len`` /
    ``num_new_tokens`` ``[B]``, ``qo_indptr [B + 1]``. Raises MetadataError naming the field
    (ArgumentTypeError for a ``meta`` that is no mapping)."""
    if not isinstance(meta, Mapping):
        raise ArgumentTypeError(f"meta={show(meta)}: expected a mapping of field names to "
                                "arrays, as step.fields() or step.tensors(device) give")
    slots = meta.get("slot_mapping")
    if slots is not None:
        require_int_array("slot_mapping", slots, (None,))
        if num_new is not None and slots.shape[0] < num_new:
            raise MetadataError(
                f"slot_mapping lists {slots.shape[0]} slots but the batch's latest reserve "
                f"handed out {num_new} new tokens; pass the step's slot mapping (padding -1 "
                "may follow). Nothing was checked or changed"
            )
    for name in LENGTH_FIELDS:
        if meta.get(name) is not None:
            require_int_array(name, meta[name], (batch_size,))
    if meta.get("qo_indptr") is not None:
        require_int_array("qo_indptr", meta["qo_indptr"], (batch_size + 1,))


def _host_or_device(like: Any) -> tuple[Any, Any, Any]:
    """(``as_array``, ``where``, int64 dtype) for computing beside ``like``: numpy for numpy
    arrays, torch on ``like``'s device for tensors."""
    if isinstance(like, np.ndarray):
        return np.asarray, np.where, np.int64
    import torch

    return functools.partial(torch.as_tensor, device=like.device), torch.where, torch.int64


def slot_mismatches(meta: Mapping[str, Any], start: Int64Array, count: Int64Array,
                    page_size: int) -> tuple[IntpArray, Int64Array]:
    """The step's new tokens whose slot (``meta["slot_mapping"]``) is not in the page its CSR
    (``kv_indptr`` + ``kv_indices``) or else its block table lists for them, at their offset:
    (batch index, page position) of each. A row's new tokens are ``[start, start + count)``, in
    batch order; slots past them must be -1 (a padding slot that writes somewhere makes every
    token suspect). ``meta``'s fields were validated (:func:`validate_step_fields`)."""
    P = page_size
    batch = np.repeat(np.arange(start.size), count)
    tokens = ranges(start, count)
    positions = tokens // P
    slots = meta["slot_mapping"]
    here, where, wide = _host_or_device(slots)
    b, pos = here(batch), here(positions)
    if "kv_indices" in meta:  # CSR: a token's page is at indptr[b] + position
        table = meta["kv_indices"]
        ip = here(meta["kv_indptr"], dtype=wide)
        at = ip[b] + pos
        listed = (at < ip[b + 1]) & (at < table.shape[0])
        pages = here(table[where(listed, at, 0)], dtype=wide) if table.shape[0] else pos * 0 - 1
    else:  # a block table: at [b, position]
        table = meta["block_table"]
        listed = pos < table.shape[1]
        pages = (here(table[b, where(listed, pos, 0)], dtype=wide) if table.shape[1]
                 else pos * 0 + PAD)
        listed &= pages != PAD
    bad = ~listed | (pages * P + here(tokens % P) != here(slots[: batch.size], dtype=wide))
    if not isinstance(bad, np.ndarray):
        bad = bad.cpu().numpy()
    if bool((slots[batch.size :] != -1).any()):
        return batch, positions
    return batch[bad], positions[bad]


def length_mismatches(meta: Mapping[str, Any], total: Int64Array, new: Int64Array,
                      page_size: int) -> IntpArray:
    """Batch indices of the requests whose step gives the kernel other lengths than
    ``total`` tokens of which ``new`` are new (the fields of ``meta`` that are there:
    ``seq_lens``, ``kv_last_page_len``, ``num_new_tokens``, ``qo_indptr``)."""
    want = {"seq_lens": total, "kv_last_page_len": (total - 1) % page_size + 1,
            "num_new_tokens": new}
    got = [(meta[name], value) for name, value in want.items() if meta.get(name) is not None]
    qo = meta.get("qo_indptr")
    bad = np.zeros(total.size, dtype=bool)
    if qo is not None:
        if int(qo[0]) != 0:
            bad[:] = True
        got.append((qo[1:] - qo[:-1], new))
    for g, value in got:
        if isinstance(g, np.ndarray):
            bad |= g != value
        else:  # a tensor: compared on its device
            import torch

            bad |= (g.long() != torch.as_tensor(value, device=g.device)).cpu().numpy()
    return bad.nonzero()[0]
