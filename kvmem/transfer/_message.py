"""The transfer message and the two notices that answer it (wire format: ``_wire.py``).

::

    offer    sender -> receiver   TransferMessage: what to read and what it must turn out to be
        transfer_id, sender      "agent:n", the sender's agent name
        request_id               the engine's id of the request (str, int, bytes or a tuple)
        identity, namespace      the sender's CacheIdentity; the pages' namespace
        token_ids    [m]   int64     every token the receiver admits (the pages hold the first
                                     num_pages * page_size)
        page_ids     [n]   int32     the sender's pages (only to compute their addresses)
        tags         [n]   int64     their lifetime tags under the sender's lease
        prefix_keys  [n, 2] uint64   the sender's prefix keys of those pages
        regions                      Region of the sender's "data" (and "token_scales")
        static_scales [L, C, Hs] float32, or absent
        page_digests [n, 16] uint8   SHA-256 per page (see ``_bundle.py``)
        lease_expiry                 when the sender's lease ends, on the sender's clock
    confirm  receiver -> sender   transfer_id and the tags it read under (the read's notice:
                                  it reaches the sender when the read has completed)
    answer   sender -> receiver   transfer_id, ok (the lease held and every tag matched) or not,
                                  and why
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError
from kvmem.transfer._descs import Region
from kvmem.transfer._identity import CacheIdentity
from kvmem.transfer._wire import namespace_from_json, namespace_json, pack, unpack

__all__ = ["TransferMessage", "answer_bytes", "confirm_bytes", "parse_notice"]


@dataclass(frozen=True)
class TransferMessage:
    """What travels for one request (see the module docstring)."""

    transfer_id: str
    sender: str
    request_id: Any
    identity: CacheIdentity
    namespace: Any
    token_ids: npt.NDArray[np.int64]
    page_ids: npt.NDArray[np.int32]
    tags: npt.NDArray[np.int64]
    prefix_keys: npt.NDArray[np.uint64]
    regions: dict[str, Region]
    static_scales: npt.NDArray[np.float32] | None
    page_digests: npt.NDArray[np.uint8]
    lease_expiry: float

    @property
    def num_pages(self) -> int:
        return int(self.page_ids.size)

    def to_bytes(self) -> bytes:
        arrays: dict[str, npt.NDArray[Any]] = {
            "token_ids": self.token_ids, "page_ids": self.page_ids, "tags": self.tags,
            "prefix_keys": self.prefix_keys, "page_digests": self.page_digests}
        if self.static_scales is not None:
            arrays["static_scales"] = self.static_scales
        return pack("offer", {"transfer_id": self.transfer_id, "sender": self.sender,
                              "request_id": namespace_json(self.request_id),
                              "identity": self.identity.to_json(),
                              "namespace": namespace_json(self.namespace),
                              "regions": {k: r.to_json() for k, r in self.regions.items()},
                              "lease_expiry": self.lease_expiry}, arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferMessage:
        head, a = unpack(data, "offer")
        return cls.from_parts(head, a)

    @classmethod
    def from_parts(cls, head: dict[str, Any], a: dict[str, npt.NDArray[Any]]
                   ) -> TransferMessage:
        try:
            msg = cls(str(head["transfer_id"]), str(head["sender"]),
                      namespace_from_json(head["request_id"]),
                      CacheIdentity.from_json(head["identity"]),
                      namespace_from_json(head["namespace"]), a["token_ids"],
                      a["page_ids"], a["tags"], a["prefix_keys"],
                      {k: Region.from_json(v) for k, v in head["regions"].items()},
                      a.get("static_scales"), a["page_digests"], float(head["lease_expiry"]))
        except (KeyError, TypeError, AttributeError) as e:
            raise ArgumentError(f"a transfer message without a valid {e}") from None
        n, P = msg.page_ids.size, msg.identity.page_size
        if (msg.tags.shape != (n,) or msg.page_digests.shape != (n, 16)
                or msg.prefix_keys.shape != (n, 2) or msg.token_ids.ndim != 1
                or msg.token_ids.size < n * P or "data" not in msg.regions):
            raise ArgumentError(f"a transfer message whose arrays disagree on its {n} pages")
        return msg


def confirm_bytes(transfer_id: str, tags: npt.NDArray[np.int64]) -> bytes:
    return pack("confirm", {"transfer_id": transfer_id}, {"tags": tags})


def answer_bytes(transfer_id: str, ok: bool, reason: str = "") -> bytes:
    return pack("answer", {"transfer_id": transfer_id, "ok": ok, "reason": reason}, {})


def parse_notice(data: bytes) -> tuple[str, dict[str, Any], dict[str, npt.NDArray[Any]]]:
    """(kind, header, arrays) of a notice; kind is "offer", "confirm" or "answer"."""
    head, arrays = unpack(data)
    kind = head.get("kind")
    if kind not in ("offer", "confirm", "answer") or not isinstance(head.get("transfer_id"),
                                                                      str):
        raise ArgumentError(f"not a transfer notice (kind {kind!r})")
    return kind, head, arrays
