"""Byte accounting: what one token of KV cache and one rank's share of the weights cost.

KV cache, per token, per TP rank (``tp`` GPUs hold one replica of the model)::

    MLA layer        (kv_lora_rank + qk_rope_head_dim) * elem      replicated on every rank
    MHA/GQA layer    2 * kv_heads_per_rank * head_dim * elem       max(1, kv_heads / tp) heads
    indexer layer    index_head_dim (fp8) + 4 per 128 (fp32 scale) replicated on every rank
    linear layer     no tokens: one fixed-size state per request     heads split across ranks
    fp8 scales       "tensor": one fp32 per layer (K and V: two)   a fixed cost, not per token
                     "head": one fp32 per (layer, KV head) [x2]    a fixed cost, not per token
                     "token_head": one fp32 per (token, KV head) [x2 for K and V]; MLA has one head

Weights, per rank: every class is split across the ``tp`` ranks except what engines replicate:
the MLA down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``), the DSA indexer, MoE routers,
norms, a vision tower, and K/V projections once there are fewer KV heads than ranks.
"""

from __future__ import annotations

from typing import NamedTuple

from kvmem._validate import flag, integer, show
from kvmem.errors import ArgumentTypeError, ConfigError
from kvmem.planning._spec import (
    WEIGHT_CLASSES,
    AttentionSpec,
    ModelSpec,
    WeightScheme,
)

__all__ = [
    "KVLayout",
    "ParamCount",
    "WeightBytes",
    "kv_element_bytes",
    "kv_heads_per_rank",
    "kv_layout",
    "layer_kv_bytes_per_token",
    "param_counts",
    "weight_bytes",
]

GIB = 1 << 30
SCALE_BYTES = 4  # fp32 scales, as the pools store them


def kv_element_bytes(kv_dtype: str) -> int:
    """Bytes of one cached element: 2 for bf16/fp16, 1 for fp8."""
    if not isinstance(kv_dtype, str):
        raise ArgumentTypeError(
            f"kv_dtype={show(kv_dtype)}: expected one of bf16, fp16, fp8_e4m3, fp8_e5m2."
        )
    if kv_dtype in ("bf16", "fp16"):
        return 2
    if kv_dtype in ("fp8_e4m3", "fp8_e5m2"):
        return 1
    raise ConfigError(f"unknown KV dtype {kv_dtype!r}; use one of bf16, fp16, fp8_e4m3, fp8_e5m2.")


def kv_heads_per_rank(attention: AttentionSpec, tp: int) -> int:
    """KV heads one TP rank caches; raises where TP cannot split the heads.

    Query heads must divide evenly across ranks. KV heads split down to one per rank; with more
    ranks than KV heads each head is replicated, which needs ``tp % num_kv_heads == 0``. MLA has
    a single latent "head", cached whole on every rank.
    """
    if not isinstance(attention, AttentionSpec):
        raise ArgumentTypeError(f"attention={show(attention)}: expected an AttentionSpec.")
    tp = integer(tp, "tp", minimum=1)
    if attention.num_heads % tp:
        raise ConfigError(
            f"TP {tp} does not divide the {attention.num_heads} attention heads; "
            "pick a TP size that divides the head count."
        )
    if attention.kind == "mla":
        return 1
    kv_heads = attention.num_kv_heads
    assert kv_heads is not None  # validated by AttentionSpec
    if kv_heads >= tp:
        if kv_heads % tp:
            raise ConfigError(
                f"TP {tp} does not divide the {kv_heads} KV heads; pick a TP size that divides "
                "the KV head count."
            )
        return kv_heads // tp
    if tp % kv_heads:
        raise ConfigError(
            f"TP {tp} > {kv_heads} KV heads needs TP to be a multiple of the KV head count so "
            "each head is replicated evenly."
        )
    return 1


def layer_kv_bytes_per_token(
    attention: AttentionSpec, kv_dtype: str, scale_layout: str = "tensor", tp: int = 1
) -> int:
    """Bytes one token costs in one attention layer on one TP rank.

    Parameters
    ----------
    attention : AttentionSpec
        The layer's attention.
    kv_dtype : str
        ``bf16``, ``fp16``, ``fp8_e4m3`` or ``fp8_e5m2``.
    scale_layout : str
        FP8 scale granularity: ``tensor``, ``head`` or ``token_head``; only ``token_head`` adds
        per-token bytes (one fp32 per KV head for K and one for V; one per token for MLA).
    tp : int
        Tensor-parallel ranks sharing the layer.

    Returns
    -------
    int
        e.g. 1152 for a BF16 MLA layer with a 512 + 64 latent, 576 in FP8.
    """
    elem = kv_element_bytes(kv_dtype)
    if not isinstance(scale_layout, str) or scale_layout not in ("tensor", "head", "token_head"):
        raise ConfigError(
            f"unknown FP8 scale layout {scale_layout!r}; use tensor, head or token_head."
        )
    per_token_scales = elem == 1 and scale_layout == "token_head"
    heads = kv_heads_per_rank(attention, tp)
    if attention.kind == "mla" and elem == 1 and scale_layout == "head":
        raise ConfigError(
            "MLA caches one latent, no KV heads: use FP8 scales 'tensor' or 'token_head'."
        )
    if attention.kind == "mla":
        assert attention.kv_lora_rank is not None and attention.qk_rope_head_dim is not None
        width = attention.kv_lora_rank + attention.qk_rope_head_dim
        return width * elem + (SCALE_BYTES if per_token_scales else 0)
    assert attention.head_dim is not None
    return 2 * heads * attention.head_dim * elem + (
        2 * heads * SCALE_BYTES if per_token_scales else 0
    )


def _layer_fixed_scale_bytes(
    attention: AttentionSpec, kv_dtype: str, scale_layout: str, tp: int
) -> int:
    """FP8 scales that do not grow with tokens: per tensor or per (layer, head)."""
    if kv_element_bytes(kv_dtype) != 1 or scale_layout == "token_head":
        return 0
    planes = 1 if attention.kind == "mla" else 2  # MLA caches one latent, not K and V
    heads = 1 if scale_layout == "tensor" else kv_heads_per_rank(attention, tp)
    return planes * heads * SCALE_BYTES


class KVLayout(NamedTuple):
    """KV bytes on one TP rank.

    Attributes
    ----------
    bytes_per_token : int
        Per token of context: the full-attention layers plus the indexer cache.
    attention_bytes_per_token : int
        The full-attention layers' share of ``bytes_per_token``.
    indexer_bytes_per_token : int
        The indexer cache's share of ``bytes_per_token``.
    sliding_bytes_per_token : int
        Per token held in the sliding windows (all sliding layers together).
    sliding_window : int
        Window length in tokens (0 without sliding layers).
    fixed_bytes : int
        Scales stored per tensor or per head, independent of tokens.
    state_bytes_per_request : int
        The linear-attention layers' fixed-size state, per request (0 without them).
    """

    bytes_per_token: int
    attention_bytes_per_token: int
    indexer_bytes_per_token: int
    sliding_bytes_per_token: int
    sliding_window: int
    fixed_bytes: int
    state_bytes_per_request: int = 0


def kv_layout(
    model: ModelSpec, kv_dtype: str, scale_layout: str = "tensor", tp: int = 1
) -> KVLayout:
    """KV byte accounting of ``model`` on one of ``tp`` ranks."""
    _check_model(model)
    attn = model.attention
    per_layer = layer_kv_bytes_per_token(attn, kv_dtype, scale_layout, tp)
    full = model.num_full_layers * per_layer
    indexer = (
        model.indexer.num_cache_layers * model.indexer.bytes_per_token_per_layer()
        if model.indexer
        else 0
    )
    sliding = attn.num_sliding_layers * per_layer
    fixed = model.num_layers * _layer_fixed_scale_bytes(attn, kv_dtype, scale_layout, tp)
    return KVLayout(
        bytes_per_token=full + indexer,
        attention_bytes_per_token=full,
        indexer_bytes_per_token=indexer,
        sliding_bytes_per_token=sliding,
        sliding_window=(attn.sliding_window or 0) if attn.num_sliding_layers else 0,
        fixed_bytes=fixed,
        state_bytes_per_request=(
            model.linear.num_layers * model.linear.state_bytes_per_layer(tp) if model.linear else 0
        ),
    )


class ParamCount(NamedTuple):
    """Parameters of one weight class: all of them, and those every TP rank holds whole."""

    total: int
    replicated: int

    def per_rank(self, tp: int) -> float:
        return (self.total - self.replicated) / tp + self.replicated


def _attention_params(model: ModelSpec, tp: int) -> ParamCount:
    """One attention layer's parameters (indexer excluded)."""
    a, h = model.attention, model.hidden_size
    if a.kind == "mla":
        assert a.kv_lora_rank and a.qk_rope_head_dim and a.qk_nope_head_dim and a.v_head_dim
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            q_down, q_up = h * a.q_lora_rank, a.q_lora_rank * a.num_heads * qk
        else:
            q_down, q_up = 0, h * a.num_heads * qk
        kv_down = h * (a.kv_lora_rank + a.qk_rope_head_dim)
        kv_up = a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        out = a.num_heads * a.v_head_dim * h
        replicated = q_down + kv_down  # engines keep the down-projections whole on every rank
        return ParamCount(q_down + q_up + kv_down + kv_up + out, replicated)
    assert a.num_kv_heads and a.head_dim
    qo = 2 * h * a.num_heads * a.head_dim
    kv = 2 * h * a.num_kv_heads * a.head_dim
    # Below one KV head per rank, each rank holds a whole head: the excess is replication.
    heads = kv_heads_per_rank(a, tp) if tp > 1 else a.num_kv_heads
    kv_per_rank = 2 * h * heads * a.head_dim
    replicated = max(0, (kv_per_rank * tp - kv) // max(tp - 1, 1)) if tp > 1 else 0
    return ParamCount(qo + kv, replicated)


def _linear_params(model: ModelSpec) -> int:
    """Parameters of all linear-attention layers (a gated delta net's projections: q, k, v,
    output gate z, beta and decay a; its convolution, decay and norm; the output projection)."""
    lin, h = model.linear, model.hidden_size
    if lin is None:
        return 0
    keys = lin.num_key_heads * lin.key_head_dim
    values = lin.num_value_heads * lin.value_head_dim
    in_proj = h * (2 * keys + 2 * values + 2 * lin.num_value_heads)
    conv = (2 * keys + values) * lin.conv_kernel_dim
    small = 2 * lin.num_value_heads + lin.value_head_dim  # A_log, dt_bias, the gated norm
    return lin.num_layers * (in_proj + conv + small + values * h)


def param_counts(model: ModelSpec, tp: int = 1, include_mtp: bool = True) -> dict[str, ParamCount]:
    """Parameters per weight class (see :data:`WEIGHT_CLASSES`).

    Parameters
    ----------
    model : ModelSpec
        The architecture.
    tp : int
        TP ranks, which decides what is replicated.
    include_mtp : bool
        Count the multi-token-prediction layers (in the checkpoint; loaded only for speculative
        decoding).
    """
    _check_model(model)
    tp = integer(tp, "tp", minimum=1)
    include_mtp = flag(include_mtp, "include_mtp")
    h = model.hidden_size
    mtp = model.num_mtp_layers if include_mtp else 0
    embed = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    attn = _attention_params(model, tp)
    num_attn_layers = model.num_layers + mtp
    num_linear = model.linear.num_layers if model.linear else 0
    idx = model.indexer
    indexer = 0
    if idx:
        q_in = model.attention.q_lora_rank or h
        indexer = q_in * idx.num_heads * idx.head_dim + h * idx.head_dim + h * idx.num_heads
        indexer *= idx.num_cache_layers + mtp
    counts: dict[str, ParamCount] = {
        "embeddings": ParamCount(embed, 0),
        "attention": ParamCount(
            attn.total * (num_attn_layers - num_linear) + indexer + _linear_params(model),
            attn.replicated * (num_attn_layers - num_linear) + indexer,
        ),
        "dense_mlp": ParamCount(3 * h * model.intermediate_size * model.num_dense_layers, 0),
    }
    moe = model.moe
    other = 2 * h * num_attn_layers + h  # RMSNorm weights
    if moe:
        moe_layers = moe.num_layers + mtp
        shared_inter = moe.shared_intermediate_size or moe.intermediate_size
        counts["shared_experts"] = ParamCount(
            3 * h * shared_inter * moe.num_shared_experts * moe_layers, 0
        )
        counts["routed_experts"] = ParamCount(
            3 * h * moe.intermediate_size * moe.num_experts * moe_layers, 0
        )
        other += h * moe.num_experts * moe_layers  # routers
    else:
        counts["shared_experts"] = ParamCount(0, 0)
        counts["routed_experts"] = ParamCount(0, 0)
    other += mtp * (2 * h * h + 3 * h)  # MTP input projection and its norms
    if model.vision:
        other += model.vision.num_params
    counts["other"] = ParamCount(other, other)
    return counts


class WeightBytes(NamedTuple):
    """Weight bytes of a model in one weight scheme.

    Attributes
    ----------
    total : float
        Every tensor of the checkpoint (MTP layers and vision tower included).
    per_gpu : float
        What one TP rank loads to serve: its shard plus the replicated tensors (MTP layers only
        when they are used).
    replicated_per_gpu : float
        The part of ``per_gpu`` that every rank holds whole.
    by_class : dict[str, float]
        ``per_gpu`` split by weight class.
    """

    total: float
    per_gpu: float
    replicated_per_gpu: float
    by_class: dict[str, float]


def weight_bytes(
    model: ModelSpec, scheme: WeightScheme | None = None, tp: int = 1, use_mtp: bool = False
) -> WeightBytes:
    """Bytes of ``model``'s weights stored as ``scheme`` (the model's own by default)."""
    _check_model(model)
    if scheme is not None and not isinstance(scheme, WeightScheme):
        raise ArgumentTypeError(f"scheme={show(scheme)}: expected None or a WeightScheme.")
    use_mtp = flag(use_mtp, "use_mtp")
    scheme = scheme or model.weights
    ckpt = param_counts(model, tp, include_mtp=True)
    served = param_counts(model, tp, include_mtp=use_mtp)
    total = 0.0
    per_gpu = 0.0
    replicated = 0.0
    by_class: dict[str, float] = {}
    for cls in WEIGHT_CLASSES:
        bpp = scheme.format_of(cls).bytes_per_param()
        total += ckpt[cls].total * bpp
        by_class[cls] = served[cls].per_rank(tp) * bpp
        per_gpu += by_class[cls]
        replicated += served[cls].replicated * bpp
    return WeightBytes(total, per_gpu, replicated, by_class)


def _check_model(model: ModelSpec) -> None:
    if not isinstance(model, ModelSpec):
        raise ArgumentTypeError(
            f"model={show(model)}: expected a ModelSpec (get_model('kimi-k2.6'), load_hf_config)."
        )
