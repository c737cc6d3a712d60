"""Capacity planning: model and GPU specs, plans, reserve policies."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from adversarial import (  # the shared menagerie of bad arguments
    BAD,
    SETTINGS,
    contracted,
    is_not_integer,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.cli import main
from kvmem.cli import main as cli_main
from kvmem.cuda import PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError, KVMemError
from kvmem.planning import (
    GPU_PRESETS,
    MODEL_PRESETS,
    AttentionSpec,
    FixedReserve,
    GPUSpec,
    LinearAttentionSpec,
    MemoryFraction,
    ModelSpec,
    SGLangPolicy,
    ThroughputModel,
    WeightScheme,
    decode_bytes_per_step,
    expected_active_experts,
    fit_throughput,
    get_gpu,
    get_model,
    kv_groups,
    kv_heads_per_rank,
    kv_layout,
    layer_kv_bytes_per_token,
    load_hf_config,
    model_from_hf_config,
    param_counts,
    plan_capacity,
    plan_groups,
    sglang_mem_fraction_static,
    tokens_freed,
    vllm_groups,
    weight_bytes,
    weight_scheme,
)

PLAN_ARGS: dict[str, Any] = {
    "model": "llama-3.1-8b", "gpu": "h100-80g", "tp": 2, "dp": 2, "kv_dtype": "fp8_e4m3",
    "kv_scale_layout": "head", "weights": "int4-g32", "policy": FixedReserve(reserve_gib=4),
    "page_size": 16, "context_len": 4096, "concurrency": 8, "use_mtp": False,
    "offload_gib": 64.0,
}


PLAN_INTEGERS = ("tp", "dp", "page_size", "context_len", "concurrency")


SPEC_CASES: list[tuple[Callable[..., Any], dict[str, Any]]] = [
    (GPUSpec, {"name": "x", "memory_mib": 1024, "bandwidth_gbs": 100.0}),
    (FixedReserve, {"reserve_gib": 2.0}),
    (MemoryFraction, {"fraction": 0.5}),
    (SGLangPolicy, {"mem_fraction_static": 0.8, "chunked_prefill_size": 4096, "pp": 1,
                    "dp_attention": False, "dp_size": 1, "vlm_adjust": True,
                    "runtime_overhead_gib": 0.0}),
    (ThroughputModel, {"t0_s": 0.005, "efficiency": 0.7, "context_len": 4096}),
]


PLAN_OPTIONS = ["--gpu", "--gpu-memory-gib", "--gpu-bandwidth-gbs", "--tp", "--dp", "--kv-dtype",
                "--kv-scales", "--compare", "--weights", "--context", "--concurrency",
                "--page-size", "--reserve-gib", "--mem-fraction", "--runtime-overhead-gib",
                "--offload-gib"]


WORDS = st.one_of(
    st.sampled_from(["0", "-1", "1", "2", "1.5", "nan", "inf", "-inf", "1e999", "", "abc",
                     "bf16", "fp8_e4m3", "head", "custom", "h200", "int4-g7", "int4-g32",
                     "8", "3", "0.5", "64", "9" * 30]),
    st.text(max_size=6),
)


CLI_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


GIB = 1 << 30


KIMI_BF16_POINTS = [(1, 137.0), (8, 731.0), (16, 1106.0), (32, 1558.0)]


def within(value: float, target: float, rel: float) -> bool:
    return abs(value / target - 1) <= rel


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


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def load_hf_config_ok(folder: Path, cfg: dict[str, object]) -> object:
    from kvmem.planning import load_hf_config

    (folder / "config.json").write_text(json.dumps(cfg))
    return load_hf_config(folder)


@pytest.mark.parametrize("param", list(PLAN_ARGS))
@SETTINGS
@given(bad=BAD)
def test_plan_capacity(param: str, bad: Any) -> None:
    args = dict(PLAN_ARGS)
    model, gpu = args.pop("model"), args.pop("gpu")
    plan_capacity(model, gpu, **args)  # valid as built
    call = {"model": model, "gpu": gpu, **args, param: bad}
    exc = contracted(lambda: plan_capacity(**call))
    if param in PLAN_INTEGERS and is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and param in str(exc), (bad, exc)


@SETTINGS
@given(bad=BAD)
def test_planning_functions(bad: Any) -> None:
    plan = plan_capacity("llama-3.1-8b", "h100-80g", 1, context_len=1024)
    model, gpu = get_model("llama-3.1-8b"), get_gpu("h100-80g")
    fit = fit_throughput(plan, [(1, 50.0), (8, 300.0)], context_len=1024)
    calls = [
        lambda: get_model(bad),
        lambda: get_gpu(bad),
        lambda: weight_scheme(bad, model),
        lambda: weight_scheme("int4-g32", bad),
        lambda: plan.concurrency_at(bad),
        lambda: plan.sequence_bytes(bad),
        lambda: decode_bytes_per_step(plan, bad, 1024),
        lambda: decode_bytes_per_step(plan, 8, bad),
        lambda: decode_bytes_per_step(bad, 8, 1024),
        lambda: expected_active_experts(bad, 8, 16),
        lambda: expected_active_experts(64, bad, 16),
        lambda: expected_active_experts(64, 8, bad),
        lambda: fit_throughput(plan, bad),
        lambda: fit_throughput(plan, [(1, 50.0), bad]),
        lambda: fit_throughput(plan, [(1, 50.0), (8, bad)], context_len=1024),
        lambda: fit_throughput(plan, [(1, 50.0), (8, 300.0)], context_len=bad),
        lambda: fit.tokens_per_s(plan, bad),
        lambda: fit.step_seconds(plan, 8, bad),
        lambda: kv_layout(model, bad),
        lambda: kv_layout(model, "fp8_e4m3", bad),
        lambda: kv_layout(model, "bf16", "tensor", bad),
        lambda: kv_layout(bad, "bf16"),
        lambda: layer_kv_bytes_per_token(model.attention, "bf16", "tensor", bad),
        lambda: kv_heads_per_rank(model.attention, bad),
        lambda: kv_heads_per_rank(bad, 1),
        lambda: param_counts(model, bad),
        lambda: param_counts(model, 1, bad),
        lambda: weight_bytes(model, bad),
        lambda: weight_bytes(model, None, 1, bad),
        lambda: sglang_mem_fraction_static(gpu, bad),
        lambda: sglang_mem_fraction_static(bad, 1),
        lambda: tokens_freed(plan, bad),
        lambda: model_from_hf_config(bad),
        lambda: model_from_hf_config({"model_type": "llama", "num_hidden_layers": bad,
                                      "hidden_size": 64, "num_attention_heads": 4,
                                      "intermediate_size": 128, "vocab_size": 100}),
        lambda: load_hf_config(bad) if not isinstance(bad, str) else None,
    ]
    for call in calls:
        contracted(call)


@pytest.mark.parametrize(
    ("cls", "field"),
    [(cls, field) for cls, fields in SPEC_CASES for field in fields],
    ids=lambda v: getattr(v, "__name__", v),
)
@SETTINGS
@given(bad=BAD)
def test_planning_specs(cls: Callable[..., Any], field: str, bad: Any) -> None:
    fields = dict(next(f for c, f in SPEC_CASES if c is cls))
    cls(**fields)  # valid as built
    exc = contracted(lambda: cls(**{**fields, field: bad}))
    if isinstance(bad, (str, bytes)) and field != "name":
        assert isinstance(exc, ArgumentTypeError) and field in str(exc), (bad, exc)


def test_model_spec_from_bad_config_dicts(tmp_path: Any) -> None:
    path = tmp_path / "config.json"
    for text in ("[1, 2]", "{", '{"model_type": "llama", "num_hidden_layers": "x"}',
                 '{"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": [64]}'):
        path.write_text(text)
        with pytest.raises(KVMemError):
            load_hf_config(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(KVMemError):
        load_hf_config(tmp_path)


@CLI_SETTINGS
@given(model=st.sampled_from(["llama-3.1-8b", "kimi-k2.6", "smollm2-135m", "nope", ""]),
       options=st.lists(st.tuples(st.sampled_from(PLAN_OPTIONS), WORDS), max_size=4))
def test_cli_plan_never_escapes(
    model: str, options: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Any `kvmem plan` command line ends with status 0 or with one line on stderr and 2."""
    capsys.readouterr()  # the fixture is shared by the examples: start each one empty
    argv = ["plan", model, *(x for pair in options for x in pair)]
    status = cli_main(argv)
    out, err = capsys.readouterr()
    assert status in (0, 2), (argv, status)
    if status == 2:
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err, (argv, err)


def test_reserve_policies_take_their_one_field_by_position() -> None:
    from kvmem.planning import FixedReserve, MemoryFraction, plan_capacity

    assert FixedReserve(10) == FixedReserve(reserve_gib=10)
    assert MemoryFraction(0.8) == MemoryFraction(fraction=0.8)
    fixed = plan_capacity("llama-3.1-8b", "h100-80g", policy=FixedReserve(10))
    assert fixed.kv_budget_gib_per_gpu == pytest.approx(
        fixed.gpu_memory_gib - fixed.weights_gib_per_gpu - 10)
    with pytest.raises(ArgumentTypeError, match="reserve_gib twice"):
        FixedReserve(1, reserve_gib=2)
    with pytest.raises(ArgumentTypeError, match="positional"):
        MemoryFraction(0.5, 0.6)
    with pytest.raises(KVMemError):
        MemoryFraction(1.5)


def test_specs_given_positional_arguments_raise_a_kvmem_error() -> None:
    from kvmem import GPUSpec, PoolSpec

    for build in (lambda: GPUSpec("x", 1000, 100), lambda: PoolSpec(2)):
        with pytest.raises(ArgumentTypeError, match="by name"):
            build()


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


def test_a_host_tier_holds_as_many_pages_as_the_planner_says() -> None:
    """offload_pages_per_gpu is what a real HostTier of the rank's share of the GiB holds
    (its page bytes: every layer's K/V and token scales), for GQA split over TP and MLA."""
    from kvmem.transfer import CacheIdentity, HostTier

    gib = 0.02
    cases = [("llama-3.1-8b", tp, dtype, scales) for tp in (1, 2, 8)
             for dtype, scales in (("bf16", None), ("fp8_e4m3", "token_head"),
                                   ("fp8_e4m3", "tensor"))]
    cases += [("kimi-k2.6", 8, "bf16", None), ("kimi-k2.6", 8, "fp8_e4m3", "token_head")]
    for name, tp, dtype, scales in cases:
        model = get_model(name)
        plan = plan_capacity(model, "h200", tp, kv_dtype=dtype, kv_scale_layout=scales,
                             offload_gib=gib)
        attn = model.attention
        if attn.kind == "mla":
            shape: dict[str, Any] = dict(attention="mla", kv_lora_rank=attn.kv_lora_rank,
                                         qk_rope_head_dim=attn.qk_rope_head_dim)
        else:
            shape = dict(attention="gqa", num_kv_heads=kv_heads_per_rank(attn, tp),
                         head_dim=attn.head_dim)
        spec = PoolSpec(num_layers=model.num_layers, num_pages=1, page_size=16, dtype=dtype,
                        scales=scales, device="cpu", **shape)
        tier = HostTier(int(gib * GIB) // tp, CacheIdentity.of(spec, name, "w"))
        assert plan.offload_pages_per_gpu == tier.num_slots > 0, (name, tp, dtype, scales)
        assert plan.offload_tokens == 16 * tier.num_slots
        assert plan.offload_tokens_total == plan.offload_tokens
        assert plan.offload_pages(gib) == tier.num_slots


def test_a_host_tier_plan_scales_with_gib_and_data_parallel() -> None:
    base = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="fp8_e4m3", offload_gib=1024)
    # 1024 GiB over 8 ranks, 61 layers x 576 B x 16 tokens per page
    assert base.offload_pages_per_gpu == 128 * GIB // (61 * 576 * 16)
    assert base.offload_tokens == 16 * base.offload_pages_per_gpu
    bf16 = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="bf16", offload_gib=1024)
    assert bf16.offload_pages_per_gpu == base.offload_pages_per_gpu // 2
    two = plan_capacity("kimi-k2.6", "h200", 8, dp=2, kv_dtype="fp8_e4m3", offload_gib=1024)
    assert two.offload_tokens == base.offload_tokens
    assert two.offload_tokens_total == 2 * base.offload_tokens
    without = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="fp8_e4m3")
    assert without.offload_gib is without.offload_tokens is None
    assert base.model_dump(exclude={"offload_gib", "offload_pages_per_gpu", "offload_tokens",
                                    "offload_tokens_total"}) == without.model_dump(
        exclude={"offload_gib", "offload_pages_per_gpu", "offload_tokens",
                 "offload_tokens_total"})


def test_a_host_tier_too_small_for_a_page_or_absurd_is_refused() -> None:
    with pytest.raises(ConfigError, match="holds no KV page of 2,097,152 bytes"):
        plan_capacity("llama-3.1-8b", "h100-80g", offload_gib=0.001)
    for bad in (0, -1.0, float("inf"), 1e30):
        with pytest.raises(ArgumentError, match="offload_gib"):
            plan_capacity("llama-3.1-8b", "h100-80g", offload_gib=bad)
    with pytest.raises(ArgumentTypeError, match="offload_gib"):
        plan_capacity("llama-3.1-8b", "h100-80g", offload_gib="8")


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


def test_planning_does_not_import_torch() -> None:
    code = "import sys, kvmem.planning, kvmem.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_weight_scheme_model_is_validated() -> None:
    with pytest.raises(ValueError):
        WeightScheme(routed_experts={"kind": "int3"})  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", [["--reserve-gib", "2"], ["--mem-fraction", "0.8"]])
def test_runtime_overhead_with_another_reserve_is_refused_not_ignored(
    capsys: pytest.CaptureFixture[str], policy: list[str]
) -> None:
    """--runtime-overhead-gib applies to the SGLang-like policy only; with --reserve-gib or
    --mem-fraction it used to be dropped without a word."""
    status, out, err = run(capsys, "plan", "llama-3.1-8b", *policy, "--runtime-overhead-gib", "4")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "--runtime-overhead-gib" in err and policy[0] in err


def test_runtime_overhead_alone_still_shrinks_the_sglang_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run(capsys, "plan", "llama-3.1-8b", "--json")
    base = json.loads(out)
    status, out, _ = run(capsys, "plan", "llama-3.1-8b", "--runtime-overhead-gib", "4", "--json")
    assert status == 0
    less = json.loads(out)
    assert less["kv_budget_gib_per_gpu"] == pytest.approx(base["kv_budget_gib_per_gpu"] - 4)


@pytest.mark.parametrize(
    ("option", "named"),
    [("--gpu-memory-gib", "memory_mib"), ("--gpu-bandwidth-gbs", "bandwidth_gbs")],
)
def test_plan_with_an_absurd_custom_gpu_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], option: str, named: str
) -> None:
    """`--gpu-memory-gib 1e300` raised OverflowError and `--gpu-bandwidth-gbs 1e300` (with a
    decode bound) ZeroDivisionError: tracebacks, status 1."""
    argv = ["plan", "llama-3.1-8b", "--gpu", "custom", "--gpu-memory-gib", "96",
            "--gpu-bandwidth-gbs", "4000", "--context", "100", "--concurrency", "2"]
    argv[argv.index(option) + 1] = "1e300"
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and named in err and "Traceback" not in err


def test_gpu_spec_bounds_keep_plans_finite() -> None:
    from kvmem.errors import ConfigError
    from kvmem.planning import GPUSpec, plan_capacity

    with pytest.raises(ConfigError, match="memory_mib"):
        GPUSpec(name="g", memory_mib=10**300, bandwidth_gbs=1000)
    with pytest.raises(ConfigError, match="bandwidth_gbs"):
        GPUSpec(name="g", memory_mib=1024, bandwidth_gbs=1e300)
    biggest = GPUSpec(name="g", memory_mib=1 << 33, bandwidth_gbs=1e9)
    plan = plan_capacity("llama-3.1-8b", biggest, context_len=1, concurrency=1 << 40)
    assert plan.decode_tokens_per_s_bound is not None and plan.decode_tokens_per_s_bound > 0
    assert plan.kv_tokens_per_gpu > 0


@pytest.mark.parametrize(
    "call",
    [
        "plan_capacity('llama-3.1-8b', 'h200', context_len=10**200, concurrency=10**200)",
        "plan_capacity('llama-3.1-8b', 'h200', context_len=10**400, concurrency=1)",
        "decode_bytes_per_step(plan, 1, 10**400)",
        "fit_throughput(plan, [(10**300, 1000.0), (8, 100.0)], context_len=100)",
        "fit_throughput(plan, [(10**400, 1000.0), (8, 100.0)], context_len=100)",
        "fit_throughput(plan, [(1, 137.0), (8, 731.0)], context_len=10**300)",
        "fit_throughput(plan, [(1, 1e-308), (8, 1e-308)], context_len=100)",
    ],
)
def test_counts_beyond_a_float_are_a_config_error(call: str) -> None:
    """These raised OverflowError (not a kvmem error) or, for tiny tokens/s, a ConfigError that
    blamed a NaN field of ThroughputModel."""
    from kvmem.errors import ConfigError
    from kvmem.planning import decode_bytes_per_step, fit_throughput, plan_capacity

    plan = plan_capacity("kimi-k2.6", "h200", 8)
    names = {"plan": plan, "plan_capacity": plan_capacity,
             "decode_bytes_per_step": decode_bytes_per_step, "fit_throughput": fit_throughput}
    with pytest.raises(ConfigError) as info:
        eval(call, names)
    assert "nan" not in str(info.value)


def test_expected_active_experts_refuses_a_negative_batch_and_saturates() -> None:
    """A batch of -5 tokens used to be 0 active experts; 10**400 tokens raised OverflowError."""
    from kvmem.errors import ArgumentError
    from kvmem.planning import expected_active_experts

    with pytest.raises(ArgumentError, match="num_tokens=-5"):
        expected_active_experts(384, 8, -5)
    assert expected_active_experts(384, 8, 0) == 0
    assert expected_active_experts(384, 8, 10**400) == 384


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", 32.5), ("num_key_value_heads", True), ("hidden_size", "4096"),
     ("intermediate_size", 14336.7), ("tie_word_embeddings", "false"),
     ("tie_word_embeddings", 1)],
)
def test_an_hf_count_that_is_no_integer_is_refused_not_truncated(
    tmp_path: Path, field: str, value: object
) -> None:
    """32.5 layers used to plan as 32, True KV heads as 1, "4096" as 4096; a tie_word_embeddings
    of "false" as tied (bool("false") is True)."""
    from kvmem.errors import ConfigError
    from kvmem.planning import load_hf_config

    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256}
    assert load_hf_config_ok(tmp_path, cfg).num_layers == 32
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        load_hf_config(tmp_path)


def test_a_page_larger_than_the_budget_names_the_page_size() -> None:
    """The message said "leaves 112.39 GiB, not even one KV page" and advised more GPUs, not
    naming the page, which was the cause."""
    from kvmem.errors import ConfigError
    from kvmem.planning import plan_capacity

    with pytest.raises(ConfigError, match="page_size") as info:
        plan_capacity("llama-3.1-8b", "h200", page_size=10**9)
    assert "1000000000 tokens" in str(info.value)


# -- KV cache groups: kvmem's, and vLLM's padded to one page size -------------------------------

GIB_ = 1 << 30


def _group_plan(name: str, tp: int, kv_dtype: str = "bf16") -> tuple[ModelSpec, Any]:
    model = get_model(name)
    return model, plan_capacity(model, "h200", tp, kv_dtype=kv_dtype, weights="fp8")


def test_qwen3_next_groups_match_a_hand_count() -> None:
    """Qwen3-Next-80B-A3B, bf16, TP 1, counted by hand from config.json: an attention layer
    caches K and V of 2 heads of 256 (2,048 bytes per token), 12 of them; a gated delta net
    keeps a conv state of 3 x (2 x 16 x 128 + 32 x 128) and a 32 x 128 x 128 recurrent state
    (1,097,728 bytes), 36 of them. vLLM groups 12 layers each (1 attention + 3 GDN groups)
    and raises the attention page to 16 * ceil(12 x 1,097,728 / (16 x 12 x 2,048)) = 544
    tokens."""
    model, plan = _group_plan("qwen3-next-80b-a3b", 1)
    state_layer = (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 2
    assert state_layer == 1_097_728 and model.linear is not None
    assert model.linear.state_bytes_per_layer(1) == state_layer
    assert model.linear.state_bytes_per_layer(2) == state_layer // 2
    assert model.num_full_layers == 12
    gp = plan_groups(model, plan, 1000)
    full, state = gp.kvmem.groups
    assert (full.name, full.page_size, full.bytes_per_token) == ("full", 16, 12 * 2048)
    assert (state.kind, state.bytes_per_state, state.page_size) == ("state", 36 * state_layer, 0)
    assert (full.pages_per_request, state.pages_per_request) == (63, 1)  # ceil(1000 / 16)
    assert gp.kvmem.bytes_per_request == 63 * 16 * 12 * 2048 + 36 * state_layer
    assert [g.name for g in gp.padded.groups] == ["full", "state0", "state1", "state2"]
    assert gp.padded.page_size == 544
    page = 544 * 12 * 2048
    assert all(g.page_bytes == page for g in gp.padded.groups)
    assert [g.pages_per_request for g in gp.padded.groups] == [2, 1, 1, 1]
    assert gp.padded.bytes_per_request == 5 * page
    budget = gp.kv_budget_bytes_per_gpu
    assert budget == int(plan.kv_budget_gib_per_gpu * GIB_)
    assert gp.kvmem.requests_fit == budget // gp.kvmem.bytes_per_request
    assert gp.padded.requests_fit == budget // page // 5  # a padded pool is whole pages
    assert gp.kvmem.tokens_fit == 1000 * gp.kvmem.requests_fit
    assert gp.gain == pytest.approx(5 * page / gp.kvmem.bytes_per_request)
    assert gp.kvmem.groups[1].bytes_at_capacity == gp.kvmem.requests_fit * 36 * state_layer
    # the plan counts the state as a fixed cost per request
    assert plan.kv_state_bytes_per_request_per_gpu == 36 * state_layer
    assert plan.sequence_bytes(1000) == gp.kvmem.bytes_per_request


def test_a_sliding_window_group_holds_the_window_and_vllm_pads_nothing_here() -> None:
    """gpt-oss-120b, bf16: 18 full and 18 sliding layers of 8 KV heads of 64 (2,048 bytes per
    token each). A 1,000-token request holds ceil(1000 / 16) = 63 full pages and, in the
    window of 128, the pages from (1000 - 127) // 16 = 54 on: 9. vLLM makes two groups of 18
    layers with equal pages: the padded layout costs the same."""
    model, plan = _group_plan("gpt-oss-120b", 1)
    gp = plan_groups(model, plan, 1000)
    full, swa = gp.kvmem.groups
    assert (full.bytes_per_token, swa.bytes_per_token, swa.kind) == (
        18 * 2048, 18 * 2048, "sliding_window")
    assert (full.pages_per_request, swa.pages_per_request) == (63, 9)
    assert gp.kvmem.bytes_per_request == (63 + 9) * 16 * 18 * 2048
    assert gp.padded.bytes_per_request == gp.kvmem.bytes_per_request and gp.gain == 1.0


def test_glm_indexer_rides_the_attention_pages_and_vllm_keeps_one_group() -> None:
    """GLM-5.2, fp8 KV, TP 8: 78 MLA layers of 512 + 64 (576 bytes) and 21 indexer layers of
    128 fp8 keys with one fp32 scale (132 bytes); the indexer's pages follow the attention's.
    vLLM puts all-full-attention layers (MLA and indexer) in one group, unpadded."""
    model, plan = _group_plan("glm-5.2", 8, "fp8_e4m3")
    gp = plan_groups(model, plan, 1000)
    full, indexer = gp.kvmem.groups
    assert (full.bytes_per_token, indexer.bytes_per_token) == (78 * 576, 21 * 132)
    assert indexer.kind == "indexer" and indexer.pages_per_request == full.pages_per_request == 63
    assert [g.name for g in gp.padded.groups] == ["full"]
    assert gp.padded.groups[0].bytes_per_token == 78 * 576 + 21 * 132
    assert gp.padded.bytes_per_request == gp.kvmem.bytes_per_request == 63 * 16 * 47_700


@settings(max_examples=60, deadline=None)
@given(context=st.integers(1, 300_000), page_size=st.sampled_from([1, 16, 64, 256]),
       which=st.sampled_from([("qwen3-next-80b-a3b", 2, "bf16"), ("qwen3-next-80b-a3b", 1,
                                                                   "fp8_e4m3"),
                              ("gpt-oss-120b", 1, "bf16"), ("glm-5.2", 8, "fp8_e4m3")]))
def test_the_padded_layout_never_costs_less_than_kvmem(context: int, page_size: int,
                                                       which: tuple[str, int, str]) -> None:
    name, tp, dtype = which
    model = get_model(name)
    plan = plan_capacity(model, "h200", tp, kv_dtype=dtype, page_size=page_size, weights="fp8")
    gp = plan_groups(model, plan, context)
    assert gp.padded.bytes_per_request >= gp.kvmem.bytes_per_request
    assert gp.padded.tokens_per_gib <= gp.kvmem.tokens_per_gib and gp.gain >= 1.0
    assert gp.padded.requests_fit <= gp.kvmem.requests_fit
    for lay in (gp.kvmem, gp.padded):
        assert lay.bytes_per_request == sum(g.bytes_per_request for g in lay.groups)
        assert all(g.bytes_per_request == g.pages_per_request * g.page_bytes
                   for g in lay.groups)


def test_group_accounting_refuses_bad_input_with_clear_errors() -> None:
    model, plan = _group_plan("qwen3-next-80b-a3b", 2)
    with pytest.raises(ArgumentError, match="context_len=-1"):
        plan_groups(model, plan, -1)
    with pytest.raises(ArgumentError, match="context_len"):
        plan_groups(model, plan, 0)
    with pytest.raises(ArgumentTypeError, match="expected a ModelSpec"):
        plan_groups("qwen3-next-80b-a3b", plan, 10)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="expected a CapacityPlan"):
        kv_groups(model, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"not 'glm-5\.2'"):
        plan_groups(get_model("glm-5.2"), plan, 10)
    with pytest.raises(ConfigError, match="unknown model 'qwen4-next'"):
        get_model("qwen4-next")
    with pytest.raises(ConfigError, match="TP 3 does not divide the 16"):
        assert model.linear is not None
        model.linear.state_bytes_per_layer(3)
    with pytest.raises(ConfigError, match="num_layers"):
        LinearAttentionSpec(num_layers=-4, num_key_heads=16, num_value_heads=32,
                            key_head_dim=128, value_head_dim=128, conv_kernel_dim=4)
    with pytest.raises(ConfigError, match="leave no full-attention layer"):
        model.model_copy(update={"linear": model.linear.model_copy(update={"num_layers": 48})})
    # a DSA indexer beside linear layers: vLLM's grouping of it is not modelled
    hybrid_glm = model.model_copy(update={"indexer": get_model("glm-5.2").indexer})
    with pytest.raises(ConfigError, match="indexer beside"):
        vllm_groups(hybrid_glm, plan)


def test_qwen3_next_weights_are_its_published_80b() -> None:
    """The gated delta nets' projections replace attention in 36 of 48 layers: the checkpoint
    counts about 80B parameters (81.3B published with the MTP layer); without them it would
    count the 36 layers as full attention instead."""
    model = get_model("qwen3-next-80b-a3b")
    total = sum(c.total for c in param_counts(model).values())
    assert 79e9 < total < 82e9
