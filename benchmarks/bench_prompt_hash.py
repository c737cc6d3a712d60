"""Prompt hashing on its own: kvmem's prefix keys against vLLM's block hashes (prints JSON).

For each prompt length (128, 512, 2048, 4096 random tokens, page / block size 16), the keys of
every full page of the prompt:

* kvmem: ``PrefixKeys.prompt_keys`` (the key function of ``HashedPrefixCache`` and of the vLLM
  adapter's cache: chained 128-bit keys, a keyed two-lane multiply-xorshift mix per page with a
  64-bit finalizer, the namespace's root by keyed BLAKE2b), over the int64 array of token ids
  that kvmem's caches hold (``kvmem_us``), and with that array first made from the prompt's
  Python list (``kvmem_from_list_us``, ``np.array``: what vLLM's hasher starts from);
* vLLM 0.33: its request block hasher (``get_request_block_hasher``) with its default hash,
  ``sha256`` over the pickled ``(parent hash, block tokens, extra keys)``, as ``Request()``
  runs it, over the request's token list (``vllm_us``).

Both run in lockstep (one call of each, the first alternating), ``--repeats`` times per
length; medians in microseconds; ``speedup`` is ``vllm_us / kvmem_us`` and
``speedup_from_list`` is ``vllm_us / kvmem_from_list_us``. Without vLLM only kvmem's figures
are printed.

    PYTHONPATH=/tmp/vllm_env/site:/tmp/vllm_env/deps taskset -c 1 \\
        python benchmarks/bench_prompt_hash.py [--repeats 500]
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmem.allocator import PrefixKeys
from kvmem.cli.args import Parser, number

PROMPT_LENS = (128, 512, 2048, 4096)
PAGE_SIZE = 16


def _kvmem_hashers(keyer: PrefixKeys, tokens: list[int]) -> dict[str, Callable[[], Any]]:
    """kvmem's keys of ``tokens`` (namespace None), from an int64 array and from the list."""
    root = keyer.root(None)
    array = np.array(tokens, dtype=np.int64)
    return {"kvmem": lambda: keyer.prompt_keys(array, root),
            "kvmem_from_list": lambda: keyer.prompt_keys(np.array(tokens, dtype=np.int64), root)}


def _vllm_hasher(tokens: list[int]) -> Callable[[], Any] | None:
    """vLLM's block hashes of a request holding ``tokens``, as one call; None without vLLM."""
    from kvmem.integrations.vllm import vllm_import_error

    if vllm_import_error() is not None:
        return None
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvmem.integrations.vllm._vllm_objects import make_block_hasher

    hasher = make_block_hasher(PAGE_SIZE)
    request = Request(request_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(
        max_tokens=1), pooling_params=None, arrival_time=0.0)  # no hasher: no hashes yet
    return lambda: hasher(request)  # every block's hash, as Request() computes them


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="bench_prompt_hash.py", description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=number(int, 1), default=500,
                   help="timed calls per length and contender (at least 1)")
    p.add_argument("--seed", type=number(int, 0), default=0)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option (one line on stderr)
        return int(exc.code or 0)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout
    rng = random.Random(args.seed)
    keyer = PrefixKeys(args.seed, PAGE_SIZE)
    clock = time.perf_counter
    rows = []
    for prompt_len in PROMPT_LENS:
        tokens = [rng.randrange(10, 30000) for _ in range(prompt_len)]
        contenders = _kvmem_hashers(keyer, tokens)
        vllm = _vllm_hasher(tokens)
        if vllm is not None:
            if len(vllm()) != len(contenders["kvmem"]()):
                raise RuntimeError(f"vLLM and kvmem hash different numbers of pages of a "
                                   f"{prompt_len}-token prompt")
            contenders["vllm"] = vllm
        times: dict[str, list[float]] = {name: [] for name in contenders}
        order = list(contenders)
        gc.collect()
        for i in range(args.repeats):
            for name in order if i % 2 == 0 else order[::-1]:
                fn = contenders[name]
                t0 = clock()
                fn()
                times[name].append(clock() - t0)
        row: dict[str, Any] = {"prompt_len": prompt_len, "pages": prompt_len // PAGE_SIZE}
        row.update({f"{name}_us": round(statistics.median(t) * 1e6, 1)
                    for name, t in times.items()})
        if vllm is not None:
            row["speedup"] = round(row["vllm_us"] / row["kvmem_us"], 2)
            row["speedup_from_list"] = round(row["vllm_us"] / row["kvmem_from_list_us"], 2)
        rows.append(row)
    print(json.dumps({"page_size": PAGE_SIZE, "repeats": args.repeats,
                      "vllm_hash": "sha256 (pickle)" if "speedup" in rows[0] else None,
                      "lengths": rows, "load_average": round(os.getloadavg()[0], 2)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
