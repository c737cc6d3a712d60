"""What the vLLM adapter hands the scheduler (:class:`KVMemBlocks`, :class:`PrefixHit`) and
what it keeps per running request (:class:`RequestState`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmem.integrations.vllm._adapter import VllmKVCacheAdapter

__all__ = ["KVMemBlocks", "PrefixHit", "RequestState"]


class KVMemBlocks:
    """What vLLM's ``KVCacheBlocks`` gives the scheduler: block ids, one list per group (one
    group here). ``ids`` is None until the adapter's queue is flushed (see the module doc)."""

    __slots__ = ("_adapter", "ids")

    def __init__(self, adapter: VllmKVCacheAdapter | None, ids: list[int] | None) -> None:
        self._adapter = adapter
        self.ids = ids

    def get_block_ids(self, allow_none: bool = False, *,
                      group_ids: Any = None) -> tuple[list[int], ...] | None:
        ids = self.ids
        if ids is None:
            assert self._adapter is not None
            self._adapter.flush()
            ids = self.ids
            assert ids is not None
        if ids or not allow_none:
            return (ids,)
        return None

    @property
    def blocks(self) -> tuple[list[int], ...]:
        b = self.get_block_ids()
        assert b is not None
        return b

    def __repr__(self) -> str:
        return f"KVMemBlocks({self.ids!r})"


class PrefixHit(KVMemBlocks):
    """``get_computed_blocks``' result: the prefix hit's block ids and how many of them only the
    cache holds (a hit takes them out of the free count, as vLLM's touch does)."""

    __slots__ = ("num_evictable",)

    def __init__(self, ids: list[int], num_evictable: int) -> None:
        super().__init__(None, ids)
        self.num_evictable = num_evictable


class RequestState:
    """Per running request: its id, its token capacity once the queue is flushed (pages *
    block size), and its tokens committed once the queue is flushed (kept up to date under
    async scheduling; synchronous scheduling commits what it schedules, so there the request's
    computed tokens say it and the decode step's flush does not touch this)."""

    __slots__ = ("cap", "committed", "rid", "row")

    def __init__(self, rid: str, cap: int, committed: int) -> None:
        self.rid = rid
        self.cap = cap
        self.committed = committed
        self.row = -1  # its kvmem row (kept for the paranoid check's worker block table)
