"""ByteArena: one byte budget split into equal chunks, each lent to one KV cache group at a time.

::

    budget_bytes  |chunk 0 |chunk 1 |chunk 2 |chunk 3 |...|chunk n-1|rest|
    owners        [  -1      2        0        -1      ...    0    ]      -1: in the arena
                           group 2  group 0                           rest < chunk_bytes: unused

A group carves each chunk it borrows into pages of its own byte size (see
:class:`~kvmem.allocator.GroupAllocator`); the chunk comes back when all its pages are free.
The arena only knows who holds which chunk.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvmem._validate import INT32_MAX, integer
from kvmem.errors import ArgumentError, IntegrityError, OutOfPagesError

__all__ = ["ByteArena"]

ChunkIds = npt.NDArray[np.int32]


class ByteArena:
    """``budget_bytes // chunk_bytes`` chunks of ``chunk_bytes`` bytes, each free or lent.

    Attributes
    ----------
    owners: ``[num_chunks]``, int32, read-only view
        The group index holding each chunk; -1 for a chunk in the arena.
    """

    def __init__(self, budget_bytes: int, chunk_bytes: int) -> None:
        self.budget_bytes = integer(budget_bytes, "budget_bytes", minimum=1)
        self.chunk_bytes = integer(chunk_bytes, "chunk_bytes", minimum=1)
        num_chunks = self.budget_bytes // self.chunk_bytes
        if not 1 <= num_chunks <= INT32_MAX:
            raise ArgumentError(f"budget_bytes={self.budget_bytes} holds {num_chunks} chunks of "
                                f"chunk_bytes={self.chunk_bytes}: expected 1..{INT32_MAX}; "
                                "lower chunk_bytes or raise the budget.")
        self.num_chunks = num_chunks
        self._owners = np.full(num_chunks, -1, dtype=np.int32)
        self._free = np.arange(num_chunks - 1, -1, -1, dtype=np.int32)  # lend 0, 1, 2, ...
        self._num_free = num_chunks
        self.owners = self._owners.view()
        self.owners.flags.writeable = False

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def unused_bytes(self) -> int:
        """Bytes of the budget past the last whole chunk (never lent)."""
        return self.budget_bytes - self.num_chunks * self.chunk_bytes

    def lend(self, group: int, num: int) -> ChunkIds:
        """Lend ``num`` free chunks to ``group``; all or nothing. Returns ``[num]``, int32."""
        num = integer(num, "num", minimum=0, maximum=INT32_MAX)
        if num > self._num_free:
            raise OutOfPagesError(num, self._num_free, "Free pages in any group first: a "
                                  "chunk whose pages are all free returns to the arena.",
                                  unit="chunks")
        start = self._num_free - num
        chunks = self._free[start : self._num_free][::-1].copy()
        self._num_free = start
        self._owners[chunks] = group
        return chunks

    def give_back(self, group: int, chunks: ChunkIds) -> None:
        """Return ``group``'s chunks (distinct) to the arena; raises IntegrityError, changing
        nothing, if one is not that group's."""
        if chunks.size == 0:
            return
        wrong = chunks[self._owners[chunks] != group]
        if wrong.size:
            raise IntegrityError(f"chunks {wrong.tolist()[:16]} are not lent to group {group} "
                                 f"(owners {self._owners[wrong].tolist()[:16]}); nothing "
                                 "returned.")
        self._owners[chunks] = -1
        self._free[self._num_free : self._num_free + chunks.size] = chunks
        self._num_free += chunks.size

    def check(self) -> list[str]:
        """Problems with the arena's own bookkeeping (empty when sound): the free list holds
        exactly the chunks owned by nobody, once each."""
        problems = []
        free = self._free[: self._num_free]
        counts = np.bincount(free, minlength=self.num_chunks)
        if np.count_nonzero(counts > 1):
            problems.append(f"chunks {np.flatnonzero(counts > 1).tolist()[:16]} are free twice")
        unowned = self._owners == -1
        if not np.array_equal(counts > 0, unowned):
            bad = np.flatnonzero((counts > 0) != unowned)
            problems.append(f"chunks {bad.tolist()[:16]} are free without being unowned, or "
                            "unowned without being free")
        return problems
