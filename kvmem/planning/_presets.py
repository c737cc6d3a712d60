"""Named models and GPUs, and named weight schemes.

Every preset's numbers are the public ``config.json`` values of the model (sources in each
``source`` field and in docs/capacity_planning.md). GPU memory is what the driver reports
(``nvidia-smi --query-gpu=memory.total`` in MiB; ``torch.cuda.get_device_properties`` on ROCm).
"""

from __future__ import annotations

import re

from kvmem._validate import show
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError
from kvmem.planning._spec import (
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

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "WEIGHT_SCHEME_NAMES",
    "get_gpu",
    "get_model",
    "weight_scheme",
]

_FP8 = WeightFormat(kind="fp8", block_size=128)
_INT4_G32 = WeightFormat(kind="int4", group_size=32, scale_dtype="bfloat16")
_MXFP4 = WeightFormat(kind="mxfp4")

# DeepSeek-V3-style FP8 checkpoints: every linear layer FP8 with 128x128 block scales;
# embeddings, lm_head, routers and norms stay BF16.
_FP8_LINEAR = WeightScheme(attention=_FP8, dense_mlp=_FP8, shared_experts=_FP8, routed_experts=_FP8)


def _kimi_k26() -> ModelSpec:
    return ModelSpec(
        name="kimi-k2.6",
        source=(
            "huggingface.co/moonshotai/Kimi-K2.6 config.json (text_config: DeepseekV3 layout, "
            "same as Kimi-K2.5); routed experts compressed-tensors pack-quantized int4, group 32, "
            "bf16 scales; MoonViT vision tower 27 x 1152 (+ patch-merger projector), 471M params "
            "summed from the checkpoint's tensor list"
        ),
        num_layers=61,
        hidden_size=7168,
        vocab_size=163840,
        attention=AttentionSpec(
            kind="mla",
            num_heads=64,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            q_lora_rank=1536,
        ),
        num_dense_layers=1,
        intermediate_size=18432,
        moe=MoESpec(
            num_layers=60,
            num_experts=384,
            top_k=8,
            intermediate_size=2048,
            num_shared_experts=1,
        ),
        vision=VisionSpec(num_params=471_143_920, num_layers=27, hidden_size=1152),
        weights=WeightScheme(routed_experts=_INT4_G32),
    )


def _deepseek_v3() -> ModelSpec:
    return ModelSpec(
        name="deepseek-v3",
        source=(
            "huggingface.co/deepseek-ai/DeepSeek-V3 config.json; FP8 e4m3 weights with 128x128 "
            "block scales (quantization_config.weight_block_size); 1 MTP layer"
        ),
        num_layers=61,
        hidden_size=7168,
        vocab_size=129280,
        attention=AttentionSpec(
            kind="mla",
            num_heads=128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            q_lora_rank=1536,
        ),
        num_dense_layers=3,
        intermediate_size=18432,
        moe=MoESpec(
            num_layers=58,
            num_experts=256,
            top_k=8,
            intermediate_size=2048,
            num_shared_experts=1,
        ),
        num_mtp_layers=1,
        weights=_FP8_LINEAR,
    )


def _glm_52() -> ModelSpec:
    # IndexShare: layers 0-2 and every 4th layer from 6 compute their own DSA indices (21 of 78);
    # the rest reuse the previous full layer's top-k and cache no index keys.
    return ModelSpec(
        name="glm-5.2",
        source=(
            "huggingface.co/zai-org/GLM-5.2 config.json (GlmMoeDsaForCausalLM; defaults mirrored "
            "in transformers/NeMo GlmMoeDsaConfig; indexer_types from llama.cpp "
            "GLM_5_2_DEFAULT_INDEXER_TYPES): 78 layers, MLA 512+64, DSA indexer 32 x 128 in 21 "
            "layers; served from the FP8 (128x128 block) checkpoint"
        ),
        num_layers=78,
        hidden_size=6144,
        vocab_size=154880,
        attention=AttentionSpec(
            kind="mla",
            num_heads=64,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=192,
            v_head_dim=256,
            q_lora_rank=2048,
        ),
        indexer=IndexerSpec(head_dim=128, num_heads=32, num_cache_layers=21),
        num_dense_layers=3,
        intermediate_size=12288,
        moe=MoESpec(
            num_layers=75,
            num_experts=256,
            top_k=8,
            intermediate_size=2048,
            num_shared_experts=1,
        ),
        num_mtp_layers=1,
        weights=_FP8_LINEAR,
    )


def _gqa(
    name: str,
    source: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    tied: bool = False,
) -> ModelSpec:
    return ModelSpec(
        name=name,
        source=source,
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        attention=AttentionSpec(
            kind="gqa", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim
        ),
        num_dense_layers=layers,
        intermediate_size=inter,
    )


def _qwen3_235b() -> ModelSpec:
    return ModelSpec(
        name="qwen3-235b-a22b",
        source="huggingface.co/Qwen/Qwen3-235B-A22B config.json",
        num_layers=94,
        hidden_size=4096,
        vocab_size=151936,
        attention=AttentionSpec(kind="gqa", num_heads=64, num_kv_heads=4, head_dim=128),
        num_dense_layers=0,
        moe=MoESpec(num_layers=94, num_experts=128, top_k=8, intermediate_size=1536),
    )


def _gpt_oss_120b() -> ModelSpec:
    return ModelSpec(
        name="gpt-oss-120b",
        source=(
            "huggingface.co/openai/gpt-oss-120b config.json: 36 layers alternating 128-token "
            "sliding window and full attention; MXFP4 experts, the rest BF16"
        ),
        num_layers=36,
        hidden_size=2880,
        vocab_size=201088,
        attention=AttentionSpec(
            kind="gqa",
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            sliding_window=128,
            num_sliding_layers=18,
        ),
        num_dense_layers=0,
        moe=MoESpec(num_layers=36, num_experts=128, top_k=4, intermediate_size=2880),
        weights=WeightScheme(routed_experts=_MXFP4),
    )


def _qwen3_next_80b() -> ModelSpec:
    # layer_types unset in the release: full_attention_interval 4 makes every 4th layer full
    # attention (12 of 48) and the other 36 gated delta nets.
    return ModelSpec(
        name="qwen3-next-80b-a3b",
        source=(
            "huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, "
            "full_attention_interval 4 (12 gated-attention layers, 16 heads, 2 KV heads of 256; "
            "36 gated delta nets, linear_num_key_heads 16, linear_num_value_heads 32, "
            "linear_key/value_head_dim 128, linear_conv_kernel_dim 4, state in the model's "
            "bf16); 512 experts top 10 of 512 wide, one shared expert of 512; 1 MTP layer; "
            "the attention output gate's q_proj half is not counted in the weights"
        ),
        num_layers=48,
        hidden_size=2048,
        vocab_size=151936,
        attention=AttentionSpec(kind="gqa", num_heads=16, num_kv_heads=2, head_dim=256),
        linear=LinearAttentionSpec(
            num_layers=36,
            num_key_heads=16,
            num_value_heads=32,
            key_head_dim=128,
            value_head_dim=128,
            conv_kernel_dim=4,
        ),
        num_dense_layers=0,
        moe=MoESpec(
            num_layers=48,
            num_experts=512,
            top_k=10,
            intermediate_size=512,
            num_shared_experts=1,
            shared_intermediate_size=512,
        ),
        num_mtp_layers=1,
    )


def _build_models() -> dict[str, ModelSpec]:
    models = [
        _kimi_k26(),
        _deepseek_v3(),
        _glm_52(),
        _gqa(
            "llama-3.1-8b",
            "huggingface.co/meta-llama/Llama-3.1-8B config.json",
            32,
            4096,
            32,
            8,
            128,
            14336,
            128256,
        ),
        _gqa(
            "llama-3.1-70b",
            "huggingface.co/meta-llama/Llama-3.1-70B config.json",
            80,
            8192,
            64,
            8,
            128,
            28672,
            128256,
        ),
        _gqa(
            "qwen3-32b",
            "huggingface.co/Qwen/Qwen3-32B config.json",
            64,
            5120,
            64,
            8,
            128,
            25600,
            151936,
        ),
        _qwen3_235b(),
        _gpt_oss_120b(),
        _qwen3_next_80b(),
        _gqa(
            "smollm2-135m",
            "huggingface.co/HuggingFaceTB/SmolLM2-135M config.json (tied embeddings)",
            30,
            576,
            9,
            3,
            64,
            1536,
            49152,
            tied=True,
        ),
    ]
    return {m.name: m for m in models}


MODEL_PRESETS: dict[str, ModelSpec] = _build_models()

_SMI = "nvidia-smi memory.total"
GPU_PRESETS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec(name="h100-80g", memory_mib=81559, bandwidth_gbs=3350, source=f"H100 SXM; {_SMI}"),
        GPUSpec(name="h200", memory_mib=143771, bandwidth_gbs=4800, source=f"H200 SXM; {_SMI}"),
        GPUSpec(name="b200", memory_mib=183359, bandwidth_gbs=8000, source=f"B200; {_SMI}"),
        GPUSpec(name="a100-80g", memory_mib=81920, bandwidth_gbs=2039, source=f"A100 SXM4; {_SMI}"),
        GPUSpec(name="l40s", memory_mib=46068, bandwidth_gbs=864, source=f"L40S; {_SMI}"),
        GPUSpec(
            name="mi300x",
            memory_mib=196592,
            bandwidth_gbs=5300,
            source="MI300X; torch total_memory 206141652992 B",
        ),
    )
}


def get_model(name: str) -> ModelSpec:
    """A preset model by name (case-insensitive)."""
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"name={show(name)}: expected a preset model name such as 'kimi-k2.6'."
        )
    key = name.strip().lower()
    if key not in MODEL_PRESETS:
        raise ConfigError(
            f"unknown model {name!r}; known models: {', '.join(MODEL_PRESETS)}. "
            "Or pass the path of a Hugging Face config.json."
        )
    return MODEL_PRESETS[key]


def get_gpu(name: str) -> GPUSpec:
    """A preset GPU by name (case-insensitive)."""
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name={show(name)}: expected a preset GPU name such as 'h200'.")
    key = name.strip().lower()
    if key not in GPU_PRESETS:
        raise ConfigError(
            f"unknown GPU {name!r}; known GPUs: {', '.join(GPU_PRESETS)}. "
            "Or describe one: GPUSpec(name=..., memory_mib=..., bandwidth_gbs=...)."
        )
    return GPU_PRESETS[key]


WEIGHT_SCHEME_NAMES: tuple[str, ...] = ("native", "bf16", "fp8", "int4-g<N>", "mxfp4")


def weight_scheme(name: str, model: ModelSpec) -> WeightScheme:
    """A named weight scheme for ``model``.

    ``native``: the checkpoint as published. ``bf16``: everything BF16. ``fp8``: every linear
    layer FP8 with 128x128 block scales (embeddings, routers, norms BF16). ``int4-g<N>`` (e.g.
    ``int4-g32``): routed experts INT4 with group N and BF16 scales, the rest BF16; a model without
    experts gets INT4 attention and MLP instead. ``mxfp4``: routed experts MXFP4, the rest BF16.
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"name={show(name)}: expected a weight scheme name: {', '.join(WEIGHT_SCHEME_NAMES)}."
        )
    if not isinstance(model, ModelSpec):
        raise ArgumentTypeError(f"model={show(model)}: expected a ModelSpec.")
    key = name.strip().lower()
    if key == "native":
        return model.weights
    if key == "bf16":
        return WeightScheme()
    if key == "fp8":
        return _FP8_LINEAR
    if key == "mxfp4":
        return WeightScheme(routed_experts=_MXFP4)
    match = re.fullmatch(r"int4-g(\d+)", key)
    if match:
        fmt = WeightFormat(kind="int4", group_size=int(match.group(1)))
        try:
            fmt.bytes_per_param()  # validates the group size
        except ArgumentError as exc:
            raise ConfigError(f"weight scheme {name!r}: {exc}") from None
        if model.moe:
            return WeightScheme(routed_experts=fmt)
        return WeightScheme(attention=fmt, dense_mlp=fmt)
    raise ConfigError(
        f"unknown weight scheme {name!r}; use one of {', '.join(WEIGHT_SCHEME_NAMES)}."
    )
