"""Hybrid models: tokens resident per GiB, kvmem's groups against one-page-size padding.

``tokens_per_gib``: for each model, the tokens one GiB of KV memory holds when it is filled with
the workload's requests (an equal number of requests of each of ``--lengths`` tokens, their
pages held between decode steps), per GPU at the model's TP, in kvmem's layout (one group per
kind of layer, each its own page size: ``kvmem.planning.kv_groups``) and in the padded layout
vLLM 0.33 uses (its layer groups on one page byte size: ``kvmem.planning.vllm_groups`` and
``kvmem.allocator.padded_layout``). Pure arithmetic over the groups' true bytes: no pools, no
timing, the same on every machine.

Models: gpt-oss-120b (18 sliding-window layers of 128 tokens beside 18 full-attention
layers; TP 1), Qwen3-Next-80B-A3B (36 gated-delta-net layers with a fixed state per request
beside 12 full-attention layers; TP 2), and the production report's GLM-5.2 (MLA and its DSA
indexer cache; TP 8).

    PYTHONPATH=. python benchmarks/bench_hybrid.py --json [--lengths 12,1024,8192] [--kv-dtype bf16]
"""

from __future__ import annotations

import json
from typing import Any

from kvmem.allocator import request_cost
from kvmem.cli.args import KV_DTYPES, Parser, number
from kvmem.planning import get_model, kv_groups, plan_capacity, vllm_groups

GIB = 1 << 30
# (preset, TP): each on H200s at a TP its native weights fit
MODELS = (("gpt-oss-120b", 1), ("qwen3-next-80b-a3b", 2), ("glm-5.2", 8))


def _lengths(text: str) -> list[int]:
    to_int = number(int, 1, maximum=1 << 24)
    lengths = [to_int(part) for part in text.split(",")]
    return lengths


def tokens_per_gib(model_name: str, tp: int, lengths: list[int], kv_dtype: str
                   ) -> dict[str, Any]:
    """``{model, kvmem, padded}``: tokens per GiB of a pool filled with an equal number of
    requests of each length, in kvmem's groups and in vLLM's padded groups."""
    model = get_model(model_name)
    plan = plan_capacity(model, "h200", tp, kv_dtype=kv_dtype)
    mine, padded = kv_groups(model, plan), vllm_groups(model, plan)
    tokens = sum(lengths)
    kvmem_bytes = sum(request_cost(mine, n).total_bytes for n in lengths)
    padded_bytes = sum(request_cost(padded, n).total_padded_bytes for n in lengths)
    return {"model": model_name, "kvmem": tokens * GIB / kvmem_bytes,
            "padded": tokens * GIB / padded_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=_lengths, default=[12, 1024, 8192],
                        help="request lengths in tokens, comma-separated (default 12,1024,8192)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                        help="KV dtype of every model (default bf16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = [tokens_per_gib(name, tp, args.lengths, args.kv_dtype) for name, tp in MODELS]
    result: dict[str, Any] = {
        "workload": {"lengths": args.lengths, "kv_dtype": args.kv_dtype, "gpu": "h200",
                     "tp": dict(MODELS)},
        "tokens_per_gib": rows,
        # "two_group_over_one_group": the decode-step ratio, added with the grouped manager
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"tokens per GiB, requests of {args.lengths} tokens, KV {args.kv_dtype}")
    print(f"{'model':<22}{'kvmem':>12}{'padded':>12}{'gain':>8}")
    for row in rows:
        print(f"{row['model']:<22}{row['kvmem']:>12,.0f}{row['padded']:>12,.0f}"
              f"{row['kvmem'] / row['padded']:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
