"""The timeline's device memory: one int64 "K/V value" per token slot, and the values each
followed request's tokens imply (:mod:`kvmem.testing._kv_values`), so a read through a wrong
page, of a slot not yet written, or of another tenant's page is visible."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.testing._kv_values import kv_value_array, namespace_key
from kvmem.testing._launch import EMPTY64, Launch, RequestSpec

__all__ = ["DRAFT", "DeviceMemory"]

Int64Array = npt.NDArray[np.int64]

_min = np.minimum.reduce  # (a little cheaper than ndarray.min())

# A rejected draft token's K/V: its position's true value XOR this (even, so never 0: every
# true value is odd), a value no true token stream gives there.
DRAFT = np.int64(0x5A5A_5A5A_5A5A_5A5A)


class DeviceMemory:
    """Device memory of ``num_pages`` pages of ``page_size`` slots, for up to ``max_requests``
    model rows (one per followed request) of ``max_len`` tokens.

    Attributes
    ----------
    kv: ``[num_pages * page_size]``, int64 — the K/V value in each slot (0 = never written)
    val: ``[max_requests, max_len + page_size]``, int64 — the value of each row's positions
    pver: ``[num_pages]`` — which page it is and which landing last wrote it (epoch *
        num_pages + page): a read through an entry is new if its page or the page's content
        changed since
    vseen: ``[max_requests, width]`` — the ``pver`` of the page each entry held when the row's
        request last read it (-1: never)
    """

    def __init__(self, num_pages: int, page_size: int, max_requests: int, max_len: int,
                 width: int) -> None:
        self.P = P = page_size
        self.num_pages = num_pages
        self.max_len = max_len
        self.kv = np.zeros(num_pages * P, dtype=np.int64)
        self.val = np.zeros((max_requests, max_len + P), dtype=np.int64)
        self.vseen = np.full((max_requests, width), -1, dtype=np.int64)
        self.vseen_flat = self.vseen.reshape(-1)
        self.pver = np.arange(num_pages, dtype=np.int64)
        self.epoch = 1
        self.arange = np.arange(max_requests * width + 1, dtype=np.int64)  # (scratch)
        self.arange_p = np.arange(P, dtype=np.int64)
        self._ns_keys: dict[str, int] = {}  # repr(namespace) -> namespace_key(namespace)
        self._owners: dict[int, tuple[Any, Any]] = {}  # row -> (request id, namespace)

    def load(self, mrow: int, spec: RequestSpec) -> None:
        """Row ``mrow`` follows ``spec`` now: its values, and nothing read yet."""
        ns = repr(spec.namespace)  # (what namespace_key hashes: 1 and True are two tenants)
        key = self._ns_keys.get(ns)
        if key is None:
            key = self._ns_keys[ns] = namespace_key(spec.namespace)
        self.val[mrow, : spec.max_len] = kv_value_array(key, spec.tokens)
        self.vseen[mrow] = -1
        self._owners[mrow] = (spec.request_id, spec.namespace)

    def unload(self, mrow: int) -> None:
        """Row ``mrow``'s request is forgotten (its values name a finished request)."""
        self._owners.pop(mrow, None)

    def copy_page(self, src: int, dst: int) -> None:
        """A page copy lands: ``dst`` holds what ``src`` holds."""
        P = self.P
        self.kv[dst * P : (dst + 1) * P] = self.kv[src * P : (src + 1) * P]
        self.pver[dst] = self.epoch * self.num_pages + dst
        self.epoch += 1

    def land_writes(self, op: Launch, landed: Int64Array | None = None
                    ) -> tuple[Int64Array, Int64Array, Int64Array]:
        """The op's K/V writes land; returns each written token's request (index in the op),
        position and value. ``landed``: ``[T]`` int64, what a transfer really wrote into
        ``op.slot_mapping`` (the bytes a transport moved), instead of the values its requests'
        tokens imply."""
        counts = op.num_new
        b = counts.size
        if b and op.slot_mapping.size == b and int(_min(counts)) == 1:  # a token each (decode)
            tb = self.arange[:b]
            pos = op.starts
            values = self.val[op.mrows, pos]
        else:
            total = int(counts.sum())
            if not total:
                return EMPTY64, EMPTY64, EMPTY64
            ar = self.arange if total <= self.arange.size else np.arange(total, dtype=np.int64)
            tb = ar[:b].repeat(counts)
            pos = (op.starts - np.cumsum(counts) + counts)[tb] + ar[:total]
            values = self.val[op.mrows[tb], pos]
            if op.rejected.size:  # a speculative step: rejected drafts write draft values
                draft = pos >= (op.starts + counts - op.rejected)[tb]
                values[draft] ^= DRAFT
        if landed is not None:
            values = landed
        self.kv[op.slot_mapping] = values
        wp = op.write_pages
        self.pver[wp] = self.epoch * self.num_pages + wp
        self.epoch += 1
        return tb, pos, values

    def whose(self, value: int) -> str:
        """Whose K/V ``value`` is (for a failure message)."""
        hits = np.argwhere(self.val == value)
        what = "the K/V"
        if not hits.size:
            hits = np.argwhere(self.val == value ^ DRAFT)
            what = "a rejected draft's K/V"
        if not hits.size:
            return "a value no request's tokens imply"
        mrow, p = (int(x) for x in hits[0])
        owner = self._owners.get(mrow)
        if owner is not None:
            return f"{what} of request {owner[0]!r} (ns {owner[1]!r}) at position {p}"
        return f"{what} of a finished request at position {p}"
