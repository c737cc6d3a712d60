"""What a capacity plan is computed from: a model's architecture, its weight formats, a GPU.

Everything here is a validated, frozen pydantic model: users type these or load them from JSON or
a Hugging Face ``config.json``, so they are checked once, at the boundary.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, model_validator

from kvmem._specs import NonNegativeInt, PositiveInt, PositiveReal, SpecModel
from kvmem.errors import ConfigError
from kvmem.quant.int4 import int4_bytes_per_param  # torch-free: int4 imports torch lazily

__all__ = [
    "KV_DTYPES",
    "SCALE_LAYOUTS",
    "WEIGHT_CLASSES",
    "AttentionSpec",
    "GPUSpec",
    "IndexerSpec",
    "KVDtype",
    "LinearAttentionSpec",
    "MoESpec",
    "ModelSpec",
    "ScaleLayout",
    "VisionSpec",
    "WeightClass",
    "WeightFormat",
    "WeightScheme",
]

KVDtype = Literal["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
ScaleLayout = Literal["tensor", "head", "token_head"]
KV_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
SCALE_LAYOUTS: tuple[str, ...] = ("tensor", "head", "token_head")

MAX_GPU_MEMORY_MIB = 1 << 33  # 8 PiB: 2**53 bytes, the most a float counts exactly
MAX_GPU_BANDWIDTH_GBS = 1e9

WeightClass = Literal[
    "embeddings", "attention", "dense_mlp", "shared_experts", "routed_experts", "other"
]
WEIGHT_CLASSES: tuple[str, ...] = (
    "embeddings",
    "attention",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
    "other",
)

class WeightFormat(SpecModel):
    """How one class of weights is stored.

    ``bf16``/``fp16``/``fp32``: plain. ``fp8``: one byte per parameter plus one fp32 scale per
    ``block_size x block_size`` block (DeepSeek-V3 style; ``block_size=0`` means one scale per
    tensor). ``int4``: the packed group-wise codec of :mod:`kvmem.quant.int4`. ``mxfp4``: 4-bit
    values with one 8-bit shared exponent per 32 (OCP MX, as gpt-oss ships its experts).
    """

    kind: Literal["bf16", "fp16", "fp32", "fp8", "int4", "mxfp4"]
    group_size: PositiveInt = 32
    scale_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    zero_point: StrictBool = False
    block_size: NonNegativeInt = 128

    def bytes_per_param(self) -> float:
        """Average bytes per parameter, scales included."""
        if self.kind in ("bf16", "fp16"):
            return 2.0
        if self.kind == "fp32":
            return 4.0
        if self.kind == "fp8":
            return 1.0 + (4.0 / (self.block_size * self.block_size) if self.block_size else 0.0)
        if self.kind == "mxfp4":
            return 0.5 + 1.0 / 32
        return int4_bytes_per_param(self.group_size, self.scale_dtype, self.zero_point)

    def label(self) -> str:
        """Short human label, e.g. ``int4-g32`` or ``fp8-b128``."""
        if self.kind == "int4":
            zp = "-zp" if self.zero_point else ""
            sd = "" if self.scale_dtype == "bfloat16" else f"-{self.scale_dtype}"
            return f"int4-g{self.group_size}{sd}{zp}"
        if self.kind == "fp8":
            return f"fp8-b{self.block_size}" if self.block_size else "fp8-tensor"
        return self.kind


BF16 = WeightFormat(kind="bf16")


class WeightScheme(SpecModel):
    """A :class:`WeightFormat` for each weight class.

    ``other`` holds what is neither of the named classes: MoE routers, norms, a vision tower.
    """

    embeddings: WeightFormat = BF16
    attention: WeightFormat = BF16
    dense_mlp: WeightFormat = BF16
    shared_experts: WeightFormat = BF16
    routed_experts: WeightFormat = BF16
    other: WeightFormat = BF16

    def format_of(self, weight_class: str) -> WeightFormat:
        fmt: WeightFormat = getattr(self, weight_class)
        return fmt

    def label(self) -> str:
        """Compact description, e.g. ``routed_experts=int4-g32, rest=bf16``."""
        labels = {c: self.format_of(c).label() for c in WEIGHT_CLASSES}
        common = max(set(labels.values()), key=list(labels.values()).count)
        odd = [f"{c}={v}" for c, v in labels.items() if v != common]
        return ", ".join([*odd, f"rest={common}"]) if odd else common


class AttentionSpec(SpecModel):
    """The attention layers and what each caches per token.

    ``mha``/``gqa``: K and V, ``num_kv_heads x head_dim`` each, split across TP ranks down to one
    KV head per rank (below that, heads are replicated). ``mla``: one latent vector of
    ``kv_lora_rank + qk_rope_head_dim`` per token per layer, replicated on every TP rank.

    ``num_sliding_layers`` of the layers attend only to the last ``sliding_window`` tokens: their
    cache is a fixed per-sequence cost, not a per-token one.
    """

    kind: Literal["mha", "gqa", "mla"]
    num_heads: PositiveInt
    num_kv_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    kv_lora_rank: PositiveInt | None = None
    qk_rope_head_dim: PositiveInt | None = None
    qk_nope_head_dim: PositiveInt | None = None
    v_head_dim: PositiveInt | None = None
    q_lora_rank: PositiveInt | None = None
    sliding_window: PositiveInt | None = None
    num_sliding_layers: NonNegativeInt = 0

    @model_validator(mode="after")
    def _check(self) -> AttentionSpec:
        if self.kind == "mla":
            missing = [
                n
                for n in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
                if getattr(self, n) is None
            ]
            if missing:
                raise ConfigError(f"MLA attention needs {', '.join(missing)}; none was given.")
        else:
            if self.num_kv_heads is None or self.head_dim is None:
                raise ConfigError(
                    f"{self.kind.upper()} attention needs num_kv_heads and head_dim; got "
                    f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}."
                )
            if self.num_heads % self.num_kv_heads:
                raise ConfigError(
                    f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                    f"{self.num_kv_heads}."
                )
            if self.kind == "mha" and self.num_kv_heads != self.num_heads:
                raise ConfigError(
                    f"MHA has one KV head per query head; got {self.num_kv_heads} KV heads for "
                    f"{self.num_heads} heads. Use kind='gqa'."
                )
        if self.num_sliding_layers and self.sliding_window is None:
            raise ConfigError("num_sliding_layers > 0 needs sliding_window (in tokens).")
        return self


class IndexerSpec(SpecModel):
    """A sparse-attention indexer (DeepSeek V3.2 / GLM 5 DSA): its own per-token key cache.

    Only ``num_cache_layers`` layers compute (and cache) their own index keys; the others reuse
    another layer's top-k selection (GLM 5.2's IndexShare). Like the MLA latent, the index keys are
    replicated on every TP rank. FP8 index keys carry one fp32 scale per ``scale_block`` values.
    """

    head_dim: PositiveInt
    num_heads: PositiveInt
    num_cache_layers: PositiveInt
    dtype: Literal["fp8_e4m3", "bf16"] = "fp8_e4m3"
    scale_block: PositiveInt = 128

    def bytes_per_token_per_layer(self) -> int:
        """Bytes one token's index key costs in one layer (132 for 128-dim FP8 keys)."""
        if self.dtype == "bf16":
            return 2 * self.head_dim
        return self.head_dim + 4 * -(-self.head_dim // self.scale_block)


class LinearAttentionSpec(SpecModel):
    """Linear-attention layers with a fixed-size recurrent state per request (Qwen3-Next's
    gated delta net): ``num_layers`` of the model's layers, which cache no tokens.

    One layer's state, per request: the causal convolution's last ``conv_kernel_dim - 1``
    inputs over ``2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim``
    channels, and the recurrent state, ``num_value_heads x key_head_dim x value_head_dim``, both
    in ``state_dtype``; heads split across TP ranks (``config.json``'s ``linear_*`` fields).
    """

    num_layers: PositiveInt
    num_key_heads: PositiveInt
    num_value_heads: PositiveInt
    key_head_dim: PositiveInt
    value_head_dim: PositiveInt
    conv_kernel_dim: PositiveInt
    state_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"

    def state_bytes_per_layer(self, tp: int = 1) -> int:
        """Bytes of one request's state in one layer on one of ``tp`` ranks (1,097,728 for
        Qwen3-Next's bf16 state at TP 1)."""
        for name in ("num_key_heads", "num_value_heads"):
            heads = getattr(self, name)
            if heads % tp:
                raise ConfigError(f"TP {tp} does not divide the {heads} linear-attention "
                                  f"{name.removeprefix('num_').replace('_', ' ')}; pick a TP "
                                  "size that divides both head counts.")
        elem = 4 if self.state_dtype == "fp32" else 2
        conv_channels = (2 * self.num_key_heads * self.key_head_dim
                         + self.num_value_heads * self.value_head_dim) // tp
        conv = conv_channels * (self.conv_kernel_dim - 1)
        recurrent = self.num_value_heads // tp * self.key_head_dim * self.value_head_dim
        return (conv + recurrent) * elem


class MoESpec(SpecModel):
    """Mixture-of-experts layers: routed experts (SwiGLU, 3 matrices each) and shared experts."""

    num_layers: PositiveInt
    num_experts: PositiveInt
    top_k: PositiveInt
    intermediate_size: PositiveInt
    num_shared_experts: NonNegativeInt = 0
    shared_intermediate_size: PositiveInt | None = None

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k {self.top_k} is larger than num_experts {self.num_experts}.")
        return self


class VisionSpec(SpecModel):
    """A vision tower, as far as capacity goes: its parameters and the size an engine sees."""

    num_params: PositiveInt
    num_layers: PositiveInt
    hidden_size: PositiveInt


class ModelSpec(SpecModel):
    """A model's architecture as far as memory is concerned.

    Layers are ``num_dense_layers`` dense-MLP layers plus ``moe.num_layers`` MoE layers.
    ``num_mtp_layers`` multi-token-prediction layers are in the checkpoint but are loaded only
    for speculative decoding. ``source`` says where the numbers came from.
    """

    name: str
    source: str = ""
    num_layers: PositiveInt
    hidden_size: PositiveInt
    vocab_size: PositiveInt
    tie_word_embeddings: StrictBool = False
    attention: AttentionSpec
    indexer: IndexerSpec | None = None
    linear: LinearAttentionSpec | None = None
    num_dense_layers: NonNegativeInt
    intermediate_size: NonNegativeInt = 0
    moe: MoESpec | None = None
    num_mtp_layers: NonNegativeInt = 0
    vision: VisionSpec | None = None
    weights: WeightScheme = WeightScheme()

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        num_moe = self.moe.num_layers if self.moe else 0
        if self.num_dense_layers + num_moe != self.num_layers:
            raise ConfigError(
                f"{self.name}: {self.num_dense_layers} dense + {num_moe} MoE layers != "
                f"num_layers {self.num_layers}."
            )
        if self.num_dense_layers and not self.intermediate_size:
            raise ConfigError(f"{self.name}: dense layers need intermediate_size.")
        if self.attention.num_sliding_layers > self.num_layers:
            raise ConfigError(
                f"{self.name}: {self.attention.num_sliding_layers} sliding-window layers but "
                f"only {self.num_layers} layers."
            )
        num_linear = self.linear.num_layers if self.linear else 0
        if self.attention.num_sliding_layers + num_linear >= self.num_layers:
            raise ConfigError(
                f"{self.name}: {self.attention.num_sliding_layers} sliding-window and "
                f"{num_linear} linear-attention layers leave no full-attention layer of "
                f"{self.num_layers}; kvmem plans models with at least one."
            )
        if self.indexer and self.indexer.num_cache_layers > self.num_layers:
            raise ConfigError(
                f"{self.name}: indexer caches in {self.indexer.num_cache_layers} layers but only "
                f"{self.num_layers} layers."
            )
        return self

    @property
    def num_full_layers(self) -> int:
        """Layers whose KV cache grows with every token (not sliding-window, not linear)."""
        num_linear = self.linear.num_layers if self.linear else 0
        return self.num_layers - self.attention.num_sliding_layers - num_linear


class GPUSpec(SpecModel):
    """A GPU: memory as the driver reports it, and peak memory bandwidth.

    ``memory_mib`` is what ``nvidia-smi --query-gpu=memory.total`` (or ``rocm-smi``) prints, in
    MiB; engines size their pools from that, not from the marketing "141 GB". Both are bounded
    far beyond any GPU (8 PiB, 1e9 GB/s) so that a plan's byte counts stay exact in a float.
    """

    name: str
    memory_mib: PositiveInt = Field(le=MAX_GPU_MEMORY_MIB)
    bandwidth_gbs: PositiveReal = Field(
        le=MAX_GPU_BANDWIDTH_GBS, description="peak HBM bandwidth, 1e9 bytes/s"
    )
    source: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024
