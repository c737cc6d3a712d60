"""Capacity planning: byte accounting, the report's figures, policies, HF configs, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.errors import ArgumentError, ConfigError
from kvmem.planning import (
    GPU_PRESETS,
    MODEL_PRESETS,
    AttentionSpec,
    FixedReserve,
    GPUSpec,
    MemoryFraction,
    ModelSpec,
    SGLangPolicy,
    WeightScheme,
    expected_active_experts,
    fit_throughput,
    get_gpu,
    get_model,
    kv_heads_per_rank,
    kv_layout,
    layer_kv_bytes_per_token,
    load_hf_config,
    model_from_hf_config,
    plan_capacity,
    sglang_mem_fraction_static,
    tokens_freed,
    weight_bytes,
    weight_scheme,
)

GIB = 1 << 30
KIMI_BF16_POINTS = [(1, 137.0), (8, 731.0), (16, 1106.0), (32, 1558.0)]


def within(value: float, target: float, rel: float) -> bool:
    return abs(value / target - 1) <= rel


# --- the report's figures ----------------------------------------------------------------------


def test_kimi_kv_bytes_per_token_per_gpu() -> None:
    bf16 = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="bf16")
    fp8 = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="fp8_e4m3", kv_scale_layout="tensor")
    assert bf16.kv_bytes_per_token_per_gpu == 70_272  # 61 x (512 + 64) x 2
    assert fp8.kv_bytes_per_token_per_gpu == 35_136  # 61 x (512 + 64) x 1
    assert round(fp8.kv_tokens_per_gpu / bf16.kv_tokens_per_gpu, 2) == 2.00
    # MLA is replicated, not split: the per-GPU cost does not depend on TP.
    assert kv_layout(get_model("kimi-k2.6"), "bf16", tp=1).bytes_per_token == 70_272


def test_kimi_resident_tokens_on_8xh200_match_the_report() -> None:
    bf16 = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="bf16")
    fp8 = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="fp8_e4m3")
    assert within(bf16.kv_tokens_per_gpu, 686_000, 0.10), bf16.kv_tokens_per_gpu
    assert within(fp8.kv_tokens_per_gpu, 1_370_000, 0.10), fp8.kv_tokens_per_gpu
    assert bf16.mem_fraction_static == pytest.approx(
        0.897 * 0.95 * (1 - 0.1 * (27 * 1152**2 / (24 * 1024**2) - 1))
    )
    # The checkpoint itself: 554.27 GiB summed over Kimi K2.5's published tensors.
    assert bf16.weights_gib_total == pytest.approx(554.27, abs=0.01)


def test_glm_checkpoint_sizes_match_the_report() -> None:
    glm = get_model("glm-5.2")
    fp8 = plan_capacity(glm, "h200", 8, weights="fp8")
    int4 = plan_capacity(glm, "h200", 8, weights="int4-g32")
    assert within(fp8.weights_gib_total, 704, 0.02), fp8.weights_gib_total
    assert within(int4.weights_gib_total, 421, 0.02), int4.weights_gib_total
    assert within(fp8.weights_gib_per_gpu, 88, 0.02), fp8.weights_gib_per_gpu
    assert within(int4.weights_gib_total / 8, 52.6, 0.02)
    # A TP8 rank holds more than checkpoint / 8: the MLA down-projections and the DSA indexer
    # are replicated on every rank (docs/capacity_planning.md explains the 52.6 vs 54.4).
    scheme = weight_scheme("int4-g32", glm)
    wb = weight_bytes(glm, scheme, tp=8)
    served = weight_bytes(glm, scheme, tp=1).per_gpu  # every served tensor once (no MTP)
    assert int4.weights_gib_per_gpu == pytest.approx(wb.per_gpu / GIB)
    assert wb.per_gpu == pytest.approx(served / 8 + wb.replicated_per_gpu * 7 / 8)
    assert 2.8 < wb.replicated_per_gpu / GIB < 3.0  # q_a, kv_a (BF16) + indexer + routers


def test_glm_real_cache_layout_and_tokens_freed_by_int4() -> None:
    glm = get_model("glm-5.2")
    bf16 = kv_layout(glm, "bf16", tp=8)
    fp8 = kv_layout(glm, "fp8_e4m3", tp=8)
    assert bf16.indexer_bytes_per_token == fp8.indexer_bytes_per_token == 21 * (128 + 4)
    assert bf16.bytes_per_token == 78 * 576 * 2 + 2772 == 92_628
    assert fp8.bytes_per_token == 78 * 576 + 2772 == 47_700
    before = plan_capacity(glm, "h200", 8, kv_dtype="fp8_e4m3", weights="fp8")
    after = plan_capacity(glm, "h200", 8, kv_dtype="fp8_e4m3", weights="int4-g32")
    freed = tokens_freed(before, after)
    freed_gib = before.weights_gib_per_gpu - after.weights_gib_per_gpu
    assert freed == pytest.approx(freed_gib * GIB / 47_700, abs=2)
    # The report's +1.18M tokens implies ~32 KiB per token: far below GLM 5.2's real layout.
    implied = (88 - 52) * GIB / 1_180_000
    assert 31_000 < implied < 33_500
    assert freed < 1_000_000


def test_throughput_fit_to_bf16_points_predicts_fp8_at_64() -> None:
    bf16 = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="bf16")
    fp8 = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="fp8_e4m3")
    model = fit_throughput(bf16, KIMI_BF16_POINTS)
    for concurrency, tok_s in KIMI_BF16_POINTS:
        assert within(model.tokens_per_s(bf16, concurrency), tok_s, 0.02)
    assert 0 < model.efficiency <= 1.0
    assert within(model.tokens_per_s(fp8, 64), 2192, 0.15)
    # The bound at the same point is an upper bound on what the fitted model predicts.
    bound = plan_capacity(
        "kimi-k2.6", "h200", 8, kv_dtype="fp8_e4m3", context_len=model.context_len, concurrency=64
    )
    assert bound.decode_tokens_per_s_bound is not None
    assert bound.decode_tokens_per_s_bound > model.tokens_per_s(fp8, 64)


def test_throughput_fit_at_a_given_context_and_bad_points() -> None:
    plan = plan_capacity("kimi-k2.6", "h200", 8)
    m = fit_throughput(plan, KIMI_BF16_POINTS, context_len=8192)
    assert m.context_len == 8192
    with pytest.raises(ConfigError, match="two or more"):
        fit_throughput(plan, [(8, 700.0)])
    with pytest.raises(ArgumentError, match="> 0"):
        fit_throughput(plan, [(1, 100.0), (8, -5.0)], context_len=1024)


# --- byte accounting ---------------------------------------------------------------------------


def test_gqa_heads_split_down_to_one_per_rank() -> None:
    llama = get_model("llama-3.1-8b")  # 8 KV heads x 128, 32 layers
    per_layer = {
        tp: layer_kv_bytes_per_token(llama.attention, "bf16", tp=tp) for tp in (1, 2, 4, 8, 16, 32)
    }
    assert per_layer == {1: 4096, 2: 2048, 4: 1024, 8: 512, 16: 512, 32: 512}
    with pytest.raises(ConfigError, match="does not divide the 32 attention heads"):
        layer_kv_bytes_per_token(llama.attention, "bf16", tp=3)
    odd = AttentionSpec(kind="gqa", num_heads=24, num_kv_heads=6, head_dim=64)
    assert layer_kv_bytes_per_token(odd, "bf16", tp=12) == 2 * 64 * 2  # each head twice
    with pytest.raises(ConfigError, match="multiple of the KV head count"):
        layer_kv_bytes_per_token(odd, "bf16", tp=8)
    with pytest.raises(ConfigError, match="does not divide the 6 KV heads"):
        layer_kv_bytes_per_token(odd, "bf16", tp=4)


def test_fp8_scale_layouts() -> None:
    gqa = AttentionSpec(kind="gqa", num_heads=8, num_kv_heads=2, head_dim=64)
    mla = get_model("kimi-k2.6").attention
    assert layer_kv_bytes_per_token(gqa, "fp8_e4m3", "tensor") == 2 * 2 * 64
    assert layer_kv_bytes_per_token(gqa, "fp8_e4m3", "head") == 2 * 2 * 64
    assert layer_kv_bytes_per_token(gqa, "fp8_e4m3", "token_head") == 2 * 2 * 64 + 2 * 2 * 4
    assert layer_kv_bytes_per_token(gqa, "fp8_e5m2", "token_head", tp=2) == 2 * 64 + 2 * 4
    assert layer_kv_bytes_per_token(mla, "fp8_e4m3", "token_head") == 576 + 4
    assert layer_kv_bytes_per_token(gqa, "bf16", "token_head") == 2 * 2 * 64 * 2  # no scales
    spec = get_model("llama-3.1-8b")
    assert kv_layout(spec, "fp8_e4m3", "tensor").fixed_bytes == 32 * 2 * 4
    assert kv_layout(spec, "fp8_e4m3", "head", tp=2).fixed_bytes == 32 * 2 * 4 * 4
    assert kv_layout(spec, "bf16").fixed_bytes == 0
    with pytest.raises(ConfigError, match="unknown KV dtype"):
        layer_kv_bytes_per_token(gqa, "int8")
    with pytest.raises(ConfigError, match="scale layout"):
        layer_kv_bytes_per_token(gqa, "fp8_e4m3", "row")


def test_sliding_window_layers_cost_a_fixed_amount_per_sequence() -> None:
    oss = get_model("gpt-oss-120b")  # 18 full + 18 sliding (128 tokens), 8 KV heads x 64
    plan = plan_capacity(oss, "h100-80g", 1, context_len=65536, page_size=16)
    assert plan.kv_bytes_per_token_per_gpu == 18 * 2 * 8 * 64 * 2
    assert plan.kv_sliding_bytes_per_token_per_gpu == 18 * 2 * 8 * 64 * 2
    assert plan.sliding_window == 128
    window_pages = 128 // 16 + 1
    assert plan.sequence_bytes(65536) == (65536 * 18 + window_pages * 16 * 18) * 2 * 8 * 64 * 2
    assert plan.sequence_bytes(40) == 3 * 16 * 36 * 2 * 8 * 64 * 2  # short: every layer, 3 pages
    full_attention = oss.model_copy(
        update={"attention": oss.attention.model_copy(update={"num_sliding_layers": 0})}
    )
    dense = plan_capacity(full_attention, "h100-80g", 1, context_len=65536)
    assert dense.max_concurrency is not None and plan.max_concurrency is not None
    assert plan.max_concurrency > 1.9 * dense.max_concurrency


def test_page_rounding_in_max_concurrency() -> None:
    plan = plan_capacity("llama-3.1-8b", "h100-80g", 1, page_size=16, context_len=17)
    assert plan.max_concurrency == plan.kv_pages_per_gpu // 2
    plan16 = plan_capacity("llama-3.1-8b", "h100-80g", 1, page_size=16, context_len=16)
    assert plan16.max_concurrency == plan16.kv_pages_per_gpu
    assert plan.kv_pages_per_gpu == plan.kv_tokens_per_gpu // 16


def test_weights_per_rank_replicate_what_engines_replicate() -> None:
    qwen = get_model("qwen3-235b-a22b")  # 4 KV heads: at TP 8 each rank holds one whole head
    wb1, wb8 = weight_bytes(qwen, tp=1), weight_bytes(qwen, tp=8)
    kv_proj = 94 * 2 * 4096 * 4 * 128 * 2
    assert wb8.by_class["attention"] * 8 == pytest.approx(
        wb1.by_class["attention"] + kv_proj, rel=1e-6
    )
    kimi = get_model("kimi-k2.6")
    replicated = 61 * (7168 * 1536 + 7168 * 576) * 2 + 60 * 384 * 7168 * 2 + 471_143_920 * 2
    assert weight_bytes(kimi, tp=8).replicated_per_gpu == pytest.approx(replicated, rel=1e-3)
    # MTP layers are in the checkpoint, and loaded only for speculative decoding.
    ds = get_model("deepseek-v3")
    assert weight_bytes(ds, tp=8, use_mtp=True).per_gpu > weight_bytes(ds, tp=8).per_gpu
    assert weight_bytes(ds, tp=8, use_mtp=True).total == weight_bytes(ds, tp=8).total


def test_weight_schemes() -> None:
    kimi = get_model("kimi-k2.6")
    assert weight_scheme("native", kimi) == kimi.weights
    assert weight_scheme("int4-g128", kimi).routed_experts.bytes_per_param() == 0.515625
    dense = weight_scheme("int4-g32", get_model("llama-3.1-8b"))
    assert dense.attention.kind == "int4" and dense.embeddings.kind == "bf16"
    assert weight_scheme("fp8", kimi).routed_experts.bytes_per_param() == pytest.approx(
        1 + 4 / 128**2
    )
    assert weight_scheme("mxfp4", kimi).routed_experts.bytes_per_param() == 0.53125
    with pytest.raises(ConfigError, match="int4-g<N>"):
        weight_scheme("int3", kimi)
    with pytest.raises(ConfigError, match="multiple of 8"):
        weight_scheme("int4-g20", kimi)


def test_expected_active_experts() -> None:
    assert expected_active_experts(384, 8, 1) == pytest.approx(8)
    assert expected_active_experts(384, 8, 10_000) == pytest.approx(384)
    assert expected_active_experts(0, 0, 5) == 0


def test_planner_bytes_agree_with_the_pool_spec() -> None:
    """The planner's per-layer bytes per token equal kvmem.cuda.PoolSpec's, for every choice."""
    from kvmem.cuda import PoolSpec

    llama, kimi = get_model("llama-3.1-8b"), get_model("kimi-k2.6")
    cases: list[tuple[AttentionSpec, int, str, str | None]] = []
    for dtype in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2"):
        fp8 = dtype.startswith("fp8")
        for scales in ("tensor", "head", "token_head") if fp8 else (None,):
            for tp in (1, 2, 8, 16):
                cases.append((llama.attention, tp, dtype, scales))
            if scales != "head":
                cases.append((kimi.attention, 8, dtype, scales))
    for attn, tp, dtype, scales in cases:
        if attn.kind == "mla":
            shape = dict(attention="mla", kv_lora_rank=512, qk_rope_head_dim=64)
        else:
            heads = kv_heads_per_rank(attn, tp)
            shape = dict(attention="gqa", num_kv_heads=heads, head_dim=attn.head_dim)
        pool = PoolSpec(
            num_layers=3, num_pages=8, page_size=16, dtype=dtype, scales=scales, **shape
        )
        layer = layer_kv_bytes_per_token(attn, dtype, scales or "tensor", tp)
        assert 3 * layer == pool.bytes_per_token, (attn.kind, tp, dtype, scales)
        model = llama if attn.kind != "mla" else kimi
        fixed = kv_layout(model, dtype, scales or "tensor", tp).fixed_bytes
        assert fixed == model.num_layers * pool.fixed_nbytes // 3, (attn.kind, tp, dtype, scales)
    with pytest.raises(ConfigError, match="no KV heads"):
        layer_kv_bytes_per_token(kimi.attention, "fp8_e4m3", "head")


# --- reserve policies --------------------------------------------------------------------------


def test_sglang_mem_fraction_static_defaults() -> None:
    # H200 at TP8: 512 + 1.5*8192 + 2*512 + 1024 = 14848 MiB reserved of 143771.
    assert sglang_mem_fraction_static(get_gpu("h200"), 8) == 0.897
    # H100 at TP1: 512 + 12288 + 512 + 128 = 13440 MiB.
    assert sglang_mem_fraction_static(get_gpu("h100-80g"), 1) == round((81559 - 13440) / 81559, 3)
    # A small GPU is floored at nothing but its own buckets: L40S TP1 = 512 + 6144 + 64 + 128.
    assert sglang_mem_fraction_static(get_gpu("l40s"), 1) == round((46068 - 6848) / 46068, 3)
    eagle = SGLangPolicy(speculative="eagle")
    assert sglang_mem_fraction_static(get_gpu("h200"), 8, eagle) == round(
        (143771 - 16896) / 143771, 3
    )
    assert (
        sglang_mem_fraction_static(get_gpu("h200"), 8, SGLangPolicy(mem_fraction_static=0.8)) == 0.8
    )


def test_fixed_and_fraction_policies_are_exact() -> None:
    spec = get_model("llama-3.1-8b")
    gpu = GPUSpec(name="test", memory_mib=40 * 1024, bandwidth_gbs=1000)
    wb = weight_bytes(spec, tp=1).per_gpu
    fixed = plan_capacity(spec, gpu, 1, policy=FixedReserve(reserve_gib=4), page_size=16)
    assert fixed.kv_budget_gib_per_gpu == pytest.approx((40 * GIB - wb - 4 * GIB) // 1 / GIB)
    assert fixed.kv_tokens_per_gpu == int(40 * GIB - wb - 4 * GIB) // 131_072
    frac = plan_capacity(spec, gpu, 1, policy=MemoryFraction(fraction=0.5))
    assert frac.kv_tokens_per_gpu == int(0.5 * 40 * GIB - wb) // 131_072
    overhead = plan_capacity(spec, "h200", 1, policy=SGLangPolicy(runtime_overhead_gib=2))
    base = plan_capacity(spec, "h200", 1)
    assert base.kv_budget_gib_per_gpu - overhead.kv_budget_gib_per_gpu == pytest.approx(2, abs=1e-6)


def test_data_parallel_multiplies_totals() -> None:
    one = plan_capacity("llama-3.1-8b", "h100-80g", 2, context_len=8192)
    four = plan_capacity("llama-3.1-8b", "h100-80g", 2, dp=4, context_len=8192)
    assert four.num_gpus == 8
    assert four.kv_tokens_total == 4 * one.kv_tokens_per_gpu
    assert four.max_concurrency_total == 4 * (one.max_concurrency or 0)


# --- bad input ---------------------------------------------------------------------------------


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"known models: kimi-k2\.6, deepseek-v3"):
        get_model("kimi-k9")
    with pytest.raises(ConfigError, match="known GPUs: h100-80g, h200"):
        get_gpu("rtx9090")


def test_impossible_plans_say_why() -> None:
    with pytest.raises(ConfigError, match=r"need 131\.4 GiB per GPU at TP 1"):
        plan_capacity("llama-3.1-70b", "l40s", 1)
    with pytest.raises(ConfigError, match="not even one KV page"):
        plan_capacity("llama-3.1-70b", "h200", 1, policy=FixedReserve(reserve_gib=10))
    with pytest.raises(ConfigError, match="does not divide the 9 attention heads"):
        plan_capacity("smollm2-135m", "l40s", 2)
    with pytest.raises(ConfigError, match="needs context_len"):
        plan_capacity("llama-3.1-8b", "h200", 1, concurrency=4)
    with pytest.raises(ValueError, match=r"1 dense \+ 0 MoE layers != num_layers 2"):
        ModelSpec(
            name="bad",
            num_layers=2,
            hidden_size=8,
            vocab_size=10,
            attention=AttentionSpec(kind="gqa", num_heads=2, num_kv_heads=2, head_dim=4),
            num_dense_layers=1,
            intermediate_size=16,
        )


def test_every_preset_plans() -> None:
    tps = {"smollm2-135m": 1, "llama-3.1-8b": 1}
    for name in MODEL_PRESETS:
        plan = plan_capacity(name, "b200", tps.get(name, 8), context_len=8192)
        assert plan.kv_tokens_per_gpu > 0 and (plan.max_concurrency or 0) > 0, name
    assert set(GPU_PRESETS) >= {"h100-80g", "h200", "b200", "a100-80g", "l40s", "mi300x"}
    assert get_gpu("H200").memory_mib == 143_771


# --- Hugging Face config.json ------------------------------------------------------------------


def _write(tmp_path: Path, cfg: dict[str, object], name: str = "m") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


LLAMA_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_hf_llama_matches_the_preset(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, LLAMA_8B, "Llama-3.1-8B"))
    assert spec.name == "Llama-3.1-8B"
    preset = get_model("llama-3.1-8b")
    assert spec.attention == preset.attention
    assert weight_bytes(spec).total == weight_bytes(preset).total
    assert kv_layout(spec, "bf16", tp=8) == kv_layout(preset, "bf16", tp=8)


def test_hf_kimi_k25_nested_config(tmp_path: Path) -> None:
    text = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": 1536,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "vocab_size": 163840,
    }
    quant = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {
                "weights": {"num_bits": 4, "group_size": 32, "symmetric": True, "type": "int"}
            }
        },
    }
    cfg = {
        "model_type": "kimi_k25",
        "text_config": text,
        "quantization_config": quant,
        "vision_config": {
            "vt_num_hidden_layers": 27,
            "vt_hidden_size": 1152,
            "vt_intermediate_size": 4304,
        },
    }
    spec = load_hf_config(_write(tmp_path, cfg) / "config.json")
    assert spec.weights.routed_experts.label() == "int4-g32"
    assert spec.vision is not None and spec.vision.num_layers == 27
    assert kv_layout(spec, "bf16", tp=8).bytes_per_token == 70_272
    preset = get_model("kimi-k2.6")
    # Same text model; the vision tower is estimated from its shape, not summed from tensors.
    text_only = lambda m: weight_bytes(m).total - (m.vision.num_params * 2 if m.vision else 0)  # noqa: E731
    assert text_only(spec) == pytest.approx(text_only(preset), rel=1e-9)


def test_hf_glm_dsa_with_indexshare_and_fp8() -> None:
    layers = 78
    cfg = {
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": layers,
        "hidden_size": 6144,
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "q_lora_rank": 2048,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * (layers - 3),
        "indexer_types": ["full" if i < 3 or (i - 2) % 4 == 0 else "shared" for i in range(layers)],
        "index_head_dim": 128,
        "index_n_heads": 32,
        "num_nextn_predict_layers": 1,
        "vocab_size": 154880,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    spec = model_from_hf_config(cfg, name="glm")
    preset = get_model("glm-5.2")
    assert spec.indexer == preset.indexer
    assert kv_layout(spec, "fp8_e4m3", tp=8) == kv_layout(preset, "fp8_e4m3", tp=8)
    assert weight_bytes(spec, tp=8).total == pytest.approx(weight_bytes(preset, tp=8).total)


def test_hf_qwen3_moe_and_gpt_oss() -> None:
    qwen = model_from_hf_config(
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 94,
            "hidden_size": 4096,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 1536,
            "vocab_size": 151936,
        }
    )
    assert weight_bytes(qwen).total == weight_bytes(get_model("qwen3-235b-a22b")).total
    oss = model_from_hf_config(
        {
            "model_type": "gpt_oss",
            "num_hidden_layers": 36,
            "hidden_size": 2880,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "intermediate_size": 2880,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 18,
            "vocab_size": 201088,
            "quantization_config": {"quant_method": "mxfp4"},
        }
    )
    assert kv_layout(oss, "bf16") == kv_layout(get_model("gpt-oss-120b"), "bf16")
    assert oss.weights == get_model("gpt-oss-120b").weights


def test_hf_glm4_moe_is_gqa_with_experts() -> None:
    spec = model_from_hf_config(
        {
            "model_type": "glm4_moe",
            "num_hidden_layers": 46,
            "hidden_size": 4096,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 1,
            "vocab_size": 151552,
        }
    )
    assert spec.attention.kind == "gqa" and spec.num_dense_layers == 1
    assert spec.moe is not None and spec.moe.num_layers == 45 and spec.num_mtp_layers == 1
    assert kv_layout(spec, "bf16", tp=8).bytes_per_token == 46 * 2 * 1 * 128 * 2


def test_hf_bad_configs_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lacks 'num_attention_heads'"):
        model_from_hf_config({k: v for k, v in LLAMA_8B.items() if k != "num_attention_heads"})
    with pytest.raises(ConfigError, match="lacks 'kv_lora_rank'"):
        model_from_hf_config({**LLAMA_8B, "model_type": "deepseek_v3"})
    with pytest.raises(ConfigError, match="'mamba' is not supported; kvmem reads llama"):
        model_from_hf_config({**LLAMA_8B, "model_type": "mamba"})
    with pytest.raises(ConfigError, match="no Hugging Face config"):
        load_hf_config(tmp_path / "missing")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(bad)


# --- layering ----------------------------------------------------------------------------------


def test_planning_does_not_import_torch() -> None:
    code = "import sys, kvmem.planning, kvmem.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_weight_scheme_model_is_validated() -> None:
    with pytest.raises(ValueError):
        WeightScheme(routed_experts={"kind": "int3"})  # type: ignore[arg-type]
