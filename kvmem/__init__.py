"""kvmem: a paged KV-cache memory manager for LLM inference engines.

Layers (data flows downward; nothing imports upward)::

    kvmem.cli          the ``kvmem`` command (plan, simulate, fuzz) and its parser
    kvmem.simulate     continuous batching on a planned pool, driving the real manager
    kvmem.planning     capacity plans, model and GPU presets, throughput model (no torch)
    kvmem.manager      KVCacheManager: the facade an engine calls, per request and per step
    kvmem.hybrid       HybridManager: the same for a model whose layers keep several kinds of
                       cache (KV cache groups: sliding windows, recurrent states, indexers)
    kvmem.allocator    PageAllocator, PageTable, prefix caches, step fences, the step's kernel
                       metadata, reserve and commit (numpy only)
    kvmem.integrity    the qualified tag format, trackers, the full check and the verifier
                       (numpy; torch forms lazily)
    kvmem.quant        KV codecs: bf16/fp16 pass-through, fp8 e4m3/e5m2 with scales; int4 weights
    kvmem.cuda         PagePool: page data on the GPU when there is one, else the CPU
    kvmem.attention    reference paged attention over a PagePool
    kvmem.integrations a transformers model and a small engine on kvmem pages; vLLM's scheduler
    kvmem.testing      fuzzing engines, oracles and the fault catalog

Names from the torch layers (``PagePool``, ``PoolSpec``, ``paged_attention``) and from planning
are imported on first use, so ``import kvmem.allocator`` needs neither torch nor pydantic models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvmem.allocator import (
    PAD,
    AllocatorStats,
    CSRMetadata,
    GrowResult,
    HashedPrefixCache,
    PageAllocator,
    PageTable,
    PrefixCache,
    StepFences,
    StepHandle,
    StepMetadata,
)
from kvmem.errors import (
    ArgumentError,
    ArgumentTypeError,
    ConcurrentUseError,
    ConfigError,
    HookError,
    IncompatibleCacheError,
    IntegrityError,
    InvalidFreeError,
    KVMemError,
    MetadataError,
    OutOfPagesError,
)
from kvmem.integrity import CheckingTracker, IntegrityReport, NoOpTracker, Tracker, VerifierStats

if TYPE_CHECKING:
    from kvmem.attention import paged_attention
    from kvmem.cuda import PagePool, PoolSpec, PoolStats
    from kvmem.hybrid import HybridManager
    from kvmem.manager import AdmitResult, KVCacheManager, ManagerStats, VerifyReport
    from kvmem.planning import (
        CapacityPlan,
        GPUSpec,
        ModelSpec,
        SGLangPolicy,
        fit_throughput,
        get_gpu,
        get_model,
        plan_capacity,
    )

__version__ = "0.1.0"

_LAZY = {
    "paged_attention": "kvmem.attention",
    "PagePool": "kvmem.cuda",
    "PoolSpec": "kvmem.cuda",
    "PoolStats": "kvmem.cuda",
    "AdmitResult": "kvmem.manager",
    "KVCacheManager": "kvmem.manager",
    "HybridManager": "kvmem.hybrid",
    "ManagerStats": "kvmem.manager",
    "VerifyReport": "kvmem.manager",
    "CapacityPlan": "kvmem.planning",
    "GPUSpec": "kvmem.planning",
    "ModelSpec": "kvmem.planning",
    "SGLangPolicy": "kvmem.planning",
    "fit_throughput": "kvmem.planning",
    "get_gpu": "kvmem.planning",
    "get_model": "kvmem.planning",
    "plan_capacity": "kvmem.planning",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "PAD",
    "AdmitResult",
    "AllocatorStats",
    "ArgumentError",
    "ArgumentTypeError",
    "CSRMetadata",
    "CapacityPlan",
    "CheckingTracker",
    "ConcurrentUseError",
    "ConfigError",
    "GPUSpec",
    "GrowResult",
    "HashedPrefixCache",
    "HookError",
    "HybridManager",
    "IncompatibleCacheError",
    "IntegrityError",
    "IntegrityReport",
    "InvalidFreeError",
    "KVCacheManager",
    "KVMemError",
    "ManagerStats",
    "MetadataError",
    "ModelSpec",
    "NoOpTracker",
    "OutOfPagesError",
    "PageAllocator",
    "PagePool",
    "PageTable",
    "PoolSpec",
    "PoolStats",
    "PrefixCache",
    "SGLangPolicy",
    "StepFences",
    "StepHandle",
    "StepMetadata",
    "Tracker",
    "VerifierStats",
    "VerifyReport",
    "__version__",
    "fit_throughput",
    "get_gpu",
    "get_model",
    "paged_attention",
    "plan_capacity",
]
