"""Pages that move: page bundles, transfer messages, leases, transports.

::

    _transport.py   Transport: the contract (one-sided reads of registered memory, notices)
    _inprocess.py   InProcessTransport: agents of one process (unit tests)
    _nixl.py        NixlTransport: NIXL over UCX (two processes, or two machines)
    _peer.py        Peer: a spawned second process and its pipe (tests, examples, benchmarks)
    _identity.py    CacheIdentity: what a cache's pages mean; the compatibility check
    _descs.py       Region, page_descs, paired_descs: page addresses as descriptors, merged
    _bundle.py      PageBundle: a run of full pages that left a pool (bytes, scales, digests)
    _message.py     TransferMessage: the offer; the confirm and answer notices
    _wire.py        a JSON header and raw arrays (no pickle)
    _sender.py      Sender: the prefill side (export under a lease, answer confirms)
    _receiver.py    Receiver: the decode side (admit, read, check, commit or fall back)
    _faults.py      TransferFaults: protections a fuzzer switches off (fault injection only)
    _tier.py        HostTier, DiskTier: full pages below the device, keyed by prefix and identity
    _offload.py     Offload: a manager's prefix pages in its tiers (host, disk), loaded back

This room sits above the pools and the allocator and below the manager: it takes a
``KVCacheManager`` as an argument and never imports the manager's module. See
docs/disaggregation.md.
"""

from __future__ import annotations

from kvmem.transfer._bundle import PageBundle, gather_pages, page_digests
from kvmem.transfer._descs import Region, merge_descs, page_descs, paired_descs, tensor_descs
from kvmem.transfer._faults import TransferFaults
from kvmem.transfer._identity import FORMAT_VERSION, CacheIdentity
from kvmem.transfer._inprocess import InProcessHub, InProcessTransport
from kvmem.transfer._message import TransferMessage
from kvmem.transfer._nixl import NixlTransport
from kvmem.transfer._offload import Offload, OffloadConfig, OffloadFaults, OffloadStats
from kvmem.transfer._peer import Peer, PeerError
from kvmem.transfer._receiver import LoadResult, Receiver, Receiving
from kvmem.transfer._sender import Sender
from kvmem.transfer._tier import DiskTier, HostTier, TierStats, tier_keys
from kvmem.transfer._transport import ReadState, Transport

__all__ = [
    "FORMAT_VERSION",
    "CacheIdentity",
    "DiskTier",
    "HostTier",
    "InProcessHub",
    "InProcessTransport",
    "LoadResult",
    "NixlTransport",
    "Offload",
    "OffloadConfig",
    "OffloadFaults",
    "OffloadStats",
    "PageBundle",
    "Peer",
    "PeerError",
    "ReadState",
    "Receiver",
    "Receiving",
    "Region",
    "Sender",
    "TierStats",
    "TransferFaults",
    "TransferMessage",
    "Transport",
    "gather_pages",
    "merge_descs",
    "page_descs",
    "page_digests",
    "paired_descs",
    "tensor_descs",
    "tier_keys",
]
