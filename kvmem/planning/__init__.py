"""Capacity planning: how many tokens of KV fit, how many requests run at once, how fast.

Pure functions over validated specs; no GPU and no torch needed (``import kvmem.planning`` does
not import torch). The KV byte accounting is the same as the pools' (issue 3): MLA latents are
replicated on every TP rank, GQA heads split down to one per rank, FP8 scales are fp32 per
tensor, head or (token, head), sliding-window layers cost a fixed amount per sequence, and
sparse-attention indexer caches are counted in their own dtype.

>>> from kvmem.planning import plan_capacity
>>> plan = plan_capacity("kimi-k2.6", "h200", tp=8, kv_dtype="fp8_e4m3", context_len=32768)
>>> plan.kv_bytes_per_token_per_gpu
35136
"""

from __future__ import annotations

from kvmem.planning._accounting import (
    KVLayout,
    WeightBytes,
    kv_heads_per_rank,
    kv_layout,
    layer_kv_bytes_per_token,
    param_counts,
    weight_bytes,
)
from kvmem.planning._groups import (
    GroupPlan,
    GroupRow,
    LayoutPlan,
    kv_groups,
    plan_groups,
    vllm_groups,
)
from kvmem.planning._hf import SUPPORTED_MODEL_TYPES, load_hf_config, model_from_hf_config
from kvmem.planning._plan import (
    CapacityPlan,
    decode_bytes_per_step,
    expected_active_experts,
    plan_capacity,
    tokens_freed,
)
from kvmem.planning._presets import (
    GPU_PRESETS,
    MODEL_PRESETS,
    get_gpu,
    get_model,
    weight_scheme,
)
from kvmem.planning._reserve import (
    FixedReserve,
    MemoryFraction,
    ReservePolicy,
    SGLangPolicy,
    sglang_mem_fraction_static,
)
from kvmem.planning._spec import (
    KV_DTYPES,
    SCALE_LAYOUTS,
    WEIGHT_CLASSES,
    AttentionSpec,
    GPUSpec,
    IndexerSpec,
    LinearAttentionSpec,
    ModelSpec,
    MoESpec,
    VisionSpec,
    WeightFormat,
    WeightScheme,
)
from kvmem.planning._throughput import ThroughputModel, fit_throughput

__all__ = [
    "GPU_PRESETS",
    "KV_DTYPES",
    "MODEL_PRESETS",
    "SCALE_LAYOUTS",
    "SUPPORTED_MODEL_TYPES",
    "WEIGHT_CLASSES",
    "AttentionSpec",
    "CapacityPlan",
    "FixedReserve",
    "GPUSpec",
    "GroupPlan",
    "GroupRow",
    "IndexerSpec",
    "KVLayout",
    "LayoutPlan",
    "LinearAttentionSpec",
    "MemoryFraction",
    "MoESpec",
    "ModelSpec",
    "ReservePolicy",
    "SGLangPolicy",
    "ThroughputModel",
    "VisionSpec",
    "WeightBytes",
    "WeightFormat",
    "WeightScheme",
    "decode_bytes_per_step",
    "expected_active_experts",
    "fit_throughput",
    "get_gpu",
    "get_model",
    "kv_groups",
    "kv_heads_per_rank",
    "kv_layout",
    "layer_kv_bytes_per_token",
    "load_hf_config",
    "model_from_hf_config",
    "param_counts",
    "plan_capacity",
    "plan_groups",
    "sglang_mem_fraction_static",
    "tokens_freed",
    "vllm_groups",
    "weight_bytes",
    "weight_scheme",
]
