"""vLLM 0.33's ``Scheduler`` and ``AsyncScheduler`` on their own KV cache manager and on kvmem's,
in lockstep in one process (JSON on stdout).

Workload (the issue's): 256 requests of ~1,000-token prompts (900..1,100), a quarter sharing a
512-token prefix, prefilled in the schedulers' own chunks (8,192-token budget), then 300 decode
steps at batch 256, prefix caching on, block size 16, ``log_stats`` on. A step is
``schedule()`` + ``update_from_output()`` with a synthetic model's output; both schedulers run
the same stream, step ``i`` of each before step ``i + 1`` of either, and their
``num_scheduled_tokens`` must agree every step (``mismatched_steps``).

Per scheduler class: ``vllm_step_us_median`` / ``kvmem_step_us_median`` and ``step_speedup``
(also ``paired_step_speedup``, the median of per-step ratios), from a pass without timers; and
``vllm_kv_us_median`` / ``kvmem_kv_us_median`` / ``kv_speedup``, the time inside the KV cache
manager per step (vLLM: its ``KVCacheManager`` methods and ``KVCacheBlocks.get_block_ids``;
kvmem: the adapter's methods, its batched flush with the integrity check, and
``KVMemBlocks.get_block_ids``), from a second pass with timers (outermost calls only).

    bash benchmarks/setup_vllm_cpu.sh /tmp/vllm_env
    PYTHONPATH=/tmp/vllm_env/site:/tmp/vllm_env/deps taskset -c 1 \\
        python benchmarks/bench_vllm_scheduler.py [--decode-steps 300] [--requests 256]
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

from kvmem.cli.args import Parser, number


def main() -> int:
    p = Parser(prog="bench_vllm_scheduler.py", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=number(int, 1, maximum=8192), default=256)
    p.add_argument("--prompt-len", type=number(int, 1), default=1000)
    p.add_argument("--shared-len", type=number(int, 0), default=512)
    p.add_argument("--decode-steps", type=number(int, 1), default=300)
    p.add_argument("--seed", type=number(int, 0), default=0)
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout
    from kvmem.integrations.vllm import vllm_import_error

    error = vllm_import_error()
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    from kvmem.integrations.vllm.bench import lockstep

    result: dict[str, object] = {"workload": {
        "requests": args.requests, "prompt_len": args.prompt_len,
        "shared_len": args.shared_len, "shared_fraction": 0.25,
        "decode_steps": args.decode_steps, "block_size": 16}}
    for key, async_scheduling in (("sync", False), ("async", True)):
        result[key] = lockstep(num_requests=args.requests, prompt_len=args.prompt_len,
                               shared_len=args.shared_len, decode_steps=args.decode_steps,
                               async_scheduling=async_scheduling, seed=args.seed)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    result["machine"] = {"python": platform.python_version(), "commit": commit,
                         "load_average_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
