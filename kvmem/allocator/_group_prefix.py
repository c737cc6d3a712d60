"""GroupPrefixCache: cached prefixes of a hybrid model, restorable in every group at once.

A prefix is cached at **checkpoints**, every ``checkpoint_tokens`` (C) tokens. The entry at
``T = k * C`` holds what each group needs to resume a request after ``T`` tokens::

    tokens      0 ........ C ........ 2C ........ 3C
    entries     [  e1     ][   e2     ][   e3     ]        chained keys k1 -> k2 -> k3
    full        pages of [T-C, T)  (the earlier ones are in e1 .. e(k-1))
    indexer     pages of [T-C, T)
    swa         the pages the query at T reads (its window), whole
    gdn         the state after exactly T tokens (a checkpoint slot), when one was taken

A hit is the greatest ``T`` that every group can restore: the chain of entries up to ``T``
unbroken (the full-attention pages of every earlier checkpoint) and the entry at ``T`` holding
a state checkpoint for every state group. An entry without a state checkpoint (the request's
chunk passed ``T`` without ending there) still links the chain for later checkpoints.

Keys are 128-bit BLAKE2b digests, chained: ``key(k) = H(key(k-1) || tokens of chunk k)``, the
root a digest of the namespace; every entry keeps its chunk's tokens and a hit confirms them.
The cache holds one reference on every page and slot its entries list (through the
:class:`~kvmem.allocator.GroupAllocator`); evicting an entry drops them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmem.allocator._group_allocator import GroupAllocator
from kvmem.allocator._prefix_keys import namespace_bytes

__all__ = ["CheckpointEntry", "GroupPrefixCache"]


@dataclass
class CheckpointEntry:
    """The cached state of a prefix ending at token ``end``: ``tokens`` the last
    ``checkpoint_tokens`` of it, ``pages`` per token group (module doc), ``states`` a
    checkpoint slot per state group (missing: none taken)."""

    end: int
    tokens: tuple[int, ...]
    pages: dict[str, list[int]]
    states: dict[str, int] = field(default_factory=dict)


class GroupPrefixCache:
    """The entries of a hybrid manager's prefix cache, by key, least recently used first."""

    def __init__(self, allocator: GroupAllocator, state_groups: tuple[str, ...],
                 checkpoint_tokens: int, seed: int = 0) -> None:
        self.allocator = allocator
        self.state_groups = state_groups
        self.checkpoint_tokens = checkpoint_tokens
        self.seed = seed.to_bytes(8, "little", signed=True)
        self.entries: OrderedDict[bytes, CheckpointEntry] = OrderedDict()
        self.num_evicted = 0

    # -- keys --------------------------------------------------------------------------------

    def root(self, namespace: Any) -> bytes:
        return hashlib.blake2b(self.seed + namespace_bytes(namespace), digest_size=16).digest()

    def next_key(self, key: bytes, chunk: list[int]) -> bytes:
        """The key of the checkpoint after ``key`` whose chunk holds ``chunk``'s tokens."""
        data = np.asarray(chunk, dtype=np.int64).tobytes()
        return hashlib.blake2b(key + data, digest_size=16).digest()

    # -- lookups -----------------------------------------------------------------------------

    def match(self, tokens: list[int], namespace: Any, max_end: int
              ) -> tuple[int, list[bytes], list[CheckpointEntry]]:
        """The longest restorable cached prefix of ``tokens`` ending at most at ``max_end``:
        ``(end, keys, entries)``, the chain's keys and entries up to ``end`` (0, [], [] when
        none). Changes nothing."""
        C = self.checkpoint_tokens
        key = self.root(namespace)
        keys: list[bytes] = []
        chain: list[CheckpointEntry] = []
        best = 0
        for end in range(C, max_end + 1, C):
            chunk = tokens[end - C : end]
            key = self.next_key(key, chunk)
            entry = self.entries.get(key)
            if entry is None or entry.end != end or list(entry.tokens) != chunk:
                break
            keys.append(key)
            chain.append(entry)
            if len(entry.states) == len(self.state_groups):
                best = len(chain)
        return best * C, keys[:best], chain[:best]

    def touch(self, keys: list[bytes]) -> None:
        """Mark the entries most recently used (a hit), the longest prefix last."""
        for key in keys:
            self.entries.move_to_end(key)

    def references(self, keep: set[bytes] | frozenset[bytes] = frozenset()
                   ) -> dict[str, list[int]]:
        """Every page and slot the cache holds a reference on, per group, but for the
        entries ``keep`` names: what evicting all the others would let go of."""
        out: dict[str, list[int]] = {}
        for key, entry in self.entries.items():
            if key in keep:
                continue
            for name, pages in entry.pages.items():
                out.setdefault(name, []).extend(pages)
            for name, slot in entry.states.items():
                out.setdefault(name, []).append(slot)
        return out

    # -- changes -----------------------------------------------------------------------------

    def insert(self, key: bytes, entry: CheckpointEntry) -> None:
        """Cache ``entry`` under ``key`` (not cached yet), taking a reference on each of its
        pages and slots (the caller transfers slots it allocated for the entry: those are
        not shared again)."""
        self.allocator.share({name: pages for name, pages in entry.pages.items() if pages})
        self.entries[key] = entry

    def add_states(self, key: bytes, states: dict[str, int]) -> None:
        """Give a cached entry the state checkpoints it lacks (slots the caller allocated;
        their one holder becomes the cache)."""
        self.entries[key].states.update(states)

    def evict(self, keep: set[bytes] | frozenset[bytes] = frozenset()) -> bool:
        """Evict the least recently used entry not in ``keep``; False when there is none."""
        for key in self.entries:
            if key not in keep:
                self._drop(self.entries.pop(key))
                self.num_evicted += 1
                return True
        return False

    def clear(self) -> None:
        while self.entries:
            self._drop(self.entries.popitem(last=False)[1])

    def _drop(self, entry: CheckpointEntry) -> None:
        held: dict[str, list[int]] = {n: list(p) for n, p in entry.pages.items() if p}
        for name, slot in entry.states.items():
            held.setdefault(name, []).append(slot)
        if held:
            self.allocator.free(held)
