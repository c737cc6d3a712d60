"""Capacity plan for Kimi K2.6 on 8 x H200 (TP 8), BF16 vs FP8 KV, and what INT4 does for GLM 5.2.

Run: ``python examples/plan_kimi.py`` (CPU only, under a second). The same figures come from
``kvmem plan kimi-k2.6 --gpu h200 --tp 8 --compare bf16,fp8_e4m3 --context 16384``.
"""

from __future__ import annotations

from kvmem.planning import fit_throughput, plan_capacity, tokens_freed

REPORT_BF16_POINTS = [(1, 137.0), (8, 731.0), (16, 1106.0), (32, 1558.0)]  # Kimi K2.6, tok/s


def main() -> None:
    bf16 = plan_capacity("kimi-k2.6", "h200", tp=8, kv_dtype="bf16", context_len=16384)
    fp8 = plan_capacity("kimi-k2.6", "h200", tp=8, kv_dtype="fp8_e4m3", context_len=16384)
    print(
        f"Kimi K2.6 on 8 x H200, TP 8, SGLang-like reserve (mem_fraction_static "
        f"{bf16.mem_fraction_static:.3f}), weights {bf16.weights_gib_per_gpu:.1f} GiB/GPU"
    )
    for plan, report in ((bf16, 686_000), (fp8, 1_370_000)):
        print(f"  {plan.kv_dtype:9s} {plan.kv_bytes_per_token_per_gpu:6,d} B/token  "
              f"{plan.kv_tokens_per_gpu:9,d} tokens (report ~{report:,})  "
              f"{plan.max_concurrency} requests of 16K")  # fmt: skip
    print(f"  FP8 / BF16 resident tokens: {fp8.kv_tokens_per_gpu / bf16.kv_tokens_per_gpu:.2f}")

    model = fit_throughput(bf16, REPORT_BF16_POINTS)
    print(f"\nthroughput fit to the BF16 points: t0 {model.t0_s * 1e3:.2f} ms, efficiency "
          f"{model.efficiency:.2f}, effective context {model.context_len} tokens")  # fmt: skip
    print(f"  predicted FP8 at 64 concurrent: {model.tokens_per_s(fp8, 64):,.0f} tok/s "
          f"(report: 2,192)")  # fmt: skip

    glm_fp8 = plan_capacity("glm-5.2", "h200", tp=8, kv_dtype="fp8_e4m3", weights="fp8")
    glm_int4 = plan_capacity("glm-5.2", "h200", tp=8, kv_dtype="fp8_e4m3", weights="int4-g32")
    print(f"\nGLM 5.2 checkpoint: FP8 {glm_fp8.weights_gib_total:.1f} GiB, INT4 experts "
          f"{glm_int4.weights_gib_total:.1f} GiB; per GPU {glm_fp8.weights_gib_per_gpu:.1f} -> "
          f"{glm_int4.weights_gib_per_gpu:.1f} GiB")  # fmt: skip
    print(f"  KV tokens freed: {tokens_freed(glm_fp8, glm_int4):+,d} at "
          f"{glm_int4.kv_bytes_per_token_per_gpu:,} B/token (FP8 KV)")  # fmt: skip


if __name__ == "__main__":
    main()
