"""Page bookkeeping in numpy (no torch).

::

    _page_allocator.py  PageAllocator: free pages, refcounts, a lifetime tag per page
    _change_log.py      ChangeLog: pages whose tag changed, a cursor per reader
    _page_table.py      PageTable: each request's row of pages and its per-row state
    _step_metadata.py   StepMetadata, StepBuilder: kernel metadata (CSR splice, slot mapping)
    _fences.py          StepFences: references held until a step retires, a copy is made or a
                        lease ends
    _prefix_keys.py     PrefixKeys: the chained key function, namespace encoding
    _prefix_cache.py    PrefixCache: the interface a prefix-reuse policy implements
    _hashed_prefix_cache.py  HashedPrefixCache: index, confirmation, LRU
    _pages.py           Pages: one manager's references (allocate/evict/drop), page contents
    _admission.py       Admission: a prompt's pages and cached prefix, whether it fits; namespaces
    _forks.py           Forks: a fork's rows and the copy-on-write copies it promised
    _reserve.py         Reserver: a batch's token slots, pages, copy-on-write, step metadata
    _commits.py         Committer: committed tokens, full pages offered to the prefix cache
    _invariants.py      the bookkeeping invariants, checked in full
    _groups.py          KV cache group specs: full attention, sliding window, state, indexer
    _arena.py           ByteArena: one byte budget in equal chunks, each lent to one group
    _group_allocator.py GroupAllocator: every group's pages from the arena's chunks, unpadded
    _window.py          WindowRow: a request's sliding-window pages, released as it advances
    _group_costs.py     a request's bytes in every group, kvmem's and padded to one page size
"""

from __future__ import annotations

from kvmem.allocator._admission import Admission, Namespaces, Plan
from kvmem.allocator._arena import ByteArena
from kvmem.allocator._change_log import ChangeLog, ChangeReader
from kvmem.allocator._commits import Committer, batch_tokens, keys_as_ints
from kvmem.allocator._fences import Lease, StepFences, StepHandle
from kvmem.allocator._forks import Forks
from kvmem.allocator._group_allocator import GroupAllocator, GroupFit, GroupStats, GroupUsage
from kvmem.allocator._group_costs import PaddedLayout, RequestCost, padded_layout, request_cost
from kvmem.allocator._group_prefix import CheckpointEntry, GroupPrefixCache
from kvmem.allocator._group_table import (
    RELEASED,
    GroupPages,
    GroupTable,
    HybridRequest,
    HybridStep,
    StateRows,
    TokenKernels,
    TokenRows,
    ragged,
)
from kvmem.allocator._groups import (
    FullAttentionSpec,
    GroupSpec,
    IndexerSpec,
    SlidingWindowSpec,
    StateSpec,
    check_groups,
    first_window_page,
)
from kvmem.allocator._hashed_prefix_cache import HashedPrefixCache
from kvmem.allocator._invariants import page_classes, problems
from kvmem.allocator._page_allocator import AllocatorStats, FreePlan, PageAllocator
from kvmem.allocator._page_table import CSRMetadata, GrowResult, PageTable
from kvmem.allocator._pages import FaultHooks, Pages
from kvmem.allocator._prefix_cache import PrefixCache, PrefixMatch
from kvmem.allocator._prefix_keys import Namespace, PrefixKeys, namespace_bytes
from kvmem.allocator._reserve import Reserver, token_counts
from kvmem.allocator._step_metadata import StepBuilder, StepMetadata, StepRecord
from kvmem.allocator._window import WindowRow
from kvmem.integrity import PAD, Splice

__all__ = [
    "PAD",
    "RELEASED",
    "Admission",
    "AllocatorStats",
    "ByteArena",
    "CSRMetadata",
    "ChangeLog",
    "ChangeReader",
    "CheckpointEntry",
    "Committer",
    "FaultHooks",
    "Forks",
    "FreePlan",
    "FullAttentionSpec",
    "GroupAllocator",
    "GroupFit",
    "GroupPages",
    "GroupPrefixCache",
    "GroupSpec",
    "GroupStats",
    "GroupTable",
    "GroupUsage",
    "GrowResult",
    "HashedPrefixCache",
    "HybridRequest",
    "HybridStep",
    "IndexerSpec",
    "Lease",
    "Namespace",
    "Namespaces",
    "PaddedLayout",
    "PageAllocator",
    "PageTable",
    "Pages",
    "Plan",
    "PrefixCache",
    "PrefixKeys",
    "PrefixMatch",
    "RequestCost",
    "Reserver",
    "SlidingWindowSpec",
    "Splice",
    "StateRows",
    "StateSpec",
    "StepBuilder",
    "StepFences",
    "StepHandle",
    "StepMetadata",
    "StepRecord",
    "TokenKernels",
    "TokenRows",
    "WindowRow",
    "batch_tokens",
    "check_groups",
    "first_window_page",
    "keys_as_ints",
    "namespace_bytes",
    "padded_layout",
    "page_classes",
    "problems",
    "ragged",
    "request_cost",
    "token_counts",
]
