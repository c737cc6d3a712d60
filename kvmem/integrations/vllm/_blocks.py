"""What the vLLM adapter hands the scheduler (:class:`KVMemBlocks`, :class:`PrefixHit`) and
what it keeps per running request (:class:`RequestState`), and kvmem's KV events as vLLM's
(:func:`vllm_events`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmem.integrations.vllm._adapter import VllmKVCacheAdapter

__all__ = ["KVMemBlock", "KVMemBlocks", "PrefixHit", "RequestState", "vllm_events"]


class KVMemBlock:
    """What a KV connector reads of vLLM's ``KVCacheBlock``: its id, whether it is the null
    block, and ``block_hash`` (not None when the block is full and cached: kvmem's page key is
    not vLLM's hash, so connectors that need the hash read ``request.block_hashes``).
    ``hold``: the adapter's key of the hold keeping it (``pop_blocks_for_free``), or None."""

    __slots__ = ("block_hash", "block_id", "hold")

    is_null = False

    def __init__(self, block_id: int, block_hash: Any = None, hold: Any = None) -> None:
        self.block_id = block_id
        self.block_hash = block_hash
        self.hold = hold

    def __repr__(self) -> str:
        return f"KVMemBlock({self.block_id!r})"


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
    def blocks(self) -> tuple[list[KVMemBlock], ...]:
        """The blocks as KV connectors read them (one group); those in kvmem's prefix cache
        carry a ``block_hash`` (True), as vLLM's cached blocks carry theirs."""
        b = self.get_block_ids()
        assert b is not None
        ids = b[0]
        cached = (self._adapter.cached_blocks(ids) if self._adapter is not None
                  else [True] * len(ids))  # (a prefix hit: cached blocks)
        return ([KVMemBlock(i, True if c else None) for i, c in zip(ids, cached)],)

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


def vllm_events(events: list[Any], lora_ids: dict[Any, int] | None = None) -> list[Any]:
    """kvmem's KV events as vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
    (hashes: kvmem's 128-bit chained keys; a namespace is reported as vLLM reports its parts:
    the ``cache_salt`` in the extra keys of a prompt's first block, a LoRA adapter's name in
    every block's and as ``lora_name``, ``lora_id`` from ``lora_ids``: namespace -> the
    adapter's id). Imports vLLM."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from kvmem.manager import AllPagesCleared, PagesRemoved, PagesStored

    out: list[Any] = []
    for ev in events:
        if isinstance(ev, PagesStored):
            ns = ev.namespace
            lora_name = lora_id = None
            salt = ns
            if isinstance(ns, tuple):  # ("lora", name, path, salt): _keys.namespace_of's
                lora_name, salt = ns[1], ns[3]
                lora_id = (lora_ids or {}).get(ns)
            extra: list[Any] = [None if lora_name is None else (lora_name,)
                                for _ in ev.page_hashes]
            if ev.parent_page_hash is None and salt is not None and extra:
                extra[0] = (salt,) if lora_name is None else (lora_name, salt)
            out.append(BlockStored(
                block_hashes=list(ev.page_hashes), parent_block_hash=ev.parent_page_hash,
                token_ids=list(ev.token_ids), block_size=ev.page_size, lora_id=lora_id,
                medium=ev.medium, lora_name=lora_name,
                extra_keys=extra if any(e is not None for e in extra) else None,
                group_idx=0, kv_cache_spec_kind="full_attention"))
        elif isinstance(ev, PagesRemoved):
            for h in ev.page_hashes:  # vLLM reports one removed block per event
                out.append(BlockRemoved(block_hashes=[h], medium=ev.medium, group_idx=0))
        elif isinstance(ev, AllPagesCleared):
            out.append(AllBlocksCleared())
    return out
