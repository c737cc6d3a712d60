"""The manager's results, events and configuration (frozen snapshots and small records).

:class:`~kvmem.manager.KVCacheManager` returns these; they are importable from
``kvmem.manager``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from kvmem.allocator._page_table import PAD, CSRMetadata
from kvmem.errors import KVMemError
from kvmem.integrity import IntegrityReport

__all__ = [
    "HOOK_KINDS",
    "AdmitResult",
    "AllPagesCleared",
    "HookError",
    "KVEvent",
    "ManagerConfig",
    "ManagerEvent",
    "ManagerStats",
    "PagesRemoved",
    "PagesStored",
    "StepMetadata",
    "VerifyReport",
]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
_INT32_MAX = int(np.iinfo(np.int32).max)

HOOK_KINDS = (
    "admit",  # a request was admitted or resumed: request_id, pages (all it maps), detail
    "allocate",  # pages were allocated: request_id (None for a batch), pages
    "free",  # pages returned to the allocator: pages
    "evict",  # cached pages were evicted to make room: pages
    "preempt",  # a request was preempted: request_id, pages (references dropped)
    "release",  # a request was released (finished or aborted): request_id, pages
    "fork",  # request_id (the child), detail (the parent)
    "step_begin",  # a step was launched: detail (the step id)
    "step_end",  # a step retired: detail (the step id), pages (references it released)
    "integrity_failure",  # a request failed verification and was aborted: request_id, detail
    "kv_event",  # a KV event for routers: event (PagesStored / PagesRemoved / AllPagesCleared)
)


# -- boundary and results -----------------------------------------------------------------------


class ManagerConfig(BaseModel):
    """The numeric configuration of a :class:`KVCacheManager` (validated at the boundary)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_pages: int = Field(gt=0, le=_INT32_MAX)
    page_size: int = Field(default=16, gt=0, le=1 << 16)
    max_seqs: int = Field(default=256, gt=0)
    max_pages_per_seq: int = Field(gt=0)
    watermark: float = Field(default=0.01, ge=0.0, lt=1.0)
    kv_events: bool = False


class AdmitResult(NamedTuple):
    """What :meth:`KVCacheManager.admit` did.

    num_cached_tokens: prompt tokens whose KV is already in mapped pages (skip their prefill)
    num_prompt_tokens: the prompt's length
    num_pages: pages mapped (the whole prompt's)
    num_hit_pages: how many of them came from the prefix cache
    """

    request_id: Any
    num_cached_tokens: int
    num_prompt_tokens: int
    num_pages: int
    num_hit_pages: int


@dataclass(frozen=True)
class StepMetadata:
    """Kernel metadata for one reserved step of a batch of ``B`` requests.

    request_ids: the batch, in order
    rows: ``[B]``, int32 — page-table rows
    num_new_tokens: ``[B]``, int32 — tokens reserved per request this step
    slot_mapping: ``[T]``, int64 — where to write each new token's K/V
        (``page * page_size + offset``), request by request, ``T = sum(num_new_tokens)``
    qo_indptr: ``[B + 1]``, int32 — request ``b``'s new tokens are ``qo_indptr[b]:qo_indptr[b+1]``
    kv_indptr: ``[B + 1]``, int32; kv_indices: ``[nnz]``, int32; kv_last_page_len: ``[B]``,
        int32 — FlashInfer CSR over each request's pages, covering every token up to and
        including the reserved ones
    seq_lens: ``[B]``, int32 — tokens per request including the reserved ones
    copy_src, copy_dst: ``[C]``, int32 — copy-on-write page copies to do before writing, when
        no pool is attached (the manager keeps ``copy_src`` alive until the next ``reserve``);
        empty when a pool is attached (the manager already called ``pool.copy_pages``)
    """

    request_ids: tuple[Any, ...]
    rows: Int32Array
    num_new_tokens: Int32Array
    slot_mapping: Int64Array
    qo_indptr: Int32Array
    kv_indptr: Int32Array
    kv_indices: Int32Array
    kv_last_page_len: Int32Array
    seq_lens: Int32Array
    copy_src: Int32Array
    copy_dst: Int32Array
    page_size: int
    epoch: int = field(default=-1, repr=False)  # the manager's row epoch at reserve()

    @property
    def batch_size(self) -> int:
        return int(self.rows.size)

    @property
    def num_pages(self) -> Int32Array:
        """Pages each request reads: ``[B]``, int32."""
        return np.diff(self.kv_indptr)

    def csr(self) -> CSRMetadata:
        return CSRMetadata(self.kv_indptr, self.kv_indices, self.kv_last_page_len)

    def tensors(self, device: Any = "cpu") -> dict[str, Any]:
        """The kernel metadata as torch tensors on ``device`` (one copy each), keyed by field:
        ``slot_mapping`` (int64), ``qo_indptr``, ``kv_indptr``, ``kv_indices``,
        ``kv_last_page_len``, ``seq_lens``, ``block_table`` (int32). Pass the dict to
        :meth:`KVCacheManager.verify` (``metadata=``) to check the very tensors the kernels
        read, on their device."""
        import torch

        names = ("slot_mapping", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                 "seq_lens", "block_table")
        return {name: torch.from_numpy(np.ascontiguousarray(getattr(self, name))).to(device)
                for name in names}

    @cached_property
    def block_table(self) -> Int32Array:
        """vLLM / flash-attn block table ``[B, W]``, int32, PAD (-1) past each request's pages;
        ``W`` is the widest request of the batch. Built from the CSR on first use."""
        counts = np.diff(self.kv_indptr)
        width = int(counts.max()) if counts.size else 0
        table = np.full((counts.size, width), PAD, dtype=np.int32)
        cols = np.arange(self.kv_indices.size) - np.repeat(self.kv_indptr[:-1], counts)
        table[np.repeat(np.arange(counts.size), counts), cols] = self.kv_indices
        return table


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`KVCacheManager.verify`.

    request_ids: the batch verified, in order
    aborted: ``{request_id: reason}`` for every request that failed (now released)
    integrity: the tracker's report (bad entries), when it found any
    """

    request_ids: tuple[Any, ...] = ()
    aborted: dict[Any, str] = field(default_factory=dict)
    integrity: IntegrityReport | None = None

    @property
    def ok(self) -> bool:
        return not self.aborted

    @property
    def keep(self) -> npt.NDArray[np.bool_]:
        """``[B]``, bool — which requests of the batch may proceed."""
        return np.array([i not in self.aborted for i in self.request_ids], dtype=bool)

    @property
    def ok_ids(self) -> tuple[Any, ...]:
        return tuple(i for i in self.request_ids if i not in self.aborted)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A snapshot of the manager; it does not change when the manager does.

    Every page is in exactly one of: free, used (mapped by a request), cached (remembered by
    the prefix cache, no request maps it: evictable, or held by a fence too), fenced (held only
    by a step fence until that step retires). ``num_free + num_used + num_cached + num_fenced ==
    num_pages``.
    """

    num_pages: int
    page_size: int
    num_free: int
    num_used: int
    num_cached: int
    num_fenced: int  # held only by step fences (or by copy-on-write sources awaiting a copy)
    num_running: int
    num_preempted: int
    num_prefix_queries: int  # admissions (and resumes) that looked up the prefix cache
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int  # pages evicted from the prefix cache
    num_preemptions: int
    num_integrity_failures: int
    num_cow_copies: int
    num_forks: int
    steps_in_flight: int

    @property
    def usage(self) -> float:
        """Fraction of pages mapped by requests (cached and fenced pages are reclaimable)."""
        return self.num_used / self.num_pages

    @property
    def prefix_hit_rate(self) -> float:
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


@dataclass(frozen=True, slots=True)
class ManagerEvent:
    """What a hook receives: ``kind`` (one of :data:`HOOK_KINDS`) and what it concerns."""

    kind: str
    request_id: Any = None
    pages: Int32Array | None = None
    detail: Any = None


# KV events in the shape vLLM publishes (BlockStored / BlockRemoved / AllBlocksCleared), so a
# cache-aware router can follow which prefixes this manager holds. Hashes are 128-bit ints.


@dataclass(frozen=True, slots=True)
class PagesStored:
    page_hashes: tuple[int, ...]
    parent_page_hash: int | None  # the page before the first one (None at the prompt's start)
    token_ids: tuple[int, ...]  # len(page_hashes) * page_size tokens
    page_size: int
    namespace: Any
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    page_hashes: tuple[int, ...]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllPagesCleared:
    medium: str = "GPU"


KVEvent = PagesStored | PagesRemoved | AllPagesCleared


class HookError(KVMemError):
    """A hook raised. The operation that triggered it completed; every other hook still ran."""
