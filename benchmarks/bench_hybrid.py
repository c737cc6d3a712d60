"""Hybrid models: tokens resident per GiB against one-page-size padding, and what a second
group costs a decode step (JSON).

``two_group_over_one_group``: the decode step (reserve, verify, commit of one token each) of
256 requests of about 1,000 tokens on ``kvmem.HybridManager`` with a full-attention group and
a 128-token sliding-window group, against the same manager with the full-attention group
alone, stepped in lockstep (alternating which goes first), ``--steps`` timed each after 10
warm-up steps; ``*_step_us_median`` and ``paired_two_group_over_one_group`` (the median of
each step pair's ratio) beside it.

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

    PYTHONPATH=. taskset -c 1 python benchmarks/bench_hybrid.py --json [--steps 300] \\
        [--lengths 12,1024,8192] [--kv-dtype bf16]
"""

from __future__ import annotations

import json
from collections.abc import Callable
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


GROUP_BATCH, GROUP_CONTEXT, GROUP_WINDOW, GROUP_PAGE = 256, 1000, 128, 16


def _decode_loop(groups: Any, batch: int, context: int) -> Callable[[], None]:
    """A HybridManager of ``groups`` with ``batch`` requests prefilled to about ``context``
    tokens (each a little different, so pages fill at different steps); returns its decode
    step (reserve, verify, commit_batch of one token each)."""
    import numpy as np

    from kvmem import HybridManager

    per_request = sum(g.page_bytes * (-(-(context + 2048) // g.page_size) + 1) for g in groups)
    mgr = HybridManager(groups, budget_bytes=batch * per_request * 2, max_seqs=batch,
                        enable_prefix_caching=False)
    ids = list(range(batch))
    prompts = [list(range(i * 100_000, i * 100_000 + context + i % 16)) for i in ids]
    for rid, prompt in zip(ids, prompts):
        mgr.admit(rid, prompt)
    step = mgr.reserve(ids, [len(p) for p in prompts])
    assert mgr.verify(ids, step).ok
    mgr.commit_batch(ids, prompts)
    token = np.full(batch, 7, dtype=np.int64)

    def decode() -> None:
        step = mgr.reserve(ids, 1)
        if not mgr.verify(ids, step).ok:
            raise AssertionError("verify aborted a request of a correct decode step")
        mgr.commit_batch(ids, token)

    return decode


def two_group_over_one_group(steps: int, batch: int = GROUP_BATCH,
                             context: int = GROUP_CONTEXT) -> dict[str, Any]:
    """The decode step of a two-group model (full attention + a sliding window of
    ``GROUP_WINDOW`` tokens, both in ``GROUP_PAGE``-token pages, equal bytes per token) against
    the same model's full-attention group alone, on HybridManager, same batch and tokens,
    stepped in lockstep (alternating), each step timed; medians and the median of the paired
    ratios."""
    import gc
    import statistics
    import time

    from kvmem.allocator import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec("full", page_size=GROUP_PAGE, bytes_per_token=4096)
    swa = SlidingWindowSpec("swa", window=GROUP_WINDOW, page_size=GROUP_PAGE,
                            bytes_per_token=4096)
    loops = {"one_group": _decode_loop([full], batch, context),
             "two_group": _decode_loop([full, swa], batch, context)}
    times: dict[str, list[float]] = {name: [] for name in loops}
    gc.collect()
    gc.disable()
    try:
        for i in range(steps + 10):
            for name, decode in (loops.items() if i % 2 else reversed(loops.items())):
                t = time.perf_counter()
                decode()
                if i >= 10:  # (warm-up)
                    times[name].append(time.perf_counter() - t)
    finally:
        gc.enable()
    med = statistics.median
    one, two = (med(times[n]) * 1e6 for n in ("one_group", "two_group"))
    return {"batch": batch, "context": context, "window": GROUP_WINDOW, "steps": steps,
            "one_group_step_us_median": round(one, 1),
            "two_group_step_us_median": round(two, 1),
            "two_group_over_one_group": round(two / one, 3),
            "paired_two_group_over_one_group": round(med(
                b / a for a, b in zip(times["one_group"], times["two_group"])), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=_lengths, default=[12, 1024, 8192],
                        help="request lengths in tokens, comma-separated (default 12,1024,8192)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                        help="KV dtype of every model (default bf16)")
    parser.add_argument("--steps", type=number(int, 1), default=300,
                        help="decode steps timed per manager (default 300)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = [tokens_per_gib(name, tp, args.lengths, args.kv_dtype) for name, tp in MODELS]
    result: dict[str, Any] = {
        "workload": {"lengths": args.lengths, "kv_dtype": args.kv_dtype, "gpu": "h200",
                     "tp": dict(MODELS)},
        "tokens_per_gib": rows,
        **two_group_over_one_group(args.steps),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"decode step, {result['batch']} requests of about {result['context']} tokens on "
          f"HybridManager: full attention {result['one_group_step_us_median']} us, + a "
          f"{result['window']}-token sliding window {result['two_group_step_us_median']} us "
          f"({result['two_group_over_one_group']}x, paired "
          f"{result['paired_two_group_over_one_group']}x)")
    print(f"tokens per GiB, requests of {args.lengths} tokens, KV {args.kv_dtype}")
    print(f"{'model':<22}{'kvmem':>12}{'padded':>12}{'gain':>8}")
    for row in rows:
        print(f"{row['model']:<22}{row['kvmem']:>12,.0f}{row['padded']:>12,.0f}"
              f"{row['kvmem'] / row['padded']:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
